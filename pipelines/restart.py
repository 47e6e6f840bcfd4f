"""Restarting a lost trainer, and rebuilding a lost data module, within the run
(docs/faults.md, "Trainer loss" and "Data-module loss").

When the trainer's worker is gone and the data module lives elsewhere
(``cluster.data_apart``), the run does not stop. The rollouts keep generating from the
weights they hold, and the buffer keeps admitting what they finish, up to its
back-pressure bound. The driver then, without blocking its poll:

1. waits for a ``trainer`` worker (the nanny restarts the killed one; a Slurm job joins),
   up to ``faults.trainer_restart_timeout_s``;
2. has the buffer hold again the groups that the updates after the newest checkpoint had
   consumed (:meth:`laminar.buffer.ExperienceBuffer.trainer_restarted`). Those updates are
   lost, so their groups are trained again, and no trajectory is trained twice into the
   final weights;
3. starts a new master relay on that worker. The rollout manager puts it at the head of
   the chain and points the lost master's readers at it;
4. starts a new :class:`~laminar.trainer.Trainer` from the checkpoint. It numbers its
   updates after the newest version the lost trainer published (``after_version``), so no
   version number is used for two sets of weights.

:class:`TrainerRestart` is that sequence as a state machine that the driver advances
once per poll; :class:`DataRestart` rebuilds a lost data module; :class:`CoreRestart`
does both at once, for a trainer and data module that shared the lost worker (the
default on a local cluster).

The steps they share (where a restart starts from, the workers it picks, what it records,
what it does when a worker it picked goes too) are in :mod:`pipelines.restart_steps`;
their names are importable from here as before.
"""

from __future__ import annotations

import logging
import time

from laminar.cluster import (
    ActorLost,
    actor_result,
    bind_actor,
    detach,
    is_lost,
    scheduler_workers,
    start_actor,
    submit_actor,
    workers_with,
)
from laminar.errors import ClusterError
from laminar.manager import RolloutManager
from laminar.trainer import Trainer
from pipelines.restart_steps import LOST_GRACE_S as LOST_GRACE_S
from pipelines.restart_steps import _each as _each
from pipelines.restart_steps import _final_checkpoint as _final_checkpoint
from pipelines.restart_steps import _finish as _finish
from pipelines.restart_steps import _holdings as _holdings
from pipelines.restart_steps import _lineage as _lineage
from pipelines.restart_steps import _new_master as _new_master
from pipelines.restart_steps import _pick_workers as _pick_workers
from pipelines.restart_steps import _point_fields as _point_fields
from pipelines.restart_steps import _restart_point as _restart_point
from pipelines.restart_steps import _running as _running
from pipelines.restart_steps import _start_again as _start_again
from pipelines.restart_steps import _steps as _steps
from pipelines.restart_steps import _still_there as _still_there
from pipelines.restart_steps import trainer_stand_in as trainer_stand_in
from storage.resume import ResumePlan, plan_rebuild

logger = logging.getLogger(__name__)


