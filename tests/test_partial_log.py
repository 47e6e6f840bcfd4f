"""The recovery log ``partial.zarr`` (storage.partial_log) and its replay into the pool's
entries (laminar.partial.replay_log), on real Zarr stores."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import laminar.partial as partial
from laminar.contract import PromptGroup
from laminar.engine import GenerationRequest, RequestState, SamplingParams
from laminar.partial import PartialCore, journal_rows, replay_log, write_records
from storage.partial_log import PartialLogWriter, log_entries, read_partial_log
from storage.trajectories import StoreError

PARAMS = SamplingParams(16, temperature=0.7, stop_token_ids=(2,), stop=("\n",))


def _states(ids: list[str], seed: int, prompt=(1, 2, 3)) -> list[RequestState]:
    group = PromptGroup(ids[0][:3], 4, prompt, "7", len(ids), 0, None)
    return [
        RequestState(
            GenerationRequest(
                rid, prompt, PARAMS, {"group": group, "sample_idx": i, "t_submit": 1.5}
            ),
            seed=seed + i,
            t_start=float(i),
        )
        for i, rid in enumerate(ids)
    ]


def _view(core: PartialCore) -> dict:
    """What a recovery reads from an entry."""
    out = {}
    for rid, e in core.entries.items():
        s = e["state"]
        out[rid] = (
            e["owner"],
            e["version"],
            s.seed,
            s.n_moves,
            list(s.tokens),
            list(np.float32(s.logprobs)),  # (logged as float32)
            list(s.token_versions),
            s.request.prompt_tokens,
            s.request.params,
            json.dumps(s.request.meta, default=str, sort_keys=True),
            e.get("finished"),
            bool(e.get("held")),
        )
    return out


def _live(core: PartialCore) -> Counter:
    """What the relays must keep, counted afresh: for each version, the unfinished
    entries the buffer does not hold that resume at it (their newest token's version,
    else their batch's)."""
    return Counter(
        int(e["state"].token_versions[-1]) if e["state"].token_versions else e["version"]
        for e in core.entries.values()
        if not ("finished" in e or e.get("held"))
    )


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "register",
                "reregister",
                "flush",
                "finish",
                "reassign",
                "move",
                "take",
                "hold",
                "forget",
                "write",
                "compact",
            ]
        ),
        st.integers(0, 7),
        st.integers(1, 5),
    ),
    max_size=40,
)


