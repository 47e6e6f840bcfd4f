"""The driver's fault handling: a trainer or data module that hangs is fenced (its
worker restarted, so that it never runs beside its replacement); one whose worker is
lost is restarted within the run where it can be (the state machines of
``pipelines/restart.py``, advanced by each poll), or the run fails, saying what was lost
and how to continue; a lost rollout gets a replacement on a free ``rollout`` worker
(never one whose process a failed fence left running), and the prompt pool refuses the
lost one groups (its process may live on).

A mixin of :class:`pipelines.driver.Schedule`, apart from its wiring, polls and stop:
what a fault does to the driver's books is one concern, documented in docs/faults.md.
Runs in ``laminar run``'s driver.
"""

from __future__ import annotations

import logging
import time

from laminar.cluster import (
    actor_result,
    bind_actor,
    is_lost,
    scheduler_workers,
    start_actor,
    workers_with,
)
from laminar.errors import ClusterError
from laminar.rollout import RolloutReplica
from pipelines.driver_calls import _answers, _send

logger = logging.getLogger("laminar")


# A poll's call that fails with the actor's own error (not a loss) this many polls in a
# row fails the run: one that fails once (a race in a stats() since fixed, a worker
# restarted at its old address answering KeyError) is logged and asked again next poll.
OWN_ERRORS_TO_FAIL = 3


def core_bound(cfg) -> str:
    """The setting that bounds each call to the trainer or the data module, as it reads
    in the config: the lower of ``cluster.actor_timeout_s`` and
    ``faults.heartbeat_timeout_s`` (a call unanswered that long marks the actor hung).

    >>> from laminar.config import RunConfig, with_overrides
    >>> core_bound(with_overrides(RunConfig(), ["cluster.actor_timeout_s=5"]))
    'cluster.actor_timeout_s=5'
    >>> core_bound(with_overrides(RunConfig(), ["faults.heartbeat_timeout_s=7"]))
    'faults.heartbeat_timeout_s=7'
    """
    actor, heartbeat = cfg.cluster.actor_timeout_s, cfg.faults.heartbeat_timeout_s
    if actor < heartbeat:
        return f"cluster.actor_timeout_s={actor:g}"
    return f"faults.heartbeat_timeout_s={heartbeat:g}"


def hung_because(fence: dict) -> str:
    """What a fence's record (:meth:`DriverFaults._fence`) says of why its actor was
    taken for hung, naming the setting that fired and what to raise if it was only slow.

    >>> hung_because({"silent_s": 0.05, "bound": "cluster.actor_timeout_s=0.05"})
    'no answer for 0.05 s (cluster.actor_timeout_s=0.05; if it was only slow, raise \
cluster.actor_timeout_s)'
    """
    bound = fence.get("bound", "faults.heartbeat_timeout_s")
    setting = bound.split("=")[0]
    what = "no answer" if fence.get("unanswered", True) else "no progress"
    return f"{what} for {fence['silent_s']:.3g} s ({bound}; if it was only slow, raise {setting})"


def timed_out_why(cfg) -> str:
    """Why a run failed on a call to one of its actors that timed out: the settings that
    bound such calls, and which to raise if they were only slow.

    >>> from laminar.config import RunConfig, with_overrides
    >>> print(timed_out_why(with_overrides(RunConfig(), ["faults.heartbeat_timeout_s=3"])))
    a call to one of the run's actors did not answer in time (each call: \
cluster.actor_timeout_s=60; one to the trainer or the data module: the lower of that and \
faults.heartbeat_timeout_s=3); if they were only slow (a loaded machine, a large \
batch), raise faults.heartbeat_timeout_s
    """
    c, f = cfg.cluster.actor_timeout_s, cfg.faults.heartbeat_timeout_s
    return (
        "a call to one of the run's actors did not answer in time (each call: "
        f"cluster.actor_timeout_s={c:g}; one to the trainer or the data module: the lower "
        f"of that and faults.heartbeat_timeout_s={f:g}); if they were only slow (a loaded "
        f"machine, a large batch), raise {core_bound(cfg).split('=')[0]}"
    )


