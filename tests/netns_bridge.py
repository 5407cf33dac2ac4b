"""Hosts as real machines look to a job: each in a network namespace of its own, with its
own hostname, Debian's stock /etc/hosts line `127.0.1.1 <hostname>`, a docker0 bridge at
172.17.0.1 and two interfaces, of which only one reaches the other hosts.

    namespace C (client: orch runs here)     namespace H<i> (host i: hostname h<i>)
    veth m<i> 10.253.<i>.1/30  <---------->  eth1 10.253.<i>.2/30   sshd on :22 (the
                                             inventory's address; C forwards nothing, so
                                             no host reaches another's eth1)
    namespace S (switch): bridge br0  <--->  eth0 10.252.0.<10+i>/24 (the hosts' own network)
                                             docker0 172.17.0.1/16 (a bridge, no ports)

`firewall(i, ports)`: host i drops every TCP connection to it but to `ports` (iptables
in its namespace; replies of its own connections pass). The root namespace is not
touched. Needs root, iproute2, util-linux's unshare (the hostname) and iptables (the
firewall). `stop()` ends every sshd (proving the pids are gone), deletes the namespaces
(their interfaces go with them) and the /etc/netns/<ns> folders `ip netns exec` reads
/etc/hosts from.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netns_cluster import _accepts, in_netns, ip
from sshd_cluster import (
    SSHD,
    ClusterError,
    _die_with_parent,
    _keygen,
    _sshd_config,
    end_sshds,
    pid_alive,
)

MGMT = "10.253"        # C <-> each host's eth1: the inventory's addresses
LAN = "10.252.0"       # the hosts' own network (eth0, on the bridge in S)


@dataclass
class BridgeHost:
    index: int
    ns: str
    address: str            # eth1: what the inventory names
    lan: str                # eth0: what the hosts use between themselves
    hostname: str
    home: Path
    host_key_pub: str = ""
    proc: subprocess.Popen | None = None

    @property
    def remote_dir(self) -> Path:
        return self.home / "orch"


class BridgeHosts:
    def __init__(self, root: Path, n: int = 3) -> None:
        self.root = Path(root).resolve()
        tag = os.getpid() % 100000
        self.client_ns, self.switch_ns = f"orch-bc{tag}", f"orch-bs{tag}"
        self.client_key = self.root / "client" / "id_ed25519"
        self.known_hosts = self.root / "client" / "known_hosts"
        self.authorized_keys = self.root / "client" / "authorized_keys"
        self.hosts = [BridgeHost(i, f"orch-bh{tag}-{i}", f"{MGMT}.{i}.2", f"{LAN}.{10 + i}",
                                 f"h{tag}-{i}", self.root / f"host{i}") for i in range(n)]
        self.tag = tag

    def start(self) -> BridgeHosts:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        self.client_key.parent.mkdir(parents=True, exist_ok=True)
        self.authorized_keys.write_text(_keygen(self.client_key, "orch-bridge-client") + "\n")
        try:
            for ns in (self.client_ns, self.switch_ns):
                ip("netns", "add", ns)
                ip("link", "set", "lo", "up", ns=ns)
            ip("link", "add", "br0", "type", "bridge", ns=self.switch_ns)
            ip("link", "set", "br0", "up", ns=self.switch_ns)
            for h in self.hosts:
                self._wire(h)
                self._spawn(h)
            self.known_hosts.write_text("".join(f"{h.address} {h.host_key_pub}\n"
                                                for h in self.hosts))
        except BaseException:
            self.stop()
            raise
        return self

    def _wire(self, h: BridgeHost) -> None:
        ip("netns", "add", h.ns)
        i, t = h.index, self.tag
        ip("link", "add", f"obm{t}x{i}", "netns", self.client_ns, "type", "veth", "peer",
           "name", "eth1", "netns", h.ns)
        ip("link", "add", f"obp{t}x{i}", "netns", self.switch_ns, "type", "veth", "peer",
           "name", "eth0", "netns", h.ns)
        ip("addr", "add", f"{MGMT}.{i}.1/30", "dev", f"obm{t}x{i}", ns=self.client_ns)
        ip("link", "set", f"obm{t}x{i}", "up", ns=self.client_ns)
        ip("link", "set", f"obp{t}x{i}", "master", "br0", ns=self.switch_ns)
        ip("link", "set", f"obp{t}x{i}", "up", ns=self.switch_ns)
        ip("addr", "add", f"{h.address}/30", "dev", "eth1", ns=h.ns)
        ip("addr", "add", f"{h.lan}/24", "dev", "eth0", ns=h.ns)
        ip("link", "add", "docker0", "type", "bridge", ns=h.ns)
        ip("addr", "add", "172.17.0.1/16", "dev", "docker0", ns=h.ns)
        for dev in ("lo", "eth0", "eth1", "docker0"):
            ip("link", "set", dev, "up", ns=h.ns)
        etc = Path("/etc/netns") / h.ns   # `ip netns exec` binds these over /etc
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {h.hostname}\n")
        (etc / "hostname").write_text(h.hostname + "\n")

    def _spawn(self, h: BridgeHost) -> None:
        h.home.mkdir(parents=True, exist_ok=True)
        h.host_key_pub = _keygen(h.home / "ssh_host_ed25519_key", f"orch-bridge-{h.index}")
        (h.home / "sshd_config").write_text(_sshd_config(h.home, h.address, 22,
                                                         self.authorized_keys))
        # a UTS namespace of its own: the host's hostname, as a real machine has
        cmd = f"hostname {h.hostname} && exec {SSHD} -D -e -f {h.home / 'sshd_config'}"
        with open(h.home / "sshd.log", "ab") as log:
            h.proc = subprocess.Popen(["ip", "netns", "exec", h.ns, "unshare", "--uts", "sh",
                                       "-c", cmd], stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=log, start_new_session=True,
                                      preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 10
        while not in_netns(h.ns, lambda: _accepts(h.address, 22)):
            if h.proc.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"sshd of {h.hostname} did not start: "
                                   f"{(h.home / 'sshd.log').read_text()[-1000:]}")
            time.sleep(0.05)

    def firewall(self, i: int, ports: str, reject: str = "") -> None:
        """Host i accepts TCP only to `ports` (iptables multiport: "22,29400:29499"); the
        rest is dropped, or refused with `reject` ("tcp-reset", "icmp-port-unreachable")."""
        ns = self.hosts[i].ns
        end = ["-j", "REJECT", "--reject-with", reject] if reject else ["-j", "DROP"]
        for rule in (["-i", "lo", "-j", "ACCEPT"],
                     ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
                     ["-p", "tcp", "-m", "multiport", "--dports", ports, "-j", "ACCEPT"],
                     ["-p", "tcp", *end]):
            subprocess.run(["ip", "netns", "exec", ns, "iptables", "-A", "INPUT", *rule],
                           check=True, capture_output=True)

    def open_all(self) -> None:
        for h in self.hosts:
            subprocess.run(["ip", "netns", "exec", h.ns, "iptables", "-F", "INPUT"],
                           capture_output=True)

    def stop(self) -> None:
        """Every sshd and its sessions ended, then the namespaces and /etc/netns folders
        deleted; raises if a process, a namespace or a folder is left."""
        procs = [h.proc for h in self.hosts if h.proc is not None]
        pids = end_sshds(procs)
        names = [self.client_ns, self.switch_ns] + [h.ns for h in self.hosts]
        for ns in names:
            ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        left = [p for p in pids if pid_alive(p)]
        listed = ip("netns", "list").stdout
        if left or any(ns in listed for ns in names):
            raise ClusterError(f"bridge hosts left pids {left} / namespaces:\n{listed}")
        if any((Path("/etc/netns") / ns).exists() for ns in names):
            raise ClusterError("an /etc/netns folder of the bridge hosts is left")

    def run_in_client(self, argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.client_ns, *argv], **kw)

    def run_in_host(self, i: int, argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.hosts[i].ns, *argv], **kw)
