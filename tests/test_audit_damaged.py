"""`laminar audit` and `laminar report` of a damaged trajectory store: a missing array
is named (as a resume names it), not a bare KeyError, and a damaged array's zarr.json
is named without a screen of asyncio's "Task was destroyed but it is pending!". And a
metrics table with a hole: the versions without an ``updates`` or ``publications`` row
are named (a reviewer's run aborted at version 40 lacked the rows of 38-40 for good and
audited CLEAN, without a word)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from test_storage import record

from pipelines.report import build_report
from storage import TrajectoryWriter
from storage.audit import audit_run
from storage.metrics import MetricsWriter
from storage.trajectories import StoreError


def test_a_store_missing_an_array_is_named_by_the_audit_and_the_report(tmp_path):
    w = TrajectoryWriter(tmp_path)
    w.append([record(0), record(1)])
    shutil.rmtree(w.path / "status")
    said = r"trajectories.zarr' has no array 'status'; it is damaged .* restore the run"
    with pytest.raises(StoreError, match=said):
        audit_run(tmp_path)
    with pytest.raises(StoreError, match=said):
        build_report([tmp_path], tmp_path / "report")
    assert not (tmp_path / "report").exists()


def test_a_damaged_array_is_named_without_asyncios_pending_tasks(tmp_path):
    """(asyncio reports zarr's reads left pending as the process ends: one is run.)"""
    TrajectoryWriter(tmp_path).append([record(0), record(1)])
    meta = tmp_path / "trajectories.zarr" / "uid" / "zarr.json"  # (the first one read)
    meta.write_text("{\n")
    with pytest.raises(StoreError, match=r"cannot read .*trajectories.zarr.*damaged"):
        audit_run(tmp_path)
    code = (
        "import sys\n"
        "from storage.audit import audit_run\n"
        "from storage.trajectories import StoreError\n"
        "try:\n"
        "    audit_run(sys.argv[1])\n"
        "except StoreError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert "refused: cannot read" in out.stdout, out
    assert "Task was destroyed" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_token_audit_reads_every_chunk_and_names_what_no_run_can_store(tmp_path, monkeypatch):
    """`laminar audit --tokens` reads the token arrays the other checks never read: a
    trained token whose behavior logprob is NaN or positive (the correction divides by
    its exponential), a negative token id, a loss mask of 2 — each counted and named
    with a trajectory, across stored chunks (5 tokens a chunk here). A NaN logprob of a
    discarded response is no problem: it was never trained on; one an update trained on,
    then lost and taken back (consumed, held again, evicted), is. A damaged token chunk
    is named, and the other chunks checked all the same."""
    import numpy as np

    from storage import trajectories

    monkeypatch.setattr(trajectories, "_CHUNK_TOK", 5)
    good = [record(i, n_resp=4) for i in range(4)]
    bad = [record(i, n_resp=4) for i in range(4, 10)]
    bad[0]["behavior_logprobs"] = np.array([-0.1, np.nan, -0.2, np.nan], np.float32)
    bad[1]["behavior_logprobs"] = np.array([-0.1, 0.5, -0.2, -0.3], np.float32)
    bad[2]["response_tokens"] = np.array([1, -7, 2, 3], np.int32)
    bad[3]["loss_mask"] = np.array([1, 2, 1, 1], np.uint8)
    bad[4]["prompt_tokens"] = np.array([-1, 0, 1], np.int32)
    # (untrained: discarded, or a token its mask leaves out)
    bad[5].update(status="discarded", sample_version=-1, t_sample=np.nan)
    bad[5]["behavior_logprobs"] = np.full(4, np.nan, np.float32)
    # (trained on by an update since lost: consumed, then held again, then evicted)
    taken_back = record(10, n_resp=4, status="buffered", sample_version=-1, t_sample=np.nan)
    taken_back["behavior_logprobs"] = np.array([-0.1, -0.2, np.nan, -0.3], np.float32)
    steps = [("consumed", 3, 6.0), ("buffered", -1, 7.0), ("evicted", -1, np.nan)]
    events = [{"uid": "u10", "status": s, "sample_version": v, "t_sample": t} for s, v, t in steps]
    clean = tmp_path / "clean"
    TrajectoryWriter(clean).append(good)
    report = audit_run(clean, tokens=True)
    assert report.figures["tokens read"] == 4 * (3 + 4), report.figures
    damaged = tmp_path / "damaged"
    TrajectoryWriter(damaged).append([*good, *bad, taken_back], events)
    assert "tokens read" not in audit_run(damaged).figures  # (only when asked)
    said = [p for p in audit_run(damaged, tokens=True).problems if " tokens " in p]
    found = sorted(
        [
            "3 response tokens trained on have a behavior logprob that is not finite, e.g. in "
            "trajectory 'u4'",
            "1 response tokens trained on have a behavior logprob above 0.001 (no "
            "log-probability), e.g. in trajectory 'u5'",
            "1 response tokens have a negative token id, e.g. in trajectory 'u6'",
            "1 response tokens have a loss_mask neither 0 nor 1, e.g. in trajectory 'u7'",
            "1 prompt tokens have a negative token id, e.g. in trajectory 'u8'",
        ]
    )
    assert sorted(said) == found, said
    # a token chunk that no longer matches its checksum (u0's and u1's tokens) is named,
    # and the other chunks are checked all the same
    chunk = damaged / "trajectories.zarr" / "behavior_logprobs" / "c" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-1] + b"\x00")
    report = audit_run(damaged, tokens=True)
    (lost,) = [p for p in report.problems if "token chunk not checked" in p]
    assert "behavior_logprobs/c/0" in lost and "checksum" in lost, lost
    assert sorted(p for p in report.problems if " tokens " in p) == found, report.problems
    assert report.figures["tokens read"] == 11 * (3 + 4) - 5, report.figures


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (
            lambda a: a | {"n_committed": "x"},
            r"commit marker 'n_committed' in zarr.json is 'x', not a count",
        ),
        (
            lambda a: a | {"n_committed": -5},
            r"commit marker 'n_committed' in zarr.json is -5, not a count",
        ),
        (
            lambda a: a | {"n_committed_tokens": {"prompt_token": 1.5}},
            r"'n_committed_tokens' in zarr.json is .*not a count per token dimension",
        ),
    ],
    ids=["string", "negative", "tokens_float"],
)
def test_an_edited_commit_marker_is_named_by_the_audit_and_the_report(tmp_path, edit, said):
    """`n_committed: "x"` raised a bare ValueError from int(); -5, xarray's "conflicting
    sizes" (helper 185): an edited or garbled root zarr.json is named, with the fix."""
    import json

    TrajectoryWriter(tmp_path).append([record(0), record(1)])
    root = tmp_path / "trajectories.zarr" / "zarr.json"
    meta = json.loads(root.read_text())
    meta["attributes"] = edit(meta["attributes"])
    root.write_text(json.dumps(meta))
    for read in (lambda: audit_run(tmp_path), lambda: build_report([tmp_path], tmp_path / "r")):
        with pytest.raises(StoreError, match=said + ".*restore the run directory from a copy"):
            read()


