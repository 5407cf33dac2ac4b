"""The network of a job, proven at preflight: the master address every host reached,
the interface each host's ranks use, and the ports between the hosts.

Preflight learns each host's network (agent/network.learn: its interfaces, its hostname
and what that resolves to, the route toward the master) and opens its listeners; then
one `net_probe` round: every host connects to host 0 on the master port at each
candidate address (a star: proves MASTER_ADDR) and to its ring neighbour on a port the
OS picked (proves the ports gloo and NCCL connect their pairs on). 2n connections
in all, each bounded by `bound` (3 s below 100 hosts), all at once: the cost stays flat
in the number of hosts. A connection that got no answer in time (not refused) is tried
once more with twice the bound before it is called blocked, unless all of its kind
timed out (a firewall: `retry_slow`). What a ring cannot see: a rule between two hosts that are not neighbours, a
port range open only in part, RDMA and UDP (docs/howto/network.md).

One machine (every host's inventory address is loopback, or every host reached the
master over lo): nothing is probed or set; loopback is then the right interface.
"""
from __future__ import annotations

import ipaddress
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TypedDict, cast

from orchestrator.config.hostranges import fold
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import HostError
from orchestrator.remote.fanout import GroupResult, fan_out
from orchestrator.remote.link import Link
from orchestrator.session.replies import NetFacts, Probed, Target
from orchestrator.wire import timeouts

PROBE_TIMEOUT = 3.0          # one connection of the probe: past this, a firewall drops it


def bound(hosts: int) -> float:
    """PROBE_TIMEOUT, and a second more per 100 hosts: host 0 takes every host's
    connection at once (200 namespace hosts on one loaded kernel: 40 SYNs answered
    after 3 s, a false exit 3 with the bare bound)."""
    return PROBE_TIMEOUT + hosts // 100
ENV_KEYS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# interfaces that never carry traffic between machines (bridges of containers and VMs)
VIRTUAL = ("lo", "docker", "veth", "br-", "virbr", "cni", "flannel", "cali", "vxlan", "tun")
MAX_CANDIDATES = 6           # addresses of one host tried at once
RING_SHOWN = 4               # blocked pairs named when one cause blocks more of them


def is_loopback(addr: str) -> bool:
    if addr.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


class NetArgs(TypedDict):
    """The preflight request's `net` (protocol.py's REQUESTS["preflight"]["?net"])."""

    toward: str
    token: str
    listen: bool
    master: bool


Results = dict[int, list[Probed]]   # host index -> its probe's targets, as probed
Targets = dict[int, list[Target]]   # host index -> what it probes


class HostDoc(TypedDict):
    host: str
    interface: str | None
    how: str
    address: str
    found: list[str]
    set: dict[str, str]


class PlanDoc(TypedDict):
    """The plan as `up --json` and `orch status --json` give it, and network.json holds."""

    master_addr: str
    how: str
    probe: str
    seconds: float
    hosts: list[HostDoc]


def inventory_master(cluster: Cluster, ssh_connection: dict[int, str] | None = None) -> str:
    """Host 0's address as the inventory gives it: an ssh master's resolved HostName (an
    ~/.ssh/config alias is not a DNS name); a local master with only local hosts:
    loopback; a local master with ssh hosts: this machine's address as the first ssh
    host sees it (SSH_CONNECTION's client field)."""
    master = cluster.hosts[0]
    if not master.is_local:
        from orchestrator.ssh.connect import (  # paramiko: see Session._ssh
            resolve_target,
            ssh_config,
        )
        return resolve_target(master, ssh_config()).hostname
    for h in cluster.hosts:
        if not h.is_local and ssh_connection and ssh_connection.get(h.index):
            return ssh_connection[h.index].split()[0]
    return "127.0.0.1"


