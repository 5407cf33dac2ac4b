"""`hosts:` and `ssh:` of cluster.yaml: every host checked and frozen into a `Host`
(with its `SSHOptions`), in inventory order, ranges expanded. inventory.py puts them
into the `Cluster` (the spares set apart, the checks across sections).

- A host is a mapping, or just its address as a shorthand (`- 10.0.0.8`). An address may
  be a range (`gpu[01-16]`, hostranges.py): one host per name, each with the entry's fields.
- `ssh:` holds the defaults of every host's ssh fields; a host's own fields are written
  on it directly. `identity_file` / `known_hosts`: `~` is expanded and relative paths
  are taken from the inventory's folder.
- Bounded: hosts, procs, ranks (the MAX_* limits). `procs` defaults to `gpus`, or 1
  when `gpus` is 0; `procs` above a non-zero `gpus` is refused (two ranks would share
  a GPU, which NCCL refuses).
- Hosts with the same address, port and connection are refused as duplicates,
  except `connection: local` hosts: several local hosts simulate several nodes on
  one machine (the shipped demo), each with its own `remote_dir` (their ssh fields
  are checked but unused).
- If the first host (the master) has a loopback address (localhost, 127.x, ::1),
  every host must: other machines could not reach MASTER_ADDR otherwise.
"""
from __future__ import annotations

import hashlib
import ipaddress
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import overload

from yaml.nodes import Node, ScalarNode

from orchestrator.config import hostranges
from orchestrator.config.networkspec import parse_host_network
from orchestrator.config.proxyjump import parse_jump
from orchestrator.config.yamlnodes import TAG, Section, Source, check_text, short, text_items

SSH_KEYS = ("user", "port", "identity_file", "known_hosts", "host_key_policy", "connect_timeout",
            "proxy_jump")
HOST_KEYS = ("address", "connection", "gpus", "procs", "remote_dir", "python", "spare",
             "network") + SSH_KEYS
HOST_KEY_POLICIES = ("strict", "accept-new")
CONNECTIONS = ("ssh", "local")
DEFAULT_REMOTE_DIR = "~/orch"
DEFAULT_PYTHON = "python3"

# Limits: far above real clusters, low enough that no inventory makes orch slow or big.
MAX_HOSTS = 4096          # hosts, after ranges are expanded
MAX_PROCS = 1024          # procs (and gpus) on one host
MAX_WORLD_SIZE = 65536    # ranks in all
_SPLIT_HINT = "split the job into several inventories, or list fewer hosts"


@dataclass(frozen=True)
class SSHOptions:
    """How to reach a host; None means 'ask ~/.ssh/config' (resolved by the transport)."""

    user: str | None          # None: ~/.ssh/config, then the local user
    port: int | None          # None: ~/.ssh/config, then 22
    identity_file: str | None # absolute, ~ expanded
    known_hosts: str             # absolute, ~ expanded
    host_key_policy: str         # "strict" | "accept-new"
    connect_timeout: float       # seconds
    # bastions, first hop first (`[user@]host[:port]`); None: ~/.ssh/config's ProxyJump
    proxy_jump: tuple[str, ...] | None = None
    # (inventory, line) that set identity_file, for messages; not part of the options' value
    identity_file_at: tuple[str, int] | None = field(default=None, compare=False)


DEFAULT_SSH = SSHOptions(None, None, None, os.path.expanduser("~/.ssh/known_hosts"), "strict", 10.0)


