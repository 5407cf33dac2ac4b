"""Shared fixtures: a session-wide fake SSH cluster (tests/sshd_cluster.py), the `jobs`
teardown; the markers. Helper functions are in tests/helpers.py."""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

from helpers import TORCHRUN_VARS, Jobs
from sshd_cluster import FakeHost, SshdCluster, free_port, loopback, pid_alive

CLUSTER_SIZE = 4

# Fuzz tests scale their document counts with the profile's max_examples: `make test` runs
# "full"; `make test-fast` passes --hypothesis-profile=fast, a quarter of it.
settings.register_profile("full", max_examples=400)
settings.register_profile("fast", max_examples=100)
settings.load_profile("full")


def pytest_configure(config: pytest.Config) -> None:
    # Started in the background by a non-interactive shell (`bash .ci/run &`), pytest
    # inherits SIGINT ignored, and so would every orch it starts: the tests that press
    # Ctrl-C on orch (a SIGINT) would test nothing. A handler here becomes the default
    # action in each child at exec.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # orch keeps the agent's bundle in the user's cache folder (remote/bundlecache.py):
    # the tests' orch keeps it in this run's own folder (pytest-xdist's workers inherit
    # it), never in the home folder, and the folder goes when the run ends
    if "ORCH_CACHE_DIR" not in os.environ:
        cache = tempfile.mkdtemp(prefix="orch-test-cache-")
        os.environ["ORCH_CACHE_DIR"] = cache
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
    config.addinivalue_line(
        "markers", "ssh: end-to-end test against the fake sshd cluster (slow)")
    config.addinivalue_line(
        "markers", "timing: waits on real time or real processes without sshd "
        "(`make test-stress` runs these and the ssh tests beside a CPU burner)")


# The markers follow from the fixtures a test uses (directly or through another fixture):
# one that starts sshd makes it an `ssh` test; one that runs a whole job or trains makes
# it `slow`. A test that does either without these fixtures is marked by hand, and so is
# one that starts a training program in a new process (its torch import alone is 3 s of
# CPU here).
SSHD_FIXTURES = {"sshd_cluster", "untrusted_host", "netns", "big_cluster"}
JOB_FIXTURES = {"jobs", "pushed", "torchrun"}
# `timing`: the modules without sshd whose tests wait on real time (fake agents' real
# waits, watchdogs, hangs) or on local processes (agents over pipes, warm supervisors):
# with `ssh`, what a busy machine can break (`make test-stress`)
TIMING_MODULES = {
    "test_warm", "test_host_paths", "test_hang_attach", "test_hang_units", "test_rootcause",
    "test_interrupt_units", "test_hostfaults_units", "test_phasefaults_units",
    "test_setupexec", "test_session", "test_controller_fake", "test_pipes_units",
    "test_network_units",
}