def one_machine(cluster: Cluster) -> bool:
    """Every host at a loopback address (or local): one kernel, nothing to prove. An
    ~/.ssh/config alias counts by the HostName it stands for (`node0` for 127.0.0.2)."""
    if all(h.is_local or is_loopback(h.address) for h in cluster.hosts):
        return True
    if all(h.is_local or is_ip(h.address) for h in cluster.hosts):
        return False   # a literal address that is not loopback: another machine
    from orchestrator.ssh.connect import resolve_target, ssh_config  # see inventory_master
    config = ssh_config()
    return all(h.is_local or is_loopback(resolve_target(h, config).hostname)
               for h in cluster.hosts)


def is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return False
    return True


def wanted(cluster: Cluster) -> bool:
    """Whether preflight learns the hosts' networks: a distributed job on more than one
    machine (an array's tasks do not talk to each other)."""
    return cluster.job.array is None and len(cluster.hosts) > 1 and not one_machine(cluster)


def named(cluster: Cluster) -> bool:
    """Whether the inventory names an interface (`network.interface`, the job's or a
    host's): then it is set on one host or one machine too, where nothing is probed."""
    return cluster.job.array is None and (
        cluster.network.interface is not None
        or any(h.interface is not None for h in cluster.hosts))


def preflight_args(cluster: Cluster, host: Host, nonce: str) -> NetArgs:
    """The preflight request's `net`: what to learn, and whether to listen for the probe
    (only where there is a probe: an interface named on one machine is only looked up)."""
    probe = wanted(cluster)
    toward = cluster.network.master_addr or ("" if cluster.hosts[0].is_local or not probe
                                             else inventory_master(cluster))
    return {"toward": toward, "token": token(nonce, host.index),
            "listen": cluster.network.check and probe, "master": host.index == 0}


def token(nonce: str, index: int) -> str:
    return f"orch-{nonce[:16]}-{index}"


def virtual(name: str) -> bool:
    return name.startswith(VIRTUAL)


def iface_of(facts: NetFacts, addr: str) -> str | None:
    return next((i.name for i in facts.interfaces if addr in i.addrs), None)


def usable_addrs(facts: NetFacts) -> list[str]:
    """Addresses another machine may reach this host at: up, not loopback, not a
    container bridge, not link-local; the route toward the master's first."""
    out = [a for i in facts.interfaces if i.up and not virtual(i.name)
           for a in i.addrs if not a.startswith(("127.", "169.254."))]
    src = facts.route_src
    if src in out:
        out.remove(src)
        out.insert(0, src)
    return out[:MAX_CANDIDATES]


@dataclass(frozen=True)
class HostNet:
    """One host's part of the plan."""

    label: str
    interface: str | None      # what the ranks' *_SOCKET_IFNAME get from orch (None: unset)
    how: str                   # why: auto, network.interface, set by the user, one machine
    address: str = ""          # its address toward the master (the probe's source)
    found: tuple[str, ...] = ()   # what can break a job: the hostname trap, docker0
    env: dict[str, str] = field(default_factory=dict)   # what orch adds to the ranks' env


@dataclass(frozen=True)
class NetPlan:
    master_addr: str
    how: str                   # where MASTER_ADDR came from
    hosts: dict[int, HostNet]
    probe: str                 # what was checked, in words
    seconds: float = 0.0

    def env(self, index: int) -> dict[str, str]:
        h = self.hosts.get(index)
        return dict(h.env) if h else {}

    def lines(self) -> list[str]:
        return plan_lines(self)

    def document(self) -> PlanDoc:
        return {"master_addr": self.master_addr, "how": self.how, "probe": self.probe,
                "seconds": round(self.seconds, 3),
                "hosts": [{"host": h.label, "interface": h.interface, "how": h.how,
                           "address": h.address, "found": list(h.found), "set": h.env}
                          for _, h in sorted(self.hosts.items())]}


