"""``laminar bench relay``: publication stall, chain broadcast and rollout wait of the relay
tier against the model of the paper's Appendix D and against two baselines, in one run.

For each weight size ``M`` and chain length ``p`` (relays in separate worker processes,
the master in the publisher's process as in a run):

* **relay** — the publisher copies a synthetic state dict into the master relay (the
  *stall*), the chain carries it to every relay (*broadcast*: until the last relay holds
  it, verified), then a rollout process pulls it from the tail relay (*rollout wait*)
  and the bench checks that what it pulled is the published state, bit for bit (its
  xxh3-64 fingerprint), or fails.
* **naive** — the publisher sends the state to each of the ``p − 1`` other processes
  itself and returns when all hold it (the trainer as the fan-out point).
* **dask** — ``Client.scatter(..., broadcast=True)`` to the same workers, and
  ``Client.replicate`` of one copy to all of them.

``T_byte``/``T_start`` are measured on the running cluster (one hop, alone), and the
model's ``T*(p)`` (its optimal ``k``) and ``T(p, k)`` (the ``k`` the chain ran) are
reported beside the measured broadcast. Run it::

    laminar bench relay --out relay.json
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from laminar.relay_client import Publisher, Puller
from laminar.relay_core import MB, RelayError, chain_time, model_optimum, state_fingerprint
from laminar.relay_tier import start_chain

N_TENSORS = 8


def synthetic_state(nbytes: int, version: int = 0) -> dict[str, torch.Tensor]:
    """``N_TENSORS`` float32 tensors totalling ``nbytes``, every element equal to
    ``version`` (so a reader can check a whole snapshot cheaply and exactly)."""
    per = max(1, nbytes // 4 // N_TENSORS)
    return {f"layer{i}.weight": torch.full((per,), float(version)) for i in range(N_TENSORS)}


class RelayDriver:
    """Dask actor on the master relay's worker: publishes as the trainer does (in-process,
    through :class:`laminar.relay_client.Publisher`) and runs the naive fan-out baseline."""

    def __init__(self, master, nbytes: int, timeout_s: float = 120.0) -> None:
        torch.set_num_threads(1)
        self.publisher = Publisher(master, timeout_s)
        self.state = synthetic_state(nbytes)
        self.timeout_s = timeout_s

    def is_local(self) -> bool:
        return self.publisher.local is not None

    def host_copy(self, repeats: int = 3) -> float:
        """One host copy of the state into a warm buffer, in this process (the stall's
        floor under the same conditions), median of ``repeats``."""
        if not hasattr(self, "_dst"):
            self._dst = {k: torch.empty_like(v) for k, v in self.state.items()}
            for k, v in self.state.items():
                self._dst[k].copy_(v)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for k, v in self.state.items():
                self._dst[k].copy_(v)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def publish(self, version: int, fill: bool = False) -> float:
        """Publish ``version``; with ``fill`` every element becomes ``version`` first."""
        if fill:
            for t in self.state.values():
                t.fill_(float(version))
        else:  # a marker suffices for timing; the relay copies all bytes either way
            next(iter(self.state.values()))[0] = float(version)
        return self.publisher.publish(version, self.state)

    def fingerprint(self) -> int:
        """xxh3-64 of the state as last published (:func:`state_fingerprint`)."""
        return state_fingerprint(self.state)

    def fan_out(self, sinks: list) -> float:
        """Send the state to every sink actor ourselves; seconds until all hold it."""
        t0 = time.perf_counter()
        futures = [s.receive(self.state) for s in sinks]
        for f in futures:
            f.result(timeout=self.timeout_s)
        return time.perf_counter() - t0


class Sink:
    """Dask actor: a rollout-like process. Receives pushed weights (naive baseline) or
    pulls them from a relay (rollout wait), and checks what it got."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.puller: Puller | None = None

    def receive(self, state: dict) -> int:
        return sum(t.numel() for t in state.values())

    def pull(self, relay, have_version: int, timeout_s: float = 120.0) -> dict | None:
        """Pull the newest version newer than ``have_version`` from ``relay``; returns its
        version, the wait and whether every element equals the version (filled states)."""
        if self.puller is None or self.puller.relay.key != relay.key:
            self.puller = Puller(relay, timeout_s)
        t0 = time.perf_counter()
        got = self.puller.newest(have_version)
        wait = time.perf_counter() - t0
        if got is None:
            return None
        version, state = got
        uniform = all(bool((t == t.flatten()[0]).all()) for t in state.values())
        values = {float(t.flatten()[0]) for t in state.values() if t.numel()}
        return {
            "version": version,
            "wait_s": wait,
            "consistent": uniform and len(values) <= 1,
            "value": values.pop() if values else math.nan,
            "fingerprint": state_fingerprint(state),
        }

    def fetch(self, relay, version: int, checkpoints_dir: str | None = None) -> dict:
        """An old ``version`` as recovery asks for it (kept by ``relay``, else from
        ``checkpoints_dir``): its value if every element agrees, else NaN."""
        from laminar.relay_client import fetch_version

        puller = Puller(relay, 60.0)
        state = fetch_version(version, puller, checkpoints_dir)
        values = {float(v) for t in state.values() for v in t.unique().tolist()}
        return {"value": values.pop() if len(values) == 1 else math.nan}


