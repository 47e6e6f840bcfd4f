"""The run API that notebooks and the CLI share.

>>> from distributed import Client                                  # doctest: +SKIP
>>> import pipelines
>>> client = Client("tcp://scheduler:8786")                          # doctest: +SKIP
>>> run = pipelines.submit("configs/tiny.yaml", client,
...                        overrides=["trainer.steps=20"])           # doctest: +SKIP
>>> run.progress()          # latest progress dict, never blocks     # doctest: +SKIP
>>> summary = run.wait()    # or run.stop() to end early, store intact  # doctest: +SKIP
>>> run = pipelines.resume(run.run_dir, client,
...                        overrides=["trainer.steps=40"])           # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from pathlib import Path

from laminar.config import (
    RunConfig,
    config_from_dict,
    load_config,
    override_list,
    with_overrides,
)
from laminar.errors import ConfigError, LaminarError, RunFailed, RunStopped
from pipelines.preflight import preflight
from pipelines.resume_plan import prepare_resume
from pipelines.run_dir import (  # noqa: F401 (PROMPT_FINGERPRINT: the API's name for it)
    PROMPT_FINGERPRINT,
    _claim,
    absolute_paths,
    check_run_dir,
    prepare_run_dir,
)
from storage.live import LIVE_FILE, claim

logger = logging.getLogger("laminar")


class RunInterrupted(KeyboardInterrupt):
    """An interrupt (the kernel's stop button, Ctrl-C) during :meth:`RunHandle.wait`,
    raised once the run has stopped in order: ``summary`` is what it did (as in
    ``RUN_DIR/summary.json``). A ``KeyboardInterrupt``, so that what waits on runs one
    after another (a notebook's loop over a grid, a bench) ends there, rather than
    taking the truncated run for a finished one and submitting the next."""

    def __init__(self, message: str, summary: dict | None) -> None:
        super().__init__(message)
        self.summary = summary


def resolve_config(
    config: RunConfig | dict | str | Path,
    overrides: list[str] | tuple[str, ...] | str | None = (),
) -> RunConfig:
    """A config object from a YAML file's path, a :class:`RunConfig`, or a dict of
    sections as the file holds them (``{"trainer": {"steps": 20}}``, checked as the file
    is), with ``a.b=value`` overrides applied (None: none). Anything else is a
    :class:`ConfigError` saying what it takes."""
    overrides = override_list(overrides)
    if isinstance(config, dict):
        config = config_from_dict(config)
    if isinstance(config, RunConfig):
        return with_overrides(config, overrides) if overrides else config
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(
            "config must be a YAML file's path (e.g. 'configs/tiny.yaml'), a "
            f"laminar.config.RunConfig or a dict of sections, not {type(config).__name__}"
        )
    return load_config(config, overrides)


class RunAborted(LaminarError):
    """A run abandoned without an orderly stop (:meth:`RunHandle.abort`)."""


class RunHandle:
    """A run in progress on a Dask cluster; every method returns at once except ``wait``
    (and ``abort``, which writes ``summary.json``)."""

    _aborted: str | None = None  # (abort()'s reason)

    def __init__(self, cfg: RunConfig, client, run_dir: Path, resume=None) -> None:
        from pipelines.driver import schedule_class

        self.config = cfg
        self.client = client
        self.run_dir = run_dir = Path(run_dir)
        self.summary: dict | None = None
        self.error: BaseException | None = None
        # Its setup done, the run began: a failure from then on is a failed run (with a
        # summary.json, unless that could not be written), not a failed start.
        self.training_began = False
        self._progress: dict = {"phase": "submitted"}
        self._stop = threading.Event()
        # (one summary.json at a time: the driver's, or an abort's)
        self._summary_lock = threading.Lock()
        self._done = threading.Event()
        # The directory's claim (prepare_run_dir's or prepare_resume's, or made here):
        # held, renewed, while the run goes; released when it ends.
        self._claim = _claim(run_dir, "start a run in")
        try:
            self._schedule = schedule_class(cfg.pipeline.schedule)(cfg, client, run_dir, resume)
        except BaseException:
            self._claim.release()
            raise
        self._claim.driving = True
        self._thread = threading.Thread(target=self._drive, name="laminar-driver", daemon=True)
        self._thread.start()

    def _set_progress(self, p: dict) -> None:
        self._progress = {**self._progress, **p}

    def _drive(self) -> None:
        from laminar.cluster import actors_made, release_actors
        from pipelines.data_module import resume_hint
        from pipelines.summary import summarize

        running = False  # set up: a failure from here on leaves a summary.json
        try:
            # Every actor the run starts (at the setup, and restarts or replacements in
            # the run) is released when it ends: none stays on the user's cluster, for
            # as long as the notebook keeps this handle.
            with actors_made() as made:
                try:
                    self._schedule.setup(self._set_progress, self._stop.is_set)
                except BaseException:  # (closed first: what holds files or threads)
                    release_actors(self.client, made)
                    made.clear()
                    raise
                running = self.training_began = True
                try:
                    raw = self._schedule.run(self._set_progress, self._stop.is_set)
                finally:  # (stopped and closed by the run's own shutdown)
                    release_actors(self.client, made, close=False)
            self.summary = summarize(self.run_dir, raw, self._schedule.sft_info, self.config)
            reason = str(self.summary["reason"])
            if reason.startswith("failed"):  # (stopped in order: wait() says so)
                self.error = RunFailed(
                    f"run {str(self.run_dir)!r} {reason}; it stopped in order and its "
                    "stores are intact (summary.json); fix the cause, then "
                    + resume_hint(self.run_dir, python=True),
                    self.summary,
                )
                self._set_progress({"phase": "failed", "error": reason})
            else:  # (the last figures, which the polling may have missed)
                done = {
                    "version": self.summary["versions"],
                    "updates": self.summary["updates"],
                    "trajectories": self.summary["trajectories"],
                    "reason": reason,
                }
                # (stopped early, by stop(), an interrupt or the walltime: not "done")
                phase = "stopped" if reason.startswith("stopped") else "done"
                self._set_progress({"phase": phase, **done})
        except BaseException as e:  # surfaced by wait(); never lost in a thread
            self.error = e
            if running and self.summary is None and not isinstance(e, RunStopped):
                self._summarize_failed(e)
            why = "".join(traceback.format_exception_only(e)).strip()
            phase = "stopped" if isinstance(e, RunStopped) else "failed"
            self._set_progress({"phase": phase, "error": why})
            logger.debug("run failed", exc_info=True)
        finally:
            try:
                self._claim.release()
            except OSError as e:  # (stale after LIVE_STALE_S all the same)
                logger.warning("cannot remove %s: %s", self.run_dir / LIVE_FILE, e)
            finally:
                self._done.set()

    def _summarize_failed(self, error: BaseException) -> None:
        """``summary.json`` from the stores, for a run whose driver failed: the reason
        stays on record, and tools that read it (``laminar bench --from-runs``, the
        audit) see a failed run, not one that may still be going."""
        from pipelines.summary import summarize_failed, write_summary

        with self._summary_lock:
            if self.summary is not None:  # (an abort's, written first)
                return
            try:
                start = self._schedule.start_records()
                summary = summarize_failed(self.run_dir, error, self.config, start)
                if self._aborted is not None:  # (its driver failed as the cluster closed)
                    summary["reason"] = self._aborted
                    write_summary(self.run_dir, summary)
                self.summary = summary
            except Exception as e:  # noqa: BLE001 — the error that failed the run stands
                why = f"{type(e).__name__}: {e}"
                logger.warning("%s: no summary.json written (%s)", self.run_dir, why)

    def abort(self, reason: str) -> None:
        """Record that the run is abandoned without an orderly stop (``laminar run``'s
        second Ctrl-C; the cluster is closed under it next): its ``summary.json`` says
        ``reason`` (``"aborted: …"``, with what continues the run) over what the stores
        hold, as a failed driver's does (``driver_failed``: no actor's figures), rather
        than an earlier start's summary standing for this one, or "failed: the Dask
        client is closed" once its driver trips on the closed cluster. Returns once it is
        written; during the setup (no run yet) it only stops the run."""
        self._aborted = reason
        self._stop.set()
        if self.training_began:
            self._summarize_failed(RunAborted(reason))

    def __fspath__(self) -> str:
        """The run directory: ``open_run(handle)``, ``open_metrics(handle, "cluster")``."""
        return str(self.run_dir)

    def progress(self) -> dict:
        """The latest progress: ``phase``; while training, ``updates`` (made, of
        ``steps``: ``trainer.steps``, the updates asked for), ``version`` (the weights'
        version number: a trainer restarted within the run skips the lost one's numbers,
        so it can pass ``steps``; the run ends at ``last_version``), ``reward``,
        ``gen_tok_s``, ``buffer_depth``, ``s_train_mean``, ``trajectories``. Once it has
        ended: ``phase`` ``"done"`` (completed), ``"stopped"`` (stopped early, in order:
        ``reason`` says how) or ``"failed"`` (``error``), with the summary's ``version``,
        ``updates`` and ``trajectories``; the other figures are the last ones polled."""
        return dict(self._progress)

    def done(self) -> bool:
        return self._done.is_set()

    def stop(self) -> None:
        """Ask the run to end: rollouts stop, the trainer checkpoints, the store is flushed.
        During its setup (the warm start included), it ends at once: ``wait`` raises
        :class:`~laminar.errors.RunStopped`, nothing having been stored."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> dict:
        """Block until the run ends; returns the summary (also in ``RUN_DIR/summary.json``).
        A run that failed raises: :class:`~laminar.errors.RunFailed` (with its
        ``summary``) when it stopped in order on an error, else the error that ended it.

        An interrupt (a notebook's, or Ctrl-C) stops the run, as ``laminar run``'s first
        Ctrl-C does, and waits on for it to end in order, then raises
        :class:`RunInterrupted` (a ``KeyboardInterrupt``) with its ``summary``: a loop
        that waits on one run after another ends there. (One stopped during its setup
        raises :class:`~laminar.errors.RunStopped`, one that failed its error, as
        above.) A second interrupt returns at once, the run still stopping."""
        deadline = None if timeout is None else time.monotonic() + timeout
        interrupted: KeyboardInterrupt | None = None
        try:
            finished = self._done.wait(timeout)
        except KeyboardInterrupt as e:
            # (else the run would go on generating on the cluster, with nothing waiting
            # for it, beside whatever the notebook submits next)
            interrupted = e
            self.stop()
            logger.warning(
                "stopping the run in %s: finishing the current update and flushing the "
                "store (interrupt again to stop waiting; it still stops)",
                self.run_dir,
            )
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            finished = self._done.wait(left)
        if not finished:
            if interrupted is not None:
                raise RunInterrupted(
                    f"run {str(self.run_dir)!r} interrupted, still stopping after {timeout} s",
                    None,
                ) from interrupted
            raise TimeoutError(f"run {str(self.run_dir)!r} still going after {timeout} s")
        if self.error is not None:
            if isinstance(self.error, LaminarError):
                raise self.error
            raise LaminarError(f"run {str(self.run_dir)!r} failed: {self.error!r}") from self.error
        assert self.summary is not None
        if interrupted is not None:
            from pipelines.data_module import resume_hint

            raise RunInterrupted(
                f"run {str(self.run_dir)!r} interrupted: it stopped in order "
                f"({self.summary['reason']}, version {self.summary['versions']}); "
                + resume_hint(self.run_dir, python=True),
                self.summary,
            ) from interrupted
        return self.summary


def submit(
    config: RunConfig | dict | str | Path,
    client,
    *,
    overrides: list[str] | tuple[str, ...] | None = (),
    run_dir: str | Path | None = None,
) -> RunHandle:
    """Start a run on ``client``'s cluster and return its handle without blocking.

    The cluster's workers must advertise the role resources (``data``, ``trainer``,
    ``rollout``; ``relay`` when ``relay.relays`` is set);
    :func:`laminar.deploy.open_cluster` starts or finds such a cluster. Workers still
    joining (queued Slurm jobs) are waited for up to ``cluster.placement_timeout_s``.
    """
    from laminar.deploy import role_needs, wait_for_roles

    cfg = absolute_paths(resolve_config(config, overrides))
    preflight(cfg)
    check_run_dir(cfg, run_dir)  # (before the wait below: a taken one is told at once)
    # Placement errors (a cluster without role resources) surface here, not in wait().
    wait_for_roles(client, role_needs(cfg), cfg.cluster.placement_timeout_s)
    warn_if_shared(client)
    path = prepare_run_dir(cfg, run_dir)
    return RunHandle(cfg, client, path)


class SharedClusterWarning(UserWarning):
    """The cluster a run is submitted to already holds another run."""


def warn_if_shared(client) -> list[str]:
    """Warn when ``client``'s cluster already holds another run's trainer (a run still
    going, from this notebook or another): the two share the role workers, and the new
    one's tasks on the trainer's worker (its warm start, its trainer) wait for the
    first, while its progress says only "warm-start". Returns the trainers' keys."""
    import warnings

    def trainers(dask_scheduler) -> list[str]:
        return [
            str(ts.key)
            for ts in dask_scheduler.tasks.values()
            if ts.actor and ts.state == "memory" and str(ts.key).startswith("Trainer-")
        ]

    try:
        found = client.run_on_scheduler(trainers)
    except Exception:  # noqa: BLE001 — a scheduler that refuses it: nothing to say
        return []
    if found:
        warnings.warn(
            f"this cluster already holds another run (its trainer actor {found[0]}): "
            "runs on one cluster share its role workers, and this one waits for the "
            "other where they meet (its progress shows 'warm-start' meanwhile); give "
            "each run its own cluster (laminar.deploy.open_cluster), or wait for the "
            "other to end",
            SharedClusterWarning,
            stacklevel=3,
        )
    return found


def resume(
    run_dir: str | Path, client, *, overrides: list[str] | tuple[str, ...] | None = ()
) -> RunHandle:
    """Continue a stopped or lost run in its own directory, from its newest checkpoint.

    The trainer restarts from the checkpoint (weights, optimizer, RNG, version); the
    buffer holds again the whole groups the store has that the checkpoint did not train
    (:mod:`storage.resume`); the prompt order goes on; every store is appended to.
    ``overrides`` change its ``config.yaml`` (e.g. ``trainer.steps``).
    """
    from laminar.deploy import role_needs, wait_for_roles

    cfg, plan, path = prepare_resume(run_dir, overrides)
    try:
        wait_for_roles(client, role_needs(cfg), cfg.cluster.placement_timeout_s)
        warn_if_shared(client)
    except BaseException:  # (the directory is free again for a resume from elsewhere)
        claim(path).release()
        raise
    return RunHandle(cfg, client, path, resume=plan)
