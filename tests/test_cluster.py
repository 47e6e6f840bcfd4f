import multiprocessing
import os
import time

import pytest

from laminar.cluster import bind_actor, place, scheduler_workers, worker_alive, workers_with
from laminar.errors import ClusterError


def test_placement_needs_role_resources(small_config):
    from distributed import Client, LocalCluster

    import pipelines

    with (
        LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        assert workers_with(client, "rollout") == []
        with pytest.raises(
            ClusterError, match=r"0 worker\(s\) with resource 'data'.*--resources data=1"
        ):
            pipelines.submit(small_config, client, overrides=["cluster.placement_timeout_s=0"])


def test_live_workers_are_read_from_the_scheduler_not_the_clients_cache():
    """The client refreshes its cached identity every 2 s with no workers in it; a read of
    that cache (``Client.scheduler_info()``) right after such a refresh finds every worker
    gone. Loss detection must never read it: a live data module was once taken for lost."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=2, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2)
        live = set(cluster.scheduler.workers)
        client.sync(client._update_scheduler_info)  # what the periodic refresh does
        assert client._scheduler_identity["workers"] == {}  # the cache a racing read sees
        assert set(scheduler_workers(client)) == live
        # (bound to this client as laminar binds its actors, bind_actor: an unpickled
        # handle binds to whatever client the process made last, the suite's cluster)
        future = client.submit(Counter, actor=True, workers=[min(live)])
        actor = bind_actor(client, Counter, min(live), future)
        assert worker_alive(actor)
        # a scheduler that does not answer in time is an error, not a wait for ever
        with pytest.raises(TimeoutError):
            scheduler_workers(client, timeout=1e-6)
    # a client closed under a run (a notebook cell run early) says so, not
    # "'NoneType' object has no attribute 'identity'" (helper 186)
    with pytest.raises(
        ClusterError, match=r"the Dask client is closed: it was closed \(by its close\(\)"
    ):
        scheduler_workers(client)


class Counter:
    pass


@pytest.mark.slow
def test_local_cluster_gives_each_role_its_own_worker(cluster_client):
    rollouts = place(cluster_client, "rollout", 2)
    trainer = place(cluster_client, "trainer", 1)
    assert len(set(rollouts)) == 2 and trainer[0] not in rollouts
    assert place(cluster_client, "data", 1) == trainer  # data module beside the trainer
    with pytest.raises(ClusterError, match="needs 3"):
        place(cluster_client, "rollout", 3)


@pytest.mark.slow
def test_local_workers_start_warm_with_the_nannies_environment(cluster_client):
    """Workers are forked from a server that imported torch and laminar once (not spawned
    to import them each), and still see the pre-spawn environment and single-threaded
    torch that a spawned worker would."""

    from laminar.cluster import WORKER_PRELOAD

    def state(preload) -> dict:
        import sys

        preloaded = all(m in sys.modules for m in preload)  # before this imports any
        import os
        import signal
        from pathlib import Path

        import torch

        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ")
        return {
            "parent": os.getppid(),
            "from_forkserver": b"forkserver" in parent,
            "preloaded": preloaded,
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "malloc_trim": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
            "torch_threads": torch.get_num_threads(),
            # Ctrl-C and a dropped session signal the whole process group: the driver
            # stops the run, its workers must not die of it (laminar.local_worker)
            "ignored": [
                signal.getsignal(sig) == signal.SIG_IGN for sig in (signal.SIGINT, signal.SIGHUP)
            ],
        }

    import os

    states = cluster_client.run(state, list(WORKER_PRELOAD))
    assert len(states) == 3
    assert len({s["parent"] for s in states.values()}) == 1  # one server forked them all
    for s in states.values():
        assert s["from_forkserver"] and s["parent"] != os.getpid(), s  # not this nanny's
        assert s["preloaded"] and s["omp"] == "1" and s["torch_threads"] == 1, s
        assert s["malloc_trim"] is None and s["ignored"] == [True, True], s


def _counter_and_holder(marker=None):
    """Two actor classes, one holding the other's handle (``more``: in a dict); made in a
    function, so they are pickled by value (workers cannot import this module)."""

    class Counter:
        def __init__(self):
            self.n = 0

        def add(self, k):
            self.n += k
            return self.n

    class Holder:
        def __init__(self, counter, more=None):
            self.counter = counter if more is None else more["c"][0]

        def bump(self):
            return self.counter.add(2).result()

        def close(self):
            marker.write_text("closed")

    return Counter, Holder


@pytest.mark.slow
def test_an_actor_is_created_whatever_the_workers_that_hold_its_arguments_handles_do(tmp_path):
    """A handle among a constructor's arguments (nested in a dict too) is no dependency
    of the creating task. As one, the new actor's worker gathered it from any worker
    that held a copy of its key, every one whose actor was created with it; one that
    hangs (SIGSTOP) never answers, and the creation waited for ever: a data module
    rebuilt while a rollout hung stalled the run so (its manager takes the master
    relay's handle, which every rollout was created with)."""
    import os
    import signal

    from distributed import Client

    from laminar.actors import actors_made, release_actors, start_actor
    from laminar.cluster import role_cluster, submit_actor

    marker = tmp_path / "closed"
    Counter, Holder = _counter_and_holder(marker)
    roles = {"a": {"data": 1}, "b": {"rollout": 1}, "c": {"relay": 1}}
    with role_cluster(roles, name="byvalue") as cluster, Client(cluster) as client:
        (a,), (b,), (c,) = (workers_with(client, r) for r in ("data", "rollout", "relay"))
        counter = submit_actor(client, Counter, worker=a, resource="data")
        held = submit_actor(client, Holder, counter, worker=b, resource="rollout")
        assert held.bump().result() == 2
        pid = client.run(os.getpid, workers=[b])[b]
        os.kill(pid, signal.SIGSTOP)  # b holds what it was created with, and hangs
        try:
            t0 = time.time()
            for args, kwargs in (((counter,), {}), ((None,), {"more": {"c": [counter]}})):
                h = submit_actor(client, Holder, *args, worker=c, resource="relay", **kwargs)
                assert h.bump().result(timeout=10) in (4, 6)
            assert time.time() - t0 < 20
        finally:
            os.kill(pid, signal.SIGCONT)
        # A run whose setup fails closes what it made (a buffer flushes its store): one
        # created with handles, by value, too.
        with actors_made() as made:
            start_actor(client, Holder, counter, worker=c, resource="relay").result()
        assert [cls for cls, _ in made] == [Holder]
        release_actors(client, made)
        assert marker.read_text() == "closed"


@pytest.mark.slow
def test_actor_handles_stay_bound_to_their_clients_cluster():
    """A newer default client (another cluster, a failed connect) must not capture the
    handles laminar creates: the run's client holds each actor, and a task that takes a
    handle as an argument depends on it. Bound to the wrong client, the scheduler forgets
    the actor and the dependent fails with "lost dependencies"."""
    from distributed import Client, LocalCluster

    from laminar.cluster import role_cluster, submit_actor

    Counter, Holder = _counter_and_holder()

    def task_state(key, dask_scheduler=None):  # nested: pickled by value, not by module
        task = dask_scheduler.tasks.get(key)
        return task.state if task is not None else None

    with (
        role_cluster({"a": {"data": 1}, "b": {"rollout": 1}}, name="bound") as cluster,
        Client(cluster) as client,
    ):
        a, b = workers_with(client, "data")[0], workers_with(client, "rollout")[0]
        with (
            LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as other,
            Client(other),  # now the newest default client
        ):
            counter = submit_actor(client, Counter, worker=a, resource="data")
            assert counter.add(1).result() == 1  # the handle talks to the right cluster
            holder = submit_actor(client, Holder, counter, worker=b, resource="rollout")
            assert holder.bump().result() == 3
            # The scheduler still holds the actor for the run's client.
            assert client.run_on_scheduler(task_state, key=counter.key) == "memory"


@pytest.mark.skipif(
    "forkserver" not in multiprocessing.get_all_start_methods(), reason="no forkserver here"
)
def test_a_multiprocessing_method_the_user_chose_is_kept(monkeypatch):
    import dask

    from laminar.cluster import fork_workers_from_a_warm_server, spawn_workers_unless_the_user_chose

    key = "distributed.worker.multiprocessing-method"
    with dask.config.set({key: "fork"}):
        fork_workers_from_a_warm_server()
        assert dask.config.get(key) == "fork"
        spawn_workers_unless_the_user_chose()  # (for UCX) it was not laminar's: kept
        assert dask.config.get(key) == "fork"
    with dask.config.set({key: "spawn"}):  # Dask's default: laminar's choice
        fork_workers_from_a_warm_server()
        assert dask.config.get(key) == "forkserver"
        spawn_workers_unless_the_user_chose()  # laminar's: undone
        assert dask.config.get(key) == "spawn"
    # "spawn" from the environment (or a config file) is the user's, though it is the default
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD", "spawn")
    with dask.config.set({key: "spawn"}):
        fork_workers_from_a_warm_server()
        assert dask.config.get(key) == "spawn"


@pytest.mark.slow
@pytest.mark.skipif(
    "forkserver" not in multiprocessing.get_all_start_methods(), reason="no forkserver here"
)
def test_a_variable_set_after_the_forkserver_started_reaches_the_next_clusters_workers(
    monkeypatch,
):
    """Forked workers get this process's environment of the moment their cluster starts
    (a notebook that sets HF_HOME between two runs), not the forkserver's."""
    from distributed import Client

    from laminar.cluster import role_cluster

    def mark():
        import os

        return os.environ.get("LAMINAR_TEST_MARK")

    for value in ("first", "second"):
        monkeypatch.setenv("LAMINAR_TEST_MARK", value)
        with role_cluster({"w": {"rollout": 1}}, name=f"env-{value}") as c, Client(c) as client:
            assert list(client.run(mark).values()) == [value]


@pytest.mark.slow
def test_binding_an_actor_whose_worker_dies_while_it_is_created_fails_instead_of_waiting():
    """The creating task is pinned to its worker's address; a killed worker comes back
    (nanny) under another address, so the task waits for ever. Binding must say that the
    worker is lost, not wait with it (a restart's new master, or a setup's trainer)."""
    import os
    import signal
    import time

    from distributed import Client

    from laminar.cluster import ActorLost, bind_actor, role_cluster, start_actor

    with (
        role_cluster({"a": {"trainer": 1}}, name="bind-lost") as cluster,
        Client(cluster) as client,
    ):
        (w,) = workers_with(client, "trainer")

        class SlowToStart:  # (defined here: pickled by value, as workers cannot import tests)
            def __init__(self, seconds):
                import time

                time.sleep(seconds)

        # a slow constructor on a live worker is waited for
        fast = start_actor(client, SlowToStart, 1.5, worker=w, resource="trainer")
        assert bind_actor(client, SlowToStart, w, fast).key == fast.key
        future = start_actor(client, SlowToStart, 60, worker=w, resource="trainer")
        time.sleep(0.5)
        os.kill(client.run(os.getpid, workers=[w])[w], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ActorLost, match="lost while it created a SlowToStart"):
            bind_actor(client, SlowToStart, w, future)
        assert time.monotonic() - t0 < 15


class Sleeper:
    def nap(self, seconds):
        import time

        time.sleep(seconds)
        return seconds


def test_a_slow_call_is_not_taken_for_lost_when_another_client_is_the_default():
    """actor_result asks whether the actor's worker is gone of the actor's own client:
    asked of the process's newest default client (another cluster's: a notebook that
    opened one after the run started), every live worker looked gone and a slow call
    (over a second) raised ActorLost."""
    from distributed import Client, LocalCluster

    from laminar.cluster import actor_result, submit_actor

    with (
        LocalCluster(
            n_workers=1, processes=False, dashboard_address=":0", resources={"data": 1}
        ) as cluster,
        Client(cluster) as client,
    ):
        (w,) = workers_with(client, "data")
        actor = submit_actor(client, Sleeper, worker=w, resource="data")
        with (
            LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as other,
            Client(other),  # now the newest default client
        ):
            assert worker_alive(actor)
            assert actor_result(actor, actor.nap(2.5), 20.0) == 2.5
        # a worker that is gone is still found gone
        client.sync(cluster.workers[0].close)
        assert not worker_alive(actor)


def test_a_placement_error_says_how_many_workers_are_missing_and_which_setting_counts_them():
    """It named no setting ("lower the count in the config"), and offered lowering the
    count of the data module, which is always one."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1, processes=False, dashboard_address=":0", resources={"rollout": 1}
        ) as cluster,
        Client(cluster) as client,
    ):
        with pytest.raises(ClusterError) as e:
            place(client, "rollout", 3)
        assert "start 2 more with `dask worker ADDRESS --resources rollout=1`" in str(e.value)
        assert "set rollout.replicas=1" in str(e.value)
        with pytest.raises(ClusterError) as e:
            place(client, "data", 1)
        assert "start 1 more with `dask worker ADDRESS --resources data=1`" in str(e.value)
        assert "set" not in str(e.value).split(";")[1], e.value


@pytest.mark.slow
def test_a_hub_variable_changed_between_two_clusters_reaches_the_second_ones_workers(
    monkeypatch, tmp_path, caplog
):
    """huggingface_hub reads HF_HOME once, at import, and the warm server imported it: a
    worker forked from it would keep the server's cache folder. Changed since, workers
    are spawned (and read it), with a warning that names it; back as it was, they are
    forked from the warm server again."""
    from distributed import Client

    from laminar.cluster import role_cluster

    def hub_cache_and_parent() -> tuple[str, bool]:
        import os
        from pathlib import Path

        from huggingface_hub import constants

        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        return constants.HF_HUB_CACHE, b"forkserver" in parent

    def worker_sees(name: str) -> tuple[str, bool]:
        with role_cluster({"w": {"relay": 1}}, name=name) as c, Client(c) as client:
            (seen,) = client.run(hub_cache_and_parent).values()
        return seen

    before, forked = worker_sees("hub-before")
    assert forked
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with caplog.at_level("WARNING", logger="laminar.cluster"):
        cache, forked = worker_sees("hub-changed")
    assert cache == str(tmp_path / "hf" / "hub") and not forked, (cache, before)
    assert "HF_HOME changed" in caplog.text
    monkeypatch.undo()
    assert worker_sees("hub-as-before") == (before, True)


@pytest.mark.slow
def test_a_module_that_fails_to_import_in_the_warm_server_does_not_stop_the_workers(tmp_path):
    """The forkserver dies of any error but ImportError in a preload, and every worker
    start with it. transformers raises ValueError as it is imported with a mistyped
    HF_HUB_ETAG_TIMEOUT: a cluster whose workers need no transformers still starts, and
    the worker that imports it gets the error. (A fresh process: this one's server is
    warm already.)"""
    import subprocess
    import sys

    script = tmp_path / "start.py"
    script.write_text(
        "from distributed import Client\n"
        "from laminar.cluster import role_cluster\n"
        "def hub():\n"
        "    try:\n"
        "        import transformers  # noqa: F401\n"
        "    except ValueError as e:\n"
        "        return f'ValueError: {e}'\n"
        "    return 'imported'\n"
        "if __name__ == '__main__':\n"
        "    with role_cluster({'w': {'relay': 1}}, name='bad-hub') as c, Client(c) as client:\n"
        "        print(list(client.run(hub).values())[0])\n"
    )
    env = {**os.environ, "HF_HUB_ETAG_TIMEOUT": "10s", "DASK_LOGGING__DISTRIBUTED": "error"}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ValueError" in out.stdout and "10s" in out.stdout, out.stdout


def test_a_script_read_from_stdin_is_told_to_be_saved_to_a_file(tmp_path):
    """`python - < script.py` (README's snippet piped in): each forked or spawned worker
    imports the main module again from its file, '<stdin>', which is none. The workers
    failed with "Nanny failed to start", the message of a missing __main__ guard, which
    did not help. The cluster is refused before any worker starts, saying what to do."""
    import subprocess
    import sys

    script = (
        "import laminar.cluster\n"
        "from laminar.errors import ClusterError\n"
        "try:\n"
        "    laminar.cluster.local_cluster(1)\n"
        "except ClusterError as e:\n"
        "    print('refused:', e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-"],
        input=script,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("refused: ") and "'<stdin>'" in r.stdout, r.stdout
    assert "save the script to a file" in r.stdout, r.stdout


def test_a_script_that_starts_a_cluster_unguarded_is_told_of_the_main_guard(tmp_path):
    """Each worker process imports the script again (spawn, forkserver): one that starts
    a local cluster at its top level fails in each, and the error named only the cluster
    settings; Python's own word on it was in Dask's log above (helper 186)."""
    import subprocess
    import sys

    script = tmp_path / "noguard.py"
    script.write_text("import laminar.cluster\nlaminar.cluster.local_cluster(n_rollouts=1)\n")
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode != 0
    assert "the local cluster did not start" in out.stderr
    assert f"from a script ({script}): start the cluster, and the run, under `if __name__ ==" in (
        out.stderr
    )


def _caller_of():
    """An actor that calls another's ``add`` in a thread and keeps what its process's
    ``tornado.application`` logger emits (made in a function: pickled by value)."""

    class Caller:
        def __init__(self, counter):
            import logging

            self.counter, self.emitted, self.outcome = counter, [], []
            emitted = self.emitted

            class Keep(logging.Handler):
                def emit(self, record):
                    emitted.append(record.getMessage()[:300])

            logging.getLogger("tornado.application").addHandler(Keep())

        def call(self):
            import threading

            def go():
                try:
                    self.outcome.append(repr(self.counter.add(2).result(timeout=60)))
                except Exception as e:  # noqa: BLE001 — kept for the test to read
                    self.outcome.append(repr(e))

            threading.Thread(target=go, daemon=True).start()

        def calls_in_flight(self):
            import asyncio

            from distributed import get_worker

            loop = get_worker().loop.asyncio_loop
            return sum("wait_then_set_result" in repr(t) for t in asyncio.all_tasks(loop))

        def handle_status(self):
            return self.counter._future.status

        def seen(self):
            return list(self.emitted)

    return Caller


@pytest.mark.slow
def test_a_call_to_a_lost_and_released_actor_logs_no_traceback():
    """A call from a worker to an actor whose worker died retries its connection, then
    awaits the actor's creating future, which the run cancels as it releases the lost
    actor; ``distributed`` re-raises that cancellation in a callback no one awaits, and
    tornado logged it as an ERROR with a 60-line traceback per call in flight (a soak's
    terminal, a recovered run's). Importing laminar.actors drops that report alone."""
    import signal

    import dask
    from distributed import Client

    from laminar.cluster import role_cluster, start_actor

    Counter, _ = _counter_and_holder()
    Caller = _caller_of()
    with (
        dask.config.set({"distributed.comm.timeouts.connect": "2s"}),
        role_cluster({"a": {"data": 1}, "b": {"rollout": 1}}, name="lost-call") as cluster,
        Client(cluster) as client,
    ):
        (a,), (b,) = workers_with(client, "data"), workers_with(client, "rollout")
        created = start_actor(client, Counter, worker=a, resource="data")
        counter = bind_actor(client, Counter, a, created)
        caller = bind_actor(
            client, Caller, b, start_actor(client, Caller, counter, worker=b, resource="rollout")
        )
        os.kill(client.run(os.getpid, workers=[a])[a], signal.SIGKILL)
        caller.call().result()
        assert caller.calls_in_flight().result() == 1
        time.sleep(0.5)
        client.cancel(created)  # as a run releases a lost actor
        del counter, created
        deadline = time.monotonic() + 30
        while caller.calls_in_flight().result() and time.monotonic() < deadline:
            time.sleep(0.5)
        # the call ended by the path the report comes from: its handle's future cancelled
        assert caller.calls_in_flight().result() == 0
        assert caller.handle_status().result() == "cancelled"
        assert caller.seen().result() == []


@pytest.mark.slow
def test_a_roles_workers_are_placed_in_the_order_of_their_names():
    """Rollout r0 goes to the worker named ``rollout-0``, r1 to ``rollout-1``, ... (numbers
    by value), whatever their ports: sorted by address, a user who killed the worker
    named ``rollout-1`` to drill a loss read that r0 was lost. (Four workers: their ports
    fall in the names' order one time in 24.)"""
    from distributed import Client

    from laminar.cluster import role_cluster, scheduler_workers

    names = ["rollout-10", "rollout-2", "rollout-0", "rollout-1"]
    with (
        role_cluster({n: {"rollout": 1} for n in names}, name="by-name") as cluster,
        Client(cluster) as client,
    ):
        info = scheduler_workers(client)
        placed = place(client, "rollout", 4)
        assert [info[a]["name"] for a in placed] == [
            "rollout-0",
            "rollout-1",
            "rollout-2",
            "rollout-10",
        ]
        assert workers_with(client, "rollout") == placed


@pytest.mark.slow
def test_ctrl_c_while_a_local_cluster_starts_closes_it_then_stops(capfd, monkeypatch):
    """Interrupted part-way, a SpecCluster was neither returned nor closed: Python's exit
    closed it in an atexit hook that failed (``AssertionError: Status.init``) beside its
    half-started workers' tracebacks, ~70 lines under "laminar: interrupted". The stop is
    held until the cluster is built, said at once, and the cluster closed before the
    interrupt goes on: nothing of it is left (this suite's leak check)."""
    import signal

    import distributed
    from distributed.deploy.spec import SpecCluster

    from laminar.cluster import role_cluster

    class CtrlCAsItStarts(SpecCluster):  # (Ctrl-C the moment the cluster is being built)
        def __init__(self, *args, **kwargs):
            signal.raise_signal(signal.SIGINT)
            super().__init__(*args, **kwargs)

    before = set(SpecCluster._instances)
    monkeypatch.setattr(distributed, "SpecCluster", CtrlCAsItStarts)
    with pytest.raises(KeyboardInterrupt):
        role_cluster({"a": {"rollout": 1}, "b": {"trainer": 1}}, name="interrupted")
    assert "stopping once the local cluster has started, then closing it" in capfd.readouterr().err
    left = [c for c in set(SpecCluster._instances) - before if c.status.name != "closed"]
    assert not left, left


@pytest.mark.slow
def test_the_rendezvous_port_stays_taken_until_rank_0_is_done(cluster_client):
    """The rendezvous chose a free port on rank 0's worker and closed it again, for rank 0
    to bind seconds later: another process of a shared node could take it meanwhile, and
    rank 0's start failed (EADDRINUSE). The port now listens from the moment it is chosen
    (the ranks join through it) until rank 0 closes it."""
    import datetime
    import socket
    from urllib.parse import urlparse

    import torch.distributed as dist

    from laminar.trainer_ranks import close_rendezvous, rendezvous

    def _rendezvous_ports() -> list[int]:  # (a local: a worker cannot import tests/)
        from laminar.trainer_ranks import _STORES

        return sorted(_STORES)

    worker = place(cluster_client, "trainer", 1)[0]
    init = rendezvous(cluster_client, worker)
    at = urlparse(init)
    with socket.socket() as s, pytest.raises(OSError):  # (the LocalCluster: this machine)
        s.bind(("", at.port))
    joined = dist.TCPStore(at.hostname, at.port, None, False, timeout=datetime.timedelta(30))
    joined.set("rank", "1")
    assert joined.get("rank") == b"1"
    assert at.port in cluster_client.run(_rendezvous_ports, workers=[worker])[worker]
    cluster_client.submit(close_rendezvous, init, workers=[worker], pure=False).result()
    assert at.port not in cluster_client.run(_rendezvous_ports, workers=[worker])[worker]


def test_a_worker_with_two_roles_hosts_the_second_only_where_too_few_have_it_alone(caplog):
    """A path-B worker started with trainer and rollout resources held the trainer and a
    rollout at once whenever its name sorted first, though rollout workers of their own
    stood idle; now it is taken last for the role it is avoided in, and the driver warns
    of each rollout that had to share a core role's worker."""
    import logging

    from distributed import Client, Scheduler, SpecCluster, Worker

    from pipelines.driver import _warn_shared_workers

    def worker(name: str, **resources) -> dict:
        return {"cls": Worker, "options": {"resources": resources, "name": name}}

    spec = {
        "a-both": worker("a-both", data=1, trainer=1, rollout=1),
        "rollout-1": worker("rollout-1", rollout=1),
        "rollout-2": worker("rollout-2", rollout=1),
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    with SpecCluster(workers=spec, scheduler=scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(3)
        names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
        (shared,) = [a for a, n in names.items() if n == "a-both"]
        assert [names[a] for a in place(client, "rollout", 2)][0] == "a-both"  # (by name)
        two = place(client, "rollout", 2, avoid={shared})
        assert [names[a] for a in two] == ["rollout-1", "rollout-2"]
        three = place(client, "rollout", 3, avoid={shared})
        assert three[-1] == shared
        with caplog.at_level(logging.WARNING, logger="laminar"):
            caplog.clear()  # (the in-process cluster's own INFO records)
            _warn_shared_workers([shared], shared, two)
            assert not [r for r in caplog.records if r.name.startswith("laminar")]
            _warn_shared_workers([shared], shared, three)
        (said,) = [r.getMessage() for r in caplog.records if r.name.startswith("laminar")]
        assert f"rollout r2 shares worker {shared} with the trainer rank 0" in said, said


def test_the_rendezvous_of_an_ipv6_worker_is_an_address_its_ranks_can_read():
    """An IPv6 worker's rendezvous was ``tcp://fd00::2:PORT``, whose port no rank could
    read (urlparse raised ValueError, and rank 0's end with it): now bracketed."""
    from types import SimpleNamespace
    from urllib.parse import urlparse

    from laminar.trainer_ranks import rendezvous

    # (a client whose task answers the port: what rank 0's worker would)
    client = SimpleNamespace(submit=lambda *a, **k: SimpleNamespace(result=lambda timeout: 4321))
    for worker, host in (
        ("tcp://[fd00::2]:40000", "fd00::2"),
        ("tls://10.0.0.7:40000", "10.0.0.7"),
    ):
        at = urlparse(rendezvous(client, worker))
        assert (at.hostname, at.port) == (host, 4321)
