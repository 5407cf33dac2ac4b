"""Ctrl-C on an attached `orch up`, over in-process fake agents (no SSH, no waits): the
first Ctrl-C stops every host with the grace period, a second one kills at once without
waiting for it; an interrupted `up` pulls nothing (a job that ends does)."""
from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fake_agent import FakeChannel, FakeTransport, later
from helpers import sigint_raises
from orchestrator import cli
from orchestrator.api import launching
from orchestrator.api.outcomes import UpHost, UpResult
from orchestrator.commands import up as up_cmd
from orchestrator.config.inventory import parse
from orchestrator.errors import EXIT_INTERRUPTED, EXIT_OK
from orchestrator.session.replies import Supervisor
from orchestrator.session.session import Session
from orchestrator.session.state import HostState, JobState
from orchestrator.ui import console
from orchestrator.wire import protocol, timeouts

SUP = Supervisor(1, 1, None, 2, "run", 0.0)   # a launched host's supervisor

INVENTORY = """name: ctrlc
hosts:
  - {address: localhost, connection: local, remote_dir: /r0, procs: 2}
  - {address: 127.0.0.1, connection: local, remote_dir: /r1, procs: 2}
job: {entrypoint: job.py}
"""


class Hosts:
    """Two fake hosts whose ranks run until a stop ends them. `presses` Ctrl-Cs: the
    first once every rank is up, the second once the first (graceful) stop reached a
    host. A graceful stop's ranks ignore SIGTERM: it ends only when a kill comes (or
    after 60 s). Every request and reply in `log`, in order."""

    def __init__(self, presses: int) -> None:
        self.presses, self.lock = presses, threading.Lock()
        self.log: list[tuple] = []
        self.killed = {0: threading.Event(), 1: threading.Event()}   # per host
        self.ended = threading.Event()
        self.up = 0

    def note(self, *what: object) -> None:
        with self.lock:
            self.log.append(what)

    def ctrl_c(self) -> None:
        later(0.05, lambda: os.kill(os.getpid(), signal.SIGINT))

    def follow(self, chan: FakeChannel, msg: dict) -> None:
        self.note(chan.host.index, "follow")
        for r in msg["ranks"]:
            chan.push(protocol.output(r, b"rank %d up\n" % r))
        with self.lock:
            self.up += 1
            everyone = self.up == 2
        if everyone and self.presses:
            self.ctrl_c()

        def end() -> None:
            self.ended.wait(60)
            code = -9 if self.killed[chan.host.index].is_set() else (0 if not self.presses else -15)
            for r in msg["ranks"]:
                chan.push(protocol.event("exit", rank=r, code=code, time=time.time()))
            chan.push(protocol.event("done", code=0 if code == 0 else 1, time=time.time()))
        threading.Thread(target=end, daemon=True).start()
        if not self.presses:   # the job ends by itself
            later(0.1, self.ended.set)

    def stop(self, chan: FakeChannel, msg: dict) -> None:
        host, grace = chan.host.index, msg["grace"]
        self.note(host, "stop", grace)
        if grace == 0:
            self.killed[host].set()
            self.ended.set()
            self.note(host, "stopped", grace)
            chan.push(protocol.reply(msg["id"], {"found": 2, "killed": 2, "left": [],
                                                 "seconds": 0.0}))
            return
        with self.lock:
            first = sum(1 for e in self.log if e[1] == "stop") == 1
        if first and self.presses >= 2:
            self.ctrl_c()

        def graceful() -> None:
            if self.presses >= 2:
                self.killed[host].wait(60)   # SIGTERM ignored: only this host's kill ends them
            self.ended.set()
            self.note(host, "stopped", grace)
            chan.push(protocol.reply(msg["id"], {"found": 2, "killed": 0, "left": [],
                                                 "seconds": 0.1}))
        threading.Thread(target=graceful, daemon=True).start()

    def pull_manifest(self, chan: FakeChannel, msg: dict) -> None:
        # the curves' live fetch (its globs) is not the pull these tests are about
        self.note(chan.host.index, "curves_manifest" if "globs" in msg else "pull_manifest")
        chan.push(protocol.reply(msg["id"], {"root": msg.get("root", "/"), "files": 0,
                                             "bytes": 0, "skipped": [], "skipped_count": 0}))

    def handlers(self) -> dict:
        return {"follow": self.follow, "stop": self.stop, "pull_manifest": self.pull_manifest}

    def requests(self, kind: str) -> list[tuple]:
        return [e for e in self.log if e[1] == kind]


def run_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hosts: Hosts) -> int:
    """`orch up` (attached) whose start is over the fake hosts: what follows the start
    (attach, Ctrl-C, the pull at the end) is the command's own."""
    path = tmp_path / "cluster.yaml"
    path.write_text(INVENTORY)
    cluster = parse(INVENTORY, path)
    state = JobState("ctrlc", "run", str(path), 0.0, 4, "127.0.0.1", 29500,
                     [HostState(h.index, h.label, f"/r{h.index}/ctrlc", list(h.ranks), 0.0, SUP)
                      for h in cluster.hosts])

    @contextlib.contextmanager
    def start(inventory, **kw) -> Iterator[launching.Started]:
        session = Session(inventory, state,
                          connector=lambda h: FakeTransport(h, hosts.handlers())).open()
        try:
            yield launching.Started(session, state, UpResult(
                job="ctrlc", run_id="run", world_size=4, master_addr="127.0.0.1",
                master_port=29500, hosts=[UpHost(h.label, h.job_dir, h.ranks) for h in state.hosts]))
        finally:
            session.close()
    monkeypatch.setattr(launching, "start", start)   # up.py calls launching.start
    args = cli.parse(["up", "-c", str(path)])   # every flag of `orch up` at its default
    with sigint_raises():
        return up_cmd.run(args)


