"""The ``Dataset.laminar`` analysis figures agree with a direct computation on raw arrays."""

import logging

import numpy as np
import pytest

from laminar.contract import Trajectory
from storage import TrajectoryWriter, open_run, open_trajectories


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A synthetic run: 40 groups of 4, versions, times and statuses drawn at random."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("run")
    records = []
    for g in range(40):
        k = int(rng.integers(0, 5))
        status = rng.choice(["consumed", "buffered", "discarded"], p=[0.7, 0.2, 0.1])
        for i in range(4):
            n = int(rng.integers(1, 20))
            t_finish = 100.0 + rng.uniform(0, 60)
            t_insert = t_finish + rng.uniform(0, 1)
            consumed = status == "consumed"
            m_f = k + int(rng.integers(0, 2))
            records.append(
                Trajectory(
                    uid=f"g{g}-{i}",
                    prompt_uid=f"g{g}",
                    prompt_key=g,
                    sample_idx=i,
                    group_size=4,
                    prompt_tokens=np.ones(3, np.int32),
                    response_tokens=np.ones(n, np.int32),
                    behavior_logprobs=np.zeros(n, np.float32),
                    loss_mask=np.ones(n, np.uint8),
                    behavior_version=k,
                    finish_reason="error" if status == "discarded" else "eos",
                    rollout_ids=f"r{g % 3}",
                    t_submit=t_finish - 5,
                    t_start=t_finish - 4,
                    t_finish=t_finish,
                    finish_version=m_f,
                    sample_version=m_f + int(rng.integers(0, 3)) if consumed else -1,
                    reward=np.nan if status == "discarded" else float(rng.random()),
                    t_insert=t_insert,
                    t_sample=t_insert + rng.uniform(0, 9) if consumed else np.nan,
                    status=str(status),
                ).to_record()
            )
    TrajectoryWriter(path).append(records)
    return open_run(path), open_trajectories(path)


def test_staleness_and_its_histogram(run):
    ds, raw = run
    consumed = raw["status"] == "consumed"
    s_train = (raw["sample_version"] - raw["behavior_version"])[consumed]
    st = ds.laminar.staleness()
    np.testing.assert_array_equal(st["s_train"].values, s_train)
    np.testing.assert_array_equal(st["trajectory"].values, np.flatnonzero(consumed))
    for name in ("behavior_version", "s_gen", "residence"):
        want = ds[name].values[consumed]
        np.testing.assert_array_equal(st[name].values, want)
    assert list(st.data_vars) == ["behavior_version", "s_gen", "residence", "s_train"]
    hist = ds.laminar.staleness_histogram()
    for value in range(int(s_train.max()) + 1):
        assert hist["s_train"].sel(staleness=value).item() == (s_train == value).sum()
    assert hist["residence"].sum().item() == consumed.sum()


def test_buffer_age(run):
    ds, raw = run
    consumed = raw["status"] == "consumed"
    np.testing.assert_allclose(
        ds.laminar.buffer_age().values, (raw["t_sample"] - raw["t_insert"])[consumed]
    )


def test_throughput(run):
    ds, raw = run
    tp = ds.laminar.throughput(window=7.0)
    t0 = raw["t_submit"].min()
    t_end = np.nanmax(np.concatenate([raw["t_finish"], raw["t_sample"]])) - t0
    tokens = raw["prompt_len"] + raw["response_len"]
    n = tp.sizes["time"]
    assert 7.0 * (n - 1) <= t_end < 7.0 * n
    for w in range(n):
        span = 7.0 if w < n - 1 else t_end - 7.0 * w  # the last window ends at the last event
        in_w = (raw["t_finish"] - t0 >= 7.0 * w) & (raw["t_finish"] - t0 < 7.0 * (w + 1))
        assert tp["generated"].values[w] == pytest.approx(tokens[in_w].sum() / span)
        decoded = raw["response_len"][in_w].sum() / span
        assert tp["response"].values[w] == pytest.approx(decoded)
        sampled = (raw["t_sample"] - t0 >= 7.0 * w) & (raw["t_sample"] - t0 < 7.0 * (w + 1))
        assert tp["trained"].values[w] == pytest.approx(tokens[sampled].sum() / span)


def test_reward_curves(run):
    ds, raw = run
    ok = raw["finish_reason"] != "error"
    by_version = ds.laminar.reward_curve(by="version")
    for k in np.unique(raw["behavior_version"][ok]):
        sel = ok & (raw["behavior_version"] == k)
        assert by_version.sel(behavior_version=k).item() == pytest.approx(raw["reward"][sel].mean())
    by_time = ds.laminar.reward_curve(by="time", window=20.0)
    t = raw["t_finish"] - raw["t_submit"].min()
    for start in by_time["time"].values:
        sel = ok & (t >= start) & (t < start + 20.0)
        assert by_time.sel(time=start).item() == pytest.approx(raw["reward"][sel].mean())
    with pytest.raises(ValueError, match="choose 'version' or 'time'"):
        ds.laminar.reward_curve(by="step")


@pytest.mark.parametrize("window", [0, -5, 0.0, float("nan"), float("inf"), "10", True])
def test_a_window_that_is_no_length_of_time_is_refused_naming_it(run, window):
    """`throughput(window=0)` was a ZeroDivisionError, `window=-5` an IndexError, and
    `reward_curve(by="time", window=0)` one window of the whole run, silently."""
    ds, _ = run
    for method, call in (
        ("throughput", lambda: ds.laminar.throughput(window=window)),
        ("reward_curve", lambda: ds.laminar.reward_curve(by="time", window=window)),
    ):
        with pytest.raises(
            ValueError, match=rf"{method}: window=.*length in seconds, a number > 0"
        ):
            call()
    assert ds.laminar.reward_curve(by="time", window=np.float32(5)).size  # (numbers pass)


def test_groups_and_rollouts(run):
    ds, raw = run
    groups = ds.laminar.groups()
    assert groups.sizes["group"] == 40 and groups["complete"].all()
    assert (groups["versions"] == 1).all()
    consumed_groups = {
        p for p, s in zip(raw["prompt_uid"], raw["status"], strict=True) if s == "consumed"
    }
    assert set(groups["group"].values[groups["consumed"].values == 4]) == consumed_groups
    for g in groups["group"].values:  # (the rewards: against numpy, group by group)
        sel = (raw["prompt_uid"] == g) & (raw["finish_reason"] != "error")
        row = groups.sel(group=g)
        assert row["scored"].item() == sel.sum()
        if sel.any():
            assert row["reward_mean"].item() == pytest.approx(raw["reward"][sel].mean())
            assert row["reward_std"].item() == pytest.approx(raw["reward"][sel].std())
        else:  # (a discarded group: its rewards failed)
            assert np.isnan(row["reward_mean"].item()) and np.isnan(row["reward_std"].item())
    assert not groups["flat"].any()  # (rewards drawn at random: none equal)
    per = ds.laminar.by_rollout()
    for r in per["rollout"].values:
        sel = raw["rollout_ids"] == r
        assert per["trajectories"].sel(rollout=r).item() == sel.sum()
        assert per["response_tokens"].sel(rollout=r).item() == raw["response_len"][sel].sum()
        assert per["reward_mean"].sel(rollout=r).item() == pytest.approx(
            np.nanmean(raw["reward"][sel])
        )


