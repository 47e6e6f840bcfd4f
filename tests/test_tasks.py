import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from laminar.errors import ConfigError, DataError, RewardError
from laminar.rewards import exact_match, resolve_reward, score_batch
from laminar.tasks import TASKS, demonstration, jsonl_prompts, length_sigmas, synthetic_prompts


def test_answer_lengths_are_long_tailed_like_the_paper():
    prompts = synthetic_prompts(
        "count", size=20000, median_len=6, tail_ratio=10, max_len=255, seed=0
    )
    lengths = np.array([len(p.answer.split()) for p in prompts])
    assert 5 <= np.median(lengths) <= 7
    assert 8 <= np.percentile(lengths, 99) / np.median(lengths) <= 12


@pytest.mark.parametrize("task", sorted(TASKS))
def test_synthetic_answers_follow_the_rule(task):
    for p in synthetic_prompts(task, size=50, median_len=4, tail_ratio=3, max_len=20, seed=1):
        tag, *xs, arrow = p.text.split()
        assert arrow == ">" and tag == TASKS[task][0]
        expect = {
            "count": [str(i) for i in range(1, int(xs[0]) + 1)] if xs else [],
            "copy": xs,
            "reverse": xs[::-1],
            "sort": sorted(xs),
            "count_range": xs,  # the band "lo hi", which count_in_range checks
        }[task]
        assert p.answer.split() == expect
        if task == "count_range":
            lo, hi = map(int, xs)
            assert 1 <= lo <= hi <= 20


def test_count_range_lengths_vary_within_a_group_and_keep_the_tail():
    """Demonstration lengths: P99/median as asked over all responses, half of the
    log-variance within a prompt's group (length_share=0.5), every one in its band."""
    prompts = synthetic_prompts(
        "count_range", size=4000, median_len=6, tail_ratio=10, max_len=255, seed=0
    )
    own = length_sigmas(10, 0.5)[1]
    rng = np.random.default_rng(1)
    lengths = np.array(
        [[len(demonstration("count_range", p, rng, own).split()) for _ in range(16)]
         for p in prompts]
    )  # fmt: skip
    bands = np.array([list(map(int, p.answer.split())) for p in prompts])
    assert ((bands[:, :1] <= lengths) & (lengths <= bands[:, 1:])).all()
    assert 5 <= np.median(lengths) <= 7
    assert 7 <= np.percentile(lengths, 99) / np.median(lengths) <= 12
    logs = np.log(lengths)
    within = logs.var(axis=1).mean()
    assert 0.35 <= within / logs.var() <= 0.6, (within, logs.var())
    # length_share=1: one length per prompt, as in count
    same = synthetic_prompts(
        "count_range", size=200, median_len=6, tail_ratio=10, max_len=255, seed=0,
        length_share=1.0,
    )  # fmt: skip
    assert all(len(set(p.answer.split())) == 1 for p in same)


def test_count_in_range_scores_any_length_in_the_band():
    from laminar.rewards import count_in_range

    assert [count_in_range(r, "2 4") for r in ("1", "1 2", "1 2 3 4", "1 2 3 4 5")] == [
        0.0, 1.0, 1.0, 0.0,
    ]  # fmt: skip
    assert count_in_range("1 2 4", "1 5") == 2 / 3  # per-symbol credit
    # a band from 0 takes the empty count (a response of only a stop token), and is right
    assert count_in_range("", "0 3") == 1.0 and count_in_range("1 3", "0 3") == 0.5
    for bad in ("5 2", "-1 3", "1", "a b"):  # (backwards it would score 0 for good)
        with pytest.raises(RewardError, match="two integers 0 <= lo <= hi"):
            count_in_range("1 2", bad)
    scores = score_batch("count_in_range", [("1 2", "1 2 3", True)])  # not a band: marked
    assert scores[0].error is not None and "'lo hi'" in scores[0].error


def test_same_seed_same_prompts():
    a = synthetic_prompts("sort", size=30, median_len=5, tail_ratio=10, max_len=30, seed=3)
    assert a == synthetic_prompts("sort", size=30, median_len=5, tail_ratio=10, max_len=30, seed=3)


