"""The driver's records: a ``cluster`` row and a ``rollouts`` row per replica at each
poll, what it copies from the trainer and the manager into ``metrics.zarr`` (updates,
repacks, faults, the master relay's publications), a resumed run's time origin and
carried counters, the update and publication rows an earlier start's driver never
wrote (written back from the checkpoint the resume starts from), and the relay tier's
part of ``summary.json``.

A mixin of :class:`pipelines.driver.Schedule`, apart from its wiring, polls and stop:
the metrics store's tables are one concern (their schema is ``storage/metrics.py``'s).
Runs in ``laminar run``'s driver.
"""

from __future__ import annotations

import logging
import math
import time

from laminar.cluster import actor_result
from pipelines.driver_calls import _answers, _stopping
from pipelines.driver_faults import OWN_ERRORS_TO_FAIL
from pipelines.summary import earlier_faults, median
from storage.audit import version_ranges
from storage.metrics import ROLLOUT_COUNTERS, ROLLOUT_GAUGES

# What summary.json keeps of each relay's stats.
RELAY_FIGURES = (
    "relay_id",
    "kept",
    "versions",
    "evicted",
    "corrupt_chunks",  # (chunks whose checksum failed on arrival: resent)
    "refused",  # (versions refused at their first chunk: not newer than one begun)
    "allocated_bytes",
    "peak_bytes",
    "budget_bytes",
    "forwarded_chunks",
    "sender",
    "rechains",
    "overtaken",
    "send_failures",
    "send_retries",
    "sends_given_up",
    "errors",
    "error_count",
)
# How long a poll waits for the trainer's new rows (and the master relay's publications).
ROWS_WAIT_S = 5.0
# A publication whose broadcast has not completed (a relay of the chain does not hold it
# yet) is written as it stands after this long: a lost relay's never completes.
PUBLICATION_SETTLE_S = 60.0
# The cluster counters a resume carries on from the store, not from the earlier start's
# last row: counter -> the ResumePlan field that counts it (MetricsRecording._origin).
FROM_STORE = {
    "inserted": "stored",
    "consumed": "consumed",
    "discarded": "discarded",
    "evicted": "evicted",
    "filtered": "filtered",
}
# Rollout stats recorded per poll (besides the rollout id and the time).
ROLLOUT_METRICS = ROLLOUT_GAUGES + ROLLOUT_COUNTERS

logger = logging.getLogger(__name__)


def _broadcast(publication: dict) -> bool:
    """Whether every relay held a publication (its record no longer changes)."""
    b = publication.get("broadcast_s")
    return b is not None and math.isfinite(b)


def restore_checkpoint_rows(writer, run_dir, checkpoint, version: int) -> dict[str, list[int]]:
    """Append to ``metrics.zarr`` (``writer``, a :class:`storage.metrics.MetricsWriter`)
    the ``updates`` and ``publications`` rows that ``checkpoint`` keeps
    (:data:`laminar.trainer_publish.CHECKPOINT_ROWS`) and its tables lack, of versions up
    to ``version`` (the checkpoint's, which a resume starts from); returns table -> the
    versions of the rows appended.

    The driver copies those rows from the trainer's process at each poll and writes them
    every few seconds; a driver aborted (a second Ctrl-C) or killed meanwhile lost them,
    and a resume redoes only the versions after its checkpoint: their curves had a hole
    for good. A row counts as there when the table holds one of the same version made at
    the same time (:data:`laminar.trainer_publish.ROW_KEYS`), so none is written twice
    (after a clean stop the tables hold them all: nothing is appended; a resume from the
    same checkpoint again finds them written), and a superseded branch's row of a version
    (a start that went on past an older checkpoint, then resumed) does not stand for the
    lineage's. Rows of versions after ``version`` are never appended: the resume redoes
    them."""
    from laminar.trainer_publish import ROW_KEYS, read_checkpoint_rows
    from storage.metrics import open_metrics

    kept = read_checkpoint_rows(checkpoint)
    added: dict[str, list[int]] = {}
    for table, key in ROW_KEYS.items():
        rows = [r for r in kept.get(table, []) if r["version"] <= version]
        if not rows:
            continue
        try:
            have = open_metrics(run_dir, table)
        except (FileNotFoundError, KeyError):  # (no store, or no row of it yet)
            there = set()
        else:
            there = (
                set(zip(have["version"].values.tolist(), have[key].values.tolist(), strict=True))
                if "version" in have and key in have
                else set()
            )
        missing = [r for r in rows if (r["version"], r[key]) not in there]
        if missing:
            writer.append(table, missing)
            added[table] = [int(r["version"]) for r in missing]
    return added


