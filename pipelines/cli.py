"""The ``laminar`` command: a thin shell over :mod:`pipelines.api` and :mod:`pipelines.report`::

laminar run CONFIG [--set k=v ...] [--run-dir DIR] [--scheduler ADDRESS | --scheduler-file F]
laminar run --resume RUN_DIR [--set k=v ...] [--scheduler ADDRESS | --scheduler-file F]
laminar certs DIR
laminar audit RUN_DIR [--json]
laminar report RUN_DIR [RUN_DIR ...] [--out DIR]
laminar bench NAME [--out FILE.json] [--repeats N] [...]
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import select
import signal
import sys
import time
from pathlib import Path

from laminar.errors import LaminarError, RunFailed, RunStopped
from storage.trajectories import StoreError


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _progress_line(p: dict) -> str:
    if p.get("phase") != "training":
        return f"[{p.get('phase')}]"
    return (
        # (the version the run ends at: a trainer restarted within the run skips the lost
        # one's numbers, so versions can pass trainer.steps; the updates cannot)
        f"t={p['elapsed_s']:6.1f}s  version {p['version']:>3}/{p.get('last_version', p['steps'])}  "
        f"reward {_fmt(p['reward'])}  gen {p['gen_tok_s']:7.0f} tok/s  "
        f"buffer {p['buffer_depth']:>4}  s_train {_fmt(p['s_train_mean'], '.2f')}  "
        f"trajectories {p['trajectories']}"
        + (f"  discarded {p['discarded']} (reward errors)" if p.get("discarded") else "")
    )


class _Lines:
    """Progress as plain lines (logs, pipes, CI): on every phase change, and every 2 s
    while training."""

    def __init__(self) -> None:
        self.last, self.t_last = "", 0.0

    def show(self, p: dict, force: bool = False) -> None:
        line = _progress_line(p)
        due = line.startswith("t=") and time.time() - self.t_last >= 2.0
        if line != self.last and (force or due or not line.startswith("t=")):
            print(line, flush=True)
            self.last, self.t_last = line, time.time()

    def close(self) -> None:
        pass


class _Bar:
    """Progress as a bar over the updates made of trainer.steps (interactive terminals)."""

    def __init__(self) -> None:
        self.bar = None
        self.phase = None

    def show(self, p: dict, force: bool = False) -> None:
        from tqdm import tqdm

        if p.get("phase") != "training":
            if p.get("phase") != self.phase:
                print(f"[{p.get('phase')}]", flush=True)
                self.phase = p.get("phase")
            return
        if self.bar is None:
            self.bar = tqdm(total=p["steps"], unit="update", dynamic_ncols=True)
        self.bar.n = p.get("updates", p["version"])
        self.bar.set_postfix_str(
            f"reward {_fmt(p['reward'])} gen {p['gen_tok_s']:.0f} tok/s "
            f"buffer {p['buffer_depth']} s_train {_fmt(p['s_train_mean'], '.2f')}"
            + (f" discarded {p['discarded']}" if p.get("discarded") else "")
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _print_summary(s: dict) -> None:
    sft = s["sft"]
    print("\n== summary ==")
    print(f"run dir            {s['run_dir']}  ({s['reason']})")
    print(
        f"reward             first 20% {s['reward_first_20pct']:.3f} -> last 20% "
        f"{s['reward_last_20pct']:.3f}  (gain {s['reward_gain']:+.3f})"
    )
    made = (
        f"  ({s['updates']} updates made)"
        if s.get("updates", s["versions"]) != s["versions"]
        else ""
    )
    print(f"versions           {s['versions']}{made}")
    if r := s.get("resumed"):
        print(
            f"resumed            at version {r['version']}: {r['readmitted']} trajectories "
            f"back in the buffer, {r.get('reissued_samples', 0)} missing siblings re-issued, "
            f"{r['dropped']} dropped"
        )
    left = {k[2:]: v for k, v in s.get("status_counts", {}).items() if k != "n_consumed" and v}
    print(
        f"trajectories       {s['trajectories']} ({s['consumed']} consumed"
        + "".join(f", {v} {k}" for k, v in sorted(left.items()))
        + ")"
    )
    print(f"tokens             {s['prompt_tokens']} prompt + {s['response_tokens']} response")
    print("staleness (mean)   " + "  ".join(f"{k[:-5]} {v:.2f}" for k, v in s["staleness"].items()))
    whole = (
        f" ({s['rl_wall_s_total']:.1f} s over the run's {s['segments']} starts)"
        if s.get("segments", 1) > 1
        else ""
    )
    print(
        f"wall time          RL {s['rl_wall_s']:.1f} s{whole}; warm start "
        f"{sft.get('wall_s', 0):.1f} s ({'cached' if sft.get('cached') else 'trained'})"
    )
    if "eval_reward" in sft:
        print(
            f"warm-start reward  {sft['eval_reward']:.3f} "
            f"(one sample each of {sft['eval_prompts']} prompts)"
        )
    eng = s.get("engine", {})
    if eng.get("parity_checks"):
        print(
            f"engine parity      max |behavior - trainer logprob| {eng['parity_max_abs']:.2e} "
            f"over {eng['parity_checks']} checks"
        )
    if "modelled_s" in eng:
        print(
            f"pacing             modelled {eng['modelled_s']:.1f} s, real compute "
            f"{eng['compute_s']:.1f} s, {eng['overruns']} steps over the model"
        )
    relay = s.get("relay")
    if relay:
        waits = relay["rollout_wait_s"]
        stall, bcast = relay["stall_s_median"] * 1e3, relay["broadcast_s_median"] * 1e3
        print(
            f"weights            {len(relay['chain'])} relay(s); publication stall {stall:.1f} ms, "
            f"broadcast {bcast:.1f} ms (medians); rollout wait "
            f"{sum(waits) / max(len(waits), 1):.1f} s per rollout"
        )
        if "fingerprints" in relay:
            fp = relay["fingerprints"]
            print(
                f"weights audit      {fp['loads_checked']} loads checked, {fp['mismatched']} "
                "differ from what the trainer published"
                + (
                    f" ({fp['unverified']} of versions a lost trainer published unchecked)"
                    if fp.get("unverified")
                    else ""
                )
            )
    repack = s.get("repack")
    if repack:
        print(
            f"repack             {repack['moves']} moves ({repack['rolled_back']} rolled back), "
            f"{repack['requests_moved']} requests, pause {repack['pause_s']:.2f} s"
        )
    faults = s.get("faults")
    if faults and faults["lost"]:
        print(
            f"faults             {len(faults['lost'])} rollout(s) lost "
            f"({', '.join(sorted(faults['lost']))}); {faults['recovered_requests']} unfinished "
            f"trajectories resumed elsewhere in {faults['recoveries']} recoveries "
            "(`laminar audit RUN_DIR`)"
        )
    if faults and faults.get("hung"):
        print(
            f"hung               {', '.join(sorted(faults['hung']))}: no progress for "
            "faults.heartbeat_timeout_s; worker restarted, then recovered as lost"
        )
    for r in (faults or {}).get("trainer_restarts", []):
        if r.get("finished"):  # (restart._finish: no trainer started again)
            print(
                f"trainer            lost after its final checkpoint (version "
                f"{r['checkpoint_version']}): every update was made, none restarted"
            )
            continue
        print(
            f"trainer            lost, restarted in the run in {r['restart_s']:.1f} s from "
            f"version {r['checkpoint_version']} ({r['lost_updates']} update(s) lost and "
            f"redone, {r['readmitted']} trajectories back in the buffer); numbering goes on "
            f"after version {r['after_version']}"
        )
    for r in (faults or {}).get("data_restarts", []):
        print(
            f"data module        lost, rebuilt in the run in {r['restart_s']:.1f} s from the "
            f"stores ({r['held_again']} trajectories held again, {r['marked_consumed']} "
            f"consumed events written, {r['outstanding_groups']} groups outstanding, "
            f"{r['registered']} unfinished trajectories registered anew)"
        )
    for r in (faults or {}).get("core_restarts", []):
        if r.get("finished"):
            print(
                f"trainer + data     lost together after the final checkpoint (version "
                f"{r['checkpoint_version']}): the data module rebuilt in {r['restart_s']:.1f} s "
                "to close the store; every update was made, no trainer restarted"
            )
            continue
        print(
            f"trainer + data     lost together, restarted in the run in {r['restart_s']:.1f} s "
            f"from version {r['checkpoint_version']} ({r['lost_updates']} update(s) lost and "
            f"redone, {r['held_again']} trajectories held again, {r['registered']} "
            f"unfinished trajectories registered anew); numbering goes on after version "
            f"{r['after_version']}"
        )
    if faults and faults.get("relays_lost"):
        print(
            f"relays             {len(faults['relays_lost'])} lost "
            f"({', '.join(sorted(faults['relays_lost']))}); chain now "
            + " -> ".join(faults["chain"] or [])
        )
    print(f"checkpoint         {s['checkpoint']}")


def cmd_run(args: argparse.Namespace) -> int:
    from laminar.deploy import open_cluster
    from laminar.errors import ConfigError
    from pipelines.api import (
        RunHandle,
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
        print(
            f"store              {plan.stored} trajectories; {len(plan.readmit)} back in the "
            f"buffer ({len(plan.readmit_groups)} groups; the missing siblings of "
            f"{len(plan.reissue) - plan.log_groups} re-issued), {len(plan.drop)} dropped "
            "(docs/faults.md)",
            flush=True,
        )
        print(
            f"recovery log       {plan.log_unfinished} trajectories were generating and "
            f"{plan.log_completed} completed but not stored; {plan.log_groups} groups with "
            "nothing stored re-issued whole",
            flush=True,
        )
    else:
        if not args.config:
            raise ConfigError("laminar run needs a CONFIG file (or --resume RUN_DIR)")
        cfg = resolve_config(args.config, overrides)
        preflight(cfg)
        try:
            run_dir = prepare_run_dir(cfg, args.run_dir)
        except OSError as e:  # (a file where the folder must be, no permission, ...)
            raise ConfigError(_run_dir_problem(args.run_dir or cfg.run_dir, e)) from None
        print(f"run dir            {run_dir}", flush=True)
    with open_cluster(cfg, run_dir) as client:
        client.forward_logging("laminar", level=logging.WARNING)
        print(f"scheduler          {client.scheduler.address}")
        print(f"dashboard          {client.dashboard_link}")  # open_cluster waited for roles
        return _follow(RunHandle(cfg, client, run_dir, resume=plan))


def _yaml_string(value: str | None) -> str:
    """``value`` as a YAML scalar that reads back as itself (a JSON string is a YAML
    double-quoted one), or ``null``."""
    return "null" if value is None else json.dumps(value, ensure_ascii=False)


def _file_in_the_way(path: Path) -> Path | None:
    """The file (not folder) at ``path`` or above it, which keeps a folder from being made."""
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def _run_dir_problem(run_dir: str | None, e: OSError) -> str:
    """Why the run directory cannot be made, naming what stands in its way."""
    path = Path(str(e.filename or run_dir or "runs"))
    blocker = _file_in_the_way(path)
    if blocker is not None:
        return (
            f"cannot make the run directory {str(path)!r}: {str(blocker)!r} is a file, not a "
            "folder; pass --run-dir (or run_dir in the config) a new folder's path, or move "
            "the file aside"
        )
    return (
        f"cannot make the run directory {str(path)!r} ({e.strerror or e}); pass --run-dir "
        "(or run_dir in the config) a folder this user can create and write"
    )


# The signals that stop a run in order, as Ctrl-C does: SIGTERM (`kill`, `scancel`, a
# Slurm job's walltime, with `#SBATCH --signal=B:TERM@300` ahead of it) and SIGHUP (the
# terminal or SSH session gone; not where it is ignored, under `nohup`).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Signalled(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside a run's progress (its setup, a bench, a report): ends
    the command as Ctrl-C does, what it started (a cluster, Slurm jobs) closed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _signalled(signum, frame):
    raise _Signalled(signum)


@contextlib.contextmanager
def _handling(signums, handler):
    """``handler`` for each of ``signums`` meanwhile, then the handlers before it back;
    one that is ignored (nohup's SIGHUP) stays ignored."""
    old = {}
    for signum in signums:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            old[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, before in old.items():
            signal.signal(signum, before)


def _exit_code(interrupt: KeyboardInterrupt) -> int:
    """128 + the signal's number: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP (an
    interrupted wait() keeps what interrupted it as its cause)."""
    for e in (interrupt, interrupt.__cause__):
        if isinstance(e, _Signalled):
            return 128 + e.signum
    return 128 + signal.SIGINT


def _stream_gone(stream) -> bool:
    """Whether ``stream``'s reader is gone: a pipe whose reader exited (POLLERR), a
    terminal hung up (POLLHUP)."""
    try:
        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (OSError, ValueError):  # (closed, or no file descriptor)
        return False


def _safely(show, *args, **kwargs) -> None:
    """Call ``show``, something that prints; when what reads the output is gone (`tee`
    ended by the same Ctrl-C, a hung-up terminal), the rest of it goes nowhere, and the
    run still stops in order and says so in its exit code."""
    try:
        show(*args, **kwargs)
        sys.stdout.flush()  # (here, not at exit: Python would report the error there)
    except OSError as e:
        if e.errno not in (errno.EPIPE, errno.EIO):
            raise
        gone = [s for s in (sys.stdout, sys.stderr) if _stream_gone(s)] or [sys.stdout]
        for stream in gone:  # (its unflushed rest would fail again: it goes nowhere)
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def _follow(handle) -> int:
    """Show a run's progress until it ends, then its summary. Ctrl-C, SIGTERM or SIGHUP
    stops it cleanly (a second one aborts): the same exit code as Ctrl-C's for Ctrl-C,
    128 + its number (143, 129) for another signal, so that a job script can tell a run
    stopped in order from one that completed."""
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        if len(received) > 1:
            raise KeyboardInterrupt
        handle.stop()
        key = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        _safely(
            print,
            f"\nstopping ({key}): finishing the current update and flushing the store "
            f"({key} again to abort)",
            flush=True,
        )

    with _handling(STOP_SIGNALS, on_signal):
        display = _Bar() if sys.stdout.isatty() else _Lines()
        try:
            code = _watch(handle, display)
        except KeyboardInterrupt:  # the second signal: no stop in order, no summary
            _safely(display.close)
            _safely(
                print,
                f"\nlaminar: aborted; the run in {handle.run_dir} did not stop in order "
                f"(`laminar run --resume {handle.run_dir}` continues it from its newest "
                "checkpoint, docs/faults.md)",
                file=sys.stderr,
            )
            return 128 + (received[-1] if received else signal.SIGINT)
        if received and received[0] != signal.SIGINT and code in (0, 130):
            return 128 + received[0]  # (stopped in order, or in its setup, by that signal)
        return code


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
        _safely(_print_summary, e.summary)
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
    _safely(_print_summary, summary)
    return 0


def _print_failed_summary(s: dict) -> None:
    """The summary of a run whose driver failed (``pipelines.summary.summarize_failed``):
    only what the stores said."""
    print("\n== summary ==")
    print(f"run dir            {s['run_dir']}  ({s['reason']})")
    if "trajectories" in s:
        print(f"trajectories       {s['trajectories']} ({s['consumed']} consumed)")
        print(
            f"reward             first 20% {s['reward_first_20pct']:.3f} -> last 20% "
            f"{s['reward_last_20pct']:.3f}"
        )
    if "versions" in s:
        print(f"versions           {s['versions']} (the last the stores record)")


def cmd_audit(args: argparse.Namespace) -> int:
    import json

    from storage.audit import audit_run

    report = audit_run(args.run_dir)
    if args.json:  # (alone on stdout, for a script to parse)
        print(json.dumps(report.to_dict(), indent=2, default=float))
    else:
        print(report.text())
    return 0 if report.ok else 1


def cmd_certs(args: argparse.Namespace) -> int:
    from laminar.deploy import TLS_FILES, generate_tls
    from laminar.errors import ConfigError

    folder = Path(args.dir).expanduser()
    blocker = _file_in_the_way(folder)
    if blocker is not None:
        raise ConfigError(
            f"cannot write the TLS files to {str(folder)!r}: {str(blocker)!r} is a file, not "
            "a folder; pass another folder (laminar certs makes it)"
        )
    there = [n for n in TLS_FILES.values() if (folder / n).exists()]
    if there and not args.force:
        raise ConfigError(
            f"{args.dir} already holds {', '.join(there)}: a scheduler and workers started "
            "with them would not trust clients given new ones; pass another folder, or "
            "--force to replace them (then restart everything that uses them)"
        )
    try:
        paths = generate_tls(folder)
    except OSError as e:  # (no permission, a read-only or pseudo file system, ...)
        raise ConfigError(
            f"cannot write the TLS files to {str(folder)!r} ({e.strerror or e}); pass a "
            "folder this user can create and write"
        ) from None
    for field, path in paths.items():
        print(f"{field:<18} {path}")
    print(
        f"\ndask scheduler --tls-ca-file {paths['ca_file']} --tls-cert {paths['cert']} "
        f"--tls-key {paths['key']} --protocol tls ...\n"
        "config: cluster.security: {ca_file: ..., cert: ..., key: ...}"
    )
    return 0


def _quiet_libraries() -> None:
    # Worker processes inherit the environment: keep Dask's INFO chatter and HF progress
    # bars out of the progress display (warnings and errors still show).
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def cmd_report(args: argparse.Namespace) -> int:
    from pipelines.report import build_report

    report = build_report(args.runs, args.out)
    print(f"report             {report}")
    for png in sorted(report.parent.glob("*.png")):
        print(f"figure             {png}")
    return 0


def _check_out(out: str) -> None:
    """Refuse an ``--out`` the bench could not write when it ends (minutes to hours on)."""
    from laminar.errors import ConfigError

    path = Path(out).expanduser()
    if path.is_dir():
        raise ConfigError(f"--out {out!r} is a folder; give a file's path, e.g. {out}/bench.json")
    blocker = _file_in_the_way(path.parent)
    if blocker is not None:
        raise ConfigError(
            f"cannot write --out {out!r}: {str(blocker)!r} is a file, not a folder; give a "
            "path in a folder (made if missing)"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise ConfigError(
            f"cannot write --out {out!r} ({e.strerror or e}); give a path in a folder this "
            "user can create and write"
        ) from None


def _check_bench_flags(args: argparse.Namespace) -> None:
    """Flags that conflict, or name what does not exist, refused before a bench starts."""
    from laminar.errors import ConfigError

    if args.data_apart and args.resume_lost:
        raise ConfigError(
            "laminar bench soak: --resume-lost and --data-apart do not go together (a "
            "resumed run is the shared layout's); give one"
        )
    if args.name != "schedules":
        return  # (run_bench refuses flags a bench does not take)
    if args.from_runs:
        if not args.runs_dir:
            raise ConfigError(
                "--from-runs computes the result of the runs a previous bench kept: give "
                "--runs-dir DIR, the folder it kept them in"
            )
        if not Path(args.runs_dir).expanduser().is_dir():
            raise ConfigError(
                f"--runs-dir: no folder {args.runs_dir!r}; with --from-runs give the folder "
                "a previous `laminar bench schedules --runs-dir DIR` kept its runs in"
            )
        run_only = {
            "--arms": args.arms,
            "--gpus": args.gpus,
            "--iterations": args.iterations,
            "--no-search": args.no_search,
            "--seeds": args.seeds,
            "--set": args.set,
            "--splits": args.splits,
        }
        given = [flag for flag, v in run_only.items() if v not in (None, False)]
        if given:
            raise ConfigError(
                "--from-runs computes the result of the runs --runs-dir kept, as they were "
                f"run: drop {', '.join(given)} (it takes --warmup, --reward-threshold, --out)"
            )
    from pipelines.bench_schedules import ARMS

    for flag, names in (("--arms", args.arms or ()), ("--splits", args.splits or {})):
        for name in names:
            if name not in ARMS:
                raise ConfigError(f"unknown schedule {name!r} in {flag}; known: {', '.join(ARMS)}")


def cmd_bench(args: argparse.Namespace) -> int:
    from pipelines.bench import run_bench

    _check_bench_flags(args)
    if args.out:
        _check_out(args.out)
    options = {}
    if args.repeats is not None:
        options["repeats"] = args.repeats
    if args.batches:
        options["batches"] = args.batches
    if args.contexts:
        options["contexts"] = args.contexts
    if args.new_tokens is not None:
        options["new_tokens"] = args.new_tokens
    if args.threads is not None:
        options["threads"] = args.threads
    if args.vllm_python:
        options["vllm"] = args.vllm_python
    if args.sizes_mb:
        options["sizes_mb"] = args.sizes_mb
    if args.relays:
        options["ps"] = args.relays
    if args.protocols:
        options["protocols"] = tuple(args.protocols.split(","))
    if args.senders:
        options["senders"] = tuple(args.senders.split(","))
    if args.duration_s is not None:
        options["duration_s"] = args.duration_s
    if args.kill_every_s is not None:
        options["kill_every_s"] = args.kill_every_s
    for key in (
        "gpus",
        "seeds",
        "warmup",
        "iterations",
        "reward_threshold",
        "runs_dir",
        "model",
        "accelerator",
        "layers",
        "tp",
        "split_kv",
    ):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    if args.no_search:
        options["search"] = False
    if args.data_apart:
        options["data_apart"] = True
    if args.resume_lost:
        options["resume"] = True
    if args.from_runs:
        options["from_runs"] = True
    if args.arms:
        options["arms"] = args.arms
    if args.set:
        options["overrides"] = tuple(args.set)  # (repack, schedules: run_bench says so)
    if args.splits:
        options["splits"] = args.splits
    result = run_bench(args.name, args.out, **options)
    if result.failed:  # (figures of the other runs written: the failed ones listed)
        print(
            f"laminar bench {args.name}: {len(result.failed)} run(s) failed and were left "
            "out (listed in the notes and the JSON's `failed`)",
            file=sys.stderr,
        )
        return 1
    return 0


def _whole_number(least: int):
    """An argparse ``type``: a whole number ≥ ``least``."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = least - 1
        if n < least:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ≥ {least}")
        return n

    return parse


_positive_int = _whole_number(1)
_count = _whole_number(0)


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _positive_ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of whole numbers ≥ 1, e.g. ``1,16,64``."""
    try:
        return tuple(_positive_int(t.strip()) for t in text.split(","))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {e}; give comma-separated whole numbers, e.g. 1,16,64"
        ) from None


def _splits(text: str) -> dict[str, int]:
    """``laminar=6,stream=7``: rollout replicas per schedule."""
    out = {}
    for item in text.split(","):
        arm, eq, n = item.partition("=")
        try:
            out[arm.strip()] = _positive_int(n.strip())
        except argparse.ArgumentTypeError:
            eq = ""
        if not eq or not arm.strip():
            raise argparse.ArgumentTypeError(
                f"{item!r} in {text!r} is not SCHEDULE=REPLICAS; give e.g. laminar=6,stream=7"
            )
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``laminar`` command line: every subcommand and flag."""
    from laminar.pacing import MODELS

    parser = argparse.ArgumentParser(
        prog="laminar", description="Asynchronous RL post-training of LLMs on Dask."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", help="train a policy (pipeline.schedule picks the schedule: laminar by default)"
    )
    run.add_argument("config", nargs="?", help="YAML run config, e.g. configs/tiny.yaml")
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a stopped or lost run in its own directory, from its newest "
        "checkpoint (docs/faults.md)",
    )
    run.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set trainer.steps=20 (repeatable)",
    )
    run.add_argument("--run-dir", help="where the run's stores go (default runs/<timestamp>)")
    where = run.add_mutually_exclusive_group()  # (one scheduler: its address or its file)
    where.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="address of a running Dask scheduler, tcp:// tls:// or ucx:// (default: "
        "cluster.kind of the config, a local cluster unless set)",
    )
    where.add_argument(
        "--scheduler-file",
        metavar="FILE",
        help="the file `dask scheduler --scheduler-file FILE` wrote (HPC recipe)",
    )
    audit = sub.add_parser(
        "audit", help="check a run from its stores: contract, groups, recoveries (exit 1: problems)"
    )
    audit.add_argument("run_dir", metavar="RUN_DIR")
    audit.add_argument("--json", action="store_true", help="print the report as JSON instead")
    certs = sub.add_parser("certs", help="write a new TLS CA, certificate and key to a folder")
    certs.add_argument("dir", help="folder for ca.pem, cert.pem, key.pem")
    certs.add_argument("--force", action="store_true", help="replace a set already in the folder")
    report = sub.add_parser("report", help="plots and a summary page of one or more runs")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    report.add_argument("--out", help="output folder (default RUN_DIR/report of the first run)")
    bench = sub.add_parser("bench", help="a benchmark: prints a table, writes figures + ratios")
    bench.add_argument(
        "name",
        choices=["engine", "relay", "repack", "soak", "schedules", "pacing"],
        help="which benchmark",
    )
    bench.add_argument("--out", metavar="FILE.json", help="write figures, ratios and samples")
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        help="engine, relay, repack, pacing: measurements of each figure (median)",
    )
    bench.add_argument(
        "--batches",
        type=_positive_ints,
        help="engine, pacing: comma-separated batch sizes (engine: 1,16,64,256)",
    )
    bench.add_argument(
        "--contexts",
        type=_positive_ints,
        help="pacing: comma-separated KV tokens per sequence (256,1024,4096)",
    )
    bench.add_argument(
        "--accelerator",
        help="pacing: the accelerator whose datasheet the efficiencies are taken against "
        "(default: the one the device's name says)",
    )
    bench.add_argument("--layers", type=int, help="pacing: decoder layers built (the model's)")
    bench.add_argument(
        "--tp", type=int, help="pacing: time one device's shard of a TP-N replica (1)"
    )
    bench.add_argument(
        "--split-kv",
        type=int,
        help="pacing: decode attention splits each sequence's KV into N chunks (1)",
    )
    bench.add_argument("--new-tokens", type=_positive_int, help="engine: tokens per request (200)")
    bench.add_argument("--threads", type=_positive_int, help="engine: torch threads (1)")
    bench.add_argument("--vllm-python", help="engine: the vLLM environment's python")
    bench.add_argument(
        "--sizes-mb", type=_positive_ints, help="relay: comma-separated weight sizes in MB (64,512)"
    )
    bench.add_argument(
        "--relays", type=_positive_ints, help="relay: comma-separated chain lengths p (2,4,8)"
    )
    bench.add_argument(
        "--protocols", help="relay: comma-separated tcp,ucx (ucx needs .venv-ucx, .ci/ucx-env)"
    )
    bench.add_argument(
        "--senders",
        help="relay: comma-separated relay.sender values to compare, thread,loop (thread)",
    )
    bench.add_argument(
        "--duration-s", type=float, help="repack: wall seconds per arm (90); soak: seconds (600)"
    )
    bench.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="repack, schedules: a config override (repeatable), e.g. "
        "rollout.groups_per_batch=4; repack: repack.* ones apply to the on arm alone; "
        "schedules: every arm's",
    )
    bench.add_argument("--kill-every-s", type=float, help="soak: seconds between worker kills (60)")
    bench.add_argument(
        "--data-apart",
        action="store_true",
        help="soak: the data module on a worker of its own; a killed trainer restarts, and a "
        "killed data module is rebuilt, in the run",
    )
    bench.add_argument(
        "--resume-lost",
        action="store_true",
        help="soak: a killed trainer (and data module) fails the run, which the soak resumes "
        "as a supervisor would (faults.restart_trainer=false), instead of restarting in the run",
    )
    bench.add_argument(
        "--gpus", type=_positive_int, help="schedules, repack: emulated GPUs in all (64)"
    )
    bench.add_argument(
        "--model",
        choices=sorted(MODELS),
        help="repack: the model the replicas serve (7B; 32B is the paper's repack experiment's); "
        "pacing: the decoder's shape (7B)",
    )
    bench.add_argument(
        "--seeds", type=_count, help="schedules: seeds per schedule (3); 0: search the splits only"
    )
    bench.add_argument("--warmup", type=_count, help="schedules: warm-up updates (3)")
    bench.add_argument("--iterations", type=_positive_int, help="schedules: measured updates (6)")
    bench.add_argument(
        "--arms", type=_names, help="schedules: comma-separated subset of the schedules"
    )
    bench.add_argument(
        "--splits",
        type=_splits,
        help="schedules: fixed rollout replicas, e.g. laminar=6,stream=7 (no search)",
    )
    bench.add_argument(
        "--no-search", action="store_true", help="schedules: no split search (model's split)"
    )
    bench.add_argument("--reward-threshold", type=float, help="schedules: time-to-reward target")
    bench.add_argument(
        "--runs-dir", help="schedules, repack: keep the runs here (default: a temp dir)"
    )
    bench.add_argument(
        "--from-runs",
        action="store_true",
        help="schedules: run nothing; the result of the runs --runs-dir kept",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # (--help, or a usage error argparse has printed): its code
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    _quiet_libraries()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # (SIGINT is Python's KeyboardInterrupt already)
    with _handling(STOP_SIGNALS[1:], _signalled):
        return _command(args)


def _command(args: argparse.Namespace) -> int:
    """Run the command ``args`` name; its failures as ``laminar``'s exit codes."""
    try:
        commands = {
            "run": cmd_run,
            "report": cmd_report,
            "bench": cmd_bench,
            "certs": cmd_certs,
            "audit": cmd_audit,
        }
        return commands[args.command](args)
    except (LaminarError, StoreError, FileNotFoundError) as e:
        print(f"laminar: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # (Ctrl-C or a signal outside a run's progress)
        _safely(print, "laminar: interrupted", file=sys.stderr)
        return _exit_code(e)
    except BrokenPipeError:  # (what reads stdout stopped: `laminar audit --json RUN | head`)
        # Its unflushed rest would fail again as Python exits: it goes nowhere instead.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # (as a shell reports a writer its pipe's reader left: 128 + SIGPIPE)


if __name__ == "__main__":
    sys.exit(main())
