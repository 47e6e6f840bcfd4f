"""A buffer whose trajectory store another writer took over (a data module rebuilt while
the lost one still runs) writes nothing more, keeps what it could not write and says
so, rather than splitting each batch record by record into refusals
(storage.trajectories.TrajectoryWriter._check_epoch, laminar.buffer)."""

import asyncio

import pytest
from test_buffer import _buffer_config, _Pool, traj
from test_rebuild_accounting import _pool

from laminar.buffer import ExperienceBuffer
from storage import TrajectoryWriter
from storage.trajectories import open_trajectories


def test_a_buffer_whose_store_was_taken_over_writes_nothing_more(tmp_path):
    async def run():
        buf = ExperienceBuffer(str(tmp_path), _Pool(_pool()), _buffer_config())
        await buf.insert([traj("p00000000-0", "p00000000", 2, 0)], "r0")
        assert (await buf.sync())["written"] == 1
        newer = TrajectoryWriter(tmp_path)  # (the rebuilt data module's)
        await buf.insert([traj("p00000000-1", "p00000000", 2, 1)], "r0")
        with pytest.raises(RuntimeError, match="another writer took the store over"):
            await buf.sync()
        stats = await buf.stats()
        newer.append([traj("p00000001-0", "p00000001", 2, 0).to_record()])
        return stats  # (the lost buffer is never closed: its thread waits, a daemon)

    stats = asyncio.run(run())
    assert stats["write_refused"] == 0 and "another writer" in stats["write_error"]
    assert open_trajectories(tmp_path)["uid"].tolist() == ["p00000000-0", "p00000001-0"]
