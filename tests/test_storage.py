"""trajectories.zarr: ragged round-trips, the commit marker, schema agreement, audit."""

import numpy as np
import pytest
from conftest import attribute_writes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laminar.contract import Trajectory
from storage import TrajectoryWriter, open_run, open_trajectories
from storage.schema import ALL_FIELDS, COMMIT_ATTR, EVENT_FIELDS
from storage.trajectories import StoreError


def record(i, n_prompt=3, n_resp=4, **kw):
    t = Trajectory(
        uid=f"u{i}",
        prompt_uid=f"p{i // 2}",
        prompt_key=i,
        sample_idx=i % 2,
        group_size=2,
        prompt_tokens=np.arange(n_prompt, dtype=np.int32),
        response_tokens=np.arange(n_resp, dtype=np.int32) + 100,
        behavior_logprobs=-np.linspace(0, 1, n_resp).astype(np.float32),
        loss_mask=np.ones(n_resp, np.uint8),
        behavior_version=1,
        finish_reason="eos",
        rollout_ids="r0",
        t_submit=1.0,
        t_start=2.0,
        t_finish=3.0,
        finish_version=2,
        sample_version=3,
        reward=0.5,
        t_insert=4.0,
        t_sample=5.0,
        status="consumed",
    )
    for k, v in kw.items():
        setattr(t, k, v)
    return t.to_record()


def test_contract_and_schema_agree():
    assert set(Trajectory.field_names()) == set(ALL_FIELDS)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(1, 9), st.integers(0, 12)), min_size=1, max_size=6),
        min_size=1,
        max_size=4,
    )
)
def test_ragged_round_trip(tmp_path_factory, batches):
    path = tmp_path_factory.mktemp("store")
    w = TrajectoryWriter(path)
    written = []
    for batch in batches:
        recs = [record(len(written) + j, n_prompt=p, n_resp=r) for j, (p, r) in enumerate(batch)]
        w.append(recs)
        written += recs
    ds = open_run(path)
    assert ds.sizes["trajectory"] == len(written)
    for i, rec in enumerate(written):
        for field in ("prompt_tokens", "response_tokens", "behavior_logprobs", "loss_mask"):
            np.testing.assert_array_equal(ds.laminar.tokens(field, i), rec[field])
        assert ds["uid"].values[i] == rec["uid"]
        assert ds["reward"].values[i] == np.float32(rec["reward"])


def test_torn_append_is_invisible_and_truncated_on_reopen(tmp_path):
    w = TrajectoryWriter(tmp_path)
    w.append([record(0), record(1)])
    # A writer that died mid-append: token arrays grown, per-trajectory arrays not, no commit.
    w.group["response_tokens"].append(np.arange(50, dtype=np.int32))
    w.group["uid"].append(np.array(["ghost"], dtype=w.group["uid"].dtype))
    assert open_run(tmp_path).sizes == {
        "trajectory": 2,
        "prompt_token": 6,
        "response_token": 8,
        "version_token": 0,
    }
    assert len(open_trajectories(tmp_path)["response_tokens"]) == 8
    w2 = TrajectoryWriter(tmp_path)  # reopening drops the uncommitted tail
    w2.append([record(2)])
    ds = open_run(tmp_path)
    assert list(ds["uid"].values) == ["u0", "u1", "u2"]
    np.testing.assert_array_equal(ds.laminar.tokens("response_tokens", 2), np.arange(4) + 100)
    assert w2.group.attrs[COMMIT_ATTR] == 3


def test_mismatched_ragged_lengths_are_refused_before_writing(tmp_path):
    w = TrajectoryWriter(tmp_path)
    bad = record(0)
    bad["loss_mask"] = np.ones(9, np.uint8)
    with pytest.raises(StoreError, match="loss_mask has 9 values but response_tokens has 4"):
        w.append([bad])


def test_missing_store_names_the_path(tmp_path):
    with pytest.raises(StoreError, match="no trajectory store at"):
        open_run(tmp_path / "nope")


