"""The experience buffer's Dask actor: rewarded trajectories in, complete GRPO groups
out. :class:`ExperienceBuffer` wraps :class:`~laminar.buffer_core.BufferCore` (the pure
state machine: admission, group completion, samplers, eviction and filtering; its names
are importable from here too) and is the single writer of ``trajectories.zarr``,
appending whatever leaves the core in batches from a background thread; it resumes a run
in place, takes over from a lost buffer, and holds again what a lost update consumed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import queue
import threading
import time
from collections.abc import Iterable

import numpy as np

from laminar.buffer_core import (  # (re-exported: the core's names, imported from here)
    SAMPLERS,
    BufferCore,
    UidSet,
)
from laminar.contract import Trajectory
from storage.resume import group_of
from storage.schema import SCALARS
from storage.stores import StoreError
from storage.trajectories import WriterReplaced

__all__ = ["SAMPLERS", "BufferCore", "ExperienceBuffer", "UidSet"]

logger = logging.getLogger(__name__)


# Pauses (s) before each try of a batch the disk refused, when the buffer closes and no
# later batch will carry it: a brief fault (a mount coming back) does not cost it.
_CLOSE_RETRY_S = (0.1, 0.5, 2.0)


class ExperienceBuffer:
    """Dask actor around :class:`BufferCore`; single writer of the trajectory store.

    A trajectory is stored when it is admitted (status ``buffered``) and a leave event
    when it leaves (:mod:`storage.trajectories`), in batches of ``flush_records`` or every
    ``flush_interval_s``: the store holds every admitted trajectory but the last batch.
    One that leaves before its batch is written is written once, as it left.

    Methods are ``async``: they run on the worker's event loop, never on the actor thread,
    so calls from rollouts and the trainer interleave and the buffer may call the prompt
    pool on the same worker without deadlock.
    """

    def __init__(
        self,
        run_dir: str,
        pool,
        cfg,
        partial=None,
        resume=None,
        schedule: str = "laminar",
        rebuild=None,
    ) -> None:
        """``partial``: the partial-response pool, told which trajectories arrived.
        ``resume``: the :class:`storage.resume.ResumePlan` of a run resumed in place.
        ``schedule``: the run's ``pipeline.schedule``, recorded in the store.
        ``rebuild``: the :class:`storage.resume.RebuildPlan` of a data module rebuilt
        within the run, in place of a lost one (docs/faults.md).

        Either plan names the trainer restarts before this buffer (``restarts``: it
        heard none of them, :meth:`trainer_restarted`), for ``max_train_staleness`` to
        count along the weights' lineage from the start."""
        from storage.trajectories import TrajectoryWriter

        plan = resume if resume is not None else rebuild
        restarts = list(plan.restarts) if plan is not None else []
        self.core = BufferCore(
            cfg.sampler,
            max_train_staleness=cfg.max_train_staleness,
            dynamic_sampling=cfg.dynamic_sampling,
            restarts=restarts,
        )
        if restarts:
            logger.info("buffer: the trainer restarts before it (V, M): %s", restarts)
        self.pool, self.partial = pool, partial
        self.version = 0
        self.writer = TrajectoryWriter(run_dir, schedule)
        self.flush_records = cfg.flush_records
        self.flush_interval_s = cfg.flush_interval_s
        self._records: dict[str, Trajectory] = {}  # admitted, not yet handed to the writer
        self._events: list[dict] = []  # leave events of trajectories handed to it before
        self._last_flush = time.time()
        self._jobs: queue.Queue[tuple[list[dict], list[dict]] | None] = queue.Queue()
        self._written = 0
        # uids the store committed, for the partial-response pool to forget (appended by
        # the writer thread; a deque's append and popleft are thread-safe) ...
        self._committed: collections.deque[str] = collections.deque()
        # ... and for the rollout that sent them: it keeps every trajectory it sent
        # until then, to send again to a buffer rebuilt after this one is lost
        self._durable: dict[str, collections.deque[str]] = {}
        self._stored_before = UidSet()  # a rebuilt buffer's store, as it found it
        self._consumed_elsewhere: dict[str, tuple[int, float]] = {}
        self._groups_consumed: set[str] = set()  # (counted, of those: _admit_consumed)
        # The last batch sampled for a caller's request id, for a retry of it (sample)
        self._answer: tuple[object, list[Trajectory]] | None = None
        self._sampling = asyncio.Lock()  # (one sample at a time: a retry waits its first)
        # Tokens of the trainers that asked for batches (sample's request), and of those
        # lost: every one seen before the last trainer_restarted (refused since)
        self._trainers_seen: set[object] = set()
        self._lost_trainers: set[object] = set()
        self._unreleased: list[Trajectory] = []  # left, their release to the pool failed
        self._write_error: str | None = None
        self._unwritten = 0  # records and events the disk refused, held to try again
        self._refused = 0  # ... and those the store refused as such: lost (logged)
        self._refused_events = 0  # (of them, leave events: the store then disagrees)
        self._refused_error = ""  # (the last)
        self._writer_thread = threading.Thread(target=self._write_loop, daemon=True)
        if resume is not None:
            self._resume(run_dir, resume)
        if rebuild is not None:
            self._rebuild(run_dir, rebuild)
        self._writer_thread.start()  # (after: a start that failed leaves no thread)

    def _resume(self, run_dir: str, plan) -> None:
        """Re-admit the plan's groups (back to ``buffered``) and drop the rest. The
        store records the resume (when, from which version) first, before this writer
        commits anything.

        The resume's events (``dropped``, and ``buffered`` for what a lost update had
        consumed) are committed here, before the buffer serves anything: queued to the
        writer thread, they were lost with a data module lost before that job ran, and
        its rebuild (:func:`storage.resume.plan_rebuild`) held the dropped groups again,
        trajectories of weights the resume redoes under the same numbers. A store that
        does not take them fails the start, naming it."""
        try:
            self.writer.record_resume(plan.version, time.time())
        except Exception as e:  # noqa: BLE001 — named, whatever it is
            raise _start_failed(self.writer.path, "its resume", e) from e
        arrays = _scalars(run_dir)
        rows = {uid: i for i, uid in enumerate(arrays["uid"].tolist())}
        readmit = [rows[u] for u in plan.readmit]
        self._hold_again(arrays, readmit, "resume", stored=arrays["uid"], stopped=True)
        self.version = plan.version
        now = time.time()  # (they leave now, at the checkpoint's version)
        self._events += [
            _event(uid, "dropped", t_leave=now, leave_version=plan.version) for uid in plan.drop
        ]
        try:
            self.writer.append([], self._events)  # (the writer thread has no job yet)
        except Exception as e:  # noqa: BLE001 — named, whatever it is
            raise _start_failed(self.writer.path, "the resume's leave events", e) from e
        self._events = []

    def _rebuild(self, run_dir: str, plan) -> None:
        """Take over from a lost buffer: hold again what the plan says, write the
        consumed events its store lacks, and count what the store holds as this
        buffer's own (its counters go on from the lost one's)."""
        arrays = _scalars(run_dir)
        rows = {uid: i for i, uid in enumerate(arrays["uid"].tolist())}
        self._stored_before = UidSet(arrays["uid"])
        held = [rows[u] for u in plan.hold]
        self._hold_again(arrays, held, "rebuild", stored=self._stored_before)
        for uid, (sample_version, t_sample) in plan.mark_consumed.items():
            self._events.append(_event(uid, "consumed", sample_version, t_sample))
        # (what a resume dropped and the store lacks the event of: storage.resume._superseded)
        now = time.time()
        self._events += [
            _event(uid, "dropped", t_leave=now, leave_version=plan.version) for uid in plan.drop
        ]
        self._consumed_elsewhere = dict(plan.consumed_elsewhere)
        self.version = plan.version
        status = arrays["status"].copy()
        status[held] = "buffered"
        status[[rows[u] for u in plan.mark_consumed]] = "consumed"
        status[[rows[u] for u in plan.drop]] = "dropped"
        c = self.core.counts
        c["inserted"] += len(rows)
        for name in ("consumed", "discarded", "evicted", "filtered"):
            mask = status == name
            c[name] += int(mask.sum())
            c[f"groups_{name}"] += len(set(arrays["prompt_uid"][mask].tolist()))
        # (a group consumed elsewhere may have siblings stored, counted here already)
        self._groups_consumed = set(arrays["prompt_uid"][status == "consumed"].tolist())
        self._flush(force=True)

    def _hold_again(
        self,
        arrays,
        rows: list[int],
        why: str,
        stored: Iterable[str] = (),
        stopped: bool = False,
    ) -> int:
        """Hold again the stored trajectories at ``rows`` of the store's ``arrays``
        (:func:`_scalars`: their tokens are read for these rows alone), by GRPO group,
        back to ``buffered`` (one consumed by a lost update gets a ``buffered`` event,
        with the time it is held again: :data:`storage.trajectories.HELD_AGAIN`).
        ``why``: as :meth:`BufferCore.restore`'s.
        ``stored``: uids never to be admitted again. ``stopped``: the run was stopped
        until now (a resume). Returns how many groups."""
        from storage.trajectories import records_at

        now = time.time()
        groups: dict[str, list[Trajectory]] = {}
        for rec in records_at(arrays, rows, self.writer.path):
            t = Trajectory(**rec)
            t.status, t.sample_version, t.t_sample = "buffered", -1, math.nan
            t.leave_version, t.t_leave = -1, math.nan
            groups.setdefault(t.prompt_uid, []).append(t)
        origins = self._origins(arrays, rows, now, stopped)
        self.core.restore(list(groups.values()), stored, why, origins)
        self._events += [
            _event(str(arrays["uid"][i]), "buffered", t_sample=now)
            for i in rows
            if arrays["status"][i] != "buffered"
        ]
        return len(groups)

    def _origins(self, arrays, rows: list[int], now: float, stopped: bool) -> dict[str, float]:
        """For the trajectories at ``rows`` held again ``now``, when their age counts from
        (:meth:`BufferCore.oldest_insert`): their time in the buffer so far (the store's
        stays: :func:`storage.trajectories.time_in_buffer`; one consumed by an update that
        was lost, up to its ``t_sample``; one still held when the run stopped, up to the
        stop), counted back from ``now`` over the time the run went. So a trajectory
        never held before, still buffered, keeps its ``t_insert``."""
        from storage.trajectories import run_stops, time_in_buffer

        if not rows:
            return {}
        pauses, last = run_stops(self.writer.path, arrays)
        stops = [*pauses, (last, now)] if stopped and math.isfinite(last) else pauses
        r = np.asarray(rows, dtype=np.int64)
        consumed = arrays["status"][r] == "consumed"
        until = np.where(consumed, arrays["t_sample"][r], last if stopped else now)
        ages = time_in_buffer(arrays["t_held"][r], arrays["held_s"][r], until, pauses)
        out = {}
        for i, age in zip(rows, ages.tolist(), strict=True):
            fine = math.isfinite(age)  # (a damaged store's: counted from t_insert)
            out[str(arrays["uid"][i])] = (
                _walk_back(now, age, stops) if fine else float(arrays["t_insert"][i])
            )
        return out

    def _write_loop(self) -> None:
        # A batch the store refused goes before the next one, in order (events follow
        # their records): after a brief write error (a full disk, a lost mount) nothing
        # is lost; it is written once the store takes it. Surfaced meanwhile through
        # stats() and sync(), which queues an empty job to try it again by itself.
        pending: tuple[list, list] = ([], [])
        while (job := self._jobs.get()) is not None:
            try:
                pending = self._write(pending[0] + job[0], pending[1] + job[1])
            finally:
                self._jobs.task_done()
        # The stop: no later batch will carry a refused one, so it is tried a few more
        # times on its own before the thread ends (close() waits for it).
        for pause in _CLOSE_RETRY_S:
            if not self._unwritten:
                return
            time.sleep(pause)
            pending = self._write(*pending)
        if self._unwritten:
            logger.error(
                "the buffer closes with %d records and %d leave events the trajectory "
                "store could not take (%s): they are lost",
                len(pending[0]),
                len(pending[1]),
                self._write_error,
            )

    def _write(self, records: list[dict], events: list[dict]) -> tuple[list, list]:
        """Append to the store; returns what it could not take yet, to try again (a disk
        error: the rest of the batch, kept whole and in order).

        A batch the store refuses as such, not the disk (a record it cannot take): tried
        whole again, it would block every later batch; dropped whole, it lost every
        record and leave event with it (consumed events of groups stored long before
        too: the store showed them ``buffered``, and a resume trained them again). So a
        refused piece is split, its records one at a time, then its events (all at once,
        else one at a time), and only what the store refuses is lost: logged by uid and
        counted. A lost record is a trajectory the store lacks, as if never generated (a
        resume generates its group's missing sample again); a lost leave event leaves
        the store disagreeing with the trainer (a consumed trajectory shown buffered is
        trained again on resume), so every sync() after reports it and no checkpoint is
        written past it. An event of a refused record is written like the rest: readers
        skip it and the audit reports it."""
        pieces = [(records, events)]
        while pieces:
            rs, es = pieces.pop(0)
            error = self._append(rs, es)
            if error is None:
                continue
            # (the disk, the mount: kept, tried again; another writer took the store
            # over: kept, written by none, not split record by record to be refused)
            if isinstance(error, OSError | WriterReplaced):
                self._write_error = f"{type(error).__name__}: {error}"
                left = [(rs, es), *pieces]
                records = [r for piece, _ in left for r in piece]
                events = [e for _, piece in left for e in piece]
                self._unwritten = len(records) + len(events)
                return records, events
            if len(rs) + len(es) > 1:
                split = [([r], []) for r in rs] + ([([], es)] if rs and es else [])
                pieces[:0] = split or [([], [e]) for e in es]
                continue
            what = (
                f"record {rs[0]['uid']!r}"
                if rs
                else f"{es[0]['status']!r} event of {es[0]['uid']!r}"
            )
            logger.error(
                "the trajectory store refused the %s: lost (%s: %s)",
                what,
                type(error).__name__,
                error,
            )
            self._refused += 1
            self._refused_events += not rs
            self._refused_error = f"the {what}: {type(error).__name__}: {error}"
        self._write_error, self._unwritten = None, 0
        return [], []

    def _append(self, records: list[dict], events: list[dict]) -> Exception | None:
        """Append and commit; the error the store raised, or ``None``."""
        try:
            self._written = self.writer.append(records, events)
        except Exception as e:  # noqa: BLE001 — the caller tells the disk's from the store's
            return e
        self._committed.extend(r["uid"] for r in records)
        for r in records:
            sent = self._durable.get(r["rollout_ids"].rsplit(",", 1)[-1])
            if sent is not None:
                sent.append(r["uid"])
        return None

    def _flush(self, force: bool = False) -> None:
        """Hand the pending records and events to the writer thread when due. Records are
        taken as they stand now: a trajectory that already left is written as it left.
        Forced with nothing pending, it still wakes the writer for a batch the store
        refused (an empty job: that batch is tried again)."""
        n = len(self._records) + len(self._events)
        due = time.time() - self._last_flush > self.flush_interval_s
        if n and (force or due or n >= self.flush_records):
            self._jobs.put(([t.to_record() for t in self._records.values()], self._events))
            self._records, self._events = {}, []
            self._last_flush = time.time()
        elif force and self._unwritten:
            self._jobs.put(([], []))

    def _leave(self, trajs: list[Trajectory]) -> None:
        for t in trajs:
            if t.uid not in self._records:  # stored already: its leave is an event
                self._events.append(
                    _event(
                        t.uid, t.status, t.sample_version, t.t_sample, t.t_leave, t.leave_version
                    )
                )
        self._flush()

    async def _stranded(
        self, n_groups: int, version: int
    ) -> tuple[list[Trajectory], list[Trajectory] | None]:
        """``same_version`` found no batch: if nothing more can arrive (every group the
        pool may have out is complete here, and it may hand out no more), the oldest
        version's groups are evicted (:meth:`BufferCore.evict_stranded`), freeing their
        slots for groups of the versions now generating. Returns what left and the batch,
        as :meth:`BufferCore.take`: while the pool answers, inserts run (a group may
        complete, one may come in too stale), so the batch is sought again on what is
        held then, and the groups are evicted only if there is still none: else they
        were evicted by a decision made on what the buffer held before (the oldest
        version's, which may now be a batch)."""
        room = await self.pool.room()
        left, batch = self.core.take(n_groups, version=version, now=time.time())
        full = room["full"] and room["outstanding"] <= len(self.core.ready)
        if batch is not None or not self.core.ready or not full:
            return left, batch
        out = self.core.evict_stranded(version, time.time())
        logger.warning(
            "buffer.sampler=same_version: no behavior version holds a batch and every slot "
            "is taken; %d groups of the oldest version evicted to free them",
            len({t.prompt_uid for t in out}),
        )
        return left + out, None

    async def _release(self, trajs: list[Trajectory]) -> None:
        """Groups that left (any status): their leave recorded, then their back-pressure
        slots freed. A release the pool did not take (the call raised) is tried again
        with the next (the pool ignores a group released twice): its groups left the
        buffer already, and nothing else would ever free their slots."""
        if trajs:
            self._leave(trajs)
        pending, self._unreleased = self._unreleased + trajs, []
        if not pending:
            return
        uids = sorted({t.prompt_uid for t in pending})
        trained = {t.prompt_uid for t in pending if t.status == "consumed"}
        try:
            await self.pool.release(uids, tuple(u for u in uids if u not in trained))
        except BaseException:
            self._unreleased = pending + self._unreleased
            raise

    async def insert(self, trajs: list[Trajectory], rollout_id: str = "") -> dict:
        """Admit rewarded trajectories (a uid seen before is dropped: a recovered
        trajectory may arrive twice), store them, and tell the partial-response pool
        they are safe. Returns the depth and, for ``rollout_id``, the uids it sent that
        the store has committed since its last insert (it may forget those)."""
        now = time.time()
        # (before anything is flushed: the writer thread reports a commit to the list of
        # the rollout that sent it, if it has one by then; a rollout's first trajectories
        # were never reported stored, kept and sent again at every rebuild)
        done = self._durable.setdefault(rollout_id, collections.deque()) if rollout_id else None
        consumed = [t for t in trajs if t.uid in self._consumed_elsewhere]
        if consumed:
            trajs = [t for t in trajs if t.uid not in self._consumed_elsewhere]
            await self._admit_consumed(consumed, now)
        admitted: list[Trajectory] = []
        leaving = self.core.insert(trajs, version=self.version, now=now, admitted=admitted)
        self._records.update((t.uid, t) for t in admitted)
        self._flush()
        await self._release(leaving)
        if self.partial is not None:
            await self.partial.hold([t.uid for t in trajs])
            # (sent again to a rebuilt buffer, and in the store it found: the pool holds
            # them finished, registered by their rollout, and need not keep them)
            self._committed.extend(t.uid for t in trajs if t.uid in self._stored_before)
            await self._forget_committed()
        stored = []
        if done is not None:
            while done:
                stored.append(done.popleft())
            # sent again to a rebuilt buffer, and in the store it found: safe already
            stored += [t.uid for t in trajs if t.uid in self._stored_before]
        return {"depth": self.core.depth, "stored": stored}

    async def _admit_consumed(self, trajs: list[Trajectory], now: float) -> None:
        """Trajectories the trainer consumed from the lost buffer before its store had
        them (:class:`storage.resume.RebuildPlan` ``consumed_elsewhere``), sent again by
        their rollout: stored as consumed, their groups released."""
        for t in trajs:
            sample_version, t_sample = self._consumed_elsewhere.pop(t.uid)
            # (when it finished is gone with the lost buffer: by the version it was
            # sampled at, which bounds it)
            t.finish_version = max(t.behavior_version, sample_version)
            t.t_insert = min(now, t_sample)
            t.sample_version, t.t_sample, t.status = sample_version, t_sample, "consumed"
            t.leave_version, t.t_leave = sample_version, t_sample
            self.core.seen.add(t.uid)
            self.core.counts["inserted"] += 1
            self.core.counts["consumed"] += 1
            if t.prompt_uid not in self._groups_consumed:
                self._groups_consumed.add(t.prompt_uid)
                self.core.counts["groups_consumed"] += 1
            self._records[t.uid] = t
        self._flush()
        self._unreleased += trajs  # (their leave is their record: released alone)
        await self._release([])

    async def _forget_committed(self) -> None:
        """Tell the partial-response pool which trajectories the store now has: it keeps
        each until then, so that the pool and the store together always hold every
        trajectory started (``RUN_DIR/partial.zarr`` outlives a lost data module)."""
        uids = []
        while self._committed:
            uids.append(self._committed.popleft())
        if uids and self.partial is not None:
            await self.partial.forget(uids)

    async def sample(
        self, n_groups: int, version: int, request: object = None
    ) -> list[Trajectory] | None:
        """``n_groups`` complete groups for the update at the trainer's ``version``, or
        ``None`` if there are none yet; the groups too stale to train at it leave first.
        Both in one step (:meth:`BufferCore.take`), what left released after: an insert
        that ran while this awaits the pool is checked against the published version,
        one behind the trainer's under ``one_step`` (and a rebuilt data module's may lag
        more), so a group it admitted may be too stale to sample now.

        ``request``: the caller's id of the batch it asks for (the trainer's: its own
        token and how many batches it has received). A call made again with the same id
        gets the batch the first got, sampled once: its answer never reached the caller
        (the trainer's ``cluster.actor_timeout_s`` ran out, or releasing the groups to
        the pool raised after they were taken) and the trainer asks again, which took a
        second batch for the same update; the first, recorded consumed, was never
        trained. The batch is kept until a call with another id (or until the trainer
        restarts); a buffer rebuilt after a loss has none, and its plan holds the lost
        buffer's again (:func:`storage.resume.plan_rebuild`: not in the trainer's
        record).

        A request is ``(trainer token, n)``: once the trainer restarted
        (:meth:`trainer_restarted`), a call of a trainer whose token this buffer had
        seen before is the lost trainer's (one still on its way, or waiting its turn)
        and is answered ``None``, taking nothing: a batch taken for it would be recorded
        consumed and trained by no one."""
        trainer = _trainer_of(request)
        if trainer is not None:
            self._trainers_seen.add(trainer)
        if trainer in self._lost_trainers:
            return self._refuse_lost(request)
        if (batch := self._answered(request)) is not None:
            return batch
        async with self._sampling:
            if trainer in self._lost_trainers:  # (lost while this call waited its turn)
                return self._refuse_lost(request)
            if (batch := self._answered(request)) is not None:  # (the first, done meanwhile)
                return batch
            if request is not None:
                self._answer = None  # (a new request: the last one's batch was received)
            left, batch = self.core.take(n_groups, version=version, now=time.time())
            if batch is None and self.core.sampler == "same_version" and self.core.ready:
                await self._release(left)  # (before the pool counts what is out)
                left, batch = await self._stranded(n_groups, version)
            if batch is not None and request is not None:
                self._answer = (request, batch)  # (before anything else may raise)
            await self._release(left + (batch or []))
            self._flush()  # the trainer polls while it waits: pending writes go out on time
            await self._forget_committed()
            return batch

    def _refuse_lost(self, request: object) -> None:
        logger.warning(
            "buffer: sample request %r of a lost trainer (the trainer restarted since): "
            "refused, nothing taken",
            request,
        )

    def _answered(self, request: object) -> list[Trajectory] | None:
        """The batch sampled for ``request`` already, if so (:meth:`sample`)."""
        if request is None or self._answer is None or self._answer[0] != request:
            return None
        logger.warning(
            "buffer: sample request %r asked again (its answer was lost: a timeout, or a "
            "failed release); the same batch of %d trajectories again",
            request,
            len(self._answer[1]),
        )
        return self._answer[1]

    async def trainer_restarted(self, version: int, after: int | None = None) -> dict:
        """The trainer was lost and restarts from its checkpoint at ``version``: the
        updates after it are gone, so the groups they consumed (``sample_version >=
        version``) are held again, whole, to be trained by the restarted trainer (each
        trajectory's last leave event is the one that stands: nothing ends up trained
        twice into the weights). They were sampled by versions the new trainer's numbers
        come after (:class:`~laminar.trainer.Trainer` ``after_version``), so any may be
        trained. Returns how many came back (``readmitted``, in ``groups``), and
        ``consumed_unstored`` as :meth:`sync` does: what the lost trainer consumed before
        ``version`` from a lost buffer that never stored it, not sent again yet. The
        restarted trainer starts its record with it (``Trainer(consumed=...)``): the
        lost trainer's record carried it past each checkpoint, and a data module lost
        before the new trainer's first checkpoint rebuilt from a record without it,
        admitted it as new when sent again, and its group was trained twice.

        ``after``: the newest version the lost trainer published (the restarted one
        numbers its updates after it): ``max_train_staleness`` then counts along the
        weights' lineage, not the numbers (:meth:`BufferCore.trainer_restarted`).

        Under the sampling lock: a sample of the lost trainer that was waiting on the
        pool (``same_version``'s :meth:`_stranded`) finishes first, and what it took is
        held again here; every trainer token seen so far is the lost trainer's, refused
        from now on (:meth:`sample`)."""
        async with self._sampling:
            self._answer = None  # (the lost trainer's: held again below if it was sampled)
            self._lost_trainers |= self._trainers_seen
            if after is not None:
                self.core.trainer_restarted(version, after)
            await self._release([])  # (a failed release first: before the pool holds again)
            await self._write_through()  # the lost updates' consumed events are in the store
            arrays = _scalars(self.writer.path)
            lost = (arrays["status"] == "consumed") & (arrays["sample_version"] >= version)
            rows = np.flatnonzero(lost).tolist()
            # What a lost update consumed from a lost buffer before its store had it
            # (a rebuild's consumed_elsewhere) and its rollout has not sent again yet is
            # no longer consumed either: sent again, it is admitted as new and completes
            # its group, held again above or here. Left as it was, it was stored
            # consumed at a version no surviving update trained at, and the sibling held
            # again waited for it for ever.
            lost_elsewhere = [u for u, (v, _) in self._consumed_elsewhere.items() if v >= version]
            for uid in lost_elsewhere:
                del self._consumed_elsewhere[uid]
            again = {str(arrays["prompt_uid"][i]) for i in rows}
            again |= {group_of(u) for u in lost_elsewhere}
            # Released when consumed, they are out again: back-pressure counts them until
            # they leave again (a rebuilt data module's pool does the same). The pool
            # hears it before the buffer holds them: else a call running while it is told
            # (a version published) could evict one and release it before it was out
            # again, a release the pool ignores, and its slot stayed taken for good.
            await self.pool.hold_again(sorted(again))
            groups = self._hold_again(arrays, rows, "trainer_restart")
            self._flush(force=True)
            if lost_elsewhere:
                logger.info(
                    "buffer: %d trajectories a lost update consumed before the lost "
                    "buffer stored them are admitted as new when sent again",
                    len(lost_elsewhere),
                )
            return {
                "readmitted": len(rows),
                "groups": groups,
                "consumed_unstored": dict(self._consumed_elsewhere),
            }

    async def update_skipped(self) -> None:
        """The trainer consumed a batch and published no version (the pool's dispatch
        rule makes up for it)."""
        await self.pool.update_skipped()

    async def version_published(self, version: int) -> None:
        self.version = max(self.version, version)
        await self.pool.version_published(self.version)  # its staleness bound counts from it
        # Groups the next update would train too stale leave now, freeing dispatch.
        await self._release(self.core.evict_stale(self.version, time.time()))

    async def pool_stats(self) -> dict:
        """The prompt pool's counters (``dispatched``: where the prompt order stands),
        for the trainer's checkpoints (:data:`laminar.prompt_pool.DATA_STATE`)."""
        return await self.pool.stats()

    async def _write_through(self) -> None:
        """Write everything pending and wait until it is committed; raises while the disk
        refuses writes."""
        self._flush(force=True)
        await asyncio.to_thread(self._jobs.join)
        await self._forget_committed()
        if self._write_error is not None:
            raise RuntimeError(f"the trajectory store cannot be written: {self._write_error}")

    async def sync(self) -> dict:
        """Write everything pending and wait until it is committed. The trainer calls it
        before each checkpoint, so that the store records every trajectory the
        checkpoint's updates consumed: it raises while the disk refuses writes, and for
        good once the store refused a leave event as such (lost: a checkpoint past it
        would not match the store). A refused record is lost alone: counted in
        ``write_refused``, it does not stop checkpoints.

        Returns ``written`` (the number of stored trajectories) and
        ``consumed_unstored``: what the trainer consumed from a lost buffer before its
        store had it and its rollout has not sent again yet (uid -> sample version, time;
        a rebuild's ``consumed_elsewhere``). The store records none of it, so the trainer
        keeps it in its record past the checkpoint: dropped there, a second rebuild
        before it arrives knew it no more, admitted it as new, and its group never
        completed (or was trained twice). Read before the write: one that arrives while
        this waits is stored consumed, perhaps after the commit, and is kept too."""
        unstored = dict(self._consumed_elsewhere)
        await self._write_through()
        if self._refused_events:
            raise RuntimeError(
                f"the trajectory store refused {self._refused_events} leave events, lost "
                f"(logged by uid; the last refusal: {self._refused_error}): the store does "
                "not record everything the trainer consumed"
            )
        return {"written": self._written, "consumed_unstored": unstored}

    async def groups(self) -> list[str]:
        """The prompt groups the buffer holds samples of (ready, or waiting for their
        siblings), and those samples' uids (:meth:`BufferCore.known`): they leave in
        time, released to the prompt pool. (The driver asks at a lost rollout's fence,
        :meth:`laminar.prompt_pool.PromptPool.reissue_stranded`.)"""
        return self.core.known()

    async def stats(self) -> dict:
        return {
            **self.core.stats(),
            "consumed_unstored": len(self._consumed_elsewhere),  # (a rebuilt buffer's)
            "version": self.version,
            "written": self._written,
            # the disk's error while it refuses writes, else the last loss the store's
            "write_error": self._write_error or self._refused_error or None,
            "write_refused": self._refused,  # records and events lost (logged by uid)
        }

    async def close(self) -> dict:
        """Write what is pending (what the buffer still holds is stored as ``buffered``)
        and wait for the writer. Returns :meth:`stats` with what it held as it closed
        (``depth``, its groups, its oldest trajectory's age: :data:`_CONTENTS`)."""
        held = self.core.stats()  # (before the drain, which empties the core)
        self.core.drain()
        self._flush(force=True)
        self._jobs.put(None)
        await asyncio.to_thread(self._writer_thread.join)
        await self._forget_committed()
        return await self.stats() | {k: held[k] for k in _CONTENTS}