def plan_lines(plan: NetPlan) -> list[str]:
    """The network plan as `up` and `--dry-run` show it: identical hosts folded."""
    lines = [f"network: MASTER_ADDR={plan.master_addr} ({plan.how})"]
    groups: dict[tuple[str, str, str], list[str]] = {}
    for _, h in sorted(plan.hosts.items()):
        key = (h.interface or "-", h.how, ", ".join(sorted(h.env)) or "nothing")
        groups.setdefault(key, []).append(h.label)
    for (iface, how, env), labels in groups.items():
        shown = f"interface {iface}" if iface != "-" else "interface left to torch"
        lines.append(f"  {shown} on {fold(labels)} ({how}; set: {env})")
    found: dict[str, list[str]] = {}
    for _, h in sorted(plan.hosts.items()):
        for what in h.found:
            found.setdefault(what, []).append(h.label)
    for what, labels in found.items():
        lines.append(f"  found on {fold(labels)}: {what}")
    lines.append(f"  probe: {plan.probe}")
    return lines


def findings(facts: NetFacts) -> tuple[str, ...]:
    """What breaks pdsh + torchrun on this host: a hostname that resolves to loopback
    (gloo advertises what the hostname resolves to), container bridges."""
    out = []
    loop = [a for a in facts.resolves if a.startswith("127.")]
    if loop:
        out.append(f"hostname resolves to {loop[0]} (loopback): gloo alone would "
                   "advertise it to the other hosts")
    for i in facts.interfaces:
        if virtual(i.name) and i.name != "lo" and i.addrs:
            out.append(f"{i.name} {i.addrs[0]} (a container bridge: never used)")
            break
    return tuple(out)


# ------------------------------------------------------------------ the probe


def candidates(cluster: Cluster, facts0: NetFacts, inventory: str) -> list[str]:
    """MASTER_ADDR candidates in order of preference: `network.master_addr` alone, else
    the inventory's address, then host 0's own addresses that another machine can use."""
    if cluster.network.master_addr:
        return [cluster.network.master_addr]
    out = [] if is_loopback(inventory) else [inventory]
    out += [a for a in usable_addrs(facts0) if a not in out]
    return out[:MAX_CANDIDATES]


def targets(cluster: Cluster, facts: dict[int, NetFacts], cands: list[str],
            nonce: str, master_port: int) -> Targets:
    """Each host's probe: host 0 at every candidate on the master port (group m), its
    ring neighbour at each usable address on its OS-picked port (group r)."""
    n = len(cluster.hosts)
    port0 = facts[0].master_listen or master_port
    out: Targets = {}
    for h in cluster.hosts:
        # host 0 reaches its own addresses at once: it proves every candidate (a group
        # each), and no second round is needed for one it would have left unfinished
        mine = [Target(c, port0, token(nonce, 0), f"m{k}" if h.index == 0 else "m")
                for k, c in enumerate(cands)]
        j = (h.index + 1) % n
        ring = facts[j].port
        if j != h.index and ring:
            mine += [Target(a, ring, token(nonce, j), "r") for a in usable_addrs(facts[j])]
        out[h.index] = mine
    return out


def run_probe(cluster: Cluster, links: dict[int, Link], plan: Targets,
              wait: float | None = None) -> Results:
    """Each host's targets probed at once; `wait`: each connection's bound (bound())."""
    def one(h: Host) -> list[Probed]:
        link = links[h.index]
        # as preflight's: every host's reply is read on this machine's CPU
        reply = link.request("net_probe", timeouts.scaled(each * 4 + 10, len(cluster.hosts)),
                             targets=[asdict(t) for t in plan[h.index]], bound=each)
        return [Probed(t.addr, t.port, t.token, t.group[:1], bool(r["ok"]), str(r["why"]),
                       str(r["src"]), float(r["ms"]), each)
                for t, r in zip(plan[h.index], reply["results"])]
    each = wait or bound(len(cluster.hosts))
    # one thread per host however many: each only waits (at most PROBE_TIMEOUT), and a
    # second wave would add a whole bound where a firewall drops (fan_out's limit is 256)
    result = fan_out(cluster.hosts, one, limit=max(256, len(cluster.hosts)))
    result.raise_failures(cluster.hosts, "the network probe")
    return result.ok