# tryfirst: before pytest's -m selection and before pytest-xdist reads the xdist_group marks
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test-fast` leaves out `ssh` and `slow` tests; `make test-stress` runs `ssh`
    and `timing`. For pytest-xdist (`make test`), a module with a fixture of its own
    that lives longer than a test is one xdist_group, and the costly tests come first."""
    _mark(items)
    if config.getoption("loadgroup", default=False):   # set in an xdist worker only
        for item in items:
            _name_the_group(item)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_cost_rank)


def _mark(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & SSHD_FIXTURES:
            item.add_marker(pytest.mark.ssh)
        if used & JOB_FIXTURES:
            item.add_marker(pytest.mark.slow)
        if item.path.stem in TIMING_MODULES:
            item.add_marker(pytest.mark.timing)
        if item.get_closest_marker("gpu") is not None:
            # one worker, in file order: a CUDA context in one test process would take
            # GPU 0 from another's orch up (test_gpu.py runs its orch up ones first)
            item.add_marker(pytest.mark.xdist_group("gpu"))
        elif _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


def _name_the_group(item: pytest.Item) -> None:
    """`--dist loadgroup` sends the tests whose nodeid ends in the same `@group` to one
    worker. pytest-xdist 3.8 adds that suffix by setting item._nodeid, which pytest 9.2
    no longer reads (the id is item._id, a NodeId): every group was then split over the
    workers, and a module's fixture built once in each. With such a pytest the suffix is
    set here, as xdist would; with one xdist can name, xdist does it."""
    mark = item.get_closest_marker("xdist_group")
    node_id: Any = getattr(item, "_id", None)   # a slot of pytest 9.2's Node; absent before
    if mark is None or not hasattr(node_id, "parse") or "@" in str(node_id):
        return
    group = mark.args[0] if mark.args else mark.kwargs.get("name", "default")
    item._id = type(node_id).parse(f"{node_id}@{group}")


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a module-scoped fixture (its own sshd cluster, namespaces, a
    trained model): under `--dist loadgroup` the module's tests then run in one worker,
    which sets it up once, instead of once in every worker that gets one of its tests."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope == "module" for chain in defs for d in chain)


def _cost_rank(item: pytest.Item) -> int:
    """xdist hands out work in collection order (`--no-loadscope-reorder`): the likely
    long units first (a module's group, then jobs over sshd, sshd, jobs, real waits), the
    many short unit tests last, where they fill the gaps. The sort is stable: a module's
    tests keep their order."""
    marks = {m.name for m in item.iter_markers()}
    for rank, need in enumerate(({"xdist_group"}, {"ssh", "slow"}, {"ssh"}, {"slow"},
                                 {"timing"})):
        if need <= marks:
            return rank
    return 5


@pytest.fixture(autouse=True, scope="session")
def _isolated_orch_env() -> Iterator[None]:
    """orch must not read the user's ~/.ssh/config nor colour its output in tests."""
    saved = {k: os.environ.get(k) for k in ("ORCH_SSH_CONFIG", "ORCH_NO_COLOR")}
    os.environ["ORCH_SSH_CONFIG"] = os.devnull
    os.environ["ORCH_NO_COLOR"] = "1"
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def sshd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """4 sshd hosts on 127.0.0.2-5 (a port free on all of them, plus room for the
    untrusted host; in a pytest-xdist worker, that worker's addresses: loopback_net).
    Session-wide (one per worker): tests must not stop it or leave hosts paused."""
    port = free_port([loopback(2 + i) for i in range(CLUSTER_SIZE + 2)])
    cluster = SshdCluster(tmp_path_factory.mktemp("sshd"), CLUSTER_SIZE, port=port).start()
    yield cluster
    pids = [h.pid for h in cluster.all_hosts()]
    cluster.stop()
    assert not [p for p in pids if pid_alive(p)], "an sshd of the fake cluster survived"


@pytest.fixture(autouse=True)
def _torch_on_one_thread() -> None:
    """The tests that call torch in this process do so on tiny tensors, beside another
    pytest worker or a job on the same cores: torch's own thread pool would only spin
    against them (a MobileNet forward at 32 px took 0.9 s of CPU with 2 threads, 0.03 s
    with one). A test that sets the count (worker.distrib does) gets it back to 1 after."""
    torch = sys.modules.get("torch")   # never imported for this: most tests do not need it
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _resume_paused_hosts(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails between pause() and resume() must not hang every later test."""
    yield
    if "sshd_cluster" in request.fixturenames:
        for host in request.getfixturevalue("sshd_cluster").all_hosts():
            if host.paused:
                host.resume()


@pytest.fixture(scope="session")
def untrusted_host(sshd_cluster: SshdCluster) -> FakeHost:
    """A running sshd whose host key is NOT in the cluster's known_hosts."""
    return sshd_cluster.add_host(trusted=False)


@pytest.fixture
def jobs(request: pytest.FixtureRequest) -> Iterator[Jobs]:
    """Register every job a test starts: at teardown, what is left of it is stopped and
    the test fails (unless it already failed for another reason)."""
    failed_before = request.session.testsfailed
    registry = Jobs()
    yield registry
    problems = registry.cleanup()
    # A test that already failed has said what went wrong; its leftovers are cleaned anyway.
    if request.session.testsfailed == failed_before:
        assert not problems, "\n".join(problems)


@pytest.fixture
def single(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun variables: worker.train runs as one process, without a process group.
    OMP_NUM_THREADS=1 all the same: worker.distrib sets torch's threads from it, else from
    the cores, and in this process beside other workers 2 threads only spun against them
    (4 epochs of LeNet at 16 px: 17.5 s of CPU with 2, 3.9 s with 1, the same losses)."""
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
