"""Preload of the worker processes a local cluster starts (:func:`laminar.cluster.role_cluster`).

Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the driver,
and the local cluster's worker processes with it; a terminal or SSH session that drops
sends SIGHUP the same way. A worker that died of it would look lost to the driver, which
would then restart roles instead of stopping the run. The workers ignore both; the driver
stops the run (docs: exit codes) and then closes them.
"""

from __future__ import annotations

import signal
import threading


def dask_setup(worker) -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
