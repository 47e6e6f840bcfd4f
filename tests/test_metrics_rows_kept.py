"""The ``updates`` and ``publications`` rows of metrics.zarr outlive a driver that never
wrote them: each checkpoint keeps the rows of its lineage (``metrics_rows.json``, listed
in its manifest), and a resume writes back those its tables lack, once, never a
superseded branch's (the audit names the versions still without a row:
tests/test_audit_damaged.py).

A reviewer's run aborted by a second Ctrl-C at version 40 (checkpoint 40 written) had
``updates`` rows for 57 of its 60 versions, 38-40 missing for good, and audited CLEAN:
the driver had copied them from the trainer but not written them, and the resume
started after them.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import zarr
from factories import InProcess
from test_trainer import CFG, FakeBuffer, FakeMaster, groups, run_until_starved

from laminar.config import with_overrides
from laminar.files import MANIFEST, ManifestMismatch, check_manifest
from laminar.prompt_pool import DATA_STATE
from laminar.schedule import LAMINAR
from laminar.trainer import Trainer
from laminar.trainer_publish import CHECKPOINT_ROWS, ROWS_FORMAT, read_checkpoint_rows
from pipelines.driver_metrics import restore_checkpoint_rows
from storage.audit import audit_run
from storage.metrics import MetricsWriter, open_metrics
from storage.schema import COMMIT_ATTR


class RecordingMaster(FakeMaster):
    """The master relay's publication records, as it keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict] = []

    def publish(self, version: int, state: dict) -> float:
        self.records.append(
            {"version": version, "t_publish": time.time(), "stall_s": 0.0, "broadcast_s": 0.001}
        )
        return super().publish(version, state)

    def publications_since(self, since: int = 0) -> list[dict]:
        return [dict(r) for r in self.records[since:]]


def _trainer(policy, run_dir, cfg, batches, master=None):
    buffer, master = FakeBuffer(batches), master or RecordingMaster()
    args = (str(run_dir), InProcess(buffer), InProcess(master), "", LAMINAR)
    return Trainer(cfg, str(policy), *args), buffer, master


def _versions(rows) -> list[int]:
    return [r["version"] for r in rows]


def test_each_checkpoint_keeps_its_lineages_rows_listed_in_its_manifest(tiny_policy, tmp_path):
    """Every checkpoint keeps the update rows (the trainer's history, as the driver copies
    it) and the master relay's publication records of the versions up to its own, in a
    file its manifest lists (a byte changed in it is named); a trainer resumed from one of
    its run's checkpoints keeps those rows in its own, not the superseded start's rows of
    the versions it redoes; a new run from another run's checkpoint keeps only its own."""
    cfg = with_overrides(CFG, ["trainer.groups_per_step=2", "trainer.checkpoint_every=1"])
    run = tmp_path / "run"
    first, buffer, master = _trainer(tiny_policy, run, cfg, [groups(i, 2) for i in range(3)])
    stats = run_until_starved(first, buffer)
    assert stats["error"] is None and stats["checkpoint"].endswith("version-000003")
    ckpts = run / "checkpoints"
    kept = read_checkpoint_rows(ckpts / "version-000003")
    assert kept["updates"] == first.history  # (every column, the time to the last bit)
    assert kept["publications"] == master.records
    assert _versions(kept["publications"]) == [0, 1, 2, 3]
    one = read_checkpoint_rows(ckpts / "version-000001")
    assert one["updates"] == first.history[:1] and one["publications"] == master.records[:2]
    # Listed in the manifest, and checked with the rest
    ckpt = ckpts / "version-000003"
    assert CHECKPOINT_ROWS in json.loads((ckpt / MANIFEST).read_text())["files"]
    assert check_manifest(ckpt, leave_out=(DATA_STATE,)).extra == ()
    text = (ckpt / CHECKPOINT_ROWS).read_text()
    (ckpt / CHECKPOINT_ROWS).write_text(text.replace('"version": 2', '"version": 7', 1))
    with pytest.raises(ManifestMismatch, match=CHECKPOINT_ROWS):
        check_manifest(ckpt, leave_out=(DATA_STATE,))
    (ckpt / CHECKPOINT_ROWS).write_text(text)

    # Resumed in place from version 2: it redoes 3 (and makes 4) on other batches
    again = with_overrides(
        cfg, ["trainer.checkpoint_every=0", f"trainer.resume_from={ckpts / 'version-000002'}"]
    )
    second, buffer, master2 = _trainer(tiny_policy, run, again, [groups(7, 2), groups(8, 2)])
    assert run_until_starved(second, buffer)["checkpoint"].endswith("version-000004")
    kept = read_checkpoint_rows(ckpts / "version-000004")
    assert kept["updates"] == first.history[:2] + second.history
    assert _versions(kept["updates"]) == [1, 2, 3, 4]
    assert kept["updates"][2]["time"] != first.history[2]["time"]  # (the redone 3)
    # (its own publication of version 2 too: a resumed start publishes it again)
    assert kept["publications"] == master.records[:3] + master2.records
    assert _versions(kept["publications"]) == [0, 1, 2, 2, 3, 4]

    # A new run from that run's checkpoint: that run's rows are not this one's
    other = tmp_path / "other"
    new, buffer, master3 = _trainer(tiny_policy, other, again, [groups(9, 2)])
    assert run_until_starved(new, buffer)["checkpoint"].endswith("version-000003")
    kept = read_checkpoint_rows(other / "checkpoints" / "version-000003")
    assert kept["updates"] == new.history and _versions(kept["updates"]) == [3]
    assert kept["publications"] == master3.records


