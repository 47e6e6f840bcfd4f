"""What every schedule's driver does: wire the actors of one run on a Dask client,
drive them to the end, record the run's metrics and summary.

The five schedules (``pipelines/laminar.py``, ``sync.py``, ``one_step.py``, ``stream.py``,
``partial_rollout.py``) are subclasses of :class:`Schedule` that say what they keep
global as a :class:`~laminar.schedule.ScheduleSpec`; every actor takes the spec and
follows it. ``pipeline.schedule`` in the config picks one (:func:`schedule_class`).
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from laminar.buffer import ExperienceBuffer
from laminar.cluster import (
    ActorHung,
    actor_result,
    bind_actor,
    is_lost,
    place,
    scheduler_workers,
    start_actor,
    submit_actor,
    workers_with,
)
from laminar.config import RunConfig
from laminar.errors import ClusterError, RunStopped
from laminar.learner import newest_checkpoint
from laminar.manager import RolloutManager
from laminar.partial import PartialResponsePool
from laminar.prompt_pool import DATA_STATE, PromptPool, load_prompts
from laminar.relay_tier import build_tier
from laminar.rollout import RolloutReplica
from laminar.schedule import ScheduleSpec
from laminar.trainer import Trainer, TrainerRank, rendezvous
from pipelines.summary import faults_summary, median
from storage.metrics import ROLLOUT_COUNTERS, ROLLOUT_GAUGES

logger = logging.getLogger("laminar")

METRICS_FLUSH_S = 5.0
# A data-module (or trainer) call that failed as if lost, with its worker still on the
# scheduler's books, is tried again for this long before the run fails.
DATA_SUSPECT_S = 10.0
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
# A hung actor's worker is restarted (the nanny waits a few seconds, then kills it); the
# run waits this long for the scheduler to drop it before it fails.
FENCE_WAIT_S = 60.0
# A run whose reward function has failed on this many responses, over this long, and
# scored none stops: every failure discards its group, so no batch would ever reach the
# trainer. (The window lets a reward service that starts late, or restarts, catch up.)
REWARD_FAILURES_TO_STOP = 64
REWARD_FAILURE_WINDOW_S = 60.0
# How long a poll waits for the rollouts' stats. A call still unanswered then is kept and
# read at a later poll, not made again: a silent rollout (lost but not yet detected, or
# hung) costs the polls this wait once, not at every poll until the manager declares it.
ROLLOUT_STATS_WAIT_S = 5.0
# Rollout stats recorded per poll (besides the rollout id and the time).
ROLLOUT_METRICS = ROLLOUT_GAUGES + ROLLOUT_COUNTERS


def _carried(carry: dict[str, float], row: dict) -> dict:
    """``row`` with ``carry``'s counts added to its columns (NaN stays NaN)."""
    for k, v in carry.items():
        if k in row and row[k] is not None:
            row[k] = row[k] + v
    return row


def prepare_policy(cfg: RunConfig, cancel: str | None = None) -> tuple[str, dict]:
    """Dask task: the warm-started policy folder (cached) and how it was obtained.
    ``cancel`` names a :class:`distributed.Event` the driver sets when the run is stopped
    meanwhile: the warm start then ends within a few of its steps (a running task is not
    ended by cancelling its future), freeing the trainer's worker."""
    from laminar.sft import warm_start

    should_stop = None
    if cancel is not None:
        from distributed import Event

        should_stop = Event(cancel).is_set
    path, info = warm_start(cfg, load_prompts(cfg), should_stop=should_stop)
    return str(path), info


