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

:class:`PartialCore` is the logic; :class:`PartialResponsePool` the actor (on the data
worker, beside the buffer).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from array import array
from collections import Counter
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path

import numpy as np

from laminar.contract import PromptGroup
from laminar.engine import GenerationRequest, RequestState, SamplingParams

logger = logging.getLogger(__name__)

# The log is compacted (rewritten with the live entries only) once it holds this many
# times the live entries' tokens, and at least COMPACT_MIN_TOKENS.
COMPACT_RATIO = 4
COMPACT_MIN_TOKENS = 1 << 16
# journal records a compaction encodes and writes at a time (its memory: their tokens)
COMPACT_BATCH = 4096


def as_arrays(st: RequestState) -> RequestState:
    """``st`` with its tokens, logprobs and token versions copied into the arrays the pool
    keeps (logprobs as float32, as the log and the trajectory store keep them)."""
    return replace(
        st,
        tokens=array("i", st.tokens),
        logprobs=array("f", st.logprobs),
        token_versions=array("i", st.token_versions),
    )


def _resume_version(entry: dict) -> int:
    """The version an entry's next token needs: its newest token's (a partial rollout
    interrupt moves a response on to the newer weights), else its batch's."""
    versions = entry["state"].token_versions
    return int(versions[-1]) if len(versions) else entry["version"]


