"""What ``laminar run`` shows: a run's progress while it goes (a bar on a terminal, plain
lines in logs and pipes) and its summary when it ends, or, for a run whose driver failed,
what the stores said.

Apart from the command (:mod:`pipelines.cli_run`) because it is formatting alone: a
progress or summary dict in, lines out, no cluster and no signals (the one store it
reads: the run's ``faults`` table, which says how each recovery resumed what it took).
"""

from __future__ import annotations

import time


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _progress_line(p: dict) -> str:
    if p.get("phase") != "training":
        return f"[{p.get('phase')}]"
    return (
        # (the version the run ends at: a trainer restarted within the run skips the lost
        # one's numbers, so versions can pass trainer.steps; the updates cannot)
        f"t={p['elapsed_s']:6.1f}s  version {p['version']:>3}/{p.get('last_version', p['steps'])}  "
        f"reward {_fmt(p['reward'])}  gen {p['gen_tok_s']:7.0f} tok/s  "
        f"buffer {p['buffer_depth']:>4}  s_train {_fmt(p['s_train_mean'], '.2f')}  "
        f"trajectories {p['trajectories']}" + _untrained(p, "  ") + _walltime(p)
    )


def _untrained(p: dict, sep: str) -> str:
    """The trajectories that left the buffer untrained, by why: a third of what a run
    generated can be evicted (``buffer.max_train_staleness``) or filtered
    (``buffer.dynamic_sampling``), and the line said only the discarded.

    >>> _untrained({"evicted": 1920, "filtered": 0, "discarded": 0}, "  ")
    '  untrained 1920 (evicted 1920)'
    >>> _untrained({"evicted": 6696, "filtered": 10384, "discarded": 3}, " ")
    ' untrained 17083 (evicted 6696, filtered 10384, discarded 3: reward errors)'
    >>> _untrained({"discarded": 0}, "  ")
    ''
    """
    why = {k: int(p.get(k) or 0) for k in ("evicted", "filtered", "discarded")}
    if not any(why.values()):
        return ""
    said = ", ".join(f"{k} {v}" for k, v in why.items() if v)
    return (
        f"{sep}untrained {sum(why.values())} ({said}"
        + (": reward errors" if why["discarded"] else "")
        + ")"
    )


def _walltime(p: dict) -> str:
    """When the run stops for its Slurm jobs' walltime (docs/deploy.md, "Walltime").

    >>> _walltime({"walltime_stop_in_s": 3300.0}), _walltime({"walltime_stop_in_s": 75.2})
    ('  walltime stop in 55 min', '  walltime stop in 75 s')
    >>> _walltime({"walltime_stop_in_s": None}), _walltime({})
    ('', '')
    """
    s = p.get("walltime_stop_in_s")
    if s is None:
        return ""
    return f"  walltime stop in {s / 60:.0f} min" if s >= 120 else f"  walltime stop in {s:.0f} s"


class _Lines:
    """Progress as plain lines (logs, pipes, CI): on every phase change, and every 2 s
    while training."""

    def __init__(self) -> None:
        self.last, self.t_last = "", 0.0

    def show(self, p: dict, force: bool = False) -> None:
        line = _progress_line(p)
        due = line.startswith("t=") and time.time() - self.t_last >= 2.0
        if line != self.last and (force or due or not line.startswith("t=")):
            print(line, flush=True)
            self.last, self.t_last = line, time.time()

    def close(self) -> None:
        pass