@settings(max_examples=25, deadline=None)
@given(ops=OPS)
# (a loss, then a write with no compaction after it: the replay must count the move;
# a second loss of the same entry after it was reassigned counts another)
@example(ops=[("register", 0, 1), ("take", 0, 1)])
@example(ops=[("register", 0, 1), ("take", 0, 1), ("reassign", 0, 1), ("take", 1, 1)])
# (a flush that rewrites tokens a compaction has yet to write: it writes the old ones)
@example(ops=[("register", 0, 1), ("flush", 0, 3), ("compact", 0, 1), ("flush", 2, 1)])
def test_the_log_replays_to_the_pools_entries(tmp_path_factory, ops):
    """Whatever the pool did, and however its changes were cut into writes (and
    compactions, each written after the changes made since its snapshot, as the pool's
    thread does), replaying the log gives back every entry as the pool holds it."""
    run = tmp_path_factory.mktemp("run")
    core, writer = PartialCore(journal=True), PartialLogWriter(run)

    def write(snapshot: tuple | None) -> None:
        if snapshot is not None:
            records, then = snapshot
            with patch.object(partial, "COMPACT_BATCH", 3):  # (a compaction in batches)
                write_records(writer, records, compact=True)
            assert _view(replay_log(run)) == then  # (not what changed since)
        writer.append(**core.drain_journal())

    n, snapshot = 0, None
    for op, k, m in ops:
        rids = list(core.entries)
        rid = rids[k % len(rids)] if rids else None
        owner = f"r{k % 3}"
        if op == "register":
            ids = [f"p{n:02d}-{i:03d}" for i in range(m)]
            core.register(owner, k, _states(ids, seed=10 * n))
            n += 1
        elif op == "reregister" and rid is not None:  # (a rollout attaching again)
            core.register(owner, k, [core.entries[rid]["state"]])
        elif op in ("flush", "finish") and rid is not None:
            logged = len(core.entries[rid]["state"].tokens)
            off = max(0, logged - (k % 3))  # sometimes a repeated (or late) flush
            toks = [100 * k + t for t in range(off, off + m)]
            core.flush(
                owner,
                {rid: (off, toks, [-0.1 * t for t in toks], [k] * m)},
                {rid: ("eos", 9.0 + k)} if op == "finish" else None,
            )
        elif op == "reassign" and rid is not None:
            core.reassign([rid], owner)
        elif op == "move" and rid is not None:  # (repack: its history goes with it)
            core.reassign([rid], owner, moved_from=core.entries[rid]["owner"] or "r9")
        elif op == "take":
            core.take(owner)
        elif op == "hold" and rid is not None:
            core.hold([rid])
        elif op == "forget" and rid is not None:
            core.forget([rid])
        elif op == "write":
            snapshot = write(snapshot)
        elif op == "compact" and snapshot is None:
            # Taken now and written at the next write, the changes made in between
            # after it: as the pool's thread writes it while its event loop goes on.
            snapshot = core.snapshot_records(), _view(core)
        # (kept as entries change: each version's count, not only the set, so that an
        # entry left counted shows while another holds its version)
        assert core._live == _live(core) and core.versions() == sorted(_live(core))
    write(snapshot)
    replayed = replay_log(run)
    assert _view(replayed) == _view(core)
    assert replayed._live == core._live
    # The storage-only reading (the audit's, resume's) says the same without the tokens.
    assert log_entries(run) == {
        rid: {
            "version": e["version"],
            "owner": e["owner"] or "",
            "tokens": len(e["state"].tokens),
            "finished": "finished" in e,
            "held": bool(e.get("held")),
            "prompt_uid": rid[:3],
            "prompt_key": 4,
            "group_size": e["state"].request.meta["group"].group_size,
            "sample_idx": e["state"].request.meta["sample_idx"],
            "rollout_path": e["state"].request.meta.get("rollout_path", []),
        }
        for rid, e in core.entries.items()
    }


def test_a_write_cut_short_is_invisible_and_the_next_writer_goes_on(tmp_path):
    core = PartialCore(journal=True)
    core.register("r0", 2, _states(["p00-000", "p00-001"], seed=0))
    writer = PartialLogWriter(tmp_path)
    writer.append(**core.drain_journal())
    core.flush("r0", {"p00-000": (0, [5, 6], [-0.5, -0.5], [2, 2])})
    rows = core.drain_journal()
    # The writer dies after writing the chunk's tokens, before its commit.
    writer._write_all([((None, "tokens"), writer.committed["token"], np.array([5, 6], np.int32))])
    log = read_partial_log(tmp_path)
    assert len(log["chunks"]["seq"]) == 0 and len(log["tokens"]) == 0
    assert replay_log(tmp_path).entries["p00-000"]["state"].tokens.tolist() == []
    # A new writer (the pool restarted) appends from what was committed.
    PartialLogWriter(tmp_path).append(**rows)
    assert replay_log(tmp_path).entries["p00-000"]["state"].tokens.tolist() == [5, 6]