def test_report_of_a_run_without_metrics_still_draws_what_it_can(run, tmp_path):
    from pipelines.report import build_report

    ds, _ = run
    report = build_report([ds.attrs["run_dir"]], tmp_path / "out")
    made = {p.name for p in report.parent.iterdir()}
    assert made == {"report.md", "reward.png", "throughput.png", "staleness.png"}
    text = report.read_text()
    assert "![reward.png](reward.png)" in text and "buffer.png" not in text


def test_several_runs_in_one_dataset(run, tmp_path):
    """open_runs: every per-trajectory field of each run on (run, trajectory), padded."""
    from factories import trajectory

    from storage import open_runs

    ds, _ = run
    small = tmp_path / "small"
    TrajectoryWriter(small).append(
        [
            trajectory(f"u{i}", f"g{i // 2}", sample_idx=i % 2, behavior_version=i).to_record()
            for i in range(10)
        ]
    )
    both = open_runs([ds.attrs["run_dir"], small], names=["big", "small"])
    assert list(both["run"].values) == ["big", "small"]
    assert both.sizes == {"run": 2, "trajectory": ds.sizes["trajectory"]}
    assert both["n_trajectories"].values.tolist() == [ds.sizes["trajectory"], 10]
    big = both.sel(run="big")
    np.testing.assert_array_equal(big["s_train"].values, ds["s_train"].values)
    assert (big["uid"].values == ds["uid"].values).all()
    own = open_run(small)
    head = both.sel(run="small").isel(trajectory=slice(0, 10))
    np.testing.assert_array_equal(head["behavior_version"].values, own["behavior_version"])
    assert (head["uid"].values == own["uid"].values).all()
    tail = both.sel(run="small").isel(trajectory=slice(10, None))
    assert np.isnan(tail["reward"].values).all() and (tail["uid"].values == "").all()
    assert "response_tokens" not in both  # token-level arrays stay with open_run


def test_report_draws_the_events_of_a_run(run, tmp_path, caplog):
    """Repack moves, a lost rollout and its recovery, publications: in report.md's events
    table and as figures, on the run's own clock (event tables hold epoch seconds)."""
    import json
    import shutil

    from pipelines.report import build_report
    from storage.metrics import MetricsWriter

    ds, _ = run
    run_dir = tmp_path / "run"
    shutil.copytree(ds.attrs["run_dir"], run_dir)
    t0 = 1.8e9  # the run's start, epoch seconds
    w = MetricsWriter(run_dir)
    w.append(
        "cluster",
        [
            {
                "elapsed_s": t,
                "wall_time": t0 + t,
                "version": t // 10,
                "buffer_depth": 3,
                "oldest_buffered_age_s": 1.0,
            }
            for t in range(0, 60, 5)
        ],
    )
    w.append(
        "rollouts",
        [
            {"elapsed_s": t, "rollout": r, "kv_used": t, "kv_capacity": 100, "version": t // 10}
            for t in range(0, 60, 5)
            for r in ("r0", "r1")
        ],
    )
    w.append(
        "publications",
        [
            {"version": v, "t_publish": t0 + 10 * v, "stall_s": 0.001 * v, "broadcast_s": 0.01 * v}
            for v in (0, 1, 2, 3)  # (version 0's, as the run set up: not counted)
        ],
    )
    w.append(
        "repacks",
        [
            {
                "time": t0 + 12,
                "source": "r1",
                "destination": "r0",
                "ok": True,
                "requests": 5,
                "pause_s": 0.02,
            }
        ],
    )
    w.append(
        "faults",
        [
            {
                "time": t0 + 30,
                "rollout": "r1",
                "destination": "r0",
                "how": how,
                "version": 2,
                "requests": n,
                "tokens_recovered": 9,
                "recovery_s": 0.01,
            }
            for how, n in (("import", 7), ("rescore", 4))
        ],
    )
    summary = {
        "faults": {"lost": {"r1": t0 + 30}, "replacements": {"r1": "r2"}},
        "repack": {"moves": 1},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))

    report = build_report([run_dir], tmp_path / "out")
    made = {p.name for p in report.parent.iterdir()}
    assert {"rollouts-0.png", "events-0.png", "buffer.png"} <= made
    text = report.read_text()
    # publications, median stall / broadcast (ms), moves, lost, by how, replacements
    assert "| run | 3 | 2.0 | 20.0 | 1 | 1 | import 7, rescore 4 | 1 |" in text
    assert "![events-0.png](events-0.png)" in text
    assert "Damaged stores" not in text

    # A damaged table or summary.json refused the whole report (a StoreError): each is
    # left out and named; the figures that do not read them are drawn.
    (run_dir / "metrics.zarr" / "faults" / "zarr.json").write_text("{")
    (run_dir / "summary.json").write_text("[]")
    with caplog.at_level(logging.WARNING, logger="laminar"):
        report = build_report([run_dir], tmp_path / "damaged")
    made = {p.name for p in report.parent.iterdir()}
    assert {"rollouts-0.png", "events-0.png", "buffer.png", "reward.png"} <= made
    text = report.read_text()
    # (no faults rows, no summary: the repacks table's move stands)
    assert "| run | 3 | 2.0 | 20.0 | 1 | 0 | - | 0 |" in text
    damaged = text.split("## Damaged stores (their figures and columns are left out)\n\n")[1]
    faults, summary_json = damaged.splitlines()[:2]
    assert faults.startswith("- run: metrics table 'faults' left out: cannot read '")
    assert summary_json == (
        f"- run: summary.json left out: '{run_dir}/summary.json' is not a JSON object; "
        "restore it from a copy"
    )
    assert caplog.text.count("left out") == 2


def test_buffer_age_leaves_out_the_time_a_resumed_run_was_stopped(tmp_path):
    """A trajectory inserted before a stop and sampled after the resume: its buffer age
    is its time in the buffer while the run ran (the metrics' segments say when it did
    not), and the age carries behavior_version for a groupby."""
    from factories import trajectory

    from storage.metrics import MetricsWriter

    t0 = 1.8e9
    times = {"a": (10.0, 12.0), "b": (15.0, 130.0), "c": (125.0, 127.5)}  # b spans the stop
    TrajectoryWriter(tmp_path).append(
        [
            trajectory(
                u,
                f"g{u}",
                group_size=1,
                behavior_version=v,
                status="consumed",
                t_submit=t0,
                t_insert=t0 + a,
                t_sample=t0 + b,
                sample_version=v,
                finish_version=v,
            ).to_record()
            for v, (u, (a, b)) in enumerate(times.items())
        ]
    )
    # ran from 0 to 20 s, stopped, resumed from 120 s on
    _two_starts(MetricsWriter(tmp_path), t0)
    ds = open_run(tmp_path)
    assert ds.laminar.pauses_s == [(t0 + 20, t0 + 120)]
    # (damaged metrics do not make the trajectories unreadable: no stops are known)
    import shutil

    damaged = tmp_path.parent / f"{tmp_path.name}-damaged"
    shutil.copytree(tmp_path, damaged)
    (damaged / "metrics.zarr" / "zarr.json").write_text('{"zarr_format": 3, ')
    assert open_run(damaged).laminar.pauses_s == []
    age = ds.laminar.buffer_age()
    np.testing.assert_allclose(age.values, [2.0, 115.0 - 100.0, 2.5])
    assert age.groupby("behavior_version").mean().sizes == {"behavior_version": 3}


