"""``laminar audit RUN_DIR``: what a run's stores prove about it, faults included.

From the stores alone (no cluster, no actors): the data contract
(:meth:`LaminarAccessor.audit`), where every stored trajectory ended up, the groups, and
each lost rollout's recovery (the ``faults`` table of ``metrics.zarr``)::

    report = audit_run("runs/my-run")
    print(report.text())
    assert report.ok, report.problems

A *problem* breaks a guarantee (a uid stored twice, a consumed group incomplete, a
trajectory that mixes weight versions, a lost rollout's trajectory that finished
nowhere); a *note* is a fact worth knowing (groups still in flight when the run stopped).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from storage.schema import ALL_FIELDS, STATUSES
from storage.stores import StoreError, no_array, reading, store_path


@dataclass
class AuditReport:
    run_dir: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    # The figures that break down the one before (each status of "trajectories", ...):
    # indented in text() only, their keys plain (``figures["buffered"]``)
    parts: set[str] = field(default_factory=set, repr=False)

    def part(self, key: str, value: float) -> None:
        """Set the figure ``key``, a part of the figure before it (indented in text)."""
        self.figures[key] = value
        self.parts.add(key)

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        lines = [f"audit of {self.run_dir}: " + ("CLEAN" if self.ok else "PROBLEMS")]
        for k, v in self.figures.items():
            key = f"  {k}" if k in self.parts else k
            lines.append(f"  {key:<34} {_fmt(v)}")
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "run_dir": self.run_dir,
            "ok": self.ok,
            "problems": self.problems,
            "notes": self.notes,
            "figures": dict(self.figures),
        }


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def require_fields(ds, run_dir: Path) -> None:
    """A :class:`StoreError` where the run's trajectories (``open_run``) lack a field of
    the contract: its array is not in the store (the message a resume gives)."""
    if missing := [f for f in ALL_FIELDS if f not in ds]:
        raise no_array(store_path(run_dir), missing)


def audit_run(run_dir: str | Path, tokens: bool = False) -> AuditReport:
    """Audit a run directory; raises ``FileNotFoundError`` without a trajectory store.
    ``tokens``: also read every token array, chunk by chunk (:func:`_audit_tokens`;
    ``laminar audit --tokens``): the other checks read the per-trajectory arrays only."""
    from storage.trajectories import open_run

    run_dir = Path(run_dir)
    ds = open_run(run_dir)
    require_fields(ds, run_dir)
    report = AuditReport(str(run_dir))
    report.problems += ds.laminar.audit()
    if ds.attrs.get("unknown_events"):
        report.problems.append(
            f"{ds.attrs['unknown_events']} leave events name trajectories the store does not "
            f"hold, e.g. {ds.attrs['unknown_event_uid']!r} (a batch that failed to write, or "
            "two processes writing the store); they were skipped"
        )
    status = ds["status"].values
    n = int(ds.sizes["trajectory"])
    report.figures["trajectories"] = n
    for s in STATUSES:
        report.part(s, int((status == s).sum()))

    # Groups: every stored group is whole, except those still generating at the stop
    # (buffered), or when a lost run stopped and was resumed (dropped then).
    prompt_uid = ds["prompt_uid"].values
    groups, inverse, sizes = np.unique(prompt_uid, return_inverse=True, return_counts=True)
    want = np.zeros(len(groups), dtype=np.int64)
    want[inverse] = ds["group_size"].values
    short = sizes < want
    report.figures["groups"] = len(groups)
    if short.any():
        open_groups = set(groups[short])
        in_flight = np.isin(prompt_uid, list(open_groups))
        left = in_flight & (status != "buffered") & (status != "dropped")
        if left.any():
            report.problems.append(
                f"{int(left.sum())} trajectories of incomplete groups left the buffer "
                "(consumed, evicted or discarded without siblings)"
            )
        buffered = in_flight & (status == "buffered")
        dropped = in_flight & (status == "dropped")
        n_short, n_buffered, n_dropped = int(short.sum()), int(buffered.sum()), int(dropped.sum())
        # (the drop only where the run was resumed, or a store shows some: a run not yet
        # resumed dropped nothing)
        resumed = bool(ds.attrs.get("resumed_at_s")) or n_dropped > 0
        report.notes.append(
            f"{n_short} {'group was' if n_short == 1 else 'groups were'} still generating "
            f"when the run stopped ({n_buffered} of {'its' if n_short == 1 else 'their'} "
            f"trajectories {'is' if n_buffered == 1 else 'are'} stored as buffered"
            + (
                f", {n_dropped} {'was' if n_dropped == 1 else 'were'} dropped when it resumed)"
                if resumed
                else ")"
            )
        )
    if (sizes > want).any():
        report.problems.append(f"{int((sizes > want).sum())} groups have more members than size")

    _audit_staleness(ds, report)
    _audit_train_bound(run_dir, ds, report)
    if tokens:
        _checked(report, "the token arrays", _audit_tokens, run_dir, ds, report)
    if damaged := _read_summary(run_dir)[1]:
        report.problems.append(damaged)
    elif not (run_dir / "summary.json").exists():
        report.notes.append(
            "no summary.json (the run is still going, or its driver was lost before the "
            "run ended, or the file was removed): the checks that read it (whether the run "
            "ended in order, the batches of updates it skipped, the losses and restarts it "
            "records) took the run as one that did not end"
        )
    _checked(report, "published versions", _audit_updates, run_dir, ds, report)
    _checked(report, "the metrics rows of each version", _audit_rows, run_dir, ds, report)
    _audit_batches(run_dir, ds, report)
    # (a damaged log cannot bound what a lost rollout may be missing: neither is checked)
    log = "the recovery log and the lost rollouts' recovery"
    unfinished = _checked(report, log, _audit_log, run_dir, ds, report)
    if unfinished is not None or not _has_log(run_dir):
        _checked(
            report, "the lost rollouts' recovery", _audit_faults, run_dir, ds, report, unfinished
        )
    return report


# A behavior logprob above this is no log-probability (0 is a token sampled with certainty;
# an engine's float rounding may land a hair above it).
LOGPROB_MAX = 1e-3


def _audit_tokens(run_dir: Path, ds, report: AuditReport) -> None:
    """Every stored token, read one stored chunk at a time (the token arrays' memory does
    not grow with the store): token ids (prompt and response) not negative,
    ``loss_mask`` 0 or 1, and, on every token an update trained on (``loss_mask`` 1 of a
    trajectory consumed now or by an update since lost: :func:`_ever_trained`), a finite
    behavior logprob at most :data:`LOGPROB_MAX`: the behavior-policy correction and any
    analysis of the ratios divide by its exponential. (A response whose logprob was not
    finite is marked ``error`` and discarded before training: ``logprob_errors``.) Each
    chunk that cannot be read (its checksum, a missing file) is a problem naming it; the
    others are checked all the same."""
    uid = ds["uid"].values
    trained = _ever_trained(run_dir, ds)
    store = store_path(run_dir)
    read = 0
    for group, fields, check in (
        ("prompt", ("prompt_tokens",), _prompt_problems),
        ("response", ("response_tokens", "behavior_logprobs", "loss_mask"), _response_problems),
    ):
        starts = ds[f"{group}_start"].values
        found: dict[str, list] = {}  # problem -> [count, first trajectory]
        for lo, values in _token_chunks(ds, store, fields, report):
            # (each token's trajectory: the stored order keeps the starts rising)
            owner = np.searchsorted(starts, np.arange(lo, lo + len(values[0])), "right") - 1
            for what, bad in check(values, trained[owner]):
                if bad.any():
                    entry = found.setdefault(what, [0, owner[np.flatnonzero(bad)[0]]])
                    entry[0] += int(bad.sum())
            read += len(values[0])
        for what, (count, first) in found.items():
            report.problems.append(
                f"{count} {group} tokens {what}, e.g. in trajectory {str(uid[first])!r}"
            )
    report.figures["tokens read"] = read


def _ever_trained(run_dir: Path, ds) -> np.ndarray:
    """Per trajectory: consumed now, or by an update since lost (a ``consumed`` leave
    event a restarted trainer took back: that update's weights were published, and
    generated)."""
    from storage.trajectories_read import leave_events

    trained = ds["status"].values == "consumed"
    events = leave_events(run_dir, ("event_uid", "event_status"))
    once = set(events["event_uid"][events["event_status"] == "consumed"].tolist())
    if once:
        rows = [i for i, u in enumerate(ds["uid"].values.tolist()) if u in once]
        trained[rows] = True
    return trained


def _token_chunks(ds, store: Path, fields: tuple[str, ...], report: AuditReport):
    """``(start, [values of each field])`` for each stored chunk of ``fields`` (one
    token dimension, chunked alike); a chunk that cannot be read is a problem of
    ``report`` naming its array and file, and is skipped."""
    import zarr

    first = ds[fields[0]]
    sizes = first.chunks[0] if first.chunks is not None else (first.size,)
    group = None
    lo = 0
    for i, size in enumerate(sizes):
        values = []
        for f in fields:
            try:
                with reading(store):
                    values.append(ds[f][lo : lo + size].values)
            except StoreError as e:  # (open_run's lazy arrays name the store alone)
                if group is None:
                    group = zarr.open_group(str(store), mode="r", zarr_format=3)
                chunk = str(store / f / group[f].metadata.encode_chunk_key((i,)))
                said = str(e) if chunk in str(e) else f"array {f!r}, chunk {chunk!r}: {e}"
                report.problems.append(f"a token chunk not checked: {said}")
                break
        if len(values) == len(fields):
            yield lo, values
        lo += size


def _prompt_problems(values, trained):
    (tokens,) = values
    return [("have a negative token id", tokens < 0)]


def _response_problems(values, trained):
    tokens, logprobs, mask = values
    on = trained & (mask == 1)
    with np.errstate(invalid="ignore"):
        return [
            ("have a negative token id", tokens < 0),
            ("have a loss_mask neither 0 nor 1", mask > 1),
            ("trained on have a behavior logprob that is not finite", on & ~np.isfinite(logprobs)),
            (
                f"trained on have a behavior logprob above {LOGPROB_MAX:g} (no log-probability)",
                on & (logprobs > LOGPROB_MAX),
            ),
        ]


def _has_log(run_dir: Path) -> bool:
    from storage.partial_log import STORE_NAME

    return (run_dir / STORE_NAME).exists()


def _checked(report: AuditReport, what: str, check, *args):
    """``check(*args)``; a store it reads that is damaged (``metrics.zarr``,
    ``partial.zarr``) is a problem that names the store and its fix, and the audit's
    other checks are still made (it refused the whole audit, the trajectory store's
    checks too). Returns what ``check`` returns, ``None`` where it could not run."""
    try:
        return check(*args)
    except StoreError as e:
        report.problems.append(f"{what} not checked: {e}")
        return None


# What each barrier schedule promises of every consumed trajectory's s_train
# (docs/schedules.md): sync and stream train on-policy; one-step trains batch b by version
# b - 1 (the first batch, and one after a skipped update, by its own: 0).
S_TRAIN_RANGE = {"sync": (0, 0), "stream": (0, 0), "one_step": (0, 1)}


def _audit_staleness(ds, report: AuditReport) -> None:
    """The staleness the run's schedule promises, held against its consumed trajectories.
    (Laminar and partial rollout promise no s_train of their own: back-pressure and η
    bound what is out, not each trajectory's lag. ``buffer.max_train_staleness`` is the
    bound any schedule can be given: :func:`_audit_train_bound`.)"""
    consumed = ds["status"].values == "consumed"
    s_train = (ds["sample_version"].values - ds["behavior_version"].values)[consumed]
    if s_train.size:
        report.figures["s_train max"] = int(s_train.max())
    schedule = ds.attrs.get("schedule")
    if schedule not in S_TRAIN_RANGE:
        return
    # A barrier schedule hands each group out to rollouts of one version (whole, or in
    # pieces split among them by sample, all at the batch's version; and it continues no
    # run in place, so no group's missing samples are handed out again).
    pu, k = ds["prompt_uid"].values[consumed], ds["behavior_version"].values[consumed]
    groups, inverse = np.unique(pu, return_inverse=True)
    lo_k = np.full(len(groups), np.iinfo(np.int64).max)
    hi_k = np.full(len(groups), np.iinfo(np.int64).min)
    np.minimum.at(lo_k, inverse, k)
    np.maximum.at(hi_k, inverse, k)
    if (split := np.flatnonzero(lo_k != hi_k)).size:
        report.problems.append(
            f"{split.size} consumed groups have siblings of several behavior versions, e.g. "
            f"{str(groups[split[0]])!r} ({lo_k[split[0]]}..{hi_k[split[0]]}): the "
            f"{schedule} schedule hands a group out whole, to one version"
        )
    lo, hi = S_TRAIN_RANGE[schedule]
    bad = (s_train < lo) | (s_train > hi)
    if bad.any():
        want = f"s_train = {lo}" if lo == hi else f"s_train {lo} or {hi}"
        uid = ds["uid"].values[consumed][bad][0]
        report.problems.append(
            f"{int(bad.sum())} consumed trajectories break the {schedule} schedule's "
            f"{want}: s_train {sorted(set(s_train[bad].tolist()))}, e.g. {str(uid)!r}"
        )


def train_staleness_bound(run_dir: str | Path) -> int | None:
    """``buffer.max_train_staleness`` as the run's ``config.yaml`` records it (``None``:
    no bound, or no ``config.yaml``: a store not written by ``laminar run``). A resume
    rewrites the file with its overrides, so it is the last start's. Raises
    :class:`StoreError` where the file does not read, or the value is no count.

    >>> train_staleness_bound("no/such/run") is None
    True
    """
    bound = _section(run_config(run_dir), "buffer").get("max_train_staleness")
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
        path = str(Path(run_dir) / "config.yaml")
        raise StoreError(f"{path!r} has buffer.max_train_staleness={bound!r}, no count")
    return bound


def run_config(run_dir: str | Path) -> dict | None:
    """The run's ``config.yaml`` (the exact resolved config, the last start's: a resume
    rewrites it with its overrides), as a dict; ``None`` without one (a store not written
    by ``laminar run``). Raises :class:`StoreError` where it does not read."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    try:
        config = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise StoreError(f"{str(path)!r} does not read ({type(e).__name__}: {e})") from e
    return config if isinstance(config, dict) else {}


