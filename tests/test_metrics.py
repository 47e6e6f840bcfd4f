"""metrics.zarr: flexible columns, commit marker, pivoted rollout table."""

import numpy as np
import pytest
from conftest import attribute_writes
from runs import tensorboard_scalars

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


def test_tensorboard_mirrors_every_numeric_column(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=True)
    t0 = 1.8e9
    w.append(
        "cluster",
        [
            {"elapsed_s": t, "wall_time": t0 + t, "version": t // 2, "buffer_depth": 10 + t}
            for t in (1.0, 2.0)
        ],
    )
    w.append(
        "rollouts",
        [
            {"elapsed_s": t, "rollout": r, "kv_used": 100 * t + i}
            for t in (1.0, 2.0)
            for i, r in enumerate(("r0", "r1"))
        ],
    )
    w.append(
        "updates",
        [{"version": v, "time": t0 + 5 * v, "loss": 1 / v, "note": "x"} for v in (1, 2, 3)],
    )
    w.append(
        "repacks",
        [{"time": t0 + 3, "source": "r1", "destination": "r0", "ok": True, "requests": 7}],
    )
    w.close()
    # A resumed run appends to the same directory; its steps continue the curves.
    w = MetricsWriter(tmp_path, tensorboard=True)
    w.append("updates", [{"version": 4, "time": t0 + 20, "loss": 0.2}])
    w.close()

    got = tensorboard_scalars(tmp_path / "tensorboard")
    # time series: the step is milliseconds since the start
    assert got["cluster/buffer_depth"] == [(t0 + 1, 1000, 11.0), (t0 + 2, 2000, 12.0)]
    assert got["cluster/version"] == [(t0 + 1, 1000, 0.0), (t0 + 2, 2000, 1.0)]
    # rollouts: one curve per rollout, at the wall time of its poll
    assert got["rollouts/kv_used/r1"] == [(t0 + 1, 1000, 101.0), (t0 + 2, 2000, 201.0)]
    assert [p[1:] for p in got["rollouts/kv_used/r0"]] == [(1000, 100.0), (2000, 200.0)]
    # updates: the version is the step, not a curve; strings are not drawn
    assert [(s, pytest.approx(v)) for _, s, v in got["updates/loss"]] == [
        (1, 1.0),
        (2, 0.5),
        (3, 1 / 3),
        (4, 0.2),
    ]
    assert "updates/version" not in got and "updates/note" not in got
    assert got["repacks/requests"] == [(t0 + 3, 0, 7.0)] and got["repacks/ok"][0][2] == 1.0
    assert not any(tag.endswith(("/elapsed_s", "/wall_time", "/time")) for tag in got)
    # ... and metrics.zarr holds the same rows.
    assert open_metrics(tmp_path, "updates")["loss"].values.tolist()[-1] == 0.2


def test_tensorboard_version_curves_of_a_resumed_run_go_on_from_its_checkpoint(tmp_path):
    """A start resumed from its checkpoint of version 3 redoes versions 4.. and publishes
    version 3 again: its updates were drawn over the lost start's at the same steps (the
    curve went 1..6, back to 4, on to 8) and the publication twice; now the earlier
    points from the checkpoint on are purged, and the re-publication is left out. The
    cluster curves (stepped by the run's clock) keep every start's points."""
    t0 = 1.8e9
    w = MetricsWriter(tmp_path, tensorboard=True)
    w.append("cluster", [{"elapsed_s": t, "wall_time": t0 + t, "buffer_depth": 1} for t in (1, 2)])
    w.append(
        "publications", [{"version": v, "t_publish": t0 + v, "stall_s": 1.0} for v in range(7)]
    )
    w.append("updates", [{"version": v, "time": t0 + v, "loss": 1.0} for v in range(1, 7)])
    w.close()
    w = MetricsWriter(tmp_path, tensorboard=True, resumed_from=3)
    w.append(
        "cluster", [{"elapsed_s": t, "wall_time": t0 + t, "buffer_depth": 2} for t in (50, 51)]
    )
    w.append(
        "publications",
        [{"version": v, "t_publish": t0 + 50 + v, "stall_s": 2.0} for v in range(3, 9)],
    )
    w.append("updates", [{"version": v, "time": t0 + 50 + v, "loss": 2.0} for v in range(4, 9)])
    w.close()

    got = tensorboard_scalars(tmp_path / "tensorboard")
    by_step = [(s, v) for _, s, v in got["updates/loss"]]
    assert by_step == [(1, 1.0), (2, 1.0), (3, 1.0)] + [(v, 2.0) for v in range(4, 9)]
    stalls = [(s, v) for _, s, v in got["publications/stall_s"]]
    assert stalls == [(v, 1.0) for v in range(4)] + [(v, 2.0) for v in range(4, 9)]
    steps = [s for _, s, _ in got["cluster/buffer_depth"]]
    assert steps == [1000, 2000, 50000, 51000]
    # ... and metrics.zarr keeps every row, the lost start's too.
    assert open_metrics(tmp_path, "updates").sizes["update"] == 11


def test_tensorboard_without_its_package_is_refused_before_a_run_but_its_config_loads(
    monkeypatch,
):
    import importlib.util

    from laminar.config import RunConfig, with_overrides
    from laminar.errors import ConfigError
    from pipelines.api import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboardX" else real(name, *a),
    )
    # A run's recorded config loads for analysis on a machine without the writer ...
    cfg = with_overrides(RunConfig(), ["metrics.tensorboard=true"])
    # ... and a run that asks for it is refused before any cluster work.
    with pytest.raises(
        ConfigError, match=r"metrics\.tensorboard.*pip install -e '\.\[tensorboard\]'"
    ):
        preflight(cfg)


