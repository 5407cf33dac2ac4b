"""A push to a host that goes silent, without SSH: the controller's stall watchdog
(sync.Stall over an in-process fake agent) and the agent's side (a receive stream that
stops half way, one receiver per folder, a full disk), called in this process."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fake_agent import FakeChannel, FakeTransport, Handler
from helpers import FakeClock, wait_until
from orchestrator.agent import files
from orchestrator.agent.common import AgentError
from orchestrator.agent.ledger import Ledger
from orchestrator.agent.paths import JobDir
from orchestrator.config.inventory import parse
from orchestrator.errors import EXIT_HOST, HostError
from orchestrator.files import sync
from orchestrator.files.localfiles import LocalFile
from orchestrator.remote.link import Link
from orchestrator.wire import protocol, timeouts

INVENTORY = """name: fake
hosts:
  - {address: localhost, connection: local, remote_dir: /r0}
job: {entrypoint: job.py}
"""


class SilentChannel(FakeChannel):
    """A host that takes `accept` bytes of a push, then nothing more (frozen sshd, cut
    link): a write blocks until the connection is closed, as paramiko's does."""

    def __init__(self, *args: Any, accept: int) -> None:
        super().__init__(*args)
        self.accept, self.taken = accept, 0
        self.gone = threading.Event()

    def write(self, data) -> None:
        if self.skip or len(data) + self.taken <= self.accept:
            self.taken += 0 if self.skip else len(data)
            return super().write(data)
        # until the close; the bound is only liveness: stepping a fake clock through
        # PUSH_IDLE took over 30 s of real time at load 15, and a write that ended on its
        # own made the stall look like a broken link
        self.gone.wait(600)
        raise OSError("Socket is closed")

    def close(self) -> None:
        self.gone.set()
        super().close()


def local_file(tmp_path: Path, name: str, size: int) -> LocalFile:
    path = tmp_path / name
    data = os.urandom(size)
    path.write_bytes(data)
    return LocalFile(name, str(path), size, 0o644, hashlib.sha256(data).hexdigest())


def blocked_in(thread: threading.Thread, caller: str) -> bool:
    """`thread` waits on an Event (its innermost frame is threading's) called from
    a function named `caller`."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None or frame.f_code.co_filename != threading.__file__:
        return False
    while frame is not None and frame.f_code.co_filename == threading.__file__:
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == caller


def silent_link(tmp_path: Path, accept: int) -> tuple[Link, SilentChannel]:
    host = parse(INVENTORY, tmp_path / "cluster.yaml").hosts[0]
    def ignore(chan: FakeChannel, msg: dict) -> None:
        pass
    # takes the stream (its file and end messages too), never answers
    handlers: dict[str, Handler] = {"receive": ignore, "file": ignore, "end": ignore}
    transport = FakeTransport(host, handlers)
    chan = SilentChannel(host, handlers, accept=accept)
    transport.channel = chan
    link = Link(transport)
    link.start(5)
    return link, chan


@pytest.mark.parametrize("accept", [200_000, 1 << 30], ids=["mid-stream", "after-the-stream"])
def test_a_push_to_a_silent_host_ends_after_push_idle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     accept: int) -> None:
    """Blocked in a send (the host took no more) or waiting for a reply that never
    comes: the push ends after PUSH_IDLE (20 s, on a fake clock: no real wait) with the
    host's name, not after SYNC; not a check before."""
    link, chan = silent_link(tmp_path, accept)
    # started after the link's hello: its last_seen is a real-clock stamp, and a fake
    # clock started before a slow start (seconds at load 15) would read it in the future
    clock = FakeClock()
    monkeypatch.setattr(timeouts, "CLOCK", clock)
    local = [local_file(tmp_path, f"f{i}", 300_000) for i in range(4)]
    caught: list[BaseException] = []

    def push() -> None:
        try:
            sync.push(link, "/r0/fake/data", local, remote={})
        except BaseException as e:
            caught.append(e)
    pusher = threading.Thread(target=push, daemon=True)
    pusher.start()
    clock.wait_for_checks(1)
    # the sender is stuck (its last progress counted): in a write the host does not
    # take, or waiting for the reply after the stream
    wait_until(lambda: blocked_in(pusher, "write" if accept < 1 << 30 else "stream_and_wait"),
               10, "the push to block")
    step = min(0.5, timeouts.PUSH_IDLE / 4)
    for _ in range(int(timeouts.PUSH_IDLE / step) - 1):   # to PUSH_IDLE - step: silent, kept
        clock.step(step, pusher.is_alive)
    assert pusher.is_alive() and not chan.closed, f"ended {caught} before PUSH_IDLE"
    clock.step(2 * step, pusher.is_alive)                 # past PUSH_IDLE: given up
    pusher.join(30)
    assert not pusher.is_alive() and len(caught) == 1, caught
    err = caught[0]
    assert isinstance(err, HostError) and err.exit_code == EXIT_HOST, repr(err)
    assert "localhost: the push to /r0/fake/data stalled" in err.message
    assert "only the rest is sent" in (err.hint or "")
    assert chan.closed, "the stalled host's connection was left open"


