"""The relay tier: versioned host-memory weight snapshots, a pipelined chain broadcast,
and rollout-local pulls (paper §4, Appendix D).

The trainer publishes a version to the *master* relay, which lives in the trainer's own
worker process: publication is one host copy into a pre-allocated slot (the *publication
stall*), after which training goes on. The master then cuts the snapshot into ``k``
chunks and sends chunk ``j`` to the next relay of the chain while that relay forwards
chunk ``j-1`` to its own successor, and so on down the chain. Each rollout asks its local
relay for the newest complete version at its batch boundary and copies it into its
engine (the *rollout wait*).

Pieces, from the bottom up:

* :class:`Layout` — where each tensor of a state dict lives in one flat byte buffer.
* :class:`RelayCore` — the versioned snapshot store of one relay, without Dask: slots
  recycled under a memory budget, the last ``keep_versions`` complete versions kept,
  per-chunk checksum (xxh3-64) verification, monotonic visibility, pins for readers and forwarders.
* :class:`Relay` — the Dask actor around a core: chain forwarding, calibration of
  ``T_byte``/``T_start``, completion reports to the master, statistics.
* :func:`pull_newest` / :func:`fetch_version` — the rollout side: newest version, or a
  given old one (kept by a relay, else the trainer's checkpoint on disk).

Guarantees: a version becomes visible only once every chunk is present and its checksum
verified; visible versions only grow; a visible snapshot is never written again until it
is evicted, and a slot that a reader or forwarder holds is never recycled. Readers verify
every chunk again on their side, so a torn read is detected, never loaded.

Bytes travel actor-to-actor over Dask's comm (TCP, or UCX on a UCX cluster), never
through the scheduler, and every relay-to-relay call has a timeout: a call to an actor
whose worker died otherwise waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import mmap
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

from laminar.errors import LaminarError

if TYPE_CHECKING:
    from laminar.config import RelayConfig, RunConfig

logger = logging.getLogger(__name__)

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

    # -- writing ------------------------------------------------------------------------
    def begin(
        self, version: int, layout: Layout, chunk_bytes: int, timeout: float = 30.0
    ) -> Snapshot | None:
        """Reserve a slot for ``version``; ``None`` if it is not newer than one already
        begun (versions only move forward: a late or repeated one is ignored)."""
        with self._lock:
            if version <= self.newest_begun:
                self.counts["refused"] += 1
                return None
            n_chunks = max(1, -(-layout.nbytes // chunk_bytes)) if layout.nbytes else 1
            # Versions arrive in order: an older one still incomplete will never complete.
            for v in [v for v, s in self._snaps.items() if not s.complete and not s.pins]:
                self._free.append(self._snaps.pop(v).buf)
            buf = self._slot(layout.nbytes, timeout)
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

    def _slot(self, nbytes: int, timeout: float) -> np.ndarray:
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
                self.allocated_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
                return host_buffer(nbytes)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RelayError(
                    f"no slot freed within {timeout:.0f} s: every kept version is held by a "
                    "reader or forwarder; raise relay.memory_budget_mb"
                )
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
        here, in the relay's thread, than inside the next publication stall)."""
        with self._lock:
            if any(b.nbytes == nbytes for b in self._free):
                return False
            if self.allocated_bytes + nbytes > self.budget_for(nbytes):
                return False
            self.allocated_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        buf = host_buffer(nbytes)
        buf.fill(0)
        with self._lock:
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
        version just became complete. A corrupt chunk raises and leaves it missing."""
        with self._lock:
            snap = self._snaps.get(version)
        if snap is None:
            raise RelayError(f"version {version} was not begun here (or was dropped)")
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
        with self._lock:
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


# -- the Dask actor ------------------------------------------------------------------------


class BulkSender:
    """A thread with its own event loop that makes a relay's calls to its successor.

    A relay in the middle of the chain receives chunk ``j`` while it sends ``j-1``. On
    the worker's event loop the two take turns on one thread, and on one host, where the
    kernel's copies are the link, each inner hop then costs about two transfers. Here
    the sends run on this thread (the socket calls release the GIL) and the worker's
    loop only receives: on 16 cores the chain ran 1.45x faster at p = 8 and 1.62x at
    p = 4 (512 MB; docs/relay.md, "Measured on 16 cores").

    Calls go to the successor's worker as the actor protocol makes them
    (``actor_execute``, arguments serialized as an actor call's are), over this
    thread's own connection, with the worker's security settings, so TLS clusters work
    as before. Only ``tcp://`` and ``tls://`` addresses use it (:meth:`serves`); others
    (UCX, in-process) keep the worker's loop, whose comm they are bound to.
    """

    def __init__(self, name: str, connection_args: dict) -> None:
        self.connection_args = connection_args
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._rpcs: dict = {}

    @staticmethod
    def serves(address: str | None) -> bool:
        return bool(address) and address.split("://", 1)[0] in ("tcp", "tls")

    async def call(self, actor, function: str, *args, timeout_s: float):
        """``actor.function(*args)`` from this thread; awaited on the caller's loop.

        Cancelled or timed out, it returns only once the send has stopped (or after a
        second more): the caller then unpins the slot the bytes were read from, which
        may be recycled at once."""
        settled = asyncio.Event()
        caller = asyncio.get_running_loop()
        future = asyncio.run_coroutine_threadsafe(
            self._call(actor._address, actor.key, function, args, caller, settled), self._loop
        )
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.wrap_future(future)
        finally:
            if not settled.is_set():
                future.cancel()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await settled.wait()

    async def _call(self, address, key, function, args, caller, settled):
        from distributed.core import rpc
        from distributed.protocol import to_serialize

        try:
            r = self._rpcs.get(address)
            if r is None:
                r = self._rpcs[address] = rpc(address, connection_args=self.connection_args)
            reply = await r.actor_execute(
                actor=key, function=function, args=[to_serialize(a) for a in args], kwargs={}
            )
        finally:
            with contextlib.suppress(RuntimeError):  # (the caller's loop is gone)
                caller.call_soon_threadsafe(settled.set)
        if reply["status"] != "OK":
            raise reply["exception"]
        return reply["result"]

    def close(self, timeout_s: float = 5.0) -> None:
        async def close_all() -> None:
            results = await asyncio.gather(
                *(r.close_rpc() for r in self._rpcs.values()), return_exceptions=True
            )
            for e in results:
                if isinstance(e, Exception):
                    logger.debug("closing a bulk sender connection: %r", e)

        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(close_all(), self._loop).result(timeout_s)
        except Exception as e:  # noqa: BLE001 — closing connections to a lost worker
            logger.debug("closing the bulk sender's connections: %r", e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()


class Relay:
    """Dask actor: one relay of the chain (the master when ``relay_id == "master"``).

    Every method a peer or a rollout calls is ``async``: it runs on the worker's event
    loop, so a relay answers while the rollout or trainer sharing its worker computes.
    Copies and checksums run in a private thread (they release the GIL) so that socket
    I/O goes on meanwhile.
    """

    def __init__(self, relay_id: str, cfg: RelayConfig | None = None) -> None:
        from laminar.config import RelayConfig

        cfg = cfg or RelayConfig()
        self.relay_id = relay_id
        budget = None if cfg.memory_budget_mb is None else int(cfg.memory_budget_mb * MB)
        self.core = RelayCore(cfg.keep_versions, budget)
        self.timeout_s = cfg.timeout_s
        self.chunks, self.max_chunk_bytes = cfg.chunks, int(cfg.max_chunk_mb * MB)
        self.t_byte, self.t_start = cfg.t_byte, cfg.t_start
        self._sender_mode = cfg.sender  # relay.sender: "thread" or "loop"
        self.measured: dict[str, float] = {}
        self.downstream = None  # the next relay's handle
        self.chain: list[str] = [relay_id]  # ids from the master down, set by set_chain
        self.master = None  # the master's handle (downstream relays report completions)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"relay-{relay_id}")
        self._read_pool = ThreadPoolExecutor(1, thread_name_prefix=f"relay-{relay_id}-read")
        self._queue: asyncio.Queue | None = None
        self._forwarder: asyncio.Task | None = None
        self._loop = None
        self._new_version: asyncio.Event | None = None  # pulls waiting for a version
        self.publications: list[dict] = []  # master: one record per published version
        self.completions: dict[int, dict[str, float]] = {}  # master: version -> relay -> t
        self.errors: list[str] = []
        self._ignored = -1  # a version refused at its first chunk: drop the rest of it
        self._forwarding: dict[int, Snapshot] = {}  # versions pinned until forwarded
        self._tasks: set[asyncio.Task] = set()
        self.forwarded_chunks = 0
        self.forward_s = 0.0
        self.rechains = 0
        self._sender: BulkSender | None = None  # set by set_chain on a tcp/tls worker
        self._publishing = threading.Lock()  # (master) one publication's copy at a time

    # -- wiring --------------------------------------------------------------------------
    async def set_chain(self, chain: list[str], downstream, master) -> None:
        """Place this relay in the chain: its successor (``None`` at the tail), the master
        (for completion reports) and the ids of the whole chain, master first."""
        self.chain, self.downstream, self.master = list(chain), downstream, master
        self._ensure_forwarder()
        if (
            self._sender is None
            and self._sender_mode == "thread"
            and BulkSender.serves(getattr(downstream, "_address", None))
        ):
            self._sender = _bulk_sender(self.relay_id)

    async def rechain(self, chain: list[str], downstream, master) -> int | None:
        """The chain was rebuilt without a lost relay (docs/faults.md): take the new place
        in it. If the successor changed, whatever was being sent to the old one is
        abandoned (a send to a lost relay would wait out its timeout), and the newest
        complete version is sent to the new one, which ignores it if it holds or began it
        (a version it began from the lost relay stays incomplete there; the next
        publication reaches it). Versions the master had queued are still forwarded.
        Returns the version resent (``None``: none)."""
        changed = downstream is not None and getattr(downstream, "key", None) != getattr(
            self.downstream, "key", None
        )
        published: list[tuple] = []  # (master) versions queued, not yet forwarded
        if changed or downstream is None:
            forwarder, queue = self._forwarder, self._queue
            self._forwarder = None  # (a chunk arriving meanwhile starts a fresh forwarder)
            if forwarder is not None:
                forwarder.cancel()
                await asyncio.gather(forwarder, return_exceptions=True)
            while queue is not None and not queue.empty():
                item = queue.get_nowait()
                if item[0] == "version":
                    published.append(item)
            for snap in self._forwarding.values():
                self.core.unpin(snap)
            self._forwarding.clear()
        await self.set_chain(chain, downstream, master)
        self.rechains += 1
        newest = self.core.newest()
        resend = changed and newest is not None
        if resend:
            self._queue.put_nowait(("resend", newest.version, time.time()))
        for item in published:  # checksummed and sent as ever (the newest one only)
            self._queue.put_nowait(item)
        return newest.version if resend else None

    async def close(self) -> None:
        """The run is over: stop forwarding and the relay's threads. (Left to the actor's
        release, the forwarder would be destroyed pending — asyncio says so on the
        worker's stderr — and each run would leave two idle threads on a long-lived
        cluster.)"""
        forwarder, self._forwarder = self._forwarder, None
        pending = [t for t in (forwarder, *self._tasks) if t is not None and not t.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for pool in (self._pool, self._read_pool):  # (waits out a chunk being written)
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=True)
        sender, self._sender = self._sender, None  # (a late chunk sends from the loop)
        if sender is not None:
            await asyncio.to_thread(sender.close)

    def _ensure_forwarder(self) -> None:
        if self._forwarder is None or self._forwarder.done():
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            self._forwarder = asyncio.ensure_future(self._forward_loop())

    async def calibrate(self, large_bytes: int = 16 * MB, repeats: int = 5) -> dict:
        """Measure ``T_start`` (a tiny call) and ``T_byte`` (a large one) to the next relay,
        medians of ``repeats``; configured values override the measured ones."""
        if self.downstream is None:
            return {"t_byte": self.t_byte, "t_start": self.t_start, "measured": False}
        small, large = np.zeros(1, np.uint8), np.ones(large_bytes, np.uint8)
        ts, tl = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await self._downstream_call("probe", small)
            t1 = time.perf_counter()
            await self._downstream_call("probe", large)
            t2 = time.perf_counter()
            ts.append(t1 - t0)
            tl.append(t2 - t1)
        t_start = float(np.median(ts))
        t_byte = max(float(np.median(tl)) - t_start, 1e-9) / large_bytes
        self.measured = {"t_start": t_start, "t_byte": t_byte}
        if self.t_start is None:
            self.t_start = t_start
        if self.t_byte is None:
            self.t_byte = t_byte
        return {
            "t_byte": self.t_byte,
            "t_start": self.t_start,
            "measured": True,
            **{f"measured_{k}": v for k, v in self.measured.items()},
        }

    async def probe(self, payload) -> int:
        """Calibration sink: receives bytes and drops them."""
        return memoryview(payload).nbytes

    # -- publication (master) --------------------------------------------------------------
    def publish_local(self, version: int, state: Mapping[str, torch.Tensor]) -> float:
        """Publish from the trainer's thread in this same process. Returns the stall: the
        time to reserve a slot and copy ``state`` into it. Forwarding down the chain and
        checksumming happen afterwards, on the relay's own loop and thread."""
        if self._loop is None:
            raise RelayError(f"relay {self.relay_id!r} has no chain yet: call set_chain first")
        t0 = time.perf_counter()
        layout = Layout.of(state)
        k = self._plan(layout.nbytes)
        # One publication at a time: a newer one drops an older one still arriving, and
        # would be given its slot while that is still being written.
        with self._publishing:
            snap = self.core.begin(version, layout, _chunk_bytes(layout.nbytes, k), self.timeout_s)
            if snap is None:
                raise RelayError(f"version {version} is not newer than one already published")
            self.core.write_state(snap, state)
        stall = time.perf_counter() - t0
        record = {
            "version": version,
            "t_publish": time.time(),
            "stall_s": stall,
            "bytes": layout.nbytes,
            "chunks": snap.n_chunks,
        }
        self.publications.append(record)
        # (The queue is read on the loop: a rechain may have replaced it meanwhile.)
        self._loop.call_soon_threadsafe(self._enqueue, ("version", version, record["t_publish"]))
        return stall

    def _enqueue(self, item: tuple) -> None:
        self._queue.put_nowait(item)

    async def publish(self, version: int, state: dict[str, torch.Tensor]) -> float:
        """Publish from another process (the state arrived with the call). Prefer
        :meth:`publish_local` from the trainer's process: see :func:`publisher`."""
        self._ensure_forwarder()
        # Not on the relay thread: a slot may have to wait for the previous version's
        # checksums, which run there.
        return await asyncio.to_thread(self.publish_local, version, state)

    def _plan(self, nbytes: int) -> int:
        p = len(self.chain)
        return plan_chunks(
            p,
            nbytes,
            self.t_byte or 0.0,
            self.t_start or 0.0,
            chunks=self.chunks,
            max_chunk_bytes=self.max_chunk_bytes,
        )

    # -- forwarding (every relay) ----------------------------------------------------------
    async def _forward_loop(self) -> None:
        """Send down the chain in order. The master queues whole versions (a version
        overtaken by a newer one before it started is skipped: downstream only ever needs
        the newest); a downstream relay queues each chunk as it arrives, so it forwards
        chunk ``j`` while its upstream sends ``j+1``."""
        while True:
            item = await self._queue.get()
            try:
                if item[0] == "version":  # (only the master queues versions; a "resend"
                    while not self._queue.empty():  # is first in a fresh queue: never skipped)
                        item = self._queue.get_nowait()
                if item[0] == "version":
                    await self._forward_version(item[1], item[2])
                elif item[0] == "resend":
                    await self._resend(item[1], item[2])
                else:
                    await self._forward_chunk(*item[1:])
            except Exception as e:  # noqa: BLE001 — reported in stats, the loop goes on
                msg = f"{self.relay_id} forwarding {item[:3]}: {e!r}"
                logger.error(msg)
                self.errors.append(msg)

    async def _forward_version(self, version: int, t_publish: float) -> None:
        """Master: checksum chunk after chunk (in the relay thread) and send each as soon
        as its checksum is known; the version is visible here once all are."""
        try:
            snap = self.core.pin(version)
        except VersionUnavailable:
            return  # evicted by newer versions meanwhile
        try:
            ready = [asyncio.Event() for _ in range(snap.n_chunks)]

            async def checksums() -> None:
                for j in range(snap.n_chunks):
                    await self._run(self.core.checksum_chunk, snap, j)
                    ready[j].set()
                self.core.complete(snap)
                self._completed(self.relay_id, version)
                await self._run(self.core.prewarm, snap.layout.nbytes)

            summing = asyncio.ensure_future(checksums())
            try:
                if self.downstream is not None:
                    for j in range(snap.n_chunks):
                        await ready[j].wait()
                        await self._send(snap, j, t_publish)
            finally:  # even when a rechain cancels the sends: the version completes here
                await asyncio.wait([summing])
            summing.result()
        finally:
            self.core.unpin(snap)

    async def _resend(self, version: int, t_publish: float) -> None:
        """Send a complete version we hold to the (new) successor, chunk after chunk."""
        try:
            snap = self.core.pin(version)
        except VersionUnavailable:
            return  # evicted meanwhile: the newer one follows through the chain anyway
        try:
            for j in range(snap.n_chunks):
                await self._send(snap, j, t_publish)
        finally:
            self.core.unpin(snap)

    async def _forward_chunk(self, version: int, j: int, t_publish: float) -> None:
        """Send one chunk; the version stays pinned (not evictable) from its first chunk
        to its last, so a lagging forwarder never loses a version halfway."""
        snap = self._forwarding.get(version)
        if snap is None:
            return  # its forwarding failed earlier: the rest of it is dropped
        try:
            await self._send(snap, j, t_publish)
        except Exception:
            self._forwarding.pop(version, None)
            self.core.unpin(snap)
            raise
        if j == snap.n_chunks - 1:
            self._forwarding.pop(version, None)
            self.core.unpin(snap)

    async def _send(self, snap: Snapshot, j: int, t_publish: float) -> None:
        a, b = snap.span(j)
        t0 = time.perf_counter()
        await self._downstream_call(
            "receive_chunk",
            snap.version,
            snap.layout,
            snap.chunk_bytes,
            j,
            snap.buf[a:b],  # a view of the pinned slot: no copy on our side
            snap.crcs[j],
            t_publish,
        )
        self.forward_s += time.perf_counter() - t0
        self.forwarded_chunks += 1

    async def receive_chunk(
        self,
        version: int,
        layout: Layout,
        chunk_bytes: int,
        j: int,
        data,
        crc: int,
        t_publish: float,
    ) -> None:
        """From the upstream relay: hand chunk ``j`` to the relay thread (store, verify)
        and return at once, so the upstream sends ``j+1`` while we verify ``j`` and
        forward ``j-1``. A chunk that fails verification never completes its version
        (the error is in :meth:`stats`); the next version replaces it."""
        self._ensure_forwarder()
        if j == 0:
            # Once the relay thread has run every earlier write, an older version still
            # incomplete was abandoned upstream (or by a rechain): stop forwarding it, and
            # free its pin before a slot is asked for the new one.
            await self._run(lambda: None)
            for v, old in list(self._forwarding.items()):
                if v < version and not old.complete:
                    del self._forwarding[v]
                    self.core.unpin(old)
            snap = await self._run(self.core.begin, version, layout, chunk_bytes, self.timeout_s)
            if snap is None:  # not newer than what we hold: the whole version is ignored
                self._ignored = version
                return
            if self.downstream is not None:
                self._forwarding[version] = self.core.pin(version)
        elif version == self._ignored:
            return
        # Submitted now (not when a task first runs): the relay thread keeps arrival order.
        stored = asyncio.get_running_loop().run_in_executor(
            self._pool, self.core.write_chunk, version, j, data, crc
        )
        task = asyncio.ensure_future(self._after_store(stored, version, j, t_publish, layout))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _after_store(self, stored, version: int, j: int, t_publish: float, layout) -> None:
        try:
            done = await stored
        except RelayError as e:
            self.errors.append(str(e))
            logger.error("relay %s: %s", self.relay_id, e)
            return
        if self.downstream is not None:
            self._queue.put_nowait(("chunk", version, j, t_publish))
        if done:
            self._completed(self.relay_id, version)
            await self._report(version)
            await self._run(self.core.prewarm, layout.nbytes)

    async def _report(self, version: int) -> None:
        if self.master is None:
            return
        try:
            await self._call(self.master.relay_completed(self.relay_id, version))
        except Exception as e:  # noqa: BLE001 — a lost master must not stop the chain
            self.errors.append(f"reporting version {version} to the master: {e!r}")

    async def relay_completed(self, relay_id: str, version: int) -> None:
        """Master: relay ``relay_id`` holds ``version`` complete (timed on our clock)."""
        self._completed(relay_id, version)

    def _completed(self, relay_id: str, version: int) -> None:
        self.completions.setdefault(version, {})[relay_id] = time.time()

    # -- reading (rollouts) ------------------------------------------------------------------
    async def newest(self, have_version: int = -1, wait_s: float = 0.0) -> dict | None:
        """The newest complete version's pull info, or ``None`` if none is newer than
        ``have_version`` — at once, or once ``wait_s`` has passed without one (a long
        poll: an idle rollout waits here, not in a loop of calls)."""
        loop = asyncio.get_running_loop()
        if self.core.on_complete is None:  # armed before the check below: no lost wake-up
            self.core.on_complete = lambda: loop.call_soon_threadsafe(self._wake_pulls)
        deadline = loop.time() + wait_s
        while True:
            snap = self.core.newest()
            if snap is not None and snap.version > have_version:
                return snap.info()
            left = deadline - loop.time()
            if left <= 0:
                return None
            if self._new_version is None:
                self._new_version = asyncio.Event()
            try:
                await asyncio.wait_for(self._new_version.wait(), left)
            except TimeoutError:
                return None

    def _wake_pulls(self) -> None:
        """On the event loop: a version became visible."""
        if self._new_version is not None:
            self._new_version.set()
            self._new_version = None

    async def info(self, version: int) -> dict:
        """Pull info of a kept version (:class:`VersionUnavailable` if not kept)."""
        return self.core.get(version).info()

    async def read_chunk(self, version: int, j: int):
        # Reads have their own thread: a write waiting for a slot must not stall pulls.
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._read_pool, self.core.read_chunk, version, j)

    async def versions(self) -> list[int]:
        return self.core.versions()

    async def heartbeat(self) -> float:
        """0: it answered (its event loop runs). The manager's hung-relay check."""
        return 0.0

    async def retain(self, versions: list[int]) -> None:
        """See :meth:`RelayCore.retain` (the manager sends the versions in use)."""
        self.core.retain(versions)

    async def stats(self) -> dict:
        out = {
            "relay_id": self.relay_id,
            "chain": self.chain,
            **self.core.stats(),
            "t_byte": self.t_byte,
            "t_start": self.t_start,
            "forwarded_chunks": self.forwarded_chunks,
            "forward_s": self.forward_s,
            # Where sends to the successor run: "thread" (BulkSender), "loop" (the
            # worker's event loop); None at the tail, which sends nothing.
            "sender": None
            if self.downstream is None
            else "thread"
            if self._sends_from_thread()
            else "loop",
            "rechains": self.rechains,
            "errors": self.errors[-5:],
        }
        if self.master is None:
            out["publications"] = self.publication_records()
        return out

    def publication_records(self) -> list[dict]:
        """Master: each publication with the time until every relay held it."""
        out = []
        for rec in self.publications:
            done = self.completions.get(rec["version"], {})
            times = [done.get(r) for r in self.chain]
            row = dict(rec)
            row["relays_complete"] = sum(t is not None for t in times)
            row["broadcast_s"] = (
                max(times) - rec["t_publish"] if all(t is not None for t in times) else math.nan
            )
            out.append(row)
        return out

    # -- helpers ---------------------------------------------------------------------------
    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _sends_from_thread(self) -> bool:
        sender = self._sender
        return sender is not None and sender.serves(getattr(self.downstream, "_address", None))

    async def _downstream_call(self, function: str, *args):
        """A call to the successor: from the bulk sender's thread where it serves the
        successor's address (calibration measures the path the chunks take)."""
        if self._sends_from_thread():
            return await self._sender.call(
                self.downstream, function, *args, timeout_s=self.timeout_s
            )
        return await self._call(getattr(self.downstream, function)(*args))

    async def _call(self, actor_future):
        # A call to an actor whose worker died never returns on its own. (asyncio.timeout,
        # not wait_for: on 3.11 wait_for swallows a cancellation that arrives as the call
        # completes, and a rechain waiting for the cancelled forwarder would hang.)
        async with asyncio.timeout(self.timeout_s):
            return await _awaitable(actor_future)


