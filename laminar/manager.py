"""The rollout manager: runs the repack planner and carries out its moves.

Every ``repack.interval_s`` (the paper: 5 s), and right after each trainer publication,
the manager asks every rollout for its load, plans with :func:`laminar.repack.plan` and
executes each move in three steps:

1. the source exports every unfinished request (tokens, logprobs and versions so far)
   and holds at its batch boundary;
2. the destination imports them into its running batch, which re-prefills them — only
   if it still decodes a batch of the same version (it may have drained meanwhile);
   otherwise the source takes them back;
3. the source is released: it pulls the newest weights and takes new prompts.

No request is ever in two engines or in none: a state leaves the source only into the
destination or back into the source. Each move is a row of the ``repacks`` table of
``metrics.zarr`` (requests and tokens moved, re-prefilled tokens, the pause it caused).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback

from laminar.cluster import start_thread
from laminar.config import RunConfig
from laminar.repack import RolloutLoad, plan

logger = logging.getLogger(__name__)


def repack_max_batch(cfg: RunConfig) -> int:
    """``B`` for the planner: ``repack.max_batch`` if set; else the pacing model's
    memory-bound batch limit when paced, capped by what one engine decodes at once."""
    if cfg.repack is not None and cfg.repack.max_batch is not None:
        return cfg.repack.max_batch
    limit = cfg.rollout.max_batch
    pacing = cfg.rollout.pacing
    if pacing is not None:
        from laminar.pacing import TimeModel

        model = TimeModel.named(pacing.accelerator, pacing.model, tp=pacing.tp)
        limit = min(limit, max(2, int(model.batch_limit)))
    return limit


class RolloutManager:
    """Dask actor (on the data worker): the repack loop over every rollout."""

    def __init__(self, cfg: RunConfig, rollouts: dict, master_relay) -> None:
        """``rollouts`` maps each rollout id to its actor handle."""
        if cfg.repack is None:
            raise ValueError("RolloutManager needs a repack section in the config")
        self.cfg = cfg
        self.rcfg = cfg.repack
        self.rollouts = dict(rollouts)
        self.master = master_relay
        self.max_batch = repack_max_batch(cfg)
        self.timeout = cfg.cluster.actor_timeout_s
        self._prev: dict[str, float] = {}
        self._seen_version = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rows: list[dict] = []  # one per executed (or rolled back) move
        self.counts = {"checks": 0, "moves": 0, "rolled_back": 0, "skipped": 0}
        self.error: str | None = None

    def start(self) -> None:
        self._thread = start_thread(self._run, "repack")

    def stop(self, timeout: float = 30.0) -> dict:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.stats()

    def stats(self) -> dict:
        moved = [r for r in self.rows if r["ok"]]
        return {
            **self.counts,
            "max_batch": self.max_batch,
            "requests_moved": sum(r["requests"] for r in moved),
            "tokens_moved": sum(r["tokens"] for r in moved),
            "reprefill_tokens": sum(r["context_tokens"] for r in moved),
            "pause_s": sum(r["pause_s"] for r in self.rows),
            "error": self.error,
        }

    def get_rows(self, start: int = 0) -> list[dict]:
        return self.rows[start:]

    def _run(self) -> None:
        last = time.time()
        try:
            while not self._stop.wait(0.05):
                published = self._published()
                if published or time.time() - last >= self.rcfg.interval_s:
                    last = time.time()
                    self.check()
        except Exception:
            self.error = traceback.format_exc()
            logger.error("rollout manager failed:\n%s", self.error)

    def _published(self) -> bool:
        if not self.rcfg.on_publish:
            return False
        info = self.master.newest(self._seen_version).result(timeout=self.timeout)
        if info is None:
            return False
        self._seen_version = info["version"]
        return True

    def check(self) -> list[dict]:
        """One planning round: loads, plan, moves. Returns the rows of its moves."""
        futures = {rid: r.load() for rid, r in self.rollouts.items()}
        loads = []
        for rid, f in futures.items():
            load = f.result(timeout=self.timeout)
            if not load:
                continue  # not started yet
            prev = self._prev.get(rid, load["kv_used"])
            self._prev[rid] = load["kv_used"]
            if load["in_batch"] and not load["held"]:
                loads.append(
                    RolloutLoad(rid, load["version"], load["kv_used"], prev, load["n_requests"])
                )
        self.counts["checks"] += 1
        rows = [
            self._move(m.source, m.destination)
            for m in plan(loads, c_max=self.rcfg.c_max, max_batch=self.max_batch)
        ]
        rows = [r for r in rows if r is not None]
        self.rows += rows
        return rows

    def _move(self, source: str, destination: str) -> dict | None:
        src, dst = self.rollouts[source], self.rollouts[destination]
        t0 = time.time()
        out = src.export_for_move().result(timeout=self.timeout)
        if out is None:  # the source drained meanwhile: nothing to move
            self.counts["skipped"] += 1
            return None
        try:
            t1 = time.time()
            try:
                ok = dst.import_for_move(out["version"], out["states"]).result(timeout=self.timeout)
            except Exception as e:  # noqa: BLE001 — the destination failed: take them back
                logger.warning(
                    "repack %s -> %s: import failed (%r); rolled back", source, destination, e
                )
                ok = False
            t_import = time.time() - t1
            if not ok:
                back = src.import_for_move(out["version"], out["states"], rollback=True)
                if not back.result(timeout=self.timeout):
                    raise RuntimeError(f"rollout {source} refused its own states back")
        finally:
            src.release().result(timeout=self.timeout)
        self.counts["moves" if ok else "rolled_back"] += 1
        for rid in (source, destination):
            self._prev.pop(rid, None)  # their KV just jumped: not "falling" next time
        return {
            "time": t0,
            "source": source,
            "destination": destination,
            "version": out["version"],
            "ok": ok,
            "requests": len(out["states"]),
            "tokens": out["tokens"],
            "context_tokens": out["context_tokens"],
            "export_s": out["export_s"],
            "import_s": t_import,
            "pause_s": time.time() - t0,
        }
