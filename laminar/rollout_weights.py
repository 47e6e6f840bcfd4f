"""Which weight version a rollout's engine holds, and when it changes.

:class:`WeightsMixin`: the pull of the newest complete version from the local relay at a
batch boundary (never mid-trajectory; see :mod:`laminar.relay`), the wait for a version
the prompt pool says is published, the interrupt of a partial rollout (:meth:`pause`: its
unfinished requests wait while it loads the new version, then resume with their KV
recomputed), a pull that failed or a relay that was lost, the switch to another relay, and
the fingerprints of what was loaded.

Apart from the generation loop (:mod:`laminar.rollout`), which asks for a version only at
its boundaries: how a version arrives is the relay tier's concern, seen from a rollout.
"""

from __future__ import annotations

import logging
import time

from laminar.engine import RequestState

# (the actor's logger: its records read as the rollout's, whichever module they come from)
logger = logging.getLogger("laminar.rollout")

# A rollout waiting for a version it was told of polls its relay this long at a time (it
# wakes the moment the version completes), serving the manager's commands between polls.
VERSION_POLL_S = 0.5


class WeightsMixin:
    """Weight pulls, version waits and interrupts, for
    :class:`~laminar.rollout.RolloutReplica` (whose ``__init__`` sets up the state)."""

    def _wait_for_version(self, version: int, wait_s: float) -> None:
        """Wait up to ``wait_s`` until the relay has ``version`` (or newer) and load it,
        in short long polls with the manager's commands served between them."""
        from laminar.relay_core import RelayError

        deadline = time.time() + wait_s
        while self.engine.version < version and time.time() < deadline:
            if self._stop.is_set() or self._paused is not None:
                return
            self._serve()
            try:
                update = self.puller.newest(
                    self.engine.version, wait_s=VERSION_POLL_S, wait_switch=False
                )
            except RelayError as e:  # lost, or a failed pull: the next poll tries again
                self._pull_failed(e)
                self._serve_for(min(VERSION_POLL_S, max(0.0, deadline - time.time())))
                continue
            if update is not None:
                self._load_version(*update)

    def pause(self, version: int) -> int:
        """Interrupt (partial rollout): hold every unfinished request until the relay has
        ``version``, load it, and resume them, recomputing their KV; served between two
        decode steps. Returns how many requests were held."""
        return self._command(lambda: self._pause(version))

    def _pause(self, version: int) -> int:
        if self.engine.version >= version:
            return 0
        if self._paused is not None:  # paused already (served while waiting): wait longer
            held, states = self._paused
            self._paused = (max(held, version), states)
            self.counts["interrupts"] += 1  # (its requests are counted held once)
            return 0
        states = self.engine.export(list(self.engine.request_ids()), moved=False)
        self._paused = (version, states)
        self.counts["interrupts"] += 1
        self.counts["interrupted_requests"] += len(states)
        return len(states)

    def _say_overdue(self, waited_s: float) -> None:
        # (The relay is not asked what it holds: a hung one would hold this loop too.)
        relay = self.puller.relay
        name = "none (lost, not replaced yet)" if relay is None else getattr(relay, "key", relay)
        logger.error(
            "rollout %s: paused for version %d for %.0f s, and its relay %s has not given "
            "it (the engine holds version %d): the paused requests wait on; see the "
            "relays' errors (summary.json relay.relays)",
            self.rollout_id,
            self._paused[0],
            waited_s,
            name,
            self.engine.version,
        )

    def _paused_states(self) -> list[RequestState]:
        paused = self._paused
        return list(paused[1]) if paused is not None else []

    def _resume_paused(self) -> None:
        """Wait until the relay has the version paused for, load it, resume the requests.

        The wait has no end of its own: the version may yet come (a failed send is made
        again, a rechain resends it, a restarted trainer publishes anew) and the requests
        need it. Each ``relay.timeout_s`` without it is logged, naming the relay: under
        partial rollout every rollout waits here, no trajectory finishes, and the trainer
        publishes nothing newer, so a version that never arrives stops the run, which
        used to say nothing at all."""
        from laminar.relay_core import RelayError

        t = time.time()
        overdue = t + self.cfg.relay.timeout_s
        # (The target is read again each round: a pause served meanwhile may raise it.)
        while self.engine.version < self._paused[0] and not self._stop.is_set():
            if time.time() >= overdue:
                overdue = time.time() + self.cfg.relay.timeout_s
                self._say_overdue(time.time() - t)
            self._tick()
            self._serve()
            try:
                update = self.puller.newest(self.engine.version, wait_s=VERSION_POLL_S)
            except RelayError as e:
                # Lost (none switched in within relay.timeout_s: the master, while the
                # trainer restarts), or a failed pull (a chunk's checksum): the paused
                # requests need this version, so the next poll tries again.
                self._pull_failed(e, f"paused for version {self._paused[0]}: trying again")
                self._serve_for(VERSION_POLL_S)
                continue
            if update is not None:
                self._load_version(*update)
        self.counts["sync_wait_s"] += time.time() - t
        version, states = self._paused
        self._paused = None
        if self._stop.is_set() and self.engine.version < version:
            # Stopped before the version came: the requests stay unfinished (the store
            # keeps nothing of them, as of any request still generating at a stop).
            return
        self.engine.import_(states, allow_version_change=True)
        self._recompute = True
        # (only those that held KV, the states with tokens: a request still waiting for
        # admission at the interrupt prefills once, as it would have anyway)
        self.counts["recomputed_tokens"] += sum(st.context_len for st in states if st.tokens)

    def _pull_failed(self, error: Exception, then: str = "", always: bool = False) -> None:
        """Count a pull that failed: its relay lost (``pulls_unreachable``) or the pull
        itself (``pulls_failed``: a chunk's checksum, a version evicted while read). With
        ``then``, say so and what happens next: once per kind, or ``always``."""
        from laminar.relay_client import RelayUnreachable

        key = "pulls_unreachable" if isinstance(error, RelayUnreachable) else "pulls_failed"
        if then and (always or not self.counts[key]):
            what = key.replace("_", " ")
            logger.warning("rollout %s: %s (%s); %s", self.rollout_id, what, error, then)
        self.counts[key] += 1

    def _maybe_load_weights(self) -> None:
        """The rollout wait: ask the local relay for a newer complete version, load it.

        Before its first batch a rollout waits until the relay holds the trainer's
        starting version: a resumed trainer starts at its checkpoint's version, not at
        the base policy the engine was built from."""
        from laminar.relay_client import RelayUnreachable
        from laminar.relay_core import RelayError

        t = time.time()
        while not self._synced and not self._stop.is_set():
            self._tick()
            try:
                self._synced = bool(self.puller.versions())
            except RelayUnreachable:  # (none switched in within relay.timeout_s: again)
                self.counts["pulls_unreachable"] += 1
            if not self._synced:
                # The manager's commands are served meanwhile: a data-module rebuild
                # asks this rollout too (a replacement may wait here a while).
                self._serve(0.02)

        t_pull = time.time()
        try:
            # A lost relay is not waited on here: this batch goes on with the weights
            # held, and the next boundary pulls again (from the relay the manager
            # switched us to by then: within a detection round for a downstream relay,
            # once the trainer has restarted for the master).
            update = self.puller.newest(self.engine.version, wait_switch=False)
        except RelayError as e:  # lost, or a failed pull (a chunk that failed its
            # checksum, a version evicted past relay.timeout_s): the engine keeps the
            # whole version it holds (it owns its weights)
            self._pull_failed(e, f"generating on at version {self.engine.version}")
            update = None
        if update is not None:
            self._load_version(*update, since=t_pull)  # (the real pull part of the hold)
        self.counts["weight_wait_s"] += time.time() - t

    def _load_version(self, version: int, state: dict, since: float | None = None) -> None:
        """Load ``version`` into the engine (and the parity reference). Paced with
        ``rollout.pacing.pull_s`` under relay weights, every load lasts the modelled
        host-to-device copy, the real load part of it: at a batch boundary, in a wait
        for a version the pool said is published (which used to load it unheld, and the
        next boundary then found nothing new to charge), for an adopted batch. ``since``:
        when the pull began, where it took no wait for the version (the copy counts from
        there)."""
        t_load = time.time() if since is None else since
        self.engine.load_weights(state, version)
        if self._reference is not None:
            self._reference.load_state_dict(state)
        if self.cfg.relay.audit_weights:
            from laminar.relay_core import state_fingerprint

            self.fingerprints[version] = state_fingerprint(state)
        self.counts["weight_loads"] += 1
        self.counts["weight_bytes"] = self.puller.bytes
        pacing = self.cfg.rollout.pacing
        if self.spec.weights == "relay" and pacing is not None and pacing.pull_s:
            from laminar.pacing import scale_of

            left = scale_of(pacing).wall(pacing.pull_s) - (time.time() - t_load)
            self._serve_for(max(0.0, left))

    async def set_relay(self, relay) -> None:
        """Pull from ``relay`` from now on: the manager's answer to the loss of ours
        (docs/faults.md). A pull waiting on the lost relay starts again on this one.
        ``None``: ours is lost and none replaces it yet (the master, while the trainer
        restarts): batches go on with the weights held.

        ``async`` so that it runs on the worker's event loop, not the actor thread: a
        command there (a pause, a move) waits for the generation thread, which may be
        waiting for this very switch; queued behind it, the switch came only once the
        pull gave up, ``relay.timeout_s`` later. (It only sets two fields.)"""
        self.puller.switch(relay)

    def get_fingerprints(self) -> dict[int, int]:
        return dict(self.fingerprints)