def _section(config: dict | None, *keys: str) -> dict:
    for key in keys:
        config = (config or {}).get(key) if isinstance(config, dict) else None
    return config if isinstance(config, dict) else {}


_SCALES = ("dilation", "length_scale", "request_scale")


def run_pacing(run_dir: str | Path) -> dict | None:
    """How a paced run's clock maps onto the cluster it models (``rollout.pacing`` of its
    ``config.yaml``; docs/pacing.md, "Scaled workloads"), or ``None``: not paced, or no
    ``config.yaml``. Its store's times are wall seconds of the dilated run; a full-size
    duration ``s`` lasted ``s * dilation / length_scale`` of them
    (``laminar.pacing.Scale.wall``), and a real token stands for ``length_scale *
    request_scale`` modelled tokens, so a rate in real tokens per wall second is
    ``request_scale * dilation`` times lower than the modelled cluster's:

    * ``dilation``, ``length_scale``, ``request_scale``: as configured;
    * ``modelled_s_per_wall_s``: ``length_scale / dilation``;
    * ``modelled_tokens_per_token``: ``length_scale * request_scale``;
    * ``modelled_rate_per_rate``: ``request_scale * dilation`` (tokens/s);
    * ``trainer_paced``: ``trainer.pacing`` is set (otherwise the trainer runs at this
      machine's speed on the dilated clock: its updates' times are not modelled ones).

    >>> run_pacing("no/such/run") is None
    True
    """
    config = run_config(run_dir)
    if _section(config, "rollout").get("pacing") is None:
        return None
    pacing = _section(config, "rollout", "pacing")
    d, lam, sigma = (float(pacing.get(k, 1.0)) for k in _SCALES)
    return {
        "dilation": d,
        "length_scale": lam,
        "request_scale": sigma,
        "modelled_s_per_wall_s": lam / d,
        "modelled_tokens_per_token": lam * sigma,
        "modelled_rate_per_rate": sigma * d,
        "trainer_paced": bool(_section(config, "trainer", "pacing")),
    }


