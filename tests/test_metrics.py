"""metrics.zarr: flexible columns, commit marker, pivoted rollout table."""

import numpy as np
import pytest

from storage.metrics import MetricsWriter, open_metrics


def test_columns_appear_and_back_fill(tmp_path):
    w = MetricsWriter(tmp_path)
    w.append(
        "cluster", [{"elapsed_s": 0.5, "buffer_depth": 3}, {"elapsed_s": 1.0, "buffer_depth": 5}]
    )
    w.append("cluster", [{"elapsed_s": 1.5, "buffer_depth": 4, "oldest_buffered_age_s": 0.2}])
    ds = open_metrics(tmp_path, "cluster")
    assert ds["time"].values.tolist() == [0.5, 1.0, 1.5]
    assert ds["buffer_depth"].values.tolist() == [3, 5, 4]
    assert np.isnan(ds["oldest_buffered_age_s"].values[:2]).all()
    assert ds["buffer_depth"].sel(time=1.0).item() == 5


def test_cluster_table_resamples_by_wall_time(tmp_path):
    w = MetricsWriter(tmp_path)
    rows = [{"elapsed_s": t, "wall_time": 1.8e9 + t, "inserted": 10 * t} for t in range(30)]
    w.append("cluster", rows)
    ds = open_metrics(tmp_path, "cluster")
    per_10s = ds.swap_dims(time="wall_time")["inserted"].resample(wall_time="10s").max()
    assert per_10s.values.tolist() == [90.0, 190.0, 290.0]


def test_rollout_table_is_pivoted_to_time_by_rollout(tmp_path):
    w = MetricsWriter(tmp_path)
    rows = [
        {"elapsed_s": t, "rollout": r, "kv_used": 10 * t + i}
        for t in (0.5, 1.0)
        for i, r in enumerate(("r0", "r1"))
    ]
    w.append("rollouts", rows)
    ds = open_metrics(tmp_path, "rollouts")
    assert dict(ds.sizes) == {"time": 2, "rollout": 2}
    assert ds["kv_used"].sel(rollout="r1").values.tolist() == [6.0, 11.0]


def test_uncommitted_rows_are_invisible_and_dropped(tmp_path):
    w = MetricsWriter(tmp_path)
    w.append("updates", [{"version": 1, "loss": 0.5}])
    w.root["updates"]["loss"].append(np.array([9.0]))  # a writer died mid-append
    assert open_metrics(tmp_path, "updates")["loss"].values.tolist() == [0.5]
    MetricsWriter(tmp_path).append("updates", [{"version": 2, "loss": 0.4}])
    ds = open_metrics(tmp_path, "updates")
    assert ds["loss"].values.tolist() == [0.5, 0.4] and ds["version"].values.tolist() == [1, 2]


def test_bad_tables_and_columns(tmp_path):
    w = MetricsWriter(tmp_path)
    with pytest.raises(ValueError, match="unknown metrics table 'nope'"):
        w.append("nope", [{"x": 1}])
    with pytest.raises(ValueError, match="mixes strings and numbers"):
        w.append("updates", [{"x": 1}, {"x": "a"}])
    with pytest.raises(FileNotFoundError, match="no metrics store"):
        open_metrics(tmp_path / "missing", "updates")
