"""The steps the restarts share (:mod:`pipelines.restart`): where one starts from and
what it records.

Where a restart starts from: the newest checkpoint, the version numbers its trainer skips
and the updates it owes (:func:`_steps`; :func:`_final_checkpoint`: none, the lost
trainer had finished); the workers it picks (:func:`_pick_workers`) and the new master
relay it starts on rank 0's (:func:`_new_master`); what it records and says once its
trainer runs or is not needed (:func:`_running`, :func:`_finish`); and what it does when
a worker it picked goes too (:func:`_start_again`, :func:`_still_there`). Also the
driver's stand-in for the trainer while none runs, and the rollouts' holdings a data
module rebuild asks for.

Apart from the state machines (:mod:`pipelines.restart`), which sequence these steps
poll by poll: these are plain functions of the driver's state, each tested alone.
"""

from __future__ import annotations

import logging
import time

from laminar.cluster import is_lost, submit_actor, workers_with
from laminar.learner import checkpoint_skipped_versions, checkpoint_version, newest_checkpoint
from laminar.relay import Relay
from storage.lineage import ordered_restarts

# (the restarts' logger: their records read as pipelines.restart's, whichever module)
logger = logging.getLogger("pipelines.restart")

# How long a restart whose call failed as if its worker were lost waits for the
# scheduler to drop that worker (it may fail a moment before) before the error stands.
LOST_GRACE_S = 5.0


def trainer_stand_in(last: dict | None, steps: int) -> dict:
    """What the driver reports for the trainer while none runs (from its ``last`` stats)."""
    last = last or {}
    return {
        "version": last.get("version", 0),
        "published": last.get("published", last.get("version", 0)),
        "steps": last.get("steps", steps),
        "done": False,
        "error": None,
        "wait_s": last.get("wait_s", 0.0),
        "last": None,
    }


def _new_master(s, worker: str, chain: list[str]):
    """A master relay on ``worker`` (the restarted trainer's), linked to the live
    ``chain``'s second relay, with the calibration measured at the run's start."""
    cfg = s.cfg
    rcfg = cfg.relay.model_copy(update={k: s.relay_info.get(k) for k in ("t_byte", "t_start")})
    master = submit_actor(s.client, Relay, "master", rcfg, worker=worker, resource="trainer")
    nxt = s.tier.handle(chain[1]) if len(chain) > 1 else None
    master.set_chain(chain, nxt, None).result(cfg.cluster.actor_timeout_s)
    return master


def _pick_workers(
    s, exclude: set[str], with_data: bool, ranks: int | None = None
) -> tuple[str, list[str]] | None:
    """A worker for rank 0 (with the ``data`` role too when ``with_data``) and one for
    each other rank (``ranks``, default ``trainer.ranks``), none in ``exclude`` (the lost
    group's: a worker restarted by its nanny has a new address); ``None`` while too few
    are there."""
    ranks = s.cfg.trainer.ranks if ranks is None else ranks
    trainers = [w for w in workers_with(s.client, "trainer") if w not in exclude]
    heads = trainers
    if with_data:
        data = set(workers_with(s.client, "data"))
        heads = [w for w in trainers if w in data]
    if not heads or len(trainers) < ranks:
        return None
    head = heads[0]
    return head, [w for w in trainers if w != head][: ranks - 1]


def _restart_point(run_dir, after: int) -> tuple:
    """The newest checkpoint (``None``: none yet, the warm-started policy), its version,
    the version ``M`` a restart from it numbers after, and the restart record's fields.
    ``M`` is ``after`` (the newest version anything that outlived the lost trainer saw
    published), or the checkpoint's if newer: a checkpoint's version was published before
    it was written, and the driver may not have seen it (the trainer wrote it after the
    driver's last look, nothing else outliving it saw it)."""
    ckpt = newest_checkpoint(run_dir)
    version = checkpoint_version(ckpt) if ckpt is not None else 0
    after = max(after, version)
    return ckpt, version, after, _point_fields(ckpt, version, after)


