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
from storage.schema import SCHEMA_VERSION
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
    assert json.loads(meta.read_text())["attributes"]["schema_version"] == SCHEMA_VERSION


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


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("sample_version", 1.7, "sample_version value 1.7"),
        ("sample_version", float("nan"), "sample_version value nan"),
        ("sample_version", 2**70, "sample_version value 1180591620717411303424"),
        ("t_sample", "soon", "t_sample value 'soon'"),
    ],
)
def test_leave_events_the_schema_cannot_hold_are_refused_not_cast(tmp_path, field, value, said):
    """Leave events skipped the check records get: a ``sample_version`` of 1.7 was
    stored as 1, and a NaN raised numpy's bare ValueError. Refused as a record's value
    is, naming the event and the field, before anything of the batch is written."""
    w = TrajectoryWriter(tmp_path)
    w.append([record(0)])
    good = {"uid": "u0", "status": "consumed", "sample_version": 3, "t_sample": 5.0}
    bad = good | {"uid": "u1", field: value}
    with pytest.raises(StoreError, match=rf"leave event 'u1': {said} is not a"):
        w.append([record(1)], [good, bad])
    assert open_trajectories(tmp_path)["uid"].tolist() == ["u0"]
    assert w.events_committed == 0
    assert w.append([record(1)], [good]) == 2  # (the writer goes on)
    assert open_trajectories(tmp_path)["sample_version"].tolist() == [3, 3]


def _all_zero_versions(tmp_path):
    """A store whose ``behavior_version`` chunk holds only zeros (zarr's fill value: left
    out unless its writer writes every chunk)."""
    w = TrajectoryWriter(tmp_path)
    w.append([record(i, behavior_version=0) for i in range(4)])
    return w.path


@pytest.mark.parametrize(
    "name", ["behavior_version", "response_tokens", "loss_mask", "prompt_tokens", "event_uid"]
)
def test_a_missing_chunk_is_named_not_read_as_zeros(tmp_path, name):
    """A copy of a run directory cut short (``zarr.json`` copied, a chunk not): zarr
    reads the chunk as its fill value; a resume would train on the zeros and its writer
    write them back for good."""
    from storage.audit import audit_run
    from storage.resume import plan_resume

    store = _all_zero_versions(tmp_path)
    TrajectoryWriter(tmp_path).append(
        [], [{"uid": "u0", "status": "consumed", "sample_version": 1, "t_sample": 6.0}]
    )
    assert open_trajectories(tmp_path)["behavior_version"].tolist() == [0] * 4
    (store / name / "c" / "0").unlink()
    said = rf"trajectories.zarr.*array '{name}' lacks chunk .*{name}/c/0.*restore the run"
    reads = (open_run, open_trajectories, audit_run, TrajectoryWriter)
    for read in reads:
        with pytest.raises(StoreError, match=said):
            read(tmp_path)
    # the resume's plan reads a few fields, and refuses for any array (before anything
    # is written: its writer starts later, on the cluster)
    with pytest.raises(StoreError, match=said):
        open_trajectories(tmp_path, ["uid"])
    with pytest.raises(StoreError, match=said):
        plan_resume(tmp_path, 1)


def test_a_store_written_before_every_chunk_was_kept_reads_its_left_out_chunks(tmp_path):
    """Stores written before :data:`storage.stores.CHUNKS_ATTR` left out chunks of fill
    values (zarr's default): those arrays read as before; a missing chunk is named only
    where such a chunk cannot be (an empty uid, 65,536 tokens all 0, ...)."""
    from storage.stores import CHUNKS_ATTR

    store = _all_zero_versions(tmp_path)
    meta = json.loads((store / "zarr.json").read_text())
    del meta["attributes"][CHUNKS_ATTR]
    (store / "zarr.json").write_text(json.dumps(meta))
    (store / "behavior_version" / "c" / "0").unlink()  # (as zarr left it out)
    assert open_trajectories(tmp_path, ["behavior_version"])["behavior_version"].tolist() == [0] * 4
    assert open_run(tmp_path)["behavior_version"].values.tolist() == [0] * 4
    (store / "response_tokens" / "c" / "0").unlink()
    with pytest.raises(StoreError, match=r"array 'response_tokens' lacks chunk"):
        open_run(tmp_path)


def test_an_array_of_only_fill_values_is_written_and_reads_back(tmp_path):
    store = _all_zero_versions(tmp_path)
    assert (store / "behavior_version" / "c" / "0").exists()
    assert (store / "n_migrations" / "c" / "0").exists()
    assert open_run(tmp_path).sizes["trajectory"] == 4


@pytest.mark.parametrize("chunk", ["chunks/seq/c/0", "requests/request_id/c/0"])
def test_a_truncated_chunk_of_the_recovery_log_is_named(tmp_path, chunk):
    """The recovery log's arrays are uncompressed: a truncated chunk fails in zarr's codecs
    with a ValueError (a number array's "cannot reshape", a string array's "data seem
    truncated"), not the RuntimeError of a failed decompression."""
    from test_partial_log import _states

    from laminar.partial import PartialCore
    from storage.partial_log import PartialLogWriter, read_partial_log

    core = PartialCore(journal=True)
    core.register("r0", 2, _states(["p00-000", "p00-001"], seed=0))
    core.flush("r0", {"p00-000": (0, [5, 6], [-0.5, -0.5], [2, 2])})
    PartialLogWriter(tmp_path).append(**core.drain_journal())
    (f,) = (tmp_path / "partial.zarr").glob(f"g*/{chunk}")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(StoreError, match=r"cannot read .*partial.zarr.*ValueError.*damaged"):
        read_partial_log(tmp_path)


