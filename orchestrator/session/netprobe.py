"""The network probe of preflight: one `net_probe` round, proving the master address
and the ports between the hosts.

Every host connects to host 0 on the master port at each candidate address (a star:
proves MASTER_ADDR) and to its ring neighbour on a port the OS picked (proves the ports
gloo and NCCL connect their pairs on). 2n connections in all, each bounded by `bound`
(3 s below 100 hosts), all at once: the cost stays flat in the number of hosts. A
connection that got no answer in time (not refused) is tried once more with twice the
bound before it is called blocked, unless all of its kind timed out (a firewall:
`retry_slow`). What a ring cannot see: a rule between two hosts that are not
neighbours, a port range open only in part, RDMA and UDP (docs/howto/network.md).

What the probe proved becomes the plan in session/network.py (`prove`).
"""
from __future__ import annotations

import ipaddress
from dataclasses import asdict, replace

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


Results = dict[int, list[Probed]]   # host index -> its probe's targets, as probed
Targets = dict[int, list[Target]]   # host index -> what it probes


def token(nonce: str, index: int) -> str:
    return f"orch-{nonce[:16]}-{index}"


def virtual(name: str) -> bool:
    return name.startswith(VIRTUAL)


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