def test_jsonl_prompts_and_their_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "n 2 >", "answer": "1 2"}) + "\n\n")
    assert jsonl_prompts(f)[0].answer == "1 2"
    f.write_text(
        json.dumps({"prompt": "n 2 >", "answer": "1 2"}) + "\n" + json.dumps({"prompt": "x"}) + "\n"
    )
    with pytest.raises(DataError, match=r"p.jsonl:2: field 'answer' is missing"):
        jsonl_prompts(f)
    for field in ("prompt", "answer"):
        row = {"prompt": "n 2 >", "answer": "1 2", field: "  "}
        f.write_text('{"prompt": "n 1 >", "answer": "1"}\n\n' + json.dumps(row) + "\n")
        with pytest.raises(DataError, match=rf"p.jsonl:3: field '{field}' is empty"):
            jsonl_prompts(f)
    f.write_text("{not json\n")
    with pytest.raises(DataError, match=r"p.jsonl:1: not valid JSON"):
        jsonl_prompts(f)
    f.write_text("")
    with pytest.raises(DataError, match="holds no prompts"):
        jsonl_prompts(f)
    with pytest.raises(DataError, match="does not exist; set task.prompt_file"):
        jsonl_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="is a directory; set task.prompt_file"):
        jsonl_prompts(tmp_path)
    import gzip

    f.write_bytes(gzip.compress(b'{"prompt": "n 2 >", "answer": "1 2"}\n'))
    with pytest.raises(DataError, match=r"not UTF-8 text .*decompress it first"):
        jsonl_prompts(f)


@pytest.mark.skipif(not Path("/proc/self/mem").is_file(), reason="needs Linux's /proc")
def test_a_prompt_file_that_cannot_be_read_names_the_field_and_the_error():
    """A file that exists but cannot be read (no permission; /proc/self/mem: EIO even for
    root) ended `laminar run` in a raw PermissionError or OSError traceback."""
    with pytest.raises(
        DataError, match=r"'/proc/self/mem' cannot be read \(\w+Error: .*task.prompt_file"
    ):
        jsonl_prompts("/proc/self/mem")


def test_reward_failures_mark_the_trajectory():
    scores = score_batch("laminar.rewards:_broken", [("1", "1", True), ("1", "1", False)])
    assert math.isnan(scores[0].reward) and "ZeroDivisionError" in scores[0].error
    assert scores[1].reward == 0.0 and scores[1].error is None  # truncated: not scored
    # (takes two arguments, and raises TypeError on strings; one taking fewer is
    # refused before the run: test_resolve_reward)
    nan = score_batch("math:pow", [("x", "y", True)])
    assert nan[0].error is not None


def test_a_reward_call_that_hangs_marks_its_trajectory_and_the_rest_are_scored():
    """task.reward_timeout_s bounds each call, not the batch: the calls after a hung one
    are scored (on a fresh thread), and a batch of slow calls within the limit is whole."""
    import time

    items = [("1", "1", True), ("hang", "1", True), ("2", "1", True), ("x", "1", False)]
    t0 = time.monotonic()
    scores = score_batch("laminar.rewards:_hangs", items, truncated_reward=-1.0, timeout_s=0.2)
    # (the hung call sleeps an hour; the bound leaves room for two child processes'
    # starts, ~0.3 s each here, on a loaded machine)
    assert 0.2 <= time.monotonic() - t0 < 30.0
    assert scores[0].reward == 1.0 and scores[3].reward == -1.0  # (truncated: not called)
    assert math.isnan(scores[1].reward) and "task.reward_timeout_s=0.2 s" in scores[1].error
    assert scores[2].reward == 0.0 and scores[2].error is None
    import laminar.rewards as r

    r.REWARDS["_sleepy"] = lambda response, answer: time.sleep(0.03) or 1.0
    try:
        slow = score_batch("_sleepy", [("a", "a", True)] * 10, timeout_s=0.2)
    finally:
        del r.REWARDS["_sleepy"]
    assert [s.reward for s in slow] == [1.0] * 10  # 0.3 s in all: each call within 0.2
    from laminar.config import RunConfig, with_overrides

    assert RunConfig().task.reward_timeout_s == 300.0
    assert with_overrides(RunConfig(), ["task.reward_timeout_s=null"]).task.reward_timeout_s is None
    with pytest.raises(ConfigError, match=r"task.reward_timeout_s: .*greater than 0"):
        with_overrides(RunConfig(), ["task.reward_timeout_s=0"])


