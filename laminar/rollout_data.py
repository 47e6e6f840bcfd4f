"""The rollout's link to the data module: prompt pool, buffer and partial-response pool.

:class:`DataLinkMixin` holds the calls a :class:`~laminar.rollout.RolloutReplica` makes to
the data module, and what it does when the module is lost with its worker and rebuilt
within the run (docs/faults.md, "Data-module loss"): every call has a timeout; a rollout
that finds the module gone decodes its batch on and waits at the batch boundary; the
rebuilt module is handed every unfinished trajectory (:meth:`~DataLinkMixin.attach_data`)
and the kept ones go to its buffer again. The partial-response log (each unfinished
request's tokens so far, for recovery) goes to the same module and is here too.

Apart from the generation loop (:mod:`laminar.rollout`), which meets the data module only
through these calls: its loss and rebuild are a concern of their own.
"""

from __future__ import annotations

import logging
import time

from laminar.cluster import actor_result, is_lost
from laminar.contract import PromptGroup
from laminar.rollout_rewards import _RESEND

# (the actor's logger: its records read as the rollout's, whichever module they come from)
logger = logging.getLogger("laminar.rollout")

# While the data module looks lost, a rollout asks the old buffer this often whether it
# answers after all (a slow call, not a loss).
PROBE_S = 3.0


