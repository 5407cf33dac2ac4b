"""Shared fixtures: a session-wide fake SSH cluster (tests/sshd_cluster.py) and helpers
to prove that no process of a job is left behind."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import pytest

from sshd_cluster import FakeHost, SshdCluster, free_port, pid_alive, pids_with_env, ssh_cmd  # noqa: F401

CLUSTER_SIZE = 4


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "ssh: end-to-end test against the fake sshd cluster (slow)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the fake cluster starts sshd: it is an `ssh` test, marked or not
    (`make test-fast` leaves those out)."""
    for item in items:
        if "sshd_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ssh)


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


def _addresses(first_octet: int, count: int) -> list[str]:
    return [f"127.0.0.{first_octet + i}" for i in range(count)]


@pytest.fixture(scope="session")
def sshd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """4 sshd hosts on 127.0.0.2-5 (a port free on all of them, plus room for the
    untrusted host). Session-wide: tests must not stop it or leave hosts paused."""
    port = free_port(_addresses(2, CLUSTER_SIZE + 2))
    cluster = SshdCluster(tmp_path_factory.mktemp("sshd"), CLUSTER_SIZE, port=port).start()
    yield cluster
    pids = [h.pid for h in cluster.all_hosts()]
    cluster.stop()
    assert not [p for p in pids if pid_alive(p)], "an sshd of the fake cluster survived"


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


def write_job(tmp_path: Path, source: str, name: str = "job.py") -> Path:
    """Write a job script (dedented by the caller if needed) and return its path."""
    path = Path(tmp_path) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return path


def wait_until(predicate: Callable[[], object], timeout: float, what: str,
               step: float = 0.05) -> object:
    """Poll until predicate() is truthy; its value, or AssertionError after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def kill_all(pids_by_host: dict) -> None:
    """SIGKILL every pid of {host: [pids]} (a test's own leftovers, after it failed)."""
    for pids in pids_by_host.values():
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