class _Group:
    """A trainer being started: rank 0 on ``worker`` (with the master relay) and, when
    data-parallel, ranks 1.. on ``rank_workers``, in a new ``torch.distributed`` group
    (a lost rank breaks the old one: the whole group restarts)."""

    def __init__(self, s, worker: str, rank_workers: list[str]) -> None:
        self.s, self.worker, self.rank_workers = s, worker, rank_workers
        self.future = None
        self.rank_futures: list = []
        self.init_method = ""  # (the group's rendezvous, once opened)
        self.started = False  # a rank was started: it waits in this group's rendezvous
        self.t_created = time.time()  # (when its actors began to be created)

    def start(
        self,
        ckpt,
        steps: int,
        after: int,
        buffer,
        master,
        restarts: list[tuple[int, int]],
        consumed: dict | None = None,
    ) -> None:
        """Create (not yet start) the ranks from checkpoint ``ckpt`` (``None``: the
        warm-started policy); rank 0 numbers its updates after ``after`` and ends at
        version ``steps`` + the versions it skips, records ``restarts`` (the run's,
        its own last: :func:`pipelines.restart_steps._lineage`) in its checkpoints, and
        begins its consumed record with ``consumed`` (the buffer's answer to the restart:
        what it still waits to store consumed)."""
        from laminar.trainer import TrainerRank, rendezvous

        s = self.s
        cfg, client = s.cfg, s.client
        tcfg = cfg.trainer.model_copy(
            update={"resume_from": str(ckpt) if ckpt is not None else None, "steps": steps}
        )
        cfg = cfg.model_copy(update={"trainer": tcfg})
        init_method = rendezvous(client, self.worker) if self.rank_workers else ""
        self.init_method = init_method  # (closed by release() if rank 0 never runs)
        on = {"resource": "trainer"}
        self.rank_futures = [
            start_actor(client, TrainerRank, cfg, s.policy_dir, r, init_method, worker=w, **on)
            for r, w in enumerate(self.rank_workers, start=1)
        ]
        self.future = start_actor(
            client,
            Trainer,
            cfg,
            s.policy_dir,
            str(s.run_dir),
            buffer,
            master,
            init_method,
            s.schedule,
            None,  # (set once it runs: see Trainer.set_manager)
            after_version=after,
            restarts=restarts,
            consumed=consumed,
            worker=self.worker,
            **on,
        )

    def done(self) -> bool:
        return all(f.done() for f in (self.future, *self.rank_futures))

    def check_workers(self, limit_s: float, setting: str) -> None:
        """While its actors are created: raise :class:`ActorLost` when a worker of the
        group is gone (their creating tasks, pinned to its address, would wait for ever:
        a worker its nanny restarts comes back under another address), and a
        :class:`ClusterError` when they are not all created ``limit_s`` after they began
        (``setting``): a worker that hangs would hold the restart for ever."""
        live = set(scheduler_workers(self.s.client))
        gone = [w for w in (self.worker, *self.rank_workers) if w not in live]
        if gone:
            raise ActorLost(f"worker(s) {', '.join(gone)} lost while the new trainer was created")
        waited = time.time() - self.t_created
        if waited > limit_s:
            raise ClusterError(
                f"the restarted trainer was not created on {self.worker} (and "
                f"{len(self.rank_workers)} more rank(s)) {waited:.0f} s after it began "
                f"({setting}={limit_s:g}: raise it for a checkpoint that loads slowly); "
                f"its worker may hang; {self.s.resume_hint()}"
            )

    def release(self) -> None:
        """Best effort: release the actors created for the group (none started), so that
        none stays on a worker that lives on."""
        futures = [f for f in (self.future, *self.rank_futures) if f is not None]
        try:
            self.s.client.cancel(futures, force=True)
        except Exception as e:  # noqa: BLE001 — the scheduler gone too: the next step says
            logger.warning("could not release the trainer's actors: %r", e)
        if self.init_method:  # (rank 0 never ran: its store would listen on)
            from laminar.trainer_ranks import close_rendezvous_on

            close_rendezvous_on(self.s.client, self.worker, self.init_method)

    def run(self) -> tuple:
        """Bind the ranks and start them (they wait in the rendezvous), then rank 0 with
        the manager. Returns rank 0's handle and the other ranks' handles."""
        from laminar.trainer import TrainerRank

        s = self.s
        timeout = s.cfg.cluster.actor_timeout_s
        ranks = [
            bind_actor(s.client, TrainerRank, w, f)
            for w, f in zip(self.rank_workers, self.rank_futures, strict=True)
        ]
        handle = bind_actor(s.client, Trainer, self.worker, self.future)
        self.started = True
        for r in ranks:
            r.start().result(timeout=timeout)
        handle.set_manager(s.actors["manager"]).result(timeout=timeout)
        handle.start().result(timeout=timeout)
        return handle, ranks


