"""The prompt pool: hands prompt groups to rollouts, with back-pressure.

:class:`PromptPoolCore` is the pure logic (what to hand out, what is in flight);
:class:`PromptPool` is the Dask actor around it. A group is dispatched to one rollout as a
unit (under ``batches``, possibly in pieces to several) and stays *outstanding* until
the buffer reports it consumed or discarded. How much is handed out is the schedule's
dispatch rule (:mod:`laminar.schedule`):

* ``free`` — dispatch pauses while ``max_outstanding`` groups are outstanding, so a fast
  rollout tier cannot grow the buffer without bound (Laminar);
* ``batches`` — one global batch of ``groups_per_step`` groups per version, split among
  the ``R`` rollouts by sample, not by group: each takes ``⌈G·n/R⌉`` or ``⌊G·n/R⌋`` of
  its ``G·n`` samples (a group of ``n`` may go out in pieces, each a
  :attr:`~laminar.contract.PromptGroup.samples` subset, which the buffer puts together
  by prompt uid), and batch ``b`` only to rollouts that hold version ``b - lag`` (sync
  and stream: ``lag = 0``; one-step: ``lag = 1``). Split by whole groups, 64 groups on
  10 rollouts went out as 7 × 9 and 1, on 12 as 6 × 10, 4 and 0: the barrier waited for
  the rollouts with 7 while one idled;
* ``eta`` — back-pressure as ``free``, and never more than ``(version + eta + 1) ×
  groups_per_step`` groups dispatched in all (AReaL's staleness bound η).

Under back-pressure, room goes to idle rollouts in the order they asked for it: a rollout
that got nothing at its batch boundary *queues*, and while it is queued no rollout behind
it in the queue, and none that did not queue, takes a new group. Without the queue a
rollout that loads a version between its asks (a replacement, one behind the trainer) is
passed over for good by rollouts that wait in the pool, each freed slot going to whoever
is waiting when it frees. A queued rollout that has not asked for
:data:`QUEUE_EXPIRY_S` (lost, or busy with work from elsewhere) leaves the queue.

The prompts it hands out are loaded, encoded and checked in :mod:`laminar.prompts`
(its public names are importable from here too).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

from laminar.config import RunConfig
from laminar.contract import PromptGroup
from laminar.errors import ConfigError, DataError
from laminar.prompts import check_answers as check_answers
from laminar.prompts import encode_prompts as encode_prompts
from laminar.prompts import load_prompts as load_prompts
from laminar.prompts import order_differs, prompt_order
from laminar.prompts import unreachable_answers as unreachable_answers
from laminar.tasks import Prompt, iter_epochs

logger = logging.getLogger(__name__)


class RolloutFenced(RuntimeError):
    """The prompt pool refuses groups to a rollout given up as lost
    (:meth:`PromptPool.fence`): raised in that rollout's process, whose generation loop
    ends on it (an error of the pool's own, not a lost data module: see
    :func:`laminar.actors.is_lost`), once, as on any error — its work was resumed
    elsewhere, and groups it took now would be finished by nothing."""


# How long a queued rollout keeps its place without asking again. An idle rollout asks at
# least every rollout.IDLE_WAIT_S (2 s) plus the load of a version it waited for.
QUEUE_EXPIRY_S = 4.0


class PromptPoolCore:
    """Which prompt groups are handed out and which are still outstanding.

    >>> core = PromptPoolCore([(Prompt(0, "n 2 >", "1 2"), (1, 5))], group_size=4,
    ...                       max_outstanding=2, seed=0)
    >>> [g.prompt_uid for g in core.acquire(5)]
    ['p00000000', 'p00000001']
    >>> core.acquire(1), core.release(["p00000000"]), len(core.acquire(1))
    ([], None, 1)

    With ``batches``, version 0 gets the first global batch, shared by the replicas:

    >>> b = PromptPoolCore([(Prompt(0, "n 2 >", "1 2"), (1, 5))], group_size=4,
    ...                    max_outstanding=8, seed=0, dispatch="batches",
    ...                    groups_per_step=4, replicas=2)
    >>> len(b.acquire(9, "r0", version=0)), len(b.acquire(9, "r1", version=0))
    (2, 2)
    >>> len(b.acquire(9, "r0", version=0)), len(b.acquire(9, "r0", version=1))
    (0, 2)

    Under back-pressure, freed room goes to the idle rollout that queued for it first:

    >>> q = PromptPoolCore([(Prompt(0, "n 2 >", "1 2"), (1, 5))], group_size=4,
    ...                    max_outstanding=2, seed=0)
    >>> len(q.acquire(2, "r0", idle=True, now=0.0)), q.acquire(2, "r1", idle=True, now=0.0)
    (2, [])
    >>> q.release(["p00000000"])
    >>> q.acquire(2, "r0", idle=True, now=1.0), len(q.acquire(2, "r1", idle=True, now=1.5))
    ([], 1)
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
        dispatch: str = "free",
        groups_per_step: int = 1,
        replicas: int = 1,
        lag: int = 0,
        eta: int = 0,
        first_version: int = 0,
    ) -> None:
        """``start``: groups already dispatched by the run being resumed (the data
        position): the order continues after them, and so do the prompt uids.
        ``outstanding``: its groups the buffer holds again (they count against
        ``max_outstanding`` until they leave). ``reissue``: of those, the groups whose
        missing samples are handed out again first (prompt uid -> prompt key, group size,
        sample indices; :class:`storage.resume.ResumePlan`).

        ``dispatch``, ``groups_per_step``, ``replicas``, ``lag`` and ``eta``: the
        schedule's dispatch rule (module docstring), counted from the trainer's starting
        version ``first_version`` (a run started from a checkpoint)."""
        if not prompts:
            raise DataError("the prompt pool is empty; check task.prompt_file or task.num_prompts")
        self.prompts = prompts
        self.group_size = group_size
        self.max_outstanding = max_outstanding
        self._order = iter_epochs(range(len(prompts)), seed)
        self.epoch = 0
        for _ in range(start):
            self.epoch, _ = next(self._order)
        if dispatch not in ("free", "batches", "eta"):
            raise ConfigError(f"dispatch {dispatch!r} is not one of free, batches, eta")
        self.dispatch = dispatch
        self.groups_per_step = groups_per_step
        self.replicas = replicas  # live rollouts: a global batch is split among them
        self.lag, self.eta = lag, eta
        self.first_version = first_version
        self.version = first_version  # the trainer's newest published version (eta)
        # batches: the global batch being handed out, numbered by the version that
        # generates it (+ lag) ...
        self.batch = first_version
        self._in_batch: dict[str, int] = {}  # ... each rollout's samples of it ...
        self._quota: dict[str, int] = {}  # ... their parts of its samples ...
        self._made = 0  # ... its groups made so far ...
        # ... and those of its groups partly handed out: [group, sample indices left,
        # the version of the rollout that took the first piece]
        self._open: list[list] = []
        self._batch_of: dict[str, int] = {}  # the batch of each outstanding group
        self._owed: list[int] = []  # batches owed a group that left untrained
        self._floor = first_version  # the least version a batch may go to (update_skipped)
        self._start = start
        self.outstanding: set[str] = set(outstanding)
        self.n_dispatched = start
        self.n_released = 0
        self.n_untrained = 0  # of those released, the groups no update consumed
        self.n_skipped = 0  # updates that consumed a batch and published no version
        self.n_reissued = 0
        self.n_held_again = 0  # groups a restarted trainer trains again (hold_again)
        self.n_passed_over = 0  # asks that found the room promised to a rollout ahead
        self.n_reissued_at_fence = 0  # groups of fenced rollouts handed out again (fence)
        self.n_answered_again = 0  # asks made again whose answer was given again (acquire)
        self._queue: dict[str, float] = {}  # idle rollouts waiting for room -> last ask
        # outstanding group -> the rollouts it was handed to, each with its piece (the
        # group whole, but for a barrier batch's group split among rollouts)
        self._owner: dict[str, dict[str, PromptGroup]] = {}
        # rollout -> its last ask that got groups: (ask id, the groups) (acquire ``ask``)
        self._answers: dict[str, tuple[object, list[PromptGroup]]] = {}
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

    def acquire(
        self,
        n: int,
        rollout_id: str = "",
        version: int = 0,
        *,
        idle: bool = False,
        newest_only: bool = False,
        now: float | None = None,
        ask: object = None,
    ) -> list[PromptGroup]:
        """Up to ``n`` groups for ``rollout_id``, which holds weight ``version``: fewer (or
        none) as the dispatch rule says. The missing samples of a resumed run's groups
        come first (they are outstanding already).

        ``ask``: the rollout's id of this ask (a counter of its own). Asked again with the
        id of its last ask that got groups, it gets those groups again, and no new ones:
        the answer never reached it (its call timed out, and the data module then
        answered: slow, not lost), and without this they were outstanding for good,
        generated by nothing (as :meth:`laminar.buffer.ExperienceBuffer.sample` does for
        the trainer's batches). The answer is kept until the rollout asks with another id.

        ``idle``: the rollout has no work (a batch boundary). Given nothing, it queues for
        room (module docstring); ``now`` is the time on :func:`time.monotonic`'s clock.
        ``newest_only``: none unless ``version`` is the newest published (a batch topping
        up, ``rollout.top_up``: work for an older version waits for a fresh batch)."""
        if (again := self.answered(rollout_id, ask)) is not None:
            self.n_answered_again += 1
            return again
        if newest_only and version < self.version:
            return []
        now = time.monotonic() if now is None else now
        turn = self._turn(rollout_id, now, version)
        groups = self._reissue[:n]
        del self._reissue[: len(groups)]
        self.n_reissued += len(groups)
        while len(groups) < n and (owed := self._owed_to(version)) is not None:
            # A replacement for a group of batch ``owed`` that left untrained: the
            # trainer still needs it for that batch's update.
            self._owed.remove(owed)
            groups.append(self._next_group(owed))
        if self.dispatch == "batches":
            groups += self._batch_pieces(n - len(groups), rollout_id, version)
        while len(groups) < n and turn and self._may_dispatch(rollout_id, version):
            groups.append(self._next_group(self.batch))
        for g in groups:
            if g.prompt_uid in self.outstanding:  # (a re-issued one may have left since)
                pieces = self._owner.setdefault(g.prompt_uid, {})
                if (had := pieces.get(rollout_id)) is not None and had is not g:
                    g = replace(g, samples=tuple(sorted({*had.sample_indices, *g.sample_indices})))
                pieces[rollout_id] = g
        if groups:
            self._queue.pop(rollout_id, None)
            if ask is not None:
                self._answers[rollout_id] = (ask, groups[:])
        elif idle and self.dispatch == "eta" and version < self.version:
            # (it must load the newest version before the rule serves it: queued, it held
            # back every rollout that had, until it asked again or its place expired)
            self._queue.pop(rollout_id, None)
        elif idle and self.dispatch != "batches":
            self._queue[rollout_id] = now  # (keeps its place if it had one)
        return groups

    def answered(self, rollout_id: str, ask: object) -> list[PromptGroup] | None:
        """The groups handed to ``rollout_id`` for its ask ``ask`` already, if that was
        its last ask that got groups (:meth:`acquire`)."""
        last = self._answers.get(rollout_id)
        if ask is None or last is None or last[0] != ask:
            return None
        return list(last[1])

    def _turn(self, rollout_id: str, now: float, version: int) -> bool:
        """Whether ``rollout_id`` may take new groups now: no live rollout is queued
        ahead of it. Drops the queued rollouts that stopped asking. Counts the ask as
        passed over only where the dispatch rule would have given it a group (not while
        the pool is full: no room existed then, for anyone)."""
        if self.dispatch == "batches":  # the share per rollout is the schedule's
            return True
        for rid, asked in list(self._queue.items()):
            if now - asked > QUEUE_EXPIRY_S:
                del self._queue[rid]
        head = next(iter(self._queue), None)
        if head is None or head == rollout_id:
            return True
        if self._may_dispatch(rollout_id, version):
            self.n_passed_over += 1
        return False

    def _next_group(self, batch: int) -> PromptGroup:
        self.epoch, idx = next(self._order)
        prompt, tokens = self.prompts[idx]
        uid = f"p{self.n_dispatched:08d}"
        self.n_dispatched += 1
        self.outstanding.add(uid)
        if self.dispatch == "batches":
            self._batch_of[uid] = batch
        return PromptGroup(uid, prompt.key, tokens, prompt.answer, self.group_size, self.epoch)

    def _batch_pieces(self, n: int, rollout_id: str, version: int) -> list[PromptGroup]:
        """``batches``: up to ``n`` pieces of the global batch for ``rollout_id`` at
        ``version``, of its part of the batch's samples: a rollout's first ask of a batch
        sets its part, ``⌈free / k⌉`` of the ``free`` samples no rollout has a part of,
        ``k`` the live rollouts without one (so ``⌈G·n/R⌉`` or ``⌊G·n/R⌋`` each), which
        it takes over one ask or more. (All ``R`` have parts and samples are free: a
        rollout was lost before it took its part, :meth:`rollouts_live`, and those that
        ask share the rest.) A group begun by a rollout at one version is finished by
        rollouts at that version where one asks: one at another starts new groups first,
        and takes the rest of one only when no new group is left to make. (As the
        barrier schedules run, every rollout takes its part of batch ``b`` at the same
        version: the version after it is published only once batch ``b`` is complete.)"""
        # A skipped update lowers every batch's label (update_skipped), and with it the
        # version the label asks for: a rollout still on the version before the newest
        # would qualify. The newest then is the floor. (Not the newest published as
        # such: a rebuilt pool hears of versions before their weights reach any rollout.)
        if n <= 0 or version < max(self.batch - self.lag, self._floor):
            return []
        size = self.group_size
        total = self.groups_per_step * size
        left = total - sum(self._in_batch.values())
        quota = self._quota
        free = total - sum(quota.values())  # (no rollout's part yet)
        if rollout_id not in quota:
            quota[rollout_id] = -(-free // max(1, self.replicas - len(quota)))
        elif free and len(quota) >= self.replicas:
            quota[rollout_id] += -(-free // self.replicas)
        allow = quota[rollout_id] - self._in_batch.get(rollout_id, 0)
        out: list[PromptGroup] = []
        taken = 0

        def piece(entry: list) -> None:
            nonlocal taken
            group, rest, _ = entry
            k = min(allow - taken, len(rest))
            mine, entry[1] = rest[:k], rest[k:]
            out.append(group if k == size else replace(group, samples=tuple(mine)))
            taken += k

        def more() -> bool:
            return taken < allow and len(out) < n

        for entry in [e for e in self._open if e[2] == version]:
            if more():
                piece(entry)
        while more() and self._made < self.groups_per_step:
            group = self._next_group(self.batch)
            self._made += 1
            entry = [group, list(range(size)), version]
            self._open.append(entry)
            piece(entry)
        for entry in list(self._open):
            if more() and entry[1]:
                piece(entry)
        self._open = [e for e in self._open if e[1]]
        if taken:
            self._in_batch[rollout_id] = self._in_batch.get(rollout_id, 0) + taken
        if taken == left:
            self.batch += 1  # the global batch is out: the next one waits
            self._in_batch, self._made, self._quota = {}, 0, {}
        return out

    def _owed_to(self, version: int) -> int | None:
        """The batch of a replacement owed that a rollout at ``version`` may generate."""
        if version < self._floor:  # (see _may_dispatch)
            return None
        return next((b for b in self._owed if version >= b - self.lag), None)

    def _may_dispatch(self, rollout_id: str, version: int) -> bool:
        if self.dispatch == "batches":  # the schedule's barrier bounds what is out
            return False  # (its pieces are handed out by _batch_pieces)
        if len(self.outstanding) >= self.max_outstanding:
            return False
        if self.dispatch == "eta":
            # Groups that left untrained (dropped, evicted) feed no update: they are made
            # up for, or a trainer that needs G groups per version would starve.
            # Counted from the version the asking rollout holds, which starts the group:
            # between a publication and the interruption that loads it, a rollout still
            # on the old version would otherwise start groups one version staler.
            held = min(version, self.version)
            ahead = (held - self.first_version + self.eta + 1) * self.groups_per_step
            spent = self.n_untrained + self.n_skipped * self.groups_per_step
            return self.n_dispatched - self._start - spent < ahead
        return True

    def full(self) -> bool:
        """Whether no rollout may be handed a group now: the back-pressure bound (or the
        ``eta`` rule) is reached. Barrier schedules (``batches``) hand out batch by batch,
        each of one version: never full in this sense."""
        return self.dispatch != "batches" and not self._may_dispatch("", self.version)

    def version_published(self, version: int) -> None:
        """The trainer published ``version`` (the ``eta`` rule counts from it)."""
        self.version = max(self.version, version)

    def rollouts_live(self, n: int) -> None:
        """``n`` rollouts generate now (one was lost, or a replacement joined): a barrier
        schedule's batch is shared among them. Kept at the configured count, a batch that
        a lost rollout had not yet taken its part of would never be handed out whole, and
        the run would wait for it for ever."""
        self.replicas = max(1, n)
        # (parts not yet taken are given out again among the rollouts that ask)
        self._quota = {r: k for r, k in self._in_batch.items() if k}

    def release(self, prompt_uids: list[str], untrained: tuple[str, ...] = ()) -> None:
        """Groups that left the system: consumed by an update, or (``untrained``, a
        subset) evicted or discarded without one."""
        for uid in prompt_uids:
            self._owner.pop(uid, None)
            if uid in self.outstanding:
                self.outstanding.remove(uid)
                self.n_released += 1
                self.n_untrained += uid in untrained
                batch = self._batch_of.pop(uid, None)
                if batch is not None and uid in untrained:
                    self._owed.append(batch)
        if self._reissue:  # (re-issued at a fence, then completed by its first rollout)
            gone = set(prompt_uids)
            self._reissue = [g for g in self._reissue if g.prompt_uid not in gone]

    def handed_to(self, rollout_id: str) -> list[str]:
        """The outstanding groups last handed to ``rollout_id``."""
        return sorted(u for u, pieces in self._owner.items() if rollout_id in pieces)

    def forget(self, rollout_id: str) -> None:
        """``rollout_id`` was given up as lost: it leaves the queue for room (the head
        of the queue is the next live asker) and its last answer is dropped (its asks
        are refused from now on, so none is served again)."""
        self._queue.pop(rollout_id, None)
        self._answers.pop(rollout_id, None)

    def reissue_stranded(self, rollout_id: str, known: set[str] | frozenset[str]) -> list[str]:
        """``rollout_id`` was given up as lost (fenced): of the outstanding groups handed
        to it, those nothing else will complete — ``known`` holds the prompt uids the
        partial-response pool has entries of and the buffer holds samples of — go out
        again whole (same prompt, same uid and samples), first to whoever asks next, as a
        resumed run's do. Without this they held ``max_outstanding`` for good: handed to
        it and never registered (it was killed between the two, or it never received the
        answer), no recovery finds them, and a few such batches stall the run. Returns
        their uids (``reissued_at_fence`` counts them).

        ``known`` may name samples too (``{uid}-{i:03d}``, a trajectory's uid): a group
        any of whose samples it names is judged by them, and the samples of the lost
        rollout's piece it does not name go out again. A barrier batch's group split
        among rollouts (:meth:`_batch_pieces`) needs that: by its uid alone, the lost
        rollout's piece of one that another rollout registered is known, and not handed
        out again.

        >>> core = PromptPoolCore([(Prompt(0, "n 2 >", "1 2"), (1, 5))], group_size=4,
        ...                       max_outstanding=8, seed=0, dispatch="batches",
        ...                       groups_per_step=3, replicas=2)
        >>> [(g.prompt_uid, g.sample_indices) for g in core.acquire(3, "r0")]
        [('p00000000', (0, 1, 2, 3)), ('p00000001', (0, 1))]
        >>> [(g.prompt_uid, g.sample_indices) for g in core.acquire(3, "r1")]
        [('p00000001', (2, 3)), ('p00000002', (0, 1, 2, 3))]

        ``r0`` is lost before it registered anything; ``r1`` registered its part:

        >>> core.reissue_stranded("r0", {"p00000001-002", "p00000001-003", "p00000002"})
        ['p00000000', 'p00000001']
        >>> [(g.prompt_uid, g.sample_indices) for g in core.acquire(3, "r2")]
        [('p00000000', (0, 1, 2, 3)), ('p00000001', (0, 1))]
        """
        self.forget(rollout_id)
        by_sample: dict[str, set[int]] = {}
        for k in known:
            uid, sep, i = k.rpartition("-")
            if sep and i.isdigit():
                by_sample.setdefault(uid, set()).add(int(i))
        stranded = []
        for uid in self.handed_to(rollout_id):
            group = self._owner[uid].pop(rollout_id)
            if not self._owner[uid]:
                del self._owner[uid]
            if uid not in self.outstanding:
                continue
            if uid in by_sample:
                missing = tuple(i for i in group.sample_indices if i not in by_sample[uid])
                if not missing:
                    continue
                group = replace(group, samples=missing)
            elif uid in known:
                continue
            self._reissue.append(group)
            stranded.append(uid)
        self.n_reissued_at_fence += len(stranded)
        return stranded

    def hold_again(self, prompt_uids: list[str]) -> None:
        """Groups released as consumed whose update was lost with the trainer: the buffer
        holds them again (:meth:`laminar.buffer.ExperienceBuffer.trainer_restarted`), so
        they count against ``max_outstanding`` until they leave again, as the groups of a
        rebuilt data module do."""
        for uid in prompt_uids:
            if uid not in self.outstanding:
                self.outstanding.add(uid)
                self.n_held_again += 1

    def update_skipped(self) -> None:
        """The trainer consumed a batch but published no version (a non-finite update):
        it trains the next batch at the same version, so with ``batches`` every batch
        still to come is generated one version earlier than counted, and with ``eta``
        one more batch may be out."""
        self.n_skipped += 1
        if self.dispatch == "batches":
            self._floor = self.version  # (generated by the newest published, at least)
            self.batch -= 1
            self._owed = [b - 1 for b in self._owed]
            self._batch_of = {u: b - 1 for u, b in self._batch_of.items()}

    def stats(self) -> dict[str, int]:
        return {
            "dispatched": self.n_dispatched,
            "released": self.n_released,
            "untrained": self.n_untrained,
            "outstanding": len(self.outstanding),
            "reissued": self.n_reissued,
            "reissued_at_fence": self.n_reissued_at_fence,
            "answered_again": self.n_answered_again,
            "held_again": self.n_held_again,
            "queued": len(self._queue),
            "passed_over": self.n_passed_over,
            "epoch": self.epoch,
            "batch": self.batch,
        }


DATA_STATE = "data_state.json"  # in a checkpoint folder: where the prompt order stood
# Its key for what that order is of (laminar.prompts.prompt_order): the pool's stats carry
# it, and the pool's stats are what is written there.
ORDER_KEY = "prompt_order"


def data_position(checkpoint: str | Path | None, order: dict | None = None) -> int:
    """Prompt groups dispatched by the run that wrote ``checkpoint`` (0: start afresh).
    A damaged ``data_state.json`` (not JSON, no ``dispatched``, not a count, not a file
    that reads) is a ``CheckpointError`` naming it; ``check_checkpoint`` calls this
    before the cluster starts.

    With ``order`` (this run's :func:`laminar.prompts.prompt_order`), the position is
    that run's only where it recorded the same order (``prompt_order``): on other
    prompts, or another seed, its position means other prompts, and the order starts
    at 0, with a warning naming what differs (a new run from the weights on other data
    is a run like any). One written before laminar recorded the order is taken on
    trust, as before, and said so."""
    if checkpoint is None:
        return 0
    path = Path(checkpoint) / DATA_STATE
    if not path.exists():
        return 0
    try:
        state = json.loads(path.read_text())
        if not isinstance(state, dict) or "dispatched" not in state:
            raise ValueError('a JSON object with "dispatched" expected')
        n = state["dispatched"]
        # (an int, as the driver writes it: 3.5, "3" or true are not a position)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f'"dispatched" is {n!r}, not a count of prompt groups (>= 0)')
        recorded = state.get(ORDER_KEY)
        if recorded is not None and not isinstance(recorded, dict):
            raise ValueError(f'"{ORDER_KEY}" is {recorded!r}, not a JSON object')
    except (ValueError, OSError) as e:  # (JSONDecodeError, UnicodeDecodeError; unreadable)
        from laminar.learner import CheckpointError

        raise CheckpointError(
            f"{str(path)!r} is damaged ({type(e).__name__}: {e}); it records where the "
            'prompt order stood ({"dispatched": N}, the prompt groups dispatched): '
            "restore it from a copy, or delete it to take the prompts from the first "
            "again, or point trainer.resume_from at another checkpoints/version-N folder"
        ) from None
    if order is None or n == 0:
        return n
    if recorded is None:
        logger.info(
            "%s records no fingerprint of its prompts (written before laminar recorded "
            "one): the prompt order continues after its %d groups dispatched, taken to be "
            "of this run's prompts and seed",
            path,
            n,
        )
        return n
    differs = order_differs(recorded, order)
    if differs is None:
        return n
    logger.warning(
        "trainer.resume_from %s: its run's prompt order differs from this run's (%s); "
        "this run starts its prompt order from the first group, not after the %d that run "
        "dispatched, which were of other prompts. To continue that order, give the run "
        "its prompts (task.prompt_file, or the task.* settings that made them) and seed",
        checkpoint,
        differs,
        n,
    )
    return 0


class PromptPool:
    """Dask actor around :class:`PromptPoolCore` (placed on a ``data`` worker)."""

    def __init__(
        self, cfg: RunConfig, policy_dir: str, resume=None, spec=None, run_dir: str | None = None
    ) -> None:
        """``resume``: the :class:`storage.resume.ResumePlan` of a run resumed in place,
        or of a data module rebuilt within the run (where its prompt order stood, the
        groups its buffer holds again, and the trainer's newest version).
        ``spec``: the run's :class:`~laminar.schedule.ScheduleSpec` (default: Laminar's).
        ``run_dir``: where the pool keeps its dispatch lease (:mod:`laminar.lease`;
        none without it)."""
        from laminar.learner import checkpoint_version
        from laminar.model import load_tokenizer
        from laminar.schedule import LAMINAR

        tok = load_tokenizer(policy_dir)
        prompts = load_prompts(cfg)
        encoded = encode_prompts(tok, prompts, cfg)
        self.order = prompt_order(prompts, cfg.seed)
        spec = spec or LAMINAR
        resumed_from = cfg.trainer.resume_from
        self.core = PromptPoolCore(
            encoded,
            group_size=cfg.rollout.group_size,
            max_outstanding=cfg.buffer.max_outstanding_groups,
            seed=cfg.seed,
            start=data_position(resumed_from, self.order) if resume is None else resume.start,
            outstanding=() if resume is None else tuple(resume.readmit_groups),
            reissue=None if resume is None else resume.reissue,
            dispatch=spec.dispatch,
            groups_per_step=cfg.trainer.groups_per_step,
            replicas=cfg.rollout.replicas,
            lag=spec.lag,
            eta=spec.eta,
            first_version=checkpoint_version(resumed_from) if resumed_from else 0,
        )
        if resume is not None:
            # A rebuilt data module's trainer is at its newest version, past the run's
            # first: from a version before it, top_up would hand groups to rollouts left
            # behind, and take would tell them a version the trainer has long passed.
            self.core.version_published(resume.version)
        self._lease = None
        if run_dir is not None:
            from laminar.lease import DispatchLease

            self._lease = DispatchLease(run_dir, ahead=max(1, cfg.buffer.max_outstanding_groups))
        self._waiting = None  # an asyncio.Event that waiting takes share, made on first use
        self._ending = False  # the run stops: takes no longer wait (end_waits)
        self.fenced: dict[str, float] = {}  # rollouts given up as lost -> when (fence)
        self.n_refused = 0  # asks of fenced rollouts refused

    async def fence(self, rollout_id: str) -> None:
        """``rollout_id`` was given up as lost (the manager found it so: its worker gone,
        or its fence failed) and its process may live on: from now on every ask of it
        raises :class:`RolloutFenced`, and it leaves the queue for room. A group handed
        to it now would hold the back-pressure budget for good, its trajectories never
        finished (its pool entries are resumed elsewhere, and it is told to stop).
        Given by the driver at its poll after the loss (:mod:`pipelines.driver_faults`),
        which then asks what the partial-response pool and the buffer know and hands
        the groups given to it that neither does out again (:meth:`reissue_stranded`)."""
        self.fenced.setdefault(rollout_id, time.time())
        self.core.forget(rollout_id)
        self._changed()  # (a take of it waiting now is refused)

    def _refuse(self, rollout_id: str) -> None:
        if rollout_id in self.fenced:
            self.n_refused += 1
            raise RolloutFenced(
                f"rollout {rollout_id} was given up as lost (its worker gone, or hung and "
                "not stopped by its restart): its work was resumed elsewhere and it gets "
                "no prompts; its process should stop (docs/faults.md, a failed fence)"
            )

    async def reissue_stranded(self, rollout_id: str, known: list[str]) -> int:
        """:meth:`PromptPoolCore.reissue_stranded`, after :meth:`fence`: the groups
        handed to ``rollout_id`` that neither the partial-response pool nor the buffer
        knows (``known``, asked by the driver after the fence) go out again. Returns how
        many."""
        stranded = self.core.reissue_stranded(rollout_id, set(known))
        if stranded:
            logger.warning(
                "prompt pool: %d groups handed to lost rollout %s, registered nowhere, "
                "go out again: %s",
                len(stranded),
                rollout_id,
                ", ".join(stranded[:8]) + (" ..." if len(stranded) > 8 else ""),
            )
            self._changed()
        return len(stranded)

    async def acquire(
        self, n: int, rollout_id: str = "", version: int = 0, ask: object = None
    ) -> list[PromptGroup]:
        """``ask``: the rollout's id of this ask (:meth:`PromptPoolCore.acquire`), here
        and in :meth:`top_up` and :meth:`take`."""
        return self._acquire(n, rollout_id, version, idle=False, ask=ask)

    async def top_up(
        self, n: int, rollout_id: str, version: int, ask: object = None
    ) -> tuple[list[PromptGroup], int]:
        """Up to ``n`` groups for a draining batch of ``version`` while that version is the
        newest published (none after), and the newest published version."""
        groups = self._acquire(n, rollout_id, version, idle=False, newest_only=True, ask=ask)
        return groups, self.core.version

    def _acquire(
        self,
        n: int,
        rollout_id: str,
        version: int,
        idle: bool,
        newest_only: bool = False,
        ask: object = None,
    ) -> list[PromptGroup]:
        self._refuse(rollout_id)
        # (on disk before any of them goes out; none does while it cannot be written. An
        # answer given again is out already.)
        lease = self._lease
        if lease is not None and self.core.answered(rollout_id, ask) is None:
            if not lease.cover(self.core.n_dispatched + n):
                return []
        groups = self.core.acquire(
            n, rollout_id, version, idle=idle, newest_only=newest_only, ask=ask
        )
        if groups:
            self._changed()  # a batch may be out: the next one may go to a waiting rollout
        return groups

    async def take(
        self, n: int, rollout_id: str, version: int, wait_s: float = 0.0, ask: object = None
    ) -> tuple[list[PromptGroup], int]:
        """:meth:`acquire`, waiting up to ``wait_s`` for groups (a long poll: an idle
        rollout waits here rather than calling again and again). Returns the groups and
        the trainer's newest published version: none are given to a rollout behind it
        while the dispatch rule holds them back — it should load that version first."""
        import asyncio

        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            changed = self._event()
            groups = self._acquire(n, rollout_id, version, idle=True, ask=ask)
            left = deadline - loop.time()
            if groups or version < self.core.version or left <= 0 or self._ending:
                return groups, self.core.version
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                return [], self.core.version

    async def end_waits(self) -> None:
        """The run stops: every waiting :meth:`take` returns now, and later ones do not
        wait. (An idle rollout told to stop is in a long poll here; its stop would
        otherwise wait out the poll, up to ``rollout.IDLE_WAIT_S``.) Dispatch is as
        before: a take still gets what the dispatch rule allows."""
        self._ending = True
        self._changed()

    def _event(self):
        import asyncio

        if self._waiting is None:
            self._waiting = asyncio.Event()
        return self._waiting

    def _changed(self) -> None:
        """Something a waiting :meth:`take` may now get: groups released, a version."""
        if self._waiting is not None:
            self._waiting.set()
            self._waiting = None

    async def release(self, prompt_uids: list[str], untrained: tuple[str, ...] = ()) -> None:
        self.core.release(prompt_uids, tuple(untrained))
        self._changed()

    async def version_published(self, version: int) -> None:
        self.core.version_published(version)
        self._changed()

    async def rollouts_live(self, n: int) -> None:
        self.core.rollouts_live(n)
        self._changed()

    async def room(self) -> dict:
        """``{"full": no group may go out now, "outstanding": groups out}`` (the buffer's
        ``same_version`` sampler asks it when it finds no batch)."""
        return {"full": self.core.full(), "outstanding": len(self.core.outstanding)}

    async def hold_again(self, prompt_uids: list[str]) -> None:
        self.core.hold_again(prompt_uids)

    async def update_skipped(self) -> None:
        self.core.update_skipped()
        self._changed()

    async def stats(self) -> dict:
        """The core's counters, and what its order is of (:data:`ORDER_KEY`): what the
        checkpoints' ``data_state.json`` records."""
        out: dict = self.core.stats()
        if self.fenced:
            out |= {"fenced": len(self.fenced), "refused_fenced": self.n_refused}
        out[ORDER_KEY] = self.order
        return out