def close_listeners(links: dict[int, Link]) -> None:
    """Sent, not waited for: the agent serves it before the launch's request."""
    for link in links.values():
        try:
            link.submit("net_close")
        except Exception:  # a lost host: its listeners end with its agent
            pass


def why(r: Probed) -> str:
    w = r.why
    if w == "timeout" and r.first:
        return (f"no answer in {r.first:g} s, nor in {r.bound:g} s once more (a "
                "firewall drops it)")
    if w == "timeout":
        return f"no answer in {r.bound:g} s (a firewall drops it)"
    if w == "refused":
        return "connection refused (nothing listens there, or a firewall rejects it)"
    if w == "other":
        return "another machine answers at that address"
    if w == "slow":
        return (f"connected, but no token in {r.bound * 3:g} s (the host is too "
                "loaded to answer, or something else listens there)")
    if w == "unresolved":
        return "the name does not resolve there"
    if w == "unfinished":
        return "not needed (an address before it answered)"
    return w.replace("unreachable", "no route to that address")


def reached(results: Results, c: str, also: str = "") -> list[int]:
    """The hosts whose probe of candidate c on the master port ended ok (or as `also`)."""
    return [i for i, rs in results.items()
            if any(r.group == "m" and r.addr == c and (r.ok or r.why == also) for r in rs)]


def settle(cluster: Cluster, links: dict[int, Link], cands: list[str],
           plan: Targets, results: Results) -> None:
    """A host stops at its best candidate, so a later one may be left unfinished there
    while another host reached only that one (host 0 reaches its inventory address, the
    others do not). The first candidate every host reached or left unfinished is then
    probed again where it was left, alone; the results are updated in place."""
    n = len(cluster.hosts)
    if any(len(reached(results, c)) == n for c in cands):
        return
    c = next((c for c in cands if len(reached(results, c, "unfinished")) == n), None)
    if c is None:
        return
    todo = set(reached(results, c, "unfinished")) - set(reached(results, c))
    again = {i: [t for t in plan[i] if t.group == "m" and t.addr == c] for i in todo}
    sub = replace(cluster, hosts=tuple(h for h in cluster.hosts if h.index in todo))
    for i, rs in run_probe(sub, links, again).items():
        results[i] = [r for r in results[i] if not (r.group == "m" and r.addr == c)] + rs


RETRY = ("timeout", "slow")   # no answer in the bound: a drop, or a host too loaded
RETRY_FACTOR = 2             # a probe tried again waits this many first bounds


def retry_slow(cluster: Cluster, links: dict[int, Link], cands: list[str],
               results: Results) -> None:
    """A connection without an answer in the bound may be a loaded host (200 namespace
    hosts on one kernel: a sixth of the SYNs to host 0 answered after 5 s), not a
    firewall: those the choice depends on are probed once more, alone, each waited for
    RETRY_FACTOR bounds, before any is called blocked. Refused and unreachable are
    answers and stand. Where every host's probe of a kind timed out, nothing is tried
    again: that is a firewall's pattern, and its error comes a bound sooner. The results
    are updated in place."""
    again = slow_master(results, cands) + slow_ring(results)
    if not again:
        return
    todo: Targets = {}
    for i, r in again:   # each target a group of its own: each is waited for
        todo.setdefault(i, []).append(Target(r.addr, r.port, r.token,
                                             f"{r.group}{len(todo[i])}"))
    first = results[again[0][0]][0].bound
    sub = replace(cluster, hosts=tuple(h for h in cluster.hosts if h.index in todo))
    for i, rs in run_probe(sub, links, todo, first * RETRY_FACTOR).items():
        for new in rs:
            old = next(k for k, r in enumerate(results[i])
                       if (r.group, r.addr, r.port) == (new.group, new.addr, new.port))
            results[i][old] = replace(new, first=first)


