"""The five schedules: what each keeps global, end to end on real worker processes, and
the pure parts the schedules bench rests on (time models, the split search)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from factories import run_to_end
from runs import check_store

from laminar.config import RunConfig, with_overrides
from laminar.errors import ConfigError
from laminar.pacing import Clock, PacingError, Scale, TrainerTimeModel, WeightSyncModel
from laminar.schedule import ScheduleSpec
from pipelines.driver import schedule_class
from storage import open_run

SCHEDULES = ("laminar", "sync", "one_step", "stream", "partial_rollout")
# RunConfig()'s defaults, under which each schedule's options bind (partial rollout's η
# within buffer.max_outstanding_groups: 48 groups of batches of 16)
VALID = with_overrides(RunConfig(), ["pipeline.eta=2"])


def test_each_pipeline_module_states_what_it_keeps_global_and_how_to_run_it():
    import importlib

    for name in SCHEDULES:
        cls = schedule_class(name)
        assert cls.name == name and cls.spec(VALID).name == name
        doc = importlib.import_module(f"pipelines.{name}").__doc__
        assert "What it keeps global" in doc and "laminar run configs/tiny.yaml" in doc


def test_the_store_knows_which_schedules_mix_versions_in_a_response():
    """The audit reads a store's ``schedule`` attribute alone (storage needs no pipeline):
    its list of schedules whose responses mix versions is the specs' ``interrupt``."""
    from storage.schema import MIXED_VERSION_SCHEDULES

    interrupting = {n for n in SCHEDULES if schedule_class(n).spec(VALID).interrupt}
    assert interrupting == set(MIXED_VERSION_SCHEDULES)


def test_a_spec_that_cannot_work_is_refused():
    with pytest.raises(ConfigError, match="dispatch='batches', lag=1"):
        ScheduleSpec("x", trainer="one_step", dispatch="free")
    with pytest.raises(ConfigError, match="weights='nccl' is not one of"):
        ScheduleSpec("x", weights="nccl")
    with pytest.raises(ConfigError, match="not pulled at batch boundaries"):
        ScheduleSpec("x", interrupt=True, weights="relay")


@pytest.mark.parametrize(
    "override, message",
    [
        (["repack.interval_s=1", "pipeline.schedule=sync"], r"repack is Laminar's"),
        (["pipeline.schedule=stream", "trainer.ranks=2"], r"set trainer.ranks=1"),
        (["trainer.pacing.gpus=8"], r"trainer.pacing needs rollout.pacing"),
        (["pipeline.schedule=sync", "rollout.top_up=true"], r"drop rollout.top_up"),
        (["pipeline.schedule=pipelined"], r"pipeline.schedule: .*'laminar'"),
        (
            ["pipeline.schedule=one_step", "buffer.max_train_staleness=0"],
            r"set it to 1 or more",
        ),
        (
            ["pipeline.schedule=stream", "trainer.correction=decoupled", "trainer.mini_batches=2"],
            r"proximal policy",
        ),
    ],
)
def test_schedule_configs_that_cannot_run_name_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        with_overrides(RunConfig(), override)


