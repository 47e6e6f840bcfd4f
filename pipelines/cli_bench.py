"""``laminar bench``: its flags checked before a bench starts (a bench runs minutes to
hours before it would trip on them), its options handed to
:func:`pipelines.bench.run_bench`, and the argparse types of its list flags.

Apart from :mod:`pipelines.cli` because the benches' flags are most of the command line;
the parser that declares them stays there, whole.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from pipelines.run_dir import _file_in_the_way


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
    if args.name == "soak":
        duration = 600.0 if args.duration_s is None else args.duration_s
        every = 60.0 if args.kill_every_s is None else args.kill_every_s
        if every >= duration:  # (it ran to the end and measured no recovery at all)
            raise ConfigError(
                f"laminar bench soak: --kill-every-s {every:g} is not below --duration-s "
                f"{duration:g}, so no worker would be killed; give a --kill-every-s below "
                "the duration (the soak measures recoveries), or a longer --duration-s"
            )
    if args.protocols and "ucx" in args.protocols:
        from laminar.deploy import ucx_is_installed

        # (else: "Scheduler failed to start.", naming cluster.protocol, which it has not)
        ucx_is_installed("--protocols", ",".join(args.protocols), "give --protocols tcp")
    if args.vllm_python:
        from pipelines.bench import vllm_python

        vllm_python(args.vllm_python)  # (one that does not exist: refused now, not minutes on)
    runs_dir = getattr(args, "runs_dir", None)
    if runs_dir and not args.from_runs:
        path = Path(runs_dir).expanduser()
        blocker = _file_in_the_way(path)
        if blocker is not None:  # (it failed minutes on, in a traceback, or named --run-dir)
            raise ConfigError(
                f"--runs-dir {runs_dir!r}: {str(blocker)!r} is a file, not a folder; give "
                "a folder's path (made if missing) for the bench to keep its runs in"
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
            "--probe-iterations": args.probe_iterations,
            "--probe-warmup": args.probe_warmup,
            "--seeds": args.seeds,
            "--set": args.set,
            "--splits": args.splits,
        }
        # (`is`: `0 in (None, False)` is true, and --seeds 0 is given)
        given = [flag for flag, v in run_only.items() if v is not None and v is not False]
        if given:
            raise ConfigError(
                "--from-runs computes the result of the runs --runs-dir kept, as they were "
                f"run: drop {', '.join(given)} (it takes --warmup, --reward-threshold, --out)"
            )
    probe = [
        f
        for f, v in (
            ("--probe-warmup", args.probe_warmup),
            ("--probe-iterations", args.probe_iterations),
        )
        if v is not None
    ]
    if probe and args.no_search:
        raise ConfigError(
            f"{' and '.join(probe)} set the split search's probes, and --no-search runs none: "
            "drop one or the other"
        )
    from pipelines.bench_schedules import ARMS

    for flag, names in (("--arms", args.arms or ()), ("--splits", args.splits or {})):
        for name in names:
            if name not in ARMS:
                raise ConfigError(f"unknown schedule {name!r} in {flag}; known: {', '.join(ARMS)}")


def cmd_bench(args: argparse.Namespace) -> int:
    from pipelines.bench import check_options, run_bench

    _check_bench_flags(args)
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
        options["protocols"] = args.protocols
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
        "probe_warmup",
        "probe_iterations",
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
    # (the flags first: a command refused for one left the folder of its --out made)
    check_options(args.name, options)
    if args.out:
        _check_out(args.out)
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


def _emulated_gpus(text: str) -> int:
    """``--gpus``: at least two replicas' GPUs (one replica and the trainer's ≥ 1 GPU,
    in replicas of 4: :class:`pipelines.bench_schedules_cluster.Cluster`)."""
    from pipelines.bench_schedules_cluster import MIN_GPUS

    return _whole_number(MIN_GPUS)(text)


def _names(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _protocols(text: str) -> tuple[str, ...]:
    """``--protocols``: comma-separated, each tcp or ucx (the relay bench's)."""
    from pipelines.bench_relay import PROTOCOLS

    names = _names(text)
    bad = [n for n in names if n not in PROTOCOLS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give comma-separated protocols, each one of {', '.join(PROTOCOLS)}"
        )
    return tuple(dict.fromkeys(names))


def _whole_numbers(least: int, example: str):
    """An argparse ``type``: a comma-separated list of whole numbers ≥ ``least``."""
    one = _whole_number(least)

    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(one(t.strip()) for t in text.split(","))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {e}; give comma-separated whole numbers, e.g. {example}"
            ) from None

    return parse


# ``1,16,64``; chain lengths from 2 (a chain of one relay has no hop to measure)
_positive_ints = _whole_numbers(1, "1,16,64")
_chain_lengths = _whole_numbers(2, "2,4,8")


def _finite(text: str) -> float:
    """An argparse ``type``: a number, not NaN or infinite (every comparison with NaN is
    false: a NaN threshold is never reached, a NaN duration never ends)."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return x


def _positive_seconds(text: str) -> float:
    """An argparse ``type``: seconds, a finite number > 0."""
    x = _finite(text)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds > 0")
    return x


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
