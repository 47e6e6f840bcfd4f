"""The relay tier's core, without Dask: the flat byte layout of a weight snapshot, the
chain broadcast's time model (paper, Appendix D) and :class:`RelayCore`, the versioned
snapshot store of one relay (slots recycled under a memory budget, the last
``keep_versions`` complete versions kept, per-chunk checksum (xxh3-64) verification,
monotonic visibility, pins for readers and forwarders). :mod:`laminar.relay` is the Dask
actor around it; the module docstring there describes the tier and its guarantees.
"""

from __future__ import annotations

import math
import mmap
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from laminar.errors import LaminarError

ALIGN = 64  # byte alignment of every tensor in a snapshot buffer
MB = 1 << 20
HUGE_PAGE = 2 * MB


def host_buffer(nbytes: int) -> np.ndarray:
    """A writable host buffer of ``nbytes``: an anonymous mapping of its own, advised for
    transparent huge pages where the kernel allows them (``madvise`` mode, the common
    default). A copy of 512 MB into ``np.empty`` ran 1.25x slower than into torch's
    allocations (here; NumPy's own huge-page advice notwithstanding) and 1.45x on a
    16-core host, the whole of the publication stall's excess over a host copy; into
    this mapping it runs as fast as into torch's."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(nbytes, dtype=np.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off or unsupported: 4 KiB pages, as np.empty would give
        pass
    return np.frombuffer(region, dtype=np.uint8)  # (the array keeps the mapping alive)


class RelayError(LaminarError):
    """A relay cannot do what was asked (budget, unknown version, corrupt chunk)."""


class VersionUnavailable(RelayError):
    """The asked-for version is neither kept by the relay nor checkpointed on disk."""


# -- layout ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """The flat byte layout of a state dict: tensors in order, each 64-byte aligned."""

    tensors: tuple[TensorSpec, ...]
    nbytes: int

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> Layout:
        specs, offset = [], 0
        for name, t in state.items():
            n = t.numel() * t.element_size()
            specs.append(
                TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, n)
            )
            offset += -(-n // ALIGN) * ALIGN
        return cls(tuple(specs), offset)

    def write(self, buf: np.ndarray, state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` into ``buf`` (one host copy; a device tensor is copied D2H)."""
        if list(state) != [s.name for s in self.tensors]:
            raise RelayError(
                "the state dict's tensors differ from this relay's layout (names or order); "
                "publish the same model's state_dict every time"
            )
        with torch.no_grad():
            for s in self.tensors:
                t = state[s.name]
                if tuple(t.shape) != s.shape or str(t.dtype).removeprefix("torch.") != s.dtype:
                    raise RelayError(
                        f"tensor {s.name!r} is {tuple(t.shape)} {t.dtype}, the layout has "
                        f"{s.shape} {s.dtype}; publish the same model every time"
                    )
                _view(buf, s).copy_(t.detach().reshape(s.shape))

    def read(self, buf: np.ndarray) -> dict[str, torch.Tensor]:
        """Tensors viewing ``buf`` (no copy): valid as long as ``buf`` is not rewritten."""
        return {s.name: _view(buf, s) for s in self.tensors}


def _view(buf: np.ndarray, s: TensorSpec) -> torch.Tensor:
    dtype = getattr(torch, s.dtype)
    if s.nbytes == 0:
        return torch.empty(s.shape, dtype=dtype)
    raw = torch.from_numpy(buf[s.offset : s.offset + s.nbytes])
    return raw.view(dtype).view(s.shape)


def checksum(data) -> int:
    """xxh3-64 of a buffer: ≈ 28 GB/s here against ≈ 4 GB/s for zlib's CRC32, which
    made verification the largest CPU cost of a relay hop."""
    return xxhash.xxh3_64_intdigest(memoryview(data).cast("B"))