def test_buffer_age_leaves_out_the_time_a_trajectory_was_out_of_the_buffer(tmp_path):
    """A trajectory consumed by an update that was lost is held again (a resume, a data
    module rebuilt within the run, a restarted trainer) and consumed again: its age was
    ``t_sample - t_insert`` less any stop, so it counted the time between its first
    consumption and the loss, when it was not in the buffer (a lost run's re-admitted
    trajectories read 13.2 s on average against 5.2 s in the buffer). Its age is its
    stays in the buffer, summed; the ``buffered`` event that holds it again has a time
    (``t_held``), which is not a ``t_sample``. A store whose events have no time (before
    they were given one) reads as before."""
    from factories import trajectory

    from storage.metrics import MetricsWriter

    t0 = 1.8e9
    nan = float("nan")
    # (seconds on the run's clock) ran from 0 to 20 s, stopped, resumed from 120 s on
    admitted = {  # uid: t_insert
        "lost": 10.0,  # consumed at 13 by an update lost with the run, held again by the
        # resume at 119 (before its first row, at 120), consumed at 125
        "twice": 15.0,  # held across the stop, consumed at 121, taken back by a
        # restarted trainer at 130, consumed at 135
        "held": 16.0,  # consumed at 17, held again at 119, still held at the end
        "old": 11.0,  # as "lost", from a store without the time it was held again
        "plain": 18.0,  # consumed at 19
        "early": 12.0,  # consumed at 12.5, before its record was written (the record
        # holds it consumed), held again at 119, consumed at 126
    }
    TrajectoryWriter(tmp_path).append(
        [
            trajectory(
                u,
                f"g{u}",
                group_size=1,
                finish_version=0,
                t_submit=t0 + a - 1,
                t_insert=t0 + a,
                **(
                    dict(status="consumed", sample_version=0, t_sample=t0 + 12.5)
                    if u == "early"
                    else dict(status="buffered", sample_version=-1, t_sample=nan)
                ),
            ).to_record()
            for u, a in admitted.items()
        ]
    )
    batches = [  # the events, (uid, status, when) in batches as the buffer writes them
        [("lost", "consumed", 13), ("held", "consumed", 17), ("old", "consumed", 14)]
        + [("plain", "consumed", 19)],
        [("lost", "buffered", 119), ("held", "buffered", 119), ("old", "buffered", None)]
        + [("twice", "consumed", 121), ("early", "buffered", 119)],
        [("lost", "consumed", 125), ("old", "consumed", 125), ("twice", "buffered", 130)]
        + [("early", "consumed", 126)],
        [("twice", "consumed", 135)],
    ]
    w = TrajectoryWriter(tmp_path)
    for batch in batches:
        events = [
            {
                "uid": uid,
                "status": status,
                "sample_version": 0 if status == "consumed" else -1,
                "t_sample": nan if t is None else t0 + t,
            }
            for uid, status, t in batch
        ]
        w.append([], events)
    _two_starts(MetricsWriter(tmp_path), t0)
    ds = open_run(tmp_path)
    # (the holding again at 119 is a sign the resumed run was going)
    assert ds.laminar.pauses_s == [(t0 + 20, t0 + 119)]
    assert ds.laminar.audit() == []  # (a held-again event's time is no t_sample)
    assert np.isnan(ds["t_sample"].values[2]) and ds["status"].values[2] == "buffered"
    np.testing.assert_allclose(ds["t_held"].values - t0, [119, 130, 119, 11, 18, 119])
    # earlier stays: lost 10-13; twice 15-121 less the stop (20-119); held 16-17; early
    # 12-12.5
    np.testing.assert_allclose(ds["held_s"].values, [3, 7, 1, 0, 0, 0.5])
    age = ds.laminar.buffer_age()
    assert age.trajectory.values.tolist() == [0, 1, 3, 4, 5]
    # lost: 3 + 6; twice: 7 + 5; old: 125 - 11 less the stop, as before; plain: 1;
    # early: 0.5 + 7
    np.testing.assert_allclose(age.values, [9.0, 12.0, 114.0 - 99.0, 1.0, 7.5])
    raw = open_trajectories(tmp_path)  # (the same for the buffer)
    np.testing.assert_allclose(raw["t_held"], ds["t_held"].values)
    np.testing.assert_allclose(raw["held_s"], ds["held_s"].values)
    # a Dataset without them (saved by an older laminar): counted from t_insert
    older = ds.drop_vars(["t_held", "held_s"])
    np.testing.assert_allclose(older.laminar.buffer_age().values[:1], [115.0 - 99.0])


def test_a_run_with_nothing_stored_yet_gives_empty_figures(tmp_path):
    """A run in its first seconds (the store made, nothing committed): empty figures,
    and staleness means NaN (not measured), not 0."""
    TrajectoryWriter(tmp_path).append([])
    ds = open_run(tmp_path)
    assert ds.sizes["trajectory"] == 0 and np.isnan(ds.laminar.t0)
    assert ds.laminar.throughput().sizes == {"time": 0}
    assert ds.laminar.reward_curve(by="time").sizes == {"time": 0}
    assert ds.laminar.buffer_age().sizes == {"trajectory": 0}
    assert ds.laminar.groups().sizes == {"group": 0}
    assert ds.laminar.by_rollout().sizes == {"rollout": 0}
    summary = ds.laminar.summary()
    assert all(np.isnan(summary[f"{n}_mean"]) for n in ("s_gen", "residence", "s_train"))
    from pipelines.report import build_report

    assert "| 0 |" in build_report([tmp_path], tmp_path / "report").read_text()


def test_wrong_paths_and_datasets_get_errors_that_say_what_to_pass(run, tmp_path):
    from storage import StoreError, open_runs
    from storage.metrics import open_metrics

    ds, _ = run
    run_dir = ds.attrs["run_dir"]
    with pytest.raises(StoreError, match="is the run's metrics.zarr, not its trajectories.zarr"):
        open_run(f"{run_dir}/metrics.zarr")
    with pytest.raises(StoreError, match="is the run's partial.zarr"):
        open_run(f"{run_dir}/partial.zarr")
    with pytest.raises(KeyError, match=r"no metrics table 'update'; the tables are \['cluster'"):
        open_metrics(run_dir, "update")
    with pytest.raises(FileNotFoundError, match="pass a run directory written by `laminar run`"):
        open_metrics(tmp_path / "nothing", "cluster")
    both = open_runs([run_dir])  # (one path as a string would be split into characters)
    assert open_runs(run_dir).sizes == both.sizes
    with pytest.raises(ValueError, match=r"ds\.sel\(run=name\)\.laminar, or use open_run\(path\)"):
        both.laminar.summary()


def _two_starts(writer, t0: float) -> None:
    """``cluster`` rows of a run that ran from 0 to 20 s, stopped, and was resumed from
    120 to 140 s (a row every 5 s; ``t0``: its start, epoch seconds)."""
    rows = [(0, t) for t in range(0, 21, 5)] + [(1, t) for t in range(120, 141, 5)]
    writer.append(
        "cluster",
        [{"segment": s, "elapsed_s": t, "wall_time": t0 + t, "version": 0} for s, t in rows],
    )


