"""Rule-based verifiable rewards, and the guarded call that scores trajectories.

A reward function is a plain function ``fn(response: str, answer: str) -> float``. Name
one in the config as ``task.reward``: a key of :data:`REWARDS` or ``"module:function"``.
:func:`score_batch` runs as a Dask task, on a rollout's worker; a function that raises,
returns a non-finite value or does not return within ``task.reward_timeout_s`` marks that
trajectory (``finish_reason="error"``) instead of killing or stalling the run. With a
timeout the calls run in a child process, killed when a call overruns however it blocks
(C code that holds the GIL included) or replaced when a call ends it
(:mod:`laminar.reward_process`): a fresh interpreter, with the worker's ``sys.path`` and
nothing else of it (no ``get_worker()``, no worker plugin's state). Without one (``null``)
they run in the task's thread, on the worker, and a call that never returns stalls its
rollout's rewards.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import os
import sysconfig
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from laminar.config import FLOAT32_MAX  # (rewards are stored as float32)
from laminar.errors import RewardError

RewardFn = Callable[[str, str], float]


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response equals the answer (ignoring surrounding whitespace), else 0.0.

    >>> exact_match("1 2 3", "1 2 3"), exact_match("1 2", "1 2 3")
    (1.0, 0.0)
    """
    return float(response.strip() == answer.strip())


def prefix_credit(response: str, answer: str) -> float:
    """Partial credit: the fraction of answer symbols matched before the first mistake,
    and 1.0 only for an exact match (a longer response loses the last step's credit).

    >>> prefix_credit("1 2 3", "1 2 3"), prefix_credit("1 2 9", "1 2 3"), prefix_credit("", "1 2")
    (1.0, 0.6666666666666666, 0.0)
    """
    got, want = response.split(), answer.split()
    if got == want:
        return 1.0
    n = 0
    for g, w in zip(got, want, strict=False):
        if g != w:
            break
        n += 1
    return min(n, len(want) - 1) / len(want) if want else 0.0


def length_band(answer: str) -> tuple[int, int] | None:
    """The band ``(lo, hi)`` of a :func:`count_in_range` answer ``"lo hi"`` (two integers
    ``0 <= lo <= hi``), or None where the answer is not one.

    >>> length_band("2 5"), length_band("5 2"), length_band("1 2 3")
    ((2, 5), None, None)
    """
    try:
        lo, hi = (int(x) for x in answer.split())
    except ValueError:
        return None
    return (lo, hi) if 0 <= lo <= hi else None


def count_in_range(response: str, answer: str) -> float:
    """The ``count_range`` task's reward: for a response of a length within the band
    ``answer = "lo hi"``, the fraction of its symbols that count right (symbol ``i`` is
    ``i``); 0.0 for any other length.

    Per-symbol credit keeps the reward neutral to length: with a mistake rate ``e`` per
    symbol, every length in the band expects ``1 − e``, so RL improves the counting and
    leaves the length distribution (the workload's shape) where the prompts put it. An
    all-or-nothing reward would favour the shortest lengths, which have the fewest
    chances to err.

    >>> count_in_range("1 2 3", "2 5"), count_in_range("1 2 3 4 5 6", "2 5")
    (1.0, 0.0)
    >>> count_in_range("1 9 3 4", "1 5"), count_in_range("", "1 5")
    (0.75, 0.0)
    """
    band = length_band(answer)
    if band is None:
        raise RewardError(
            f"count_in_range needs the answer 'lo hi', two integers 0 <= lo <= hi, got "
            f"{answer!r}; it scores the count_range task"
        )
    lo, hi = band
    got = response.split()
    if not lo <= len(got) <= hi:
        return 0.0
    if not got:  # (a band from 0: counting to 0 is saying nothing, and right)
        return 1.0
    return sum(g == str(i) for i, g in enumerate(got, start=1)) / len(got)


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "prefix_credit": prefix_credit,
    "count_in_range": count_in_range,
}


