"""Benchmarks, one form for all: ``laminar bench NAME [--out FILE.json]``.

A benchmark measures the things it compares side by side in one run (interleaved, so a
noisy neighbour hits all of them alike), repeats each measurement, and reports medians:
a table on stdout and, with ``--out``, JSON holding ``figures`` (name -> median),
``ratios`` (name -> quotient of two figures of this same run), every raw sample
(``samples``) and what it ran on (``machine``, ``options``).

Benchmarks: ``engine`` (generation throughput of each engine and of HF ``generate``),
``relay`` (pipelined chain broadcast vs its model), ``repack`` (repack on vs off),
``soak`` (a long run with a random worker killed every minute; docs/faults.md),
``schedules`` (the five schedules on one emulated cluster; docs/benchmarks.md),
``pacing`` (the pacing model's constants measured on a real accelerator; docs/pacing.md).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from laminar.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


@dataclass
class BenchResult:
    name: str
    figures: dict[str, float | None]
    ratios: dict[str, float | None]
    samples: dict[str, list[float]]
    columns: list[str]
    rows: list[list]
    options: dict
    notes: list[str] = field(default_factory=list)
    # Writes more files beside the JSON (a markdown table, plots): extras(result, out)
    extras: Callable[[BenchResult, Path], list[Path]] | None = None
    # Runs that failed and were left out of every figure (``laminar bench`` exits 1)
    failed: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        import torch

        return {
            "bench": self.name,
            "figures": self.figures,
            "ratios": self.ratios,
            "samples": self.samples,
            "options": self.options,
            "notes": self.notes,
            "failed": self.failed,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "platform": platform.platform(),
            },
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def table(self) -> str:
        cells = [self.columns] + [[_cell(v) for v in row] for row in self.rows]
        widths = [max(len(str(r[i])) for r in cells) for i in range(len(self.columns))]
        lines = ["  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        # (the ratios too: relay's, repack's and soak's headline figures were in the
        # JSON alone; helper 189)
        ratios = [f"ratio: {k} = {_cell(v)}" for k, v in self.ratios.items()]
        return "\n".join(lines + ratios + [f"note: {n}" for n in self.notes])


@contextlib.contextmanager
def stop_on_interrupt(handle: Callable[[], object], timeout_s: float = 600.0):
    """Within it, an interrupt (Ctrl-C; SIGTERM or SIGHUP, which ``laminar`` takes as
    Ctrl-C) stops the run ``handle()`` and waits for it to end in order (the trainer
    checkpoints, the store is flushed) before it goes on up: a bench's polling loop sits
    inside its ``local_cluster``, which the interrupt would otherwise close under the
    live run. (``handle`` is a callable: a soak's run is replaced when it resumes.) One
    raised by :meth:`~pipelines.api.RunHandle.wait` has stopped its run already."""
    try:
        yield
    except KeyboardInterrupt as e:
        from pipelines.api import RunInterrupted

        if isinstance(e, RunInterrupted):
            raise
        run = handle()
        run.stop()
        print(
            f"interrupted: stopping the run in {run.run_dir} in order (trainer checkpoint, "
            "store flush) before the cluster closes",
            file=sys.stderr,
            flush=True,
        )
        try:
            run.wait(timeout=timeout_s)
        except Exception:  # (how the run ended: the interrupt is what ends the bench)
            pass
        raise


def failed_run(why, *, arm: str, replicas: int, run: str, run_dir) -> dict:
    """A bench's record of a run that failed: ``why`` the run's
    :class:`~laminar.errors.RunFailed` or its summary's ``reason``."""
    if isinstance(why, BaseException):
        why = (getattr(why, "summary", None) or {}).get("reason") or why
    return {
        "arm": arm,
        "replicas": replicas,
        "run": run,
        "run_dir": str(run_dir),
        "reason": str(why),
    }


def failed_notes(failed: list[dict]) -> list[str]:
    """The notes that list the runs a result leaves out (the bench exits 1 with them)."""
    return [
        f"FAILED, left out: {f['arm']} R={f['replicas']} {f['run']}: {f['reason']} ({f['run_dir']})"
        for f in failed
    ]


def json_safe(obj, path: str = "") -> tuple[object, list[str]]:
    """``obj`` with every float that is not finite (NaN, ±inf) turned into ``None``, and
    the keys where that happened (list positions as ``[]``, each key once): strict JSON
    has no NaN or Infinity, and ``json.dumps`` writes them unless told not to, a file
    that ``jq``, JavaScript and most parsers other than Python's refuse.

    >>> json_safe({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": (2, -float("inf"))}})
    ({'a': None, 'b': [1.0, None], 'c': {'d': [2, None]}}, ['a', 'b[]', 'c.d[]'])
    """
    bad: list[str] = []

    def walk(x, where: str):
        if type(x).__module__ == "numpy" and hasattr(x, "item") and not hasattr(x, "__len__"):
            x = x.item()  # (a numpy scalar: float32 is no float, and NaN in it no less)
        if isinstance(x, float) and not math.isfinite(x):
            if where not in bad:
                bad.append(where)
            return None
        if isinstance(x, dict):
            return {k: walk(v, f"{where}.{k}" if where else str(k)) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v, f"{where}[]") for v in x]
        return x

    return walk(obj, path), bad


