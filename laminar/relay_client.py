"""The relay tier's ends (:mod:`laminar.relay`): the trainer's :class:`Publisher` (one
host copy into a co-located master) and a rollout's :class:`Puller` (the newest version
from its local relay, verified chunk by chunk), and :func:`fetch_version` (an old version
for a recovery: a relay's kept copy, else the trainer's checkpoint on disk).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from laminar.relay_core import Layout, RelayError, VersionUnavailable, checksum, host_buffer


def local_instance(actor):
    """The object behind an actor handle when it lives in this very process, else ``None``
    (the trainer's thread publishes to its co-located master without any comm)."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        return None
    if getattr(actor, "_address", None) != worker.address:
        return None
    return worker.state.actors.get(actor.key)


class Publisher:
    """The trainer's end of the relay tier: publish in-process when the master is
    co-located (one host copy), else through a call that carries the weights."""

    def __init__(self, master, timeout_s: float) -> None:
        self.master = master
        self.local = local_instance(master)
        self.timeout_s = timeout_s

    def publish(self, version: int, state: Mapping[str, torch.Tensor]) -> float:
        if self.local is not None:
            return self.local.publish_local(version, state)
        cpu = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        return self.master.publish(version, cpu).result(timeout=self.timeout_s)


class RelaySwitched(RelayError):
    """The rollout was pointed at another relay while a pull waited on the old one."""


class RelayUnreachable(RelayError):
    """The relay could not be reached (its worker is lost) and the caller chose not to
    wait for the manager to point it at another one."""


class Puller:
    """A rollout's end: the newest version from its local relay, verified chunk by chunk,
    into a buffer kept warm across pulls. Up to ``window`` chunk reads are in flight.

    :meth:`switch` points it at another relay (its own was lost, docs/faults.md); a pull
    waiting on the old relay gives up within ``poll_s`` and starts again on the new one,
    instead of waiting out the timeout of a call that will never be answered.
    """

    def __init__(self, relay, timeout_s: float, window: int = 4, poll_s: float = 0.1) -> None:
        self.relay = relay
        self.timeout_s = timeout_s
        self.window = window
        self.poll_s = poll_s
        self._buf: np.ndarray | None = None
        self.pulls = 0
        self.bytes = 0
        self.retries = 0
        self.switches = 0
        # Called after each chunk read and each poll while waiting on the relay: the
        # rollout's heartbeat (waiting on a relay is not hanging; a hung relay is the
        # manager's to fence, and a switch ends the wait).
        self.on_progress = None

    def switch(self, relay) -> None:
        """Pull from ``relay`` from now on (called from another thread); ``None``: the
        relay is lost and there is none to pull from yet (the master, until the trainer
        restarts): a pull waits for the next switch, or with ``wait_switch=False`` raises
        :class:`RelayUnreachable` at once."""
        self.relay = relay
        self.switches += 1

    def _result(self, future, switches: int):
        """``future.result()``, abandoned as soon as :meth:`switch` was called, or once
        the relay's worker is gone (a call in flight to a lost actor otherwise waits out
        its whole timeout; nobody may be there to switch us: the manager can be lost
        with the master, when the trainer and data module share a worker)."""
        from laminar.cluster import LOST_POLL_S, ActorLost, worker_alive

        relay = self.relay
        deadline = time.monotonic() + self.timeout_s
        next_check = time.monotonic() + LOST_POLL_S
        while True:
            try:
                return future.result(timeout=self.poll_s)
            except UnboundLocalError:
                # distributed's sync met the answer as its timeout fired (seen under
                # load, laminar.cluster.actor_result): it is there for the next wait.
                # Not a lost relay: counting it as one failed a pull from a healthy relay.
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no answer from the relay in {self.timeout_s} s") from None
                continue
            except TimeoutError:
                self._progress()
                if self.switches != switches:
                    raise RelaySwitched("the relay was switched during a pull") from None
                if time.monotonic() >= deadline:
                    raise
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + LOST_POLL_S
                    if relay is not None and not worker_alive(relay):
                        raise ActorLost(f"the worker of relay {relay.key} is gone") from None

    def _retrying(self, fn, wait_switch: bool = True):
        """``fn(relay, switches)``, started again on the new relay after a switch. A relay
        that cannot be reached (its worker lost: the call fails, or never returns) is
        given up for the one the manager switches us to, if that comes within the
        timeout, else :class:`RelayUnreachable` (``wait_switch=False``: at once); an
        answer that is an error (checksum, eviction) is raised as it is. Callers catch
        :class:`RelayError`: a raw timeout or comm error escaping here failed the
        rollout."""
        while True:
            switches = self.switches
            if self.relay is None:  # lost, none to pull from yet
                if not wait_switch:
                    raise RelayUnreachable("the relay is lost and none replaces it yet")
                if not self._switched_since(switches):
                    raise RelayUnreachable("the relay is lost and none replaced it in time")
                continue
            try:
                return fn(self.relay, switches)
            except RelaySwitched:
                self.retries += 1
            except RelayError:
                raise
            except Exception as e:
                if self.switches != switches:  # switched while it failed: go again
                    self.retries += 1
                    continue
                if not wait_switch:
                    raise RelayUnreachable(f"the relay cannot be reached: {e!r}") from e
                if not self._switched_since(switches):
                    raise RelayUnreachable(
                        f"the relay cannot be reached and none replaced it in time: {e!r}"
                    ) from e
                self.retries += 1

    def _switched_since(self, switches: int) -> bool:
        deadline = time.monotonic() + self.timeout_s
        while self.switches == switches:
            if time.monotonic() >= deadline:
                return False
            self._progress()
            time.sleep(self.poll_s)
        return True

    def _progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress()

    def versions(self) -> list[int]:
        """The versions the relay holds complete."""
        return self._retrying(lambda relay, sw: self._result(relay.versions(), sw))

    def newest(
        self, have_version: int, wait_s: float = 0.0, wait_switch: bool = True
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``(version, state)`` if the relay holds a version newer than ``have_version``
        (waiting up to ``wait_s`` for one). The tensors view a buffer this puller reuses:
        load them before the next pull. ``wait_switch``: see :meth:`_retrying`."""

        def pull(relay, switches):
            # A version evicted while we read it was replaced by a newer one: take that.
            # Only a relay that evicts every version it offers for a whole timeout (the
            # trainer publishing faster than a pull, for that long) fails the pull.
            deadline = time.monotonic() + self.timeout_s
            while True:
                info = self._result(relay.newest(have_version, wait_s), switches)
                if info is None:
                    return None
                try:
                    return info["version"], self._read(relay, info, switches)
                except VersionUnavailable:
                    self.retries += 1
                    if time.monotonic() >= deadline:
                        raise RelayError(
                            f"every version the relay offered for {self.timeout_s:.0f} s was "
                            "evicted while it was read: publications outpace a pull; raise "
                            "relay.keep_versions"
                        ) from None

        return self._retrying(pull, wait_switch)

    def version(self, version: int) -> dict[str, torch.Tensor]:
        """A given (older) version if the relay keeps it, else :class:`VersionUnavailable`."""

        def pull(relay, switches):
            info = self._result(relay.info(version), switches)
            return self._read(relay, info, switches)

        return self._retrying(pull)

    def _read(self, relay, info: dict, switches: int) -> dict[str, torch.Tensor]:
        layout: Layout = info["layout"]
        if self._buf is None or self._buf.nbytes != layout.nbytes:
            self._buf = host_buffer(layout.nbytes)
        crcs, cb, n = info["crcs"], info["chunk_bytes"], len(info["crcs"])
        futures, ahead = {}, 0
        for j in range(n):
            while ahead < min(n, j + self.window):
                futures[ahead] = relay.read_chunk(info["version"], ahead)
                ahead += 1
            data, crc = self._result(futures.pop(j), switches)
            if crc != crcs[j] or checksum(data) != crc:
                raise RelayError(
                    f"chunk {j} of version {info['version']} failed its checksum on pull"
                )
            self._buf[j * cb : j * cb + data.nbytes] = data
            self._progress()
        self.pulls += 1
        self.bytes += layout.nbytes
        return layout.read(self._buf)


def fetch_version(
    version: int, puller: Puller | None, checkpoints_dir: str | Path | None
) -> dict[str, torch.Tensor]:
    """Weights of an old ``version`` (recovery): a relay's kept copy, else the trainer's
    checkpoint ``checkpoints_dir/version-NNNNNN`` on disk, its files checked against its
    manifest first. A damaged checkpoint is :class:`VersionUnavailable`, naming the
    files: a flipped bit in the weights would otherwise finish a lost rollout's
    responses with weights nobody published, their log-probs taken as the behavior
    policy's."""
    if puller is not None:
        try:
            return puller.version(version)
        except VersionUnavailable:
            pass
    if checkpoints_dir is not None:
        folder = Path(checkpoints_dir) / f"version-{version:06d}"
        files = sorted(folder.glob("*.safetensors"))
        if files:
            from safetensors.torch import load_file

            from laminar.files import ManifestMismatch, check_manifest
            from laminar.model import weight_files

            # The weights alone are read and checked, not the optimizer state beside
            # them (several times their size: minutes of reading at 72B, on a recovery).
            # (A checkpoint written before manifests were: loaded unchecked.)
            # (model.safetensors, or saved sharded: its index and shards, each listed
            # and each there: a shard gone would load as part of the weights)
            try:
                weights = weight_files(folder)
                only = sorted({*weights, *(f.name for f in files)})
                check_manifest(folder, require=weights, only=only)
            except (ManifestMismatch, OSError, ValueError) as e:
                said = (
                    "; ".join(f"{str(path)!r}: {what}" for path, what in e.problems)
                    if isinstance(e, ManifestMismatch)
                    else f"{type(e).__name__}: {e}"
                )
                raise VersionUnavailable(
                    f"version {version} is not kept by the relay, and its checkpoint is "
                    f"damaged ({said}); its weights cannot be had as published"
                ) from None

            state: dict[str, torch.Tensor] = {}
            try:
                for f in files:
                    state.update(load_file(f))
            except OSError as e:  # (removed meanwhile: trainer.keep_checkpoints)
                raise VersionUnavailable(
                    f"version {version} is not kept by the relay, and its checkpoint went "
                    f"as it was read ({type(e).__name__}: {e}; trainer.keep_checkpoints "
                    "removes the older ones)"
                ) from None
            return state
    where = "the relay" if puller is not None else "a relay (none was asked)"
    if checkpoints_dir is None:
        raise VersionUnavailable(
            f"version {version} is not kept by {where}, and this run keeps no "
            "checkpoints (no checkpoints folder); raise relay.keep_versions, or "
            "checkpoint (trainer.checkpoint_every)"
        )
    raise VersionUnavailable(
        f"version {version} is neither kept by {where} nor checkpointed under "
        f"{checkpoints_dir}; raise relay.keep_versions, checkpoint more often, or keep "
        "more checkpoints (trainer.keep_checkpoints)"
    )
