"""QuietPacketizer (ssh/sshtransport.py): paramiko's packetizer without a timer thread
for the key exchange, and without keepalives while the host talks."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

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
    p.start_handshake(0.05)
    assert threading.active_count() == before   # paramiko's own started a Timer here
    assert not p.handshake_timed_out()
    time.sleep(0.06)
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
    monkeypatch.setattr("paramiko.packet.Packetizer._check_keepalive",
                        lambda self: checked.append(time.monotonic()))
    monkeypatch.setattr("paramiko.packet.Packetizer.read_message", lambda self: (94, None))
    p._check_keepalive()
    assert len(checked) == 1   # no keepalive asked for: paramiko's check, as before
    p.set_keepalive(0.05, lambda: None)
    p._check_keepalive()
    assert len(checked) == 2   # nothing heard yet
    p.read_message()   # the host said something just now
    p._check_keepalive()
    assert len(checked) == 2
    time.sleep(0.06)
    p._check_keepalive()
    assert len(checked) == 3