class TrainerRestart:
    """One restart of a lost trainer (all its ranks, when data-parallel): :meth:`step`
    each poll until it returns the new trainer's handle; :attr:`record` is what
    ``summary.json`` reports for it. ``exclude``: the lost group's workers."""

    def __init__(
        self, schedule, lost_worker: str, last_stats: dict | None, exclude: set[str] = frozenset()
    ) -> None:
        self.s = schedule  # the driver (pipelines.driver.Schedule)
        self.lost_worker = lost_worker
        self.exclude = {lost_worker, *exclude}
        self.t_lost = time.time()
        self.stand_in = trainer_stand_in(last_stats, schedule.cfg.trainer.steps)
        self.worker: str | None = None
        self.master = None
        self.group: _Group | None = None
        self.ranks: list = []  # the other ranks' handles, once running
        self.finished = False  # the lost trainer had finished (_final_checkpoint): none starts
        self.record: dict = {"lost_worker": lost_worker, "time": self.t_lost}
        logger.warning(
            "trainer lost (worker %s gone) at version %s; restarting it within the run",
            lost_worker,
            self.stand_in["version"],
        )

    def step(self):
        """Advance; returns the new trainer's handle once it runs, else ``None`` (and
        :attr:`finished` once it found the run's final checkpoint: no trainer starts).
        Raises :class:`ClusterError` when no ``trainer`` worker came within the timeout."""
        try:
            if self.group is None:
                self._begin()
                return None
            if not self.group.done():
                limit = self.s.cfg.faults.trainer_restart_timeout_s
                self.group.check_workers(limit, "faults.trainer_restart_timeout_s")
                return None
            handle, self.ranks = self.group.run()
        except Exception as e:  # noqa: BLE001 — a worker went too: wait for others
            _start_again(self, e)
            return None
        _running(self)
        return handle

    def _begin(self) -> None:
        s = self.s
        cfg, a = s.cfg, s.actors
        if (final := _final_checkpoint(s, self.record)) is not None:  # (no worker needed)
            _finish(self, final)
            return
        picked = _pick_workers(s, self.exclude, with_data=False)
        if picked is None:
            waited = time.time() - self.t_lost
            if waited > cfg.faults.trainer_restart_timeout_s:
                raise ClusterError(
                    f"lost the trainer (worker {self.lost_worker} is gone) and not "
                    f"{cfg.trainer.ranks} `trainer` worker(s) came back within "
                    f"faults.trainer_restart_timeout_s={cfg.faults.trainer_restart_timeout_s:g}"
                    f" s; {s.resume_hint()}"
                )
            return
        self.worker, rank_workers = picked
        # The newest version any trainer of this run published (the buffer hears of
        # each before it is published).
        after = self._ask_data("buffer", lambda b: b.stats())["version"]
        ckpt, version, after, fields = _restart_point(s.run_dir, after)
        # (again after a retry: finds nothing more, the groups are held already)
        back = self._ask_data("buffer", lambda b: b.trainer_restarted(version, after))
        chain = self._ask_data("manager", lambda m: m.stats())["chain"]
        master = _new_master(s, self.worker, chain)
        self._ask_data("manager", lambda m: m.replace_master(master, self.worker))
        self.master = master
        self.group = _Group(s, self.worker, rank_workers)
        steps = _steps(s, version, self.record, ckpt)
        restarts = _lineage(s, self, (version, after))  # (what the buffer heard, and this)
        self.group.start(
            ckpt, steps, after, a["buffer"], master, restarts, back["consumed_unstored"]
        )
        self.record.update(
            worker_wait_s=time.time() - self.t_lost,
            **fields,
            steps=steps + after - version,  # (the version it ends at)
            readmitted=self.record.get("readmitted", 0) + back["readmitted"],
            readmitted_groups=self.record.get("readmitted_groups", 0) + back["groups"],
        )

    def _ask_data(self, name: str, call):
        """``call(actor)``'s answer, for the data module's actor ``name``; a
        :class:`ClusterError` that says so when that actor is lost too (a trainer and a
        data module lost together on two workers are not restarted within the run)."""
        actor = self.s.actors[name]
        try:
            return actor_result(actor, call(actor), self.s.cfg.cluster.actor_timeout_s)
        except Exception as e:
            if not is_lost(e):
                raise
            raise ClusterError(
                f"lost the trainer (worker {self.lost_worker} is gone) and, while it "
                f"restarted, the data module's {name} did not answer ({e!r}): a trainer and "
                f"a data module lost together on two workers are not restarted within the "
                f"run; {self.s.resume_hint()}"
            ) from e


def _stored(run_dir, uids) -> list[str]:
    """Those of ``uids`` that ``run_dir``'s trajectory store has committed."""
    from storage.trajectories_read import open_trajectories

    stored = set(open_trajectories(run_dir, ["uid"])["uid"].tolist())
    return [u for u in uids if u in stored]


def _orphans(entries: dict, owners: set[str]) -> dict:
    """Of the lost pool's log ``entries`` (:func:`laminar.partial.replay_log`), those a
    data module's rebuild restores: owned by one of ``owners`` (rollouts lost, silent,
    or found lost by the lost manager), and those taken from one of them and given to no
    other yet (ownerless: their recovery was cut short with the data module), owned
    again by the rollout they were taken from (the last on their path; the take undone,
    as the new manager's take of them moves them again). A rollout that said what it
    holds is in no ``owners``: it registers its own."""
    out = {}
    for uid, e in entries.items():
        if e["owner"] is None:
            st = e["state"]
            path = list(st.request.meta.get("rollout_path") or [])
            if not path or path[-1] not in owners:
                continue
            st.request.meta["rollout_path"] = path[:-1]
            st.n_moves -= 1
            e = {**e, "owner": path[-1]}
        if e["owner"] in owners:
            out[uid] = e
    return out