def dumps_strict(data: dict, **kwargs) -> str:
    """``data`` as strict JSON: non-finite floats written as ``null``, and (where ``data``
    has ``notes``) a note naming the keys that held them."""
    clean, bad = json_safe(data)
    if bad and isinstance(clean.get("notes"), list):
        clean["notes"].append(
            "written as null, not finite (NaN or infinite; strict JSON has neither): "
            + ", ".join(bad)
        )
    return json.dumps(clean, allow_nan=False, **kwargs)


def _cell(v) -> str:
    """A table cell.

    >>> [_cell(v) for v in (0.01377, 0.49, 8.0, 123.4, None, "tcp")]
    ['0.0138', '0.49', '8.00', '123', '-', 'tcp']
    """
    if v is None:
        return "-"
    if isinstance(v, float):
        if 0 < abs(v) < 1:  # three significant digits: a 13 ms stall is not "0.01"
            return f"{v:.3g}"
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# -- engine ---------------------------------------------------------------------------------
PROMPT_LEN = 8


def _torch_tok_s(policy, batch: int, new_tokens: int) -> float:
    from laminar.engine import GenerationRequest, SamplingParams
    from laminar.torch_engine import TorchEngine

    model, tok = policy
    eng = TorchEngine(
        model.config,
        model.state_dict(),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_batch=batch,
        max_seq_len=PROMPT_LEN + new_tokens,
    )
    for i in range(batch):
        prompt = tuple(3 + (i + j) % 50 for j in range(PROMPT_LEN))
        sp = SamplingParams(new_tokens, seed=i, ignore_eos=True)
        eng.add_request(GenerationRequest(str(i), prompt, sp))
    t = time.perf_counter()
    produced = 0
    while eng.has_work():
        produced += sum(len(o.response_tokens) for o in eng.step())
    elapsed = time.perf_counter() - t
    assert produced == batch * new_tokens
    return produced / elapsed


def _hf_tok_s(policy, batch: int, new_tokens: int) -> float:
    import torch

    model, tok = policy
    ids = torch.tensor([[3 + (i + j) % 50 for j in range(PROMPT_LEN)] for i in range(batch)])
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tok.pad_token_id,
        )
    elapsed = time.perf_counter() - t
    assert out.shape == (batch, PROMPT_LEN + new_tokens)
    return batch * new_tokens / elapsed


def vllm_python(explicit: str | None = None) -> str | None:
    """The interpreter of the vLLM environment: ``--vllm-python``, ``$LAMINAR_VLLM_PYTHON``,
    or the ``.venv-vllm`` that ``.ci/vllm-env`` builds. One given that does not exist is a
    :class:`~laminar.errors.ConfigError` (it fell through to the others, whose figures
    then read as the one asked for)."""
    from laminar.errors import ConfigError

    if explicit and not Path(explicit).exists():
        raise ConfigError(
            f"--vllm-python {explicit!r} does not exist; give the python of a vLLM "
            "environment (.ci/vllm-env builds .venv-vllm), or leave it out"
        )
    for cand in (explicit, os.environ.get("LAMINAR_VLLM_PYTHON"), REPO / ".venv-vllm/bin/python"):
        if cand and Path(cand).exists():
            return str(cand)
    return None


