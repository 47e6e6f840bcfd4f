"""The buffer's writes to the trajectory store when the disk or the store refuses one.

The disk's faults (ENOSPC, a lost mount) are injected into the real writer's append; the
store, the buffer and the prompt pool are the real ones."""

import asyncio
import errno
import time

import pytest
from test_buffer import _buffer_config, _Pool, _pool, traj

from laminar.buffer import ExperienceBuffer
from storage.trajectories import TrajectoryWriter, open_trajectories


def _generate(pool, n=1, version=0):
    return [
        traj(f"{g.prompt_uid}-{i}", g.prompt_uid, 2, i, version, reward=float(i))
        for g in pool.acquire(n, "r0", version)
        for i in range(2)
    ]


class _Disk:
    """The real writer's append behind a disk that is full while ``full`` (or for its
    first ``full_for`` writes)."""

    def __init__(self, monkeypatch, full=False, full_for=0):
        self.full, self.full_for, self.calls = full, full_for, []
        real = TrajectoryWriter.append

        def append(writer, records, events=()):
            self.calls.append((len(records), len(events)))
            if self.full or len(self.calls) <= self.full_for:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(writer, records, events)

        monkeypatch.setattr(TrajectoryWriter, "append", append)


async def _until(predicate, timeout=10.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_refused_batch_is_written_by_sync_once_the_disk_takes_writes(tmp_path, monkeypatch):
    """A batch the disk refused was only tried again with the next batch: with nothing
    new pending, sync() kept raising the old error after the disk had recovered (and the
    trainer wrote no checkpoint). sync() now tries it again by itself."""
    disk = _Disk(monkeypatch, full=True)
    pool = _pool(5, max_outstanding=4)

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), _buffer_config(flush_records=1))
        await buf.insert(_generate(pool))
        with pytest.raises(RuntimeError, match="No space left on device"):
            await buf.sync()
        disk.full = False
        assert (await buf.sync())["written"] == 2  # nothing new: the refused batch alone
        assert (await buf.stats())["write_error"] is None
        await buf.close()

    asyncio.run(run())
    assert sorted(open_trajectories(tmp_path)["uid"].tolist()) == [
        "p00000000-0",
        "p00000000-1",
    ]


def test_close_writes_a_batch_the_disk_refused_with_nothing_after_it(tmp_path, monkeypatch):
    """The disk refused the last batch and nothing came after it: close() stopped the
    writer thread, which dropped the batch (the store stayed empty). The stop now tries
    it again, a few times, before the thread ends."""
    disk = _Disk(monkeypatch, full_for=1)
    pool = _pool(5, max_outstanding=4)

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), _buffer_config(flush_records=1))
        batch = _generate(pool)
        await buf.insert(batch)
        await _until(lambda: buf._write_error is not None)  # the first write failed
        return batch, await buf.close()

    batch, stats = asyncio.run(run())
    assert stats["write_error"] is None and stats["written"] == 2
    assert open_trajectories(tmp_path)["uid"].tolist() == [t.uid for t in batch]
    assert disk.calls == [(2, 0), (2, 0)]


def test_a_record_the_store_refuses_costs_only_itself_and_sync_reports_it(tmp_path, caplog):
    """A batch the store refused as such (not the disk) was dropped whole: with the one
    record it could not take went its siblings and the consumed events of a group stored
    earlier (the store showed it ``buffered``: a resume trained it again), and the next
    good batch cleared the error. Now the rest of the batch is written (the consumed
    events too) and the refused record is logged by uid and counted; sync() passes: a
    record lost is a trajectory the store lacks, as if never generated, and the store
    still records everything the trainer consumed."""
    import numpy as np

    pool = _pool(5, max_outstanding=4)
    cfg = _buffer_config(flush_records=10_000, flush_interval_s=1e9)

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), cfg)
        await buf.insert(_generate(pool))  # p0
        assert (await buf.sync())["written"] == 2
        assert [t.uid for t in await buf.sample(1, 0)] == ["p00000000-0", "p00000000-1"]
        bad, good = _generate(pool)  # p1: a loss mask of -1 fits no uint8
        bad.loss_mask = np.array([-1, 1])
        await buf.insert([bad, good])  # pending with p0's consumed events: one batch
        for _ in range(2):  # (the second after a good batch)
            assert (await buf.sync())["written"] == 3 + 2 * _
            await buf.insert(_generate(pool))  # p2, p3
        stats = await buf.close()
        assert stats["write_refused"] == 1 and "p00000001-0" in stats["write_error"]

    asyncio.run(run())
    stored = open_trajectories(tmp_path)
    status = dict(zip(stored["uid"].tolist(), stored["status"].tolist(), strict=True))
    assert status == {
        "p00000000-0": "consumed",
        "p00000000-1": "consumed",
        "p00000001-1": "buffered",
        **{f"p0000000{g}-{i}": "buffered" for g in (2, 3) for i in range(2)},
    }
    assert "p00000001-0" in caplog.text


def test_a_leave_event_the_store_refuses_stops_checkpoints_past_it(tmp_path, monkeypatch):
    """A consumed event the store refuses leaves it showing the trajectory buffered: a
    resume from a checkpoint past it would train it again. So every sync() after
    raises, naming it, and the trainer writes no checkpoint past the loss."""
    from storage.trajectories import TrajectoryWriter

    pool = _pool(5, max_outstanding=4)
    cfg = _buffer_config(flush_records=10_000, flush_interval_s=1e9)
    append = TrajectoryWriter.append

    def refuse_consumed(self, records, events=()):
        if any(e["status"] == "consumed" for e in events):
            raise ValueError("refused for the test")
        return append(self, records, events)

    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(pool), cfg)
        await buf.insert(_generate(pool))
        assert (await buf.sync())["written"] == 2
        await buf.sample(1, 0)
        monkeypatch.setattr(TrajectoryWriter, "append", refuse_consumed)
        for _ in range(2):
            with pytest.raises(RuntimeError, match="refused 2 leave events"):
                await buf.sync()
        stats = await buf.close()
        assert stats["write_refused"] == 2

    asyncio.run(run())
