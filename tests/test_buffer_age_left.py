"""Buffer age beyond the survivors: the trajectories that left the buffer unconsumed
(evicted, filtered, ...) are aged up to their ``t_leave``, and the audit checks the
leave fields against the sampling fields."""

import numpy as np
import pytest
from factories import trajectory

from storage import TrajectoryWriter, open_run

T0 = 1.8e9


def _left(u, status, t_insert, t_leave, leave_version, behavior=0):
    """A trajectory admitted at ``t_insert`` s (the run's clock) that left as ``status``
    at ``t_leave`` s, at ``leave_version``."""
    consumed = status == "consumed"
    return trajectory(
        u,
        f"g{u}",
        group_size=1,
        behavior_version=behavior,
        finish_version=behavior,
        status=status,
        sample_version=leave_version if consumed else -1,
        t_submit=T0 + t_insert - 1,
        t_start=T0 + t_insert - 1,
        t_finish=T0 + t_insert,
        t_insert=T0 + t_insert,
        t_sample=T0 + t_leave if consumed else np.nan,
        t_leave=T0 + t_leave,
        leave_version=leave_version,
    ).to_record()


def test_the_evicted_are_aged_up_to_their_leave_beside_the_consumed(tmp_path):
    """Under max_train_staleness the longest-waiting groups are evicted: buffer_age of
    the consumed alone is a survivor figure (run2 of the review: 1.19 s over the consumed,
    its 944 evicted left out). ``statuses`` takes the others, up to their t_leave."""
    TrajectoryWriter(tmp_path).append(
        [
            _left("a", "consumed", 0, 2, 1),
            _left("b", "consumed", 1, 2, 1),
            _left("c", "evicted", 0, 9, 3),
            _left("d", "filtered", 4, 4.5, 1, behavior=1),
            trajectory("e", "ge", group_size=1, finish_version=0, t_insert=T0 + 5).to_record(),
        ]
    )
    ds = open_run(tmp_path)
    assert ds.laminar.buffer_age().values.tolist() == [2.0, 1.0]  # (the consumed: as before)
    left = ds.laminar.buffer_age(statuses="left")
    assert left.values.tolist() == [2.0, 1.0, 9.0, 0.5]
    assert left["status"].values.tolist() == ["consumed", "consumed", "evicted", "filtered"]
    assert left["leave_version"].values.tolist() == [1, 1, 3, 1]
    assert left.groupby("status").mean().sel(status="evicted") == 9.0
    assert ds.laminar.buffer_age(statuses=["evicted"]).values.tolist() == [9.0]
    mean = ds.laminar.buffer_age(by_version="mean", statuses="left")
    assert mean.sel(behavior_version=0) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="a buffered trajectory has not left"):
        ds.laminar.buffer_age(statuses="buffered")
    assert ds.laminar.audit() == []


def test_the_audit_checks_the_leave_fields_against_the_sampling_fields(tmp_path):
    """A consumed trajectory left when and at the version it was sampled; a buffered one
    has not left."""
    TrajectoryWriter(tmp_path).append(
        [
            _left("a", "consumed", 0, 2, 1),
            trajectory("b", "gb", group_size=1, finish_version=0).to_record(),
        ]
    )
    ds = open_run(tmp_path)
    assert ds.laminar.audit() == []
    # (the writer fills a buffered one's leave fields itself: the damage is the reader's)
    t_leave = ds["t_leave"].values.copy()
    t_leave[0] += 1.0
    leave_version = ds["leave_version"].values.copy()
    leave_version[1] = 4
    problems = ds.assign(t_leave=("trajectory", t_leave)).laminar.audit()
    assert problems == [
        "1 consumed trajectories left the buffer at another time or version than they were "
        "sampled (t_leave, leave_version), e.g. 'a'"
    ]
    problems = ds.assign(leave_version=("trajectory", leave_version)).laminar.audit()
    assert problems == ["1 buffered trajectories have a t_leave or leave_version, e.g. 'b'"]


def test_a_store_that_knows_when_trajectories_left_has_it_for_every_one(tmp_path):
    """Schema 3 records when and at which version every trajectory left: an evicted one
    without it is a problem there (a store of schema 2 knew it of the consumed alone)."""
    silent = _left("c", "evicted", 0, 9, 3) | {"t_leave": np.nan, "leave_version": -1}
    TrajectoryWriter(tmp_path).append([_left("a", "consumed", 0, 2, 1), silent])
    assert open_run(tmp_path).laminar.audit() == [
        "1 trajectories that left the buffer unconsumed have no t_leave or leave_version, e.g. 'c'"
    ]
