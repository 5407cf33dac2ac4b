"""While an attached job starts: the network hangs it would otherwise wait out without a
word (gloo waits 30 minutes in init_process_group, NCCL 10, torchrun's rendezvous 15),
said while they last.

A few looks after the launch (`looks`: 10, 20 and 40 s, then notice_after() and every
doubling of it), every host is asked for the job's connections that get no answer
(`net_waits`, agent/network.py: SYN_SENT, the SYN sent again): a rank in
init_process_group whose peer's firewall drops the port the OS picked there, a node's
torchrun that cannot reach the rendezvous or the ranks' store. Each such connection is
named by the two hosts (the peer found among the hosts' addresses), the address and the
port. The first look at or past notice_after() also names the hosts none of whose
ranks started (`stalled`), unless waiting connections name the cause.
A firewall that refuses (iptables REJECT, an ICMP unreachable) leaves no waiting socket:
a rank whose store connection is refused tries again until torch's timeout. Each reply
also carries the kernel's count of failed connects in the job's network namespace
(Tcp: AttemptFails); where it grew at each look of a run of looks that found the
host's ranks started, by MIN_FAILS or more in all (`grown`), and no connection waits,
that host checks the next REACH_PEERS hosts on a port the OS picks (each listens once,
as at preflight), REACH_FROM hosts at most per look, and the pairs it cannot connect
are named with the cause (refused, unreachable, no answer); if all answer, only what
was seen is said (once, and only while no rank printed since the last look; the looks go
on for a cause). Each is said once, as a `NetworkStall` event; the job goes on (Ctrl-C,
`orch stop` or `job.hang_timeout` ends it). A look is one small request per host; the
looks thin out, so a long run asks a handful of times in all.

A pair refused at once (gloo tries 4 times in about a second, then init_process_group
raises) ends the job instead: `refused` reads the root cause's last lines and names the
network as its cause, host pair, port and fix, right after the RootCause.

What it cannot see: a hang that is not a connection (a collective on an open path); a
refused port the check's own port is not (one port closed, the rest open: the count
is then said without a pair); failed connects of other processes in the namespace
(the whole host's, without containers) look like the job's, and the check then finds
every host answering."""
from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator

from orchestrator.config.hostranges import fold
from orchestrator.config.inventory import Cluster
from orchestrator.remote.fanout import fan_out
from orchestrator.session import netprobe, network
from orchestrator.session.replies import NetWaitsReply
from orchestrator.session.session import Session
from orchestrator.watch import events as ev
from orchestrator.wire import timeouts

EARLY = (10.0, 20.0, 40.0)   # looks before the rendezvous notice: a wait is certain at once
SHOWN = 4                     # host pairs named in one line; the rest counted


RDZV_NOTICE = 60.0   # seconds after the launch: a host with no rank started is named


def notice_after() -> float:
    """RDZV_NOTICE, or ORCH_RDZV_NOTICE's seconds (a test's, or a slow cluster's)."""
    try:
        return max(1.0, float(os.environ.get("ORCH_RDZV_NOTICE", RDZV_NOTICE)))
    except ValueError:
        return RDZV_NOTICE


def stalled(cluster: Cluster, started: set[int], addr: str, port: int,
            waited: float) -> str | None:
    """The hosts none of whose ranks has started: torchrun starts them only once every
    node joined its rendezvous at addr:port. None when each host has a rank started."""
    late = [h.label for h in cluster.hosts if not any(r in started for r in h.ranks)]
    if not late:
        return None
    who = "no host has" if len(late) == len(cluster.hosts) else \
        f"{fold(late)} {'has' if len(late) == 1 else 'have'} not"
    return (f"rendezvous: {who} joined torchrun's rendezvous at {addr}:{port} "
            f"{waited:g} s after the launch; likely cause: "
            + ("host 0's torchrun is not up, or no host reaches it (a firewall on the "
               "master port)" if len(late) == len(cluster.hosts) else
               "they cannot reach it (a firewall on the master port, or no route), or "
               "their torchrun failed (its log: run/<host part>/torchrun.log there)")
            + "; the job goes on until torchrun's own timeout, Ctrl-C or `orch stop` ends it")


def looks(notice: float) -> Iterator[float]:
    """Seconds after the launch of each look: EARLY below `notice`, then notice, 2x, 4x..."""
    yield from (t for t in EARLY if t < notice)
    t = notice
    while True:
        yield t
        t *= 2


