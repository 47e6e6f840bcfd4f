"""Shared fixtures: a tiny policy folder, a private warm-start cache, a real multi-process
Dask cluster with role resources, and a small run config for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parent.parent

# No per-example deadline for property tests: it is a timing check, and on a loaded
# 2-core machine (CI, or tests beside other work) a torch call's first use exceeds
# hypothesis's 200 ms now and then, failing a test whose property holds ("Flaky").
settings.register_profile("laminar", deadline=None)
settings.load_profile("laminar")


def pytest_configure(config) -> None:
    """Ctrl-C as from a terminal, however the suite was started: a background job of a
    shell without job control (`nohup pytest ... &`, a CI step's `cmd &`) starts with
    SIGINT ignored, Python then installs no handler, and every process the tests start
    inherits the ignored signal. The tests of Ctrl-C (the CLI's, RunHandle.wait's, a
    child's `laminar run`) then waited for a stop that never came, to the timeout."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# Small enough for CI on 2 cores, big enough to exercise every actor and the store.
SMALL_RUN = [
    "task.num_prompts=200",
    "task.max_len=24",
    "sft.steps=20",
    # (one torch thread: beside the suite's other worker the default's second thread is
    # descheduled again and again, 46-70 s against 7-13 s; not in the entry's cache key)
    "sft.torch_threads=1",
    "rollout.group_size=4",
    "rollout.groups_per_batch=4",
    "rollout.max_new_tokens=30",
    "rollout.max_seq_len=60",
    "buffer.max_outstanding_groups=8",
    "trainer.groups_per_step=4",
    "trainer.steps=4",
]


@pytest.fixture(scope="session", autouse=True)
def laminar_cache(tmp_path_factory) -> Path:
    """Keep warm-start results of the test session out of the user's cache."""
    path = tmp_path_factory.mktemp("laminar-cache")
    os.environ["LAMINAR_CACHE"] = str(path)
    # One intra-op thread in the test process, as in every worker: on a shared 2-core
    # machine a second OpenMP thread is often descheduled, and each op then waits for it.
    import torch

    torch.set_num_threads(int(os.environ.get("LAMINAR_TEST_THREADS", "1")))
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    return path


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory) -> Path:
    from laminar.model import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("tiny-policy"), seed=0)


@pytest.fixture(scope="session")
def cluster_client():
    """A real cluster of worker processes (data+trainer, 2 rollouts) and a client."""
    from distributed import Client

    from laminar.cluster import local_cluster

    with local_cluster(2, memory_limit="3GiB") as cluster, Client(cluster) as client:
        yield client


@pytest.fixture
def small_config():
    from laminar.config import RunConfig, with_overrides

    return with_overrides(RunConfig(), SMALL_RUN)


@pytest.fixture
def no_cluster(monkeypatch):
    """A run that got past its pre-start checks would start a cluster: fail instead."""

    def refuse(*a, **k):
        raise AssertionError("the cluster was started")

    monkeypatch.setattr("laminar.deploy.open_cluster", refuse)


# -- state a test must not leave to the next -------------------------------------------
# A test that leaves this process changed fails the tests after it, in one selection and
# not alone. Seen: tests/test_driver.py's fake ``scheduler_workers`` stayed in
# pipelines.restart (first imported, lazily, while the patch was on), and every restart
# of tests/test_faults.py after it saw its new workers as gone ("the data module was
# lost and not rebuilt within 120 s"). Also checked: a patched distributed class (the
# nannies run here), a cluster, client or run's driver left going. Each is looked for
# after every test, and the test that left it fails, naming it.

# distributed's classes whose methods the fault tests may patch (monkeypatch restores).
PATCHABLE = ("Nanny", "Worker", "Scheduler", "SpecCluster", "Client")
# Threads of this process that belong to one run: none may outlive its test.
RUN_THREADS = ("laminar-driver",)
# How long a closed cluster's worker processes may take to be gone.
LEFTOVER_GRACE_S = 5.0


def _class_methods(cls) -> dict[str, object]:
    kinds = (property, staticmethod, classmethod)
    return {k: v for k, v in vars(cls).items() if callable(v) or isinstance(v, kinds)}


def _running(objects) -> set[int]:
    """The ids of those of ``objects`` (distributed servers, clusters, clients) that are
    neither closed nor closing."""
    return {id(o) for o in list(objects) if _status(o) not in DONE}