def test_an_array_whose_data_type_was_edited_is_named(tmp_path):
    """An array's zarr.json edited to int8 (its NaN fill value then unreadable) raised
    zarr's TypeError from its metadata parsing (helper 185)."""
    import json

    TrajectoryWriter(tmp_path).append([record(0), record(1)])
    meta_file = tmp_path / "trajectories.zarr" / "reward" / "zarr.json"
    meta = json.loads(meta_file.read_text())
    meta["data_type"] = "int8"
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=r"cannot read .*trajectories.zarr.*damaged"):
        audit_run(tmp_path)


def test_an_audit_without_summary_json_says_what_it_took_the_run_for(tmp_path):
    """Without summary.json the audit read the run as one that did not end and said
    nothing of it: a file removed read the same as a run still going (helper 185)."""
    import json

    TrajectoryWriter(tmp_path).append([record(0), record(1)])
    [note] = [n for n in audit_run(tmp_path).notes if "summary.json" in n]
    assert note.startswith("no summary.json (the run is still going, or its driver was lost")
    (tmp_path / "summary.json").write_text(json.dumps({"reason": "completed", "segments": 1}))
    assert not [n for n in audit_run(tmp_path).notes if "summary.json" in n]


def test_a_bug_making_an_array_is_not_read_as_damage(tmp_path):
    """Errors zarr raises reading an array's zarr.json are damage; the same errors made
    creating an array (a writer's bad data type or fill) are a bug, and must not tell
    the user to restore a brand-new run directory (helper 187)."""
    import numpy as np
    import zarr

    from storage.stores import reading

    group = zarr.open_group(str(tmp_path / "s"), mode="w", zarr_format=3)
    for bad in (dict(dtype="nonsense"), dict(dtype="int8", fill_value=np.nan)):
        with pytest.raises((TypeError, ValueError)) as e, reading(tmp_path / "s"):
            group.create_array("b", shape=(4,), overwrite=True, **bad)
        assert not isinstance(e.value, StoreError)