def _resumed_run(path, times):
    """A run that ran from 0 to 20 s, was stopped, and ran again from 120 s on (epoch
    origin 1.8e9): one consumed trajectory per ``(t_finish, t_sample)`` in ``times``
    (seconds on the run's clock), 5 tokens each."""
    from factories import trajectory

    from storage.metrics import MetricsWriter

    t0 = 1.8e9
    TrajectoryWriter(path).append(
        [
            trajectory(
                f"u{i}",
                f"g{i}",
                group_size=1,
                status="consumed",
                t_submit=t0 + max(f - 1.0, 0.0),
                t_start=t0 + max(f - 1.0, 0.0),
                t_finish=t0 + f,
                t_insert=t0 + f,
                t_sample=t0 + s,
                sample_version=0,
            ).to_record()
            for i, (f, s) in enumerate(times)
        ]
    )
    _two_starts(MetricsWriter(path), t0)
    return open_run(path)


def test_throughput_of_a_resumed_run_counts_only_the_time_it_ran(tmp_path):
    """Windows the run was stopped throughout have no rate (NaN, not 0: a mean over the
    windows is the rate while it ran), and a window it was stopped part of is divided by
    the seconds it ran."""
    ds = _resumed_run(tmp_path, [(1, 3), (8, 9), (14, 16), (18, 19), (125, 126), (131, 132)])
    assert ds.laminar.pauses_s == [(1.8e9 + 20, 1.8e9 + 120)]
    tp = ds.laminar.throughput(window=15.0)
    nan = np.nan
    # [0,15): 3 finished, 15 s; [15,30): 1 finished, ran 5 s; [30,120): stopped;
    # [120,135): 2 finished in 15 s; [135,140): none, the run going on to its last row
    expected = [15 / 15, 5 / 5, nan, nan, nan, nan, nan, nan, 10 / 15, 0.0]
    np.testing.assert_allclose(tp["generated"].values, expected)
    np.testing.assert_allclose(tp["trained"].values, [10 / 15, 10 / 5, *[nan] * 6, 10 / 15, 0])
    assert tp["running_s"].values[-1] == pytest.approx(5.0)


def test_the_updates_of_a_lost_and_resumed_run_by_version(tmp_path):
    """After a lost run is resumed from its checkpoint, the lost updates' versions come
    again in ``updates``; docs/analysis.md's recipe keeps the rows in the weights (the
    later ones), one per version, so that ``.sel(version=v)`` works."""
    from storage.metrics import MetricsWriter, open_metrics

    # versions 1-5, lost after 5; resumed from the checkpoint of version 3: 4, 5, 6 redone
    rows = [(v, 0.1 * v) for v in range(1, 6)] + [(v, 1.0 + v) for v in (4, 5, 6)]
    MetricsWriter(tmp_path).append("updates", [{"version": v, "loss": x} for v, x in rows])
    updates = open_metrics(tmp_path, "updates")
    kept = (
        updates.set_coords("version")
        .swap_dims(update="version")
        .drop_duplicates("version", keep="last")
    )
    assert kept["version"].values.tolist() == [1, 2, 3, 4, 5, 6]
    assert kept["loss"].sel(version=5).item() == 6.0
    assert kept["loss"].sel(version=2).item() == pytest.approx(0.2)


def _update_throughput(run_dir, w, t0: float, ups: list[tuple]):
    """The report's actor-update throughput of a run whose metrics writer ``w`` recorded
    ``ups``: (version, time after ``t0``, interval_s, tokens) per update."""
    from pipelines.report import _load, update_throughput

    w.append(
        "updates",
        [{"version": v, "time": t0 + t, "interval_s": i, "tokens": n} for v, t, i, n in ups],
    )
    TrajectoryWriter(run_dir).append([])
    return update_throughput(_load(run_dir))


def test_actor_update_throughput_of_a_lost_and_resumed_run(tmp_path):
    """The report's actor-update throughput (the paper's measure, after warm-up): of a
    version trained twice (a lost run resumed from an older checkpoint) only the later
    row, whose weights stand, and no start's first update (its interval holds the start:
    the model loading, the first batch)."""
    from storage.metrics import MetricsWriter

    t0 = 1.8e9
    w = MetricsWriter(tmp_path)
    # ran 0-20 s (versions 1-5, an update every 4 s), lost; resumed at 120 s from the
    # checkpoint of version 3: versions 4, 5, 6 redone
    _two_starts(w, t0)
    # (version, time, interval since the previous update or the start, tokens)
    ups = [(v, 4.0 * v, 4.0, 400.0) for v in range(1, 6)]
    ups += [(4, 127.0, 7.0, 100.0), (5, 129.0, 2.0, 200.0), (6, 131.0, 2.0, 300.0)]
    versions, rate = _update_throughput(tmp_path, w, t0, ups)
    # v1: warm-up; v2, v3: 400 / 4 s; v4: the resumed start's first; v5, v6: 2 s each
    assert versions.tolist() == [2, 3, 5, 6]
    np.testing.assert_allclose(rate, [100.0, 100.0, 100.0, 150.0])


def test_actor_update_throughput_leaves_out_a_restarted_trainers_first_update(tmp_path):
    """A trainer lost after version 3 and restarted within the run (no stop: one start):
    its first update's interval runs from when it started, not from an update (its first
    batch, which the buffer filled meanwhile, came at once: 800 tokens/s against 100)."""
    from storage.metrics import MetricsWriter

    t0 = 1.8e9
    w = MetricsWriter(tmp_path)
    w.append(
        "cluster",
        [
            {"segment": 0, "elapsed_s": t, "wall_time": t0 + t, "version": 0}
            for t in range(0, 41, 5)
        ],
    )
    # (version, time, interval since the previous update or the trainer's start, tokens)
    ups = [(v, 4.0 * v, 4.0, 400.0) for v in range(1, 4)]  # lost at 13 s, restarted at 29.5 s
    ups += [(4, 30.0, 0.5, 400.0), (5, 34.0, 4.0, 400.0), (6, 38.0, 4.0, 800.0)]
    versions, rate = _update_throughput(tmp_path, w, t0, ups)
    assert versions.tolist() == [2, 3, 5, 6]
    np.testing.assert_allclose(rate, [100.0, 100.0, 100.0, 200.0])


