"""The driver's polls: what it asks the run's actors every ``metrics.poll_s`` (the data
module's, the manager's, the trainer's and every live rollout's stats), and what in
their answers fails the run (an actor's error, a reward function that never scores).

A mixin of :class:`pipelines.driver.Schedule`, apart from its wiring and its stop so
that each can be read whole. A poll that finds the trainer or the data module silent,
or its worker gone, hands it to the fault handling (:mod:`pipelines.driver_faults`),
which fences a hung worker or restarts what was lost; the poll answers with the last
stats meanwhile. Runs in ``laminar run``'s driver.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from laminar.cluster import actor_result, is_lost
from laminar.rewards import (
    OVERWHELMED_SHARE,
    OVERWHELMED_WINDOW_S,
    REWARD_FAILURE_WINDOW_S,
    REWARD_FAILURES_TO_STOP,
    REWARD_SHARE_WINDOW_S,
    fails_nearly_always,
    fails_too_often,
    never_scores,
    past_share,
    timed_out,
)
from pipelines.driver_faults import core_bound

logger = logging.getLogger("laminar")

# A data-module (or trainer) call that failed as if lost, with its worker still on the
# scheduler's books, is tried again for this long before the run fails.
DATA_SUSPECT_S = 10.0
# A run whose reward function has failed on REWARD_FAILURES_TO_STOP responses, over this
# long, and scored none stops: every failure discards its group, so no batch would ever
# reach the trainer. (The window lets a reward service that starts late, or restarts,
# catch up.) Once it has scored, a run whose reward has failed on REWARD_FAILURES_TO_STOP
# or more of the responses of the last REWARD_SHARE_WINDOW_S, and on more than
# task.reward_max_failure_share of them, stops too (RewardFailures). That window is
# longer: a judge service that restarts, every call failing meanwhile, costs a share of
# it (at 0.25, an outage of up to 75 s goes on; over 60 s it was 15 s). A reward that
# fails on nearly every response (OVERWHELMED_SHARE) does not wait for it: over the
# shorter OVERWHELMED_WINDOW_S it stops the run, whatever it has scored. (The windows
# are laminar.rewards', read here: the warm start names them too.)

# How long a poll waits for the rollouts' stats. A call still unanswered then is kept and
# read at a later poll, not made again: a silent rollout (lost but not yet detected, or
# hung) costs the polls this wait once, not at every poll until the manager declares it.
ROLLOUT_STATS_WAIT_S = 5.0


class RewardFailures:
    """The reward function's failures as the driver's polls see them, and the rules
    that stop a run for them (:meth:`check`); one per run (``Schedule.run``).

    From each poll's rollout stats, the cumulative counters of every rollout
    (``reward_errors``, ``rewards_scored``: responses the function scored, not those cut at
    the length limit, which it is not given) are turned into what is new since that
    rollout's previous answer: a lost rollout's counters leave the stats, and its
    replacement (a new ``rollout_id``) counts from 0, so a sum over the rollouts of a
    poll would go down, then count the replacement's afresh. What was new at each poll
    is kept for ``window_s`` (:data:`REWARD_SHARE_WINDOW_S`).

    A failure discards its trajectory's whole GRPO group (a group dynamic sampling
    filters was scored, all of it: not a failure). A reward that fails on half the
    responses discards all but ``0.5**8`` of groups of 8 (0.4%), and the run would train
    on the few whose every response happened to score; :meth:`check` stops it."""

    def __init__(
        self,
        reward: str,
        max_share: float,
        window_s: float | None = None,
        wait_s: float | None = None,
    ) -> None:
        """``wait_s``: how long a stopping run waits for its rollouts' reward batches
        still in flight (``cluster.actor_timeout_s``), said as the run stops."""
        self.reward, self.max_share = reward, max_share
        self.window_s = REWARD_SHARE_WINDOW_S if window_s is None else window_s
        self.wait_s = wait_s
        self.failing_since: float | None = None  # the first poll that saw a failure
        # the first poll that saw a response scored, in any rollout (None: the never-scores
        # rule stands)
        self.scored_since: float | None = None
        # rollout id -> (reward_errors, rewards_scored) at its last answer (kept once it
        # is gone: a rollout whose stats call is slow is left out of a poll, then back)
        self._seen: dict[str, tuple[int, int]] = {}
        self._new: deque[tuple[float, int, int]] = deque()  # (poll, failed, scored)
        self._latest = ""  # the latest error of a rollout whose failures grew
        self._timeout_said = False  # (a call cut at task.reward_timeout_s: warned of once)

    def check(self, r_stats: list[dict], now: float) -> str | None:
        """Why the run must stop (:meth:`_why`); said as a warning when first found,
        with what the stop waits for: a reward that hangs holds its batches until
        ``cluster.actor_timeout_s``, and the run was silent meanwhile."""
        why = self._why(r_stats, now)
        if why is not None:
            out = sum(int(s.get("pending_rewards") or 0) for s in r_stats)
            logger.warning(
                "stopping the run: %s%s",
                why,
                f" (waiting up to {self._waits()} for the {out} reward batches in flight)"
                if out
                else "",
            )
        return why

    def _waits(self) -> str:
        if self.wait_s is None:
            return "cluster.actor_timeout_s"
        return f"{self.wait_s:.0f} s, cluster.actor_timeout_s,"

    def _why(self, r_stats: list[dict], now: float) -> str | None:
        """Why the run must stop, at the poll at ``now`` that read ``r_stats`` (the live
        rollouts' stats), for its reward's failures; ``None`` while it goes on.

        A reward that has failed on every response given to it stops the run once it
        has failed on :data:`REWARD_FAILURES_TO_STOP` of them over at least
        :data:`REWARD_FAILURE_WINDOW_S` (:func:`~laminar.rewards.never_scores`): no batch
        would ever reach the trainer. Once anything has scored, it stops the run when,
        over the last ``window_s`` (after a whole one from its first score: a service that
        starts late is the rule above's), it has failed on that many and on more than
        ``task.reward_max_failure_share`` of the responses
        (:func:`~laminar.rewards.fails_too_often`); at ``1.0`` it never does, and only
        the first rule stands.

        Whatever has scored, a reward that has failed on :data:`REWARD_FAILURES_TO_STOP`
        or more, and on :data:`~laminar.rewards.OVERWHELMED_SHARE` (90%) or more of the
        responses of the last :data:`~laminar.rewards.OVERWHELMED_WINDOW_S` (120 s), stops
        the run then, not after the share rule's longer window
        (:func:`~laminar.rewards.fails_nearly_always`): a group is kept only if all its
        responses scored, so next to none is, and those few are not the policy's
        (``None`` for a wrong answer, 1.0 for a right one: only the groups right
        throughout, whose advantages are all 0). An outage of up to a minute (the time
        the never-scores rule gives a late start) leaves that window half scored. At
        ``task.reward_max_failure_share`` 0.9 or more, its share is that one instead."""
        self._count(r_stats, now)
        self._say_timeout(r_stats)
        errors = sum(s.get("reward_errors", 0) for s in r_stats)
        if errors and self.failing_since is None:
            self.failing_since = now
        if self.scored_since is None and any(s.get("rewards_scored") for s in r_stats):
            self.scored_since = now
        if self.scored_since is not None:
            return self._overwhelmed(now) or self._share_stop(now)
        if not errors:
            return None
        if errors < REWARD_FAILURES_TO_STOP or now - self.failing_since < REWARD_FAILURE_WINDOW_S:
            return None
        latest = next((s["last_reward_error"] for s in r_stats if s.get("last_reward_error")), "")
        return never_scores(self.reward, errors, now - self.failing_since, latest)

    def _say_timeout(self, r_stats: list[dict]) -> None:
        """Warn, once, of the first call cut at ``task.reward_timeout_s`` a poll sees:
        each holds its rollout's rewards that long, and a reward that never returns
        stops the run only after :data:`REWARD_FAILURES_TO_STOP` of them (at the default
        300 s, hours of a run that trains nothing, silent till then)."""
        if self._timeout_said:
            return
        cut = next((e for s in r_stats if timed_out(e := s.get("last_reward_error"))), None)
        if cut is None:
            return
        self._timeout_said = True
        logger.warning(
            "task.reward %r: %s (cut, its trajectory marked a reward error); each such call "
            "holds its rollout's rewards that long, and a reward that never returns stops "
            "the run only after %d such failures with none scored: fix the function or the "
            "service it calls, or lower task.reward_timeout_s to fail sooner (raise it if "
            "the reward is only slow)",
            self.reward,
            cut,
            REWARD_FAILURES_TO_STOP,
        )

    def _count(self, r_stats: list[dict], now: float) -> None:
        """Keep the failures and scored responses new since the last poll, by its time,
        for a window."""
        failed = scored = 0
        for s in r_stats:
            rid = s.get("rollout_id")
            errors, done = s.get("reward_errors", 0), s.get("rewards_scored", 0)
            seen_errors, seen_done = self._seen.get(rid, (0, 0))
            # (below what was seen: counted from 0 again, by a rollout of the same id)
            new_errors = errors - seen_errors if errors >= seen_errors else errors
            new_done = done - seen_done if done >= seen_done else done
            self._seen[rid] = (errors, done)
            failed, scored = failed + new_errors, scored + new_done
            if new_errors and s.get("last_reward_error"):
                self._latest = s["last_reward_error"]
        self._new.append((now, failed, scored))
        kept_s = max(self.window_s, OVERWHELMED_WINDOW_S)
        while self._new and self._new[0][0] <= now - kept_s:
            self._new.popleft()

    def _within(self, now: float, window_s: float) -> tuple[int, int]:
        """Failed and scored responses of the polls of the last ``window_s``."""
        polls = [(f, d) for t, f, d in self._new if t > now - window_s]
        return sum(f for f, _ in polls), sum(d for _, d in polls)

    def _overwhelmed(self, now: float) -> str | None:
        """The rule of :meth:`check` on a reward that fails on nearly every response."""
        share = max(OVERWHELMED_SHARE, self.max_share)
        if self.max_share >= 1.0 or self.failing_since is None:
            return None
        if now - self.failing_since < OVERWHELMED_WINDOW_S:
            return None
        failed, scored = self._within(now, OVERWHELMED_WINDOW_S)
        if failed < REWARD_FAILURES_TO_STOP or failed < share * (failed + scored):
            return None
        return fails_nearly_always(
            self.reward, failed, scored, share, OVERWHELMED_WINDOW_S, self._latest
        )

    def _share_stop(self, now: float) -> str | None:
        """The failure-share rule of :meth:`check`, once something has scored."""
        window = self.window_s
        if self.max_share >= 1.0 or now - self.scored_since < window:
            return None
        # (all after the poll that first saw a score: what failed before, a late start,
        # is the never-scores rule's)
        failed, scored = self._within(now, window)
        if not past_share(failed, scored, self.max_share):
            return None
        return fails_too_often(
            self.reward, failed, scored, self.max_share, f"in the last {window:.0f} s", self._latest
        )


class StatsPolling:
    """The polls of :class:`~pipelines.driver.Schedule`, which sets up what they read
    (``cfg``, ``actors``, ``core_workers``, the last stats of each, the restarts in
    progress) and calls them from ``run``."""

    def _data_stats(self) -> tuple[dict, dict]:
        """The buffer's and prompt pool's stats; while a lost data module is rebuilt
        (:attr:`data_restartable`), the last ones, and each call advances the rebuild.
        Raises when the data module is lost and cannot be rebuilt."""
        a = self.actors
        timeout = self._core_timeout()
        if self._data_restart is None:
            try:
                if self._data_hung is not None:  # fenced: wait until the scheduler drops it
                    raise TimeoutError(f"the data module on {self._data_worker()} is hung")
                futures = [(x, x.stats()) for x in (a["buffer"], a["pool"])]
                self._last_data_stats = tuple(actor_result(x, f, timeout) for x, f in futures)
                self._data_suspect = None
                return self._last_data_stats
            except Exception as e:
                lost = self._lost_core()
                if not lost and is_lost(e) and self._last_data_stats is not None:
                    now = time.time()
                    self._data_suspect = self._data_suspect or now
                    hung = self._data_hung
                    if hung is not None:  # fenced: wait for its worker to go
                        self._fence_overdue(hung, now, e)
                        return self._last_data_stats
                    if isinstance(e, TimeoutError):  # silent for heartbeat_timeout_s
                        self._fence_data(timeout)
                        return self._last_data_stats
                    # (a call may fail a moment before the scheduler drops the worker)
                    if self.data_restartable and now - self._data_suspect < DATA_SUSPECT_S:
                        return self._last_data_stats
                if not self._begin_restart(lost, e):
                    return self._last_data_stats
        if self._data_restart.step():
            self._restarted(self._data_restart)
        return self._last_data_stats

    def _trainer_errors(self, t_stats: dict) -> list[dict]:
        """The trainer's errors (and its other ranks') that fail the run. Restartable and
        data-parallel, an error may be a collective that a lost rank broke: it fails
        the run only if no rank's worker is lost within :data:`DATA_SUSPECT_S` (a lost
        one restarts the group instead)."""
        from pipelines.restart import CoreRestart

        a = self.actors
        if self._restart is not None or isinstance(self._data_restart, CoreRestart):
            return []  # (no trainer runs)
        out = [t_stats] if t_stats["error"] else []
        # Every rank asked at once, one wait for them all (one after another, a poll
        # took 1.3 ms a rank, and a silent rank's wait was added to each later one's).
        asked = []
        for r in a["trainer_ranks"]:
            if r._address in self._fenced:
                continue
            try:
                asked.append((r, r.stats()))
            except Exception:  # noqa: BLE001 — its worker is known lost
                continue
        deadline = time.monotonic() + min(5.0, self._core_timeout())
        for r, future in asked:
            try:
                # (not 0 past the deadline: distributed then times out an answer already in)
                rank = actor_result(r, future, max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 — lost or hung: _check_group fences the group
                continue
            if rank["error"]:
                out.append(rank)
        if out and self.restartable and self.cfg.trainer.ranks > 1:
            group = self._group().values()
            if any(w in self._fenced for w in group):
                return []  # (being restarted)
            now = time.time()
            self._group_suspect = self._group_suspect or now
            if now - self._group_suspect < DATA_SUSPECT_S:
                return []
        return out

    def _manager_stats(self) -> dict | None:
        """The manager's stats (``None``: there is none, it is being rebuilt, or the data
        module does not answer)."""
        manager = self.actors["manager"]
        if manager is None or self._data_restart is not None or self._data_suspect:
            return None
        if self._data_hung is not None:  # (fenced: its worker is going)
            return None
        what = "the rollout manager's stats()"
        try:
            self._last_m_stats = actor_result(manager, manager.stats(), self._core_timeout())
        except Exception as e:
            if not self.data_restartable:
                raise
            self._own_error(what, e)
            self._data_silent(e)
            return None  # lost with the data module just now: the next poll rebuilds it
        self._answered(what)
        return self._last_m_stats

    def _trainer_stats(self) -> dict:
        """The trainer's stats; while a lost trainer restarts (:attr:`restartable`), what
        it last reported, and each call advances the restart. A trainer that does not
        answer, or whose training loop shows no progress, for
        ``faults.heartbeat_timeout_s`` is hung: its worker is restarted (:meth:`_fence`)
        and it is then lost. Raises when the trainer is lost and cannot be restarted."""
        from pipelines.restart import CoreRestart

        a, faults = self.actors, self.cfg.faults
        if isinstance(self._data_restart, CoreRestart):  # (no trainer runs meanwhile)
            return self._data_restart.stand_in
        if a["trainer"] is None and self._restart is None:  # (_trainer_finished)
            return self._last_t_stats
        if self._restart is None:
            worker = self._trainer_worker()
            try:
                if worker in self._fenced:  # hung: wait until the scheduler drops it
                    raise TimeoutError(f"the trainer on {worker} is hung (fenced)")
                t_stats = actor_result(a["trainer"], a["trainer"].stats(), self._core_timeout())
                silent = t_stats.get("silent_s")
                if silent is not None and silent > faults.heartbeat_timeout_s:
                    self._fence("trainer", worker, silent)
                    return self._t_stand_in()
                self._last_t_stats, self._trainer_suspect = t_stats, None
                if self.restartable and self.cfg.relay.audit_weights:
                    # Kept here, every poll: the fingerprints die with the trainer.
                    since = max(self._published_fps, default=-1)
                    try:
                        future = a["trainer"].get_fingerprints(since)
                        new = actor_result(a["trainer"], future, self._core_timeout())
                    except TimeoutError:  # slow, not silent (its stats answered): next poll
                        new = {}
                    self._published_fps.update(new)
                return self._last_t_stats
            except Exception as e:
                lost = self._lost_core()
                now = time.time()
                if not lost and is_lost(e) and not isinstance(e, TimeoutError):
                    # (a call may fail a moment before the scheduler drops the worker)
                    self._trainer_suspect = self._trainer_suspect or now
                    if self.restartable and now - self._trainer_suspect < DATA_SUSPECT_S:
                        return self._t_stand_in()
                if not lost and isinstance(e, TimeoutError):
                    fenced = self._fenced.get(worker)
                    if fenced is None:  # it did not answer for heartbeat_timeout_s
                        bound = core_bound(self.cfg)
                        self._fence("trainer", worker, self._core_timeout(), bound=bound)
                    else:
                        self._fence_overdue(fenced, now, e)
                    return self._t_stand_in()
                self._trainer_suspect = None
                if not self._begin_restart(lost, e):
                    return self._t_stand_in()
                if self._restart is None:  # (lost with the data module: CoreRestart)
                    return self._data_restart.stand_in
        handle = self._restart.step()
        if handle is None and not self._restart.finished:
            return self._restart.stand_in
        r, self._restart = self._restart, None
        self.trainer_restarts.append(r.record)
        if r.finished:
            self._trainer_finished(r)
        else:
            self._trainer_back(r, "trainer", handle)
        return self._last_t_stats

    def _share_batches(self, m_stats: dict) -> None:
        """Tell the prompt pool how many rollouts generate, when that changes: a barrier
        schedule's batch is handed out in parts, one per live rollout."""
        # (a hung one too: fenced, it generates nothing, though not declared lost yet)
        live = len(self._rollouts_except({*m_stats["lost"], *m_stats["hung"]}))
        told = (self.actors["pool"], live)
        if told == self._pool_told or self.schedule.dispatch != "batches":
            return
        try:
            actor_result(self.actors["pool"], self.actors["pool"].rollouts_live(live), 5.0)
            self._pool_told = told
        except Exception as e:  # noqa: BLE001 — the data module's loss is found elsewhere
            logger.warning("the prompt pool was not told of %d live rollouts: %r", live, e)

    def _live_rollouts(self) -> list:
        """The rollouts the manager has not declared lost."""
        a = self.actors
        lost = {}
        if a["manager"] is not None:
            try:
                if self._data_restart is not None:
                    raise RuntimeError("the manager is being rebuilt")
                lost = a["manager"].get_lost().result(timeout=5.0)
            except Exception:  # noqa: BLE001 — the manager (data worker) is gone itself
                lost = (self._last_m_stats or {}).get("lost", {})
        return self._rollouts_except(lost)

    def _rollouts_except(self, gone) -> list:
        """The rollouts whose ids are not in ``gone``. A rollout's id is ``r<i>``, ``i``
        its place in ``actors["rollouts"]`` (a replacement is appended with the next)."""
        return [r for i, r in enumerate(self.actors["rollouts"]) if f"r{i}" not in gone]

    def _rollout_stats(self) -> list[dict]:
        """Stats of every live rollout that answers within :data:`ROLLOUT_STATS_WAIT_S`
        (one lost but not yet detected does not hold the run up). A rollout whose last
        call is still out is not called again: that call's answer is read when it comes,
        and until then the rollout is left out, as a lost one is."""
        out, waiting = [], []
        pending, self._r_pending = self._r_pending, {}
        for r in self._live_rollouts():
            f = pending.get(r.key)
            if f is None:
                try:
                    f = r.stats()
                except Exception:  # noqa: BLE001 — its worker is known lost
                    continue
            elif not f.done():
                self._r_pending[r.key] = f  # still silent: no new call, no wait
                continue
            waiting.append((r.key, f))
        deadline = time.monotonic() + ROLLOUT_STATS_WAIT_S
        for key, f in waiting:
            what = f"rollout {key}'s stats()"
            try:
                # (not 0 past the deadline: distributed then times out an answer already in)
                out.append(f.result(timeout=max(0.1, deadline - time.monotonic())))
            except TimeoutError:
                self._r_pending[key] = f
            except Exception as e:  # noqa: BLE001 — lost (the manager recovers its work)
                self._own_error(what, e)
            else:
                self._answered(what)
        return out