class Schedule:
    """Wires the actors of one run on a Dask client and drives them to the end.

    A subclass says what its schedule keeps global (:meth:`spec`). ``progress`` is called
    with a dict about twice a second; ``should_stop`` is polled (Ctrl-C in the CLI,
    ``RunHandle.stop()`` in a notebook).
    """

    name = "laminar"

    @classmethod
    def spec(cls, cfg: RunConfig) -> ScheduleSpec:
        """What the schedule keeps global, for the actors to follow."""
        raise NotImplementedError

    def __init__(self, cfg: RunConfig, client, run_dir: Path, resume=None) -> None:
        """``resume``: the :class:`storage.resume.ResumePlan` of a run resumed in place."""
        self.schedule = self.spec(cfg)
        self.cfg = cfg
        self.client = client
        self.run_dir = run_dir
        self.resume = resume
        self.actors: dict = {}
        self.sft_info: dict = {}
        # this start's segment of the run's metrics, and those before it (_origin)
        self._segment, self._earlier_segments = 0, []
        self._pauses: list[tuple[float, float]] = []  # a resumed run's stops (epoch s)
        # a resumed run's counters at its last stop (storage.metrics.counters_at_end):
        # its cumulative columns go on from them
        self._carry: dict[str, dict] = {"cluster": {}, "rollouts": {}}
        # each rollout's response tokens as last read: one lost, replaced or slow to
        # answer still counts in the cluster's total
        self._tokens_by_rollout: dict[str, float] = {}
        # the trainer's wait: (what trainers restarted within the run had waited, the
        # last reading); a new trainer counts from 0 again
        self._trainer_wait = (0.0, 0.0)
        # rollout handle's key -> its stats call not yet answered (_rollout_stats)
        self._r_pending: dict = {}
        # (the prompt pool's handle, the live rollouts it was last told of: _share_batches)
        self._pool_told: tuple | None = None

    def setup(
        self, progress: Callable[[dict], None], should_stop: Callable[[], bool] = lambda: False
    ) -> None:
        """Start the run's actors. ``should_stop``: asked while the warm start runs and
        between the phases after it; a stop raises :class:`~laminar.errors.RunStopped`
        (the caller releases what had started)."""
        from distributed import Event
        from distributed import wait as wait_futures

        cfg, client = self.cfg, self.client

        def phase(name: str, **more) -> None:
            if should_stop():
                raise RunStopped(
                    f"run {str(self.run_dir)!r} was stopped during its setup (before "
                    f"{name!r}): nothing was generated; start it again when ready"
                )
            progress({"phase": name, **more})

        data_w = place(client, "data", 1)[0]
        trainer_ws = place(client, "trainer", cfg.trainer.ranks)
        if data_w in workers_with(client, "trainer"):  # it shares rank 0's (role_workers)
            trainer_ws = [data_w, *[w for w in trainer_ws if w != data_w]][: len(trainer_ws)]
        trainer_w = trainer_ws[0]
        rollout_ws = place(client, "rollout", cfg.rollout.replicas)
        phase("warm-start")
        t0 = time.time()
        cancel = Event(f"laminar-warm-start-{uuid.uuid4().hex}", client=client)
        fut = client.submit(
            prepare_policy,
            cfg,
            cancel.name,
            workers=[trainer_w],
            resources={"trainer": 1},
            pure=False,
        )
        try:
            while True:  # (minutes for a warm start from scratch: a stop need not wait)
                try:
                    wait_futures(fut, timeout=0.5)  # (raises its own errors in result())
                    break
                except TimeoutError:
                    if should_stop():
                        cancel.set()  # (the task ends itself: cancel() cannot end it)
                        fut.cancel()
                        phase("starting actors")
        finally:
            if not cancel.is_set():
                cancel.clear()  # (the scheduler forgets an event that is clear)
        policy_dir, self.sft_info = fut.result()
        self.sft_info["wall_s"] = time.time() - t0
        self.policy_dir = policy_dir
        phase("starting actors", policy_dir=policy_dir, sft=self.sft_info)
        spec = self.schedule
        pool, partial, buffer = start_data_module(
            client, cfg, policy_dir, self.run_dir, spec, data_w, resume=self.resume
        )
        # data-parallel: rank 0's worker hosts the rendezvous
        init_method = rendezvous(client, trainer_w) if cfg.trainer.ranks > 1 else ""
        ranks = [
            submit_actor(
                client,
                TrainerRank,
                cfg,
                policy_dir,
                r,
                init_method,
                worker=w,
                resource="trainer",
            )
            for r, w in enumerate(trainer_ws[1:], start=1)
        ]
        phase("relays")
        tier = build_tier(client, cfg, trainer_w, rollout_ws)
        self.relay_info = {"chain": tier.ids, "workers": tier.workers, **tier.calibration}
        if partial is not None:  # the versions of unfinished trajectories stay kept
            partial.set_relays(tier.relays).result()
        taken: dict[int, int] = {}
        self.tier, self._taken = tier, taken
        self.rollout_workers = {f"r{i}": w for i, w in enumerate(rollout_ws)}
        # The relay each rollout pulls from (the manager re-points them when one is lost).
        self.rollout_relays = {
            f"r{i}": tier.ids[tier.local_relay(w, taken)] for i, w in enumerate(rollout_ws)
        }
        self._joining: tuple[str, str, str, str, object] | None = None  # a replacement
        # Created at once (each loads its policy and builds its engine), then bound.
        starting = [
            start_actor(
                client,
                RolloutReplica,
                f"r{i}",
                cfg,
                policy_dir,
                pool,
                buffer,
                tier.handle(self.rollout_relays[f"r{i}"]),
                partial,
                str(self.run_dir / "checkpoints"),
                spec,
                worker=w,
                resource="rollout",
            )
            for i, w in enumerate(rollout_ws)
        ]
        rollouts = [
            bind_actor(client, RolloutReplica, w, f)
            for w, f in zip(rollout_ws, starting, strict=True)
        ]
        phase("starting the trainer")
        manager = None
        if cfg.repack is not None or partial is not None or spec.interrupt:
            manager = submit_actor(
                client,
                RolloutManager,
                cfg,
                {f"r{i}": r for i, r in enumerate(rollouts)},
                tier.master,
                partial,
                {f"r{i}": w for i, w in enumerate(rollout_ws)},
                relays=dict(zip(tier.ids, tier.relays, strict=True)),
                relay_workers=dict(zip(tier.ids, tier.workers, strict=True)),
                rollout_relays=self.rollout_relays,
                worker=data_w,
                resource="data",
            )
        trainer = submit_actor(
            client,
            Trainer,
            cfg,
            policy_dir,
            str(self.run_dir),
            buffer,
            tier.master,
            init_method,
            spec,
            manager,
            worker=trainer_w,
            resource="trainer",
        )
        # Where the actors that a run cannot go on without live (loss is reported by role).
        if trainer_w == data_w:
            self.core_workers = {"trainer and data module": trainer_w}
        else:
            self.core_workers = {"trainer": trainer_w, "data module": data_w}
        # A lost trainer restarts within the run (all its ranks, when data-parallel: a
        # lost rank breaks the group), and a lost data module is rebuilt, under Laminar's
        # schedule (whose dispatch and weights do not count versions), with the
        # partial-response pool and manager a rebuild needs (pipelines/restart.py). When
        # the two share a worker (the local default) they are lost together and
        # restarted together, which needs both switches.
        self._laminar = (spec.dispatch, spec.weights, spec.trainer) == ("free", "relay", "free")
        laminar, shared = self._laminar, trainer_w == data_w
        trainer_ok = cfg.faults.restart_trainer
        data_ok = partial is not None and cfg.faults.restart_data
        self.restartable = (
            laminar and manager is not None and trainer_ok and (data_ok or not shared)
        )
        self.data_restartable = (
            laminar and manager is not None and data_ok and (trainer_ok or not shared)
        )
        self.trainer_restarts: list[dict] = []
        self._restart = None  # a TrainerRestart in progress
        self.data_restarts: list[dict] = []
        self.core_restarts: list[dict] = []  # both at once (pipelines.restart.CoreRestart)
        self._data_restart = None  # a DataRestart or CoreRestart in progress
        # Workers restarted because what they host hung (worker -> when, why, outcome).
        self._fenced: dict[str, dict] = {}
        self._data_suspect: float | None = None  # a data-module call failed, not yet lost
        self._trainer_suspect: float | None = None  # ... a trainer call
        self._group_suspect: float | None = None  # a data-parallel rank failed
        self._last_data_stats: tuple[dict, dict] | None = None
        self._last_m_stats: dict | None = None
        self._published_fps: dict[int, int] = {}  # kept across trainer restarts
        self._old_publications: list[dict] = []  # the lost masters' records
        self._master_publications: list[dict] = []  # the live master's, as last copied
        self._last_t_stats: dict | None = None
        self._updates_before = 0  # rows of the updates table from trainers since lost
        self._master_gone = False  # lost with a trainer that had finished: none replaced it
        self.core_workers |= {f"trainer rank {r}": w for r, w in enumerate(trainer_ws[1:], 1)}
        self.actors = {
            "manager": manager,
            "partial": partial,
            "pool": pool,
            "buffer": buffer,
            "trainer": trainer,
            "trainer_ranks": ranks,
            "rollouts": rollouts,
            "relays": tier.relays,
        }

    def run(self, progress: Callable[[dict], None], should_stop: Callable[[], bool]) -> dict:
        from storage.metrics import MetricsWriter

        a = self.actors
        timeout = self.cfg.cluster.actor_timeout_s
        try:
            # (the other ranks first: they wait in the group's rendezvous for rank 0)
            for x in [*a["trainer_ranks"], a["trainer"], *a["rollouts"], a["manager"]]:
                if x is not None:
                    actor_result(x, x.start(), timeout)
        except Exception:
            # Its actors are released when the run ends, but a released actor's threads
            # go on: what started is stopped, so nothing trains or generates on.
            logger.exception("the run's actors could not all start: stopping those that did")
            self._abort()
            _answers([lambda t=t: t.stop(timeout=5.0) for t in (a["trainer"], *a["trainer_ranks"])])
            raise
        self._n_repacks = self._n_faults = 0
        self.metrics = MetricsWriter(self.run_dir, tensorboard=self.cfg.metrics.tensorboard)
        self._rows: dict[str, list[dict]] = {"cluster": [], "rollouts": []}
        self._n_updates = 0
        self._reward_scored = False  # (_reward_never_scores)
        self._reward_failing_since: float | None = None
        t_start = last_t = last_flush = time.time()
        t_origin = self._origin(t_start)
        last_tokens = 0
        reason = "completed"
        try:
            while True:
                time.sleep(self.cfg.metrics.poll_s)
                b_stats, p_stats = self._data_stats()
                self._check_group()
                t_stats = self._trainer_stats()
                r_stats = self._rollout_stats()
                now = time.time()
                for s in r_stats:
                    self._tokens_by_rollout[s["rollout_id"]] = s["response_tokens"]
                tokens = sum(self._tokens_by_rollout.values())
                gen_tok_s = (tokens - last_tokens) / max(now - last_t, 1e-9)
                last = t_stats["last"] or {}
                self._record(now - t_origin, now, t_stats, b_stats, p_stats, r_stats, tokens)
                progress(
                    {
                        "phase": "training",
                        "elapsed_s": now - t_start,
                        "version": t_stats["version"],
                        "steps": t_stats["steps"],
                        "reward": last.get("reward_mean"),
                        "s_train_mean": last.get("s_train_mean"),
                        "gen_tok_s": gen_tok_s,
                        "buffer_depth": b_stats["depth"],
                        # (the run's, as in the cluster table: a resumed run's earlier
                        # starts' included)
                        "trajectories": b_stats["inserted"]
                        + int(self._carry["cluster"].get("inserted", 0)),
                        "discarded": b_stats["discarded"],
                        "evicted": b_stats["evicted"],
                        "filtered": b_stats["filtered"],
                        "rollout_versions": [s["version"] for s in r_stats],
                    }
                )
                last_t, last_tokens = now, tokens
                if now - last_flush > METRICS_FLUSH_S:
                    self._flush_metrics()
                    last_flush = now
                failed = [s for s in r_stats if s["error"]] + self._trainer_errors(t_stats)
                m = self._manager_stats()
                if m is not None and m["error"]:
                    failed.append(m)
                elif m is not None:
                    self._replace_lost(m)
                    self._share_batches(m)
                if failed:
                    reason = "failed: " + failed[0]["error"].strip().splitlines()[-1]
                    break
                if unscorable := self._reward_never_scores(r_stats):
                    reason = "failed: " + unscorable
                    break
                if t_stats["done"] and not t_stats["error"]:  # (an error: a rank lost)
                    break
                if should_stop():
                    reason = "stopped"
                    break
        except Exception as e:
            try:  # a lost trainer or data module: say so, stop the rest
                if not self._fail_on_lost_core(e):
                    self._wind_down(e, t_start)  # anything else: stop the run in order
            finally:
                try:  # up to METRICS_FLUSH_S of the run's time series, kept
                    self._write_rows()
                except Exception as w:  # noqa: BLE001 — the run's own error comes first
                    logger.warning("metrics rows not written: %r", w)
                self.metrics.close()
            raise
        try:
            return self.shutdown(reason, t_start)
        except Exception as e:
            # (a core actor lost or silent as the run stops: what still runs is stopped,
            # and the store closed where it can be; the rows are kept)
            try:
                if not self._fail_on_lost_core(e):
                    logger.error("stopping the run failed (%r): aborting it", e)
                    self._abort()
            finally:
                try:
                    self._write_rows()
                except Exception as w:  # noqa: BLE001 — the run's own error comes first
                    logger.warning("metrics rows not written: %r", w)
            raise
        finally:
            self.metrics.close()

    def _reward_never_scores(self, r_stats: list[dict]) -> str | None:
        """Why the run must stop when ``task.reward`` has failed on every response given
        to it, :data:`REWARD_FAILURES_TO_STOP` of them over at least
        :data:`REWARD_FAILURE_WINDOW_S` (else ``None``): each failure discards its
        group, so no batch would ever reach the trainer and the run would go on for
        ever. Once anything has scored (as remembered here: a lost rollout's counters
        leave the stats), the run goes on whatever fails later."""
        if self._reward_scored or any(s.get("rewards_scored") for s in r_stats):
            self._reward_scored = True
            return None
        errors = sum(s.get("reward_errors", 0) for s in r_stats)
        if not errors:
            return None
        now = time.time()
        self._reward_failing_since = self._reward_failing_since or now
        if errors < REWARD_FAILURES_TO_STOP or now - self._reward_failing_since < (
            REWARD_FAILURE_WINDOW_S
        ):
            return None
        latest = next((s["last_reward_error"] for s in r_stats if s.get("last_reward_error")), "")
        return (
            f"task.reward {self.cfg.task.reward!r} failed on all {errors} responses it was "
            f"given and scored none in {now - self._reward_failing_since:.0f} s (latest: "
            f"{latest}); fix the function, or what it needs on the workers"
        )

    def _data_stats(self) -> tuple[dict, dict]:
        """The buffer's and prompt pool's stats; while a lost data module is rebuilt
        (:attr:`data_restartable`), the last ones, and each call advances the rebuild.
        Raises when the data module is lost and cannot be rebuilt."""
        a = self.actors
        timeout = self._core_timeout()
        if self._data_restart is None:
            try:
                if self._data_hung is not None:  # fenced: wait until the scheduler drops it
                    raise TimeoutError(f"the data module on {self._data_worker()} is hung")
                futures = [(x, x.stats()) for x in (a["buffer"], a["pool"])]
                self._last_data_stats = tuple(actor_result(x, f, timeout) for x, f in futures)
                self._data_suspect = None
                return self._last_data_stats
            except Exception as e:
                lost = self._lost_core()
                if not lost and is_lost(e) and self._last_data_stats is not None:
                    now = time.time()
                    self._data_suspect = self._data_suspect or now
                    hung = self._data_hung
                    if hung is not None:  # fenced: wait for its worker to go
                        self._fence_overdue(hung, now, e)
                        return self._last_data_stats
                    if isinstance(e, TimeoutError):  # silent for heartbeat_timeout_s
                        self._fence_data(timeout)
                        return self._last_data_stats
                    # (a call may fail a moment before the scheduler drops the worker)
                    if self.data_restartable and now - self._data_suspect < DATA_SUSPECT_S:
                        return self._last_data_stats
                if not self._begin_restart(lost, e):
                    return self._last_data_stats
        if self._data_restart.step():
            self._restarted(self._data_restart)
        return self._last_data_stats

    def _begin_restart(self, lost: dict[str, str], error: Exception) -> bool:
        """The core workers in ``lost`` are gone: begin restarting what they hosted
        within the run (``False``: not yet — a data-parallel rank is lost, and the rest of
        its group is being fenced), or raise ``error`` (what the call that found it
        raised) when that cannot be."""
        from pipelines.restart import CoreRestart, DataRestart, TrainerRestart

        if not lost:  # (every worker still there: the call's error is the run's)
            raise error
        if self.actors["trainer"] is None:  # (_trainer_finished: nothing left to train)
            raise ClusterError(
                f"lost the {' and '.join(lost)} (worker(s) {', '.join(lost.values())} gone) "
                "after the trainer had made every update (its final checkpoint: "
                f"{(self._last_t_stats or {}).get('checkpoint')}); the trajectory store "
                "holds what it had committed, the trajectories generated since are lost"
            ) from error
        hung = self._fenced.get(next(iter(lost.values()), ""))
        group = self._group()
        head = "trainer" if "trainer" in group else "trainer and data module"
        in_group = set(lost) <= set(group)
        if self.restartable and in_group and head not in lost:
            self._check_group()  # (a rank other than 0: fence the group, then restart it)
            return False
        if self.restartable and in_group and head == "trainer":
            r = self._restart = TrainerRestart(
                self, lost["trainer"], self._last_t_stats, exclude=set(group.values())
            )
        elif self.data_restartable and list(lost) == ["data module"] and self._last_m_stats:
            r = self._data_restart = DataRestart(self, lost["data module"], self._last_m_stats)
        elif self.restartable and in_group and self._last_m_stats:  # (head shares data's)
            r = self._data_restart = CoreRestart(
                self,
                lost[head],
                self._last_t_stats,
                self._last_m_stats,
                exclude=set(group.values()),
            )
        else:
            raise error
        if isinstance(r, TrainerRestart | CoreRestart):  # (the master went with rank 0)
            self._old_publications += self._master_publications
            self._master_publications = []
        self._check_group()  # (the rest of a data-parallel group goes too)
        if r is not self._restart:
            self._data_suspect = None
        self._group_suspect = None
        if hung is not None:
            r.record["hung"] = hung
        return True

    def _group(self) -> dict[str, str]:
        """Role -> worker of the trainer's processes: rank 0 (``trainer``, or ``trainer
        and data module``) and, data-parallel, ``trainer rank N``."""
        return {r: w for r, w in self.core_workers.items() if r.startswith("trainer")}

    def _check_group(self) -> None:
        """A data-parallel trainer whose group lost a rank (its worker gone, or fenced)
        cannot go on: every collective with the lost rank fails or hangs. Every other
        rank's worker is fenced too, so that the whole group restarts from the
        checkpoint (:class:`pipelines.restart.TrainerRestart`) once rank 0's is gone."""
        if self.cfg.trainer.ranks == 1 or not self.restartable:
            return
        group = self._group()
        workers = set(scheduler_workers(self.client))
        if all(w in workers and w not in self._fenced for w in group.values()):
            return
        for role, w in group.items():
            if w in workers and w not in self._fenced:
                self._fence(role, w, 0.0, why="its data-parallel group lost a rank")

    def _trainer_errors(self, t_stats: dict) -> list[dict]:
        """The trainer's errors (and its other ranks') that fail the run. Restartable and
        data-parallel, an error may be a collective that a lost rank broke: it fails
        the run only if no rank's worker is lost within :data:`DATA_SUSPECT_S` (a lost
        one restarts the group instead)."""
        from pipelines.restart import CoreRestart

        a = self.actors
        if self._restart is not None or isinstance(self._data_restart, CoreRestart):
            return []  # (no trainer runs)
        out = [t_stats] if t_stats["error"] else []
        for r in a["trainer_ranks"]:
            if r._address in self._fenced:
                continue
            try:
                rank = actor_result(r, r.stats(), min(5.0, self._core_timeout()))
            except Exception:  # noqa: BLE001 — lost or hung: _check_group fences the group
                continue
            if rank["error"]:
                out.append(rank)
        if out and self.restartable and self.cfg.trainer.ranks > 1:
            group = self._group().values()
            if any(w in self._fenced for w in group):
                return []  # (being restarted)
            now = time.time()
            self._group_suspect = self._group_suspect or now
            if now - self._group_suspect < DATA_SUSPECT_S:
                return []
        return out

    def _restarted(self, r) -> None:
        """A data-module rebuild (or a core restart) finished: the driver's books follow."""
        from pipelines.restart import CoreRestart

        self._data_restart = None
        self._n_repacks = self._n_faults = 0  # the new manager's rows start empty
        # The rebuilt buffer counts the whole store as its own, earlier starts' rows
        # included: its counters need no carry (a resumed run's) any more.
        for k in ("inserted", "consumed", "discarded", "evicted", "filtered"):
            self._carry["cluster"].pop(k, None)
        if not isinstance(r, CoreRestart):
            self.data_restarts.append(r.record)
            return
        self.core_restarts.append(r.record)
        if r.finished:
            self._trainer_finished(r)
        else:
            self._trainer_back(r, "trainer and data module", r.handle)

    def _core_timeout(self) -> float:
        """How long a call to the trainer or the data module may take: one silent for
        ``faults.heartbeat_timeout_s`` is hung (and no call may wait on it longer)."""
        return min(self.cfg.cluster.actor_timeout_s, self.cfg.faults.heartbeat_timeout_s)

    def _data_silent(self, error: Exception) -> None:
        """A call to the manager (the data module's) failed: if it was not answered
        within :meth:`_core_timeout` and its worker is still there, the data module is
        hung (the next poll of its stats then waits for the fenced worker to go)."""
        if isinstance(error, TimeoutError) and self._data_hung is None and not self._lost_core():
            self._data_suspect = self._data_suspect or time.time()
            self._fence_data(self._core_timeout())

    def _fence_data(self, silent_s: float) -> None:
        """The data module did not answer for ``faults.heartbeat_timeout_s``: hung. Its
        worker is restarted; once the scheduler has dropped it, it is lost and rebuilt
        like a killed one (with the trainer, when they share it)."""
        role = "data module" if "data module" in self.core_workers else "trainer and data module"
        self._fence(role, self.core_workers[role], silent_s)

    def _data_worker(self) -> str:
        return self.core_workers.get("data module") or self.core_workers["trainer and data module"]

    @property
    def _data_hung(self) -> dict | None:
        """The fence of the data module's worker, when it hung."""
        return self._fenced.get(self._data_worker())

    def _fence(self, role: str, worker: str, silent_s: float, why: str = "") -> dict:
        """``role`` on ``worker`` showed no progress for ``silent_s``: hung. Its worker is
        restarted (the nanny stops the process, or kills it), in the background, so that
        it never runs beside its own replacement; the scheduler then drops it and it is
        lost. Returns the record of the fence (``restart``: the nanny's outcome)."""
        from laminar.cluster import start_thread

        now = time.time()
        info = {"role": role, "time": now, "worker": worker, "silent_s": silent_s}
        self._fenced[worker] = info
        if why:
            info["why"] = why
            logger.warning("%s on %s: %s; restarting its worker", role, worker, why)
        else:
            logger.warning(
                "%s on %s showed no progress for %.1f s (faults.heartbeat_timeout_s=%g): "
                "hung; restarting its worker",
                role,
                worker,
                silent_s,
                self.cfg.faults.heartbeat_timeout_s,
            )

        def fence() -> None:
            from laminar.deploy import fence_workers

            t0 = time.time()
            try:
                # (restarted by its nanny; one without, a Slurm worker, removed: path A
                # then submits a new job in its place)
                out = fence_workers(self.client, [worker], timeout=10)
                info["restart"] = str(out.get(worker, out))
            except Exception as e:  # noqa: BLE001 — gone meanwhile: fenced all the same
                info["restart"] = repr(e)
            info["restart_s"] = time.time() - t0

        start_thread(fence, f"fence-{role.replace(' ', '-')}")
        return info

    def _fence_overdue(self, hung: dict, now: float, error: Exception) -> None:
        """Raise when a fenced worker is still the scheduler's :data:`FENCE_WAIT_S` after
        its fence (its restart failed: nothing can be restarted in its place)."""
        if now - hung["time"] > FENCE_WAIT_S:
            raise ClusterError(
                f"the {hung['role']} on {hung['worker']} hung and its worker did not go "
                f"within {FENCE_WAIT_S:g} s of its restart ({hung.get('restart')}); "
                f"{self.resume_hint()}"
            ) from error

    def _manager_stats(self) -> dict | None:
        """The manager's stats (``None``: there is none, it is being rebuilt, or the data
        module does not answer)."""
        manager = self.actors["manager"]
        if manager is None or self._data_restart is not None or self._data_suspect:
            return None
        if self._data_hung is not None:  # (fenced: its worker is going)
            return None
        try:
            self._last_m_stats = actor_result(manager, manager.stats(), self._core_timeout())
        except Exception as e:
            if not self.data_restartable:
                raise
            self._data_silent(e)
            return None  # lost with the data module just now: the next poll rebuilds it
        return self._last_m_stats

    def _trainer_stats(self) -> dict:
        """The trainer's stats; while a lost trainer restarts (:attr:`restartable`), what
        it last reported, and each call advances the restart. A trainer that does not
        answer, or whose training loop shows no progress, for
        ``faults.heartbeat_timeout_s`` is hung: its worker is restarted (:meth:`_fence`)
        and it is then lost. Raises when the trainer is lost and cannot be restarted."""
        from pipelines.restart import CoreRestart

        a, faults = self.actors, self.cfg.faults
        if isinstance(self._data_restart, CoreRestart):  # (no trainer runs meanwhile)
            return self._data_restart.stand_in
        if a["trainer"] is None and self._restart is None:  # (_trainer_finished)
            return self._last_t_stats
        if self._restart is None:
            worker = self._trainer_worker()
            try:
                if worker in self._fenced:  # hung: wait until the scheduler drops it
                    raise TimeoutError(f"the trainer on {worker} is hung (fenced)")
                t_stats = actor_result(a["trainer"], a["trainer"].stats(), self._core_timeout())
                silent = t_stats.get("silent_s")
                if silent is not None and silent > faults.heartbeat_timeout_s:
                    self._fence("trainer", worker, silent)
                    return self._t_stand_in()
                self._last_t_stats, self._trainer_suspect = t_stats, None
                if self.restartable and self.cfg.relay.audit_weights:
                    # Kept here, every poll: the fingerprints die with the trainer.
                    since = max(self._published_fps, default=-1)
                    try:
                        future = a["trainer"].get_fingerprints(since)
                        new = actor_result(a["trainer"], future, self._core_timeout())
                    except TimeoutError:  # slow, not silent (its stats answered): next poll
                        new = {}
                    self._published_fps.update(new)
                return self._last_t_stats
            except Exception as e:
                lost = self._lost_core()
                now = time.time()
                if not lost and is_lost(e) and not isinstance(e, TimeoutError):
                    # (a call may fail a moment before the scheduler drops the worker)
                    self._trainer_suspect = self._trainer_suspect or now
                    if self.restartable and now - self._trainer_suspect < DATA_SUSPECT_S:
                        return self._t_stand_in()
                if not lost and isinstance(e, TimeoutError):
                    fenced = self._fenced.get(worker)
                    if fenced is None:  # it did not answer for heartbeat_timeout_s
                        self._fence("trainer", worker, self._core_timeout())
                    else:
                        self._fence_overdue(fenced, now, e)
                    return self._t_stand_in()
                self._trainer_suspect = None
                if not self._begin_restart(lost, e):
                    return self._t_stand_in()
                if self._restart is None:  # (lost with the data module: CoreRestart)
                    return self._data_restart.stand_in
        handle = self._restart.step()
        if handle is None and not self._restart.finished:
            return self._restart.stand_in
        r, self._restart = self._restart, None
        self.trainer_restarts.append(r.record)
        if r.finished:
            self._trainer_finished(r)
        else:
            self._trainer_back(r, "trainer", handle)
        return self._last_t_stats

    def _trainer_finished(self, r) -> None:
        """A restart ``r`` found that the lost trainer had written the run's final
        checkpoint (:func:`pipelines.restart._final_checkpoint`): no trainer runs from here on.
        Its last stats stand, done at that checkpoint, so the run stops as completed;
        the updates it made after the driver last copied its history are not in the
        ``updates`` table (as for any lost trainer)."""
        a = self.actors
        a["trainer"], a["trainer_ranks"] = None, []
        self.core_workers = {
            role: w for role, w in self.core_workers.items() if not role.startswith("trainer")
        }
        if r.worker is not None:  # (a CoreRestart: the rebuilt data module's, alone now)
            self.core_workers["data module"] = r.worker
        if r.master is not None:  # (a CoreRestart: the manager made it the chain's head)
            self.tier.relays[0], self.tier.workers[0] = r.master, r.worker
        else:  # (lost with the trainer: its publications are in _old_publications)
            self._master_gone = True
        version = r.record["checkpoint_version"]
        self._last_t_stats = {
            **(self._last_t_stats or r.stand_in),
            "version": version,
            "steps": version,
            "done": True,
            "error": None,
            "silent_s": None,
            "checkpoint": r.record["checkpoint"],
        }

    def _trainer_back(self, r, head: str, handle) -> None:
        """A restart ``r`` has its new trainer (``handle``) running: its master relay, its
        workers (rank 0's as ``head``) and other ranks, and its history, in the driver's
        books."""
        a = self.actors
        a["trainer"], a["trainer_ranks"] = handle, r.ranks
        # The new trainer counts its wait from 0: the lost one's goes on in the total.
        before, last = self._trainer_wait
        self._trainer_wait = (before + last, 0.0)
        if self._last_t_stats is not None:  # (this poll's row: not the lost one's again)
            self._last_t_stats = {**self._last_t_stats, "wait_s": 0.0}
        self.tier.relays[0] = r.master  # (a["relays"] is this list)
        self.tier.workers[0] = r.worker  # (a replacement rollout's relay is chosen by host)
        self.core_workers = {
            role: w for role, w in self.core_workers.items() if not role.startswith("trainer")
        }
        self.core_workers[head] = r.worker
        for i, w in enumerate(r.group.rank_workers, start=1):
            self.core_workers[f"trainer rank {i}"] = w
        self._updates_before += self._n_updates
        self._n_updates = 0  # the new trainer's history starts empty
        try:
            future = handle.stats()
            self._last_t_stats = actor_result(handle, future, self.cfg.cluster.actor_timeout_s)
        except Exception as e:  # noqa: BLE001 — lost again at once: the next poll sees it
            logger.warning("the restarted trainer did not answer its first stats: %r", e)

    def _t_stand_in(self) -> dict:
        """The trainer's last stats, for a poll that cannot ask it (hung, or being lost)."""
        from pipelines.restart import trainer_stand_in

        return self._last_t_stats or trainer_stand_in(None, self.cfg.trainer.steps)

    def _trainer_worker(self) -> str | None:
        """Rank 0's worker (``None``: none runs, see :meth:`_trainer_finished`)."""
        return self.core_workers.get("trainer") or self.core_workers.get("trainer and data module")

    def _keep_publications(self) -> None:
        """The master's publication records, which only the trainer's process holds,
        copied here while it lives (every metrics flush): they outlive a restart."""
        a = self.actors
        try:
            self._master_publications = a["relays"][0].stats().result(timeout=5.0)["publications"]
        except Exception:  # noqa: BLE001 — lost meanwhile: the last copy stands
            pass

    def resume_hint(self) -> str:
        """How to continue this run once it has failed."""
        return resume_hint(self.run_dir)

    def _share_batches(self, m_stats: dict) -> None:
        """Tell the prompt pool how many rollouts generate, when that changes: a barrier
        schedule's batch is handed out in parts, one per live rollout."""
        # (a hung one too: fenced, it generates nothing, though not declared lost yet)
        live = len(self._rollouts_except({*m_stats["lost"], *m_stats["hung"]}))
        told = (self.actors["pool"], live)
        if told == self._pool_told or self.schedule.dispatch != "batches":
            return
        try:
            actor_result(self.actors["pool"], self.actors["pool"].rollouts_live(live), 5.0)
            self._pool_told = told
        except Exception as e:  # noqa: BLE001 — the data module's loss is found elsewhere
            logger.warning("the prompt pool was not told of %d live rollouts: %r", live, e)

    def _replace_lost(self, m_stats: dict) -> None:
        """Start a rollout in place of a lost one on a ``rollout`` worker that hosts none
        (its worker restarted by the nanny, or a new one), one at a time, without
        blocking the poll: created on one poll, started and handed to the manager on a
        later one. The new rollout takes the next id (``r<N>``)."""
        cfg, client, a = self.cfg, self.client, self.actors
        if not (cfg.faults.recover and cfg.faults.replace) or self._data_restart is not None:
            return
        if self._joining is not None:
            rid, worker, replaces, relay_id, future = self._joining
            if not future.done():
                # (its creating task, pinned to a worker lost meanwhile, would never end:
                # nothing would be replaced for the rest of the run)
                try:
                    gone = worker not in scheduler_workers(client, timeout=5.0)
                except Exception:  # noqa: BLE001 — no answer: the next poll asks again
                    gone = False
                if gone:
                    logger.warning("rollout %s: its worker %s was lost as it started", rid, worker)
                    self._joining = None
                return
            self._joining = None
            try:
                handle = bind_actor(client, RolloutReplica, worker, future)
                handle.start().result(timeout=cfg.cluster.actor_timeout_s)
            except Exception as e:  # noqa: BLE001 — that worker went too: try again later
                logger.warning("rollout %s could not start on %s: %s", rid, worker, e)
                return
            a["rollouts"].append(handle)
            self.rollout_workers[rid] = worker
            m = a["manager"]
            try:
                call = m.add_rollout(rid, handle, worker, replaces, relay_id)
                actor_result(m, call, self._core_timeout())
            except Exception as e:
                if not self.data_restartable:
                    raise
                self._data_silent(e)  # (hung or lost: the rebuilt manager takes it over)
            return
        waiting = [r for r in m_stats["lost"] if r not in m_stats["replacements"]]
        if not waiting:
            return
        hosting = {w for r, w in self.rollout_workers.items() if r not in m_stats["lost"]}
        free = [w for w in workers_with(client, "rollout") if w not in hosting]
        if not free:
            return
        rid, worker = f"r{len(a['rollouts'])}", free[0]
        tier = self.tier
        relay_id = tier.ids[tier.local_relay(worker, self._taken, lost=m_stats["relays_lost"])]
        self.rollout_relays[rid] = relay_id
        future = start_actor(
            client,
            RolloutReplica,
            rid,
            cfg,
            self.policy_dir,
            a["pool"],
            a["buffer"],
            tier.handle(relay_id),
            a["partial"],
            str(self.run_dir / "checkpoints"),
            self.schedule,
            worker=worker,
            resource="rollout",
        )
        self._joining = (rid, worker, waiting[0], relay_id, future)

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

    def _fail_on_lost_core(self, error: Exception) -> bool:
        """The driver's loop failed on ``error``: if a call to the trainer or the data
        module failed because its worker is gone, stop what still runs and raise a
        :class:`ClusterError` that says what was lost and how to continue (docs/faults.md).
        True if ``error`` is such a failure, said already (what still ran is stopped);
        False if every core actor is still there."""
        if isinstance(error, ClusterError):  # said already (a restart that could not be)
            self._abort()
            return True
        lost = self._lost_core()
        if not lost:
            return False
        self._abort()
        each = []  # (several at once: each named, so that the user sees what is left)
        for role, worker in lost.items():
            why = type(error).__name__
            if worker in self._fenced:
                hung = self._fenced[worker]
                why = f"hung, no progress for {hung['silent_s']:.0f} s, and restarted"
            each.append(f"the {role} (worker {worker} is gone: {why})")
        raise ClusterError(
            f"lost {' and '.join(each)}; the run cannot continue "
            f"{self._why_not_restarted()}; {self.resume_hint()} (docs/faults.md)"
        ) from error

    def _wind_down(self, error: Exception, t_start: float) -> None:
        """The driver failed with every core actor still there (a full disk under
        ``metrics.zarr``, a bug): stop the run as :meth:`shutdown` does — the rollouts,
        then the trainer with its final checkpoint, then the buffer, which flushes the
        store — so that nothing generates on for a run that has ended and nothing it
        generated is lost. If that fails too, abort what still runs. The caller then
        raises ``error``."""
        logger.error("the run failed (%r): stopping its actors in order", error)
        try:
            self.shutdown(f"failed: {error!r}", t_start)
        except Exception:  # noqa: BLE001 — the original error is the one raised
            logger.exception("stopping the failed run in order failed too: aborting it")
            self._abort()
        logger.error("the run failed; %s", self.resume_hint())

    def _why_not_restarted(self) -> str:
        """Why a lost trainer or data module fails this run (docs/faults.md)."""
        cfg = self.cfg
        if not self._laminar:
            return f"(schedule {self.schedule.name!r} does not restart them within the run)"
        if not (cfg.faults.restart_trainer and cfg.faults.restart_data):
            return "(faults.restart_trainer or faults.restart_data is off)"
        if not cfg.faults.recover:
            return "(faults.recover is off: no partial-response pool to rebuild from)"
        return (
            "(it was lost as the run stopped, or the trainer and the data module on two "
            "workers were lost at once)"
        )

    def _lost_core(self) -> dict[str, str]:
        """Role -> worker of the core actors whose worker the scheduler no longer has."""
        workers = set(scheduler_workers(self.client))
        return {role: w for role, w in self.core_workers.items() if w not in workers}

    def _abort(self) -> None:
        """Best effort: stop the manager and the rollouts that still run, so no worker
        generates for a run that has ended, then close the relays they pulled from."""
        a = self.actors
        workers = set(scheduler_workers(self.client))  # (a call to a lost one never answers)
        stop = [r for r in [a["manager"], *self._live_rollouts()] if r is not None]
        _answers([lambda r=r: r.stop(timeout=5.0) for r in stop if r._address in workers], 15.0)
        # the relays: not waited on, a lost one never answers
        _send([lambda r=r: r.close() for r in a["relays"]])
        # The store and the recovery log, where their worker lives on (the trainer was
        # lost, or the stop failed): what they hold unwritten is kept for the resume
        # (the buffer first: the log then keeps only what the store lacks).
        if self._data_restart is not None or self._data_hung is not None:
            return
        if self._data_worker() not in workers:
            return
        wait = min(15.0, self.cfg.cluster.actor_timeout_s)
        for name in ("buffer", "partial"):
            if a[name] is not None:
                try:
                    actor_result(a[name], a[name].close(), wait)
                except Exception as e:  # noqa: BLE001 — lost or hung meanwhile: best effort
                    logger.warning("the %s could not be closed: %r", name, e)

    def _live_rollouts(self) -> list:
        """The rollouts the manager has not declared lost."""
        a = self.actors
        lost = {}
        if a["manager"] is not None:
            try:
                if self._data_restart is not None:
                    raise RuntimeError("the manager is being rebuilt")
                lost = a["manager"].get_lost().result(timeout=5.0)
            except Exception:  # noqa: BLE001 — the manager (data worker) is gone itself
                lost = (self._last_m_stats or {}).get("lost", {})
        return self._rollouts_except(lost)

    def _rollouts_except(self, gone) -> list:
        """The rollouts whose ids are not in ``gone``. A rollout's id is ``r<i>``, ``i``
        its place in ``actors["rollouts"]`` (a replacement is appended with the next)."""
        return [r for i, r in enumerate(self.actors["rollouts"]) if f"r{i}" not in gone]

    def _rollout_stats(self) -> list[dict]:
        """Stats of every live rollout that answers within :data:`ROLLOUT_STATS_WAIT_S`
        (one lost but not yet detected does not hold the run up). A rollout whose last
        call is still out is not called again: that call's answer is read when it comes,
        and until then the rollout is left out, as a lost one is."""
        out, waiting = [], []
        pending, self._r_pending = self._r_pending, {}
        for r in self._live_rollouts():
            f = pending.get(r.key)
            if f is None:
                try:
                    f = r.stats()
                except Exception:  # noqa: BLE001 — its worker is known lost
                    continue
            elif not f.done():
                self._r_pending[r.key] = f  # still silent: no new call, no wait
                continue
            waiting.append((r.key, f))
        deadline = time.monotonic() + ROLLOUT_STATS_WAIT_S
        for key, f in waiting:
            try:
                # (not 0 past the deadline: distributed then times out an answer already in)
                out.append(f.result(timeout=max(0.1, deadline - time.monotonic())))
            except TimeoutError:
                self._r_pending[key] = f
            except Exception:  # noqa: BLE001 — lost (the manager recovers its work)
                continue
        return out

    def shutdown(self, reason: str, t_start: float) -> dict:
        """Stop rollouts (their rewarded trajectories still reach the buffer), then the
        trainer (final checkpoint), then close the buffer (flushes the store)."""
        a = self.actors
        timeout = self.cfg.cluster.actor_timeout_s
        # No moves while rollouts stop: the manager goes first.
        m_stats = self._stop_manager()
        # (a rollout's stop waits for its rewards still out: actor_timeout_s, and more)
        stopping = _send([lambda r=r: r.stop() for r in self._live_rollouts()])
        # The idle ones wait in the prompt pool's long poll: it returns at once now.
        # (Not waited for long: the stops are what the run waits for.)
        _answers([a["pool"].end_waits], timeout=1.0)
        r_stats = _results(stopping, timeout + 60.0)
        # Every call below waits at most its timeout, and a second once its worker is
        # gone (a call in flight to a lost actor otherwise never returns): a core actor
        # lost or hung as the run stops fails the stop, and run() stops what still runs.
        # (the trainer's stop waits up to 60 s for its update, then writes its checkpoint)
        if a["trainer"] is None:  # (lost after its final checkpoint: _trainer_finished)
            t_stats = self._last_t_stats
        else:
            t_stats = _stopping(a["trainer"], "stop", timeout + 60.0)
        while not t_stats["done"] and t_stats.get("silent_s") is not None:
            # A last update or checkpoint longer than that (a big model): waited for while
            # it shows progress, or the data position would go into an older checkpoint
            # and the buffer close under its last commit.
            if t_stats["silent_s"] > self.cfg.faults.heartbeat_timeout_s:
                raise ClusterError(
                    f"the trainer showed no progress for {t_stats['silent_s']:.0f} s as the "
                    "run stopped (faults.heartbeat_timeout_s): hung in its last update or "
                    "checkpoint; continue the run from its newest checkpoint with "
                    f"`laminar run --resume {self.run_dir}`"
                )
            time.sleep(self.cfg.metrics.poll_s)
            t_stats = _stopping(a["trainer"], "stats", timeout)
        t_stats["ranks_stats"] = [_stopping(r, "stats", timeout) for r in a["trainer_ranks"]]
        p_stats = _stopping(a["pool"], "stats", timeout)  # rollouts stopped: dispatch is final
        record_data_position(t_stats["checkpoint"], t_stats["version"], p_stats)
        relay = self._relay_summary(r_stats)
        _answers([lambda r=r: r.close() for r in a["relays"]])  # (a lost one: nothing to stop)
        b_stats = _stopping(a["buffer"], "close", timeout)  # (its last store write)
        wall = time.time() - t_start
        # (after the buffer's last commit: the log keeps only what the store lacks)
        partial = _stopping(a["partial"], "close", timeout) if a["partial"] is not None else None
        # The driver's own tables last: if writing them fails, the store is whole.
        self.metrics.append("publications", relay.pop("publications"))
        self._flush_metrics()
        return {
            "faults": faults_summary(
                m_stats, partial, self.trainer_restarts, self.data_restarts, self.core_restarts
            ),
            "repack": m_stats if self.cfg.repack is not None else None,
            "relay": relay,
            "reason": reason,
            "resumed": self.resume.summary() if self.resume is not None else None,
            "earlier_segments": self._earlier_segments,
            "wall_s": wall,
            "trainer": t_stats,
            "buffer": b_stats,
            "pool": p_stats,
            "rollouts": r_stats,
            "updates": self._updates_before + self._n_updates,
        }

    def _settle(self) -> None:
        """Wait for a restart in progress (a lost trainer, or data module) to finish."""
        while self._restart is not None:  # stopped while a lost trainer restarts
            self._trainer_stats()
            time.sleep(self.cfg.metrics.poll_s)
        while self._data_restart is not None:  # ... or a lost data module is rebuilt
            self._data_stats()
            time.sleep(self.cfg.metrics.poll_s)

    def _stop_manager(self) -> dict | None:
        """Stop the rollout manager (its stats), once any restart in progress is done. A
        trainer or data module found lost by this stop is first restarted within the
        run where it can be (so that the stop still ends with a final checkpoint and a
        flushed store); else the stop fails (run() stops what still runs)."""
        for attempt in (0, 1):
            self._settle()
            m = self.actors["manager"]
            if m is None:
                return None
            try:
                return _stopping(m, "stop", self.cfg.cluster.actor_timeout_s)
            except Exception as e:
                lost = self._lost_core()
                if attempt or not lost or not self._begin_restart(lost, e):
                    raise
        raise AssertionError("unreachable")

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


