"""Hosts each in a network namespace of its own, behind a cable (a veth pair) that a
test can pull out and plug back in, one host at a time.

    namespace C ("client": orch runs here)      namespace H<i> (host i)
    veth c<i>  10.251.<i>.1/30  <------------>  veth h<i>  10.251.<i>.2/30, sshd on :22

C forwards between the hosts (torchrun's rendezvous). `cut(i)` takes h<i> down:
packets to host i are dropped (no reset, no error: TCP waits, as over a dead link),
the other hosts are untouched; `restore(i)` brings it back.
`pause(i)`/`resume(i)` SIGSTOP/SIGCONT host i's sshd and everything under it. The root
namespace is not touched. Needs root and iproute2. `stop()` ends every sshd (proving the
pids are gone) and deletes the namespaces, which removes their veths.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netns_cluster import _accepts, in_netns, ip
from sshd_cluster import (
    SSHD,
    ClusterError,
    _die_with_parent,
    _keygen,
    _signal,
    _sshd_config,
    descendants_of,
    end_sshds,
    pid_alive,
)

NET = "10.251"


@dataclass
class NsHost:
    index: int
    ns: str
    veth: tuple[str, str]          # (client side, host side)
    address: str
    home: Path
    host_key_pub: str
    proc: subprocess.Popen | None = None
    paused: list[int] = field(default_factory=list)

    @property
    def remote_dir(self) -> Path:
        return self.home / "orch"

    @property
    def port(self) -> int:
        return 22

    def known_hosts_line(self) -> str:
        return f"{self.address} {self.host_key_pub}"


class NsHosts:
    def __init__(self, root: Path, n: int = 2) -> None:
        self.root = Path(root).resolve()
        tag = os.getpid() % 100000
        self.client_ns = f"orch-fc{tag}"
        self.client_key = self.root / "client" / "id_ed25519"
        self.known_hosts = self.root / "client" / "known_hosts"
        self.authorized_keys = self.root / "client" / "authorized_keys"
        self.hosts = [NsHost(i, f"orch-fh{tag}-{i}", (f"ofc{tag}x{i}", f"ofh{tag}x{i}"),
                             f"{NET}.{i}.2", self.root / f"host{i}", "") for i in range(n)]

    # -- lifecycle
    def start(self) -> NsHosts:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        self.client_key.parent.mkdir(parents=True, exist_ok=True)
        self.authorized_keys.write_text(_keygen(self.client_key, "orch-fault-client") + "\n")
        try:
            ip("netns", "add", self.client_ns)
            ip("link", "set", "lo", "up", ns=self.client_ns)
            # the hosts reach each other (torchrun's rendezvous) through C, which forwards
            subprocess.run(["ip", "netns", "exec", self.client_ns, "sysctl", "-qw",
                            "net.ipv4.ip_forward=1"], check=True)
            for h in self.hosts:
                self._wire(h)
                self._spawn(h)
            self.known_hosts.write_text("".join(h.known_hosts_line() + "\n" for h in self.hosts))
        except BaseException:
            self.stop()
            raise
        return self

    def _wire(self, h: NsHost) -> None:
        c, v = h.veth
        ip("netns", "add", h.ns)
        ip("link", "add", c, "netns", self.client_ns, "type", "veth", "peer", "name", v,
           "netns", h.ns)
        ip("addr", "add", f"{NET}.{h.index}.1/30", "dev", c, ns=self.client_ns)
        ip("link", "set", c, "up", ns=self.client_ns)
        ip("addr", "add", f"{h.address}/30", "dev", v, ns=h.ns)
        ip("link", "set", v, "up", ns=h.ns)
        ip("link", "set", "lo", "up", ns=h.ns)
        self._route(h)

    @staticmethod
    def _route(h: NsHost) -> None:
        """To the other hosts through C (the kernel drops it when the veth goes down)."""
        ip("route", "replace", f"{NET}.0.0/16", "via", f"{NET}.{h.index}.1", ns=h.ns)

    def _spawn(self, h: NsHost) -> None:
        h.home.mkdir(parents=True, exist_ok=True)
        h.host_key_pub = _keygen(h.home / "ssh_host_ed25519_key", f"orch-fault-host{h.index}")
        (h.home / "sshd_config").write_text(_sshd_config(h.home, h.address, 22, self.authorized_keys))
        with open(h.home / "sshd.log", "ab") as log:
            h.proc = subprocess.Popen(["ip", "netns", "exec", h.ns, SSHD, "-D", "-e", "-f",
                                       str(h.home / "sshd_config")], stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=log, start_new_session=True,
                                      preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 10
        while not in_netns(h.ns, lambda: _accepts(h.address, 22)):
            if h.proc.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"sshd of host{h.index} did not start: "
                                   f"{(h.home / 'sshd.log').read_text()[-1000:]}")
            time.sleep(0.05)

    # -- faults
    def cut(self, i: int) -> None:
        ip("link", "set", self.hosts[i].veth[1], "down", ns=self.hosts[i].ns)

    def restore(self, i: int) -> None:
        ip("link", "set", self.hosts[i].veth[1], "up", ns=self.hosts[i].ns)
        self._route(self.hosts[i])

    def pause(self, i: int) -> None:
        """SIGSTOP the host's sshd and everything under it (its sessions, the agent)."""
        h = self.hosts[i]
        assert h.proc is not None
        stopped = [h.proc.pid]
        os.kill(h.proc.pid, signal.SIGSTOP)
        while True:   # a process forked between snapshot and signal is caught next pass
            new = [p for p in descendants_of(h.proc.pid) if p not in stopped]
            if not new:
                break
            _signal(new, signal.SIGSTOP)
            stopped.extend(new)
        h.paused = stopped

    def resume(self, i: int) -> None:
        h = self.hosts[i]
        if h.proc is not None:
            _signal(reversed(h.paused + descendants_of(h.proc.pid)), signal.SIGCONT)
        h.paused = []

    def heal(self) -> None:
        """Every cable back in, every host running: a failed test leaves no fault behind."""
        for h in self.hosts:
            if h.paused:
                self.resume(h.index)
            if ip("link", "set", h.veth[1], "up", ns=h.ns, check=False).returncode == 0:
                ip("route", "replace", f"{NET}.0.0/16", "via", f"{NET}.{h.index}.1", ns=h.ns,
                   check=False)

    def stop(self) -> None:
        """Every sshd (and its sessions) ended, then the namespaces deleted; raises if a
        process, a namespace or an interface is left."""
        self.heal()
        procs = [h.proc for h in self.hosts if h.proc is not None]
        pids = end_sshds(procs)
        for ns in [self.client_ns] + [h.ns for h in self.hosts]:
            ip("netns", "del", ns, check=False)
        left = [p for p in pids if pid_alive(p)]
        names = ip("netns", "list").stdout
        links = ip("-o", "link", "show").stdout
        if left or any(h.ns in names for h in self.hosts) or self.client_ns in names:
            raise ClusterError(f"fault hosts left pids {left} / namespaces:\n{names}")
        if any(v in links for h in self.hosts for v in h.veth):
            raise ClusterError(f"a veth of the fault hosts is left:\n{links}")

    def run_in_client(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.client_ns, *argv], **kw)

    def popen_in_client(self, argv: list[str], **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.client_ns, *argv], **kw)