def slow_master(results: Results, cands: list[str]) -> list[tuple[int, Probed]]:
    """No candidate reached by every host: the first that every host reached or got no
    answer from in time, at the hosts that got none (not all of them)."""
    if any(len(reached(results, c)) == len(results) for c in cands):
        return []
    for c in cands:
        mine = {i: next((r for r in rs if r.group == "m" and r.addr == c), None)
                for i, rs in results.items()}
        if any(r is None or not (r.ok or r.why in RETRY) for r in mine.values()):
            continue
        slow = [(i, r) for i, r in mine.items() if r is not None and not r.ok]
        others = sum(1 for i in mine if i != 0)
        return [] if len(slow) >= others else slow
    return []


def slow_ring(results: Results) -> list[tuple[int, Probed]]:
    """The ring targets that got no answer in time at hosts that reached no address of
    their neighbour; none where every host's ring is so (its other addresses may have
    answered no route: the inventory's, on an interface the hosts do not share)."""
    rings = {i: [r for r in rs if r.group == "r"] for i, rs in results.items()}
    rings = {i: ring for i, ring in rings.items() if ring}
    stuck = {i: [r for r in ring if r.why in RETRY] for i, ring in rings.items()
             if not any(r.ok for r in ring)}
    stuck = {i: slow for i, slow in stuck.items() if slow}
    if len(stuck) == len(rings):
        return []
    return [(i, r) for i, slow in sorted(stuck.items()) for r in slow]


def choose_master(cluster: Cluster, cands: list[str], results: Results) -> str:
    """The first candidate every host reached; else exit 3 naming who failed where."""
    for c in cands:
        if all(any(r.group == "m" and r.addr == c and r.ok for r in rs)
               for rs in results.values()):
            return c
    port = next(r.port for rs in results.values() for r in rs if r.group == "m")
    failed: dict[int, BaseException] = {}
    for i, rs in sorted(results.items()):
        bad = [r for r in rs if r.group == "m" and not r.ok and r.why != "unfinished"]
        if bad:
            text = "; ".join(f"{r.addr}:{r.port} {why(r)}" for r in bad)
            failed[i] = HostError(f"{cluster.hosts[i].label}: cannot reach host 0 "
                                  f"({cluster.hosts[0].label}) on the master port: {text}")
    GroupResult(failed=failed).raise_failures(
        cluster.hosts, "to reach the master (no address of host 0 is reached by every host)",
        hint=f"allow TCP port {port} from the other hosts to host 0, or set "
             "`network.master_addr:` to an address of host 0 that every host reaches")
    raise HostError("no address of host 0 is reached by every host")   # not reached


def check_ring(cluster: Cluster, results: Results,
               address: dict[int, str], took: float = 0.0) -> None:
    """Each host reached its neighbour on a port the OS picked, at the address that
    neighbour's ranks will use; else exit 3 naming both hosts, the port and the cause
    (and how long the check took after preflight: `took`)."""
    n = len(cluster.hosts)
    bad: dict[int, Probed] = {}
    for i, rs in sorted(results.items()):
        ring = [r for r in rs if r.group == "r"]
        if not ring:
            continue
        r = ([r for r in ring if r.addr == address.get((i + 1) % n)] or ring[:1])[0]
        if not (r.ok or (r.why == "unfinished" and any(x.ok for x in ring))):
            bad[i] = r
    if not bad:
        return
    fix = ("allow TCP between the hosts of the job on every port (gloo and NCCL connect "
           "each pair of ranks on ports the OS picks), or turn this check off with "
           "`network.check: false`")
    pair = {i: f"{cluster.hosts[i].label} -> {cluster.hosts[(i + 1) % n].label} "
               f"{r.addr}:{r.port}" for i, r in bad.items()}
    causes = {why(r) for r in bad.values()}
    what = f"the network check before launch ({took:.1f} s)"
    if len(bad) > RING_SHOWN and len(causes) == 1:   # one cause everywhere: one message
        shown = "; ".join(pair[i] for i in sorted(bad)[:RING_SHOWN])
        raise HostError(f"{what}: {len(bad)} of {n} hosts cannot "
                        f"reach their ring neighbour on a port the OS picked (as gloo and "
                        f"NCCL connect their pairs): {causes.pop()}: {shown} "
                        f"(and {len(bad) - RING_SHOWN} more)", hint=fix)
    GroupResult(failed={i: HostError(f"{pair[i]} (a port the OS picked, as gloo and NCCL "
                                     f"connect their pairs): {why(r)}")
                        for i, r in bad.items()}).raise_failures(
        cluster.hosts, what, hint=fix)


