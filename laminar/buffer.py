"""The experience buffer: rewarded trajectories in, complete GRPO groups out.

:class:`BufferCore` is the pure state machine: it admits trajectories one by one, holds a
group until all its siblings are in, and hands out complete groups by a sampler policy:

* ``fifo`` — in the order groups completed (the paper's);
* ``oldest_version`` — lowest behavior version first (bounds the tail of staleness);
* ``same_version`` — every batch from one behavior version, the oldest that has enough.

Optionally, groups whose training would exceed ``max_train_staleness`` versions
(``sample_version - behavior_version``) are *evicted*, and groups whose rewards are all
equal — no GRPO signal — are *filtered* (DAPO's dynamic sampling). Every trajectory leaves
exactly once, with a status (consumed, discarded, evicted, filtered, or still buffered at
the end) — nothing is dropped silently. :class:`ExperienceBuffer` is the Dask
actor around it: the single writer of ``trajectories.zarr``, appending whatever leaves the
core in batches from a background thread.
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from laminar.contract import Trajectory
from storage.schema import SCALARS

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    size: int
    members: list[Trajectory] = field(default_factory=list)


SAMPLERS = ("fifo", "oldest_version", "same_version")

# Pauses (s) before each try of a batch the disk refused, when the buffer closes and no
# later batch will carry it: a brief fault (a mount coming back) does not cost it.
_CLOSE_RETRY_S = (0.1, 0.5, 2.0)


def _no_signal(members: list[Trajectory]) -> bool:
    """Every reward equal, compared as the store holds them (float32): a sibling held
    again from it (a resume, a rebuild) reads 0.1 as 0.10000000149 beside a fresh 0.1."""
    as_stored = SCALARS["reward"].type
    return len({float(as_stored(m.reward)) for m in members}) == 1


def _behavior_version(members: list[Trajectory]) -> int:
    """A group's behavior version for staleness: its oldest member's."""
    return min(m.behavior_version for m in members)


# The uids the prompt pool and rollouts give trajectories: prompt n's sample i, written
# ``p{n:08d}-{i:03d}`` (laminar.prompt_pool, laminar.rollout).
_UID = re.compile(r"p([0-9]{8,})-([0-9]{3,})")
# A sample index from it on is kept as a string (a bitmask of that many bits: 128 bytes).
_MAX_SAMPLE = 1024
# Of a 13-character uid p{n:08d}-{i:03d}, where the digits of n and i are.
_DIGITS = [*range(1, 9), 10, 11, 12]


def _uid_key(uid: str) -> tuple[int, int] | None:
    """``(n, i)`` of a uid written exactly ``p{n:08d}-{i:03d}``, else ``None``.

    >>> _uid_key("p00000042-007"), _uid_key("p123456789-1000"), _uid_key("p42-7")
    ((42, 7), (123456789, 1000), None)
    """
    if len(uid) == 13 and uid[0] == "p" and uid[9] == "-" and uid.isascii():
        n, i = uid[1:9], uid[10:]  # (8 and 3 ASCII digits: written so)
        return (int(n), int(i)) if n.isdigit() and i.isdigit() else None
    m = _UID.fullmatch(uid)
    if m is None:
        return None
    n, i = int(m[1]), int(m[2])
    if i >= _MAX_SAMPLE or f"p{n:08d}-{i:03d}" != uid:  # (one form per uid: "p042..." not)
        return None
    return n, i


def _uid_keys(uids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of a string array, the positions of the uids ``p{n:08d}-{i:03d}`` with 8 digits of
    n and i < 64 (13 characters), and their ``n`` and ``i``: read at once, the rest one
    by one (:func:`_uid_key`)."""
    none = np.zeros(0, np.int64)
    if uids.dtype.kind not in "TU" or not uids.size:
        return none, none, none
    at = np.flatnonzero(np.strings.str_len(uids) == 13)
    fixed = uids[at].astype("<U13")
    c = fixed.view(np.uint32).reshape(len(at), 13)  # (a code point a character)
    d = c[:, _DIGITS] - np.uint32(ord("0"))  # (0..9 for a digit: below "0" wraps)
    ok = (c[:, 0] == ord("p")) & (c[:, 9] == ord("-")) & (d <= 9).all(axis=1)
    n = d[:, 0].astype(np.int64)
    for k in range(1, 8):
        n = n * 10 + d[:, k]
    i = (d[:, 8] * 100 + d[:, 9] * 10 + d[:, 10]).astype(np.int64)
    ok = np.flatnonzero(ok & (i < 64))
    # (numpy's string length leaves out NULs at the end, and so does <U13: the uid must
    # be these 13 characters, which == tells, NULs compared)
    ok = ok[uids[at[ok]] == fixed[ok].astype(np.dtypes.StringDType())]
    return at[ok], n[ok], i[ok]


