"""This host's network, learnt with the stdlib alone (no ip, ifconfig or root), and the
probes that prove the hosts of a job reach each other before it starts.

At preflight (`learn`): the interfaces with their IPv4 addresses and state, the
hostname and what it resolves to, the source address of the route toward the master
(a UDP connect sends no packet), and listeners: one on a port the OS picks and, on
host 0, one on the master port. Each listener answers every connection with this
host's token, so a probe that lands on another machine holding the same address (every
host's docker0 is 172.17.0.1) is told from one that reached the right host.
`net_probe` connects to the given targets, all at once, each bounded by its timeout;
`net_close` closes the listeners before the launch needs the master port. After the
launch, `net_waits` names the job's connections that get no answer (a network hang),
with the kernel's count of failed connects in the job's network namespace (a refused
connect that is tried again leaves no waiting socket, only that count); `net_listen`
opens one listener again, on a port the OS picks, for the controller's check of which
hosts a host with failed connects still reaches (`net_probe` to it, then `net_close`).
"""
from __future__ import annotations

# _socket, not socket: socket.py's enum wrapping costs CPU at every host's preflight
import _socket
import os
import select
import struct
import threading
import time

MYPY = False
if MYPY:   # annotations only: typing's import costs CPU at every agent start
    from typing import Any

    from orchestrator.agent.main import Request

SIOCGIFCONF = 0x8912
SIOCGIFFLAGS = 0x8913
IFF_UP = 0x1
IFREQ = 40                  # sizeof(struct ifreq) on 64-bit Linux
ENV_KEYS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
HOLD = 900.0                # a listener left open this long (a controller gone) closes
READ_FACTOR = 3             # the token's wait, in connect bounds, once connected
LISTENERS = []              # type: list[Listener]


def interface_addrs() -> dict[str, list[str]]:
    """Interface -> its IPv4 addresses (secondary ones too), from SIOCGIFCONF."""
    import array
    import fcntl
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        size = IFREQ * 256
        buf = array.array("B", b"\0" * size)
        addr, _ = buf.buffer_info()
        got = struct.unpack("iL", fcntl.ioctl(s.fileno(), SIOCGIFCONF,
                                               struct.pack("iL", size, addr)))[0]
    finally:
        s.close()
    raw = buf.tobytes()[:got]
    out = {}   # type: dict[str, list[str]]
    for off in range(0, len(raw), IFREQ):
        label = raw[off:off + 16].split(b"\0", 1)[0].decode("ascii", "replace")
        ip = _socket.inet_ntoa(raw[off + 20:off + 24])
        # an alias label (eth0:1) is an address of eth0
        out.setdefault(label.split(":", 1)[0], []).append(ip)
    return out