def record_data_position(checkpoint: str | None, version: int, position: dict) -> bool:
    """Write where the prompt order stood at the stop (``position``: the pool's stats)
    into the final ``checkpoint``, for ``trainer.resume_from``; returns whether it did.

    Only into the checkpoint of the trainer's last ``version``: when that one was not
    written (the store could not commit), the newest is an older one, whose weights
    never trained the prompts dispatched since, and a run from it would skip them; its
    own position (written with it) stays. Written whole or not at all: a crash
    mid-write leaves the old file, never a truncated one that fails a later run."""
    from laminar.files import replace_text
    from laminar.learner import CheckpointError, checkpoint_version

    if not checkpoint:
        return False
    try:
        held = checkpoint_version(checkpoint)
    except CheckpointError as e:  # (the stop goes on: a resume's checks will say so)
        logger.warning("the data position is not recorded: %s", e)
        return False
    if held != version:
        return False
    replace_text(Path(checkpoint, DATA_STATE), json.dumps(position, indent=2))
    return True


def resume_hint(run_dir: Path) -> str:
    """How to continue the run in ``run_dir`` once it has failed."""
    saved = newest_checkpoint(run_dir)
    if saved is None:
        return (
            "it has no checkpoint yet (one is written when a run ends and every "
            "trainer.checkpoint_every versions): start it again"
        )
    return (
        f"continue it from its last checkpoint ({saved.name}) with `laminar run --resume {run_dir}`"
    )


