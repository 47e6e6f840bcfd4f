"""A whole run over UCX (`cluster.protocol: ucx`), weights through the relay tier included.

distributed-ucxx pins its own dask release, so this runs in its own environment
(`.ci/ucx-env`, then `.venv-ucx/bin/python -m pytest tests/test_ucx.py`); in the main
environment it skips, saying so.
"""

from __future__ import annotations

import pytest
from conftest import SMALL_RUN
from runs import check_store, cli_run

pytest.importorskip(
    "distributed_ucxx", reason="UCX lives in its own environment: .ci/ucx-env builds .venv-ucx"
)
pytestmark = pytest.mark.slow


def test_a_run_over_ucx(tmp_path):
    run_dir = tmp_path / "run"
    out, summary = cli_run(run_dir, [*SMALL_RUN, "cluster.protocol=ucx"])
    assert "scheduler          ucx://" in out
    assert summary["reason"] == "completed" and summary["versions"] == 4
    check_store(run_dir, expect_consumed_groups=4 * 4)
