"""The driver's records: a ``cluster`` row and a ``rollouts`` row per replica at each
poll, what it copies from the trainer and the manager into ``metrics.zarr`` (updates,
repacks, faults, the master relay's publications), a resumed run's time origin and
carried counters, and the relay tier's part of ``summary.json``.

A mixin of :class:`pipelines.driver.Schedule`, apart from its wiring, polls and stop:
the metrics store's tables are one concern (their schema is ``storage/metrics.py``'s).
Runs in ``laminar run``'s driver.
"""

from __future__ import annotations

import math

from laminar.cluster import actor_result
from pipelines.driver_calls import _answers, _stopping
from pipelines.summary import median
from storage.metrics import ROLLOUT_COUNTERS, ROLLOUT_GAUGES

# What summary.json keeps of each relay's stats.
RELAY_FIGURES = (
    "relay_id",
    "kept",
    "versions",
    "evicted",
    "allocated_bytes",
    "peak_bytes",
    "budget_bytes",
    "forwarded_chunks",
    "sender",
    "errors",
)
# Rollout stats recorded per poll (besides the rollout id and the time).
ROLLOUT_METRICS = ROLLOUT_GAUGES + ROLLOUT_COUNTERS


def _carried(carry: dict[str, float], row: dict) -> dict:
    """``row`` with ``carry``'s counts added to its columns (NaN stays NaN)."""
    for k, v in carry.items():
        if k in row and row[k] is not None:
            row[k] = row[k] + v
    return row


class MetricsRecording:
    """The records of :class:`~pipelines.driver.Schedule`, which opens the metrics
    store (``metrics``) and the rows it fills (``_rows``) in ``run``."""

    def _origin(self, t_start: float) -> float:
        """When the run first started: a resumed run's ``cluster`` rows go on from its
        earlier ones (``elapsed_s`` keeps rising, across the gap), as a new segment
        (:func:`storage.metrics.segments`; the earlier ones are kept for the summary)."""
        if self.resume is None:
            return t_start
        from storage.metrics import counters_at_end, open_metrics, segments, time_origin

        try:
            cluster = open_metrics(self.run_dir, "cluster")
        except Exception:  # noqa: BLE001 — lost before its first metrics flush
            return t_start
        self._carry = counters_at_end(self.run_dir)
        self._earlier_segments = segments(cluster)
        if self._earlier_segments:
            self._segment = self._earlier_segments[-1]["segment"] + 1
        origin = time_origin(cluster)
        if origin is not None and self._earlier_segments:
            # (between its starts: no trajectory the buffer held again aged meanwhile)
            ends = [origin + seg["end_s"] for seg in self._earlier_segments]
            starts = [origin + seg["start_s"] for seg in self._earlier_segments[1:]]
            self._pauses = list(zip(ends, [*starts, t_start], strict=True))
        return t_start if origin is None else origin

    def _record(self, elapsed, now, t_stats, b_stats, p_stats, r_stats, tokens) -> None:
        """One row of the ``cluster`` table and one ``rollouts`` row per replica (their
        cumulative columns go on from a resumed run's earlier starts: ``_carry``)."""
        # (the buffer's own reading; a stand-in's, or an older buffer's, has none)
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

    def _write_rows(self) -> None:
        """The driver's own rows (``cluster``, ``rollouts``) into the metrics store."""
        for table, rows in self._rows.items():
            self.metrics.append(table, rows)
            rows.clear()

    def _flush_metrics(self) -> None:
        self._write_rows()
        # (no trainer restarting, and one runs: after _trainer_finished none does)
        restarting = self._restart is not None or self._data_restart is not None
        if self.actors["trainer"] is not None and not restarting:
            try:
                if self._trainer_worker() in self._fenced:
                    raise TimeoutError("the trainer is hung")
                t = self.actors["trainer"]
                new = actor_result(t, t.get_history(self._n_updates), self._core_timeout())
            except Exception:
                if not self.restartable:
                    raise
                new = []  # lost just now: the next poll starts its restart
            self.metrics.append("updates", new)
            self._n_updates += len(new)
            if self.restartable:
                self._keep_publications()
        if self.actors["manager"] is not None and self._data_restart is None:
            if self._data_suspect or self._data_hung is not None:
                return  # (it does not answer now: its rows come with a later flush)
            m, timeout = self.actors["manager"], self._core_timeout()
            try:
                moves = actor_result(m, m.get_rows(self._n_repacks), timeout)
                faults = actor_result(m, m.get_fault_rows(self._n_faults), timeout)
            except Exception as e:
                if not self.data_restartable:
                    raise
                self._data_silent(e)
                return  # lost with the data module: its last rows are lost with it
            self.metrics.append("repacks", moves)
            self._n_repacks += len(moves)
            self.metrics.append("faults", faults)
            self._n_faults += len(faults)

    def _keep_publications(self) -> None:
        """The master's publication records, which only the trainer's process holds,
        copied here while it lives (every metrics flush): they outlive a restart."""
        a = self.actors
        try:
            self._master_publications = a["relays"][0].stats().result(timeout=5.0)["publications"]
        except Exception:  # noqa: BLE001 — lost meanwhile: the last copy stands
            pass

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
