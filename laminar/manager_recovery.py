"""Recovery, the manager's side: lost and hung rollouts and relays.

:class:`RecoveryMixin` of :class:`laminar.manager.RolloutManager` (docs/faults.md): loss
detection against the scheduler's workers (:meth:`~RecoveryMixin.detect`), hang detection
by heartbeats and the fence of a hung worker (:meth:`~RecoveryMixin.check_heartbeats`),
the relay chain rebuilt without a lost downstream relay (:meth:`~RecoveryMixin.drop_relays`)
or headed by a restarted trainer's new master, replacement rollouts joining, and a lost
rollout's unfinished trajectories resumed from the partial-response pool on healthy
rollouts, imported or adopted (:meth:`~RecoveryMixin.recover`).

Apart from repack (:mod:`laminar.manager_repack`): recovery answers faults, repack answers
load; they share only the manager's call helpers and its view of the live rollouts.
"""

from __future__ import annotations

import logging
import time
import uuid

from laminar.cluster import actor_result, start_thread

# (the actor's logger: its records read as the manager's, whichever module they come from)
logger = logging.getLogger("laminar.manager")


# A rollout or relay is asked whether it progresses this many times per
# faults.heartbeat_timeout_s, and at least this often (seconds).
HEARTBEATS_PER_TIMEOUT = 10
HEARTBEAT_MAX_INTERVAL_S = 5.0

# A hung actor's worker is restarted (the nanny waits a few seconds, then kills it); how
# long the scheduler may take to drop it before the fence is taken to have failed: the
# default of faults.fence_wait_s, which is what the manager and the driver use.
FENCE_WAIT_S = 60.0


def heartbeat_interval(faults) -> float:
    """How often the manager asks each rollout and relay for its heartbeat: a tenth of
    ``faults.heartbeat_timeout_s``, at most :data:`HEARTBEAT_MAX_INTERVAL_S`, and no
    more often than its detection rounds (``faults.detect_interval_s``), which call it.

    >>> from laminar.config_sections import FaultsConfig
    >>> heartbeat_interval(FaultsConfig()), heartbeat_interval(FaultsConfig(heartbeat_timeout_s=3))
    (5.0, 0.3)
    """
    return min(faults.heartbeat_timeout_s / HEARTBEATS_PER_TIMEOUT, HEARTBEAT_MAX_INTERVAL_S)


