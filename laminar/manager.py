"""The rollout manager: recovers lost rollouts, runs the repack planner and carries out
its moves.

**Recovery** (``faults.recover``, docs/faults.md). Every ``faults.detect_interval_s`` the
manager checks with the scheduler that every rollout's worker is alive. A lost rollout's
unfinished trajectories come back from the partial-response pool (:mod:`laminar.partial`)
and are imported into a healthy rollout decoding a batch of the same weight version; if
none is, the least loaded healthy rollout *adopts* them as a batch of their own at its
next boundary, loading that version from its relay's kept versions or the trainer's
checkpoint. Either way each trajectory keeps one behavior version, its group stays whole,
and at most one flush interval of tokens is regenerated. Each recovery is a row of the
``faults`` table of ``metrics.zarr``.

**Repack** (with a ``repack`` section).

Every ``repack.interval_s`` (the paper: 5 s), and right after each trainer publication,
the manager asks every rollout for its load, plans with :func:`laminar.repack.plan` and
executes each move in three steps:

1. the source exports every unfinished request (tokens, logprobs and versions so far)
   and holds at its batch boundary;
2. the destination imports them into its running batch, which re-prefills them — only
   if it still decodes a batch of the same version (it may have drained meanwhile);
   otherwise the source takes them back;
3. the source is released: it pulls the newest weights and takes new prompts.

No request is ever in two engines or in none: a state leaves the source only into the
destination or back into the source. Each move is a row of the ``repacks`` table of
``metrics.zarr`` (requests and tokens moved, re-prefilled tokens, the pause it caused).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import Counter

from laminar.cluster import actor_result, scheduler_workers, start_thread
from laminar.config import RunConfig
from laminar.repack import RolloutLoad, plan

logger = logging.getLogger(__name__)


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


# The totals a manager's stats() sums over its rows, carried over by take_over().
_CARRIED = (
    "recoveries",
    "recovered_requests",
    "requests_moved",
    "tokens_moved",
    "reprefill_tokens",
    "pause_s",
)


class RolloutManager:
    """Dask actor (on the data worker): the repack loop over every rollout."""

    def __init__(
        self,
        cfg: RunConfig,
        rollouts: dict,
        master_relay,
        partial=None,
        workers: dict | None = None,
        *,
        relays: dict | None = None,
        relay_workers: dict | None = None,
        rollout_relays: dict | None = None,
    ) -> None:
        """``rollouts`` maps each rollout id to its actor handle, ``workers`` to its
        worker's address (for loss detection); ``partial`` is the partial-response pool.
        ``relays`` maps each relay id to its handle in chain order (master first),
        ``relay_workers`` to its worker, ``rollout_relays`` each rollout to the relay it
        pulls from: a lost downstream relay is cut out of the chain (:meth:`drop_relays`)."""
        self.cfg = cfg
        self.rcfg = cfg.repack
        self.rollouts = dict(rollouts)
        self.master = master_relay
        self.max_batch = repack_max_batch(cfg)
        self.timeout = cfg.cluster.actor_timeout_s
        # rid -> (batch, kv_used) at the last check: the falling-KV rule, and the batch a
        # move of that round may import into
        self._prev: dict[str, tuple[int | None, float]] = {}
        self._seen_version = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rows: list[dict] = []  # one per executed (or rolled back) move
        self.counts = {"checks": 0, "moves": 0, "rolled_back": 0, "skipped": 0}
        self.partial = partial
        self.workers = dict(workers or {})
        self.lost: dict[str, float] = {}  # rollout id -> when its loss was detected
        self.fault_rows: list[dict] = []  # one per recovered batch
        self.replacements: dict[str, str] = {}  # lost rollout id -> the one that replaced it
        self._joining: queue.Queue = queue.Queue()  # (id, handle, worker, replaces, relay)
        self.relays = dict(relays or {"master": master_relay})
        self.relay_workers = dict(relay_workers or {})
        self.rollout_relays = dict(rollout_relays or {})
        self.relays_lost: dict[str, dict] = {}  # relay id -> what its loss changed
        self._alive_at: dict[str, float] = {}  # rollout -> when it last showed progress
        self._beat_calls: dict[str, object] = {}  # rollout -> its heartbeat call in flight
        self.hung: dict[str, dict] = {}  # rollout -> when it was declared hung, its fence
        self.masters: list[dict] = []  # master relays that replaced a lost one (restarts)
        self._master_lost: float | None = None  # when the master's worker was found gone
        # Totals of the managers this one took over from (lost with the data module).
        self._carried: Counter = Counter()
        self.error: str | None = None

    def start(self) -> None:
        self._thread = start_thread(self._run, "repack")

    def stop(self, timeout: float = 30.0) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.stats()

    def take_over(self, last: dict, rollouts: dict, workers: dict) -> None:
        """Go on from a manager lost with the data module, from its last ``stats()``: the
        rollouts and relays it had found lost, hung or replaced stay so, the relay each
        rollout pulls from stands, and its totals carry on into this one's. ``rollouts``
        (id -> handle, made by :func:`laminar.cluster.detach`: the scheduler holds their
        creating tasks erred, their data-module arguments being lost) and ``workers``
        are the live rollouts, given here rather than to the constructor for that
        reason (a task with such an argument never runs)."""
        self.rollouts.update(rollouts)
        self.workers.update(workers)
        self.lost.update(last["lost"])
        self.replacements.update(last["replacements"])
        self.relays_lost.update(last["relays_lost"])
        self.hung.update(last["hung"])
        self.masters += last["masters_replaced"]
        self.rollout_relays.update(last["rollout_relays"])
        for k in ("checks", "moves", "rolled_back", "skipped", "global_pauses"):
            if k in last:
                self.counts[k] = self.counts.get(k, 0) + last[k]
        for k in _CARRIED:
            self._carried[k] += last[k]

    def stats(self) -> dict:
        moved = [r for r in self.rows if r["ok"]]
        c = self._carried
        return {
            "lost": dict(self.lost),
            "replacements": dict(self.replacements),
            "relays_lost": {rid: dict(info) for rid, info in self.relays_lost.items()},
            "hung": {rid: dict(info) for rid, info in self.hung.items()},
            "chain": self._chain(),
            "rollout_relays": dict(self.rollout_relays),
            "masters_replaced": [dict(m) for m in self.masters],
            "recoveries": c["recoveries"] + len(self.fault_rows),
            "recovered_requests": c["recovered_requests"]
            + sum(r["requests"] for r in self.fault_rows),
            **self.counts,
            "max_batch": self.max_batch,
            "requests_moved": c["requests_moved"] + sum(r["requests"] for r in moved),
            "tokens_moved": c["tokens_moved"] + sum(r["tokens"] for r in moved),
            "reprefill_tokens": c["reprefill_tokens"] + sum(r["context_tokens"] for r in moved),
            "pause_s": c["pause_s"] + sum(r["pause_s"] for r in self.rows),
            "error": self.error,
        }

    def get_rows(self, start: int = 0) -> list[dict]:
        return self.rows[start:]

    def get_fault_rows(self, start: int = 0) -> list[dict]:
        return self.fault_rows[start:]

    def get_lost(self) -> dict[str, float]:
        return dict(self.lost)

    async def pause_all(self, version: int) -> dict:
        """A global weight update (partial rollout): every live rollout holds its
        unfinished requests until it has loaded ``version`` (:meth:`RolloutReplica.pause`).
        Returns once each has paused; one that does not answer within half of
        ``cluster.actor_timeout_s`` is left to loss detection (the trainer waits for this
        call as long as that whole timeout, counted from before it reached here: a
        rollout slow to answer must not fail the run), and a hung one is not asked."""
        import asyncio

        gone = {*self.lost, *self.hung}
        live = [r for rid, r in list(self.rollouts.items()) if rid not in gone]

        async def one(rollout) -> int | None:
            try:
                return await asyncio.wait_for(rollout.pause(version), self.timeout / 2)
            except Exception:  # noqa: BLE001 — lost or hung: detection handles it
                return None

        held = await asyncio.gather(*(one(r) for r in live))
        self.counts["global_pauses"] = self.counts.get("global_pauses", 0) + 1
        return {
            "paused": sum(h is not None for h in held),
            "requests": sum(h or 0 for h in held),
        }

    def add_rollout(
        self, rollout_id: str, handle, worker: str, replaces: str, relay_id: str = "master"
    ) -> None:
        """A new rollout (started by the driver in place of the lost ``replaces``, pulling
        from ``relay_id``): a candidate for moves and recovery, and watched for loss, from
        the next round."""
        self._joining.put((rollout_id, handle, worker, replaces, relay_id))

    def replace_master(self, handle, worker: str) -> None:
        """The trainer was restarted on ``worker`` with a new master relay (``handle``):
        from the next round it heads the chain (each live relay takes its place after
        it), the rollouts that pulled from the lost master pull from it, and the
        partial-response pool keeps versions on it (docs/faults.md)."""
        self._joining.put(("master", handle, worker, None, None))

    def _master_readers(self) -> list[str]:
        """The live rollouts that pull from the master relay."""
        return [
            roll
            for roll, rel in sorted(self.rollout_relays.items())
            if rel == "master" and roll not in self.lost and roll not in self.hung
        ]

    def _lose_master(self, now: float) -> None:
        """The master relay's worker (the trainer's) is gone: its readers stop waiting
        on it and go on with the weights they hold until a restarted trainer's master
        replaces it (:meth:`replace_master`). Without a restart the driver fails the run."""
        self._master_lost = now
        for roll in self._master_readers():
            try:
                self.rollouts[roll].set_relay(None).result(timeout=min(self.timeout, 5.0))
            except Exception as e:  # noqa: BLE001 — lost too: detect() recovers it
                logger.warning("%s.set_relay(None) failed: %r", roll, e)
        logger.warning(
            "master relay lost (worker %s gone); its readers go on with the weights they hold",
            self.relay_workers.get("master"),
        )

    def _take_master(self, handle, worker: str) -> None:
        t0 = time.time()
        lost_for = None if self._master_lost is None else t0 - self._master_lost
        self._master_lost = None
        self.master = handle
        self.relays["master"], self.relay_workers["master"] = handle, worker
        chain = self._chain()
        errors: list[str] = []
        self._rechain(chain, errors)  # (a relay lost too is cut out by detect())
        repointed = []
        for roll in self._master_readers():
            ok, _ = self._noting(f"{roll}.set_relay", self.rollouts[roll].set_relay(handle), errors)
            if ok:
                repointed.append(roll)
        if self.partial is not None:
            relays = [self.relays[r] for r in chain]
            self._noting(
                "partial.set_relays", self._try(lambda: self.partial.set_relays(relays)), errors
            )
        self._seen_version = -1
        self.masters.append(
            {
                "time": t0,
                "worker": worker,
                "master_lost_s": lost_for,  # since the lost master was detected
                "chain": chain,
                "rollouts": repointed,
                "errors": errors,
                "rechain_s": time.time() - t0,
            }
        )
        logger.warning(
            "new master relay on %s heads the chain %s; %s pull from it",
            worker,
            " -> ".join(chain),
            ", ".join(repointed) or "no rollout",
        )

    def _take_joining(self) -> None:
        while not self._joining.empty():
            rid, handle, worker, replaces, relay_id = self._joining.get_nowait()
            if rid == "master":
                self._take_master(handle, worker)
                continue
            self.rollouts[rid], self.workers[rid] = handle, worker
            # (A call here that fails is logged, not raised out of the loop: a replacement
            # lost already is found by detect(), a slow one may yet take it.)
            if relay_id in self.relays_lost:  # lost while the replacement was starting
                relay_id = self._chain()[0]
                relay = self.relays[relay_id]
                self._noting(
                    f"{rid}.set_relay", self._try(lambda h=handle, r=relay: h.set_relay(r))
                )
            self.rollout_relays[rid] = relay_id
            if relay_id == "master" and self._master_lost is not None:
                # (started with the lost master's handle: the restart's re-points it)
                self._noting(
                    f"{rid}.set_relay(None)", self._try(lambda h=handle: h.set_relay(None))
                )
            self.replacements[replaces] = rid
            logger.warning("rollout %s replaces %s (worker %s)", rid, replaces, worker)

    def _run(self) -> None:
        last = last_detect = time.time()
        detect = self.cfg.faults.recover and self.partial is not None and self.workers
        try:
            while not self._stop.wait(0.05):
                self._take_joining()
                now = time.time()
                if detect and now - last_detect >= self.cfg.faults.detect_interval_s:
                    last_detect = now
                    self.detect()
                if self.rcfg is None:
                    continue
                published = self._published()
                if published or time.time() - last >= self.rcfg.interval_s:
                    last = time.time()
                    self.check()
        except Exception:
            self.error = traceback.format_exc()
            logger.error("rollout manager failed:\n%s", self.error)

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
        loads = planner_loads(self._loads(), self._prev)
        self.counts["checks"] += 1
        moves = plan(loads, c_max=self.rcfg.c_max, max_batch=self.max_batch)
        rows = self._execute(moves, {ld.rollout_id: ld for ld in loads}) if moves else []
        self.rows += rows
        return rows

    def _execute(self, moves: list, loads: dict[str, RolloutLoad]) -> list[dict]:
        """Carry out a round's moves together: every source exports at once, then each
        destination imports all its sources' requests in one call (destinations at
        once), then every source whose move went through is released and every other
        takes its requests back. A command waits for its rollout's next step boundary, so
        one move at a time cost two steps per move; a round now costs about two steps,
        however many moves it has.

        A request is never in no engine: a source holds what it exported until it is
        released or aborted (and takes it back by itself after a hold nobody ends), and
        the manager aborts every export it did not get the answer of, which may yet run.
        ``loads`` (the planner's input) bounds each source's export to its planned batch."""
        t0 = time.time()
        # Each phase's calls run at once: one deadline for all of them. (A command the
        # manager stops waiting for may still run on its rollout, which starts its own
        # clock later: every export not answered is aborted.)
        window = self.timeout
        exports = {
            m.source: self._try(
                lambda s=m.source: self.rollouts[s].export_for_move(
                    batch=self._prev[s][0], max_requests=loads[s].n_requests
                )
            )
            for m in moves
        }
        outs: dict[str, dict] = {}
        ok_of: dict[str, bool] = {}
        aborts: dict[str, object] = {}
        try:
            deadline = time.time() + window
            for src, future in exports.items():
                got, out = self._noting(
                    f"repack: {src} export", future, actor=self.rollouts[src], deadline=deadline
                )
                if not got:  # not answered: it may yet export, so undo it there
                    aborts[src] = self._try(self.rollouts[src].abort_export)
                if out is None:  # (or its batch drained or changed meanwhile)
                    self.counts["skipped"] += 1
                else:
                    outs[src] = out
            t1 = time.time()
            # One import per destination and version (the planner merges one version;
            # a source that loaded another since is refused and takes its states back).
            merged: dict[tuple[str, int], list[str]] = {}
            for m in moves:
                if m.source in outs:
                    merged.setdefault((m.destination, outs[m.source]["version"]), []).append(
                        m.source
                    )
            imports = {
                (dst, v): self._try(
                    lambda d=dst, v=v, s=sources: self.rollouts[d].import_for_move(
                        v,
                        [st for src in s for st in outs[src]["states"]],
                        batch=self._prev[d][0],  # the batch this round planned with
                        sources=len(s),
                        max_requests=self.max_batch,
                        max_kv=self.rcfg.c_max,
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
                    ids = [st.request_id for src in sources for st in outs[src]["states"]]
                    unanswered[dst, v] = self._try(lambda d=dst, i=ids: self.rollouts[d].holds(i))
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
                    aborts[src] = self._try(self.rollouts[src].abort_export)
            released = {
                src: self._try(self.rollouts[src].release) for src in outs if ok_of.get(src)
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
                    "pause_s": t_released - t0,
                    "round_moves": len(outs),
                }
            )
        return rows

    @staticmethod
    def _try(call):
        """Start an actor call; the exception instead of a future if it cannot start."""
        try:
            return call()
        except Exception as e:  # noqa: BLE001 — a known-lost worker: a failed step
            return e

    def _ok(self, future, what: str, *, actor=None, deadline: float | None = None) -> bool:
        """Whether an actor call started by :meth:`_try` succeeded and did not refuse
        (returned ``False``); a failure is logged, and the move rolls back."""
        ok, result = self._noting(what, future, actor=actor, deadline=deadline)
        return ok and result is not False

    # -- faults ---------------------------------------------------------------------------
    def _alive(self) -> list[str]:
        return [rid for rid in self.rollouts if rid not in self.lost]

    def _healthy(self) -> list[str]:
        """The live rollouts not declared hung: a hung one may still answer ``load()``
        (its generation loop is what stopped), but what it is given waits out its fence
        and is then recovered again."""
        return [rid for rid in self._alive() if rid not in self.hung]

    def _loads(self) -> dict[str, dict]:
        """Every healthy rollout's load; one that does not answer within a few seconds is
        skipped this round (a lost one is detected by :meth:`detect`)."""
        futures = {}
        for rid in self._healthy():
            try:
                futures[rid] = self.rollouts[rid].load()
            except Exception:  # noqa: BLE001 — its worker is known lost
                continue
        out = {}
        deadline = time.time() + min(self.timeout, 5.0)
        for rid, f in futures.items():
            while (left := deadline - time.time()) > 0:
                try:
                    out[rid] = f.result(timeout=min(left, self.cfg.faults.detect_interval_s))
                except TimeoutError:
                    # A rollout lost at the same time as the one being recovered never
                    # answers: stop waiting once the scheduler has dropped its worker
                    # (the next detect() round then finds it at once).
                    try:
                        gone = rid in self.workers and (
                            self.workers[rid] not in self._scheduler_workers()
                        )
                    except Exception:  # noqa: BLE001 — unknown: wait for it on
                        gone = False
                    if gone:
                        break
                    continue
                except Exception:  # noqa: BLE001 — failed: not a candidate now
                    pass
                break
        return out

    def _scheduler_workers(self) -> set[str]:
        return set(scheduler_workers())

    def detect(self) -> list[str]:
        """Relays and rollouts whose worker the scheduler no longer has: cut each relay
        out of the chain, then recover each rollout. Returns the lost rollouts."""
        try:
            workers = self._scheduler_workers()
        except Exception as e:  # noqa: BLE001 — says nothing of the rollouts: next round
            logger.warning("loss detection: the scheduler's workers unknown (%r); skipped", e)
            return []
        gone = [rid for rid in self._alive() if self.workers.get(rid) not in workers]
        now = time.time()
        for rid in gone:  # all of them first: none is a candidate for another's work
            self.lost[rid] = now
            logger.warning("rollout %s lost (worker %s gone); recovering", rid, self.workers[rid])
        relays = [r for r in self._chain()[1:] if self.relay_workers.get(r) not in workers]
        master_w = self.relay_workers.get("master")
        if self._master_lost is None and master_w is not None and master_w not in workers:
            self._lose_master(now)
        for rid in (*gone, *relays):
            if rid in self.hung:  # fenced: the scheduler no longer has its process
                self.hung[rid]["fenced_s"] = now - self.hung[rid]["time"]
        # The master lives in the trainer's process: its loss is the trainer's (the run
        # fails and resumes, docs/faults.md). Downstream relays are cut out here, before
        # recovery, which may read old versions from them.
        if relays:
            self.drop_relays(relays)
        for rid in gone:
            self.recover(rid)
        self.check_heartbeats()  # (after: it must not delay the recovery of a lost one)
        return gone

    def _watched(self) -> dict[str, tuple[object, str | None, str]]:
        """Id -> (handle, worker, kind) of every live rollout and downstream relay."""
        out = {rid: (self.rollouts[rid], self.workers.get(rid), "rollout") for rid in self._alive()}
        for rid in self._chain()[1:]:  # (the master's loss is the trainer's)
            out[rid] = (self.relays[rid], self.relay_workers.get(rid), "relay")
        return out

    def check_heartbeats(self) -> list[str]:
        """Rollouts and relays that showed no progress for ``faults.heartbeat_timeout_s``
        are hung: each one's worker is restarted (the nanny stops the process, or kills
        it), in the background. Its actor is then gone, so a later :meth:`detect` round
        handles it like any lost one — a hung rollout is fenced before its trajectories
        resume elsewhere, never generating beside them. A rollout shows progress by its
        generation loop's heartbeat, a relay by answering. Returns the newly hung."""
        limit = self.cfg.faults.heartbeat_timeout_s
        now = time.time()
        watched = {k: v for k, v in self._watched().items() if k not in self.hung}
        for rid, (handle, _, _) in watched.items():
            self._alive_at.setdefault(rid, now)  # (a new one: from when it is watched)
            call = self._beat_calls.get(rid)
            if call is not None and not call.done():
                continue  # one call at a time: a silent one is not asked again
            if call is not None:  # answered since the last round (never waited on here)
                try:
                    age = call.result(timeout=1.0)
                except Exception:  # noqa: BLE001 — its worker is gone: detect() sees to it
                    age = None
                # (None: its generation loop ended — failed or stopped, for the driver
                # to see — not hung.)
                self._alive_at[rid] = max(self._alive_at[rid], now - (age or 0.0))
            try:
                self._beat_calls[rid] = handle.heartbeat()
            except Exception:  # noqa: BLE001 — its worker is gone: detect() sees to it
                self._beat_calls.pop(rid, None)
        hung = [r for r in watched if now - self._alive_at[r] > limit]
        for rid in hung:
            _, worker, kind = watched[rid]
            silent = now - self._alive_at[rid]
            logger.warning(
                "%s %s hung: no progress for %.1f s (faults.heartbeat_timeout_s=%s); "
                "restarting its worker %s",
                kind,
                rid,
                silent,
                limit,
                worker,
            )
            # "restart" stays "pending" until the nanny has a new worker up (that may come
            # after the run ends); the fence proper is the old process's going, which
            # detect() records as "fenced_s".
            self.hung[rid] = {
                "kind": kind,
                "time": now,
                "silent_s": silent,
                "worker": worker,
                "restart": "pending",
            }
            start_thread(lambda rid=rid, w=worker: self._fence(rid, w), f"fence-{rid}")
        return hung

    def _fence(self, rid: str, worker: str) -> None:
        from distributed import get_client

        from laminar.deploy import fence_workers

        t0 = time.time()
        try:
            out = fence_workers(get_client(), [worker], timeout=10)
            self.hung[rid]["restart"] = str(out.get(worker, out))
        except Exception as e:  # noqa: BLE001 — the worker went meanwhile: also fenced
            self.hung[rid]["restart"] = repr(e)
        self.hung[rid]["restart_s"] = time.time() - t0

    def _chain(self) -> list[str]:
        return [rid for rid in self.relays if rid not in self.relays_lost]

    def _noting(
        self,
        what: str,
        future,
        errors: list[str] | None = None,
        *,
        actor=None,
        deadline: float | None = None,
    ) -> tuple[bool, object]:
        """``(True, result)`` of ``future`` (or of an exception :meth:`_try` returned in
        its place), or ``(False, None)``, the failure logged and recorded in ``errors``.
        A call made while rebuilding the chain may fail when more than one relay was lost
        (a whole host): what it left undone falls to the next round. The wait ends at
        ``deadline`` (else after the actor timeout) and, given the call's ``actor``, about
        a second after its worker is lost."""
        timeout = self.timeout if deadline is None else max(deadline - time.time(), 0.1)
        try:
            if isinstance(future, Exception):
                raise future
            if actor is not None:
                return True, actor_result(actor, future, timeout)
            return True, future.result(timeout=timeout)
        except Exception as e:  # noqa: BLE001
            if errors is not None:
                errors.append(f"{what}: {e!r}")
            logger.warning("%s failed: %r", what, e)
            return False, None

    def _rechain(self, chain: list[str], errors: list[str]) -> dict[str, int]:
        """Give every relay of ``chain`` (master first) its place in it
        (:meth:`~laminar.relay.Relay.rechain`). Returns relay -> the version it resent to
        its new successor."""
        resent = {}
        for i, rid in enumerate(chain):
            nxt = self.relays[chain[i + 1]] if i + 1 < len(chain) else None
            master = None if i == 0 else self.relays[chain[0]]
            _, version = self._noting(
                f"{rid}.rechain", self.relays[rid].rechain(chain, nxt, master), errors
            )
            if version is not None:
                resent[rid] = version
        return resent

    def drop_relays(self, gone: list[str]) -> dict[str, dict]:
        """Rebuild the chain without the ``gone`` relays: every live relay takes its new
        place (the one above a lost relay sends its newest complete version to its new
        successor at once), each rollout that pulled from a lost relay pulls from the
        nearest live relay above it (which held every chunk the lost one had), and the
        partial-response pool keeps versions on the live relays only."""
        t0 = time.time()
        old = self._chain()
        chain = [r for r in old if r not in gone]
        for rid in gone:  # recorded first: out of the chain even if a call below fails
            self.relays_lost[rid] = {
                "time": t0,
                "worker": self.relay_workers.get(rid, ""),
                "chain": chain,
                "rollouts": {},
                "resent": {},
                "errors": [],
            }
            logger.warning(
                "relay %s lost (worker %s gone); chain rebuilt: %s",
                rid,
                self.relay_workers.get(rid),
                " -> ".join(chain),
            )
        errors: list[str] = []
        resent = self._rechain(chain, errors)
        repointed: dict[str, dict[str, str]] = {rid: {} for rid in gone}
        for roll, rel in sorted(self.rollout_relays.items()):
            if rel not in gone or roll in self.lost or roll in self.hung:
                continue
            above = next(r for r in reversed(old[: old.index(rel)]) if r not in gone)
            self.rollout_relays[roll] = above
            self._noting(
                f"{roll}.set_relay", self.rollouts[roll].set_relay(self.relays[above]), errors
            )
            repointed[rel][roll] = above
        if self.partial is not None:
            self._noting(
                "partial.set_relays",
                self.partial.set_relays([self.relays[r] for r in chain]),
                errors,
            )
        t1 = time.time()
        for rid in gone:
            self.relays_lost[rid].update(
                rollouts=repointed[rid], resent=resent, errors=errors, rechain_s=t1 - t0
            )
            logger.warning(
                "relay %s: %s; rebuilt in %.3f s",
                rid,
                ", ".join(f"{r} now pulls from {up}" for r, up in repointed[rid].items())
                or "no rollout pulled from it",
                t1 - t0,
            )
        return {rid: self.relays_lost[rid] for rid in gone}

    def _least_loaded(self, alive: list[str], loads: dict[str, dict]) -> str:
        return min(
            (rid for rid in alive if rid in loads),
            key=lambda rid: (loads[rid] or {}).get("n_requests", 0),
            default=alive[0],
        )

    def _resume(
        self, version: int, batch: list, alive: list[str], loads: dict[str, dict]
    ) -> tuple[str, str]:
        """Import ``batch`` into a running batch of ``version`` (the least KV-loaded that
        accepts it), else have the least loaded rollout adopt it. Returns (how, where)."""
        same = sorted(
            (
                rid
                for rid, ld in loads.items()
                if ld and ld["in_batch"] and not ld["held"] and ld["version"] == version
            ),
            key=lambda rid: loads[rid]["kv_used"],
        )
        for rid in same:
            roll = self.rollouts[rid]
            try:
                ok = actor_result(roll, roll.import_for_move(version, batch), self.timeout)
            except Exception:  # noqa: BLE001 — no answer: it may yet have gone in
                ids = [st.request_id for st in batch]
                try:  # (asked after the import, which it runs first)
                    ok = actor_result(roll, roll.holds(ids), self.timeout)
                except Exception:  # noqa: BLE001 — try the next one
                    ok = False
            if ok:
                return "import", rid
        dest = self._least_loaded(alive, loads)
        # Not answered (its worker lost meanwhile, or its actor thread busy: it may yet
        # run): the batch stays this rollout's all the same. Trying another could adopt
        # it twice; the pool names this one the owner, so its loss recovers it from it.
        roll = self.rollouts[dest]
        self._noting(f"{dest}.adopt", self._try(lambda: roll.adopt(version, batch)), actor=roll)
        return "adopt", dest

    def _take(self, lost: str, attempts: int = 3) -> list:
        """The pool's entries of ``lost``. A take not answered in time may have run (its
        entries then ownerless): asked again, the pool hands those out too."""
        for attempt in range(attempts):
            try:
                future = self.partial.take(lost, again=attempt > 0)
                return actor_result(self.partial, future, self.timeout)
            except TimeoutError:
                if attempt == attempts - 1:
                    raise
                logger.warning("the partial-response pool did not answer take(%s); again", lost)
        raise AssertionError("unreachable")

    def recover(self, lost: str) -> list[dict]:
        """Resume ``lost``'s unfinished trajectories on healthy rollouts, one batch per
        weight version: imported into a running batch of that version, else adopted.
        Its finished ones (rewards in flight when it died) are scored again elsewhere."""
        t0 = time.time()
        states = self._take(lost)
        by_version: dict[tuple[bool, int], list] = {}
        for st in states:
            key = ("finished" in st.request.meta, st.request.meta["resume_version"])
            by_version.setdefault(key, []).append(st)
        rows = []
        # The loads once for every batch of the lost rollout: a rollout lost too but not
        # detected yet (the scheduler may drop two workers a round apart) does not answer,
        # and each asking would wait for it again. One that did not answer takes none of
        # this work.
        loads = self._loads() if states else {}
        for (finished, version), batch in sorted(by_version.items()):
            alive = self._alive()
            if not alive:
                raise RuntimeError(
                    f"every rollout is lost ({sorted(self.lost)}); {len(states)} unfinished "
                    "trajectories wait in the partial-response pool"
                )
            alive = [rid for rid in alive if rid in loads] or self._healthy() or alive
            if finished:
                how, dest = "rescore", self._least_loaded(alive, loads)
                # (not answered: as an adoption, see _resume)
                roll = self.rollouts[dest]
                self._noting(
                    f"{dest}.rescore", self._try(lambda r=roll, b=batch: r.rescore(b)), actor=roll
                )
            else:
                how, dest = self._resume(version, batch, alive, loads)
            ids = [st.request_id for st in batch]
            # A pool slow to answer names the owner later, or the destination's next flush
            # does: no reason to fail the run (an exception here ended the manager's loop).
            self._noting(
                f"partial.reassign to {dest}",
                self._try(lambda i=ids, d=dest: self.partial.reassign(i, d)),
            )
            if loads.get(dest):  # the next batch goes where there is less to do
                loads[dest] = {**loads[dest], "n_requests": loads[dest]["n_requests"] + len(ids)}
            rows.append(
                {
                    "time": t0,
                    "rollout": lost,
                    "destination": dest,
                    "how": how,
                    "version": version,
                    "requests": len(batch),
                    "tokens_recovered": sum(len(st.tokens) for st in batch),
                    "max_since_flush_s": max(t0 - st.request.meta["t_flush"] for st in batch),
                    "recovery_s": time.time() - t0,
                }
            )
            logger.warning(
                "rollout %s: %d %s trajectories of version %d resumed on %s (%s)",
                lost,
                len(batch),
                "finished" if finished else "unfinished",
                version,
                dest,
                how,
            )
        if not states:
            rows.append(
                {
                    "time": t0,
                    "rollout": lost,
                    "destination": "",
                    "how": "none",
                    "version": -1,
                    "requests": 0,
                    "tokens_recovered": 0,
                    "max_since_flush_s": 0.0,
                    "recovery_s": time.time() - t0,
                }
            )
        self.fault_rows += rows
        return rows