def test_non_finite_rewards_are_errors():
    scores = score_batch("numpy:true_divide", [("1", "1", True)])  # str / str raises
    assert scores[0].error is not None
    import laminar.rewards as r

    r.REWARDS["_nan"] = lambda response, answer: float("nan")
    try:
        assert score_batch("_nan", [("a", "a", True)])[0].error == "reward _nan returned nan"
    finally:
        del r.REWARDS["_nan"]


def test_resolve_reward(tmp_path, monkeypatch):
    assert resolve_reward("exact_match") is exact_match
    with pytest.raises(RewardError, match="neither a built-in reward"):
        resolve_reward("nope")
    with pytest.raises(RewardError, match="cannot be imported"):
        resolve_reward("no_such_module:fn")
    with pytest.raises(RewardError, match=r"module 'os' imports, but has no 'nosuchfn'.*colon"):
        resolve_reward("os:nosuchfn")
    (tmp_path / "laminar_test_badmod.py").write_text("raise RuntimeError('bad setup')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="importing 'laminar_test_badmod' raised RuntimeError"):
        resolve_reward("laminar_test_badmod:fn")
    # a function that cannot take (response, answer) is refused before the warm start,
    # not called on every trajectory after it (each an error)
    with pytest.raises(RewardError, match=r"'os:getcwd' cannot be called as fn\(response, answer"):
        resolve_reward("os:getcwd")
    (tmp_path / "laminar_test_rewards.py").write_text(
        "def three(a, b, c): return 1.0\n"
        "def extra(response, answer, scale=1.0): return scale\n"
        "def star(*args): return 1.0\n"
        "async def judged(response, answer): return 1.0\n"
    )
    with pytest.raises(RewardError, match=r"it has \(a, b, c\)"):
        resolve_reward("laminar_test_rewards:three")
    # (called, it returns a coroutine: every trajectory an error, after the warm start)
    with pytest.raises(RewardError, match=r"'laminar_test_rewards:judged' is an async function"):
        resolve_reward("laminar_test_rewards:judged")
    assert resolve_reward("laminar_test_rewards:extra")("r", "a") == 1.0
    assert resolve_reward("laminar_test_rewards:star")("r", "a") == 1.0


def test_what_a_reward_returns_is_a_number_or_marks_the_trajectory():
    """A bool or a numpy number is a reward (a rollout turns it into a float); None, a
    string, an overflowing int or a non-finite value mark the trajectory, as a raise
    does, and never fail the scoring task."""
    import laminar.rewards as r

    values = {
        "_none": None,
        "_text": "0.5",
        "_huge": 10**400,
        "_bool": True,
        "_np": np.float32(0.25),
        "_list": [0.5],
    }
    for name, value in values.items():
        r.REWARDS[name] = lambda response, answer, value=value: value
    try:
        for name in ("_none", "_text", "_huge", "_list"):
            (score,) = score_batch(name, [("a", "a", True)])
            assert math.isnan(score.reward) and score.error.startswith(f"reward {name} returned")
        # (what is not a number says what it is, and what a reward returns)
        assert score_batch("_list", [("a", "a", True)])[0].error == (
            "reward _list returned [0.5] (a list); a reward returns one number a response"
        )
        assert score_batch("_bool", [("a", "a", True)])[0].reward == 1.0
        assert score_batch("_np", [("a", "a", True)])[0].reward == 0.25
    finally:
        for name in values:
            del r.REWARDS[name]


def test_config_offers_exactly_the_tasks_that_exist():
    from typing import get_args

    from laminar.config import TaskConfig

    assert set(get_args(TaskConfig.model_fields["name"].annotation)) == set(TASKS)


def test_prompts_that_do_not_fit_the_model_are_refused_before_the_run(tmp_path):
    """A prompt file's prompts are encoded with the model's tokenizer before any cluster
    work: one with symbols outside the vocabulary, or longer than the rollout's sequence
    leaves room for, is named by its file and position, with the fix."""
    from laminar.config import RunConfig, with_overrides
    from pipelines.api import preflight

    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "n 2 >", "answer": "1 2"}, {"prompt": "n 2 hello >", "answer": "1 2"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = with_overrides(RunConfig(), [f"task.prompt_file={f}"])
    with pytest.raises(
        DataError,
        match=r"p.jsonl:2: the prompt 'n 2 hello >' has symbols outside the model's "
        r"vocabulary \(hello\); its vocabulary: .*>",
    ):
        preflight(cfg)
    f.write_text(json.dumps({"prompt": "n " + "2 " * 80 + ">", "answer": "1 2"}) + "\n")
    with pytest.raises(DataError, match=r"p.jsonl:1: the prompt has \d+ tokens.*raise rollout"):
        preflight(cfg)
    f.write_text(json.dumps(rows[0]) + "\n")
    preflight(cfg)


def test_answers_the_warm_start_trains_on_are_checked_before_the_run(tmp_path):
    """An answer outside the vocabulary is named by its file and line (1-based, blank
    lines counted) before any cluster work, and where the warm start runs; with no warm
    start the answers are only compared as text, and pass."""
    from laminar.config import RunConfig, with_overrides
    from laminar.sft import warm_start
    from pipelines.api import preflight

    f = tmp_path / "p.jsonl"
    rows = [{"prompt": "n 3 >", "answer": "1 2 3"}, {"prompt": "n 2 >", "answer": "xyzzy 2"}]
    f.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    cfg = with_overrides(RunConfig(), [f"task.prompt_file={f}"])
    message = (
        r"p.jsonl:3: the answer 'xyzzy 2' has symbols outside the model's vocabulary "
        r"\(xyzzy\); its vocabulary: .*set sft.enabled=false"
    )
    with pytest.raises(DataError, match=message):
        preflight(cfg)
    with pytest.raises(DataError, match=message):
        warm_start(cfg, jsonl_prompts(f))
    preflight(with_overrides(cfg, ["sft.enabled=false"]))
    # a control character is named escaped, not printed as nothing
    f.write_text(json.dumps({"prompt": "n 3 \u0000 >", "answer": "1 2 3"}) + "\n")
    with pytest.raises(DataError, match=r"p.jsonl:1: .*vocabulary \('\\x00'\)"):
        preflight(cfg)


def test_a_tokenizer_whose_unk_is_its_bos_passes_the_vocabulary_check():
    """GPT-2's family uses one token for unk and bos; every encoded prompt starts with
    bos, so that token cannot tell an unknown symbol (the check is skipped)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from laminar.config import RunConfig
    from laminar.prompt_pool import encode_prompts
    from laminar.tasks import Prompt

    core = Tokenizer(models.WordLevel({"<|e|>": 0, "n": 1, "2": 2}, unk_token="<|e|>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|e|>", eos_token="<|e|>", unk_token="<|e|>"
    )
    ((_, ids),) = encode_prompts(tok, [Prompt(key=0, text="n 2", answer="1 2")], RunConfig())
    assert ids == (0, 1, 2)


def test_a_prompt_file_with_a_byte_order_mark_is_read(tmp_path):
    """Windows tools (Notepad, Excel's "UTF-8" export) start a file with a BOM: it is
    UTF-8 all the same, and its first prompt is read, not refused as bad JSON."""
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "n 2 >", "answer": "1 2"}\r\n')
    (p,) = jsonl_prompts(f)
    assert (p.text, p.answer, p.line) == ("n 2 >", "1 2", 1)


def test_a_prompt_file_that_is_not_utf8_names_the_line(tmp_path):
    f = tmp_path / "p.jsonl"
    good = b'{"prompt": "n 2 >", "answer": "1 2"}\n'
    f.write_bytes(good * 2 + b'{"prompt": "n 2 >", "answer": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"p.jsonl:3: not UTF-8 text .*decompress it first"):
        jsonl_prompts(f)


def test_a_prompt_with_a_lone_surrogate_escape_is_refused_with_its_line(tmp_path):
    """JSON lets a string escape half a UTF-16 pair (``\\ud800``); no tokenizer can
    encode it, and the pre-start check failed with a TypeError from the tokenizer."""
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"prompt": "n 2 >", "answer": "1 2"}\n{"prompt": "n 2 \\ud800 >", "answer": "1"}\n'
    )
    with pytest.raises(
        DataError, match=r"p.jsonl:2: field 'prompt' holds '\\ud800', half of a UTF-16 surrogate"
    ):
        jsonl_prompts(f)


def test_a_line_naming_a_field_twice_is_refused(tmp_path):
    """JSON parsers keep the last of two equal keys: the first prompt (or answer) of
    the line would be dropped without a word."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "n 2 >", "answer": "1 2", "prompt": "n 3 >"}\n')
    with pytest.raises(DataError, match=r"p.jsonl:1: field 'prompt' appears twice"):
        jsonl_prompts(f)


def test_a_json_file_given_for_a_jsonl_one_is_told_the_format(tmp_path):
    """A JSON array, or objects spread over lines (``json.dump(rows, indent=2)``), is the
    commonest wrong file: the error says what one line must hold, and a long wrong value
    (a chat transcript for a prompt) is shown cut, not whole."""
    rows = [{"prompt": "n 2 >", "answer": "1 2"}] * 2
    fix = r"task.prompt_file takes JSONL: one JSON object per line, " + re.escape(
        '{"prompt": "...", "answer": "..."}'
    )
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(rows, indent=2))
    with pytest.raises(DataError, match=rf"p.jsonl:1: not valid JSON \(Expecting value\); {fix}"):
        jsonl_prompts(f)
    f.write_text(json.dumps(rows))
    with pytest.raises(DataError, match=rf"p.jsonl:1: a JSON array, not an object; {fix}"):
        jsonl_prompts(f)
    chat = [{"role": "user", "content": "x" * 5000}]
    f.write_text(json.dumps({"prompt": chat, "answer": "1 2"}) + "\n")
    with pytest.raises(DataError, match=r"field 'prompt' is missing or not a string") as e:
        jsonl_prompts(f)
    assert len(str(e.value)) < 500


def test_answers_longer_than_a_response_may_be_are_warned_of_before_the_run(tmp_path, caplog):
    """Under exact_match an answer of rollout.max_new_tokens tokens or more is never
    generated (with the end of sequence after it): every response is cut off and scores
    task.truncated_reward. The run went on without a word; now the check before it warns,
    naming how many, the first one's line and the fix. Other rewards may not need the
    whole answer: no warning."""
    import logging

    from laminar.config import RunConfig, with_overrides
    from pipelines.api import preflight

    f = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "n 2 >", "answer": "1 2"},
        {"prompt": "n 9 >", "answer": "1 2 3 4 5 6 7 8 9"},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = with_overrides(
        RunConfig(),
        [f"task.prompt_file={f}", "rollout.max_new_tokens=8", f"sft.cache_dir={tmp_path}"],
    )
    with caplog.at_level(logging.WARNING, logger="laminar"):
        preflight(cfg)
    (said,) = [r.getMessage() for r in caplog.records if "cannot be generated" in r.getMessage()]
    assert said.startswith(f"1 of 2 answers in {f} cannot be generated within rollout.max_new")
    assert f"{f}:2, 9 tokens" in said and "raise rollout.max_new_tokens" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="laminar"):
        preflight(with_overrides(cfg, ["task.reward=prefix_credit"]))
        preflight(with_overrides(cfg, ["rollout.max_new_tokens=10"]))
    assert not [r for r in caplog.records if "cannot be generated" in r.getMessage()]


