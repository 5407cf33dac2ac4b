"""`network:` -> NetworkSpec: the master address, the ranks' interfaces and the probe
between the hosts (session/network.py proves them at preflight).

    network:
      master_addr: 10.0.0.8        # overrides the address orch proves
      interface: auto              # auto | NAME | [NAME, ...]; a host may set its own
      check: true                  # the reachability probe before launch

A host's own `network:` takes `interface:` only (the others are the job's).
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from yaml.nodes import ScalarNode

from orchestrator.config.yamlnodes import TAG, Section, short

NETWORK_KEYS = ("master_addr", "interface", "check")
HOST_NETWORK_KEYS = ("interface",)
# an interface name as the kernel allows it (IFNAMSIZ: 15 bytes, no / or blank)
_IFNAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")


@dataclass(frozen=True)
class NetworkSpec:
    master_addr: str | None = None          # None: proven at preflight
    interface: tuple[str, ...] | None = None   # None: auto (the one that reached the master)
    check: bool = True


NO_NETWORK = NetworkSpec()   # no `network:`: every default


def parse_network(top: Section) -> NetworkSpec:
    top.refuse_empty("network", "indent its settings under it (master_addr:, interface:, "
                                "check:), or delete the line for the defaults")
    sec = Section(top.src, top.node("network"), "network", top.key_line("network"))
    sec.check_keys(NETWORK_KEYS, {})
    addr = sec.text("master_addr", None)
    if addr is not None and not _address_like(addr):
        sec.src.fail(sec.node("master_addr"), f"`network.master_addr` {short(addr)!r} is not "
                     "an address or a host name", "write an IP the hosts use between "
                     "themselves, e.g. `master_addr: 10.0.0.8`, or delete the line")
    return NetworkSpec(addr, parse_interface(sec), _check(sec))


def parse_host_network(host: Section) -> tuple[str, ...] | None:
    """A host's `network: {interface: ...}`; None: the job's setting applies."""
    node = host.node("network")
    if node is None:
        return None
    sec = Section(host.src, node, host.what("network"), host.key_line("network"))
    sec.check_keys(HOST_NETWORK_KEYS, {k: "under the top-level `network:`"
                                       for k in NETWORK_KEYS if k != "interface"})
    return parse_interface(sec)


def parse_interface(sec: Section) -> tuple[str, ...] | None:
    node = sec.node("interface")
    if node is None:
        return None
    what = sec.what("interface")
    one = isinstance(node, ScalarNode) and node.tag == TAG + "str"
    items = [node] if one else sec.src.sequence(node, what)
    if not items:
        sec.src.fail(node, f"`{what}` lists no interface", "write `interface: auto`, or name "
                     "one: `interface: eth0`")
    names = []
    for item in items:
        value = sec.src.value(item, what)
        if not isinstance(value, str) or not _IFNAME.fullmatch(value):
            sec.src.fail(item, f"`{what}` must be auto or interface names, got "
                         f"{sec.src.describe(item) if not isinstance(value, str) else repr(short(value))}",
                         "write `interface: auto`, `interface: eth0` or `interface: [eth0, eth1]`")
        names.append(value)
    if names == ["auto"]:
        return None
    if "auto" in names:
        sec.src.fail(node, f"`{what}` mixes auto with names", "write either `auto` or names")
    if any(n == "lo" for n in names) and len(names) > 1:
        sec.src.fail(node, f"`{what}` mixes lo with other interfaces",
                     "name the interfaces that carry traffic between the hosts")
    return tuple(names)


def _check(sec: Section) -> bool:
    node = sec.node("check")
    if node is None:
        return True
    value = sec.src.value(node, sec.what("check"))
    if not isinstance(value, bool):
        sec.src.fail(node, f"`network.check` must be true or false, got {sec.src.describe(node)}",
                     "write `check: false` to skip the probe between the hosts")
    return bool(value)


def _address_like(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        return re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})", addr) is not None