def train_lags(run_dir: str | Path, ds, unsure: list[str] | None = None) -> np.ndarray:
    """Each trajectory's ``s_train`` counted along the weights' lineage, as the buffer's
    ``buffer.max_train_staleness`` counts it (:func:`storage.lineage.lineage_lags` with
    the run's trainer restarts, :func:`storage.lineage.run_restarts`; by the numbers, a
    trainer restarted from ``V`` numbering after ``M`` trains ``V``'s trajectories
    ``M - V`` late): NaN where not sampled. ``unsure``: where the run's restarts are not
    all known, why (appended)."""
    from storage.lineage import lineage_lags, run_restarts

    restarts = run_restarts(run_dir, shortfalls=[] if unsure is None else unsure)
    return lineage_lags(ds["sample_version"].values, ds["behavior_version"].values, restarts)


def _audit_train_bound(run_dir: Path, ds, report: AuditReport) -> None:
    """Where the run's ``config.yaml`` sets ``buffer.max_train_staleness``, no consumed
    trajectory trained further behind (:func:`train_lags`, along the weights' lineage as
    the buffer counts it): the buffer evicts a group before it would, so one over it is a
    problem. Where a lag may cross a trainer restart the stores do not record (a run whose
    ``summary.json`` is not its last start's), or a trajectory was sampled before the
    run's last resume (``config.yaml`` holds the last start's settings; an earlier start
    may have run with another bound), a note instead."""
    try:
        bound = train_staleness_bound(run_dir)
    except StoreError as e:
        report.notes.append(f"buffer.max_train_staleness not checked: {e}")
        return
    if bound is None:
        return
    report.figures["max_train_staleness"] = bound
    consumed = ds["status"].values == "consumed"
    if not consumed.any():
        return
    unsure: list[str] = []
    lags = train_lags(run_dir, ds, unsure)[consumed]
    sampled = np.isfinite(lags)
    if sampled.any():
        report.figures["s_train max (lineage)"] = int(lags[sampled].max())
    over = sampled & (lags > bound)
    if not over.any():
        return
    resumes = ds.attrs.get("resumed_from_version") or []
    before = ds["sample_version"].values[consumed] < (int(resumes[-1]) if resumes else 0)
    uid = ds["uid"].values[consumed]

    def said(which: np.ndarray) -> str:
        lags_over = sorted({int(x) for x in lags[which]})
        return (
            f"{int(which.sum())} consumed trajectories trained more than "
            f"buffer.max_train_staleness={bound} versions behind (s_train along the "
            f"weights' lineage {version_ranges(lags_over)}), e.g. {str(uid[which][0])!r}"
        )

    if (now := over & ~before).any():
        if unsure:
            report.notes.append(
                said(now) + f"; a trainer restart the stores do not record may account for "
                f"it ({unsure[0]})"
            )
        else:
            report.problems.append(said(now) + ": the buffer evicts a group before it would")
    if (earlier := over & before).any():
        report.notes.append(
            said(earlier) + f", sampled before the run's last resume (from version "
            f"{int(resumes[-1])}): config.yaml holds the last start's settings, and an "
            "earlier start may have run with another bound"
        )


