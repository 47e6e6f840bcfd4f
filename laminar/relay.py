"""The relay tier: versioned host-memory weight snapshots, a pipelined chain broadcast,
and rollout-local pulls (paper §4, Appendix D).

The trainer publishes a version to the *master* relay, which lives in the trainer's own
worker process: publication is one host copy into a pre-allocated slot (the *publication
stall*), after which training goes on. The master then cuts the snapshot into ``k``
chunks and sends chunk ``j`` to the next relay of the chain while that relay forwards
chunk ``j-1`` to its own successor, and so on down the chain. Each rollout asks its local
relay for the newest complete version at its batch boundary and copies it into its
engine (the *rollout wait*).

Pieces, from the bottom up, one module each:

* :mod:`laminar.relay_core` — :class:`~laminar.relay_core.Layout` (where each tensor of a
  state dict lives in one flat byte buffer), the chain's time model, and
  :class:`~laminar.relay_core.RelayCore`, the versioned snapshot store of one relay,
  without Dask: slots recycled under a memory budget, the last ``keep_versions`` complete
  versions kept, per-chunk checksum (xxh3-64) verification, monotonic visibility, pins
  for readers and forwarders.
* :mod:`laminar.relay_sender` — :class:`~laminar.relay_sender.BulkSender`, the thread
  with its own event loop that a relay's sends to its successor run on.
* this module — :class:`Relay`, the Dask actor around a core: chain forwarding,
  calibration of ``T_byte``/``T_start``, completion reports to the master, statistics.
* :mod:`laminar.relay_client` — the trainer's :class:`~laminar.relay_client.Publisher`,
  a rollout's :class:`~laminar.relay_client.Puller` (the newest version) and
  :func:`~laminar.relay_client.fetch_version` (a given old one: kept by a relay, else
  the trainer's checkpoint on disk).
* :mod:`laminar.relay_tier` — placement: where the relays go and whom each rollout
  pulls from.

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
import bisect
import contextlib
import logging
import math
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from laminar.relay_core import (
    ALIGN,
    MB,
    Layout,
    RelayCore,
    RelayError,
    Snapshot,
    VersionUnavailable,
    plan_chunks,
)
from laminar.relay_sender import BulkSender as BulkSender
from laminar.relay_sender import _bulk_sender

if TYPE_CHECKING:
    from laminar.config import RelayConfig

logger = logging.getLogger(__name__)

# A version whose send to the successor failed (a timeout under load, a reset connection,
# the successor finding no free slot) is sent again whole, up to this many times, after
# SEND_RETRY_S, then twice that, and so on: the successor goes on with the part it holds
# (RelayCore.begin ``resume``), so the relays below it are not left without that version
# until the next publication (a paused partial rollout below waits for it).
SEND_RETRIES = 3
SEND_RETRY_S = 0.25
# A relay keeps its newest KEEP_ERRORS error messages (``error_count`` counts them all)
# and the completion times of its newest KEEP_COMPLETIONS versions: a long run with a
# recurring fault grew both by one entry a version. (The master settles a version's
# publication record when its completions are dropped: it no longer changes.)
KEEP_ERRORS = 100
KEEP_COMPLETIONS = 1000


# -- the Dask actor ------------------------------------------------------------------------


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
        self.errors: list[str] = []  # the newest KEEP_ERRORS
        self.error_count = 0
        self._ignored = -1  # a version refused at its first chunk: drop the rest of it
        self._forwarding: dict[int, Snapshot] = {}  # versions pinned until forwarded
        # The forward loop's current item, (version, task): a newer version that needs a
        # slot, or is complete here, cancels it (:meth:`_abandon`).
        self._in_flight: tuple[int, asyncio.Future] | None = None
        # Master: each published version's checksums, (per-chunk events, task), run
        # apart from the forwarding so that a version is visible here at once.
        self._sums: dict[int, tuple[list[asyncio.Event], asyncio.Future]] = {}
        # Versions arriving here when a rechain gave us a new successor: each is sent to
        # it whole once complete (its chunks so far went to the lost one).
        self._resend_when_complete: set[int] = set()
        self._rechaining = False  # no forwarder starts while a rechain swaps it
        self._rechain_lock: asyncio.Lock | None = None
        self._retain_seq: tuple | None = None  # the newest retain call taken
        self._tasks: set[asyncio.Task] = set()
        self.forwarded_chunks = 0
        self.forward_s = 0.0
        self.rechains = 0
        # Sends to the successor that failed, versions sent again after one, and versions
        # given up (SEND_RETRIES spent). ``_retrying``: the version retried and its tries.
        self.overtaken = 0  # versions whose forwarding stopped: a newer one was complete
        self.send_failures = 0
        self.send_retries = 0
        self.sends_given_up = 0
        self._retrying: tuple[int, int] = (-1, 0)
        self._retry_timer: asyncio.TimerHandle | None = None
        self._retry_msg: str | None = None  # the error entry that announced that timer
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
        complete version is sent to the new one, which ignores it if it holds it already
        (or began a newer one). A version still arriving here is sent to it whole once
        complete; the new successor completes a version it began from the lost relay
        from that send (:meth:`RelayCore.begin` ``resume``). Versions the master had
        queued are still forwarded. Returns the version resent at once (``None``:
        none)."""
        if self._rechain_lock is None:
            self._rechain_lock = asyncio.Lock()
        async with self._rechain_lock:
            return await self._rechain(chain, downstream, master)

    async def _rechain(self, chain: list[str], downstream, master) -> int | None:
        changed = downstream is not None and getattr(downstream, "key", None) != getattr(
            self.downstream, "key", None
        )
        published: list[tuple] = []  # (master) versions queued, not yet forwarded
        if changed or downstream is None:
            forwarder, queue = self._forwarder, self._queue
            # Until the new forwarder starts, none may: one started while we wait would
            # send to the lost relay, and release (again) a pin released below.
            self._rechaining = True
            try:
                if forwarder is not None:
                    forwarder.cancel()
                    await asyncio.gather(forwarder, return_exceptions=True)
            finally:
                self._rechaining = False
            # (No await from here to set_chain: chunks stored meanwhile were queued on
            # the old queue, and are dropped with it.)
            while queue is not None and not queue.empty():
                item = queue.get_nowait()
                if item[0] == "version":
                    published.append(item)
            forwarding, self._forwarding = self._forwarding, {}
            for snap in forwarding.values():
                self.core.unpin(snap)
            self._forwarder = None
            if self._retry_timer is not None:  # (it would send to the lost successor)
                self._retry_timer.cancel()
                self._retry_timer = None
                self._call_off_retry(
                    "the chain was rebuilt; the new successor gets what it needs from the rechain"
                )
        await self.set_chain(chain, downstream, master)
        self.rechains += 1
        newest = self.core.newest()
        resend = changed and newest is not None
        if changed:
            above = -1 if newest is None else newest.version
            self._resend_when_complete = {v for v in self.core.arriving() if v > above}
        elif downstream is None:
            self._resend_when_complete = set()
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
        if self._retry_timer is not None:
            self._retry_timer.cancel()
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
        if self._rechaining:  # (the rechain starts it once the old one has stopped)
            return
        if self._forwarder is None or self._forwarder.done():
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            self._forwarder = asyncio.ensure_future(self._forward_loop())
            self.core.on_slot_wanted = self._slot_wanted

    def _slot_wanted(self, version: int) -> None:
        """From :meth:`RelayCore.begin` (any thread, the core's lock held): ``version``
        waits for a slot. Forwarding older versions must not be what it waits for."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                loop.call_soon_threadsafe(self._abandon, version)

    def _abandon(self, newer: int) -> None:
        """Stop forwarding every version older than ``newer`` (a newer version needs a
        slot here, or is complete here): release their forwarding pins and cancel the
        send in flight, whose own pin is released as it stops. A send to a hung successor
        otherwise held its version's slot for up to ``relay.timeout_s``; the next
        version's :meth:`RelayCore.begin` waited for it on the relay thread, the upstream's
        send of that version's first chunk waited for the begin, and so on up to the
        master. The relays below get ``newer`` instead (they only ever need the newest)."""
        dropped = set()
        for v, snap in list(self._forwarding.items()):
            if v < newer:
                self._stop_forwarding(v, snap)
                dropped.add(v)
        flight = self._in_flight
        if flight is not None and flight[0] < newer and not flight[1].done():
            flight[1].cancel()
            dropped.add(flight[0])
        self.overtaken += len(dropped)

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
            self.core.pin(version)  # the checksums' (:meth:`_checksums` releases it)
            try:
                self.core.write_state(snap, state)
            except BaseException:
                self.core.unpin(snap)
                raise
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
        self._loop.call_soon_threadsafe(self._published, snap, record["t_publish"])
        return stall

    def _published(self, snap: Snapshot, t_publish: float) -> None:
        """On the loop: checksum the new version (it is visible here once they are
        done, whatever the forwarding does) and queue it to be sent down."""
        ready = [asyncio.Event() for _ in range(snap.n_chunks)]
        task = asyncio.ensure_future(self._checksums(snap, ready))
        self._sums[snap.version] = (ready, task)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._sums.pop(snap.version, None))
        self._queue.put_nowait(("version", snap.version, t_publish))

    async def _checksums(self, snap: Snapshot, ready: list[asyncio.Event]) -> None:
        """Master: checksum chunk after chunk in the relay thread (the forwarder sends
        each as soon as it is known), then make the version visible here. Holds the pin
        :meth:`publish_local` took."""
        try:
            for j in range(snap.n_chunks):
                await self._run(self.core.checksum_chunk, snap, j)
                ready[j].set()
            self.core.complete(snap)
        except Exception as e:  # noqa: BLE001 — said in errors; the next version goes on
            msg = f"{self.relay_id} checksumming version {snap.version}: {e!r}"
            logger.error(msg)
            self._error(msg)
            return
        finally:
            self.core.unpin(snap)
        self._completed(self.relay_id, snap.version)
        await self._prewarm(snap.layout.nbytes)

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
        chunk ``j`` while its upstream sends ``j+1``, and stops forwarding a version once
        a newer one is complete here. Each item runs as a task of its own, which
        :meth:`_abandon` cancels when a newer version needs its slot (or, below the
        master, is complete here): a hung successor then costs the relays above it
        nothing but the sends it swallows."""
        while True:
            item = await self._queue.get()
            if item[0] == "version":  # (only the master queues versions; a "resend"
                while not self._queue.empty():  # is first in a fresh queue: never skipped)
                    item = self._queue.get_nowait()
            if item[0] == "version":
                work = self._forward_version(item[1], item[2])
            elif item[0] == "resend":
                work = self._resend(item[1], item[2])
            else:
                work = self._forward_chunk(*item[1:])
            # Its own task: :meth:`_abandon` cancels it, not the loop.
            task = asyncio.ensure_future(work)
            self._in_flight = (item[1], task)
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:  # (a rechain or close stops the loop)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise
            finally:
                self._in_flight = None
            if task.cancelled():
                continue  # abandoned: a newer version overtook it (counted there)
            e = task.exception()
            if e is not None:  # reported in stats, the loop goes on
                msg = f"{self.relay_id} forwarding {item[:3]}: {e!r}"
                logger.error(msg)
                self._error(msg)

    async def _forward_version(self, version: int, t_publish: float) -> None:
        """Master: send the version chunk after chunk, each as soon as its checksum is
        known (:meth:`_checksums`, which makes it visible here on its own)."""
        if self.downstream is None:
            return
        try:
            snap = self.core.pin(version)
        except VersionUnavailable:
            return  # evicted by newer versions meanwhile
        try:
            ready, summing = self._sums.get(version, (None, None))
            for j in range(snap.n_chunks):
                if snap.crcs[j] is None:
                    if summing is None:
                        return  # its checksums failed (said in errors)
                    await _either(ready[j], summing)
                    if not ready[j].is_set():
                        return  # its checksums failed (said in errors)
                try:
                    await self._send(snap, j, t_publish)
                except Exception as e:  # noqa: BLE001 — sent again once complete
                    self._send_failed(version, t_publish, e)
                    return
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
                try:
                    taken = await self._send(snap, j, t_publish)
                except Exception as e:  # noqa: BLE001 — sent again, up to SEND_RETRIES
                    self._send_failed(version, t_publish, e)
                    return
                if j == 0 and taken is False:
                    break  # it holds this version or a newer one: the rest is not needed
            if self._retrying[0] == version:  # (sent: a later failure starts counting anew)
                self._retrying = (-1, 0)
        finally:
            self.core.unpin(snap)

    async def _forward_chunk(self, version: int, j: int, t_publish: float) -> None:
        """Send one chunk; the version stays pinned (not evictable) from its first chunk
        to its last, so a lagging forwarder never loses a version halfway. That pin has
        one owner, the ``_forwarding`` entry: whoever removes the entry releases it (a
        newer version's first chunk or a rechain may drop it during a send). The send
        holds a pin of its own, so the slot it reads is not recycled under it."""
        snap = self._forwarding.get(version)
        if snap is None:
            return  # its forwarding failed earlier, or was dropped: the rest of it too
        newest = self.core.newest()
        if newest is not None and newest.version > version:
            # Overtaken: a newer version is complete here, and its chunks follow in the
            # queue. The relays below need only the newest (a pull takes the newest; a
            # rollout paused for this one resumes with a newer), and a successor slower
            # than our upstream would otherwise fall further behind at every version.
            self._stop_forwarding(version, snap)
            self.overtaken += 1
            return
        held = self.core.pin(version)
        try:
            await self._send(snap, j, t_publish)
        except Exception as e:  # noqa: BLE001 — its later chunks are skipped (no entry)
            self._stop_forwarding(version, snap)
            self._send_failed(version, t_publish, e)
            return
        finally:
            self.core.unpin(held)
        if j == snap.n_chunks - 1:
            self._stop_forwarding(version, snap)

    def _send_failed(self, version: int, t_publish: float, error: Exception) -> None:
        """A send of ``version`` to the successor failed (a rechain's cancellation is no
        failure: it resends what the new successor needs). Record it, and send the version
        again whole after a backoff, once it is complete here, unless a newer one has
        begun here by then (it supersedes this one all the way down) or the successor has
        changed (the rechain resends). After ``SEND_RETRIES`` tries it is given up: the
        next version is the next chance of the relays below."""
        self.send_failures += 1
        msg = f"{self.relay_id} sending version {version} on: {error!r}"
        done = self._retrying[1] if self._retrying[0] == version else 0
        if done >= SEND_RETRIES:
            self.sends_given_up += 1
            msg += f"; given up after {done} retries"
        elif self.core.newest_begun > version:
            msg += f"; version {self.core.newest_begun} supersedes it"
        else:
            self._retrying = (version, done + 1)
            delay = SEND_RETRY_S * 2**done
            msg += f"; sending it again in {delay:.2f} s (retry {done + 1} of {SEND_RETRIES})"
            if self._retry_timer is not None:
                self._retry_timer.cancel()
                self._call_off_retry(f"version {version} failed since, and is retried instead")
            self._retry_timer = asyncio.get_running_loop().call_later(
                delay, self._retry, self._queue, version, t_publish
            )
            self._retry_msg = msg
        logger.error(msg)
        self._error(msg)

    def _call_off_retry(self, reason: str) -> None:
        """The retry announced in ``errors`` will not be made: say so in that entry (it
        read "sending it again in 0.25 s" after a rechain had called the retry off)."""
        msg, self._retry_msg = self._retry_msg, None
        if msg is None:
            return
        logger.info("%s; called off: %s", msg, reason)
        for i in range(len(self.errors) - 1, -1, -1):
            if self.errors[i] is msg:
                self.errors[i] = f"{msg}; called off: {reason}"
                break

    def _retry(self, queue: asyncio.Queue, version: int, t_publish: float) -> None:
        """The backoff of a failed send is over: queue the version to be sent again whole
        (once it is complete here, if it is still arriving)."""
        self._retry_timer = None
        if queue is not self._queue:  # (a rechain calls it off itself, said there)
            return
        if self.core.newest_begun > version:
            self._call_off_retry(f"version {self.core.newest_begun} supersedes it")
            return
        self._retry_msg = None
        try:
            self.core.get(version)
        except VersionUnavailable:
            if version in self.core.arriving():
                self.send_retries += 1
                self._resend_when_complete.add(version)  # (_after_store queues it)
            return
        self.send_retries += 1
        queue.put_nowait(("resend", version, t_publish))

    def _error(self, msg: str) -> None:
        self.error_count += 1
        self.errors.append(msg)
        if len(self.errors) > KEEP_ERRORS:
            del self.errors[: len(self.errors) - KEEP_ERRORS]

    def _stop_forwarding(self, version: int, snap: Snapshot) -> None:
        """Release the forwarding pin of ``snap``, unless it was released already."""
        if self._forwarding.get(version) is snap:
            del self._forwarding[version]
            self.core.unpin(snap)

    async def _send(self, snap: Snapshot, j: int, t_publish: float):
        a, b = snap.span(j)
        t0 = time.perf_counter()
        taken = await self._downstream_call(
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
        return taken

    async def receive_chunk(
        self,
        version: int,
        layout: Layout,
        chunk_bytes: int,
        j: int,
        data,
        crc: int,
        t_publish: float,
    ) -> bool:
        """From the upstream relay: hand chunk ``j`` to the relay thread (store, verify)
        and return at once, so the upstream sends ``j+1`` while we verify ``j`` and
        forward ``j-1``. The last chunk's call is answered once it is stored, and raises
        if the version is incomplete here (a chunk failed verification: the error is in
        :meth:`stats`), so that the upstream sends it again. Returns whether the chunk
        was taken (``False``: its version is ignored here, held already or older than
        one begun)."""
        self._ensure_forwarder()
        if j == 0:
            # Once the relay thread has run every earlier write, an older version still
            # incomplete was abandoned upstream (or by a rechain): stop forwarding it, and
            # free its pin before a slot is asked for the new one.
            await self._run(lambda: None)
            for v, old in list(self._forwarding.items()):
                if v < version and not old.complete:
                    self._stop_forwarding(v, old)
            self._resend_when_complete = {v for v in self._resend_when_complete if v >= version}
            # (resume: a version begun from a relay lost since, sent again from its start
            # by the new upstream, goes on in the same snapshot)
            snap = await self._run(
                self.core.begin, version, layout, chunk_bytes, self.timeout_s, True
            )
            if snap is None:  # not newer than what we hold: the whole version is ignored
                self._ignored = version
                return False
            if self._ignored == version:
                self._ignored = -1
            if self.downstream is not None and version not in self._forwarding:
                self._forwarding[version] = self.core.pin(version)
        elif version == self._ignored or version < self.core.newest_begun:
            # (a newer version begun here dropped this one: e.g. the rest of a send that
            # the upstream abandoned, arriving late)
            return False
        # Submitted now (not when a task first runs): the relay thread keeps arrival order.
        stored = asyncio.get_running_loop().run_in_executor(
            self._pool, self.core.write_chunk, version, j, data, crc
        )
        task = asyncio.ensure_future(self._after_store(stored, version, j, t_publish, layout))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if j == max(1, -(-layout.nbytes // chunk_bytes)) - 1:
            # The last chunk is answered once stored (the relay thread has then stored
            # every earlier one): a version left incomplete here by a chunk that failed
            # its checksum is a failed send, which the upstream makes again (it never
            # heard of it, and the relays from here down waited for the next version).
            with contextlib.suppress(RelayError):  # (said by _after_store)
                await asyncio.shield(stored)
            missing = self.core.missing(version)
            if missing:
                raise RelayError(
                    f"relay {self.relay_id}: version {version} is incomplete after its last "
                    f"chunk, chunks {missing} missing (not sent, or failed their checksum): "
                    "send it again"
                )
        return True

    async def _after_store(self, stored, version: int, j: int, t_publish: float, layout) -> None:
        try:
            done = await stored
        except RelayError as e:
            self._error(str(e))
            logger.error("relay %s: %s", self.relay_id, e)
            return
        if self.downstream is not None:
            self._queue.put_nowait(("chunk", version, j, t_publish))
        if done:
            # Arriving at a rechain, its first chunks went to the lost successor: the
            # new one gets it whole. (Older ones waiting for that are not needed now.)
            if version in self._resend_when_complete and self.downstream is not None:
                self._queue.put_nowait(("resend", version, t_publish))
            self._resend_when_complete = {v for v in self._resend_when_complete if v > version}
            self._abandon(version)  # (older versions being sent on are overtaken)
            self._completed(self.relay_id, version)
            await self._report(version)
            await self._prewarm(layout.nbytes)

    async def _prewarm(self, nbytes: int) -> None:
        """A spare slot ahead of the next version (:meth:`RelayCore.prewarm`). One that
        cannot be allocated is said in ``errors``, and the next version allocates its
        slot itself (it escaped as an exception nobody retrieved, and stopped the
        master's forwarding of that version)."""
        try:
            await self._run(self.core.prewarm, nbytes)
        except (OSError, MemoryError) as e:
            msg = (
                f"relay {self.relay_id}: a spare slot of {nbytes / MB:.1f} MiB could not be "
                f"allocated ahead of the next version ({e!r})"
            )
            logger.warning(msg)
            self._error(msg)

    async def _report(self, version: int) -> None:
        if self.master is None:
            return
        try:
            await self._call(self.master.relay_completed(self.relay_id, version))
        except Exception as e:  # noqa: BLE001 — a lost master must not stop the chain
            self._error(f"reporting version {version} to the master: {e!r}")

    async def relay_completed(self, relay_id: str, version: int) -> None:
        """Master: relay ``relay_id`` holds ``version`` complete (timed on our clock)."""
        self._completed(relay_id, version)

    def _completed(self, relay_id: str, version: int) -> None:
        self.completions.setdefault(version, {})[relay_id] = time.time()
        while len(self.completions) > KEEP_COMPLETIONS:
            self._settle(min(self.completions))

    def _settle(self, version: int) -> None:
        """Drop ``version``'s completions; its publication record (master) keeps what
        they said as it stands, for good."""
        i = bisect.bisect_left(self.publications, version, key=lambda r: r["version"])
        if i < len(self.publications) and self.publications[i]["version"] == version:
            self.publications[i] = self._record(self.publications[i], list(self.chain))
        del self.completions[version]

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

    async def retain(self, versions: list[int], seq: tuple | None = None) -> None:
        """See :meth:`RelayCore.retain` (the partial-response pool sends the versions in
        use). ``seq`` numbers the pool's calls: one older than the last taken arrived
        late (calls run concurrently) and is ignored."""
        if seq is not None:
            seq = tuple(seq)
            if self._retain_seq is not None and seq < self._retain_seq:
                return
            self._retain_seq = seq
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
            "overtaken": self.overtaken,
            "send_failures": self.send_failures,
            "send_retries": self.send_retries,
            "sends_given_up": self.sends_given_up,
            "errors": self.errors[-5:],
            "error_count": self.error_count,
        }
        if self.master is None:
            out["publications"] = self.publication_records()
        return out

    async def publications_since(self, since: int = 0) -> list[dict]:
        """Master: :meth:`publication_records` from the ``since``-th publication on (the
        driver copies them as the run goes: a caller that holds the earlier ones, and
        needs none of them again, asks for the rest only)."""
        return self.publication_records(since)

    def publication_records(self, since: int = 0) -> list[dict]:
        """Master: each publication from the ``since``-th on, with how many relays of the
        chain hold it and the time until every one did (NaN until then).

        Each record costs set operations over the chain, not a lookup per relay: at 5,000
        versions down a 128-relay chain the whole list took 50-80 ms of the event loop
        (a record's time is the newest of its relays', so it still reads every one)."""
        chain = list(self.chain)
        members = set(chain)
        return [self._record(rec, chain, members) for rec in self.publications[since:]]

    def _record(self, rec: dict, chain: list[str], members: set | None = None) -> dict:
        if "relays_complete" in rec:  # settled (its completions dropped)
            return dict(rec)
        members = set(chain) if members is None else members
        done = self.completions.get(rec["version"], {})
        row = dict(rec)
        if done.keys() >= members:
            row["relays_complete"] = len(chain)
            row["broadcast_s"] = max(map(done.__getitem__, chain)) - rec["t_publish"]
        else:
            row["relays_complete"] = len(members & done.keys())
            row["broadcast_s"] = math.nan
        return row

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


async def _either(event: asyncio.Event, task: asyncio.Future) -> None:
    """Until ``event`` is set or ``task`` is done (a chunk's checksum, or the task that
    computes them failing before it: waiting on the event alone then waited forever, and
    the master forwarded nothing more)."""
    if event.is_set() or task.done():
        return
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def _chunk_bytes(nbytes: int, k: int) -> int:
    per = -(-max(nbytes, 1) // max(k, 1))
    return -(-per // ALIGN) * ALIGN