# A reward that has failed on this many responses and scored none stops what it scores:
# the run (over REWARD_FAILURE_WINDOW_S, pipelines.driver_polls) and the warm start's
# evaluation. Every failure discards its group, so no batch would ever be trained. So
# does one that has failed on this many and on more than task.reward_max_failure_share
# of its responses (over that window, in the run): it discards nearly every group.
REWARD_FAILURES_TO_STOP = 64
# The run's window for that rule (pipelines.driver_polls): it lets a reward service that
# starts late, or restarts, catch up.
REWARD_FAILURE_WINDOW_S = 60.0

# The run's window for the share rule (task.reward_max_failure_share,
# pipelines.driver_polls), counted from its first score: a judge service that restarts,
# every call failing meanwhile, costs a share of it (at 0.25, an outage of up to 75 s
# goes on).
REWARD_SHARE_WINDOW_S = 300.0

# A reward that has failed on this share or more of the responses of the last
# OVERWHELMED_WINDOW_S (and on REWARD_FAILURES_TO_STOP or more) stops the run, whatever
# it scored (pipelines.driver_polls): a group is kept only when all its responses
# scored, so next to none is. The window is twice the never-scores rule's: an outage
# of up to a minute (a late start, a restart) leaves it half scored.
OVERWHELMED_SHARE = 0.9
OVERWHELMED_WINDOW_S = 2 * REWARD_FAILURE_WINDOW_S

# What marks a call cut at ``task.reward_timeout_s`` (:mod:`laminar.reward_process`).
TIMED_OUT = "did not return within task.reward_timeout_s"


def timed_out(error: str | None) -> bool:
    """Whether a :class:`Score`'s ``error`` is a call cut at ``task.reward_timeout_s``."""
    return bool(error) and TIMED_OUT in error


def never_scores(reward: str, errors: int, seconds: float, latest: str, what: str = "") -> str:
    """Why a run (or ``what`` of it: "scoring the warm start") stops when ``task.reward``
    has failed on all ``errors`` responses given to it in ``seconds`` and scored none."""
    doing = f", {what}" if what else ""
    return (
        f"task.reward {reward!r} failed on all {errors} responses it was given and scored "
        f"none in {seconds:.0f} s{doing} (latest: {latest}); fix the function, or what it "
        "needs on the workers"
    )


def past_share(failures: int, scored: int, max_share: float) -> bool:
    """The share rule (``task.reward_max_failure_share``), the run's over its window and
    the warm start's over its scoring: failed on :data:`REWARD_FAILURES_TO_STOP` or more
    responses, and on more than ``max_share`` of them (at 1.0, never).

    >>> past_share(64, 192, 0.25), past_share(65, 192, 0.25), past_share(63, 0, 0.25)
    (False, True, False)
    """
    return failures >= REWARD_FAILURES_TO_STOP and failures > max_share * (failures + scored)


def fails_too_often(
    reward: str, failures: int, scored: int, max_share: float, where: str, latest: str
) -> str:
    """Why a run (or its warm start's scoring) stops when ``task.reward`` has failed on
    more than ``max_share`` (``task.reward_max_failure_share``) of the responses given to
    it ``where``: ``failures`` of them, ``scored`` scored. Each failure discards its whole
    group, so such a run would train only on the few groups whose every response
    happened to score (a biased few: half failing discards 99.6% of groups of 8).

    >>> why = fails_too_often("m:f", 120, 136, 0.25, "in the last 300 s", "reward m:f returned nan")
    >>> print(why)
    task.reward 'm:f' failed on 120 of the 256 responses it was given in the last 300 s, a \
share of 0.47, over task.reward_max_failure_share=0.25; each failure discards its whole \
group, so the run would train only on the few groups whose every response scored (latest: \
reward m:f returned nan); fix the function, or the service it calls, or raise \
task.reward_max_failure_share (up to 1.0: only a reward that never scores stops the run) \
to train on the groups it does score
    """
    return (
        f"task.reward {reward!r} failed on {failures} of the {failures + scored} responses "
        f"it was given {where}, a share of {failures / (failures + scored):.2f}, over "
        f"task.reward_max_failure_share={max_share:g}; each failure discards its whole "
        "group, so the run would train only on the few groups whose every response scored "
        f"(latest: {latest}); fix the function, or the service it calls, or raise "
        "task.reward_max_failure_share (up to 1.0: only a reward that never scores stops "
        "the run) to train on the groups it does score"
    )


