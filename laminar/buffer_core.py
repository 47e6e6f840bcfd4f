"""The experience buffer's pure state machine, no Dask and no I/O: :class:`BufferCore`
admits rewarded trajectories one by one, holds a group until all its siblings are in,
and hands out complete groups by a sampler policy (:data:`SAMPLERS`):

* ``fifo`` — in the order groups completed (the paper's);
* ``oldest_version`` — lowest behavior version first (bounds the tail of staleness);
* ``same_version`` — every batch from one behavior version, the oldest that has enough.

Optionally, groups whose training would exceed ``max_train_staleness`` versions
(``sample_version - behavior_version``) are *evicted*, and groups whose rewards are all
equal — no GRPO signal — are *filtered* (DAPO's dynamic sampling). Every trajectory leaves
exactly once, with a status (consumed, discarded, evicted, filtered, or still buffered at
the end), the time and the trainer's version it left at (``t_leave``,
``leave_version``) — nothing is dropped silently. :class:`UidSet` holds every uid admitted (never
admitted again) in a few bytes each.

Apart from :mod:`laminar.buffer`, the actor around it (the store's single writer, its
resume and rebuild), as the repack planner is apart from the manager.
"""

from __future__ import annotations

import heapq
import math
import re
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from laminar.contract import Trajectory
from storage.lineage import lineage_lag
from storage.schema import SCALARS


@dataclass
class _Group:
    size: int
    members: list[Trajectory] = field(default_factory=list)


SAMPLERS = ("fifo", "oldest_version", "same_version")


def _no_signal(members: list[Trajectory]) -> bool:
    """Every reward equal, compared as the store holds them (float32): a sibling held
    again from it (a resume, a rebuild) reads 0.1 as 0.10000000149 beside a fresh 0.1."""
    as_stored = SCALARS["reward"].type
    return len({float(as_stored(m.reward)) for m in members}) == 1


