"""Files written whole: a text replaced in one rename (:func:`replace_text`), a folder
flushed to disk before it is renamed into place (:func:`sync_tree`, :func:`sync_dir`).
Checkpoints, the warm-start cache, ``summary.json`` and a checkpoint's data position are
written this way: after a crash a name never points at a half-written file or at files
the disk has not got."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


def replace_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a reader never sees half of it, nor, after a
    crash, an empty file: the text reaches the disk before the rename)."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        # (mkstemp makes it 0600: the mode of the file it replaces, else a new file's)
        os.fchmod(fd, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` sets it, racing with
    threads that create files meanwhile); 0o022 where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def sync_tree(path: Path) -> None:
    """Flush every file under the folder ``path``, and the folders themselves, to disk:
    before the folder is renamed into place, so that after a crash (power, a node lost)
    the name never points at files the disk has not got."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        sync_dir(Path(root))


def sync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename into it, a file created) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