class NetWatch:
    """The looks, in a thread of their own: the follow loop never waits on them."""

    def __init__(self, session: Session, started: set[int], failed: Callable[[], bool],
                 emit: ev.Emit, master: tuple[str, int],
                 moving: Callable[[float], bool] = lambda since: False) -> None:
        self.session, self.started, self.failed, self.emit = session, started, failed, emit
        self.master = master
        # whether any rank printed (or touched its heartbeat) after a time.monotonic():
        # a job that moves is not stalled on its network, whatever the host's count does
        self.moving = moving
        self.last_look = time.monotonic()
        self.done = threading.Event()
        self.said_late = self.said_waits = self.said_fails = False
        self.said_unfound = False   # failed connects said once without a cause found
        # host -> its failed connects at the last look, whether its ranks had started,
        # and how many the run of looks that each saw the count grow has added up
        self.fails: dict[int, tuple[int, bool, int]] = {}
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self.run, daemon=True, name="orch-netwatch")

    def start(self) -> NetWatch:
        self.thread.start()
        return self

    def close(self) -> None:
        self.done.set()

    def run(self) -> None:
        notice = notice_after()
        for at in looks(notice):
            if self.done.wait(max(0.0, self.t0 + at - time.monotonic())) or self.failed():
                return
            try:
                self.look(at, at >= notice)
            except Exception:  # a look is advice: never the job's end
                pass
            if self.said_late and (self.said_waits or self.said_fails):
                return

    def look(self, at: float, rendezvous: bool) -> None:
        cluster = self.session.cluster
        waits: tuple[ev.NetWait, ...] = ()
        grown: dict[int, int] = {}
        if not (self.said_waits or self.said_fails):
            waits, grown = self.ask(rendezvous)
        late: tuple[str, ...] = ()
        text = None
        if rendezvous and not self.said_late:
            self.said_late = True
            late = tuple(h.label for h in cluster.hosts
                         if not any(r in self.started for r in h.ranks))
            text = stalled(cluster, set(self.started), *self.master, at)
        if waits:   # the waiting connections name the cause the rendezvous line guesses
            self.said_waits = True
            text = waits_text(waits, self.master)
        elif grown and not self.failed():   # refused and tried again: no socket waits
            waits = self.reach(grown)
            # a pair found is said once and ends the looks; "not found" (every host
            # answered the check: a node refused while host 0 still started, say) is
            # said once, and the looks go on: a firewall that comes later is still named.
            # Not found is said only while no rank printed since the last look: the count
            # is the whole host's, and a job that prints is not held by its network
            # (the shipped demo said it between two epochs beside a busy machine).
            quiet = not self.moving(self.last_look)
            if waits or (quiet and not self.said_unfound):
                labels = {i: cluster.hosts[i].label for i in grown}
                text = fails_text(grown, labels, waits) + (f"\n{text}" if text else "")
                self.said_unfound = self.said_unfound or not waits
            self.said_fails = bool(waits)
        self.last_look = time.monotonic()
        if text and not self.done.is_set() and not self.failed():
            self.emit(ev.NetworkStall(time.time(), late, waits, text))

    def ask(self, rendezvous: bool = False) -> tuple[tuple[ev.NetWait, ...], dict[int, int]]:
        """Every host's waiting connections, each peer named by the addresses the hosts
        hold (one held by several hosts, as docker0's, names none); and the hosts whose
        failed connects grew look after look, by how many (grown())."""
        s = self.session
        got = ask_waits(s)
        grown = self.grown(got, rendezvous)
        owners = owners_of(s, got, self.master[0])
        out = []
        for i, reply in sorted(got.items()):
            for w in reply.waits:
                peers = owners.get(w.addr)
                if not peers or netprobe.is_loopback(w.addr):
                    continue   # not a connection between the job's hosts
                peer = next(iter(peers)) if len(peers) == 1 else None
                out.append(ev.NetWait(s.cluster.hosts[i].label, w.rank, peer, w.addr,
                                      w.port, w.tries))
        return tuple(out), grown

    def grown(self, got: dict[int, NetWaitsReply], rendezvous: bool) -> dict[int, int]:
        """Hosts whose count of failed connects grew at each look of a run of looks, by
        MIN_FAILS or more in all since the run began, counted only between two looks
        that each found every rank of the host started: before, a node's launcher is
        refused by the store while host 0 still imports torch, which is no fault. At the
        rendezvous look a host with no rank started counts too: by then its refusals are
        one. A run, not one gap between looks: torch's store client tries again with a
        growing backoff, about two refusals between looks that double (a gap alone never
        reached MIN_FAILS in half of the runs of a store refused at host 0). A look
        without growth ends the run (another program's stray refusals never add up),
        and so does a count returned here (the next check counts anew)."""
        out = {}
        for i, reply in got.items():
            now = reply.fails
            if now is None:
                continue
            ranks = self.session.cluster.hosts[i].ranks
            up = all(r in self.started for r in ranks)
            late = rendezvous and not any(r in self.started for r in ranks)
            before, was_up, run = self.fails.get(i, (None, False, 0))
            grew = now - before if before is not None and ((up and was_up) or late) else 0
            run = run + grew if grew > 0 else 0
            if run >= MIN_FAILS:
                out[i], run = run, 0
            self.fails[i] = (now, up, run)
        return out

    def reach(self, grown: dict[int, int]) -> tuple[ev.NetWait, ...]:
        """Which hosts those with failed connects reach on a port the OS picks: each of
        the next REACH_PEERS hosts on the ring listens once (`net_listen`), the host
        probes them as preflight does, then the listeners close. Bounded at any size:
        REACH_FROM hosts checked, REACH_PEERS connections each. A pair refused,
        unreachable or unanswered is returned (rank None: the check's own connection)."""
        s = self.session
        n = len(s.cluster.hosts)
        froms = [i for i in sorted(grown) if i in s.links][:REACH_FROM]
        peers = {i: [j % n for j in range(i + 1, i + n) if j % n in s.links][:REACH_PEERS]
                 for i in froms}
        need = tuple(s.cluster.hosts[j] for j in sorted({j for js in peers.values() for j in js}))
        tokens = {h.index: f"orch-reach-{s.run_id}-{h.index}" for h in need}
        wait = timeouts.scaled(timeouts.NET_WAITS, len(need))
        ports = fan_out(need, lambda h: s.links[h.index].request(
            "net_listen", wait, token=tokens[h.index])).ok
        try:
            addrs = self.addresses()
            targets = {i: [{"addr": addrs[j], "port": ports[j]["port"], "token": tokens[j],
                            "group": str(j)} for j in peers[i] if ports.get(j, {}).get("port")]
                       for i in froms}
            bound = netprobe.bound(n)
            got = fan_out(tuple(s.cluster.hosts[i] for i in froms),
                          lambda h: s.links[h.index].request(
                              "net_probe", timeouts.scaled(bound * 4 + 10, len(froms)),
                              targets=targets[h.index], bound=bound)).ok
        finally:
            fan_out(need, lambda h: s.links[h.index].request("net_close", wait))
        return tuple(ev.NetWait(s.cluster.hosts[i].label, None,
                                s.cluster.hosts[int(t["group"])].label, t["addr"], t["port"],
                                0, PROBE_CAUSE[r["why"]])
                     for i, reply in sorted(got.items())
                     for t, r in zip(targets[i], reply["results"]) if r["why"] in PROBE_CAUSE)

    def addresses(self) -> dict[int, str]:
        """Each host's address the hosts use between themselves: the network plan's (its
        source toward the master), else the inventory's; host 0's: MASTER_ADDR."""
        s = self.session
        out = {h.index: h.address for h in s.cluster.hosts}
        doc = network.load(s.cluster, s.run_id)
        for h, planned in zip(s.cluster.hosts, doc["hosts"] if doc else []):
            if planned.get("address"):
                out[h.index] = str(planned["address"])
        out[0] = self.master[0]
        return out


