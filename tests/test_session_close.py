"""Session.close on in-process agents: every agent's stdin is closed before any end is
waited for, the waits share one deadline (timeouts.CLOSE in all, not per host), every
connection is closed, and no thread is started per host (at 1,000 hosts a thread each
was the command's peak of threads)."""
from __future__ import annotations

import _thread
import threading
from pathlib import Path
from typing import Any

import pytest

from fake_agent import FakeChannel, FakeTransport
from orchestrator.config.inventory import Host, load
from orchestrator.session.session import Session
from orchestrator.wire import timeouts

HOSTS = 12


class Stubborn(FakeChannel):
    """An agent that does not end when its stdin closes: each wait for it lasts its
    whole timeout, which is recorded."""

    def __init__(self, host: Host, log: list[tuple[str, int, float]]) -> None:
        super().__init__(host, {})
        self.log = log

    def close_stdin(self) -> None:
        self.log.append(("stdin", self.host.index, 0.0))

    def wait_exit(self, timeout: float) -> int | None:
        self.log.append(("wait", self.host.index, timeout))
        threading.Event().wait(timeout)
        return None


def _open(tmp_path: Path) -> tuple[Session, list[tuple[str, int, float]], list[FakeTransport]]:
    """A session over HOSTS fake hosts whose channels log each close and wait."""
    log: list[tuple[str, int, float]] = []
    transports: list[FakeTransport] = []

    def connector(host: Host) -> FakeTransport:
        t = FakeTransport(host, {})
        t.channel = Stubborn(host, log)
        transports.append(t)
        return t
    return Session(load(_inventory(tmp_path)), connector=connector).open(), log, transports


def test_close_waits_by_one_deadline_without_a_thread_per_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeouts, "CLOSE", 0.3)
    session, log, transports = _open(tmp_path)
    assert len(session.links) == HOSTS
    started: list[object] = []
    start_raw, thread_start = _thread.start_new_thread, threading.Thread.start

    def raw(*args: Any) -> int:
        started.append(args)
        return start_raw(*args)

    def start(self: threading.Thread) -> None:
        started.append(self)
        thread_start(self)
    monkeypatch.setattr(_thread, "start_new_thread", raw)
    monkeypatch.setattr(threading.Thread, "start", start)
    session.close()
    assert started == []
    # every stdin closed before the first wait
    kinds = [kind for kind, _, _ in log]
    assert kinds[:HOSTS] == ["stdin"] * HOSTS and set(kinds[HOSTS:]) == {"wait"}
    # the first wait may take the whole bound; each later one only what is left of it,
    # and the first lasted at least its timeout, so nothing is left to wait: CLOSE in all
    # (a wait per host, each of CLOSE, took 12 x 0.3 s here)
    waits = [t for kind, _, t in log if kind == "wait"]
    assert len(waits) == 1 and 0 < waits[0] <= timeouts.CLOSE, waits
    assert all(t.channel.closed for t in transports)


def test_a_dead_link_is_not_waited_for_and_still_closed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    session, log, transports = _open(tmp_path)
    for link in session.links.values():
        link.lost("gone")
    session.close()
    assert [kind for kind, _, _ in log] == ["stdin"] * HOSTS
    assert all(t.channel.closed for t in transports)


def _inventory(tmp_path: Path) -> Path:
    (tmp_path / "job.py").write_text("")
    path = tmp_path / "cluster.yaml"
    path.write_text(f"name: c\nhosts:\n  - node[1-{HOSTS}]\njob:\n  entrypoint: job.py\n")
    return path
