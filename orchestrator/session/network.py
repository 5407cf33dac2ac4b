"""The network of a job, proven at preflight: the master address every host reached,
the interface each host's ranks use, and the ports between the hosts.

Preflight learns each host's network (agent/network.learn: its interfaces, its hostname
and what that resolves to, the route toward the master) and opens its listeners; then
one probe round (session/netprobe.py) proves MASTER_ADDR and the ports between the
hosts, and this module makes the plan of it: each host's interface, what was found,
`.orch/<name>/network.json`.

One machine (every host's inventory address is loopback, or every host reached the
master over lo): nothing is probed or set; loopback is then the right interface.
"""
from __future__ import annotations

import ipaddress
import json
import time
from dataclasses import dataclass, field, replace
from typing import TypedDict, cast

from orchestrator.config.hostranges import fold
from orchestrator.config.inventory import Cluster, Host
from orchestrator.config.safefile import write_whole
from orchestrator.errors import HostError
from orchestrator.remote.link import Link
from orchestrator.session.netprobe import (
    Results,
    candidates,
    check_ring,
    choose_master,
    close_listeners,
    is_loopback,
    retry_slow,
    run_probe,
    settle,
    targets,
    token,
    virtual,
    why,
)
from orchestrator.session.replies import NetFacts

ENV_KEYS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class NetArgs(TypedDict):
    """The preflight request's `net` (protocol.py's REQUESTS["preflight"]["?net"])."""

    toward: str
    token: str
    listen: bool
    master: bool


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
        from orchestrator.ssh.sshconfig import (  # paramiko: see Session._ssh
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
    from orchestrator.ssh.sshconfig import resolve_target, ssh_config  # see inventory_master
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


def iface_of(facts: NetFacts, addr: str) -> str | None:
    return next((i.name for i in facts.interfaces if addr in i.addrs), None)


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
    # through a .tmp of this thread's own: two saves at once through one shared name
    # made one's rename find the other's file gone
    write_whole(cluster.state_dir / "network.json",
                json.dumps(dict(plan.document(), run_id=run_id), indent=1).encode(), 0o644)


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