MIN_FAILS = 3      # failed connects over looks that each saw more that start the check
REACH_FROM = 16    # hosts with failed connects checked in one look
REACH_PEERS = 64   # hosts each of them is checked against (the next on the ring)
PROBE_CAUSE = {"refused": "refused", "unreachable": "unreachable", "timeout": "no answer"}


def fails_text(grown: dict[int, int], labels: dict[int, str],
               found: tuple[ev.NetWait, ...]) -> str:
    """What the failed connects and the check found, in a line: the pairs refused or
    unanswered with the cause and fix; else only what was seen (no pair invented)."""
    seen = ", ".join(f"{n} on {labels[i]}" for i, n in sorted(grown.items())[:SHOWN])
    more = f" (and {len(grown) - SHOWN} more hosts)" if len(grown) > SHOWN else ""
    seen = (f"failed TCP connects, more at each look: {seen}{more} (refused or "
            "unreachable, then tried again, so no connection waits)")
    if not found:
        return (f"network: {seen}; every host checked from there answered on a port the "
                "OS picks, so the cause is not found: a rank may be trying a peer that "
                "is not listening, or one port a firewall closes; the job goes on")
    pairs: dict[tuple[str, str], ev.NetWait] = {}
    for w in found:
        pairs.setdefault((w.host, w.peer or w.addr), w)
    shown = [f"{w.host} -> {w.peer} at {w.addr}:{w.port} {w.cause}"
             for w in list(pairs.values())[:SHOWN]]
    extra = f" (and {len(pairs) - SHOWN} more)" if len(pairs) > SHOWN else ""
    causes = {w.cause for w in pairs.values()}
    act = "refuses" if causes == {"refused"} else "drops or refuses"
    hosts = fold(sorted({h for pair in pairs for h in pair}))
    return (f"network hang: {seen}; checked on a port the OS picks: {len(pairs)} host "
            f"{'pair' if len(pairs) == 1 else 'pairs'} cannot connect ({'; '.join(shown)}"
            f"{extra}); likely cause: a firewall between {hosts} {act} it; fix: allow TCP "
            "between the hosts of the job on every port (gloo and NCCL connect each pair "
            "of ranks on ports the OS picks); the job waits until torch's own timeout "
            "(gloo 30 min, NCCL 10), Ctrl-C or `orch stop`")