class DataLinkMixin:
    """The data module's calls, loss and rebuild, for
    :class:`~laminar.rollout.RolloutReplica` (whose ``__init__`` sets up the state)."""

    def _call(self, actor_future, actor=None):
        """Every actor-to-actor call has a timeout: a call to a lost actor never returns.
        With its ``actor``, one whose worker is lost fails within a second."""
        if actor is not None:
            return actor_result(actor, actor_future, self.cfg.cluster.actor_timeout_s)
        return actor_future.result(timeout=self.cfg.cluster.actor_timeout_s)

    def _acquire(self, n: int) -> list[PromptGroup]:
        ask = self._next_ask()
        ok, groups = self._data_call(
            self.pool, lambda: self.pool.acquire(n, self.rollout_id, self.engine.version, ask)
        )
        self._ask_open = not ok
        return groups if ok else []

    def _next_ask(self) -> int:
        """The id of the prompt-pool ask about to be made (``acquire``, ``top_up``,
        ``take``): a new one, or the last one's again while its answer is owed — a call
        that timed out may have run, and the pool keeps what it handed out for that id
        (:meth:`laminar.prompt_pool.PromptPoolCore.acquire`): asked again with it, a
        rollout that found the data module slow, not lost, gets those groups rather than
        leaving them outstanding for good. The caller closes it (``_ask_open``) when the
        answer arrives."""
        if not self._ask_open:
            self._ask_id += 1
            self._ask_open = True
        return self._ask_id

    def _take(self, n: int, wait_s: float) -> tuple[list[PromptGroup], int]:
        """Ask the pool for ``n`` groups, waiting up to ``wait_s`` for them in the pool
        (a long poll); returns the groups and the trainer's newest published version.

        The generation thread blocks meanwhile, and little waits on it: an idle rollout
        holds no batch to move, the manager's other calls and stats are not served by it,
        a publication (which a partial rollout's pause follows) wakes the poll at once,
        and a move's import, planned while the last batch drained, is refused after the
        poll (``_run``)."""
        self._tick()
        epoch = self._data_epoch
        while True:
            if self._data_lost is None:
                ask = self._next_ask()
                try:
                    future = self.pool.take(n, self.rollout_id, self.engine.version, wait_s, ask)
                    answer = actor_result(
                        self.pool, future, wait_s + self.cfg.cluster.actor_timeout_s
                    )
                    self._ask_open = False
                    return answer
                except Exception as e:
                    self._lose_data(e)
            self._await_data(epoch, serve=True)
            if self._data_lost is not None or self._data_epoch != epoch or self._stop.is_set():
                return [], self.engine.version
            # Slow, not lost: the pool may have handed out groups for the ask whose answer
            # never came. The same ask again gets them (none new), without waiting.
            wait_s = 0.0

    def _data_call(self, actor, call) -> tuple[bool, object]:
        """``(True, result)`` of ``call()`` on the data module's ``actor``; ``(False,
        None)`` while the data module is lost (this call may find it so)."""
        if self._data_lost is not None:
            return False, None
        try:
            return True, self._call(call(), actor)
        except Exception as e:
            self._lose_data(e)
            return False, None

    def _lose_data(self, error: Exception) -> None:
        """A call to the data module failed: lost (its worker gone, or not answering),
        or an error of its own, which fails this rollout as before."""
        if not is_lost(error):
            raise error
        if self._data_lost is None:
            self._data_lost = time.time()
            logger.warning(
                "rollout %s: the data module does not answer (%s: %s); generating on, "
                "keeping what finishes, until it is back or rebuilt",
                self.rollout_id,
                type(error).__name__,
                error,
            )

    def _await_data(self, epoch: int, serve: bool) -> None:
        """Wait until a data module newer than ``epoch`` is attached, or the old one
        answers after all; ``serve``: the generation thread, serving commands meanwhile.
        Fails after :meth:`laminar.config_sections.FaultsConfig.data_wait`."""
        t0 = time.time()
        timeout, settings = self.cfg.faults.data_wait()
        next_probe = t0 + PROBE_S
        while self._data_epoch == epoch and self._data_lost is not None:
            if self._stop.is_set():
                return
            if time.time() - self._data_lost > timeout:
                raise RuntimeError(
                    f"rollout {self.rollout_id}: the data module was lost and not rebuilt "
                    f"within {timeout:g} s ({settings})"
                )
            if time.time() > next_probe:
                next_probe = time.time() + PROBE_S
                try:
                    actor_result(self.buffer, self.buffer.stats(), 2.0)
                except Exception:  # noqa: BLE001 — still gone
                    pass
                else:
                    if self._data_epoch == epoch:
                        self._data_lost = None  # it was slow, not lost
                        logger.warning("rollout %s: the data module answers again", self.rollout_id)
            if serve:
                self._serve(0.05)
            else:
                time.sleep(0.05)
        if serve:
            self.counts["data_wait_s"] += time.time() - t0

    def data_holdings(self) -> list[str]:
        """The prompt groups this rollout holds trajectories of: decoding, handed to it
        by a recovery, waiting for a reward, or sent and not yet stored. (Served by the
        generation thread: what it holds does not change meanwhile.)"""
        return self._command(self._holdings)

    def _holdings(self) -> list[str]:
        groups = {st.request.meta["group"].prompt_uid for st in self.engine.in_flight()}
        # (asked while a paced step waits out its time: what it finished is on its way to
        # the reward and the buffer, in neither in_flight nor _unstored yet. Left out, a
        # rebuilt data module took the group for held by nobody and re-issued its missing
        # samples, which this rollout then sent too.)
        groups |= {o.request.meta["group"].prompt_uid for o in self.engine.finishing()}
        for _, states in list(self._adopted.queue) + self._exported_batches():
            groups |= {st.request.meta["group"].prompt_uid for st in states}
        for states in list(self._rescore.queue):
            groups |= {st.request.meta["group"].prompt_uid for st in states}
        groups |= {st.request.meta["group"].prompt_uid for st in self._paused_states()}
        with self._unstored_lock:
            groups |= {t.prompt_uid for t, _ in self._unstored.values()}
        return sorted(groups)

    def attach_data(self, pool, buffer, partial) -> int:
        """The data module rebuilt in place of a lost one: use it from now on. Every
        unfinished trajectory is registered with the new partial-response pool, with the
        tokens it has, and every finished one no store has yet too, as finished
        (:meth:`_register_finished`); every kept one is sent again to the new buffer.
        Returns how many unfinished ones were registered."""
        return self._command(lambda: self._attach(pool, buffer, partial))

    def _attach(self, pool, buffer, partial) -> int:
        from dataclasses import replace

        self.pool, self.buffer, self.partial = pool, buffer, partial
        self._data_epoch += 1
        self._data_lost = None
        self._ask_open = False  # (a new pool: it knows no ask of ours)
        registered = 0
        if partial is not None:
            # (Paused requests are this batch's too: they wait outside the engine for a
            # version, sampled so far by the one it holds.)
            unfinished = self.engine.in_flight() + self._paused_states()
            batches = [(self.engine.version, unfinished)]
            batches += list(self._adopted.queue) + self._exported_batches()
            for version, states in batches:
                copies = [
                    replace(
                        st,
                        tokens=list(st.tokens),
                        logprobs=list(st.logprobs),
                        token_versions=list(st.token_versions),
                    )
                    for st in states
                ]
                if copies:
                    self._call(partial.register(self.rollout_id, version, copies), partial)
                    registered += len(copies)
            self._logged = {st.request_id: len(st.tokens) for st in unfinished}
            self._ended.clear()  # (kept as unstored: the new buffer gets them)
            finished = self._register_finished(partial)
        self.counts["data_rebuilds"] += 1
        self._to_score.put(_RESEND)
        logger.warning(
            "rollout %s: a rebuilt data module; %d unfinished and %d finished trajectories "
            "registered with it, %d kept trajectories to send again",
            self.rollout_id,
            registered,
            finished if partial is not None else 0,
            len(self._unstored),
        )
        return registered

    def _register_finished(self, partial) -> int:
        """Register with a rebuilt partial-response pool, as finished (their tokens and
        how they ended, as a finished flush leaves them), the finished trajectories this
        rollout keeps that no store has yet: waiting for a reward or for the new buffer
        (``_unstored``), a lost rollout's queued for scoring here (``_rescore``), or
        finishing in a paced step. The lost pool had them; without them here, a loss of
        this rollout before the new buffer holds them lost them (a take found nothing,
        and their groups, held by it, were not re-issued). Returns how many."""
        from laminar.engine import RequestState

        with self._unstored_lock:
            self._prune_finished()
            finishing = {o.request.request_id: o for o in self.engine.finishing()}
            outputs = {**self._finished_outputs, **finishing}
        by_version: dict[int, list[RequestState]] = {}
        tokens, ended = {}, {}
        for rid, out in outputs.items():
            # (registered bare, then flushed whole with how it ended: what a rollout's own
            # register and finishing flush leave; its seed no longer matters, it is only
            # scored again)
            version = int(out.token_versions.min(initial=out.version))
            state = RequestState(out.request, seed=0, t_start=out.t_start, n_moves=out.n_moves)
            by_version.setdefault(version, []).append(state)
            tokens[rid] = (
                0,
                out.response_tokens.tolist(),
                out.logprobs.tolist(),
                out.token_versions.tolist(),
            )
            ended[rid] = (out.finish_reason, out.t_finish)
        for version, states in sorted(by_version.items()):
            self._call(partial.register(self.rollout_id, version, states), partial)
        if tokens:
            self._call(partial.flush(self.rollout_id, tokens, ended), partial)
        return len(tokens)

    # -- finished trajectories kept for a rebuilt pool -------------------------------------
    def _keep_finished(self, outputs, prune: bool = False) -> None:
        """Keep these finished outputs (``_finished_outputs``: for a rebuilt pool,
        :meth:`_register_finished`) until their trajectories are stored. ``prune`` (the
        generation thread's, with no output of its own between finished and submitted):
        first drop those whose trajectories no longer wait, when they are many more than
        those that do."""
        if self.partial is None or (not outputs and not prune):
            return
        with self._unstored_lock:
            if prune and len(self._finished_outputs) > 2 * len(self._unstored) + 64:
                self._prune_finished()
            self._finished_outputs.update((o.request.request_id, o) for o in outputs)

    def _prune_finished(self) -> None:
        """Drop the kept outputs whose trajectories are neither kept unstored nor queued
        for scoring (under ``_unstored_lock``, on the generation thread: what it
        finishes it submits before it prunes again)."""
        queued = {st.request_id for states in list(self._rescore.queue) for st in states}
        kept = self._finished_outputs
        for rid in [r for r in kept if r not in self._unstored and r not in queued]:
            del kept[rid]

    # -- the partial-response log (laminar.partial) ----------------------------------------------
    def _log_partial(self, finished=(), force: bool = False) -> None:
        """Send the unfinished requests' new tokens to the partial-response pool when one
        has ``faults.flush_tokens`` unlogged or ``faults.flush_s`` have passed (a loss
        then regenerates at most that much). Waits for the pool: one log in flight.

        Requests that finished go with the next send, marked finished (their version no
        longer needs keeping); the end of a batch always sends them (:meth:`_decode`)."""
        self._keep_finished(finished, prune=True)  # (lost or not: a rebuilt pool gets them)
        if self.partial is None or self._data_lost is not None:
            return  # (lost: a rebuilt pool has every unfinished one registered in full)
        for out in finished:
            rid = out.request.request_id
            if rid in self._logged:
                self._ended[rid] = (self._logged.pop(rid), out)
        f = self.cfg.faults
        states = self.engine.in_flight()
        due = force or time.time() - self._t_logged >= f.flush_s
        if not due:
            due = any(
                len(st.tokens) - self._logged.get(st.request_id, 0) >= f.flush_tokens
                for st in states
            )
        if not due:
            return
        tokens = {}
        for st in states:
            n = self._logged.get(st.request_id, 0)
            if len(st.tokens) > n:
                tokens[st.request_id] = (
                    n,
                    st.tokens[n:],
                    st.logprobs[n:],
                    st.token_versions[n:],
                )
        ended = {}
        for rid, (n, out) in self._ended.items():
            tokens[rid] = (
                n,
                out.response_tokens[n:].tolist(),
                out.logprobs[n:].tolist(),
                out.token_versions[n:].tolist(),
            )
            ended[rid] = (out.finish_reason, out.t_finish)
        if tokens:
            ok, _ = self._data_call(
                self.partial, lambda: self.partial.flush(self.rollout_id, tokens, ended)
            )
            if not ok:
                return
            self._ended.clear()
            for rid, (n, toks, _, _) in tokens.items():
                if rid not in ended:
                    self._logged[rid] = n + len(toks)
            self.counts["partial_flushes"] += 1
            self.counts["partial_tokens"] += sum(len(t[1]) for t in tokens.values())
        self._t_logged = time.time()