def test_compaction_keeps_the_live_entries_and_drops_the_rest(tmp_path):
    core, writer = PartialCore(journal=True), PartialLogWriter(tmp_path)
    for b in range(20):
        ids = [f"p{b:02d}-{i:03d}" for i in range(4)]
        core.register("r0", b, _states(ids, seed=b))
        for rid in ids:
            core.flush("r0", {rid: (0, list(range(50)), [0.0] * 50, [b] * 50)}, {rid: ("eos", 1.0)})
        if b < 19:
            core.hold(ids)
            core.forget(ids)
        writer.append(**core.drain_journal())
    assert writer.tokens() == 20 * 4 * 50
    before = _view(replay_log(tmp_path))
    writer.compact(**core.snapshot())
    assert writer.tokens() == 4 * 50 and writer.generation == 1
    assert not (writer.path / "g0").exists()
    assert _view(replay_log(tmp_path)) == before == _view(core)


def test_a_store_that_is_not_a_recovery_log_is_refused(tmp_path):
    PartialLogWriter(tmp_path)
    meta = tmp_path / "partial.zarr" / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["schema_version"] = 99
    meta.write_text(json.dumps(doc))
    with pytest.raises(StoreError, match="schema_version 99.*move it aside"):
        read_partial_log(tmp_path)
    with pytest.raises(StoreError, match="partial.zarr"):
        PartialLogWriter(tmp_path)
    shutil.rmtree(tmp_path / "partial.zarr")
    assert replay_log(tmp_path).entries == {}  # no log: nothing to replay


def test_the_pool_writes_its_log_in_the_background_and_at_close(tmp_path):
    """The actor's own loop (run here without a cluster): changes reach the disk within
    a log interval, one write at a time, and ``close`` writes the rest."""
    import asyncio

    from laminar.partial import PartialResponsePool

    async def run() -> tuple[list[int], dict]:
        pool = PartialResponsePool(run_dir=str(tmp_path), log_interval_s=0.05)
        await pool.register("r0", 1, _states(["p00-000"], seed=0))
        seen = []
        for i in range(20):
            await pool.flush("r0", {"p00-000": (i, [i], [-0.5], [1])})
            await asyncio.sleep(0.01)
            entry = replay_log(tmp_path).entries.get("p00-000")
            seen.append(len(entry["state"].tokens) if entry else 0)
        await pool.flush("r0", {"p00-000": (20, [20], [-0.5], [1])}, {"p00-000": ("eos", 3.0)})
        return seen, await pool.close()

    seen, stats = asyncio.run(run())
    assert seen == sorted(seen) and 0 < seen[-1] <= 20  # written as it went, in order
    assert stats["log"]["writes"] >= 2 and stats["log"]["error"] is None
    entry = replay_log(tmp_path).entries["p00-000"]
    assert entry["state"].tokens.tolist() == list(range(21)) and entry["finished"] == ("eos", 3.0)


def test_a_reader_that_a_compaction_overtakes_reads_the_new_generation(tmp_path, monkeypatch):
    """A reader (``laminar audit`` of a running run) reads the root's pointer, then the
    generation it names; the writer compacting in between removes that generation. The
    reader reads again, from the new one, rather than failing or reading the holes."""
    import zarr

    core, writer = PartialCore(journal=True), PartialLogWriter(tmp_path)
    for b in range(3):
        ids = [f"p{b:02d}-{i:03d}" for i in range(2)]
        core.register("r0", b, _states(ids, seed=b))
        for rid in ids:
            core.flush("r0", {rid: (0, list(range(8)), [0.0] * 8, [b] * 8)})
        if b < 2:
            core.hold(ids)
            core.forget(ids)
        writer.append(**core.drain_journal())
    before = _view(replay_log(tmp_path))
    real_open, compacted = zarr.open_group, []

    def open_then_compact(*args, **kwargs):
        root = real_open(*args, **kwargs)
        if kwargs.get("mode") == "r" and not compacted:
            compacted.append(True)
            writer.compact(**core.snapshot())  # (after the reader read the pointer)
        return root

    monkeypatch.setattr(zarr, "open_group", open_then_compact)
    after = _view(replay_log(tmp_path))
    assert compacted and writer.generation == 1
    assert after == before == _view(core)