def test_a_column_absent_after_an_interrupted_append_reads_nan_not_its_remains(tmp_path):
    w = MetricsWriter(tmp_path)
    w.append("updates", [{"version": 1, "loss": 0.5, "note": "a"}])
    w.root["updates"]["loss"].append(np.array([9.0]))  # a writer died mid-append
    w.root["updates"]["note"].append(np.array(["torn"], dtype=w.root["updates"]["note"].dtype))
    MetricsWriter(tmp_path).append("updates", [{"version": 2}])  # without those columns
    ds = open_metrics(tmp_path, "updates")
    assert ds["loss"].values[0] == 0.5 and np.isnan(ds["loss"].values[1])
    assert ds["note"].values.tolist() == ["a", ""]


def test_none_and_non_ascii_in_string_columns(tmp_path):
    w = MetricsWriter(tmp_path)
    w.append("faults", [{"time": 1.0, "rollout": "r0", "destination": None}])
    w.append("faults", [{"time": 2.0, "rollout": "r0", "destination": "r1"}])
    w.append("faults", [{"time": 3.0, "rollout": "r1", "destination": None}])
    w.append(
        "faults",
        [
            {"time": 4.0, "rollout": "r2", "destination": "été→日本"},
            {"time": 5.0, "rollout": "r2", "destination": None},
        ],
    )
    ds = open_metrics(tmp_path, "faults")
    assert ds["destination"].values.tolist() == ["", "r1", "", "été→日本", ""]
    # a column first seen at row 1000, NaN and None among numbers
    for i in range(2):
        w.append("updates", [{"version": v} for v in range(500 * i, 500 * (i + 1))])
    w.append("updates", [{"version": 1000, "loss": None, "grad_norm": 1.5, "how": "ok"}])
    ds = open_metrics(tmp_path, "updates")
    assert ds.sizes["update"] == 1001 and np.isnan(ds["grad_norm"].values[:1000]).all()
    assert ds["grad_norm"].values[1000] == 1.5 and np.isnan(ds["loss"].values).all()
    assert set(ds["how"].values[:1000].tolist()) == {""} and ds["how"].values[1000] == "ok"


def test_gaps_begin_and_end_at_the_last_and_first_activity_around_a_stop(tmp_path):
    """Rows come every few seconds and a crash loses the last unflushed ones: other
    activity between two starts' rows (e.g. trajectory times) narrows the stop to the
    longest stretch with none."""
    from storage.metrics import gaps

    w = MetricsWriter(tmp_path)
    rows = [(0, 0.0), (0, 5.0), (1, 60.0), (1, 65.0), (2, 200.0)]
    w.append("cluster", [{"segment": s, "elapsed_s": t, "version": 0} for s, t in rows])
    cluster = open_metrics(tmp_path, "cluster")
    assert gaps(cluster) == [(5.0, 60.0), (65.0, 200.0)]
    # 6.5 and 9: the first start's last seconds; 58: the second's, before its first row;
    # activity outside the stops (or NaN) changes nothing
    activity = np.array([1.0, 6.5, 9.0, 58.0, np.nan, 62.0, 210.0])
    assert gaps(cluster, activity) == [(9.0, 58.0), (65.0, 200.0)]


