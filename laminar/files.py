"""Files written whole: a text replaced in one rename (:func:`replace_text`), a folder
flushed to disk before it is renamed into place (:func:`sync_tree`, :func:`sync_dir`).
Checkpoints, the warm-start cache, ``summary.json`` and a checkpoint's data position are
written this way: after a crash a name never points at a half-written file or at files
the disk has not got.

And a folder's files as written, checked when it is read back: :func:`write_manifest`
records the size and digest of each (``manifest.json``, written before the folder is
renamed into place, so it is part of the same write), :func:`check_manifest` finds a
file changed since (a flipped byte, cut short, replaced) or gone. Checkpoints are
written and read this way: a resume from damaged weights would train on, silently."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import xxhash

from laminar.errors import LaminarError


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


MANIFEST = "manifest.json"  # in a folder written whole: each file's size and digest
MANIFEST_FORMAT = 1
DIGEST = "xxh3_128"  # (xxhash: 5-8 GB/s in memory, faster than the disk that wrote it)
_CHUNK = 8 << 20


class ManifestMismatch(LaminarError):
    """The folder is not as its manifest recorded it: ``problems`` holds
    ``(path, what differs)`` of each file, or of the manifest itself when it cannot be
    read."""

    def __init__(self, problems: list[tuple[Path, str]]) -> None:
        super().__init__("; ".join(f"{str(p)!r}: {what}" for p, what in problems))
        self.problems = problems


@dataclass(frozen=True)
class ManifestCheck:
    """What :func:`check_manifest` found in a folder whose files all match: whether it
    had a manifest (``recorded``; without one nothing was checked), and the files it
    holds that the manifest does not list (``extra``: added since the write)."""

    recorded: bool
    extra: tuple[str, ...] = ()


def file_digest(path: Path) -> tuple[int, str]:
    """The size and xxh3_128 hex digest of a file, read in chunks (a big model's
    weights are not held in memory at once)."""
    h = xxhash.xxh3_128()
    buf = memoryview(bytearray(_CHUNK))
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(buf[:n])
            size += n
    return size, h.hexdigest()


def _files(folder: Path, leave_out: Collection[str]) -> list[str]:
    """Every file under ``folder`` (relative, ``/``-separated), the manifest and
    ``leave_out`` excepted."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = (Path(root) / name).relative_to(folder).as_posix()
            if rel != MANIFEST and rel not in leave_out:
                out.append(rel)
    return sorted(out)


def write_manifest(folder: Path, *, leave_out: Collection[str] = ()) -> Path:
    """Record the size and digest of every file under ``folder`` (but ``leave_out``:
    files rewritten later by design) in ``folder/manifest.json``; call it once the
    folder is complete, before it is renamed into place."""
    files = {}
    for rel in _files(folder, leave_out):
        size, digest = file_digest(folder / rel)
        files[rel] = {"size": size, DIGEST: digest}
    out = folder / MANIFEST
    out.write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1))
    return out


def _listed(path: Path) -> dict[str, tuple[int, str]]:
    """The files a manifest lists: relative path -> (size, digest). Raises
    :class:`ManifestMismatch` naming the manifest when it cannot be read."""
    try:
        manifest = json.loads(path.read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError('a JSON object with "files" expected')
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(
                f"format {manifest.get('format')!r}; this laminar reads format {MANIFEST_FORMAT}"
            )
        out = {}
        for rel, entry in manifest["files"].items():
            parts = PurePosixPath(rel).parts
            if not parts or rel.startswith("/") or ".." in parts:
                raise ValueError(f"{rel!r} is not a path inside the folder")
            size, digest = entry["size"], entry[DIGEST]
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(f"{rel!r}: size {size!r} is not a byte count")
            if not isinstance(digest, str) or len(digest) != 32:
                raise ValueError(f"{rel!r}: {DIGEST} {digest!r} is not a digest")
            out[rel] = (size, digest)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ManifestMismatch([(path, f"{type(e).__name__}: {e}")]) from None
    return out


def check_manifest(
    folder: Path,
    *,
    leave_out: Collection[str] = (),
    require: Collection[str] = (),
    only: Collection[str] | None = None,
) -> ManifestCheck:
    """Check every file ``folder/manifest.json`` lists: there, of its size, of its
    digest (each file read whole). Raises :class:`ManifestMismatch` naming each file
    that differs and how; sizes and missing files are checked first, so a file cut short
    is named without reading the rest. A manifest that does not list each of
    ``require`` (files every such folder is written with) is damaged: it would leave them
    unchecked. A folder without a manifest (written before manifests were) is
    ``ManifestCheck(recorded=False)``.

    ``only``: check just these of its files (a reader that loads part of the folder:
    a checkpoint's weights without its optimizer state, several times their size), each
    of which the manifest must list (one it does not would be read unchecked); the
    others are not looked at, and ``extra`` is then empty."""
    path = folder / MANIFEST
    if not path.exists():
        return ManifestCheck(recorded=False)
    listed = _listed(path)
    if unlisted := [rel for rel in require if rel not in listed]:
        raise ManifestMismatch(
            [(path, f"it does not list {unlisted}, written with every such folder")]
        )
    if only is not None:
        if unlisted := [rel for rel in only if rel not in listed]:
            raise ManifestMismatch(
                [
                    (folder / rel, f"{MANIFEST} does not list it: added since the write")
                    for rel in unlisted
                ]
            )
        listed = {rel: listed[rel] for rel in only}
    problems = []
    for rel, (size, _) in listed.items():
        f = folder / rel
        if not f.is_file():
            problems.append((f, f"missing: the manifest lists it ({size:,} bytes)"))
        elif (now := f.stat().st_size) != size:
            change = "cut short" if now < size else "grown"
            problems.append(
                (f, f"{now:,} bytes, written as {size:,} ({MANIFEST}): {change} or replaced since")
            )
    if problems:
        raise ManifestMismatch(problems)
    for rel, (_, digest) in listed.items():
        _, now = file_digest(folder / rel)
        if now != digest:
            problems.append(
                (
                    folder / rel,
                    f"its bytes changed since it was written: {DIGEST} {now}, written as "
                    f"{digest} ({MANIFEST})",
                )
            )
    if problems:
        raise ManifestMismatch(problems)
    if only is not None:
        return ManifestCheck(recorded=True)
    extra = tuple(rel for rel in _files(folder, leave_out) if rel not in listed)
    return ManifestCheck(recorded=True, extra=extra)