def fails_nearly_always(
    reward: str, failures: int, scored: int, share: float, window_s: float, latest: str
) -> str:
    """Why a run stops when ``task.reward`` has failed on ``share`` (90%) or more of the
    responses of the last ``window_s``, ``failures`` of them, ``scored`` scored.

    >>> print(fails_nearly_always("m:f", 990, 10, 0.9, 120, "reward m:f returned None"))
    task.reward 'm:f' failed on 990 of the 1000 responses it was given in the last 120 s \
(99%, at least 90%); a group is trained on only when every response in it scored, so \
nearly every group is discarded and the run would train on next to nothing (latest: \
reward m:f returned None); fix the function (a reward returns a number for every \
response, e.g. 0.0 for a wrong one), or the service it calls
    """
    given = failures + scored
    shown = f"{failures / given:.0%}" if failures < given else "all"
    if failures < given and shown == "100%":
        shown = ">99%"
    return (
        f"task.reward {reward!r} failed on {failures} of the {given} responses it was "
        f"given in the last {window_s:.0f} s ({shown}, at least {share:.0%}); a group is "
        "trained on only when every response in it scored, so nearly every group is "
        f"discarded and the run would train on next to nothing (latest: {latest}); fix "
        "the function (a reward returns a number for every response, e.g. 0.0 for a "
        "wrong one), or the service it calls"
    )


