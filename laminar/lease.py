"""The dispatch lease: a bound on the prompt uids a data module has handed out, on disk.

Prompt uids are dispatch positions (``p00000042``), so a data module rebuilt within the
run continues the prompt order after the highest position the store, the recovery log
and the live rollouts name. A rollout that did not answer the rebuild (hung, or slow)
may hold a group the lost pool handed out in the log's last interval, which none of
them names; had its position been handed out again, two rollouts would generate under
one uid. And the lost pool may have handed out any number of positions there: groups
that left again untrained (filtered, evicted) no longer count against the back-pressure
bound.

So before a pool hands out a position at or past its lease, it writes a new lease
``ahead`` positions further (``RUN_DIR/dispatch_lease.json``, replaced atomically), or
the one on disk where that is further (another pool's): the lease on disk never goes
back, and every position ever handed out lies below it.
A rebuild with a silent rollout starts its order at the lease (the positions between go
untrained). The pool writes once per ``ahead`` groups, so the cost is one small file
write per ``buffer.max_outstanding_groups`` groups.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from laminar.files import replace_text

logger = logging.getLogger(__name__)

LEASE_FILE = "dispatch_lease.json"


class DispatchLease:
    """The lease of one prompt pool, writing to ``run_dir``.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> lease = DispatchLease(d, ahead=16)
    >>> lease.cover(3), read_lease(d), lease.writes  # positions 0-2 to go out: to 19
    (True, 19, 1)
    >>> lease.cover(19), lease.writes, lease.cover(20), read_lease(d)  # 20 needs a write
    (True, 1, True, 36)
    """

    def __init__(self, run_dir: str | Path, ahead: int) -> None:
        if ahead < 1:
            raise ValueError(f"a lease must reach at least one position ahead, not {ahead}")
        self.path = Path(run_dir) / LEASE_FILE
        self.ahead = ahead
        self.end = read_lease(run_dir) or 0  # (a rebuilt pool starts at or past it)
        self.writes = 0
        self.failing = False  # (the last write failed)

    def cover(self, below: int) -> bool:
        """Make sure every position below ``below`` is below the lease on disk, before
        any of them is handed out. ``False`` when the lease could not be written (the
        run directory's disk full or gone: logged once a streak): hand none out until a
        later call writes it, as a store that cannot be written holds up the buffer's
        commits, rather than fail the rollout that asked."""
        if below <= self.end:
            return True
        # Never below what is on disk: a pool fenced as lost may still write, and its
        # lower lease would let the pool rebuilt in its place hand out positions again.
        end = max(below + self.ahead, read_lease(self.path.parent) or 0)
        try:  # (whole or not at all, on disk before the name; a failed write leaves no temp)
            replace_text(self.path, json.dumps({"dispatched_below": end}))
        except OSError as e:
            if not self.failing:
                logger.warning(
                    "the dispatch lease %s cannot be written (%r): no prompt group is "
                    "handed out until it can (check the run directory's disk)",
                    self.path,
                    e,
                )
            self.failing = True
            return False
        if self.failing:
            logger.warning("the dispatch lease %s is written again", self.path)
        self.end, self.failing = end, False
        self.writes += 1
        return True


def read_lease(run_dir: str | Path) -> int | None:
    """The lease on disk in ``run_dir``: no position at or past it was handed out.
    ``None`` when there is none (no group went out, or a run of a laminar before the
    lease) or it cannot be read (logged: the caller falls back on its own bound), as
    when it holds anything but a count (``Infinity``, ``-1``, ``2.5``: damaged)."""
    path = Path(run_dir) / LEASE_FILE
    try:
        below = json.loads(path.read_text())["dispatched_below"]
        # (an int, as the pool writes it: int() of Infinity raised OverflowError, and
        # of 2.5 or true made a count of what is none)
        if not isinstance(below, int) or isinstance(below, bool) or below < 0:
            raise ValueError(f"dispatched_below is {below!r}, not a count of positions")
        return below
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        logger.warning("the dispatch lease %s cannot be read (%r); ignored", path, e)
        return None
