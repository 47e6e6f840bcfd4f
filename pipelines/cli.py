"""The ``laminar`` command: a thin shell over :mod:`pipelines.api` and :mod:`pipelines.report`::

laminar run CONFIG [--set k=v ...] [--run-dir DIR] [--scheduler ADDRESS | --scheduler-file F]
laminar run --resume RUN_DIR [--set k=v ...] [--scheduler ADDRESS | --scheduler-file F]
laminar certs DIR
laminar audit RUN_DIR [--json] [--tokens]
laminar report RUN_DIR [RUN_DIR ...] [--out DIR]
laminar bench NAME [--out FILE.json] [--repeats N] [...]

Here: the parser (every subcommand and flag), :func:`main` (the console entry point) and
the small commands (``audit``, ``certs``, ``report``). ``laminar run`` is
:mod:`pipelines.cli_run`, what it shows :mod:`pipelines.cli_display`, ``laminar bench``'s
checks and options :mod:`pipelines.cli_bench`, and how a command stops on a signal
:mod:`pipelines.cli_signals`.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time  # noqa: F401 — (tests reach time.sleep as pipelines.cli.time.sleep)
from pathlib import Path

from laminar.errors import LaminarError
from pipelines.cli_bench import (
    _chain_lengths,
    _count,
    _emulated_gpus,
    _finite,
    _names,
    _positive_int,
    _positive_ints,
    _positive_seconds,
    _protocols,
    _splits,
    cmd_bench,
)
from pipelines.cli_display import _print_summary as _print_summary  # (re-exported: tests call it)
from pipelines.cli_run import _follow as _follow  # (re-exported: tests call it)
from pipelines.cli_run import _watch as _watch  # (re-exported: tests call it)
from pipelines.cli_run import cmd_run
from pipelines.cli_signals import STOP_SIGNALS, _exit_code, _handling, _safely, _signalled
from pipelines.run_dir import _file_in_the_way
from storage.trajectories import StoreError


def cmd_audit(args: argparse.Namespace) -> int:
    from storage.audit import audit_run

    report = audit_run(args.run_dir, tokens=args.tokens)
    if args.json:  # (alone on stdout, for a script to parse)
        from pipelines.bench import dumps_strict

        print(dumps_strict(report.to_dict(), indent=2, default=float))
    else:
        print(report.text())
    return 0 if report.ok else 1


def cmd_certs(args: argparse.Namespace) -> int:
    import shlex

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
    # (quoted for the shell it is pasted into: a folder "my certs" split into two words)
    q = {field: shlex.quote(path) for field, path in paths.items()}
    print(
        f"\ndask scheduler --tls-ca-file {q['ca_file']} --tls-cert {q['cert']} "
        f"--tls-key {q['key']} --protocol tls ...\n"
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
    # The figures this report links (an earlier report's in the same folder are not).
    for name in re.findall(r"^!\[[^\]]*\]\(([^)]+)\)$", report.read_text(), re.MULTILINE):
        print(f"figure             {report.parent / name}")
    return 0


def _user_path(text: str) -> str:
    """An argparse ``type`` for a path: ``~`` expanded. The shell does not expand it after
    ``=`` (``--out=~/b.json``): taken as it was, a folder named ``~`` was made here."""
    return os.path.expanduser(text)


# What each benchmark measures, and where its page is (`laminar bench NAME --help`).
BENCH_ABOUT = {
    "engine": "tokens/s of the torch engine, HF generate and vLLM by batch (docs/engines.md)",
    "relay": "the publisher's stall and a chunked broadcast along relay chains, against "
    "naive fan-out, scatter and replicate (docs/relay.md)",
    "repack": "repack on against off on the paced, tail-heavy workload (docs/repack.md)",
    "soak": "a long run with a random worker SIGKILLed every minute (docs/faults.md, Soak)",
    "schedules": "the five schedules on the emulated cluster, side by side (docs/schedules.md)",
    "pacing": "the pacing model's constants measured on this device (docs/pacing.md)",
}


class _BenchHelp(argparse.Action):
    """``laminar bench NAME --help``: the flags benchmark NAME takes (each refuses the
    others); without a NAME, every flag, each saying which benchmarks take it."""

    def __call__(self, parser, namespace, values, option_string=None):
        from pipelines.bench import _FLAGS, bench_options

        name = getattr(namespace, "name", None)
        if name is None:
            parser.print_help()
            parser.exit()
        takes = {_FLAGS[o] for o in bench_options(name) if o in _FLAGS} | {"--out", "--help"}
        own = argparse.ArgumentParser(
            prog=f"laminar bench {name}", description=BENCH_ABOUT[name], add_help=False
        )
        for action in parser._actions:
            if action.option_strings and action.option_strings[-1] in takes:
                own._add_action(action)
        own.print_help()
        parser.exit()


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
        type=_user_path,
        help="continue a stopped or lost run in its own directory, from its newest "
        "checkpoint (docs/faults.md)",
    )
    run.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set trainer.steps=20 (repeatable)",
    )
    run.add_argument(
        "--run-dir", type=_user_path, help="where the run's stores go (default runs/<timestamp>)"
    )
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
    audit.add_argument(
        "--tokens",
        action="store_true",
        help="also read every token array (ids, loss masks, the trained tokens' logprobs)",
    )
    certs = sub.add_parser("certs", help="write a new TLS CA, certificate and key to a folder")
    certs.add_argument("dir", help="folder for ca.pem, cert.pem, key.pem")
    certs.add_argument("--force", action="store_true", help="replace a set already in the folder")
    report = sub.add_parser("report", help="plots and a summary page of one or more runs")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories to compare")
    report.add_argument("--out", help="output folder (default RUN_DIR/report of the first run)")
    bench = sub.add_parser(
        "bench",
        help="a benchmark: prints a table, writes figures + ratios",
        add_help=False,
        description="`laminar bench NAME --help` lists the flags NAME takes.",
    )
    bench.add_argument(
        "-h", "--help", action=_BenchHelp, nargs=0, help="show this help message and exit"
    )
    bench.add_argument(
        "name",
        choices=["engine", "relay", "repack", "soak", "schedules", "pacing"],
        help="which benchmark",
    )
    bench.add_argument(
        "--out", metavar="FILE.json", type=_user_path, help="write figures, ratios and samples"
    )
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
        "--relays", type=_chain_lengths, help="relay: comma-separated chain lengths p (2,4,8)"
    )
    bench.add_argument(
        "--protocols",
        type=_protocols,
        help="relay: comma-separated tcp,ucx (ucx needs .venv-ucx, .ci/ucx-env)",
    )
    bench.add_argument(
        "--senders",
        help="relay: comma-separated relay.sender values to compare, thread,loop (thread)",
    )
    bench.add_argument(
        "--duration-s",
        type=_positive_seconds,
        help="repack: wall seconds per arm (90); soak: seconds (600)",
    )
    bench.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="repack, schedules: a config override (repeatable), e.g. "
        "rollout.groups_per_batch=4; repack: repack.* ones apply to the on arm alone; "
        "schedules: every arm's",
    )
    bench.add_argument(
        "--kill-every-s", type=_positive_seconds, help="soak: seconds between worker kills (60)"
    )
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
        "--gpus",
        type=_emulated_gpus,
        help="schedules, repack: emulated GPUs in all, at least 8 (64)",
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
        help="schedules: fixed rollout replicas of the arms named, e.g. laminar=6,stream=7 "
        "(those are not searched, the others still are, unless --no-search)",
    )
    bench.add_argument(
        "--no-search", action="store_true", help="schedules: no split search (model's split)"
    )
    bench.add_argument(
        "--probe-warmup", type=_count, help="schedules: warm-up updates of a split probe (2)"
    )
    bench.add_argument(
        "--probe-iterations",
        type=_positive_int,
        help="schedules: measured updates of a split probe (4)",
    )
    bench.add_argument("--reward-threshold", type=_finite, help="schedules: time-to-reward target")
    bench.add_argument(
        "--runs-dir",
        type=_user_path,
        help="schedules, repack: keep the runs here (default: a temporary folder, removed "
        "at the end unless a run fails or the bench is stopped)",
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
