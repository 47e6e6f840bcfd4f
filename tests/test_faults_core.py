"""Faults of the trainer and the data module on real worker processes: a lost trainer
that fails the run (and its resume in place), a trainer restarted within the run, the
trainer and data module lost together, a data-parallel rank, a data module rebuilt.
Apart from tests/test_faults.py (rollouts, relays, the driver) so that a parallel run
(`pytest -n 2 --dist loadfile`) gives the two halves to two workers: together they were
the suite's longest file by far.

Each test ends with an audit from the stores alone."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL_RUN
from runs import check_store, laminar_cli
from test_faults import POLL_S, apart_run, logged_tokens, rollout_threads, until_decoding, wait_for

from storage import open_run
from storage.audit import audit_run
from storage.metrics import open_metrics
from storage.partial_log import log_entries

pytestmark = pytest.mark.slow


def test_a_lost_trainer_fails_the_run_clearly_and_it_resumes_in_place(tmp_path):
    """With faults.restart_trainer off, trainer loss is not recovered within the run
    (docs/faults.md): the run ends at once with an error that names what was lost, why
    it is not restarted and how to continue, and stops the rollouts; nothing hangs.
    `laminar run --resume` then continues it in its own directory from its periodic
    checkpoint: the updates after it are redone on the groups they had consumed, and
    every version is trained on exactly one batch of whole groups."""
    from distributed import Client

    import pipelines
    from laminar.cluster import local_cluster, workers_with
    from laminar.errors import LaminarError

    run_dir = tmp_path / "run"
    with local_cluster(2, memory_limit="3GiB") as cluster, Client(cluster) as client:
        handle = pipelines.submit(
            "configs/tiny.yaml",
            client,
            overrides=[
                *SMALL_RUN,
                "trainer.steps=40",
                "trainer.checkpoint_every=2",
                "cluster.actor_timeout_s=10",
                "relay.timeout_s=10",  # the master relay dies with the trainer
                "buffer.flush_interval_s=0.5",
                "faults.restart_trainer=false",  # (on, it restarts in the run: below)
            ],
            run_dir=run_dir,
        )
        wait_for(handle, lambda p: p.get("phase") == "training" and p["version"] >= 3)
        # The first three updates' batches stored as consumed (flushed every 0.5 s): the
        # store must hold them after the loss (below), whatever a loaded host's writes take.
        deadline = time.time() + 60
        while (open_run(run_dir)["status"].values == "consumed").sum() < 3 * 4 * 4:
            assert time.time() < deadline, "the first updates' batches were never stored"
            time.sleep(0.25)
        trainer_w = workers_with(client, "trainer")[0]
        pid = client.run(os.getpid, workers=[trainer_w])[trainer_w]
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(LaminarError) as failed:
            handle.wait(timeout=120)
        assert time.time() - t_kill < 30
        # The rollouts were told to stop; one waiting on the lost data module or master
        # relay gives up after cluster.actor_timeout_s or relay.timeout_s (10 s here).
        # The relays they pulled from were closed after them.
        deadline = time.time() + 30
        while left := rollout_threads(client):
            assert time.time() < deadline, f"{left} still run after the run failed"
            time.sleep(0.5)
    ckpt = sorted((run_dir / "checkpoints").glob("version-*"))[-1]
    assert "lost the trainer and data module (worker" in str(failed.value)
    assert "(faults.restart_trainer or faults.restart_data is off)" in str(failed.value)
    assert f"({ckpt.name}) with `laminar run --resume {run_dir}`" in str(failed.value)
    # The driver failed: summary.json says so, with what the stores hold
    failed_summary = json.loads((run_dir / "summary.json").read_text())
    assert failed_summary["reason"].startswith("failed: ") and failed_summary["driver_failed"]
    assert "lost the trainer" in failed_summary["reason"]
    assert failed_summary["versions"] >= 3 and failed_summary["consumed"] >= 3 * 4 * 4
    # (its wall time, from the rows the driver kept: the report and benches read it)
    assert failed_summary["segments"] == 1 and failed_summary["rl_wall_s"] > 0
    # What only the lost trainer's process held (its history, the master relay's
    # publications) was copied every poll and written as the run failed, where none of
    # the publications were kept. (Versions 1 and 2 were done when a poll saw 3.)
    updates = open_metrics(run_dir, "updates")["version"].values.tolist()
    assert updates[:2] == [1, 2], updates
    first_pubs = open_metrics(run_dir, "publications")["version"].values.tolist()
    assert first_pubs[:3] == [0, 1, 2], first_pubs
    # The buffer died with the data worker, but it stored each trajectory on admission:
    # the store holds them (all but the last flush), with where each stood.
    ds = open_run(run_dir)
    consumed = ds["status"].values == "consumed"
    assert consumed.sum() >= 3 * 4 * 4  # three updates of 4 groups of 4 (SMALL_RUN)
    assert ds.laminar.audit() == []
    lost_updates = int(ds["sample_version"].max()) + 1 - int(ckpt.name.split("-")[1])
    # What was generating (or completed, not yet stored) at the loss: the recovery log on
    # disk names it, the pool being gone with the worker.
    stored = set(ds["uid"].values.tolist())
    pending = {u: e["prompt_uid"] for u, e in log_entries(run_dir).items() if u not in stored}

    version = int(ckpt.name.split("-")[1])
    proc = laminar_cli("run", "--resume", str(run_dir), "--set", f"trainer.steps={version + 3}")
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    assert f"resumed from {ckpt}" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reason"] == "completed" and summary["versions"] == version + 3
    resumed = summary["resumed"]
    assert resumed["version"] == version and resumed["consumed_before"] == version * 16
    # The groups the lost updates had consumed are back in the buffer (with any others).
    assert resumed["readmitted"] >= lost_updates * 16
    ds = check_store(run_dir)
    consumed = ds["status"].values == "consumed"
    # Every version trained on exactly one batch of whole groups; nothing twice.
    per_version = np.bincount(ds["sample_version"].values[consumed])
    assert per_version.tolist() == [16] * (version + 3)
    dropped = ds["status"].values == "dropped"
    assert dropped.sum() == resumed["dropped"]
    # The store recorded the resume: what the lost weights generated is superseded.
    assert ds.attrs["resumed_from_version"] == [version]
    lost_weights = (ds["t_finish"].values < ds.attrs["resumed_at_s"][0]) & (
        ds["behavior_version"].values > version
    )
    assert (ds.laminar.superseded().values == lost_weights).all()
    # Only groups with a sibling from lost weights (finished after the checkpoint) or a
    # failed reward are dropped; a group still generating at the loss had its missing
    # siblings re-issued and completed.
    uids, fv = ds["prompt_uid"].values, ds["finish_version"].values
    why = dropped & ((fv > version) | (ds["finish_reason"].values == "error"))
    assert set(uids[dropped]) == set(uids[why])
    # Each trajectory the log held at the loss was generated again (its uid is stored),
    # or its group dropped, or it was generating again when the resumed run ended.
    assert resumed["log_unfinished"] + resumed["log_completed"] == len(pending)
    again = set(ds["uid"].values.tolist()) | set(log_entries(run_dir))
    missed = [u for u, g in pending.items() if u not in again and g not in set(uids[dropped])]
    assert not missed, missed
    report = audit_run(run_dir)
    assert report.ok, report.text()
    # Each start's publications, its own weights first: the resumed start's checkpoint
    # version again (the lost start's row of it copied unless it was lost at once).
    pubs = open_metrics(run_dir, "publications")["version"].values.tolist()
    assert pubs[: len(first_pubs)] == first_pubs, pubs
    assert pubs[len(first_pubs)] == version, pubs
    assert pubs.count(version) == 1 + (version in first_pubs), pubs
    # One clock, two starts: the second's rows follow a gap; the wall time adds up both.
    from pipelines.report import build_report
    from storage.metrics import segments

    cluster = open_metrics(run_dir, "cluster")
    segs = segments(cluster)
    assert [s["segment"] for s in segs] == [0, 1], segs
    # The counters go on across the stop: a rate is a diff over the whole run.
    for col in ("inserted", "consumed", "response_tokens", "trainer_wait_s"):
        assert (np.diff(cluster[col].values) >= 0).all(), col
    rollouts = open_metrics(run_dir, "rollouts")
    for rid in rollouts["rollout"].values:
        for col in ("trajectories", "response_tokens", "batches"):
            counts = rollouts[col].sel(rollout=rid).values
            assert (np.diff(counts[~np.isnan(counts)]) >= 0).all(), (rid, col)
    assert segs[0]["end_s"] < segs[1]["start_s"] and segs[1]["last_version"] == version + 3
    assert summary["segments"] == 2 and summary["rl_wall_s_total"] > summary["rl_wall_s"]
    page = build_report([run_dir], tmp_path / "report").read_text()
    assert "(2 starts) |" in page


def trained_once_across_the_restart(ds, v: int, after: int, steps: int) -> None:
    """Each of the run's ``steps`` updates trained one batch of 4 whole groups (16
    trajectories); the lost updates' version numbers (``v`` .. ``after`` - 1: after the
    checkpoint, by weights that are gone) were never trained into the final weights."""
    consumed = ds["status"].values == "consumed"
    per_version = np.bincount(ds["sample_version"].values[consumed], minlength=after + steps)
    trained = [*range(v), *range(after, after + steps - v)]
    assert np.flatnonzero(per_version).tolist() == trained
    assert (per_version[trained] == 16).all()


def test_a_lost_trainer_restarts_within_the_run_while_rollouts_generate(tmp_path, monkeypatch):
    """The data module on a worker of its own, the trainer lost at version >= 3 (a
    checkpoint every 2): the run goes on without a resume. Meanwhile the rollouts keep
    generating into the buffer; the nanny brings the worker back, the buffer takes back
    the groups the lost updates had consumed, a new master relay heads the chain, and a
    new trainer continues from the checkpoint, numbering its updates after the last lost
    version. The run ends with its 12 updates, every version number used once, every
    load equal to what the trainer published, and a clean audit.

    The trainer is lost by hanging: its update blocks for good while the actor still
    answers (a hung collective). Its heartbeat stops; after faults.heartbeat_timeout_s
    the driver has the nanny restart its worker, and the trainer is lost as if killed.
    (A SIGKILL of its worker takes the same restart; it is left out to keep the suite
    short: kills are detected the same way in the shared-worker and data-parallel
    tests, and `laminar bench soak --data-apart` kills trainers every few minutes.)"""
    import asyncio

    from distributed import Nanny

    from laminar.cluster import workers_with

    RETURN_S = 4.0

    def stick_updates(dask_worker=None) -> None:
        """Make every update on this worker's trainer block for good, as a collective
        whose peer is gone does: the actor answers, its loop makes no progress. Nested,
        so that it is pickled by value: workers cannot import the test modules."""
        import threading

        from laminar.learner import Learner

        Learner.update = lambda self, batch: threading.Event().wait()

    steps = 12
    run_dir = tmp_path / "run"
    overrides = [
        f"trainer.steps={steps}",
        "trainer.checkpoint_every=2",
        "relay.audit_weights=true",
        "buffer.flush_interval_s=0.5",
        # Generation-bound (paced as GPU replicas, as in `laminar bench soak`): unpaced,
        # the tiny policy generates far faster than it trains, the buffer is full at the
        # kill, and back-pressure alone holds the rollouts.
        "rollout.pacing.dilation=15",
        "faults.heartbeat_timeout_s=5",
    ]
    with apart_run(run_dir, overrides) as (client, handle):
        wait_for(handle, lambda p: p.get("phase") == "training" and p["version"] >= 3)
        # The kill comes while a rollout is decoding: with the buffer already full of
        # finished groups (a loaded machine slows the trainer more than the paced
        # rollouts), there would be nothing to generate while the trainer is gone.
        until_decoding(handle)
        trainer_w = workers_with(client, "trainer")[0]
        # Its worker comes back RETURN_S after the restart, as a lost node's would (a
        # forked local worker is back in ~0.3 s): meanwhile the master relay is gone and
        # the rollouts' batch boundaries meet it unreachable. (Nannies run here, in this
        # process; the trainer's is the only one that restarts.)
        instantiate = Nanny.instantiate

        async def slow_return(nanny):
            await asyncio.sleep(RETURN_S)
            return await instantiate(nanny)

        monkeypatch.setattr(Nanny, "instantiate", slow_return)
        t_kill = time.time()
        client.run(stick_updates, workers=[trainer_w])
        summary = handle.wait(timeout=300)
    assert summary["reason"] == "completed"
    (r,) = summary["faults"]["trainer_restarts"]
    hung = r["hung"]  # the next update stuck; silent past the timeout, then fenced
    assert hung["role"] == "trainer" and hung["worker"] == trainer_w, r
    assert 5 < hung["silent_s"] < 5 + 3 and hung["restart"] == "OK", r
    assert 5 < hung["time"] - t_kill < 60 and 0 <= r["time"] - hung["time"] < 15, r
    v, after = r["checkpoint_version"], r["after_version"]
    assert v % 2 == 0 and after >= 3 and after - v == r["lost_updates"] >= 0
    assert r["restart_s"] < 60 and r["worker"] != trainer_w
    # The lost updates' groups came back (and the batch in training at the kill, if any).
    assert r["readmitted"] % 16 == 0 and r["readmitted"] >= 16 * r["lost_updates"]
    assert summary["versions"] == steps + after - v  # (the lost updates' numbers skipped)
    assert summary["updates"] == steps  # ... and as many updates made as asked for
    (m,) = summary["faults"]["masters_replaced"]
    assert sorted(m["rollouts"]) == ["r0", "r1"] and m["errors"] == []
    ds = check_store(run_dir)
    trained_once_across_the_restart(ds, v, after, steps)
    # The rollouts went on generating while no trainer ran, up to the back-pressure
    # bound (this trainer-bound run is at it by the kill), never waiting on the lost
    # master: a batch boundary whose relay is unreachable keeps the weights it has.
    # (from the stuck update to the new trainer: r["time"] is when the driver found the
    # trainer lost, a heartbeat timeout after the kill; r["restart_s"] runs from there)
    t_back = r["time"] + r["restart_s"]
    rows = open_metrics(run_dir, "cluster")
    wall = rows["wall_time"].values.astype("datetime64[ns]").astype(np.int64) / 1e9
    down = (wall > t_kill) & (wall < t_back)
    assert down.sum() >= 5
    tokens = rows["response_tokens"].values
    assert tokens[down][-1] > tokens[wall <= t_kill][-1]
    # (cumulative across the restart: the new trainer's wait adds to the lost one's)
    for col in ("response_tokens", "inserted", "trainer_wait_s"):
        assert (np.diff(rows[col].values) >= 0).all(), col
    # The groups the lost updates consumed are held again, and out again: the count may
    # pass the bound by them once (the pool then hands out none until it is back under)
    held_again = summary["pool"]["held_again"]
    assert held_again == r["readmitted"] // 4  # (groups of 4: SMALL_RUN)
    # (at the bound while no trainer ran; the last row before the restart's end may come
    # after the new trainer's buffer held the lost updates' groups again: a loaded host)
    assert rows["outstanding_groups"].values[down][-1] in (16, 16 + held_again)
    assert rows["outstanding_groups"].values.max() <= 16 + held_again
    rollouts = summary["rollouts"]
    assert sum(s["pulls_unreachable"] for s in rollouts) >= 1
    assert max(s["weight_wait_s"] for s in rollouts) < 4.0
    # Every version number was published once, in order; every load checked out.
    pubs = open_metrics(run_dir, "publications")["version"].values.tolist()
    assert pubs == sorted(set(pubs)) and pubs[-1] == after + steps - v
    fp = summary["relay"]["fingerprints"]
    assert fp["loads_checked"] > 0 and fp["mismatched"] == 0
    # (Loads of versions the lost trainer published after the driver's last copy of its
    # fingerprints, every few seconds, cannot be checked: at most the last few.)
    assert fp["unverified"] <= 2 * r["lost_updates"] + 2
    report = audit_run(run_dir)
    assert report.ok, report.text()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_lost_trainer_and_data_module_on_one_worker_restart_within_the_run(tmp_path, sig):
    """The local default: the trainer and the data module share a worker, SIGKILLed at
    version >= 3 (a checkpoint every 2) while a rollout decodes, with 2 s of admissions
    and consumptions the store had not committed. Both restart within the run: the
    nanny brings the worker back, a new master relay heads the chain, the data module is
    rebuilt from the store with the checkpoint standing in for the lost trainer's record
    (every group consumed after it is held again), the rollouts register what they
    decode and resend what the store lacked, and a new trainer continues from the
    checkpoint after the newest version anything saw. The run ends with its 12 updates,
    every version number published once, each update's batch trained once, every load
    equal to what was published, and a clean audit.

    SIGSTOP: the worker hangs (the scheduler still has it). After
    faults.heartbeat_timeout_s without an answer the driver has the nanny restart it,
    and then restarts both like a killed one."""
    from laminar.cluster import workers_with

    hung = sig == signal.SIGSTOP
    steps = 12
    run_dir = tmp_path / "run"
    overrides = [
        f"trainer.steps={steps}",
        "trainer.checkpoint_every=2",
        "relay.audit_weights=true",
        "buffer.flush_interval_s=2",
        "rollout.pacing.dilation=15",  # generation-bound (as the trainer-restart test)
        *(["faults.heartbeat_timeout_s=3"] if hung else []),
    ]
    with apart_run(run_dir, overrides, data_apart=False) as (client, handle):
        wait_for(handle, lambda p: p.get("phase") == "training" and p["version"] >= 3)
        until_decoding(handle)
        core_w = workers_with(client, "trainer")[0]
        assert workers_with(client, "data") == [core_w]
        pid = client.run(os.getpid, workers=[core_w])[core_w]
        t_kill = time.time()
        os.kill(pid, sig)
        summary = handle.wait(timeout=300)
    assert summary["reason"] == "completed", summary["reason"]
    faults = summary["faults"]
    assert faults["trainer_restarts"] == [] and faults["data_restarts"] == []
    (r,) = faults["core_restarts"]
    assert r["lost_worker"] == core_w and r["worker"] != core_w, r
    if hung:  # silent for the timeout (its last answer came at most a poll before)
        assert r["hung"]["silent_s"] == 3 and r["hung"]["worker"] == core_w, r
        assert 3 - POLL_S <= r["hung"]["time"] - t_kill < 3 + 5, r
        assert 0 <= r["time"] - r["hung"]["time"] < 15, r
    else:
        assert 0 <= r["time"] - t_kill < 10, r
    v, after = r["checkpoint_version"], r["after_version"]
    assert v % 2 == 0 and after >= 3 and after - v == r["lost_updates"] >= 0, r
    assert r["restart_s"] < 60 and r["rollouts_attached"] == 2, r
    assert summary["versions"] == steps + after - v  # (the lost updates' numbers skipped)
    assert summary["updates"] == steps  # ... and as many updates made as asked for
    (m,) = faults["masters_replaced"]
    assert sorted(m["rollouts"]) == ["r0", "r1"] and m["errors"] == [], m
    rollouts = summary["rollouts"]
    assert [s["data_rebuilds"] for s in rollouts] == [1, 1]
    ds = check_store(run_dir)
    # Nothing a rollout finished is lost or stored twice (check_store: uids unique).
    assert ds.sizes["trajectory"] == sum(s["trajectories"] for s in rollouts)
    trained_once_across_the_restart(ds, v, after, steps)
    # Every version number was published once, in order; every load checked out.
    pubs = open_metrics(run_dir, "publications")["version"].values.tolist()
    assert pubs == sorted(set(pubs)) and pubs[-1] == after + steps - v
    fp = summary["relay"]["fingerprints"]
    assert fp["loads_checked"] > 0 and fp["mismatched"] == 0, fp
    # The rollouts went on decoding while neither ran, within the back-pressure bound.
    rows = open_metrics(run_dir, "cluster")
    wall = rows["wall_time"].values.astype("datetime64[ns]").astype(np.int64) / 1e9
    assert rows["outstanding_groups"].values.max() <= 16
    before = rows["response_tokens"].values[wall <= t_kill][-1]
    assert rows["response_tokens"].values[wall > r["time"] + r["restart_s"]][0] > before
    report = audit_run(run_dir)
    assert report.ok, report.text()


@pytest.mark.parametrize("data_apart", [True, False], ids=["trainer", "with-data-module"])
def test_a_trainer_lost_after_its_final_checkpoint_ends_the_run_completed(tmp_path, data_apart):
    """The trainer's worker dies right after the trainer wrote the run's final checkpoint,
    before the driver saw it done. The restart finds nothing left to train, so no
    trainer starts again (one used to be started, refuse the checkpoint with "nothing
    left to train", and fail the run). The run ends as completed with all its updates;
    where the data module shared the lost worker it is rebuilt first, so that the store
    still closes in order."""
    from laminar.cluster import workers_with

    def die_after_the_final_checkpoint(dask_worker=None) -> None:
        """SIGKILL this worker once its trainer has saved the final version. Nested, so
        that it is pickled by value: workers cannot import the test modules."""
        import os
        import signal

        from laminar.trainer import Trainer

        save = Trainer._save_checkpoint

        def save_then_die(self):
            out = save(self)
            if self.version >= self.steps and out is not None:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        Trainer._save_checkpoint = save_then_die

    steps = 4
    run_dir = tmp_path / "run"
    overrides = [f"trainer.steps={steps}", "trainer.checkpoint_every=2"]
    with apart_run(run_dir, overrides, data_apart=data_apart) as (client, handle):
        trainer_w = workers_with(client, "trainer")[0]
        client.run(die_after_the_final_checkpoint, workers=[trainer_w])
        summary = handle.wait(timeout=300)
    assert summary["reason"] == "completed", summary["reason"]
    faults = summary["faults"]
    kind = "trainer_restarts" if data_apart else "core_restarts"
    (r,) = faults[kind]
    assert all(faults[k] == [] for k in ("trainer_restarts", "core_restarts") if k != kind)
    assert r["finished"] is True and r["lost_worker"] == trainer_w, r
    assert r["checkpoint_version"] == r["after_version"] == steps and r["lost_updates"] == 0
    if not data_apart:  # (the store's module came back on another worker)
        assert r["worker"] != trainer_w and r["rollouts_attached"] == 2, r
    assert summary["versions"] == summary["updates"] == steps
    assert Path(r["checkpoint"]).name == f"version-{steps:06d}"
    assert (Path(r["checkpoint"]) / "data_state.json").exists()
    ds = check_store(run_dir, expect_consumed_groups=4 * steps)  # (SMALL_RUN's batches)
    assert int(ds["behavior_version"].max()) <= steps
    report = audit_run(run_dir)
    assert report.ok, report.text()


def test_a_lost_rank_restarts_the_data_parallel_trainer_within_the_run(tmp_path):
    """trainer.ranks=2, rank 0 sharing its worker with the data module (the local
    default). Rank 1's worker is SIGKILLed at version >= 3: the group is broken (every
    collective with rank 1 fails), so the driver fences rank 0's worker too, and then
    restarts the whole group within the run with the data module (CoreRestart): two new
    ranks from the checkpoint, in a new rendezvous. The run ends with its 8 updates,
    each batch trained once, both ranks with the same weights, every load equal to what
    was published, and a clean audit."""
    from laminar.cluster import workers_with

    steps = 8
    run_dir = tmp_path / "run"
    overrides = [
        "trainer.ranks=2",
        f"trainer.steps={steps}",
        "trainer.checkpoint_every=2",
        "relay.audit_weights=true",
        "buffer.flush_interval_s=1",
        "rollout.pacing.dilation=15",
    ]
    with apart_run(run_dir, overrides, data_apart=False, ranks=2) as (client, handle):
        wait_for(handle, lambda p: p.get("phase") == "training" and p["version"] >= 3)
        head_w = workers_with(client, "data")[0]
        (rank1_w,) = [w for w in workers_with(client, "trainer") if w != head_w]
        pid = client.run(os.getpid, workers=[rank1_w])[rank1_w]
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        summary = handle.wait(timeout=300)
    assert summary["reason"] == "completed", summary["reason"]
    (r,) = summary["faults"]["core_restarts"]
    # Rank 0's worker was fenced for the lost rank, then both restarted elsewhere.
    assert r["lost_worker"] == head_w and "lost a rank" in r["hung"]["why"], r
    assert 0 <= r["hung"]["time"] - t_kill < 10, r
    assert r["worker"] not in (head_w, rank1_w) and len(r["rank_workers"]) == 1, r
    assert r["rank_workers"][0] not in (head_w, rank1_w, r["worker"]), r
    v, after = r["checkpoint_version"], r["after_version"]
    assert v % 2 == 0 and after - v == r["lost_updates"] >= 0 and r["restart_s"] < 90, r
    assert summary["versions"] == steps + after - v  # (the lost updates' numbers skipped)
    assert summary["updates"] == steps  # ... and as many updates made as asked for
    sums = summary["weights_checksums"]
    assert len(sums) == 2 and sums[0] == sums[1]
    ds = check_store(run_dir)
    trained_once_across_the_restart(ds, v, after, steps)
    fp = summary["relay"]["fingerprints"]
    assert fp["loads_checked"] > 0 and fp["mismatched"] == 0, fp
    report = audit_run(run_dir)
    assert report.ok, report.text()


@pytest.mark.parametrize("r1_sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_lost_data_module_is_rebuilt_within_the_run(tmp_path, r1_sig):
    """The data module on a worker of its own, SIGKILLed with trajectories admitted and
    consumed that its store had not yet committed (a 4 s flush interval), and with it
    the worker of rollout r1 while r1 decodes. The trainer and r0 run on: the nanny
    brings the workers back, a new buffer, prompt pool, partial-response pool and
    manager start from the store, the trainer's record and what r0 holds; r0 sends what
    the lost store lacked. r1's unfinished trajectories were in the lost pool: the
    rebuild reads them from its log on disk (RUN_DIR/partial.zarr), and the new manager
    finds r1 lost, resumes them on r0 and replaces r1. The run makes its 6 updates with
    no version lost: nothing is stored twice, each update trained one batch of 4 whole
    groups, and the audit is clean.

    ``hung``: r1 is SIGSTOPped instead, so the rebuild finds it live but silent (it
    cannot say which groups it holds). Its groups are resumed from the log all the same,
    none handed out again (they used to be re-issued whole beside r1's copies, and r1's
    own work, never registered with the new pool, was not recovered when the new
    manager fenced it).

    (A hung data module is detected and fenced the same way in either layout: the
    SIGSTOP case is test_a_lost_trainer_and_data_module_on_one_worker_...[hung].)"""
    from laminar.cluster import workers_with

    steps = 6
    run_dir = tmp_path / "run"
    hung = r1_sig == signal.SIGSTOP
    overrides = [
        f"trainer.steps={steps}",
        "buffer.flush_interval_s=4",
        # generation-bound, and slow enough (a batch lasts ~13 s) that r1's batch is
        # still decoding at the kill and r0's may still decode when the new data module
        # is there (~5-10 s later: most of it the new process's imports)
        "rollout.pacing.dilation=160",
    ]
    if hung:  # (the rebuild asks r1 and attaches it within the actor timeout, each)
        overrides += ["faults.heartbeat_timeout_s=3", "cluster.actor_timeout_s=10"]
    with apart_run(run_dir, overrides) as (client, handle):
        wait_for(handle, lambda p: p.get("phase") == "training" and p["version"] >= 2)
        partial = handle._schedule.actors["partial"]
        data_w = workers_with(client, "data")[0]
        victim_w = handle._schedule.rollout_workers["r1"]
        pids = client.run(os.getpid, workers=[data_w, victim_w])
        deadline = time.time() + 120
        while not logged_tokens(partial.owned().result().get("r1", (0, 0, 0))):
            assert time.time() < deadline and not handle.done(), "r1 never decoded"
            time.sleep(0.05)
        time.sleep(2.5)  # a log interval (faults.log_interval_s): r1's entries are on disk
        t_kill = time.time()
        os.kill(pids[victim_w], r1_sig)
        os.kill(pids[data_w], signal.SIGKILL)
        summary = handle.wait(timeout=300)
    assert summary["reason"] == "completed", summary["reason"]
    (r,) = summary["faults"]["data_restarts"]
    assert r["lost_worker"] == data_w and r["worker"] != data_w
    assert 0 <= r["time"] - t_kill < 10, r
    # (A batch still decoding at the attach is registered anew with the new pool, here
    # when the rebuild beats it: tests/test_partial.py checks what is registered.)
    assert r["restart_s"] < 60 and r["rollouts_attached"] == 1, r
    assert (r["rollouts_gone"], r["rollouts_silent"]) == (([], ["r1"]) if hung else (["r1"], []))
    assert r["restored_from_log"] > 0 and r["reissued_groups"] == 0, r
    # A silent rollout may hold groups no log names: the order starts past every
    # position the lost pool handed out (its lease on disk), none handed out again.
    if hung:
        assert r["dispatch_lease"] > 0 and r["prompt_start"] >= r["dispatch_lease"], r
    else:
        assert r["dispatch_lease"] is None and r["prompt_gap"] == 0, r
    faults = summary["faults"]
    assert "r1" in faults["lost"] and faults["recovered_requests"] > 0, faults
    assert "r1" in faults["replacements"], faults
    assert ("r1" in faults["hung"]) == hung, faults
    assert summary["versions"] == summary["updates"] == steps
    rollouts = {s["rollout_id"]: s for s in summary["rollouts"]}
    assert rollouts["r0"]["data_rebuilds"] == 1
    ds = check_store(run_dir, moved=True)  # (uids unique: nothing stored twice)
    # What the lost store lacked came back: sent again by r0, or written as consumed
    # from the trainer's record (4 s of admissions at the kill).
    assert rollouts["r0"]["resent"] + r["marked_consumed"] > 0, r
    consumed = ds["status"].values == "consumed"
    per_version = np.bincount(ds["sample_version"].values[consumed], minlength=steps)
    assert per_version.tolist() == [16] * steps
    # r0 went on decoding while no data module ran.
    rows = open_metrics(run_dir, "cluster")
    wall = rows["wall_time"].values.astype("datetime64[ns]").astype(np.int64) / 1e9
    assert rows["outstanding_groups"].values.max() <= 16
    assert rollouts["r0"]["data_wait_s"] < r["restart_s"] + 5
    # (the rollouts table shares the cluster table's time axis)
    # (its decode steps: response_tokens counts finished responses, and at ~0.6 s a step
    # none need finish in the outage; a loaded host's suite saw that once)
    steps_r0 = open_metrics(run_dir, "rollouts")["decode_steps"].sel(rollout="r0").values
    assert steps_r0[wall > r["time"] + r["restart_s"]][0] > steps_r0[wall <= t_kill][-1]
    report = audit_run(run_dir)
    assert report.ok, report.text()
