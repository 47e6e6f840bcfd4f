"""What every engine shares besides the contract: checks, one admission rule, a base.

Pure functions of an engine's limits and its requests' states, with no model or cache
state — the request checks (:func:`check_limits`, :func:`check_request`,
:func:`check_imports`, :func:`check_weight_load`), the finish reason
(:func:`stop_reason`) and the admission rule (:func:`plan_admission`) — and
:class:`EngineBase`, which applies them around an engine's compute: the waiting queue,
``add_request``, ``export``/``import_``, ``load_weights``, ``kv_stats``, ``stats`` and
pacing. An engine provides the running side and its ``step``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from numbers import Integral

import torch

from laminar.engine import (
    EngineError,
    FinishedOutput,
    GenerationRequest,
    KVStats,
    RequestState,
    default_seed,
)

# -- what every engine checks and decides --------------------------------------------------
# Pure functions of the engine's limits and its requests' states, with no model or cache
# state: each engine is a shell that calls them and does the compute.


def check_limits(max_batch: int, max_seq_len: int, kv_capacity_tokens: int | None) -> int:
    """The KV capacity ``C_max`` of an engine with these limits, or :class:`EngineError`.

    ``kv_capacity_tokens=None`` means every slot: ``max_batch * max_seq_len``.

    >>> check_limits(4, 32, None), check_limits(4, 32, 100)
    (128, 100)
    """
    if max_batch <= 0 or max_seq_len <= 1:
        raise EngineError(f"max_batch={max_batch!r}, max_seq_len={max_seq_len!r}: need ≥ 1 and ≥ 2")
    slots = max_batch * max_seq_len
    capacity = slots if kv_capacity_tokens is None else kv_capacity_tokens
    if not 1 < capacity <= slots:
        raise EngineError(
            f"kv_capacity_tokens={kv_capacity_tokens!r} must be in [2, max_batch * "
            f"max_seq_len = {slots}]"
        )
    return capacity


def check_request(
    request: GenerationRequest,
    *,
    vocab_size: int,
    max_seq_len: int,
    capacity: int,
    has_tokenizer: bool = True,
) -> None:
    """Raise :class:`EngineError` if ``request`` can never run on an engine of these limits.

    The message names the request, the bad field and the fix.

    >>> from laminar.engine import SamplingParams
    >>> req = GenerationRequest("a", (5, 200), SamplingParams(max_new_tokens=4))
    >>> check_request(req, vocab_size=128, max_seq_len=32, capacity=64)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    laminar.engine.EngineError: request 'a': prompt token id 200 is outside the model's ...
    """
    rid = request.request_id
    if not isinstance(rid, str):
        raise EngineError(f"request_id={rid!r}; must be a str (its bytes seed the request)")
    p = request.params
    p.check(rid)
    prompt = request.prompt_tokens
    # (A list or an array of ids is fine; text, or floats, would fail in the step.)
    seq = isinstance(prompt, Iterable) and not isinstance(prompt, (str, bytes))
    odd = [t for t in prompt if not isinstance(t, Integral)][:1] if seq else []
    if not seq or odd:
        what = f"the token {odd[0]!r}" if odd else f"a {type(prompt).__name__}"
        raise EngineError(
            f"request {rid!r}: prompt_tokens must be integer token ids, not {what}; "
            "encode prompts with the policy's tokenizer"
        )
    n = len(prompt)
    if n == 0:
        raise EngineError(f"request {rid!r} has an empty prompt; give at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise EngineError(
            f"request {rid!r}: prompt token id {bad[0]!r} is outside the model's "
            f"vocabulary [0, {vocab_size}); encode prompts with the policy's tokenizer"
        )
    if n + p.max_new_tokens > max_seq_len:
        raise EngineError(
            f"request {rid!r}: prompt ({n}) + max_new_tokens ({p.max_new_tokens}) exceeds "
            f"the engine's max_seq_len ({max_seq_len}); raise rollout.max_seq_len or lower "
            "max_new_tokens"
        )
    if n + p.max_new_tokens > capacity:
        raise EngineError(
            f"request {rid!r}: prompt ({n}) + max_new_tokens ({p.max_new_tokens}) exceeds "
            f"the KV capacity ({capacity} tokens); it could never finish here"
        )
    if p.stop and not has_tokenizer:
        raise EngineError(
            f"request {rid!r} has stop strings but the engine has no tokenizer; "
            "build the engine with tokenizer=..."
        )


def check_imports(
    states: Iterable[RequestState],
    *,
    in_flight: Iterable[str],
    version: int,
    allow_version_change: bool,
    check: Callable[[GenerationRequest], None],
) -> None:
    """Raise :class:`EngineError` if an engine of ``version`` cannot resume every state.

    ``in_flight`` are the ids the engine holds; ``check`` is its request check
    (:func:`check_request` with its limits). A state sampled by another version is refused
    unless ``allow_version_change``.
    """
    present = set(in_flight)
    for s in states:
        check(s.request)
        rid = s.request_id
        if rid in present:
            raise EngineError(f"import: request {rid!r} is already in flight here")
        present.add(rid)
        if not len(s.tokens) == len(s.logprobs) == len(s.token_versions):
            raise EngineError(
                f"import: request {rid!r} has {len(s.tokens)} tokens, "
                f"{len(s.logprobs)} logprobs and {len(s.token_versions)} versions"
            )
        if len(s.tokens) >= s.request.params.max_new_tokens:
            raise EngineError(f"import: request {rid!r} already has all its tokens")
        if s.tokens and s.token_versions[-1] > version:
            raise EngineError(
                f"import: request {rid!r} has tokens of version {s.token_versions[-1]}, "
                f"newer than this engine's {version}: its versions would fall; load that "
                "version (or a newer one) first"
            )
        if s.tokens and s.token_versions[-1] != version and not allow_version_change:
            raise EngineError(
                f"import: request {rid!r} was sampled by version {s.token_versions[-1]} "
                f"and this engine holds version {version}; import it on an engine "
                "of that version, or pass allow_version_change=True to mix versions"
            )


def check_weight_load(
    version: int, *, current: int, running: int, waiting: Iterable[RequestState]
) -> None:
    """Refuse to load ``version`` while requests hold tokens of the ``current`` one.

    ``running`` counts the requests decoding; a waiting request holds tokens if it was
    preempted or imported part-way.
    """
    partial = sum(1 for s in waiting if s.tokens)
    if running or partial:
        raise EngineError(
            f"cannot load version {version}: {running} running and {partial} preempted "
            f"requests hold tokens of version {current}; drain the batch or export them first"
        )


def stop_reason(state: RequestState, token: int, *, eos: int, tokenizer=None) -> str | None:
    """Why ``state`` ends with ``token``, its latest (already appended), or ``None``.

    ``"eos"`` for the engine's end-of-sequence token (unless ``ignore_eos``), ``"stop"``
    for a stop token or a stop string in the decoded response (``tokenizer`` is needed
    only then), ``"length"`` at ``max_new_tokens``.

    >>> from laminar.engine import SamplingParams
    >>> s = RequestState(GenerationRequest("a", (1,), SamplingParams(3)), seed=0, tokens=[5, 2])
    >>> stop_reason(s, 2, eos=2), stop_reason(s, 2, eos=7)
    ('eos', None)
    """
    p = state.request.params
    if token == eos and not p.ignore_eos:
        return "eos"
    if token in p.stop_token_ids:
        return "stop"
    if p.stop:
        text = tokenizer.decode(state.tokens)  # (once a token, not once per stop string)
        if any(x in text for x in p.stop):
            return "stop"
    if len(state.tokens) >= p.max_new_tokens:
        return "length"
    return None


@dataclass(frozen=True)
class Admission:
    """What a step does before computing: preempt, then admit (see :func:`plan_admission`)."""

    preempt: int  # the most recently admitted running requests that go back to the queue
    admit: int  # requests taken from the head of the queue, the preempted ones included


def plan_admission(
    running: Sequence[int], waiting: Sequence[int], *, capacity: int, max_batch: int
) -> Admission:
    """The admission rule of every engine, on context lengths alone.

    ``running`` are the contexts (prompt + tokens so far) of the running requests, oldest
    admission first; after this step each holds KV for its whole context. ``waiting`` are
    the contexts of the queue, head first. While the running ones would outgrow
    ``capacity``, the most recently admitted is preempted: it goes back to the head of the
    queue (the preempted keep their admission order) and resumes later by re-prefill.
    Then requests are admitted from the head of the queue while fewer than ``max_batch``
    run and their context plus the next step's decode (one entry per running request,
    itself included) fits; an empty engine always admits one.

    >>> plan_admission([30, 30, 30], [10], capacity=80, max_batch=8)
    Admission(preempt=1, admit=0)
    >>> plan_admission([20], [10, 10, 40], capacity=80, max_batch=8)
    Admission(preempt=0, admit=2)
    """
    kept = len(running)
    used = sum(running)
    while kept and used > capacity:
        kept -= 1
        used -= running[kept]
    admit = 0
    for context in [*running[kept:], *waiting]:
        n = kept + admit
        if n >= max_batch or (n and used + context + n + 1 > capacity):
            break
        used += context
        admit += 1
    return Admission(preempt=len(running) - kept, admit=admit)


@dataclass(frozen=True)
class StepStart:
    """A step after admission: what it computes (for the counters and the pacer)."""

    t0: float  # time.perf_counter() at the start
    decoding: int  # running requests that decode one token: the first ones
    context_tokens: int  # KV entries they attend over
    admitted: list[RequestState]  # prefilled this step: the last running ones
    prefill_tokens: int


# (``admitted``: requests a step prefilled, new or resumed; ``decode_tokens``: those it
# decoded, the requests it found running)
_COUNTERS = (
    "steps prefill_tokens decode_tokens admitted preemptions finished exported imported".split()
)


class EngineBase:
    """What every engine does around its compute, built on the functions above.

    The base holds the waiting queue (new requests at the back, imported and preempted
    ones at the head) and implements the protocol's bookkeeping: :meth:`add_request`,
    :meth:`export`, :meth:`import_`, :meth:`load_weights`, :meth:`kv_stats`,
    :meth:`stats`. A subclass holds the running requests and computes; it sets
    ``vocab_size`` and provides

    * ``_running_states()`` — the running requests' states, oldest admission first;
    * ``_start(state)`` — take an admitted request (prefilled by the next compute);
    * ``_stop(request_ids)`` — drop these running requests, returning their states;
    * ``_load(state_dict)`` — swap the weights;
    * ``_used_tokens()`` — the KV entries written now (never above ``capacity``);

    and its ``step`` calls :meth:`_begin_step` first, :meth:`_stop_reason` for every
    sampled token and :meth:`_end_step` last.
    """

    vocab_size: int

    def __init__(
        self,
        *,
        eos_token_id: int,
        pad_token_id: int | None,
        max_batch: int,
        max_seq_len: int,
        kv_capacity_tokens: int | None,
        seed: int,
        version: int,
        tokenizer,
        pacer,
    ) -> None:
        self.capacity = check_limits(max_batch, max_seq_len, kv_capacity_tokens)
        self.eos = eos_token_id
        # Only fills prefill rows past their length, which nothing attends to: a
        # tokenizer without a pad token (pad_token_id None) pads with 0.
        self.pad = 0 if pad_token_id is None else pad_token_id
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.seed = seed
        self.version = version
        self.tokenizer = tokenizer
        self.pacer = pacer
        # Called instead of time.sleep while a paced step waits out its modelled time
        # (the step's work is done, the engine consistent): a rollout serves its
        # manager's commands there instead of only between steps.
        self.wait_hook: Callable[[float], None] | None = None
        # The outputs of the step being waited out (finishing): no longer in flight, not
        # yet returned by step(), so a command served meanwhile would see them nowhere
        self._finishing: list[FinishedOutput] = []
        self._waiting: deque[RequestState] = deque()
        self.counters = dict.fromkeys(_COUNTERS, 0)

    # -- what a subclass provides ---------------------------------------------------------
    def _running_states(self) -> list[RequestState]:
        raise NotImplementedError

    def _start(self, state: RequestState) -> None:
        raise NotImplementedError

    def _stop(self, request_ids: list[str]) -> list[RequestState]:
        raise NotImplementedError

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def _used_tokens(self) -> int:
        raise NotImplementedError

    # -- the protocol's bookkeeping -----------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        self._check(request)
        prompt = request.prompt_tokens
        if type(prompt) is not tuple or not all(type(t) is int for t in prompt):
            # (a tokenizer's list, an array of numpy ints: held as the tuple of ints the
            # protocol says, which every engine, the partial log's JSON and vLLM take)
            request = replace(request, prompt_tokens=tuple(int(t) for t in prompt))
        rid = request.request_id
        if rid in self.request_ids():
            raise EngineError(f"request {rid!r} is already in flight on this engine")
        seed = request.params.seed
        if seed is None:
            seed = default_seed(self.seed, rid)
        self._waiting.append(RequestState(request, seed=seed, t_start=time.time()))

    def has_work(self) -> bool:
        return bool(self._waiting) or bool(self._running_states())

    # (request_ids, in_flight and kv_stats are read from other threads too: a rollout's
    # stats() on its actor thread while the generation thread steps. They iterate
    # snapshots, tuple(deque) and the like, which CPython copies in one step under the
    # GIL; iterating the deque itself, with Python code run between items, meets the
    # step's popleft/extendleft as "deque mutated during iteration".)
    def request_ids(self) -> list[str]:
        return [s.request_id for s in (*self._running_states(), *tuple(self._waiting))]

    def in_flight(self) -> list[RequestState]:
        """The unfinished requests' states as of the last step: the engine's own objects,
        to read between steps (the partial-response log), never to change."""
        return [*self._running_states(), *tuple(self._waiting)]

    def kv_stats(self) -> KVStats:
        """The KV figures now. Safe to call from another thread while the engine steps:
        each figure is read from a snapshot, though not all from the same instant."""
        waiting = tuple(self._waiting)
        return KVStats(
            used_tokens=self._used_tokens(),
            capacity_tokens=self.capacity,
            running=len(self._running_states()),
            waiting=len(waiting),
            waiting_tokens=sum(s.context_len for s in waiting),
        )

    def stats(self) -> dict[str, float]:
        return self.counters | (self.pacer.stats() if self.pacer is not None else {})

    def export(self, request_ids: list[str], *, moved: bool = True) -> list[RequestState]:
        wanted = list(dict.fromkeys(request_ids))
        in_flight = set(self.request_ids())
        unknown = [rid for rid in wanted if rid not in in_flight]
        if unknown:
            raise EngineError(f"export: no request {unknown[0]!r} in flight on this engine")
        moving = set(wanted)
        states = {s.request_id: s for s in self._waiting if s.request_id in moving}
        self._waiting = deque(s for s in self._waiting if s.request_id not in moving)
        running = [s.request_id for s in self._running_states() if s.request_id in moving]
        states.update(zip(running, self._stop(running), strict=True))
        self.counters["exported"] += len(wanted)
        return [states[rid].moved() if moved else states[rid] for rid in wanted]

    def import_(self, states: list[RequestState], *, allow_version_change: bool = False) -> None:
        check_imports(
            states,
            in_flight=self.request_ids(),
            version=self.version,
            allow_version_change=allow_version_change,
            check=self._check,
        )
        # Copies of the lists the engine appends to: the caller's states (a move's export,
        # which a rollout also keeps to take back, or that a manager imports elsewhere
        # too) must never share a token list with this engine, nor two engines one.
        own = [
            replace(
                s,
                tokens=list(s.tokens),
                logprobs=list(s.logprobs),
                token_versions=list(s.token_versions),
            )
            for s in states
        ]
        self._waiting.extendleft(reversed(own))
        self.counters["imported"] += len(own)

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        check_weight_load(
            version,
            current=self.version,
            running=len(self._running_states()),
            waiting=self._waiting,
        )
        self._load(state)
        self.version = version

    # -- for the subclass's step --------------------------------------------------------------
    def _check(self, request: GenerationRequest) -> None:
        check_request(
            request,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            capacity=self.capacity,
            has_tokenizer=self.tokenizer is not None,
        )

    def _admit(self) -> list[RequestState]:
        """Preempt and admit by :func:`plan_admission`; return the admitted (now running last)."""
        running = self._running_states()
        # After this step each running request holds KV for its whole context.
        plan = plan_admission(
            [s.context_len for s in running],
            [s.context_len for s in self._waiting],
            capacity=self.capacity,
            max_batch=self.max_batch,
        )
        preempted = running[len(running) - plan.preempt :]
        self._stop([s.request_id for s in preempted])
        self._waiting.extendleft(reversed(preempted))
        self.counters["preemptions"] += plan.preempt
        # One at a time: a request the engine refuses (vLLM's own input checks) stays at
        # the head of the queue with those behind it, in flight, before the error goes up;
        # taking them all off first lost every one after it from both queues.
        admitted = []
        for _ in range(plan.admit):
            state = self._waiting.popleft()
            try:
                self._start(state)
            except BaseException:
                self._waiting.appendleft(state)
                raise
            admitted.append(state)
        return admitted

    def _begin_step(self) -> StepStart:
        """Preempt and admit (:meth:`_admit`); say what the step will compute."""
        t0 = time.perf_counter()
        admitted = self._admit()
        running = self._running_states()
        decoding = running[: len(running) - len(admitted)]
        return StepStart(
            t0=t0,
            decoding=len(decoding),
            # Their last token's KV is written by this step's decode.
            context_tokens=sum(s.context_len - 1 for s in decoding),
            admitted=admitted,
            prefill_tokens=sum(s.context_len for s in admitted),
        )

    def _stop_reason(self, state: RequestState, token: int) -> str | None:
        return stop_reason(state, token, eos=self.eos, tokenizer=self.tokenizer)

    def _end_step(self, start: StepStart, finished: list[FinishedOutput]) -> None:
        """Count the step and, if paced, wait out the modelled step time; the outputs the
        step ``finished`` (the list its ``step`` returns) then finish at its deadline."""
        self.counters["steps"] += 1
        self.counters["decode_tokens"] += start.decoding
        self.counters["prefill_tokens"] += start.prefill_tokens
        self.counters["admitted"] += len(start.admitted)
        self.counters["finished"] += len(finished)
        if self.pacer is not None:
            self._finishing = finished
            sleep = self.wait_hook or time.sleep

            def wait(seconds: float) -> None:
                # The step ends in modelled time at its deadline, ``seconds`` from now: its
                # finished outputs end there, not when its compute did (stamped by the
                # subclass, up to a whole paced step early). Stamped before the wait, so a
                # command served meanwhile (finishing()) sees the same time; a step that
                # overran is never waited on and keeps its compute's stamp, already past
                # its deadline. (In place: ``finished`` is the list step() returns.)
                t_end = time.time() + seconds
                finished[:] = [replace(o, t_finish=max(o.t_finish, t_end)) for o in finished]
                sleep(seconds)

            try:
                self.pacer.pace(
                    start.t0,
                    batch=start.decoding,
                    context_tokens=start.context_tokens,
                    prefill_tokens=start.prefill_tokens,
                    admitted=len(start.admitted),
                    sleep=wait,
                )
            finally:
                self._finishing = []

    def finishing(self) -> list[FinishedOutput]:
        """While a paced step waits out its modelled time: the outputs it finished, out of
        :meth:`in_flight` and not yet returned by :meth:`step` (a rollout's command served
        from ``wait_hook`` meanwhile, asked what it holds, counts them); else []."""
        return list(self._finishing)