@dataclass(frozen=True)
class Host:
    """One machine (node) of the job, in inventory order; `index` is its node rank."""

    index: int
    address: str
    connection: str              # "ssh" | "local"
    gpus: int
    procs: int                   # worker processes (nproc-per-node)
    first_rank: int              # global rank of its local rank 0
    remote_dir: str              # as written; ~ is resolved on the host
    python: str
    ssh: SSHOptions
    line: int                    # 1-based line of its entry in the file
    display: str = ""            # label when the address alone is ambiguous
    # the GPUs of this run when `orch up --hosts host:0,1` named some (procs = their number);
    # None: the host as the inventory gives it
    gpu_ids: tuple[int, ...] | None = None
    all_gpus: bool = False       # `gpus: all`: every GPU free at preflight (gpus is then 1)
    spare: bool = False          # `spare: true`: runs nothing until it replaces a lost host
    procs_given: bool = True     # `procs:` written: a claim of `gpus: all` leaves it as is
    interface: tuple[str, ...] | None = None   # its own `network.interface` (None: the job's)

    @property
    def gpu_want(self) -> int | str | list[int] | None:
        """What the host's agent claims at preflight (agent/gpus.py); None: no GPU."""
        if self.gpu_ids is not None:
            return list(self.gpu_ids)
        if self.all_gpus:
            return "all"
        return self.gpus or None

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.procs)

    @property
    def label(self) -> str:
        """Short name for output: the address, or `address:port` / `address#index` when shared."""
        return self.display or self.address

    @property
    def is_local(self) -> bool:
        return self.connection == "local"

    @property
    def part(self) -> str:
        """Its part of the job folder, run/<part>/ (hosts may share one job folder)."""
        return host_part(self.label)