def test_a_damaged_store_is_named_not_a_traceback(tmp_path):
    """What a damaged store raises (a truncated zarr.json, a chunk that does not
    decompress, a missing chunk of rewards, which zarr would read as NaN) comes back as a
    StoreError naming it."""
    import shutil

    from storage.audit import audit_run

    w = TrajectoryWriter(tmp_path / "good")
    w.append([record(0), record(1), record(2), record(3)])
    assert audit_run(tmp_path / "good").ok

    def damaged(name, damage):
        run = tmp_path / name
        shutil.copytree(tmp_path / "good", run)
        damage(run / "trajectories.zarr")
        return run

    def chunk(store, array):
        return next(p for p in (store / array).rglob("*") if p.is_file() and p.name != "zarr.json")

    run = damaged("trunc-json", lambda s: (s / "zarr.json").write_text('{"zarr_format": 3, '))
    with pytest.raises(StoreError, match=r"cannot read .*trunc-json.*JSONDecodeError.*damaged"):
        open_run(run)
    run = damaged("trunc-chunk", lambda s: chunk(s, "uid").write_bytes(b"\x28\xb5\x2f\xfd\x00"))
    with pytest.raises(StoreError, match=r"cannot read .*trunc-chunk.*damaged"):
        open_trajectories(run)
    run = damaged("no-reward-chunk", lambda s: chunk(s, "reward").unlink())
    with pytest.raises(StoreError, match=r"no-reward-chunk.*array 'reward' lacks chunk"):
        audit_run(run)


def test_audit_finds_violations(tmp_path):
    w = TrajectoryWriter(tmp_path)
    w.append([record(0), record(1)])
    assert open_run(tmp_path).laminar.audit() == []
    w.append(
        [record(2, finish_version=0), record(2)]
    )  # finishes early; uid twice; group p1 incomplete
    problems = open_run(tmp_path).laminar.audit()
    text = "\n".join(problems)
    assert "finish before their behavior version" in text
    assert "stored more than once" in text
    assert "consumed groups incomplete" not in text  # p1 has 2 consumed rows (the duplicate)
    w.append([record(4)])  # p2 gets one of its two siblings
    assert any("incomplete" in p for p in open_run(tmp_path).laminar.audit())


@pytest.mark.parametrize(
    ("rows", "problem"),
    [
        # trained by version 0 (sampled at 0) but finished at version 1
        ([dict(finish_version=1, sample_version=0)], "consumed trajectories sampled before"),
        # siblings trained by two versions: the group was split
        (
            [dict(sample_version=0), dict(sample_idx=1, sample_version=1)],
            "groups consumed across several trainer versions",
        ),
        ([dict(status="evicted")], "unknown statuses ['lost-in-space']"),  # (then damaged)
    ],
    ids=["sampled_before_finished", "group_split", "unknown_status"],
)
def test_the_audit_catches_each_violation_of_the_data_contract(tmp_path, rows, problem):
    """Each check of the audit fires on a store that breaks it (none did in any test:
    a check that never fires could be broken unseen, and every end-to-end test's clean
    audit would mean nothing for it)."""
    from factories import trajectory

    consumed = dict(status="consumed", t_sample=1.0, finish_version=0, group_size=len(rows))
    TrajectoryWriter(tmp_path).append(
        [trajectory(f"u{i}", "g", **(consumed | r)).to_record() for i, r in enumerate(rows)]
    )
    if "unknown" in problem:  # (the writer refuses one: another writer's, or damage)
        import zarr

        zarr.open_group(str(tmp_path / "trajectories.zarr"), mode="r+")["status"][0] = (
            "lost-in-space"
        )
    assert any(problem in p for p in open_run(tmp_path).laminar.audit()), problem


def test_the_run_audit_catches_a_group_with_more_members_than_its_size(tmp_path):
    from factories import trajectory

    from storage.audit import audit_run

    TrajectoryWriter(tmp_path).append(
        [trajectory(u, "g", sample_idx=i, group_size=1).to_record() for i, u in enumerate("ab")]
    )
    (tmp_path / "summary.json").write_text('{"reason": "completed"}')
    assert "1 groups have more members than size" in audit_run(tmp_path).problems


def test_staleness_columns(tmp_path):
    w = TrajectoryWriter(tmp_path)
    w.append([record(0), record(1, status="buffered", sample_version=-1, t_sample=np.nan)])
    ds = open_run(tmp_path)
    assert ds["s_gen"].values.tolist() == [1, 1]
    assert ds["s_train"].values[0] == 2 and np.isnan(ds["s_train"].values[1])
    assert ds.laminar.staleness().sizes["trajectory"] == 1
    assert ds.laminar.summary()["n_buffered"] == 1


