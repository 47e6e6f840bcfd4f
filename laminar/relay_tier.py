"""The relay tier's placement (:mod:`laminar.relay`): where a run's relays go, how they
are chained, and which relay each rollout pulls from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from laminar.relay import Relay

if TYPE_CHECKING:
    from laminar.config import RelayConfig, RunConfig


@dataclass
class RelayTier:
    """The chain of one run: the master (in the trainer's process) first, then the
    downstream relays, and which relay each rollout pulls from."""

    relays: list  # actor handles, master first
    ids: list[str]
    workers: list[str]
    calibration: dict

    @property
    def master(self):
        return self.relays[0]

    def handle(self, relay_id: str):
        """The handle of relay ``relay_id``."""
        return self.relays[self.ids.index(relay_id)]

    def local_relay(self, rollout_worker: str, taken: dict[int, int], lost=()) -> int:
        """The index of the relay a rollout on ``rollout_worker`` pulls from: a
        downstream relay on its host if there is one (the least used), else the master if
        it shares the host, else the least used relay anywhere; never one of ``lost``
        (ids). ``taken`` counts the rollouts each relay serves."""
        host = _host(rollout_worker)
        live = [i for i in range(len(self.relays)) if self.ids[i] not in set(lost)]
        down = [i for i in live if i > 0 and _host(self.workers[i]) == host]
        cands = down or ([0] if _host(self.workers[0]) == host else live)
        i = min(cands, key=lambda i: (taken.get(i, 0), i))
        taken[i] = taken.get(i, 0) + 1
        return i


def _host(address: str) -> str:
    from urllib.parse import urlparse

    return urlparse(address).hostname or address


def start_chain(
    client, placement: list[tuple[str, str]], cfg: RelayConfig
) -> tuple[list, list[str]]:
    """A :class:`Relay` on each ``(worker, resource)`` of ``placement``, the first being
    the master, chained in that order. Returns the handles and their ids."""
    from laminar.cluster import submit_actor

    ids = ["master"] + [f"relay{i}" for i in range(1, len(placement))]
    relays = [
        submit_actor(client, Relay, rid, cfg, worker=w, resource=res)
        for rid, (w, res) in zip(ids, placement, strict=True)
    ]
    for i, r in enumerate(relays):
        nxt = relays[i + 1] if i + 1 < len(relays) else None
        r.set_chain(ids, nxt, None if i == 0 else relays[0]).result(timeout=cfg.timeout_s)
    return relays, ids


def build_tier(
    client, cfg: RunConfig, trainer_worker: str, rollout_workers: list[str]
) -> RelayTier:
    """Create the relays of a run, chain them and measure the first link.

    The master goes on the trainer's worker (publication is then one host copy in that
    process). ``relay.relays = None`` puts one relay on every other host that runs
    rollouts — on a worker of that host with the ``relay`` resource if any, else on its
    first rollout worker; a number ``n`` takes ``n`` workers with the ``relay`` resource.
    """
    from laminar.cluster import place, workers_with

    rcfg = cfg.relay
    placed: list[tuple[str, str]] = []  # (worker, resource)
    if rcfg.relays is None:
        relay_ws = workers_with(client, "relay")
        hosts = []
        for w in rollout_workers:
            h = _host(w)
            if h != _host(trainer_worker) and h not in hosts:
                hosts.append(h)
        for h in hosts:
            own = [w for w in relay_ws if _host(w) == h]
            placed.append(
                (own[0], "relay")
                if own
                else (next(w for w in rollout_workers if _host(w) == h), "rollout")
            )
    else:
        placed = [(w, "relay") for w in place(client, "relay", rcfg.relays)]
    relays, ids = start_chain(client, [(trainer_worker, "trainer"), *placed], rcfg)
    calibration = relays[0].calibrate().result(timeout=rcfg.timeout_s * 2)
    return RelayTier(relays, ids, [trainer_worker] + [w for w, _ in placed], calibration)
