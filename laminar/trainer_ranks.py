"""The trainer's data-parallel ranks: :class:`TrainerRank` and the ``torch.distributed``
group calls it and rank 0 share.

With ``trainer.ranks = N > 1``, ranks 1..N-1 are :class:`TrainerRank` actors on other
``trainer`` workers: each holds a full replica of the policy and optimizer and trains on
its shard of every batch rank 0 broadcasts. Here too: a rank's learner (:func:`_learner`),
joining and leaving the group (:func:`_join_group`, :func:`_leave_group`, on the backend
:func:`group_backend` picks), each batch's broadcast (:func:`_broadcast`), and the
rendezvous store on rank 0's worker (:func:`rendezvous`, :func:`open_rendezvous`).

Apart from rank 0 (:class:`laminar.trainer.Trainer`), which samples, publishes and
checkpoints: the other ranks only train, and meet rank 0 only through these calls.
"""

from __future__ import annotations

import logging
import threading
import traceback

import torch

from laminar.cluster import actor_threads, start_thread
from laminar.config import RunConfig
from laminar.learner import Learner

# (the actor's logger: its records read as the trainer's, whichever module they come from)
logger = logging.getLogger("laminar.trainer")

# Where the learner's parameters and gradients live: the CPU (policies load there, and
# no option moves them yet), whatever accelerators the host has.
LEARNER_DEVICE = "cpu"


class TrainerRank:
    """Dask actor: data-parallel rank ``rank`` ≥ 1 of the trainer (another ``trainer``
    worker). It holds a full replica of the policy and optimizer, trains on its shard of
    every batch rank 0 broadcasts, and ends when rank 0 broadcasts ``None``."""

    def __init__(self, cfg: RunConfig, policy_dir: str, rank: int, init_method: str) -> None:
        torch.set_num_threads(actor_threads(cfg))
        self.cfg, self.rank, self.init_method = cfg, rank, init_method
        self.learner = _learner(cfg, policy_dir, rank=rank)
        self.error: str | None = None
        self.done = False
        self.weights_checksum: float | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = start_thread(self._run, f"trainer-rank{self.rank}")

    def _run(self) -> None:
        try:
            _join_group(self.cfg, self.init_method, rank=self.rank)
            while (batch := _broadcast()) is not None:
                try:
                    self.learner.update(batch)
                except Exception:  # noqa: BLE001 — the group goes on: see below
                    # Every rank raised at this update (the learner agrees on a failure
                    # before its gradient all-reduce) and none took the step: rank 0 now
                    # stops the group, or trains on, and this rank must meet it either
                    # way (gone, it would leave rank 0 waiting for the group's timeout,
                    # its last checkpoint unwritten).
                    self.error = (self.error or "") + traceback.format_exc()
                    logger.error("trainer rank %d failed an update:\n%s", self.rank, self.error)
            self.weights_checksum = _leave_group(self.learner)
        except Exception:
            self.error = (self.error or "") + traceback.format_exc()
            logger.error("trainer rank %d failed:\n%s", self.rank, self.error)
        finally:
            self.done = True

    def stats(self) -> dict:
        return {
            "rank": self.rank,
            "version": self.learner.version,
            "done": self.done,
            "error": self.error,
            "weights_checksum": self.weights_checksum,
        }


def _learner(cfg: RunConfig, policy_dir: str, rank: int) -> Learner:
    from laminar.learner import torch_all_reduce

    n = cfg.trainer.ranks
    return Learner(
        cfg,
        policy_dir,
        resume_from=cfg.trainer.resume_from,
        rank=rank,
        world_size=n,
        all_reduce=torch_all_reduce if n > 1 else None,
    )


def group_backend(device: str | torch.device) -> str:
    """The ``torch.distributed`` backend for tensors on ``device``: NCCL for CUDA ones,
    gloo for CPU ones. Chosen by where the reduced tensors live, not by what the host
    has: the learner trains on the CPU, and a GPU node that picked NCCL for it failed
    at the first all-reduce (NCCL takes no CPU tensors)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _join_group(cfg: RunConfig, init_method: str, rank: int) -> None:
    """Join the group through the rendezvous store :func:`rendezvous` opened (every
    rank, rank 0 too, as a client of it)."""
    import datetime
    from urllib.parse import urlparse

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=cfg.cluster.actor_timeout_s * 5)
    at = urlparse(init_method)
    store = dist.TCPStore(at.hostname, at.port, None, False, timeout=timeout)
    dist.init_process_group(
        group_backend(LEARNER_DEVICE),
        store=store,
        rank=rank,
        world_size=cfg.trainer.ranks,
        timeout=timeout,
    )


def _broadcast(batch=None):
    """Rank 0 sends ``batch`` (or ``None``: stop); every other rank receives it."""
    import torch.distributed as dist

    box = [batch]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _leave_group(learner: Learner) -> float:
    """Leave the process group; returns a checksum of the weights (equal on every rank)."""
    import torch.distributed as dist

    dist.destroy_process_group()
    with torch.no_grad():
        return float(sum(p.double().sum() for p in learner.model.parameters()))


def rendezvous(client, worker: str) -> str:
    """The address (``tcp://host:port``) of a rendezvous store opened on ``worker``
    (rank 0's), which the group's ranks join through (:func:`_join_group`)."""
    from urllib.parse import urlparse

    # (bounded: a rank-0 worker lost meanwhile would leave the task pending for ever)
    port = client.submit(open_rendezvous, workers=[worker], pure=False).result(timeout=60)
    host = urlparse(worker).hostname
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"  # (IPv6)


def close_rendezvous_on(client, worker: str, init_method: str) -> None:
    """Best effort: close the rendezvous store at ``init_method`` on ``worker`` (a group
    that never reached rank 0's run, whose end closes it: its store would listen on for
    the worker's life)."""
    try:
        client.submit(close_rendezvous, init_method, workers=[worker], pure=False).result(10)
    except Exception as e:  # noqa: BLE001 — the worker gone: its store with it
        logger.warning("could not close the trainer ranks' rendezvous %s: %r", init_method, e)


# The rendezvous stores this worker process serves, by port. A store listens from the
# moment its port is chosen until rank 0 is done with the group: a port chosen free and
# closed again, for rank 0 to bind seconds later, could be taken meanwhile by another
# process of a shared node, and rank 0's start failed (EADDRINUSE).
_STORES: dict[int, object] = {}


def open_rendezvous() -> int:
    """Open a ``torch.distributed`` store on a free port of this machine, kept
    listening in this process (a Dask task on rank 0's worker, whose trainer closes it:
    :func:`close_rendezvous`); returns its port."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    _STORES[store.port] = store
    return store.port


def close_rendezvous(init_method: str) -> None:
    """Stop serving the rendezvous store at ``init_method`` (rank 0, once its group is
    over; nothing if this process does not serve it)."""
    from urllib.parse import urlparse

    _STORES.pop(urlparse(init_method).port, None)