def state_fingerprint(state: Mapping[str, torch.Tensor]) -> int:
    """xxh3-64 over every tensor's bytes in order: equal iff the weights are
    bit-identical (up to hash collisions). The trainer and each rollout compute it when
    ``relay.audit_weights`` is on."""
    h = xxhash.xxh3_64()
    for t in state.values():
        # (reshape: a 0-d tensor cannot be viewed as bytes; a scalar parameter is one)
        t = t.detach().to("cpu").contiguous().reshape(-1)
        if t.numel():
            h.update(memoryview(t.view(torch.uint8).numpy()))
    return h.intdigest()


# -- the chain's time model (paper, Appendix D) ------------------------------------------


def chain_time(p: int, k: int, m_bytes: float, t_byte: float, t_start: float) -> float:
    """``T(p, k) = (p + k − 2)(M·T_byte/k + T_start)``: ``k`` chunks through ``p`` relays."""
    return (p + k - 2) * (m_bytes * t_byte / k + t_start)


def optimal_chunks(p: int, m_bytes: float, t_byte: float, t_start: float) -> int:
    """The integer ``k ≥ 1`` minimising :func:`chain_time` (around
    ``k* = sqrt((p − 2)·M·T_byte/T_start)``)."""
    if p <= 2 or t_start <= 0:
        return 1
    k_star = math.sqrt((p - 2) * m_bytes * t_byte / t_start)
    cands = {max(1, math.floor(k_star)), max(1, math.ceil(k_star))}
    return min(cands, key=lambda k: chain_time(p, k, m_bytes, t_byte, t_start))


def model_optimum(p: int, m_bytes: float, t_byte: float, t_start: float) -> float:
    """``T*(p) = M·T_byte + (p−2)·T_start + 2·sqrt((p−2)·M·T_byte·T_start)``."""
    q = max(p - 2, 0)
    return m_bytes * t_byte + q * t_start + 2 * math.sqrt(q * m_bytes * t_byte * t_start)