def test_a_generation_missing_an_array_is_named_as_damaged(tmp_path):
    core, writer = PartialCore(journal=True), PartialLogWriter(tmp_path)
    core.register("r0", 0, _states(["p00-000"], seed=0))
    writer.append(**core.drain_journal())
    shutil.rmtree(writer.path / "g0" / "requests" / "owner")
    with pytest.raises(StoreError, match=r"partial.zarr.*g0.*damaged.*move it aside"):
        read_partial_log(tmp_path)


def test_a_missing_chunk_is_named_as_damaged_not_read_as_zeros(tmp_path):
    """zarr reads a chunk file that is not there as its fill value: a log that lost its
    tokens' chunk (a copy cut short) would restore a response after tokens 0, as if
    generated. Every chunk is written (those of fill values too: a request's
    ``n_moves`` 0), so any one missing is damage, named with its array and file."""
    core, writer = PartialCore(journal=True), PartialLogWriter(tmp_path)
    core.register("r0", 0, _states(["p00-000"], seed=0))
    core.flush("r0", {"p00-000": (0, [5, 6], [-0.5, -0.25], [0, 0])})
    writer.append(**core.drain_journal())
    g0 = writer.path / "g0"
    for name in ("tokens", "token_versions", "requests/n_moves"):
        chunk = g0 / name / "c" / "0"
        saved = chunk.read_bytes()
        chunk.unlink()
        with pytest.raises(StoreError, match=rf"'{name}'.*lacks chunk.*c/0.*move it aside"):
            read_partial_log(tmp_path)
        chunk.write_bytes(saved)
    assert read_partial_log(tmp_path)["tokens"].tolist() == [5, 6]
    # a log written before every chunk was (a chunk of fill values left out) still reads,
    # and a chunk that cannot be all fill values is checked there too
    import zarr

    zarr.open_group(str(g0), mode="a", zarr_format=3).attrs.pop("every_chunk_written")
    (g0 / "token_versions" / "c" / "0").unlink()
    assert read_partial_log(tmp_path)["token_versions"].tolist() == [0, 0]
    (g0 / "tokens" / "c" / "0").unlink()
    with pytest.raises(StoreError, match=r"'tokens'.*lacks chunk"):
        replay_log(tmp_path)


def test_a_chunk_whose_bytes_changed_is_named_as_damaged_not_replayed(tmp_path):
    """A crash can leave a chunk file whose bytes never reached the disk (zeros), or a
    byte can change: uncompressed, the log read them back as tokens, and a resume went
    on after them as if generated. Each chunk carries a CRC32C, checked at read."""
    core, writer = PartialCore(journal=True), PartialLogWriter(tmp_path)
    core.register("r0", 0, _states(["p00-000"], seed=0))
    core.flush("r0", {"p00-000": (0, [5, 6], [-0.5, -0.25], [0, 0])})
    writer.append(**core.drain_journal())
    chunk = writer.path / "g0" / "tokens" / "c" / "0"
    saved = chunk.read_bytes()
    flipped = bytearray(saved)
    flipped[1] ^= 0x04  # (token 5 would read as 1029)
    for damaged in (bytes(flipped), bytes(len(saved))):
        chunk.write_bytes(damaged)
        with pytest.raises(StoreError, match=r"partial.zarr/g0/tokens.*checksum.*move it aside"):
            replay_log(tmp_path)
    chunk.write_bytes(saved)
    assert read_partial_log(tmp_path)["tokens"].tolist() == [5, 6]