def _kept(ckpt, updates, publications, version):
    """A checkpoint folder keeping these rows, as the trainer writes it."""
    ckpt.mkdir(parents=True)
    kept = {"format": ROWS_FORMAT, "version": version}
    (ckpt / CHECKPOINT_ROWS).write_text(
        json.dumps(kept | {"updates": updates, "publications": publications})
    )
    return ckpt


def _update(v: int, t: float) -> dict:
    return {"version": v, "time": t, "loss": 0.1 * v, "grad_norm": 1.0 + v, "publish_s": 0.01}


def _publication(v: int, t: float) -> dict:
    return {"version": v, "t_publish": t, "stall_s": 0.002, "bytes": 10.0, "chunks": 1.0}


def _table(run, table) -> list[tuple]:
    ds = open_metrics(run, table)
    key = "time" if table == "updates" else "t_publish"
    return list(zip(ds["version"].values.tolist(), ds[key].values.tolist(), strict=True))


def test_a_resume_writes_back_the_rows_its_tables_lack_once(tmp_path):
    """An aborted start's driver wrote the rows of versions 1 (and publications 0-1),
    its checkpoint at 3 keeps 1-3: the resume appends 2-3, every column as kept; a second
    resume from it (its first was aborted too) appends nothing; a clean stop's tables
    lack nothing."""
    run = tmp_path / "run"
    updates = [_update(v, 100.0 + v) for v in (1, 2, 3)]
    pubs = [_publication(v, 99.5 + v) for v in (0, 1, 2, 3)]
    ckpt = _kept(run / "checkpoints" / "version-000003", updates, pubs, 3)
    w = MetricsWriter(run)
    w.append("updates", updates[:1])
    w.append("publications", pubs[:2])
    assert restore_checkpoint_rows(w, run, ckpt, 3) == {
        "updates": [2, 3],
        "publications": [2, 3],
    }
    ds = open_metrics(run, "updates")
    assert ds["version"].values.tolist() == [1, 2, 3]
    assert ds["loss"].values.tolist() == [r["loss"] for r in updates]
    assert ds["time"].values.tolist() == [r["time"] for r in updates]
    assert _table(run, "publications") == [(r["version"], r["t_publish"]) for r in pubs]
    # Never twice: a resume from the same checkpoint again
    assert restore_checkpoint_rows(MetricsWriter(run), run, ckpt, 3) == {}
    assert open_metrics(run, "updates").sizes["update"] == 3
    assert open_metrics(run, "publications").sizes["publication"] == 4
    # A clean stop wrote them all: nothing; a checkpoint from before they were kept: nothing
    clean = tmp_path / "clean"
    w = MetricsWriter(clean)
    w.append("updates", updates)
    w.append("publications", pubs)
    assert restore_checkpoint_rows(w, clean, ckpt, 3) == {}
    old = tmp_path / "old" / "checkpoints" / "version-000003"
    old.mkdir(parents=True)
    assert restore_checkpoint_rows(MetricsWriter(tmp_path / "old"), tmp_path / "old", old, 3) == {}