def _leave(i, status="consumed", sample_version=3, t_sample=5.0):
    return {
        "uid": f"u{i}",
        "status": status,
        "sample_version": sample_version,
        "t_sample": t_sample,
    }


def test_leave_events_update_stored_trajectories_in_order(tmp_path):
    """Stored on admission as buffered; where each stands now comes from its events."""
    w = TrajectoryWriter(tmp_path)
    admitted = dict(status="buffered", sample_version=-1, t_sample=np.nan)
    w.append([record(0, **admitted), record(1, **admitted), record(2, **admitted)])
    assert set(open_run(tmp_path)["status"].values) == {"buffered"}
    w.append([record(3, **admitted)], events=[_leave(0), _leave(3, "evicted", -1, np.nan)])
    w.append([], events=[_leave(1, "consumed", 4, 6.0)])
    ds = open_run(tmp_path)
    assert ds["status"].values.tolist() == ["consumed", "consumed", "buffered", "evicted"]
    assert ds["sample_version"].values.tolist() == [3, 4, -1, -1]
    assert ds["s_train"].values[1] == 3 and np.isnan(ds["s_train"].values[2])
    raw = open_trajectories(tmp_path)
    assert raw["status"].tolist() == ds["status"].values.tolist()
    assert raw["t_sample"][1] == 6.0
    assert "event_uid" not in ds  # applied, not shown


def test_a_half_written_event_batch_is_invisible_and_dropped_on_reopen(tmp_path):
    w = TrajectoryWriter(tmp_path)
    w.append([record(0, status="buffered", sample_version=-1, t_sample=np.nan)])
    # A writer dies after appending events but before the commit marker.
    w.group["event_uid"].append(np.array(["u0"], dtype=w.group["event_uid"].dtype))
    w.group["event_status"].append(np.array(["consumed"], dtype=w.group["event_status"].dtype))
    assert open_run(tmp_path)["status"].values.tolist() == ["buffered"]
    w2 = TrajectoryWriter(tmp_path)
    assert w2.group["event_uid"].shape[0] == 0 and w2.group["event_status"].shape[0] == 0
    w2.append([], events=[_leave(0)])
    assert open_run(tmp_path)["status"].values.tolist() == ["consumed"]


def test_bad_leave_events_are_refused(tmp_path):
    w = TrajectoryWriter(tmp_path)
    with pytest.raises(StoreError, match="status 'lost' is not one of"):
        w.append([record(0)], events=[_leave(0, "lost")])
    assert open_trajectories(tmp_path)["uid"].tolist() == []  # nothing written
    w.append([record(0), record(1)])
    w.append([], events=[_leave(7), _leave(1, t_sample=6.0)])  # u7: not stored
    # The store stays readable (its trajectories are the run's record); the audit says it.
    ds = open_run(tmp_path)
    assert ds["t_sample"].values.tolist() == [5.0, 6.0]
    assert ds.attrs["unknown_events"] == 1
    assert open_trajectories(tmp_path)["t_sample"].tolist() == [5.0, 6.0]
    from storage.audit import audit_run

    (problem,) = audit_run(tmp_path).problems
    assert "1 leave events name trajectories the store does not hold, e.g. 'u7'" in problem


def test_stores_of_schema_1_are_still_read(tmp_path):
    """Schema 1 stored trajectories when they left the buffer, without events."""
    w = TrajectoryWriter(tmp_path)
    w.append([record(0), record(1)])
    w.group.attrs.update({"schema_version": 1})
    for name in (*EVENT_FIELDS, "t_leave", "leave_version"):
        del w.group[name]
    del w.group.attrs["n_committed_events"]
    ds = open_run(tmp_path)
    assert ds["status"].values.tolist() == ["consumed", "consumed"]
    assert ds["t_leave"].values.tolist() == [5.0, 5.0]  # (as sampled)
    assert ds["leave_version"].values.tolist() == [3, 3]
    with pytest.raises(StoreError, match="schema_version 1, this code writes 3"):
        TrajectoryWriter(tmp_path)


