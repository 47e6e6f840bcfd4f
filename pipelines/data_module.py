"""A run's data module (the prompt pool, the partial-response pool and the experience
buffer, on the ``data`` worker): its start, at the run's start and when it is rebuilt
within the run (``pipelines/restart.py``), and what a run leaves for its continuation:
where the prompt order stood, in the final checkpoint, and how to resume a failed run.

Apart from ``pipelines/driver.py`` because the driver's setup and stop, its fault
handling and the restarts all use them. Used by ``laminar run``'s driver.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from laminar.buffer import ExperienceBuffer
from laminar.cluster import ActorHung, bind_actor, start_actor
from laminar.config import RunConfig
from laminar.errors import ClusterError
from laminar.learner import newest_checkpoint
from laminar.partial import PartialResponsePool
from laminar.prompt_pool import DATA_STATE, PromptPool

logger = logging.getLogger("laminar")


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


def run_schedule(run_dir: str | Path) -> str:
    """The ``pipeline.schedule`` the run in ``run_dir`` ran, from its ``config.yaml``, as
    ``laminar run --resume`` reads it (``laminar`` when that file does not say: the
    default, and the advice that ``--resume`` itself then corrects)."""
    import yaml

    try:
        data = yaml.safe_load(Path(run_dir, "config.yaml").read_text())
        schedule = data["pipeline"]["schedule"]
    except Exception:  # noqa: BLE001 — absent or unreadable: the default's advice
        return "laminar"
    return schedule if isinstance(schedule, str) else "laminar"


def resume_hint(run_dir: str | Path, schedule: str | None = None, *, python: bool = False) -> str:
    """How to continue the run in ``run_dir`` once it has failed or stopped, as one
    clause that begins with its verb: ``laminar run --resume`` for a laminar run; a new
    run from the newest checkpoint for another ``schedule`` (its ``config.yaml``'s when
    not given), which ``--resume`` refuses (:func:`pipelines.resume_plan.prepare_resume`).
    ``python``: the Python API's way too."""
    import shlex

    run_dir = Path(run_dir)
    schedule = schedule or run_schedule(run_dir)
    config = run_dir / "config.yaml"
    new_run = f"laminar run {shlex.quote(str(config))} --run-dir NEW_DIR"
    saved = newest_checkpoint(run_dir)
    if saved is None:
        return (
            f"start it again in a new run directory (`{new_run}`"
            + (
                f"; from Python: pipelines.submit({str(config)!r}, client, run_dir=NEW_DIR)"
                if python
                else ""
            )
            + "): it has no checkpoint yet to continue from (one is written when a run "
            "ends and every trainer.checkpoint_every versions)"
        )
    if schedule == "laminar":
        return (
            f"continue it from its last checkpoint ({saved.name}) with "
            f"`laminar run --resume {shlex.quote(str(run_dir))}`"
            + (f" or pipelines.resume({str(run_dir)!r}, client)" if python else "")
        )
    setting = f"trainer.resume_from={saved}"
    return (
        f"continue it in a new run from its last checkpoint ({saved.name}): "
        f"`{new_run} --set {shlex.quote(setting)}`"
        + (
            f" or pipelines.submit({str(config)!r}, client, run_dir=NEW_DIR, "
            f"overrides=[{setting!r}])"
            if python
            else ""
        )
        + f" (it ran pipeline.schedule={schedule!r}, and `laminar run --resume` continues "
        "only laminar runs in place)"
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

    pool = create(PromptPool, cfg, policy_dir, order, spec, str(run_dir))
    partial = None
    if cfg.faults.recover:
        # (it keeps the groups the pool re-issues in its log; a rebuild's leaves the lost
        # pool's log as it is until the rebuild has restored and registered its entries:
        # PartialResponsePool.open_log)
        partial = create(
            PartialResponsePool,
            cfg.relay.timeout_s,
            str(run_dir),
            cfg.faults.log_interval_s,
            sorted(order.reissue) if order is not None else [],
            plans.get("rebuild") is not None,
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
