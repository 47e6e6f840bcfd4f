"""trajectories.zarr given a store that is not what its writer left: copied while being
written, damaged, or not laminar's. Each is named, with the fix, rather than read wrong,
padded by a writer, or raised as a bare traceback."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from test_storage import record

from storage import TrajectoryWriter, open_run, open_trajectories
from storage.trajectories import StoreError, committed


def _copied_while_written(tmp_path):
    """A copy of a live run taken as ``cp -r`` takes one: the arrays before the writer's
    next append, the group's ``zarr.json`` (the commit marker) after it."""
    src, dst = tmp_path / "live", tmp_path / "copy"
    w = TrajectoryWriter(src)
    w.append([record(0), record(1)])
    shutil.copytree(src, dst)
    w.append([record(2), record(3)])
    shutil.copy(src / "trajectories.zarr" / "zarr.json", dst / "trajectories.zarr" / "zarr.json")
    return dst


def test_a_store_whose_arrays_are_shorter_than_its_commit_marker_is_named(tmp_path):
    run = _copied_while_written(tmp_path)
    for read in (open_run, open_trajectories):
        with pytest.raises(StoreError, match=r"copy.*'\w+' holds 2 .* committed 4.*copied"):
            read(run)
    # A writer (a run resumed from the copy) refuses it too, rather than padding every
    # array to the marker with empty trajectories.
    with pytest.raises(StoreError, match=r"copy.*holds 2 .* committed 4"):
        TrajectoryWriter(run)
    with pytest.raises(StoreError, match="committed 4"):  # (fields read alone as well)
        open_trajectories(run, ["uid"])
    assert TrajectoryWriter(tmp_path / "live").n_committed == 4  # (the run's own is sound)


def test_a_store_missing_an_array_is_named_by_the_writer_and_the_reader(tmp_path):
    w = TrajectoryWriter(tmp_path)
    w.append([record(0), record(1)])
    shutil.rmtree(w.path / "reward")
    with pytest.raises(StoreError, match=r"trajectories.zarr.* has no array 'reward'"):
        open_trajectories(tmp_path)
    with pytest.raises(StoreError, match=r"trajectories.zarr.* has no array 'reward'"):
        TrajectoryWriter(tmp_path)


def test_a_damaged_store_is_named_by_the_writer(tmp_path):
    TrajectoryWriter(tmp_path).append([record(0)])
    meta = tmp_path / "trajectories.zarr" / "zarr.json"
    meta.write_text(meta.read_text()[:40])
    with pytest.raises(StoreError, match=r"cannot read .*trajectories.zarr.*damaged"):
        TrajectoryWriter(tmp_path)


def test_a_foreign_store_without_commit_markers_is_named(tmp_path):
    w = TrajectoryWriter(tmp_path)
    w.append([record(0)])
    meta = w.path / "zarr.json"
    doc = json.loads(meta.read_text())
    del doc["attributes"]["n_committed"]
    meta.write_text(json.dumps(doc))
    for read in (open_run, open_trajectories, committed, TrajectoryWriter):
        with pytest.raises(StoreError, match=r"no commit marker 'n_committed'"):
            read(tmp_path)
    assert np.array_equal(json.loads(meta.read_text())["attributes"]["schema_version"], 2)


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("response_tokens", np.array([1.7, 2.0, 3.0, 4.0]), "response_tokens.*1.7"),
        ("prompt_tokens", np.array([1, 2**31, 3], np.int64), "prompt_tokens.*2147483648"),
        ("loss_mask", np.array([1, 1, -1, 1]), "loss_mask.*-1"),
        ("sample_version", 2.5, "sample_version.*2.5"),
        ("prompt_key", 2**70, "prompt_key"),
        ("group_size", None, "group_size.*None"),
        ("status", "lost", "status 'lost' is not one of"),
    ],
)
def test_values_the_schema_cannot_hold_are_refused_not_cast(tmp_path, field, value, said):
    """A value the field's dtype cannot hold was cast (1.7 -> 1, 2**31 -> -2**31, -1 ->
    255 in a uint8 mask) or raised numpy's bare error; it is refused, naming the record
    and the field, before anything is written."""
    w = TrajectoryWriter(tmp_path)
    w.append([record(0)])
    bad = record(1) | {field: value}
    with pytest.raises(StoreError, match=rf"record 'u1': {said}"):
        w.append([record(2), bad])
    assert open_trajectories(tmp_path)["uid"].tolist() == ["u0"]
    assert w.append([record(1)]) == 2  # (the writer goes on)
    got = open_trajectories(tmp_path)
    assert got["response_tokens"].tolist() == [100, 101, 102, 103] * 2