def test_a_superseded_branchs_row_neither_stands_for_the_lineages_nor_comes_back(tmp_path):
    """A start went on past checkpoint 2 to 4 (its rows of 3-4 written), was resumed from
    2, redid 3-4 and checkpointed 4 but its driver wrote none of it: the resume from
    that checkpoint writes back the lineage's 3 and 4 (the table's 3 and 4 are other
    rows: the superseded start's). Rows of versions past the resume's are never written:
    it redoes those."""
    run = tmp_path / "run"
    superseded = [_update(v, 100.0 + v) for v in (1, 2, 3, 4)]
    lineage = superseded[:2] + [_update(3, 200.0), _update(4, 201.0)]
    w = MetricsWriter(run)
    w.append("updates", superseded)
    ckpt = _kept(run / "checkpoints" / "version-000004", lineage, [], 4)
    assert restore_checkpoint_rows(w, run, ckpt, 4) == {"updates": [3, 4]}
    assert _table(run, "updates") == [(v, 100.0 + v) for v in (1, 2, 3, 4)] + [
        (3, 200.0),
        (4, 201.0),
    ]
    # (a resume from version 3 with rows past it kept: they are not written)
    other = tmp_path / "other"
    ckpt = _kept(other / "checkpoints" / "version-000003", lineage, [], 4)
    assert restore_checkpoint_rows(MetricsWriter(other), other, ckpt, 3) == {"updates": [1, 2, 3]}


def test_commit_hides_rows_as_an_abort_leaves_them(tmp_path):
    """(The end-to-end test below hides the rows an abort loses by lowering the table's
    commit count, as a driver that never committed them leaves it: checked here.)"""
    w = MetricsWriter(tmp_path)
    w.append("updates", [_update(v, 100.0 + v) for v in (1, 2, 3)])
    _uncommit(tmp_path, "updates", 1)
    assert open_metrics(tmp_path, "updates")["version"].values.tolist() == [1]
    w = MetricsWriter(tmp_path)
    w.append("updates", [_update(9, 109.0)])
    assert open_metrics(tmp_path, "updates")["version"].values.tolist() == [1, 9]


def _uncommit(run, table: str, n: int) -> None:
    group = zarr.open_group(str(run / "metrics.zarr" / table), mode="r+", zarr_format=3)
    group.update_attributes({COMMIT_ATTR: n})


@pytest.mark.slow
def test_a_resume_after_an_abort_has_every_versions_row_once(
    cluster_client, small_config, tmp_path
):
    """A real run stopped at version 4 (its checkpoint), whose driver then lost the
    ``updates`` and ``publications`` rows of 3 and 4 (never committed, as an abort
    leaves them), resumed to 6: every version has its row once, 3 and 4 the very rows the
    trainer made, and the publications read as a clean stop's (the resumed start's own
    publication of 4 after the first start's); the audit names no hole."""
    import pipelines

    run_dir = tmp_path / "run"
    cfg = with_overrides(small_config, ["trainer.steps=4", "trainer.checkpoint_every=0"])
    first = pipelines.submit(cfg, cluster_client, run_dir=run_dir)
    assert first.wait(timeout=400)["versions"] == 4
    made = open_metrics(run_dir, "updates")
    assert made["version"].values.tolist() == [1, 2, 3, 4]
    pubs = open_metrics(run_dir, "publications")["version"].values.tolist()
    assert pubs == [0, 1, 2, 3, 4]
    _uncommit(run_dir, "updates", 2)
    _uncommit(run_dir, "publications", 3)
    said = [n for n in audit_run(run_dir).notes if "no row in the" in n]
    assert [n.split(": ")[1].split(";")[0] for n in said] == ["3-4", "3-4"], said

    second = pipelines.resume(run_dir, cluster_client, overrides=["trainer.steps=6"])
    assert second.wait(timeout=400)["versions"] == 6
    rows = open_metrics(run_dir, "updates")
    assert rows["version"].values.tolist() == [1, 2, 3, 4, 5, 6]
    for col in ("time", "loss", "grad_norm", "reward_mean", "publish_s"):
        np.testing.assert_array_equal(rows[col].values[:4], made[col].values)
    pubs = open_metrics(run_dir, "publications")["version"].values.tolist()
    assert pubs == [0, 1, 2, 3, 4, 4, 5, 6]
    report = audit_run(run_dir)
    assert report.ok and not [n for n in report.notes if "no row in the" in n], report.text()