class PartialCore:
    """Unfinished trajectories by request id, each owned by the rollout decoding it.

    >>> from laminar.engine import GenerationRequest, SamplingParams
    >>> core = PartialCore()
    >>> req = GenerationRequest("p0-000", (1, 2), SamplingParams(8))
    >>> core.register("r0", 3, [RequestState(req, seed=7)])
    >>> core.flush("r0", {"p0-000": (0, [5, 6], [-0.1, -0.2], [3, 3])})
    >>> [(s.tokens, s.n_moves, s.request.meta["rollout_path"]) for s in core.take("r0")]
    [([5, 6], 1, ['r0'])]
    >>> core.take("r0"), core.owned()  # taken: ownerless until reassigned
    ([], {None: (1, 2, 0)})
    >>> core.reassign(["p0-000"], "r1")
    >>> core.flush("r1", {"p0-000": (2, [7], [-0.3], [3])}, finished={"p0-000": ("eos", 9.5)})
    >>> core.versions()  # finished: its version need not be kept
    []
    >>> [(s.tokens, s.request.meta["finished"]) for s in core.take("r1")]
    [([5, 6, 7], ('eos', 9.5))]
    >>> core.forget(["p0-000"]); core.stats()["entries"]
    0
    """

    def __init__(self, journal: bool = False) -> None:
        """``journal``: also record every change for the recovery log
        (:mod:`storage.partial_log`), for :meth:`drain_journal`."""
        self.entries: dict[str, dict] = {}
        self.counts: Counter = Counter()
        # the changes since the last drain, as records (see _record); None: not journaled
        self.journal: list[tuple] | None = [] if journal else None
        self._seq = 0
        # request id -> its ``requests`` row, of a group a resumed run re-issues: in the
        # log (every snapshot too) until registered again (:meth:`keep`)
        self.kept: dict[str, dict] = {}
        # version -> the live (unfinished, not held) entries that resume at it, kept as
        # entries change: :meth:`versions` is asked at every register, every flush that
        # finishes one and every hold, over tens of thousands of entries at scale
        self._live: Counter = Counter()

    def _track(self, e: dict, gone: bool = False) -> None:
        """Count ``e`` at the version it resumes at now (``gone``: at none), uncounting
        it where it was (``e["live_v"]``)."""
        live = not (gone or "finished" in e or e.get("held"))
        v = _resume_version(e) if live else None
        old = e.get("live_v")
        if old == v:
            return
        if old is not None:
            self._live[old] -= 1
            if not self._live[old]:
                del self._live[old]
        if v is not None:
            self._live[v] += 1
        e["live_v"] = v

    # -- the journal (rows of storage.partial_log) ---------------------------------------
    def _record(self, table: str, *fields, rows: int = 1) -> None:
        """Journal a change as a record ``(table, seq, *fields)``: made on the event loop
        at every change, it is a tuple that refers to the tokens, which
        :func:`journal_rows` makes ``rows`` rows (``seq`` on), in the pool's thread.
        Per table the fields are

        - ``entry`` (4 rows): an entry whole: request id, owner, version, seed, t_start,
          n_moves, params, meta (a copy: a take or a move rebinds its ``rollout_path``),
          prompt tokens, t_flush, the token, logprob and token version arrays, how many
          tokens, finished (``None``: not) and held: its ``requests`` row, a ``chunks``
          row of its tokens, and its ``finished`` and ``held`` events (those it has);
        - ``kept``: a ``requests`` row as :meth:`keep` got it;
        - ``chunks``: request id, owner, offset, t, the token arrays, and how many of
          them from ``offset`` are the chunk's;
        - ``events``: request id, kind, owner, finish_reason, t.
        """
        if self.journal is not None:
            self.journal.append((table, self._seq, *fields))
            self._seq += rows

    def _event(
        self, rid: str, kind: str, owner: str | None = "", reason: str = "", t: float | None = None
    ) -> None:
        """``t``: when (a finished entry's: when it finished)."""
        if self.journal is not None:
            self._record("events", rid, kind, owner or "", reason, time.time() if t is None else t)

    def _entry_record(self, rid: str, e: dict) -> None:
        st: RequestState = e["state"]
        req = st.request
        self._record(
            "entry",
            rid,
            e["owner"] or "",
            e["version"],
            st.seed,
            st.t_start,
            st.n_moves,
            req.params,
            dict(req.meta),
            req.prompt_tokens,
            e["t_flush"],
            st.tokens,
            st.logprobs,
            st.token_versions,
            len(st.tokens),
            e.get("finished"),
            bool(e.get("held")),
            rows=4,
        )

    def drain_records(self) -> list[tuple]:
        """The records made since the last drain (or snapshot): cheap, for the event loop;
        :func:`journal_rows` makes them the rows to append to the log."""
        records = self.journal or []
        if self.journal is not None:
            self.journal = []
        return records

    def drain_journal(self) -> dict[str, list[dict]]:
        """The rows recorded since the last drain (to append to the log)."""
        return journal_rows(self.drain_records())

    def snapshot_records(self) -> list[tuple]:
        """The live entries (and the kept rows) as records of a fresh journal (what
        compaction writes), and the journal emptied: the snapshot stands for everything
        in it. A pass over the entries that copies no token (:func:`journal_rows` reads
        them)."""
        saved, self.journal = self.journal, []
        for row in self.kept.values():
            self._record("kept", row)
        for rid, e in self.entries.items():
            self._entry_record(rid, e)
        records, self.journal = self.journal, None if saved is None else []
        return records

    def snapshot(self) -> dict[str, list[dict]]:
        """:meth:`snapshot_records` as rows."""
        return journal_rows(self.snapshot_records())

    def live_tokens(self) -> int:
        return sum(len(e["state"].tokens) for e in self.entries.values())

    # -- changes --------------------------------------------------------------------------
    def keep(self, rows: list[dict]) -> None:
        """``requests`` rows of the groups a run resumed in place re-issues whole
        (:func:`storage.partial_log.requests_of_groups`): nothing of them is stored, and
        only the log names them. They are no entries (nothing takes, retains or owns
        them), but the log keeps them until their requests are registered again (or
        stored), so that a run stopped again before then re-issues them too."""
        for row in rows:
            self.kept[row["request_id"]] = row
            self._record("kept", row)
        self.counts["kept"] += len(rows)

    def register(self, rollout_id: str, version: int, states: list[RequestState]) -> None:
        """New requests of ``rollout_id`` (sampled by ``version``), with no tokens yet
        (or, for a batch adopted after a loss, with those it had)."""
        now = time.time()
        for st in map(as_arrays, states):
            self.kept.pop(st.request_id, None)
            if (old := self.entries.get(st.request_id)) is not None:  # (registered again)
                self._track(old, gone=True)
            e = self.entries[st.request_id] = {
                "state": st,
                "owner": rollout_id,
                "version": version,
                "t_flush": now,
            }
            self._entry_record(st.request_id, e)
            self._track(e)
        self.counts["registered"] += len(states)

    def flush(
        self,
        rollout_id: str,
        tokens: dict[str, tuple],
        finished: dict[str, tuple[str, float]] | None = None,
    ) -> None:
        """New tokens: ``{request_id: (offset, tokens, logprobs, token_versions)}``, and
        the requests that ended with them: ``{request_id: (finish_reason, t_finish)}``.

        ``offset`` is how many tokens the rollout had logged before: a repeated or late
        flush overwrites from there instead of appending twice. A flush names its sender
        as the owner (a request moved by repack is flushed by its new rollout)."""
        now = time.time()
        finished = finished or {}
        n_tokens = 0
        for rid, (offset, toks, lps, tvs) in tokens.items():
            e = self.entries.get(rid)
            if e is None:  # already in the buffer
                continue
            st: RequestState = e["state"]
            logged = len(st.tokens)
            if offset > logged:  # a gap: keep what is contiguous
                self.counts["gaps"] += 1
                continue
            if offset < logged:  # (new arrays: the tokens records refer to never change)
                st.tokens, st.logprobs = st.tokens[:offset], st.logprobs[:offset]
                st.token_versions = st.token_versions[:offset]
            st.tokens.extend(toks)
            st.logprobs.extend(lps)
            st.token_versions.extend(tvs)
            e["owner"], e["t_flush"] = rollout_id, now
            self._record(
                "chunks",
                rid,
                rollout_id,
                offset,
                now,
                st.tokens,
                st.logprobs,
                st.token_versions,
                len(toks),
            )
            n_tokens += len(toks)
            if rid in finished:
                e["finished"] = finished[rid]
                self._event(rid, "finished", rollout_id, *finished[rid])
                self.counts["finished"] += 1
            self._track(e)
        self.counts["flushed_tokens"] += n_tokens
        self.counts["flushes"] += 1

    def restore(self, entries: dict[str, dict]) -> None:
        """Entries of rollouts lost while no pool ran, as :func:`replay_log` read them
        from the lost pool's log (request id -> entry): registered again with what was
        logged, finished ones marked so (a recovery then scores them; the rebuild leaves
        out those the store has: :func:`storage.resume.plan_rebuild`). The buffer that
        held some is lost: they count as not held."""
        for rid, e in entries.items():
            self.register(e["owner"], e["version"], [e["state"]])
            if "finished" in e:
                self.entries[rid]["finished"] = e["finished"]
                self._event(rid, "finished", e["owner"], *e["finished"])
                self._track(self.entries[rid])
        self.counts["restored"] += len(entries)

    def reassign(
        self, request_ids: list[str], rollout_id: str, moved_from: str | None = None
    ) -> None:
        """Requests now decoded by ``rollout_id`` (moved by repack or recovery).
        ``moved_from``: a repack move's source, which the trajectory's history gains as
        the exported copies did (one more move, the source on its path): a later
        recovery of them from here (their new rollout lost) goes on from that history."""
        for rid in request_ids:
            e = self.entries.get(rid)
            if e is None:
                continue
            if moved_from is not None:
                st: RequestState = e["state"]
                st.n_moves += 1
                st.request.meta["rollout_path"] = [
                    *st.request.meta.get("rollout_path", []),
                    moved_from,
                ]
                self._event(rid, "moved", moved_from)
            e["owner"] = rollout_id
            e.pop("taken_from", None)
            self._event(rid, "owner", rollout_id)

    def hold(self, uids: list[str]) -> None:
        """Trajectories the buffer now holds: not scored again if their rollout is lost
        (kept until the store has them: :meth:`forget`)."""
        for uid in uids:
            e = self.entries.get(uid)
            if e is not None and not e.get("held"):
                e["held"] = True
                self._track(e)
                self._event(uid, "held", e["owner"])
                self.counts["held"] += 1

    def forget(self, uids: list[str]) -> None:
        """Trajectories the trajectory store has committed."""
        for uid in uids:
            kept = self.kept.pop(uid, None)
            if (e := self.entries.pop(uid, None)) is not None:
                self._track(e, gone=True)
            if e is not None or kept is not None:
                self._event(uid, "forgotten")
                self.counts["forgotten"] += 1

    def take(self, rollout_id: str, again: bool = False) -> list[RequestState]:
        """The lost ``rollout_id``'s entries as states to import elsewhere (counted as
        moved once more, with the lost rollout on their path), oldest first. They stay
        registered, ownerless, until :meth:`reassign`.

        ``again``: also those taken from it before and not reassigned since (a caller
        that got no answer to its take, which may have run: without this they would be
        ownerless for good, and their trajectories lost).

        Each copy's ``request.meta`` also says what the recovery needs:
        ``behavior_version`` (the version its batch was given), ``resume_version`` (the
        version of its newest token: the weights its next token needs; newer than the
        first where a partial rollout interrupt moved it on), ``recovered_tokens``,
        ``t_flush`` and, for an entry that had finished, ``finished`` = (finish_reason,
        t_finish): score it, do not decode."""
        out = []
        for rid, e in self.entries.items():
            if e.get("held"):  # (the buffer has it)
                continue
            retaken = again and e["owner"] is None and e.get("taken_from") == rollout_id
            if e["owner"] != rollout_id and not retaken:
                continue
            st: RequestState = e["state"]
            if not retaken:
                # The loss moves it: the path and the count are kept on the entry, so a
                # second loss adds to them (the copies handed out carry them as they are).
                st.request.meta["rollout_path"] = [
                    *st.request.meta.get("rollout_path", []),
                    rollout_id,
                ]
                st.n_moves += 1
                self._event(rid, "owner", None)
            meta = {
                **st.request.meta,
                "recovered_tokens": len(st.tokens),
                "t_flush": e["t_flush"],
                "behavior_version": e["version"],
                "resume_version": _resume_version(e),
            }
            if "finished" in e:
                meta["finished"] = e["finished"]
            # (moved() copies the lists; the count is the entry's, raised by the loss above)
            moved = replace(st.moved(), request=replace(st.request, meta=meta), n_moves=st.n_moves)
            e["owner"], e["taken_from"] = None, rollout_id
            out.append(moved)
        self.counts["taken"] += len(out)
        return sorted(out, key=lambda s: s.t_start)

    def versions(self) -> list[int]:
        """The weight versions of the unfinished trajectories: the relays keep these
        (:meth:`laminar.relay_core.RelayCore.retain`) so a recovery can resume them exactly.
        (A finished entry is only scored again: it needs no weights.)"""
        return sorted(self._live)

    def owned(self) -> dict[str | None, tuple[int, int, int]]:
        """Owner -> (entries, tokens logged, finished entries) (``None``: taken, not yet
        reassigned). The held are left out: the buffer has them."""
        out: dict[str | None, tuple[int, int, int]] = {}
        for e in self.entries.values():
            if e.get("held"):
                continue
            n, t, f = out.get(e["owner"], (0, 0, 0))
            out[e["owner"]] = (n + 1, t + len(e["state"].tokens), f + ("finished" in e))
        return out

    def stats(self) -> dict:
        held = sum(1 for e in self.entries.values() if e.get("held"))
        return {"entries": len(self.entries) - held, "held_entries": held, **self.counts}