def test_the_throughput_figure_of_several_runs_gives_each_run_one_colour(tmp_path, monkeypatch):
    """`laminar report A B`: each line took the next colour of the cycle, so a run's
    "trained" was another colour than its "generated", and its actor-update line a third
    (that panel had no legend); each run's grey "not running" band was a legend entry."""
    import matplotlib

    matplotlib.use("Agg")
    from pipelines import report
    from storage.metrics import MetricsWriter

    drawn = {}
    monkeypatch.setattr(report, "_save", lambda fig, out, name: drawn.setdefault(name, fig))
    runs = []
    for name in ("a", "b"):
        path = tmp_path / name
        _resumed_run(path, [(1, 3), (8, 9), (125, 126)])
        ups = [(v, 4.0 * v, 4.0, 400.0) for v in range(1, 4)]
        MetricsWriter(path).append(
            "updates",
            [{"version": v, "time": 1.8e9 + t, "interval_s": i, "tokens": n} for v, t, i, n in ups],
        )
        runs.append(report._load(path))
    report.plot_throughput(runs, tmp_path)
    ax_g, ax_u = drawn["throughput.png"].axes
    lines = {line.get_label(): line for line in ax_g.lines}
    assert sorted(lines) == ["a generated", "a trained", "b generated", "b trained"]
    for name in ("a", "b"):
        assert lines[f"{name} generated"].get_color() == lines[f"{name} trained"].get_color()
        assert lines[f"{name} trained"].get_linestyle() == "--"
    assert lines["a generated"].get_color() != lines["b generated"].get_color()
    by_run = {line.get_label(): line.get_color() for line in ax_u.lines}
    assert by_run == {"a": lines["a generated"].get_color(), "b": lines["b generated"].get_color()}
    assert [t.get_text() for t in ax_u.get_legend().get_texts()] == ["a", "b"]
    shown = [t.get_text() for t in ax_g.get_legend().get_texts()]
    assert shown.count("not running (resumed)") == 1, shown
    report.plot_reward(runs, tmp_path)
    ax_t, _ = drawn["reward.png"].axes
    labels = [p.get_label() for p in ax_t.patches]
    assert labels.count("not running (resumed)") == 1, labels


def test_groups_count_the_weight_versions_a_group_was_generated_with(tmp_path):
    """A group whose siblings were generated at versions 2 and 5 (a baseline that does
    not keep siblings together) has 2 versions, not the span 2..5."""
    from factories import trajectory

    TrajectoryWriter(tmp_path).append(
        [
            trajectory(f"a-{i}", "a", sample_idx=i, group_size=3, behavior_version=v).to_record()
            for i, v in enumerate((2, 5, 5))
        ]
        + [trajectory("b-0", "b", group_size=1, behavior_version=4).to_record()]
    )
    groups = open_run(tmp_path).laminar.groups()
    assert groups["versions"].values.tolist() == [2, 1]


def test_flat_groups_are_those_whose_scored_rewards_are_all_equal(tmp_path):
    """A group is flat (advantages 0) when two or more of its siblings have a reward
    that counts and all are equal, exactly: a failed sibling's reward (NaN, or any value
    with ``finish_reason == "error"``) is left out, one scored sibling is not a group,
    and 0.7 six times is flat though its mean rounds. ``summary()``'s share is of the
    groups trained on."""
    from factories import trajectory

    def group(p, rewards, reasons=None, status="consumed"):
        reasons = reasons or ["eos"] * len(rewards)
        return [
            trajectory(
                f"{p}-{i}",
                p,
                sample_idx=i,
                group_size=len(rewards),
                reward=r,
                finish_reason=why,
                status=status,
                sample_version=1 if status == "consumed" else -1,
                t_sample=1.0 if status == "consumed" else np.nan,
            ).to_record()
            for i, (r, why) in enumerate(zip(rewards, reasons, strict=True))
        ]

    TrajectoryWriter(tmp_path).append(
        group("a", [0.7] * 6)  # flat, though 0.7 * 6 / 6 != 0.7 in floats
        + group("b", [1.0, 0.0, 1.0])
        + group("c", [1.0, 0.0], ["eos", "error"])  # one scored: not a group of rewards
        + group("d", [0.0, 0.0, 5.0], ["eos", "eos", "error"])  # the failed one left out
        + group("e", [1.0, 1.0], status="buffered")  # flat, not trained on
    )
    ds = open_run(tmp_path)
    g = ds.laminar.groups()
    assert g["flat"].values.tolist() == [True, False, False, True, True]
    assert g["scored"].values.tolist() == [6, 3, 1, 2, 2]
    assert g["reward_std"].values[3] == 0 and g["reward_mean"].values[3] == 0
    assert ds.laminar.summary()["flat_group_share"] == pytest.approx(2 / 4)
    only_buffered = ds.isel(trajectory=ds.status == "buffered")
    assert np.isnan(only_buffered.laminar.summary()["flat_group_share"])


def test_to_dataframe_has_a_row_per_trajectory_and_every_scalar_field(run):
    """``ds.to_dataframe()`` takes the product of the dimensions (0 rows while
    ``version_token`` is empty); the accessor's is one row per trajectory."""
    ds, raw = run
    assert len(ds.to_dataframe()) == 0  # (why the accessor has its own)
    df = ds.laminar.to_dataframe()
    assert len(df) == ds.sizes["trajectory"] == len(raw["uid"])
    assert df["uid"].tolist() == list(raw["uid"])
    assert df["response_len"].tolist() == list(raw["response_len"])
    assert "response_tokens" not in df.columns and "reward" in df.columns


def test_staleness_histogram_of_a_damaged_store_skips_and_counts_unsampled(tmp_path):
    """A damaged store can hold a trajectory ``consumed`` with ``sample_version == -1``
    (the audit reports it): its residence and s_train are unknown (NaN). The histogram
    counts the others and says how many it left out, rather than raising."""
    from factories import trajectory

    def consumed(u, sample_version):
        return trajectory(
            u,
            f"g{u}",
            group_size=1,
            behavior_version=1,
            finish_version=1,
            sample_version=sample_version,
            status="consumed",
            t_sample=1.0,
        ).to_record()

    TrajectoryWriter(tmp_path).append([consumed("a", 2), consumed("b", 3), consumed("c", -1)])
    ds = open_run(tmp_path)
    assert any("sample_version inconsistent" in p for p in ds.laminar.audit())
    hist = ds.laminar.staleness_histogram()
    assert hist["staleness"].values.tolist() == [0, 1, 2]
    assert hist["s_gen"].values.tolist() == [3, 0, 0]  # (known for all three)
    assert hist["residence"].values.tolist() == [0, 1, 1]
    assert hist["s_train"].values.tolist() == [0, 1, 1]
    assert hist.attrs["unsampled"] == 1
    # every consumed trajectory damaged: no residence or s_train known at all
    only = tmp_path / "only-damaged"
    TrajectoryWriter(only).append([consumed("c", -1)])
    hist = open_run(only).laminar.staleness_histogram()
    assert hist["staleness"].values.tolist() == [0]
    assert hist["s_gen"].values.tolist() == [1] and hist["s_train"].values.tolist() == [0]
    assert hist.attrs["unsampled"] == 1