def host_part(label: str) -> str:
    """`host-<label>` as a plain file name; a label changed to fit one gets a short hash
    of itself, so that two labels never give one part."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in label)[:80]
    if safe == label:
        return "host-" + safe
    return f"host-{safe}-{hashlib.sha256(label.encode()).hexdigest()[:8]}"


def parse_hosts(top: Section, base_dir: Path, belongs: Mapping[str, str]) -> tuple[Host, ...]:
    """`hosts:` (with `ssh:`, `remote_dir:` and `python:` as every host's defaults);
    `belongs`: where a key unknown here belongs instead (inventory.py's, for the hint)."""
    src = top.src
    node = top.node("hosts")
    items = src.sequence(node, "hosts") if node is not None else []
    if not items:
        src.fail(top.key_line("hosts") if node is not None else 1, "no hosts: `hosts` lists none",
                 "add at least one host, e.g. `hosts: [{address: localhost, connection: local}]`")
    if len(items) > MAX_HOSTS:
        src.fail(items[MAX_HOSTS], f"`hosts` lists more than {MAX_HOSTS} hosts (the limit)", _SPLIT_HINT)
    ssh_section = Section(src, top.node("ssh"), "ssh", top.key_line("ssh"))
    ssh_section.check_keys(SSH_KEYS, belongs)
    defaults = (_ssh_options(ssh_section, DEFAULT_SSH, base_dir), _remote_dir(top, DEFAULT_REMOTE_DIR),
                top.text("python", DEFAULT_PYTHON))
    hosts: list[Host] = []
    names: list[str] = []  # each host as messages name it: `hosts[3]`, or `hosts[3] (gpu02)`
    nodes: list[Node] = []
    seen: dict[tuple[object, ...], int] = {}
    for entry, item in enumerate(items):
        template, addresses = _entry(src, item, entry, MAX_HOSTS - len(hosts), defaults, base_dir,
                                     belongs)
        for address in addresses:
            first_rank = hosts[-1].ranks.stop if hosts else 0
            host = replace(template, index=len(hosts), address=address, first_rank=first_rank)
            name = f"hosts[{entry}]" + (f" ({address})" if len(addresses) > 1 else "")
            _check_world_size(src, item, host, name)
            _check_duplicate(src, item, host, name, seen, names, hosts)
            hosts.append(host)
            names.append(name)
            nodes.append(item)
    _check_master_reachable(src, nodes, hosts, names)
    return tuple(replace(h, display=label) for h, label in zip(hosts, _labels(hosts)))


def _entry(src: Source, node: Node, entry: int, room: int, defaults: tuple[SSHOptions, str, str],
           base_dir: Path, belongs: Mapping[str, str]) -> tuple[Host, list[str]]:
    """One `hosts:` entry: its settings (as a Host for its first address) and its addresses."""
    ssh, remote_dir, python = defaults
    sec, address_node, address = _host_section(src, node, f"hosts[{entry}]", belongs)
    if room <= 0:
        src.fail(node, f"`{sec.name}` is past the limit of {MAX_HOSTS} hosts", _SPLIT_HINT)
    try:
        addresses = hostranges.expand(address, room)
    except hostranges.BadAddress as exc:
        src.fail(address_node, f"`{sec.what('address')}` {exc.message}", exc.hint)
    gpus_node = sec.node("gpus")
    all_gpus = gpus_node is not None and src.value(gpus_node, sec.what("gpus")) == "all"
    if gpus_node is not None and not all_gpus and isinstance(src.value(gpus_node, ""), str):
        src.fail(gpus_node, f"`{sec.what('gpus')}` must be a number of GPUs or `all`, got "
                            f"{src.describe(gpus_node)}",
                 "write e.g. `gpus: 2`, or `gpus: all` for every GPU free at preflight")
    # `gpus: all`: at least one; how many is the number free at preflight (agent/gpus.py)
    gpus = 1 if all_gpus else sec.integer("gpus", 0, 0, MAX_PROCS, example=1)
    procs_given = not all_gpus or sec.node("procs") is not None
    procs = sec.integer("procs", gpus or 1, 1, MAX_PROCS, example=max(gpus, 1))
    if gpus and procs > gpus and not all_gpus:
        src.fail(sec.node("procs"), f"`{sec.name}.procs` is {procs} but the host gives the job only "
                                    f"{gpus} GPU(s): two ranks would share a GPU",
                 f"set `procs: {gpus}`, or raise `gpus`, or set `gpus: 0` to run on CPU")
    host = Host(index=entry, address=addresses[0], connection=sec.choice("connection", CONNECTIONS, "ssh"),
                spare=_spare(src, sec),
                gpus=gpus, procs=procs, first_rank=0, remote_dir=_remote_dir(sec, remote_dir),
                python=sec.text("python", python), ssh=_ssh_options(sec, ssh, base_dir), line=sec.line,
                all_gpus=all_gpus, procs_given=procs_given, interface=parse_host_network(sec))
    return host, addresses


def _spare(src: Source, sec: Section) -> bool:
    node = sec.node("spare")
    if node is None:
        return False
    value = src.value(node, sec.what("spare"))
    if not isinstance(value, bool):
        src.fail(node, f"`{sec.what('spare')}` must be true or false, got {src.describe(node)}",
                 "write `spare: true` on a host that waits to replace a lost one")
    spare: bool = value
    return spare


def _host_section(src: Source, node: Node, name: str,
                  belongs: Mapping[str, str]) -> tuple[Section, Node, str]:
    """A host's settings, its address node and address; `- 10.0.0.8` is short for
    `- address: 10.0.0.8`."""
    line = src.line(node)
    if not isinstance(node, ScalarNode) or node.tag == TAG + "null":
        sec = Section(src, node, name, line)
        sec.check_keys(HOST_KEYS, belongs)
        return sec, sec.node("address") or node, sec.text("address")
    address = src.value(node, f"{name}.address")
    if not isinstance(address, str) or not address.strip():
        src.fail(node, f"`{name}` must be a host's address or settings, got {src.describe(node)}",
                 f'write `- address: "{short(node.value)}"`')
    check_text(src, node, f"{name}.address", address)
    return Section(src, None, name, line), node, address


def _check_world_size(src: Source, node: Node, host: Host, name: str) -> None:
    if host.ranks.stop > MAX_WORLD_SIZE:
        src.fail(node, f"`{name}` brings the job past {MAX_WORLD_SIZE} ranks in all (the limit)",
                 "give the hosts fewer `procs`, or list fewer hosts")


def _ssh_options(sec: Section, base: SSHOptions, base_dir: Path) -> SSHOptions:
    """`sec`'s ssh fields over `base` (top-level ssh: over the defaults, a host over ssh:)."""
    user = sec.text("user", base.user)
    if user is not None and (any(c.isspace() or c in "@:" for c in user) or user.startswith("-")):
        sec.src.fail(sec.node("user"), f"`{sec.what('user')}` {short(user)!r} is not a user name",
                     "write just the login name, e.g. `user: ubuntu`")
    return SSHOptions(
        user=user,
        port=sec.integer("port", base.port, 1, 65535, example=22),
        identity_file=_local_file(sec, "identity_file", base.identity_file, base_dir),
        known_hosts=_local_file(sec, "known_hosts", base.known_hosts, base_dir),
        host_key_policy=sec.choice("host_key_policy", HOST_KEY_POLICIES, base.host_key_policy),
        connect_timeout=sec.number("connect_timeout", base.connect_timeout),
        proxy_jump=_proxy_jump(sec, base.proxy_jump),
        identity_file_at=((sec.src.path, sec.key_line("identity_file"))
                          if "identity_file" in sec.items else base.identity_file_at),
    )


def _proxy_jump(sec: Section, default: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """`a`, `a,b` or a list [a, b]: a chain of bastions; `none` or []: direct."""
    sec.refuse_empty("proxy_jump", "write `proxy_jump: none` to connect directly, or delete "
                                   "the line to use ssh's (and ~/.ssh/config's) setting")
    node = sec.node("proxy_jump")
    if node is None:
        return default
    hops = [(hop, item) for value, item in text_items(sec, "proxy_jump") or []
            for hop in value.split(",")]
    if len(hops) == 1 and hops[0][0].strip().lower() == "none":
        return ()
    for hop, item in hops:
        try:
            parse_jump(hop)
        except ValueError as exc:
            sec.src.fail(item, f"`{sec.what('proxy_jump')}`: {exc}",
                         "write the bastion as `proxy_jump: user@bastion:22` "
                         "(several: `a,b` or a list, first hop first; `none`: direct)")
    return tuple(str(parse_jump(hop)) for hop, _ in hops)


@overload
def _local_file(sec: Section, key: str, default: str, base_dir: Path) -> str: ...
@overload
def _local_file(sec: Section, key: str, default: str | None, base_dir: Path) -> str | None: ...


def _local_file(sec: Section, key: str, default: str | None, base_dir: Path) -> str | None:
    value = sec.text(key, default)
    if value is None or key not in sec.items:
        return value
    return os.path.normpath(base_dir / os.path.expanduser(value))


def _remote_dir(sec: Section, default: str) -> str:
    return sec.text("remote_dir", default)  # text() refuses line breaks and NULs


def _check_duplicate(src: Source, node: Node, host: Host, name: str, seen: dict[tuple[object, ...], int],
                     names: list[str], hosts: list[Host]) -> None:
    """Refuse a host listed twice; `seen` maps each earlier host's identity to its index
    (a dict, not a scan of every earlier host: thousands of hosts stay fast)."""
    if host.is_local:
        # several local hosts stand for several nodes on this machine, but each needs a
        # job folder of its own (run/, logs/ hold per-node state)
        key: tuple[object, ...] = ("local", host.remote_dir)
        if key in seen:
            other = hosts[seen[key]]
            src.fail(node, f"`{name}` and {names[other.index]} (line {other.line}) "
                           f"are both local with remote_dir {host.remote_dir}",
                     "give each local host its own `remote_dir` (e.g. .orch/nodes/a and .orch/nodes/b)")
    else:
        key = (host.address.lower(), host.ssh.port, host.connection)
        if key in seen:
            other = hosts[seen[key]]
            src.fail(node, f"`{name}` is the same host as {names[other.index]} "
                           f"(line {other.line}): {host.address}, port {host.ssh.port or 'default'}",
                     "list each machine once and give it more `procs` to run more ranks there")
    seen[key] = host.index


def _is_loopback(address: str) -> bool:
    if address.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _check_master_reachable(src: Source, nodes: list[Node], hosts: list[Host], names: list[str]) -> None:
    if not _is_loopback(hosts[0].address):
        return
    for host, node, name in zip(hosts[1:], nodes[1:], names[1:]):
        if not _is_loopback(host.address):
            src.fail(node, f"`{name}` ({host.address}) could not reach the master: "
                           f"hosts[0] is {hosts[0].address!r}, which is MASTER_ADDR for every host",
                     "give hosts[0] an address the other hosts can reach "
                     "(a `connection: local` host may use its network address)")


def _labels(hosts: list[Host]) -> list[str]:
    shared = Counter(h.address for h in hosts)
    labels = [h.address if shared[h.address] == 1 or h.ssh.port is None or h.is_local
              else f"{h.address}:{h.ssh.port}" for h in hosts]
    taken = Counter(labels)
    return [label if taken[label] == 1 else f"{label}#{h.index}" for label, h in zip(labels, hosts)]