def test_a_run_resumed_and_stopped_again_before_it_reissued_a_group_reissues_it_again(
    tmp_path,
):
    """A group nothing of which is stored was generating when the run ended: only the log
    names it, and the resume plan re-issues it whole. The resumed run's pool starts its
    log over, keeping those groups' entries until a rollout registers them again (none
    does before the trainer has loaded its checkpoint): a run stopped again in between
    re-issues them too. Registered again, they are logged as the new run's; stored, the
    log forgets them, also across a compaction."""
    import asyncio

    from factories import trajectory

    from laminar.partial import PartialResponsePool
    from storage import TrajectoryWriter
    from storage.resume import plan_resume

    def requests(g: int) -> list[RequestState]:
        group = PromptGroup(f"p{g:08d}", g + 5, (1, 2), "x", 2, 0)
        return [
            RequestState(
                GenerationRequest(
                    f"p{g:08d}-{k}", (1, 2), PARAMS, {"group": group, "sample_idx": k}
                ),
                seed=k,
            )
            for k in range(2)
        ]

    def stored(g: int) -> list[dict]:
        return [
            trajectory(f"p{g:08d}-{k}", f"p{g:08d}", sample_idx=k, prompt_key=g + 5).to_record()
            | {"status": "consumed", "sample_version": 0, "finish_version": 0}
            for k in range(2)
        ]

    store = TrajectoryWriter(tmp_path)
    store.append(stored(2))
    core = PartialCore(journal=True)
    for g in (1, 3):
        core.register("r0", 1, requests(g))
    core.flush("r0", {"p00000001-0": (0, [3], [-0.1], [1])})
    PartialLogWriter(tmp_path).append(**core.drain_journal())
    first = plan_resume(tmp_path, version=1)
    assert first.reissue == {"p00000001": (6, 2, (0, 1)), "p00000003": (8, 2, (0, 1))}
    assert first.start == 4

    # The resumed run's data module starts, and the run is lost before a rollout takes
    # anything: its resume re-issues the same groups.
    PartialResponsePool(run_dir=str(tmp_path), reissue=sorted(first.reissue))
    again = plan_resume(tmp_path, version=1)
    assert (again.reissue, again.start) == (first.reissue, first.start)
    assert {e["owner"] for e in log_entries(tmp_path).values()} == {""}  # (nobody's)

    async def resumed_run() -> PartialResponsePool:
        pool = PartialResponsePool(run_dir=str(tmp_path), reissue=sorted(again.reissue))
        await pool.register("r1", 1, requests(1))  # a rollout takes p00000001 again
        await pool.close()
        return pool

    pool = asyncio.run(resumed_run())
    entries = log_entries(tmp_path)
    assert {rid: e["owner"] for rid, e in entries.items()} == {
        "p00000001-0": "r1",
        "p00000001-1": "r1",
        "p00000003-0": "",
        "p00000003-1": "",
    }
    assert entries["p00000001-0"]["tokens"] == 0  # (the new run's, generated anew)
    store.append(stored(1))
    pool.core.forget(["p00000001-0", "p00000001-1"])
    pool.writer.compact(**pool.core.snapshot())
    third = plan_resume(tmp_path, version=1)
    assert third.reissue == {"p00000003": (8, 2, (0, 1))} and third.start == 4
    assert sorted(log_entries(tmp_path)) == ["p00000003-0", "p00000003-1"]


def test_a_commit_switches_generation_and_counts_in_one_write(tmp_path, monkeypatch):
    """A compaction's commit names the new generation and its row counts: written key by
    key (attrs.update), a reader could see the new generation with the old one's counts."""
    from test_storage import group_metadata_writes

    core, writer = PartialCore(journal=True), PartialLogWriter(tmp_path)
    core.register("r0", 2, _states(["p00-000", "p00-001"], seed=0))
    writes = group_metadata_writes(monkeypatch)
    writer.compact(**core.snapshot())
    root = [w for w in writes if "schema_version" in w]  # (not the new generation's groups)
    assert root and all(w["generation"] == 1 for w in root)
    assert all(w["committed"] == writer.committed for w in root)
    assert writer.committed["request"] == 2