def _as_schema_2(w: TrajectoryWriter) -> None:
    """The store of ``w`` as laminar wrote it before ``t_leave`` and ``leave_version``."""
    for name in ("t_leave", "leave_version", "event_t_leave", "event_leave_version"):
        del w.group[name]
    w.group.update_attributes({"schema_version": 2})


def test_a_store_of_schema_2_reads_resumes_and_is_taken_on_by_a_writer(tmp_path):
    """A store written before ``t_leave``/``leave_version`` reads them as its samples
    say (a consumed trajectory left when sampled; any other's are unknown: NaN, -1),
    passes the checks a resume makes and the audit, and a writer opening it (a resume)
    adds them as read, raises its schema, and records the leaves after."""
    from storage.audit import audit_run
    from storage.trajectories import check_resumable
    from storage.trajectories_read import leave_events

    w = TrajectoryWriter(tmp_path)
    admitted = dict(status="buffered", sample_version=-1, t_sample=np.nan)
    evicted = dict(status="evicted", sample_version=-1, t_sample=np.nan)
    w.append(
        [record(i, **admitted) for i in range(4)]
        + [record(i, **evicted) for i in (4, 5)]  # (written as they left)
        + [record(i, **admitted) for i in (6, 7)]
    )
    w.append([], events=[_leave(0), _leave(1), _leave(2, **evicted), _leave(3, **evicted)])
    _as_schema_2(w)

    def read(last="buffered"):
        ds = open_run(tmp_path)
        statuses = [*["consumed"] * 2, *["evicted"] * 4, *[last] * 2]
        assert ds["status"].values.tolist() == statuses
        return ds["t_leave"].values, ds["leave_version"].values.tolist()

    assert np.array_equal(read()[0], [5.0, 5.0, *[np.nan] * 6], equal_nan=True)
    assert read()[1] == [3, 3, *[-1] * 6]
    assert leave_events(tmp_path)["event_leave_version"].tolist() == [3, 3, -1, -1]
    assert open_trajectories(tmp_path, ["t_leave"])["leave_version"].tolist() == read()[1]
    check_resumable(tmp_path, ["u6", "u7"])
    assert audit_run(tmp_path).ok, audit_run(tmp_path).text()
    before = read()

    w = TrajectoryWriter(tmp_path)  # (a resume's)
    assert w.group.attrs["schema_version"] == 3
    # (its 8 rows are known for the consumed alone: the audit asks the rows after it)
    assert open_run(tmp_path).attrs["leave_known_from"] == 8
    assert np.array_equal(read()[0], before[0], equal_nan=True) and read()[1] == before[1]
    gone = {"t_leave": 9.0, "leave_version": 4}
    w.append([], events=[_leave(6, **evicted) | gone, _leave(7, **evicted) | gone])
    t, v = read("evicted")
    assert v == [3, 3, *[-1] * 4, 4, 4] and t[6:].tolist() == [9.0, 9.0]
    check_resumable(tmp_path)
    assert audit_run(tmp_path).ok, audit_run(tmp_path).text()


def test_a_writer_fills_a_consumed_ones_leave_from_its_sampling_and_a_buffered_ones_not(
    tmp_path,
):
    """Callers that name no ``t_leave``/``leave_version`` (records and events as laminar
    wrote them before) get a consumed trajectory's sampling; one buffered, or held
    again, has neither, whatever it names."""
    w = TrajectoryWriter(tmp_path)
    held = {"t_leave": 7.0, "leave_version": 2}
    admitted = dict(status="buffered", sample_version=-1, t_sample=np.nan, **held)
    w.append([record(0), record(1, **admitted), record(2, **admitted)])
    w.append([], events=[_leave(1), _leave(0, "buffered", -1, 8.0) | held])
    ds = open_run(tmp_path)
    assert ds["leave_version"].values.tolist() == [-1, 3, -1]
    assert np.array_equal(ds["t_leave"].values, [np.nan, 5.0, np.nan], equal_nan=True)


