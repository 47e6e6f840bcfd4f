"""The partial-response pool: what every unfinished trajectory has generated so far.

Rollouts register each request when they start it and stream its new tokens, logprobs and
token versions here every ``faults.flush_tokens`` tokens or ``faults.flush_s`` seconds;
the experience buffer forgets a trajectory once it holds it. When a rollout is lost, the
manager :meth:`~PartialCore.take`\\ s its entries and resumes them on healthy rollouts of
the same weight version: with counter-based sampling (:mod:`laminar.sampling`) a resumed
request continues with exactly the tokens it would have produced, so a loss costs at
most one flush interval of regeneration per trajectory, never a trajectory.

A request's last token is never logged as unfinished: an engine hands a request back in
the step that finishes it, so a logged entry can always be resumed. A finished request is
logged as *finished* (all its tokens, how it ended) before its rollout starts another
batch, and stays here until the buffer has it: if its rollout is lost in between (its
reward still in flight), the entry is scored again elsewhere, with no token regenerated.
A finished entry needs no weights, so only unfinished entries' versions are retained:
each rollout decodes one version at a time, so at most ``rollout.replicas`` versions are.

When the buffer admits a trajectory its entry is *held* (not scored again if its rollout
is lost: the buffer has it); when the trajectory store has committed it, the entry is
forgotten. So what the pool holds, plus the store, is every trajectory started.

The pool also writes its changes to ``RUN_DIR/partial.zarr`` (:mod:`storage.partial_log`)
every ``faults.log_interval_s``, so the entries outlive the pool's worker:
:func:`replay_log` rebuilds them from the run directory.

At scale the pool holds hundreds of millions of tokens, on the data worker's one event
loop. So each entry keeps its tokens, logprobs and token versions as arrays
(``array('i')``, ``array('f')``, ``array('i')``: 12 B a token), which a flush extends and
nothing changes in place: a flush that rewrites logged tokens (a repeated or late one)
gives the entry new arrays. The journal of changes then refers to the tokens instead of
copying them, and a compaction's snapshot of the live entries is a pass over the entries
that copies no token: the rows are made and written from the pool's thread, while the
loop goes on (a slice of an array is one step under the GIL, and the positions a record
refers to never change).

:class:`PartialCore` is the logic (:mod:`laminar.partial_core`); :class:`PartialResponsePool`
the actor (on the data worker, beside the buffer); :mod:`laminar.partial_rows` the log's
rows. Their names are all importable from here.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Collection
from pathlib import Path

from laminar.contract import PromptGroup  # noqa: F401 — replay_log's doctest
from laminar.engine import GenerationRequest, RequestState, SamplingParams
from laminar.partial_core import PartialCore as PartialCore
from laminar.partial_core import _resume_version as _resume_version
from laminar.partial_core import as_arrays as as_arrays
from laminar.partial_rows import _fields as _fields
from laminar.partial_rows import _ndarray as _ndarray
from laminar.partial_rows import encode_meta as encode_meta
from laminar.partial_rows import journal_rows as journal_rows
from laminar.partial_rows import revive_meta as revive_meta

logger = logging.getLogger(__name__)

# The log is compacted (rewritten with the live entries only) once it holds this many
# times the live entries' tokens, and at least COMPACT_MIN_TOKENS.
COMPACT_RATIO = 4
COMPACT_MIN_TOKENS = 1 << 16
# journal records a compaction encodes and writes at a time (its memory: their tokens)
COMPACT_BATCH = 4096


def write_records(writer, records: list[tuple], compact: bool = False) -> int:
    """Append ``records`` to the log with ``writer`` (a
    :class:`storage.partial_log.PartialLogWriter`), or with ``compact`` replace the log by
    them (:meth:`PartialCore.snapshot_records`), :data:`COMPACT_BATCH` at a time; returns
    the rows written. Encoding them is most of a write: the pool calls this in its thread."""
    written = 0

    def batches(size: int):
        nonlocal written
        for i in range(0, len(records), size):
            rows = journal_rows(records[i : i + size])
            written += sum(map(len, rows.values()))
            yield rows

    if compact:
        writer.rewrite(batches(COMPACT_BATCH))
    else:
        for rows in batches(max(len(records), 1)):  # (one)
            writer.append(**rows)
    return written


def replay_log(run_dir: str | Path) -> PartialCore:
    """The pool's entries as ``RUN_DIR/partial.zarr`` last recorded them (lost with its
    worker, the pool's last ``faults.log_interval_s`` of changes are not in it): each
    entry's state (tokens, logprobs and token versions logged), owner (``None``: taken
    from a lost rollout, not yet given to another), version, and whether it finished or
    the buffer holds it; and the rollouts it had fenced (:meth:`PartialCore.fence`).

    >>> import tempfile
    >>> from laminar.engine import GenerationRequest, SamplingParams
    >>> run = tempfile.mkdtemp()
    >>> core = PartialCore(journal=True)
    >>> group = PromptGroup("p0", 3, (1, 2), "4", 2, 0)
    >>> req = GenerationRequest("p0-000", (1, 2), SamplingParams(8), {"group": group})
    >>> core.register("r0", 3, [RequestState(req, seed=7)])
    >>> core.flush("r0", {"p0-000": (0, [5, 6], [-0.5, -0.25], [3, 3])})
    >>> from storage.partial_log import PartialLogWriter
    >>> PartialLogWriter(run).append(**core.drain_journal())
    >>> back = replay_log(run).entries["p0-000"]
    >>> back["owner"], back["version"], back["state"].tokens  # (kept as the pool keeps them)
    ('r0', 3, array('i', [5, 6]))
    >>> back["state"].request.meta["group"] == group
    True
    """
    from storage.partial_log import fenced_rollouts, replay

    core = PartialCore()
    core.fenced.update(fenced_rollouts(run_dir))
    for rid, e in replay(run_dir).items():
        p = e["params"]
        params = SamplingParams(
            **p | {"stop_token_ids": tuple(p["stop_token_ids"]), "stop": tuple(p["stop"])}
        )
        req = GenerationRequest(rid, tuple(e["prompt_tokens"]), params, revive_meta(e["meta"]))
        state = as_arrays(
            RequestState(
                req,
                e["seed"],
                e["tokens"],
                e["logprobs"],
                e["token_versions"],
                t_start=e["t_start"],
                n_moves=e["n_moves"],
            )
        )
        entry = {
            "state": state,
            "owner": e["owner"] or None,
            "version": e["version"],
            "t_flush": e["t_flush"],
        }
        if e["finished"] is not None:
            entry["finished"] = e["finished"]
        if e["held"]:
            entry["held"] = True
        core.entries[rid] = entry
        core._track(entry)
    core.counts["replayed"] = len(core.entries)
    return core


RETAIN_WAIT_S = 1.0  # the longest a register or flush waits on the relays' retain calls


class PartialResponsePool:
    """Dask actor around :class:`PartialCore` (async: calls run on the event loop, in
    order, without a thread hop).

    It also keeps the relays' retained versions (:meth:`laminar.relay_core.RelayCore.retain`)
    equal to the versions of its entries, as they change: a batch's version is retained
    from the moment the batch is registered, so a recovery can resume it at that version.

    With a ``run_dir`` it writes the recovery log ``RUN_DIR/partial.zarr`` every
    ``log_interval_s`` from a thread (one write at a time; changes made meanwhile go with
    the next), compacting it when it has grown to many times the live entries: only the
    snapshot of the entries is taken on the event loop, the rows are made and written in
    the thread.
    """

    def __init__(
        self,
        timeout_s: float = 60.0,
        run_dir: str | None = None,
        log_interval_s: float = 2.0,
        reissue: Collection[str] = (),
        rebuild: bool = False,
    ) -> None:
        """``reissue``: the prompt groups a run resumed in place re-issues
        (:class:`storage.resume.ResumePlan`); the log is started over with their entries
        only (:meth:`PartialCore.keep`): its resume plan has read the rest.

        ``rebuild``: the pool of a data module rebuilt within the run
        (``pipelines/restart.py``). The lost pool's log is left as it is until
        :meth:`open_log`: until the rebuild has restored the lost rollouts' entries and
        the live rollouts have registered theirs, it is what a rebuild tried again (this
        pool's worker lost too) or a resume (the driver lost) reads them from; started
        over at once, it would name none of them."""
        from storage.partial_log import PartialLogWriter, requests_of_groups

        self.core = PartialCore(journal=run_dir is not None)
        self.relays: list = []
        self.timeout_s = timeout_s
        self._retained: list[int] | None = []  # (None: not told since the relays changed)
        self._pending: set = set()  # retain calls still running
        # Each retain call is numbered (this pool's start, then a count): a relay ignores
        # one older than the last it took (calls run concurrently and may land out of
        # order). Per relay, the newest call it answered and the newest that failed: a
        # failed one is sent again (the versions now) at the next sync.
        self._retain_epoch = time.time()
        self._retain_seq = 0
        self._retain_acked: dict = {}
        self._retain_failed: dict = {}
        self._retain_busy: Counter = Counter()
        self.writer = None
        if run_dir is not None:
            # (read before the log is started over, in the one update that compacts it)
            if reissue:
                self.core.keep(requests_of_groups(run_dir, reissue))
            self.writer = PartialLogWriter(run_dir)
            if not rebuild:
                self.writer.compact(**self.core.snapshot())
        self.log_interval_s = log_interval_s
        self._log_task = None
        self._log_lock = None  # an asyncio.Lock, made on the event loop
        self._log_error: str | None = None
        # (a write failed, or a rebuild's first write: the next one compacts)
        self._resync = rebuild
        # a rebuild's pool writes nothing until open_log: the lost pool's log stands
        self._log_held = rebuild and run_dir is not None
        self.log_counts: Counter = Counter()

    # -- the recovery log -----------------------------------------------------------------
    def _start_log(self) -> None:
        import asyncio

        if self.writer is not None and self._log_task is None and not self._log_held:
            self._log_task = asyncio.ensure_future(self._log_loop())

    async def open_log(self) -> None:
        """A rebuild's pool (``rebuild``) has its entries (the lost rollouts' restored,
        the live ones' registered): the log is started over with them at once (compacted,
        in the background: at scale a long write, which the rebuild does not wait for),
        then written every ``log_interval_s``. (Any other pool's already is.)"""
        import asyncio

        if not self._log_held:
            return
        self._log_held = False
        if self.writer is not None and self._log_task is None:
            self._log_task = asyncio.ensure_future(self._log_loop(now=True))

    async def _log_loop(self, now: bool = False) -> None:
        """Write the log every ``log_interval_s`` (``now``: first at once)."""
        import asyncio

        while True:
            if not now:
                await asyncio.sleep(self.log_interval_s)
            now = False
            await self._write_log()

    async def _write_log(self) -> None:
        """Append what changed since the last write (or compact), off the event loop; one
        write at a time (a write still running in its thread is waited for)."""
        import asyncio

        if self._log_lock is None:
            self._log_lock = asyncio.Lock()
        async with self._log_lock:
            await self._write_log_now()

    async def _write_log_now(self) -> None:
        core, w = self.core, self.writer
        live = core.live_tokens()  # (prompts too)
        if self._resync or w.all_tokens() > max(COMPACT_RATIO * live, COMPACT_MIN_TOKENS):
            # The snapshot is taken on the loop (a pass over the entries, no token copied)
            # and written from the thread; the changes made meanwhile follow it at once.
            if await self._write(core.snapshot_records(), compact=True):
                await self._write(core.drain_records())
        else:
            await self._write(core.drain_records())

    async def _write(self, records: list[tuple], compact: bool = False) -> bool:
        """Write journal records from the thread: whether they were written. A write
        that failed loses its records, and a compaction that failed leaves the log as it
        was: either way the next write compacts (the log is written whole again)."""
        import asyncio

        if not (records or compact):
            return True
        t = time.perf_counter()
        try:
            rows = await asyncio.to_thread(write_records, self.writer, records, compact)
        except Exception as e:  # noqa: BLE001 — keep the run going; reported in stats()
            self._log_error = f"{type(e).__name__}: {e}"
            self._resync = True
            logger.error(
                "the recovery log %s cannot be written: %s", self.writer.path, self._log_error
            )
            return False
        if compact:
            self._resync = False
        self.log_counts["writes"] += 1
        self.log_counts["compactions"] += compact
        self.log_counts["rows"] += rows
        self.log_counts["write_s"] += time.perf_counter() - t
        return True

    async def close(self) -> dict:
        """Write what is left of the log (the run ends); returns :meth:`stats`. (A
        rebuild's pool not yet :meth:`open_log`\\ ed writes nothing: the lost pool's log
        stands.)"""
        if self.writer is not None and not self._log_held:
            await self._write_log()  # (after a write in progress, if any)
        if self._log_task is not None:
            self._log_task.cancel()  # (it sleeps or waits for the lock: no write is cut)
            self._log_task = None
        return await self.stats()

    async def set_relays(self, relays: list) -> None:
        self._start_log()
        self.relays = list(relays)
        # A relay new to the chain keeps nothing yet: every relay is told, even where
        # the versions in use did not change.
        self._retained = None
        await self._sync_retained()

    async def _sync_retained(self) -> None:
        import asyncio

        versions = self.core.versions()
        if not self.relays:
            return
        relays = list(self.relays)
        if versions == self._retained:
            # (a relay whose last call failed is told again; not while one is on its way:
            # a relay lost but not yet detected would gather calls waiting out timeouts)
            relays = [
                r
                for r in relays
                if self._retain_failed.get(_key(r), 0) > self._retain_acked.get(_key(r), 0)
                and not self._retain_busy[_key(r)]
            ]
            if not relays:
                return
        self._retained = versions
        self._retain_seq += 1
        seq = (self._retain_epoch, self._retain_seq)

        async def one(relay) -> None:
            key = _key(relay)
            self._retain_busy[key] += 1
            try:
                await asyncio.wait_for(relay.retain(versions, seq), self.timeout_s)
                self._retain_acked[key] = max(self._retain_acked.get(key, 0), seq[1])
            except Exception:  # noqa: BLE001 — a lost relay: dropped when detected
                self.core.counts["retain_errors"] += 1
                self._retain_failed[key] = max(self._retain_failed.get(key, 0), seq[1])
            finally:
                self._retain_busy[key] -= 1

        # Live relays answer in milliseconds. A relay lost but not yet detected never
        # answers: its call runs out its timeout in the background, and the rollout
        # whose register or flush triggered this is not held up more than RETAIN_WAIT_S.
        tasks = [asyncio.ensure_future(one(r)) for r in relays]
        self._pending |= set(tasks)
        for t in tasks:
            t.add_done_callback(self._pending.discard)
        await asyncio.wait(tasks, timeout=RETAIN_WAIT_S)

    async def register(self, rollout_id: str, version: int, states: list) -> None:
        self._start_log()
        self.core.register(rollout_id, version, states)
        await self._sync_retained()

    async def flush(self, rollout_id: str, tokens: dict, finished: dict | None = None) -> None:
        self.core.flush(rollout_id, tokens, finished)
        if finished:
            await self._sync_retained()

    async def restore(self, entries: dict) -> None:
        self.core.restore(entries)
        self._start_log()
        await self._sync_retained()

    async def reassign(
        self, request_ids: list[str], rollout_id: str, moved_from: str | None = None
    ) -> None:
        self.core.reassign(request_ids, rollout_id, moved_from)

    async def hold(self, uids: list[str]) -> None:
        self.core.hold(uids)
        await self._sync_retained()

    async def forget(self, uids: list[str]) -> None:
        self.core.forget(uids)

    async def take(self, rollout_id: str, again: bool = False) -> list:
        return self.core.take(rollout_id, again)

    async def fence(self, rollout_id: str) -> None:
        """:meth:`PartialCore.fence`: ``rollout_id`` was given up as lost."""
        self.core.fence(rollout_id)

    async def late(self) -> list[str]:
        return self.core.late()

    async def versions(self) -> list[int]:
        return self.core.versions()

    async def owned(self) -> dict:
        return self.core.owned()

    async def groups(self) -> list[str]:
        """The prompt groups the pool has entries of (any owner, finished or held), and
        those entries' uids (a sample's, ``{group}-{i:03d}``): a recovery resumes them,
        or the buffer has them. (The driver asks at a lost rollout's fence: what was
        handed to it that neither this pool nor the buffer knows goes out again, judged
        by sample where samples are named,
        :meth:`laminar.prompt_pool.PromptPool.reissue_stranded`.)"""
        out = set()
        for rid, e in self.core.entries.items():
            group = e["state"].request.meta.get("group")
            out.add(group.prompt_uid if group is not None else rid.rsplit("-", 1)[0])
            out.add(rid)
        return sorted(out)

    async def stats(self) -> dict:
        out = self.core.stats()
        if self.writer is not None:
            c = self.log_counts
            out["log"] = {
                "path": str(self.writer.path),
                "writes": c["writes"],
                "rows": c["rows"],
                "compactions": c["compactions"],
                "mean_write_s": c["write_s"] / c["writes"] if c["writes"] else None,
                "tokens": self.writer.tokens(),
                "error": self._log_error,
            }
        return out


def _key(relay):
    """A relay's identity across calls: its actor key (a local Relay: its id)."""
    return getattr(relay, "key", None) or getattr(relay, "relay_id", None) or id(relay)