def interface_up(name: str) -> bool:
    """IFF_UP and a link that is not down (a veth whose peer is gone is down)."""
    import fcntl
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        req = struct.pack("16sH14x", name.encode()[:15], 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
    except OSError:
        return False
    finally:
        s.close()
    return bool(flags & IFF_UP) and link_state(name) != "down"


def link_state(name: str, root: str = "/sys/class/net") -> str:
    """"up", "down" or "unknown". `carrier` is the link now; `operstate` follows it
    through the kernel's link watch, which may lag by a second or more (on Linux
    6.18 sysfs read "down" for a veth up for half a second, while `ip link` said UP),
    so it is read only where `carrier` cannot be (an interface that is administratively
    down, or a driver without one)."""
    try:
        with open("%s/%s/carrier" % (root, name)) as f:
            return "up" if f.read().strip() == "1" else "down"
    except OSError:
        pass
    try:
        with open("%s/%s/operstate" % (root, name)) as f:
            return "down" if f.read().strip() == "down" else "unknown"
    except OSError:
        return "unknown"


def interfaces() -> list[dict[str, Any]]:
    try:
        names = [n for _, n in _socket.if_nameindex()]
    except OSError:
        names = []
    try:
        addrs = interface_addrs()
    except OSError:
        addrs = {}
    return [{"name": n, "addrs": addrs.get(n, []), "up": interface_up(n)}
            for n in names + sorted(set(addrs) - set(names))]


def resolve(name: str, bound: float = 2.0) -> list[str]:
    """What `name` resolves to here (IPv4), as gloo resolves the hostname; a resolver
    that hangs is given up after `bound` seconds (the answer is then empty)."""
    got = []   # type: list[str]

    def look() -> None:
        try:
            for info in _socket.getaddrinfo(name, None, _socket.AF_INET, _socket.SOCK_STREAM):
                addr = str(info[4][0])
                if addr not in got:
                    got.append(addr)
        except OSError:
            pass
    th = threading.Thread(target=look, daemon=True)
    th.start()
    th.join(bound)
    return list(got)


def route_source(addr: str) -> str:
    """The source address the kernel picks toward addr ("" when there is no route)."""
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        s.connect((addr, 9))
        src = s.getsockname()[0]   # type: str
        return src
    except OSError:
        return ""
    finally:
        s.close()


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Listener:
    """Listening sockets that answer each connection with the token, then wait for the
    peer to close first: the TIME_WAIT stays on the prober's side, so the master port
    is free for torchrun's store the moment the listener closes."""

    def __init__(self, token: bytes, ports: list[int]) -> None:
        self.token, self.socks, self.ports = token, [], []   # type: bytes, list[Any], list[int]
        for port in ports:
            s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
            try:
                # as torchrun's store: a job's TIME_WAIT on the master port is no obstacle
                s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
                s.bind(("", port))
                s.listen(1024)
            except OSError:
                s.close()
                self.ports.append(0)
                continue
            s.setblocking(False)
            self.socks.append(s)
            self.ports.append(s.getsockname()[1])
        self.r, self.w = os.pipe()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        # poll, not select: host 0 of a thousand hosts may hold more than 1024 sockets
        poll, socks, conns = select.poll(), {}, {}   # type: Any, dict[int, Any], dict[int, Any]
        for s in self.socks:
            socks[s.fileno()] = s
            poll.register(s, select.POLLIN)
        poll.register(self.r, select.POLLIN)
        end = time.monotonic() + HOLD
        while time.monotonic() < end:
            ready = [fd for fd, _ in poll.poll(1000)]
            if self.r in ready:
                break
            for fd in ready:
                if fd in conns:
                    self._drop(poll, conns, fd)   # the peer closed first: done
                elif fd in socks:
                    self._accept(poll, conns, socks[fd])
            now = time.monotonic()
            for fd in [fd for fd, (_, t) in conns.items() if t < now]:
                self._drop(poll, conns, fd)
        for fd in list(conns):
            self._drop(poll, conns, fd)
        for s in self.socks:
            s.close()

    def _accept(self, poll: Any, conns: dict[int, Any], s: Any) -> None:
        try:
            fd, _ = s._accept()   # the C socket's accept: a descriptor
        except OSError:
            return
        c = _socket.socket(fileno=fd)
        try:
            c.send(self.token)
        except OSError:
            c.close()
            return
        conns[c.fileno()] = (c, time.monotonic() + 10)
        poll.register(c, select.POLLIN)

    @staticmethod
    def _drop(poll: Any, conns: dict[int, Any], fd: int) -> None:
        c, _ = conns.pop(fd)
        poll.unregister(fd)
        c.close()

    def close(self) -> None:
        os.write(self.w, b"x")
        self.thread.join(5)
        os.close(self.r)
        os.close(self.w)


def learn(net: dict[str, Any], master_port: int) -> dict[str, Any]:
    """The preflight's network part. `net`: toward (the master as the controller
    resolved it), token, listen (start the listeners), master (this is host 0)."""
    host = _socket.gethostname()
    out = {}   # type: dict[str, Any]
    out.update(hostname=host, resolves=resolve(host), interfaces=interfaces())
    out.update({
        "route_src": route_source(net["toward"]) if net["toward"] else "",
        "boot_id": boot_id(),
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ}})
    if net["listen"]:
        ports = [0, master_port] if net["master"] and master_port else [0]
        lis = Listener(net["token"].encode() + b"\n", ports)
        LISTENERS.append(lis)
        out["port"] = lis.ports[0]
        if len(ports) > 1:
            out["master_listen"] = lis.ports[1]
    return out