def test_scales_keep_the_model_and_compress_its_time():
    """A real step of b requests over S tokens, with length scale L and request scale R,
    lasts the mean of L modelled steps of R·b requests, the first over R·(L·(S + b) − b)
    tokens of KV (a real request of c tokens, c − 1 of them in S, stands for R holding
    L·c − 1; it also prefills), each later one over the R·b tokens more its predecessor wrote;
    everything else modelled (training, weight syncs) is divided by L."""
    from laminar.pacing import Pacer, TimeModel

    m = TimeModel.named("H800", "7B", tp=4)
    plain = Pacer(m, dilation=2.0)
    assert plain.modelled(16, 4000, 300) == pytest.approx(2 * m.step_time(16, 4000, 300))
    scaled = Pacer(m, dilation=2.0, length_scale=100, request_scale=4)
    # a real request of c tokens (S sums c − 1) stands for R requests holding L·c − 1 of KV
    kv = 4 * (100 * (4000 + 16) - 16)
    # (the 99 steps after the first read on average the 100 × 64 / 2 tokens written since)
    rest = 99 * m.decode_time(64, kv + 100 * 64 / 2)
    want = (m.step_time(64, kv, 300 * 400) + rest) / 100
    assert scaled.modelled(16, 4000, 300) == pytest.approx(2 * want)
    # requests admitted by the step (prefilled: their first token) decode in the 99 after
    # it, over their prefilled KV less the token each decodes: a step that only admits is
    # no cheaper than its prefill plus 99 decode steps of them (it used to cost the
    # prefill alone)
    rest = 99 * m.decode_time(64 + 8, kv + 300 * 400 - 8 + 100 * (64 + 8) / 2)
    want = (m.step_time(64, kv, 300 * 400) + rest) / 100
    assert scaled.modelled(16, 4000, 300, admitted=2) == pytest.approx(2 * want)
    alone = scaled.modelled(0, 0, 300, admitted=2)
    rest = 99 * m.decode_time(8, 300 * 400 - 8 + 100 * 8 / 2)
    assert alone == pytest.approx(2 * (m.step_time(0, 0, 300 * 400) + rest) / 100)
    assert alone > 1.4 * scaled.modelled(0, 0, 300)  # (the prefill of 120k tokens: 1.5 s)
    sc = Scale(dilation=16, length_scale=256, request_scale=8)
    assert sc.wall(256.0) == 16.0 and sc.tokens == 2048
    train = TrainerTimeModel(gpus=40)
    assert train.update_time(200_000 * 40) == pytest.approx(40 + 2.0)
    assert train.tokens_time(200_000 * 40) == pytest.approx(40)
    syncs = WeightSyncModel()
    assert syncs.global_sync(1) == 3.0 and syncs.global_sync(64) == pytest.approx(4.5)
    with pytest.raises(Exception, match="length_scale=0"):
        Scale(length_scale=0)


def test_a_clock_holds_work_to_its_model_and_counts_what_overran():
    import time

    slept: list[float] = []
    clock = Clock(Scale(dilation=2.0, length_scale=4.0), strict=True, window=2, sleep=slept.append)
    t0 = time.time()
    clock.hold(t0, 2.0, "update")  # 2 s modelled: 1 s here, less what passed since t0
    assert slept and 1.0 - (time.time() - t0) <= slept[0] <= 1.0
    clock.hold(time.time() - 5, 2.0, "sync")  # the work took 5 s: an overrun, no sleep
    assert len(slept) == 1
    clock.hold(time.time() - 5, 0.0, "publish")  # modelled to cost nothing: not a stretch
    stats = clock.stats()
    assert "publish" not in stats
    assert stats["update"]["n"] == 1 and stats["update"]["overruns"] == 0
    assert stats["sync"]["overruns"] == 1 and stats["sync"]["compute_s"] >= 5
    with pytest.raises(PacingError, match="Raise rollout.pacing.dilation to at least 15"):
        clock.hold(time.time() - 5, 2.0, "sync")  # a median of 2 overran: strict stops


@pytest.mark.parametrize("gpus", [64, 128])
def test_every_arm_of_the_bench_is_a_valid_run_on_one_workload(gpus):
    """Each arm's config validates; they differ in the schedule, the split and Laminar's
    own knobs alone (its local batches top up; its ablation only drops repack)."""
    from pipelines.bench_schedules import ARMS, Cluster

    cluster = Cluster(gpus)
    cfgs = {a: with_overrides(RunConfig(), cluster.overrides(a, 5, 9, 0)) for a in ARMS}
    for arm, cfg in cfgs.items():
        assert cfg.pipeline.schedule == ARMS[arm][0]
        assert cfg.rollout.top_up == (cfg.pipeline.schedule == "laminar")
        assert (cfg.repack is not None) == ARMS[arm][1]
        assert cfg.task == cfgs["sync"].task and cfg.trainer.lr == cfgs["sync"].trainer.lr


def test_the_split_search_finds_the_best_split_of_a_unimodal_throughput():
    from pipelines.bench_schedules import search_split

    for best in range(1, 16):
        for start in (1, 6, 15):
            calls = []

            def f(r, best=best, calls=calls):
                calls.append(r)
                return -((r - best) ** 2)

            got, seen = search_split(f, lo=1, hi=15, start=start)
            assert got == best and len(set(calls)) == len(calls)  # each split run once
            assert got in seen


