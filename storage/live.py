"""``RUN_DIR/driver.json``: which process drives a run while it goes.

A process claims the directory before it writes there (:func:`claim`, at
``prepare_run_dir`` / ``prepare_resume``), drives the run (:class:`pipelines.api.RunHandle`
takes the claim over) and releases it at the end; while it holds the claim, the file is
renewed every :data:`LIVE_EVERY_S`. The claim is an exclusive create, so of two starts or
resumes of one directory, however close together, exactly one goes on; the other is
refused, naming the driver. ``laminar audit`` reads a run that has a live driver as
running, not lost.

A driver killed outright leaves the file behind. It counts as gone at once when it names
a process on this host that no longer exists, or one that started after the claim (its
pid reused since); another host's driver once the file is older than
:data:`LIVE_STALE_S`. A living driver on this host holds the directory however long it
has not renewed (stopped with Ctrl-Z, swapping): taken over, it went on writing there
once it ran again.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

LIVE_FILE = "driver.json"
LIVE_EVERY_S = 5.0  # how often a held claim is renewed
LIVE_STALE_S = 30.0  # older: the driver is gone (killed, its machine lost)


class RunGoing(Exception):
    """The directory is claimed by a live driver; ``live`` is its ``driver.json``."""

    def __init__(self, run_dir: Path, live: dict, here: bool = False) -> None:
        super().__init__(f"{run_dir}: driven by pid {live.get('pid')} on {live.get('host')}")
        self.run_dir, self.live, self.here = run_dir, live, here


def _pid_gone(pid: object) -> bool:
    try:
        os.kill(int(pid), 0)  # (signal 0: existence only)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, TypeError, OverflowError):
        return False  # (someone else's process, or a pid we cannot judge)
    return False


# A process that started this long after a claim's ``since`` is not the one that made it
# (its pid reused since): the start times read back are rounded (the boot time to 1 s).
STARTED_AFTER_S = 2.0


def _started_at(pid: object) -> float | None:
    """When process ``pid`` of this host started (epoch seconds), or ``None`` where that
    cannot be read (psutil missing, no such process, no access)."""
    try:
        import psutil  # (distributed's dependency)

        return float(psutil.Process(int(pid)).create_time())
    except Exception:  # noqa: BLE001 — unknown: judged by its renewals instead
        return None


def _alive(live: dict, run_dir: Path) -> bool:
    """Whether ``live`` (``run_dir``'s ``driver.json``) names a driver that still holds
    the directory: this process only if it holds a claim there now (not a directory
    moved from under it); another process on this host if it exists and is the one that
    claimed (it started before the claim's ``since``: else its pid was reused), however
    long ago it renewed (stopped with Ctrl-Z, or swapping: it goes on writing once it
    runs again); one on another host, or one whose start time cannot be read, if it
    renewed lately."""
    try:
        seen = float(live["seen"])
    except (KeyError, TypeError, ValueError):
        return False
    if live.get("host") == socket.gethostname():
        if live.get("pid") == os.getpid():
            return run_dir.resolve() in _held
        if _pid_gone(live.get("pid")):
            return False
        started = _started_at(live.get("pid"))
        try:
            since = float(live["since"])
        except (KeyError, TypeError, ValueError):
            since = None
        if started is not None and since is not None:
            return started <= since + STARTED_AFTER_S
    return time.time() - seen < LIVE_STALE_S


def _read(path: Path) -> dict | None:
    try:
        live = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return live if isinstance(live, dict) else None


def running_driver(run_dir: str | Path) -> dict | None:
    """The driver running ``run_dir``'s run now (``{"pid", "host", "since", "seen"}``),
    or ``None`` when there is none (no ``driver.json``, or one whose driver is gone).

    >>> import tempfile
    >>> run = Path(tempfile.mkdtemp())
    >>> running_driver(run) is None
    True
    >>> held = claim(run)
    >>> running_driver(run)["pid"] == os.getpid()
    True
    >>> held.release()
    >>> running_driver(run) is None
    True
    """
    live = _read(Path(run_dir) / LIVE_FILE)
    return live if live is not None and _alive(live, Path(run_dir)) else None


def check_free(run_dir: str | Path) -> None:
    """Raise :class:`RunGoing` if a driver other than an idle claim of this process's
    holds ``run_dir``: what :func:`claim` would refuse, checked without claiming."""
    path = Path(run_dir).resolve()
    with _lock:
        if _idle_claim(path) is not None:
            return
    live = running_driver(path)
    if live is not None:
        raise RunGoing(path, live)


@dataclass
class Claim:
    """This process's claim on a run directory, renewed until :meth:`release`."""

    run_dir: Path
    since: float = field(default_factory=time.time)
    driving: bool = False  # a RunHandle drives the run (a second one is refused)

    def _record(self) -> dict:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": self.since,
            "seen": time.time(),
        }

    def renew(self) -> None:
        path = self.run_dir / LIVE_FILE
        tmp = self.run_dir / f".{LIVE_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(self._record()))
        tmp.replace(path)  # (atomic: a reader never sees half of it)

    def release(self) -> None:
        """Give the directory up: another process may start or resume there now."""
        with _lock:
            if _held.get(self.run_dir) is self:
                del _held[self.run_dir]
            live = _read(self.run_dir / LIVE_FILE)
            if live is not None and live.get("pid") == os.getpid():
                (self.run_dir / LIVE_FILE).unlink(missing_ok=True)


_lock = threading.Lock()
_held: dict[Path, Claim] = {}
_renewer: threading.Thread | None = None


def claim(run_dir: str | Path) -> Claim:
    """Claim ``run_dir`` (which exists) for this process, or raise :class:`RunGoing`
    naming the live driver that holds it. A claim this process holds already is
    returned again, unless a run is being driven under it."""
    path = Path(run_dir).resolve()
    with _lock:
        held = _idle_claim(path)
        if held is not None:
            return held
        new = Claim(path)
        file = path / LIVE_FILE
        while True:
            try:
                fd = os.open(file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                _take_over_if_gone(file)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(new._record()))
            break
        _held[path] = new
        _start_renewer()
        return new


def _still_held(path: Path) -> Claim | None:
    """This process's claim on ``path``, unless another live driver's ``driver.json``
    has replaced it (taken over as stale, this process having stalled): then it is
    dropped. Called under ``_lock``."""
    held = _held.get(path)
    live = _read(path / LIVE_FILE)
    mine = live is None or (live.get("pid"), live.get("host")) == (
        os.getpid(),
        socket.gethostname(),
    )
    if held is not None and not mine and _alive(live, path):
        del _held[path]
        return None
    return held


def _idle_claim(path: Path) -> Claim | None:
    """This process's claim on ``path`` if no run is driven under it; raises
    :class:`RunGoing` if one is. Called under ``_lock``."""
    held = _still_held(path)
    if held is not None and held.driving:
        raise RunGoing(path, held._record(), here=True)
    return held


def _take_over_if_gone(file: Path) -> None:
    """Move a gone driver's ``driver.json`` aside, or raise :class:`RunGoing` for a live
    one. Of several processes that judged one stale file, one moves it; one that moved a
    fresh claim instead (made between its read and its move) puts it back."""
    judged = _read(file)
    if judged is not None and _alive(judged, file.parent):
        raise RunGoing(file.parent, judged)
    if judged is None:  # (a claim is written right after its create: give it a moment)
        try:
            if time.time() - file.stat().st_mtime < 1.0:
                time.sleep(0.05)
                return
        except FileNotFoundError:
            return
    aside = file.with_name(f".{LIVE_FILE}.gone.{os.getpid()}.{threading.get_ident()}")
    try:
        os.replace(file, aside)
    except FileNotFoundError:
        return  # (another process moved it: try the exclusive create again)
    if _read(aside) != judged:  # (a claim made meanwhile: restore it, keep trying)
        try:
            os.link(aside, file)
        except FileExistsError:
            pass
    aside.unlink(missing_ok=True)


def _start_renewer() -> None:
    global _renewer
    if _renewer is None or not _renewer.is_alive():
        _renewer = threading.Thread(target=_renew_held, name="laminar-live", daemon=True)
        _renewer.start()


def _renew_held() -> None:
    while True:
        time.sleep(LIVE_EVERY_S)
        with _lock:
            for held in list(_held.values()):
                # (a claim another live driver took over while this process stalled is
                # dropped, not renewed over theirs)
                if _still_held(held.run_dir) is not held:
                    continue
                try:
                    held.renew()
                except OSError:  # (a full or lost disk: the run says so itself)
                    pass


@atexit.register
def _release_all() -> None:
    for held in list(_held.values()):
        try:
            held.release()
        except OSError:
            pass