def test_a_store_whose_creation_was_killed_is_created_again(tmp_path, monkeypatch):
    """Creating the store was the bare group, its arrays, its attributes, then its
    ``schedule`` in another write: a kill after the bare group made every later open
    fail ("schema_version None ... use a new run directory"), and one before the
    ``schedule`` left a partial_rollout store that read as laminar. Its attributes are
    one write, the last; until then a writer opening the store creates it again."""
    import zarr

    from storage.stores import new_array

    g = zarr.open_group(str(tmp_path / "trajectories.zarr"), mode="a", zarr_format=3)
    new_array(g, "uid", np.dtypes.StringDType(), "trajectory", 16384)  # (killed here)
    (tmp_path / "trajectories.zarr" / "reward").mkdir()  # (and here, making another)
    with attribute_writes(monkeypatch) as writes:
        w = TrajectoryWriter(tmp_path, schedule="partial_rollout")
    assert len(writes) == 1 and writes[0]["schedule"] == "partial_rollout"
    assert writes[0]["schema_version"] == 3 and writes[0][COMMIT_ATTR] == 0
    w.append([record(0), record(1)])
    assert open_run(tmp_path).attrs["schedule"] == "partial_rollout"
    assert open_trajectories(tmp_path)["uid"].tolist() == ["u0", "u1"]


def test_a_group_without_attributes_that_holds_data_is_not_created_over(tmp_path):
    """Only a store with nothing written but (some of) its empty arrays is created
    again: a group that holds any value, or anything a trajectory store has not, is
    refused as before."""
    import zarr

    for what in ("values", "other"):
        root = tmp_path / what
        g = zarr.open_group(str(root / "trajectories.zarr"), mode="a", zarr_format=3)
        if what == "values":
            g.create_array("reward", shape=(2,), dtype="float32")[:] = [1.0, 2.0]
        else:
            g.create_group("mine")
        with pytest.raises(StoreError, match="schema_version None"):
            TrajectoryWriter(root)
        assert "schedule" not in zarr.open_group(str(root / "trajectories.zarr")).attrs


def test_a_writer_another_took_the_store_from_commits_nothing_more(tmp_path):
    """Two writers of one store corrupt it silently (a data module rebuilt while the
    lost one still writes). Each writer raises the store's ``writer_epoch`` as it opens
    it and checks it before it writes and before it commits: the older one refuses,
    naming the store, and the newer one's batches start at the committed lengths, past
    nothing the older wrote meanwhile."""
    from storage.trajectories import WriterReplaced

    old = TrajectoryWriter(tmp_path)
    old.append([record(0)])
    opened = []
    check = old._check_epoch

    def taken_over_as_it_writes():  # (the newer one opens the store between the checks)
        if not opened:
            opened.append(TrajectoryWriter(tmp_path))
        check()

    old._check_epoch = taken_over_as_it_writes
    with pytest.raises(WriterReplaced, match="another writer took the store over"):
        old.append([record(1, n_resp=7)])
    (new,) = opened
    assert new.epoch == 2
    with pytest.raises(WriterReplaced, match=str(tmp_path)):
        old.record_resume(1, 1.0)
    assert new.append([record(2)]) == 2
    got = open_trajectories(tmp_path)
    assert got["uid"].tolist() == ["u0", "u2"]
    assert got["response_tokens"].tolist() == [100, 101, 102, 103] * 2
    assert TrajectoryWriter(tmp_path).epoch == 3