def _update(v: int, t: float) -> dict:
    return {"version": v, "time": t, "loss": 0.1 * v, "grad_norm": 1.0 + v}


def _publication(v: int, t: float) -> dict:
    return {"version": v, "t_publish": t, "stall_s": 0.002, "bytes": 10.0, "chunks": 1.0}


def _run_with_rows(tmp_path, versions: int, updates, publications, summary=None):
    """A run directory whose store holds a consumed batch at each version below
    ``versions`` (generated by version 0 on), with these rows of metrics.zarr."""
    run = tmp_path / "run"
    recs = [
        record(2 * v + i, behavior_version=0, finish_version=0, sample_version=v)
        for v in range(versions)
        for i in (0, 1)
    ]
    TrajectoryWriter(run).append(recs)
    w = MetricsWriter(run)
    w.append("updates", [_update(v, 100.0 + v) for v in updates])
    w.append("publications", [_publication(v, 99.5 + v) for v in publications])
    summary = summary or {"reason": "completed", "versions": versions, "segments": 1}
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_the_audit_names_the_versions_without_a_row(tmp_path):
    """Versions 3-4 and 7 of a run that ended at 8 have no ``updates`` row, 4 no
    ``publications`` row: each named, in a note (the trajectories and weights are sound:
    it is the record of those updates that is missing), not left to a plot's hole."""
    run = _run_with_rows(tmp_path, 8, [1, 2, 5, 6, 8], [0, 1, 2, 3, 5, 6, 7, 8])
    report = audit_run(run)
    assert report.ok, report.text()
    said = [n for n in report.notes if "no row in the" in n]
    assert said == [
        "3 versions of the run's lineage (1..8) have no row in the updates table of "
        "metrics.zarr: 3-4, 7; the loss, KL, gradient norm and batch figures of each are "
        "missing (the driver stopped, aborted or lost, before it wrote them, and no resume "
        "wrote them back from its checkpoint)",
        "1 version of the run's lineage (1..8) has no row in the publications table of "
        "metrics.zarr: 4; the publication stall and broadcast time of each is missing (the "
        "driver stopped, aborted or lost, before it wrote it, and no resume wrote it back "
        "from its checkpoint)",
    ]


def test_the_audit_names_the_last_versions_an_abort_lost_after_its_stop_checkpoint(tmp_path):
    """Stopped at 5 (its checkpoint written), then aborted before its driver wrote the
    rows of 4 and 5, which the last ``cluster`` row (at 3) does not reach either: the
    newest checkpoint says the run got to 5. Versions a trainer restart skipped are no
    hole; a run whose rows are all there has no note."""
    run = _run_with_rows(tmp_path, 5, [1, 2, 3], [0, 1, 2, 3], summary={"segments": 1})
    MetricsWriter(run).append(
        "cluster", [{"segment": 0, "elapsed_s": 1.0, "wall_time": 1e9, "version": 3}]
    )
    (run / "checkpoints" / "version-000005").mkdir(parents=True)
    said = [n for n in audit_run(run).notes if "no row in the" in n]
    assert [n.split(": ")[1].split(";")[0] for n in said] == ["4-5", "4-5"], said
    # A restart at 2 that skipped 3-4 (its updates from 5 on), every other row there
    faults = {"trainer_restarts": [{"checkpoint_version": 2, "after_version": 4, "time": 1.0}]}
    skipped = tmp_path / "skipped"
    skipped.mkdir()
    run = _run_with_rows(
        skipped,
        6,
        [1, 2, 5, 6],
        [0, 1, 2, 5, 6],
        summary={"reason": "completed", "versions": 6, "segments": 1, "faults": faults},
    )
    assert not [n for n in audit_run(run).notes if "no row in the" in n], audit_run(run).text()