def test_a_host_that_keeps_taking_data_is_not_stalled(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Slow is not silent: each send that returns is progress. Sends 0.6 PUSH_IDLE apart
    on a fake clock (five times PUSH_IDLE in all) never fire it; silence then does."""
    link, chan = silent_link(tmp_path, 1 << 30)
    # started after the link's hello: its last_seen is a real-clock stamp, and a fake
    # clock started before a slow start (seconds at load 15) would read it in the future
    clock = FakeClock()
    monkeypatch.setattr(timeouts, "CLOCK", clock)
    stall = sync.Stall(link)
    with stall:
        clock.wait_for_checks(1)
        for _ in range(8):
            clock.step(0.6 * timeouts.PUSH_IDLE, stall.thread.is_alive)
            stall.send(b"x" * 10)
        assert not stall.fired and not chan.closed
        clock.step(1.1 * timeouts.PUSH_IDLE, stall.thread.is_alive)
        stall.thread.join(10)
        assert stall.fired and chan.closed, "a silent host was never given up"


class QuietLink:
    """What a Stall reads of a link: its last frame's time, its transport to close."""

    def __init__(self, name: str) -> None:
        self.name, self.last_seen = name, timeouts.CLOCK.now()
        self.transport = self
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


def test_many_pushes_are_watched_by_one_thread_that_ends_with_the_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """50 pushes at once are one watchdog thread, not 50; the silent one of them is given
    up after PUSH_IDLE alone (the others, still sending, are kept); the thread ends
    with the last push."""
    clock = FakeClock()
    monkeypatch.setattr(timeouts, "CLOCK", clock)
    before = {t.ident for t in threading.enumerate()}
    links = [QuietLink(f"h{i}") for i in range(50)]
    stalls = [sync.Stall(link) for link in links]   # type: ignore[arg-type]
    for s in stalls:
        s.__enter__()
    watcher = stalls[0].thread
    assert all(s.thread is watcher for s in stalls)
    new = [t for t in threading.enumerate() if t.ident not in before]
    assert [t.name for t in new] == ["push-stall"], new
    clock.wait_for_checks(1)
    for _ in range(4):
        clock.step(0.4 * timeouts.PUSH_IDLE, watcher.is_alive)
        for s in stalls[1:]:
            s.sent = clock.now()   # what a send that returned records
    assert stalls[0].fired and links[0].closed.is_set(), "the silent push was kept"
    assert not any(s.fired or link.closed.is_set() for s, link in zip(stalls[1:], links[1:]))
    for s in stalls:
        s.__exit__(None, None, None)
    watcher.join(10)
    assert not watcher.is_alive(), "the watch outlived the last push"


# ---------------------------------------------------------------- the agent's side

def stream_frames(name: str, data: bytes) -> bytes:
    head = protocol.stream_item("file", p=name, s=len(data), h=hashlib.sha256(data).hexdigest(),
                                m=0o644)
    return head + protocol.frame(protocol.DATA, data)


def test_a_stream_that_stops_half_way_ends_the_receiver_and_keeps_what_landed(tmp_path: Path) -> None:
    jd = JobDir(str(tmp_path / "job"))
    whole, half = os.urandom(5000), os.urandom(5000)
    r, w = os.pipe()
    os.write(w, stream_frames("w0/whole.bin", whole) + stream_frames("w0/half.bin", half)[:3000])
    reader = protocol.FrameReader(lambda n: os.read(r, n), caps=protocol.CAPS)
    t0 = time.monotonic()
    try:
        with pytest.raises(files.StreamIdle), files.IdleReader(reader, 0.5) as idle:
            files.receive_into(idle, jd, "data")
    finally:
        os.close(r)
        os.close(w)
    assert 0.4 < time.monotonic() - t0 < 5
    data = tmp_path / "job" / "data"
    assert (data / "w0" / "whole.bin").read_bytes() == whole
    names = [p.name for p in data.rglob("*")]
    assert sorted(names) == ["w0", "whole.bin"], names   # no half file, no staging folder
    assert list(Ledger(jd, "data").manifest()) == ["w0/whole.bin"]


def test_one_receiver_per_folder(tmp_path: Path) -> None:
    jd = JobDir(str(tmp_path / "job"))
    first = files.receive_lock(jd, "data")
    try:
        t0 = time.monotonic()
        with pytest.raises(AgentError) as caught:
            files.receive_lock(jd, "data", wait=0.3)
        assert time.monotonic() - t0 >= 0.3
        assert "still being received" in str(caught.value)
    finally:
        os.close(first)
    os.close(files.receive_lock(jd, "data", wait=0.3))   # free again once the first ended
    fd = os.open(str(tmp_path / "job" / "run" / "data-receive.lock"), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # nothing holds it now
    os.close(fd)


def test_a_full_disk_names_the_file_the_folder_and_the_fix(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    jd = JobDir(str(tmp_path / "job"))
    real_write = os.write

    def full(fd: int, data: Any) -> int:
        if len(data) > 100:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)
    stream = stream_frames("w0/big.bin", os.urandom(4000)) + protocol.stream_item("end", delete=[])
    chunks = iter([stream, b""])
    reader = protocol.FrameReader(lambda n: next(chunks), caps=protocol.CAPS)
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(files.NoSpace) as caught:
        files.receive_into(reader, jd, "data")
    monkeypatch.undo()
    text = str(caught.value)
    assert "no space left on device writing data/w0/big.bin (4000 bytes) into " in text
    assert str(tmp_path / "job" / "data") in text and "bytes free of" in text
    assert "remote_dir" in caught.value.fix   # type: ignore[attr-defined]
    assert not [p for p in (tmp_path / "job" / "data").rglob("*") if p.is_file()]


def test_a_request_queued_behind_a_stuck_writer_fails_once_the_host_is_lost(
        tmp_path: Path) -> None:
    """A writer stuck on a host that takes nothing more holds the link's write lock; a
    request behind it (a stop sent to every host in turn) fails as soon as the host is
    called lost, instead of waiting for the stuck write, which ends only at the close."""
    link, chan = silent_link(tmp_path, accept=0)
    stuck = threading.Thread(target=lambda: suppress_oserror(link.send, b"x" * 1000),
                             daemon=True)
    stuck.start()
    wait_until(lambda: blocked_in(stuck, "write"), 10, "the first write to block")
    caught: list[BaseException] = []

    def stop() -> None:
        try:
            link.submit("stop", job_dir="/r0/fake", grace=1.0)
        except BaseException as e:
            caught.append(e)
    queued = threading.Thread(target=stop, daemon=True)
    queued.start()
    time.sleep(0.2)
    assert queued.is_alive() and not caught, "the request did not wait behind the writer"
    link.lost("no answer for 15 s")
    queued.join(10)
    assert not queued.is_alive() and stuck.is_alive(), "the request waited for the stuck write"
    assert isinstance(caught[0], HostError) and "no answer for 15 s" in caught[0].message
    chan.close()
    stuck.join(10)


def suppress_oserror(send: Any, data: bytes) -> None:
    try:
        send(data)
    except (OSError, HostError):
        pass