# ------------------------------------------------------------------ the plan


def user_set(cluster: Cluster, facts: NetFacts) -> dict[str, str]:
    """The interface variables the user set: in `job.env`, or in the host's environment
    (the ranks inherit it). orch never overrides them."""
    job = dict(cluster.job.env)
    out = {k: "job.env" for k in ENV_KEYS if k in job}
    out.update({k: "the host's environment" for k in ENV_KEYS
                if k in facts.env and k not in out})
    return out


def host_plan(cluster: Cluster, host: Host, facts: NetFacts, src: str,
              master: str, all_lo: bool) -> HostNet:
    """The interface of one host's ranks: `network.interface` (the host's, else the
    job's), else the one that carried the probe to the master; none on one machine."""
    names = host.interface if host.interface is not None else cluster.network.interface
    iface: str | None
    if names is not None:
        have = {i.name for i in facts.interfaces}
        missing = [n for n in names if n not in have]
        if missing:
            raise HostError(f"{host.label}: network.interface {', '.join(missing)} does not "
                            f"exist there (its interfaces: {', '.join(sorted(have))})",
                            hint="name an interface the host has, or write `interface: auto`")
        iface, how = ",".join(names), "network.interface"
    elif all_lo:
        iface, how = None, ("one host" if len(cluster.hosts) == 1 else
                            "one machine: all hosts reached the master over loopback")
    else:
        iface = iface_of(facts, src)
        if iface == "lo":   # this host is host 0's machine: host 0's interface there
            iface = iface_of(facts, master)
        how = "auto: it carried the probe to the master"
        if iface is None or virtual(iface):
            iface, how = None, f"not set: the probe to the master left from {src or '?'}"
    user = user_set(cluster, facts)
    if user:
        how += "; " + ", ".join(f"{k} set in {w}" for k, w in sorted(user.items()))
    env = {k: iface for k in ENV_KEYS if k not in user} if iface else {}
    return HostNet(host.label, iface, how, src, findings(facts), env)


def plan_of(cluster: Cluster, facts: dict[int, NetFacts], src: dict[int, str],
            master: str, how: str, probe: str, t0: float) -> NetPlan:
    all_lo = all(iface_of(facts[i], s) == "lo" for i, s in src.items() if s)
    hosts = {h.index: host_plan(cluster, h, facts[h.index], src.get(h.index, ""), master, all_lo)
             for h in cluster.hosts}
    return NetPlan(master, how, hosts, probe, time.monotonic() - t0)


def named_only(cluster: Cluster, facts: dict[int, NetFacts], inventory: str,
               t0: float) -> NetPlan:
    """One host or one machine with `network.interface` named: the names are checked
    against each host's interfaces and set; a host without a name is left to torch."""
    base = unproven(cluster, inventory)
    # no findings: a hostname on loopback or a docker0 breaks nothing within one machine
    hosts = {h.index: replace(host_plan(cluster, h, facts[h.index], "", base.master_addr, True),
                              found=()) for h in cluster.hosts}
    why = "one host" if len(cluster.hosts) == 1 else "one machine"
    return NetPlan(base.master_addr, base.how, hosts, f"none ({why}: the named interfaces "
                   "set as they are)", time.monotonic() - t0)


