"""Repack moves, the rollout's side: its load for the planner, export, import, hold.

:class:`MovesMixin`: what :class:`laminar.manager.RolloutManager` asks of a rollout to
carry out a move that :mod:`laminar.repack` planned: the load it plans with, the export of
a draining batch (the source then *held* at its batch boundary until the manager releases
it, so a failed import can always be undone), the import into a running batch of the same
version, and the undo of an export whose move did not happen. The manager's requests run
on the generation thread through its command mailbox
(:meth:`laminar.rollout.RolloutReplica._command`): between decode steps, or, on a paced
engine, within a step's wait for its modelled time (an export is then withheld until
that step's deadline).

Apart from the generation loop (:mod:`laminar.rollout`), which meets a move only at its
holds and in its mailbox: a move is a protocol with the manager of its own.
"""

from __future__ import annotations

import logging
import time

from laminar.engine import RequestState
from laminar.repack import HOLD_LIMIT_TIMEOUTS as HOLD_LIMIT_TIMEOUTS

# (the actor's logger: its records read as the rollout's, whichever module they come from)
logger = logging.getLogger("laminar.rollout")


class MovesMixin:
    """Load, export, import and hold for repack moves, for
    :class:`~laminar.rollout.RolloutReplica` (whose ``__init__`` sets up the state)."""

    def load(self) -> dict:
        """This rollout's load for the repack planner (as of its latest decode step)."""
        return dict(self._load)

    def _publish_load(self) -> None:
        kv = self.engine.kv_stats()
        self._load = {
            "rollout_id": self.rollout_id,
            "version": self.engine.version,
            # (what its requests will hold: the waiting ones, groups a top-up just took,
            # take their KV at their admission)
            "kv_used": (kv.used_tokens + kv.waiting_tokens) / max(kv.capacity_tokens, 1),
            "n_requests": kv.running + kv.waiting,
            "in_batch": self._in_batch,
            # which batch: KV "falls" only within one (a new batch after a long one
            # holds less KV, but nothing of it has finished)
            "batch": self._batch_seq,
            "held": self._held,
            # (changes when the batch takes in more: an export checks it is as planned)
            "taken_in": self._taken_in,
            "t": time.time(),
        }

    def export_for_move(
        self,
        batch: int | None = None,
        max_requests: int | None = None,
        taken_in: int | None = None,
        move: str | None = None,
    ) -> dict | None:
        """Hand every unfinished request to the manager and hold at the batch boundary
        until :meth:`release` (the move is done) or :meth:`abort_export` (it is not),
        each naming the same ``move`` (the manager's token for it). ``None`` if there is
        no batch to take any more, or if it is not the one the manager planned with:
        another batch than ``batch`` (:meth:`load`'s; the planned one drained and a
        fresh one began), or one that took in more since (a top-up or an import:
        :meth:`load`'s ``taken_in`` is not ``taken_in``; or more than ``max_requests``
        requests): the destination's limits were planned without them. ``None`` too
        while the data module is flagged lost (recovery log on): the destination takes
        the exported requests as logged up to their last token, and only a flush that
        went through makes them so.

        Served within a paced step's wait, the export returns at that step's deadline
        (the states hold its tokens); ``handed_at`` (epoch seconds) says when it was
        handed over, where the moved requests' pause begins."""
        return self._command(lambda: self._export_all(batch, max_requests, taken_in, move))

    def import_for_move(
        self,
        version: int,
        states: list,
        batch: int | None = None,
        sources: int = 0,
        max_requests: int | None = None,
        max_kv: float | None = None,
        move: str | None = None,
    ) -> bool:
        """Take over ``states`` (sampled by ``version``) into the running batch: a repack
        move's from ``sources`` rollouts (counted as ``moves_in``), or a lost rollout's
        (``sources=0``: a recovery, not a move). Refused (``False``) unless this rollout
        is decoding a batch of that same version — the batch the manager planned with
        (``batch``, :meth:`load`'s), not a fresh one begun since, which the planner did
        not count — and would then hold at most ``max_requests`` requests (the planner's
        ``max_batch``: a batch that took new groups since, ``rollout.top_up``, may have
        no room left for what was planned) and at most ``max_kv`` of its KV capacity
        (``repack.c_max``: both sides' contexts grew since the plan). ``move``: the
        manager's token for this import, which :meth:`holds` answers about."""
        return self._command(
            lambda: self._import(version, states, batch, sources, max_requests, max_kv, move)
        )

    def release(self, move: str | None = None) -> None:
        """Commit the move :meth:`export_for_move` began for ``move``: the exported
        requests are the destination's now. The rollout pulls the newest weights and
        takes new prompts (or, after :meth:`abort_export`, decodes its batch on). A
        release of another move is ignored: one delivered after this rollout took that
        move's requests back (its hold ran out) and exported again must not commit the
        later export, whose import may yet be refused."""
        with self._hold_lock:
            if self._exported is not None and self._export_move != move:
                return
            self._held, self._exported, self._export_move = False, None, None

    def abort_export(self, move: str | None = None) -> int:
        """Undo :meth:`export_for_move` of ``move``: take the exported requests back and
        decode them on. For a move that did not happen (the destination refused, or the
        manager gave up waiting for the export, which may yet have run). Returns how
        many came back (0 for another move's export: that one is not undone)."""
        return self._command(lambda: self._take_back(move))

    def holds(self, move: str) -> bool:
        """Whether the import the manager tokened ``move`` went through here (the
        manager asks a destination whose import it got no answer to: asked after the
        import, served after it). The import itself, not the requests: some may have
        finished since (a move's tail is near its end), and some may have moved on in a
        later move, which answering by request ids took for the old import's success."""
        return self._command(lambda: self._holds(move))

    def _holds(self, move: str) -> bool:
        return move in self._imported

    def _exported_batches(self) -> list[tuple[int, list[RequestState]]]:
        exported = self._exported
        return [exported] if exported is not None else []

    def _export_all(
        self,
        batch: int | None = None,
        max_requests: int | None = None,
        taken_in: int | None = None,
        move: str | None = None,
    ):
        if not self._in_batch or self._held or not self.engine.has_work():
            return None
        if batch is not None and batch != self._batch_seq:
            return None
        if taken_in is not None and taken_in != self._taken_in:
            return None
        ids = list(self.engine.request_ids())
        if max_requests is not None and len(ids) > max_requests:
            return None
        t0 = time.perf_counter()
        self._log_partial(force=True)  # the log holds every exported token ...
        if self.partial is not None and self._data_lost is not None:
            # ... unless the flush was skipped (a pool call timed out: flagged lost until
            # a probe) or failed. The destination counts every exported token as logged:
            # its flushes would start past the log's end, and the pool ignores a gap and
            # every flush after it, the finish included. (Sending the offset logged along
            # does not do: a flush of ours still queued in the pool could run after the
            # destination's and cut the log back behind it. One that went through now
            # ran after every earlier one: the pool serves its calls in order.)
            return None
        states = self.engine.export(ids)
        for st in states:
            self._logged.pop(st.request_id, None)
        for st in states:  # the rollouts a trajectory passed through, in order
            st.request.meta["rollout_path"] = [
                *st.request.meta.get("rollout_path", []),
                self.rollout_id,
            ]
        with self._hold_lock:
            self._held, self._exported = True, (self.engine.version, states)
            self._export_move = move
        self._held_since = time.time()
        self.counts["moves_out"] += 1
        self.counts["requests_out"] += len(states)
        export_s = time.perf_counter() - t0
        # Served from a paced step's wait, the export holds the step's tokens before the
        # step has ended in modelled time: handed over now, a destination could decode
        # on from them while the source's GPU would still be computing them. Withheld
        # until the step's deadline (the wait the step would have spent anyway).
        pacer = getattr(self.engine, "pacer", None)
        if pacer is not None and (left := pacer.until_deadline()) > 0:
            time.sleep(left)
        return {
            "version": self.engine.version,
            "states": states,
            "tokens": sum(len(st.tokens) for st in states),
            "context_tokens": sum(st.context_len for st in states),
            "export_s": export_s,
            # (epoch seconds) when the requests left this rollout's decoding, the withheld
            # wait past: their pause starts here, not at the manager's round start — the
            # source decoded them until its step's deadline
            "handed_at": time.time(),
        }

    def _joined(self) -> None:
        """Requests joined the engine now (an import, a take-back): a paced engine's next
        step is paced from now at the earliest (:meth:`laminar.pacing.Pacer.floor`), not
        chained to a deadline that passed before they came."""
        pacer = getattr(self.engine, "pacer", None)
        if pacer is not None:
            pacer.floor(pacer.clock())

    def _take_back(self, move: str | None = None, any_move: bool = False) -> int:
        """The exported requests back into the engine, as they were before the export
        (not counted as moved, nor this rollout as on their path twice): those of
        ``move``'s export, or of whichever export with ``any_move`` (a hold that ran out)."""
        from dataclasses import replace

        with self._hold_lock:
            if self._exported is None:  # nothing exported, or the move was committed
                return 0
            if not any_move and self._export_move != move:  # (a late abort of another)
                return 0
            version, states = self._exported
            if self.engine.version != version:  # a held source loads no weights: a bug
                raise RuntimeError(
                    f"rollout {self.rollout_id} holds requests of version {version} but "
                    f"its engine is at {self.engine.version}"
                )
            self._held, self._exported, self._export_move = False, None, None
        back = []
        for st in states:
            st.request.meta["rollout_path"] = st.request.meta["rollout_path"][:-1]
            back.append(replace(st, n_moves=st.n_moves - 1))
        self.engine.import_(back)
        self._joined()
        self._logged.update({st.request_id: len(st.tokens) for st in back})
        self._reprefill = True  # (its time in reprefill_s: its tokens beside it)
        self.counts["reprefill_tokens"] += sum(st.context_len for st in back)
        self.counts["moves_out"] -= 1
        self.counts["requests_out"] -= len(back)
        self.counts["moves_taken_back"] += 1
        return len(back)

    def _import(
        self,
        version: int,
        states: list,
        batch: int | None,
        sources: int,
        max_requests: int | None = None,
        max_kv: float | None = None,
        move: str | None = None,
    ) -> bool:
        # (Paused: the batch is on its way out to wait for a version; taken in, these
        # would decode on with the old weights past the interrupt.)
        if not self._in_batch or self._held or self._paused is not None or self._stop.is_set():
            return False
        if self.engine.version != version:
            return False
        if batch is not None and batch != self._batch_seq:
            return False
        held = len(self.engine.request_ids())
        if max_requests is not None and held + len(states) > max_requests:
            return False
        if max_kv is not None:
            kv = self.engine.kv_stats()
            after = kv.used_tokens + kv.waiting_tokens + sum(st.context_len for st in states)
            if after > max_kv * kv.capacity_tokens:
                return False
        self.engine.import_(states)
        self._joined()
        if move is not None:
            self._imported.append(move)
        self._taken_in += 1
        # (every token logged: a move's source flushed them all, a recovery's come from
        # the log)
        self._logged.update({st.request_id: len(st.tokens) for st in states})
        self._reprefill = True
        if sources:  # (a recovery's import is no move: requests_in matches requests_out)
            self.counts["moves_in"] += sources
            self.counts["requests_in"] += len(states)
        self.counts["reprefill_tokens"] += sum(st.context_len for st in states)
        return True

    def _wait_while_held(self) -> None:
        limit = HOLD_LIMIT_TIMEOUTS * self.cfg.cluster.actor_timeout_s
        while self._held and not self._stop.is_set():
            self._serve(0.02)
            if self._held and time.time() - self._held_since > limit:
                # (a release may come meanwhile: then nothing is taken back)
                if n := self._take_back(any_move=True):
                    self.counts["holds_timed_out"] += 1
                    logger.warning(
                        "rollout %s: held by a move for over %.0f s, neither released nor "
                        "aborted (the manager was lost?): took its %d requests back",
                        self.rollout_id,
                        limit,
                        n,
                    )
