"""The benchmark harness around the measurements: what ``laminar bench`` writes, and the
checks of its options that must hold before a bench starts (a bench runs minutes to
hours). Every bench here is a stub measure function or a pure function: what is tested
is the harness, not a cluster."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipelines import bench


def _strict(text: str):
    """JSON as a strict parser reads it: NaN and Infinity are not JSON."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _stub_result(**figures) -> bench.BenchResult:
    return bench.BenchResult(
        name="engine",
        figures=figures,
        ratios={"a_vs_b": figures.get("a", 1.0)},
        samples={"a": [1.0, math.nan]},
        columns=["x"],
        rows=[[1.0]],
        options={},
    )


@pytest.fixture
def stub_engine(monkeypatch):
    """``laminar bench engine`` measuring nothing: it returns what the test sets."""
    box = {}
    monkeypatch.setitem(bench.BENCHES, "engine", lambda **options: box["result"])
    return box


def test_out_is_strict_json_with_non_finite_figures_null_and_named(tmp_path, stub_engine):
    stub_engine["result"] = _stub_result(a=math.nan, b=-math.inf, c=2.0)
    out = tmp_path / "engine.json"
    bench.run_bench("engine", str(out))
    data = _strict(out.read_text())
    assert data["figures"] == {"a": None, "b": None, "c": 2.0}
    assert data["ratios"] == {"a_vs_b": None} and data["samples"] == {"a": [1.0, None]}
    note = next(n for n in data["notes"] if "written as null" in n)
    assert all(k in note for k in ("figures.a", "figures.b", "ratios.a_vs_b", "samples.a[]"))
    assert "figures.c" not in note


def test_strict_json_turns_numpy_scalars_that_are_not_finite_into_null():
    import numpy as np

    text = bench.dumps_strict({"x": np.float32("nan"), "y": np.int64(3), "notes": []})
    assert _strict(text)["x"] is None and _strict(text)["y"] == 3


def test_every_committed_json_in_docs_is_strict_json():
    from pathlib import Path

    for path in sorted((Path(bench.REPO) / "docs").glob("*.json")):
        _strict(path.read_text())


@pytest.fixture
def no_local_cluster(monkeypatch):
    """A bench that got past its checks would start its cluster: fail instead."""

    def refuse(*a, **k):
        raise AssertionError("the bench's cluster was started")

    monkeypatch.setattr("laminar.cluster.local_cluster", refuse)


@pytest.mark.parametrize(
    "splits, why",
    [
        ({"laminar": 16}, "--splits laminar=16: at 64 GPUs give 1 to 15 replicas"),
        ({"stream": 5, "sync": 17}, "--splits sync=17: at 64 GPUs give 1 to 16 replicas"),
    ],
)
def test_a_split_the_cluster_cannot_hold_is_refused_before_any_run(splits, why, no_local_cluster):
    """Checked before the first run, not when the arm's turn comes after the others ran."""
    from laminar.errors import ConfigError
    from pipelines.bench_schedules import bench_schedules

    with pytest.raises(ConfigError) as e:
        bench_schedules(gpus=64, splits=splits)
    assert why in str(e.value)


COLS = ("stall_s", "host_copy_s", "naive_s", "broadcast_s", "model_s", "model_loaded_s")
COLS += ("wait_s", "t_byte", "t_start")


def _relay_figures(protocols, ps, sizes_mb=(64,), senders=("thread",)) -> dict[str, float]:
    """The figures a relay bench of these variants would hold, every one 2.0 but tcp's
    1.0 (a stub of the measurements: only their names matter here)."""
    figures = {}
    for proto in protocols:
        for sender in senders:
            beside = sender == "loop" and "thread" in senders
            pre = ("" if proto == "tcp" else f"{proto}_") + ("loop_" if beside else "")
            for mb in sizes_mb:
                for p in ps:
                    for c in COLS:
                        figures[f"{pre}m{mb}_p{p}_{c}"] = 1.0 if proto == "tcp" else 2.0
    return figures