def test_a_value_error_not_of_a_chunk_is_not_called_damage(tmp_path):
    from storage.stores import reading

    with pytest.raises(ValueError, match="a bug") as e, reading(tmp_path):
        raise ValueError("a bug")
    assert not isinstance(e.value, StoreError)


def _flips(chunk):
    """Single-bit changes of ``chunk`` in turn (two bits of 16 bytes across it), the
    file restored after."""
    data = chunk.read_bytes()
    try:
        for i in range(0, len(data), max(1, len(data) // 16)):
            for bit in (0, 5):
                changed = bytearray(data)
                changed[i] ^= 1 << bit
                chunk.write_bytes(bytes(changed))
                yield
    finally:
        chunk.write_bytes(data)


ROWS = [record(i, reward=i / 64, n_resp=4 + i % 7) for i in range(64)]


def test_a_store_written_without_zstds_checksum_reads_changed_bits_as_other_values(
    tmp_path, monkeypatch
):
    """What the checksum is for: chunks compressed with zstd without it, as stores were
    written before, read most changed bits back as other values, silently (a resume
    trained on them, the audit counted them). Such a store still reads, and takes
    appends, with the codec its arrays record."""
    from zarr.codecs import ZstdCodec

    from storage import stores

    monkeypatch.setattr(stores, "CHECKED_ZSTD", (ZstdCodec(level=0, checksum=False),))
    TrajectoryWriter(tmp_path).append(ROWS)
    monkeypatch.undo()
    store = tmp_path / "trajectories.zarr"
    want = open_run(tmp_path)["reward"].values
    silent = 0
    for _ in _flips(store / "reward" / "c" / "0"):
        try:
            silent += not np.array_equal(open_run(tmp_path)["reward"].values, want)
        except StoreError:
            pass
    assert silent
    TrajectoryWriter(tmp_path).append([record(64)])
    meta = json.loads((store / "reward" / "zarr.json").read_text())
    assert meta["codecs"][-1]["configuration"]["checksum"] is False
    assert open_run(tmp_path)["reward"].values.tolist() == [*want.tolist(), 0.5]


@pytest.mark.parametrize("name", ["reward", "uid", "response_tokens"])
def test_a_changed_bit_of_a_chunk_is_refused_not_read_as_other_values(tmp_path, name):
    """With zstd's checksum a changed bit of a chunk is refused, naming the chunk, by
    the resume's check and by the readers, unless the values read back the same (a bit
    the decoder does not use: one of a frame header's unused)."""
    from storage.audit import audit_run
    from storage.trajectories import check_resumable

    TrajectoryWriter(tmp_path).append(ROWS)
    meta = json.loads((tmp_path / "trajectories.zarr" / name / "zarr.json").read_text())
    assert meta["codecs"][-1] == {"name": "zstd", "configuration": {"level": 0, "checksum": True}}
    want = open_run(tmp_path)[name].values
    chunk = tmp_path / "trajectories.zarr" / name / "c" / "0"
    refused = 0
    for _ in _flips(chunk):
        try:
            check_resumable(tmp_path, [r["uid"] for r in ROWS])
        except StoreError as e:
            assert f"array '{name}' does not read, chunk '{chunk}'" in str(e), e
            refused += 1
            if refused > 1:  # (the readers: at the first)
                continue
            if name == "response_tokens":  # (read lazily, where computed; not audited)
                with pytest.raises((RuntimeError, StoreError)):
                    _ = open_run(tmp_path)[name].values
                continue
            for read in (open_run, audit_run):
                with pytest.raises(StoreError, match="damaged"):
                    read(tmp_path)
        else:
            assert open_run(tmp_path)[name].values.tolist() == want.tolist()
    assert refused
    assert open_run(tmp_path)[name].values.tolist() == want.tolist()


def test_a_changed_bit_of_a_metrics_chunk_is_refused_not_read_as_other_values(tmp_path):
    """metrics.zarr's columns carry zstd's checksum as the trajectory store's do: a
    changed bit of a chunk is refused where it is read, naming the store, or the values
    read back the same (a bit the decoder does not use)."""
    from storage.metrics import MetricsWriter, open_metrics

    rows = [{"version": v, "loss": 1.0 / (v + 1)} for v in range(200)]
    MetricsWriter(tmp_path).append("updates", rows)
    column = tmp_path / "metrics.zarr" / "updates" / "loss"
    meta = json.loads((column / "zarr.json").read_text())
    assert meta["codecs"][-1] == {"name": "zstd", "configuration": {"level": 0, "checksum": True}}
    want = open_metrics(tmp_path, "updates")["loss"].values.tolist()
    refused = 0
    for _ in _flips(column / "c" / "0"):
        try:
            got = open_metrics(tmp_path, "updates")["loss"].values.tolist()
        except StoreError as e:
            assert "metrics.zarr" in str(e), e
            refused += 1
        else:
            assert got == want
    assert refused