def _vllm_tok_s(
    python: str, policy_dir: str, batch: int, new_tokens: int, repeats: int, threads: int
):
    cmd = [
        python, "-m", "laminar.vllm_engine", "--bench", "--policy", policy_dir,
        "--batch", str(batch), "--new-tokens", str(new_tokens), "--repeats", str(repeats),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("{")][-1]
    return json.loads(line)["tokens_per_s"]


def bench_engine(
    batches: tuple[int, ...] = (1, 16, 64, 256),
    new_tokens: int = 200,
    repeats: int = 5,
    threads: int = 1,
    vllm: str | None = None,
) -> BenchResult:
    """Decode throughput (tokens/s, ``new_tokens`` per request, EOS ignored) of the torch
    engine, HF ``generate`` and vLLM (in its own environment) at each batch size."""
    import torch

    from laminar.model import build_tiny_policy

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="laminar-bench-") as tmp:
        return _bench_engine(build_tiny_policy(tmp), batches, new_tokens, repeats, threads, vllm)


def _bench_engine(policy_dir, batches, new_tokens, repeats, threads, vllm) -> BenchResult:
    from laminar.model import load_policy

    policy = load_policy(policy_dir)
    python = vllm_python(vllm)
    notes = []
    if python is None:
        notes.append(
            "vLLM skipped: no vLLM environment (build it with .ci/vllm-env, or pass "
            "--vllm-python / set LAMINAR_VLLM_PYTHON)"
        )
    samples: dict[str, list[float]] = {}
    _torch_tok_s(policy, 4, 8)  # warm up kernels and allocator
    for b in batches:
        for _ in range(repeats):  # interleaved: both see the same machine state
            samples.setdefault(f"torch_b{b}", []).append(_torch_tok_s(policy, b, new_tokens))
            samples.setdefault(f"hf_b{b}", []).append(_hf_tok_s(policy, b, new_tokens))
        if python is not None:
            try:
                samples[f"vllm_b{b}"] = _vllm_tok_s(
                    python, str(policy_dir), b, new_tokens, repeats, threads
                )
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                notes.append(f"vLLM at batch {b}: {e}")
    figures, ratios, rows = {}, {}, []
    for b in batches:
        med = {e: _median(samples.get(f"{e}_b{b}", [])) for e in ("torch", "hf", "vllm")}
        for e, v in med.items():
            figures[f"{e}_tok_s_b{b}"] = v
        ratios[f"torch_vs_hf_b{b}"] = _ratio(med["torch"], med["hf"])
        ratios[f"torch_vs_vllm_b{b}"] = _ratio(med["torch"], med["vllm"])
        rows.append(
            [b, med["torch"], med["hf"], med["vllm"], ratios[f"torch_vs_hf_b{b}"],
             ratios[f"torch_vs_vllm_b{b}"]]
        )  # fmt: skip
    return BenchResult(
        name="engine",
        figures=figures,
        ratios=ratios,
        samples=samples,
        columns=["batch", "torch tok/s", "hf tok/s", "vllm tok/s", "torch/hf", "torch/vllm"],
        rows=rows,
        options={
            "batches": list(batches),
            "new_tokens": new_tokens,
            "prompt_tokens": PROMPT_LEN,
            "repeats": repeats,
            "threads": threads,
            "vllm_python": python,
            "statistic": "median",
        },
        notes=notes,
    )


def _bench_relay(**options) -> BenchResult:
    from pipelines.bench_relay import bench_relay

    return bench_relay(**options)


def _bench_repack(**options) -> BenchResult:
    from pipelines.bench_repack import bench_repack

    return bench_repack(**options)


def _bench_schedules(from_runs: bool = False, **options) -> BenchResult:
    from pipelines.bench_schedules import bench_schedules, reanalyse

    if from_runs:
        if not options.get("runs_dir"):
            raise ConfigError("--from-runs re-analyses the runs of --runs-dir DIR: give it")
        kept = ("runs_dir", "warmup", "reward_threshold")
        return reanalyse(**{k: v for k, v in options.items() if k in kept})
    return bench_schedules(**options)


def _bench_pacing(**options) -> BenchResult:
    from pipelines.bench_pacing import bench_pacing

    return bench_pacing(**options)


def _bench_soak(**options) -> BenchResult:
    from pipelines.bench_soak import bench_soak

    return bench_soak(**options)