def test_a_second_ctrl_c_kills_at_once_without_the_grace_period(tmp_path: Path, capsys,
                                                               monkeypatch) -> None:
    """The first Ctrl-C's stop (grace INTERRUPT_GRACE) does not end: the ranks ignore
    SIGTERM. The second Ctrl-C sends a kill (grace 0) to every host while it is under
    way; the graceful stops end only because of it."""
    hosts = Hosts(presses=2)
    code = run_up(tmp_path, monkeypatch, hosts)
    err = capsys.readouterr().err
    assert code == EXIT_INTERRUPTED, err
    assert "interrupted: stopping job 'ctrlc'" in err and "killing every process of the job now" in err
    for host in (0, 1):
        mine = [e[1:] for e in hosts.log if e[0] == host and e[1] in ("stop", "stopped")]
        # the kill went out and was done before the graceful stop ended on this host
        assert mine == [("stop", timeouts.INTERRUPT_GRACE), ("stop", 0), ("stopped", 0),
                        ("stopped", timeouts.INTERRUPT_GRACE)], hosts.log
    assert not hosts.requests("pull_manifest"), hosts.log


@pytest.mark.parametrize("presses", [1, 0], ids=["ctrl-c", "job-ends"])
def test_ctrl_c_pulls_nothing(tmp_path: Path, capsys, monkeypatch, presses: int) -> None:
    """Interrupted: every host stopped once, gracefully; no pull is asked of any host and
    no outputs/ folder is made. The same `up` whose job ends pulls rank 0's output/ (the
    pull is there to be seen)."""
    hosts = Hosts(presses=presses)
    code = run_up(tmp_path, monkeypatch, hosts)
    err = capsys.readouterr().err
    if presses:
        assert code == EXIT_INTERRUPTED, err
        assert sorted(e[:3] for e in hosts.requests("stop")) == [
            (0, "stop", timeouts.INTERRUPT_GRACE), (1, "stop", timeouts.INTERRUPT_GRACE)]
        assert "killing" not in err
        assert hosts.requests("pull_manifest") == [], hosts.log
        assert not (tmp_path / "outputs").exists()
    else:
        assert code == EXIT_OK, err
        assert hosts.requests("stop") == [] and hosts.requests("pull_manifest") == [
            (0, "pull_manifest")], hosts.log


class PipedHosts(Hosts):
    """`orch up | tee log` and one Ctrl-C, which reaches tee too: the pipe's reader
    (`reader`, the read end) is closed when the first stop reaches a host, and each
    host's graceful stop sends a rank's last line, which finds it closed, then answers
    0.3 s after that (a stop takes its time)."""

    def __init__(self, reader: int) -> None:
        super().__init__(presses=1)
        self.reader: int | None = reader

    def stop(self, chan: FakeChannel, msg: dict) -> None:
        with self.lock:
            if self.reader is not None:
                os.close(self.reader)
                self.reader = None
        pushed = chan.push

        def push(frame: bytes) -> None:
            if b'"id"' in frame:   # the stop's reply
                rank = 2 * chan.host.index   # its first rank
                pushed(protocol.output(rank, b"rank %d: terminated\n" % rank))
                deadline = time.monotonic() + 30
                while not console.STDOUT_CLOSED.is_set() and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.3)
            pushed(frame)
        chan.push = push   # type: ignore[method-assign,assignment]
        super().stop(chan, msg)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_pipe_closed_by_the_ctrl_c_does_not_cut_the_stop_short(
        tmp_path: Path, capsys, monkeypatch) -> None:
    """The Ctrl-C's stop runs to its end on every host although the rank lines written
    during it find stdout closed: that closed pipe is no second interrupt (it ended the
    stop half done, orch exited without a word, and the job ran on)."""
    r, w = os.pipe()
    raw = open(w, "wb", buffering=0)  # noqa: SIM115 (closed in the finally below)
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(
        console._Guarded(raw, is_stdout=True), write_through=True))  # type: ignore[type-var]
    monkeypatch.setattr(console, "_INTERRUPTING", threading.Event())
    console._INTERRUPTING.set()
    hosts = PipedHosts(reader=r)

    @contextlib.contextmanager
    def orch_handlers() -> Iterator[None]:   # the `orch` command's own, not Python's
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM,
                                                         signal.SIGHUP)}
        signal.signal(signal.SIGINT, signal.default_int_handler)
        cli.interrupt_on_termination()
        try:
            yield
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
    monkeypatch.setattr(sys.modules[__name__], "sigint_raises", orch_handlers)
    console.new_command()
    try:
        with contextlib.suppress(KeyboardInterrupt):   # cli() makes it 141
            run_up(tmp_path, monkeypatch, hosts)
        closed = console.STDOUT_CLOSED.is_set()
    finally:
        console.stop_interrupting()
        console.STDOUT_CLOSED.clear()
        raw.close()
    assert closed   # the rank's last line found the pipe closed
    # one graceful stop per host, and no kill: the closed pipe was no second Ctrl-C
    assert sorted(hosts.requests("stop")) == [(0, "stop", timeouts.INTERRUPT_GRACE),
                                              (1, "stop", timeouts.INTERRUPT_GRACE)], hosts.log
    stopped = sorted(e[:3] for e in hosts.log if e[1] == "stopped")
    assert stopped == [(0, "stopped", timeouts.INTERRUPT_GRACE),
                       (1, "stopped", timeouts.INTERRUPT_GRACE)], hosts.log
