"""Hosts that only a bastion can reach, in network namespaces of their own.

    namespace C ("client")        namespace H ("hidden")
    orch runs here                bastion sshd  10.250.0.2:22  (AllowTcpForwarding yes)
    veth 10.250.0.1/30  <------>  veth 10.250.0.2/30
                                  on H's loopback: hosts 10.250.1.10, .11, ... :22 (one sshd each)

C has no route to 10.250.1.0/24 (and no default route), so a direct connection fails at
once and no packet leaves the two namespaces; the bastion, in H, reaches the hosts. The
root namespace is not touched: no address, route or interface is added there. Needs
root and iproute2. `stop()` ends every sshd (proving the pids are gone) and deletes both
namespaces, which removes their interfaces.
"""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from sshd_cluster import (
    SSHD,
    ClusterError,
    _die_with_parent,
    _keygen,
    _sshd_config,
    end_sshds,
    pid_alive,
)

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
LINK = "10.250.0"        # C <-> H
HIDDEN = "10.250.1"      # the hosts, inside H only


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(argv)}: {result.stderr.strip()}")
    return result


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """Run fn in a thread that has entered namespace ns (a network namespace is per thread)."""
    out: dict[str, Any] = {}

    def body() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                out["error"] = OSError(ctypes.get_errno(), "setns")
                return
        finally:
            os.close(fd)
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            out["error"] = exc
    th = threading.Thread(target=body)
    th.start()
    th.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _accepts(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class HiddenSshd:
    name: str
    address: str
    port: int
    host_key_pub: str
    proc: subprocess.Popen
    home: Path

    @property
    def remote_dir(self) -> Path:
        return self.home / "orch"

    def known_hosts_line(self) -> str:
        name = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        return f"{name} {self.host_key_pub}"


class NetnsCluster:
    def __init__(self, root: Path, n: int = 2) -> None:
        self.root = Path(root).resolve()
        self.n = n
        tag = os.getpid() % 100000
        self.client_ns, self.hidden_ns = f"orch-c{tag}", f"orch-h{tag}"
        self.veth = (f"orchc{tag}", f"orchh{tag}")
        self.client_key = self.root / "client" / "id_ed25519"
        self.known_hosts = self.root / "client" / "known_hosts"
        self.authorized_keys = self.root / "client" / "authorized_keys"
        self.bastion: HiddenSshd | None = None
        self.hosts: list[HiddenSshd] = []
        self.extra: list[HiddenSshd] = []

    # -- lifecycle
    def start(self) -> NetnsCluster:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        self.client_key.parent.mkdir(parents=True, exist_ok=True)
        self.authorized_keys.write_text(_keygen(self.client_key, "orch-netns-client") + "\n")
        try:
            self._network()
            self.bastion = self.spawn("bastion", f"{LINK}.2", forwarding=True)
            self.hosts = [self.spawn(f"host{i}", f"{HIDDEN}.{10 + i}") for i in range(self.n)]
            self.write_known_hosts()
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        c, h = self.veth
        ip("netns", "add", self.client_ns)
        ip("netns", "add", self.hidden_ns)
        ip("link", "add", c, "netns", self.client_ns, "type", "veth", "peer", "name", h,
           "netns", self.hidden_ns)
        ip("addr", "add", f"{LINK}.1/30", "dev", c, ns=self.client_ns)
        ip("link", "set", c, "up", ns=self.client_ns)
        ip("link", "set", "lo", "up", ns=self.client_ns)
        ip("addr", "add", f"{LINK}.2/30", "dev", h, ns=self.hidden_ns)
        ip("link", "set", h, "up", ns=self.hidden_ns)
        ip("link", "set", "lo", "up", ns=self.hidden_ns)
        # the hosts' addresses sit on H's own loopback (no dummy interfaces in this kernel)
        for i in range(self.n + 2):
            ip("addr", "add", f"{HIDDEN}.{10 + i}/32", "dev", "lo", ns=self.hidden_ns)

    def spawn(self, name: str, address: str, forwarding: bool = False) -> HiddenSshd:
        """An sshd inside the hidden namespace on address:22."""
        home = self.root / name
        home.mkdir(parents=True, exist_ok=True)
        pub = _keygen(home / "ssh_host_ed25519_key", f"orch-netns-{name}")
        config = _sshd_config(home, address, 22, self.authorized_keys)
        if forwarding:
            config = config.replace("AllowTcpForwarding no", "AllowTcpForwarding yes")
        (home / "sshd_config").write_text(config)
        with open(home / "sshd.log", "ab") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", self.hidden_ns, SSHD, "-D", "-e", "-f",
                                     str(home / "sshd_config")], stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=log, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        sshd = HiddenSshd(name, address, 22, pub, proc, home)
        deadline = time.monotonic() + 10
        while not in_netns(self.hidden_ns, lambda: _accepts(address, 22)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"sshd {name} on {address}:22 did not start: "
                                   f"{(home / 'sshd.log').read_text()[-1000:]}")
            time.sleep(0.05)
        return sshd

    def add_extra(self, name: str, address: str, forwarding: bool = False) -> HiddenSshd:
        """One more sshd in the hidden namespace (a second bastion, say); stopped by stop()."""
        sshd = self.spawn(name, address, forwarding)
        self.extra.append(sshd)
        self.write_known_hosts()
        return sshd

    def all_sshds(self) -> list[HiddenSshd]:
        return ([self.bastion] if self.bastion else []) + self.hosts + self.extra

    def write_known_hosts(self) -> None:
        self.known_hosts.write_text("".join(s.known_hosts_line() + "\n" for s in self.all_sshds()))

    def stop(self) -> None:
        """Every sshd (and its sessions) ended, then both namespaces deleted; raises if a
        process, a namespace or an interface is left."""
        pids = end_sshds([s.proc for s in self.all_sshds()])
        for ns in (self.client_ns, self.hidden_ns):
            ip("netns", "del", ns, check=False)
        self.bastion, self.hosts, self.extra = None, [], []
        left = [p for p in pids if pid_alive(p)]
        names = ip("netns", "list").stdout
        if left or self.client_ns in names or self.hidden_ns in names:
            raise ClusterError(f"netns cluster left pids {left} / namespaces:\n{names}")
        links = ip("-o", "link", "show").stdout
        if any(v in links for v in self.veth):
            raise ClusterError(f"a veth of the netns cluster is left:\n{links}")

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def run_in_client(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
        """A command in the client namespace (where orch runs)."""
        return subprocess.run(["ip", "netns", "exec", self.client_ns, *argv], **kw)

    def popen_in_client(self, argv: list[str], **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.client_ns, *argv], **kw)

    def established(self, address: str, port: int = 22) -> int:
        """TCP connections established to address:port, seen from the hidden namespace."""
        out = subprocess.run(["ip", "netns", "exec", self.hidden_ns, "ss", "-Htn", "state",
                              "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, check=True).stdout
        return sum(1 for line in out.splitlines() if line.split()[2] == f"{address}:{port}")
