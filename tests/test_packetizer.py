"""QuietPacketizer (ssh/sshtransport.py): paramiko's packetizer without a timer thread
for the key exchange, and without keepalives while the host talks."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from paramiko.message import Message
from paramiko.packet import Packetizer

from orchestrator.ssh.sshtransport import READ_AHEAD, QuietPacketizer


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


class Counted:
    """A socket that counts its recv calls (the writer's end of a socketpair beside)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.recvs = sock, 0

    def recv(self, n: int) -> bytes:
        self.recvs += 1
        return self.sock.recv(n)

    def send(self, data: bytes) -> int:
        return self.sock.send(data)

    def close(self) -> None:
        self.sock.close()


def test_packets_that_arrived_together_are_read_in_one_recv() -> None:
    """paramiko reads each packet in two exact-size recvs; 30 packets in the socket at
    once (within READ_AHEAD) are read, in order and whole, in one (a poll and a recv
    each, with the GIL let go: hundreds of thousands at 1,000 hosts). The end still
    reads as paramiko's EOF."""
    a, b = socket.socketpair()
    counted = Counted(a)
    try:
        writer, reader = Packetizer(b), QuietPacketizer(counted)  # type: ignore[arg-type]
        sent = []
        for i in range(30):
            m = Message()
            m.add_byte(bytes([94]))   # MSG_CHANNEL_DATA's number: any will do unencrypted
            m.add_string(b"x" * (i * 37 % 100))
            writer.send_message(m)
            sent.append(m.asbytes())
        assert len(a.recv(READ_AHEAD, socket.MSG_PEEK)) < READ_AHEAD   # all there, in one
        got = [reader.read_message() for _ in sent]
        assert [bytes([t]) + m.asbytes() for t, m in got] == sent
        assert counted.recvs == 1, counted.recvs
        b.close()
        with pytest.raises(EOFError):
            reader.read_message()
    finally:
        a.close()
        b.close()


def test_a_packet_goes_out_in_one_write_and_a_full_socket_still_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket with a timeout polls before each send (the GIL let go twice); its
    descriptor is non-blocking, so a packet goes out in one write. When the socket's
    buffer is full, the write says so and the socket's own send waits for room: nothing
    is lost or sent twice. A closed socket is never written to by its old number."""
    import os

    from orchestrator.ssh import sshtransport
    a, b = socket.socketpair()
    a.settimeout(5)
    writes: list[int] = []
    real_write, ours = os.write, a.fileno()

    def write(fd: int, data: bytes) -> int:
        if fd == ours:   # (the test's own output may write too)
            writes.append(fd)
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", write)   # the one sshtransport calls
    try:
        sock = sshtransport.ReadAhead(a)
        writer, reader = QuietPacketizer(a), Packetizer(b)
        m = Message()
        m.add_byte(bytes([94]))
        m.add_string(b"hello")
        writer.send_message(m)
        assert writes == [ours]
        assert reader.read_message()[1].asbytes() == m.asbytes()[1:]
        big = os.urandom(4 << 20)   # far past both sockets' buffers
        got = bytearray()

        def drain() -> None:
            time.sleep(0.3)   # meanwhile the buffer fills: the sender waits in send
            while len(got) < len(big):
                got.extend(b.recv(1 << 20))
        reading = threading.Thread(target=drain)
        reading.start()
        view = memoryview(big)
        while view:   # as paramiko's write_all does
            view = view[sock.send(bytes(view[:1 << 20])):]
        reading.join(30)
        assert bytes(got) == big
        written = len(writes)
        a.close()
        with pytest.raises(OSError):
            sock.send(b"x")
        assert len(writes) == written, "a closed socket's number was written to"
    finally:
        a.close()
        b.close()
