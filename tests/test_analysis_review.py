"""The analysis layer as a researcher comparing runs meets it (a review's findings): the
last throughput window ends at ``t_end`` whether or not it holds an event; a run selected
from ``open_runs`` is that run, its padding left out; the audit's figures have plain keys;
a paced run's clock is named; staleness histograms compare as shares."""

import numpy as np
import pytest
from factories import trajectory

from storage import TrajectoryWriter, open_run
from storage.metrics import MetricsWriter

T0 = 1.8e9


def _traj(u, finish, sample=None, *, version=0, group=None, size=1, reward=1.0):
    """A trajectory finished at ``finish`` s (the run's clock), submitted 1 s before,
    inserted then, consumed at ``sample`` (None: buffered)."""
    status = "consumed" if sample is not None else "buffered"
    return trajectory(
        u,
        group or f"g{u}",
        group_size=size,
        behavior_version=version,
        finish_version=version,
        status=status,
        sample_version=version if status == "consumed" else -1,
        reward=reward,
        t_submit=T0 + finish - 1,
        t_start=T0 + finish - 1,
        t_finish=T0 + finish,
        t_insert=T0 + finish,
        t_sample=np.nan if sample is None else T0 + sample,
    ).to_record()


def _rows(path, until):
    """``cluster`` rows every 5 s from 0 to ``until`` s (the run's clock)."""
    rows = [
        {"segment": 0, "elapsed_s": float(t), "wall_time": T0 + t, "version": 0}
        for t in np.arange(0.0, until + 0.1, 5.0)
    ]
    MetricsWriter(path).append("cluster", rows)


def test_the_last_throughput_window_ends_at_t_end_though_it_holds_no_event(tmp_path):
    """Events up to 12 s, the run's last metrics row at 35 s: the windows run to 35 s
    (they stopped at the last event's, leaving 15 s the run ran out of the rate)."""
    TrajectoryWriter(tmp_path).append([_traj("a", 2, sample=3), _traj("b", 12, sample=12.5)])
    _rows(tmp_path, 35)
    ds = open_run(tmp_path)
    assert ds.laminar.t_end == T0 + 35 and ds.laminar.t0 == T0 + 1
    tp = ds.laminar.throughput(window=10.0)
    assert tp["time"].values.tolist() == [0.0, 10.0, 20.0, 30.0]
    assert float(tp["running_s"].sum()) == pytest.approx(34.0)
    rate = tp.weighted(tp["running_s"]).mean("time")
    assert float(rate["trained"]) == pytest.approx(10 / 34.0)  # (5 tokens each)
    assert tp["trained"].values[2:].tolist() == [0.0, 0.0]  # (ran, trained nothing)


def test_the_audits_figures_have_plain_keys_and_indent_in_text_only(tmp_path):
    """``audit_run(run).figures["buffered"]``: the statuses break down "trajectories",
    indented when printed, not in their keys (``--json`` stripped them; Python had
    ``"  buffered"``)."""
    from storage.audit import audit_run

    TrajectoryWriter(tmp_path).append([_traj("a", 2, sample=3), _traj("b", 4)])
    report = audit_run(tmp_path)
    assert report.figures["trajectories"] == 2
    assert report.figures["buffered"] == 1 and report.figures["consumed"] == 1
    assert not [k for k in report.figures if k != k.strip()]
    assert report.to_dict()["figures"] == report.figures
    lines = report.text().splitlines()
    assert any(line.startswith("  trajectories ") for line in lines)
    assert any(line.startswith("    buffered ") for line in lines)