def connect(target: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One probe: connect, read the token, close first (TIME_WAIT here, not there)."""
    t0 = time.monotonic()
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    s.settimeout(timeout)
    res = {"ok": False, "why": "", "src": "", "ms": 0.0}   # type: dict[str, Any]
    try:
        s.connect((target["addr"], target["port"]))
        res["src"] = s.getsockname()[0]
        # the path is open (the handshake passed any firewall): the token may take its
        # listener longer on a loaded host, which is no network fault
        s.settimeout(timeout * READ_FACTOR)
        got = b""
        while not got.endswith(b"\n") and len(got) < 200:
            more = s.recv(200)
            if not more:
                break
            got += more
        if got.strip() == target["token"].encode():
            res["ok"] = True
        else:
            res["why"] = "other"     # something else answers there (another machine)
    except _socket.timeout:
        res["why"] = "slow" if res["src"] else "timeout"
    except ConnectionRefusedError:
        res["why"] = "refused"
    except _socket.gaierror:
        res["why"] = "unresolved"   # a name only the controller (or its bastion) knows
    except OSError as e:
        res["why"] = "unreachable" if e.errno in (101, 113) else "error: %s" % (e.strerror or e)
    finally:
        s.close()
    res["ms"] = round((time.monotonic() - t0) * 1000, 1)
    return res


def run_probe(req: Request) -> dict[str, Any]:
    """Every target at once, each in its thread, none longer than `timeout`. The reply
    comes once each group's best answer is known: the first target of a group that
    succeeded with every target before it finished (the rest are then not waited for)."""
    targets, timeout = req.args["targets"], float(req.args["bound"])
    results = [None] * len(targets)   # type: list[Any]
    done = threading.Condition()

    def one(i: int) -> None:
        r = connect(targets[i], timeout)
        with done:
            results[i] = r
            done.notify_all()
    for i in range(len(targets)):
        threading.Thread(target=one, args=(i,), daemon=True).start()
    end = time.monotonic() + timeout * (1 + READ_FACTOR) + 2
    with done:
        while not settled(targets, results) and time.monotonic() < end:
            done.wait(0.05)
        # not waited for: an address before it in its group answered (or, past the
        # deadline, none did)
        left = "unfinished" if settled(targets, results) else "timeout"
        got = list(results)
    return {"results": [r if r is not None else {"ok": False, "why": left, "src": "",
                                                   "ms": 0.0} for r in got]}


def settled(targets: list[dict[str, Any]], results: list[Any]) -> bool:
    groups = {}   # type: dict[str, list[int]]
    for i, t in enumerate(targets):
        groups.setdefault(t["group"], []).append(i)
    for idx in groups.values():
        for i in idx:
            if results[i] is None:
                return False
            if results[i]["ok"]:
                break
    return True


def run_close(req: Request) -> dict[str, Any]:
    """The listeners closed: the master port is torchrun's from now on."""
    n = len(LISTENERS)
    while LISTENERS:
        LISTENERS.pop().close()
    return {"closed": n}


# ------------------------------------------------------------------ after the launch

SYN_SENT = "02"             # /proc/net/tcp's st of a connection that waits for its answer


def run_waits(req: Request) -> dict[str, Any]:
    """The job's TCP connections that got no answer: SYN_SENT with the SYN sent again at
    least once (a second without an answer; a LAN answers in a millisecond). A firewall
    that drops the ports gloo or NCCL connect their pairs on leaves a rank so, inside
    init_process_group, for up to gloo's 30 minutes; a node's torchrun so before the
    rendezvous. Also this host's interfaces: the controller names the peer by them."""
    from orchestrator.agent import procs
    from orchestrator.agent.common import job_paths
    from orchestrator.wire.protocol import MAX_NET_WAITS
    p = job_paths(req.args["job_dir"])
    sup = procs.supervisor_alive(p)
    pids = procs.job_pids(p, sup)
    fails = attempt_fails(pids + ([sup["pid"]] if sup and isinstance(sup.get("pid"), int)
                                  else []))
    owner = {}   # type: dict[str, int]
    for pid in pids:
        owner.update(dict.fromkeys(socket_inodes(pid), pid))
    waits = []   # type: list[dict[str, Any]]
    seen = set()   # type: set[str]
    mine = namespace("self")
    for ns, pid in namespaces(sorted(set(owner.values()))).items():
        for w in syn_sent(pid, owner, seen, ns == mine):
            del w["inode"]
            w["rank"] = rank_of(w["pid"])
            waits.append(w)
    out = {"waits": waits[:MAX_NET_WAITS], "interfaces": interfaces()}   # type: dict[str, Any]
    if fails is not None:
        out["fails"] = fails
    return out


def attempt_fails(pids: list[int]) -> int | None:
    """The kernel's failed TCP connects (Tcp: AttemptFails: refused, unreachable or given
    up on) summed over the network namespaces the pids live in, each counted once; None
    when none is readable. Counts since the namespace began: the controller compares."""
    total, seen = None, set()   # type: int | None, set[str]
    for pid in pids:
        ns = namespace(pid)
        if ns is None or ns in seen:
            continue
        n = snmp_attempt_fails("/proc/%d/net/snmp" % pid)
        if n is not None:
            seen.add(ns)
            total = (total or 0) + n
    return total


def snmp_attempt_fails(path: str) -> int | None:
    """AttemptFails from a /proc/net/snmp file: its two `Tcp:` lines, names then values."""
    try:
        with open(path) as f:
            tcp = [line.split() for line in f if line.startswith("Tcp:")]
    except OSError:
        return None
    try:
        return int(tcp[1][tcp[0].index("AttemptFails")])
    except (IndexError, ValueError):
        return None


def run_listen(req: Request) -> dict[str, Any]:
    """One listener on a port the OS picks that answers with the token, as preflight's
    (closed by `net_close`, or after HOLD): the controller checks who reaches this host."""
    lis = Listener(req.args["token"].encode() + b"\n", [0])
    LISTENERS.append(lis)
    return {"port": lis.ports[0]}


def socket_inodes(pid: int) -> list[str]:
    """The inodes of pid's sockets ("socket:[N]" links in /proc/<pid>/fd)."""
    from orchestrator.agent.procs import fds_of  # as the other /proc readers here
    out = []   # type: list[str]
    for fd in fds_of(pid):
        try:
            link = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if link.startswith("socket:["):
            out.append(link[8:-1])
    return out


def namespace(pid: int | str) -> str | None:
    """The network namespace pid lives in (its /proc link, "self": this agent's); None
    once the process is gone."""
    try:
        return os.readlink("/proc/%s/ns/net" % pid)
    except OSError:
        return None


def namespaces(pids: list[int]) -> dict[str, int]:
    """Each network namespace of pids -> the first of them in it: processes that share
    one see the same sockets, and each look at a namespace's table costs the whole table."""
    out = {}   # type: dict[str, int]
    for pid in pids:
        ns = namespace(pid)
        if ns is not None:
            out.setdefault(ns, pid)
    return out


def syn_sent(pid: int, owner: dict[str, int], seen: set[str], own: bool
             ) -> list[dict[str, Any]]:
    """pid's network namespace's waiting connections that a process of the job owns;
    `seen`: inodes already reported (processes that share a namespace list the same).
    In the agent's own namespace (`own`) the kernel is asked for the SYN_SENT sockets
    alone (sockdiag); elsewhere, or where it cannot answer, /proc/<pid>/net/tcp{,6}."""
    found = own_syn_sent(owner) if own else None
    if found is None:
        found = proc_syn_sent(pid, owner)
    out = []   # type: list[dict[str, Any]]
    for w in found:
        if w["inode"] not in seen:
            seen.add(w["inode"])
            out.append(w)
    return out


def own_syn_sent(owner: dict[str, int]) -> list[dict[str, Any]] | None:
    """This namespace's SYN_SENT sockets of the job sent again at least once, from
    sock_diag; None where the kernel does not answer it."""
    from orchestrator.agent import sockdiag
    got = sockdiag.sockets(sockdiag.TCP_SYN_SENT)
    if got is None:
        return None
    return [{"inode": str(inode), "pid": owner[str(inode)], "local": local, "addr": addr,
             "port": port, "tries": tries}
            for inode, local, addr, port, tries in got if str(inode) in owner and tries >= 1]


def proc_syn_sent(pid: int, owner: dict[str, int]) -> list[dict[str, Any]]:
    """pid's namespace's waiting connections of the job, from /proc/<pid>/net/tcp{,6}."""
    out = []   # type: list[dict[str, Any]]
    for name in ("tcp", "tcp6"):
        try:
            with open("/proc/%d/net/%s" % (pid, name)) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            w = waiting(line.split(), owner)
            if w is not None:
                out.append(w)
    return out


def waiting(f: list[str], owner: dict[str, int]) -> dict[str, Any] | None:
    """One line of /proc/net/tcp{,6} as a waiting connection of the job, else None."""
    if len(f) < 10 or f[3] != SYN_SENT or f[9] not in owner:
        return None
    try:
        tries = int(f[6], 16)
        local, remote = hex_addr(f[1]), hex_addr(f[2])
    except (ValueError, OSError):
        return None
    if tries < 1:
        return None
    return {"inode": f[9], "pid": owner[f[9]], "local": local[0], "addr": remote[0],
            "port": remote[1], "tries": tries}


def hex_addr(text: str) -> tuple[str, int]:
    """"0100007F:1F90" -> ("127.0.0.1", 8080); an IPv4-mapped IPv6 address as IPv4."""
    host, port = text.split(":")
    raw = b"".join(struct.pack("<I", int(host[i:i + 8], 16)) for i in range(0, len(host), 8))
    if len(raw) == 4:
        return _socket.inet_ntoa(raw), int(port, 16)
    if raw[:12] == b"\0" * 10 + b"\xff\xff":
        return _socket.inet_ntoa(raw[12:]), int(port, 16)
    return _socket.inet_ntop(_socket.AF_INET6, raw), int(port, 16)


def rank_of(pid: int) -> int | None:
    """The global rank of a rank's process (RANK in its environment); None: torchrun."""
    from orchestrator.agent.procs import read_environ
    for entry in read_environ(pid).split(b"\0"):
        if entry.startswith(b"RANK="):
            try:
                return int(entry[5:])
            except ValueError:
                return None
    return None