def ask_waits(s: Session) -> dict[int, NetWaitsReply]:
    """Every reachable host's `net_waits` reply (a host that does not answer is left out)."""
    hosts = tuple(h for h in s.cluster.hosts if h.index in s.links)
    got = fan_out(hosts, lambda h: s.links[h.index].request(
        "net_waits", timeouts.scaled(timeouts.NET_WAITS, len(hosts)),
        job_dir=s.records[h.index].job_dir))
    return {i: NetWaitsReply.of(reply) for i, reply in got.ok.items()}


def owners_of(s: Session, replies: dict[int, NetWaitsReply], master: str
              ) -> dict[str, set[str]]:
    """Address -> the labels of the hosts that hold it, from `net_waits` replies."""
    owners: dict[str, set[str]] = {}
    for i, reply in replies.items():
        for iface in reply.interfaces:
            for addr in iface.addrs:
                owners.setdefault(addr, set()).add(s.cluster.hosts[i].label)
    owners.setdefault(master, set()).add(s.cluster.hosts[0].label)
    return owners


def waits_text(waits: tuple[ev.NetWait, ...], master: tuple[str, int]) -> str:
    """One line: each host pair once (the first connection of it), the cause, the fix."""
    pairs: dict[tuple[str, str], ev.NetWait] = {}
    for w in waits:
        pairs.setdefault((w.host, w.peer or w.addr), w)
    shown = [pair_text(w, master) for w in list(pairs.values())[:SHOWN]]
    more = f" (and {len(pairs) - SHOWN} more)" if len(pairs) > SHOWN else ""
    store = all(w.rank is None and (w.addr, w.port) == master for w in pairs.values())
    fix = (f"allow TCP port {master[1]} from the other hosts to host 0" if store else
           "allow TCP between the hosts of the job on every port (gloo and NCCL connect "
           "each pair of ranks on ports the OS picks)")
    hosts = fold(sorted({h for pair in pairs for h in pair}))
    return (f"network hang: {len(pairs)} host "
            f"{'pair gets' if len(pairs) == 1 else 'pairs get'} no answer to a connection "
            f"({'; '.join(shown)}{more}); likely cause: a firewall between {hosts} drops "
            f"it; fix: {fix}; the job waits until torch's own timeout (gloo 30 min, "
            f"NCCL 10), Ctrl-C or `orch stop`")


def pair_text(w: ev.NetWait, master: tuple[str, int]) -> str:
    who = "torchrun" if w.rank is None else f"rank {w.rank}"
    where = " (the rendezvous)" if (w.addr, w.port) == master else ""
    peer = w.peer or "an address several hosts hold"
    return (f"{who} on {w.host} -> {peer} at {w.addr}:{w.port}{where}, "
            f"{w.tries + 1} tries unanswered")