def check_pull(pull: dict | None, version: int, fingerprint: int, where: str) -> None:
    """The bench's proof that the chain carried the weights: the rollout pulled
    ``version`` from the tail relay, bit for bit the published state (its fingerprint).
    Otherwise it raises :class:`RelayError` (the bench's figures would time a broken
    transfer).

    >>> check_pull({"version": 2, "fingerprint": 7}, 2, 7, "M=1 MB p=2")  # whole: silent
    """
    if pull is None or pull["version"] != version:
        got = None if pull is None else pull["version"]
        raise RelayError(
            f"{where}: the rollout pulled version {got!r} from the tail relay, which held "
            f"version {version} (the newest published) complete"
        )
    if pull["fingerprint"] != fingerprint:
        raise RelayError(
            f"{where}: version {version} as the rollout pulled it from the tail relay "
            f"differs from the published weights (fingerprint {pull['fingerprint']:#x}, "
            f"published {fingerprint:#x})"
        )


def relay_cluster(p: int, sinks: int, memory_limit: str = "6GiB", protocol: str = "tcp"):
    """A local cluster: ``p`` relay workers (the first hosts the master and the driver)
    and ``sinks`` rollout-like workers, every connection over ``protocol``."""
    from laminar.cluster import role_cluster

    workers = {f"relay-{i}": {"relay": 1} for i in range(p)}
    workers |= {f"sink-{i}": {"rollout": 1} for i in range(sinks)}
    return role_cluster(
        workers, memory_limit=memory_limit, name="laminar-relay-bench", protocol=protocol
    )


