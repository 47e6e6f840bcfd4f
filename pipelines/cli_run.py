"""``laminar run``: a run started, or resumed in place, on the cluster its config names;
its progress followed until it ends, then its summary; Ctrl-C, SIGTERM or SIGHUP stops it
in order, with an exit code that says which.

Apart from :mod:`pipelines.cli` (the parser, the other commands) as the one command that
holds a cluster and follows a run; what it prints is :mod:`pipelines.cli_display`'s, its
signal handling :mod:`pipelines.cli_signals`'.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from laminar.deploy_walltime import WALLTIME_EXIT
from laminar.errors import LaminarError, RunFailed, RunStopped
from pipelines.cli_display import _Bar, _Lines, _print_failed_summary, _print_summary, groups
from pipelines.cli_signals import STOP_SIGNALS, _handling, _safely
from storage.audit import WALLTIME_REASON


def cmd_run(args: argparse.Namespace) -> int:
    from laminar.deploy import open_cluster
    from laminar.errors import ConfigError
    from pipelines.api import (
        RunHandle,
        absolute_paths,
        preflight,
        prepare_resume,
        prepare_run_dir,
        resolve_config,
    )

    overrides = list(args.set or [])
    if args.scheduler or args.scheduler_file:
        # (quoted: a value is read as YAML, where " #2" of "exp #2/sched.json" would be
        # a comment)
        overrides += [
            "cluster.kind=address",
            f"cluster.address={_yaml_string(args.scheduler)}",
            f"cluster.scheduler_file={_yaml_string(args.scheduler_file)}",
        ]
    plan = None
    if args.resume:
        if args.config or args.run_dir:
            raise ConfigError(
                "laminar run --resume RUN_DIR continues RUN_DIR with its own config.yaml; "
                "drop CONFIG and --run-dir (change settings with --set)"
            )
        cfg, plan, run_dir = prepare_resume(args.resume, overrides)
        print(f"run dir            {run_dir}  (resumed from {cfg.trainer.resume_from})")
        why = [  # (each group dropped, by why: the ones that apply)
            f"{groups(n)} {what}"
            for n, what in (
                (
                    plan.dropped_late,
                    f"finished after version {plan.version}, by weights the resume redoes",
                ),
                (plan.dropped_failed, "with a failed reward"),
                (
                    plan.dropped_incomplete,
                    "stored in part, whose missing samples another policy would generate",
                ),
            )
            if n
        ]
        print(
            f"store              {plan.stored} trajectories; {len(plan.readmit)} back in the "
            f"buffer ({groups(len(plan.readmit_groups))}), {len(plan.drop)} dropped"
            + (f" ({'; '.join(why)}: docs/faults.md)" if why else ""),
            flush=True,
        )
        print(
            f"recovery log       {plan.log_unfinished} trajectories were generating and "
            f"{plan.log_completed} completed but not stored; {groups(plan.log_groups)} with "
            "nothing stored re-issued whole",
            flush=True,
        )
    else:
        if not args.config:
            raise ConfigError("laminar run needs a CONFIG file (or --resume RUN_DIR)")
        cfg = absolute_paths(resolve_config(args.config, overrides))
        preflight(cfg)
        run_dir = prepare_run_dir(cfg, args.run_dir)  # (OSError: a ConfigError naming it)
        print(f"run dir            {run_dir}", flush=True)
    last: list[str] = []  # (an abort's message: said once the cluster has closed)
    with open_cluster(cfg, run_dir) as client:
        client.forward_logging("laminar", level=logging.WARNING)
        print(f"scheduler          {client.scheduler.address}")
        print(f"dashboard          {client.dashboard_link}")  # open_cluster waited for roles
        code = _follow(RunHandle(cfg, client, run_dir, resume=plan), last)
    for said in last:
        _safely(print, said, file=sys.stderr)
    return code


def _yaml_string(value: str | None) -> str:
    """``value`` as a YAML scalar that reads back as itself (a JSON string is a YAML
    double-quoted one), or ``null``."""
    return "null" if value is None else json.dumps(value, ensure_ascii=False)


def _say_from_a_handler(text: str) -> None:
    """Print ``text`` from a signal handler. The signal may come in the middle of a print
    to stdout (the progress line), whose buffer then refuses another ("RuntimeError:
    reentrant call"), which ended the command with a traceback instead of stopping the
    run in order: then it goes to stderr's descriptor, unbuffered."""
    try:
        _safely(print, text, flush=True)
    except RuntimeError:
        try:
            os.write(sys.stderr.fileno(), (text.lstrip("\n") + "\n").encode())
        except (OSError, ValueError):  # (stderr gone too: the run still stops in order)
            pass


def _follow(handle, last: list[str] | None = None) -> int:
    """Show a run's progress until it ends, then its summary. Ctrl-C, SIGTERM or SIGHUP
    stops it cleanly (a second one aborts): the same exit code as Ctrl-C's for Ctrl-C,
    128 + its number (143, 129) for another signal, so that a job script can tell a run
    stopped in order from one that completed. ``last``: where an abort's message goes,
    for the caller to print once the cluster has closed (printed here without it)."""
    from pipelines.data_module import resume_hint  # (here: not imported mid-abort)

    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        if len(received) == 2:
            raise KeyboardInterrupt
        if len(received) > 2:  # (the abort is under way: it ends with the cluster closed)
            return
        handle.stop()
        key = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if getattr(handle, "training_began", True):
            doing = "finishing the current update and flushing the store"
        else:  # (no update yet, nothing stored: the setup ends at its next phase)
            doing = "ending its setup, before anything is generated"
        _say_from_a_handler(f"\nstopping ({key}): {doing} ({key} again to abort)")

    with _handling(STOP_SIGNALS, on_signal):
        display = _Bar() if sys.stdout.isatty() else _Lines()
        try:
            code = _watch(handle, display)
        except KeyboardInterrupt:  # the second signal: no stop in order
            _safely(display.close)
            # (the workers' logs too, of a cluster laminar started and now closes: one
            # of yours, cluster.kind=address, outlives the run and serves the resume)
            cfg = getattr(handle, "config", None)
            own = cfg is None or cfg.cluster.kind != "address"
            _quiet_after_abort(getattr(handle, "client", None) if own else None)
            hint = resume_hint(handle.run_dir)
            signum = received[-1] if received else signal.SIGINT
            key = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            said = (
                f"laminar: aborted; the run in {handle.run_dir} did not stop in order; "
                f"{hint} (docs/faults.md)"
            )
            if last is not None:  # (the cluster's close may take a while: say it goes on)
                _safely(print, "\nlaminar: aborting; closing the cluster", file=sys.stderr)
            abort = getattr(handle, "abort", None)
            if abort is not None:  # (its summary.json: aborted, not an earlier start's)
                try:
                    abort(f"aborted: {key} a second time, before it stopped in order; {hint}")
                except Exception:  # noqa: BLE001 — the abort goes on; its log is silenced
                    pass
            if last is not None:
                last.append(said)
            else:
                _safely(print, "\n" + said, file=sys.stderr)
            return 128 + signum
        if received and received[0] != signal.SIGINT and code in (0, 130):
            return 128 + received[0]  # (stopped in order, or in its setup, by that signal)
        return code


def _quiet_after_abort(client=None) -> None:
    """Silence what logs as an aborted run's cluster is torn down under actors still in
    use: Dask's scheduler and asyncio (~90 lines of errors), and laminar's own loggers,
    the driver's, those forwarded from the workers and, through ``client``, the
    workers' own (a local cluster's write to this terminal): a trainer's 'trainer
    failed:' traceback, 'no checkpoint at version N', warnings, ~35 lines, none of them
    news, that buried the abort's message. (A forwarded record is handled by its logger
    whatever its level: those loggers are disabled.)"""
    for name in ("distributed", "asyncio", "laminar"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    names = [n for n in logging.root.manager.loggerDict if n.startswith("laminar.")]
    for name in ("laminar", *names):
        logging.getLogger(name).disabled = True
    run = getattr(client, "run", None)
    if run is not None:
        try:  # (not waited for: a worker that does not answer holds nothing up)
            run(_quiet_worker, wait=False)
        except Exception:  # noqa: BLE001 — a closed client: the message still comes last
            pass


async def _quiet_worker() -> None:
    """On a worker of an aborted run: its laminar loggers silenced (see above). (A
    coroutine: ``client.run`` takes no other without waiting for it.)"""
    for name in ("laminar", "distributed", "asyncio", "tornado"):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def _watch(handle, display) -> int:
    while not handle.done():
        _safely(display.show, handle.progress())
        time.sleep(0.5)
    final = handle.progress()
    if "version" in final:  # the last state, which the polling may have missed
        _safely(display.show, {**final, "phase": "training"}, force=True)
    _safely(display.close)
    try:
        summary = handle.wait()
    except RunStopped as e:  # Ctrl-C before it generated anything
        _safely(print, f"laminar: {e}", file=sys.stderr)
        return 130
    except RunFailed as e:  # stopped in order: what it did, then why it failed
        _safely(_print_summary, e.summary, _began_from(handle))
        _safely(print, f"laminar: error: {e}", file=sys.stderr)
        return 1
    except LaminarError as e:
        if not handle.training_began:  # failed in its setup (the cluster, the warm start)
            raise
        # The driver failed under a running run (a cluster lost under it): what the
        # stores hold (unless even that could not be written), then why; exit 1, a
        # failed run, as above (2 is a usage error).
        if handle.summary is not None:
            _safely(_print_failed_summary, handle.summary)
        _safely(print, f"laminar: error: {e}", file=sys.stderr)
        return 1
    _safely(_print_summary, summary, _began_from(handle))
    if (said := _stopped_early(handle, summary)) is not None:
        _safely(print, said, file=sys.stderr)
    if str(summary.get("reason", "")).startswith(WALLTIME_REASON):
        # (stopped in order before its jobs' end: a job script tells it by the exit code)
        from pipelines.data_module import resume_hint

        _safely(
            print,
            f"laminar: {summary['reason']}; its final checkpoint is written: "
            f"{resume_hint(handle.run_dir)} in new jobs"
            + (
                " (path B: a new scheduler job and new worker jobs first, docs/deploy.md)"
                if getattr(handle, "config", None) is not None
                and handle.config.cluster.kind == "address"
                else ""
            ),
            file=sys.stderr,
        )
        return WALLTIME_EXIT
    return 0


def _stopped_early(handle, summary: dict) -> str | None:
    """What continues a run stopped in order (Ctrl-C, SIGTERM, ``stop()``) before
    ``trainer.steps``, as a failed, aborted or walltime-stopped run is told; None for
    any other end."""
    from pipelines.data_module import resume_hint

    reason = str(summary.get("reason", ""))
    # (a walltime stop says what continues it, in new jobs: one line, not two)
    if not reason.startswith("stopped") or reason.startswith(WALLTIME_REASON):
        return None
    version = summary.get("versions")
    updates = summary.get("updates", version)
    cfg = getattr(handle, "config", None)
    steps = cfg.trainer.steps if cfg is not None else None
    if steps is not None and updates is not None and updates >= steps:
        return None
    at = f"version {version}" if version is not None else "its last version"
    if steps is not None:
        at += f" of {steps}" if updates == version else f" ({updates} of {steps} updates made)"
    ckpt = summary.get("checkpoint")
    written = version is not None and ckpt and Path(ckpt).name == f"version-{version:06d}"
    return (
        f"laminar: stopped at {at}; "
        + ("its final checkpoint is written: " if written else "")
        + resume_hint(handle.run_dir)
    )


def _began_from(handle) -> str | None:
    """The checkpoint a run began from (``trainer.resume_from`` of a new run), as its
    ``config.yaml`` records it: a resume in place keeps the run's own there (its
    config's is the checkpoint it resumed from); None for a run from the warm start."""
    from laminar.config import load_config

    run_dir = getattr(handle, "run_dir", None)
    if run_dir is None:
        return None
    try:
        return load_config(Path(run_dir) / "config.yaml").trainer.resume_from
    except (OSError, LaminarError):  # (the summary is printed without it)
        return None
