"""Reading a store while it is written: zarr's temporary files are not warned about."""

import uuid
import warnings

from test_storage import record

from storage import TrajectoryWriter, open_run


def _store(path) -> None:
    TrajectoryWriter(path).append([record(0), record(1)])  # (one group of 2)


def _warnings_of_open_run(path) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = open_run(path)
    assert ds.sizes["trajectory"] == 2
    return [str(w.message) for w in caught]


def test_open_run_of_a_store_being_written_emits_no_warning(tmp_path):
    """zarr writes ``zarr.json`` through ``zarr.<hex>.partial`` beside it (its atomic
    write); a reader listing the group meanwhile sees that file. It is no damage."""
    _store(tmp_path)
    store = tmp_path / "trajectories.zarr"
    (store / f"zarr.{uuid.uuid4().hex}.partial").write_text("{")
    assert _warnings_of_open_run(tmp_path) == []


def test_open_run_still_warns_of_other_strange_entries(tmp_path):
    """Only zarr's temporary files are passed over in silence."""
    _store(tmp_path)
    (tmp_path / "trajectories.zarr" / "notes.txt").write_text("mine")
    messages = _warnings_of_open_run(tmp_path)
    assert any("notes.txt" in m and "not recognized" in m for m in messages), messages


def test_open_metrics_of_a_store_being_written_emits_no_warning(tmp_path):
    """The metrics store is written (and its tables read) the same way."""
    from storage.metrics import MetricsWriter, open_metrics

    MetricsWriter(tmp_path).append("cluster", [{"elapsed_s": 1.0, "wall_time": 1.8e9}])
    table = tmp_path / "metrics.zarr" / "cluster"
    (table / f"zarr.{uuid.uuid4().hex}.partial").write_text("{")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert open_metrics(tmp_path, "cluster").sizes["time"] == 1
    assert [str(w.message) for w in caught] == []
