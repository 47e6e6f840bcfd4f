"""Dask cluster helpers: a local cluster with role resources, and actor placement.

Every long-lived component is a Dask actor pinned to a worker by its role resource
(``rollout``, ``trainer``, ``data``, ``relay``). Any cluster
works — the local one below, a scheduler address, a ``dask_jobqueue.SLURMCluster`` — as
long as its workers advertise those resources (``dask worker ADDR --resources rollout=1``).

Actor creation and handles (:func:`start_actor`, :func:`detach`, ...) are in
:mod:`laminar.actors`, importable from here too. The waits on an actor that watch the
scheduler's view of its worker (:func:`bind_actor`, :func:`submit_actor`,
:func:`actor_result`) stay here, beside :func:`scheduler_workers`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Collection, Iterator

from laminar.actors import ActorHung as ActorHung
from laminar.actors import ActorLost as ActorLost
from laminar.actors import actors_made as actors_made
from laminar.actors import detach as detach
from laminar.actors import is_lost as is_lost
from laminar.actors import release_actors as release_actors
from laminar.actors import start_actor as start_actor
from laminar.actors import start_thread as start_thread
from laminar.errors import ClusterError

logger = logging.getLogger(__name__)

ROLES = ("data", "trainer", "rollout", "relay")

# The Dask setting that pauses a worker near its memory limit (off in laminar's workers).
MEMORY_PAUSE = "distributed.worker.memory.pause"

# The torch threads of a worker's actors, in its environment: what the cluster laminar
# started gave that worker (cluster.torch_threads locally, its role's on a Slurm job).
TORCH_THREADS_VAR = "LAMINAR_TORCH_THREADS"


def local_cluster(
    n_rollouts: int,
    *,
    trainer_ranks: int = 1,
    relays: int = 0,
    memory_limit: str = "4GiB",
    torch_threads: int = 1,
    data_apart: bool = False,
):
    """A cluster of worker *processes* on this machine, one per role instance
    (:func:`role_workers`)."""
    return role_cluster(
        role_workers(n_rollouts, trainer_ranks=trainer_ranks, relays=relays, data_apart=data_apart),
        memory_limit=memory_limit,
        torch_threads=torch_threads,
        name="laminar-local",
    )


def role_workers(
    n_rollouts: int, *, trainer_ranks: int = 1, relays: int = 0, data_apart: bool = False
) -> dict:
    """Worker name -> resources, one worker per role instance.

    The data module shares the first trainer worker (``data=1, trainer=1``): it is small
    and talks mostly to the trainer — unless ``data_apart``, when it has a worker of its
    own (as on CPU nodes beside the GPUs; the trainer's process then trains undisturbed
    by the buffer's writes and the manager's calls). Then one ``trainer=1`` worker per extra
    data-parallel rank, one ``rollout=1`` per replica and one ``relay=1`` per downstream
    relay (the master relay lives in the trainer's process).

    >>> list(role_workers(2, relays=1).items())  # doctest: +NORMALIZE_WHITESPACE
    [('data-trainer', {'data': 1, 'trainer': 1}), ('rollout-0', {'rollout': 1}),
     ('rollout-1', {'rollout': 1}), ('relay-1', {'relay': 1})]
    """
    if data_apart:
        workers = {"data": {"data": 1}, "trainer": {"trainer": 1}}
    else:
        workers = {"data-trainer": {"data": 1, "trainer": 1}}
    for i in range(1, trainer_ranks):
        workers[f"trainer-{i}"] = {"trainer": 1}
    for i in range(n_rollouts):
        workers[f"rollout-{i}"] = {"rollout": 1}
    for i in range(1, relays + 1):
        workers[f"relay-{i}"] = {"relay": 1}
    return workers


def role_cluster(
    workers: dict[str, dict[str, int]],
    *,
    memory_limit: str = "4GiB",
    torch_threads: int = 1,
    name: str = "laminar",
    protocol: str = "tcp",
    security=None,
):
    """One single-threaded worker process on this machine per ``workers`` entry (name ->
    its resources), with :func:`worker_environ`. A :class:`distributed.SpecCluster` of
    nannies, because ``LocalCluster`` gives every worker the same resources.

    ``protocol`` is ``tcp``, ``tls`` (with ``security``, a :class:`distributed.Security`)
    or ``ucx``. The workers ignore Ctrl-C (:mod:`laminar.local_worker`)."""
    import dask
    from distributed import Nanny, Scheduler, SpecCluster

    # Yours, then ours (the terminal's Ctrl-C is the driver's to handle), each with its
    # arguments: a flat argument list is every preload's, as Dask reads it.
    preload = dask.config.get("distributed.worker.preload") or []
    preload = [preload] if isinstance(preload, str) else list(preload)
    argv = dask.config.get("distributed.worker.preload-argv") or []
    argv = [list(argv)] * len(preload) if argv and isinstance(argv[0], str) else list(argv)
    argv = argv or [[]] * len(preload)
    specs = {
        w: {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "resources": resources,
                "memory_limit": memory_limit,
                "host": "127.0.0.1",
                "protocol": f"{protocol}://",
                "security": security,
                "preload": [*preload, "laminar.local_worker"],
                "preload_argv": [*argv, []],
            },
        }
        for w, resources in workers.items()
    }
    scheduler = {
        "cls": Scheduler,
        "options": {
            "dashboard_address": ":0",
            "host": "127.0.0.1",
            "protocol": f"{protocol}://",
            "security": security,
        },
    }
    environ = worker_environ(torch_threads)
    if protocol != "ucx":  # (the UCX run is checked in its own CI environment only)
        fork_workers_from_a_warm_server()
    else:
        spawn_workers_unless_the_user_chose()
    check_main_importable()
    if dask.config.get("distributed.worker.multiprocessing-method") == "forkserver":
        # A forked worker starts with the forkserver's environment, from when it started
        # (this process's first worker); a spawned one would have this process's, now. So
        # that a variable set since (in a notebook: HF_HOME, LAMINAR_CACHE) reaches the
        # workers as it would with spawn, the nannies set it in each worker.
        theirs = {*environ, *dask.config.get("distributed.nanny.environ", {})}
        current = {k: v for k, v in os.environ.items() if k not in theirs}
        for spec in specs.values():
            spec["options"]["env"] = current
    # A worker pauses at Dask's memory.pause (80%) of its memory_limit, and a paused
    # worker starts no task, nor does the scheduler give it one: a rollout whose engine
    # holds most of its limit would run none of the run's reward tasks. Off, unless your
    # Dask config sets it; the nanny's restart at memory.terminate (95%) is the nanny's
    # own and stays. (In the nanny's config: the nanny sets its process's whole config in
    # the worker after the worker reads its environment, so a DASK_ variable would not
    # hold.)
    config = {} if _set_in_users_config(MEMORY_PAUSE) else {MEMORY_PAUSE: False}
    for spec in specs.values():
        # (the nanny's env, not its pre-spawn one: Dask lets this process's environment
        # override that, where a cluster started before left its own value)
        spec["options"]["env"] = {
            **spec["options"].get("env", {}),
            TORCH_THREADS_VAR: str(torch_threads),
        }
        spec["options"]["config"] = config
        spec["options"]["silence_logs"] = logging.WARNING  # (the nanny's and its worker's)
    # Dask's statistical profiler samples every thread's stack every 10 ms in every
    # worker; a dozen workers on two cores lose a tenth of a core to it (measured: an
    # idle cluster of 17 workers used 0.37 cores with it, 0.25 without).
    environ["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] = "False"
    with dask.config.set({"distributed.nanny.pre-spawn-environ": environ}):
        try:
            # (Dask's INFO lines of each worker's and the scheduler's start, 70 of them in
            # a notebook's cell for a tiny run, left out as LocalCluster leaves them out)
            with _stops_held() as held:
                cluster = SpecCluster(
                    workers=specs,
                    scheduler=scheduler,
                    name=name,
                    security=security,
                    silence_logs=logging.WARNING,
                )
            if held:  # (closed first, then the stop goes on as if it came now)
                cluster.close()
                signal.raise_signal(held[0])
            return cluster
        except RuntimeError as e:  # ("Cluster failed to start: ..." and Dask's cause)
            raise ClusterError(
                f"the local cluster did not start: {e}; check the cluster settings it "
                f"started with: cluster.protocol ({protocol}://), cluster.security "
                f"({'set' if security is not None else 'none'}), cluster.memory_limit "
                f"({memory_limit})" + _script_hint()
            ) from e


@contextlib.contextmanager
def _stops_held() -> Iterator[list[int]]:
    """Ctrl-C, SIGTERM and SIGHUP held while a local cluster is built, then handed to
    the handlers they would have reached (its caller closes what was built first).

    Interrupted part-way (its scheduler up, its nannies starting), a SpecCluster is
    neither returned nor closed: Python's exit closed it, in an atexit hook that
    failed (``AssertionError: Status.init``) beside the half-started workers' own
    tracebacks, ~70 lines under "laminar: interrupted". A start takes seconds; the stop
    is said at once. (Only in the main thread, the one signals reach.)"""
    import threading

    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def hold(signum, frame):
        if not held:
            os.write(2, b"\nstopping once the local cluster has started, then closing it\n")
        held.append(signum)

    before = {}
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        handler = signal.getsignal(signum)
        if handler not in (signal.SIG_IGN, None):
            before[signum] = signal.signal(signum, hold)
    try:
        yield held
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _script_hint() -> str:
    """Why a local cluster may fail to start from a script: its worker processes start
    by importing the script's ``__main__`` again (Python's ``spawn`` and ``forkserver``),
    and one that starts a cluster at its top level, unguarded, fails in each (Python's
    own word on it is in Dask's log above, not in the error)."""
    import __main__

    main = getattr(__main__, "__file__", None)
    # (none: a notebook, a REPL, `python -c`; `laminar` itself guards its entry point)
    if not main or os.path.basename(main) in ("laminar", "cli.py", "__main__.py", "pytest"):
        return ""
    return (
        f"; or, from a script ({__main__.__file__}): start the cluster, and the run, under "
        "`if __name__ == '__main__':` (each worker process imports the script again, and "
        "one that starts a cluster as it is imported fails)"
    )


# What every worker process imports before it can host an actor: forked from a server
# that imported them once, a worker starts in a fraction of a second instead of ~3 s.
WORKER_PRELOAD = (
    "distributed",
    "torch",
    "storage",
    "laminar.buffer",
    "laminar.manager",
    "laminar.relay",
    "laminar.relay_client",
    "laminar.rollout",
    "laminar.trainer",
    "laminar.model",
    "laminar.torch_engine",
    "laminar.sft",
    "laminar.worker_imports",  # transformers' lazily resolved classes: ~2.5 s a worker
)


# Variables that huggingface_hub and transformers read once, as they are imported (the
# forkserver imports them): where models are cached, and whether to go online. A worker
# forked from the server keeps what the server read, whatever its own environment says.
READ_AT_IMPORT = (
    "HF_HOME",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_ENDPOINT",
    "XDG_CACHE_HOME",
)

# Whether laminar, not the user, set the forkserver (see below).
_FORKSERVER_IS_OURS = False
# READ_AT_IMPORT as the forkserver read them (when laminar first chose it).
_SERVER_READ: dict[str, str | None] | None = None


def _read_at_import() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in READ_AT_IMPORT}


