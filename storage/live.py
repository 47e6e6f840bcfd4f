"""``RUN_DIR/driver.json``: which process drives a run while it goes.

The driver (:class:`pipelines.api.RunHandle`) writes it at the start, renews it every
:data:`LIVE_EVERY_S` and removes it at the end. Another start or resume of the directory
refuses while it is fresh, and ``laminar audit`` reads a run that has it as running, not
lost. A driver killed outright leaves it behind: stale after :data:`LIVE_STALE_S`.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

LIVE_FILE = "driver.json"
LIVE_EVERY_S = 5.0  # how often a running driver renews it
LIVE_STALE_S = 30.0  # older: the driver is gone (killed, its machine lost)


def running_driver(run_dir: str | Path) -> dict | None:
    """The driver running ``run_dir``'s run now (``{"pid", "host", "since", "seen"}``),
    or ``None`` when none renewed its ``driver.json`` within :data:`LIVE_STALE_S`.

    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> running_driver(run) is None
    True
    >>> mark_running(run, since=time.time())
    >>> running_driver(run)["pid"] == os.getpid()
    True
    """
    try:
        live = json.loads((Path(run_dir) / LIVE_FILE).read_text())
        seen = float(live["seen"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return live if time.time() - seen < LIVE_STALE_S else None


def mark_running(run_dir: str | Path, since: float) -> None:
    """Write (or renew) ``run_dir/driver.json``: this process drives the run."""
    path = Path(run_dir)
    live = {"pid": os.getpid(), "host": socket.gethostname(), "since": since, "seen": time.time()}
    tmp = path / f".{LIVE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(live))
    tmp.replace(path / LIVE_FILE)  # (atomic: a reader never sees half of it)
