"""The learner: a policy, its optimizer and its version — updates and exact checkpoints.

No Dask here. The :class:`~laminar.trainer.Trainer` actor owns one per rank; a test or a
notebook can drive one directly. One :meth:`Learner.update` consumes one global batch of
complete groups, split into ``trainer.mini_batches`` optimizer steps, and counts as one
version. With ``world_size > 1`` every rank calls :meth:`update` with the same batch and
computes a shard of it; gradients are summed over ranks (``all_reduce``), so every rank
takes the same steps and holds the same weights.

A checkpoint (:meth:`Learner.save`) is a plain HF folder (safetensors weights, config,
tokenizer) plus ``optimizer.pt``, ``rng.pt`` and ``trainer_state.json``, and
``manifest.json``: the size and digest of each file (:mod:`laminar.files`). Resuming from
it (``Learner(..., resume_from=dir)``) continues bit-identically to an uninterrupted run
fed the same batches; a checkpoint of another model shape or optimizer setting is refused
with the mismatch named, and one whose files changed since they were written (a flipped
byte, a file cut short or replaced) with the file named.
"""

from __future__ import annotations

import json
import logging
import random
import shlex
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from laminar.config import RunConfig
from laminar.contract import Trajectory
from laminar.errors import LaminarError
from laminar.update import (
    STEP_COUNTS,
    check_prompts,
    failing_together,
    grpo_step,
    metric_weight,
    trajectory_logprobs,
)

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
# Trainer settings a resumed run must share with its checkpoint (the optimizer's state is
# only meaningful under them); everything else — steps, clipping, batch sizes — may change.
OPTIMIZER_FIELDS = ("lr", "weight_decay", "betas")
# Model-config keys that define the architecture (a checkpoint must match them).
ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


# The files every checkpoint has (Learner.save writes them; a resume refuses one without).
CHECKPOINT_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",  # (without it the tokenizer loads with no EOS, silently)
    "model.safetensors",
    "optimizer.pt",
    "rng.pt",
    "trainer_state.json",
)


def checkpoint_files(ckpt: Path) -> tuple[str, ...]:
    """:data:`CHECKPOINT_FILES` with the weights as :meth:`Learner.save` wrote them:
    ``model.safetensors``, or, saved sharded (a model past ``save_pretrained``'s
    ``max_shard_size``), its index and the shards it names
    (:func:`laminar.model.weight_files`); a checkpoint of one was refused as lacking
    ``model.safetensors``. An index that cannot be read is a :class:`CheckpointError`."""
    from laminar.model import WEIGHTS_INDEX, weight_files

    try:
        weights = weight_files(ckpt)
    except (OSError, ValueError) as e:
        raise _damaged(ckpt / WEIGHTS_INDEX, e) from None
    return (*(f for f in CHECKPOINT_FILES if f != "model.safetensors"), *weights)


class CheckpointError(LaminarError):
    """A checkpoint is missing, incomplete, or does not match the model or config."""


def check_groups(batch: list[Trajectory]) -> None:
    """Refuse a batch with a group not whole: GRPO's advantages compare a group's
    rewards with each other, and a group trained short trains on wrong advantages,
    silently. Whole is each of its samples once: ``sample_idx`` 0 .. ``group_size`` - 1,
    not just as many rows (one sample twice and another missing would train one draw
    twice, its advantage and the others' from the wrong rewards). The buffer releases
    whole groups only; this names what broke that, before any weight moves. (A reward
    that is not finite is not refused here: it makes the step non-finite, which is
    skipped and counted.)"""
    groups: dict[str, list[Trajectory]] = {}
    for x in batch:
        groups.setdefault(x.prompt_uid, []).append(x)
    for uid, members in groups.items():
        sizes = sorted({x.group_size for x in members})
        if len(sizes) > 1:
            raise LaminarError(
                f"group {uid!r}: its trajectories in the batch disagree on its size "
                f"(group_size {sizes}); the buffer releases whole groups only"
            )
        size = sizes[0]
        if len(members) != size:
            raise LaminarError(
                f"group {uid!r}: {len(members)} of its {size} trajectories in the batch "
                "(GRPO's advantages need the whole group); the buffer releases whole "
                "groups only"
            )
        seen = Counter(int(x.sample_idx) for x in members)
        if set(seen) != set(range(size)):
            twice = sorted(i for i, n in seen.items() if n > 1)
            missing = sorted(set(range(size)) - set(seen))
            other = sorted(set(seen) - set(range(size)))
            what = [
                *([f"sample_idx {twice} more than once"] if twice else []),
                *([f"{missing} missing"] if missing else []),
                *([f"{other} outside 0..{size - 1}"] if other else []),
            ]
            raise LaminarError(
                f"group {uid!r}: its {size} trajectories in the batch are not its {size} "
                f"samples: {', '.join(what)} (GRPO's advantages need each sample once); "
                "the buffer releases whole groups only"
            )


