"""The notebook API's handle and ``laminar report``, as a notebook user meets them."""

from __future__ import annotations

import signal
import threading
import time

import pytest


@pytest.mark.slow
def test_an_interrupted_wait_stops_the_run_instead_of_leaving_it_going(
    cluster_client, small_config, tmp_path
):
    """A kernel interrupt (Ctrl-C) while ``wait()`` blocks stops the run in order, as
    `laminar run`'s first Ctrl-C does: it used to return control with the run still
    generating on the cluster, where the next submit stacked a second run beside it."""
    import pipelines
    from laminar.config import with_overrides
    from laminar.errors import RunStopped

    cfg = with_overrides(  # (uncached: a warm start that would train for hours)
        small_config, ["sft.steps=1000000", f"sft.cache_dir={tmp_path / 'cache'}"]
    )
    run = pipelines.submit(cfg, cluster_client, run_dir=tmp_path / "run")
    try:
        deadline = time.time() + 120
        while run.progress().get("phase") != "warm-start":
            assert time.time() < deadline and not run.done(), run.progress()
            time.sleep(0.1)
        main = threading.main_thread().ident
        timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(RunStopped, match="stopped during its setup"):
                run.wait(timeout=120)
        except KeyboardInterrupt:
            pytest.fail(f"wait() let the interrupt through; the run goes on: {run.progress()}")
        finally:
            timer.join()
        assert run.done() and run.progress()["phase"] == "stopped"
    finally:
        run.stop()
        run._done.wait(60)