def start_data_module(
    client, cfg: RunConfig, policy_dir: str, run_dir: Path, spec, worker: str, **plans
) -> tuple:
    """The prompt pool, partial-response pool (``None`` without ``faults.recover``) and
    experience buffer of a run, on ``worker``. ``plans``: ``resume`` (a run resumed in
    place: :class:`storage.resume.ResumePlan`, for the pool and the buffer), or
    ``order`` (the pool's) and ``rebuild`` (the buffer's) for a data module rebuilt
    within the run (pipelines/restart.py).

    Raises a :class:`ClusterError` when ``worker`` sends the scheduler nothing for
    ``faults.data_restart_timeout_s`` while they are created: a worker that hangs
    (stopped) stays on the scheduler's books for minutes, and its creating tasks would be
    waited on for ever. A live one is waited for however long they take (a prompt file
    of millions to tokenize, a large store to read back)."""
    resume = plans.get("resume")
    order = plans.get("order", resume)  # (the pool's: both re-issue missing samples)
    limit = cfg.faults.data_restart_timeout_s

    def create(cls, *args):
        future = start_actor(client, cls, *args, worker=worker, resource="data")
        try:
            return bind_actor(client, cls, worker, future, silent_s=limit)
        except ActorHung:
            raise ClusterError(
                f"the data module's {cls.__name__} was not created on {worker}: that worker "
                f"sent the scheduler nothing for faults.data_restart_timeout_s={limit:g} s "
                "and may hang (look at its log, or restart it); "
                f"{resume_hint(run_dir)}"
            ) from None

    pool = create(PromptPool, cfg, policy_dir, order, spec)
    partial = None
    if cfg.faults.recover:
        partial = create(  # (it keeps the groups the pool re-issues in its log)
            PartialResponsePool,
            cfg.relay.timeout_s,
            str(run_dir),
            cfg.faults.log_interval_s,
            sorted(order.reissue) if order is not None else [],
        )
    buffer = create(
        ExperienceBuffer,
        str(run_dir),
        pool,
        cfg.buffer,
        partial,
        resume,
        spec.name,
        plans.get("rebuild"),
    )
    return pool, partial, buffer