def journal_rows(records: list[tuple]) -> dict[str, list[dict]]:
    """:meth:`PartialCore.drain_records` or :meth:`~PartialCore.snapshot_records` as the
    rows of :class:`storage.partial_log.PartialLogWriter` (safe in a thread while the pool
    goes on: the tokens a record refers to do not change)."""
    out: dict[str, list[dict]] = {"requests": [], "chunks": [], "events": []}
    params_json: dict[int, str] = {}  # (a rollout's requests share their parameters)

    def chunk(seq, rid, owner, offset, t, toks, lps, tvs, n) -> None:
        end = offset + n
        out["chunks"].append(
            {
                "seq": seq,
                "request_id": rid,
                "owner": owner,
                "offset": offset,
                "t": t,
                "tokens": _ndarray(toks[offset:end]),
                "logprobs": _ndarray(lps[offset:end]),
                "token_versions": _ndarray(tvs[offset:end]),
            }
        )

    def event(seq, rid, kind, owner, reason, t) -> None:
        out["events"].append(
            {
                "seq": seq,
                "request_id": rid,
                "kind": kind,
                "owner": owner,
                "finish_reason": reason,
                "t": t,
            }
        )

    for table, seq, *f in records:
        if table == "chunks":
            chunk(seq, *f)
        elif table == "events":
            event(seq, *f)
        elif table == "kept":
            out["requests"].append({**f[0], "seq": seq})
        else:
            rid, owner, version, seed, t_start, n_moves, params, meta, prompt = f[:9]
            t, toks, lps, tvs, n, finished, held = f[9:]
            if id(params) not in params_json:
                params_json[id(params)] = json.dumps(_fields(params))
            out["requests"].append(
                {
                    "seq": seq,
                    "request_id": rid,
                    "owner": owner,
                    "version": version,
                    "seed": seed,
                    "t_start": t_start,
                    "n_moves": n_moves,
                    "params": params_json[id(params)],
                    "meta": encode_meta(meta),
                    "prompt_tokens": prompt,
                }
            )
            if n:
                chunk(seq + 1, rid, owner, 0, t, toks, lps, tvs, n)
            if finished is not None:
                event(seq + 2, rid, "finished", owner, *finished)
            if held:
                event(seq + 3, rid, "held", owner, "", t)
    return out


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


