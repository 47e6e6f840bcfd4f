"""trajectories.zarr: ragged round-trips, the commit marker, schema agreement, audit."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laminar.contract import Trajectory
from storage import TrajectoryWriter, open_run, open_trajectories
from storage.schema import ALL_FIELDS, COMMIT_ATTR
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


def test_staleness_columns(tmp_path):
    w = TrajectoryWriter(tmp_path)
    w.append([record(0), record(1, status="buffered", sample_version=-1, t_sample=np.nan)])
    ds = open_run(tmp_path)
    assert ds["s_gen"].values.tolist() == [1, 1]
    assert ds["s_train"].values[0] == 2 and np.isnan(ds["s_train"].values[1])
    assert ds.laminar.staleness().sizes["trajectory"] == 1
    assert ds.laminar.summary()["n_buffered"] == 1