def _point_fields(ckpt, version: int, after: int) -> dict:
    """The restart record's fields for a restart from ``ckpt`` (at ``version``) after
    version ``after``."""
    return {
        "checkpoint": str(ckpt) if ckpt is not None else None,
        "checkpoint_version": version,
        "after_version": after,
        "lost_updates": after - version,
    }


def _steps(s, checkpoint_version: int, current: dict, ckpt=None) -> int:
    """``trainer.steps`` for a trainer restarted from the checkpoint at
    ``checkpoint_version`` (folder ``ckpt``; ``None``: the warm-started policy, or not
    given), so that
    the run makes ``trainer.steps`` updates in all: the config's, plus the version
    numbers that the trainers which led to that checkpoint skipped. The new trainer adds
    its own skip. Not the lost trainer's ``steps``: that counts its own skip too, which a
    checkpoint from before it (it wrote none) does not hold — its lost updates were then
    counted twice.

    The checkpoint records its lineage's skips (``skipped_versions``), those of trainers
    restarted before a resume too, of which this driver has no record. Without one, or
    for one written before it did, they are read from this driver's restart records (each restart's
    ``after_version - checkpoint_version``); ``current``: the restart's own record (a try
    that started a trainer may have written the checkpoint)."""
    recorded = checkpoint_skipped_versions(ckpt) if ckpt is not None else None
    if recorded is not None:
        return s.cfg.trainer.steps + recorded
    records = [*s.trainer_restarts, *s.core_restarts]
    if "after_version" in current:
        records.append(current)
    records.sort(key=lambda r: r["time"])
    skipped, version = 0, checkpoint_version
    while True:
        # (written by the newest trainer whose numbers start before it)
        writer = [r for r in records if r["after_version"] < version]
        if not writer:
            return s.cfg.trainer.steps + skipped
        newest = max(r["after_version"] for r in writer)
        w = [r for r in writer if r["after_version"] == newest][-1]  # (of equals, the later)
        skipped += w["after_version"] - w["checkpoint_version"]
        version = w["checkpoint_version"]
        records = [r for r in records if r["time"] < w["time"]]