class DataRestart:
    """One rebuild of a lost data module (the experience buffer, prompt pool,
    partial-response pool and rollout manager, on their own ``data`` worker), while the
    trainer and the rollouts run on. Meanwhile the rollouts decode their batches on and
    keep what finishes, and the trainer waits for a buffer to sample from. Once a
    ``data`` worker is back (the nanny restarts a killed local one; a Slurm job joins):

    1. the trainer says what it sampled since its newest checkpoint (the store lacks
       what the lost buffer had not yet committed), and each rollout which groups it
       holds trajectories of;
    2. :func:`storage.resume.plan_rebuild` reads the trajectory store against them: the
       buffer holds again what is buffered (or consumed in the store by a batch the
       trainer never received), writes the consumed events the store lacks, and the
       prompt pool counts as outstanding every group still held anywhere;
    3. a new prompt pool, partial-response pool, buffer and manager start on that
       worker; the manager goes on from the lost one's last stats (what was lost, hung
       or replaced; the chain);
    4. the trainer and every rollout are handed the new actors. Each rollout registers
       its unfinished trajectories, with their tokens, with the new partial-response
       pool and sends the new buffer every trajectory the lost store had not committed.

    :meth:`step` advances it once per poll; :attr:`record` is what ``summary.json``
    reports."""

    def __init__(self, schedule, lost_worker: str, last_manager: dict) -> None:
        self.s = schedule  # the driver (pipelines.driver.Schedule)
        self.lost_worker = lost_worker
        self.t_lost = time.time()
        self.last_manager = last_manager
        # The worker of the data module rebuilt, once it runs (the driver's books still
        # name the lost one's until the restart ends: _abort closes this one)
        self.rebuilt_on: str | None = None
        self.record: dict = {"lost_worker": lost_worker, "time": self.t_lost}
        self._announce()

    def _announce(self) -> None:
        logger.warning(
            "data module lost (worker %s gone); rebuilding it within the run", self.lost_worker
        )

    def step(self) -> bool:
        """Advance; ``True`` once the new data module runs. Raises
        :class:`ClusterError` when no ``data`` worker came within the timeout."""
        s = self.s
        live = [w for w in workers_with(s.client, "data") if w != self.lost_worker]
        if not live:
            waited = time.time() - self.t_lost
            if waited > s.cfg.faults.data_restart_timeout_s:
                raise ClusterError(
                    f"lost the data module (worker {self.lost_worker} is gone) and no `data` "
                    f"worker came back within faults.data_restart_timeout_s="
                    f"{s.cfg.faults.data_restart_timeout_s:g} s; {s.resume_hint()}"
                )
            return False
        self.record["worker_wait_s"] = time.time() - self.t_lost
        try:
            self._rebuild(live[0])
        except Exception as e:  # noqa: BLE001 — that worker went too: wait for another
            if _still_there(s.client, "data", {live[0]}, e):
                raise
            logger.warning("the data module could not be rebuilt on %s: %r", live[0], e)
            self.lost_worker = live[0]
            return False
        return True

    def _rebuild(
        self,
        worker: str,
        record: dict | None = None,
        master=None,
        restarts: list[tuple[int, int]] | None = None,
    ) -> None:
        """Rebuild on ``worker``. ``record``: what the trainer consumed (default: asked of
        the live trainer); ``master``: the master relay's handle when it is new (a
        :class:`CoreRestart`; the live trainer is then not attached: a new one starts);
        ``restarts``: the trainer restarts for the new buffer to count staleness along
        (default: every one so far, :func:`pipelines.restart_steps._lineage`; a core
        restart's include its own, which no buffer heard)."""
        from laminar.lease import read_lease
        from pipelines.driver import start_data_module

        s = self.s
        cfg, client, a = s.cfg, s.client, s.actors
        timeout = cfg.cluster.actor_timeout_s
        t0 = time.time()
        m = self.last_manager
        ids = [f"r{i}" for i in range(len(a["rollouts"]))]
        live = {rid: h for rid, h in zip(ids, a["rollouts"], strict=True) if rid not in m["lost"]}
        workers = set(scheduler_workers(client))
        gone = {rid for rid in live if s.rollout_workers[rid] not in workers}
        alive = {rid: h for rid, h in live.items() if rid not in gone}
        phases: dict[str, float] = {}

        def mark(name: str) -> None:
            phases[name] = time.time() - t0 - sum(phases.values())

        if record is None:
            record = a["trainer"].consumed_record().result(timeout)
        held = _holdings(alive, timeout)
        silent = sorted(set(alive) - set(held))
        # Rollouts lost while no manager watched, and live ones that did not say what
        # they hold (hung, or too slow): their unfinished (and finished, not yet stored)
        # trajectories are in the lost pool's log, read before the new pool starts its
        # own. Registered with the new pool, their groups count as outstanding and none
        # is handed out again; the new manager finds a lost (or hung) one and recovers
        # them from there, and a silent one that attaches registers its own over them.
        # So are those of rollouts the lost manager had found lost (its recovery may not
        # have reached the log, or reached no rollout: taken, ownerless, not yet given to
        # another): the new manager takes them once more (RolloutManager.take_over).
        orphans: dict = {}
        if gone or silent or m["lost"]:
            from laminar.partial import replay_log

            orphans = _orphans(replay_log(s.run_dir).entries, gone | set(silent) | set(m["lost"]))
        plan = plan_rebuild(
            s.run_dir,
            version=record["version"],
            consumed=record["consumed"],
            since=record["since"],
            held_groups={g for groups in held.values() for g in groups},
            orphans=orphans,
        )
        # (committed by the lost store, its "forgotten" not yet logged: the buffer has it)
        for uid in plan.orphans_stored:
            del orphans[uid]
        # A silent rollout may hold groups it took from the lost pool within the log's
        # last interval: in no log and no store, so the plan's prompt order does not know
        # them, and it may still attach. Their uids must not be handed out again (to
        # another rollout, whose requests would share their ids): the order starts at
        # the lost pool's dispatch lease, past every position it handed out (the
        # positions between go untrained; laminar.lease).
        gap, lease = 0, None
        if silent:
            lease = read_lease(s.run_dir)
            if lease is None:  # (none readable: the back-pressure bound on what is out)
                lease = plan.start + cfg.buffer.max_outstanding_groups
            gap = max(0, lease - plan.start)
        plan.start += gap
        plan.restarts = _lineage(s) if restarts is None else restarts
        mark("plan_s")
        order = ResumePlan(
            version=plan.version,
            readmit_groups=plan.outstanding,
            start=plan.start,
            reissue=plan.reissue,
        )
        pool, partial, buffer = start_data_module(
            client, cfg, s.policy_dir, s.run_dir, s.schedule, worker, order=order, rebuild=plan
        )
        mark("data_actors_s")
        chain = m["chain"]
        relays = {rid: s.tier.handle(rid) for rid in chain}
        relay_workers = {rid: s.tier.workers[s.tier.ids.index(rid)] for rid in chain}
        if master is not None:  # (the lost one's handle must not be an argument: see detach)
            relays["master"], relay_workers["master"] = master, worker
        manager = submit_actor(
            client,
            RolloutManager,
            cfg,
            {},
            relays["master"],
            partial,
            relays=relays,
            relay_workers=relay_workers,
            rollout_relays=m["rollout_relays"],
            worker=worker,
            resource="data",
        )
        manager.take_over(
            m,
            {rid: detach(h) for rid, h in live.items()},
            {rid: s.rollout_workers[rid] for rid in live},
        ).result(timeout)
        partial.set_relays([relays[r] for r in chain]).result(timeout)
        if orphans:  # (before the live rollouts register theirs: theirs stand)
            partial.restore(orphans).result(timeout)
        mark("manager_s")
        if master is None:
            a["trainer"].attach_data(buffer, manager).result(timeout)
        else:  # the new master heads the chain, the lost one's readers pull from it
            manager.replace_master(master, worker).result(timeout)
        registered = _each(alive, lambda r: r.attach_data(pool, buffer, partial), timeout)
        # A rollout that said what it holds and then was not attached (lost, or stalled,
        # since): its groups are outstanding, and its trajectories in no pool but the
        # lost one's log, which the new pool is about to start over. Restored from it as
        # a silent one's are, the new manager recovers them (or it registers its own
        # over them, should it attach after all); those the store has are left out.
        unattached = sorted(set(alive) - set(registered))
        if unattached:
            from laminar.partial import replay_log

            late = _orphans(replay_log(s.run_dir).entries, set(unattached))
            for uid in _stored(s.run_dir, late):
                del late[uid]
            if late:
                partial.restore(late).result(timeout)
            orphans.update(late)
        # The lost pool's log stood until now (a rebuild tried again, or a resume, reads
        # the lost rollouts' entries from it): the new pool starts it over with its own.
        partial.open_log().result(timeout)
        manager.start().result(timeout)
        mark("attach_s")
        a.update(pool=pool, partial=partial, buffer=buffer, manager=manager)
        self.rebuilt_on = worker
        if master is None:
            s.core_workers["data module"] = worker
        now = time.time()
        self.record.update(
            worker=worker,
            **plan.summary(),
            rollouts_holding=len(held),
            registered=sum(registered.values()),
            rollouts_attached=len(registered),
            rollouts_unattached=unattached,  # answered, then lost: restored from the log
            rollouts_gone=sorted(gone),  # lost meanwhile: recovered by the new manager
            rollouts_silent=silent,  # did not say what they hold: resumed from the log
            prompt_gap=gap,  # (prompt order skipped for what a silent one may hold)
            dispatch_lease=lease,
            restored_from_log=len(orphans),
            reissued=sorted(plan.reissue),  # (the groups of reissued_groups)
            rebuild_s=now - t0,
            phases=phases,
            restart_s=now - self.t_lost,
        )
        logger.warning(
            "data module rebuilt on %s in %.1f s: %d trajectories held again, %d consumed "
            "events written, %d groups outstanding, %d unfinished trajectories registered",
            worker,
            now - self.t_lost,
            len(plan.hold),
            len(plan.mark_consumed),
            len(plan.outstanding),
            sum(registered.values()),
        )