class UidSet:
    """A set of trajectory uids (``add``, ``in``, ``update``, ``len``), exact for any
    string and compact for those the prompt pool and rollouts give
    (``p{n:08d}-{i:03d}``): a bitmask of the samples seen per prompt, not a string per
    trajectory. The buffer keeps every uid it saw for the whole run: as strings ~100
    bytes each, 1 GB at 10 M trajectories. Any other uid (a test's) is kept as it is.

    >>> seen = UidSet(["p00000001-000", "a"])
    >>> seen.add("p00000001-001"), seen.add("p00000001-000"), seen.add("p1-0")
    (True, False, True)
    >>> "p00000001-001" in seen, "p00000001-002" in seen, "p1-0" in seen, len(seen)
    (True, False, True, 4)
    """

    def __init__(self, uids: Iterable[str] = ()) -> None:
        self._masks: dict[int, int] = {}  # prompt n -> bit i: its sample i seen
        self._other: set[str] = set()
        self._n = 0
        self.update(uids)

    def add(self, uid: str) -> bool:
        """Add ``uid``; whether it was not there."""
        key = _uid_key(uid)
        if key is None:
            if uid in self._other:
                return False
            self._other.add(uid)
        else:
            mask, bit = self._masks.get(key[0], 0), 1 << key[1]
            if mask & bit:
                return False
            self._masks[key[0]] = mask | bit
        self._n += 1
        return True

    def __contains__(self, uid: object) -> bool:
        key = _uid_key(uid) if isinstance(uid, str) else None
        if key is None:
            return uid in self._other
        return bool(self._masks.get(key[0], 0) >> key[1] & 1)

    def __len__(self) -> int:
        return self._n

    def update(self, uids: Iterable[str]) -> None:
        """Add every uid of ``uids``: strings, a string array (a store's, read at once)
        or another :class:`UidSet`."""
        if isinstance(uids, UidSet):
            self._merge(uids._masks.items())
            uids = uids._other
        elif isinstance(uids, np.ndarray):
            at, n, i = _uid_keys(uids)
            if at.size:
                order = np.argsort(n, kind="stable")
                n, bits = n[order], np.left_shift(np.uint64(1), i[order].astype(np.uint64))
                first = np.flatnonzero(np.concatenate([[True], n[1:] != n[:-1]]))
                masks = np.bitwise_or.reduceat(bits, first)
                self._merge(zip(n[first].tolist(), masks.tolist(), strict=True))
            rest = np.ones(uids.size, dtype=bool)
            rest[at] = False
            uids = uids[rest].tolist()
        for uid in uids:
            self.add(uid)

    def _merge(self, masks: Iterable[tuple[int, int]]) -> None:
        for k, mask in masks:
            old = self._masks.get(k, 0)
            if new := mask & ~old:
                self._masks[k] = old | mask
                self._n += new.bit_count()