def _audit_updates(run_dir: Path, ds, report: AuditReport) -> None:
    """Each version the trainer published (the ``updates`` table of ``metrics.zarr``)
    trained a batch that the store holds as consumed at the version before.

    Without this an empty or truncated store audits clean. A Laminar trainer restarted
    within the run skips past the lost one's versions (the checkpoint's, exclusive, to
    the newest the lost one published: their batches are trained again later), which
    ``summary.json`` records (``faults.trainer_restarts``, ``faults.core_restarts``):
    every other version is checked. In a resumed run, the restarts of every start along
    its weights' lineage (:func:`storage.lineage.run_restarts`) are skipped, and so are
    the versions an earlier start published past the version the run ended at (a resume
    redid those numbers, and a row of ``updates`` holds a version's newest publication);
    where its restarts are not all known, only a store with nothing consumed is a
    problem (and a note says why). (In a run that did not end, a note: the store lags the
    metrics.)"""
    from storage.metrics import open_metrics

    try:
        rows = open_metrics(run_dir, "updates")
    except (FileNotFoundError, KeyError):
        return
    published = rows["version"].values
    published = sorted({int(v) for v in published[np.isfinite(published)]})
    if not published:
        return
    consumed = ds["status"].values == "consumed"
    if not consumed.any():
        _problem_if_ended(
            run_dir,
            report,
            f"the trainer published {len(published)} versions, but the store holds no "
            "consumed trajectory: it is not this run's, or its batches were never written",
        )
        return
    if ds.attrs.get("schedule") == "laminar":
        from storage.lineage import run_restarts

        summary = _summary(run_dir)
        resumed = int(summary.get("segments", 1)) != 1
        unsure: list[str] = []
        restarts = run_restarts(run_dir, shortfalls=unsure)
        if resumed and unsure:
            report.notes.append(
                "the versions of a resumed run were not checked one by one (each trained "
                f"a stored batch): its restarts within the run are not all known ({unsure[0]})"
            )
            return
        skipped = {v for lo, hi in restarts for v in range(lo + 1, hi + 1)}
        published = [v for v in published if v not in skipped]
        if resumed:  # (an earlier start's versions past the last start's: superseded)
            final = _final_version(run_dir, summary)
            published = [v for v in published if final is not None and v <= final]
    trained = set(ds["sample_version"].values[consumed].tolist())
    missing = [v for v in published if v - 1 not in trained]
    if missing:
        _problem_if_ended(
            run_dir,
            report,
            f"{len(missing)} published versions trained a batch the store does not hold "
            f"as consumed (at sample_version one less), e.g. version {missing[0]}",
        )