def wait_broadcast(master, version: int, timeout_s: float) -> dict:
    """Poll the master until every relay reported ``version``; its publication record."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        recs = [r for r in master.stats().result()["publications"] if r["version"] == version]
        if recs and not math.isnan(recs[0]["broadcast_s"]):
            return recs[0]
        time.sleep(0.01)
    raise TimeoutError(f"version {version} did not reach every relay within {timeout_s} s")


def measure(
    p: int,
    nbytes: int,
    repeats: int,
    timeout_s: float = 300.0,
    max_chunk_mb: float = 8.0,
    protocol: str = "tcp",
    sender: str = "thread",
) -> dict:
    """Every figure for one (p, M) on a fresh cluster (medians over ``repeats``)."""
    from distributed import Client

    from laminar.cluster import scheduler_workers, submit_actor
    from laminar.config import RelayConfig

    cfg = RelayConfig(
        keep_versions=1, timeout_s=timeout_s, max_chunk_mb=max_chunk_mb, sender=sender
    )
    # The master's process holds the publisher's state, its host-copy target, the master's
    # slots and the fan-out's sends: about 5 M at once. Below 6 M, Dask's nanny would kill
    # it at 2 GB.
    memory_limit = f"{max(6, math.ceil(6 * nbytes / 2**30))}GiB"
    with (
        relay_cluster(p, sinks=1, memory_limit=memory_limit, protocol=protocol) as cluster,
        Client(cluster) as client,
    ):
        info = scheduler_workers(client)
        relay_ws = sorted(a for a, w in info.items() if w["resources"].get("relay"))
        sink_w = next(a for a, w in info.items() if w["resources"].get("rollout"))
        relays, _ = start_chain(client, [(w, "relay") for w in relay_ws], cfg)
        calib = relays[0].calibrate().result()
        driver = submit_actor(
            client, RelayDriver, relays[0], nbytes, timeout_s, worker=relay_ws[0], resource="relay"
        )
        assert driver.is_local().result(), "the driver must share the master's process"
        sink = submit_actor(client, Sink, worker=sink_w, resource="rollout")
        # Naive fan-out: one sink per non-master relay worker (the rollouts of those hosts).
        fan_sinks = [submit_actor(client, Sink, worker=w, resource="relay") for w in relay_ws[1:]]
        # T_byte with every link of the chain busy at once: what each hop gets when the
        # p - 1 hops share this machine's cores (the model assumes independent links).
        loaded = []
        if p > 2:
            futures = [r.calibrate() for r in relays[:-1]]
            loaded = [f.result() for f in futures]
        t_byte_loaded = (
            float(np.median([c["measured_t_byte"] for c in loaded]))
            if loaded
            else calib["measured_t_byte"]
        )
        rows = []
        for v in range(1, repeats + 2):  # the first version warms the slots up
            copy = driver.host_copy().result()
            stall = driver.publish(v).result()
            rec = wait_broadcast(relays[0], v, timeout_s)
            pull = sink.pull(relays[-1], v - 1, timeout_s).result()
            check_pull(pull, v, driver.fingerprint().result(), f"M={nbytes / MB:g} MB p={p}")
            naive = driver.fan_out(fan_sinks).result()
            rows.append(
                {
                    "stall_s": stall,
                    "host_copy_s": copy,
                    "broadcast_s": rec["broadcast_s"],
                    "chunks": rec["chunks"],
                    "wait_s": pull["wait_s"],
                    "naive_s": naive,
                }
            )
            if v == 1:  # (every relay holds the warm-up version: its sends are over)
                warm = [r.stats().result() for r in relays[:-1]]
        rows = rows[1:]
        # Seconds per chunk sent (the call, until the successor took it) over the measured
        # publications: the master's, and the median inner relay's (one that receives
        # and sends at once), beside the one-hop model's chunk time.
        sent = [r.stats().result() for r in relays[:-1]]
        per_chunk = [
            (st["forward_s"] - w["forward_s"])
            / max(1, st["forwarded_chunks"] - w["forwarded_chunks"])
            for st, w in zip(sent, warm, strict=True)
        ]
        data = np.ones(nbytes, np.uint8)
        scatter, replicate = [], []
        targets = relay_ws[1:]
        for _ in range(repeats):
            t0 = time.perf_counter()
            fut = client.scatter(data, workers=targets, broadcast=True, hash=False)
            scatter.append(time.perf_counter() - t0)
            del fut
            one = client.scatter(data, workers=[relay_ws[0]], hash=False)
            t0 = time.perf_counter()
            client.replicate(one, n=len(relay_ws), workers=relay_ws)
            replicate.append(time.perf_counter() - t0)
            del one
        t_byte, t_start = calib["measured_t_byte"], calib["measured_t_start"]
        med = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
        return {
            "p": p,
            "mb": nbytes / MB,
            **med,
            "scatter_s": float(np.median(scatter)),
            "replicate_s": float(np.median(replicate)),
            "t_byte": t_byte,
            "t_start": t_start,
            "model_s": model_optimum(p, nbytes, t_byte, t_start),
            # The model at the k the chain ran: the chunk cap (relay.max_chunk_mb) raises
            # k above k* (512 MB: k = 64 at every p, where k* = 1 at p = 2), and T*(p)
            # then compares the chain with a plan it did not run.
            "model_at_k_s": chain_time(p, med["chunks"], nbytes, t_byte, t_start),
            "t_byte_loaded": t_byte_loaded,
            "model_loaded_s": model_optimum(p, nbytes, t_byte_loaded, t_start),
            "chunk_model_s": nbytes / med["chunks"] * t_byte + t_start,
            "send_master_s": per_chunk[0],
            "send_inner_s": float(np.median(per_chunk[1:])) if p > 2 else math.nan,
            # the raw measurements the medians are of: each publication's (the warm-up's
            # left out), the baselines', and each sending relay's seconds per chunk
            "samples": {
                "publications": rows,
                "scatter_s": scatter,
                "replicate_s": replicate,
                "send_per_chunk_s": per_chunk,
            },
        }


COLUMNS = [
    "stall_s",
    "host_copy_s",
    "broadcast_s",
    "model_s",
    "model_at_k_s",
    "model_loaded_s",
    "wait_s",
    "naive_s",
    "scatter_s",
    "replicate_s",
    "chunks",
    "chunk_model_s",
    "send_master_s",
    "send_inner_s",
]


PROTOCOLS = ("tcp", "ucx")


def relay_ratios(
    figures: dict[str, float],
    sizes_mb: tuple[int, ...],
    ps: tuple[int, ...],
    protocols: tuple[str, ...],
    senders: tuple[str, ...],
) -> tuple[dict[str, float], list[str]]:
    """The ratios of one relay bench's ``figures`` (each protocol's within itself; a
    protocol other than tcp's prefixed with its name), ``<proto>_vs_tcp_*`` where tcp
    was measured, and the headline ratios, named after the chain lengths they compare
    (the longest over the shortest: ``p8``/``p2`` by default). Returns them and the notes
    on the ratios left out."""
    ratios: dict[str, float] = {}
    notes: list[str] = []
    lo, hi = min(ps), max(ps)
    for proto in protocols:
        pre = "" if proto == "tcp" else f"{proto}_"
        for mb in sizes_mb:
            f = {k.removeprefix(pre): v for k, v in figures.items() if k.startswith(f"{pre}m{mb}_")}
            if lo != hi:
                for c in ("stall_s", "naive_s"):
                    name = f"{pre}m{mb}_{c.removesuffix('_s')}_p{hi}_vs_p{lo}"
                    ratios[name] = f[f"m{mb}_p{hi}_{c}"] / f[f"m{mb}_p{lo}_{c}"]
            for p in ps:
                k = f"m{mb}_p{p}_"
                ratios[pre + k + "stall_vs_host_copy"] = f[k + "stall_s"] / f[k + "host_copy_s"]
                ratios[pre + k + "broadcast_vs_model"] = f[k + "broadcast_s"] / f[k + "model_s"]
                if k + "model_at_k_s" in f:  # (not in figures of benches before it)
                    ratios[pre + k + "broadcast_vs_model_at_k"] = (
                        f[k + "broadcast_s"] / f[k + "model_at_k_s"]
                    )
                ratios[pre + k + "broadcast_vs_model_loaded"] = (
                    f[k + "broadcast_s"] / f[k + "model_loaded_s"]
                )
                ratios[pre + k + "naive_vs_relay_stall"] = f[k + "naive_s"] / f[k + "stall_s"]
                if proto != "tcp" and "tcp" in protocols:
                    for c in ("broadcast_s", "wait_s", "t_byte", "t_start"):
                        name = f"{proto}_vs_tcp_m{mb}_p{p}_{c.removesuffix('_s')}"
                        ratios[name] = f[k + c] / figures[k + c]
                if "loop" in senders and "thread" in senders:
                    for c in ("broadcast_s", "stall_s", "wait_s"):
                        name = f"{pre}loop_vs_thread_m{mb}_p{p}_{c.removesuffix('_s')}"
                        ratios[name] = figures[f"{pre}loop_{k}{c}"] / f[k + c]
    if "tcp" not in protocols:
        notes.append(
            f"no <protocol>_vs_tcp ratios: tcp was not measured (--protocols "
            f"{','.join(protocols)}); add tcp to compare with it"
        )
    # The headline ratios, at the largest M, the longest chain against the shortest (p8
    # and p2 by default), of tcp: named after the chain lengths they compare.
    m = max(sizes_mb)
    headline = {
        f"stall_p{hi}_vs_p{lo}": f"m{m}_stall_p{hi}_vs_p{lo}",
        "stall_vs_host_copy": f"m{m}_p{hi}_stall_vs_host_copy",
        f"broadcast_vs_model_p{hi}": f"m{m}_p{hi}_broadcast_vs_model",
        f"broadcast_vs_model_at_k_p{hi}": f"m{m}_p{hi}_broadcast_vs_model_at_k",
        f"broadcast_vs_model_loaded_p{hi}": f"m{m}_p{hi}_broadcast_vs_model_loaded",
        f"naive_stall_p{hi}_vs_relay_stall_p{hi}": f"m{m}_p{hi}_naive_vs_relay_stall",
        f"broadcast_loop_vs_thread_p{hi}": f"loop_vs_thread_m{m}_p{hi}_broadcast",
    }
    for name, key in headline.items():
        if key in ratios:
            ratios[name] = ratios[key]
    return ratios, notes


def bench_relay(
    sizes_mb: tuple[int, ...] = (64, 512),
    ps: tuple[int, ...] = (2, 4, 8),
    repeats: int = 5,
    protocols: tuple[str, ...] = ("tcp",),
    senders: tuple[str, ...] = ("thread",),
):
    """The relay bench; see the module docstring. Each (M, p) on a fresh cluster, once per
    protocol and sender (``relay.sender``). Figures of a protocol other than tcp are
    prefixed with its name, and ``<proto>_vs_tcp_*`` ratios compare them; figures of the
    ``loop`` sender are prefixed ``loop_``, and ``loop_vs_thread_*`` ratios compare it
    with the default, measured in the same run."""
    from laminar.errors import ConfigError
    from pipelines.bench import BenchResult

    bad = [s for s in senders if s not in ("thread", "loop")]
    if bad or not senders:
        raise ConfigError(
            f"laminar bench relay: --senders {','.join(senders)}: each must be thread or loop"
        )
    if not ps or min(ps) < 2:
        raise ConfigError(
            f"laminar bench relay: --relays {','.join(map(str, ps))}: give chain lengths of "
            "2 or more (a chain of one relay has no hop to measure)"
        )
    unknown = [p for p in protocols if p not in PROTOCOLS]
    if unknown or not protocols:
        raise ConfigError(
            f"laminar bench relay: --protocols {','.join(protocols)}: each must be one of "
            + ", ".join(PROTOCOLS)
        )
    figures: dict[str, float] = {}
    samples: dict[str, dict] = {}  # per (M, p): the publications' rows, the baselines'
    rows = []
    variants = [(proto, sender) for proto in protocols for sender in senders]
    for proto, sender in variants:
        # The loop sender's figures are prefixed when both ran; alone, they are the figures.
        beside = sender == "loop" and "thread" in senders
        pre = ("" if proto == "tcp" else f"{proto}_") + ("loop_" if beside else "")
        for mb in sizes_mb:
            for p in ps:
                row = measure(p, mb * MB, repeats, protocol=proto, sender=sender)
                for c in COLUMNS + ["t_byte", "t_start", "t_byte_loaded"]:
                    figures[f"{pre}m{mb}_p{p}_{c}"] = row[c]
                samples[f"{pre}m{mb}_p{p}"] = row["samples"]
                rows.append([proto, sender, mb, p] + [row[c] for c in COLUMNS])
                print(
                    f"  {proto} {sender} M={mb} MB p={p}: "
                    + ", ".join(f"{c} {row[c]:.4g}" for c in COLUMNS),
                    flush=True,
                )
    ratios, notes = relay_ratios(figures, sizes_mb, ps, protocols, senders)
    return BenchResult(
        name="relay",
        figures=figures,
        ratios=ratios,
        samples=samples,
        columns=["protocol", "sender", "M (MB)", "p"] + COLUMNS,
        rows=rows,
        options={
            "sizes_mb": list(sizes_mb),
            "ps": list(ps),
            "repeats": repeats,
            "protocols": list(protocols),
            "senders": list(senders),
        },
        notes=notes
        + [
            "stall: publish() returns once the master (in the publisher's process) holds "
            "a copy; broadcast: until the last relay holds the version, verified",
            "model_s: T*(p) from T_byte/T_start measured on one hop alone (the paper's "
            "independent links), at the model's optimal k; model_at_k_s: T(p,k) = "
            "(p+k-2)*chunk_model_s at the k the chain ran (chunks: relay.max_chunk_mb "
            "raises it above the optimum); model_loaded_s: T*(p) with T_byte measured "
            "while every hop of the chain transfers at once (on one host they share the "
            "cores)",
            "host_copy_s: one copy of M into a warm buffer in the publisher's process, "
            "measured right before each publication",
        ],
    )