# What BufferCore.stats() says of the trajectories held, which a drain empties.
_CONTENTS = (
    "depth",
    "oldest_t_insert",
    "oldest_age_s",
    "read_at",
    "ready_groups",
    "partial_groups",
)


def _trainer_of(request: object) -> object:
    """The trainer token of a sample request ``(token, n)`` (``None``: no request)."""
    return request[0] if isinstance(request, tuple) and request else None


def _scalars(run_dir) -> dict[str, np.ndarray]:
    """Every per-trajectory field of the store, its leave events applied, and no tokens:
    a buffer holding trajectories again reads theirs alone
    (:func:`storage.trajectories.records_at`). The whole store's tokens are 9.6 bytes a
    response token: 38 GB for a million trajectories of 4k tokens, over two minutes to
    read, which outlasted the rollouts' wait for a rebuilt data module."""
    from storage.trajectories import open_trajectories

    return open_trajectories(run_dir, list(SCALARS))


def _walk_back(t: float, seconds: float, stops: list[tuple[float, float]]) -> float:
    """The moment ``seconds`` of the run's going time before ``t`` (epoch seconds): the
    ``stops`` (from, to) in between are skipped.

    >>> _walk_back(100.0, 5.0, [(60.0, 98.0)])
    57.0
    """
    for start, end in sorted(stops, reverse=True):
        if start >= t:
            continue
        ran = t - min(end, t)
        if seconds <= ran:
            break
        seconds -= ran
        t = start
    return t - seconds


def _start_failed(store, what: str, error: BaseException) -> StoreError:
    """A resumed buffer's start failed: the store did not take ``what``."""
    return StoreError(
        f"{str(store)!r} did not take {what} ({type(error).__name__}: {error}): the "
        "resume fails before the buffer serves anything; free the disk or fix the store "
        "and resume the run again"
    )


def _event(
    uid: str,
    status: str,
    sample_version: int = -1,
    t_sample: float = math.nan,
    t_leave: float | None = None,
    leave_version: int | None = None,
) -> dict:
    """A leave event of the trajectory store (:data:`storage.schema.EVENT_FIELDS`): when
    it left and at which version (``t_leave``, ``leave_version``), for one consumed by
    default its sampling's; one held again (``buffered``) has neither."""
    consumed = status == "consumed"
    if t_leave is None:
        t_leave = t_sample if consumed else math.nan
    if leave_version is None:
        leave_version = sample_version if consumed else -1
    return {
        "uid": uid,
        "status": status,
        "sample_version": sample_version,
        "t_sample": t_sample,
        "t_leave": t_leave,
        "leave_version": leave_version,
    }