def _carried(carry: dict[str, float], row: dict) -> dict:
    """``row`` with ``carry``'s counts added to its columns (NaN stays NaN)."""
    for k, v in carry.items():
        if k in row and row[k] is not None:
            row[k] = row[k] + v
    return row


class MetricsRecording:
    """The records of :class:`~pipelines.driver.Schedule`, which opens the metrics
    store (``metrics``) and the rows it fills (``_rows``) in ``run``."""

    # The buffer's reading the last ``cluster`` row was stamped at (:meth:`_record`)
    _last_read_at = -math.inf

    def _origin(self, t_start: float) -> float:
        """When the run first started: a resumed run's ``cluster`` rows go on from its
        earlier ones (``elapsed_s`` keeps rising, across the gap), as a new segment
        (:func:`storage.metrics.segments`; the earlier ones are kept for the summary)."""
        if self.resume is None:
            return t_start
        # (first: whatever else is read or fails below, the rows an earlier start lost)
        self._restore_rows()
        from storage.metrics import counters_at_end, open_metrics, segments, time_origin

        try:
            cluster = open_metrics(self.run_dir, "cluster")
        except Exception:  # noqa: BLE001 — lost before its first metrics flush
            # (or moved aside, as a StoreError advises): the stops the store records
            # still leave out of oldest_buffered_age_s what buffer_age() leaves out
            self._pauses = self._stops(t_start, t_start)
            return t_start
        self._carry = counters_at_end(self.run_dir)
        # The buffer's counters go on from what the store says, not from the earlier
        # start's last row: ``consumed`` from what the updates that stand trained on (the
        # plan's ``consumed_before``; the last row counted the lost updates' batches too,
        # which this start's buffer holds again and counts again as it trains them), the
        # others from the store's rows and statuses (a start killed after its last row
        # admitted, discarded, evicted or filtered more than that row says). So
        # inserted = consumed + discarded + evicted + filtered + depth + dropped holds
        # at every row of this start, whatever ended the one before (docs/storage.md).
        carried = self._carry["cluster"]
        for name, field in FROM_STORE.items():
            if name in carried:  # (an earlier start that wrote no row of it: none carried)
                carried[name] = float(getattr(self.resume, field))
        self._earlier_segments = segments(cluster)
        if self._earlier_segments:
            self._segment = self._earlier_segments[-1]["segment"] + 1
        origin = time_origin(cluster)
        # (summary.json is rewritten by this start: the earlier ones' losses carried on)
        self._earlier_faults = earlier_faults(self.run_dir, self._earlier_segments, origin)
        if origin is not None and self._earlier_segments:
            # (between its starts: no trajectory the buffer held again aged meanwhile)
            self._pauses = self._stops(origin, t_start)
        return t_start if origin is None else origin

    def _restore_rows(self) -> None:
        """A resumed start's first write: the ``updates`` and ``publications`` rows of
        the versions up to its checkpoint that an earlier start's driver never wrote,
        from the checkpoint (:func:`restore_checkpoint_rows`). Said at INFO; one that
        fails is said, and the run goes on (the rows stay in the checkpoint: a later
        resume from it writes them)."""
        ckpt = self.cfg.trainer.resume_from
        if ckpt is None:
            return
        try:
            added = restore_checkpoint_rows(self.metrics, self.run_dir, ckpt, self.resume.version)
        except Exception as e:  # noqa: BLE001 — metrics rows must not stop the run
            logger.warning(
                "the update and publication rows %s keeps were not written back to "
                "metrics.zarr (%s: %s): the versions an earlier start's driver did not "
                "write have no row",
                ckpt,
                type(e).__name__,
                e,
            )
            return
        for table, versions in added.items():
            logger.info(
                "metrics.zarr's %s lacked the rows of versions %s (an earlier start's "
                "driver stopped before it wrote them): written back from %s",
                table,
                version_ranges(versions),
                ckpt,
            )

    def _stops(self, origin: float, t_start: float) -> list[tuple[float, float]]:
        """The stops of a resumed run, this start's included, as ``open_run``'s
        ``pauses_s`` has them (:func:`storage.trajectories_read.resume_stops`: each from
        the last sign of the start before to the resume the store recorded), so that
        ``oldest_buffered_age_s`` leaves out what ``buffer_age()`` does. A store that
        cannot be read: from each start's last row to the next's first (this one's:
        ``t_start``); none without rows of an earlier start."""
        from storage.trajectories_read import resume_stops

        try:
            return resume_stops(self.run_dir, t_start)
        except Exception as e:  # noqa: BLE001 — its rows still go on
            logger.warning("%s: its stops are read from the metrics alone: %s", self.run_dir, e)
        if not self._earlier_segments:
            return []
        ends = [origin + seg["end_s"] for seg in self._earlier_segments]
        starts = [origin + seg["start_s"] for seg in self._earlier_segments[1:]]
        return list(zip(ends, [*starts, t_start], strict=True))

    def _record(self, elapsed, now, t_stats, b_stats, p_stats, r_stats, tokens) -> None:
        """One row of the ``cluster`` table and one ``rollouts`` row per replica (their
        cumulative columns go on from a resumed run's earlier starts: ``_carry``).

        The ``cluster`` row is stamped when the buffer was read (its ``read_at``), not
        when the poll ended: its columns are mostly the buffer's (and the prompt pool's,
        read with it), and the trainer's and rollouts' calls after it took 0.1 s at the
        median and up to 1.8 s, so a row's ``inserted`` or age lined up against the
        store's times or the updates' read up to 128 trajectories off (helper 200). The
        ``rollouts`` rows of the poll share the stamp (readers select a poll's rollouts
        by it; their own reading is their ``read_at``). A reading the buffer did not give
        this poll (a data module silent or being rebuilt: the driver's last one, read
        again) stamps the row at the poll's end: restamped at its old time, the rows
        stood still on the time axis."""
        read_at = b_stats.get("read_at")  # (a stand-in's, or an older buffer's: none)
        if read_at is not None and read_at > self._last_read_at:
            self._last_read_at = read_at
            elapsed -= now - read_at
            now = read_at
        age = b_stats.get("oldest_age_s")
        if age is None:
            age = now - b_stats["oldest_t_insert"]
        oldest = now - age  # (NaN when the buffer is empty)
        # A trajectory held again by a resume does not age while the run is stopped (as
        # the accessor's buffer_age, which subtracts pauses_s).
        age -= sum(max(0.0, end - max(start, oldest)) for start, end in self._pauses)
        self._rows["cluster"].append(
            _carried(
                self._carry["cluster"],
                {
                    "elapsed_s": elapsed,
                    "wall_time": now,
                    "segment": self._segment,  # (a resume starts the next)
                    "version": t_stats["version"],
                    "buffer_depth": b_stats["depth"],
                    "ready_groups": b_stats["ready_groups"],
                    "partial_groups": b_stats["partial_groups"],
                    "inserted": b_stats["inserted"],
                    "consumed": b_stats["consumed"],
                    "discarded": b_stats["discarded"],
                    # (a stand-in's, from before they were counted: NaN)
                    "evicted": b_stats.get("evicted"),
                    "filtered": b_stats.get("filtered"),
                    "oldest_buffered_age_s": age,  # NaN when the buffer is empty
                    "outstanding_groups": p_stats["outstanding"],
                    "dispatched_groups": p_stats["dispatched"],
                    "response_tokens": tokens,
                    "trainer_wait_s": self._trainer_wait_total(t_stats["wait_s"]),
                },
            )
        )
        for s in r_stats:
            rid = s["rollout_id"]
            row = {"elapsed_s": elapsed, "rollout": rid}
            row |= {k: s.get(k, math.nan) for k in ROLLOUT_METRICS}
            self._rows["rollouts"].append(_carried(self._carry["rollouts"].get(rid, {}), row))

    def _trainer_wait_total(self, wait_s: float) -> float:
        """The trainers' wait over this start: the current trainer's reading plus what
        those restarted within the run before it had waited (:meth:`_trainer_back`)."""
        before, _ = self._trainer_wait
        self._trainer_wait = (before, wait_s)
        return before + wait_s

    def _trainer_wait_run(self, wait_s: float) -> float:
        """The trainers' wait over the whole run, as the ``cluster`` table's
        ``trainer_wait_s`` counts it: what a resume carried over from the starts before
        (``_carry``), the trainers restarted within this start before the current one,
        and the current one's ``wait_s`` (summary.json's ``trainer_wait_s``)."""
        before, _ = self._trainer_wait
        return float(self._carry["cluster"].get("trainer_wait_s", 0.0)) + before + wait_s

    def _write_rows(self, final: bool = False) -> None:
        """The rows copied since the last write into the metrics store: the driver's own
        (``cluster``, ``rollouts``), the trainer's, the manager's (:meth:`_copy_rows`) and
        the master relay's publications. ``final`` (the run stops or fails): every
        publication copied, its broadcast complete or not."""
        self._rows.setdefault("publications", []).extend(self._settled_publications(final))
        for table, rows in self._rows.items():
            self.metrics.append(table, rows)
            rows.clear()

    def _flush_metrics(self) -> None:
        self._write_rows()

    def _copy_rows(self, manager_answered: bool, final: bool = False) -> None:
        """Copy the rows that only the trainer's and the manager's processes hold — the
        trainer's history, the manager's repack moves and recoveries, the master relay's
        publications — into the driver's memory (``_rows``), from where each flush, the
        stop and a failure write them: a trainer or data module lost between two flushes
        used to take its rows with it (docs/faults.md). Called every poll (each call asks
        only for the rows after those copied), and ``final`` once as the run stops, when a
        call that fails fails the stop where nothing can restart what it asked.

        ``manager_answered``: the manager's stats answered this poll (else it is not asked:
        lost, hung or being rebuilt, it would hold the poll up)."""
        from pipelines.restart import CoreRestart

        t = self.actors["trainer"]
        # (none runs while a restart is in progress; one that failed a call is asked again
        # once it answers; a hung one's worker is being restarted)
        trainer_up = (
            t is not None
            and self._restart is None
            and not isinstance(self._data_restart, CoreRestart)
            and self._trainer_worker() not in self._fenced
            and (final or self._trainer_suspect is None)
        )
        if trainer_up:
            # (a poll waits for this no longer than its rollouts' stats: the trainer
            # answered its stats just now, so a slow answer is load, asked again next poll)
            wait = self._core_timeout() if final else min(ROWS_WAIT_S, self._core_timeout())
            what = "the trainer's get_history()"
            try:
                new = actor_result(t, t.get_history(self._n_updates), wait)
            except Exception as e:
                if final and not self.restartable:
                    raise
                if final:  # (no later poll to ask again)
                    self._own_errors[what] = OWN_ERRORS_TO_FAIL - 1
                self._own_error(what, e)
                new = []  # lost or slow: the polls judge which
            else:
                self._answered(what)
            self._rows.setdefault("updates", []).extend(new)
            self._n_updates += len(new)
            if not final:  # (the stop reads them from the relays itself: _relay_summary)
                self._keep_publications()
        m = self.actors["manager"]
        if m is None or not manager_answered or self._data_restart is not None:
            return
        if self._data_suspect or self._data_hung is not None:
            return  # (it does not answer now: its rows come with a later poll)
        timeout = self._core_timeout()
        what = "the rollout manager's get_rows()"
        try:
            moves = actor_result(m, m.get_rows(self._n_repacks), timeout)
            faults = actor_result(m, m.get_fault_rows(self._n_faults), timeout)
        except Exception as e:
            if not self.data_restartable:
                raise
            self._own_error(what, e)
            self._data_silent(e)
            return  # lost with the data module: the rows it made since the last poll too
        self._answered(what)
        # (which start of the run made them: a resumed run's rollout ids begin at r0 again)
        self._rows.setdefault("repacks", []).extend(r | {"segment": self._segment} for r in moves)
        self._n_repacks += len(moves)
        self._rows.setdefault("faults", []).extend(r | {"segment": self._segment} for r in faults)
        self._n_faults += len(faults)

    def _keep_publications(self) -> None:
        """The master's publication records, which only the trainer's process holds,
        copied here while it lives (every poll that has something new to learn: a newer
        version, or a broadcast not yet complete): they outlive a lost trainer, restarted
        or not. Only the records not yet written are asked for again (a record's
        ``broadcast_s`` comes once every relay holds its version)."""
        copied = self._master_publications
        version = (self._last_t_stats or {}).get("published")
        written = min(len(copied), max(0, self._n_pubs - len(self._old_publications)))
        if (
            copied
            and copied[-1]["version"] == version
            and all(_broadcast(p) for p in copied[written:])
        ):
            return
        master = self.actors["relays"][0]
        try:
            wait = min(ROWS_WAIT_S, self._core_timeout())
            new = actor_result(master, master.publications_since(written), wait)
        except Exception:  # noqa: BLE001 — lost meanwhile: the last copy stands
            return
        self._master_publications = copied[:written] + list(new)

    def _settled_publications(self, final: bool) -> list[dict]:
        """The publications copied and not yet written whose records will not change: a
        lost master's, and the live master's once every relay holds the version (its
        ``broadcast_s``) or :data:`PUBLICATION_SETTLE_S` after it (a relay lost
        meanwhile never completes it); in order, so a row waits for those before it.
        ``final``: all of them, as they stand."""
        pubs = self._old_publications + self._master_publications
        new = pubs[self._n_pubs :]
        if not final:
            old, now, k = len(self._old_publications), time.time(), 0
            for i, p in enumerate(new):
                settled = _broadcast(p) or now - p["t_publish"] > PUBLICATION_SETTLE_S
                if self._n_pubs + i >= old and not settled:
                    break
                k += 1
            new = new[:k]
        self._n_pubs += len(new)
        return new

    def _relay_summary(self, r_stats: list[dict]) -> dict:
        """The relay tier over the run: each publication (stall, time until every relay
        held it), each relay's memory, each rollout's waits, and — with
        ``relay.audit_weights`` — whether every version a rollout loaded was bit-identical
        to the one the trainer published."""
        a = self.actors
        master, *down = a["relays"]  # a lost downstream relay does not answer: left out
        timeout = self.cfg.cluster.actor_timeout_s
        head = [] if self._master_gone else [_stopping(master, "stats", timeout)]
        stats = [*head, *_answers([lambda r=r: r.stats() for r in down])]
        pubs = self._old_publications + (head[0].get("publications", []) if head else [])
        out = {
            **self.relay_info,
            "publications": pubs,
            "stall_s_median": median([p["stall_s"] for p in pubs]),
            "broadcast_s_median": median([p["broadcast_s"] for p in pubs]),
            "relays": [{k: s[k] for k in RELAY_FIGURES} for s in stats],
            "rollout_wait_s": [s["weight_wait_s"] for s in r_stats],
            "weight_loads": [s["weight_loads"] for s in r_stats],
        }
        if self.cfg.relay.audit_weights:
            published = self._published_fps
            if a["trainer"] is not None:  # (else lost after its last copy: unverified)
                published = published | _stopping(a["trainer"], "get_fingerprints", timeout)
            checked = mismatched = unverified = 0
            loaded = _answers([lambda r=r: r.get_fingerprints() for r in self._live_rollouts()])
            for fingerprints in loaded:
                for v, fp in fingerprints.items():
                    if v not in published:  # published by a lost trainer after our copy
                        unverified += 1
                        continue
                    checked += 1
                    mismatched += published[v] != fp
            out["fingerprints"] = {
                "published": len(published),
                "loads_checked": checked,
                "mismatched": mismatched,
                "unverified": unverified,
            }
        return out
