"""What every schedule's driver does: wire the actors of one run on a Dask client,
drive them to the end, record the run's metrics and summary.

The five schedules (``pipelines/laminar.py``, ``sync.py``, ``one_step.py``, ``stream.py``,
``partial_rollout.py``) are subclasses of :class:`Schedule` that say what they keep
global as a :class:`~laminar.schedule.ScheduleSpec`; every actor takes the spec and
follows it. ``pipeline.schedule`` in the config picks one (:func:`schedule_class`).

Here: the wiring (``Schedule.setup``), the poll loop (``run``) and the stop
(``shutdown``). What a poll asks and judges (``pipelines/driver_polls.py``), what a
fault does (``pipelines/driver_faults.py``) and what is recorded
(``pipelines/driver_metrics.py``) are mixins :class:`Schedule` inherits; the data
module's start and the calls to many actors at once are ``pipelines/data_module.py``'s
and ``pipelines/driver_calls.py``'s. ``laminar run CONFIG`` runs a schedule.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from laminar.cluster import (
    actor_result,
    bind_actor,
    place,
    start_actor,
    submit_actor,
    workers_with,
)
from laminar.config import RunConfig
from laminar.deploy_walltime import WalltimeWatch
from laminar.errors import ClusterError, RunStopped
from laminar.learner import checkpoint_restarts
from laminar.manager import RolloutManager
from laminar.prompt_pool import load_prompts
from laminar.relay_tier import build_tier
from laminar.rollout import RolloutReplica
from laminar.schedule import ScheduleSpec
from laminar.trainer import Trainer, TrainerRank, rendezvous
from pipelines.data_module import record_data_position, resume_hint, start_data_module
from pipelines.driver_calls import _answers, _results, _send, _stopping
from pipelines.driver_faults import FaultHandling, stuck_workers
from pipelines.driver_metrics import MetricsRecording
from pipelines.driver_polls import RewardFailures, StatsPolling
from pipelines.summary import faults_summary, rollouts_seen, updates_made
from storage.audit import WALLTIME_REASON

logger = logging.getLogger("laminar")

METRICS_FLUSH_S = 5.0


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


class Schedule(StatsPolling, FaultHandling, MetricsRecording):
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
        # The Slurm jobs it cannot lose (core_workers, read at each look: set at placement,
        # moved by restarts): checked in setup, watched from run() on
        self._walltime = WalltimeWatch(
            client, lambda: dict(self.core_workers), cfg.cluster.stop_before_walltime_s
        )
        # this start's segment of the run's metrics, and those before it (_origin)
        self._segment, self._earlier_segments = 0, []
        self._pauses: list[tuple[float, float]] = []  # a resumed run's stops (epoch s)
        self._earlier_faults: list[dict] = []  # their losses (summary.earlier_faults)
        # a resumed run's counters at its last stop (storage.metrics.counters_at_end):
        # its cumulative columns go on from them
        self._carry: dict[str, dict] = {"cluster": {}, "rollouts": {}}
        # each rollout's response tokens as last read: one lost, replaced or slow to
        # answer still counts in the cluster's total
        self._tokens_by_rollout: dict[str, float] = {}
        # each rollout's last stats: what one lost with faults.recover off held
        self._last_r_stats: dict[str, dict] = {}
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
                raise RunStopped(stopped_in_setup(self.run_dir, name))
            progress({"phase": name, **more})

        # (a worker started with two roles' resources, on a cluster of one's own, hosts
        # the second role only where too few workers have it alone: a rollout's engine
        # and the trainer in one process contend for its device and threads)
        generating = workers_with(client, "rollout")
        data_w = place(client, "data", 1, avoid=generating)[0]
        trainer_ws = place(client, "trainer", cfg.trainer.ranks, avoid=generating)
        if data_w in workers_with(client, "trainer"):  # it shares rank 0's (role_workers)
            trainer_ws = [data_w, *[w for w in trainer_ws if w != data_w]][: len(trainer_ws)]
        trainer_w = trainer_ws[0]
        rollout_ws = place(client, "rollout", cfg.rollout.replicas, avoid={data_w, *trainer_ws})
        _warn_shared_workers(trainer_ws, data_w, rollout_ws)
        # Where the actors that a run cannot go on without live (loss is reported by role).
        if trainer_w == data_w:
            self.core_workers = {"trainer and data module": trainer_w}
        else:
            self.core_workers = {"trainer": trainer_w, "data module": data_w}
        self.core_workers |= {f"trainer rank {r}": w for r, w in enumerate(trainer_ws[1:], 1)}
        # (refused here when its jobs are already within the walltime margin: it would
        # stop at its first poll)
        self._walltime.check_start()
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
        if self.resume is not None and cfg.trainer.resume_from is not None:
            # The trainer restarts before the resume, which its checkpoint records: the
            # resumed buffer counts staleness along them, and this driver's restarts
            # come after them (pipelines.restart_steps._lineage; storage.resume.ResumePlan)
            self.resume.restarts = checkpoint_restarts(cfg.trainer.resume_from)
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
        # Always, repack and recovery or not: its loss detection is what fails a run that
        # loses a rollout with faults.recover off (it went on, quietly, on fewer rollouts).
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
        # (as when the manager was started only for these: recovery off and no repack,
        # a lost trainer fails the run; what a restart without them needs is untested)
        managed = cfg.repack is not None or partial is not None
        self.restartable = laminar and managed and trainer_ok and (data_ok or not shared)
        self.data_restartable = laminar and managed and data_ok and (trainer_ok or not shared)
        self.trainer_restarts: list[dict] = []
        self._restart = None  # a TrainerRestart in progress
        self.data_restarts: list[dict] = []
        self.core_restarts: list[dict] = []  # both at once (pipelines.restart.CoreRestart)
        self._data_restart = None  # a DataRestart or CoreRestart in progress
        # Workers restarted because what they host hung (worker -> when, why, outcome).
        self._fenced: dict[str, dict] = {}
        # A poll's call -> how many polls in a row it failed with its actor's own error
        self._own_errors: dict[str, int] = {}
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

    def _stop_started(self) -> None:
        """Stop what :meth:`run` started, before its loop: its actors are released when
        the run ends, but a released actor's threads go on (nothing may train or
        generate on)."""
        self._abort()  # (the trainer too; its other ranks leave with it)

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
            self._stop_started()
            raise
        self._n_repacks = self._n_faults = self._n_pubs = 0
        self._rows: dict[str, list[dict]] = {"cluster": [], "rollouts": []}
        self._n_updates = 0
        # (why the run stops for its reward's failures: never scored, or past the share)
        self._reward_failures = RewardFailures(
            self.cfg.task.reward,
            self.cfg.task.reward_max_failure_share,
            wait_s=self.cfg.cluster.actor_timeout_s,  # (a rollout's stop waits that long)
        )
        t_start = last_t = last_flush = time.time()
        self.metrics = None
        try:  # (the metrics store, and a resumed run's earlier starts read from it)
            self.metrics = MetricsWriter(
                self.run_dir,
                tensorboard=self.cfg.metrics.tensorboard,
                # (the TensorBoard curves stepped by version go on from its checkpoint)
                resumed_from=None if self.resume is None else self.resume.version,
            )
            t_origin = self._origin(t_start)
        except BaseException:
            logger.exception("the run's records could not be opened: stopping its actors")
            with contextlib.suppress(Exception):  # (the error that stopped it stands)
                self._stop_started()
            if self.metrics is not None:
                with contextlib.suppress(Exception):
                    self.metrics.close()
            raise
        last_tokens = 0
        reason = "completed"
        walltime = self._walltime.start()
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
                    self._last_r_stats[s["rollout_id"]] = s
                tokens = sum(self._tokens_by_rollout.values())
                gen_tok_s = (tokens - last_tokens) / max(now - last_t, 1e-9)
                last = t_stats["last"] or {}
                self._record(now - t_origin, now, t_stats, b_stats, p_stats, r_stats, tokens)
                progress(
                    {
                        "phase": "training",
                        "elapsed_s": now - t_start,
                        # the updates made of the trainer.steps asked for, as in
                        # summary.json: a trainer restarted within the run skips the
                        # lost one's version numbers, so the version may pass steps
                        # (it ends at last_version)
                        "updates": updates_made(t_stats, self.cfg.trainer.steps),
                        "steps": self.cfg.trainer.steps,
                        "version": t_stats["version"],
                        "last_version": t_stats["steps"],
                        "reward": last.get("reward_mean"),
                        "s_train_mean": last.get("s_train_mean"),
                        "gen_tok_s": gen_tok_s,
                        "buffer_depth": b_stats["depth"],
                        # (the run's, as in the cluster table: a resumed run's earlier
                        # starts' included, here and in what left untrained)
                        "trajectories": b_stats["inserted"]
                        + int(self._carry["cluster"].get("inserted", 0)),
                        **{
                            k: b_stats[k] + int(self._carry["cluster"].get(k, 0))
                            for k in ("discarded", "evicted", "filtered")
                        },
                        "rollout_versions": [s["version"] for s in r_stats],
                        # (None: no Slurm job of the run's core has a limit)
                        "walltime_stop_in_s": walltime.stop_in(),
                    }
                )
                last_t, last_tokens = now, tokens
                if now - last_flush > METRICS_FLUSH_S:
                    self._flush_metrics()
                    last_flush = now
                failed = [s for s in r_stats if s["error"]] + self._trainer_errors(t_stats)
                m = self._manager_stats()
                self._copy_rows(manager_answered=m is not None)
                if m is not None and m["error"]:
                    failed.append(m)
                elif m is not None:
                    self._replace_lost(m)
                    self._share_batches(m)
                if failed:
                    reason = "failed: " + failed[0]["error"].strip().splitlines()[-1]
                    break
                if unscorable := self._reward_failures.check(r_stats, time.time()):
                    reason = "failed: " + unscorable
                    break
                if t_stats["done"] and not t_stats["error"]:  # (an error: a rank lost)
                    break
                if should_stop():
                    reason = "stopped"
                    break
                if (why := walltime.due()) is not None:
                    logger.warning("stopping the run in order: %s", why)
                    reason = f"{WALLTIME_REASON}: {why}"
                    break
        except Exception as e:
            try:  # a lost trainer or data module: say so, stop the rest
                if not self._fail_on_lost_core(e):
                    self._wind_down(e, t_start)  # anything else: stop the run in order
            finally:
                try:  # the rows copied since the last flush (up to METRICS_FLUSH_S), kept
                    self._write_rows(final=True)
                except Exception as w:  # noqa: BLE001 — the run's own error comes first
                    logger.warning("metrics rows not written: %r", w)
                self.metrics.close()
            raise
        finally:
            walltime.close()
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
                    self._write_rows(final=True)
                except Exception as w:  # noqa: BLE001 — the run's own error comes first
                    logger.warning("metrics rows not written: %r", w)
            raise
        finally:
            self.metrics.close()

    def resume_hint(self) -> str:
        """How to continue this run once it has failed."""
        return resume_hint(self.run_dir)

    def start_records(self) -> dict:
        """What this start's ``summary.json`` records of its restarts within the run and
        of the resume it began from, for a driver that failed
        (:func:`pipelines.summary.summarize_failed`): the restarts it finished (one still
        in progress published nothing of its own), as an orderly stop records them."""
        return {
            "trainer_restarts": self.trainer_restarts,
            "data_restarts": self.data_restarts,
            "core_restarts": self.core_restarts,
            "resumed": self.resume.summary() if self.resume is not None else None,
        }

    def shutdown(self, reason: str, t_start: float) -> dict:
        """Stop rollouts (their rewarded trajectories still reach the buffer), then the
        trainer (final checkpoint), then close the buffer (flushes the store)."""
        a = self.actors
        timeout = self.cfg.cluster.actor_timeout_s
        # No moves while rollouts stop: the manager goes first.
        m_stats = self._stop_manager()
        reason = final_reason(reason, m_stats)
        for w in sorted(stuck_workers(m_stats)):
            logger.warning(
                "worker %s hung and did not go when restarted: it is no longer used by this "
                "run, but its process may still run; stop it yourself (docs/faults.md)",
                w,
            )
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
                    "checkpoint; " + self.resume_hint()
                )
            time.sleep(self.cfg.metrics.poll_s)
            t_stats = _stopping(a["trainer"], "stats", timeout)
        if reason.startswith("stopped") and updates_made(t_stats, self.cfg.trainer.steps) >= (
            self.cfg.trainer.steps
        ):
            # (the stop, Ctrl-C or the walltime's, came as the last update was made, or
            # the trainer finished it in its stop: the run reached trainer.steps, and a
            # resume would have nothing left to train; a walltime loop's exit 124 would
            # run one that says so, exit 2)
            reason = "completed"
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
        self._master_publications = relay.pop("publications")[len(self._old_publications) :]
        self._copy_rows(manager_answered=True, final=True)
        self._write_rows(final=True)
        return {
            "faults": faults_summary(
                m_stats,
                partial,
                self.trainer_restarts,
                self.data_restarts,
                self.core_restarts,
                earlier=self._earlier_faults,
                unrecovered=self._unrecovered(m_stats),
            ),
            "repack": m_stats if self.cfg.repack is not None else None,
            "relay": relay,
            "reason": reason,
            "resumed": self.resume.summary() if self.resume is not None else None,
            "earlier_segments": self._earlier_segments,
            "wall_s": wall,
            "trainer": t_stats,
            "trainer_wait_s": self._trainer_wait_run(t_stats["wait_s"]),  # (every start's)
            "buffer": b_stats,
            "pool": p_stats,
            "rollouts": r_stats,
            # (every rollout of this start at its last answer: those lost too, whose
            # reward failures the summary counts)
            "rollouts_seen": rollouts_seen(self._last_r_stats, r_stats),
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


def _warn_shared_workers(trainer_ws: list[str], data_w: str, rollout_ws: list[str]) -> None:
    """Warn of each rollout placed on a trainer rank's or the data module's worker (too
    few workers advertise ``rollout`` alone)."""
    cores = {w: f"trainer rank {r}" for r, w in reversed(list(enumerate(trainer_ws)))}
    cores.setdefault(data_w, "data module")
    for r, w in enumerate(rollout_ws):
        if w in cores:
            logger.warning(
                "rollout r%d shares worker %s with the %s (a worker advertising both roles' "
                "resources, and too few with 'rollout' alone): its engine and the %s contend "
                "for one process's device and threads, and a loss of it loses both; start "
                "rollout workers of their own (`dask worker ADDRESS --resources rollout=1`: "
                "docs/deploy.md)",
                r,
                w,
                cores[w],
                cores[w],
            )


def stopped_in_setup(run_dir: Path, phase: str) -> str:
    """What a run stopped during its setup (before ``phase``) says: nothing was
    generated, and the command that starts it again. A new run's directory takes the
    same command (its empty stores are moved aside: pipelines.run_dir._set_aside_failed_start);
    a resume's is resumed again."""
    import shlex

    from laminar.learner import newest_checkpoint

    said = f"run {str(run_dir)!r} was stopped during its setup (before {phase!r}): nothing was "
    if newest_checkpoint(run_dir) is not None:  # (a resume in place, or its own checkpoint)
        return said + f"generated; {resume_hint(run_dir)} when ready"
    config = Path(run_dir) / "config.yaml"
    return said + (
        f"generated; start it again when ready with `laminar run {shlex.quote(str(config))}` "
        f"(or pipelines.submit({str(config)!r}, client)): what this start left in its "
        "directory is moved aside"
    )


def final_reason(reason: str, m_stats: dict | None) -> str:
    """The run's reason once its manager has stopped (``m_stats``: its last stats). Its
    last round, after the driver's last poll of it, may have found a fault it fails on —
    a rollout lost with ``faults.recover`` off — or it failed: the run fails as it would
    have at that poll (the same reason), and is stopped in order all the same.

    >>> final_reason("completed", {"error": "rollout r1 (worker w gone) was lost ..."})
    'failed: rollout r1 (worker w gone) was lost ...'
    >>> final_reason("failed: the reward never scored", {"error": "rollout r1 ..."})
    'failed: the reward never scored'
    >>> final_reason("stopped", {"error": None}), final_reason("completed", None)
    ('stopped', 'completed')
    """
    if m_stats is None or not m_stats.get("error") or reason.startswith("failed"):
        return reason
    failed = "failed: " + m_stats["error"].strip().splitlines()[-1]
    logger.error("the rollout manager failed as the run stopped (was %r): %s", reason, failed)
    return failed


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