def spawn_workers_unless_the_user_chose() -> None:
    """Undo :func:`fork_workers_from_a_warm_server` (for clusters over UCX): back to
    Dask's default, ``spawn``, unless the user chose the method."""
    global _FORKSERVER_IS_OURS
    import dask

    key = "distributed.worker.multiprocessing-method"
    if _FORKSERVER_IS_OURS and dask.config.get(key) == "forkserver":
        dask.config.set({key: "spawn"})
        _FORKSERVER_IS_OURS = False


def check_main_importable() -> None:
    """Refuse to start worker processes that could not import this process's ``__main__``.

    With the ``spawn`` and ``forkserver`` methods every worker process imports the main
    module again from its file, as Python's multiprocessing does. A script read from
    standard input (``python - < run.py``, a heredoc) has ``__file__`` ``'<stdin>'``, no
    file: each worker failed with ``FileNotFoundError: '<stdin>'``, shown as "Nanny failed
    to start", which reads like the missing ``__main__`` guard the README warns of. A
    notebook, an interactive session and ``python -c`` have no such file to import, and
    ``python -m`` imports by name: those start as they are.

    >>> check_main_importable()  # (under pytest: a real file, or none)
    """
    from multiprocessing import process

    import dask

    if dask.config.get("distributed.worker.multiprocessing-method") == "fork":
        return  # (a forked worker imports nothing again)
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(getattr(main, "__spec__", None), "name", None):
        return
    full = path if os.path.isabs(path) else os.path.join(process.ORIGINAL_DIR or "", path)
    if not os.path.isfile(full):
        raise ClusterError(
            f"a local cluster's worker processes import this program's main module again, "
            f"from its file, and it has none ({path!r}: a script read from standard input, "
            "`python - < script.py` or a heredoc); save the script to a file and run "
            '`python script.py` (with the `if __name__ == "__main__":` guard), or run '
            "it in a notebook or with `python -c`"
        )


