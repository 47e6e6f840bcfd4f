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

from laminar.cluster import LOST_POLL_S, actor_result
from laminar.config import RunConfig
from laminar.repack import (
    EXPORT_WAIT_TIMEOUTS,
    HOLD_LIMIT_TIMEOUTS,
    IMPORT_WAIT_TIMEOUTS,
    QUESTION_WAIT_TIMEOUTS,
    RolloutLoad,
    plan,
)

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


def _ready(future) -> bool:
    """Whether a call started by ``_try`` has its answer (or failed to start)."""
    return isinstance(future, Exception) or future.done()


class _Round:
    """A round's moves in flight, as :meth:`RepackMixin._execute` and
    :meth:`RepackMixin._advance` share them."""

    def __init__(self, t0: float, token: dict[str, str]) -> None:
        self.t0, self.token = t0, token  # (source -> its export's token)
        self.outs: dict[str, dict] = {}  # source -> its export's answer
        self.handed: dict[str, float] = {}  # source -> when its export was handed over
        self.groups: dict[tuple[str, int], list[str]] = {}  # (destination, version) -> sources
        self.into: dict[tuple[str, int], str] = {}  # -> its import's token
        self.started: dict[tuple[str, int], float] = {}  # -> when its import was sent
        # -> ("import" or "question", the call, when it was sent, its wait in timeouts)
        self.waiting: dict[tuple[str, int], tuple] = {}
        self.import_s: dict[tuple[str, int], float] = {}  # -> its import's call to answer
        self.ok_of: dict[str, bool] = {}  # source -> whether its move went through
        # source -> ("release" or "abort", the call (None: to send again), when sent)
        self.acks: dict[str, tuple] = {}
        self.due: dict[str, float] = {}  # source -> when to send its release again
        self.released: dict[str, float] = {}  # source -> when its release or abort ended
        self.gone: set[str] = set()  # its rollouts whose worker is gone, as of gone_at
        self.gone_at = 0.0

    def send(self, src: str, kind: str, future, now: float) -> None:
        self.acks[src] = (kind, future, now)

    def done(self, src: str, now: float) -> None:
        self.acks.pop(src, None)
        self.released[src] = now


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
        once), and each destination's sources are released (or take their requests
        back) as soon as that destination's import is answered, whatever the others'
        do. A command waits for its rollout's next step boundary, so one move at a time
        cost two steps per move; a round costs about two steps, however many moves it
        has, and a slow or hung destination holds its own sources alone.

        It returns only once every move is decided and its release or abort acknowledged
        (or given up): a hung destination keeps the manager's thread here for about four
        actor timeouts (export, import, the question about it), and loss detection waits
        meanwhile. Until the round's end the partial-response pool names each moved
        request's source its owner: a loss of the source recovered in between would
        resume them elsewhere while its destination decoded them too.

        A request is never in no engine: a source holds what it exported until it is
        released or aborted (and takes it back by itself after a hold nobody ends), and
        the manager aborts every export it did not get the answer of, which may yet run.
        A release not acknowledged is sent again (it is idempotent, tied to its move's
        token) until it is, or until the source's hold would run out. ``loads`` (the
        planner's input) and ``taken_in`` (each rollout's published ``taken_in`` then)
        bound each source's export to its planned batch, grown by nothing since.

        Every export and import carries a token of its own: a release or abort acts on
        the export of its token only (one delivered late leaves a later move alone), and
        the question to a destination whose import was not answered is whether the
        import of its token went through.

        Each move's row times its source's hold from the export's hand-over (a paced
        source withholds it until its step's deadline, decoding until then) to its own
        release (``pause_s``), its destination's import from its call to its answer (or
        to the answer of the question about it: ``import_s``), and the round from its
        start (``round_s``). An export not answered is counted in
        ``exports_unanswered``, one answered with nothing to move (its batch drained or
        changed) in ``skipped``."""
        t0 = time.time()
        window = self.timeout
        taken_in = taken_in or {}
        round_id = uuid.uuid4().hex[:12]
        token = {m.source: f"{round_id}:{m.source}" for m in moves}
        # Each phase's calls run at once: one deadline for all of them. (A command the
        # manager stops waiting for may still run on its rollout, which starts its own
        # clock later: every export not answered is aborted.)
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
        rnd = _Round(t0, token)
        try:
            self._wait_ready(exports, t0 + EXPORT_WAIT_TIMEOUTS * window)
            for src, future in exports.items():
                if _ready(future):
                    got, out = self._answer(f"repack: {src} export", future)
                else:
                    logger.warning("repack: %s export not answered in time", src)
                    got, out = False, None
                if not got:  # not answered: it may yet export, so undo it there
                    rnd.send(src, "abort", self._try(self._call("abort", src, rnd)), time.time())
                    self.counts["exports_unanswered"] += 1
                elif out is None:  # its batch drained or changed meanwhile: nothing moves
                    self.counts["skipped"] += 1
                else:
                    rnd.outs[src] = out
                    # A paced source decodes until its step's deadline and hands its
                    # requests over then: their pause starts there, not at t0. (The
                    # rollout's clock: kept between t0 and the answer here.)
                    now = time.time()
                    rnd.handed[src] = min(max(out.get("handed_at", now), t0), now)
            # One import per destination and version (the planner merges one version;
            # a source that loaded another since is refused and takes its states back).
            for m in moves:
                if m.source in rnd.outs:
                    key = (m.destination, rnd.outs[m.source]["version"])
                    rnd.groups.setdefault(key, []).append(m.source)
            for (dst, v), sources in rnd.groups.items():
                rnd.into[dst, v] = f"{round_id}:{dst}:{v}"  # (each import's token)
                future = self._try(
                    lambda d=dst, v=v, s=sources: self.rollouts[d].import_for_move(
                        v,
                        [st for src in s for st in rnd.outs[src]["states"]],
                        batch=self._prev[d][0],  # the batch this round planned with
                        sources=len(s),
                        max_requests=self.max_batch,
                        max_kv=self.rcfg.c_max,
                        move=rnd.into[d, v],
                    )
                )
                rnd.started[dst, v] = time.time()
                rnd.waiting[dst, v] = ("import", future, rnd.started[dst, v], IMPORT_WAIT_TIMEOUTS)
            # The round returns once every move is decided and its release or abort
            # acknowledged (or given up): the partial-response pool names the moved
            # requests' new owner at its end, so a loss detected in between would recover
            # them from their source, and they would decode twice (docs/repack.md).
            self._advance(rnd)
        finally:
            # (an error above: no source is left holding what nobody will import)
            for src in rnd.outs:
                if src not in rnd.ok_of and src not in rnd.acks:
                    rnd.ok_of[src] = False
                    rnd.send(src, "abort", self._try(self._call("abort", src, rnd)), time.time())
            self._advance(rnd, acks_only=True)
        return self._finish(moves, rnd)

    def _finish(self, moves: list, rnd: _Round) -> list[dict]:
        """The partial-response pool told of the committed moves' new owners, and each
        move's row."""
        window = self.timeout
        t0 = rnd.t0
        if self.partial is not None:  # after the releases: a slow pool holds no source
            reassigned = {}
            for m in moves:
                if rnd.ok_of.get(m.source):
                    ids = [st.request_id for st in rnd.outs[m.source]["states"]]
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
            if m.source not in rnd.outs:
                continue
            out, ok = rnd.outs[m.source], rnd.ok_of.get(m.source, False)
            self.counts["moves" if ok else "rolled_back"] += 1
            for rid in (m.source, m.destination):
                self._prev.pop(rid, None)  # their KV just jumped: not "falling" next time
            key = (m.destination, out["version"])
            released = rnd.released.get(m.source, time.time())
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
                    # its destination's import, from its call to its (or the question's)
                    # answer: the import of every source of this destination
                    "import_s": rnd.import_s.get(key, 0.0),
                    # the source's hold: from its hand-over to its own release
                    "pause_s": released - rnd.handed[m.source],
                    "t_handed": rnd.handed[m.source],
                    "t_released": released,
                    "round_s": released - t0,  # the round, its exports' waits included
                    "round_moves": len(rnd.outs),
                }
            )
        return rows

    def _wait_ready(self, calls: dict, deadline: float) -> None:
        """Until every call of ``calls`` (rollout id -> its call) has its answer, or
        ``deadline``, or those left are to rollouts whose worker is gone. (One wait for
        them all: a wait per call took at least 0.1 s each past the deadline.)"""
        checked = time.time()
        while (left := [r for r, f in calls.items() if not _ready(f)]) and time.time() < deadline:
            if time.time() - checked >= LOST_POLL_S:
                checked = time.time()
                if set(left) <= self._gone(left):
                    return
            time.sleep(0.01)

    def _advance(self, rnd: _Round, acks_only: bool = False) -> None:
        """Wait on a round's imports, the questions about those not answered, and its
        releases and aborts, acting on each answer as it comes: a destination's sources
        are released (or abort) at its own import's answer, not after every other's.
        One thread polls them all, so no call waits behind another's deadline. Returns
        when nothing is left open (each wait is bounded: at most about
        ``HOLD_LIMIT_TIMEOUTS`` timeouts from the round's start)."""
        window = self.timeout
        while (rnd.waiting and not acks_only) or rnd.acks:
            now = time.time()
            if now - rnd.gone_at >= LOST_POLL_S:  # (a lost rollout answers nothing)
                rnd.gone_at = now
                rnd.gone = self._gone({*(dst for dst, _ in rnd.waiting), *rnd.acks})
            for key, (phase, future, start, waits) in list(rnd.waiting.items()):
                if acks_only:
                    break
                dst = key[0]
                if dst in rnd.gone and not _ready(future):
                    # (what it took, if anything, went with it: the source takes them back)
                    logger.warning("repack %s -> %s: %s lost", rnd.groups[key], dst, dst)
                    self._decide(rnd, key, False, now)
                elif _ready(future):
                    got, answer = self._answer(f"repack: {dst} {phase}", future)
                    if phase == "import" and not got:  # (failed: it may still have run)
                        self._ask(rnd, key, now)
                    elif phase == "import":
                        self._decide(rnd, key, answer is not False, now)
                    else:
                        self._decide(rnd, key, bool(got and answer), now)
                elif now - start >= waits * window:
                    logger.warning(
                        "repack %s -> %s: %s not answered within %.1f s",
                        rnd.groups[key],
                        dst,
                        phase,
                        waits * window,
                    )
                    if phase == "import":  # it may yet be imported: ask (served after it)
                        self._ask(rnd, key, now)
                    else:
                        # (no answer either: the source takes them back, and if the
                        # destination took them too they decode twice, the buffer keeping
                        # the first to finish)
                        self._decide(rnd, key, False, now)
            for src, (kind, future, sent) in list(rnd.acks.items()):
                if src in rnd.gone and not (future is not None and _ready(future)):
                    rnd.done(src, now)  # (lost: its requests are recovery's)
                elif future is None:  # a release or abort to send again
                    if now >= rnd.due[src]:
                        rnd.send(src, kind, self._try(self._call(kind, src, rnd)), now)
                elif _ready(future):
                    got, _ = self._answer(f"repack: {src} {kind}", future)
                    if got or not self._may_retry(rnd, src, kind, now):
                        rnd.done(src, now)
                    else:  # (failed at once: again a little later, not in a tight loop)
                        rnd.acks[src] = (kind, None, now)
                        rnd.due[src] = now + min(window / 10, 1.0)
                elif now - sent >= window:
                    logger.warning("repack: %s %s not answered within %.1f s", src, kind, window)
                    # Not answered by the end of the hold: the source was lost or stopped
                    # meanwhile (a lost one's requests are in the partial-response log,
                    # and recovery resumes them), or it is stuck and takes them back
                    # itself when its hold runs out.
                    if not self._may_retry(rnd, src, kind, now):
                        rnd.done(src, now)
                    else:
                        rnd.send(src, kind, self._try(self._call(kind, src, rnd)), now)
            if (rnd.waiting and not acks_only) or rnd.acks:
                time.sleep(0.01)

    def _answer(self, what: str, future) -> tuple[bool, object]:
        """:meth:`_noting` of a call whose answer is in (``_ready``). Read with the
        actor timeout, not what is left of the round's: the client's loop hands the
        answer over, and on a loaded host it took over 0.1 s, so an export, import or
        release that had answered was taken for failed (an export undone, a release sent
        again: three times in a 9-minute bench)."""
        return self._noting(what, future, deadline=time.time() + self.timeout)

    def _ask(self, rnd: _Round, key: tuple[str, int], now: float) -> None:
        """Ask a destination whether the import it did not answer went through. The
        question waits behind the import (and behind a pool call the destination's
        generation thread may be in): twice the timeout. The source holds its requests
        longer than the whole move may take (HOLD_LIMIT_TIMEOUTS)."""
        dst = key[0]
        future = self._try(lambda d=dst: self.rollouts[d].holds(rnd.into[key]))
        rnd.waiting[key] = ("question", future, now, QUESTION_WAIT_TIMEOUTS)

    def _decide(self, rnd: _Round, key: tuple[str, int], ok: bool, now: float) -> None:
        """A destination's import went through (``ok``) or not: release its sources, or
        have them take their requests back, at once."""
        del rnd.waiting[key]
        rnd.import_s[key] = now - rnd.started.get(key, now)
        for src in rnd.groups[key]:
            rnd.ok_of[src] = ok
            if ok:
                rnd.send(src, "release", self._try(self._call("release", src, rnd)), now)
            else:
                rnd.send(src, "abort", self._try(self._call("abort", src, rnd)), now)

    def _call(self, kind: str, src: str, rnd: _Round):
        """The release or abort of ``src``'s export in ``rnd``, to start."""
        if kind == "release":
            return lambda: self.rollouts[src].release(move=rnd.token[src])
        return lambda: self.rollouts[src].abort_export(move=rnd.token[src])

    def _may_retry(self, rnd: _Round, src: str, kind: str, now: float) -> bool:
        """Whether to send a release or abort not acknowledged again: yes unless the
        source's hold has run out (it then takes its requests back by itself: it was
        first served no earlier than the round's start) or its worker is gone. Both are
        idempotent and act on their own move's export only: one that arrives twice, or
        after the hold ran out, does nothing more. (A release not sent again left the
        source held for the whole hold, after which it took its requests back while the
        destination decoded them too; an abort, a source idle as long.)"""
        if now >= rnd.t0 + HOLD_LIMIT_TIMEOUTS * self.timeout or src in self._gone({src}):
            logger.warning(
                "repack: %s's %s not acknowledged; given up%s",
                src,
                kind,
                " (if it takes its requests back, they decode twice and the buffer keeps "
                "the first copy)"
                if kind == "release"
                else "",
            )
            return False
        logger.warning("repack: %s's %s not acknowledged; sending it again", src, kind)
        return True

    def _gone(self, rids) -> set[str]:
        """Those of ``rids`` whose worker the scheduler no longer has (none if it does
        not answer): a call to them is not waited for any more."""
        rids = {r for r in rids if r in self.workers}
        if not rids:
            return set()
        try:
            alive = self._scheduler_workers()
        except Exception:  # noqa: BLE001 — unknown: wait on
            return set()
        return {r for r in rids if self.workers[r] not in alive}
