"""A lost rollout's work, taken over by a surviving one (docs/faults.md).

:class:`RecoveryMixin`: the manager hands a rollout the lost one's finished trajectories
whose rewards were in flight (:meth:`~RecoveryMixin.rescore`: scored here, nothing
decoded) and its unfinished requests (:meth:`~RecoveryMixin.adopt`), which decode on as a
batch of their own at their own version, loaded from a relay's kept copy or a checkpoint;
when no copy of that version is left, their groups are dropped whole.

Apart from the generation loop (:mod:`laminar.rollout`), which only takes an adopted batch
at a boundary: recovery is the fault path, not the loop's ordinary work.
"""

from __future__ import annotations

import logging
import time

from laminar.engine import FinishedOutput, RequestState

# (the actor's logger: its records read as the rollout's, whichever module they come from)
logger = logging.getLogger("laminar.rollout")


def _finished(
    state: RequestState, reason: str, t_finish: float, version: int | None = None
) -> FinishedOutput:
    """A recovered request as ended with ``reason``. One with no token logged yet is
    given the version that sampled its batch (``version``, else the recovery's
    ``behavior_version``)."""
    if version is None and not state.tokens:
        version = state.request.meta["behavior_version"]
    return FinishedOutput.from_state(state, reason, t_finish, version)


class RecoveryMixin:
    """A lost rollout's requests and trajectories, for
    :class:`~laminar.rollout.RolloutReplica` (whose ``__init__`` sets up the state)."""

    def rescore(self, states: list) -> None:
        """Take a lost rollout's *finished* trajectories (their rewards were in flight):
        score them and insert them into the buffer; nothing is decoded. (Kept, for a
        rebuilt data module's pool, until they are stored: :meth:`_keep_finished`.)"""
        outputs = [_finished(st, *st.request.meta["finished"]) for st in states]
        with self._unstored_lock:  # (kept and queued at once: a prune sees both or neither)
            if self.partial is not None:
                self._finished_outputs.update((o.request.request_id, o) for o in outputs)
            self._rescore.put(states)

    def adopt(self, version: int, states: list) -> None:
        """Take a lost rollout's unfinished requests (their newest tokens sampled by
        ``version``) as a batch of their own at the next batch boundary, loading that
        version for them. Under an interrupting schedule (partial rollout) they go on at
        this rollout's version instead, if newer, their KV recomputed: as after an
        interrupt, a response continues with the newest weights."""
        self._adopted.put((version, states))

    def _fetch_version(self, version: int) -> dict:
        """An old ``version``'s weights: its relay's kept copy, else its checkpoint
        (:class:`~laminar.relay_core.VersionUnavailable` if neither has it)."""
        from laminar.relay_client import fetch_version
        from laminar.relay_core import RelayError, VersionUnavailable

        try:
            return fetch_version(version, self.puller, self.checkpoints_dir)
        except VersionUnavailable:
            raise
        except RelayError as e:  # lost, or a failed pull: the checkpoint may have it
            self._pull_failed(e, f"version {version}: looking for its checkpoint", always=True)
            return fetch_version(version, None, self.checkpoints_dir)

    def _take_adopted(self) -> None:
        from laminar.relay_core import VersionUnavailable

        version, states = self._adopted.get_nowait()
        # (partial rollout: every rollout holds the newest version; loading an older
        # one for these would sample the rest of them by weights the run has left)
        newer_here = self.spec.interrupt and self.engine.version > version
        if self.engine.version != version and not newer_here:
            try:
                weights = self._fetch_version(version)
            except VersionUnavailable as e:
                self._drop_adopted(version, states, e)
                return
            self._load_version(version, weights)
        self.engine.import_(states, allow_version_change=self.spec.interrupt)
        self._logged.update({st.request_id: len(st.tokens) for st in states})
        self._reprefill = True
        self.counts["adopted_batches"] += 1
        self.counts["adopted_requests"] += len(states)
        self.counts["reprefill_tokens"] += sum(st.context_len for st in states)

    def _adopt_now(self) -> None:
        """Under an interrupting schedule, a lost rollout's requests of this version or
        older join the running engine at once (as after an interrupt), rather than at a
        batch boundary that refilling may put off for a whole update."""
        while (
            self.spec.interrupt
            and not self._adopted.empty()
            and self._adopted.queue[0][0] <= self.engine.version
        ):
            self._take_adopted()

    def _drop_adopted(self, version: int, states: list[RequestState], why: Exception) -> None:
        """No copy of ``version`` is left for a lost rollout's unfinished ``states``:
        their groups are dropped, not finished at another version.

        Their siblings that finished before the loss were sampled by ``version`` (in the
        buffer, or being scored): restarted at this rollout's version, these would give
        one group two behavior policies, and GRPO's advantages compare a group's samples
        as draws of one. Nothing of the group has been trained on (the buffer releases
        whole groups only), so each of these goes to the buffer as it is, marked
        ``finish_reason="error"`` and not scored: the buffer discards its group whole
        once the group is in (``groups_discarded``), and the prompt pool makes the group
        up as it does for any group that left untrained. Logged as finished first, so a
        loss of this rollout before the buffer has them hands them on as such."""
        now = time.time()
        outputs = [_finished(st, "error", now, version) for st in states]
        if self.partial is not None:  # (the pool has every token: nothing new to log)
            for out in outputs:
                self._ended[out.request.request_id] = (len(out.response_tokens), out)
            self._log_partial(force=True)
        self._keep_finished(outputs)
        groups = {st.request.meta["group"].prompt_uid for st in states}
        self.counts["dropped_requests"] += len(states)
        self.counts["dropped_groups"] += len(groups)
        logger.warning(
            "rollout %s: %s; %d recovered trajectories of version %d cannot be finished by "
            "it: their %d groups are discarded (a group mixing two versions would break "
            "its GRPO advantages)",
            self.rollout_id,
            why,
            len(states),
            version,
            len(groups),
        )
        self._submit_rewards(outputs, score=False)
