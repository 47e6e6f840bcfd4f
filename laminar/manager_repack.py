"""Repack, the manager's side: planning rounds and the execution of their moves.

:func:`repack_max_batch` (the planner's ``B``) and :func:`planner_loads` (the planner's
input from the rollouts' published loads), and :class:`RepackMixin`, the rounds of
:class:`laminar.manager.RolloutManager`: every ``repack.interval_s`` and after each
publication it plans with :func:`laminar.repack.plan` and carries out the moves together
(export, import, release or take back; docs/repack.md).

Apart from loss and hang recovery (:mod:`laminar.manager_recovery`): a move is a protocol
with the rollouts of its own, and shares with recovery only the manager's call helpers
(``_try``, ``_noting``) and its view of the live rollouts (``_loads``).
"""

from __future__ import annotations

import logging
import time
import uuid

from laminar.cluster import actor_result
from laminar.config import RunConfig
from laminar.repack import RolloutLoad, plan

# (the actor's logger: its records read as the manager's, whichever module they come from)
logger = logging.getLogger("laminar.manager")


def repack_max_batch(cfg: RunConfig) -> int:
    """``B`` for the planner: ``repack.max_batch`` if set; else the pacing model's
    memory-bound batch limit when paced, capped by what one engine decodes at once."""
    if cfg.repack is not None and cfg.repack.max_batch is not None:
        return cfg.repack.max_batch
    limit = cfg.rollout.max_batch
    pacing = cfg.rollout.pacing
    if pacing is not None:
        model = pacing.time_model()
        # in real requests: each stands for request_scale modelled ones
        limit = min(limit, max(2, int(model.batch_limit / pacing.request_scale)))
    return limit


def planner_loads(loads: dict[str, dict], prev: dict[str, tuple[int | None, float]]):
    """The planner's :class:`~laminar.repack.RolloutLoad` of each rollout decoding a batch
    (and not held by a move), from the rollouts' published loads. ``kv_prev`` is a
    rollout's KV at the previous check *of the same batch*: a batch seen for the first
    time is not falling (a fresh batch after a long tail holds less KV than the tail did,
    yet none of its requests has finished, and moving it would only pause it). ``prev``
    is updated in place.

    >>> prev = {}
    >>> tail = {"version": 3, "kv_used": 0.4, "n_requests": 2, "in_batch": True, "held": False}
    >>> planner_loads({"r0": {**tail, "batch": 1}}, prev)[0].kv_prev
    0.4
    >>> planner_loads({"r0": {**tail, "batch": 1, "kv_used": 0.3}}, prev)[0].kv_prev
    0.4
    >>> planner_loads({"r0": {**tail, "batch": 2, "kv_used": 0.1}}, prev)[0].kv_prev  # new
    0.1
    """
    out = []
    for rid, load in loads.items():
        if not load:
            continue  # not started yet
        batch, kv_prev = prev.get(rid, (None, load["kv_used"]))
        if batch != load.get("batch"):
            kv_prev = load["kv_used"]
        prev[rid] = (load.get("batch"), load["kv_used"])
        if load["in_batch"] and not load["held"]:
            out.append(
                RolloutLoad(rid, load["version"], load["kv_used"], kv_prev, load["n_requests"])
            )
    return out