class _Bar:
    """Progress as a bar over the updates made of trainer.steps (interactive terminals)."""

    def __init__(self) -> None:
        self.bar = None
        self.phase = None

    def show(self, p: dict, force: bool = False) -> None:
        from tqdm import tqdm

        if p.get("phase") != "training":
            if p.get("phase") != self.phase:
                print(f"[{p.get('phase')}]", flush=True)
                self.phase = p.get("phase")
            return
        if self.bar is None:
            self.bar = tqdm(total=p["steps"], unit="update", dynamic_ncols=True)
        self.bar.n = p.get("updates", p["version"])
        self.bar.set_postfix_str(
            f"reward {_fmt(p['reward'])} gen {p['gen_tok_s']:.0f} tok/s "
            f"buffer {p['buffer_depth']} s_train {_fmt(p['s_train_mean'], '.2f')}"
            + _untrained(p, " ")
            + _walltime(p).replace("  ", " ", 1)
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def groups(n: int) -> str:
    """``n`` prompt groups, in words: ``"1 group"``, ``"0 groups"``."""
    return f"{n} group" + ("" if n == 1 else "s")


def reissued(r: dict) -> str:
    """What a resume re-issued, from its plan's summary (``summary.json``'s ``resumed``):
    the samples, of two kinds of group, as the resume's start printed them (a group the
    store holds siblings of, and one only the recovery log names: every sample)."""
    samples = r.get("reissued_samples", 0)
    if "reissued_groups" not in r:
        return f"{samples} samples re-issued"
    whole = r.get("log_groups", 0)
    if siblings := r["reissued_groups"] - whole:  # (a resume before groups stored in part
        return (  # were dropped: their missing samples were re-issued)
            f"{samples} samples re-issued (the missing siblings of "
            f"{groups(siblings)}; {groups(whole)} with nothing stored, whole)"
        )
    return f"{samples} samples re-issued ({groups(whole)} with nothing stored, whole)"


def dropped(r: dict) -> str:
    """What a resume dropped, from its plan's summary: the trajectories, and the groups
    among them stored in part (their missing samples would be another policy's)."""
    if "dropped_incomplete_groups" not in r:
        return f"{r['dropped']} dropped"
    return f"{r['dropped']} dropped ({groups(r['dropped_incomplete_groups'])} stored in part)"


def replaced(rids: list[str], faults: dict) -> str:
    """Lost rollouts ``rids`` with the replacement each got (``faults.replacements`` of
    summary.json), as ``r0 → r2``; one not replaced (none free, or ``faults.replace``
    off) alone.

    >>> replaced(["r0", "r1"], {"replacements": {"r0": "r2"}})
    'r0 → r2, r1 not replaced'
    """
    new = faults.get("replacements") or {}
    return ", ".join(f"{r} → {new[r]}" if r in new else f"{r} not replaced" for r in rids)


def recovered_how(s: dict) -> str:
    """What this start's recoveries resumed, from the ``faults`` table of the run's
    ``metrics.zarr`` (each row's ``how``): unfinished trajectories resumed (imported into
    a running batch, or adopted as a new one) and finished ones rescored (their rewards
    were in flight). ``faults.recovered_requests`` counts both: said alone as
    "unfinished ... resumed", it called 120 rescored trajectories unfinished. Where the
    table does not add up to it (absent, or rows lost with a data module before the
    driver copied them), the total, said as both."""
    faults = s["faults"]
    total = int(faults.get("recovered_requests", 0))
    either = f"{total} trajectories recovered elsewhere (unfinished resumed or finished rescored)"
    import numpy as np

    from storage.metrics import open_metrics

    try:
        rows = open_metrics(s["run_dir"], "faults")
    except Exception:  # noqa: BLE001 — no table (or unreadable): the total alone
        return either
    start = int(s.get("segments", 1)) - 1
    if "segment" in rows:  # (this start's rows; an older table's are all the first start's)
        here = rows["segment"].values == start
    else:
        here = np.full(rows.sizes["recovery"], start == 0)
    how = rows["how"].values.astype(str)[here]
    n = np.nan_to_num(rows["requests"].values[here].astype(float)).astype(int)
    rescored = int(n[how == "rescore"].sum())
    resumed = int(n[how != "rescore"].sum())  # (import, adopt; none and unrecovered: 0)
    if resumed + rescored != total:
        return either
    return f"{resumed} unfinished trajectories resumed elsewhere, {rescored} finished rescored"


def trajectories_line(s: dict) -> str:
    """The summary's trajectories: those stored, and where each ended up (every status
    but consumed where there are any: ``status_counts``), so that what left the buffer
    untrained (evicted, filtered, discarded) is said beside what was trained on.

    >>> trajectories_line({"trajectories": 6016, "consumed": 3840, "status_counts":
    ...     {"n_consumed": 3840, "n_buffered": 256, "n_evicted": 1920, "n_filtered": 0}})
    'trajectories       6016 (3840 consumed, 256 buffered, 1920 evicted)'
    """
    left = {k[2:]: v for k, v in s.get("status_counts", {}).items() if k != "n_consumed" and v}
    return (
        f"trajectories       {s['trajectories']} ({s['consumed']} consumed"
        + "".join(f", {v} {k}" for k, v in sorted(left.items()))
        + ")"
    )


def reward_errors_line(errors: dict | None) -> str | None:
    """The summary's reward failures (:func:`pipelines.summary.reward_errors`), where
    there were any: the reward line above it is the mean of the responses that scored
    alone, and said nothing of a reward that failed on 99% of them.

    >>> print(reward_errors_line({"failed": 15, "scored": 265, "groups_discarded": 11,
    ...     "latest": "m:f raised"}))
    reward errors      15 of 280 responses (5%), 11 groups discarded; latest: m:f raised
    >>> reward_errors_line({"failed": 0, "scored": 280, "groups_discarded": 0, "latest": None})
    """
    if not errors or not errors.get("failed"):
        return None
    failed, given = errors["failed"], errors["failed"] + errors["scored"]
    share = failed / given
    # (never "0%" nor "100%" for a share that is neither)
    shown = "<1%" if share < 0.005 else ">99%" if 0.995 <= share < 1 else f"{share:.0%}"
    return (
        f"reward errors      {failed} of {given} responses ({shown}), "
        f"{errors['groups_discarded']} groups discarded; latest: {errors['latest']}"
    )


def warm_start_said(sft: dict) -> str:
    """The summary's warm start: its time, and whether it was trained or found cached;
    or that it was off (it said "cached" then, of a warm start that never was).

    >>> warm_start_said({"wall_s": 41.2, "cached": False})
    'warm start 41.2 s (trained)'
    >>> warm_start_said({"wall_s": 0.2, "cached": True, "off": True})
    'warm start off (sft.enabled=false or sft.steps=0)'
    """
    if sft.get("off"):
        return "warm start off (sft.enabled=false or sft.steps=0)"
    how = "cached" if sft.get("cached") else "trained"
    return f"warm start {sft.get('wall_s', 0):.1f} s ({how})"


def _print_summary(s: dict, began_from: str | None = None) -> None:
    """``began_from``: the checkpoint the run began from (``trainer.resume_from`` of a
    new run), whose weights, not the warm start's, it started with."""
    sft = s["sft"]
    print("\n== summary ==")
    print(f"run dir            {s['run_dir']}  ({s['reason']})")
    failed = (s.get("reward_errors") or {}).get("failed")
    print(
        f"reward             first 20% {s['reward_first_20pct']:.3f} -> last 20% "
        f"{s['reward_last_20pct']:.3f}  (gain {s['reward_gain']:+.3f})"
        # (a mean of what scored alone: 1.000 of a reward that failed on 99%)
        + ("; reward errors left out" if failed else "")
    )
    if line := reward_errors_line(s.get("reward_errors")):
        print(line)
    if (flat := s.get("flat_group_share")) is not None and flat == flat:
        print(
            f"flat groups        {flat:.0%} of those trained on (every reward equal: "
            "advantage 0, no gradient)"
        )
    made = (
        f"  ({s['updates']} updates made)"
        if s.get("updates", s["versions"]) != s["versions"]
        else ""
    )
    print(f"versions           {s['versions']}{made}")
    if r := s.get("resumed"):
        print(
            f"resumed            at version {r['version']}: {r['readmitted']} trajectories "
            f"back in the buffer, {reissued(r)}, {dropped(r)}"
        )
    print(trajectories_line(s))
    print(f"tokens             {s['prompt_tokens']} prompt + {s['response_tokens']} response")
    print("staleness (mean)   " + "  ".join(f"{k[:-5]} {v:.2f}" for k, v in s["staleness"].items()))
    whole = (
        f" ({s['rl_wall_s_total']:.1f} s over the run's {s['segments']} starts)"
        if s.get("segments", 1) > 1
        else ""
    )
    print(f"wall time          RL {s['rl_wall_s']:.1f} s{whole}; {warm_start_said(sft)}")
    if "eval_reward" in sft:
        print(
            f"warm-start reward  {sft['eval_reward']:.3f} "
            f"(one sample each of {sft['eval_prompts']} prompts"
            + (
                f"; not this run's start: it began from the weights of {began_from})"
                if began_from
                else ")"
            )
        )
    eng = s.get("engine", {})
    if eng.get("parity_checks"):
        print(
            f"engine parity      max |behavior - trainer logprob| {eng['parity_max_abs']:.2e} "
            f"over {eng['parity_checks']} checks"
        )
    if "modelled_s" in eng:
        print(
            f"pacing             modelled {eng['modelled_s']:.1f} s, real compute "
            f"{eng['compute_s']:.1f} s, {eng['overruns']} steps over the model"
        )
    relay = s.get("relay")
    if relay:
        waits = relay["rollout_wait_s"]
        stall, bcast = relay["stall_s_median"] * 1e3, relay["broadcast_s_median"] * 1e3
        print(
            f"weights            {len(relay['chain'])} relay(s); publication stall {stall:.1f} ms, "
            f"broadcast {bcast:.1f} ms (medians); rollout wait "
            f"{sum(waits) / max(len(waits), 1):.1f} s per rollout"
        )
        if "fingerprints" in relay:
            fp = relay["fingerprints"]
            print(
                f"weights audit      {fp['loads_checked']} loads checked, {fp['mismatched']} "
                "differ from what the trainer published"
                + (
                    f" ({fp['unverified']} of versions a lost trainer published unchecked)"
                    if fp.get("unverified")
                    else ""
                )
            )
    repack = s.get("repack")
    if repack:
        print(
            f"repack             {repack['moves']} moves ({repack['rolled_back']} rolled back), "
            f"{repack['requests_moved']} requests, pause {repack['pause_s']:.2f} s"
        )
    faults = s.get("faults")
    unrecovered = (faults or {}).get("unrecovered") or {}
    recovered = sorted(set((faults or {}).get("lost") or {}) - set(unrecovered))
    if recovered:
        print(
            f"faults             {len(recovered)} rollout(s) lost "
            f"({replaced(recovered, faults)}); {recovered_how(s)} in "
            f"{faults['recoveries']} recoveries (`laminar audit RUN_DIR`)"
        )
    for rid, u in sorted(unrecovered.items()):
        held = (
            "what it held unknown (it never reported)"
            if u.get("requests") is None
            else f"{u['requests']} unfinished requests and {u['unscored']} unscored "
            "trajectories with it"
        )
        new = (faults.get("replacements") or {}).get(rid)
        print(
            f"faults             {rid} {'hung, then ' if u.get('hung') else ''}lost, not "
            f"recovered (faults.recover=false): {held}"
            + (f"; replaced: {rid} → {new}" if new else "")
        )
    if hung := sorted(set((faults or {}).get("hung") or {}) - set(unrecovered)):
        print(
            f"hung               {', '.join(hung)}: no progress for "
            "faults.heartbeat_timeout_s; worker restarted, then recovered as lost"
        )
    for r in (faults or {}).get("trainer_restarts", []):
        if r.get("finished"):  # (restart._finish: no trainer started again)
            print(
                f"trainer            lost after its final checkpoint (version "
                f"{r['checkpoint_version']}): every update was made, none restarted"
            )
            continue
        print(
            f"trainer            lost, restarted in the run in {r['restart_s']:.1f} s from "
            f"version {r['checkpoint_version']} ({r['lost_updates']} update(s) lost and "
            f"redone, {r['readmitted']} trajectories back in the buffer); numbering goes on "
            f"after version {r['after_version']}"
        )
    for r in (faults or {}).get("data_restarts", []):
        print(
            f"data module        lost, rebuilt in the run in {r['restart_s']:.1f} s from the "
            f"stores ({r['held_again']} trajectories held again, {r['marked_consumed']} "
            f"consumed events written, {r['outstanding_groups']} groups outstanding, "
            f"{r['registered']} unfinished trajectories registered anew)"
        )
    for r in (faults or {}).get("core_restarts", []):
        if r.get("finished"):
            print(
                f"trainer + data     lost together after the final checkpoint (version "
                f"{r['checkpoint_version']}): the data module rebuilt in {r['restart_s']:.1f} s "
                "to close the store; every update was made, no trainer restarted"
            )
            continue
        print(
            f"trainer + data     lost together, restarted in the run in {r['restart_s']:.1f} s "
            f"from version {r['checkpoint_version']} ({r['lost_updates']} update(s) lost and "
            f"redone, {r['held_again']} trajectories held again, {r['registered']} "
            f"unfinished trajectories registered anew); numbering goes on after version "
            f"{r['after_version']}"
        )
    if faults and faults.get("relays_lost"):
        print(
            f"relays             {len(faults['relays_lost'])} lost "
            f"({', '.join(sorted(faults['relays_lost']))}); chain now "
            + " -> ".join(faults["chain"] or [])
        )
    print(f"checkpoint         {s['checkpoint']}")


def _print_failed_summary(s: dict) -> None:
    """The summary of a run whose driver failed (``pipelines.summary.summarize_failed``):
    only what the stores said."""
    print("\n== summary ==")
    print(f"run dir            {s['run_dir']}  ({s['reason']})")
    if "trajectories" in s:
        print(trajectories_line(s))
        print(
            f"reward             first 20% {s['reward_first_20pct']:.3f} -> last 20% "
            f"{s['reward_last_20pct']:.3f}"
        )
    if "versions" in s:
        print(f"versions           {s['versions']} (the last the stores record)")