def test_numbers_into_a_string_column_are_refused_not_stored_as_text(tmp_path):
    """A string column took numbers as their text ("3.5"): refused, as strings into a
    number column are, and nothing of the batch is written."""
    w = MetricsWriter(tmp_path)
    w.append("faults", [{"how": "import", "time": 1.0}])
    with pytest.raises(ValueError, match=r"faults\.'how'.* mixes strings and numbers"):
        w.append("faults", [{"how": 3.5, "time": 2.0}])
    w.append("faults", [{"how": None, "time": 3.0}])  # (absent: the fill, as before)
    ds = open_metrics(tmp_path, "faults")
    assert ds["how"].values.tolist() == ["import", ""]
    assert ds["time"].values.tolist() == [1.0, 3.0]


def test_a_resume_reads_the_kept_counters_not_the_whole_rollouts_table(tmp_path):
    """Where each rollout's counters stand is kept beside the rows at every append, so a
    resume (counters_at_end) reads it instead of reading and pivoting the whole
    ``rollouts`` table (7 s and 0.9 GB at a million rows); a store written before it was
    kept, or rows appended after it by a writer that did not keep it, are read from the
    table."""
    import json
    import shutil

    from storage.metrics import LAST_ATTR, counters_at_end

    def rows(t0, n, gone=()):
        return [
            {"elapsed_s": t, "rollout": r, "batches": t, "response_tokens": 10 * t}
            | ({"batches": None} if r in gone else {})
            for t in range(t0, t0 + n)
            for r in ("r0", "r1", "r10")
        ]

    w = MetricsWriter(tmp_path)
    w.append("cluster", [{"elapsed_s": 1.0, "inserted": 4}, {"elapsed_s": 2.0, "inserted": 9}])
    w.append("rollouts", rows(0, 3))
    w.append("rollouts", rows(3, 2, gone={"r1"}))  # (NaN: r1's last reading stands)
    want = {
        "cluster": {"inserted": 9.0},
        "rollouts": {
            "r0": {"batches": 4.0, "response_tokens": 40.0},
            "r1": {"batches": 2.0, "response_tokens": 40.0},
            "r10": {"batches": 4.0, "response_tokens": 40.0},
        },
    }
    assert counters_at_end(tmp_path) == want
    group = w.root["rollouts"]
    kept = group.attrs[LAST_ATTR]
    assert json.loads(kept) == {"n": 15, "counters": want["rollouts"]}
    # a store from before: the table, read whole
    del group.attrs[LAST_ATTR]
    assert counters_at_end(tmp_path) == want
    # rows appended after the kept counters by a writer that did not keep them: read
    MetricsWriter(tmp_path).append("rollouts", rows(5, 1))
    MetricsWriter(tmp_path).root["rollouts"].attrs[LAST_ATTR] = kept
    assert counters_at_end(tmp_path)["rollouts"]["r1"] == {"batches": 5.0, "response_tokens": 50.0}
    # ... and nothing else: the table's counter chunks gone, the counters still read
    MetricsWriter(tmp_path).append("rollouts", rows(6, 1))
    for col in ("batches", "response_tokens"):
        shutil.rmtree(tmp_path / "metrics.zarr" / "rollouts" / col / "c")
    got = counters_at_end(tmp_path)["rollouts"]
    assert got["r10"] == {"batches": 6.0, "response_tokens": 60.0}, got


def test_a_failed_commit_commits_nothing_and_the_rows_append_again(tmp_path, monkeypatch):
    """The commit (the row count and where the counters stand) is one write of the
    table's metadata. It was two (``attrs.update``, key by key): a full disk at the
    second left the rows committed while append raised; the driver keeps rows whose
    append failed and appends them again, and the rollout table then held each
    (time, rollout) twice and never opened again ("Cannot unstack MultiIndex containing
    duplicates")."""
    import errno

    import zarr

    from storage.metrics import LAST_ATTR

    w = MetricsWriter(tmp_path)
    rows = [{"elapsed_s": 1.0, "rollout": r, "batches": i + 1} for i, r in enumerate(("r0", "r1"))]
    w.append("rollouts", rows[:1])  # (the table exists: only its commits are written below)
    real = zarr.Group.update_attributes

    def full(self, new):  # (the disk fills as the counters' new values are written)
        if new.get(LAST_ATTR) != self.attrs.get(LAST_ATTR):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, new)

    monkeypatch.setattr(zarr.Group, "update_attributes", full)
    with pytest.raises(OSError, match="No space"):
        w.append("rollouts", rows[1:])
    monkeypatch.setattr(zarr.Group, "update_attributes", real)
    w.append("rollouts", rows[1:])  # (the driver's next flush)
    ds = open_metrics(tmp_path, "rollouts")
    assert ds["batches"].sel(rollout="r1").values.tolist() == [2.0]
    assert zarr.open_group(str(tmp_path / "metrics.zarr" / "rollouts")).attrs["n_committed"] == 2


