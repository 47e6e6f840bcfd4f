"""The dispatch lease's file (laminar/lease.py): a write that fails leaves nothing behind,
and a damaged lease is ignored, not a crash. (The pool's use of it:
tests/test_prompt_pool.py.)"""

from __future__ import annotations

import logging
import os

import pytest

from laminar.lease import LEASE_FILE, DispatchLease, read_lease


def test_a_lease_write_that_fails_leaves_no_temporary_file(tmp_path):
    """The write went to ``.dispatch_lease.json.tmp`` and then renamed it; where the
    rename failed (here the lease's name is taken by a folder) the temporary file stayed
    in the run directory. Now it is removed, and a later write succeeds."""
    lease = DispatchLease(tmp_path, ahead=4)
    (tmp_path / LEASE_FILE).mkdir()
    assert lease.cover(3) is False and lease.failing
    assert os.listdir(tmp_path) == [LEASE_FILE]
    (tmp_path / LEASE_FILE).rmdir()
    assert lease.cover(3) is True and not lease.failing
    assert read_lease(tmp_path) == 7 and os.listdir(tmp_path) == [LEASE_FILE]


@pytest.mark.parametrize(
    "text",
    [
        '{"dispatched_below": Infinity}',
        '{"dispatched_below": -Infinity}',
        '{"dispatched_below": 1e999}',
        '{"dispatched_below": NaN}',
        '{"dispatched_below": -1}',
        '{"dispatched_below": 2.5}',
        '{"dispatched_below": true}',
        '{"dispatched_below": "12"}',
    ],
)
def test_a_lease_that_holds_no_count_is_damaged_and_ignored(tmp_path, caplog, text):
    """``int(Infinity)`` raised OverflowError, which escaped the damaged-lease branch (a
    rebuilt data module failed to start); 2.5 or ``true`` read as a count. Each is a
    damaged lease: ignored with a warning, as one that is not JSON."""
    (tmp_path / LEASE_FILE).write_text(text)
    with caplog.at_level(logging.WARNING, logger="laminar"):
        assert read_lease(tmp_path) is None
        assert DispatchLease(tmp_path, ahead=4).end == 0
    assert "cannot be read" in caplog.text


def test_the_lease_on_disk_never_goes_back(tmp_path):
    """A pool fenced as lost may still run and write its lease; the pool rebuilt in its
    place wrote a higher one, and the old pool's lower write took it back below positions
    the new pool had handed out (a later rebuild would hand them out again). A write
    keeps what is on disk where that is further."""
    old = DispatchLease(tmp_path, ahead=16)
    assert old.cover(3) and read_lease(tmp_path) == 19
    new = DispatchLease(tmp_path, ahead=16)  # the rebuilt pool starts at the lease
    assert new.cover(100) and read_lease(tmp_path) == 116
    assert old.cover(20) and read_lease(tmp_path) == 116  # (it wrote 36)
    assert new.cover(117) and read_lease(tmp_path) == 133