class RecoveryMixin:
    """Loss and hang detection and recovery, replacements and relay chain rebuilds, for
    :class:`~laminar.manager.RolloutManager` (whose ``__init__`` sets up the state)."""

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
                self.rollouts[roll].set_relay(None).result(timeout=self.quick_s)
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
        repointed = self._set_relays({roll: handle for roll in self._master_readers()}, errors)
        self._set_pool_relays(chain, errors)
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

    def _set_relays(self, relays: dict, errors: list[str] | None = None) -> list[str]:
        """Point each rollout of ``relays`` (id -> the relay handle it pulls from, or
        ``None``) at its relay, all at once; returns those that took it. One that does
        not answer within a few seconds (lost and not yet detected, or stalled) is left
        to detection: waiting the actor timeout on each kept this thread, and with it
        every heartbeat, blind for that long (check_heartbeats then took the blind time
        for every rollout's silence)."""
        deadline = time.time() + self.quick_s
        calls = {
            rid: self._try(lambda h=self.rollouts[rid], r=relay: h.set_relay(r))
            for rid, relay in relays.items()
        }
        return [
            rid
            for rid, call in calls.items()
            if self._noting(
                f"{rid}.set_relay", call, errors, actor=self.rollouts[rid], deadline=deadline
            )[0]
        ]

    def _set_pool_relays(self, chain: list[str], errors: list[str]) -> None:
        """Tell the partial-response pool the relays of ``chain`` (which retain its
        entries' versions), within :attr:`quick_s`: one not answered is left to detection."""
        if self.partial is None:
            return
        relays = [self.relays[r] for r in chain]
        self._noting(
            "partial.set_relays",
            self._try(lambda: self.partial.set_relays(relays)),
            errors,
            actor=self.partial,
            deadline=time.time() + self.quick_s,
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
                self._set_relays({rid: self.relays[relay_id]})
            self.rollout_relays[rid] = relay_id
            if relay_id == "master" and self._master_lost is not None:
                # (started with the lost master's handle: the restart's re-points it)
                self._set_relays({rid: None})
            elif relay_id == "master" and self.masters:
                # A trainer restart hands its new master to this manager before the
                # driver's tier has it: a replacement started in between got the lost
                # master's handle, and pulled from it for the rest of the run.
                self._set_relays({rid: self.relays["master"]})
            self.replacements[replaces] = rid
            logger.warning("rollout %s replaces %s (worker %s)", rid, replaces, worker)

    def detect(self) -> list[str]:
        """Relays and rollouts whose worker the scheduler no longer has, or whose fence
        failed (:meth:`_overdue`): cut each relay out of the chain, then recover
        each rollout — or, with ``faults.recover`` off, fail the run naming them
        (:meth:`_fail_unrecovered`). Returns the lost rollouts."""
        try:
            workers = self._scheduler_workers()
        except Exception as e:  # noqa: BLE001 — says nothing of the rollouts: next round
            logger.warning("loss detection: the scheduler's workers unknown (%r); skipped", e)
            return []
        gone = [rid for rid in self._alive() if self.workers.get(rid) not in workers]
        now = time.time()
        recover = self.cfg.faults.recover
        for rid in gone:  # all of them first: none is a candidate for another's work
            self.lost[rid] = now
            logger.warning(
                "rollout %s lost (worker %s gone); %s",
                rid,
                self.workers[rid],
                "recovering" if recover else "not recovered: faults.recover is off",
            )
        relays = [r for r in self._chain()[1:] if self.relay_workers.get(r) not in workers]
        master_w = self.relay_workers.get("master")
        if self._master_lost is None and master_w is not None and master_w not in workers:
            self._lose_master(now)
        for rid in (*gone, *relays):
            if rid in self.hung:  # fenced: the scheduler no longer has its process
                self.hung[rid]["fenced_s"] = now - self.hung[rid]["time"]
        self._late_fences(workers, now)
        # Those whose fence failed are given up as lost, the relays cut out too.
        stuck_relays = [r for r in self._chain()[1:] if r not in relays and self._overdue(r, now)]
        stuck = [rid for rid in self._alive() if self._overdue(rid, now)]
        self._unfence([*stuck_relays, *stuck], now)
        # The master lives in the trainer's process: its loss is the trainer's (the run
        # fails and resumes, docs/faults.md). Downstream relays are cut out here, before
        # recovery, which may read old versions from them.
        if relays or stuck_relays:
            self.drop_relays([*relays, *stuck_relays])
        elif getattr(self, "_chain_dirty", False) and self._master_lost is None:
            self._rechain_again()
        gone += stuck
        if not recover and gone:
            self._fail_unrecovered(gone, now)
            return gone
        for rid in gone:
            self.recover(rid)
        if self.lost and self.partial is not None:
            self._retake_late()
        self.check_heartbeats()  # (after: it must not delay the recovery of a lost one)
        return gone

    def _retake_late(self) -> None:
        """Recover again what lost rollouts registered after their recovery took their
        entries: a process given up while it lived (a failed fence; a worker the
        scheduler dropped without ending it) that woke and took groups from the prompt
        pool before it saw its stop. The pool kept those requests, owned by it, and
        ignores its flushes (:meth:`laminar.partial.PartialCore.fence`); nothing else
        would finish them, and their groups would hold the back-pressure budget for
        good. One call a round while any rollout is lost; not answered: next round.

        Also, once, the rollouts a manager lost with the data module had found lost
        (:meth:`take_over`): a data module's rebuild restores their entries from the lost
        pool's log (its recovery of them cut short: taken and given to no rollout, or
        not yet logged), and nothing else finds them lost again."""
        try:
            late = actor_result(self.partial, self.partial.late(), self.quick_s)
        except Exception as e:  # noqa: BLE001 — the pool slow or lost: next round
            logger.warning("the partial-response pool did not answer late(): %r", e)
            return
        for rid in late:
            if rid in self.lost:  # (always: the pool fences only what is taken as lost)
                logger.warning("rollout %s, given up, registered requests since: resumed", rid)
                self.recover(rid, again=True)
        for rid in sorted(self._lost_before):  # (one not done: next round)
            if rid not in late:
                self.recover(rid, again=True)
            self._lost_before.discard(rid)

    def _overdue(self, rid: str, now: float) -> bool:
        """Whether ``rid`` (a rollout or relay) was declared hung more than
        ``faults.fence_wait_s`` ago and its worker is still the scheduler's: its restart
        failed (a process that does not die, a nanny that does not answer)."""
        hung = self.hung.get(rid)
        wait = self.cfg.faults.fence_wait_s
        return hung is not None and not hung.get("unfenced") and now - hung["time"] > wait

    def _unfence(self, ids: list[str], now: float) -> None:
        """Give up the hung rollouts and relays ``ids``, whose fence failed
        (:meth:`_overdue`): each is taken as lost now (``unfenced`` in its hang's
        record), a rollout in :attr:`lost` — so that the driver neither polls nor stops it
        (its stop would wait out the actor timeout), and its work resumes elsewhere from
        the partial-response pool, or with ``faults.recover`` off the run fails naming it
        — and a relay is cut out of the chain. Left hung, a rollout's groups held the
        back-pressure budget for the rest of the run and nothing of its work resumed.

        Resuming its work while its process lives is safe: should it wake, the
        trajectories it sends again have the uids of those resumed, and the buffer
        admits a uid once (the later copy is counted a duplicate), as it does for a
        rollout whose flush was recovered twice. Nor can it take its entries back: the
        recovery's take fences it in the partial-response pool, which then ignores its
        flushes and keeps what it registers later for :meth:`_retake_late`; the driver
        fences it in the prompt pool at its next poll (every ask of it then fails, and
        its generation loop ends). It is also told to stop (not waited for: a process
        that wakes stops its generation loop instead of taking new prompts), and its
        worker is left alone — no replacement is placed on it
        (:meth:`pipelines.driver.Schedule._replace_lost`) — until the scheduler drops
        it (:meth:`_late_fences`): that process is the user's to stop."""
        for rid in ids:
            hung = self.hung[rid]
            hung["unfenced"] = True
            then = "cut out of the chain"
            if hung["kind"] == "rollout":
                self.lost[rid] = now
                roll = self.rollouts.get(rid)
                self._try(lambda r=roll: r.stop(timeout=0.0))  # (never waited for)
                recover = self.cfg.faults.recover
                then = "its work resumes elsewhere" if recover else "faults.recover is off"
            logger.warning(
                "%s %s hung and its worker %s did not go within %g s of its restart (%s): "
                "taken as lost (%s); stop that worker's process yourself (no rollout is "
                "placed on it while the scheduler has it)",
                hung["kind"],
                rid,
                hung.get("worker"),
                self.cfg.faults.fence_wait_s,
                hung.get("restart"),
                then,
            )

    def _late_fences(self, workers: set[str], now: float) -> None:
        """A given-up rollout's or relay's worker the scheduler has dropped since
        (stopped by hand, or a late end of its restart): ``gone_s`` in its hang's record,
        seconds after it was declared hung; from then on a replacement may use its
        address (a new process)."""
        for rid, hung in self.hung.items():
            if hung.get("unfenced") and "gone_s" not in hung and hung.get("worker") not in workers:
                hung["gone_s"] = now - hung["time"]
                logger.warning(
                    "%s %s's worker %s, given up as unfenced, has gone (%.0f s after its hang)",
                    hung["kind"],
                    rid,
                    hung.get("worker"),
                    hung["gone_s"],
                )

    def _fail_unrecovered(self, gone: list[str], now: float) -> None:
        """With ``faults.recover`` off, lost rollouts are not recovered, and the run must
        not go on quietly with fewer (their groups holding the back-pressure budget for
        ever): each is a row of the ``faults`` table (``how`` ``unrecovered``, nothing
        resumed), so that the audit and the report count it, and the manager fails with
        an error that names them (the driver fails the run on it, in order)."""
        self.fault_rows += [
            {
                "time": now,
                "rollout": rid,
                "destination": "",
                "how": "unrecovered",
                "version": -1,
                "requests": 0,
                "tokens_recovered": 0,
                "max_since_flush_s": 0.0,
                "recovery_s": 0.0,
            }
            for rid in gone
        ]

        def named(rid: str) -> str:
            hung = self.hung.get(rid)
            if hung is None:
                return f"{rid} (worker {self.workers.get(rid)} gone)"
            if hung.get("unfenced"):
                return (
                    f"{rid} (hung: no progress for {hung['silent_s']:.0f} s; its worker "
                    f"{self.workers.get(rid)} did not go within "
                    f"{self.cfg.faults.fence_wait_s:g} s of its "
                    f"restart ({hung.get('restart')}): stop that process yourself)"
                )
            return (
                f"{rid} (hung: no progress for {hung['silent_s']:.0f} s; its worker "
                f"{self.workers.get(rid)} stopped)"
            )

        one = len(gone) == 1
        self.error = (
            f"rollout{'' if one else 's'} {', '.join(map(named, gone))} "
            f"{'was' if one else 'were'} lost and faults.recover is off: "
            f"{'it is' if one else 'they are'} not recovered, and the run does not go on "
            f"without {'it' if one else 'them'}; turn faults.recover on (--set "
            "faults.recover=true) to recover a lost rollout within the run, or resume the run"
        )
        logger.error("%s", self.error)

    def _watched(self) -> dict[str, tuple[object, str | None, str]]:
        """Id -> (handle, worker, kind) of every live rollout and downstream relay."""
        out = {rid: (self.rollouts[rid], self.workers.get(rid), "rollout") for rid in self._alive()}
        for rid in self._chain()[1:]:  # (the master's loss is the trainer's)
            out[rid] = (self.relays[rid], self.relay_workers.get(rid), "relay")
        return out

    def check_heartbeats(self) -> list[str]:
        """Rollouts and relays that neither answered nor showed progress for
        ``faults.heartbeat_timeout_s`` are hung: each one's worker is restarted (the nanny
        stops the process, or kills it), in the background. Its actor is then gone, so a
        later :meth:`detect` round handles it like any lost one — a hung rollout is fenced
        before its trajectories resume elsewhere, never generating beside them (unless
        the fence fails: :meth:`_unfence` gives it up then, the buffer dropping what it
        may send again). A rollout
        shows progress by its generation loop's heartbeat, a relay by answering. Returns
        the newly hung.

        Called every detection round; each is asked only every :func:`heartbeat_interval`
        (a call costs the manager's thread about a millisecond: asking 256 rollouts every
        round took 40 % of it), an answer is read the round it is in, and the silence of
        one whose question is unanswered counts from the later of its last progress and
        that question: detection comes within a round of the timeout (one question
        interval more when it stopped just after an answer), never before it."""
        limit = self.cfg.faults.heartbeat_timeout_s
        now = time.time()
        self._discount_blind_time(now)
        watched = {k: v for k, v in self._watched().items() if k not in self.hung}
        for rid in watched:
            self._alive_at.setdefault(rid, now)  # (a new one: from when it is watched)
            asked = self._beat_calls.get(rid)
            if asked is None or not asked[1].done():
                continue  # one call at a time: a silent one is not asked again
            del self._beat_calls[rid]
            try:
                age = asked[1].result(timeout=1.0)
            except Exception:  # noqa: BLE001 — its worker is gone: detect() sees to it
                age = None
            # (None: its generation loop ended — failed or stopped, for the driver to
            # see — not hung.)
            self._alive_at[rid] = max(self._alive_at[rid], now - (age or 0.0))
        silent = {r: self._silent_s(r, now) for r in watched}
        hung = [r for r in watched if silent[r] > limit]
        if now - self._beat_asked >= heartbeat_interval(self.cfg.faults):
            self._beat_asked = now
            for rid, (handle, _, _) in watched.items():
                if rid in self._beat_calls or rid in hung:
                    continue
                try:
                    self._beat_calls[rid] = (now, handle.heartbeat())
                except Exception:  # noqa: BLE001 — its worker is gone: detect() sees to it
                    pass
        for rid in hung:
            _, worker, kind = watched[rid]
            logger.warning(
                "%s %s hung: no progress for %.1f s (faults.heartbeat_timeout_s=%s); "
                "restarting its worker %s",
                kind,
                rid,
                silent[rid],
                limit,
                worker,
            )
            # "restart" stays "pending" until the nanny has a new worker up (that may come
            # after the run ends); the fence proper is the old process's going, which
            # detect() records as "fenced_s".
            self.hung[rid] = {
                "kind": kind,
                "time": now,
                "silent_s": silent[rid],
                "worker": worker,
                "restart": "pending",
            }
            start_thread(lambda rid=rid, w=worker: self._fence(rid, w), f"fence-{rid}")
        return hung

    def _discount_blind_time(self, now: float) -> None:
        """This thread was held up (a call that waited out its timeout, a recovery that
        took long) for longer than a detection round and a question interval: nobody was
        asked meanwhile, so one whose last answer had been read looked silent for all
        that time, and every healthy rollout was declared hung at once. Its silence goes
        on from where it stood when the gap began. One with a question in flight is
        judged as ever: it had the gap to answer, and an answer in is read this round (a
        hung one always has one in flight, so a manager that is always slow finds it
        within a gap of the timeout)."""
        last, self._beats_read = self._beats_read, now
        if last is None:
            return
        gap = now - last
        faults = self.cfg.faults
        if gap <= faults.detect_interval_s + heartbeat_interval(faults):
            return
        for rid, t in self._alive_at.items():
            if rid not in self._beat_calls:
                self._alive_at[rid] = min(now, t + gap)

    def _silent_s(self, rid: str, now: float) -> float:
        """How long ``rid`` has neither shown progress nor left a question unanswered:
        since its last progress, or since it was asked if it has not answered since (it
        was not asked in between, and may have run until then)."""
        silent = now - self._alive_at[rid]
        asked = self._beat_calls.get(rid)
        return silent if asked is None else min(silent, now - asked[0])

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

    def _rechain(self, chain: list[str], errors: list[str]) -> dict[str, int]:
        """Give every relay of ``chain`` (master first) its place in it
        (:meth:`~laminar.relay.Relay.rechain`). Returns relay -> the version it sent its
        new successor at once (which the successor takes unless it holds it already; a
        version still arriving above the gap follows once complete). A call that failed
        leaves the chain *dirty*: each detection round calls every relay again
        (:meth:`_rechain_again`; a relay already in place takes the call as a no-op) until
        every call succeeded, so a relay is not left sending to a lost successor."""
        resent = {}
        dirty = False
        for i, rid in enumerate(chain):
            nxt = self.relays[chain[i + 1]] if i + 1 < len(chain) else None
            master = None if i == 0 else self.relays[chain[0]]
            call = self._try(lambda r=rid, n=nxt, m=master: self.relays[r].rechain(chain, n, m))
            # (one that does not answer within a few seconds leaves the chain dirty: the
            # next round calls it again, rather than this thread waiting, blind, on it)
            ok, version = self._noting(
                f"{rid}.rechain",
                call,
                errors,
                actor=self.relays[rid],
                deadline=time.time() + self.quick_s,
            )
            dirty = dirty or not ok
            if version is not None:
                resent[rid] = version
        self._chain_dirty = dirty
        return resent

    def _rechain_again(self) -> None:
        """A rechain call failed (:meth:`_rechain`): call every relay of the chain again."""
        errors: list[str] = []
        chain = self._chain()
        self._rechain(chain, errors)
        logger.warning(
            "chain %s given again to every relay: %s",
            " -> ".join(chain),
            "; ".join(errors) if errors else "done",
        )

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
        moved = {}
        for roll, rel in sorted(self.rollout_relays.items()):
            if rel not in gone or roll in self.lost or roll in self.hung:
                continue
            above = next(r for r in reversed(old[: old.index(rel)]) if r not in gone)
            self.rollout_relays[roll] = above
            moved[roll] = self.relays[above]
            repointed[rel][roll] = above
        self._set_relays(moved, errors)
        self._set_pool_relays(chain, errors)
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
            move = uuid.uuid4().hex[:12]  # (what the question names: this import)
            try:
                future = roll.import_for_move(version, batch, move=move)
                ok = actor_result(roll, future, self.timeout)
            except Exception:  # noqa: BLE001 — no answer: it may yet have gone in
                try:  # (asked after the import, which it runs first)
                    ok = actor_result(roll, roll.holds(move), self.timeout)
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

    def recover(self, lost: str, again: bool = False) -> list[dict]:
        """Resume ``lost``'s unfinished trajectories on healthy rollouts, one batch per
        weight version: imported into a running batch of that version, else adopted.
        Its finished ones (rewards in flight when it died) are scored again elsewhere.
        The pool fences ``lost`` as it takes them (:meth:`laminar.partial.PartialCore.take`):
        what its process may yet send no longer changes them.

        ``again``: a later recovery of what it registered after the first
        (:meth:`_retake_late`); one that finds nothing writes no row."""
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
        if not states and not again:
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
        self._record_faults(rows)
        return rows