def fork_workers_from_a_warm_server() -> None:
    """Have this process's nannies fork their workers from a forkserver that has imported
    :data:`WORKER_PRELOAD`, instead of spawning fresh interpreters.

    Spawned, every worker imports torch and laminar itself: ~3 s of CPU each. On two
    cores a short run of the tiny config (three workers) took 3-8 s longer, and a worker
    the nanny brought back after a fault took seconds, not ~0.3 s. The forkserver imports
    them once, with the nannies' pre-spawn environment (``OMP_NUM_THREADS`` and the rest,
    :func:`worker_environ`), which the nanny sets in this process before it starts its
    first worker. Dask reads the
    method when a nanny starts a worker, so this sets
    ``distributed.worker.multiprocessing-method`` for the process, and only if it still
    has Dask's default (``spawn``) and no Dask config file or ``DASK_*`` variable of
    yours set it: a method you chose yourself is kept. The preload is
    taken only if the forkserver has not started yet.

    A forked worker would start with the forkserver's environment; :func:`role_cluster`
    has its nannies set this process's current one in it, as spawn would have (a variable
    *removed* since still reaches the worker). Clusters over UCX undo this setting
    (:func:`spawn_workers_unless_the_user_chose`).

    Except for :data:`READ_AT_IMPORT`: the server imported transformers, which read them
    then. While one differs from what the server read (``HF_HOME`` set in a notebook
    between two clusters), workers are spawned, each reading it (with a warning that
    names it); once they match again, the server is used again."""
    import multiprocessing as mp

    import dask
    from distributed.utils import get_mp_context

    global _FORKSERVER_IS_OURS, _SERVER_READ
    key = "distributed.worker.multiprocessing-method"
    now = _read_at_import()
    if _SERVER_READ is not None and now != _SERVER_READ:
        if dask.config.get(key) == "forkserver" and not _set_in_users_config(key):
            changed = sorted(k for k in now if now[k] != _SERVER_READ[k])
            logger.warning(
                "%s changed since this process's warm worker server imported transformers, "
                "which read it then: workers are spawned (each imports torch and "
                "transformers itself, seconds slower) until it is as before",
                ", ".join(changed),
            )
            dask.config.set({key: "spawn"})
            _FORKSERVER_IS_OURS = False
        return
    if dask.config.get(key) != "spawn" or "forkserver" not in mp.get_all_start_methods():
        return  # (no forkserver: Windows)
    if _set_in_users_config(key):  # "spawn" from a YAML file or a DASK_ variable: theirs
        return
    dask.config.set({key: "forkserver"})
    _FORKSERVER_IS_OURS = True
    if _SERVER_READ is None:  # (the server starts with this cluster's first worker)
        _SERVER_READ = now
    get_mp_context()  # Dask sets its own preload list on its first call: ours replaces it
    # (one module that imports each of WORKER_PRELOAD: the server dies of any error but
    # ImportError in a preload, and every worker start with it)
    mp.get_context("forkserver").set_forkserver_preload(["laminar.forkserver_preload"])


