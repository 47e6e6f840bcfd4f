"""A resumed run's starts, as ``open_run`` and :func:`storage.metrics.segments` read
them: a start's updates and publications are signs it was going (a review found the
stop of a run stopped at version 29 beginning before its update of 29, and the start's
``last_version`` 28)."""

import pytest
import zarr

import pipelines
from laminar.config import with_overrides
from storage import open_run
from storage.metrics import open_metrics, segments
from storage.schema import COMMIT_ATTR


def _uncommit(run, table: str, n: int) -> None:
    group = zarr.open_group(str(run / "metrics.zarr" / table), mode="r+", zarr_format=3)
    group.update_attributes({COMMIT_ATTR: n})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_start_ends_with_its_last_update_and_publication_not_its_last_cluster_row(
    cluster_client, small_config, tmp_path
):
    """A real run to version 3, whose ``cluster`` rows end before its update of 3 (a
    stop finishes the update under way after the driver's last row: run3 of the review,
    76.05 s against 77.06 s), resumed to 5. The first start's ``last_version`` is 3,
    not its last row's; the resumed start's first is the checkpoint's it published; the
    stop begins after the update of 3 (the trajectories held across it keep that time
    of their age), at the last sign of the first start, and ends at the resume."""
    run = tmp_path / "run"
    cfg = with_overrides(small_config, ["trainer.steps=3", "trainer.checkpoint_every=0"])
    first = pipelines.submit(cfg, cluster_client, run_dir=run)
    assert first.wait(timeout=400)["versions"] == 3
    t_update = float(open_metrics(run, "updates")["time"].values[-1])  # (version 3's)
    t_publish = float(open_metrics(run, "publications")["t_publish"].values[-1])
    cluster = open_metrics(run, "cluster")
    # (the rows before the trainer was seen at version 3: a row is stamped when the
    # buffer was read, and the trainer read after it, so by time one may already say 3)
    before = int((cluster["version"].values < 3).sum())
    assert 0 < before and (cluster["version"].values[before:] == 3).all()
    _uncommit(run, "cluster", before)
    assert segments(open_metrics(run, "cluster"))[0]["last_version"] == 3

    second = pipelines.resume(run, cluster_client, overrides=["trainer.steps=5"])
    assert second.wait(timeout=400)["versions"] == 5
    starts = segments(open_metrics(run, "cluster"))
    assert [(s["first_version"], s["last_version"]) for s in starts] == [(0, 3), (3, 5)]
    ds = open_run(run)
    assert ds.attrs["segment_first_version"] == [0, 3]
    (stop, resumed), *_ = ds.laminar.pauses_s
    assert resumed == ds.attrs["resumed_at_s"][0]
    assert stop >= max(t_update, t_publish), (stop, t_update, t_publish)
    # (the last sign of the first start: nothing of it after the stop began)
    t = ds["t_insert"].values
    assert not ((t > stop) & (t < resumed)).any()