def _status(o) -> str:
    return str(getattr(o, "status", "undefined")).split(".")[-1]


DONE = ("undefined", "stopping", "stopped", "closing", "closing_gracefully", "closed", "failed")


def _servers() -> dict[str, tuple]:
    import distributed
    from distributed.deploy.spec import SpecCluster

    return {
        "cluster": (SpecCluster._instances, lambda c: getattr(c, "name", c)),
        "nanny": (distributed.Nanny._instances, lambda n: getattr(n, "name", n)),
        "scheduler": (distributed.Scheduler._instances, lambda s: getattr(s, "address", s)),
        "client": (distributed.Client._instances, lambda c: getattr(c, "id", c)),
    }


def _worker_pids() -> set[int]:
    """Worker processes of this process's nannies: the forkserver's children (a forked
    worker) and spawned ones, not the forkserver and resource tracker themselves."""
    import psutil

    me = psutil.Process()
    out = set()
    for child in me.children():
        try:
            cmd = " ".join(child.cmdline())
            if "multiprocessing.forkserver" in cmd:
                out |= {p.pid for p in child.children() if p.status() != psutil.STATUS_ZOMBIE}
            elif "multiprocessing.spawn" in cmd and child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
        except psutil.Error:  # (gone meanwhile)
            continue
    return out


def _nanny_pids() -> set[int]:
    import distributed

    pids = set()
    for nanny in list(distributed.Nanny._instances):
        proc = getattr(getattr(nanny, "process", None), "process", None)
        if proc is not None and proc.pid is not None:
            pids.add(proc.pid)
    return pids


# The packages we ship: none of their modules may keep a test's function after the test.
SHIPPED = ("laminar", "pipelines", "storage")
TESTS = str(REPO / "tests")


def _from_tests(value) -> bool:
    """Whether ``value`` is a function or class that a test module defined (a fake)."""
    if isinstance(value, types.FunctionType):
        return value.__code__.co_filename.startswith(TESTS)
    if isinstance(value, type):
        module = sys.modules.get(value.__module__)
        return (getattr(module, "__file__", None) or "").startswith(TESTS)
    return False


def kept_fakes() -> list[str]:
    """Names in our packages' modules (and their classes) bound to a test's function.
    ``monkeypatch`` restores what it set, but not a copy: a module first imported while
    a patch is on (``from laminar.cluster import scheduler_workers``, lazily, by the
    code under test) keeps the fake for the rest of the session."""
    out = []
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in SHIPPED or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if _from_tests(value):
                out.append(f"{name}.{attr} is {value.__qualname__} of the tests")
            elif isinstance(value, type) and value.__module__ == name:
                out += [
                    f"{name}.{attr}.{k} is {v.__qualname__} of the tests"
                    for k, v in list(vars(value).items())
                    if _from_tests(v)
                ]
    return out