def test_a_summary_an_earlier_start_left_does_not_cut_the_versions_checked(tmp_path):
    """Resumed twice, the last start's driver killed outright: summary.json is still the
    second start's ("stopped" at version 5, two segments) while the cluster table records
    three starts, the third to version 8. The audit took the stale summary's end and
    checked only versions up to 5, so the third start's versions 7 and 8, which trained
    no batch the store holds, passed; it takes the summary only when it counts every
    start."""
    run = _run_with_rows(
        tmp_path,
        6,
        list(range(1, 9)),
        list(range(0, 9)),
        summary={"reason": "stopped", "versions": 5, "segments": 2},
    )
    MetricsWriter(run).append(
        "cluster",
        [
            {"segment": 0, "elapsed_s": 1.0, "wall_time": 1e9, "version": 3},
            {"segment": 1, "elapsed_s": 1.0, "wall_time": 1e9 + 60, "version": 5},
            {"segment": 2, "elapsed_s": 1.0, "wall_time": 1e9 + 120, "version": 8},
        ],
    )
    report = audit_run(run)
    said = [p for p in report.problems + report.notes if "published versions trained" in p]
    assert said and "2 published versions" in said[0] and "e.g. version 7" in said[0], said


def _bounded(run, bound, summary: dict | None = None) -> None:
    """Two groups consumed at version 3 of behavior version 1 (s_train 2), in a run whose
    config.yaml sets buffer.max_train_staleness=``bound``."""
    import json

    TrajectoryWriter(run).append([record(i) for i in range(4)])
    (run / "config.yaml").write_text(f"buffer:\n  max_train_staleness: {bound}\n")
    summary = {"reason": "completed", "segments": 1} if summary is None else summary
    (run / "summary.json").write_text(json.dumps(summary))


def test_a_trajectory_trained_past_the_configured_bound_is_a_problem(tmp_path):
    """`laminar audit` printed s_train max and held it against nothing: the buffer evicts
    a group before it trains further behind than buffer.max_train_staleness, so a
    consumed one past it breaks the setting the run was given."""
    _bounded(tmp_path, 1)
    report = audit_run(tmp_path)
    assert report.figures["max_train_staleness"] == 1
    assert report.figures["s_train max (lineage)"] == 2
    [said] = [p for p in report.problems if "max_train_staleness" in p]
    assert said.startswith(
        "4 consumed trajectories trained more than buffer.max_train_staleness=1 versions "
        "behind (s_train along the weights' lineage 2), e.g. 'u0'"
    ), said
    (tmp_path / "config.yaml").write_text("buffer:\n  max_train_staleness: 2\n")
    assert audit_run(tmp_path).ok, audit_run(tmp_path).text()
    (tmp_path / "config.yaml").write_text("buffer:\n  max_train_staleness: null\n")
    report = audit_run(tmp_path)
    assert report.ok and "max_train_staleness" not in report.figures, report.text()


def test_the_bound_counts_along_the_lineage_of_a_restarted_trainer(tmp_path):
    """A trainer lost after publishing version 3 and restarted from its checkpoint of 1
    numbers its updates after 3: its first batch, of version 1's weights, is sampled at
    3, two behind by the numbers and none along the weights' lineage, as the buffer
    counted it. Not a problem; where summary.json does not say the restart (a killed
    driver's run), a note that one may account for it."""
    restart = {"time": 10.0, "checkpoint_version": 1, "after_version": 3}
    _bounded(
        tmp_path,
        0,
        {"reason": "completed", "segments": 1, "faults": {"trainer_restarts": [restart]}},
    )
    report = audit_run(tmp_path)
    assert report.ok and report.figures["s_train max (lineage)"] == 0, report.text()
    assert report.figures["s_train max"] == 2  # (by the numbers, as stored)
    (tmp_path / "summary.json").unlink()
    report = audit_run(tmp_path)
    assert report.ok, report.text()
    [note] = [n for n in report.notes if "max_train_staleness" in n]
    assert "a trainer restart the stores do not record may account for it" in note, note


def test_a_trajectory_sampled_before_the_last_resume_is_a_note(tmp_path):
    """A resume may set another bound (config.yaml then holds the last start's): what an
    earlier start trained past it is said, not counted a problem."""
    _bounded(tmp_path, 1, {"reason": "completed", "segments": 2, "resumed": {"version": 5}})
    TrajectoryWriter(tmp_path).record_resume(5, 100.0)
    report = audit_run(tmp_path)
    assert not [p for p in report.problems if "max_train_staleness" in p], report.text()
    [note] = [n for n in report.notes if "max_train_staleness" in n]
    assert "sampled before the run's last resume (from version 5)" in note, note


def test_a_config_yaml_that_does_not_read_leaves_the_bound_unchecked(tmp_path):
    _bounded(tmp_path, "[1")
    [note] = [n for n in audit_run(tmp_path).notes if "max_train_staleness" in n]
    assert note.startswith("buffer.max_train_staleness not checked: ") and "config.yaml" in note