def _ndarray(a: array) -> np.ndarray:
    # (A copy: an ndarray is no object the garbage collector tracks, an array is, and a
    # write's tens of thousands of them would trigger full collections, each a pause of
    # the pool's event loop too.)
    return np.frombuffer(a.tobytes(), a.typecode)


def _fields(obj) -> dict:
    # (dataclasses.asdict deep-copies: these hold only numbers, strings and tuples of them)
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def encode_meta(meta: dict) -> str:
    """A request's ``meta`` as JSON (its :class:`PromptGroup` as a tagged object)."""

    def default(obj):
        if isinstance(obj, PromptGroup):
            return {"__prompt_group__": _fields(obj)}
        raise TypeError(f"request meta holds a {type(obj).__name__}, which the log cannot store")

    return json.dumps(meta, default=default)


def revive_meta(meta):
    """:func:`encode_meta`'s JSON, decoded, with its :class:`PromptGroup` back."""
    if isinstance(meta, list):
        return [revive_meta(v) for v in meta]
    if not isinstance(meta, dict):
        return meta
    g = meta.get("__prompt_group__")
    if g is None:
        return {k: revive_meta(v) for k, v in meta.items()}
    samples = g["samples"]
    return PromptGroup(
        **g
        | {
            "prompt_tokens": tuple(g["prompt_tokens"]),
            "samples": None if samples is None else tuple(samples),
        }
    )