async def _awaitable(fut):
    return await fut


def _bulk_sender(relay_id: str) -> BulkSender | None:
    """A :class:`BulkSender` with this worker's security settings (``None`` outside a
    worker: sends stay on the caller's loop)."""
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:
        return None
    return BulkSender(f"relay-{relay_id}-send", worker.connection_args)


def _chunk_bytes(nbytes: int, k: int) -> int:
    per = -(-max(nbytes, 1) // max(k, 1))
    return -(-per // ALIGN) * ALIGN


# -- the trainer and rollout sides ----------------------------------------------------------


def local_instance(actor):
    """The object behind an actor handle when it lives in this very process, else ``None``
    (the trainer's thread publishes to its co-located master without any comm)."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        return None
    if getattr(actor, "_address", None) != worker.address:
        return None
    return worker.state.actors.get(actor.key)


class Publisher:
    """The trainer's end of the relay tier: publish in-process when the master is
    co-located (one host copy), else through a call that carries the weights."""

    def __init__(self, master, timeout_s: float) -> None:
        self.master = master
        self.local = local_instance(master)
        self.timeout_s = timeout_s

    def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> float:
        if self.local is not None:
            return self.local.publish_local(version, state)
        cpu = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        return self.master.publish(version, cpu).result(timeout=self.timeout_s)


class RelaySwitched(RelayError):
    """The rollout was pointed at another relay while a pull waited on the old one."""


class RelayUnreachable(RelayError):
    """The relay could not be reached (its worker is lost) and the caller chose not to
    wait for the manager to point it at another one."""


class Puller:
    """A rollout's end: the newest version from its local relay, verified chunk by chunk,
    into a buffer kept warm across pulls. Up to ``window`` chunk reads are in flight.

    :meth:`switch` points it at another relay (its own was lost, docs/faults.md); a pull
    waiting on the old relay gives up within ``poll_s`` and starts again on the new one,
    instead of waiting out the timeout of a call that will never be answered.
    """

    def __init__(self, relay, timeout_s: float, window: int = 4, poll_s: float = 0.1) -> None:
        self.relay = relay
        self.timeout_s = timeout_s
        self.window = window
        self.poll_s = poll_s
        self._buf: np.ndarray | None = None
        self.pulls = 0
        self.bytes = 0
        self.retries = 0
        self.switches = 0
        # Called after each chunk read and each poll while waiting on the relay: the
        # rollout's heartbeat (waiting on a relay is not hanging; a hung relay is the
        # manager's to fence, and a switch ends the wait).
        self.on_progress = None

    def switch(self, relay) -> None:
        """Pull from ``relay`` from now on (called from another thread); ``None``: the
        relay is lost and there is none to pull from yet (the master, until the trainer
        restarts): a pull waits for the next switch, or with ``wait_switch=False`` raises
        :class:`RelayUnreachable` at once."""
        self.relay = relay
        self.switches += 1

    def _result(self, future, switches: int):
        """``future.result()``, abandoned as soon as :meth:`switch` was called, or once
        the relay's worker is gone (a call in flight to a lost actor otherwise waits out
        its whole timeout; nobody may be there to switch us: the manager can be lost
        with the master, when the trainer and data module share a worker)."""
        from laminar.cluster import LOST_POLL_S, ActorLost, worker_alive

        relay = self.relay
        deadline = time.monotonic() + self.timeout_s
        next_check = time.monotonic() + LOST_POLL_S
        while True:
            try:
                return future.result(timeout=self.poll_s)
            except UnboundLocalError:
                # distributed's sync met the answer as its timeout fired (seen under
                # load, laminar.cluster.actor_result): it is there for the next wait.
                # Not a lost relay: counting it as one failed a pull from a healthy relay.
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no answer from the relay in {self.timeout_s} s") from None
                continue
            except TimeoutError:
                self._progress()
                if self.switches != switches:
                    raise RelaySwitched("the relay was switched during a pull") from None
                if time.monotonic() >= deadline:
                    raise
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + LOST_POLL_S
                    if relay is not None and not worker_alive(relay):
                        raise ActorLost(f"the worker of relay {relay.key} is gone") from None

    def _retrying(self, fn, wait_switch: bool = True):
        """``fn(relay, switches)``, started again on the new relay after a switch. A relay
        that cannot be reached (its worker lost: the call fails, or never returns) is
        given up for the one the manager switches us to, if that comes within the
        timeout (``wait_switch=False``: :class:`RelayUnreachable` at once); an answer
        that is an error (checksum, eviction) is raised as it is."""
        while True:
            switches = self.switches
            if self.relay is None:  # lost, none to pull from yet
                if not wait_switch:
                    raise RelayUnreachable("the relay is lost and none replaces it yet")
                if not self._switched_since(switches):
                    raise RelayUnreachable("the relay is lost and none replaced it in time")
                continue
            try:
                return fn(self.relay, switches)
            except RelaySwitched:
                self.retries += 1
            except RelayError:
                raise
            except Exception as e:
                if self.switches != switches:  # switched while it failed: go again
                    self.retries += 1
                    continue
                if not wait_switch:
                    raise RelayUnreachable(f"the relay cannot be reached: {e!r}") from e
                if not self._switched_since(switches):
                    raise
                self.retries += 1

    def _switched_since(self, switches: int) -> bool:
        deadline = time.monotonic() + self.timeout_s
        while self.switches == switches:
            if time.monotonic() >= deadline:
                return False
            self._progress()
            time.sleep(self.poll_s)
        return True

    def _progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress()

    def versions(self) -> list[int]:
        """The versions the relay holds complete."""
        return self._retrying(lambda relay, sw: self._result(relay.versions(), sw))

    def newest(
        self, have_version: int, wait_s: float = 0.0, wait_switch: bool = True
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``(version, state)`` if the relay holds a version newer than ``have_version``
        (waiting up to ``wait_s`` for one). The tensors view a buffer this puller reuses:
        load them before the next pull. ``wait_switch``: see :meth:`_retrying`."""

        def pull(relay, switches):
            # A version evicted while we read it was replaced by a newer one: take that.
            # Only a relay that evicts every version it offers for a whole timeout (the
            # trainer publishing faster than a pull, for that long) fails the pull.
            deadline = time.monotonic() + self.timeout_s
            while True:
                info = self._result(relay.newest(have_version, wait_s), switches)
                if info is None:
                    return None
                try:
                    return info["version"], self._read(relay, info, switches)
                except VersionUnavailable:
                    self.retries += 1
                    if time.monotonic() >= deadline:
                        raise RelayError(
                            f"every version the relay offered for {self.timeout_s:.0f} s was "
                            "evicted while it was read: publications outpace a pull; raise "
                            "relay.keep_versions"
                        ) from None

        return self._retrying(pull, wait_switch)

    def version(self, version: int) -> dict[str, torch.Tensor]:
        """A given (older) version if the relay keeps it, else :class:`VersionUnavailable`."""

        def pull(relay, switches):
            info = self._result(relay.info(version), switches)
            return self._read(relay, info, switches)

        return self._retrying(pull)

    def _read(self, relay, info: dict, switches: int) -> dict[str, torch.Tensor]:
        layout: Layout = info["layout"]
        if self._buf is None or self._buf.nbytes != layout.nbytes:
            self._buf = host_buffer(layout.nbytes)
        crcs, cb, n = info["crcs"], info["chunk_bytes"], len(info["crcs"])
        futures, ahead = {}, 0
        for j in range(n):
            while ahead < min(n, j + self.window):
                futures[ahead] = relay.read_chunk(info["version"], ahead)
                ahead += 1
            data, crc = self._result(futures.pop(j), switches)
            if crc != crcs[j] or checksum(data) != crc:
                raise RelayError(
                    f"chunk {j} of version {info['version']} failed its checksum on pull"
                )
            self._buf[j * cb : j * cb + data.nbytes] = data
            self._progress()
        self.pulls += 1
        self.bytes += layout.nbytes
        return layout.read(self._buf)


def fetch_version(
    version: int, puller: Puller | None, checkpoints_dir: str | Path | None
) -> dict[str, torch.Tensor]:
    """Weights of an old ``version`` (recovery): a relay's kept copy, else the trainer's
    checkpoint ``checkpoints_dir/version-NNNNNN`` on disk."""
    if puller is not None:
        try:
            return puller.version(version)
        except VersionUnavailable:
            pass
    if checkpoints_dir is not None:
        folder = Path(checkpoints_dir) / f"version-{version:06d}"
        files = sorted(folder.glob("*.safetensors"))
        if files:
            from safetensors.torch import load_file

            state: dict[str, torch.Tensor] = {}
            for f in files:
                state.update(load_file(f))
            return state
    raise VersionUnavailable(
        f"version {version} is neither kept by the relay nor checkpointed under "
        f"{checkpoints_dir}; raise relay.keep_versions or checkpoint more often"
    )


# -- placement ---------------------------------------------------------------------------


@dataclass
class RelayTier:
    """The chain of one run: the master (in the trainer's process) first, then the
    downstream relays, and which relay each rollout pulls from."""

    relays: list  # actor handles, master first
    ids: list[str]
    workers: list[str]
    calibration: dict

    @property
    def master(self):
        return self.relays[0]

    def handle(self, relay_id: str):
        """The handle of relay ``relay_id``."""
        return self.relays[self.ids.index(relay_id)]

    def local_relay(self, rollout_worker: str, taken: dict[int, int], lost=()) -> int:
        """The index of the relay a rollout on ``rollout_worker`` pulls from: a
        downstream relay on its host if there is one (the least used), else the master if
        it shares the host, else the least used relay anywhere; never one of ``lost``
        (ids). ``taken`` counts the rollouts each relay serves."""
        host = _host(rollout_worker)
        live = [i for i in range(len(self.relays)) if self.ids[i] not in set(lost)]
        down = [i for i in live if i > 0 and _host(self.workers[i]) == host]
        cands = down or ([0] if _host(self.workers[0]) == host else live)
        i = min(cands, key=lambda i: (taken.get(i, 0), i))
        taken[i] = taken.get(i, 0) + 1
        return i


def _host(address: str) -> str:
    from urllib.parse import urlparse

    return urlparse(address).hostname or address


def start_chain(
    client, placement: list[tuple[str, str]], cfg: RelayConfig
) -> tuple[list, list[str]]:
    """A :class:`Relay` on each ``(worker, resource)`` of ``placement``, the first being
    the master, chained in that order. Returns the handles and their ids."""
    from laminar.cluster import submit_actor

    ids = ["master"] + [f"relay{i}" for i in range(1, len(placement))]
    relays = [
        submit_actor(client, Relay, rid, cfg, worker=w, resource=res)
        for rid, (w, res) in zip(ids, placement, strict=True)
    ]
    for i, r in enumerate(relays):
        nxt = relays[i + 1] if i + 1 < len(relays) else None
        r.set_chain(ids, nxt, None if i == 0 else relays[0]).result(timeout=cfg.timeout_s)
    return relays, ids


def build_tier(
    client, cfg: RunConfig, trainer_worker: str, rollout_workers: list[str]
) -> RelayTier:
    """Create the relays of a run, chain them and measure the first link.

    The master goes on the trainer's worker (publication is then one host copy in that
    process). ``relay.relays = None`` puts one relay on every other host that runs
    rollouts — on a worker of that host with the ``relay`` resource if any, else on its
    first rollout worker; a number ``n`` takes ``n`` workers with the ``relay`` resource.
    """
    from laminar.cluster import place, workers_with

    rcfg = cfg.relay
    placed: list[tuple[str, str]] = []  # (worker, resource)
    if rcfg.relays is None:
        relay_ws = workers_with(client, "relay")
        hosts = []
        for w in rollout_workers:
            h = _host(w)
            if h != _host(trainer_worker) and h not in hosts:
                hosts.append(h)
        for h in hosts:
            own = [w for w in relay_ws if _host(w) == h]
            placed.append(
                (own[0], "relay")
                if own
                else (next(w for w in rollout_workers if _host(w) == h), "rollout")
            )
    else:
        placed = [(w, "relay") for w in place(client, "relay", rcfg.relays)]
    relays, ids = start_chain(client, [(trainer_worker, "trainer"), *placed], rcfg)
    calibration = relays[0].calibrate().result(timeout=rcfg.timeout_s * 2)
    return RelayTier(relays, ids, [trainer_worker] + [w for w, _ in placed], calibration)