def test_relay_ratios_without_tcp_say_why_there_is_no_comparison_with_it():
    from pipelines.bench_relay import relay_ratios

    ratios, notes = relay_ratios(
        _relay_figures(["ucx"], (2, 4)), (64,), (2, 4), ("ucx",), ("thread",)
    )
    assert ratios["ucx_m64_p4_broadcast_vs_model"] == 1.0
    assert not any("_vs_tcp_" in k for k in ratios)
    assert any("tcp was not measured" in n for n in notes)
    ratios, notes = relay_ratios(
        _relay_figures(["tcp", "ucx"], (2, 4)), (64,), (2, 4), ("tcp", "ucx"), ("thread",)
    )
    assert ratios["ucx_vs_tcp_m64_p4_broadcast"] == 2.0 and not notes


def test_relay_bench_refuses_a_protocol_it_does_not_know_before_measuring(monkeypatch):
    from laminar.errors import ConfigError
    from pipelines import bench_relay

    def refuse(*a, **k):
        raise AssertionError("measured")

    monkeypatch.setattr(bench_relay, "measure", refuse)
    with pytest.raises(ConfigError, match="--protocols udp: each must be one of tcp, ucx"):
        bench_relay.bench_relay(protocols=("udp",))


def test_relay_headline_ratios_are_named_after_the_chains_measured():
    from pipelines.bench_relay import relay_ratios

    args = ((64, 512), ("tcp",), ("thread",))
    ratios, _ = relay_ratios(
        _relay_figures(["tcp"], (2, 4, 8), (64, 512)), args[0], (2, 4, 8), *args[1:]
    )
    assert {"stall_p8_vs_p2", "broadcast_vs_model_p8", "naive_stall_p8_vs_relay_stall_p8"} <= set(
        ratios
    )
    ratios, _ = relay_ratios(_relay_figures(["tcp"], (3, 6), (64, 512)), args[0], (3, 6), *args[1:])
    assert {"stall_p6_vs_p3", "broadcast_vs_model_p6", "naive_stall_p6_vs_relay_stall_p6"} <= set(
        ratios
    )
    assert not any("p8" in k or "p2" in k for k in ratios)


def test_relay_bench_keeps_every_publications_measurements_as_its_samples(monkeypatch):
    from pipelines import bench_relay

    def measure(p, nbytes, repeats, protocol="tcp", sender="thread"):
        pubs = [{"stall_s": 0.1 * (i + 1), "wait_s": 0.2} for i in range(repeats)]
        row = {c: 1.0 for c in bench_relay.COLUMNS + ["t_byte", "t_start", "t_byte_loaded"]}
        return row | {"samples": {"publications": pubs, "scatter_s": [0.5] * repeats}}

    monkeypatch.setattr(bench_relay, "measure", measure)
    result = bench_relay.bench_relay(sizes_mb=(64,), ps=(2, 4), repeats=3)
    assert set(result.samples) == {"m64_p2", "m64_p4"}
    assert [r["stall_s"] for r in result.samples["m64_p4"]["publications"]] == pytest.approx(
        [0.1, 0.2, 0.3]
    )


def test_arms_run_each_once_in_the_tables_order_whatever_order_they_are_given_in():
    """Given first, the ablation was searched alone (the docs say it runs at Laminar's
    split); an arm named twice ran twice into the same run directories."""
    from pipelines.bench_schedules import ordered_arms

    assert ordered_arms(("laminar_no_repack", "laminar", "laminar")) == (
        "laminar",
        "laminar_no_repack",
    )


@pytest.mark.parametrize(
    "key, flag",
    [
        ("seed=1", "--seeds"),
        ("pipeline.schedule=sync", "--arms"),
        ("rollout.replicas=4", "--splits"),
        ("trainer.pacing.gpus=8", "--gpus"),
        ("trainer.steps=3", "--warmup and --iterations"),
        ("rollout.pacing.dilation=1", "--gpus"),
    ],
)
def test_a_set_of_a_key_the_bench_sets_per_run_is_refused_naming_its_flag(
    key, flag, no_local_cluster
):
    """`--set seed=1` gave three "seeds" that all ran seed 1."""
    from laminar.errors import ConfigError
    from pipelines.bench_schedules import bench_schedules

    with pytest.raises(ConfigError) as e:
        bench_schedules(arms=("laminar",), overrides=("trainer.lr=1e-4", key))
    assert f"--set {key}: the bench sets" in str(e.value) and f"use {flag}" in str(e.value)