# The tables of metrics.zarr with one row per version of the run's weights, and what a
# version without its row lacks.
VERSION_TABLES = {
    "updates": "the loss, KL, gradient norm and batch figures of each",
    "publications": "the publication stall and broadcast time of each",
}


def _audit_rows(run_dir: Path, ds, report: AuditReport) -> None:
    """Each version of the run's lineage has its row in the ``updates`` and
    ``publications`` tables of ``metrics.zarr``: a note names the versions without one.

    The driver copies those rows from the trainer's process at each poll and writes them
    every few seconds; one aborted (a second Ctrl-C) or killed meanwhile loses them, and
    a resume redoes only the versions after its checkpoint, so their curves have a hole
    where nothing else says so (a resume writes them back from a checkpoint that keeps
    them, ``metrics_rows.json``: laminar's since 2026-12-07). A note, not a problem: the
    trajectories and weights are sound; what is missing is the record of those updates.

    The lineage: the versions after the one the run began from (its oldest trajectory's
    behavior version: 0, or the checkpoint a new run started from) up to the one it ended
    at (:func:`_lineage_end`), less the numbers a trainer restarted within the run
    skipped (:func:`storage.lineage.run_restarts`: a lost branch's rows may or may not have
    been copied), and ``publications`` the version it began from too. Where those
    restarts are not all known (a start whose driver was killed: its ``summary.json`` is
    an earlier start's), up to its newest checkpoint, whose trainer was handed every
    restart before it. Not checked while the run's driver is running (its rows lag by a
    flush)."""
    from storage.lineage import run_restarts
    from storage.live import running_driver
    from storage.metrics import open_metrics

    if running_driver(run_dir) is not None:
        return
    behavior = ds["behavior_version"].values
    behavior = behavior[behavior >= 0]
    final, newest = _lineage_end(run_dir)
    if not behavior.size or final is None:
        return
    start = int(behavior.min())
    unsure: list[str] = []
    restarts = run_restarts(run_dir, shortfalls=unsure)
    if unsure:  # (those it knows are the newest checkpoint's, which names all before it)
        if newest is None:
            return
        final = min(final, newest)
    skipped = {v for lo, hi in restarts for v in range(lo + 1, hi + 1)}
    lineage = [v for v in range(start + 1, final + 1) if v not in skipped]
    for table, lacks in VERSION_TABLES.items():
        try:
            rows = open_metrics(run_dir, table)
        except (FileNotFoundError, KeyError):
            rows = None
        have = set() if rows is None or "version" not in rows else set(rows["version"].values)
        want = ([start] if table == "publications" else []) + lineage
        if rows is None and table == "publications":
            continue  # (a run recorded before publications were)
        if missing := [v for v in want if v not in have]:
            one = len(missing) == 1
            report.notes.append(
                f"{len(missing)} {'version' if one else 'versions'} of the run's lineage "
                f"({start + 1}..{final}) {'has' if one else 'have'} no row in the {table} "
                f"table of metrics.zarr: {version_ranges(missing)}; {lacks} "
                f"{'is' if one else 'are'} missing (the driver stopped, aborted or lost, "
                f"before it wrote {'it' if one else 'them'}, and no resume wrote "
                f"{'it' if one else 'them'} back from its checkpoint)"
            )


def _lineage_end(run_dir: Path) -> tuple[int | None, int | None]:
    """The newest version of the run's lineage, and its newest checkpoint's: where the
    run ended (:func:`_final_version`), or its newest checkpoint where that is newer (a
    start's stop checkpoint, written after the last row: the rows of its last versions
    are the ones an abort loses). A checkpoint of a superseded start is not newer: a
    resume starts from the newest."""
    from storage.lineage import run_checkpoints

    ended = _final_version(run_dir, _summary(run_dir))
    saved = list(run_checkpoints(run_dir))
    ends = [] if ended is None else [ended]
    return max(ends + saved, default=None), max(saved, default=None)