def plan_chunks(
    p: int,
    m_bytes: int,
    t_byte: float,
    t_start: float,
    *,
    chunks: int | None = None,
    max_chunk_bytes: int = 8 * MB,
) -> int:
    """The chunk count for one broadcast: ``chunks`` if set, else the model's optimum,
    raised so that no chunk exceeds ``max_chunk_bytes`` (see :class:`RelayConfig`)."""
    if chunks is not None:
        return max(1, min(chunks, m_bytes or 1))
    k = optimal_chunks(p, m_bytes, t_byte, t_start)
    return max(1, k, -(-m_bytes // max_chunk_bytes))


# -- the store of one relay --------------------------------------------------------------


@dataclass
class Snapshot:
    """One version in one slot. ``complete`` once every chunk is in and verified."""

    version: int
    layout: Layout
    chunk_bytes: int
    buf: np.ndarray
    crcs: list[int | None]
    received: int = 0
    complete: bool = False
    pins: int = 0  # readers copying and forwarders sending from this slot

    @property
    def n_chunks(self) -> int:
        return len(self.crcs)

    def span(self, j: int) -> tuple[int, int]:
        if not 0 <= j < self.n_chunks:
            raise RelayError(f"chunk {j} out of range (version {self.version} has {self.n_chunks})")
        start = j * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.layout.nbytes)

    def info(self) -> dict:
        """What a reader needs to pull this version (small: no tensor data)."""
        return {
            "version": self.version,
            "layout": self.layout,
            "chunk_bytes": self.chunk_bytes,
            "crcs": list(self.crcs),
        }


class RelayCore:
    """The versioned snapshots of one relay: thread-safe, no Dask.

    Memory is a set of slots of the snapshot size, allocated once and recycled (a fresh
    allocation of hundreds of MB costs page faults on every publish; a warm slot is one
    memcpy). At most ``budget_bytes`` are ever allocated — enough for ``keep_versions``
    complete versions plus the one arriving, or a :class:`RelayError` says how to fix the
    config. Beginning a new version evicts the oldest complete one beyond
    ``keep_versions`` that nobody holds.
    """

    def __init__(self, keep_versions: int = 2, budget_bytes: int | None = None) -> None:
        if keep_versions < 1:
            raise RelayError("keep_versions must be at least 1")
        self.keep_versions = keep_versions
        self.retained: set[int] = set()  # versions in use: kept before older unused ones
        self.budget_bytes = budget_bytes
        self._lock = threading.Condition()
        self._snaps: dict[int, Snapshot] = {}  # version -> snapshot (arriving or complete)
        self._free: list[np.ndarray] = []
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.newest_begun = -1
        self.slot_bytes = 0  # the snapshot size, known from the first version
        self.counts = {"versions": 0, "evicted": 0, "corrupt_chunks": 0, "refused": 0}
        # Called (lock held, from whichever thread completed it) when a version becomes
        # visible: the Relay actor wakes the pulls that wait for one (it must not block).
        self.on_complete = None
        # Called (lock held, from the waiting thread) with the version that waits for a
        # slot, each time before it waits: the Relay actor stops forwarding older
        # versions, whose pins would otherwise keep it waiting (it must not block).
        self.on_slot_wanted = None

    # -- writing ------------------------------------------------------------------------
    def begin(
        self,
        version: int,
        layout: Layout,
        chunk_bytes: int,
        timeout: float = 30.0,
        resume: bool = False,
    ) -> Snapshot | None:
        """Reserve a slot for ``version``; ``None`` if it is not newer than one already
        begun (versions only move forward: a late or repeated one is ignored). With
        ``resume`` (a downstream relay's chunks), the newest version begun and still
        incomplete, of the same layout and chunk size, is the one exception: its snapshot
        is returned as it is, chunks held and all (sent again from the start by a new
        upstream after a relay loss, docs/faults.md; a chunk that arrives twice counts
        once)."""
        with self._lock:
            if resume and version == self.newest_begun:
                snap = self._snaps.get(version)
                if (
                    snap is not None
                    and not snap.complete
                    and snap.layout == layout
                    and snap.chunk_bytes == chunk_bytes
                ):
                    return snap
            if version <= self.newest_begun:
                self.counts["refused"] += 1
                return None
            n_chunks = max(1, -(-layout.nbytes // chunk_bytes)) if layout.nbytes else 1
            # Versions arrive in order: an older one still incomplete will never complete.
            for v in [v for v, s in self._snaps.items() if not s.complete and not s.pins]:
                self._free.append(self._snaps.pop(v).buf)
            buf = self._slot(version, layout.nbytes, timeout)
            self.slot_bytes = layout.nbytes
            snap = Snapshot(version, layout, chunk_bytes, buf, [None] * n_chunks)
            self._snaps[version] = snap
            self.newest_begun = version
            return snap

    def budget_for(self, nbytes: int) -> int:
        """The bytes this relay may hold: ``budget_bytes``, or by default exactly
        ``keep_versions`` complete versions plus the arriving one."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        return nbytes * (self.keep_versions + 1)

    def _slot(self, version: int, nbytes: int, timeout: float) -> np.ndarray:
        """A slot of ``nbytes`` (lock held): a free one, a new one within the budget, or
        the oldest evictable version's; waits for a pinned one to be released."""
        budget = self.budget_for(nbytes)
        if nbytes * (self.keep_versions + 1) > budget:
            raise RelayError(
                f"relay memory budget {budget / MB:.0f} MiB cannot hold "
                f"keep_versions={self.keep_versions} versions plus the arriving one of "
                f"{nbytes / MB:.1f} MiB each ({nbytes * (self.keep_versions + 1) / MB:.0f} "
                "MiB); raise relay.memory_budget_mb or lower relay.keep_versions"
            )
        deadline = time.monotonic() + timeout
        while True:
            self._evict()
            for i, buf in enumerate(self._free):
                if buf.nbytes == nbytes:
                    return self._free.pop(i)
            # Free slots of another size (the model changed) are dropped.
            while self._free and self.allocated_bytes + nbytes > budget:
                self.allocated_bytes -= self._free.pop().nbytes
            if self.allocated_bytes + nbytes <= budget:
                buf = host_buffer(nbytes)  # (counted once it exists: a failed one is not)
                self.allocated_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
                return buf
            left = deadline - time.monotonic()
            if left <= 0:
                raise RelayError(
                    f"no slot freed within {timeout:.0f} s: every kept version is held by a "
                    "reader or forwarder; raise relay.memory_budget_mb"
                )
            if self.on_slot_wanted is not None:
                self.on_slot_wanted(version)
            self._lock.wait(min(left, 0.1))

    def retain(self, versions) -> None:
        """Versions still in use (unfinished trajectories sampled by them, which recovery
        may have to resume): among the ``keep_versions`` kept, these go before older
        unused ones. No extra memory: the newest version is always kept.
        """
        with self._lock:
            self.retained = set(versions)

    def _evict(self) -> None:
        """Free the complete, unpinned versions beyond ``keep_versions`` (lock held): the
        newest stays, then retained ones (newest first), then the newest others.
        Incomplete versions older than the newest complete one were abandoned by their
        sender and are dropped too."""
        done = self._kept()
        newest_done = done[-1] if done else -1
        keep = done[-1:]
        ranked = sorted(self.retained & set(done), reverse=True) + done[::-1]
        for v in ranked:
            if len(keep) >= self.keep_versions:
                break
            if v not in keep:
                keep.append(v)
        surplus = set(done) - set(keep)
        for v in sorted(self._snaps):
            s = self._snaps[v]
            stale = not s.complete and v < newest_done
            if (v in surplus or stale) and not s.pins:
                del self._snaps[v]
                self._free.append(s.buf)
                self.counts["evicted"] += s.complete

    def prewarm(self, nbytes: int) -> bool:
        """Allocate and touch one spare slot of ``nbytes`` ahead of the next version, if
        the budget allows (a fresh allocation's first touch costs page faults: better
        here, in the relay's thread, than inside the next publication stall). An
        allocation that fails (``OSError``, ``MemoryError``) raises and counts nothing:
        the budget is as it was, and the next version allocates its slot itself."""
        with self._lock:
            if any(b.nbytes == nbytes for b in self._free):
                return False
            if self.allocated_bytes + nbytes > self.budget_for(nbytes):
                return False
            # Reserved before the allocation (outside the lock) so that a slot asked for
            # meanwhile stays within the budget; given back if the allocation fails.
            self.allocated_bytes += nbytes
        try:
            buf = host_buffer(nbytes)
            buf.fill(0)
        except BaseException:
            with self._lock:
                self.allocated_bytes -= nbytes
                self._lock.notify_all()
            raise
        with self._lock:
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            self._free.append(buf)
            self._lock.notify_all()
        return True

    def write_state(self, snap: Snapshot, state: Mapping[str, torch.Tensor]) -> None:
        """The master's path: copy a whole state dict into the reserved slot."""
        snap.layout.write(snap.buf, state)

    def checksum_chunk(self, snap: Snapshot, j: int) -> int:
        """The master's path: the checksum of chunk ``j`` of its own copy (computed once)."""
        crc = snap.crcs[j]
        if crc is None:
            a, b = snap.span(j)
            crc = snap.crcs[j] = checksum(snap.buf[a:b])
        return crc

    def write_chunk(self, version: int, j: int, data, crc: int) -> bool:
        """A downstream relay's path: store and verify chunk ``j``. Returns whether the
        version just became complete. A corrupt chunk raises and leaves it missing. The
        slot is pinned while the chunk is written (outside the lock): a newer version
        begun meanwhile from another thread must not be given it."""
        with self._lock:
            snap = self._snaps.get(version)
            if snap is None and version < self.newest_begun:
                return False  # dropped for a newer one (the rest of an abandoned send)
            if snap is not None:
                snap.pins += 1
        if snap is None:
            raise RelayError(f"version {version} was not begun here (or was dropped)")
        try:
            return self._store(snap, j, data, crc)
        finally:
            with self._lock:
                snap.pins -= 1
                self._lock.notify_all()

    def _store(self, snap: Snapshot, j: int, data, crc: int) -> bool:
        version = snap.version
        a, b = snap.span(j)
        data = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        if data.nbytes != b - a:
            raise RelayError(
                f"chunk {j} of version {version}: {data.nbytes} bytes, expected {b - a}"
            )
        got = checksum(data)
        if got != crc:
            with self._lock:
                self.counts["corrupt_chunks"] += 1
            raise RelayError(f"chunk {j} of version {version} failed its checksum; it is dropped")
        with self._lock:
            if snap.complete:  # (a chunk sent twice, the version visible meanwhile:
                return False  # a visible snapshot is never written again)
        snap.buf[a:b] = data
        with self._lock:
            if snap.crcs[j] is None:
                snap.received += 1
            snap.crcs[j] = crc
            if snap.received == snap.n_chunks and not snap.complete:
                self._complete(snap)
                return True
        return False

    def complete(self, snap: Snapshot) -> None:
        """The master's path: every chunk's checksum computed, the version is visible."""
        with self._lock:
            if any(c is None for c in snap.crcs):
                raise RelayError(f"version {snap.version} has chunks without a checksum")
            snap.received = snap.n_chunks
            self._complete(snap)

    def _complete(self, snap: Snapshot) -> None:
        snap.complete = True
        self.counts["versions"] += 1
        self._evict()
        self._lock.notify_all()
        if self.on_complete is not None:
            self.on_complete()

    # -- reading --------------------------------------------------------------------------
    def newest(self) -> Snapshot | None:
        with self._lock:
            kept = self._kept()
            return self._snaps[kept[-1]] if kept else None

    def versions(self) -> list[int]:
        with self._lock:
            return self._kept()

    def arriving(self) -> list[int]:
        """The versions begun here and not complete yet, oldest first."""
        with self._lock:
            return sorted(v for v, s in self._snaps.items() if not s.complete)

    def missing(self, version: int) -> list[int]:
        """The chunks of ``version``, begun here and not complete, not stored yet (one that
        failed its checksum among them); ``[]`` if it is complete or not here."""
        with self._lock:
            snap = self._snaps.get(version)
            if snap is None or snap.complete:
                return []
            return [j for j, c in enumerate(snap.crcs) if c is None]

    def get(self, version: int) -> Snapshot:
        with self._lock:
            snap = self._snaps.get(version)
            if snap is None or not snap.complete:
                raise VersionUnavailable(
                    f"version {version} is not kept here (kept: {self._kept()})"
                )
            return snap

    def _kept(self) -> list[int]:
        """The complete versions, oldest first (lock held)."""
        return sorted(v for v, s in self._snaps.items() if s.complete)

    def pin(self, version: int) -> Snapshot:
        """Hold a version's slot, complete or arriving (a reader copying, a forwarder
        sending): it is not recycled until :meth:`unpin`."""
        with self._lock:
            snap = self._snaps.get(version)
            if snap is None:
                raise VersionUnavailable(
                    f"version {version} is no longer kept here (kept: {self._kept()})"
                )
            snap.pins += 1
            return snap

    def unpin(self, snap: Snapshot) -> None:
        """Release one :meth:`pin`. Releasing a pin nobody holds is a bug of the caller
        (a slot whose count went below zero would never be recycled again): it raises."""
        with self._lock:
            if snap.pins <= 0:
                raise RelayError(
                    f"version {snap.version} unpinned more often than pinned (pins {snap.pins})"
                )
            snap.pins -= 1
            self._lock.notify_all()

    def read_chunk(self, version: int, j: int) -> tuple[np.ndarray, int]:
        """A copy of chunk ``j`` of a complete version and its checksum (the slot is pinned
        during the copy, so it cannot be recycled underneath)."""
        snap = self.pin(version)
        try:
            if not snap.complete:
                raise VersionUnavailable(f"version {version} is still arriving")
            a, b = snap.span(j)
            return snap.buf[a:b].copy(), snap.crcs[j]
        finally:
            self.unpin(snap)

    def stats(self) -> dict:
        with self._lock:
            return {
                **self.counts,
                "kept": self._kept(),
                "arriving": sorted(v for v, s in self._snaps.items() if not s.complete),
                "allocated_bytes": self.allocated_bytes,
                "peak_bytes": self.peak_bytes,
                "budget_bytes": self.budget_for(self.slot_bytes) if self.slot_bytes else None,
            }
