"""``Dataset.laminar``: analysis helpers that work in a notebook with no cluster::

    ds = open_run("runs/my-run")
    ds.laminar.staleness()                       # s_gen, residence, s_train per trajectory
    ds.laminar.staleness(restarts="run")         # ... and along the weights' lineage
    ds.laminar.tokens("response_tokens", 0)      # one trajectory's ragged field
    ds.laminar.audit()                           # [] when every contract invariant holds
    ds.laminar.reward_curve(by="version").plot()
    ds.laminar.throughput(window=10).to_dataframe()

Every figure is tested against a direct computation on the raw arrays
(``tests/test_analysis.py``); recipes are in ``docs/analysis.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import xarray as xr

from storage.lineage import lineage_lags, run_restarts
from storage.runs_selected import attrs_of_run, own_rows, run_name, selected_run
from storage.schema import (
    MIXED_VERSION_SCHEDULES,
    RAGGED_FIELDS,
    STATUSES,
)
from storage.stores import StoreError
from storage.trajectories import time_in_buffer

# The token versions the audit checks at a time (of a partial rollout run: one per
# response token): ~20 MB of working memory.
AUDIT_BLOCK_TOKENS = 1 << 21
# A start of the metrics' segments this close before a resume the store recorded is that
# resume (its first metrics row and the buffer's record of it are seconds apart)
_SEGMENT_SLACK_S = 60.0
# The statistics buffer_age(by_version=...) takes (xarray's groupby reductions)
_GROUP_STATS = ("mean", "median", "min", "max", "std", "sum", "count")


@xr.register_dataset_accessor("laminar")
class LaminarAccessor:
    """Views of a trajectory dataset returned by :func:`storage.open_run`, or of one run
    of :func:`storage.open_runs` (``.sel(run=name)``: its padding left out)."""

    def __init__(self, ds: xr.Dataset) -> None:
        if "run" in ds.dims:
            raise ValueError(
                "ds.laminar reads one run's trajectories (storage.open_run); this Dataset "
                "has a 'run' dimension (storage.open_runs, padded to the longest run): "
                "select one, ds.sel(run=name).laminar, or use open_run(path).laminar"
            )
        # A run selected from open_runs (ds.sel(run=name)): its own rows, without the
        # padding (status "", NaN) that reached every figure; where it was stored is
        # found when a figure needs the run's record (_attrs)
        self._runs: list[str] | None = None
        self._run_attrs: dict | None = None
        if selected_run(ds):
            ds, self._runs = own_rows(ds), list(ds.attrs.get("run_dirs", []))
        self._ds = ds
        # tokens(): what it read, with the variables it read them from (xarray keeps this
        # accessor with the Dataset, and an assignment in place swaps a variable only)
        self._spans: dict[str, tuple[tuple, np.ndarray, np.ndarray]] = {}  # read once
        self._blocks: dict[str, tuple[object, int, np.ndarray]] = {}  # the last read

    @property
    def _attrs(self) -> Mapping:
        """The run's record (``open_run``'s attributes: its end, stops, resumes,
        schedule): the Dataset's own, or of a run selected from ``open_runs``, whose
        attributes are the runs' directories alone, read from its store the first time a
        figure needs them (one ``open_run``)."""
        if self._runs is None:
            return self._ds.attrs
        if self._run_attrs is None:
            self._run_attrs = attrs_of_run(self._ds, self._runs)
        return self._run_attrs

    def _needs_tokens(self, method: str) -> None:
        """Refuse ``method`` on a run selected from ``open_runs``: it reads the
        token-level fields, which ``open_runs`` leaves out."""
        if self._runs is not None:
            raise ValueError(
                f"ds.laminar.{method}() reads the token-level fields, which open_runs leaves "
                f"out: use open_run(path).laminar.{method}() for run "
                f"{run_name(self._ds)!r} (of {self._runs})"
            )

    def tokens(self, field: str, i: int) -> np.ndarray:
        """The ragged ``field`` (e.g. ``"response_tokens"``) of trajectory ``i``.

        A loop over trajectories is fast in order: each call reads the whole stored
        chunk(s) its tokens lie in (a chunk holds a few hundred trajectories) and keeps
        them for the next call."""
        if field not in RAGGED_FIELDS:
            raise KeyError(f"{field!r} is not a ragged field; choose from {sorted(RAGGED_FIELDS)}")
        self._needs_tokens("tokens")
        group = RAGGED_FIELDS[field]
        variables = self._ds.variables
        read_from = (variables[f"{group}_start"], variables[f"{group}_len"])
        cached = self._spans.get(group)
        if cached is None or any(a is not b for a, b in zip(cached[0], read_from, strict=True)):
            # every trajectory's offsets, read once: a loop over trajectories otherwise
            # reads two lazy arrays a call (3 reads, ~14 ms, each)
            cached = self._spans[group] = (read_from, read_from[0].values, read_from[1].values)
        _, starts, lengths = cached
        start, end = int(starts[i]), int(starts[i]) + int(lengths[i])
        source, lo, block = self._blocks.get(field, (None, 0, None))
        if source is not variables[field] or start < lo or end > lo + len(block):
            # (a slice of the lazy array a call cost ~3 ms of dask graph and chunk reads,
            # ~10 minutes for a loop over 200k trajectories)
            lo, block = self._chunks_of(field, start, end)
            self._blocks[field] = (variables[field], lo, block)
        return block[start - lo : end - lo].copy()  # (a copy: the block is kept)

    def _chunks_of(self, field: str, start: int, end: int) -> tuple[int, np.ndarray]:
        """The stored chunks of ``field`` that hold its values ``start:end``: where they
        begin, and their values (an array in memory: the whole of it)."""
        values = self._ds[field]
        if values.chunks is None:
            return 0, values.values
        bounds = np.cumsum((0, *values.chunks[0]))
        lo = int(bounds[np.searchsorted(bounds, start, side="right") - 1])
        hi = int(bounds[min(np.searchsorted(bounds, end, side="left"), len(bounds) - 1)])
        return lo, values[lo : max(hi, end)].values

    def staleness(self, restarts: Sequence[tuple[int, int]] | str | None = None) -> xr.Dataset:
        """Per consumed trajectory: ``s_gen``, ``residence`` and ``s_train`` (versions),
        counted by the version numbers, as stored.

        ``restarts``: the run's trainer restarts ``(V, M)`` in order (a trainer restarted
        from its checkpoint of ``V``, numbering its updates after ``M``), or ``"run"``
        for those the run recorded: its last start's in ``summary.json``, after those
        the checkpoint of its last resume records (:func:`storage.lineage.run_restarts`).
        With them, also ``s_gen_lineage``, ``residence_lineage`` and ``s_train_lineage``:
        the same lags counted along the weights' lineage
        (:func:`storage.lineage.lineage_lag`, as ``buffer.max_train_staleness`` counts):
        a trajectory of ``V``'s weights trained by the restarted trainer's first update
        has ``s_train = M - V`` but ``s_train_lineage = 0``. Each is the path between two
        weights in the tree, so for a trajectory generated on a lost branch ``s_gen_lineage
        + residence_lineage`` can exceed ``s_train_lineage``. NaN where not sampled."""
        ds = self._ds
        consumed = np.flatnonzero(ds["status"].values == "consumed")
        # (the four columns, then the rows: the rows of every column, strings included,
        # took 1 s for 1M trajectories)
        out = ds[["behavior_version", "s_gen", "residence", "s_train"]].isel(trajectory=consumed)
        if restarts is None:
            return out
        if isinstance(restarts, str):
            if restarts != "run":
                raise ValueError(f"restarts={restarts!r}; a list of (V, M) or 'run'")
            if "run_dir" not in self._attrs:
                raise ValueError("restarts='run' needs a Dataset from storage.open_run")
            restarts = run_restarts(self._attrs["run_dir"])
        restarts = [(int(v), int(m)) for v, m in restarts]
        behavior = ds["behavior_version"].values[consumed]
        finish = ds["finish_version"].values[consumed]
        sample = ds["sample_version"].values[consumed]
        lags = {
            "s_gen_lineage": lineage_lags(finish, behavior, restarts, trainer=False),
            "residence_lineage": lineage_lags(sample, finish, restarts),
            "s_train_lineage": lineage_lags(sample, behavior, restarts),
        }
        out = out.assign({name: ("trajectory", values) for name, values in lags.items()})
        return out.assign_attrs(restarts=[list(r) for r in restarts])  # (a copy of attrs)

    def staleness_histogram(self, normalize: bool = False) -> xr.Dataset:
        """Counts of consumed trajectories per staleness value (in versions), for
        ``s_gen``, ``residence`` and ``s_train``, on a ``staleness`` dimension.

        ``normalize``: each one's share of the trajectories it counts instead (each sums
        to 1; NaN while none), to compare runs of different lengths. Runs' histograms
        side by side (docs/analysis.md, "Several runs")::

            xr.concat([h1, h2], dim="run", join="outer", fill_value=0)

        (``fill_value=0``: a staleness one run never reached is none of its trajectories,
        not NaN, xarray's fill.)

        A damaged store can hold trajectories ``consumed`` with no ``sample_version``
        (-1; :meth:`audit` reports them): their ``residence`` and ``s_train`` are unknown
        and left out of those two counts; the attribute ``unsampled`` says how many."""
        st = self.staleness()
        names = ("s_gen", "residence", "s_train")
        values = {n: st[n].values[np.isfinite(st[n].values)] for n in names}
        top = max((int(v.max()) for v in values.values() if v.size), default=0)
        edges = np.arange(top + 2)  # one bin per integer staleness 0..top
        counts = {n: np.histogram(v, bins=edges - 0.5)[0] for n, v in values.items()}
        units = "trajectories"
        if normalize:
            with np.errstate(invalid="ignore"):  # (NaN: none counted)
                counts = {n: c / c.sum() for n, c in counts.items()}
            units = "share of the consumed trajectories counted"
        out = {n: ("staleness", c, {"units": units}) for n, c in counts.items()}
        unsampled = int(st.sizes["trajectory"] - values["s_train"].size)
        coords = {"staleness": ("staleness", edges[:-1], {"units": "versions"})}
        return xr.Dataset(out, coords=coords, attrs={"unsampled": unsampled})

    @property
    def t_end(self) -> float:
        """When the run ended (a run still going: was last seen going), epoch seconds:
        the later of its last ``cluster`` row in ``metrics.zarr`` (the attribute
        ``metrics_end_s``) and its trajectories' last finish or sample; without metrics,
        the last of those alone (NaN before the first trajectory is stored)."""
        ds = self._ds
        t = np.concatenate(
            [
                ds["t_finish"].values,
                ds["t_sample"].values,
                [self._attrs.get("metrics_end_s", np.nan)],
            ]
        ).astype(np.float64)
        return float(np.nanmax(t)) if np.isfinite(t).any() else float("nan")

    @property
    def t0(self) -> float:
        """Wall-clock origin of the run: the first request's submit time (NaN before the
        first trajectory is stored)."""
        t = self._ds["t_submit"].values
        return float(np.nanmin(t)) if np.isfinite(t).any() else float("nan")

    def buffer_age(
        self, by_version: str | None = None, statuses: str | Sequence[str] = "consumed"
    ) -> xr.DataArray:
        """Seconds each consumed trajectory spent in the buffer while the run ran: its
        stays in the buffer, summed, less any stretch the run was stopped in them
        (:func:`storage.trajectories.time_in_buffer`). Most have one stay,
        ``t_insert`` to ``t_sample``; one that was held again after an update consumed
        it and was lost (a resume, a data module rebuilt within the run, a restarted
        trainer) was out of the buffer in between: its last stay runs from ``t_held``
        (when it was held again) to ``t_sample``, its earlier ones are ``held_s``
        seconds. A trajectory held again by ``laminar run --resume`` while still
        buffered stays in the buffer across the stop, which is left out
        (``pauses_s`` below). On the consumed trajectories, with ``behavior_version``
        as a coordinate, so that ``age.groupby("behavior_version").mean()`` works
        (while something was consumed: xarray refuses to group none, "behavior_version
        must not be empty").

        ``by_version``: a statistic's name (``"mean"``, ``"median"``, ``"max"``, ...) to
        get it per ``behavior_version`` instead; a run that has consumed nothing yet (a
        run still going, or one opened in its first seconds) gets an empty result on
        that dimension, as its per-trajectory ages are empty.

        ``statuses``: the trajectories aged, by how they left (``"consumed"``, the
        default; ``"evicted"``, ``"filtered"``, ``"discarded"``, ``"dropped"``; several
        in a list; ``"left"`` for all five), each up to when it left (``t_leave``), with
        ``status`` and ``leave_version`` as coordinates. The consumed alone are the
        survivors: under ``buffer.max_train_staleness`` the longest-waiting are evicted,
        and ``buffer_age(statuses="left").groupby("status").mean()`` says how long they
        waited. A store written before ``t_leave`` (schema 1 and 2) holds it for the
        consumed alone: the others' ages are NaN.

        A store written before laminar recorded when a trajectory was held again
        (its ``buffered`` events have no time) counts it from ``t_insert``, the time it
        was out of the buffer included; so does a Dataset without ``t_held``."""
        ds = self._ds
        wanted = _left_statuses(statuses)
        idx = np.flatnonzero(np.isin(ds["status"].values, wanted))
        t_in = ds["t_held"] if "t_held" in ds else ds["t_insert"]
        held = ds["held_s"].values[idx] if "held_s" in ds else 0.0
        until = ds["t_leave"] if "t_leave" in ds else ds["t_sample"]  # (t_sample: consumed)
        age = time_in_buffer(t_in.values[idx], held, until.values[idx], self.pauses_s)
        coords = {
            "trajectory": ds["trajectory"].values[idx],  # (the labels: ds may be a slice)
            "behavior_version": ("trajectory", ds["behavior_version"].values[idx]),
        }
        if wanted != ("consumed",):
            coords["status"] = ("trajectory", ds["status"].values[idx])
            left_at = ds["leave_version"] if "leave_version" in ds else ds["sample_version"]
            coords["leave_version"] = ("trajectory", left_at.values[idx])
        out = xr.DataArray(age, dims="trajectory", coords=coords, name="buffer_age_s")
        if by_version is None:
            return out
        if by_version not in _GROUP_STATS:
            raise ValueError(f"by_version={by_version!r}; choose from {list(_GROUP_STATS)}")
        if not idx.size:  # (xarray's groupby refuses an empty group variable)
            return xr.DataArray(
                np.zeros(0),
                dims="behavior_version",
                coords={"behavior_version": np.zeros(0, np.int64)},
                name="buffer_age_s",
            )
        return getattr(out.groupby("behavior_version"), by_version)()

    @property
    def pauses_s(self) -> list[tuple[float, float]]:
        """The stretches (epoch seconds, from to) a resumed run was stopped, between its
        starts; none for a run started once. :func:`storage.open_run` finds them: each
        resume the trajectory store recorded ends one, whatever ``metrics.zarr`` holds
        (docs/analysis.md, "``laminar report``")."""
        flat = np.asarray(self._attrs.get("pauses_s", []), dtype=np.float64)
        return [(float(a), float(b)) for a, b in flat.reshape(-1, 2)]

    def superseded(self) -> xr.DataArray:
        """True for each trajectory generated by weights that no longer exist: a run lost
        after its checkpoint of version V and resumed from it redoes the versions after V
        with new weights, so the lost run's trajectories of those versions (``dropped``,
        mostly; any status) share their version numbers with the redone weights'.

        A trajectory is superseded when it finished before a later start that resumed
        from a version below its ``behavior_version``; in a schedule whose responses mix
        versions (partial rollout: the store's ``schedule`` attribute), below the newest
        of its ``token_versions``: a response begun on weights that stand and carried on
        by the lost ones is theirs in part (its token versions are read for the
        trajectories that may be, those whose ``finish_version`` is above the version
        resumed from, in blocks as :meth:`audit` reads them). Each resume is recorded in the
        store (the attributes ``resumed_at_s``/``resumed_from_version``:
        :meth:`storage.trajectories.TrajectoryWriter.record_resume`). A resume by a
        laminar from before that record is read from the metrics' starts
        (``segment_start_s``/``segment_first_version``: the trainer's version in a
        start's first row, bounded by the lowest behavior version the start generated,
        in case its trainer had published an update before that row). None for a run
        started once.
        """
        ds = self._ds
        k = ds["behavior_version"].values
        t = ds["t_finish"].values
        out = np.zeros(ds.sizes["trajectory"], dtype=bool)
        attrs = self._attrs
        at_s, versions = attrs.get("resumed_at_s", []), attrs.get("resumed_from_version", [])
        recorded = list(zip(at_s, versions, strict=True))
        # Starts before the first resume the store recorded (by an older laminar): from
        # the metrics' segments
        until = min((at for at, _ in recorded), default=np.inf)
        starts = attrs.get("segment_start_s", [])
        firsts = attrs.get("segment_first_version", [])
        older = []
        for start, first in list(zip(starts, firsts, strict=True))[1:]:
            if start >= until - _SEGMENT_SLACK_S:
                break
            after = t >= start  # (what this start, or a later one, generated)
            if after.any():  # (its first batch is generated by the checkpoint's weights)
                first = min(first, int(k[after].min()))
            older.append((start, first))
        resumes = [*recorded, *older]  # (what the store says is exact)
        newest = self._newest_versions(resumes) if resumes else k
        for at, version in resumes:
            out |= (t < at) & (newest > version)
        return xr.DataArray(out, dims="trajectory", name="superseded")

    def _newest_versions(self, resumes: Sequence[tuple[float, int]]) -> np.ndarray:
        """Per trajectory, the newest weights' version its response holds: its
        ``behavior_version``, or in a schedule whose responses mix versions, the newest
        of its ``token_versions``, read for those whose ``finish_version`` is above a
        version one of the ``resumes`` (when, from which version) resumed from, before
        it (the rest are superseded, or not, whatever their tokens say)."""
        ds = self._ds
        k = ds["behavior_version"].values
        if self._attrs.get("schedule") not in MIXED_VERSION_SCHEDULES or "versions_len" not in ds:
            return k
        t, m_f = ds["t_finish"].values, ds["finish_version"].values
        maybe = np.zeros(k.shape, dtype=bool)
        for at, version in resumes:
            maybe |= (t < at) & (k <= version) & (m_f > version)
        newest = k.copy()
        for block, seg, first in self._token_version_blocks(np.flatnonzero(maybe)):
            newest[block] = np.maximum(k[block], np.maximum.reduceat(seg, first))
        return newest

    def _token_version_blocks(self, rows: np.ndarray):
        """The ``token_versions`` of the trajectories at ``rows`` (those with any), in
        blocks of about :data:`AUDIT_BLOCK_TOKENS` values read one at a time: each
        block's rows, their values end to end, and where each row's begin in them."""
        ds = self._ds
        n_versions = ds["versions_len"].values
        rows = rows[n_versions[rows] > 0]
        if not rows.size:
            return
        starts = ds["versions_start"].values
        ends = np.cumsum(n_versions[rows])
        cuts = np.searchsorted(ends, np.arange(AUDIT_BLOCK_TOKENS, ends[-1], AUDIT_BLOCK_TOKENS))
        for block in np.split(rows, np.unique(cuts)):
            if not block.size:
                continue
            n = n_versions[block]
            lo = int(starts[block].min())
            values = ds["token_versions"][lo : int((starts[block] + n).max())].values
            first = np.cumsum(n) - n  # each trajectory's first value in `seg`
            if np.array_equal(starts[block] - lo, first):  # (as stored: end to end)
                seg = values
            else:  # (some rows, or a Dataset cut or reordered on the trajectory dimension)
                seg = values[np.arange(n.sum()) + np.repeat(starts[block] - lo - first, n)]
            yield block, seg, first

    @staticmethod
    def _check_window(method: str, window) -> None:
        """``window`` is a length of time (seconds > 0): 0 divided by zero, a negative one
        indexed out of range, and reward_curve drew one window of the whole run."""
        ok = isinstance(window, int | float | np.integer | np.floating) and not isinstance(
            window, bool
        )
        if not ok or not np.isfinite(window) or window <= 0:
            raise ValueError(
                f"{method}: window={window!r}; it takes the windows' length in seconds, a "
                "number > 0 (e.g. window=10.0)"
            )

    def _windows(self, t: np.ndarray, window: float) -> np.ndarray:
        return np.floor((t - self.t0) / window).astype(np.int64)

    @property
    def pacing(self) -> dict | None:
        """How a paced run's clock maps onto the cluster it models (``rollout.pacing``
        of the ``config.yaml`` beside its store: :func:`storage.audit.run_pacing`), or
        ``None``: not paced, or no ``config.yaml`` (a store not written by ``laminar
        run``, a Dataset not from ``open_run``). A paced run's times are wall seconds of
        the dilated run, its tokens real ones: its rates in tokens/s are
        ``pacing["modelled_rate_per_rate"]`` (``request_scale * dilation``) times lower
        than the modelled cluster's, and a wall second is ``pacing["modelled_s_per_wall_s"]``
        (``length_scale / dilation``) modelled ones (docs/analysis.md, "Three clocks")."""
        from storage.audit import run_pacing

        run_dir = self._attrs.get("run_dir")
        return None if run_dir is None else run_pacing(run_dir)

    def _windows_end(self) -> float:
        """Where :meth:`throughput`'s last window ends: :attr:`t_end`, or the last
        trajectory event where every ``cluster`` row of the run's metrics comes after it
        (``segment_start_s``, the first row): rows that do not overlap the trajectories
        are on another clock (synthetic records), or of a resumed start that stored
        nothing, and windows to them would span the gap."""
        first_row = self._attrs.get("segment_start_s", [])
        ds = self._ds
        events = np.concatenate([ds["t_finish"].values, ds["t_sample"].values])
        events = events[np.isfinite(events)]
        if len(first_row) and events.size and first_row[0] > events.max():
            return float(events.max())
        return self.t_end

    def throughput(self, window: float = 10.0) -> xr.Dataset:
        """Tokens per second in windows of ``window`` seconds since the run started.

        ``generated``: prompt + response tokens of trajectories that finished in the window
        (the paper's token count); ``response``: their response tokens alone (what the
        engines decoded: generation throughput); ``trained``: prompt + response tokens of
        trajectories the trainer consumed in the window. Each window is divided by the
        seconds the run ran in it, its coordinate ``running_s``: the windows go on to
        when the run ended, whether or not its last seconds hold an event (:attr:`t_end`:
        its last metrics row, or a later event; a run without metrics, or whose metrics
        rows all come after its last event, on another clock, at its last event), and a
        resumed run's stops (:attr:`pauses_s`) are left
        out; a window it was stopped throughout has no rate (NaN, not 0) and
        ``running_s`` 0. (Ending the last window at the last event instead would divide,
        say, a batch the trainer sampled 0.05 s into it by 0.05 s.)

        The windows differ in length (the last, those around a stop), so the rate while
        the run ran is their mean weighted by ``running_s``, not a plain mean (which
        weighs a sliver of a window like a whole one)::

            tp = ds.laminar.throughput()
            tp.weighted(tp.running_s).mean("time")  # tokens/s while it ran

        A damaged store can hold trajectories ``consumed`` with no ``t_sample``
        (:meth:`audit` reports them): they are left out of ``trained``, and the attribute
        ``unsampled`` says how many.
        """
        self._check_window("throughput", window)
        ds = self._ds
        if not ds.sizes["trajectory"]:  # (a run that has stored nothing yet)
            empty = ("time", np.zeros(0))
            return xr.Dataset(
                {"generated": empty, "response": empty, "trained": empty},
                coords={"time": np.zeros(0), "running_s": empty},
                attrs={"units": "tokens/s", "window_s": window, "unsampled": 0},
            )
        tokens = (ds["prompt_len"].values + ds["response_len"].values).astype(np.float64)
        # (an event at the very end of a run that ended on a window's start, as one
        # without metrics does at its last event, is the window before's: the one it
        # opens lasts 0 s, and would give its tokens no rate)
        last = max(int(np.ceil((self._windows_end() - self.t0) / window)) - 1, 0)
        finish = np.minimum(self._windows(ds["t_finish"].values, window), last)
        consumed = ds["status"].values == "consumed"
        # (a damaged store's consumed trajectory with no t_sample: the audit reports it;
        # its tokens were trained at an unknown time, left out of ``trained``)
        unsampled = int((consumed & ~np.isfinite(ds["t_sample"].values)).sum())
        consumed &= np.isfinite(ds["t_sample"].values)
        sample = np.minimum(self._windows(ds["t_sample"].values[consumed], window), last)
        # (to the window t_end falls in, whether or not the run's last seconds hold an
        # event: windows up to the last event's alone left those seconds out)
        n = last + 1
        # Every window lasts `window` seconds except the last, cut where the run ended,
        # less the time the run was stopped in it.
        lo = self.t0 + np.arange(n) * window
        hi = np.append(lo[1:], min(lo[-1] + window, self._windows_end()))
        span = hi - lo
        for start, end in self.pauses_s:
            span -= np.clip(np.minimum(hi, end) - np.maximum(lo, start), 0.0, None)
        running = np.maximum(span, 0.0)
        span = np.where(span > 0, span, np.nan)  # (stopped throughout: no rate)
        gen = np.bincount(finish, weights=tokens, minlength=n)[:n] / span
        response = ds["response_len"].values.astype(np.float64)
        decoded = np.bincount(finish, weights=response, minlength=n)[:n] / span
        trained = np.bincount(sample, weights=tokens[consumed], minlength=n)[:n] / span
        return xr.Dataset(
            {
                "generated": ("time", gen),
                "response": ("time", decoded),
                "trained": ("time", trained),
            },
            coords={"time": np.arange(n) * window, "running_s": ("time", running)},
            attrs={"units": "tokens/s", "window_s": window, "unsampled": unsampled}
            | self._paced_attrs(),
        )

    def _paced_attrs(self) -> dict:
        """A paced run's throughput says so (its tokens/s are real tokens per dilated
        wall second): the scales, and the factor to the modelled cluster's rate."""
        try:
            pacing = self.pacing
        except StoreError as e:  # (config.yaml damaged: the figures stand, the clock unsure)
            return {"clock": f"unknown: {e}"}
        if pacing is None:
            return {}
        return {
            "clock": (
                "paced: real tokens per wall second of the dilated run; times the attribute "
                "modelled_rate_per_rate for the modelled cluster's tokens/s, times "
                "modelled_s_per_wall_s for its seconds (docs/analysis.md, 'Three clocks')"
            ),
            **{k: v for k, v in pacing.items() if k != "trainer_paced"},
        }

    def reward_curve(self, by: str = "version", window: float = 10.0) -> xr.DataArray:
        """Mean reward by ``behavior_version`` (``by="version"``) or by finish-time window
        (``by="time"``, seconds since the run started); failed rewards are left out.

        By version, only the weights that stand count: of a lost run resumed from an older
        checkpoint, the lost run's trajectories of the versions the resume redid
        (:meth:`superseded`) are left out. By time each window shows what ran then.

        The coordinate ``trajectories`` counts the rewards each mean is of: by time, the
        last windows of a run hold only the slow tail of its final batches (a handful of
        long responses, often low-reward), so a curve's last point can fall on few;
        ``curve.where(curve.trajectories >= n)`` leaves out the windows of fewer than
        ``n`` (the report leaves out those with under a quarter of the median window's)."""
        if by == "time":
            self._check_window("reward_curve", window)
        ds = self._ds
        ok = ds["finish_reason"].values != "error"
        if by == "version":
            ok &= ~self.superseded().values
        reward = ds["reward"].values[ok].astype(np.float64)
        if by == "version":
            key, dim = ds["behavior_version"].values[ok], "behavior_version"
        elif by == "time":
            key, dim = self._windows(ds["t_finish"].values[ok], window), "time"
        else:
            raise ValueError(f"by={by!r}; choose 'version' or 'time'")
        keys, inverse = np.unique(key, return_inverse=True)
        count = np.bincount(inverse, minlength=len(keys))
        mean = np.bincount(inverse, weights=reward, minlength=len(keys)) / count
        coord = keys * window if by == "time" else keys
        coords = {dim: coord, "trajectories": (dim, count.astype(np.int64))}
        return xr.DataArray(mean, dims=dim, coords=coords, name="reward")

    def _scored_rewards(self) -> tuple[np.ndarray, np.ndarray]:
        """Each trajectory's reward (float64), and whether it counts in a mean: finite,
        and not a failed reward's (``finish_reason == "error"``)."""
        reward = self._ds["reward"].values.astype(np.float64)
        return reward, np.isfinite(reward) & (self._ds["finish_reason"].values != "error")

    def to_dataframe(self):
        """One row per trajectory: every per-trajectory field (a pandas DataFrame indexed
        by ``trajectory``). The ragged token fields are left out (read them with
        :meth:`tokens`): ``ds.to_dataframe()`` takes the product of every dimension, which
        is empty while ``version_token`` is (no trajectory mixed versions) and the size of
        the store's tokens squared when it is not."""
        ds = self._ds
        ragged = [d for d in ds.dims if d != "trajectory"]
        return ds.drop_dims(ragged).to_dataframe()

    def groups(self) -> xr.Dataset:
        """One row per prompt group (``prompt_uid``): siblings stored, group size,
        completeness, how many distinct weight versions generated its siblings, how many
        were consumed, and its rewards: ``scored`` siblings (a reward that counts: finite,
        ``finish_reason`` not ``"error"``, as :meth:`reward_curve` takes them), their
        ``reward_mean`` and ``reward_std`` (population, as GRPO normalises; NaN with none
        scored) and ``flat``: two or more scored, every reward equal. A flat group's
        advantages are all 0 (``laminar.losses.group_advantages``): trained on, it adds
        nothing to the policy gradient (``buffer.dynamic_sampling`` drops such groups)."""
        ds = self._ds
        pu = ds["prompt_uid"].values
        uids, inverse = np.unique(pu, return_inverse=True)
        n = len(uids)
        reward, ok = self._scored_rewards()
        scored = np.bincount(inverse, weights=ok, minlength=n)
        with np.errstate(invalid="ignore", divide="ignore"):  # (NaN: none scored)
            mean = np.bincount(inverse, weights=np.where(ok, reward, 0.0), minlength=n) / scored
            dev = np.where(ok, reward - mean[inverse], 0.0)
            std = np.sqrt(np.bincount(inverse, weights=dev * dev, minlength=n) / scored)
        # equal rewards exactly, not a std below some rounding (the loss's test too)
        lo, hi = np.full(n, np.inf), np.full(n, -np.inf)
        np.minimum.at(lo, inverse[ok], reward[ok])
        np.maximum.at(hi, inverse[ok], reward[ok])
        stored = np.bincount(inverse, minlength=n)
        size = np.zeros(n, np.int64)
        size[inverse] = ds["group_size"].values
        # distinct (group, behavior version) pairs, counted per group (as one integer
        # each: np.unique(axis=1) on the pairs took 0.11 s for 200k trajectories)
        k = ds["behavior_version"].values.astype(np.int64)
        span = int(k.max(initial=0)) - int(k.min(initial=0)) + 1
        pairs = np.unique(inverse * span + (k - k.min(initial=0)))
        versions = np.bincount(pairs // span, minlength=n)
        consumed = np.bincount(inverse, weights=ds["status"].values == "consumed", minlength=n)
        return xr.Dataset(
            {
                "stored": ("group", stored),
                "group_size": ("group", size),
                "complete": ("group", stored == size),
                "versions": ("group", versions.astype(np.int64)),
                "consumed": ("group", consumed.astype(np.int64)),
                "scored": ("group", scored.astype(np.int64)),
                "reward_mean": ("group", mean),
                "reward_std": ("group", std),
                "flat": ("group", (scored >= 2) & (lo == hi)),
            },
            coords={"group": uids},
        )

    def by_rollout(self) -> xr.Dataset:
        """Per rollout (the last in ``rollout_ids``: the one that finished it):
        trajectories, response tokens, mean reward and mean response length. The mean
        reward leaves out failed ones (``finish_reason == "error"``: a reward that could
        not be computed, or one of a response with a behavior logprob that is not finite,
        whose group was discarded), as :meth:`reward_curve` does.

        A resumed run's starts name their rollouts alike (``r0``, ``r1``, ...): each
        rollout here is every start's of that name. One start's alone are those of its
        trajectories, e.g. the last start's (``resumed_at_s``: when each resume began)::

            last = ds.isel(trajectory=ds.t_finish >= ds.attrs["resumed_at_s"][-1])
            last.laminar.by_rollout()
        """
        ds = self._ds
        ids = ds["rollout_ids"].values
        last = np.strings.rpartition(ids, ",")[2] if ids.size else ids  # (numpy: none fails)
        ids, inverse = np.unique(last, return_inverse=True)
        count = np.bincount(inverse, minlength=len(ids))
        rlen = ds["response_len"].values.astype(np.float64)
        reward, ok = self._scored_rewards()
        scored = np.bincount(inverse, weights=ok, minlength=len(ids))
        total = np.bincount(inverse, weights=np.where(ok, reward, 0.0), minlength=len(ids))
        return xr.Dataset(
            {
                "trajectories": ("rollout", count),
                "response_tokens": ("rollout", np.bincount(inverse, weights=rlen).astype(np.int64)),
                "reward_mean": ("rollout", total / scored),
                "response_len_mean": ("rollout", np.bincount(inverse, weights=rlen) / count),
            },
            coords={"rollout": ids},
        )

    def summary(self) -> dict[str, float]:
        """Counts by status (``n_<status>``, one for each of
        :data:`storage.schema.STATUSES`, 0 where none) and mean staleness of consumed
        trajectories.

        The three means are over the same trajectories: a damaged store can hold some
        ``consumed`` with no ``sample_version`` (-1; :meth:`audit` reports them), whose
        ``residence`` and ``s_train`` are unknown; they are left out of all three (their
        ``s_gen`` too), and ``unsampled`` says how many, as
        :meth:`staleness_histogram`'s attribute does.

        ``flat_group_share``: of the groups trained on (a sibling consumed), the share
        whose rewards were all equal (:meth:`groups`' ``flat``), so that their advantages
        were 0; NaN while none was trained on."""
        ds = self._ds
        status = ds["status"].values
        # (every status, 0 where none: one key each whatever the run went through; a
        # damaged store's unknown ones too, which the audit reports)
        every = [*STATUSES, *sorted(set(np.unique(status).tolist()) - set(STATUSES))]
        out: dict[str, float] = {f"n_{s}": int((status == s).sum()) for s in every}
        st = self.staleness()
        sampled = np.isfinite(st["s_train"].values)
        for name in ("s_gen", "residence", "s_train"):
            # (NaN, not 0, while nothing was sampled: no staleness was measured)
            values = st[name].values[sampled]
            out[f"{name}_mean"] = float(values.mean()) if values.size else np.nan
        out["unsampled"] = int((~sampled).sum())
        groups = self.groups()
        trained = groups["consumed"].values > 0
        flat = groups["flat"].values[trained]
        out["flat_group_share"] = float(flat.mean()) if flat.size else np.nan
        return out

    def audit(self) -> list[str]:
        """Check the data contract's invariants; returns the violations (empty when sound).

        * every contract field is present;
        * ``behavior_version <= finish_version <= sample_version`` (for consumed ones);
        * one behavior version per trajectory (``token_versions`` empty or all equal to it)
          — or, in a schedule whose responses mix versions (partial rollout: the store's
          ``schedule`` attribute), one version per response token, rising from the
          behavior version to at most the finish version;
        * uids unique, so nothing was stored — or consumed — twice;
        * ``sample_version``/``t_sample`` set exactly for consumed trajectories, and
          ``t_leave``/``leave_version`` equal to them there, unset on buffered ones;
        * every consumed group complete: ``group_size`` consumed siblings per prompt_uid,
          all sampled at the same version.
        """
        from storage.contract_audit import contract_problems

        return contract_problems(self)


# The statuses a trajectory leaves the buffer with (buffer_age's ``statuses="left"``).
LEFT = ("consumed", "evicted", "filtered", "discarded", "dropped")


def _left_statuses(statuses: str | Sequence[str]) -> tuple[str, ...]:
    """``buffer_age``'s ``statuses`` as a tuple of leaving statuses, or a ValueError
    naming the ones it takes."""
    wanted = LEFT if statuses == "left" else (statuses,) if isinstance(statuses, str) else statuses
    wanted = tuple(wanted)
    if not wanted or set(wanted) - set(LEFT):
        raise ValueError(
            f"statuses={statuses!r}: give one or more of {list(LEFT)}, or 'left' for all "
            "(a buffered trajectory has not left: it has no age yet)"
        )
    return wanted
