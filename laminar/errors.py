"""One error hierarchy for the whole library.

Every message names the culprit (a config field, a file, a reward function) with ``!r``
and says what to do about it.
"""

from __future__ import annotations


class LaminarError(Exception):
    """Base class of every error laminar raises on purpose."""


class ConfigError(LaminarError, ValueError):
    """A run config (YAML file or ``--set`` override) is invalid."""


class ModelError(LaminarError):
    """A model or tokenizer folder is missing, incomplete or unsupported."""


class DataError(LaminarError, ValueError):
    """A prompt file, a trajectory record or a run store is malformed."""


class RewardError(LaminarError):
    """A reward function could not be found, raised, or returned a non-finite value."""


class ClusterError(LaminarError):
    """The Dask cluster lacks the workers or resources a run needs."""


class RunFailed(LaminarError):
    """A run ended early on an error (a reward function that always fails, a rollout or
    trainer error): stopped in order, its stores intact. ``summary`` is what it did (as
    in ``RUN_DIR/summary.json``)."""

    def __init__(self, message: str, summary: dict) -> None:
        super().__init__(message)
        self.summary = summary


class RunStopped(LaminarError):
    """A run was stopped (``RunHandle.stop``, Ctrl-C) during its setup, before it
    generated anything: nothing is stored, and no actor of it stays on the cluster."""