def _set_in_users_config(key: str) -> bool:
    """Whether the user's Dask config files or ``DASK_*`` variables set ``key`` (whatever
    the value: one equal to Dask's default is still their choice)."""
    import dask

    node = dask.config.collect()
    for part in key.split("."):
        names = {k.replace("_", "-"): k for k in node} if isinstance(node, dict) else {}
        if part.replace("_", "-") not in names:
            return False
        node = node[names[part.replace("_", "-")]]
    return True


def worker_environ(torch_threads: int = 1) -> dict[str, str]:
    """Environment for worker processes, set before they start.

    Dask's nanny sets ``MALLOC_TRIM_THRESHOLD_=65536`` by default so that workers hand
    memory back to the OS promptly. For torch's many short-lived tensors that makes glibc
    trim on nearly every free: a training step ran 2x slower, mostly in system calls. We
    keep glibc's default (adaptive) threshold instead. Slurm jobs export these variables
    and run their worker without a nanny (:func:`laminar.deploy.slurm_cluster`); for
    workers you start yourself, see docs/deploy.md.
    """
    import dask

    env = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}))
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    threads = str(torch_threads)
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
    return env


def actor_threads(cfg) -> int:
    """The torch threads an actor of this worker computes with: its environment's
    ``LAMINAR_TORCH_THREADS``, which laminar's clusters give their workers (a local
    one's ``cluster.torch_threads``, a Slurm job its role's ``torch_threads`` or cores),
    else ``cluster.torch_threads`` (a worker you started yourself without it)."""
    value = os.environ.get(TORCH_THREADS_VAR, "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return cfg.cluster.torch_threads


def scheduler_workers(client=None, timeout: float = 30.0) -> dict[str, dict]:
    """The scheduler's workers now, address -> info, asked of the scheduler itself (a
    :class:`TimeoutError` after ``timeout`` s: a scheduler that does not answer must not
    hold loss detection for ever).

    Not ``Client.scheduler_info()``: that returns the client's cached identity, which
    the client's own refresh (every 2 s, with no workers) may overwrite between the fetch
    and the read, so that a live worker looks gone (4 reads in 92,000 on this machine;
    a bench run once took the data module for lost by it)."""
    if client is None:
        from distributed import get_client

        client = get_client()
    status = getattr(client, "status", "running")
    if getattr(client, "scheduler", None) is None or status in ("closing", "closed"):
        # (closed under a run: a notebook cell that closed the client or its cluster
        # early; it read as "'NoneType' object has no attribute 'identity'")
        raise ClusterError(
            f"the Dask client is {status}: it was closed (by its close() or its "
            "cluster's, or by itself after it lost its scheduler and could not reconnect) "
            "while the run was going, and the run cannot go on without it; keep the "
            "client and cluster open until the run has ended (RunHandle.wait), and "
            "continue the run from its newest checkpoint with "
            "pipelines.resume(RUN_DIR, client) or `laminar run --resume RUN_DIR`"
        )
    return client.sync(client.scheduler.identity, n_workers=-1, callback_timeout=timeout)["workers"]


def workers_with(client, resource: str) -> list[str]:
    """Addresses of workers advertising ``resource``, in the order of their names (numbers
    within a name by value: ``rollout-2`` before ``rollout-10``), then addresses: a stable
    placement, and the one the names promise. Sorted by address, the worker named
    ``rollout-1`` held rollout r0 whenever its port sorted first, and a user who killed
    ``rollout-1`` to drill a loss read that r0 was lost."""
    info = scheduler_workers(client)
    held = [a for a, w in info.items() if w.get("resources", {}).get(resource, 0) > 0]
    return sorted(held, key=lambda a: (_natural(str(info[a].get("name", a))), a))


def _natural(name: str) -> tuple:
    """A sort key that reads the numbers in ``name`` by value.

    >>> sorted(["rollout-10", "rollout-2", "rollout-1", "node-²"], key=_natural)
    ['node-²', 'rollout-1', 'rollout-2', 'rollout-10']
    """
    import re

    # (the split's odd parts are its runs of digits: str.isdigit takes a superscript
    # "²" too, which int() refuses)
    parts = re.split(r"(\d+)", name)
    return tuple((0, int(p), "") if i % 2 else (1, 0, p) for i, p in enumerate(parts))


def place(client, resource: str, count: int, avoid: Collection[str] = ()) -> list[str]:
    """``count`` distinct worker addresses for a role, or a :class:`ClusterError` saying why.

    Actors hold their worker's resource only while being created, so placement pins each
    actor to an explicit worker rather than relying on the resource count. Workers in
    ``avoid`` (another role's: a worker started with two roles' resources) are taken
    last, only where the others are too few.
    """
    addrs = sorted(workers_with(client, resource), key=lambda a: a in avoid)
    if len(addrs) < count:
        setting = ROLE_COUNTS.get(resource)
        lower = f", or set {setting}={len(addrs)}" if setting and addrs else ""
        raise ClusterError(
            f"the cluster has {len(addrs)} worker(s) with resource {resource!r}, the run "
            f"needs {count}; start {count - len(addrs)} more with `dask worker ADDRESS "
            f"--resources {resource}=1`{lower}"
        )
    return addrs[:count]


# The setting that counts a role's workers (the data module always needs one).
ROLE_COUNTS = {"trainer": "trainer.ranks", "rollout": "rollout.replicas", "relay": "relay.relays"}


def bind_actor(client, cls, worker: str, future, silent_s: float | None = None):
    """The handle of the actor ``future`` created on ``worker``, bound to ``client``
    (raises the constructor's error). See :func:`submit_actor` for why it is rebuilt.

    Raises :class:`ActorLost` within about a second of ``worker`` leaving the scheduler
    before the actor exists: its creating task, pinned to that address, would otherwise
    wait for ever (a worker the nanny restarts comes back under another address). A
    constructor that is merely slow (a model load) is waited for.

    ``silent_s``: raise :class:`ActorHung` once ``worker`` has sent the scheduler
    nothing (its ``last_seen`` unchanged: no heartbeat) for that long, or the scheduler
    has not answered for as long. A hung (stopped) worker stays on the scheduler's books
    for minutes; one whose constructor is slow beats on (its event loop runs beside the
    task's thread) and is still waited for, as is a constructor deadlocked in it."""
    from distributed import Actor

    seen, since = None, time.monotonic()
    while True:
        try:
            future.result(timeout=LOST_POLL_S)
            break
        except UnboundLocalError:  # (see actor_result): the result is there now
            continue
        except TimeoutError:
            if future.done():  # (done as the wait ended: read it again)
                continue
            try:
                info = scheduler_workers(client, timeout=5.0)
            except Exception:  # noqa: BLE001 — no scheduler that answers: keep waiting
                info = None
            if info is not None and worker not in info:
                raise ActorLost(
                    f"the worker {worker} was lost while it created a {cls.__name__} actor "
                    f"(task {future.key})"
                ) from None
            if info is not None and info[worker].get("last_seen") != seen:
                seen, since = info[worker].get("last_seen"), time.monotonic()
            if silent_s is not None and time.monotonic() - since > silent_s:
                raise ActorHung(
                    f"the worker {worker} sent the scheduler nothing for {silent_s:g} s "
                    f"while it created a {cls.__name__} actor (task {future.key})"
                ) from None
    with client.as_current():
        return Actor(cls, worker, future.key)


def submit_actor(client, cls, *args, worker: str, resource: str, **kwargs):
    """Create an actor of ``cls`` on ``worker`` and return its handle (waits for it).

    The handle is bound to ``client``. Unpickled, a :class:`distributed.Actor` binds to
    whatever ``get_client()`` finds first: the newest default client of the process, which
    may belong to another cluster (or be a failed connect that was never closed). Then the
    run's client forgets the actor's key once the creating future is dropped, the scheduler
    releases the actor, and every call to it fails (and a plain task that takes the
    handle as an argument is cancelled for "lost dependencies"; :func:`start_actor`
    passes handles by value). So it is built again here, in the caller's thread, with
    ``client`` current: its ``Future`` keeps the key alive on the right client for as long
    as the handle lives.
    """
    future = start_actor(client, cls, *args, worker=worker, resource=resource, **kwargs)
    return bind_actor(client, cls, worker, future)


LOST_POLL_S = 1.0  # how often actor_result looks whether the actor's worker is gone


def actor_result(actor, future, timeout: float):
    """``future.result(timeout)`` for a call on ``actor``, that raises
    :class:`ActorLost` within about a second of the actor's worker being lost. (A call
    in flight when its actor's worker dies otherwise waits out its whole timeout:
    distributed waits for the actor's creating task, which is never done.)"""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return future.result(timeout=max(0.0, min(left, LOST_POLL_S)))
        except UnboundLocalError:  # distributed's sync met the result as its timeout fired:
            continue  # it is there now
        except TimeoutError:
            if left <= LOST_POLL_S:
                raise
            if not worker_alive(actor):
                raise ActorLost(
                    f"the worker holding actor {actor.key} ({actor._address}) is gone"
                ) from None


def worker_alive(actor) -> bool:
    """Whether the scheduler still has the worker of ``actor`` (``True`` when it cannot
    be asked: the call's own timeout then stands). Asked of the actor's own client: the
    process's default one may be another cluster's (a notebook's newer client), where
    every worker of this one looks gone."""
    try:
        workers = scheduler_workers(getattr(actor, "_client", None), timeout=5.0)
    except Exception:  # noqa: BLE001 — no client here, or no scheduler that answers
        return True
    return actor._address in workers
