"""What a run leaves untrained is said where the user looks: `buffer.max_train_staleness`
evicted 1920 of a run's 6016 trajectories (32%), `buffer.dynamic_sampling` filtered 10384
of another's 21106, and the progress line said only the discarded (none), the failed
run's summary only the consumed."""

from __future__ import annotations

from pipelines.cli_display import _Bar, _print_failed_summary, _progress_line


def _progress(**kw) -> dict:
    return {
        "phase": "training",
        "elapsed_s": 51.6,
        "updates": 30,
        "steps": 30,
        "version": 30,
        "last_version": 30,
        "reward": 0.898,
        "s_train_mean": 1.0,
        "gen_tok_s": 973.0,
        "buffer_depth": 256,
        "trajectories": 6016,
        "discarded": 0,
        "evicted": 0,
        "filtered": 0,
        "walltime_stop_in_s": None,
    } | kw


def test_the_progress_line_says_the_evicted_and_the_filtered():
    line = _progress_line(_progress(evicted=1920))
    assert line.endswith("trajectories 6016  untrained 1920 (evicted 1920)"), line
    line = _progress_line(_progress(trajectories=21106, evicted=6696, filtered=10384))
    assert "untrained 17080 (evicted 6696, filtered 10384)" in line, line
    line = _progress_line(_progress(evicted=5, discarded=16))
    assert "untrained 21 (evicted 5, discarded 16: reward errors)" in line, line
    assert "untrained" not in _progress_line(_progress())


def test_the_bar_says_them_too(capsys):
    bar = _Bar()
    try:
        bar.show(_progress(evicted=1920, filtered=8))
        assert "untrained 1928 (evicted 1920, filtered 8)" in bar.bar.postfix
    finally:
        bar.close()


def test_a_failed_runs_summary_says_where_its_trajectories_ended_up(capsys):
    _print_failed_summary(
        {
            "run_dir": "runs/k1",
            "reason": "failed: lost",
            "trajectories": 6016,
            "consumed": 3840,
            "reward_first_20pct": 0.5,
            "reward_last_20pct": 0.9,
            "status_counts": {"n_consumed": 3840, "n_buffered": 256, "n_evicted": 1920},
        }
    )
    assert "trajectories       6016 (3840 consumed, 256 buffered, 1920 evicted)" in (
        capsys.readouterr().out
    )