# ------------------------------------------------ a connection that failed at once

# A firewall that refuses (iptables REJECT) rather than drops leaves no waiting socket:
# gloo tries a pair 4 times in about a second, then init_process_group raises. The
# root cause's last lines then say so, in gloo's, NCCL's or the c10d store's words.
WHY = r"(?P<why>Connection refused|No route to host|Network is unreachable|Connection timed out)"
ADDR = r"\[?(?P<addr>[0-9A-Za-z.:_-]{1,253}?)\]?"
CONNECT_ERRORS = (
    re.compile(WHY + r"[^\n]{0,200}?remote=" + ADDR + r":(?P<port>\d{1,5})"),          # gloo
    re.compile(r"Connect to " + ADDR + r"<(?P<port>\d{1,5})> failed\s*:\s*" + WHY),    # NCCL
    re.compile(r"failed to connect to " + ADDR + r":(?P<port>\d{1,5}) \(errno: \d+ - " + WHY),
)
CAUSE = {"Connection refused": "refused", "No route to host": "unreachable",
         "Network is unreachable": "unreachable", "Connection timed out": "no answer"}


def connect_error(lines: tuple[str, ...]) -> tuple[str, int, str] | None:
    """The last failed connection the lines name: (address, port, cause)."""
    for line in reversed(lines):
        for pattern in CONNECT_ERRORS:
            m = pattern.search(line[-2000:])
            if m and 0 < int(m["port"]) < 65536:
                return m["addr"], int(m["port"]), CAUSE[m["why"]]
    return None


def refused(s: Session, cause: ev.RootCause, master: tuple[str, int]
            ) -> ev.NetworkStall | None:
    """After a failure of a job of several hosts: when the root cause's rank could not
    connect to another host, the network named as the cause (host pair, address, port,
    fix); the hosts are asked once for their addresses to name the peer. None else."""
    f = cause.rank
    if f is None or len(s.cluster.hosts) < 2:
        return None
    found = connect_error(f.last_lines + tuple(f.error_file.splitlines()))
    if found is None:
        return None
    addr, port, why = found
    try:
        owners = owners_of(s, ask_waits(s), master[0])
    except Exception:   # advice: the root cause is said without the peer's name
        owners = {}
    for h in s.cluster.hosts:
        owners.setdefault(h.address, set()).add(h.label)
    peers = owners.get(addr, set())
    peer = next(iter(peers)) if len(peers) == 1 else None
    w = ev.NetWait(f.host, f.rank, peer, addr, port, 0, why)
    return ev.NetworkStall(time.time(), (), (w,), refused_text(w, master))


def refused_text(w: ev.NetWait, master: tuple[str, int]) -> str:
    """The cause in a line: who could not connect to whom, where, why, and the fix."""
    peer = w.peer or ("a loopback address" if netprobe.is_loopback(w.addr) else
                      "another host")
    where = " (the rendezvous)" if (w.addr, w.port) == master else ""
    head = (f"the root cause is the network: rank {w.rank} on {w.host} could not connect "
            f"to {peer} at {w.addr}:{w.port}{where} ({w.cause}); ")
    every = ("allow TCP between the hosts of the job on every port (gloo and NCCL "
             "connect each pair of ranks on a port the OS picks, not only the master port)")
    if netprobe.is_loopback(w.addr):
        return head + ("likely cause: a rank told the others a loopback address (its "
                       "hostname resolves to one; gloo binds what the hostname resolves "
                       "to); fix: set `network.interface` in cluster.yaml (or "
                       "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in job.env) to the "
                       "interface that reaches the other hosts")
    if where:
        return head + (f"likely cause: a firewall on host 0 {FIREWALL[w.cause]} the master "
                       f"port; fix: allow TCP port {w.port} from the other hosts to host 0")
    if w.cause == "unreachable":
        return head + (f"likely cause: no route from {w.host} to {w.addr}, or a firewall "
                       f"that answers `unreachable`; fix: {every}, and set "
                       "`network.interface` to one that reaches the other hosts")
    return head + f"likely cause: a firewall on {peer} {FIREWALL[w.cause]} that port; fix: {every}"


FIREWALL = {"refused": "refuses (REJECT)", "no answer": "drops", "unreachable": "refuses"}