class BufferCore:
    """Group-complete FIFO sampling over admitted trajectories.

    A group with a sibling whose reward failed (``finish_reason == "error"``) is
    discarded whole when it completes: GRPO advantages need every sibling's reward.

    >>> import numpy as np
    >>> def traj(uid, group, reward=1.0):
    ...     z = np.zeros(1, np.int32)
    ...     return Trajectory(uid, group, 0, 0, 2, z, z, z.astype(np.float32), z.astype(np.uint8),
    ...                       0, "eos", "r0", 0., 0., 0., reward=reward)
    >>> core = BufferCore()
    >>> core.insert([traj("a", "g0")], version=0, now=1.0)
    []
    >>> core.sample(1, version=0, now=2.0) is None   # g0 still misses a sibling
    True
    >>> core.insert([traj("b", "g0")], version=1, now=3.0)
    []
    >>> [t.uid for t in core.sample(1, version=1, now=4.0)]
    ['a', 'b']
    """

    def __init__(
        self,
        sampler: str = "fifo",
        *,
        max_train_staleness: int | None = None,
        dynamic_sampling: bool = False,
    ) -> None:
        if sampler not in SAMPLERS:
            raise ValueError(f"buffer.sampler {sampler!r} is not one of {SAMPLERS}")
        self.sampler = sampler
        self.max_train_staleness = max_train_staleness
        self.dynamic_sampling = dynamic_sampling
        self.partial: dict[str, _Group] = {}
        self.ready: OrderedDict[str, list[Trajectory]] = OrderedDict()
        self.seen = UidSet()  # every uid admitted, or stored (never admitted again)
        # Kept as trajectories come and go, not counted over what is held at each read
        # (every insert's reply, every stats poll: 0.24 ms and 6 ms at 4,096 groups):
        self._depth = 0  # trajectories held
        # uid -> when the age of each one held counts from: its t_insert, or for one
        # held again (restore) its origin there (it was out of the buffer for a while
        # since) ...
        self._since: dict[str, float] = {}
        # ... and those times in a heap, the oldest first (with those of trajectories
        # gone since: skipped when they come first, dropped when they outnumber the rest)
        self._heap: list[tuple[float, str]] = []
        self.counts = {
            "inserted": 0,
            "duplicates": 0,
            "consumed": 0,
            "discarded": 0,
            "evicted": 0,
            "filtered": 0,
            "groups_consumed": 0,
            "groups_discarded": 0,
            "groups_evicted": 0,
            "groups_stranded": 0,  # of those, evicted by evict_stranded (same_version)
            "groups_filtered": 0,
        }

    def restore(
        self,
        groups: list[list[Trajectory]],
        stored: Iterable[str],
        why: str = "resume",
        origins: dict[str, float] | None = None,
    ) -> None:
        """Hold again groups a store had not trained (``stored``: every uid of the
        store, never admitted again: strings, or a store's array, as
        :meth:`UidSet.update` takes them). A group missing siblings waits for them
        (re-issued by the prompt pool) like any partial group. ``origins``: uid -> when
        its age counts from (:meth:`oldest_insert`), where not its ``t_insert``. The
        counters keep ``inserted + restored == consumed + discarded + evicted +
        filtered + depth``; by ``why``:

        * ``resume``: a resumed run's, admitted by an earlier buffer: counted ``restored``;
        * ``rebuild``: a lost buffer's, whose store its rebuilt one counts as its own;
        * ``trainer_restart``: consumed here by updates lost with the trainer: their
          consumption is taken back (``consumed`` counts what the updates that stand
          trained on, as the store does) and counted ``taken_back``.
        """
        n = sum(len(g) for g in groups)
        origins = origins or {}
        for members in groups:
            uid, size = members[0].prompt_uid, members[0].group_size
            if uid in self.ready or uid in self.partial:  # (replaced: never so far)
                self._gone(self.ready.get(uid) or self.partial[uid].members)
            if len(members) < size:
                self.partial[uid] = _Group(size, list(members))
            else:
                self.ready[uid] = sorted(members, key=lambda m: m.sample_idx)
            for m in members:
                self._held(m.uid, origins.get(m.uid, m.t_insert))
        self.seen.update(stored)
        c = self.counts
        if why == "resume":
            c["restored"] = c.get("restored", 0) + n
        elif why == "trainer_restart":
            c["consumed"] -= n
            c["groups_consumed"] -= len(groups)
            c["taken_back"] = c.get("taken_back", 0) + n

    @property
    def depth(self) -> int:
        """Trajectories held (complete groups and partial ones)."""
        return self._depth

    def _held(self, uid: str, since: float) -> None:
        """A trajectory is held now, its age counting from ``since``."""
        self._depth += 1
        self._since[uid] = since
        if not math.isnan(since):  # (no age: left out of the oldest)
            heapq.heappush(self._heap, (since, uid))
        if len(self._heap) > 2 * len(self._since) + 64:
            self._heap = [(t, u) for u, t in self._since.items() if not math.isnan(t)]
            heapq.heapify(self._heap)

    def _gone(self, members: list[Trajectory]) -> None:
        """Trajectories held leave (or are dropped)."""
        self._depth -= len(members)
        for m in members:
            self._since.pop(m.uid, None)

    def insert(
        self,
        trajs: list[Trajectory],
        *,
        version: int,
        now: float,
        admitted: list[Trajectory] | None = None,
    ) -> list[Trajectory]:
        """Admit rewarded trajectories (appended to ``admitted`` when given; a uid seen
        before is not); returns those that leave at once (discarded, filtered, evicted)."""
        leaving: list[Trajectory] = []
        for t in trajs:
            if not self.seen.add(t.uid):
                self.counts["duplicates"] += 1
                continue
            if admitted is not None:
                admitted.append(t)
            # The trainer's version when the trajectory finished; never below the version
            # that generated it (a rollout may see a version before the buffer hears of it).
            t.finish_version = max(version, t.behavior_version)
            t.t_insert = now
            t.status = "buffered"
            self.counts["inserted"] += 1
            self._held(t.uid, now)
            group = self.partial.setdefault(t.prompt_uid, _Group(t.group_size))
            group.members.append(t)
            if len(group.members) < group.size:
                continue
            del self.partial[t.prompt_uid]
            members = sorted(group.members, key=lambda x: x.sample_idx)
            if any(m.finish_reason == "error" for m in members):
                leaving += self._leave(members, "discarded")
            elif self.dynamic_sampling and _no_signal(members):
                leaving += self._leave(members, "filtered")
            elif self._too_stale(members, version):
                leaving += self._leave(members, "evicted")
            else:
                if t.prompt_uid in self.ready:  # (replaced: a group completed twice, never so far)
                    self._gone(self.ready[t.prompt_uid])
                self.ready[t.prompt_uid] = members
        return leaving

    def evict_stale(self, version: int) -> list[Trajectory]:
        """Evict the complete groups that training at ``version`` would make too stale."""
        stale = [uid for uid, g in self.ready.items() if self._too_stale(g, version)]
        return [m for uid in stale for m in self._leave(self.ready.pop(uid), "evicted")]

    def evict_stranded(self) -> list[Trajectory]:
        """``same_version``: evict the complete groups of the oldest behavior version
        held. For the caller to do when no version holds a batch and none can gain a
        group: every group that may be out is complete here (the back-pressure bound is
        reached). Without it such a run waits forever: versions too rare to fill a
        batch hold every slot, and only a publication would evict them.

        >>> import numpy as np
        >>> def traj(uid, group, version):
        ...     z = np.zeros(1, np.int32)
        ...     return Trajectory(uid, group, 0, 0, 1, z, z, z.astype(np.float32),
        ...                       z.astype(np.uint8), version, "eos", "r0", 0., 0., 0.,
        ...                       reward=1.0)
        >>> core = BufferCore("same_version")
        >>> _ = core.insert([traj("a", "g0", 0), traj("b", "g1", 1)], version=1, now=1.0)
        >>> core.sample(2, version=1, now=2.0) is None   # one group of each version
        True
        >>> [t.uid for t in core.evict_stranded()], list(core.ready)
        (['a'], ['g1'])
        """
        if self.sampler != "same_version" or not self.ready:
            return []
        oldest = min(_behavior_version(g) for g in self.ready.values())
        uids = [u for u, g in self.ready.items() if _behavior_version(g) == oldest]
        self.counts["groups_stranded"] += len(uids)
        return [m for u in uids for m in self._leave(self.ready.pop(u), "evicted")]

    def _too_stale(self, members: list[Trajectory], version: int) -> bool:
        k = self.max_train_staleness
        return k is not None and version - _behavior_version(members) > k

    def _leave(self, members: list[Trajectory], status: str) -> list[Trajectory]:
        self._gone(members)
        for m in members:
            m.status = status
        self.counts[status] += len(members)
        self.counts[f"groups_{status}"] += 1
        return members

    def sample(self, n_groups: int, *, version: int, now: float) -> list[Trajectory] | None:
        """``n_groups`` complete groups chosen by the sampler, or ``None`` if it cannot yet.

        Stale groups must have been evicted first (:meth:`evict_stale`); sampling one
        would break the staleness bound, so it raises.
        """
        uids = self._choose(n_groups)
        if uids is None:
            return None
        # Checked before any group leaves: a batch refused halfway lost the groups taken.
        for uid in uids:
            if self._too_stale(self.ready[uid], version):
                raise RuntimeError(f"group {uid!r} exceeds max_train_staleness; evict first")
        out: list[Trajectory] = []
        for uid in uids:
            members = self.ready.pop(uid)
            self._gone(members)
            for m in members:
                m.sample_version = version
                m.t_sample = now
                m.status = "consumed"
            out.extend(members)
        self.counts["consumed"] += len(out)
        self.counts["groups_consumed"] += n_groups
        return out

    def _choose(self, n: int) -> list[str] | None:
        if len(self.ready) < n:
            return None
        if self.sampler == "fifo":
            return list(self.ready)[:n]
        if self.sampler == "oldest_version":
            return sorted(self.ready, key=lambda u: _behavior_version(self.ready[u]))[:n]
        # same_version: the oldest version with n groups ready, in the order they came
        # (one pass: a scan of every group per version took seconds at 16k groups)
        by_version: dict[int, list[str]] = {}
        for u, g in self.ready.items():
            by_version.setdefault(_behavior_version(g), []).append(u)
        for v in sorted(by_version):
            if len(by_version[v]) >= n:
                return by_version[v][:n]
        return None

    def drain(self) -> list[Trajectory]:
        """Everything still held (status ``buffered``), emptying the buffer."""
        out = [m for g in self.ready.values() for m in g]
        out += [m for g in self.partial.values() for m in g.members]
        self.ready.clear()
        self.partial.clear()
        self._depth = 0
        self._since.clear()
        self._heap.clear()
        return out

    def oldest_insert(self) -> float:
        """When the age of the oldest trajectory held counts from (NaN when empty):
        buffer age. A trajectory's ``t_insert``; one held again (:meth:`restore`) counts
        from its origin there, which leaves out the time it was out of the buffer while
        the run went. (The age still spans any stop of the run in between, as that of
        one held across a stop does: the driver, which records it as
        ``oldest_buffered_age_s``, leaves the stops out.) One without a time (NaN) is
        left out."""
        heap, since = self._heap, self._since
        while heap and since.get(heap[0][1]) != heap[0][0]:  # (gone since)
            heapq.heappop(heap)
        return heap[0][0] if heap else float("nan")

    def stats(self) -> dict[str, float]:
        """Counters and contents; ``oldest_age_s``: the oldest held trajectory's age by
        this process's clock when read (``read_at``), which a driver polling many actors
        on another host reads seconds later and with its own clock (from
        :meth:`oldest_insert`: ``oldest_t_insert``)."""
        now, oldest = time.time(), self.oldest_insert()
        return {
            **self.counts,
            "depth": self.depth,
            "oldest_t_insert": oldest,
            "oldest_age_s": now - oldest,  # (NaN when empty)
            "read_at": now,
            "ready_groups": len(self.ready),
            "partial_groups": len(self.partial),
        }


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
        within the run, in place of a lost one (docs/faults.md)."""
        from storage.trajectories import TrajectoryWriter

        self.core = BufferCore(
            cfg.sampler,
            max_train_staleness=cfg.max_train_staleness,
            dynamic_sampling=cfg.dynamic_sampling,
        )
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
        self._write_error: str | None = None
        self._unwritten = 0  # records and events the disk refused, held to try again
        self._refused = 0  # ... and those the store refused as such: lost (logged)
        self._refused_events = 0  # (of them, leave events: the store then disagrees)
        self._refused_error = ""  # (the last)
        self._writer_thread = threading.Thread(target=self._write_loop, daemon=True)
        self._writer_thread.start()
        if resume is not None:
            self._resume(run_dir, resume)
        if rebuild is not None:
            self._rebuild(run_dir, rebuild)

    def _resume(self, run_dir: str, plan) -> None:
        """Re-admit the plan's groups (back to ``buffered``) and drop the rest. The
        store records the resume (when, from which version) first, before this writer
        commits anything."""
        self.writer.record_resume(plan.version, time.time())
        arrays = _scalars(run_dir)
        rows = {uid: i for i, uid in enumerate(arrays["uid"].tolist())}
        readmit = [rows[u] for u in plan.readmit]
        self._hold_again(arrays, readmit, "resume", stored=arrays["uid"], stopped=True)
        self.version = plan.version
        self._events += [_event(uid, "dropped") for uid in plan.drop]
        self._flush(force=True)

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
        self._consumed_elsewhere = dict(plan.consumed_elsewhere)
        self.version = plan.version
        status = arrays["status"].copy()
        status[held] = "buffered"
        status[[rows[u] for u in plan.mark_consumed]] = "consumed"
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
            if isinstance(error, OSError):  # (the disk, the mount): kept, tried again
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
                self._events.append(_event(t.uid, t.status, t.sample_version, t.t_sample))
        self._flush()

    async def _stranded(self) -> list[Trajectory]:
        """``same_version`` found no batch: if nothing more can arrive (every group the
        pool may have out is complete here, and it may hand out no more), the oldest
        version's groups are evicted (:meth:`BufferCore.evict_stranded`), freeing their
        slots for groups of the versions now generating."""
        room = await self.pool.room()
        if not room["full"] or room["outstanding"] > len(self.core.ready):
            return []
        out = self.core.evict_stranded()
        logger.warning(
            "buffer.sampler=same_version: no behavior version holds a batch and every slot "
            "is taken; %d groups of the oldest version evicted to free them",
            len({t.prompt_uid for t in out}),
        )
        return out

    async def _release(self, trajs: list[Trajectory]) -> None:
        """Groups that left (any status) free their back-pressure slots; then record it."""
        if trajs:
            uids = sorted({t.prompt_uid for t in trajs})
            trained = {t.prompt_uid for t in trajs if t.status == "consumed"}
            await self.pool.release(uids, tuple(u for u in uids if u not in trained))
            self._leave(trajs)

    async def insert(self, trajs: list[Trajectory], rollout_id: str = "") -> dict:
        """Admit rewarded trajectories (a uid seen before is dropped: a recovered
        trajectory may arrive twice), store them, and tell the partial-response pool
        they are safe. Returns the depth and, for ``rollout_id``, the uids it sent that
        the store has committed since its last insert (it may forget those)."""
        now = time.time()
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
            await self._forget_committed()
        stored = []
        if rollout_id:
            done = self._durable.setdefault(rollout_id, collections.deque())
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
            self.core.seen.add(t.uid)
            self.core.counts["inserted"] += 1
            self.core.counts["consumed"] += 1
            if t.prompt_uid not in self._groups_consumed:
                self._groups_consumed.add(t.prompt_uid)
                self.core.counts["groups_consumed"] += 1
            self._records[t.uid] = t
        self._flush()
        await self.pool.release(sorted({t.prompt_uid for t in trajs}))

    async def _forget_committed(self) -> None:
        """Tell the partial-response pool which trajectories the store now has: it keeps
        each until then, so that the pool and the store together always hold every
        trajectory started (``RUN_DIR/partial.zarr`` outlives a lost data module)."""
        uids = []
        while self._committed:
            uids.append(self._committed.popleft())
        if uids and self.partial is not None:
            await self.partial.forget(uids)

    async def sample(self, n_groups: int, version: int) -> list[Trajectory] | None:
        await self._release(self.core.evict_stale(version))
        batch = self.core.sample(n_groups, version=version, now=time.time())
        if batch is None and self.core.sampler == "same_version" and self.core.ready:
            await self._release(await self._stranded())
        await self._release(batch or [])
        self._flush()  # the trainer polls while it waits: pending writes go out on time
        await self._forget_committed()
        return batch

    async def trainer_restarted(self, version: int) -> dict:
        """The trainer was lost and restarts from its checkpoint at ``version``: the
        updates after it are gone, so the groups they consumed (``sample_version >=
        version``) are held again, whole, to be trained by the restarted trainer (each
        trajectory's last leave event is the one that stands: nothing ends up trained
        twice into the weights). They were sampled by versions the new trainer's numbers
        come after (:class:`~laminar.trainer.Trainer` ``after_version``), so any may be
        trained. Returns how many came back."""
        await self._write_through()  # the lost updates' consumed events are in the store
        arrays = _scalars(self.writer.path)
        lost = (arrays["status"] == "consumed") & (arrays["sample_version"] >= version)
        rows = np.flatnonzero(lost).tolist()
        groups = self._hold_again(arrays, rows, "trainer_restart")
        # Released when consumed, they are out again: back-pressure counts them until
        # they leave again (a rebuilt data module's pool does the same).
        await self.pool.hold_again(sorted({str(arrays["prompt_uid"][i]) for i in rows}))
        self._flush(force=True)
        return {"readmitted": len(rows), "groups": groups}

    async def update_skipped(self) -> None:
        """The trainer consumed a batch and published no version (the pool's dispatch
        rule makes up for it)."""
        await self.pool.update_skipped()

    async def version_published(self, version: int) -> None:
        self.version = max(self.version, version)
        await self.pool.version_published(self.version)  # its staleness bound counts from it
        # Groups the next update would train too stale leave now, freeing dispatch.
        await self._release(self.core.evict_stale(self.version))

    async def pool_stats(self) -> dict:
        """The prompt pool's counters (``dispatched``: where the prompt order stands),
        for the trainer's checkpoints (:data:`laminar.prompt_pool.DATA_STATE`)."""
        return await self.pool.stats()

    async def _write_through(self) -> None:
        """Write everything pending and wait until it is committed; raises while the disk
        refuses writes."""
        import asyncio

        self._flush(force=True)
        await asyncio.to_thread(self._jobs.join)
        await self._forget_committed()
        if self._write_error is not None:
            raise RuntimeError(f"the trajectory store cannot be written: {self._write_error}")

    async def sync(self) -> int:
        """Write everything pending and wait until it is committed; returns the number
        of stored trajectories. The trainer calls it before each checkpoint, so that the
        store records every trajectory the checkpoint's updates consumed: it raises while
        the disk refuses writes, and for good once the store refused a leave event as
        such (lost: a checkpoint past it would not match the store). A refused record is
        lost alone: counted in ``write_refused``, it does not stop checkpoints."""
        await self._write_through()
        if self._refused_events:
            raise RuntimeError(
                f"the trajectory store refused {self._refused_events} leave events, lost "
                f"(logged by uid; the last refusal: {self._refused_error}): the store does "
                "not record everything the trainer consumed"
            )
        return self._written

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
        import asyncio

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


def _event(uid: str, status: str, sample_version: int = -1, t_sample: float = math.nan) -> dict:
    """A leave event of the trajectory store (:data:`storage.schema.EVENT_FIELDS`)."""
    return {"uid": uid, "status": status, "sample_version": sample_version, "t_sample": t_sample}
