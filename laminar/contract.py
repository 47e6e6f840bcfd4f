"""The trajectory record (DESIGN.md §4) and the messages between components.

Field names are public API: the trajectory store, the xarray dataset and the trainer all
use them. The on-disk schema is defined once, in :mod:`storage.schema`; a
:class:`Trajectory` maps onto it field for field (a test checks that they agree).

Derived staleness: ``s_gen = finish_version - behavior_version``,
``residence = sample_version - finish_version``, ``s_train = s_gen + residence``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from storage.schema import FINISH_REASONS, STATUSES


@dataclass
class Trajectory:
    """One response to one prompt, with everything needed to train on it and audit it."""

    uid: str
    prompt_uid: str
    prompt_key: int
    sample_idx: int
    group_size: int
    prompt_tokens: np.ndarray  # int32
    response_tokens: np.ndarray  # int32
    behavior_logprobs: np.ndarray  # float32, one per response token
    loss_mask: np.ndarray  # uint8, 0 on tool/environment tokens
    behavior_version: int
    finish_reason: str
    rollout_ids: str  # comma-separated rollouts it ran on, in order
    t_submit: float
    t_start: float
    t_finish: float
    token_versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    finish_version: int = -1
    sample_version: int = -1
    reward: float = math.nan
    n_migrations: int = 0
    t_insert: float = math.nan
    t_sample: float = math.nan
    status: str = "buffered"
    # When it left the buffer, and the trainer's version then, whatever its status (for
    # one consumed: t_sample, sample_version); NaN, -1 while buffered
    t_leave: float = math.nan
    leave_version: int = -1

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} not in {STATUSES}")
        n = len(self.response_tokens)
        for name in ("behavior_logprobs", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory {self.uid!r}: {name} has {len(getattr(self, name))} values "
                    f"for {n} response tokens"
                )
        versions = self.token_versions
        if len(versions) and (len(versions) != n or int(versions.min()) != self.behavior_version):
            raise ValueError(
                f"trajectory {self.uid!r}: token_versions must be empty or one per response "
                f"token ({n}) with the behavior version {self.behavior_version} the oldest; "
                f"it has {len(versions)} from {int(versions.min())}"
            )

    def to_record(self) -> dict[str, Any]:
        """Field name -> value (arrays shared, not copied), as the store writer takes it."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class PromptGroup:
    """A prompt handed to one rollout as a unit: all ``group_size`` siblings go together,
    or those of ``samples`` (a resumed run's missing ones; a barrier batch's group split
    among rollouts, :meth:`laminar.prompt_pool.PromptPoolCore.acquire`)."""

    prompt_uid: str
    prompt_key: int
    prompt_tokens: tuple[int, ...]
    answer: str
    group_size: int
    epoch: int
    # The sample indices to generate; None: all ``group_size``. A resumed run re-issues
    # only the siblings its store lacks (:mod:`storage.resume`); a barrier batch hands a
    # group out in pieces where its samples split unevenly among the rollouts.
    samples: tuple[int, ...] | None = None

    @property
    def sample_indices(self) -> tuple[int, ...]:
        return tuple(range(self.group_size)) if self.samples is None else self.samples
