"""The benchmark harness around the measurements: what ``laminar bench`` writes, and the
checks of its options that must hold before a bench starts (a bench runs minutes to
hours). Every bench here is a stub measure function or a pure function: what is tested
is the harness, not a cluster."""

from __future__ import annotations

import json
import math

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