def stuck_workers(m_stats: dict | None) -> set[str]:
    """The workers of hung rollouts and relays whose fence failed and that the scheduler
    still has (``unfenced`` in their hang's record, no ``gone_s``: see
    :meth:`laminar.manager_recovery.RecoveryMixin._unfence`): taken as lost, but their
    process may live on, so no rollout is placed there; the user must stop them.

    >>> stuck_workers({"hung": {"r1": {"worker": "tcp://w1", "unfenced": True},
    ...                         "r2": {"worker": "tcp://w2", "unfenced": True, "gone_s": 90.0},
    ...                         "r3": {"worker": "tcp://w3", "fenced_s": 4.0}}})
    {'tcp://w1'}
    """
    return {
        h["worker"]
        for h in ((m_stats or {}).get("hung") or {}).values()
        if h.get("unfenced") and "gone_s" not in h and h.get("worker")
    }


# What a message quotes of an error at most: a CommClosedError's names both ends and the
# stream's state, a traceback's last line can run to hundreds of characters.
SAID_CHARS = 160


def said(error: BaseException) -> str:
    """``error`` as a message quotes it: its type and its words on one line, cut to
    :data:`SAID_CHARS` (its type alone dropped its cause: ``RuntimeError``).

    >>> said(RuntimeError("actor   lost  (worker gone)"))
    "RuntimeError: 'actor lost (worker gone)'"
    >>> said(TimeoutError()), len(said(OSError("x" * 500)))
    ('TimeoutError', 171)
    """
    words = " ".join(str(error).split())
    if len(words) > SAID_CHARS:
        words = words[: SAID_CHARS - 1] + "…"
    return f"{type(error).__name__}: {words!r}" if words else type(error).__name__


def why_not_restarted(cfg, roles: list[str], laminar: bool, schedule: str) -> str:
    """Why a lost trainer or data module (``roles``: ``trainer``, ``data module``,
    ``trainer and data module``, ``trainer rank N``) fails the run rather than restarting
    within it: ``schedule`` (``laminar``: the driver's dispatch, weights and trainer are
    Laminar's) does not, or exactly the settings that are off of those its restart needs
    (a trainer: ``faults.restart_trainer``, and a rollout manager: ``faults.recover`` or
    a ``repack`` section; a data module: ``faults.restart_data`` and ``faults.recover``,
    whose partial-response pool it is rebuilt from; both, sharing a worker: all).

    >>> from laminar.config import RunConfig, with_overrides
    >>> cfg = with_overrides(RunConfig(), ["faults.restart_trainer=false"])
    >>> why_not_restarted(cfg, ["trainer and data module"], True, "laminar")
    '(faults.restart_trainer is off)'
    >>> print(why_not_restarted(cfg, ["data module"], True, "laminar"))  # (not this one's)
    (it was lost as the run stopped, or the trainer and the data module on two workers \
were lost at once)
    >>> cfg = with_overrides(cfg, ["faults.restart_data=false", "faults.recover=false"])
    >>> print(why_not_restarted(cfg, ["trainer and data module"], True, "laminar"))
    (faults.restart_trainer, faults.restart_data and faults.recover are off: a data module \
is rebuilt from the partial-response pool that faults.recover keeps)
    >>> why_not_restarted(cfg, ["trainer"], False, "sync")
    "(schedule 'sync' does not restart them within the run)"
    """
    if not laminar:
        return f"(schedule {schedule!r} does not restart them within the run)"
    f = cfg.faults
    trainer = any(r.startswith("trainer") for r in roles)
    data = any(r.endswith("data module") for r in roles)
    off = [
        name
        for name, needed, on in (
            ("faults.restart_trainer", trainer, f.restart_trainer),
            ("faults.restart_data", data, f.restart_data),
            ("faults.recover", data, f.recover),
        )
        if needed and not on
    ]
    if off:
        names = off[0] if len(off) == 1 else f"{', '.join(off[:-1])} and {off[-1]}"
        why = f"{names} {'is' if len(off) == 1 else 'are'} off"
        if "faults.recover" in off:
            why += (
                ": a data module is rebuilt from the partial-response pool that "
                "faults.recover keeps"
            )
        return f"({why})"
    if trainer and not f.recover and cfg.repack is None:
        return (
            "(faults.recover is off and there is no repack section: a trainer restarts "
            "through the rollout manager, which then does not run)"
        )
    return (
        "(it was lost as the run stopped, or the trainer and the data module on two "
        "workers were lost at once)"
    )


