"""The trainer's publications and checkpoints: each trained version sent to the rollouts
and written to disk.

:class:`PublicationMixin` of :class:`laminar.trainer.Trainer`: each update published in
the order that keeps trajectories' versions sound (the buffer hears of the version first;
with ``interrupt`` every rollout is stopped first, through the manager); the weights handed
to the master relay (:meth:`~PublicationMixin.publish`; paced, held to the modelled cost
of the schedule's way of moving weights) and their fingerprints (``relay.audit_weights``);
the checkpoints, written aside and renamed into place, only once the buffer committed its
store and only for weights that are exactly their version's. Each checkpoint keeps the
rows of ``metrics.zarr``'s ``updates`` and ``publications`` tables of the versions up to
its own (:data:`CHECKPOINT_ROWS`): only this process holds them until the driver copies
them, and a driver lost (or aborted) before it wrote them lost them for good, the resume
starting after them; a resume writes back those its table lacks
(:func:`pipelines.driver_metrics.restore_checkpoint_rows`).

Apart from the training loop (:mod:`laminar.trainer`), which calls
:meth:`~PublicationMixin._publish_update` once per update: what leaves the trainer, for
the relays and for the disk, is a concern of its own.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import time
from pathlib import Path

from laminar.cluster import actor_result
from laminar.files import sync_dir, sync_tree
from laminar.learner import CheckpointError, saved_checkpoints
from laminar.prompt_pool import DATA_STATE

# (the actor's logger: its records read as the trainer's, whichever module they come from)
logger = logging.getLogger("laminar.trainer")

# In each checkpoint folder (listed in its manifest): the rows of metrics.zarr's
# ``updates`` and ``publications`` tables of the versions up to the checkpoint's, along
# its weights' lineage (this trainer's, and those the checkpoint it started from kept).
CHECKPOINT_ROWS = "metrics_rows.json"
ROWS_FORMAT = 1
# What tells two rows of a table apart: the version and the time the row was made (a
# resumed start publishes its checkpoint's version again; a superseded branch's row of a
# version is another row than the lineage's). Never NaN: both are set as the row is made.
ROW_KEYS = {"updates": "time", "publications": "t_publish"}


def merge_rows(parts, key: str, upto: int) -> list[dict]:
    """The rows of ``parts`` (lists of rows, oldest first) of versions up to ``upto``,
    once each by ``(version, key)``: a later part's copy of a row replaces an earlier's
    in its place (a publication's record is completed once every relay holds it).

    >>> old = [{"version": 1, "time": 5.0, "x": 1}, {"version": 2, "time": 6.0, "x": 1}]
    >>> new = [{"version": 2, "time": 6.0, "x": 2}, {"version": 3, "time": 7.0, "x": 2}]
    >>> [(r["version"], r["x"]) for r in merge_rows([old, new], "time", upto=2)]
    [(1, 1), (2, 2)]
    """
    rows: dict[tuple, dict] = {}
    for part in parts:
        for r in part:
            if r.get("version") is not None and r["version"] <= upto:
                rows[(r["version"], r[key])] = r
    return list(rows.values())


def read_checkpoint_rows(ckpt: str | Path) -> dict[str, list[dict]]:
    """The ``updates`` and ``publications`` rows a checkpoint keeps
    (:data:`CHECKPOINT_ROWS`): table -> rows; ``{}`` for one written before checkpoints
    kept them. One that does not read as written is a :class:`CheckpointError` naming
    it (its digest is checked with the rest, :func:`laminar.learner.check_checkpoint`,
    before a resume or restart loads the checkpoint)."""
    path = Path(ckpt).expanduser() / CHECKPOINT_ROWS
    if not path.exists():
        return {}
    try:
        kept = json.loads(path.read_text())
        if not isinstance(kept, dict) or kept.get("format") != ROWS_FORMAT:
            raise ValueError(f"not format {ROWS_FORMAT} (format {kept.get('format')!r})")
        out = {}
        for table, key in ROW_KEYS.items():
            rows = kept.get(table, [])
            for r in rows:
                if not (
                    isinstance(r, dict)
                    and isinstance(r.get("version"), int)
                    and isinstance(r.get(key), float)
                    and math.isfinite(r[key])
                ):
                    raise ValueError(f"a {table} row without its version and {key}: {r!r}")
            out[table] = rows
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(
            f"{str(path)!r} is damaged ({type(e).__name__}: {e}); the update and "
            "publication rows it keeps are not read"
        ) from None
    return out


def carried_rows(resume_from: str | None, run_dir: Path) -> dict[str, list[dict]]:
    """The rows kept by the checkpoint a trainer starts from, when it is one of this
    run's (a resume in place, a restart within the run): its own checkpoints keep them
    too, so that a resume from one of them has every row of its lineage, whatever an
    earlier start's driver wrote. A checkpoint of another run (a new run from it) keeps
    that run's rows: none carried. A damaged file: said, none carried."""
    if resume_from is None:
        return {}
    ckpt = Path(resume_from).expanduser()
    if ckpt.resolve().parent != (Path(run_dir) / "checkpoints").resolve():
        return {}
    try:
        return read_checkpoint_rows(ckpt)
    except CheckpointError as e:
        logger.warning("%s: its checkpoints keep only this trainer's rows", e)
        return {}


def _write_listed(folder: Path, name: str, text: str) -> None:
    """Write ``folder/name`` and list it in the folder's manifest (written by
    :meth:`laminar.learner.Learner.save`, before the folder is renamed into place: still
    one write), so that it is checked with the rest (:func:`laminar.files.check_manifest`)
    and not named as a file added since. Its own digest only: the others' are not read
    again."""
    from laminar.files import DIGEST, MANIFEST, file_digest

    (folder / name).write_text(text)
    path = folder / MANIFEST
    if not path.exists():  # (a learner that records none: nothing is checked)
        return
    manifest = json.loads(path.read_text())
    size, digest = file_digest(folder / name)
    manifest["files"][name] = {"size": size, DIGEST: digest}
    path.write_text(json.dumps(manifest, indent=1))


def _plain(value):
    """A row's value as JSON (a NumPy or torch scalar as its Python number)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} {value!r} is no number")


class PublicationMixin:
    """Publications and checkpoints of :class:`~laminar.trainer.Trainer` (its state is set
    there)."""

    def publish(self) -> float:
        """Hand the current weights to the master relay; returns the stall (seconds)."""
        state = self.learner.model.state_dict()
        with self._bounded():  # (relay.timeout_s)
            stall = self.publisher.publish(self.version, state)
        if self.cfg.relay.audit_weights:
            from laminar.relay_core import state_fingerprint

            fingerprint = state_fingerprint(state)
            with self._fingerprints_lock:
                self.fingerprints[self.version] = fingerprint
        return stall

    def get_fingerprints(self, since: int = -1) -> dict[int, int]:
        """Version -> fingerprint of what it published, for versions after ``since``."""
        with self._fingerprints_lock:
            return {v: fp for v, fp in self.fingerprints.items() if v > since}

    def _publish_update(self, record: dict) -> None:
        """Tell the buffer, move the weights as the schedule does, record the update, and
        checkpoint when due."""
        timeout = self.cfg.cluster.actor_timeout_s
        self._tell_published()
        t_pub = time.time()
        if self.spec.interrupt:  # every rollout stops before the weights move
            with self._bounded():
                self.manager.pause_all(self.version).result(timeout)
        stall = self._move_weights()
        now = time.time()
        self.history.append(
            {
                "version": self.version,
                "time": now,
                **record,
                "publish_s": stall,
                "sync_s": now - t_pub,
                "interval_s": now - self._last_publication,
            }
        )
        self._last_publication = now
        every = self.cfg.trainer.checkpoint_every
        if every and self.version % every == 0 and self.version < self.steps:
            self.checkpoint = self._save_checkpoint()

    def _move_weights(self) -> float:
        """Publish the version; returns the trainer's stall. Paced, the stall is the
        modelled cost of the schedule's weight movement: a relay publication, a global
        broadcast or a colocated switch (which every rollout waits out too), each held
        before the real copy, so that no rollout can load the version earlier than the
        model says it exists. (A relay publication was held after its copy, so a rollout
        could pull a version up to ``trainer.pacing.publish_s`` modelled early.)"""
        p = self.cfg.trainer.pacing
        if self.clock is None:
            return self.publish()
        from laminar.pacing import WeightSyncModel

        costs = WeightSyncModel(
            publish_s=p.publish_s,
            global_s=p.global_sync_s,
            global_log2_s=p.global_sync_log2_s,
            colocated_s=p.colocated_switch_s,
        )
        t0 = time.time()
        if self.spec.weights == "relay":
            self._hold(t0, costs.publish_s, "publish")
        elif self.spec.weights == "global":
            self._hold(t0, costs.global_sync(self.cfg.rollout.replicas), "global_sync")
        else:
            self._hold(t0, costs.colocated_s, "colocated_switch")
        self.publish()
        return time.time() - t0

    def _save_checkpoint(self) -> str | None:
        """HF folder + optimizer, RNG and trainer state under ``checkpoints/version-N``,
        written aside and renamed into place: a folder there is always complete. A
        version already saved (periodically, then at the end) is not written again.

        First the buffer commits its store, so that it records every trajectory the
        updates up to here consumed (a resume must not train them again); when it cannot
        (the data module is lost) no checkpoint is written and the newest one stands."""
        root = self.run_dir / "checkpoints"
        out = root / f"version-{self.version:06d}"
        if self._weights_version != self.version:
            logger.warning(
                "no checkpoint at version %d: the weights are not that version's (a "
                "restart that has not trained yet, or an update that did not finish); the "
                "newest checkpoint stands",
                self.version,
            )
            return self.checkpoint
        if out.exists():
            return str(out)
        try:
            synced = self._on_buffer(lambda b: b.sync())
            # Where the prompt order stands, for a new run from this checkpoint
            # (trainer.resume_from): the groups dispatched so far.
            position = self._on_buffer(lambda b: b.pool_stats())
        except Exception as e:  # noqa: BLE001 — the data module is gone or cannot write
            logger.warning(
                "no checkpoint at version %d: the trajectory store could not be committed "
                "(%s: %s); the newest checkpoint stands",
                self.version,
                type(e).__name__,
                e,
            )
            return self.checkpoint
        # The store has what was sampled before this version, but what a rebuilt buffer
        # still waits to store as consumed (ExperienceBuffer.sync): kept, for a later
        # rebuild to know it was consumed.
        unstored = dict(synced["consumed_unstored"])
        with self._consumed_lock:
            self._consumed = {u: c for u, c in self._consumed.items() if c[0] >= self.version}
            self._consumed |= unstored
            self._since = self.version
        rows = self._checkpoint_rows()
        tmp = root / f".version-{self.version:06d}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with self._bounded():  # (a big checkpoint's write may outlast the heartbeat)
                self.learner.save(tmp)
            _write_listed(tmp, CHECKPOINT_ROWS, json.dumps(rows, default=_plain))
            (tmp / DATA_STATE).write_text(json.dumps(position, indent=2))
            sync_tree(tmp)  # (a folder under its final name is complete on disk too)
            tmp.rename(out)
        except Exception as e:
            # (the folder goes either way: gigabytes nothing else removes)
            shutil.rmtree(tmp, ignore_errors=True)
            if not _disk_error(e):
                raise
            logger.warning(
                "no checkpoint at version %d: writing it failed on the disk (%s: %s); its "
                "partial folder %s is removed and the newest checkpoint stands",
                self.version,
                type(e).__name__,
                e,
                tmp,
            )
            return self.checkpoint
        sync_dir(root)
        with self._bounded():  # (removing a 100 GB checkpoint is progress, not silence)
            self._remove_older_checkpoints(root)
        return str(out)

    def _checkpoint_rows(self) -> dict:
        """What the checkpoint of this version keeps of the ``updates`` and
        ``publications`` tables (:data:`CHECKPOINT_ROWS`): every row of the versions up
        to it that this trainer holds (its history, the master relay's records) or
        carried from the checkpoint it started from (:func:`carried_rows`). Its whole
        lineage, not the rows since the last checkpoint: the driver may have lost rows
        of several (a flush covers a few seconds; one checkpoint a version is allowed),
        and a resume from this one must find them all. About 1 KB a version (10 MB at
        10,000 versions: beside the weights, nothing)."""
        upto = self.version
        carried = self._carried_rows
        out: dict = {"format": ROWS_FORMAT, "version": upto}
        own = {"updates": list(self.history), "publications": self._publication_records()}
        for table, key in ROW_KEYS.items():
            out[table] = merge_rows([carried.get(table, []), own[table]], key, upto)
        return out

    def _publication_records(self) -> list[dict]:
        """The master relay's record of each publication (as the driver copies them);
        ``[]``, said, where it does not give them: the checkpoint is written without."""
        master = self.publisher.master
        try:
            with self._bounded():
                call = master.publications_since(0)
                return list(actor_result(master, call, self.cfg.relay.timeout_s))
        except Exception as e:  # noqa: BLE001 — the checkpoint matters more than its rows
            logger.warning(
                "the checkpoint at version %d keeps no publication rows: the master relay "
                "did not give them (%s: %s)",
                self.version,
                type(e).__name__,
                e,
            )
            return []

    def _remove_older_checkpoints(self, root) -> None:
        """Past ``trainer.keep_checkpoints``, the oldest of the run's checkpoints up to
        this version go, once this one is in place (a newer one, of a start a resume
        superseded, is the resume's to handle). Each is renamed aside first
        (``.version-N.removed``), so a removal cut short leaves no ``version-N`` folder
        that a resume or the analysis would take for a checkpoint; what a trainer killed
        meanwhile left is removed as the next starts. A removal the disk refuses is said
        and the run goes on: disk, not data, is what it costs."""
        keep = self.cfg.trainer.keep_checkpoints
        if not keep:
            return
        saved = saved_checkpoints(root)
        older = sorted(v for v in saved if v <= self.version)[:-keep]
        for v in older:
            aside = root / f".version-{v:06d}.removed"
            try:
                saved[v].rename(aside)
                shutil.rmtree(aside)
            except OSError as e:
                logger.warning(
                    "could not remove checkpoint %s past trainer.keep_checkpoints=%d "
                    "(%s: %s); it stays, taking its disk space",
                    saved[v],
                    keep,
                    type(e).__name__,
                    e,
                )
                continue
            logger.info("removed checkpoint %s (trainer.keep_checkpoints=%d)", saved[v], keep)


# What a write that the disk refused raises: OSError (the files laminar writes, the
# rename); safetensors' SafetensorError ("I/O error: No space left on device (os error
# 28)"); torch.save's RuntimeError from its zip writer ("[enforce fail at
# inline_container.cc:...] unexpected pos ...", "PytorchStreamWriter failed writing file
# ...: file write failed"), which says nothing of the disk's error.
_DISK_ERROR = re.compile(r"os error \d+|I/O error|No space left|inline_container|file write failed")


def _disk_error(e: BaseException) -> bool:
    """``e``, raised writing a checkpoint, is the disk's refusal (full, a lost mount)."""
    return isinstance(e, OSError) or bool(_DISK_ERROR.search(str(e)))