def test_a_bench_result_leaves_failed_runs_out_and_lists_them():
    """A run that failed is no measurement: an arm with none left has no figures and
    its ratios are None; the notes and ``failed`` name every failed run."""
    from pipelines.bench_schedules import FIGURES, Cluster, _result

    def fig(throughput: float) -> dict:
        return {k: 1.0 for k in FIGURES} | {
            "throughput": throughput,
            "_policy": [(0.0, 0.5), (10.0, 0.9)],
            "_trained": [(0.0, 0.5), (10.0, 0.9)],
        }

    results = {"sync": [fig(100.0), fig(120.0)], "laminar": [fig(150.0)], "stream": []}
    failed = [
        {
            "arm": "laminar",
            "replicas": 5,
            "run": "s1",
            "run_dir": "d/laminar-r5-s1",
            "reason": "failed: lost",
        },
        {
            "arm": "stream",
            "replicas": 6,
            "run": "s0",
            "run_dir": "d/stream-r6-s0",
            "reason": "failed: reward",
        },
    ]
    res = _result(
        Cluster(64),
        ("sync", "laminar", "stream"),
        results,
        {"sync": 16, "laminar": 5, "stream": 6},
        {},
        None,
        "d",
        failed,
        dict(seeds=2),
    )
    assert res.figures["laminar_throughput"] == 150.0 and res.figures["sync_throughput"] == 110
    assert np.isnan(res.figures["stream_throughput"])
    assert res.ratios["laminar_vs_sync"] == pytest.approx(150 / 110)
    assert res.ratios["laminar_vs_stream"] is None
    assert res.failed == failed and res.to_json()["failed"] == failed
    assert [n for n in res.notes if n.startswith("FAILED")] == [
        "FAILED, left out: laminar R=5 s1: failed: lost (d/laminar-r5-s1)",
        "FAILED, left out: stream R=6 s0: failed: reward (d/stream-r6-s0)",
    ]
    with pytest.raises(RuntimeError, match="every measured run failed"):
        _result(
            Cluster(64),
            ("stream",),
            {"stream": []},
            {"stream": 6},
            {},
            None,
            "d",
            failed[1:],
            dict(seeds=1),
        )


def test_a_search_only_bench_reports_each_split_and_its_probes():
    """``--seeds 0``: the splits the search found, with every probe, and no ratios
    (nothing was measured at those splits)."""
    from pipelines.bench_schedules import Cluster, _search_result

    probes = {"laminar": {10: 390e3, 12: 371e3, 8: 355e3}}
    res = _search_result(
        Cluster(128), ("sync", "laminar"), {"sync": 32, "laminar": 10}, probes, "d"
    )
    assert res.ratios == {}
    assert (
        res.figures["laminar_replicas"] == 10 and res.figures["laminar_probe_throughput"] == 390e3
    )
    assert res.rows[0][:3] == ["sync", 32, 128]  # colocated: every GPU trains as well
    assert res.rows[1][:4] == ["laminar", 10, 88, 390e3]
    assert "12: 371k" in res.rows[1][4] and res.options["probes"]["laminar"]["8"] == 355e3
    from pipelines.bench_schedules import bench_schedules

    with pytest.raises(ValueError, match="--seeds -1"):
        bench_schedules(seeds=-1)
    # nothing to search: refused before a cluster starts
    with pytest.raises(ValueError, match="no arm's split is searched"):
        bench_schedules(seeds=0, arms=("sync", "laminar"), splits={"laminar": 5})
    with pytest.raises(ValueError, match="no arm's split is searched"):
        bench_schedules(seeds=0, search=False)
    ablation = _search_result(
        Cluster(64),
        ("laminar", "laminar_no_repack"),
        {"laminar": 5, "laminar_no_repack": 5},
        {"laminar": {5: 2e5}},
        "d",
    )
    assert ablation.rows[1][4] == "at laminar's split"


# -- end to end -------------------------------------------------------------------------