def test_a_stop_begins_at_the_last_sign_the_run_was_going(tmp_path):
    """A crash loses up to a metrics flush (5 s) of ``cluster`` rows, but the trajectory
    store may have committed events after the last row: the stop begins at the latest of
    them. Likewise a resumed run's trainer can sample re-admitted trajectories before the
    resume's first row: the stop ends at the first sign of the resumed run."""
    from factories import trajectory

    from storage.metrics import MetricsWriter

    t0 = 1.8e9

    def consumed(u, finish, sample):
        return trajectory(
            u,
            f"g{u}",
            group_size=1,
            status="consumed",
            sample_version=0,
            t_submit=t0 + finish - 1,
            t_start=t0 + finish - 1,
            t_finish=t0 + finish,
            t_insert=t0 + finish,
            t_sample=t0 + sample,
        ).to_record()

    # rows every 5 s from 0 to 20 s; the run went on to 23.5 s (its last trajectory in,
    # sampled at 23 s, another in at 23.5 s), crashed; resumed, its first row at 120 s,
    # its trainer sampled the re-admitted one at 118 s
    TrajectoryWriter(tmp_path).append(
        [consumed("a", 10, 12), consumed("b", 21, 23), consumed("c", 23.5, 118)]
    )
    _two_starts(MetricsWriter(tmp_path), t0)
    ds = open_run(tmp_path)
    assert ds.laminar.pauses_s == [(t0 + 23.5, t0 + 118)]
    # c waited from 23.5 s to the stop, and from the resume to its sample: nothing
    np.testing.assert_allclose(ds.laminar.buffer_age().values, [2.0, 2.0, 0.0])
    # the report's grey "not running" bands are the same stop (on the metrics' clock)
    from pipelines.report import _load

    assert _load(tmp_path)["gaps"] == [(23.5, 118.0)]


def test_the_last_throughput_window_ends_when_the_run_did(tmp_path):
    """The last window ends at the run's end (its last ``cluster`` row, or a later
    trajectory event), not at its last event: a batch the trainer sampled 0.05 s into a
    window is not divided by 0.05 s."""
    from factories import trajectory

    from storage.metrics import MetricsWriter

    t0 = 1.8e9
    TrajectoryWriter(tmp_path).append(
        [
            trajectory(
                f"u{i}",
                "g",
                sample_idx=i,
                group_size=8,
                status="consumed",
                sample_version=0,
                t_submit=t0,
                t_start=t0,
                t_finish=t0 + 0.5 * (i + 1),
                t_insert=t0 + 0.5 * (i + 1),
                t_sample=t0 + 5.05,
            ).to_record()
            for i in range(8)  # 5 tokens each, finished 0.5 ... 4 s
        ]
    )
    MetricsWriter(tmp_path).append(
        "cluster",
        [{"elapsed_s": t, "wall_time": t0 + t, "version": 0} for t in np.arange(0.0, 9.5, 0.5)],
    )
    ds = open_run(tmp_path)
    assert ds.laminar.t_end == t0 + 9.0
    tp = ds.laminar.throughput(window=5.0)
    np.testing.assert_allclose(tp["generated"].values, [40 / 5, 0.0])
    np.testing.assert_allclose(tp["trained"].values, [0.0, 40 / 4])  # [5 s, 9 s]: 4 s
    # without metrics, the last event is all there is to end it
    bare = tmp_path.parent / f"{tmp_path.name}-bare"
    bare.mkdir()
    import shutil

    shutil.copytree(tmp_path / "trajectories.zarr", bare / "trajectories.zarr")
    ds = open_run(bare)
    assert ds.laminar.t_end == t0 + 5.05
    trained = ds.laminar.throughput(window=5.0)["trained"].values
    np.testing.assert_allclose(trained[-1], 40 / 0.05, rtol=1e-5)  # (epoch rounding)
    # ... and a run that ended exactly on a window's start (its last event, the batch
    # sampled at ~5.05 s, there with windows of half that): the batch is the window
    # before's, not a 0 s window's (which gave it no rate: NaN)
    half = (ds.laminar.t_end - ds.laminar.t0) / 2  # (exactly: a power of 2)
    tp = ds.laminar.throughput(window=half)
    assert tp.sizes["time"] == 2 and np.isfinite(tp["trained"].values).all()
    np.testing.assert_allclose(tp["trained"].values, [0.0, 40 / half])