def leaks(before: dict) -> list[str]:
    """What this process holds now that it did not at :func:`state` ``before``: a
    patched method of distributed's classes, a test's fake kept by one of our modules
    (:func:`kept_fakes`), a cluster, nanny, scheduler or client still running, a worker
    process no nanny owns, a run's driver thread still going."""
    import threading
    import time

    import distributed

    out = []
    for name in PATCHABLE:
        now = _class_methods(getattr(distributed, name))
        was = before["methods"][name]
        for attr in sorted(now.keys() | was.keys()):
            if now.get(attr) is not was.get(attr):
                out.append(f"distributed.{name}.{attr} changed (a patch not undone)")
    for kind, (objects, label) in _servers().items():
        new = _running(objects) - before[kind]
        out += [f"a {kind} still running: {label(o)}" for o in list(objects) if id(o) in new]
    out += [f for f in kept_fakes() if f not in before["fakes"]]
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (orphans := _worker_pids() - _nanny_pids() - before["orphans"]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    out += [f"a worker process no nanny owns: pid {pid}" for pid in sorted(orphans)]
    threads = [t for t in threading.enumerate() if t.name.startswith(RUN_THREADS)]
    new = [t for t in threads if t.ident not in before["threads"]]
    for t in new:  # (a run that just ended: its thread is returning)
        t.join(max(0.0, deadline - time.monotonic()) + 1.0)
    new = [t for t in new if t.is_alive()]
    out += [f"a run's thread still going: {t.name}" for t in new]
    return out


def state() -> dict:
    import threading

    import distributed

    return {
        "methods": {name: _class_methods(getattr(distributed, name)) for name in PATCHABLE},
        **{kind: _running(objects) for kind, (objects, _) in _servers().items()},
        "orphans": _worker_pids() - _nanny_pids(),
        "fakes": set(kept_fakes()),
        "threads": {t.ident for t in threading.enumerate() if t.name.startswith(RUN_THREADS)},
    }


@pytest.fixture(autouse=True)
def leaves_nothing_behind(request):
    """Fail a test that leaves this process changed for the next (:func:`leaks`)."""
    before = state()
    yield
    found = leaks(before)
    if found:
        pytest.fail(f"{request.node.nodeid} left: " + "; ".join(found), pytrace=False)


class FakeClient:
    """What `laminar run` reads of a Dask client, for the CLI tests that stand in for the
    cluster and the run (signals, Ctrl-C, the advice printed): no cluster starts."""

    scheduler = types.SimpleNamespace(address="inproc://fake")
    dashboard_link = "http://fake/status"

    def forward_logging(self, *a, **k):
        pass


def fake_cluster(monkeypatch, on_enter=None) -> list[bool]:
    """`laminar run` on a stand-in cluster (:class:`FakeClient`); returns the list its
    exit is recorded in."""
    import contextlib

    closed: list[bool] = []

    @contextlib.contextmanager
    def fake_open_cluster(cfg, run_dir=None):
        if on_enter:
            on_enter()
        try:
            yield FakeClient()
        finally:
            closed.append(True)

    monkeypatch.setattr("laminar.deploy.open_cluster", fake_open_cluster)
    return closed


def ctrl_c_every_poll(monkeypatch, checkpoint: str) -> list[bool]:
    """`laminar run` of a stand-in run that never ends by itself and is Ctrl-C'd at every
    poll, with ``checkpoint`` (``version-NNNNNN``) written in its run directory as it
    starts (without one, --resume refuses the run). Returns the list its ``stop()``
    calls are recorded in. (With :func:`fake_cluster`.)"""
    import signal

    stops: list[bool] = []

    class Handle:
        def __init__(self, cfg, client, run_dir, resume=None):
            self.run_dir = run_dir
            (run_dir / "checkpoints" / checkpoint).mkdir(parents=True)

        def done(self):
            return False

        def progress(self):
            os.kill(os.getpid(), signal.SIGINT)
            return {"phase": "setup"}

        def stop(self):
            stops.append(True)

    monkeypatch.setattr("pipelines.api.RunHandle", Handle)
    monkeypatch.setattr("pipelines.cli.time.sleep", lambda s: None)
    return stops


def resumable_run(tmp_path: Path, overrides=()) -> Path:
    """A run directory as `laminar run` leaves it, with a checkpoint's trainer state at
    version 1 (``checkpoints/version-000001``; its weights missing: a resume that gets
    past the config checks fails on them, in preflight)."""
    import json

    from laminar.config import RunConfig, with_overrides
    from pipelines.api import prepare_run_dir

    cfg = with_overrides(RunConfig(), ["trainer.steps=2", *overrides])
    run = prepare_run_dir(cfg, tmp_path / "run")
    ckpt = run / "checkpoints" / "version-000001"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"version": 1}))
    return run


@contextlib.contextmanager
def attribute_writes(monkeypatch):
    """The attribute writes of zarr groups made inside, as dicts, in order (each
    ``update_attributes`` call is one write of a group's ``zarr.json``)."""
    import zarr

    writes: list[dict] = []
    real = zarr.Group.update_attributes

    def counted(self, new):
        writes.append(dict(new))
        return real(self, new)

    monkeypatch.setattr(zarr.Group, "update_attributes", counted)
    try:
        yield writes
    finally:
        monkeypatch.setattr(zarr.Group, "update_attributes", real)


@pytest.fixture
def logging_put_back():
    """The loggers an abort silences (levels, and disabled flags: pipelines.cli_run's
    second Ctrl-C), put back after the test."""
    import logging

    names = ("distributed", "asyncio", "tornado", "laminar")
    levels = {n: logging.getLogger(n).level for n in names}
    disabled = {
        n: lg.disabled
        for n, lg in logging.root.manager.loggerDict.items()
        if isinstance(lg, logging.Logger)
    }
    yield
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)
    for n, lg in logging.root.manager.loggerDict.items():
        if isinstance(lg, logging.Logger):
            lg.disabled = disabled.get(n, False)