def test_a_resume_readmits_untrained_whole_groups_and_drops_the_rest(tmp_path):
    """Checkpoint at version 2: what it trained stays consumed; whole groups it did not
    train (buffered, or consumed by an update after it) come back; the rest is dropped,
    a group whose siblings were still generating too: its missing samples, generated by
    the resumed run, would be another behavior policy's than its stored ones (they were
    re-issued, and the group trained so)."""
    from storage.resume import plan_resume

    def group(g, status="buffered", members=2, **kw):
        if status == "buffered":
            kw = {"sample_version": -1, "t_sample": np.nan} | kw
        return [
            record(
                2 * g + k, prompt_uid=f"p{g:08d}", status=status, **{"uid": f"p{g:08d}-{k}"} | kw
            )
            for k in range(members)
        ]

    w = TrajectoryWriter(tmp_path)
    w.append(
        group(0, "consumed", sample_version=1)  # trained into the checkpoint
        + group(1, "consumed", sample_version=2, finish_version=2)  # by a lost update
        + group(2, finish_version=1)  # buffered, whole
        + group(3, members=1)  # a sibling still generating when the run ended
        + group(5, finish_version=3)  # finished after the checkpoint: its policy is gone
        + group(6, members=1)
        + group(6, members=1, finish_reason="error", uid="p00000006-1")  # reward failed
        + group(8, "evicted", sample_version=-1, t_sample=np.nan)
    )
    plan = plan_resume(tmp_path, version=2)
    assert plan.readmit == ["p00000001-0", "p00000001-1", "p00000002-0", "p00000002-1"]
    assert plan.readmit_groups == ["p00000001", "p00000002"]
    # p00000003's sample 1 was generating: the group is dropped, nothing re-issued
    assert plan.reissue == {} and plan.dropped_incomplete == 1
    # and why the others went (the resume's header said "stored in part" alone)
    assert (plan.dropped_late, plan.dropped_failed) == (1, 1)
    assert plan.drop == [
        "p00000003-0",
        "p00000005-0",
        "p00000005-1",
        "p00000006-0",
        "p00000006-1",
    ]
    assert plan.start == 9 and plan.consumed == 2 and plan.stored == 13


def test_a_resume_reissues_the_groups_only_the_recovery_log_names(tmp_path):
    """A group with nothing stored was generating when the run ended: the recovery log
    names it, and it is re-issued whole, also below the last stored prompt; a logged
    trajectory the store has (its forget lagged) or whose group is stored is not."""
    from laminar.contract import PromptGroup
    from laminar.engine import GenerationRequest, RequestState, SamplingParams
    from laminar.partial import PartialCore
    from storage.partial_log import PartialLogWriter
    from storage.resume import plan_resume

    TrajectoryWriter(tmp_path).append(
        [record(k, prompt_uid="p00000000", uid=f"p00000000-{k}", sample_version=0) for k in (0, 1)]
        + [  # its sibling is missing
            record(
                8,
                prompt_uid="p00000003",
                uid="p00000003-0",
                status="buffered",
                finish_version=1,
                sample_version=-1,
                t_sample=np.nan,
            )
        ]
    )
    core = PartialCore(journal=True)
    for g, key in ((0, 5), (1, 6), (3, 8), (4, 9)):
        uid = f"p{g:08d}"
        group = PromptGroup(uid, key, (1, 2), "x", 2, 0)
        core.register(
            "r0",
            1,
            [
                RequestState(
                    GenerationRequest(
                        f"{uid}-{k}", (1, 2), SamplingParams(4), {"group": group, "sample_idx": k}
                    ),
                    seed=k,
                )
                for k in range(2)
            ],
        )
    core.flush("r0", {"p00000001-0": (0, [3], [-0.1], [1])}, {"p00000001-0": ("eos", 2.0)})
    PartialLogWriter(tmp_path).append(**core.drain_journal())
    plan = plan_resume(tmp_path, version=1)
    assert plan.reissue == {
        "p00000001": (6, 2, (0, 1)),  # below the last stored prompt: only the log knew
        "p00000004": (9, 2, (0, 1)),
    }
    # (p00000003, stored in part, is dropped: not completed by another policy's sample)
    assert plan.drop == ["p00000003-0"]
    assert plan.start == 5 and plan.log_groups == 2
    # not stored: p00000001's two (one had finished), p00000003-1, p00000004's two
    assert (plan.log_completed, plan.log_unfinished) == (1, 4)

    # The audit: a completed trajectory in the log and not the store was lost only if
    # the run ended; running (or lost, or resumed and running again), it is on its way.
    import json

    from storage.audit import audit_run
    from storage.metrics import MetricsWriter

    def log_note_or_problem() -> str:
        report = audit_run(tmp_path)
        said = [("note", n) for n in report.notes] + [("problem", p) for p in report.problems]
        (kind,) = [k for k, text in said if "in the recovery log but not the store" in text]
        return kind

    assert log_note_or_problem() == "note"  # (no summary.json: running or lost)
    (tmp_path / "summary.json").write_text(json.dumps({"reason": "stopped", "segments": 1}))
    metrics = MetricsWriter(tmp_path)
    metrics.append("cluster", [{"segment": 0, "elapsed_s": 1.0, "wall_time": 1e9, "version": 1}])
    assert log_note_or_problem() == "problem"
    # resumed: the first start's summary stands until the second ends
    metrics.append("cluster", [{"segment": 1, "elapsed_s": 9.0, "wall_time": 1e9, "version": 1}])
    assert log_note_or_problem() == "note"