def test_a_set_of_repack_goes_to_the_arms_with_repack_on_alone(no_local_cluster):
    """In every arm's config, a repack section refused the other schedules (the bench
    aborted at sync) and switched repack on in laminar_no_repack."""
    from pipelines.bench_schedules import arm_set, bench_schedules

    assert arm_set("laminar_no_repack", ["repack.max_batch=4"]) == []
    with pytest.raises(AssertionError, match="cluster was started"):  # (its checks passed)
        bench_schedules(
            arms=("sync", "laminar", "laminar_no_repack"), overrides=("repack.max_batch=4",)
        )


class _InterruptedRun:
    """A stand-in run, interrupted at its first poll (Ctrl-C): records what was asked of it."""

    run_dir = "RUN"

    def __init__(self):
        self.calls = []

    def progress(self):
        raise KeyboardInterrupt

    def done(self):
        return False

    def stop(self):
        self.calls.append("stop")

    def wait(self, timeout=None):
        self.calls.append("wait")
        return {"reason": "stopped"}


def test_an_interrupt_in_the_repack_benchs_polling_stops_the_run_in_order_then_goes_on_up(
    monkeypatch, tmp_path
):
    """The polling loop runs inside the bench's local_cluster: the interrupt unwound
    through it, closing the cluster under the live run, never stopped or flushed."""
    import pipelines
    from pipelines.bench_repack import _arm

    run = _InterruptedRun()
    monkeypatch.setattr(pipelines, "submit", lambda *a, **k: run)
    with pytest.raises(KeyboardInterrupt):
        _arm(None, tmp_path / "run", [], 10.0, None, 0.25)
    assert run.calls == ["stop", "wait"]


def test_an_interrupt_the_run_stopped_on_already_is_not_stopped_again():
    from pipelines.api import RunInterrupted
    from pipelines.bench import stop_on_interrupt

    run = _InterruptedRun()
    with pytest.raises(RunInterrupted), stop_on_interrupt(lambda: run):
        raise RunInterrupted("stopped in order", {})
    assert run.calls == []
    with pytest.raises(KeyboardInterrupt), stop_on_interrupt(lambda: run):
        run.progress()
    assert run.calls == ["stop", "wait"]


def test_the_schedules_bench_says_where_it_keeps_its_runs_before_the_first(
    monkeypatch, tmp_path, capsys, no_local_cluster
):
    """Without --runs-dir the runs went to a temporary folder named nowhere before the
    end: a bench stopped before it could not be re-analysed (--from-runs)."""
    import tempfile

    from pipelines.bench_schedules import bench_schedules

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(AssertionError, match="cluster was started"):
        bench_schedules(arms=("laminar",))
    (root,) = tmp_path.glob("laminar-bench-schedules-*")
    assert f"--from-runs --runs-dir {root}" in capsys.readouterr().out


@pytest.fixture
def repack_without_a_cluster(monkeypatch):
    """``laminar bench repack`` whose arms are stubs: each returns the same figures, but
    ``fail`` (a set of (arm, pair)) fails, as a run that stopped on an error does."""
    import contextlib

    import distributed

    from laminar.errors import RunFailed
    from pipelines import bench_repack

    fail = set()
    calls = []

    def arm(client, run_dir, overrides, duration_s, scale, warmup):
        run_dir.mkdir(parents=True)
        arm, rep = run_dir.name.split("-")
        calls.append(run_dir)
        if (arm, int(rep)) in fail:
            raise RunFailed("stub failure", {"reason": "failed: stub"})
        return dict.fromkeys(
            ("gen_tok_s", "kv_util_mean", "latency_mean_s", "latency_max_s", "step_ms")
            + ("decode_batch", "moves", "overhead_frac", "freed_replica_s")
            + ("latency_trajectories", "pause_s"),
            1.0,
        )

    monkeypatch.setattr(bench_repack, "_arm", arm)
    monkeypatch.setattr(
        "laminar.cluster.local_cluster", lambda *a, **k: contextlib.nullcontext(None)
    )
    monkeypatch.setattr(distributed, "Client", lambda c: contextlib.nullcontext(None))
    return fail, calls