def _behavior_version(members: list[Trajectory]) -> int:
    """A group's behavior version for the samplers' order: its oldest member's. (Not
    for ``max_train_staleness``, judged member by member: :meth:`BufferCore._too_stale`.)"""
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
        restarts: Iterable[tuple[int, int]] = (),
    ) -> None:
        """``restarts``: the trainer restarts ``(V, M)`` that came before this core, in
        the order they happened (:meth:`trainer_restarted`): a buffer that did not hear
        them (a resumed run's, a rebuilt data module's) counts :meth:`lag` along the
        same lineage as one that did."""
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
        # Trainer restarts, (checkpoint version, the lost trainer's last), in order: the
        # lineage max_train_staleness counts along (lag)
        self._restarts: list[tuple[int, int]] = []
        for v, m in restarts:
            self.trainer_restarted(int(v), int(m))
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
            # The newest version published when the buffer admitted it (the trainer may
            # hold a newer one, unpublished); never below the version that generated it (a
            # rollout may see a version before the buffer hears of it).
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
                leaving += self._leave(members, "discarded", version, now)
            elif self.dynamic_sampling and _no_signal(members):
                leaving += self._leave(members, "filtered", version, now)
            elif self._too_stale(members, version):
                leaving += self._leave(members, "evicted", version, now)
            else:
                if t.prompt_uid in self.ready:  # (replaced: a group completed twice, never so far)
                    self._gone(self.ready[t.prompt_uid])
                self.ready[t.prompt_uid] = members
        return leaving

    def evict_stale(self, version: int, now: float | None = None) -> list[Trajectory]:
        """Evict the complete groups that training at ``version`` would make too stale
        (``now``: when, epoch seconds; default the clock's)."""
        now = time.time() if now is None else now
        stale = [uid for uid, g in self.ready.items() if self._too_stale(g, version)]
        return [
            m for uid in stale for m in self._leave(self.ready.pop(uid), "evicted", version, now)
        ]

    def evict_stranded(self, version: int = -1, now: float | None = None) -> list[Trajectory]:
        """``same_version``: evict the complete groups of the oldest behavior version
        held. For the caller to do when no version holds a batch and none can gain a
        group: every group that may be out is complete here (the back-pressure bound is
        reached). Without it such a run waits forever: versions too rare to fill a
        batch hold every slot, and only a publication would evict them. ``version``:
        the trainer's that found no batch, ``now``: when (default the clock's), recorded
        as the evicted trajectories' ``leave_version`` and ``t_leave``.

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
        >>> out = core.evict_stranded(version=1, now=3.0)
        >>> [(t.uid, t.leave_version, t.t_leave) for t in out], list(core.ready)
        ([('a', 1, 3.0)], ['g1'])
        """
        if self.sampler != "same_version" or not self.ready:
            return []
        now = time.time() if now is None else now
        oldest = min(_behavior_version(g) for g in self.ready.values())
        uids = [u for u, g in self.ready.items() if _behavior_version(g) == oldest]
        self.counts["groups_stranded"] += len(uids)
        return [m for u in uids for m in self._leave(self.ready.pop(u), "evicted", version, now)]

    def _too_stale(self, members: list[Trajectory], version: int) -> bool:
        """Whether any member would train more than ``max_train_staleness`` behind.
        Judged member by member: along a restarted lineage the lag is not monotone in
        the version number (a restart from 10 published as 16: at 16, a member of 14,
        on the lost branch, is 4 behind, one of 10 none), so the oldest member's alone
        let a group through with a member past the bound."""
        k = self.max_train_staleness
        if k is None:
            return False
        return max(self.lag(version, b) for b in {m.behavior_version for m in members}) > k

    def trainer_restarted(self, version: int, after: int) -> None:
        """The trainer restarted from its checkpoint at ``version`` and numbers its
        updates after ``after`` (the newest version the lost one published): it holds
        ``version``'s weights under the number ``after``, and the weights published as
        ``version + 1`` .. ``after`` are a branch it does not descend from. From now on
        :meth:`lag` counts along that lineage."""
        if (version, after) not in self._restarts[-1:]:  # (a restart asked again: once)
            self._restarts.append((version, after))

    def lag(self, version: int, behavior: int) -> int:
        """How many updates apart the trainer at ``version`` and the weights that
        generated a group (``behavior``) are: ``version - behavior`` until a trainer
        restart; after restarts (:meth:`trainer_restarted`), the path between the two in
        the tree of weights, each restart ``(V, M)`` branching the numbers after ``M``
        off ``V`` (the restarted trainer, at ``M`` before its first update, holds ``V``'s
        weights). So for the restart ``(V, M)`` and a trainer at ``t >= M`` on it:
        ``(t - M) + (V - b)`` for ``b <= V``, ``(t - M) + (b - V)`` for ``b`` in ``(V,
        M]`` (the lost branch), ``t - b`` for ``b > M``
        (:func:`storage.lineage.lineage_lag`, which the analysis counts with too).

        >>> core = BufferCore()
        >>> core.trainer_restarted(10, 19)
        >>> core.lag(19, 10), core.lag(19, 19), core.lag(21, 4), core.lag(21, 15), core.lag(21, 20)
        (0, 9, 8, 7, 1)
        """
        return lineage_lag(version, behavior, self._restarts)

    def _leave(
        self, members: list[Trajectory], status: str, version: int, now: float
    ) -> list[Trajectory]:
        """A group leaves with ``status``, at the trainer's ``version`` (the one it was
        judged at: the published one at admission or a publication, the trainer's
        asking for a batch) and time ``now``."""
        self._gone(members)
        for m in members:
            m.status, m.leave_version, m.t_leave = status, version, now
        self.counts[status] += len(members)
        self.counts[f"groups_{status}"] += 1
        return members

    def sample(self, n_groups: int, *, version: int, now: float) -> list[Trajectory] | None:
        """``n_groups`` complete groups chosen by the sampler, or ``None`` if it cannot yet.

        Stale groups must have been evicted first (:meth:`evict_stale`, or :meth:`take`,
        which does both at once); sampling one would break the staleness bound, so it
        raises.
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
                m.sample_version = m.leave_version = version
                m.t_sample = m.t_leave = now
                m.status = "consumed"
            out.extend(members)
        self.counts["consumed"] += len(out)
        self.counts["groups_consumed"] += n_groups
        return out

    def take(
        self, n_groups: int, *, version: int, now: float
    ) -> tuple[list[Trajectory], list[Trajectory] | None]:
        """:meth:`evict_stale` at ``version``, then :meth:`sample`, in one step:
        ``(evicted, batch)``. A caller that lets other calls run in between (an actor
        awaiting the prompt pool to release what it evicted) may admit a group in
        between that was fresh enough at the buffer's published version and is too
        stale at the trainer's, one ahead of it under ``one_step``: :meth:`sample`
        raised on it, and the trainer failed.

        >>> import numpy as np
        >>> def traj(uid, group, version):
        ...     z = np.zeros(1, np.int32)
        ...     return Trajectory(uid, group, 0, 0, 1, z, z, z.astype(np.float32),
        ...                       z.astype(np.uint8), version, "eos", "r0", 0., 0., 0.,
        ...                       reward=1.0)
        >>> core = BufferCore(max_train_staleness=1)
        >>> _ = core.insert([traj("a", "g0", 4), traj("b", "g1", 5)], version=5, now=1.0)
        >>> evicted, batch = core.take(1, version=6, now=2.0)
        >>> [t.uid for t in evicted], [t.uid for t in batch]
        (['a'], ['b'])
        """
        evicted = self.evict_stale(version, now)
        return evicted, self.sample(n_groups, version=version, now=now)

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

    def known(self) -> list[str]:
        """The prompt groups held (ready, or waiting for their siblings) and each of their
        samples' uids: at a lost rollout's fence the prompt pool re-issues what neither
        this nor the partial-response pool knows, judging a group by its samples where
        they are named (a barrier batch's group split among rollouts: the lost one's
        piece goes out again, the samples held here do not)."""
        members = [t.uid for ts in self.ready.values() for t in ts]
        members += [t.uid for g in self.partial.values() for t in g.members]
        return sorted({*self.ready, *self.partial, *members})

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