def test_a_rebuilt_data_module_takes_the_store_against_the_trainer_and_the_rollouts(tmp_path):
    """The data module lost within the run: the trainer's record of what it sampled
    (since its checkpoint at version 2) is the truth for consumption, the store for
    everything it committed; what the rollouts still hold stays outstanding."""
    from storage.resume import plan_rebuild

    def group(g, status="buffered", **kw):
        if status == "buffered":
            kw = {"sample_version": -1, "t_sample": np.nan} | kw
        return [
            record(2 * g + k, prompt_uid=f"p{g:08d}", status=status, uid=f"p{g:08d}-{k}", **kw)
            for k in range(2)
        ]

    TrajectoryWriter(tmp_path).append(
        group(0, "consumed", sample_version=1)  # before the checkpoint: committed, as it is
        + group(1, "consumed", sample_version=2)  # the trainer has it: stays consumed
        + group(2, "consumed", sample_version=3)  # its reply died with the buffer
        + group(3)  # consumed, its event not yet stored
        + group(4)  # buffered
        + group(5, "evicted", sample_version=-1, t_sample=np.nan)
    )
    consumed = {u: (v, 9.0) for u, v in [("p00000001-0", 2), ("p00000001-1", 2)]}
    consumed |= {f"p00000003-{k}": (4, 9.5) for k in range(2)}
    consumed |= {f"p00000007-{k}": (4, 9.5) for k in range(2)}  # never stored
    plan = plan_rebuild(
        tmp_path,
        version=5,
        consumed=consumed,
        since=2,
        held_groups={"p00000007", "p00000008", "p00000011"},  # 7: sent, not yet stored
        # a lost rollout's, in the pool's log: p00000004-1 committed, its "forgotten"
        # not logged (not resumed), p00000009-0 unfinished (resumed: outstanding)
        orphans=["p00000004-1", "p00000009-0"],
    )
    assert plan.orphans_stored == ["p00000004-1"] and plan.summary()["log_stored"] == 1
    assert plan.hold == ["p00000002-0", "p00000002-1", "p00000004-0", "p00000004-1"]
    assert plan.taken_back == 2
    assert plan.mark_consumed == {"p00000003-0": (4, 9.5), "p00000003-1": (4, 9.5)}
    assert plan.consumed_elsewhere == {"p00000007-0": (4, 9.5), "p00000007-1": (4, 9.5)}
    # held again or held by a rollout, and not consumed
    assert plan.outstanding == [
        "p00000002",
        "p00000004",
        "p00000008",
        "p00000009",
        "p00000011",
    ]
    assert plan.start == 12 and plan.stored == 12 and plan.version == 5


def test_an_events_only_batch_leaves_the_next_records_tokens_where_they_are(tmp_path):
    """The buffer flushes leave events without records all the time; the records
    appended after such a batch must still point at their own tokens."""
    w = TrajectoryWriter(tmp_path)
    admitted = dict(status="buffered", sample_version=-1, t_sample=np.nan)
    w.append([record(0, **admitted), record(1, **admitted)])
    w.append([], events=[_leave(0)])
    recs = [
        record(2, n_prompt=5, n_resp=7, **admitted),
        record(3, n_prompt=2, n_resp=1, **admitted),
    ]
    recs[1]["prompt_tokens"] = np.array([77, 78], np.int32)
    recs[1]["response_tokens"] = np.array([99], np.int32)
    w.append(recs)
    ds = open_run(tmp_path)
    assert ds["prompt_start"].values.tolist() == [0, 3, 6, 11]
    assert ds["response_start"].values.tolist() == [0, 4, 8, 15]
    np.testing.assert_array_equal(ds.laminar.tokens("prompt_tokens", 3), [77, 78])
    np.testing.assert_array_equal(ds.laminar.tokens("response_tokens", 3), [99])
    assert w.group["prompt_start"].shape == (4,)


