"""The trainer's link to the data module: its buffer calls, their waits, what it sampled.

:class:`DataLinkMixin` of :class:`laminar.trainer.Trainer`: every call to the buffer
(:meth:`~DataLinkMixin._on_buffer`) and, when the data module is lost with its worker and
rebuilt within the run (docs/faults.md, "Data-module loss"), the wait for the rebuilt one
(:meth:`~DataLinkMixin.attach_data`); each batch sampled under a request id of its own
(:meth:`~DataLinkMixin._sample`), and the record of what was sampled since the newest
checkpoint, which a rebuilt data module asks for (:meth:`~DataLinkMixin.consumed_record`);
the rollout manager, handed over after construction.

Apart from the training loop (:mod:`laminar.trainer`), which meets the data module only
through these calls: its loss and rebuild are a concern of their own.
"""

from __future__ import annotations

import logging
import time

from laminar.cluster import actor_result, is_lost
from laminar.contract import Trajectory

# (the actor's logger: its records read as the trainer's, whichever module they come from)
logger = logging.getLogger("laminar.trainer")


class DataLinkMixin:
    """The data-module calls of :class:`~laminar.trainer.Trainer` (its state is set there)."""

    def set_manager(self, manager) -> None:
        """The rollout manager, given after construction: a restarted trainer is created
        without it, because a task that takes an actor handle as an argument depends on
        it, and the scheduler errs such a task when one of the manager's own arguments
        (the lost master relay) is gone."""
        self.manager = manager

    def consumed_record(self) -> dict:
        """What a rebuilt data module needs of this trainer (the data module is lost):
        every trajectory it sampled at versions ``>= since``, and the newest version it
        told the buffer was published. Not the learner's version: that moves at each
        update, before its publication (one-step's waits for the next batch), and a
        rebuilt buffer at it would stamp trajectories with a version no rollout could
        have held, and let the prompt pool's staleness bound and the buffer's eviction
        run one version ahead."""
        with self._consumed_lock:
            return {"consumed": dict(self._consumed), "since": self._since, "version": self._told}

    def _tell_published(self) -> None:
        """Tell the buffer the current version is (about to be) published: trajectories
        finish at it from now on, and its staleness bound counts from it."""
        version = self.version
        self._on_buffer(lambda b: b.version_published(version))
        with self._consumed_lock:
            self._told = version

    def attach_data(self, buffer, manager) -> None:
        """The data module rebuilt in place of a lost one: a call waiting on the lost
        buffer goes to this one."""
        self.buffer, self.manager = buffer, manager
        self._data_epoch += 1

    def _on_buffer(self, call):
        """``call(buffer)``'s result. A lost buffer: wait for the rebuilt one (up to
        :meth:`~laminar.config_sections.FaultsConfig.data_wait`) and call that; one that
        answers again after
        all (a slow call), called again."""
        timeout = self.cfg.cluster.actor_timeout_s
        while True:
            epoch = self._data_epoch
            try:
                with self._bounded():
                    return actor_result(self.buffer, call(self.buffer), timeout)
            except Exception as e:
                if not is_lost(e):
                    raise
                with self._bounded():  # (itself bounded: FaultsConfig.data_wait)
                    self._await_data(epoch, e)

    def _await_data(self, epoch: int, error: Exception) -> None:
        t0 = time.time()
        limit, settings = self.cfg.faults.data_wait()
        logger.warning(
            "trainer: the buffer does not answer (%s: %s); waiting for it",
            type(error).__name__,
            error,
        )
        next_probe = t0 + 3.0
        try:
            while self._data_epoch == epoch:
                if self._stop.is_set():
                    raise RuntimeError("stopped while the buffer was lost") from error
                if time.time() - t0 > limit:
                    raise RuntimeError(
                        f"the buffer was lost and not rebuilt within {limit:g} s ({settings})"
                    ) from error
                if time.time() > next_probe:
                    next_probe = time.time() + 3.0
                    try:
                        actor_result(self.buffer, self.buffer.stats(), 2.0)
                        return  # slow, not lost
                    except Exception:  # noqa: BLE001 — still gone
                        pass
                time.sleep(0.05)
        finally:
            self.data_wait_s += time.time() - t0

    def _sample(self, n_groups: int) -> list[Trajectory] | None:
        """``n_groups`` complete groups from the buffer, waiting for them (``None``: stopped).

        Each batch is asked for under an id of its own (this trainer's token, and how many
        batches it has received), the same each time it is asked again: a call whose
        answer was lost (timed out, or failed after the buffer took the batch) and made
        again gets that batch, not a second one
        (:meth:`~laminar.buffer.ExperienceBuffer.sample`)."""
        t_wait = time.time()
        request = (self._token, self._batches)
        try:
            while not self._stop.is_set():
                batch = self._on_buffer(lambda b: b.sample(n_groups, self.version, request))
                if batch is not None:
                    self._batches += 1
                    with self._consumed_lock:
                        self._consumed.update(
                            (t.uid, (t.sample_version, t.t_sample)) for t in batch
                        )
                    return batch
                self._stop.wait(0.02)
            return None
        finally:
            self.wait_s += time.time() - t_wait
