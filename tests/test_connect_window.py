"""What a host may send that the controller has not read is bounded: each channel's
receive window shrinks as the hosts grow (connect.window), so a printer that falls behind
holds at most the budget in this process, and the rest waits on the host, unlost."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from orchestrator.config.inventory import load
from orchestrator.ssh import connect, sshconfig
from orchestrator.ssh.sshtransport import SSHChannel, SSHTransport
from sshd_cluster import SshdCluster

SENT = 4 << 20   # more than any window


@pytest.mark.parametrize(("hosts", "size"), [(1, 2 << 20), (128, 2 << 20),
                                             (1000, (256 << 20) // 1000), (5000, 256 << 10)])
def test_the_window_shrinks_past_128_hosts_within_the_budget(hosts: int, size: int) -> None:
    assert connect.window(hosts) == size
    assert hosts * connect.window(hosts) <= max(connect.WINDOW_BUDGET, hosts * connect.WINDOW_MIN)


def buffered_while_unread(link: SSHTransport, window: int) -> tuple[int, bytes]:
    """A command writes SENT bytes that nobody reads: what this process holds of them
    once half the window has come and a second more has passed (a loaded machine may be
    slow to fill it; an unbounded buffer would keep growing), and all of them once read."""
    chan = link.open(["head", "-c", str(SENT), "/dev/zero"], 30)
    assert isinstance(chan, SSHChannel)
    deadline = time.monotonic() + 60
    while len(chan.chan.in_buffer) <= window // 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)
    held = len(chan.chan.in_buffer)
    got = bytearray()
    while len(got) < SENT:
        piece = chan.chan.recv(1 << 16)
        if not piece:
            break
        got += piece
    return held, bytes(got)


def test_unread_output_is_held_up_to_the_window_and_none_is_lost(
        sshd_cluster: SshdCluster, tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("")
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=sshd_cluster.hosts[:1])
    host = load(inv).hosts[0]
    for hosts in (1, 1000):
        link = connect.connect(host, sshconfig.ssh_config(), tmp_path, hosts=hosts)
        assert isinstance(link, SSHTransport)
        try:
            held, got = buffered_while_unread(link, connect.window(hosts))
        finally:
            link.close()
        assert got == bytes(SENT), f"{len(got)} of {SENT} bytes came back at {hosts} hosts"
        assert connect.window(hosts) // 2 < held <= connect.window(hosts), (hosts, held)