class RepackMixin:
    """Planning rounds and move execution, for
    :class:`~laminar.manager.RolloutManager` (whose ``__init__`` sets up the state)."""

    def _published(self) -> bool:
        if not self.rcfg.on_publish or self._master_lost is not None:
            # (lost: a call to it would wait out the actor timeout, every iteration of
            # the loop that also detects losses; the restarted trainer's master replaces it)
            return False
        try:
            future = self.master.newest(self._seen_version)
            info = actor_result(self.master, future, self.timeout)  # (~1 s once it is lost)
        except Exception:  # noqa: BLE001 — the master went with the trainer: it restarts
            return False
        if info is None:
            return False
        self._seen_version = info["version"]
        return True

    def check(self) -> list[dict]:
        """One planning round: loads, plan, moves. Returns the rows of its moves."""
        published = self._loads()
        loads = planner_loads(published, self._prev)
        self.counts["checks"] += 1
        moves = plan(loads, c_max=self.rcfg.c_max, max_batch=self.max_batch)
        taken_in = {rid: ld.get("taken_in") for rid, ld in published.items() if ld}
        by_id = {ld.rollout_id: ld for ld in loads}
        rows = self._execute(moves, by_id, taken_in) if moves else []
        self._record_moves(rows)
        return rows

    def _execute(
        self,
        moves: list,
        loads: dict[str, RolloutLoad],
        taken_in: dict[str, int | None] | None = None,
    ) -> list[dict]:
        """Carry out a round's moves together: every source exports at once, then each
        destination imports all its sources' requests in one call (destinations at
        once), then every source whose move went through is released and every other
        takes its requests back. A command waits for its rollout's next step boundary, so
        one move at a time cost two steps per move; a round now costs about two steps,
        however many moves it has.

        A request is never in no engine: a source holds what it exported until it is
        released or aborted (and takes it back by itself after a hold nobody ends), and
        the manager aborts every export it did not get the answer of, which may yet run.
        ``loads`` (the planner's input) and ``taken_in`` (each rollout's published
        ``taken_in`` then) bound each source's export to its planned batch, grown by
        nothing since.

        Every export and import carries a token of its own: a release or abort acts on
        the export of its token only (one delivered late leaves a later move alone), and
        the question to a destination whose import was not answered is whether the
        import of its token went through.

        Each move's row times its source's pause from the export's hand-over (a paced
        source withholds it until its step's deadline, decoding until then) to the
        release (``pause_s``), and the round from its start (``round_s``). An export not
        answered is counted in ``exports_unanswered``, one answered with nothing to
        move (its batch drained or changed) in ``skipped``."""
        t0 = time.time()
        # Each phase's calls run at once: one deadline for all of them. (A command the
        # manager stops waiting for may still run on its rollout, which starts its own
        # clock later: every export not answered is aborted.)
        window = self.timeout
        taken_in = taken_in or {}
        round_id = uuid.uuid4().hex[:12]
        token = {m.source: f"{round_id}:{m.source}" for m in moves}
        exports = {
            m.source: self._try(
                lambda s=m.source: self.rollouts[s].export_for_move(
                    batch=self._prev[s][0],
                    max_requests=loads[s].n_requests,
                    taken_in=taken_in.get(s),
                    move=token[s],
                )
            )
            for m in moves
        }
        outs: dict[str, dict] = {}
        handed: dict[str, float] = {}  # source -> when its export was handed over
        ok_of: dict[str, bool] = {}
        aborts: dict[str, object] = {}
        try:
            deadline = time.time() + window
            for src, future in exports.items():
                got, out = self._noting(
                    f"repack: {src} export", future, actor=self.rollouts[src], deadline=deadline
                )
                if not got:  # not answered: it may yet export, so undo it there
                    aborts[src] = self._try(
                        lambda s=src: self.rollouts[s].abort_export(move=token[s])
                    )
                    self.counts["exports_unanswered"] += 1
                elif out is None:  # its batch drained or changed meanwhile: nothing moves
                    self.counts["skipped"] += 1
                else:
                    outs[src] = out
                    # A paced source decodes until its step's deadline and hands its
                    # requests over then: their pause starts there, not at t0. (The
                    # rollout's clock: kept between t0 and the answer here.)
                    now = time.time()
                    handed[src] = min(max(out.get("handed_at", now), t0), now)
            t1 = time.time()
            # One import per destination and version (the planner merges one version;
            # a source that loaded another since is refused and takes its states back).
            merged: dict[tuple[str, int], list[str]] = {}
            for m in moves:
                if m.source in outs:
                    merged.setdefault((m.destination, outs[m.source]["version"]), []).append(
                        m.source
                    )
            into = {(d, v): f"{round_id}:{d}:{v}" for d, v in merged}  # (each import's token)
            imports = {
                (dst, v): self._try(
                    lambda d=dst, v=v, s=sources: self.rollouts[d].import_for_move(
                        v,
                        [st for src in s for st in outs[src]["states"]],
                        batch=self._prev[d][0],  # the batch this round planned with
                        sources=len(s),
                        max_requests=self.max_batch,
                        max_kv=self.rcfg.c_max,
                        move=into[d, v],
                    )
                )
                for (dst, v), sources in merged.items()
            }
            deadline = time.time() + window
            unanswered = {}
            for (dst, v), sources in merged.items():
                got, answer = self._noting(
                    f"repack {sources} -> {dst}: import",
                    imports[dst, v],
                    actor=self.rollouts[dst],
                    deadline=deadline,
                )
                ok_of |= dict.fromkeys(sources, got and answer is not False)
                if not got:  # it may yet be imported: ask, after it (calls run in order)
                    unanswered[dst, v] = self._try(
                        lambda d=dst, v=v: self.rollouts[d].holds(into[d, v])
                    )
            # Twice as long: the question waits behind the import (and behind a pool call
            # the destination's generation thread may be in); given up on, the source
            # takes back what the destination may hold, and both decode it. The source
            # holds its requests longer than the whole move may take (5 timeouts:
            # export, import and this question's 2 at most, then the release).
            deadline = time.time() + 2 * window
            for (dst, v), future in unanswered.items():
                got, holds = self._noting(
                    f"repack: does {dst} hold what it was sent",
                    future,
                    actor=self.rollouts[dst],
                    deadline=deadline,
                )
                # (no answer either: the source takes them back, and if the destination
                # took them too they decode twice, the buffer keeping the first to finish)
                ok_of |= dict.fromkeys(merged[dst, v], bool(got and holds))
            t_import = time.time() - t1
        finally:
            for src in outs:
                if not ok_of.get(src) and src not in aborts:  # refused, or not reached
                    aborts[src] = self._try(
                        lambda s=src: self.rollouts[s].abort_export(move=token[s])
                    )
            released = {
                src: self._try(lambda s=src: self.rollouts[s].release(move=token[s]))
                for src in outs
                if ok_of.get(src)
            }
            deadline = time.time() + window
            for src, future in released.items():
                self._ok(
                    future, f"repack: {src} release", actor=self.rollouts[src], deadline=deadline
                )
            # Not answered: the source was lost or stopped meanwhile (a lost one's requests
            # are in the partial-response log, and recovery resumes them), or it is stuck
            # and takes them back itself when its hold runs out.
            for src, future in aborts.items():
                self._noting(
                    f"repack: {src} takes its states back",
                    future,
                    actor=self.rollouts[src],
                    deadline=deadline,
                )
            t_released = time.time()  # the pause a move caused ends here
        if self.partial is not None:  # after the releases: a slow pool holds no source
            reassigned = {}
            for m in moves:
                if ok_of.get(m.source):
                    ids = [st.request_id for st in outs[m.source]["states"]]
                    reassigned[m.source] = self._try(
                        lambda i=ids, d=m.destination, s=m.source: self.partial.reassign(i, d, s)
                    )
            # The destination's next flush names it their owner too; until then a loss of
            # it would look for them under the source. A move is never undone for this:
            # the requests would decode twice.
            deadline = time.time() + window
            for src, future in reassigned.items():
                self._noting(f"repack: {src}'s requests in the log", future, deadline=deadline)
        rows = []
        for m in moves:
            if m.source not in outs:
                continue
            out, ok = outs[m.source], ok_of.get(m.source, False)
            self.counts["moves" if ok else "rolled_back"] += 1
            for rid in (m.source, m.destination):
                self._prev.pop(rid, None)  # their KV just jumped: not "falling" next time
            rows.append(
                {
                    "time": t0,
                    "source": m.source,
                    "destination": m.destination,
                    "version": out["version"],
                    "ok": ok,
                    "requests": len(out["states"]),
                    "tokens": out["tokens"],
                    "context_tokens": out["context_tokens"],
                    "export_s": out["export_s"],
                    "import_s": t_import,
                    # the source's requests paused: from its hand-over to the release
                    "pause_s": t_released - handed[m.source],
                    "t_handed": handed[m.source],
                    "t_released": t_released,
                    "round_s": t_released - t0,  # the round, its exports' waits included
                    "round_moves": len(outs),
                }
            )
        return rows

    def _ok(self, future, what: str, *, actor=None, deadline: float | None = None) -> bool:
        """Whether an actor call started by :meth:`_try` succeeded and did not refuse
        (returned ``False``); a failure is logged, and the move rolls back."""
        ok, result = self._noting(what, future, actor=actor, deadline=deadline)
        return ok and result is not False