def unproven(cluster: Cluster, inventory: str) -> NetPlan:
    """One machine, one host, or a host that learnt nothing: the inventory's address."""
    why = "one host" if len(cluster.hosts) == 1 else "one machine"
    addr = cluster.network.master_addr or inventory
    how = "network.master_addr" if cluster.network.master_addr else "the inventory's address"
    return NetPlan(addr, how, {}, f"none ({why}: interfaces left to torch)")


def prove(cluster: Cluster, links: dict[int, Link], facts: dict[int, NetFacts | None],
          ssh_connection: dict[int, str], master_port: int, nonce: str) -> NetPlan:
    """MASTER_ADDR, every host's interface and the ports between the hosts, proven by
    one probe round (or, with `network.check: false`, taken from the routes)."""
    t0 = time.monotonic()
    inventory = inventory_master(cluster, ssh_connection)
    known = {i: f for i, f in facts.items() if f is not None}
    if not wanted(cluster) or len(known) < len(cluster.hosts):
        if named(cluster) and len(known) == len(cluster.hosts):
            return named_only(cluster, known, inventory, t0)
        return unproven(cluster, inventory)
    if not cluster.network.check:
        addr = cluster.network.master_addr or inventory
        src = {i: f.route_src for i, f in known.items()}
        return plan_of(cluster, known, src, addr, "not probed", "off (network.check: false)", t0)
    cands = candidates(cluster, known[0], inventory)
    try:
        todo = targets(cluster, known, cands, nonce, master_port)
        results = run_probe(cluster, links, todo)
        settle(cluster, links, cands, todo, results)
        retry_slow(cluster, links, cands, results)
    finally:
        close_listeners(links)
    addr = choose_master(cluster, cands, results)
    src = {i: next(r.src for r in rs if r.group == "m" and r.addr == addr and r.ok)
           for i, rs in results.items()}
    plan = plan_of(cluster, known, src, addr, master_how(cluster, addr, inventory, results),
                   "", t0)
    check_ring(cluster, results, {i: h.address for i, h in plan.hosts.items()},
               time.monotonic() - t0)
    count = sum(1 for rs in results.values() for r in rs if r.why != "unfinished")
    probe = (f"all hosts reached host 0 on port {results[0][0].port} and its ring "
             f"neighbour on a port the OS picked ({count} connections, "
             f"{time.monotonic() - t0:.2f} s)")
    return NetPlan(plan.master_addr, plan.how, plan.hosts, probe, time.monotonic() - t0)


def master_how(cluster: Cluster, addr: str, inventory: str,
               results: Results) -> str:
    if cluster.network.master_addr:
        return "network.master_addr, reached by all hosts"
    if addr == inventory:
        return "the inventory's address, reached by all hosts"
    bad = [r for rs in results.values() for r in rs
           if r.group == "m" and r.addr == inventory and not r.ok]
    cause = f": {why(bad[0])}" if bad else ""
    return (f"an address of host 0 that all hosts reached; the inventory's {inventory} "
            f"is not one the hosts use between themselves{cause}")


def save(cluster: Cluster, run_id: str, plan: NetPlan) -> None:
    """.orch/<name>/network.json: `orch status` shows each host's interface from it."""
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    path = cluster.state_dir / "network.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(plan.document(), run_id=run_id), indent=1))
    os.replace(tmp, path)


def load(cluster: Cluster, run_id: str) -> PlanDoc | None:
    """The saved plan of this run as `up --json` gives it (NetPlan.document), or None
    (another run's, none, or unreadable)."""
    try:
        doc = json.loads((cluster.state_dir / "network.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.pop("run_id", None) != run_id:
        return None
    return cast(PlanDoc, doc)   # save() wrote it from document(): passed on as it is