def test_the_repack_bench_keeps_its_runs_where_a_run_failed_and_records_no_removed_path(
    repack_without_a_cluster, monkeypatch, tmp_path
):
    """The temporary folder was removed before the result was built: options.runs and
    failed[].run_dir named folders that were gone."""
    import tempfile

    from pipelines.bench_repack import bench_repack

    fail, calls = repack_without_a_cluster
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = bench_repack(repeats=2)
    assert result.options["runs"] is None and not list(tmp_path.iterdir())
    fail.add(("off", 1))
    result = bench_repack(repeats=2)
    assert Path(result.options["runs"]).is_dir()
    assert Path(result.failed[0]["run_dir"]).is_dir()


def test_the_repack_benchs_samples_hold_every_figure_of_every_run(repack_without_a_cluster):
    """The samples held the table's columns alone: pause_s, decode_unmodelled and the
    other figures of each run could not be read back from the JSON, only their medians."""
    from pipelines.bench_repack import bench_repack

    result = bench_repack(repeats=2)
    assert result.samples["on_pause_s"] == [1.0, 1.0] and "off_pause_s" in result.samples
    assert {k.split("_", 1)[1] for k in result.figures} <= {
        k.split("_", 1)[1] for k in result.samples
    }


def test_an_emulated_cluster_too_small_for_a_replica_and_a_trainer_is_refused():
    from laminar.errors import ConfigError
    from pipelines.bench_schedules_cluster import Cluster

    with pytest.raises(ConfigError, match="--gpus 4: the emulated cluster needs at least 8"):
        Cluster(4)
    assert Cluster(8).balanced_replicas() == 1


def test_the_soaks_last_minute_ends_where_the_soak_did_not_after_its_shutdown():
    """Taken after the stop, flush and cluster shutdown (here 20 s in which nothing
    finishes), the last minute held that time and read the soak's throughput low."""
    import numpy as np

    from pipelines.bench_soak import first_and_last_minute

    t = np.arange(0.0, 120.0, 1.0)  # one token a second, the soak's 120 s
    first, last = first_and_last_minute(t, np.ones_like(t), 0.0, 120.0)
    assert last / first == 1.0
    first, late = first_and_last_minute(t, np.ones_like(t), 0.0, 140.0)
    assert late / first == pytest.approx(40 / 60)


def test_an_arm_whose_every_probe_failed_has_no_split_and_says_so():
    """The search returned its start when every probe failed (each -inf): a failed probe
    was the chosen split, and the arm was measured there."""
    from pipelines.bench_schedules import Cluster, _search_result, search_split

    best, seen = search_split(lambda r: -math.inf, lo=1, hi=15, start=5)
    assert best is None and seen
    best, _ = search_split(lambda r: -math.inf if r == 5 else -abs(r - 9), lo=1, hi=15, start=5)
    assert best == 9  # (one failed probe, the others measured: the best of those)
    result = _search_result(Cluster(64), ["laminar"], {}, {"laminar": seen}, "d")
    assert result.figures["laminar_replicas"] is None
    assert result.rows[0][-1].startswith("search failed")


