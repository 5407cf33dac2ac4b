"""A fake SSH cluster on one machine: one real OpenSSH sshd per loopback address.

Every "host" is its own `/usr/sbin/sshd -D` bound to 127.0.0.<k>:<port> with its own
host key (in a pytest-xdist worker, on an address range of that worker's: loopback_net),
so host-key checking, per-host failures (pause one sshd, drop one host key) and parallel
fan-out are exercised for real, without containers or root-only tricks beyond running
sshd itself. Used by tests/conftest.py and by bench/.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SSHD = "/usr/sbin/sshd"
START_TIMEOUT_S = 10.0
STOP_GRACE_S = 3.0
_PR_SET_PDEATHSIG = 1


class ClusterError(RuntimeError):
    """The fake cluster could not be started or stopped as asked."""


# ---------------------------------------------------------------- /proc helpers

def _read_stat(pid: int) -> tuple[int, str] | None:
    """(ppid, state) of pid, or None when it is gone; comm may hold spaces and ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = data.rsplit(")", 1)[1].split()
    return int(rest[1]), rest[0]


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def children_map() -> dict[int, list[int]]:
    """ppid -> child pids, one snapshot of /proc."""
    tree: dict[int, list[int]] = {}
    for pid in _all_pids():
        stat = _read_stat(pid)
        if stat is not None:
            tree.setdefault(stat[0], []).append(pid)
    return tree


