"""The reward of the worked example (examples/custom_task/README.md): adding two numbers.

A reward is a plain function ``fn(response, answer) -> float``, named in the config as
``task.reward: add_reward:add_reward`` (module, colon, function), with this folder on
``PYTHONPATH``. It gets the model's response and the prompt file's ``answer`` for that
prompt, both strings, and nothing else (not the prompt, nor other fields of the line).

It returns a number for every response, 0.0 for one that is not a number at all: a
raise, ``None`` or NaN marks the response a reward error, and discards its whole group
(a run whose reward fails on many responses stops: docs/configuration.md, task.reward).
"""

from __future__ import annotations


def add_reward(response: str, answer: str) -> float:
    """1.0 for the right sum; partial credit for a number near it (a signal for RL to
    climb before the model gets sums exactly right); 0.0 for anything else.

    >>> add_reward("146", "146"), add_reward("140", "146"), add_reward("", "146")
    (1.0, 0.45, 0.0)
    >>> add_reward("146 146", "146"), add_reward("x", "146")
    (1.0, 0.0)
    """
    words = response.split()
    if not words or not words[0].isdigit():  # (not a number: no credit, not an error)
        return 0.0
    miss = abs(int(words[0]) - int(answer))
    return 1.0 if miss == 0 else round(0.5 * max(0.0, 1 - miss / 60), 4)