class CoreRestart(DataRestart):
    """One restart of a trainer and data module lost together: they shared the lost
    worker (``data=1, trainer=1``, the default on a local cluster). It is the two
    restarts above in one, and sound for the same reasons; what differs is that the
    trainer's record of what it consumed is lost too. The newest checkpoint stands in
    for it: the store recorded every trajectory consumed before the checkpoint's version
    ``V`` (the checkpoint commits it first), and every update after ``V`` is lost and
    redone. So the store is read with an empty record from ``V`` on
    (:func:`storage.resume.plan_rebuild`): whatever it says was consumed at ``V`` or
    later is held again, whole groups, and no trajectory is trained twice into the final
    weights. Once a worker with both roles is back:

    1. a new master relay starts on it, heading the live chain;
    2. the data module is rebuilt as in :class:`DataRestart`, knowing version ``M``, the
       newest any part of the run saw published (the driver's last look at the trainer
       and buffer, the master's publication records it copied, the rollouts' and relays'
       versions); the rollouts register their unfinished trajectories with it and send
       again what the lost store lacked;
    3. a new trainer loads the checkpoint and numbers its updates after ``M``, as in
       :class:`TrainerRestart`.

    :meth:`step` advances it once per poll; :attr:`record` is what ``summary.json``
    reports (``faults.core_restarts``).

    ``published``: the newest version of the lost master's publication records that the
    driver copied (:meth:`pipelines.driver_metrics.MetricsRecording._keep_publications`).
    The copy is taken late in a poll, after the trainer's stats: the trainer may have
    published a version since, which nothing else that outlived it saw (one relay on a
    single host, no rollout loaded it yet). Numbered after less, the new trainer
    published that number again: two sets of weights under it, and two rows of it in
    the ``publications`` table."""

    def __init__(
        self,
        schedule,
        lost_worker: str,
        last_trainer: dict | None,
        last_manager: dict,
        exclude: set[str] = frozenset(),
        published: int = 0,
    ) -> None:
        self.stand_in = trainer_stand_in(last_trainer, schedule.cfg.trainer.steps)
        self.exclude = {lost_worker, *exclude}  # (the lost group's workers)
        self.worker: str | None = None
        self.master = None
        self.group: _Group | None = None
        self.handle = None  # rank 0's, once running
        self.after = published  # M, as of the last try (a retry never numbers after less)
        self.ranks: list = []  # the other ranks' handles, once running
        self.finished = False  # the lost trainer had finished (_final_checkpoint): none starts
        super().__init__(schedule, lost_worker, last_manager)

    def _announce(self) -> None:
        logger.warning(
            "trainer and data module lost (worker %s gone) at version %s; restarting both "
            "within the run",
            self.lost_worker,
            self.stand_in["version"],
        )

    def step(self) -> bool:
        """Advance; ``True`` once the new data module and trainer run (the data module
        alone when the lost trainer had finished: :attr:`finished`). Raises
        :class:`ClusterError` when no worker with both roles (and one for each other
        rank) came within the longer of ``faults.trainer_restart_timeout_s`` and
        ``faults.data_restart_timeout_s``."""
        try:
            if self.group is None:
                self._begin()
                return self.finished
            if not self.group.done():
                faults = self.s.cfg.faults
                limit = max(faults.trainer_restart_timeout_s, faults.data_restart_timeout_s)
                self.group.check_workers(limit, "faults.trainer_restart_timeout_s")
                return False
            handle, self.ranks = self.group.run()
        except Exception as e:  # noqa: BLE001 — a worker went too: start again
            _start_again(self, e, redo_head=False)
            return False
        self.handle = handle
        _running(self)
        return True

    def _begin(self) -> None:
        s = self.s
        faults = s.cfg.faults
        # (the run's final checkpoint: the data module alone is rebuilt, on the worker
        # with both roles the master relay needs; no other rank is waited for)
        final = _final_checkpoint(s, self.record)
        picked = _pick_workers(s, self.exclude, with_data=True, ranks=1 if final else None)
        if picked is None:
            limit = max(faults.trainer_restart_timeout_s, faults.data_restart_timeout_s)
            if time.time() - self.t_lost > limit:
                raise ClusterError(
                    f"lost the trainer and data module (worker {self.lost_worker} is gone) "
                    f"and no worker with both roles (and {s.cfg.trainer.ranks - 1} more "
                    f"`trainer` workers) came back within {limit:g} s "
                    f"(faults.trainer_restart_timeout_s, faults.data_restart_timeout_s); "
                    f"{s.resume_hint()}"
                )
            return
        worker, rank_workers = picked
        self.worker = worker
        self.record["worker_wait_s"] = time.time() - self.t_lost
        after = self._newest_published()
        ckpt, version, after, fields = _restart_point(s.run_dir, after)
        self.after = after  # (a retry never numbers after less)
        self.master = _new_master(s, worker, self.last_manager["chain"])
        # (the record stands in for the trainer's: nothing consumed at V or later stands)
        record = {"consumed": {}, "since": version, "version": after}
        # (the new trainer's restart, which the new buffer must know: none at the final
        # checkpoint, where no trainer starts)
        restarts = _lineage(s, self, (version, after) if final is None else None)
        self._rebuild(worker, record=record, master=self.master, restarts=restarts)
        if final is not None:  # (rebuilt: the store's)
            _finish(self, final)
            return
        group = _Group(s, worker, rank_workers)
        steps = _steps(s, version, self.record, ckpt)
        group.start(ckpt, steps, after, s.actors["buffer"], self.master, restarts)
        self.group = group
        self.record.update(fields, steps=steps + after - version)  # (the version it ends at)

    def _newest_published(self) -> int:
        """``M``: the newest version the lost trainer published, as far as anything that
        outlived it saw (it told the buffer of each before publishing it; a rollout or a
        downstream relay may hold one the driver has not seen yet; the driver's copy of
        the master's records, ``published`` at the start, may hold one newer than all of
        these)."""
        from pipelines.driver import _answers

        s = self.s
        # (a try that failed saw it too: what saw it then may be lost since)
        # (the lost trainer's published version, not its learner's: one-step's is one
        # ahead between an update and its publication)
        seen = [self.after, self.stand_in["published"], max(s._published_fps, default=0)]
        if s._last_data_stats is not None:
            seen.append(s._last_data_stats[0]["version"])
        lost = self.last_manager["lost"]
        live = [r for i, r in enumerate(s.actors["rollouts"]) if f"r{i}" not in lost]
        seen += [st["version"] for st in _answers([lambda r=r: r.stats() for r in live])]
        down = [s.tier.handle(r) for r in self.last_manager["chain"][1:]]
        for st in _answers([lambda r=r: r.stats() for r in down]):
            seen += [*st["kept"], *st["arriving"]]  # (arriving: the master had published it)
        self.after = max(seen)
        return self.after