def test_stores_whose_starts_an_events_only_batch_shifted_are_read_right(
    tmp_path, caplog, monkeypatch
):
    """Before the fix above, each events-only batch appended one stray start per ragged
    group, shifting every later trajectory's start. The tokens and lengths were written
    right, so readers take the starts from the lengths and say so."""
    w = TrajectoryWriter(tmp_path)
    w.append([record(0), record(1)])
    for group, stray in (("prompt", 6), ("response", 8), ("versions", 0)):  # as it did
        w.group[f"{group}_start"].append(np.array([stray], np.int64))
    # (and the writer then appended at the arrays' ends: it takes back what is past the
    # committed lengths now)
    monkeypatch.setattr(w, "_lengths", lambda: {n: a.shape[0] for n, a in w.group.arrays()})
    last = record(3, n_prompt=2)
    last["prompt_tokens"] = np.array([77, 78], np.int32)
    w.append([record(2, n_prompt=5), last])
    assert w.group["prompt_start"][:4].tolist() == [0, 3, 6, 6]  # shifted on disk
    ds = open_run(tmp_path)
    assert ds["prompt_start"].values.tolist() == [0, 3, 6, 11]
    np.testing.assert_array_equal(ds.laminar.tokens("prompt_tokens", 3), [77, 78])
    assert open_trajectories(tmp_path)["prompt_start"].tolist() == [0, 3, 6, 11]
    assert "taken from the lengths" in caplog.text


def test_a_failed_append_leaves_nothing_behind_for_the_next(tmp_path, monkeypatch):
    """A batch refused half-way (a bad record after good ones) or cut by an error while
    writing (a full disk) must not shift what the same writer appends next: the buffer's
    writer thread keeps going after a failed batch."""
    w = TrajectoryWriter(tmp_path)
    w.append([record(0), record(1)])
    bad = record(2)
    bad["loss_mask"] = np.ones(9, np.uint8)  # prompt_tokens come first: checked late
    with pytest.raises(StoreError, match="loss_mask has 9 values"):
        w.append([bad])
    assert w.group["prompt_tokens"].shape == (6,)  # refused before writing anything

    real = type(w.group["uid"]).append
    calls = []

    def failing(self, data, *a, **kw):
        calls.append(1)
        if len(calls) == 7:
            raise OSError(28, "No space left on device")
        return real(self, data, *a, **kw)

    monkeypatch.setattr(type(w.group["uid"]), "append", failing)
    with pytest.raises(OSError):
        w.append([record(4)])
    monkeypatch.undo()
    last = record(3, n_prompt=2)
    last["prompt_tokens"] = np.array([77, 78], np.int32)
    assert w.append([last]) == 3
    ds = open_run(tmp_path)
    assert ds["uid"].values.tolist() == ["u0", "u1", "u3"]
    np.testing.assert_array_equal(ds.laminar.tokens("prompt_tokens", 2), [77, 78])
    np.testing.assert_array_equal(ds.laminar.tokens("response_tokens", 2), np.arange(4) + 100)
    assert w.group["prompt_tokens"].shape == (8,) and w.group["uid"].shape == (3,)


def group_metadata_writes(monkeypatch) -> list[dict]:
    """The attributes of every write of a Zarr group's metadata (``zarr.json``) from
    here on."""
    from zarr.core.group import AsyncGroup

    writes: list[dict] = []
    save = AsyncGroup._save_metadata

    async def counted(self, *args, **kwargs):
        writes.append(dict(self.metadata.attributes))
        return await save(self, *args, **kwargs)

    monkeypatch.setattr(AsyncGroup, "_save_metadata", counted)
    return writes


def test_a_batchs_commit_markers_go_in_one_write(tmp_path, monkeypatch):
    """Readers slice every array to the markers (trajectories, tokens per dimension,
    events): written key by key (attrs.update), a reader of a run still going could see
    the trajectories raised and the token counts not yet (the newest batch's tokens read
    short or empty), and a crash between the writes left rows whose tokens the next
    batch then filled with its own."""
    writer = TrajectoryWriter(tmp_path)
    writes = group_metadata_writes(monkeypatch)
    writer.append([record(0, n_resp=5), record(1, n_resp=7)])
    (commit,) = writes
    assert commit[COMMIT_ATTR] == 2 and commit["n_committed_tokens"]["response_token"] == 12