def _lineage(s, own=None, point: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """Every trainer restart ``(V, M)`` of the run so far, in the order they happened:
    those before a resume (its checkpoint's, ``s.resume.restarts``), then this driver's
    records by their time (``trainer_restarts``, ``core_restarts``, a trainer restart in
    progress that told the buffer), then ``own``'s, the restart asking (``point``: its
    ``(V, M)`` in this try; a core restart's rebuilt buffer never hears it). For a
    buffer that heard none of them (a rebuilt data module's) and a new trainer, which
    records them in its checkpoints: ``max_train_staleness`` counts along the weights'
    lineage with them (:meth:`laminar.buffer_core.BufferCore.lag`, a tree: the lost
    branches too). A restart with ``M == V`` (nothing lost, or the run's final
    checkpoint: no trainer started) branches nothing and is left out."""
    resume = getattr(s, "resume", None)
    earlier = [(int(v), int(m)) for v, m in resume.restarts] if resume is not None else []
    records = [*s.trainer_restarts, *s.core_restarts]
    pending = getattr(s, "_restart", None)  # (begun: it told the buffer)
    if pending is not None and pending is not own:
        records.append(pending.record)
    more = [(own.t_lost, *point)] if own is not None and point is not None else []
    return [*earlier, *ordered_restarts(records, more)]


def _final_checkpoint(s, record: dict) -> dict | None:
    """The restart record's fields (:func:`_restart_point`) when the newest checkpoint
    holds every update the run asked for: the lost trainer wrote its final checkpoint
    before the driver saw it done (and had published that version: nothing was lost
    after it). Nothing is left to train, so no trainer starts again (one would refuse
    the checkpoint: "nothing left to train"); the run ends as completed. ``None``
    otherwise. ``record``: the restart's own (see :func:`_steps`)."""
    ckpt = newest_checkpoint(s.run_dir)
    if ckpt is None:
        return None
    version = checkpoint_version(ckpt)
    if version < _steps(s, version, record, ckpt):
        return None
    return _point_fields(ckpt, version, version)


def _finish(r, fields: dict) -> None:
    """The restart ``r`` (:class:`TrainerRestart` or :class:`CoreRestart`) found the run's
    final checkpoint (:func:`_final_checkpoint`): recorded and said."""
    r.finished = True
    r.record.update(
        fields,
        finished=True,
        steps=fields["checkpoint_version"],
        restart_s=time.time() - r.t_lost,  # (no trainer needed: the downtime ends here)
    )
    logger.warning(
        "the trainer was lost after its final checkpoint (version %s, %s): the run has "
        "every update it asked for; no trainer starts again",
        fields["checkpoint_version"],
        fields["checkpoint"],
    )


def _running(r) -> None:
    """A restart ``r`` (:class:`TrainerRestart` or :class:`CoreRestart`) has its new
    trainer running: recorded and said."""
    now = time.time()
    r.record.update(worker=r.worker, rank_workers=r.group.rank_workers, restart_s=now - r.t_lost)
    logger.warning(
        "trainer restarted on %s from version %s in %.1f s; its first update is version %s",
        r.worker,
        r.record["checkpoint_version"],
        now - r.t_lost,
        r.record["after_version"] + 1,
    )


def _still_there(client, role: str, workers: set[str], error: Exception) -> set[str]:
    """Those of ``workers`` (with ``role``) still on the scheduler's books after a call
    failed with ``error``. One that looks like a loss is given :data:`LOST_GRACE_S` for
    the scheduler to drop a worker: a call to a killed one fails a moment before."""
    live = workers & set(workers_with(client, role))
    deadline = time.monotonic() + LOST_GRACE_S
    while workers and live == workers and is_lost(error) and time.monotonic() < deadline:
        time.sleep(0.2)
        live = workers & set(workers_with(client, role))
    return live


def _holdings(rollouts: dict, timeout: float) -> dict[str, list[str]]:
    """Rollout id -> the prompt groups it holds trajectories of, for those of
    ``rollouts`` (id -> handle) that answer within ``timeout`` (one wait for them all)."""
    return _each(rollouts, lambda r: r.data_holdings(), timeout)


def _each(rollouts: dict, call, timeout: float) -> dict:
    """Rollout id -> ``call(handle)``'s answer, for those of ``rollouts`` (id -> handle)
    that answer within ``timeout`` (one wait for them all); one lost or stalled is left
    out, so that the caller knows which did not answer."""
    from pipelines.driver import _results, _send

    asked = {rid: _send([lambda r=r: call(r)]) for rid, r in rollouts.items()}
    deadline = time.monotonic() + timeout
    answers = {}
    for rid, futures in asked.items():
        if got := _results(futures, max(0.1, deadline - time.monotonic())):
            answers[rid] = got[0]
    return answers


def _start_again(r, error: Exception, redo_head: bool = True) -> None:
    """The restart ``r`` (:class:`TrainerRestart` or :class:`CoreRestart`) could not
    start its trainer (``error``). When a worker it picked is gone, it waits for others
    (its actors on the ones that live on released). Otherwise ``error`` is raised: none
    went (the error is the trainer's own: a checkpoint it cannot load, a bad config), or
    a group half started (its live ranks wait in the old rendezvous), or, unless
    ``redo_head``, rank 0's worker lives on (a :class:`CoreRestart` rebuilt the data
    module there: a second one must not write the same store)."""
    group = r.group
    tried = {r.worker, *(group.rank_workers if group is not None else ())} - {None}
    live = _still_there(r.s.client, "trainer", tried, error)
    started = group is not None and group.started
    if not tried or tried == live or (live and (started or (r.worker in live and not redo_head))):
        if group is not None and not started:  # (each loaded a checkpoint: not kept)
            group.release()
        raise error
    logger.warning(
        "the trainer could not start on %s: %r; waiting for others", sorted(tried), error
    )
    if group is not None:
        group.release()
    r.exclude |= tried - live
    r.worker = r.group = None