class FaultHandling:
    """The fault handling of :class:`~pipelines.driver.Schedule`, which sets up the books
    it keeps (``core_workers``, ``_fenced``, the restarts in progress and done) and
    calls it from its polls, ``run`` and ``shutdown``."""

    def _begin_restart(self, lost: dict[str, str], error: Exception) -> bool:
        """The core workers in ``lost`` are gone: begin restarting what they hosted
        within the run (``False``: not yet — a data-parallel rank is lost, and the rest of
        its group is being fenced), or raise ``error`` (what the call that found it
        raised) when that cannot be."""
        from pipelines.restart import CoreRestart, DataRestart, TrainerRestart

        if not lost:  # (every worker still there: the call's error is the run's)
            raise error
        running = self._restart or self._data_restart
        if running is not None:  # (one restart at a time: each rebuilds from the other)
            roles = {TrainerRestart: "trainer", DataRestart: "data module"}
            what = roles.get(type(running), "trainer and data module")
            raise ClusterError(
                f"lost the {' and '.join(lost)} (worker(s) {', '.join(lost.values())} gone) "
                f"while the {what} lost on {running.lost_worker} was being restarted; the "
                f"run cannot continue (two restarts cannot overlap); {self.resume_hint()} "
                "(docs/faults.md)"
            ) from error
        if self.actors["trainer"] is None:  # (_trainer_finished: nothing left to train)
            raise ClusterError(
                f"lost the {' and '.join(lost)} (worker(s) {', '.join(lost.values())} gone) "
                "after the trainer had made every update (its final checkpoint: "
                f"{(self._last_t_stats or {}).get('checkpoint')}); the trajectory store "
                "holds what it had committed, the trajectories generated since are lost"
            ) from error
        hung = self._fenced.get(next(iter(lost.values()), ""))
        group = self._group()
        head = "trainer" if "trainer" in group else "trainer and data module"
        in_group = set(lost) <= set(group)
        if self.restartable and in_group and head not in lost:
            self._check_group()  # (a rank other than 0: fence the group, then restart it)
            return False
        if self.restartable and in_group and head == "trainer":
            r = self._restart = TrainerRestart(
                self, lost["trainer"], self._last_t_stats, exclude=set(group.values())
            )
        elif self.data_restartable and list(lost) == ["data module"] and self._last_m_stats:
            r = self._data_restart = DataRestart(self, lost["data module"], self._last_m_stats)
        elif self.restartable and in_group and self._last_m_stats:  # (head shares data's)
            # (the lost master's records copied: the newest may be newer than anything
            # else the driver saw, and its number must not be published again)
            copied = [*self._old_publications, *self._master_publications]
            r = self._data_restart = CoreRestart(
                self,
                lost[head],
                self._last_t_stats,
                self._last_m_stats,
                exclude=set(group.values()),
                published=max((p["version"] for p in copied), default=0),
            )
        else:
            raise error
        if isinstance(r, TrainerRestart | CoreRestart):  # (the master went with rank 0)
            self._old_publications += self._master_publications
            self._master_publications = []
        if isinstance(r, DataRestart):  # (a CoreRestart too)
            self._drop_joining()
        self._check_group()  # (the rest of a data-parallel group goes too)
        if r is not self._restart:
            self._data_suspect = None
        self._group_suspect = None
        if hung is not None:
            r.record["hung"] = hung
        return True

    def _group(self) -> dict[str, str]:
        """Role -> worker of the trainer's processes: rank 0 (``trainer``, or ``trainer
        and data module``) and, data-parallel, ``trainer rank N``."""
        return {r: w for r, w in self.core_workers.items() if r.startswith("trainer")}

    def _check_group(self) -> None:
        """A data-parallel trainer whose group lost a rank (its worker gone, or fenced)
        cannot go on: every collective with the lost rank fails or hangs. Every other
        rank's worker is fenced too, so that the whole group restarts from the
        checkpoint (:class:`pipelines.restart.TrainerRestart`) once rank 0's is gone."""
        if self.cfg.trainer.ranks == 1 or not self.restartable:
            return
        group = self._group()
        workers = set(scheduler_workers(self.client))
        if all(w in workers and w not in self._fenced for w in group.values()):
            return
        for role, w in group.items():
            if w in workers and w not in self._fenced:
                self._fence(role, w, 0.0, why="its data-parallel group lost a rank")

    def _restarted(self, r) -> None:
        """A data-module rebuild (or a core restart) finished: the driver's books follow."""
        from pipelines.restart import CoreRestart

        self._data_restart = None
        self._n_repacks = self._n_faults = 0  # the new manager's rows start empty
        # The rebuilt buffer counts the whole store as its own, earlier starts' rows
        # included: its counters need no carry (a resumed run's) any more.
        for k in ("inserted", "consumed", "discarded", "evicted", "filtered"):
            self._carry["cluster"].pop(k, None)
        if not isinstance(r, CoreRestart):
            self.data_restarts.append(r.record)
            return
        self.core_restarts.append(r.record)
        if r.finished:
            self._trainer_finished(r)
        else:
            self._trainer_back(r, "trainer and data module", r.handle)

    def _own_error(self, what: str, error: Exception) -> None:
        """``what`` (an actor call of a poll) failed with ``error``. A loss (its worker
        gone, the connection cut, the call cancelled or timed out:
        :func:`laminar.actors.is_lost`) is for the polls to judge, and returns. Any other
        error is the actor's own (a bug, a full disk): logged at ERROR, and raised once
        the same call has failed so :data:`OWN_ERRORS_TO_FAIL` polls in a row, so that the
        run fails, stopped in order (taken for a loss, it was swallowed at every poll,
        those stats or rows never read again)."""
        if is_lost(error):
            return
        n = self._own_errors[what] = self._own_errors.get(what, 0) + 1
        logger.error(
            "%s failed with its own error, not a loss (%d of %d polls in a row before the "
            "run fails): %r",
            what,
            n,
            OWN_ERRORS_TO_FAIL,
            error,
        )
        if n >= OWN_ERRORS_TO_FAIL:
            raise error

    def _answered(self, what: str) -> None:
        """``what`` answered: its run of own errors (:meth:`_own_error`) is over."""
        self._own_errors.pop(what, None)

    def _core_timeout(self) -> float:
        """How long a call to the trainer or the data module may take: one silent for
        ``faults.heartbeat_timeout_s`` is hung (and no call may wait on it longer), or for
        ``cluster.actor_timeout_s`` where that is lower (:func:`core_bound` names it)."""
        return min(self.cfg.cluster.actor_timeout_s, self.cfg.faults.heartbeat_timeout_s)

    def _data_silent(self, error: Exception) -> None:
        """A call to the manager (the data module's) failed: if it was not answered
        within :meth:`_core_timeout` and its worker is still there, the data module is
        hung (the next poll of its stats then waits for the fenced worker to go)."""
        if isinstance(error, TimeoutError) and self._data_hung is None and not self._lost_core():
            self._data_suspect = self._data_suspect or time.time()
            self._fence_data(self._core_timeout())

    def _fence_data(self, silent_s: float) -> None:
        """The data module did not answer for ``faults.heartbeat_timeout_s``: hung. Its
        worker is restarted; once the scheduler has dropped it, it is lost and rebuilt
        like a killed one (with the trainer, when they share it)."""
        role = "data module" if "data module" in self.core_workers else "trainer and data module"
        self._fence(role, self.core_workers[role], silent_s, bound=core_bound(self.cfg))

    def _data_worker(self) -> str:
        return self.core_workers.get("data module") or self.core_workers["trainer and data module"]

    @property
    def _data_hung(self) -> dict | None:
        """The fence of the data module's worker, when it hung."""
        return self._fenced.get(self._data_worker())

    def _fence(
        self, role: str, worker: str, silent_s: float, why: str = "", bound: str = ""
    ) -> dict:
        """``role`` on ``worker`` showed no progress for ``silent_s``: hung. Its worker is
        restarted (the nanny stops the process, or kills it), in the background, so that
        it never runs beside its own replacement; the scheduler then drops it and it is
        lost. ``bound``: the setting that fired, where a call went unanswered
        (:func:`core_bound`); none, its training loop's ``faults.heartbeat_timeout_s``.
        Returns the record of the fence (``restart``: the nanny's outcome)."""
        from laminar.cluster import start_thread

        now = time.time()
        info = {"role": role, "time": now, "worker": worker, "silent_s": silent_s}
        info["unanswered"] = bool(bound)
        info["bound"] = (
            bound or f"faults.heartbeat_timeout_s={self.cfg.faults.heartbeat_timeout_s:g}"
        )
        self._fenced[worker] = info
        if why:
            info["why"] = why
            logger.warning("%s on %s: %s; restarting its worker", role, worker, why)
        else:
            logger.warning(
                "%s on %s: %s: hung; restarting its worker", role, worker, hung_because(info)
            )

        def fence() -> None:
            from laminar.deploy import fence_workers

            t0 = time.time()
            try:
                # (restarted by its nanny; one without, a Slurm worker, removed: path A
                # then submits a new job in its place)
                out = fence_workers(self.client, [worker], timeout=10)
                info["restart"] = str(out.get(worker, out))
            except Exception as e:  # noqa: BLE001 — gone meanwhile: fenced all the same
                info["restart"] = repr(e)
            info["restart_s"] = time.time() - t0

        start_thread(fence, f"fence-{role.replace(' ', '-')}")
        return info

    def _fence_overdue(self, hung: dict, now: float, error: Exception) -> None:
        """Raise when a fenced worker is still the scheduler's ``faults.fence_wait_s``
        after its fence (its restart failed: nothing can be restarted in its place), as
        the manager gives up a hung rollout then."""
        wait = self.cfg.faults.fence_wait_s
        if now - hung["time"] > wait:
            raise ClusterError(
                f"the {hung['role']} on {hung['worker']} hung and its worker did not go "
                f"within {wait:g} s of its restart ({hung.get('restart')}); "
                f"{self.resume_hint()}"
            ) from error

    def _trainer_finished(self, r) -> None:
        """A restart ``r`` found that the lost trainer had written the run's final
        checkpoint (:func:`pipelines.restart._final_checkpoint`): no trainer runs from here on.
        Its last stats stand, done at that checkpoint, so the run stops as completed;
        the updates it made after the driver last copied its history are not in the
        ``updates`` table (as for any lost trainer)."""
        a = self.actors
        a["trainer"], a["trainer_ranks"] = None, []
        self.core_workers = {
            role: w for role, w in self.core_workers.items() if not role.startswith("trainer")
        }
        if r.worker is not None:  # (a CoreRestart: the rebuilt data module's, alone now)
            self.core_workers["data module"] = r.worker
        if r.master is not None:  # (a CoreRestart: the manager made it the chain's head)
            self.tier.relays[0], self.tier.workers[0] = r.master, r.worker
        else:  # (lost with the trainer: its publications are in _old_publications)
            self._master_gone = True
        version = r.record["checkpoint_version"]
        self._last_t_stats = {
            **(self._last_t_stats or r.stand_in),
            "version": version,
            "steps": version,
            "done": True,
            "error": None,
            "silent_s": None,
            "checkpoint": r.record["checkpoint"],
        }

    def _trainer_back(self, r, head: str, handle) -> None:
        """A restart ``r`` has its new trainer (``handle``) running: its master relay, its
        workers (rank 0's as ``head``) and other ranks, and its history, in the driver's
        books."""
        a = self.actors
        a["trainer"], a["trainer_ranks"] = handle, r.ranks
        # The new trainer counts its wait from 0: the lost one's goes on in the total.
        before, last = self._trainer_wait
        self._trainer_wait = (before + last, 0.0)
        if self._last_t_stats is not None:  # (this poll's row: not the lost one's again)
            self._last_t_stats = {**self._last_t_stats, "wait_s": 0.0}
        self.tier.relays[0] = r.master  # (a["relays"] is this list)
        self.tier.workers[0] = r.worker  # (a replacement rollout's relay is chosen by host)
        self.core_workers = {
            role: w for role, w in self.core_workers.items() if not role.startswith("trainer")
        }
        self.core_workers[head] = r.worker
        for i, w in enumerate(r.group.rank_workers, start=1):
            self.core_workers[f"trainer rank {i}"] = w
        self._updates_before += self._n_updates
        self._n_updates = 0  # the new trainer's history starts empty
        try:
            future = handle.stats()
            self._last_t_stats = actor_result(handle, future, self.cfg.cluster.actor_timeout_s)
        except Exception as e:  # noqa: BLE001 — lost again at once: the next poll sees it
            logger.warning("the restarted trainer did not answer its first stats: %r", e)

    def _t_stand_in(self) -> dict:
        """The trainer's last stats, for a poll that cannot ask it (hung, or being lost)."""
        from pipelines.restart import trainer_stand_in

        return self._last_t_stats or trainer_stand_in(None, self.cfg.trainer.steps)

    def _trainer_worker(self) -> str | None:
        """Rank 0's worker (``None``: none runs, see :meth:`_trainer_finished`)."""
        return self.core_workers.get("trainer") or self.core_workers.get("trainer and data module")

    def _replace_lost(self, m_stats: dict) -> None:
        """Start a rollout in place of a lost one on a ``rollout`` worker that hosts none
        (its worker restarted by the nanny, or a new one), one at a time, without
        blocking the poll: created on one poll, started and handed to the manager on a
        later one. The new rollout takes the next id (``r<N>``). (First, at every poll:
        :meth:`_fence_in_pool`.)"""
        self._fence_in_pool(m_stats)
        cfg, client, a = self.cfg, self.client, self.actors
        if not (cfg.faults.recover and cfg.faults.replace) or self._data_restart is not None:
            return
        if self._joining is not None:
            rid, worker, replaces, relay_id, future = self._joining
            if not future.done():
                # (its creating task, pinned to a worker lost meanwhile, would never end:
                # nothing would be replaced for the rest of the run)
                try:
                    gone = worker not in scheduler_workers(client, timeout=5.0)
                except Exception:  # noqa: BLE001 — no answer: the next poll asks again
                    gone = False
                if gone:
                    logger.warning("rollout %s: its worker %s was lost as it started", rid, worker)
                    self._joining = None
                return
            self._joining = None
            try:
                handle = bind_actor(client, RolloutReplica, worker, future)
                handle.start().result(timeout=cfg.cluster.actor_timeout_s)
            except Exception as e:  # noqa: BLE001 — that worker went too: try again later
                logger.warning("rollout %s could not start on %s: %s", rid, worker, e)
                return
            a["rollouts"].append(handle)
            self.rollout_workers[rid] = worker
            m = a["manager"]
            try:
                call = m.add_rollout(rid, handle, worker, replaces, relay_id)
                actor_result(m, call, self._core_timeout())
            except Exception as e:
                if not self.data_restartable:
                    raise
                self._data_silent(e)  # (hung or lost: the rebuilt manager takes it over)
            return
        waiting = [r for r in m_stats["lost"] if r not in m_stats["replacements"]]
        if not waiting:
            return
        hosting = {w for r, w in self.rollout_workers.items() if r not in m_stats["lost"]}
        hosting |= stuck_workers(m_stats)  # (lost, but its process may live: not free)
        free = [w for w in workers_with(client, "rollout") if w not in hosting]
        # (a worker of the trainer's or the data module's too, last: see place())
        cores = set(getattr(self, "core_workers", {}).values())
        free.sort(key=lambda w: w in cores)
        if not free:
            return
        rid, worker = f"r{len(a['rollouts'])}", free[0]
        if worker in cores:  # (as at the start: pipelines.driver._warn_shared_workers)
            logger.warning(
                "replacement rollout %s shares worker %s with the trainer or the data module "
                "(no worker with 'rollout' alone is free): its engine and theirs contend for "
                "one process; start rollout workers of their own (docs/deploy.md)",
                rid,
                worker,
            )
        tier = self.tier
        relay_id = tier.ids[tier.local_relay(worker, self._taken, lost=m_stats["relays_lost"])]
        self.rollout_relays[rid] = relay_id
        future = start_actor(
            client,
            RolloutReplica,
            rid,
            cfg,
            self.policy_dir,
            a["pool"],
            a["buffer"],
            tier.handle(relay_id),
            a["partial"],
            str(self.run_dir / "checkpoints"),
            self.schedule,
            worker=worker,
            resource="rollout",
        )
        self._joining = (rid, worker, waiting[0], relay_id, future)

    def _drop_joining(self) -> None:
        """A replacement being created was given the data module's actors, lost now: its
        creation is cancelled, and a new one is started with the rebuilt module's once it
        runs (:meth:`_replace_lost`: the lost rollout is still waiting for one, and the
        new one takes the same id). Bound after the rebuild, it took and sent to the lost
        pool, buffer and partial-response pool, and its loop failed when no rebuild came
        (``faults.data_restart_timeout_s``)."""
        joining, self._joining = self._joining, None
        if joining is None:
            return
        rid, worker, replaces, _, future = joining
        self.rollout_relays.pop(rid, None)
        try:
            self.client.cancel([future], force=True)
        except Exception as e:  # noqa: BLE001 — the client's own error: nothing to cancel
            logger.warning("replacement %s: its creation could not be cancelled: %r", rid, e)
        logger.warning(
            "replacement %s (for %s, on %s) dropped: made with the lost data module's "
            "actors; one is made again once it is rebuilt",
            rid,
            replaces,
            worker,
        )

    def _fence_in_pool(self, m_stats: dict) -> None:
        """Fence each rollout the manager has taken as lost in the prompt pool
        (:meth:`laminar.prompt_pool.PromptPool.fence`), once per pool (a rebuilt data
        module's too): one given up while its process lived (a failed fence) may wake
        and ask for groups, which nothing would then finish — they would hold the
        back-pressure budget for good. Its asks now fail, ending its generation loop.
        (The partial-response pool fenced it when its entries were taken.)

        Then the groups the pool handed to it that nothing else will complete — no
        entry in the partial-response pool, no sample in the buffer (asked in that
        order: a trajectory reaches the buffer before the pool forgets it) — go out
        again whole (:meth:`~laminar.prompt_pool.PromptPool.reissue_stranded`): handed
        to it just before it died, or in an answer it never received. Without this each
        held ``buffer.max_outstanding_groups`` for good, and a few stalled the run.
        A call not answered is made again at the next poll."""
        pool = self.actors.get("pool")
        if pool is None:
            return
        done = getattr(self, "_pool_fenced", None)
        if done is None or done[0] is not pool:
            done = self._pool_fenced = (pool, set())
        new = sorted(set(m_stats.get("lost") or ()) - done[1])
        if not new:
            return
        timeout = self._core_timeout()
        for rid in new:
            try:
                actor_result(pool, pool.fence(rid), timeout)
            except Exception as e:  # noqa: BLE001 — slow or lost: the next poll asks again
                logger.warning("the prompt pool did not fence lost rollout %s: %r", rid, e)
                return
        buffer, partial = self.actors.get("buffer"), self.actors.get("partial")
        if buffer is not None:
            try:
                known: set[str] = set()
                if partial is not None:  # (first: see above)
                    known.update(actor_result(partial, partial.groups(), timeout))
                known.update(actor_result(buffer, buffer.groups(), timeout))
                known_list = sorted(known)
                for rid in new:
                    n = actor_result(pool, pool.reissue_stranded(rid, known_list), timeout)
                    if n:
                        logger.warning(
                            "rollout %s was handed %d prompt groups that nothing holds "
                            "(it was lost before it registered them): they go out again",
                            rid,
                            n,
                        )
            except Exception as e:  # noqa: BLE001 — slow or lost: the next poll asks again
                logger.warning("the groups handed to lost rollouts %s were not checked: %r", new, e)
                return
        done[1].update(new)

    def _unrecovered(self, m_stats: dict | None) -> dict[str, dict]:
        """The rollouts lost with ``faults.recover`` off, for ``summary.json``
        (:func:`pipelines.summary.unrecovered_losses`): each one's worker and what it held
        at its last stats, from the driver's polls (the manager's fault row records
        nothing resumed; the rollout itself is gone)."""
        from pipelines.summary import unrecovered_losses

        if self.cfg.faults.recover:
            return {}
        return unrecovered_losses(m_stats, self.rollout_workers, self._last_r_stats)

    def _fail_on_lost_core(self, error: Exception) -> bool:
        """The driver's loop failed on ``error``: if a call to the trainer or the data
        module failed because its worker is gone, stop what still runs and raise a
        :class:`ClusterError` that says what was lost and how to continue (docs/faults.md).
        True if ``error`` is such a failure, said already (what still ran is stopped);
        False if every core actor is still there."""
        if isinstance(error, ClusterError):  # said already (a restart that could not be)
            self._abort()
            return True
        lost = self._lost_core(every=True)
        if not lost:
            return False
        self._abort()
        each = []  # (several at once: each named, so that the user sees what is left)
        for role, worker in lost.items():
            why = f"the scheduler no longer has it; the call that found it: {said(error)}"
            if worker in self._fenced:
                hung = self._fenced[worker]
                why = hung.get("why") or f"hung, {hung_because(hung)}"
                why = f"{why}, and restarted"
            each.append(f"the {role} (worker {worker} is gone: {why})")
        raise ClusterError(
            f"lost {' and '.join(each)}; the run cannot continue "
            f"{self._why_not_restarted(list(lost))}; {self.resume_hint()} (docs/faults.md)"
        ) from error

    def _wind_down(self, error: Exception, t_start: float) -> None:
        """The driver failed with every core actor still there (a full disk under
        ``metrics.zarr``, a bug): stop the run as :meth:`shutdown` does — the rollouts,
        then the trainer with its final checkpoint, then the buffer, which flushes the
        store — so that nothing generates on for a run that has ended and nothing it
        generated is lost. If that fails too, abort what still runs. The caller then
        raises ``error``; a call that timed out (a bare :class:`TimeoutError`) is raised
        as a :class:`ClusterError` that names the settings that bound it instead."""
        said = timed_out_why(self.cfg) if isinstance(error, TimeoutError) else ""
        logger.error("the run failed (%s): stopping its actors in order", said or repr(error))
        try:
            self.shutdown(f"failed: {said or repr(error)}", t_start)
        except Exception:  # noqa: BLE001 — the original error is the one raised
            logger.exception("stopping the failed run in order failed too: aborting it")
            self._abort()
        logger.error("the run failed; %s", self.resume_hint())
        if said:
            raise ClusterError(f"{said}; {self.resume_hint()}") from error

    def _why_not_restarted(self, roles: list[str]) -> str:
        """Why the lost core actors ``roles`` (:attr:`core_workers`' names) fail this run
        (docs/faults.md): the schedule, or exactly the settings that are off of those a
        restart of them needs (``or`` named both when one was off)."""
        schedule = "laminar" if self._laminar else self.schedule.name
        return why_not_restarted(self.cfg, roles, self._laminar, schedule)

    def _lost_core(self, every: bool = False) -> dict[str, str]:
        """Role -> worker of the core actors whose worker the scheduler no longer has;
        unless ``every``, not those a restart in progress is restarting
        (:meth:`_restarting`): their worker stays in ``core_workers`` until it is done,
        and a failed call to the other core actor took it for a new loss, skipped its
        own grace and fence, and began a second restart over the first."""
        workers = set(scheduler_workers(self.client))
        skip = set() if every else self._restarting()
        return {
            role: w
            for role, w in self.core_workers.items()
            if w not in workers and role not in skip
        }

    def _restarting(self) -> set[str]:
        """The roles of ``core_workers`` that the restart in progress restarts."""
        from pipelines.restart import CoreRestart

        roles = set()
        if self._restart is not None or isinstance(self._data_restart, CoreRestart):
            roles |= {r for r in self.core_workers if r.startswith("trainer")}
        if self._data_restart is not None:
            roles |= {"data module", "trainer and data module"} & set(self.core_workers)
        return roles

    def _abort(self) -> None:
        """Best effort: stop the manager and the rollouts that still run, so no worker
        generates for a run that has ended, then the trainer, so it does not train on (a
        released actor's thread goes on: with the data module lost it waited up to
        ``FaultsConfig.data_wait`` for it; after a failed stop in order it trained on),
        then close the relays they pulled from. The trainer writes no final checkpoint:
        one still finishing its update after the driver has given up would put it into a
        run directory a resume may already use; the resume starts from the newest
        checkpoint before. Its other ranks leave with it (its broadcast at the end), once
        it ran: a restart's ranks started before a rank 0 that then failed wait in their
        rendezvous until its timeout (``5 × cluster.actor_timeout_s``) and end with an
        error in their worker's log. A restart in progress: the actors it created and
        did not start are released and its new master relay closed; a data module it
        rebuilt is closed as the run's is."""
        a = self.actors
        workers = set(scheduler_workers(self.client))  # (a call to a lost one never answers)
        stop = [r for r in [a["manager"], *self._live_rollouts()] if r is not None]
        _answers([lambda r=r: r.stop(timeout=5.0) for r in stop if r._address in workers], 15.0)
        trainer = a["trainer"]
        if trainer is not None and trainer._address in workers:
            _answers([lambda: trainer.stop(timeout=5.0, checkpoint=False)], 15.0)
        # the relays: not waited on, a lost one never answers
        relays = list(a["relays"])
        for r in (self._restart, self._data_restart):
            group, master = getattr(r, "group", None), getattr(r, "master", None)
            if group is not None and not group.started:
                group.release()  # (created, none started: each loaded a checkpoint)
            if master is not None and all(master is not x for x in relays):
                relays.append(master)  # (the restart's, not yet in the tier)
        _send([lambda r=r: r.close() for r in relays])
        # The store and the recovery log, where their worker lives on (the trainer was
        # lost, or the stop failed): what they hold unwritten is kept for the resume
        # (the buffer first: the log then keeps only what the store lacks). A data
        # module being rebuilt: the new one's, once it runs (the lost one's is gone).
        if self._data_restart is not None:
            where = self._data_restart.rebuilt_on
        elif self._data_hung is None:
            where = self._data_worker()
        else:
            return
        if where is None or where not in workers:
            return
        wait = min(15.0, self.cfg.cluster.actor_timeout_s)
        for name in ("buffer", "partial"):
            if a[name] is not None:
                try:
                    actor_result(a[name], a[name].close(), wait)
                except Exception as e:  # noqa: BLE001 — lost or hung meanwhile: best effort
                    logger.warning("the %s could not be closed: %r", name, e)
