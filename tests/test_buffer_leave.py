"""Every trajectory that leaves the experience buffer records when it left and the
trainer's version then (``t_leave``, ``leave_version``), whatever its status: a review
found evictions and filtering impossible to analyse, their events and rows without a
time or a version (``sample_version``/``t_sample`` stay a consumed trajectory's alone)."""

import asyncio
import time

import numpy as np
from test_buffer import _buffer_config, _Pool, _pool, traj

from laminar.buffer import ExperienceBuffer
from storage import open_run, open_trajectories
from storage.trajectories_read import leave_events


def test_a_real_buffer_records_when_and_at_which_version_each_trajectory_left(tmp_path):
    """Filtered, discarded and evicted at admission, evicted at a publication (from the
    store, as a leave event) and when the trainer asks for a batch, consumed, and still
    buffered at the close: each as the buffer saw it leave."""
    pool = _pool(20, max_outstanding=10)
    cfg = _buffer_config(max_train_staleness=1, dynamic_sampling=True)

    def group(version, rewards=(0.0, 1.0), reason="eos"):
        (g,) = pool.acquire(1, "r0", version)
        return [
            traj(f"{g.prompt_uid}-{i}", g.prompt_uid, 2, i, version, reason, reward=r)
            for i, r in enumerate(rewards)
        ]

    times = {}

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), cfg)
        times["start"] = time.time()
        flat, failed, old, fresh = (
            group(0, (1.0, 1.0)),
            group(0, reason="error"),
            group(0),
            group(0),
        )
        await buf.insert(flat + failed + old)  # flat: filtered; failed: discarded
        await buf.sync()  # (old is stored: its leave is an event)
        await buf.version_published(2)  # too stale to train at 2: evicted now
        times["published"] = time.time()
        await buf.insert(fresh)  # behind the published 2 by 2: evicted at admission
        late = group(1)
        await buf.insert(late)
        await buf.sync()
        batch = await buf.sample(1, 3)  # late is 2 behind the trainer's 3: evicted
        assert batch is None
        trained, kept = group(2), group(3)
        await buf.insert(trained + kept)
        times["sampled"] = time.time()
        assert [t.uid for t in await buf.sample(1, 3)] == [t.uid for t in trained]
        await buf.close()
        times["end"] = time.time()
        return {
            "filtered": flat,
            "discarded": failed,
            "evicted on publication": old,
            "evicted on admission": fresh,
            "evicted for the trainer": late,
            "consumed": trained,
            "buffered": kept,
        }

    groups = asyncio.run(run())
    ds = open_run(tmp_path)
    row = {u: i for i, u in enumerate(ds["uid"].values.tolist())}

    def left(name):
        rows = [row[t.uid] for t in groups[name]]
        return (
            ds["status"].values[rows].tolist(),
            ds["leave_version"].values[rows].tolist(),
            ds["t_leave"].values[rows],
        )

    start, end = times["start"], times["end"]
    for name, status, version in [
        ("filtered", "filtered", 0),
        ("discarded", "discarded", 0),
        ("evicted on publication", "evicted", 2),
        ("evicted on admission", "evicted", 2),
        ("evicted for the trainer", "evicted", 3),
        ("consumed", "consumed", 3),
    ]:
        statuses, versions, t = left(name)
        assert statuses == [status] * 2 and versions == [version] * 2, name
        assert ((t >= start) & (t <= end)).all(), name
    assert (left("evicted on publication")[2] <= times["published"]).all()
    assert (left("evicted for the trainer")[2] <= times["sampled"]).all()
    # consumed: the same as its sampling; buffered: not left
    consumed = ds["status"].values == "consumed"
    np.testing.assert_array_equal(ds["t_leave"].values[consumed], ds["t_sample"].values[consumed])
    np.testing.assert_array_equal(
        ds["leave_version"].values[consumed], ds["sample_version"].values[consumed]
    )
    statuses, versions, t = left("buffered")
    assert statuses == ["buffered"] * 2 and versions == [-1, -1] and np.isnan(t).all()
    # the evictions of stored trajectories are leave events that carry them
    events = leave_events(tmp_path)
    evicted = events["event_status"] == "evicted"
    assert evicted.sum() == 4  # (old's and late's: stored before they left)
    assert set(events["event_leave_version"][evicted].tolist()) == {2, 3}
    assert np.isfinite(events["event_t_leave"][evicted]).all()
    # (the contract's sample fields are unchanged: set for consumed trajectories alone)
    assert (ds["sample_version"].values[~consumed] == -1).all()
    assert np.isnan(ds["t_sample"].values[~consumed]).all()
    assert ds.laminar.audit() == []
    read = open_trajectories(tmp_path, ["t_leave", "leave_version"])
    np.testing.assert_array_equal(read["t_leave"], ds["t_leave"].values)
    np.testing.assert_array_equal(read["leave_version"], ds["leave_version"].values)
