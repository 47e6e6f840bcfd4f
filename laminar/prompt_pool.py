"""The prompt pool: hands prompt groups to rollouts, with back-pressure.

:class:`PromptPoolCore` is the pure logic (what to hand out, what is in flight);
:class:`PromptPool` is the Dask actor around it. A group is dispatched to one rollout as a
unit and stays *outstanding* until the buffer reports it consumed or discarded; dispatch
pauses while ``max_outstanding`` groups are outstanding, so a fast rollout tier cannot
grow the buffer without bound.
"""

from __future__ import annotations

import json
from pathlib import Path

from laminar.config import RunConfig
from laminar.contract import PromptGroup
from laminar.errors import DataError
from laminar.tasks import Prompt, iter_epochs, jsonl_prompts, synthetic_prompts


class PromptPoolCore:
    """Which prompt groups are handed out and which are still outstanding.

    >>> core = PromptPoolCore([(Prompt(0, "n 2 >", "1 2"), (1, 5))], group_size=4,
    ...                       max_outstanding=2, seed=0)
    >>> [g.prompt_uid for g in core.acquire(5)]
    ['p00000000', 'p00000001']
    >>> core.acquire(1), core.release(["p00000000"]), len(core.acquire(1))
    ([], None, 1)
    """

    def __init__(
        self,
        prompts: list[tuple[Prompt, tuple[int, ...]]],
        *,
        group_size: int,
        max_outstanding: int,
        seed: int,
        start: int = 0,
        outstanding: tuple[str, ...] = (),
        reissue: dict[str, tuple[int, int, tuple[int, ...]]] | None = None,
    ) -> None:
        """``start``: groups already dispatched by the run being resumed (the data
        position): the order continues after them, and so do the prompt uids.
        ``outstanding``: its groups the buffer holds again (they count against
        ``max_outstanding`` until they leave). ``reissue``: of those, the groups whose
        missing samples are handed out again first (prompt uid -> prompt key, group size,
        sample indices; :class:`storage.resume.ResumePlan`)."""
        if not prompts:
            raise DataError("the prompt pool is empty; check task.prompt_file or task.num_prompts")
        self.prompts = prompts
        self.group_size = group_size
        self.max_outstanding = max_outstanding
        self._order = iter_epochs(range(len(prompts)), seed)
        self.epoch = 0
        for _ in range(start):
            self.epoch, _ = next(self._order)
        self.outstanding: set[str] = set(outstanding)
        self.n_dispatched = start
        self.n_released = 0
        self.n_reissued = 0
        by_key = {p.key: (p, tokens) for p, tokens in prompts}
        self._reissue: list[PromptGroup] = []
        for uid, (key, size, samples) in (reissue or {}).items():
            if key not in by_key:
                raise DataError(
                    f"the resumed run's group {uid} is of prompt {key}, which the dataset no "
                    "longer has: resume with the task settings (or prompt file) it ran with"
                )
            prompt, tokens = by_key[key]
            group = PromptGroup(uid, key, tokens, prompt.answer, size, self.epoch, samples)
            self._reissue.append(group)
            self.outstanding.add(uid)

    def acquire(self, n: int) -> list[PromptGroup]:
        """Up to ``n`` groups, fewer (or none) while back-pressure holds. The missing
        samples of a resumed run's groups come first (they are outstanding already)."""
        groups = self._reissue[:n]
        del self._reissue[: len(groups)]
        self.n_reissued += len(groups)
        room = max(0, self.max_outstanding - len(self.outstanding))
        for _ in range(min(n - len(groups), room)):
            self.epoch, idx = next(self._order)
            prompt, tokens = self.prompts[idx]
            uid = f"p{self.n_dispatched:08d}"
            self.n_dispatched += 1
            self.outstanding.add(uid)
            groups.append(
                PromptGroup(uid, prompt.key, tokens, prompt.answer, self.group_size, self.epoch)
            )
        return groups

    def release(self, prompt_uids: list[str]) -> None:
        """Groups that left the system (consumed, evicted or discarded)."""
        for uid in prompt_uids:
            if uid in self.outstanding:
                self.outstanding.remove(uid)
                self.n_released += 1

    def stats(self) -> dict[str, int]:
        return {
            "dispatched": self.n_dispatched,
            "released": self.n_released,
            "outstanding": len(self.outstanding),
            "reissued": self.n_reissued,
            "epoch": self.epoch,
        }


DATA_STATE = "data_state.json"  # in a checkpoint folder: where the prompt order stood


def data_position(checkpoint: str | None) -> int:
    """Prompt groups dispatched by the run that wrote ``checkpoint`` (0: start afresh)."""
    if checkpoint is None:
        return 0
    path = Path(checkpoint) / DATA_STATE
    if not path.exists():
        return 0
    return int(json.loads(path.read_text())["dispatched"])


def load_prompts(cfg: RunConfig) -> list[Prompt]:
    """The run's prompts: the JSONL file if one is named, else the synthetic task."""
    t = cfg.task
    if t.prompt_file:
        return jsonl_prompts(t.prompt_file)
    return synthetic_prompts(
        t.name,
        size=t.num_prompts,
        median_len=t.median_len,
        tail_ratio=t.tail_ratio,
        max_len=t.max_len,
        seed=cfg.seed + 1,
    )


class PromptPool:
    """Dask actor around :class:`PromptPoolCore` (placed on a ``data`` worker)."""

    def __init__(self, cfg: RunConfig, policy_dir: str, resume=None) -> None:
        """``resume``: the :class:`storage.resume.ResumePlan` of a run resumed in place
        (where its prompt order stood, and the groups its buffer holds again)."""
        from transformers import AutoTokenizer

        from laminar.model import encode_prompt

        tok = AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
        prompts = load_prompts(cfg)
        max_prompt = cfg.rollout.max_seq_len - cfg.rollout.max_new_tokens
        encoded = []
        for p in prompts:
            ids = tuple(encode_prompt(tok, p.text))
            if len(ids) > max_prompt:
                raise DataError(
                    f"prompt {p.key} has {len(ids)} tokens, more than rollout.max_seq_len - "
                    f"rollout.max_new_tokens = {max_prompt}; raise rollout.max_seq_len"
                )
            if tok.unk_token_id is not None and tok.unk_token_id in ids:
                raise DataError(
                    f"prompt {p.key} ({p.text!r}) has symbols outside the model's vocabulary"
                )
            encoded.append((p, ids))
        self.core = PromptPoolCore(
            encoded,
            group_size=cfg.rollout.group_size,
            max_outstanding=cfg.buffer.max_outstanding_groups,
            seed=cfg.seed,
            start=data_position(cfg.trainer.resume_from) if resume is None else resume.start,
            outstanding=() if resume is None else tuple(resume.readmit_groups),
            reissue=None if resume is None else resume.reissue,
        )

    async def acquire(self, n: int) -> list[PromptGroup]:
        return self.core.acquire(n)

    async def release(self, prompt_uids: list[str]) -> None:
        self.core.release(prompt_uids)

    async def stats(self) -> dict[str, int]:
        return self.core.stats()