def replay_log(run_dir: str | Path) -> PartialCore:
    """The pool's entries as ``RUN_DIR/partial.zarr`` last recorded them (lost with its
    worker, the pool's last ``faults.log_interval_s`` of changes are not in it): each
    entry's state (tokens, logprobs and token versions logged), owner (``None``: taken
    from a lost rollout, not yet given to another), version, and whether it finished or
    the buffer holds it.

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
    from storage.partial_log import replay

    core = PartialCore()
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
    ) -> None:
        """``reissue``: the prompt groups a run resumed in place re-issues
        (:class:`storage.resume.ResumePlan`); the log is started over with their entries
        only (:meth:`PartialCore.keep`): its resume plan has read the rest."""
        from storage.partial_log import PartialLogWriter, requests_of_groups

        self.core = PartialCore(journal=run_dir is not None)
        self.relays: list = []
        self.timeout_s = timeout_s
        self._retained: list[int] | None = []  # (None: not told since the relays changed)
        self._pending: set = set()  # retain calls still running
        self.writer = None
        if run_dir is not None:
            # (read before the log is started over, in the one update that compacts it)
            if reissue:
                self.core.keep(requests_of_groups(run_dir, reissue))
            self.writer = PartialLogWriter(run_dir)
            self.writer.compact(**self.core.snapshot())
        self.log_interval_s = log_interval_s
        self._log_task = None
        self._log_lock = None  # an asyncio.Lock, made on the event loop
        self._log_error: str | None = None
        self._resync = False  # (a write failed: the next one compacts)
        self.log_counts: Counter = Counter()

    # -- the recovery log -----------------------------------------------------------------
    def _start_log(self) -> None:
        import asyncio

        if self.writer is not None and self._log_task is None:
            self._log_task = asyncio.ensure_future(self._log_loop())

    async def _log_loop(self) -> None:
        import asyncio

        while True:
            await asyncio.sleep(self.log_interval_s)
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
        if self._resync or w.tokens() > max(COMPACT_RATIO * core.live_tokens(), COMPACT_MIN_TOKENS):
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
        """Write what is left of the log (the run ends); returns :meth:`stats`."""
        if self.writer is not None:
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
        if versions == self._retained or not self.relays:
            return
        self._retained = versions

        async def one(relay) -> None:
            try:
                await asyncio.wait_for(relay.retain(versions), self.timeout_s)
            except Exception:  # noqa: BLE001 — a lost relay: dropped when detected
                self.core.counts["retain_errors"] += 1

        # Live relays answer in milliseconds. A relay lost but not yet detected never
        # answers: its call runs out its timeout in the background, and the rollout
        # whose register or flush triggered this is not held up more than RETAIN_WAIT_S.
        tasks = [asyncio.ensure_future(one(r)) for r in self.relays]
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

    async def versions(self) -> list[int]:
        return self.core.versions()

    async def owned(self) -> dict:
        return self.core.owned()

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
