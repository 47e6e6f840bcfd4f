"""The analysis layer as a researcher comparing runs meets it (a review's findings): the
last throughput window ends at ``t_end`` whether or not it holds an event; a run selected
from ``open_runs`` is that run, its padding left out; the audit's figures have plain keys;
a paced run's clock is named; staleness histograms compare as shares."""

import numpy as np
import pytest
from factories import timed, trajectory

from storage import TrajectoryWriter, open_run, open_runs
from storage.metrics import MetricsWriter

T0 = 1.8e9


def _traj(u, finish, sample=None, *, version=0, group=None, size=1, reward=1.0):
    """A trajectory finished at ``finish`` s (the run's clock), submitted 1 s before,
    inserted then, consumed at ``sample`` (None: buffered)."""
    return timed(
        u, finish, None, sample, t0=T0, version=version, group=group, size=size, reward=reward
    )


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

    # Metrics rows that all come after the last trajectory event are on another clock
    # (a synthetic record: trajectories at 0-12 s, rows at epoch seconds): the windows
    # end at the last event, not 1.8e9 s of windows later
    other = tmp_path / "other"
    TrajectoryWriter(other).append(
        [
            trajectory("a", "g", t_finish=2.0).to_record(),
            trajectory("b", "g", t_finish=12.0).to_record(),
        ]
    )
    _rows(other, 35)
    tp = open_run(other).laminar.throughput(window=10.0)
    assert tp["time"].values.tolist() == [0.0, 10.0]


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


def _two_runs(tmp_path):
    """``short``: 3 trajectories (2 of a group of 2), resumed once, metrics to 40 s;
    ``long``: 6, metrics to 20 s: ``short`` is padded in ``open_runs``."""
    short, long = tmp_path / "short", tmp_path / "long"
    writer = TrajectoryWriter(short)
    writer.append([_traj("a", 2, sample=3, group="g", size=2), _traj("b", 3, group="g", size=2)])
    writer.record_resume(0, T0 + 25)
    writer.append([_traj("c", 30, sample=32, version=1, reward=0.0)])
    _rows(short, 40)
    TrajectoryWriter(long).append([_traj(f"u{i}", 1 + i, sample=2 + i) for i in range(6)])
    _rows(long, 20)
    return short, long


@pytest.mark.parametrize("how", ["sel", "isel", "default names"])
def test_a_run_selected_from_open_runs_is_that_run_without_its_padding(tmp_path, how):
    """``open_runs(...).sel(run=name).laminar`` passed the accessor's guard with the
    padding rows (status "", NaN) in: summary() overflowed, throughput() raised, an
    extra "" rollout, a NaN reward bucket, the audit's "missing contract fields". Each
    figure is now the run's, as ``open_run`` gives it (its record, the end and stop of
    its metrics, read from its directory)."""
    short, long = _two_runs(tmp_path)
    if how == "default names":
        one = open_runs([long, short]).sel(run="short")
    else:
        runs = open_runs([long, short], names=["fifo", "k1"])
        one = runs.sel(run="k1") if how == "sel" else runs.isel(run=1)
    a, b = one.laminar, open_run(short).laminar
    assert one.laminar is a  # (the accessor's padding left out once)
    assert a.summary() == b.summary()
    assert a.t_end == b.t_end == T0 + 40 and a.pauses_s == b.pauses_s != []
    assert a.throughput().identical(b.throughput())
    for name in ("by_rollout", "groups", "staleness_histogram", "reward_curve"):
        assert getattr(a, name)().identical(getattr(b, name)()), name
    assert a.reward_curve(by="time").identical(b.reward_curve(by="time"))
    assert a.buffer_age().equals(b.buffer_age())
    assert a.superseded().identical(b.superseded())
    lineage = [x.staleness(restarts="run")["s_train_lineage"] for x in (a, b)]
    assert lineage[0].drop_vars("run").identical(lineage[1])  # (the run's name kept)
    assert len(a.to_dataframe()) == 3
    with pytest.raises(ValueError, match=r"open_run\(path\)\.laminar\.audit\(\)"):
        a.audit()
    with pytest.raises(ValueError, match=r"open_run\(path\)\.laminar\.tokens\(\)"):
        a.tokens("response_tokens", 0)