def test_a_table_is_created_with_its_commit_marker_and_one_killed_before_it_still_appends(
    tmp_path, monkeypatch
):
    """A table's group and its ``n_committed`` were two writes: a kill between them left
    a table every later append failed on (KeyError 'n_committed'), which
    check_metrics_store passed. Created now with its marker in one write; an empty
    table without one (left so by an older writer) is read as 0 rows, and one with
    columns but no marker is refused as damaged."""
    import zarr

    from storage.metrics import check_metrics_store
    from storage.trajectories import StoreError

    with attribute_writes(monkeypatch) as writes:
        w = MetricsWriter(tmp_path)
        w.append("cluster", [{"elapsed_s": 1.0, "version": 0}])
    commit = ["committed_columns", "last_counters", "n_committed"]
    assert [sorted(a) for a in writes] == [commit]  # (the commit: one write)

    w.root.create_group("faults")  # (an older writer killed before it wrote the marker)
    check_metrics_store(tmp_path)
    MetricsWriter(tmp_path).append("faults", [{"time": 1.0, "rollout": "r0"}])
    assert open_metrics(tmp_path, "faults")["rollout"].values.tolist() == ["r0"]

    del zarr.open_group(str(tmp_path / "metrics.zarr" / "faults")).attrs["n_committed"]
    with pytest.raises(StoreError, match="faults has columns but no n_committed"):
        check_metrics_store(tmp_path)


def test_a_chunk_missing_from_a_table_is_refused_where_it_is_read(tmp_path):
    """zarr reads a missing chunk as NaN: a metrics table whose chunk was lost (a copy
    cut short) drew an empty panel in the report, with numpy's cast warning, and said
    nothing (helper 185). A table written since writes every chunk, the all-NaN ones of
    a column that appears late too, so one missing is named; the report leaves the
    table out under "Damaged stores"."""
    import shutil

    from test_storage import record

    from pipelines.report import build_report
    from storage import TrajectoryWriter
    from storage.trajectories import StoreError

    TrajectoryWriter(tmp_path).append([record(0), record(1)])
    w = MetricsWriter(tmp_path)
    rows = [{"version": v, "loss": 0.5} for v in range(1, 5001)]  # (two chunks of 4096)
    w.append("updates", rows)
    w.append("updates", [{"version": 5001, "loss": 0.4, "grad_norm": 1.0}])  # (a new column)
    ds = open_metrics(tmp_path, "updates")  # (grad_norm's all-NaN chunk: written, no error)
    assert np.isnan(ds["grad_norm"].values[:5000]).all() and ds["grad_norm"].values[-1] == 1.0
    chunk = tmp_path / "metrics.zarr" / "updates" / "loss" / "c" / "1"
    assert chunk.exists()
    chunk.unlink()
    with pytest.raises(StoreError, match=r"metrics.zarr/updates': array 'loss' lacks chunk"):
        open_metrics(tmp_path, "updates")
    report = build_report([tmp_path], tmp_path / "report").read_text()
    assert "## Damaged stores" in report and "metrics table 'updates' left out" in report
    shutil.rmtree(tmp_path / "metrics.zarr")
    report = build_report([tmp_path], tmp_path / "report2").read_text()
    assert "no metrics.zarr" in report  # (absent: the figures that read it are said to be)


def test_a_column_made_by_an_append_killed_before_its_commit_is_not_a_lost_chunk(tmp_path):
    """A column new to a table of 5,000 rows is made at that length, then its earlier
    rows' chunks written with the fill: a driver killed between the two left a table
    every read refused for a lost chunk, after a resume too (helper 187). A table's
    columns are committed with its rows: a reader leaves out one not committed, and the
    next append makes it again."""
    import zarr

    w = MetricsWriter(tmp_path)
    w.append("updates", [{"version": v, "loss": 0.5} for v in range(1, 5001)])
    group = zarr.open_group(str(tmp_path / "metrics.zarr" / "updates"))
    group.create_array("grad_norm", shape=(5000,), dtype="float64", chunks=(4096,),
                       dimension_names=["update"], fill_value=float("nan"))  # fmt: skip
    group["grad_norm"][4096:] = 1.0  # (killed here: chunk 0 never written)
    ds = open_metrics(tmp_path, "updates")  # (read while it was being made, or after)
    assert "grad_norm" not in ds and ds.sizes["update"] == 5000
    MetricsWriter(tmp_path).append("updates", [{"version": 5001, "loss": 0.4, "grad_norm": 2.0}])
    ds = open_metrics(tmp_path, "updates")
    assert np.isnan(ds["grad_norm"].values[:5000]).all() and ds["grad_norm"].values[-1] == 2.0
