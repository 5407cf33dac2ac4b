"""QuietPacketizer (ssh/sshtransport.py): paramiko's packetizer without a timer thread
for the key exchange, and without keepalives while the host talks."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from paramiko.packet import Packetizer

from orchestrator.ssh.sshtransport import QuietPacketizer


@pytest.fixture
def packetizer() -> Iterator[QuietPacketizer]:
    a, b = socket.socketpair()
    try:
        yield QuietPacketizer(a)
    finally:
        a.close()
        b.close()


def test_the_key_exchange_deadline_needs_no_thread(packetizer: QuietPacketizer) -> None:
    p = packetizer
    assert not p.handshake_timed_out()   # not started: never timed out
    before = threading.active_count()
    p.start_handshake(0.5)   # long enough that a loaded machine does not pass it here
    assert threading.active_count() == before   # paramiko's own started a Timer here
    assert not p.handshake_timed_out()
    time.sleep(0.55)
    assert p.handshake_timed_out()
    p.complete_handshake()
    assert not p.handshake_timed_out()


def test_no_keepalive_while_the_host_talks(packetizer: QuietPacketizer,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A packet in within the period holds paramiko's keepalive check back; after a
    period of silence both ways, paramiko's own check runs (and sends when nothing went
    out either)."""
    p = packetizer
    checked: list[float] = []
    # paramiko's own methods stubbed for this packetizer only: another test's transport
    # thread still ending in this process calls them too (CI counted one such call)
    check, read = getattr(Packetizer, "_check_keepalive"), Packetizer.read_message  # noqa: B009
    monkeypatch.setattr(Packetizer, "_check_keepalive", lambda self: checked.append(
        time.monotonic()) if self is p else check(self))
    monkeypatch.setattr(Packetizer, "read_message",
                        lambda self: (94, None) if self is p else read(self))
    p._check_keepalive()
    assert len(checked) == 1   # no keepalive asked for: paramiko's check, as before
    p.set_keepalive(0.5, lambda: None)   # as above
    p._check_keepalive()
    assert len(checked) == 2   # nothing heard yet
    p.read_message()   # the host said something just now
    p._check_keepalive()
    assert len(checked) == 2
    time.sleep(0.55)
    p._check_keepalive()
    assert len(checked) == 3