def _lost_and_resumed_run(path, first_row_version):
    """Lost at version 5 after 20 s; resumed at 120 s from the checkpoint of version 3,
    redoing versions 4 and 5 and going on to 6. ``first_row_version``: the trainer's
    version in the resume's first ``cluster`` row (4 when it had already redone an
    update by its first poll). Rewards: the lost weights' trajectories 0.9, the others
    a tenth of their version."""
    from factories import timed

    from storage.metrics import MetricsWriter

    t0 = 1.8e9
    # (behavior version, finish time, reward, status)
    lost = [(0, 2, 0.0, "consumed"), (1, 5, 0.1, "consumed"), (2, 8, 0.2, "consumed")]
    lost += [(3, 12, 0.3, "consumed"), (4, 16, 0.9, "dropped"), (5, 19, 0.9, "filtered")]
    redone = [(3, 125, 0.35, "consumed"), (4, 130, 0.4, "consumed"), (5, 135, 0.5, "consumed")]
    redone += [(6, 138, 0.6, "buffered")]
    TrajectoryWriter(path).append(
        [
            timed(
                f"u{i}",
                f,
                sample=f + 0.5 if status == "consumed" else None,
                t0=t0,
                version=k,
                status=status,
                reward=r,
            )
            for i, (k, f, r, status) in enumerate(lost + redone)
        ]
    )
    rows = [(0, t, t // 4) for t in range(0, 21, 4)]  # versions 0 ... 5
    rows += [(1, 120, first_row_version), (1, 130, 4), (1, 140, 6)]
    if first_row_version is not None:  # (None: the run has no metrics)
        MetricsWriter(path).append(
            "cluster",
            [{"segment": s, "elapsed_s": t, "wall_time": t0 + t, "version": v} for s, t, v in rows],
        )
    return open_run(path)


@pytest.mark.parametrize("metrics", ["none", "kept"])
def test_a_resume_the_store_recorded_marks_what_it_superseded_whatever_the_metrics_say(
    tmp_path, metrics
):
    """The resume records itself in the trajectory store (when, from which checkpoint
    version), so the lost start's trajectories of the versions it redid are found
    without the metrics (``none``: moved aside as damaged, when nothing marked them).
    With the metrics too (``kept``), whose first row of the resumed start reads version
    2, the record is what counts: the start the metrics show is that resume, not a
    second one (which would mark version 3's trajectories too)."""
    from storage import TrajectoryWriter

    first_row = {"none": None, "kept": 2}[metrics]
    _lost_and_resumed_run(tmp_path, first_row)
    TrajectoryWriter(tmp_path).record_resume(3, 1.8e9 + 100)
    ds = open_run(tmp_path)
    assert ds.attrs["resumed_from_version"] == [3] and ds.attrs["resumed_at_s"] == [1.8e9 + 100]
    assert ds.laminar.superseded().values.tolist() == [False] * 4 + [True] * 2 + [False] * 4


@pytest.mark.parametrize("first_row_version", [3, 4])
def test_reward_by_version_of_a_lost_and_resumed_run_keeps_the_weights_that_stand(
    tmp_path, first_row_version
):
    """A run resumed from the checkpoint of version 3 redoes versions 4 and 5: the lost
    run's trajectories of those versions were generated by weights that no longer exist
    (whatever their status), and are left out of the reward by version; version 3's
    weights are the checkpoint's, the same in both starts. The run summary's first vs
    last 20% leaves them out too."""
    from pipelines.summary import reward_first_last

    ds = _lost_and_resumed_run(tmp_path, first_row_version)
    assert ds.attrs["segment_first_version"] == [0, first_row_version]
    assert ds.laminar.superseded().values.tolist() == [False] * 4 + [True] * 2 + [False] * 4
    curve = ds.laminar.reward_curve(by="version")
    assert curve["behavior_version"].values.tolist() == [0, 1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(curve.values, [0.0, 0.1, 0.2, 0.325, 0.4, 0.5, 0.6])
    # by time, each window is one start's: what ran then
    by_time = ds.laminar.reward_curve(by="time", window=10.0)
    assert by_time.sel(time=10.0).item() == pytest.approx((0.3 + 0.9 + 0.9) / 3)
    # 8 trajectories whose weights stand: the first and the last 20% are one each
    assert reward_first_last(ds) == (0.0, pytest.approx(0.6))


def test_throughput_of_a_damaged_store_leaves_out_and_counts_unsampled(tmp_path):
    """A damaged store can hold a trajectory ``consumed`` with no ``t_sample`` (NaN; the
    audit reports it): ``throughput`` raised numpy's "'list' argument must have no
    negative elements". Its tokens are left out of ``trained`` (not of ``generated``),
    and the attribute ``unsampled`` says how many, as in the staleness histogram."""
    from factories import trajectory

    TrajectoryWriter(tmp_path).append(
        [
            trajectory(
                f"u{i}",
                f"g{i}",
                group_size=1,
                finish_version=0,
                sample_version=0,
                status="consumed",
                t_submit=100.0,
                t_finish=100.0 + i,
                t_insert=100.0 + i,
                t_sample=[101.0, 102.0, np.nan, 104.5][i],
            ).to_record()
            for i in range(4)
        ]
    )
    ds = open_run(tmp_path)
    assert any("t_sample inconsistent" in p for p in ds.laminar.audit())
    tp = ds.laminar.throughput(window=2.0)  # windows [0, 2), [2, 4), [4, 4.5]; 5 tokens each
    assert tp["generated"].values.tolist() == [5.0, 5.0, 0.0]
    assert tp["trained"].values.tolist() == [2.5, 2.5, 10.0]
    assert tp.attrs["unsampled"] == 1


@pytest.mark.parametrize("chunk", ["stored", 7, 64, "in memory"])
def test_tokens_of_every_trajectory_in_any_order(run, chunk):
    """``tokens`` keeps the chunks it read for the next call: a trajectory's values are
    its own in any order of calls, on chunks smaller than a trajectory, and a result
    changed by the caller changes nothing read later."""
    ds, raw = run
    if chunk == "in memory":
        ds = ds.load()
    elif chunk != "stored":
        ds = ds.chunk({"prompt_token": chunk, "response_token": chunk})
    n = ds.sizes["trajectory"]
    order = [*range(n), *reversed(range(n)), *np.random.default_rng(1).integers(0, n, 50)]
    for field, group in (("response_tokens", "response"), ("behavior_logprobs", "response")):
        for i in order:
            start, length = raw[f"{group}_start"][i], raw[f"{group}_len"][i]
            got = ds.laminar.tokens(field, int(i))
            np.testing.assert_array_equal(got, raw[field][start : start + length])
            got[:] = 99
    i = n // 2
    start, length = raw["prompt_start"][i], raw["prompt_len"][i]
    np.testing.assert_array_equal(
        ds.laminar.tokens("prompt_tokens", i), raw["prompt_tokens"][start : start + length]
    )


def test_tokens_after_the_dataset_is_changed_in_place_reads_the_new_values(run):
    """xarray keeps the accessor (and what ``tokens`` read) with the Dataset: a field or
    the offsets assigned in place since are read again, not served from before."""
    ds, raw = run
    ds = ds.load()
    first = ds.laminar.tokens("response_tokens", 0)
    ds["response_tokens"] = ds["response_tokens"] + 1000
    np.testing.assert_array_equal(ds.laminar.tokens("response_tokens", 0), first + 1000)
    length = int(raw["response_len"][0])
    assert length > 1
    ds["response_len"] = ds["response_len"].copy(data=np.full_like(raw["response_len"], 1))
    np.testing.assert_array_equal(ds.laminar.tokens("response_tokens", 0), first[:1] + 1000)


def _token_versions_problem_by_loop(raw, mixing: bool) -> list[str]:
    """The audit's token-version rule, one trajectory at a time (what it computes)."""
    k, m_f, uid = raw["behavior_version"], raw["finish_version"], raw["uid"]
    for i in np.flatnonzero(raw["versions_len"]):
        seg = raw["token_versions"][raw["versions_start"][i] :][: raw["versions_len"][i]]
        versions = sorted(set(seg.tolist()))
        if not mixing and (seg != k[i]).any():
            return [f"trajectory {str(uid[i])!r} mixes weight versions {versions}"]
        if mixing and not (
            raw["versions_len"][i] == raw["response_len"][i]
            and seg[0] == k[i]
            and (np.diff(seg) >= 0).all()
            and seg[-1] <= m_f[i]
        ):
            return [
                f"trajectory {str(uid[i])!r}: token versions {versions} are not one "
                f"per response token, rising from its behavior version {k[i]} to at "
                f"most its finish version {m_f[i]}"
            ]
    return []


@pytest.mark.parametrize("schedule", ["laminar", "partial_rollout"])
@pytest.mark.parametrize("broken", [None, "rises", "falls", "starts above", "ends above"])
def test_the_audit_of_token_versions_agrees_with_a_loop_over_trajectories(
    tmp_path, monkeypatch, schedule, broken
):
    """The audit checks ``token_versions`` in blocks, vectorised: it names the first
    trajectory that breaks the rule (one version; in a partial rollout, one per response
    token rising from the behavior to at most the finish version), as a loop over
    trajectories does, whatever the blocks, however the Dataset was cut."""
    from factories import trajectory

    import storage.accessor

    rng = np.random.default_rng(2)
    records = []
    for i in range(60):
        n = int(rng.integers(1, 9))
        k = int(rng.integers(0, 4))
        versions = np.full(n, k, np.int32)
        versions[max(1, n // 2) :] += 1 if schedule == "partial_rollout" and i % 3 == 0 else 0
        if broken and i in (17, 41):  # two broken: the audit names the first
            versions[{"rises": -1, "falls": 0, "starts above": 0, "ends above": -1}[broken]] = {
                "rises": k + 1,
                "falls": k - 1,
                "starts above": k + 1,
                "ends above": k + 3,
            }[broken]
            if broken == "falls" and n > 1:
                versions[0], versions[-1] = k, k - 1
        rec = trajectory(
            f"u{i}",
            f"g{i}",
            group_size=1,
            response=np.arange(n),
            behavior_version=k,
            finish_version=k + 1,
        ).to_record()
        # (the laminar schedule's trajectories mostly store none: one version)
        empty = schedule == "laminar" and i % 4 == 1 and not (broken and i in (17, 41))
        rec["token_versions"] = versions[:0] if empty else versions
        records.append(rec)
    TrajectoryWriter(tmp_path, schedule=schedule).append(records)
    ds, raw = open_run(tmp_path), open_trajectories(tmp_path)
    raw["uid"] = ds["uid"].values  # (as the audit names them)
    mixing = schedule == "partial_rollout"
    want = _token_versions_problem_by_loop(raw, mixing)
    assert bool(want) == (broken is not None and not (mixing and broken == "rises"))
    for block in (storage.accessor.AUDIT_BLOCK_TOKENS, 1, 7, 50):
        monkeypatch.setattr(storage.accessor, "AUDIT_BLOCK_TOKENS", block)
        got = [p for p in ds.laminar.audit() if "version" in p and "trajectory " in p]
        assert got == want, block
    # a Dataset reordered on the trajectory dimension: its token values are not end to end
    back = ds.isel(trajectory=slice(None, None, -1))
    rev = {f: v[::-1] for f, v in raw.items() if v.shape == raw["uid"].shape}
    rev["token_versions"] = raw["token_versions"]
    got = [p for p in back.laminar.audit() if "version" in p and "trajectory " in p]
    assert got == _token_versions_problem_by_loop(rev, mixing)


def test_the_audit_names_uids_groups_and_versions_as_the_store_holds_them(tmp_path):
    """Problems quote a uid as 'u1' and versions as [1, 2], not numpy's reprs
    (np.str_('u1'), np.int32(1))."""
    from factories import trajectory

    records = [
        trajectory("u1", "g1", behavior_version=2, finish_version=1).to_record(),
        trajectory("u1", "g1", sample_idx=1, finish_version=0).to_record(),
        trajectory(
            "u2", "g2", finish_version=0, status="consumed", sample_version=0, t_sample=1.0
        ).to_record(),
        trajectory("u3", "g3", response=(4, 5), behavior_version=1, finish_version=2).to_record(),
    ]
    records[3]["token_versions"] = np.array([1, 2], np.int32)
    TrajectoryWriter(tmp_path).append(records)
    problems = open_run(tmp_path).laminar.audit()
    assert "1 trajectories finish before their behavior version, e.g. 'u1'" in problems
    assert "1 uids stored more than once, e.g. 'u1'" in problems
    assert "1 consumed groups incomplete, e.g. 'g2' (1/2)" in problems
    assert "trajectory 'u3' mixes weight versions [1, 2]" in problems


def test_the_audit_counts_each_lost_rollouts_trajectories_stored_elsewhere(tmp_path):
    """``laminar audit``'s "resumed and stored" per lost rollout: the trajectories whose
    path names it before their last rollout (not as the last; r1 is not r10)."""
    from factories import trajectory

    from storage.audit import audit_run
    from storage.metrics import MetricsWriter

    paths = ["r1", "r1,r0", "r2,r1,r0", "r0,r1", "r10,r0", "r1,r1,r2", "r10", "r2,r10"] * 3
    TrajectoryWriter(tmp_path).append(
        [
            trajectory(f"u{i}", f"g{i}", group_size=1, rollout_ids=p).to_record()
            for i, p in enumerate(paths)
        ]
    )
    lost = ("r1", "r2", "r10", "r3")
    MetricsWriter(tmp_path).append(
        "faults",
        [
            {"time": 1.0, "rollout": r, "destination": "r0", "how": "import", "version": 0,
             "requests": 0, "tokens_recovered": 0, "max_since_flush_s": 0.0, "recovery_s": 0.1}
            for r in lost
        ],
    )  # fmt: skip
    figures = audit_run(tmp_path).figures
    for r in lost:
        want = sum(r in p.split(",")[:-1] for p in paths)
        assert figures[f"{r}: resumed and stored"] == want, r
    assert [figures[f"{r}: resumed and stored"] for r in lost] == [9, 6, 3, 0]


def test_groups_and_rollouts_of_many_versions_and_resumed_paths(tmp_path):
    """groups' distinct versions and by_rollout's last rollout agree with a count per
    group and a split per path."""
    from factories import trajectory

    rng = np.random.default_rng(3)
    paths = ["r0", "r1", "r0,r1", "r2,r0", "r1,r2,r10", "r10"]
    records = [
        trajectory(
            f"u{i}",
            f"g{i % 13}",
            sample_idx=i // 13,
            group_size=8,
            behavior_version=int(rng.integers(-1, 6)),
            rollout_ids=paths[int(rng.integers(0, len(paths)))],
            response=np.arange(int(rng.integers(1, 9))),
        ).to_record()
        for i in range(100)
    ]
    TrajectoryWriter(tmp_path).append(records)
    ds, raw = open_run(tmp_path), open_trajectories(tmp_path)
    groups = ds.laminar.groups()
    for g in groups["group"].values:
        sel = raw["prompt_uid"] == g
        assert groups["versions"].sel(group=g).item() == len(set(raw["behavior_version"][sel]))
        assert groups["stored"].sel(group=g).item() == sel.sum()
    per = ds.laminar.by_rollout()
    last = np.array([p.split(",")[-1] for p in raw["rollout_ids"].tolist()])
    assert sorted(per["rollout"].values.tolist()) == sorted(set(last.tolist()))
    for r in per["rollout"].values:
        sel = last == r
        assert per["trajectories"].sel(rollout=r).item() == sel.sum()
        assert per["response_tokens"].sel(rollout=r).item() == raw["response_len"][sel].sum()


def test_the_rollouts_figure_marks_each_repack_move_on_its_rollouts(run, tmp_path, monkeypatch):
    """Each successful move: a ▼ at its time on its source's colour, a ▲ on its
    destination's (what rollouts-N.png draws, read off the figure as it is saved)."""
    import shutil

    import matplotlib.figure

    from pipelines.report import build_report
    from storage.metrics import MetricsWriter

    ds, _ = run
    run_dir = tmp_path / "run"
    shutil.copytree(ds.attrs["run_dir"], run_dir)
    t0, rollouts = 1.8e9, ("r0", "r1", "r2")
    w = MetricsWriter(run_dir)
    row = {"version": 0, "buffer_depth": 3, "oldest_buffered_age_s": 1.0}
    w.append("cluster", [row | {"elapsed_s": t, "wall_time": t0 + t} for t in range(60)])
    w.append(
        "rollouts",
        [
            {"elapsed_s": t, "rollout": r, "kv_used": t, "kv_capacity": 100, "version": 0}
            for t in range(0, 60, 5)
            for r in rollouts
        ],
    )
    rng = np.random.default_rng(4)
    moves = [
        {
            "time": t0 + 0.5 * i,
            "source": rollouts[i % 3],
            "destination": rollouts[(i + 1 + i % 2) % 3],
            "ok": bool(rng.random() < 0.8),
            "requests": 2,
            "pause_s": 0.01,
        }
        for i in range(100)
    ]
    w.append("repacks", moves)
    drawn = {}
    save = matplotlib.figure.Figure.savefig

    def record(fig, name, *args, **kwargs):
        drawn[str(name).rsplit("/", 1)[-1]] = [
            [(line.get_xdata(), line.get_ydata(), line.get_marker(), line.get_color())
             for line in ax.get_lines()]
            for ax in fig.axes
        ]  # fmt: skip
        return save(fig, name, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    build_report([run_dir], tmp_path / "out")
    lines = drawn["rollouts-0.png"][0]
    colour = {r: c for r, (_, _, _, c) in zip(rollouts, lines, strict=False)}
    for marker, y, end in (("v", 0.97, "source"), ("^", 0.91, "destination")):
        got = sorted(
            (float(x), c)
            for xs, ys, m, c in lines
            if m == marker and len(xs)
            for x, yy in zip(xs, ys, strict=True)
            if yy == y
        )
        want = sorted((m["time"] - t0, colour[m[end]]) for m in moves if m["ok"])
        assert got == want, end