def test_a_line_json_cannot_read_for_its_size_is_refused_with_its_line(tmp_path):
    """Python's JSON reader refuses an integer over 4300 digits (a ValueError) and
    nesting about a thousand deep (a RecursionError), even in a field laminar ignores:
    each was a raw traceback, not a DataError naming the line and the fix."""
    f = tmp_path / "p.jsonl"
    good = '{"prompt": "n 2 >", "answer": "1 2"}\n'
    f.write_text(good + '{"prompt": "n 2 >", "answer": "1 2", "id": ' + "1" * 5000 + "}\n")
    with pytest.raises(
        DataError, match=r"p.jsonl:2: a number too long to read .*write very long numbers as"
    ):
        jsonl_prompts(f)
    deep = "[" * 100_000 + "]" * 100_000
    f.write_text(good * 2 + '{"prompt": "n 2 >", "answer": "1 2", "x": ' + deep + "}\n")
    with pytest.raises(DataError, match=r"p.jsonl:3: JSON nested too deeply .*nest less deeply"):
        jsonl_prompts(f)


def test_a_reward_module_that_exits_blocks_or_is_a_path_is_named(tmp_path, monkeypatch):
    """Preflight imported the reward's module bare in the driver: one that exits as it is
    imported (`sys.exit`, an argparse parse at its top) ended `laminar run` with its own
    usage line, or none, and not a word of task.reward; one that blocks hung it, nothing
    printed. A file path for the module, or a module not on the path, said nothing of
    the fix (helper 185)."""
    from pipelines.preflight import _check_reward_imports

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "laminar_test_exits.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "laminar_test_argv.py").write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--judge-url')\n"
        "p.parse_args(['--nope'])\n"
    )
    (tmp_path / "laminar_test_blocks.py").write_text("import time\ntime.sleep(20)\n")
    for module in ("laminar_test_exits", "laminar_test_argv"):
        with pytest.raises(
            RewardError,
            match=rf"task.reward '{module}:fn': importing '{module}' raised SystemExit.*"
            r"`if __name__ == '__main__':`",
        ):
            _check_reward_imports(f"{module}:fn", resolve_reward)
    with pytest.raises(
        RewardError,
        match=r"importing 'laminar_test_blocks' did not finish in 0.5 s: it blocks as it is",
    ):
        _check_reward_imports("laminar_test_blocks:fn", resolve_reward, timeout_s=0.5)
    with pytest.raises(
        RewardError, match=r"names a file; .*'myrewards:fn', with its folder \('rw'\) on PYTHONPATH"
    ):
        resolve_reward("rw/myrewards.py:fn")
    with pytest.raises(RewardError, match="put the folder that holds it on PYTHONPATH"):
        resolve_reward("laminar_test_nowhere:fn")
    _check_reward_imports("exact_match", resolve_reward)  # (one that imports: passes)
    # one that sets a signal handler as it is imported: in the main thread alone (it passed
    # before the import moved to a thread, and passes still)
    (tmp_path / "laminar_test_signal.py").write_text(
        "import signal\nsignal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
        "def fn(response, answer): return 1.0\n"
    )
    _check_reward_imports("laminar_test_signal:fn", resolve_reward)


def test_a_misspelt_reward_is_told_what_it_may_mean(tmp_path, monkeypatch):
    """``exact_mach`` (a typo of a built-in), ``rw_cases.ok`` (a dot for the colon), and
    a function name misspelt after the colon: each refusal says what was likely meant."""
    with pytest.raises(RewardError, match=r"nor 'module:function'; did you mean 'exact_match'\?"):
        resolve_reward("exact_mach")
    with pytest.raises(RewardError, match=r"; did you mean 'rw_cases:ok'\?"):
        resolve_reward("rw_cases.ok")
    (tmp_path / "laminar_test_named.py").write_text("def score_add(response, answer): return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"did you mean 'laminar_test_named:score_add'\?"):
        resolve_reward("laminar_test_named:score_ad")
    with pytest.raises(RewardError) as nothing_like:
        resolve_reward("zzz")
    assert "did you mean" not in str(nothing_like.value)