def _filled(run) -> tuple[PartialCore, PartialLogWriter]:
    """A pool's core and log writer: two batches logged, the first forgotten since."""
    core, writer = PartialCore(journal=True), PartialLogWriter(run)
    for b in range(2):
        ids = [f"p{b:02d}-{i:03d}" for i in range(3)]
        core.register("r0", b, _states(ids, seed=b))
        for rid in ids:
            core.flush("r0", {rid: (0, [b, 7, 8], [-0.5] * 3, [b] * 3)})
        writer.append(**core.drain_journal())
    core.hold([f"p00-{i:03d}" for i in range(3)])
    core.forget([f"p00-{i:03d}" for i in range(3)])
    writer.append(**core.drain_journal())
    return core, writer


class _Killed(BaseException):
    """The writer's process dies here."""


def test_a_compaction_cut_short_at_any_step_leaves_a_log_that_replays(tmp_path, monkeypatch):
    """A compaction writes its batches into a new generation, points the root at it,
    then removes the old one. A writer that dies before the commit leaves the old
    generation, which the next writer appends to (and later compacts over the half-made
    one); one that dies after it leaves the compacted log, and the next writer removes
    the old generation it left."""
    import storage.partial_log as partial_log

    core, writer = _filled(tmp_path)
    view = _view(core)
    monkeypatch.setattr(partial, "COMPACT_BATCH", 2)

    def dies_after_a_batch(records):
        batches = iter(journal_rows(records[i : i + 2]) for i in range(0, len(records), 2))
        yield next(batches)
        raise _Killed

    with pytest.raises(_Killed):
        writer.rewrite(dies_after_a_batch(core.snapshot_records()))
    assert (writer.path / "g1").exists()  # (half-made)
    assert _view(replay_log(tmp_path)) == view
    writer = PartialLogWriter(tmp_path)  # the pool restarted on the log
    core.flush("r0", {"p01-000": (3, [9], [-0.5], [1])})
    writer.append(**core.drain_journal())
    assert _view(replay_log(tmp_path)) == _view(core) != view

    rmtree = partial_log.shutil.rmtree

    def dies_before_removing_g0(path, **kwargs):
        if path.name == "g0":
            raise _Killed
        rmtree(path, **kwargs)

    monkeypatch.setattr(partial_log.shutil, "rmtree", dies_before_removing_g0)
    with pytest.raises(_Killed):
        write_records(writer, core.snapshot_records(), compact=True)
    monkeypatch.undo()
    assert writer.generation == 1 and (writer.path / "g0").exists()
    assert _view(replay_log(tmp_path)) == _view(core)
    writer = PartialLogWriter(tmp_path)
    assert not (writer.path / "g0").exists()
    assert writer.tokens() == 3 * 3 + 1 and _view(replay_log(tmp_path)) == _view(core)


def test_a_failed_write_makes_the_next_one_a_compaction(tmp_path, monkeypatch):
    """A write that fails loses its rows, and a compaction that fails leaves the log as
    it was, its writer on the old generation: either way the next write compacts, and the
    log replays to the pool's entries again."""
    import asyncio

    from laminar.partial import PartialResponsePool

    def failing(*args, **kwargs):
        raise OSError("no space left on device")

    async def run() -> PartialResponsePool:
        pool = PartialResponsePool(run_dir=str(tmp_path), log_interval_s=1e6)
        pool.core, pool.writer = _filled(tmp_path)
        logged, g = _view(replay_log(tmp_path)), pool.writer.generation
        pool.core.flush("r0", {"p01-000": (3, [9], [-0.5], [1])})
        with monkeypatch.context() as m:
            m.setattr(pool.writer, "_write_all", failing)
            await pool._write_log()  # (an append)
            assert pool.log_counts["writes"] == 0 and pool._resync
            await pool._write_log()  # (the compaction, cut short after its first batch)
        assert pool.writer.generation == g and pool.log_counts["compactions"] == 0
        assert _view(replay_log(tmp_path)) == logged != _view(pool.core)
        await pool._write_log()
        assert pool.writer.generation == g + 1 and pool.log_counts["compactions"] == 1
        await pool.close()
        return pool

    pool = asyncio.run(run())
    assert _view(replay_log(tmp_path)) == _view(pool.core)
    assert "no space left" in asyncio.run(pool.stats())["log"]["error"]