def descendants_of(root: int) -> list[int]:
    """Every pid below root (not root itself), parents before children."""
    tree = children_map()
    out: list[int] = []
    todo = list(tree.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(tree.get(pid, []))
    return out


def pid_alive(pid: int) -> bool:
    """True when pid exists and is not a zombie (a zombie has already exited)."""
    stat = _read_stat(pid)
    return stat is not None and stat[1] != "Z"


def pids_with_env(marker: str) -> list[int]:
    """Live pids whose environment holds exactly `marker` ("KEY=VALUE")."""
    want = marker.encode()
    found = []
    for pid in _all_pids():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:  # vanished, or not ours to read
            continue
        if want in entries and pid_alive(pid):
            found.append(pid)
    return found


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


# ---------------------------------------------------------------- addresses and ports

def loopback_net() -> str:
    """The first three numbers of this process's fake hosts' addresses: 127.0.0 (hosts
    127.0.0.2, ...), or, in pytest-xdist worker gw<N>, 127.<10+N>.<R> with R from the run's
    id. Every 127.x.y.z is this machine's loopback, so each worker's clusters (and those of
    another run beside it) have addresses of their own, whatever ports they pick; bench/
    keeps 127.0.1-4.* for its wide clusters."""
    worker = _xdist_worker()
    if worker is None:
        return "127.0.0"
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")
    return f"127.{10 + worker % 240}.{1 + zlib.crc32(run.encode()) % 250}"


def _xdist_worker() -> int | None:
    """N in pytest-xdist's worker gw<N>, or None outside one."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else None


def loopback(octet: int) -> str:
    """This process's fake host address ending in `octet` (see loopback_net)."""
    return f"{loopback_net()}.{octet}"


def port_free(address: str, port: int) -> bool:
    """True when nothing listens on address:port and we could bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def accepts(address: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def end_sshds(procs: Sequence[subprocess.Popen]) -> list[int]:
    """SIGTERM every sshd and its sessions, reap the sshds (SIGKILL one that stays), and
    wait up to 5 s for the rest: the pids, for the caller's check that none is left."""
    pids = [p.pid for p in procs] + [d for p in procs for d in descendants_of(p.pid)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def free_port(addresses: Sequence[str], start: int = 2222, stop: int = 2400) -> int:
    """A port free on every address, so that concurrent clusters (other test runs,
    benchmarks) on the same addresses do not collide. In a pytest-xdist worker, from that
    worker's share of start..stop only (worker_ports): two workers that look at once
    (torchrun's master port on 127.0.0.1) never take the same one."""
    start, stop = worker_ports(start, stop)
    for port in range(start, stop):
        if all(port_free(a, port) for a in addresses):
            return port
    raise ClusterError(f"no port in {start}..{stop} is free on {', '.join(addresses)}")


def worker_ports(start: int, stop: int) -> tuple[int, int]:
    """This process's share of the ports start..stop: all of them without pytest-xdist,
    else the worker's slice of one in PYTEST_XDIST_WORKER_COUNT."""
    worker, count = _xdist_worker(), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker is None or not count.isdigit() or worker >= int(count):
        return start, stop
    width = (stop - start) // int(count)
    if width < 1:
        return start, stop
    first = start + worker * width
    return first, first + width


# ---------------------------------------------------------------- hosts

def _die_with_parent() -> None:
    # If the test process is SIGKILLed, its sshds must not outlive it holding ports.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class FakeHost:
    address: str
    port: int
    remote_dir: Path
    host_key_pub: str
    proc: subprocess.Popen
    index: int = 0
    home: Path = field(default_factory=Path)  # <root>/host<i>: config, keys, pid, log
    _paused: list[int] = field(default_factory=list, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log_file(self) -> Path:
        return self.home / "sshd.log"

    def sessions(self) -> int:
        """How many exec sessions (remote commands) this sshd has started so far."""
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return 0
        return text.count("Starting session: command")

    def descendants(self) -> list[int]:
        return descendants_of(self.proc.pid)

    def pause(self) -> None:
        """SIGSTOP sshd and everything under it: the host stops answering, but the
        kernel still completes TCP handshakes, like a hung machine."""
        stopped = [self.proc.pid]
        os.kill(self.proc.pid, signal.SIGSTOP)
        while True:  # a process forked between snapshot and signal is caught next pass
            new = [p for p in self.descendants() if p not in stopped]
            if not new:
                break
            _signal(new, signal.SIGSTOP)
            stopped.extend(new)
        self._paused = stopped

    @property
    def paused(self) -> bool:
        return bool(self._paused)

    def resume(self) -> None:
        _signal(reversed(self._paused + self.descendants()), signal.SIGCONT)
        self._paused = []

    def known_hosts_line(self) -> str:
        name = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        return f"{name} {self.host_key_pub}"


def _keygen(path: Path, comment: str) -> str:
    if not path.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
                        "-f", str(path)], check=True, stdin=subprocess.DEVNULL)
    return " ".join(path.with_name(path.name + ".pub").read_text().split()[:2])


def _sshd_config(home: Path, address: str, port: int, authorized_keys: Path,
                 options: dict[str, Any] | None = None) -> str:
    """The per-host sshd_config; `options` (keyword -> value) replace or add lines."""
    lines = [
        f"ListenAddress {address}:{port}",
        f"HostKey {home / 'ssh_host_ed25519_key'}",
        f"AuthorizedKeysFile {authorized_keys}",
        "PermitRootLogin prohibit-password",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        f"PidFile {home / 'sshd.pid'}",
        "MaxSessions 64",
        "MaxStartups 200:30:400",
        "LogLevel VERBOSE",   # one "Starting session: command ..." line per exec session
        "Subsystem sftp internal-sftp",
        "AllowTcpForwarding no",
    ]
    # a value may name this host's files: {authorized_keys} (the cluster's client key)
    extra = {k: str(v).format(authorized_keys=authorized_keys) for k, v in (options or {}).items()}
    lines = [f"{w.split()[0]} {extra.pop(w.split()[0])}" if w.split()[0] in extra else w
             for w in lines]
    return "\n".join(lines + [f"{k} {v}" for k, v in extra.items()] + [""])


# ---------------------------------------------------------------- the cluster

class SshdCluster:
    """n sshd "hosts" on 127.0.0.<first_octet>.. (loopback(first_octet), ...) sharing one
    port, one client key and one known_hosts file that trusts exactly the trusted hosts."""

    def __init__(self, root: Path, n: int, *, port: int = 2222, first_octet: int = 2,
                 sshd_options: dict[str, Any] | None = None, net: str | None = None) -> None:
        """`sshd_options` (keyword -> value) replace or add lines of every sshd_config
        (the scale benchmark raises MaxStartups, adds a user's own authorized_keys);
        `net` the addresses' first three numbers (default: loopback_net())."""
        self.root = Path(root).resolve()
        self.net = net or loopback_net()
        self.sshd_options = dict(sshd_options or {})
        self.n = n
        self.port = port
        self.first_octet = first_octet
        self.hosts: list[FakeHost] = []            # trusted hosts, inventory order
        self.untrusted_hosts: list[FakeHost] = []  # running, but not in known_hosts
        self.client_key = self.root / "client" / "id_ed25519"
        self.known_hosts = self.root / "client" / "known_hosts"
        self.ssh_config = self.root / "client" / "ssh_config"
        self.authorized_keys = self.root / "client" / "authorized_keys"
        self._next_octet = first_octet
        self._started = False

    # -- lifecycle
    def start(self) -> SshdCluster:
        if self._started:
            return self
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privsep dir
        self.client_key.parent.mkdir(parents=True, exist_ok=True)
        pub = _keygen(self.client_key, "orch-test-client")
        self.authorized_keys.write_text(pub + "\n")
        self._write_ssh_config()
        self._started = True
        atexit.register(self.stop)
        try:
            for _ in range(self.n):
                self.add_host(trusted=True)
        except BaseException:
            self.stop()
            raise
        return self

    def all_hosts(self) -> list[FakeHost]:
        return self.hosts + self.untrusted_hosts

    def stop(self) -> None:
        """Stop every sshd and every session under it; raise if anything survives."""
        hosts = self.all_hosts()
        if not hosts:
            return
        pids = self._tree_pids(hosts)
        _signal(pids, signal.SIGCONT)  # a paused sshd must be able to act on SIGTERM
        _signal(pids, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            self._reap(hosts)
            pids = [p for p in pids + self._tree_pids(hosts) if pid_alive(p)]
            if not pids:
                break
            time.sleep(0.05)
        _signal(pids + self._tree_pids(hosts), signal.SIGKILL)
        self._reap(hosts, wait=True)
        survivors = [p for p in pids if pid_alive(p)]
        self.hosts, self.untrusted_hosts = [], []
        if survivors:
            raise ClusterError(f"processes of the fake cluster survived SIGKILL: {survivors}")

    @staticmethod
    def _tree_pids(hosts: list[FakeHost]) -> list[int]:
        pids: list[int] = []
        for h in hosts:
            if h.proc.poll() is None:
                pids.append(h.proc.pid)
            pids.extend(h.descendants())
        return pids

    @staticmethod
    def _reap(hosts: list[FakeHost], wait: bool = False) -> None:
        for h in hosts:
            if wait:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.proc.wait(timeout=5)
            else:
                h.proc.poll()

    def __enter__(self) -> SshdCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- hosts
    def add_host(self, trusted: bool = True) -> FakeHost:
        """One more sshd on the next free address. trusted=False keeps its host key out
        of known_hosts (and the host out of `hosts`, so inventories skip it)."""
        if not self._started:
            raise ClusterError("start() the cluster before adding hosts")
        index = len(self.all_hosts())
        address = f"{self.net}.{self._next_octet}"
        self._next_octet += 1
        host = self._spawn(index, address)
        (self.hosts if trusted else self.untrusted_hosts).append(host)
        self._write_known_hosts()
        return host

    def _spawn(self, index: int, address: str) -> FakeHost:
        home = self.root / f"host{index}"
        home.mkdir(parents=True, exist_ok=True)
        host_pub = _keygen(home / "ssh_host_ed25519_key", f"orch-test-host{index}")
        config = home / "sshd_config"
        config.write_text(_sshd_config(home, address, self.port, self.authorized_keys,
                                       self.sshd_options))
        if not port_free(address, self.port):
            raise ClusterError(f"{address}:{self.port} is already in use; pick another port "
                               f"(sshd_cluster.free_port) or first_octet")
        with open(home / "sshd.log", "ab") as log:
            proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        host = FakeHost(address=address, port=self.port, remote_dir=home / "orch",
                        host_key_pub=host_pub, proc=proc, index=index, home=home)
        self._wait_listening(host)
        return host

    @staticmethod
    def _wait_listening(host: FakeHost) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if host.proc.poll() is not None:
                raise ClusterError(f"sshd for {host.address}:{host.port} exited with "
                                   f"{host.proc.returncode}: {host.log_file.read_text()[-2000:]}")
            if accepts(host.address, host.port, timeout=0.5):
                return
            time.sleep(0.02)
        host.proc.kill()
        host.proc.wait()
        raise ClusterError(f"sshd on {host.address}:{host.port} did not listen within "
                           f"{START_TIMEOUT_S:.0f} s")

    @staticmethod
    def unreachable() -> tuple[str, int]:
        """An address:port where nothing listens (connections are refused)."""
        for octet in range(250, 200, -1):
            address = loopback(octet)
            if not accepts(address, 2222, timeout=0.3):
                return address, 2222
        raise ClusterError("no unused loopback address found for unreachable()")

    # -- client-side files
    def _write_known_hosts(self) -> None:
        lines = [h.known_hosts_line() for h in self.hosts]
        self.known_hosts.write_text("".join(line + "\n" for line in lines))

    def _write_ssh_config(self) -> None:
        self.ssh_config.write_text("\n".join([
            f"Host {self.net}.*",
            "  User root",
            f"  Port {self.port}",
            f"  IdentityFile {self.client_key}",
            "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {self.known_hosts}",
            "  GlobalKnownHostsFile /dev/null",
            "  StrictHostKeyChecking yes",
            "  BatchMode yes",
            "  LogLevel ERROR",
            "",
        ]))

    def write_inventory(self, path: Path, *, hosts: list[FakeHost] | None = None,
                        procs: int | list[int] = 1, name: str = "job",
                        entrypoint: str = "job.py", args: Sequence[str] = (),
                        env: dict | None = None, code_paths: Sequence[str] = ("job.py",),
                        extra_hosts: Sequence[dict] = (), top: dict | None = None) -> Path:
        """Write a cluster.yaml (SPEC format) for these hosts (default: every trusted host).
        `top` is merged last: a dict value updates the section of that name, key by key
        (top={"ssh": {"host_key_policy": "accept-new"}}); anything else replaces it."""
        hosts = self.hosts if hosts is None else hosts
        counts = procs if isinstance(procs, list) else [procs] * len(hosts)
        if len(counts) != len(hosts):
            raise ValueError(f"procs has {len(counts)} entries for {len(hosts)} hosts")
        doc: dict[str, Any] = {
            "name": name,
            "ssh": {"user": "root", "identity_file": str(self.client_key),
                    "known_hosts": str(self.known_hosts), "host_key_policy": "strict",
                    "connect_timeout": 5, "port": self.port},
            "hosts": [self._host_entry(h, c) for h, c in zip(hosts, counts)] + list(extra_hosts),
            "python": sys.executable,
            "code": {"paths": list(code_paths)},
            "job": {"entrypoint": entrypoint, "args": list(args), "env": dict(env or {})},
        }
        for key, value in (top or {}).items():  # dicts merge one level: top={"ssh": {...}}
            if isinstance(value, dict) and isinstance(doc.get(key), dict):
                doc[key] = {**doc[key], **value}
            else:
                doc[key] = value
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def _host_entry(self, host: FakeHost, procs: int) -> dict:
        entry: dict[str, Any] = {"address": host.address, "procs": procs,
                                 "remote_dir": str(host.remote_dir)}
        if host.port != self.port:
            entry["port"] = host.port
        return entry


def ssh_cmd(cluster: SshdCluster) -> list[str]:
    """OpenSSH client argv prefix for this cluster: `ssh_cmd(c) + [addr, "true"]`."""
    return ["ssh", "-F", str(cluster.ssh_config)]


@contextlib.contextmanager
def own_cluster(root: Path, hosts: int, first_octet: int,
                sshd_options: dict[str, Any] | None = None) -> Iterator[SshdCluster]:
    """A module's own cluster of `hosts` sshd on loopback(first_octet)..., apart from the
    session's (a test may kill one of its hosts); proven gone at the end."""
    port = free_port([loopback(first_octet + i) for i in range(hosts)])
    cluster = SshdCluster(root, hosts, port=port, first_octet=first_octet,
                          sshd_options=sshd_options).start()
    try:
        yield cluster
    finally:
        pids = [h.pid for h in cluster.all_hosts()]
        cluster.stop()
    assert not [p for p in pids if pid_alive(p)], f"an sshd of the {hosts}-host cluster survived"