def version_ranges(versions: list[int]) -> str:
    """``[3, 4, 5, 9]`` as ``3-5, 9``.

    >>> version_ranges([3, 4, 5, 9]), version_ranges([7])
    ('3-5, 9', '7')
    """
    out: list[list[int]] = []
    for v in sorted(set(versions)):
        if out and out[-1][1] == v - 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def _final_version(run_dir: Path, summary: dict) -> int | None:
    """The version a run ended at: an orderly stop's ``summary.json`` says it, when it is
    the last start's (it counts no fewer starts than the ``cluster`` table: a driver
    killed outright leaves an earlier start's, whose end cut a resumed run's checked
    versions short); else the last start's last ``cluster`` row (it may lag the run by a
    poll)."""
    from storage.metrics import open_metrics, segments

    try:
        starts = segments(open_metrics(run_dir, "cluster"))
    except (FileNotFoundError, KeyError):
        starts = []
    if (
        ended_in_order(summary.get("reason"))
        and "versions" in summary
        and len(starts) <= int(summary.get("segments", 1))
    ):
        return int(summary["versions"])
    return starts[-1]["last_version"] if starts else None


def _audit_batches(run_dir: Path, ds, report: AuditReport) -> None:
    """No version trained more groups than its updates took: ``trainer.groups_per_step``
    for each, one more update for each skipped at it (non-finite: its batch consumed,
    nothing published, the next one consumed at the same version). A group consumed
    twice over, or a batch sampled twice (a retried sample), passes every other check.

    From ``summary.json`` (its trainer's ``skipped_updates``), so only where it holds
    them all: a run of one start whose trainer was never restarted (a lost trainer's
    skips are lost with it). Fewer groups than that is no problem: a stop in the middle
    of a stream update, a lost update's groups consumed again later."""
    summary = _summary(run_dir)
    if "skipped_updates" not in summary or int(summary.get("segments", 1)) != 1:
        return  # (a run recorded before they were, or resumed: the earlier starts' lost)
    faults = summary.get("faults") or {}
    if faults.get("trainer_restarts") or faults.get("core_restarts"):
        return
    consumed = (ds["status"].values == "consumed") & (ds["sample_version"].values >= 0)
    pairs = set(
        zip(
            ds["sample_version"].values[consumed].tolist(),
            ds["prompt_uid"].values[consumed].tolist(),
            strict=True,
        )
    )
    if not pairs:
        return
    v, n = np.unique(np.fromiter((k for k, _ in pairs), np.int64, len(pairs)), return_counts=True)
    skipped = np.array([summary["skipped_updates"].count(int(x)) for x in v])
    bound = int(summary["groups_per_step"]) * (1 + skipped)
    over = n > bound
    report.figures["groups trained, max per version"] = int(n.max())
    if over.any():
        i = int(np.argmax(over))
        report.problems.append(
            f"{int(over.sum())} versions trained more groups than their updates took, e.g. "
            f"version {int(v[i])}: {int(n[i])} groups consumed at it, its updates "
            f"({1 + int(skipped[i])}, {int(skipped[i])} skipped) took {int(bound[i])} "
            "(trainer.groups_per_step each): a batch sampled twice, or groups consumed twice"
        )


def _problem_if_ended(run_dir: Path, report: AuditReport, msg: str) -> None:
    """A problem in a run that ended; in one running or lost, the store lags the metrics
    by up to a flush (``buffer.flush_interval_s``): a note."""
    if _ended(run_dir):
        report.problems.append(msg)
    else:
        report.notes.append(f"{msg} (the run is still running, or was lost before a flush)")


ENDED = ("completed", "stopped")  # summary.json reasons of a run that ended, not lost
# ... and how the reason of one stopped in order before its Slurm jobs' walltime begins
# (it goes on to name the job: laminar/deploy_walltime.py)
WALLTIME_REASON = "stopped before the walltime"


def ended_in_order(reason) -> bool:
    """Whether ``summary.json``'s ``reason`` is a run's that ended in order, not lost.

    >>> [ended_in_order(r) for r in ("completed", "stopped", "failed: x", None)]
    [True, True, False, False]
    >>> ended_in_order(WALLTIME_REASON + ": Slurm job 7 (driver) reaches its walltime in 290 s")
    True
    """
    return reason in ENDED or (isinstance(reason, str) and reason.startswith(WALLTIME_REASON))


def _audit_log(run_dir: Path, ds, report: AuditReport) -> list[dict] | None:
    """What the recovery log ``partial.zarr`` held at the stop and the store lacks.

    The pool forgets a trajectory only once the store has committed it, so at the end of
    a run that was not lost the log holds only trajectories still generating: a
    completed one (finished, or held by the buffer) that is not in the store was lost.
    After a loss the log lags the pool by up to ``faults.log_interval_s``, and what it
    held is what a resume generates again. Returns the unfinished entries (as
    :func:`storage.partial_log.log_entries` gives them); ``None``: the run wrote no
    log."""
    from storage.partial_log import log_entries

    if not _has_log(run_dir):
        return None
    stored = set(ds["uid"].values.tolist())
    left = {rid: e for rid, e in log_entries(run_dir).items() if rid not in stored}
    done = [rid for rid, e in left.items() if e["finished"] or e["held"]]
    unfinished = len(left) - len(done)
    report.figures["unfinished at the stop"] = unfinished
    report.part("tokens logged", sum(e["tokens"] for e in left.values()))
    if done:
        msg = f"{len(done)} completed trajectories are in the recovery log but not the store"
        if _ended(run_dir):
            report.problems.append(f"{msg}, e.g. {done[0]} (lost)")
        else:
            report.notes.append(
                f"{msg}: the run is still running (they are committed with the next flush), "
                "or it was lost (a resume generates them again)"
            )
    return [e for e in left.values() if not (e["finished"] or e["held"])]