class Learner:
    """Policy + AdamW + version counter; see the module docstring.

    ``all_reduce(tensor, op)`` reduces a tensor in place over the ranks (``op`` "sum" or
    "max"); :func:`torch_all_reduce` is the ``torch.distributed`` one.
    """

    def __init__(
        self,
        cfg: RunConfig,
        policy_dir: str | Path,
        *,
        resume_from: str | Path | None = None,
        rank: int = 0,
        world_size: int = 1,
        all_reduce: Callable | None = None,
    ) -> None:
        from laminar.model import check_policy_dir, load_policy

        if world_size > 1 and all_reduce is None:
            raise ValueError("world_size > 1 needs an all_reduce")
        self.cfg = cfg
        self.rank, self.world_size, self.all_reduce = rank, world_size, all_reduce
        torch.manual_seed(cfg.seed)
        self.version = 0
        state = None
        if resume_from is not None:  # the policy's config is all the check needs
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(check_policy_dir(policy_dir), local_files_only=True)
            # (a run's pre-start check warned of a checkpoint it cannot verify already)
            state = check_checkpoint(resume_from, config, cfg, warn_unchecked=False)
        self.model, self.tok = load_policy(policy_dir if resume_from is None else resume_from)
        t = cfg.trainer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=t.betas
        )
        self.skipped_steps = 0
        # Version numbers this policy's lineage skipped: a trainer restarted within the run
        # numbers its updates after the lost one's last version (laminar.trainer.Trainer
        # ``after_version``). ``version - skipped_versions`` is the updates it has made.
        self.skipped_versions = 0
        # The trainer restarts (V, M) of this policy's run, in order, lost branches too
        # (laminar.buffer_core.BufferCore.lag): a resumed run's buffer starts with its
        # checkpoint's (storage.resume.plan_resume). The trainer sets them (the driver's
        # list); resumed from a checkpoint, they are its own.
        self.restarts: list[tuple[int, int]] = []
        self._part_applied = 0  # update_part: steps applied so far in this global batch
        if state is not None:
            self._restore(Path(resume_from).expanduser(), state)
        self.reference = None  # the warm-started policy, frozen: the KL penalty's anchor
        if cfg.trainer.kl_coef:
            self.reference, _ = load_policy(policy_dir)
            self.reference.eval().requires_grad_(False)

    # -- training ---------------------------------------------------------------------------
    def update(self, batch: list[Trajectory]) -> dict[str, float]:
        """Train on one global batch of complete groups; returns metrics.

        The batch's groups are split into ``trainer.mini_batches`` optimizer steps
        (advantages are per group, so each mini-batch holds whole groups), shuffled
        (:func:`split_groups`). A step
        whose loss or gradient is not finite is skipped and counted; the version advances
        if at least one step was taken (``metrics["applied_steps"]``).
        """
        t = self.cfg.trainer
        # The whole batch checked before any step: a bad group or row in a later
        # mini-batch must not fail the update after earlier steps moved the weights.
        check_groups(batch)
        check_prompts([x.prompt_tokens for x in batch])
        uids = list(dict.fromkeys(x.prompt_uid for x in batch))
        parts = split_groups(uids, t.mini_batches, seed=self.cfg.seed)
        # Decoupled PPO's proximal policy is the weights before this batch's first step;
        # with several steps, later ones need those logprobs computed up front.
        prox = None
        if t.correction == "decoupled" and len(parts) > 1:
            # (a rank failing alone would hang the others)
            ranks = self.all_reduce if self.world_size > 1 else None
            with failing_together(ranks, self.rank, self.world_size):
                prox = dict(zip((x.uid for x in batch), self.logprobs(batch), strict=True))
        steps = []
        for chosen in parts:
            mini = [x for x in batch if x.prompt_uid in chosen]
            steps.append(self._step(mini, None if prox is None else [prox[x.uid] for x in mini]))
        totals = step_means(steps, t.loss_agg)
        applied = len(steps) - int(sum(m["skipped"] for m in steps))
        self.skipped_steps += len(parts) - applied
        if applied:
            self.version += 1
        return {**totals, "mini_batches": float(len(parts)), "applied_steps": float(applied)}

    def update_part(self, part: list[Trajectory], *, last: bool) -> dict[str, float]:
        """One optimizer step on one mini-batch of a global batch whose mini-batches
        arrive one at a time (the stream schedule); the version advances after the
        ``last`` one if any of the batch's steps was applied. Decoupled PPO would need the
        proximal policy of the batch's first step for later parts: refused."""
        if self.cfg.trainer.correction == "decoupled" and self.cfg.trainer.mini_batches > 1:
            raise LaminarError(
                "trainer.correction=decoupled needs every mini-batch of a global batch at "
                "once; the stream schedule trains them as they arrive: use none or tis"
            )
        check_groups(part)
        metrics = self._step(part)
        self._part_applied += int(not metrics["skipped"])
        self.skipped_steps += int(metrics["skipped"])
        applied = self.end_parts() if last else self._part_applied
        return {**metrics, "applied_steps": float(applied)}

    def end_parts(self) -> int:
        """End the global batch of :meth:`update_part` after the parts taken so far (the
        last one, or fewer: the trainer was stopped while waiting for the rest). The
        version advances if any of its steps was applied: those steps moved the weights,
        which must not go on under the version before them. Returns the steps applied."""
        applied, self._part_applied = self._part_applied, 0
        if applied:
            self.version += 1
        return applied

    def logprobs(self, batch: list[Trajectory]) -> list[np.ndarray]:
        """The current policy's logprobs of each trajectory's response tokens."""
        return trajectory_logprobs(
            self.model,
            [x.prompt_tokens for x in batch],
            [x.response_tokens for x in batch],
            pad_token_id=self.tok.pad_token_id,
            temperature=self.cfg.rollout.temperature,
            micro_batch_tokens=self.cfg.trainer.micro_batch_tokens,
        )

    def _loss_mask(self, x: Trajectory) -> np.ndarray:
        """``x``'s loss mask, all zeros for a response cut at its length when
        ``trainer.mask_truncated`` (DAPO's overlong filtering: the tokens of a response
        that never ended would be pushed up or down for an answer it never gave)."""
        if self.cfg.trainer.mask_truncated and x.finish_reason == "length":
            return np.zeros_like(x.loss_mask)
        return x.loss_mask

    def _step(self, batch: list[Trajectory], proximal=None) -> dict[str, float]:
        t = self.cfg.trainer
        groups = {uid: i for i, uid in enumerate(dict.fromkeys(x.prompt_uid for x in batch))}
        return grpo_step(
            self.model,
            self.optimizer,
            [x.prompt_tokens for x in batch],
            [x.response_tokens for x in batch],
            [x.behavior_logprobs for x in batch],
            [self._loss_mask(x) for x in batch],
            # As stored (float32), which the buffer's no-signal filter and a resumed
            # run read too: rewards equal there are equal here (advantages 0), and a
            # group trains alike before and after a resume. (Advantages in float64.)
            torch.tensor([x.reward for x in batch], dtype=torch.float32),
            torch.tensor([groups[x.prompt_uid] for x in batch]),
            pad_token_id=self.tok.pad_token_id,
            clip_low=t.clip_low,
            clip_high=t.clip_high,
            temperature=self.cfg.rollout.temperature,
            max_grad_norm=t.max_grad_norm,
            micro_batch_tokens=t.micro_batch_tokens,
            agg=t.loss_agg,
            clip_c=t.clip_c,
            shard=self.shard(batch) if self.world_size > 1 else None,
            all_reduce=self.all_reduce if self.world_size > 1 else None,
            rank=self.rank,
            world_size=self.world_size,
            correction=t.correction,
            is_cap=t.is_cap,
            proximal_logprobs=proximal,
            ref_model=self.reference,
            kl_coef=t.kl_coef,
            kl_kind=t.kl_kind,
            entropy_coef=t.entropy_coef,
            norm_by_std=t.norm_adv_by_std,
        )

    def shard(self, batch: list[Trajectory]) -> list[int]:
        """This rank's rows: a balanced split of the tokens (longest first, greedy)."""
        sizes = [len(x.prompt_tokens) + len(x.response_tokens) for x in batch]
        load = [0] * self.world_size
        mine = []
        for i in sorted(range(len(batch)), key=lambda i: (-sizes[i], i)):
            r = min(range(self.world_size), key=lambda r: (load[r], r))
            load[r] += sizes[i]
            if r == self.rank:
                mine.append(i)
        return sorted(mine)

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, out: str | Path) -> Path:
        """Write a checkpoint folder; ``trainer_state.json``, then ``manifest.json`` (the
        size and digest of every file, for :func:`check_checkpoint`) last, so a folder
        that has them is complete. ``data_state.json``, which the trainer writes beside
        them and the driver rewrites at the stop, is left out of the manifest."""
        from laminar.files import write_manifest
        from laminar.prompt_pool import DATA_STATE

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(out)
        self.tok.save_pretrained(out)
        torch.save(self.optimizer.state_dict(), out / "optimizer.pt")
        torch.save(
            {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
                # (each GPU's, when the model is on one; None on CPU, where asking
                # would initialise CUDA for GPUs the rollouts may be using)
                "cuda": torch.cuda.get_rng_state_all() if self._on_cuda() else None,
            },
            out / "rng.pt",
        )
        state = {
            "format": CHECKPOINT_FORMAT,
            "version": self.version,
            "seed": self.cfg.seed,
            "skipped_steps": self.skipped_steps,
            "skipped_versions": self.skipped_versions,
            "restarts": [[v, m] for v, m in self.restarts],
            "trainer": self.cfg.trainer.model_dump(mode="json"),
        }
        (out / "trainer_state.json").write_text(json.dumps(state, indent=2))
        write_manifest(out, leave_out=(DATA_STATE,))
        return out

    def _on_cuda(self) -> bool:
        return next(self.model.parameters()).is_cuda

    def _restore(self, ckpt: Path, state: dict) -> None:
        self.optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
        # (the state holds the checkpoint's learning rate: a resume may lower it, as
        # check_checkpoint says; the same one is the same float, bit-identical)
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.trainer.lr
        rng = torch.load(ckpt / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        cuda = rng.get("cuda")  # (older checkpoints, and CPU ones: none)
        if cuda is not None and self._on_cuda():
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
            else:  # (another machine: the CPU-side state still restores exactly)
                logger.warning(
                    "checkpoint %s holds the RNG state of %d GPUs, this process sees %d: "
                    "the GPUs' random streams start afresh",
                    ckpt,
                    len(cuda),
                    torch.cuda.device_count(),
                )
        self.version = int(state["version"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.skipped_versions = skipped_versions(state)
        self.restarts = restarts_of(state, ckpt)


def step_means(steps: list[dict[str, float]], agg: str = "token-mean") -> dict[str, float]:
    """The metrics of one version from those of its optimizer steps (mini-batches), as
    they would be over its whole batch: a mean over loss tokens weighted by each step's
    loss tokens, one following the loss aggregation ``agg`` by its loss tokens
    (``token-mean``) or its rows (``seq-mean-*``), a mean over rows by its rows, a maximum
    the steps' maximum (:func:`laminar.update.metric_weight`); ``grad_norm``, which is
    each step's own, their mean. Over the steps applied (those made the version; a
    skipped step's loss or gradient norm is NaN or infinite), or over all when none
    was; ``skipped`` the fraction skipped. The counts that weigh the steps are not kept.

    >>> step = {"skipped": 0.0}
    >>> step_means([step | {"logprob_diff_max": 3.0, "clip_frac": 0.5, "loss_tokens": 30.0},
    ...             step | {"logprob_diff_max": 1.0, "clip_frac": 0.1, "loss_tokens": 10.0}])
    {'logprob_diff_max': 3.0, 'clip_frac': 0.4, 'skipped': 0.0}
    >>> step_means([{"loss": 1.0, "skipped": 0.0}, {"loss": float("nan"), "skipped": 1.0}])
    {'loss': 1.0, 'skipped': 0.5}
    """
    applied = [m for m in steps if not m["skipped"]] or steps
    out = {}
    for k in steps[0]:
        if k in STEP_COUNTS or k == "skipped":
            continue
        values = [m[k] for m in applied]
        weight = metric_weight(k, agg)
        if k.endswith("_max"):
            out[k] = max(values)
        elif k.endswith("_min"):
            out[k] = min(values)
        else:
            counts = [m.get(weight, 0.0) if weight else 1.0 for m in applied]
            total = sum(counts)
            if not total:  # (no loss token in any step: every such mean is 0 alike)
                counts, total = [1.0] * len(values), float(len(values))
            out[k] = sum(c * v for c, v in zip(counts, values, strict=True)) / total
    out["skipped"] = sum(m["skipped"] for m in steps) / len(steps)
    return out


def skipped_versions(state: dict) -> int:
    """The version numbers a checkpoint's lineage skipped (its ``trainer_state.json``
    ``state``): 0 for one written before laminar recorded them."""
    return int(state.get("skipped_versions", 0))


def checkpoint_skipped_versions(ckpt: str | Path) -> int | None:
    """:func:`skipped_versions` of a checkpoint folder; ``None`` for one written before
    laminar recorded them (its lineage's skips are unknown)."""
    state = _trainer_state(Path(ckpt) / "trainer_state.json")
    return skipped_versions(state) if "skipped_versions" in state else None


def restarts_of(state: dict, ckpt: str | Path | None = None) -> list[tuple[int, int]]:
    """The trainer restarts ``(V, M)`` a checkpoint's ``trainer_state.json`` (``state``)
    records, in order (:attr:`Learner.restarts`). One written before laminar recorded
    them reads as none, said at INFO when ``ckpt`` (its folder) is given: a buffer then
    counts ``max_train_staleness`` by the version numbers (docs/faults.md)."""
    if "restarts" not in state:
        if ckpt is not None:
            logger.info(
                "checkpoint %s records no trainer restarts (written before laminar did): "
                "read as none; max_train_staleness counts the versions before it by "
                "their numbers",
                ckpt,
            )
        return []
    return [(int(v), int(m)) for v, m in state["restarts"]]


def checkpoint_restarts(ckpt: str | Path) -> list[tuple[int, int]]:
    """:func:`restarts_of` a checkpoint folder."""
    ckpt = Path(ckpt).expanduser()
    return restarts_of(_trainer_state(ckpt / "trainer_state.json"), ckpt)


def split_groups(uids: list[str], n: int, *, seed: int) -> list[set[str]]:
    """The groups ``uids`` as ``n`` mini-batches of whole groups (fewer if there are
    fewer groups), in an order drawn from ``seed`` and the groups themselves (their uids),
    not from the order given: the buffer hands groups out as they finished, short ones
    first, and split in that order the first steps took the short responses on fresh
    weights and the last the long ones on the most-moved weights (clipped most), a bias
    by length that verl, which splits its shuffled prompts, does not have. Every
    data-parallel rank draws the same split of a batch, whatever version its learner
    counts (a restart renumbers rank 0's alone), and a resume draws it again.

    >>> [sorted(p) for p in split_groups(["a", "b", "c", "d"], 1, seed=0)]
    [['a', 'b', 'c', 'd']]
    >>> [len(p) for p in split_groups(list("abcde"), 2, seed=0)]
    [3, 2]
    >>> split_groups(list("abcd"), 2, seed=0) == split_groups(list("dcba"), 2, seed=0)
    True
    """
    import zlib

    ordered = sorted(uids)
    batch = zlib.crc32("\n".join(ordered).encode())
    order = np.random.default_rng([seed, batch]).permutation(len(ordered))
    return [{ordered[i] for i in part} for part in np.array_split(order, min(n, len(uids)))]


def saved_checkpoints(folder: Path) -> dict[int, Path]:
    """The checkpoints in a run's ``checkpoints`` folder by version. Only
    ``version-<digits>`` folders count: one renamed aside (``version-000014.damaged``)
    is passed over."""
    return {
        int(p.name.removeprefix("version-")): p
        for p in folder.glob("version-*")
        if p.name.removeprefix("version-").isdigit()  # (isdigit: no sign, no space)
    }


def remove_partial_checkpoints(folder: Path) -> list[Path]:
    """Remove the partial checkpoint folders (``.version-N.partial``, written aside
    before the rename into place; ``.version-N.removed``, one renamed aside to be removed
    past ``trainer.keep_checkpoints``) in a run's ``checkpoints`` ``folder``: a trainer
    killed as it wrote or removed one (or one before 2026-12-06 whose write the disk
    refused) left it, model and optimizer, gigabytes nothing else removes. Only the
    trainer writes there, one at a time: call it as one starts. Returns those removed
    (each logged)."""
    removed = []
    for p in sorted([*folder.glob(".version-*.partial"), *folder.glob(".version-*.removed")]):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            what = "left unfinished" if p.suffix == ".partial" else "left half removed"
            logger.info("removed %s, a checkpoint a trainer %s", p, what)
            removed.append(p)
    return removed


def newest_checkpoint(run_dir: str | Path) -> Path | None:
    """A run's checkpoint of the highest version (every folder there is complete: they
    are written aside and renamed into place), or ``None``."""
    saved = saved_checkpoints(Path(run_dir) / "checkpoints")
    return saved[max(saved)] if saved else None


def checkpoint_version(ckpt: str | Path) -> int:
    """The version a checkpoint folder holds (from its ``trainer_state.json``)."""
    path = Path(ckpt) / "trainer_state.json"
    if not path.exists():
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} has no trainer_state.json; point at a "
            "checkpoints/version-N folder written by laminar"
        )
    return int(_trainer_state(path)["version"])


def _damaged(path: Path, e: Exception | str) -> CheckpointError:
    what = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return CheckpointError(f"{str(path)!r} is damaged ({what}); {_another(path.parent)}")


def _another(ckpt: Path) -> str:
    """How to resume from a checkpoint other than the damaged ``ckpt`` (the one before
    it named, where its run has one)."""
    saved, mine = saved_checkpoints(ckpt.parent), ckpt.name.removeprefix("version-")
    older = [v for v in saved if mine.isdigit() and v < int(mine)]
    before = saved[max(older)].name if older else None
    if before is None and ckpt.parent.name == "checkpoints":
        # (none older beside it: a resume in place, once it is moved aside, has nothing
        # to continue from; what does is a new run, in a new directory)
        config = shlex.quote(str(ckpt.parent.parent / "config.yaml"))
        return (
            "its run has no earlier checkpoint to resume from: start it again in a new run "
            f"directory (`laminar run {config} --run-dir NEW_DIR`), or, for a new run, set "
            "trainer.resume_from to another checkpoints/version-N folder"
        )
    run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else "RUN_DIR"
    return (
        "resume from an earlier checkpoint"
        + (f" ({before}, beside it)" if before else "")
        + f": to resume a laminar run in place (`laminar run --resume {run}`), move this one aside "
        f"first, renaming it, e.g. to {ckpt.name}.damaged (the resume takes the newest "
        "version-<digits> folder); for a new run, set trainer.resume_from to another "
        "checkpoints/version-N folder"
    )


def _check_digests(ckpt: Path, warn_unchecked: bool) -> None:
    """Each file of the checkpoint as :meth:`Learner.save` wrote it: of the size and
    digest its ``manifest.json`` records (every byte read: about 0.2 s a GB from the page
    cache, the disk's read speed otherwise). A file that differs, or a manifest that does not read,
    is a :class:`CheckpointError` naming it. A checkpoint without a manifest (written
    before laminar recorded one) loads, with a warning that it is not checked
    (``warn_unchecked``; else logged at INFO); files added since the write are named in
    a warning, as unchecked (a note beside the weights changes no weight)."""
    from laminar.files import MANIFEST, ManifestMismatch, check_manifest
    from laminar.prompt_pool import DATA_STATE

    try:
        found = check_manifest(ckpt, leave_out=(DATA_STATE,), require=checkpoint_files(ckpt))
    except ManifestMismatch as e:
        said = "; ".join(f"{str(path)!r} is damaged ({what})" for path, what in e.problems)
        if any(path.name == MANIFEST for path, _ in e.problems):
            # (it was written in the same rename as the rest: it alone cannot vouch)
            fix = (
                f"{_another(ckpt)} (or, if you know its other files are sound, delete "
                f"{MANIFEST}: the checkpoint then loads unchecked)"
            )
        else:
            fix = _another(ckpt)
        raise CheckpointError(f"{said}; {fix}") from None
    if not found.recorded:
        logger.log(
            logging.WARNING if warn_unchecked else logging.INFO,
            "checkpoint %r has no %s (it was written before laminar recorded the size and "
            "digest of a checkpoint's files): its files are loaded unchecked, and one "
            "damaged since it was written (a flipped byte in the weights) goes unnoticed",
            str(ckpt),
            MANIFEST,
        )
    elif found.extra:
        logger.warning(
            "checkpoint %r holds %s beside the files its %s lists: added since it was "
            "written, they are not checked (the files it lists are as written)",
            str(ckpt),
            list(found.extra),
            MANIFEST,
        )


def _trainer_state(path: Path) -> dict:
    """A checkpoint's ``trainer_state.json``; a damaged one is a :class:`CheckpointError`."""
    try:
        state = json.loads(path.read_text())
        int(state["version"])
        skipped_versions(state)
        restarts_of(state)
    except (ValueError, KeyError, TypeError) as e:
        raise _damaged(path, e) from None
    return state


def _check_files(ckpt: Path) -> dict:
    """The checkpoint's model ``config.json``, after reading it, its
    ``tokenizer_config.json`` and ``tokenizer.json`` (parsed by ``tokenizers``, as loading
    it does), the header of ``model.safetensors`` (:func:`laminar.model.check_model_files`,
    which the pre-start check of ``model.path`` runs too), the zip directories of
    ``optimizer.pt`` and ``rng.pt``, and its ``data_state.json`` when it has one; no tensor
    is loaded, so this is cheap enough to run before the cluster starts."""
    from laminar.model import check_model_files, check_torch_file
    from laminar.prompt_pool import data_position

    config = check_model_files(ckpt, _damaged)
    for name in ("optimizer.pt", "rng.pt"):
        check_torch_file(ckpt / name, _damaged)
    data_position(ckpt)  # (its own CheckpointError: no file is position 0)
    return config


def check_checkpoint(
    ckpt: str | Path, model_config, cfg: RunConfig, *, warn_unchecked: bool = True
) -> dict:
    """The checkpoint's trainer state, after checking its files are as written (their
    digests: :func:`_check_digests`; ``warn_unchecked``: warn, rather than log at INFO,
    that one written without them is not checked) and it fits this model and config.
    ``~`` is this machine's home."""
    from laminar.files import MANIFEST

    ckpt = Path(ckpt).expanduser()
    if not ckpt.is_dir():
        raise CheckpointError(
            f"trainer.resume_from {str(ckpt)!r} is not a folder; point it at a "
            "checkpoints/version-N folder written by laminar"
        )
    missing = [n for n in checkpoint_files(ckpt) if not (ckpt / n).exists()]
    # (a run's folder, or its checkpoints/: the checkpoint is a version-N within)
    run = ckpt.parent if ckpt.name == "checkpoints" else ckpt
    if missing and (newest := newest_checkpoint(run)) is not None:
        raise CheckpointError(
            f"trainer.resume_from {str(ckpt)!r} is a run's "
            + ("checkpoints folder" if run != ckpt else "folder")
            + f", not a checkpoint; point it at one of its checkpoints, e.g. the newest: "
            f"trainer.resume_from={newest} (or continue that run in place: laminar run "
            f"--resume {run})"
        )
    if missing and (ckpt / MANIFEST).is_file():
        # (laminar wrote it, whole: a file gone since is damage, as a changed one is,
        # with the same advice; "a folder written by laminar" sent a resume in place to
        # trainer.resume_from, which --resume does not take)
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} lacks {missing}: it was written with them (its "
            f"{MANIFEST} says so), so they are gone since; {_another(ckpt)}"
        )
    if missing:
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} lacks {missing}; point trainer.resume_from at a "
            "checkpoints/version-N folder written by laminar"
        )
    _check_digests(ckpt, warn_unchecked)
    state = _trainer_state(ckpt / "trainer_state.json")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} has format {state.get('format')!r}; this laminar "
            f"reads format {CHECKPOINT_FORMAT}"
        )
    theirs = _check_files(ckpt)
    ours = model_config.to_dict()
    diff = [k for k in ARCH_KEYS if k in ours and theirs.get(k) != ours.get(k)]
    if diff:
        shown = ", ".join(f"{k}: checkpoint {theirs.get(k)!r}, model {ours.get(k)!r}" for k in diff)
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} is another model ({shown}); resume with the model "
            "settings it was trained with (model.*), or start a new run"
        )
    saved = state.get("trainer", {})
    now = cfg.trainer.model_dump(mode="json")
    diff = [k for k in OPTIMIZER_FIELDS if k in saved and saved[k] != now[k]]
    if diff == ["lr"]:  # (the moments stand; the step size is the new one: Learner._restore)
        (logger.warning if warn_unchecked else logger.info)(
            "trainer.lr: checkpoint %r, now %r: the run goes on from %s with the new "
            "learning rate, AdamW's moments as they were (not bit-identical with a run "
            "at the checkpoint's)",
            saved["lr"],
            now["lr"],
            ckpt.name,
        )
    elif diff:
        shown = ", ".join(f"trainer.{k}: checkpoint {saved[k]!r}, now {now[k]!r}" for k in diff)
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} was trained with other optimizer settings ({shown}); "
            "set them to the checkpoint's values to resume (trainer.lr alone may change: "
            "the moments AdamW keeps are of these betas and weight decay)"
        )
    # (trainer.steps counts updates: a restart within the run skipped version numbers)
    made = state["version"] - skipped_versions(state)
    if cfg.trainer.steps <= made:
        skipped = f" ({made} updates: it skipped {state['version'] - made} numbers)"
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} is at version {state['version']}"
            f"{skipped if made != state['version'] else ''}, and trainer.steps is "
            f"{cfg.trainer.steps}: nothing left to train; raise trainer.steps"
        )
    return state


def torch_all_reduce(tensor: torch.Tensor, op: str) -> None:
    """``all_reduce`` over the default ``torch.distributed`` group (gloo or NCCL)."""
    import torch.distributed as dist

    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