def test_open_runs_unselected_and_a_run_moved_since_are_refused_saying_what_to_do(tmp_path):
    short, long = _two_runs(tmp_path)
    runs = open_runs([long, short], names=["fifo", "k1"])
    with pytest.raises(ValueError, match=r"ds\.sel\(run=name\)\.laminar"):
        _ = runs.laminar
    one = runs.sel(run="k1")
    assert one.laminar.summary()["n_consumed"] == 2  # (what needs no record of the run)
    short.rename(tmp_path / "moved")
    with pytest.raises(ValueError, match="none of its runs' directories"):
        one.laminar.throughput()


@pytest.mark.parametrize("paced", [True, False])
def test_a_paced_runs_throughput_names_its_clock_and_the_factor_to_the_modelled(tmp_path, paced):
    """A paced run's tokens/s are real tokens per dilated wall second (701 against the
    modelled cluster's ~10,500 in a review's run): its throughput says so, from the
    ``config.yaml`` beside the store, and its figures are unchanged."""
    TrajectoryWriter(tmp_path).append([_traj("a", 2, sample=3), _traj("b", 12, sample=12.5)])
    before = open_run(tmp_path).laminar.throughput()
    pacing = "\n".join(
        ["  pacing:", "    dilation: 15.0", "    length_scale: 16.0", "    request_scale: 2.0"]
    )
    (tmp_path / "config.yaml").write_text(
        "rollout:\n" + (pacing if paced else "  pacing: null") + "\ntrainer:\n  pacing: null\n"
    )
    ds = open_run(tmp_path)
    tp = ds.laminar.throughput()
    np.testing.assert_array_equal(tp["generated"].values, before["generated"].values)
    if not paced:
        assert ds.laminar.pacing is None and tp.attrs == before.attrs
        return
    p = ds.laminar.pacing
    assert p["modelled_rate_per_rate"] == 30.0 and p["modelled_s_per_wall_s"] == 16 / 15
    assert p["modelled_tokens_per_token"] == 32.0 and p["trainer_paced"] is False
    assert tp.attrs["units"] == "tokens/s" and tp.attrs["clock"].startswith("paced")
    assert tp.attrs["modelled_rate_per_rate"] == 30.0 and tp.attrs["dilation"] == 15.0


def test_staleness_histograms_compare_as_shares_and_concat_with_zeros(tmp_path):
    """Runs of different lengths compare by shares; the docs' concat fills a staleness
    one run never reached with 0 (join="outer" alone gave NaN)."""
    import xarray as xr

    one, two = tmp_path / "one", tmp_path / "two"
    TrajectoryWriter(one).append([_traj(f"u{i}", 1 + i, sample=2 + i) for i in range(3)])
    late = _traj("late", 1, sample=2)
    late["sample_version"] = 2  # (s_train 2: residence 2)
    TrajectoryWriter(two).append([_traj("a", 1, sample=2), late])
    counts = open_run(two).laminar.staleness_histogram()
    assert counts["s_train"].values.tolist() == [1, 0, 1]
    assert counts["s_train"].attrs["units"] == "trajectories"
    shares = [open_run(r).laminar.staleness_histogram(normalize=True) for r in (one, two)]
    assert shares[1]["s_train"].values.tolist() == [0.5, 0.0, 0.5]
    assert shares[1]["s_gen"].values.tolist() == [1.0, 0.0, 0.0]
    both = xr.concat(shares, dim="run", join="outer", fill_value=0)
    assert both["s_train"].values.tolist() == [[1.0, 0.0, 0.0], [0.5, 0.0, 0.5]]
    assert (both["s_train"].sum("staleness") == 1).all()