def resolve_reward(name: str) -> RewardFn:
    """The reward function called ``name`` (a :data:`REWARDS` key or ``module:function``)."""
    if name in REWARDS:
        return REWARDS[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise RewardError(
            f"task.reward {name!r} is neither a built-in reward {sorted(REWARDS)} nor "
            f"'module:function'{_did_you_mean(name)}"
        )
    if "/" in module or "\\" in module or module.endswith(".py"):
        folder, _, file = module.replace("\\", "/").rpartition("/")
        raise RewardError(
            f"task.reward {name!r} names a file; it takes a module name: "
            f"'{file.removesuffix('.py')}:{attr}', with its folder "
            f"({folder or '.'!r}) on PYTHONPATH (the workers' too), or the module installed"
        )
    try:
        imported = importlib.import_module(module)
    except ImportError as e:
        raise RewardError(
            f"task.reward {name!r} cannot be imported ({e}); the module must be importable "
            "by the driver and on every Dask worker: put the folder that holds it on "
            "PYTHONPATH (a local cluster's workers inherit the driver's environment, a "
            "Slurm job the submitting shell's), or install it (pip install -e .); the "
            "working directory is not on the path of the `laminar` command"
        ) from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 — a module that fails, or exits, as it is imported
        # (a bug, a syntax error; sys.exit or an argparse parse at the top of a script,
        # which would end the driver with its own usage line and no word of the reward)
        raise RewardError(
            f"task.reward {name!r}: importing {module!r} raised {_said(e)}"
            + (
                "; a module that exits as it is imported (sys.exit, or argparse parsing "
                "at the top) cannot be a reward: move that under "
                "`if __name__ == '__main__':`"
                if isinstance(e, SystemExit)
                else ""
            )
        ) from None
    fn = getattr(imported, attr, None)
    if fn is None:
        close = difflib.get_close_matches(attr, [n for n in dir(imported) if n[:1] != "_"], 1)
        raise RewardError(
            f"task.reward {name!r}: module {module!r} imports, but has no {attr!r} "
            f"(from {getattr(imported, '__file__', None) or module!r}); check the name "
            "after the colon" + (f"; did you mean '{module}:{close[0]}'?" if close else "")
        )
    if not callable(fn):
        raise RewardError(f"task.reward {name!r} is not callable")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        # (called, it returns a coroutine, never a number: every trajectory an error)
        raise RewardError(
            f"task.reward {name!r} is an async function; a reward returns its number: "
            "make it a plain def (for a judge service, call it synchronously, e.g. "
            "asyncio.run(...) inside), bounded by task.reward_timeout_s"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # (some builtins have none to read: called as they are)
        return fn
    try:
        signature.bind("response", "answer")
    except TypeError as e:
        # (found here, before the warm start; called, every trajectory would be an error)
        raise RewardError(
            f"task.reward {name!r} cannot be called as fn(response, answer) ({e}); a "
            f"reward takes the response and the answer, two strings (it has {signature})"
        ) from None
    return fn


def _did_you_mean(name: str) -> str:
    """A hint for a ``task.reward`` that is neither: the built-in it is a typo of, or
    ``module:function`` for a dotted ``module.function``.

    >>> _did_you_mean("exact_mach"), _did_you_mean("rw_cases.ok"), _did_you_mean("zzz")
    ("; did you mean 'exact_match'?", "; did you mean 'rw_cases:ok'?", '')
    """
    if close := difflib.get_close_matches(name, REWARDS, 1):
        return f"; did you mean {close[0]!r}?"
    module, dot, attr = name.rpartition(".")
    if dot and module and attr.isidentifier():
        return f"; did you mean '{module}:{attr}'?"
    return ""


def _reward_value(value) -> float:
    """A reward function's return value as a float; NaN for what is not a number (a
    string, ``None``): such a value marks the trajectory, as a raise does."""
    if isinstance(value, str | bytes | bytearray):
        return math.nan
    try:
        return float(value)
    except Exception:  # (a user's value may raise anything as it converts: mark, don't crash)
        return math.nan


def _shown(value, limit: int = 200) -> str:
    """``repr(value)`` for an error message, cut at ``limit`` characters (a reward
    error is kept per rollout and logged), or its type if even that raises."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 — a user's object: say what it is
        return f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[:limit] + "..."


def _said(error: BaseException) -> str:
    """``Type: message`` for an error message; the type alone where the error has no
    message, or its ``__str__`` raises (a user's exception class: say what it is)."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 — raised by a user's __str__: it must not escape
        text = ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@dataclass(frozen=True)
class Score:
    """The outcome of scoring one response: a finite reward, or the error that prevented
    it, with its ``context``: the line of the function's own code that raised
    (``file:line in function``) and the response and answer it was given (shortened).

    >>> Score(float("nan"), "reward m:f raised KeyError: 'x'", "at m.py:3 in f").said
    "reward m:f raised KeyError: 'x' (at m.py:3 in f)"
    """

    reward: float
    error: str | None = None
    context: str | None = field(default=None, repr=False)

    @property
    def said(self) -> str | None:
        """The error with its context, as a warning and ``last_reward_error`` say it."""
        if self.error is None or not self.context:
            return self.error
        return f"{self.error} ({self.context})"


def score_batch(
    reward_name: str,
    items: Sequence[tuple[str, str, bool]],
    truncated_reward: float = 0.0,
    timeout_s: float | None = None,
) -> list[Score]:
    """Score ``(response, answer, ended_with_eos)`` items; runs as a Dask task.

    Responses cut at the length limit get ``truncated_reward`` without calling the function.
    With ``timeout_s`` the calls are made in a child process (kept for the next batch), and
    one that takes longer is cut however it blocks (:mod:`laminar.reward_process`): its
    item is marked, and the calls after it go to a new child; a call that ends that
    process (``os._exit``, a crash) marks its item too. Where no child can be had (one
    cannot be started, or ends before it has loaded the function, twice) the items are
    marked; only a function that a running child cannot load raises
    :class:`~laminar.errors.RewardError`. Without a timeout the calls are made here.

    >>> score_batch("exact_match", [("1 2", "1 2", True), ("1 2", "1 2", False)])
    [Score(reward=1.0, error=None), Score(reward=0.0, error=None)]
    >>> score_batch("laminar.rewards:_broken", [("1", "1", True)])[0].error
    'reward laminar.rewards:_broken raised ZeroDivisionError: division by zero'
    >>> score_batch("laminar.rewards:_broken", [("1", "2", True)])[0].context  # doctest: +ELLIPSIS
    "at .../laminar/rewards.py:... in _broken; response '1', answer '2'"
    >>> score_batch("laminar.rewards:_hangs", [("hang", "1", True)], timeout_s=0.05)[0].error
    'reward laminar.rewards:_hangs did not return within task.reward_timeout_s=0.05 s'
    """
    calls = [(r, a) for r, a, ended in items if ended]
    if timeout_s is None:
        fn = resolve_reward(reward_name)
        scores = [
            _scored(reward_name, *outcome, call)
            for call, outcome in zip(calls, _outcomes(fn, calls), strict=False)
        ]
    else:
        from laminar.reward_process import scores_in_child

        # A module:function is imported in the child only, by its name: not in the worker,
        # where its import (a model loaded, a service started) would run for nothing, and
        # a crash or hang in it would take the worker down, past the timeout's reach.
        by_name = reward_name not in REWARDS and ":" in reward_name
        fn = None if by_name else resolve_reward(reward_name)
        scores = list(scores_in_child(reward_name, fn, calls, timeout_s))
    scored = iter(scores)
    return [next(scored) if ended else Score(float(truncated_reward)) for _, _, ended in items]


# Where a reward's frames are not its author's: the standard library and installed
# packages (a frame of a library the function called is not the line to fix).
_LIBRARY_DIRS = tuple(
    {
        os.path.join(os.path.realpath(p), "")
        for k in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(k))
    }
)


def _own_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the reward's own code in ``error``'s traceback: the
    deepest outside the standard library and installed packages (where a library it
    called raised, the line that called it), else the deepest; not this module's
    calling frame (:func:`_outcomes`)."""
    try:
        frames = [
            f
            for f in traceback.extract_tb(error.__traceback__)
            if not (f.name == "_outcomes" and f.filename == __file__)
        ]
    except Exception:  # noqa: BLE001 — a user's traceback object: none to show then
        return None
    own = [f for f in frames if not os.path.realpath(f.filename).startswith(_LIBRARY_DIRS)]
    return (own or frames or [None])[-1]


def call_context(call: tuple[str, str] | None, error: BaseException | None = None) -> str | None:
    """What a failed call's error is shown with (:attr:`Score.context`): where the
    function raised ``error``, and the ``(response, answer)`` it was given, each cut
    at 80 characters.

    >>> call_context(("12", "3 4"))
    "response '12', answer '3 4'"
    >>> call_context(("x" * 500, ""))[-20:]  # (the repr's first 80 characters, and "...")
    "xxxxx..., answer ''"
    """
    parts = []
    if error is not None and (frame := _own_frame(error)) is not None:
        parts.append(f"at {frame.filename}:{frame.lineno} in {frame.name}")
    if call is not None:
        parts.append(f"response {_shown(call[0], 80)}, answer {_shown(call[1], 80)}")
    return "; ".join(parts) or None


def _scored(
    reward_name: str,
    raw: object,
    error: BaseException | None,
    call: tuple[str, str] | None = None,
) -> Score:
    """The score of one ``call``: its value, or the error that marks its item, with
    its :func:`call_context`."""
    if error is not None:  # a user function may raise anything: mark, don't crash
        return Score(
            math.nan, f"reward {reward_name} raised {_said(error)}", call_context(call, error)
        )
    value = _reward_value(raw)
    if not math.isfinite(value):
        # (a number that is not finite is its own message; anything else, what it takes)
        number = isinstance(raw, int | float) or hasattr(raw, "__float__")
        return Score(
            math.nan,
            f"reward {reward_name} returned {_shown(raw)}"
            + (
                ""
                if number
                else f" (a {type(raw).__name__}); a reward returns one number a response"
            ),
            call_context(call),
        )
    if abs(value) > FLOAT32_MAX:  # (stored as float32: inf, and a group's variance)
        return Score(
            math.nan,
            f"reward {reward_name} returned {_shown(raw)}, beyond float32's range "
            f"(±{FLOAT32_MAX:.4g}) in which rewards are stored; scale it down",
            call_context(call),
        )
    return Score(value)


def _outcomes(
    fn: RewardFn, calls: Sequence[tuple[str, str]], main_interrupts: bool = True
) -> Iterator[tuple[object, BaseException | None]]:
    """``(value, None)`` or ``(None, exception)`` for each call, in order, made here.

    A function's ``SystemExit`` (``sys.exit(3)``) or ``KeyboardInterrupt`` is its
    error too: uncaught, it escaped the task (or ended the scoring process, and the
    batch's later calls with it). Only a ``KeyboardInterrupt`` on the main thread goes
    on up, with ``main_interrupts``: that is Ctrl-C, whatever was running when it came.
    (The ``yield`` stands outside the ``try``: a generator closed there gets
    ``GeneratorExit``, which is not the function's.)"""
    for response, answer in calls:
        try:
            outcome = fn(response, answer), None
        except KeyboardInterrupt as e:
            if main_interrupts and threading.current_thread() is threading.main_thread():
                raise
            outcome = None, e
        except BaseException as e:  # noqa: BLE001 — a user function may raise anything
            outcome = None, e
        yield outcome


def _broken(response: str, answer: str) -> float:
    """A reward that always raises; used by tests and doctests of the error path."""
    return 1 / 0


def _hangs(response: str, answer: str) -> float:
    """:func:`exact_match`, except that for the response ``hang`` it does not return for
    an hour (a judge service that hangs)."""
    import time

    if response == "hang":
        time.sleep(3600)
    return exact_match(response, answer)


def _slow(response: str, answer: str) -> float:
    """:func:`exact_match` after 0.25 s: rewards stay in flight (the fault tests)."""
    import time

    time.sleep(0.25)
    return exact_match(response, answer)


def _half_flat(response: str, answer: str) -> float:
    """The same reward for every response to a prompt whose answer has an even number
    of symbols, else the response's length: half the groups have no GRPO signal, so
    dynamic sampling filters them (the schedule tests)."""
    if len(answer.split()) % 2 == 0:
        return 0.0
    return float(len(response))


def _half_nan(response: str, answer: str) -> float:
    """:func:`exact_match`, except that it returns NaN for about half the responses (by a
    hash of the response, the same in every process): a reward that fails on half its
    responses (the run's rule on the share that fails, task.reward_max_failure_share)."""
    import zlib

    if zlib.crc32(response.encode()) % 2:
        return math.nan
    return exact_match(response, answer)


def _raises_on_some(response: str, answer: str) -> float:
    """:func:`exact_match`, except that it raises ``IndexError`` on every response to
    about one prompt in eight (by a hash of the answer, the same in every process): a
    reward with a bug that fails on a few responses, and not often enough to stop the
    run (the summary's reward errors)."""
    import zlib

    if zlib.crc32(answer.encode()) % 8 == 0:
        return float(response.split()[99])
    return exact_match(response, answer)


def _mostly_none(response: str, answer: str) -> float | None:
    """1.0 for about one response in fifty (at random), ``None`` for the rest: a reward
    that fails on nearly every response, and scores a few (the run's rule on a reward
    that fails nearly always)."""
    import random

    return 1.0 if random.random() < 0.02 else None
