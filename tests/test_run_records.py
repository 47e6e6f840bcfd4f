"""What a run's records say of its faults across its starts and losses: the audit's
check of each lost rollout, the summary's and the report's counts of them, the
progress a notebook shows. Synthetic stores, no cluster."""

from __future__ import annotations

import json
import shutil

from factories import trajectory

from storage import TrajectoryWriter
from storage.metrics import MetricsWriter

T0 = 1.8e9  # the run's start, epoch seconds


def _store(run_dir, paths=("r0", "r1,r0", "r1,r0", "r0")) -> None:
    TrajectoryWriter(run_dir).append(
        [
            trajectory(f"u{i}", f"g{i}", group_size=1, rollout_ids=p, finish_version=0).to_record()
            for i, p in enumerate(paths)
        ]
    )


def _fault(rollout: str, t: float, **row) -> dict:
    return {
        "time": t,
        "rollout": rollout,
        "destination": "r0",
        "how": "import",
        "version": 1,
        "requests": 2,
        "tokens_recovered": 4,
        "max_since_flush_s": 0.1,
        "recovery_s": 0.1,
        **row,
    }


def test_the_audit_flags_a_lost_rollout_whose_recovery_rows_were_lost(tmp_path):
    """summary.json names r1 lost, but its recovery rows died with the data module before
    the driver wrote them: the audit said "rollouts lost 0 ... CLEAN", its recovery
    check skipped. It counts the loss and says it cannot check it."""
    from storage.audit import audit_run

    _store(tmp_path)
    summary = {"reason": "completed", "segments": 1, "faults": {"lost": {"r1": T0 + 3}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    report = audit_run(tmp_path)
    assert report.figures["rollouts lost"] == 1
    assert report.problems == [
        "1 rollouts summary.json names as lost (r1 (start 0)) have no row in the faults "
        "table of metrics.zarr: their recovery rows were lost (with the data module, "
        "before the driver copied them), so their recovery is unchecked"
    ]
    # with its rows, the check is made
    MetricsWriter(tmp_path).append("faults", [_fault("r1", T0 + 3, segment=0)])
    report = audit_run(tmp_path)
    assert report.ok, report.text()
    assert report.figures["rollouts lost"] == 1
    assert report.figures["r1: resumed and stored"] == 2


def test_a_lost_rollouts_missing_trajectories_are_excused_only_by_its_own_unfinished_ones(
    tmp_path,
):
    """r1 was lost and 4 of its trajectories recovered; none is in the store. At the
    stop the recovery log holds 4 unfinished requests, but all of r0's own, never on
    r1: they cannot be r1's missing ones. The audit took the log's whole count as the
    bound (4 missing <= 4 unfinished: a note) and called the run clean; it counts only
    what the log holds of r1's (its rollout path), and the loss is a problem. Resumed
    elsewhere and still unfinished at the stop, they excuse it again."""
    from test_partial_log import _states

    from laminar.partial import PartialCore
    from storage.audit import audit_run
    from storage.partial_log import PartialLogWriter

    _store(tmp_path, paths=("r0",) * 4)
    MetricsWriter(tmp_path).append("faults", [_fault("r1", T0 + 3, requests=4, segment=0)])
    summary = {"reason": "completed", "segments": 1, "faults": {"lost": {"r1": T0 + 3}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    core = PartialCore(journal=True)
    core.register("r0", 0, _states([f"p00-{i:03d}" for i in range(4)], seed=0))
    PartialLogWriter(tmp_path).append(**core.drain_journal())
    report = audit_run(tmp_path)
    assert not report.ok and report.figures["unfinished at the stop"] == 4
    assert report.problems == [
        "rollout r1: 4 trajectories recovered, 0 stored as finished elsewhere (0 of them "
        "were unfinished at the stop)"
    ]
    # r1's own 4, taken at its loss and resumed on r0, still generating at the stop
    core.register("r1", 0, _states([f"p01-{i:03d}" for i in range(4)], seed=9))
    core.take("r1")
    core.reassign([f"p01-{i:03d}" for i in range(4)], "r0")
    PartialLogWriter(tmp_path).append(**core.drain_journal())
    report = audit_run(tmp_path)
    assert report.ok, report.text()
    assert report.notes[-1].endswith("(4 of them were unfinished at the stop)")


def test_a_take_the_log_had_not_recorded_still_excuses_the_lost_rollouts_unfinished_ones(
    tmp_path,
):
    """The run was lost after r3's loss was recovered but before the log's next write:
    the log still names r3 the owner of its 4 unfinished requests (no take, so r3 is not
    on their path). They are the 4 missing ones: a note, not a problem."""
    from test_partial_log import _states

    from laminar.partial import PartialCore
    from storage.audit import audit_run
    from storage.partial_log import PartialLogWriter

    _store(tmp_path, paths=("r0",) * 4)
    MetricsWriter(tmp_path).append("faults", [_fault("r3", T0 + 3, requests=4, segment=0)])
    core = PartialCore(journal=True)
    core.register("r3", 0, _states([f"p00-{i:03d}" for i in range(4)], seed=0))
    PartialLogWriter(tmp_path).append(**core.drain_journal())
    report = audit_run(tmp_path)  # (no summary.json: the run was lost)
    assert report.ok, report.text()
    assert report.notes[-1].endswith("(4 of them were unfinished at the stop)"), report.notes


def test_a_later_starts_rollout_of_the_same_name_does_not_excuse_an_earlier_loss(tmp_path):
    """r1 of the first start was lost and 4 of its trajectories recovered, none stored.
    The resumed start names its rollouts r0, r1, ... again: its live r1's 4 unfinished
    requests at the stop are its own work, not the lost r1's, and excuse nothing."""
    from test_partial_log import _states

    from laminar.partial import PartialCore
    from storage.audit import audit_run
    from storage.partial_log import PartialLogWriter

    _store(tmp_path, paths=("r0",) * 4)
    MetricsWriter(tmp_path).append("faults", [_fault("r1", T0 + 3, requests=4, segment=0)])
    earlier = [{"segment": 0, "lost": {"r1": T0 + 3}}]
    summary = {"reason": "completed", "segments": 2, "faults": {"lost": {}, "earlier": earlier}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    core = PartialCore(journal=True)
    core.register("r1", 0, _states([f"p00-{i:03d}" for i in range(4)], seed=0))
    PartialLogWriter(tmp_path).append(**core.drain_journal())
    report = audit_run(tmp_path)
    assert report.problems == [
        "rollout r1: 4 trajectories recovered, 0 stored as finished elsewhere (0 of them "
        "were unfinished at the stop)"
    ], report.text()


def _cluster(run_dir, starts=((0, 0.0, 10.0), (1, 100.0, 110.0), (2, 200.0, 210.0))) -> None:
    MetricsWriter(run_dir).append(
        "cluster",
        [
            {"segment": s, "elapsed_s": t, "wall_time": T0 + t, "version": 1, "buffer_depth": 0}
            | {"oldest_buffered_age_s": 0.0}
            for s, a, b in starts
            for t in (a, b)
        ],
    )


def test_a_resumed_runs_summary_carries_every_earlier_starts_losses(tmp_path):
    """Each start rewrites summary.json: a resume's showed only its own losses, while the
    faults table holds every start's. The earlier starts' are carried under
    ``faults.earlier``: from the summary of a start that stopped in order (with what it
    carried), through a failed driver's summary (``faults_earlier``), and from the
    faults table for a start that wrote no summary of its faults."""
    from laminar.config import RunConfig
    from pipelines.summary import earlier_faults, summarize_failed
    from storage.metrics import open_metrics, segments, time_origin

    _store(tmp_path)
    _cluster(tmp_path)
    MetricsWriter(tmp_path).append(
        "faults",
        [
            _fault("r1", T0 + 3, segment=0),
            _fault("r1", T0 + 4, segment=0),
            _fault("r2", T0 + 103, segment=1),
            _fault("r0", T0 + 205, segment=2, requests=5),
            _fault("r0", T0 + 206, segment=2, how="none", requests=0),
        ],
    )
    start0 = {"segment": 0, "lost": {"r1": T0 + 3}, "replacements": {"r1": "r3"}}
    start0 |= {"recoveries": 2, "recovered_requests": 4}
    faults = {"lost": {"r2": T0 + 103}, "replacements": {}, "recoveries": 1}
    faults |= {"recovered_requests": 2, "earlier": [start0]}
    summary = {"reason": "stopped", "segments": 2, "faults": faults}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    # start 2 failed: its driver's summary keeps what the one it replaces carried
    failed = summarize_failed(tmp_path, RuntimeError("lost the trainer"), RunConfig())
    assert failed["driver_failed"] and [e["segment"] for e in failed["faults_earlier"]] == [0, 1]
    cluster = open_metrics(tmp_path, "cluster")
    earlier = earlier_faults(tmp_path, segments(cluster), time_origin(cluster))
    assert [e["segment"] for e in earlier] == [0, 1, 2]
    assert earlier[0] == start0
    assert earlier[1] == {"segment": 1, **{k: faults[k] for k in start0 if k != "segment"}}
    assert earlier[2] == {
        "segment": 2,
        "lost": {"r0": T0 + 205},
        "replacements": None,  # (not in the table)
        "recoveries": 2,
        "recovered_requests": 5,
        "from": "faults table",
    }


def test_the_report_counts_and_marks_the_losses_of_every_start(tmp_path):
    """A run that lost r1, then was stopped and resumed: report.md said "rollouts lost
    0 ... replacements 0" beside the recoveries of r1 from the faults table, and its
    figures marked no loss, reading the losses from the resumed start's summary alone."""
    from pipelines.report import _load, _lost, build_report

    _store(tmp_path)
    _cluster(tmp_path, starts=((0, 0.0, 10.0), (1, 100.0, 110.0)))
    MetricsWriter(tmp_path).append(
        "faults",
        [_fault("r1", T0 + 3, segment=0), _fault("r1", T0 + 3, segment=0, how="rescore")],
    )
    start0 = {"segment": 0, "lost": {"r1": T0 + 3}, "replacements": {"r1": "r2"}}
    start0 |= {"recoveries": 2, "recovered_requests": 4}
    faults = {"lost": {}, "replacements": {}, "recoveries": 0, "recovered_requests": 0}
    summary = {"reason": "completed", "segments": 2, "faults": faults | {"earlier": [start0]}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert _lost(_load(tmp_path)) == [("r1", 3.0)]  # (marked on the figures)
    text = build_report([tmp_path], tmp_path / "report").read_text()
    # moves, lost, by how, replacements
    assert f"| {tmp_path.name} | 0 | - | - | 0 | 1 | import 2, rescore 2 | 1 |" in text, text


def test_the_report_counts_the_replacements_a_failed_drivers_summary_carries():
    """A failed driver's summary carries the earlier starts as ``faults_earlier`` (the
    audit reads them there): the report's replacements counted only ``faults.earlier``."""
    from pipelines.report import _replacements

    earlier = [{"segment": 0, "lost": {"r1": T0}, "replacements": {"r1": "r2"}}]
    failed = {"reason": "failed: …", "faults": {"replacements": {}}, "faults_earlier": earlier}
    assert _replacements(failed) == 1
    carried = {"faults": {"replacements": {"r0": "r3"}, "earlier": earlier}}
    assert _replacements(carried) == 2


def test_a_damaged_metrics_or_recovery_log_is_a_problem_and_the_other_checks_are_made(tmp_path):
    """A damaged metrics.zarr made the audit raise: no report at all, not even the
    trajectory store's checks, which do not read it. Each check that reads a damaged
    store is now a problem naming the store and its fix; the others are made."""
    from laminar.partial import PartialCore
    from storage.audit import audit_run
    from storage.partial_log import PartialLogWriter

    _store(tmp_path)
    metrics = MetricsWriter(tmp_path)
    metrics.append("faults", [_fault("r1", T0 + 3, segment=0)])
    metrics.append("updates", [{"version": 1, "loss": 0.5}])
    PartialLogWriter(tmp_path).append(**PartialCore(journal=True).drain_journal())
    summary = {"reason": "completed", "segments": 1, "faults": {"lost": {"r1": T0 + 3}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    report = audit_run(tmp_path)
    assert report.figures["rollouts lost"] == 1
    (unconsumed,) = report.problems  # (the update's batch is not in this synthetic store)
    assert unconsumed.startswith("the trainer published 1 versions, but the store holds no")
    (tmp_path / "metrics.zarr" / "faults" / "zarr.json").write_text("{")
    report = audit_run(tmp_path)
    assert report.figures["trajectories"] == 4 and report.figures["groups"] == 4
    assert "rollouts lost" not in report.figures
    assert report.problems[0] == unconsumed
    problem = report.problems[1]
    assert problem.startswith("the lost rollouts' recovery not checked: cannot read '")
    assert "metrics.zarr" in problem and "restore the run directory from a copy" in problem
    (tmp_path / "metrics.zarr" / "updates" / "zarr.json").write_text("{")
    assert [p.split(":")[0] for p in audit_run(tmp_path).problems] == [
        "published versions not checked",
        "the lost rollouts' recovery not checked",
    ]
    # a damaged recovery log: the lost rollouts cannot be bounded by it, nor checked
    shutil.rmtree(tmp_path / "metrics.zarr")
    (tmp_path / "partial.zarr" / "zarr.json").write_text("{")
    (problem,) = audit_run(tmp_path).problems
    assert problem.startswith("the recovery log and the lost rollouts' recovery not checked")
    assert "partial.zarr" in problem
    # a damaged summary.json was taken as absent, silently: the run's losses unchecked
    shutil.rmtree(tmp_path / "partial.zarr")
    for text, said in [("{", "cannot be read (JSONDecodeError"), ("[]", "is not a JSON object")]:
        (tmp_path / "summary.json").write_text(text)
        (problem,) = audit_run(tmp_path).problems
        assert problem.startswith(f"'{tmp_path}/summary.json' {said}"), problem
        assert problem.endswith("restore it from a copy")


def test_the_audit_bounds_the_groups_a_version_trained_by_its_updates(tmp_path):
    """Two batches consumed at version 1 audited clean (every other check passes: the
    groups are whole, each published version trained one): a batch sampled twice, as a
    retried sample once did. A version trains groups_per_step groups per update, one
    more update for each skipped at it (non-finite: nothing published)."""
    from storage.audit import audit_run

    def batch(version: int, first: int) -> list:
        return [
            trajectory(
                f"g{g}-{i}",
                f"g{g}",
                sample_idx=i,
                status="consumed",
                finish_version=version,
                sample_version=version,
                t_sample=1.0 + version,
            ).to_record()
            for g in range(first, first + 2)
            for i in range(2)
        ]

    TrajectoryWriter(tmp_path).append(batch(0, 0) + batch(1, 2) + batch(1, 4))
    MetricsWriter(tmp_path).append("updates", [{"version": v, "loss": 0.5} for v in (1, 2)])
    summary = {"reason": "completed", "segments": 1, "groups_per_step": 2}
    for skipped, problems in [
        ([], ["1 versions trained more groups than their updates took, e.g. version 1: "]),
        ([1], []),  # (its first batch trained nothing: the second was consumed at it too)
        ([0], ["1 versions trained more groups than their updates took, e.g. version 1: "]),
    ]:
        (tmp_path / "summary.json").write_text(json.dumps(summary | {"skipped_updates": skipped}))
        report = audit_run(tmp_path)
        assert [p[: len(w)] for p, w in zip(report.problems, problems, strict=False)] == problems
        assert len(report.problems) == len(problems), report.problems
        assert report.figures["groups trained, max per version"] == 4
    assert report.problems[0].endswith(
        "4 groups consumed at it, its updates (1, 0 skipped) took 2 (trainer.groups_per_step "
        "each): a batch sampled twice, or groups consumed twice"
    )
    # not checked where summary.json may lack skips: a restarted trainer's, an older run's
    restarted = {"faults": {"trainer_restarts": [{"checkpoint_version": 0}]}}
    (tmp_path / "summary.json").write_text(
        json.dumps(summary | restarted | {"skipped_updates": []})
    )
    assert "groups trained, max per version" not in audit_run(tmp_path).figures
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert "groups trained, max per version" not in audit_run(tmp_path).figures


def test_the_audits_log_bound_figure_is_of_the_unfinished_requests_alone(tmp_path):
    """faults.flush_s bounds what an unfinished request has unlogged. A finished
    trajectory rescored after its rollout's loss last logged as it finished and then
    waited for its reward: its 23 s went into "since last log, max (s)", which read as
    the bound broken. The figure is now of the resumed (unfinished) requests alone."""
    from storage.audit import audit_run

    _store(tmp_path)
    summary = {"reason": "completed", "segments": 1, "faults": {"lost": {"r1": T0 + 3}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    MetricsWriter(tmp_path).append(
        "faults",
        [
            _fault("r1", T0 + 3, segment=0, max_since_flush_s=0.4),
            _fault("r1", T0 + 3, segment=0, how="rescore", requests=0, max_since_flush_s=23.5),
        ],
    )
    report = audit_run(tmp_path)
    assert report.figures["unfinished, since last log, max (s)"] == 0.4
    assert "since last log, max (s)" not in report.figures
