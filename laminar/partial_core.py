"""The partial-response pool's logic, :class:`PartialCore`: the entries by request id,
who owns each, the versions they resume at, and the journal of their changes.

Apart from :mod:`laminar.partial` (the actor and its recovery log) because it is the
pool's whole bookkeeping with no event loop, thread or store: tests and
:func:`laminar.partial.replay_log` use it bare. Each entry keeps its tokens, logprobs and
token versions as arrays (:func:`as_arrays`; :mod:`laminar.partial` says why). Import it
from :mod:`laminar.partial`, which re-exports it.
"""

from __future__ import annotations

import time
from array import array
from collections import Counter
from dataclasses import replace

from laminar.engine import RequestState
from laminar.partial_rows import journal_rows


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
        # rollout -> when it was fenced (:meth:`fence`): given up as lost, its process
        # perhaps alive; and those of them that registered requests since (:meth:`late`)
        self.fenced: dict[str, float] = {}
        self._late: set[str] = set()

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
        - ``events``: request id, kind, owner, finish_reason, t (a ``fenced`` event
          names no request: its owner is the rollout fenced, :meth:`fence`).
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
        for rollout_id, t in self.fenced.items():
            self._event("", "fenced", rollout_id, t=t)
        for rid, e in self.entries.items():
            self._entry_record(rid, e)
        records, self.journal = self.journal, None if saved is None else []
        return records

    def snapshot(self) -> dict[str, list[dict]]:
        """:meth:`snapshot_records` as rows."""
        return journal_rows(self.snapshot_records())

    def live_tokens(self) -> int:
        """The live entries' tokens, their prompts' too (compaction weighs the log's
        against them): a log of long prompts and short responses grew by the prompts of
        every request ever registered, where the responses alone never reached the
        ratio that compacts it."""
        return sum(
            len(e["state"].tokens) + len(e["state"].request.prompt_tokens)
            for e in self.entries.values()
        ) + sum(len(row.get("prompt_tokens", ())) for row in self.kept.values())

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

    def fence(self, rollout_id: str, t: float | None = None) -> None:
        """``rollout_id`` was given up as lost (its entries are taken, or about to be:
        :meth:`take` fences too), while its process may live on — a hung rollout whose
        fence failed, a worker the scheduler dropped without ending it. What that process
        sends from now on must not change the entries resumed elsewhere: its flushes are
        ignored (``fenced_flushes``: as the entry's owner, its older offset would cut the
        new owner's tokens back, whose next flushes were then refused as gaps), and of
        its registers only requests the pool has never seen are kept, owned by it, for
        the manager to take again (:meth:`late`; ``fenced_registers``): groups it took
        from the prompt pool before it saw its stop, which nothing else would finish.
        Journaled (an ``events`` row of kind ``fenced``), so a pool replayed from the log
        keeps it."""
        if rollout_id in self.fenced:
            return
        t = time.time() if t is None else t
        self.fenced[rollout_id] = t
        self._event("", "fenced", rollout_id, t=t)
        self.counts["fenced"] += 1

    def late(self) -> list[str]:
        """The fenced rollouts that own entries registered (or reassigned to them) since
        their fence and not yet taken: their work is resumed by another :meth:`take`."""
        return sorted(self._late)

    def register(self, rollout_id: str, version: int, states: list[RequestState]) -> None:
        """New requests of ``rollout_id`` (sampled by ``version``), with no tokens yet
        (or, for a batch adopted after a loss, with those it had). From a fenced
        rollout only requests new to the pool are kept (:meth:`fence`)."""
        if rollout_id in self.fenced:
            new = [st for st in states if st.request_id not in self.entries]
            self.counts["fenced_registers"] += len(states)
            if not new:
                return
            self._late.add(rollout_id)
            states = new
        self._register(rollout_id, version, states)

    def _register(self, rollout_id: str, version: int, states: list[RequestState]) -> None:
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
        as the owner (a request moved by repack is flushed by its new rollout). A fenced
        rollout's flush is ignored (:meth:`fence`)."""
        if rollout_id in self.fenced:
            self.counts["fenced_flushes"] += 1
            self.counts["fenced_tokens"] += sum(len(t[1]) for t in tokens.values())
            return
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
            self._register(e["owner"], e["version"], [e["state"]])  # (the pool's own: no fence)
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
        recovery of them from here (their new rollout lost) goes on from that history.

        To a fenced rollout (given up while the move or recovery went on): its entries
        all the same, and it is :meth:`late`, so that they are taken again."""
        if rollout_id in self.fenced and request_ids:
            self.counts["fenced_reassigns"] += 1
            self._late.add(rollout_id)
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
        t_finish): score it, do not decode.

        A rollout whose entries are taken is lost: it is fenced (:meth:`fence`) first, so
        that nothing its process may yet send makes it their owner again."""
        self.fence(rollout_id)
        self._late.discard(rollout_id)
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
        return {
            "entries": len(self.entries) - held,
            "held_entries": held,
            "fenced_rollouts": sorted(self.fenced),
            **self.counts,
        }