def test_the_pool_goes_on_while_its_log_is_compacted(tmp_path, monkeypatch):
    """A compaction takes its snapshot of the entries on the event loop, with no token
    copied, and writes it from the pool's thread: a flush goes through meanwhile, even
    one that rewrites tokens the compaction has yet to write (it writes the ones of its
    snapshot), and follows the compaction into the log at once."""
    import asyncio
    import threading

    from laminar.partial import PartialResponsePool

    monkeypatch.setattr(partial, "COMPACT_RATIO", 0)
    monkeypatch.setattr(partial, "COMPACT_MIN_TOKENS", 0)

    async def run() -> tuple[dict, list, PartialResponsePool]:
        pool = PartialResponsePool(run_dir=str(tmp_path), log_interval_s=1e6)
        await pool.register("r0", 1, _states(["p00-000", "p00-001"], seed=0))
        await pool.flush("r0", {"p00-000": (0, [5, 6, 7], [-0.5] * 3, [1] * 3)})
        await pool._write_log()  # (appended: the log had no token)
        snapshot = _view(pool.core)
        writing, go, written = threading.Event(), threading.Event(), []
        rewrite = pool.writer.rewrite

        def slow_rewrite(batches) -> None:
            writing.set()
            assert go.wait(10)
            rewrite(batches)
            written.append(_view(replay_log(tmp_path)))

        monkeypatch.setattr(pool.writer, "rewrite", slow_rewrite)
        compaction = asyncio.ensure_future(pool._write_log())
        assert await asyncio.to_thread(writing.wait, 10)
        await pool.flush(
            "r1",
            {"p00-000": (1, [8], [-0.25], [2]), "p00-001": (0, [9], [-0.5], [1])},
            {"p00-001": ("eos", 2.0)},
        )
        go.set()
        await compaction
        return snapshot, written, pool

    snapshot, written, pool = asyncio.run(run())
    assert written == [snapshot]
    assert pool.log_counts["compactions"] == 1 and pool.log_counts["writes"] == 3
    assert pool.core.entries["p00-000"]["state"].tokens.tolist() == [5, 8]
    assert _view(replay_log(tmp_path)) == _view(pool.core)  # (not at the next write only)


def test_a_log_of_long_prompts_and_short_responses_is_compacted(tmp_path, monkeypatch):
    """Compaction weighed the journal's response tokens alone against the live entries':
    with long prompts and one-token responses the log grew by the prompt of every request
    ever registered and was never compacted (helper's note, left alone before). It now
    weighs prompts too: the finished, forgotten requests' prompts go at a compaction."""
    import asyncio

    from laminar.partial import PartialResponsePool

    monkeypatch.setattr(partial, "COMPACT_MIN_TOKENS", 2000)
    prompt = tuple(range(1, 201))  # (200 tokens a request)

    async def run() -> PartialResponsePool:
        pool = PartialResponsePool(run_dir=str(tmp_path), log_interval_s=1e6)
        for b in range(12):
            ids = [f"p{b:02d}-{i:03d}" for i in range(4)]
            await pool.register("r0", b, _states(ids, seed=b, prompt=prompt))
            await pool.flush("r0", {rid: (0, [5], [-0.5], [b]) for rid in ids},
                             {rid: ("eos", 1.0) for rid in ids})  # fmt: skip
            await pool.hold(ids)
            await pool.forget(ids)
            await pool._write_log()
        await pool.close()
        return pool

    pool = asyncio.run(run())
    # 48 requests: 9,600 prompt tokens and 48 response tokens logged, none live at the end
    assert pool.log_counts["compactions"] >= 1
    assert pool.writer.all_tokens() < 2000 + 4 * 201