def _consumed(ds):
    c = ds["status"].values == "consumed"
    return {k: ds[k].values[c] for k in ("behavior_version", "sample_version", "prompt_uid")}


def decode_reads(ro) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each rollout's ``decode_s`` and ``read_at`` (its own clock: a poll of several
    rollouts on a loaded host reads them a fraction of a second apart) at the polls it
    answered (one that answered a poll's stats call late has no row there: NaN), having
    checked that over the run it decoded no longer than passed between its first and
    last reading, but for the iteration under way at the first. Over the whole run, so
    that one slow data-module call at a single poll cannot fail it (a single interval's
    bound did, with the code right); 1 s is far below the seconds that decoding counted
    twice would add."""
    out = {}
    for rid in ro["rollout"].values:
        d, t = ro["decode_s"].sel(rollout=rid).values, ro["read_at"].sel(rollout=rid).values
        d, t = d[~np.isnan(d)], t[~np.isnan(d)]
        assert d[-1] - d[0] <= t[-1] - t[0] + 1.0, (rid, d, t)
        out[str(rid)] = d, t
    return out


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["sync", "one_step", "stream", "partial_rollout"])
def test_each_baseline_schedule_runs_end_to_end_and_keeps_its_promises(
    schedule, cluster_client, small_config, tmp_path
):
    """Every baseline trains its versions on whole groups and audits clean; what it keeps
    global shows in the store: sync and stream train on-policy, one-step exactly one
    version stale, partial rollout interrupts every rollout at every publication. The
    barrier schedules' batches of 3 groups of 4 split 6 samples to each of the 2
    rollouts: a group goes out in pieces, put together whole by the buffer."""
    overrides = [f"pipeline.schedule={schedule}", "trainer.mini_batches=2"]
    barrier = schedule != "partial_rollout"
    if barrier:
        overrides.append("trainer.groups_per_step=3")
    if schedule == "partial_rollout":  # (η within max_outstanding_groups=8: 2 batches of 4)
        overrides += ["pipeline.eta=1", "rollout.pacing.dilation=10", "rollout.pacing.strict=false"]
    run, summary = run_to_end(cluster_client, small_config, tmp_path / "run", overrides)
    assert summary["reason"] == "completed", summary
    assert summary["schedule"] == schedule and summary["versions"] == 4
    ds = open_run(run.run_dir)
    assert ds.attrs["schedule"] == schedule
    c = _consumed(ds)
    groups = 3 if barrier else small_config.trainer.groups_per_step
    for v in range(4):  # one global batch of whole groups per version
        assert len(set(c["prompt_uid"][c["sample_version"] == v])) == groups
    if barrier:  # (each batch's middle group split between the rollouts)
        consumed = ds["status"].values == "consumed"
        ran_on: dict[str, set] = {}
        for uid, rid in zip(c["prompt_uid"], ds["rollout_ids"].values[consumed], strict=True):
            ran_on.setdefault(str(uid), set()).add(str(rid))
        assert sum(len(r) > 1 for r in ran_on.values()) >= 4, ran_on
    s_train = c["sample_version"] - c["behavior_version"]
    if schedule in ("sync", "stream"):
        assert (s_train == 0).all()
        check_store(run.run_dir)
    elif schedule == "one_step":  # batches 0 and 1 by version 0, then b by b - 1
        assert (s_train == np.minimum(c["sample_version"], 1)).all()
        check_store(run.run_dir)
    else:
        assert ds.laminar.audit() == []  # mixed versions rise from the behavior version
        assert all(r["interrupts"] >= 3 for r in summary["rollouts"])
        # Each response that crossed a version was held by an interrupt, then resumed
        # with its KV recomputed. (Paced, a batch decodes for ~1 s, an update ~0.1 s: a
        # publication finds requests generating. Unpaced, the next batch had finished by
        # nearly every publication here, and by all of them on a slow CI host.)
        held = sum(r["interrupted_requests"] for r in summary["rollouts"])
        recomputed = sum(r["recomputed_tokens"] for r in summary["rollouts"])
        crossed = sum(
            len(set(ds.laminar.tokens("token_versions", i).tolist())) > 1
            for i in range(ds.sizes["trajectory"])
        )
        assert 0 < crossed <= held and recomputed > 0, (crossed, held, recomputed)
    from storage.metrics import open_metrics

    if schedule == "stream":
        updates = open_metrics(run.run_dir, "updates")
        assert (updates["mini_batches"].values == 2).all()
    # Decoding time is counted as it passes (the idle fractions are read from it), also
    # while a refilled batch lasts a whole update: it used to be added once per batch.
    # That bug leaves decode_s flat between two polls while the rollout makes decode
    # steps (partial rollout: 4 of 12 intervals here, 13 steps each, with it put back).
    # decode_steps grows a step before decode_s, within one loop iteration: 2 steps
    # between two polls mean an iteration ended between them, and added its time.
    # (This once bounded decode_s's growth beyond the time between polls, by 0.3 s: the
    # bug gave 0.27-0.35 s over as well as 0.47, and a loaded host's data-module call,
    # in the iteration under way at a poll, gave 0.3 s over with the code right.)
    ro = open_metrics(run.run_dir, "rollouts").transpose("time", ...)
    steps = np.diff(ro["decode_steps"].values, axis=0)
    decoded = np.diff(ro["decode_s"].values, axis=0)
    assert not (decoded[steps >= 2] <= 0).any(), (steps.T, decoded.T)
    # ... and never more than the time that passed
    decode_reads(ro)


@pytest.mark.slow
def test_laminar_batches_top_up_at_the_newest_version_and_keep_one_version_a_group(
    cluster_client, small_config, tmp_path
):
    """``rollout.top_up``: draining local batches take new groups while their version is
    the newest published; every trajectory still has one weight version, every group one
    behavior version, and the store audits clean."""
    # (room for more than the two local batches: else back-pressure leaves none to top up)
    overrides = ["rollout.top_up=true", "trainer.steps=6", "buffer.max_outstanding_groups=16"]
    run, summary = run_to_end(cluster_client, small_config, tmp_path / "run", overrides)
    assert summary["reason"] == "completed", summary
    topped = sum(r["topped_up_groups"] for r in summary["rollouts"])
    assert topped > 0, summary["rollouts"]
    # every ask is counted, and each that got groups got at most the room of one engine
    asks = sum(r["top_up_asks"] for r in summary["rollouts"])
    room = small_config.rollout.max_batch // small_config.rollout.group_size
    assert topped <= asks * room, (topped, asks)
    assert sum(r["top_up_s"] for r in summary["rollouts"]) > 0
    from storage.metrics import open_metrics

    polled = open_metrics(run.run_dir, "rollouts")["top_up_asks"].max("time").values
    assert 0 < np.nansum(polled) <= asks
    ds = check_store(run.run_dir)
    versions = ds[["prompt_uid", "behavior_version"]].to_dataframe()
    assert (versions.groupby("prompt_uid")["behavior_version"].nunique() == 1).all()


@pytest.mark.slow
def test_sync_makes_up_for_the_groups_dynamic_sampling_filters(
    cluster_client, small_config, tmp_path
):
    """A global batch whose groups are filtered (no reward signal) is completed by
    replacements generated by the same version: the run does not wait forever for a
    batch the pool holds back, and each version still trains one whole batch on-policy."""
    overrides = [
        "pipeline.schedule=sync",
        "buffer.dynamic_sampling=true",
        "task.reward=laminar.rewards:_half_flat",
        "trainer.steps=3",
    ]
    run, summary = run_to_end(cluster_client, small_config, tmp_path / "run", overrides)
    assert summary["reason"] == "completed", summary
    assert summary["buffer"]["groups_filtered"] > 0
    assert summary["pool"]["untrained"] == summary["buffer"]["groups_filtered"]
    ds = open_run(run.run_dir)
    c = _consumed(ds)
    for v in range(3):
        assert len(set(c["prompt_uid"][c["sample_version"] == v])) == 4
    assert (c["sample_version"] == c["behavior_version"]).all()
    check_store(run.run_dir)


@pytest.mark.slow
def test_paced_schedules_pay_their_weight_movements_and_the_bench_reads_them(
    cluster_client, small_config, tmp_path
):
    """One-step on emulated trainer GPUs: each update lasts at least its modelled time
    and each publication a global NCCL sync, and the bench's figures of the run are the
    tables' own numbers in modelled units."""
    from pipelines.bench_schedules import arm_figures, reanalyse
    from storage.metrics import open_metrics

    pacing = [
        "rollout.pacing.dilation=8",
        "rollout.pacing.strict=false",
        "rollout.pacing.length_scale=32",
        "rollout.pacing.request_scale=2",
        "trainer.pacing.gpus=4",
        "trainer.pacing.global_sync_s=4",  # with 2 replicas 4.25 s modelled: 1.06 s here
        "pipeline.schedule=one_step",
        "trainer.steps=3",
    ]
    runs = tmp_path / "runs"  # named as the bench names its runs: arm, replicas, seed
    run, summary = run_to_end(cluster_client, small_config, runs / "one_step-r2-s0", pacing)
    assert summary["reason"] == "completed", summary
    paced = summary["trainer_pacing"]
    assert paced["update"]["n"] == 3 and paced["global_sync"]["n"] == 3
    updates = open_metrics(run.run_dir, "updates")
    sync_wall = (4 + 0.25 * 1) * 8 / 32
    assert (updates["sync_s"].values >= sync_wall * 0.99).all()
    want = TrainerTimeModel(gpus=4).update_time(updates["tokens"].values * 64) * 8 / 32
    assert (updates["update_s"].values >= want * 0.99).all()
    check_store(run.run_dir)

    fig = arm_figures(run.run_dir, summary, warmup=1)
    rows = updates.sortby("version")
    # after the warm-up update, and not one-step's last (it waits for no next batch)
    measured = (rows["version"].values > 1) & (rows["version"].values < 3)
    tokens = rows["tokens"].values[measured].sum()
    interval = rows["interval_s"].values[measured].sum()
    assert fig["throughput"] == pytest.approx(tokens * 64 / (interval * 32 / 8))
    assert 0 <= fig["rollout_idle"] <= 1 and 0 <= fig["trainer_idle"] <= 1
    # Each rollout's counters come with the time it read them: over the run it decoded
    # at most that long (decode_reads), its readings in order.
    decoded = 0.0
    for rid, (d, t) in decode_reads(open_metrics(run.run_dir, "rollouts")).items():
        assert (np.diff(t) > 0).all() and (np.diff(d) >= 0).all(), (rid, d, t)
        decoded += d[-1] - d[0]
    assert decoded > 0
    assert fig["s_train_max"] == 1 and fig["audit_ok"] == 1.0
    # the measured batches' staleness only: one-step's first (s_train 0) is warm-up
    assert fig["s_train_mean"] == 1.0
    # the decode loops' time beyond their modelled steps: some (the work between steps),
    # none of it top-up asks (one-step does not top up)
    decode_s = sum(r["decode_s"] for r in summary["rollouts"])
    assert fig["decode_unmodelled"] == pytest.approx(1 - summary["engine"]["modelled_s"] / decode_s)
    assert 0 < fig["decode_unmodelled"] < 1 and fig["top_up_share"] == 0
    # ... and re-analysing the kept runs gives the same figures, the cluster read back
    again = reanalyse(str(runs), warmup=1)
    assert again.figures["one_step_throughput"] == fig["throughput"]
    assert again.options["gpus"] == 4 + 2 * 4 and again.options["splits"] == {"one_step": 2}
    # ... and a folder of probes alone (a --seeds 0 bench, or one stopped in its search)
    # gives the search's result: the best probe's split
    probes = tmp_path / "probes"
    shutil.copytree(run.run_dir, probes / "one_step-r2-probe")
    searched = reanalyse(str(probes), probe_warmup=1)
    assert searched.ratios == {} and searched.options["splits"] == {"one_step": 2}
    assert searched.figures["one_step_probe_throughput"] == fig["throughput"]
    # ... and a run that failed is left out of every figure and listed; the command
    # writes the others' figures and exits 1
    lost = runs / "stream-r2-s0"
    shutil.copytree(run.run_dir, lost)
    (lost / "summary.json").write_text(
        json.dumps(summary | {"reason": "failed: reward function raised"})
    )
    out = tmp_path / "again.json"
    from pipelines.cli import main

    assert (
        main(
            [
                "bench",
                "schedules",
                "--from-runs",
                "--runs-dir",
                str(runs),
                "--warmup",
                "1",
                "--out",
                str(out),
            ]
        )
        == 1
    )
    written = json.loads(out.read_text())
    assert written["figures"]["one_step_throughput"] == fig["throughput"]
    assert written["figures"]["stream_throughput"] is None  # (its one run failed: NaN)
    assert [(f["arm"], f["run"], f["reason"]) for f in written["failed"]] == [
        ("stream", "s0", "failed: reward function raised")
    ]
    assert any(n.startswith("FAILED, left out: stream R=2 s0") for n in written["notes"])


def test_a_baseline_run_is_not_resumed_in_place(tmp_path):
    import pipelines

    run = tmp_path / "run"
    (run / "checkpoints" / "version-000002").mkdir(parents=True)
    (run / "checkpoints" / "version-000002" / "trainer_state.json").write_text('{"version": 2}')
    cfg = with_overrides(RunConfig(), ["pipeline.schedule=sync"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    with pytest.raises(ConfigError, match="start a new run from its checkpoint"):
        pipelines.resume(run, client=None)


# -- the audit of a baseline's store -----------------------------------------------------


def _baseline_store(path, schedule, groups, updates=None, split=False, resume=None):
    """A run directory whose store holds consumed groups of 2, each ``(K, M_t)``, written
    by ``schedule``; ``updates``: the published versions to record in ``metrics.zarr``;
    ``split``: the first group's second sibling generated one version later; ``resume``:
    the store records a resume from that version's checkpoint."""
    from factories import trajectory

    from storage import TrajectoryWriter
    from storage.metrics import MetricsWriter

    records = []
    for g, (k, m_t) in enumerate(groups):
        for i in range(2):
            k_i = k + (split and g == 0 and i == 1)
            records.append(
                trajectory(
                    f"p{g}-{i}",
                    f"p{g}",
                    prompt_key=g,
                    sample_idx=i,
                    behavior_version=k_i,
                    finish_version=k_i,
                    sample_version=m_t,
                    t_insert=0.0,
                    t_sample=0.0,
                    status="consumed",
                ).to_record()
            )
    writer = TrajectoryWriter(path, schedule=schedule)
    if resume is not None:
        writer.record_resume(resume, 1.0)
    writer.append(records)
    if updates is not None:
        MetricsWriter(path).append("updates", [{"version": v, "tokens": 10} for v in updates])
    (path / "summary.json").write_text(json.dumps({"reason": "completed"}))
    return path


@pytest.mark.parametrize(
    "schedule, groups, stale",
    [
        ("sync", [(0, 0), (0, 1)], "s_train = 0"),
        ("stream", [(1, 1), (0, 1)], "s_train = 0"),
        ("one_step", [(0, 0), (0, 1), (0, 2)], "s_train 0 or 1"),
    ],
)
def test_the_audit_holds_each_baseline_to_its_staleness(tmp_path, schedule, groups, stale):
    """``laminar audit`` applies what each schedule promises (docs/schedules.md): a store
    that breaks it is a problem, one that keeps it is clean."""
    from storage.audit import audit_run

    bad = audit_run(_baseline_store(tmp_path / "bad", schedule, groups))
    assert any(stale in p for p in bad.problems), bad.problems
    kept = [(k, m) for k, m in groups if m - k <= (1 if schedule == "one_step" else 0)]
    good = audit_run(_baseline_store(tmp_path / "good", schedule, kept))
    assert good.ok, good.problems
    # the same store, written by Laminar (no staleness promise): clean
    assert audit_run(_baseline_store(tmp_path / "laminar", "laminar", groups)).ok


def test_the_audit_finds_the_trained_batches_in_the_store(tmp_path):
    """Every version the trainer published (the ``updates`` table) trained a batch the
    store holds as consumed at the version before: an empty store, or one missing a
    version's batch, is a problem, not a clean audit of nothing."""
    from storage.audit import audit_run

    empty = audit_run(_baseline_store(tmp_path / "empty", "sync", [], updates=[1, 2]))
    assert any("no consumed trajectory" in p for p in empty.problems), empty.problems
    gap = audit_run(_baseline_store(tmp_path / "gap", "sync", [(0, 0)], updates=[1, 2]))
    assert [p for p in gap.problems if "version 2" in p], gap.problems
    assert audit_run(_baseline_store(tmp_path / "ok", "sync", [(0, 0), (1, 1)], [1, 2])).ok
    # Laminar: checked too, but for the versions a trainer restarted within the run
    # skipped (the lost one's after its checkpoint: their batches were trained again)
    lam = audit_run(_baseline_store(tmp_path / "lam", "laminar", [(0, 0)], updates=[1, 2]))
    assert [p for p in lam.problems if "version 2" in p], lam.problems
    restarted = _baseline_store(tmp_path / "lam-r", "laminar", [(0, 0), (3, 3)], [1, 2, 3, 4])
    summary = {"reason": "completed", "segments": 1}
    summary["faults"] = {"trainer_restarts": [{"checkpoint_version": 1, "after_version": 3}]}
    (restarted / "summary.json").write_text(json.dumps(summary))
    assert audit_run(restarted).ok  # (1 and 4 trained at 0 and 3; 2 and 3 skipped)
    summary["faults"]["trainer_restarts"][0]["after_version"] = 2  # (3 not skipped)
    (restarted / "summary.json").write_text(json.dumps(summary))
    assert [p for p in audit_run(restarted).problems if "version 3" in p]
    assert not audit_run(_baseline_store(tmp_path / "lam0", "laminar", [], updates=[1])).ok
    # A resumed run: the first start restarted (1, 2) and published up to 6; the second
    # resumed from its checkpoint of 3 (which records that restart) and ended at 5. A row
    # of `updates` holds a version's newest publication: 6 is the lost start's, past the
    # end, superseded; 2 was skipped; every other version trained a batch.
    trained = [(0, 0), (2, 2), (3, 3), (4, 4)]
    resumed = _baseline_store(tmp_path / "res", "laminar", trained, [1, 2, 3, 4, 5, 6], resume=3)
    ckpt = resumed / "checkpoints" / "version-000003"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"version": 3, "restarts": [[1, 2]]}))
    summary = {"reason": "completed", "segments": 2, "versions": 5, "resumed": {"version": 3}}
    (resumed / "summary.json").write_text(json.dumps(summary))
    assert audit_run(resumed).ok
    gap = _baseline_store(
        tmp_path / "res-gap", "laminar", trained[:-1], [1, 2, 3, 4, 5, 6], resume=3
    )
    shutil.copytree(ckpt, gap / "checkpoints" / ckpt.name)
    (gap / "summary.json").write_text(json.dumps(summary))
    assert [p for p in audit_run(gap).problems if "version 5" in p], audit_run(gap).problems
    # ... and where its restarts are not all known (the checkpoint it resumed from gone,
    # no later one): only an empty store is a problem, and a note says why
    shutil.rmtree(gap / "checkpoints")
    unsure = audit_run(gap)
    assert unsure.ok and [n for n in unsure.notes if "not all known" in n], unsure.notes
    # a run still running (or lost): its store lags the metrics by a flush, a note
    (tmp_path / "gap" / "summary.json").unlink()
    running = audit_run(tmp_path / "gap")
    assert running.ok and [n for n in running.notes if "version 2" in n], running.notes


def test_the_audit_finds_a_barrier_group_split_across_versions(tmp_path):
    """A barrier schedule hands a group out whole, to one rollout of one version: a
    consumed group whose siblings have two behavior versions (each within one-step's
    s_train 0 or 1) broke the barrier."""
    from storage.audit import audit_run

    groups = [(0, 1), (1, 2)]
    assert audit_run(_baseline_store(tmp_path / "whole", "one_step", groups)).ok
    split = audit_run(_baseline_store(tmp_path / "split", "one_step", groups, split=True))
    assert any("behavior versions" in p for p in split.problems), split.problems