def rollout_losses(summary: dict, faults) -> dict[tuple[int | None, str], dict]:
    """Each rollout a run lost, over all its starts: ``(start, rollout id) -> {"time":
    when it was found lost (epoch seconds), "in_summary": named by summary.json,
    "rows": its rows in the faults table}``. A resumed run's rollouts are named ``r0``,
    ``r1``, ... again, so a loss is keyed by its start too (``None``: a faults row
    written before rows named their start, matched to a loss of its rollout id).

    From ``summary`` (summary.json: ``faults.lost`` of the start that wrote it,
    ``faults.earlier`` of the starts before, ``faults_earlier`` in a failed driver's)
    and ``faults`` (the ``faults`` table of ``metrics.zarr``, or ``None``): every lost
    rollout has a row there (``how`` ``none`` when it held nothing to recover), unless
    the rows were lost with the data module before the driver copied them, and the
    summary names the losses of the starts that stopped in order, so each covers what
    the other may lack."""
    f = summary.get("faults") or {}  # (null: recovery off)
    out: dict[tuple[int | None, str], dict] = {}

    def loss(key, t: float, in_summary: bool = False, rows: int = 0) -> None:
        e = out.setdefault(key, {"time": t, "in_summary": False, "rows": 0})
        e["time"] = t if in_summary else min(e["time"], t)
        e["in_summary"] |= in_summary
        e["rows"] += rows

    for earlier in f.get("earlier") or summary.get("faults_earlier") or []:
        for rid, t in (earlier.get("lost") or {}).items():
            loss((int(earlier["segment"]), str(rid)), float(t), in_summary=True)
    here = int(summary.get("segments", 1)) - 1
    for rid, t in (f.get("lost") or {}).items():
        loss((here, str(rid)), float(t), in_summary=True)
    if faults is None or not faults.sizes.get("recovery"):
        return out
    rids = faults["rollout"].values.astype(str)
    times = faults["time"].values.astype(float)
    seg = faults["segment"].values if "segment" in faults else np.full(len(rids), np.nan)
    for rid, t, s in zip(rids.tolist(), times.tolist(), seg.tolist(), strict=True):
        key = (None if s != s else int(s), rid)
        if key[0] is None:  # (an older row: the loss of that rollout id, if one is known)
            key = next((k for k in out if k[1] == rid), key)
        loss(key, t, rows=1)
    return out


def _audit_faults(run_dir: Path, ds, report: AuditReport, unfinished: list[dict] | None) -> None:
    """Each lost rollout's trajectories finished elsewhere, counted against the recovery
    records; recovery times and what the log held. A rollout that summary.json names as
    lost without a recovery row cannot be checked: said, not skipped."""
    from storage.metrics import open_metrics

    try:
        rows = open_metrics(run_dir, "faults")
    except (FileNotFoundError, KeyError):
        rows = None
    losses = rollout_losses(_summary(run_dir), rows)
    report.figures["rollouts lost"] = len(losses)
    unrecorded = [k for k, e in losses.items() if not e["rows"]]
    if unrecorded:
        names = ", ".join(rid if s is None else f"{rid} (start {s})" for s, rid in unrecorded)
        _problem_if_ended(
            run_dir,
            report,
            f"{len(unrecorded)} rollouts summary.json names as lost ({names}) have no row "
            "in the faults table of metrics.zarr: their recovery rows were lost (with the "
            "data module, before the driver copied them), so their recovery is unchecked",
        )
    _audit_unrecovered(run_dir, rows, report)
    if rows is None:
        return
    lost = sorted(set(rows["rollout"].values.tolist()))
    report.figures["recovered trajectories"] = int(rows["requests"].sum())
    report.figures["recovered tokens (kept)"] = int(rows["tokens_recovered"].sum())
    # (a rollout lost with faults.recover off has a row, `unrecovered`, and no recovery)
    recovered = rows["how"].values != "unrecovered"
    if recovered.any():
        t = rows["recovery_s"].values[recovered]
        report.figures["recovery time mean (s)"] = float(np.mean(t))
        report.figures["recovery time max (s)"] = float(np.max(t))
        # The log's bound (faults.flush_s) is on unfinished requests; a finished one
        # rescored waited for its reward since its last log (23 s read as a broken bound)
        resumed = recovered & (rows["how"].values != "rescore")
        if resumed.any():
            report.figures["unfinished, since last log, max (s)"] = float(
                rows["max_since_flush_s"].values[resumed].max()
            )
    # The rollouts each trajectory left (all on its path but the last): only one resumed
    # elsewhere has several (a split of every trajectory's path took ~0.3 s for 200k).
    ids = ds["rollout_ids"].values
    left = [p.split(",")[:-1] for p in ids[np.strings.find(ids, ",") >= 0].tolist()]
    # Trajectories still generating when the run stopped are not stored: those the log
    # holds that had left the lost rollout bound how many of its recovered ones may be
    # missing for that reason (not the log's whole count: a loss of most of them would
    # hide behind the other rollouts' unfinished work).
    if unfinished is None:  # (a run without a log on disk: the pool's count at the stop)
        faults = _summary(run_dir).get("faults") or {}
        n = int((faults.get("partial") or {}).get("entries", 0))
        if faults.get("partial") is not None:  # (none with faults.recover off: unknown)
            report.figures["unfinished at the stop"] = n
        bound, whose = (lambda rid: n), "trajectories"
    else:
        # The log holds the last start's entries. One a lost rollout's recovery took is on
        # its path; one whose take the log had not recorded when the run was lost is
        # still logged as the lost rollout's own. (An owner only for the rollouts lost in
        # the last start: a resumed run names its rollouts r0, r1, ... again, and a live
        # one of the same name owns its own work.)
        here = int(_summary(run_dir).get("segments", 1)) - 1
        last = {rid for seg, rid in losses if seg in (here, None)}

        def bound(rid: str) -> int:
            return sum(
                rid in e["rollout_path"] or (rid in last and e["owner"] == rid) for e in unfinished
            )

        whose = "of them"
    for rid in lost:
        # A trajectory it had started and that finished elsewhere: rid on its path, not last.
        resumed = sum(1 for p in left if rid in p)
        recorded = int(rows["requests"].values[rows["rollout"].values == rid].sum())
        if resumed < recorded:
            msg = (
                f"rollout {rid}: {recorded} trajectories recovered, {resumed} stored as "
                f"finished elsewhere ({bound(rid)} {whose} were unfinished at the stop)"
            )
            (report.notes if recorded - resumed <= bound(rid) else report.problems).append(msg)
        report.part(f"{rid}: resumed and stored", resumed)