def test_out_is_written_whole_through_a_file_beside_it_renamed_over_it(
    tmp_path, stub_engine, monkeypatch
):
    """Written in place, an interrupt or a full disk mid-write left a truncated JSON
    where the previous result was."""
    import os

    renames = []
    real = os.replace

    def replace(src, dst):
        renames.append((Path(src), Path(dst)))
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    stub_engine["result"] = _stub_result(a=1.0)
    out = tmp_path / "engine.json"
    out.write_text("the previous result")
    bench.run_bench("engine", str(out))
    ((src, dst),) = renames
    assert dst == out and src.parent == tmp_path and _strict(out.read_text())["figures"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine.json"]


def test_a_schedules_out_its_table_or_plot_would_overwrite_is_refused_before_the_bench(
    monkeypatch,
):
    from laminar.errors import ConfigError

    def refuse(**options):
        raise AssertionError("the bench was started")

    monkeypatch.setitem(bench.BENCHES, "schedules", refuse)
    for out in ("s.md", "s.PNG"):
        with pytest.raises(ConfigError, match="give a .json path"):
            bench.run_bench("schedules", out)


def test_relay_ratios_compare_the_loop_sender_with_the_thread_one_of_each_protocol():
    """Both senders measured: the loop sender's figures (prefixed ``loop_``, after a
    protocol's own prefix) are compared with the thread sender's, cell by cell, and the
    headline names the longest chain."""
    from pipelines.bench_relay import relay_ratios

    senders = ("thread", "loop")
    figures = _relay_figures(["tcp", "ucx"], (2, 3), (1,), senders)
    for k in figures:
        if "loop_" in k:
            figures[k] *= 3.0
    ratios, _ = relay_ratios(figures, (1,), (2, 3), ("tcp", "ucx"), senders)
    assert ratios["loop_vs_thread_m1_p3_broadcast"] == 3.0
    assert ratios["ucx_loop_vs_thread_m1_p2_stall"] == 3.0
    assert ratios["broadcast_loop_vs_thread_p3"] == 3.0


def test_the_benches_find_their_config_from_any_working_directory(tmp_path, monkeypatch):
    """repack, schedules and soak loaded 'configs/tiny.yaml' from the working directory:
    run from anywhere but the checkout's root they stopped at once, "config file
    'configs/tiny.yaml' does not exist" (helper 189)."""
    from pathlib import Path

    from laminar.config import load_config
    from pipelines import bench_repack, bench_schedules, bench_soak
    from pipelines.bench_schedules_cluster import TINY_CONFIG

    monkeypatch.chdir(tmp_path)
    assert Path(TINY_CONFIG).is_absolute()
    load_config(TINY_CONFIG)
    for module in (bench_repack, bench_schedules, bench_soak):
        assert '"configs/tiny.yaml"' not in Path(module.__file__).read_text()


def test_the_printed_table_gives_the_ratios():
    """relay's, repack's and soak's ratios (repack's headline gen_throughput_on_vs_off)
    were in the JSON alone: the printed table now ends with every ratio (helper 189)."""
    from pipelines.bench import BenchResult

    result = BenchResult(
        name="x",
        figures={"on": 157362.0, "off": 116094.0},
        ratios={"gen_throughput_on_vs_off": 157362.0 / 116094.0, "not_measured": None},
        samples={},
        columns=["arm", "tok/s"],
        rows=[["on", 157362.0], ["off", 116094.0]],
        options={},
        notes=["a note"],
    )
    lines = result.table().splitlines()
    assert lines[-3:] == [
        "ratio: gen_throughput_on_vs_off = 1.36",
        "ratio: not_measured = -",
        "note: a note",
    ]


@pytest.mark.parametrize(
    ("runs_dir", "failed", "kept"),
    [(None, [], False), (None, [{"arm": "sync"}], True), ("given", [], True)],
    ids=["temporary", "a_run_failed", "runs_dir_given"],
)
def test_the_schedules_bench_removes_its_temporary_runs_unless_a_run_failed(
    tmp_path, runs_dir, failed, kept
):
    """It kept every run in /tmp for good (36 MB for two one-update runs; helper 189):
    like repack's, its temporary folder goes at the end, unless a run failed; a folder
    given as --runs-dir stays."""
    from pipelines.bench import BenchResult
    from pipelines.bench_schedules import _tidy

    root = tmp_path / "runs"
    (root / "sync-r16-s0").mkdir(parents=True)
    result = BenchResult("schedules", {}, {}, {}, [], [], {"runs": str(root)}, failed=failed)
    result = _tidy(result, root, str(root) if runs_dir else None)
    assert root.exists() == kept
    assert result.options["runs"] == (str(root) if kept else None)