def _stopping(actor, method: str, timeout: float):
    """``actor.method()``'s answer at the run's stop, within ``timeout``
    (:func:`~laminar.cluster.actor_result`: within a second once its worker is gone). One
    that does not answer in time raises a :class:`ClusterError` that says which."""
    try:
        return actor_result(actor, getattr(actor, method)(), timeout)
    except TimeoutError as e:
        raise ClusterError(
            f"{method}() of the actor on {actor._address} did not answer within "
            f"{timeout:g} s as the run stopped (hung?)"
        ) from e


def _send(calls: list) -> list:
    """Call every actor method at once; the futures of the calls made (one to an actor
    whose worker is known lost raises at once: skipped)."""
    futures = []
    for call in calls:
        try:
            futures.append(call())
        except Exception:  # noqa: BLE001 — its worker is known lost
            continue
    return futures


def _answers(calls: list, timeout: float = 5.0) -> list:
    """Call every actor method at once; the results of those that answer within
    ``timeout`` (one wait for them all: calls that never answer do not add up). A call
    to an actor whose worker is lost raises at once or never returns: skipped (the
    manager detects the loss and recovers its work)."""
    return _results(_send(calls), timeout)


def _results(futures: list, timeout: float) -> list:
    """The results of those of ``futures`` (:func:`_send`'s) that come within
    ``timeout``, one wait for them all; the rest are skipped (:func:`_answers`)."""
    out = []
    deadline = time.monotonic() + timeout
    for f in futures:
        try:
            # (not 0 past the deadline: distributed then times out an answer already in)
            out.append(f.result(timeout=max(0.1, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 — lost or stalled
            continue
    return out


def schedule_class(name: str) -> type[Schedule]:
    """The driver of ``pipeline.schedule`` ``name``."""
    from pipelines.laminar import LaminarSchedule
    from pipelines.one_step import OneStepSchedule
    from pipelines.partial_rollout import PartialRolloutSchedule
    from pipelines.stream import StreamSchedule
    from pipelines.sync import SyncSchedule

    classes = (
        LaminarSchedule,
        SyncSchedule,
        OneStepSchedule,
        StreamSchedule,
        PartialRolloutSchedule,
    )
    return {c.name: c for c in classes}[name]