def _audit_unrecovered(run_dir: Path, rows, report: AuditReport) -> None:
    """The rollouts lost with ``faults.recover`` off (the faults table's ``unrecovered``
    rows, summary.json's ``faults.unrecovered``): counted, and each one a note that says
    what was lost with it (the run failed on it: nothing resumed them). One that
    summary.json names without its row is the unrecorded loss above; one of a run that
    ended in order (completed or stopped) went on without it, as runs did before the
    manager failed them (a loss found as the trainer finished may also read so)."""
    summary = _summary(run_dir)
    f = summary.get("faults") or {}
    here = int(summary.get("segments", 1)) - 1
    held: dict[tuple[int | None, str], dict] = {}
    for e in f.get("earlier") or summary.get("faults_earlier") or []:
        for rid, info in (e.get("unrecovered") or {}).items():
            held[(int(e["segment"]), str(rid))] = info
    for rid, info in (f.get("unrecovered") or {}).items():
        held[(here, str(rid))] = info
    if rows is not None and rows.sizes.get("recovery"):
        mine = rows["how"].values == "unrecovered"
        seg = rows["segment"].values if "segment" in rows else np.full(len(mine), np.nan)
        for rid, t, s in zip(
            rows["rollout"].values[mine].astype(str).tolist(),
            rows["time"].values[mine].astype(float).tolist(),
            seg[mine].tolist(),
            strict=True,
        ):
            key = (None if s != s else int(s), rid)
            held.setdefault(key, {"time": t})
    if not held:
        return
    report.figures["rollouts lost, not recovered"] = len(held)
    ended = ended_in_order(summary.get("reason"))
    for (seg, rid), info in sorted(held.items(), key=lambda kv: kv[1].get("time") or 0.0):
        name = rid if seg is None or seg == here else f"{rid} (start {seg})"
        what = "what it held is unknown"
        if info.get("requests") is not None:
            ago = info["time"] - info["as_of"]
            what = (
                f"{info['requests']} unfinished requests and {info['unscored']} finished "
                f"trajectories awaiting their rewards, as of its last report {ago:.1f} s "
                "before, were lost with it"
            )
        elif "worker" in info:
            what = "it never reported what it held"
        hung = " (hung, then fenced)" if info.get("hung") else ""
        worker = f" on {info['worker']}" if info.get("worker") else ""
        msg = f"rollout {name}{worker}{hung} was lost with faults.recover off: {what}"
        if ended and seg in (here, None):
            report.notes.append(f"{msg}; the run went on to {summary['reason']!r} without it")
        else:
            report.notes.append(f"{msg}; the run failed on it")


def _ended(run_dir: Path) -> bool:
    """Whether the run ended (completed or stopped), as opposed to running or lost: its
    ``summary.json`` says so, and is its last start's (a resumed run keeps the earlier
    start's summary until it ends: the metrics then show more starts than it counts)."""
    from storage.live import running_driver

    summary = _summary(run_dir)
    if not ended_in_order(summary.get("reason")) or running_driver(run_dir) is not None:
        return False
    from storage.metrics import open_metrics, segments

    try:
        starts = len(segments(open_metrics(run_dir, "cluster")))
    except (FileNotFoundError, KeyError, StoreError):  # (a damaged one: named where read)
        return True
    return starts <= summary.get("segments", 1)


def _read_summary(run_dir: Path) -> tuple[dict, str | None]:
    """``summary.json`` (``{}`` where it is absent or damaged), and what is wrong with
    one that is there but unreadable (the checks that read it then take it as absent: a
    run that did not end, lost nothing)."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as e:
        return {}, (
            f"{str(path)!r} cannot be read ({type(e).__name__}: {e}): the checks that read "
            "it (whether the run ended, its lost rollouts and restarts) were made without "
            "it; restore it from a copy"
        )
    if not isinstance(summary, dict):
        return {}, f"{str(path)!r} is not a JSON object; restore it from a copy"
    return summary, None


def _summary(run_dir: Path) -> dict:
    """``summary.json``; ``{}`` where it is absent or damaged (:func:`_read_summary`)."""
    return _read_summary(run_dir)[0]
