"""The partial-response pool: what every unfinished trajectory has generated so far.

Rollouts register each request when they start it and stream its new tokens, logprobs and
token versions here every ``faults.flush_tokens`` tokens or ``faults.flush_s`` seconds;
the experience buffer forgets a trajectory once it holds it. When a rollout is lost, the
manager :meth:`~PartialCore.take`\\ s its entries and resumes them on healthy rollouts of
the same weight version: with counter-based sampling (:mod:`laminar.sampling`) a resumed
request continues with exactly the tokens it would have produced, so a loss costs at
most one flush interval of regeneration per trajectory, never a trajectory.

A request's last token is never logged as unfinished: an engine hands a request back in
the step that finishes it, so a logged entry can always be resumed. A finished request is
logged as *finished* (all its tokens, how it ended) before its rollout starts another
batch, and stays here until the buffer has it: if its rollout is lost in between (its
reward still in flight), the entry is scored again elsewhere, with no token regenerated.
A finished entry needs no weights, so only unfinished entries' versions are retained:
each rollout decodes one version at a time, so at most ``rollout.replicas`` versions are.

:class:`PartialCore` is the logic; :class:`PartialResponsePool` the actor (on the data
worker, beside the buffer).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

from laminar.engine import RequestState


class PartialCore:
    """Unfinished trajectories by request id, each owned by the rollout decoding it.

    >>> from laminar.engine import GenerationRequest, SamplingParams
    >>> core = PartialCore()
    >>> req = GenerationRequest("p0-000", (1, 2), SamplingParams(8))
    >>> core.register("r0", 3, [RequestState(req, seed=7)])
    >>> core.flush("r0", {"p0-000": (0, [5, 6], [-0.1, -0.2], [3, 3])})
    >>> [(s.tokens, s.n_moves, s.request.meta["rollout_path"]) for s in core.take("r0")]
    [([5, 6], 1, ['r0'])]
    >>> core.take("r0"), core.owned()  # taken: ownerless until reassigned
    ([], {None: (1, 2, 0)})
    >>> core.reassign(["p0-000"], "r1")
    >>> core.flush("r1", {"p0-000": (2, [7], [-0.3], [3])}, finished={"p0-000": ("eos", 9.5)})
    >>> core.versions()  # finished: its version need not be kept
    []
    >>> [(s.tokens, s.request.meta["finished"]) for s in core.take("r1")]
    [([5, 6, 7], ('eos', 9.5))]
    >>> core.forget(["p0-000"]); core.stats()["entries"]
    0
    """

    def __init__(self) -> None:
        self.entries: dict[str, dict] = {}
        self.counts: Counter = Counter()

    def register(self, rollout_id: str, version: int, states: list[RequestState]) -> None:
        """New requests of ``rollout_id`` (sampled by ``version``), with no tokens yet."""
        now = time.time()
        for st in states:
            self.entries[st.request_id] = {
                "state": st,
                "owner": rollout_id,
                "version": version,
                "t_flush": now,
            }
        self.counts["registered"] += len(states)

    def flush(
        self,
        rollout_id: str,
        tokens: dict[str, tuple],
        finished: dict[str, tuple[str, float]] | None = None,
    ) -> None:
        """New tokens: ``{request_id: (offset, tokens, logprobs, token_versions)}``, and
        the requests that ended with them: ``{request_id: (finish_reason, t_finish)}``.

        ``offset`` is how many tokens the rollout had logged before: a repeated or late
        flush overwrites from there instead of appending twice. A flush names its sender
        as the owner (a request moved by repack is flushed by its new rollout)."""
        now = time.time()
        finished = finished or {}
        for rid, (offset, toks, lps, tvs) in tokens.items():
            e = self.entries.get(rid)
            if e is None:  # already in the buffer
                continue
            st: RequestState = e["state"]
            if offset > len(st.tokens):  # a gap: keep what is contiguous
                self.counts["gaps"] += 1
                continue
            st.tokens[offset:] = list(toks)
            st.logprobs[offset:] = list(lps)
            st.token_versions[offset:] = list(tvs)
            e["owner"], e["t_flush"] = rollout_id, now
            self.counts["flushed_tokens"] += len(toks)
            if rid in finished:
                e["finished"] = finished[rid]
                self.counts["finished"] += 1
        self.counts["flushes"] += 1

    def reassign(self, request_ids: list[str], rollout_id: str) -> None:
        """Requests now decoded by ``rollout_id`` (moved by repack or recovery)."""
        for rid in request_ids:
            if rid in self.entries:
                self.entries[rid]["owner"] = rollout_id

    def forget(self, uids: list[str]) -> None:
        """Trajectories the buffer now holds."""
        for uid in uids:
            if self.entries.pop(uid, None) is not None:
                self.counts["forgotten"] += 1

    def take(self, rollout_id: str) -> list[RequestState]:
        """The lost ``rollout_id``'s entries as states to import elsewhere (counted as
        moved once more, with the lost rollout on their path), oldest first. They stay
        registered, ownerless, until :meth:`reassign`.

        Each copy's ``request.meta`` also says what the recovery needs:
        ``behavior_version``, ``recovered_tokens``, ``t_flush`` and, for an entry that
        had finished, ``finished`` = (finish_reason, t_finish): score it, do not decode."""
        out = []
        for e in self.entries.values():
            if e["owner"] != rollout_id:
                continue
            st: RequestState = e["state"]
            # The path is kept on the entry: a second loss appends to it.
            st.request.meta["rollout_path"] = [
                *st.request.meta.get("rollout_path", []),
                rollout_id,
            ]
            meta = {
                **st.request.meta,
                "recovered_tokens": len(st.tokens),
                "t_flush": e["t_flush"],
                "behavior_version": e["version"],
            }
            if "finished" in e:
                meta["finished"] = e["finished"]
            moved = replace(st.moved(), request=replace(st.request, meta=meta))
            e["owner"] = None
            out.append(moved)
        self.counts["taken"] += len(out)
        return sorted(out, key=lambda s: s.t_start)

    def versions(self) -> list[int]:
        """The weight versions of the unfinished trajectories: the relays keep these
        (:meth:`laminar.relay.RelayCore.retain`) so a recovery can resume them exactly.
        (A finished entry is only scored again: it needs no weights.)"""
        return sorted({e["version"] for e in self.entries.values() if "finished" not in e})

    def owned(self) -> dict[str | None, tuple[int, int, int]]:
        """Owner -> (entries, tokens logged, finished entries) (``None``: taken, not yet
        reassigned)."""
        out: dict[str | None, tuple[int, int, int]] = {}
        for e in self.entries.values():
            n, t, f = out.get(e["owner"], (0, 0, 0))
            out[e["owner"]] = (n + 1, t + len(e["state"].tokens), f + ("finished" in e))
        return out

    def stats(self) -> dict:
        return {"entries": len(self.entries), **self.counts}


RETAIN_WAIT_S = 1.0  # the longest a register or flush waits on the relays' retain calls


class PartialResponsePool:
    """Dask actor around :class:`PartialCore` (async: calls run on the event loop, in
    order, without a thread hop).

    It also keeps the relays' retained versions (:meth:`laminar.relay.RelayCore.retain`)
    equal to the versions of its entries, as they change: a batch's version is retained
    from the moment the batch is registered, so a recovery can resume it at that version.
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.core = PartialCore()
        self.relays: list = []
        self.timeout_s = timeout_s
        self._retained: list[int] = []
        self._pending: set = set()  # retain calls still running

    async def set_relays(self, relays: list) -> None:
        self.relays = list(relays)
        await self._sync_retained()

    async def _sync_retained(self) -> None:
        import asyncio

        versions = self.core.versions()
        if versions == self._retained or not self.relays:
            return
        self._retained = versions

        async def one(relay) -> None:
            try:
                await asyncio.wait_for(relay.retain(versions), self.timeout_s)
            except Exception:  # noqa: BLE001 — a lost relay: dropped when detected
                self.core.counts["retain_errors"] += 1

        # Live relays answer in milliseconds. A relay lost but not yet detected never
        # answers: its call runs out its timeout in the background, and the rollout
        # whose register or flush triggered this is not held up more than RETAIN_WAIT_S.
        tasks = [asyncio.ensure_future(one(r)) for r in self.relays]
        self._pending |= set(tasks)
        for t in tasks:
            t.add_done_callback(self._pending.discard)
        await asyncio.wait(tasks, timeout=RETAIN_WAIT_S)

    async def register(self, rollout_id: str, version: int, states: list) -> None:
        self.core.register(rollout_id, version, states)
        await self._sync_retained()

    async def flush(self, rollout_id: str, tokens: dict, finished: dict | None = None) -> None:
        self.core.flush(rollout_id, tokens, finished)
        if finished:
            await self._sync_retained()

    async def reassign(self, request_ids: list[str], rollout_id: str) -> None:
        self.core.reassign(request_ids, rollout_id)

    async def forget(self, uids: list[str]) -> None:
        self.core.forget(uids)
        await self._sync_retained()

    async def take(self, rollout_id: str) -> list:
        return self.core.take(rollout_id)

    async def versions(self) -> list[int]:
        return self.core.versions()

    async def owned(self) -> dict:
        return self.core.owned()

    async def stats(self) -> dict:
        return self.core.stats()