BENCHES: dict[str, Callable[..., BenchResult]] = {
    "engine": bench_engine,
    "relay": _bench_relay,
    "repack": _bench_repack,
    "soak": _bench_soak,
    "schedules": _bench_schedules,
    "pacing": _bench_pacing,
}


# The function behind each benchmark: the options it takes are its keyword parameters.
_TARGETS = {
    "engine": ("pipelines.bench", "bench_engine"),
    "relay": ("pipelines.bench_relay", "bench_relay"),
    "repack": ("pipelines.bench_repack", "bench_repack"),
    "soak": ("pipelines.bench_soak", "bench_soak"),
    "schedules": ("pipelines.bench_schedules", "bench_schedules"),
    "pacing": ("pipelines.bench_pacing", "bench_pacing"),
}


# Benchmark option -> the `laminar bench` flag that sets it (pipelines/cli.py).
_FLAGS = {
    "repeats": "--repeats",
    "batches": "--batches",
    "new_tokens": "--new-tokens",
    "threads": "--threads",
    "vllm": "--vllm-python",
    "sizes_mb": "--sizes-mb",
    "ps": "--relays",
    "protocols": "--protocols",
    "senders": "--senders",
    "duration_s": "--duration-s",
    "overrides": "--set",
    "kill_every_s": "--kill-every-s",
    "data_apart": "--data-apart",
    "resume": "--resume-lost",
    "gpus": "--gpus",
    "seeds": "--seeds",
    "warmup": "--warmup",
    "iterations": "--iterations",
    "arms": "--arms",
    "splits": "--splits",
    "search": "--no-search",
    "probe_warmup": "--probe-warmup",
    "probe_iterations": "--probe-iterations",
    "reward_threshold": "--reward-threshold",
    "runs_dir": "--runs-dir",
    "from_runs": "--from-runs",
    "model": "--model",
    "contexts": "--contexts",
    "accelerator": "--accelerator",
    "layers": "--layers",
    "tp": "--tp",
    "split_kv": "--split-kv",
}


def bench_options(name: str) -> set[str]:
    """The options benchmark ``name`` takes.

    >>> sorted(bench_options("soak"))
    ['data_apart', 'duration_s', 'kill_every_s', 'resume', 'run_dir', 'seed']
    """
    import importlib
    import inspect

    module, fn = _TARGETS[name]
    params = inspect.signature(getattr(importlib.import_module(module), fn)).parameters
    return set(params) | ({"from_runs"} if name == "schedules" else set())


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: to a temporary file in the same
    folder, then renamed over it. Written in place, an interrupt or a full disk during
    the write left a truncated JSON where the previous result was (hours of a bench)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # (not mkstemp: its file is the user's alone, and the rename would keep that)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_options(name: str, options: dict) -> None:
    """Refuse a benchmark ``name`` that does not exist, or an option it does not take
    (naming the ones it does), before anything runs or is made."""
    if name not in BENCHES:
        raise KeyError(f"no benchmark {name!r}; known: {sorted(BENCHES)}")
    takes = bench_options(name)
    unknown = set(options) - takes
    if unknown:
        cli = sorted(_FLAGS[k] for k in takes if k in _FLAGS)
        python = sorted(k for k in takes if k not in _FLAGS)
        raise ConfigError(
            f"laminar bench {name} does not take "
            + ", ".join(f"{_FLAGS.get(k, k)}" for k in sorted(unknown))
            + f"; it takes {', '.join(cli) or 'no option'}"
            + (f" (and from Python: {', '.join(python)})" if python else "")
        )


def run_bench(name: str, out: str | None = None, **options) -> BenchResult:
    """Run benchmark ``name``, print its table, write its JSON to ``out`` if given. An
    option the benchmark does not take is refused, naming the ones it does."""
    check_options(name, options)
    if out and name == "schedules" and Path(out).suffix.lower() in (".md", ".png"):
        raise ConfigError(
            f"--out {out!r}: the schedules bench writes its table (.md) and plots (.png) "
            f"beside the JSON, over this file; give a .json path, e.g. "
            f"{Path(out).with_suffix('.json')}"
        )
    result = BENCHES[name](**options)
    print(result.table())
    if out:
        write_atomically(Path(out), dumps_strict(result.to_json(), indent=2))
        print(f"wrote {out}", file=sys.stderr)
        for path in result.extras(result, Path(out)) if result.extras else []:
            print(f"wrote {path}", file=sys.stderr)
    return result
