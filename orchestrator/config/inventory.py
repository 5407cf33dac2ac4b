"""cluster.yaml: read the inventory, check every field, and freeze it into a `Cluster`.

`load(path)` / `parse(text, path)` raise `InventoryError` (exit code 2) for any
mistake, always as one message `FILE:LINE: what is wrong` plus the fix. Nothing
here touches a host: checks that need one (GPUs present, python runs) are preflight's.

Defaults and decisions (the README states them):

- `name`, `hosts` (at least one) and `job.entrypoint` are required; everything else
  has a default. `name` is letters, digits, `-` and `_` (not starting with `-`), at
  most 64 characters, because it names folders on every host and `.orch/<name>/`.
- A host is a mapping, or just its address as a shorthand (`- 10.0.0.8`). An address may
  be a range (`gpu[01-16]`, hostranges.py): one host per name, each with the entry's fields.
- Everything is bounded (file, YAML, hosts, procs, ranks, values): see the MAX_* limits.
  `procs` defaults to `gpus`, or 1 when `gpus` is 0; `procs` above a non-zero `gpus`
  is refused (two ranks would share a GPU, which NCCL refuses).
- Hosts with the same address, port and connection are refused as duplicates,
  except `connection: local` hosts: several local hosts simulate several nodes on
  one machine (the shipped demo). Their ssh fields are checked but unused.
- If the first host (the master) has a loopback address (localhost, 127.x, ::1),
  every host must: other machines could not reach MASTER_ADDR otherwise.
- `code:` is optional. Without it (or with `paths: []`) nothing is pushed and the
  entrypoint must already be in `<remote_dir>/<name>/code` on every host. Each path
  must exist, be relative to the inventory's folder and stay inside it; it lands in
  the code folder under its own name (`src/job` -> `code/job`), so two paths with
  the same name are refused. Paths are stored normalized (`./worker/` -> `worker`).
- `job:` is checked by jobspec.py (its `array:` by arrayspec.py), `setup:` by setupspec.py.
- `ssh.identity_file` / `known_hosts`: `~` is expanded and relative paths are taken
  from the inventory's folder. `data.source` / `data.shards` likewise (absolute allowed).
- A `null` value (`port:` with nothing after it) means "the default" only for fields
  whose default is "unset" (user, port, identity_file, data paths, master_port);
  elsewhere it is refused, so a half-deleted line is not silently ignored.
"""
from __future__ import annotations

import hashlib
import ipaddress
import os
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import overload

from yaml.nodes import MappingNode, Node, ScalarNode

from orchestrator.config import hostranges
from orchestrator.config.jobspec import JOB_KEYS, JobSpec, parse_job
from orchestrator.config.networkspec import (
    NO_NETWORK,
    NetworkSpec,
    parse_host_network,
    parse_network,
)
from orchestrator.config.patterns import PATTERN_HINT, pattern_problem
from orchestrator.config.proxyjump import parse_jump
from orchestrator.config.safefile import FileRefused, read_regular
from orchestrator.config.setupspec import SetupSpec, parse_setup
from orchestrator.config.yamlnodes import TAG, Section, Source, check_text, exists, short
from orchestrator.errors import InventoryError, UsageError

SSH_KEYS = ("user", "port", "identity_file", "known_hosts", "host_key_policy", "connect_timeout",
            "proxy_jump")
HOST_KEYS = ("address", "connection", "gpus", "procs", "remote_dir", "python", "spare",
             "network") + SSH_KEYS
TOP_KEYS = ("name", "ssh", "hosts", "remote_dir", "python", "code", "data", "job", "setup",
            "network")
CODE_KEYS = ("paths", "exclude")
DATA_KEYS = ("source", "shards")
HOST_KEY_POLICIES = ("strict", "accept-new")
CONNECTIONS = ("ssh", "local")
DEFAULT_EXCLUDE = ("*.pyc", "__pycache__", ".git")
DEFAULT_REMOTE_DIR = "~/orch"
# sections that `key:` with nothing after it would silently turn off: refused at their line
EMPTY_SECTIONS = {
    "ssh": "indent its settings under it, or delete the line (~/.ssh/config and the defaults apply)",
    "code": "indent `paths: [...]` under it, or delete the line to push nothing",
    "data": "indent `source:` and `shards:` under it, or delete the line to push no data",
    "setup": "give it a command (`setup: pip install -r requirements.txt`), or delete the line",
}
DEFAULT_PYTHON = "python3"

# Limits: far above real clusters, low enough that no inventory makes orch slow or big.
MAX_FILE_BYTES = 1 << 20  # the inventory file itself
MAX_HOSTS = 4096          # hosts, after ranges are expanded
MAX_PROCS = 1024          # procs (and gpus) on one host
MAX_WORLD_SIZE = 65536    # ranks in all
_SPLIT_HINT = "split the job into several inventories, or list fewer hosts"

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")

# Where a key that is unknown here belongs instead, for the error's hint.
_BELONGS: dict[str, str] = {k: "under `ssh:` or directly on a host" for k in SSH_KEYS}
_BELONGS.update({k: "on a host, under `hosts:`"
                 for k in ("address", "connection", "gpus", "procs", "spare")})
_BELONGS.update({k: "under `code:`" for k in CODE_KEYS})
_BELONGS.update({k: "under `data:`" for k in DATA_KEYS})
_BELONGS.update({k: "under `job:`" for k in JOB_KEYS})
_BELONGS.update({k: "at the top level" for k in ("name", "hosts", "code", "data", "job")})
_BELONGS["ssh"] = "at the top level; on a host, write its ssh fields directly (e.g. `port: 2222`)"


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


@dataclass(frozen=True)
class CodeSpec:
    """What `up` pushes: paths relative to the inventory's folder (empty: push nothing)."""

    paths: tuple[str, ...]
    exclude: tuple[str, ...]


@dataclass(frozen=True)
class DataSpec:
    """`split-data`'s source and output folders (absolute), or None when not given."""

    source: Path | None
    shards: Path | None


@dataclass(frozen=True)
class RankSlot:
    rank: int
    host_index: int
    local_rank: int


@dataclass(frozen=True)
class Cluster:
    """The whole inventory, checked; `ranks[r]` says where global rank r runs."""

    path: Path                   # absolute
    name: str
    hosts: tuple[Host, ...]
    code: CodeSpec
    data: DataSpec
    job: JobSpec
    world_size: int
    ranks: tuple[RankSlot, ...]
    setup: SetupSpec | None = None   # `setup:` (setupspec.py), None when absent
    # `orch up --hosts/--exclude` as given, when this run uses only some of the hosts
    # (config/hostselect.narrow); "" for the whole inventory
    selection: str = ""
    spares: tuple[Host, ...] = ()    # `spare: true` hosts: outside the run until one is lost
    restart: int = 0                 # the attempt: 0, then k on the k-th restart (ORCH_RESTART_COUNT)
    network: NetworkSpec = NO_NETWORK    # `network:` (networkspec.py)

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    @property
    def state_dir(self) -> Path:
        return self.base_dir / ".orch" / self.name

    @property
    def master(self) -> Host:
        return self.hosts[0]

    def host_of(self, rank: int) -> Host:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            last = self.world_size - 1
            raise UsageError(f"rank {rank} does not exist: this job has ranks 0 to {last}",
                             hint=f"give a rank from 0 to {last}")
        return self.hosts[self.ranks[rank].host_index]


def load(path: str | Path) -> Cluster:
    """Read and check an inventory file; raises InventoryError for any problem."""
    shown = str(path)
    try:
        data = read_regular(Path(path), MAX_FILE_BYTES)
    except FileNotFoundError:
        raise InventoryError(shown, None, "no such file",
                             "create it (see the README's cluster.yaml) "
                             "or name another with -c FILE") from None
    except FileRefused as exc:
        hint = ("many hosts fit in a few lines with ranges such as gpu[001-512]" if exc.too_big
                else "give the path of a cluster.yaml file")
        raise InventoryError(shown, None, exc.message, hint) from None
    except OSError as exc:
        raise InventoryError(shown, None, f"cannot read the inventory: {exc.strerror}",
                             "give the path of a readable YAML file") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InventoryError(shown, line, "the file is not UTF-8 text",
                             "save it as UTF-8 (plain text)") from None
    return parse(text, path)


def parse(text: str, path: str | Path) -> Cluster:
    """Check an inventory given as text; `path` is used in messages and as the base folder."""
    src = Source(str(path), text)
    if len(text) > MAX_FILE_BYTES:
        src.fail(None, f"the inventory is longer than {MAX_FILE_BYTES} characters (the limit)",
                 "list many hosts with ranges such as gpu[001-512]")
    root = src.compose()
    if root is None:
        src.fail(1, "the file is empty",
                 "start from the README's example: name:, hosts: and job: are required")
    if not isinstance(root, MappingNode):
        src.fail(root, f"the file must be a mapping of settings (name:, hosts:, job:, ...), "
                       f"got {src.describe(root)}", "start from the README's example cluster.yaml")
    top = Section(src, root, "", 1)
    top.check_keys(TOP_KEYS, _BELONGS)
    for key, fix in EMPTY_SECTIONS.items():
        top.refuse_empty(key, fix)
    base_dir = Path(os.path.abspath(path)).parent
    name = _name(top)
    hosts, spares = _split_spares(src, _hosts(top, base_dir))
    code = _code(top, base_dir)
    job = _job(top, code, base_dir, max(h.procs for h in hosts))
    _check_gpus_per_task(src, hosts, job)
    _check_min_hosts(top, hosts, job)
    data = _data(top, base_dir)
    setup = parse_setup(top, code.paths, base_dir)
    network = parse_network(top)
    ranks = tuple(RankSlot(r, h.index, r - h.first_rank) for h in hosts for r in h.ranks)
    return Cluster(Path(os.path.abspath(path)), name, hosts, code, data, job, len(ranks), ranks,
                   setup, spares=spares, network=network)


def _split_spares(src: Source, every: tuple[Host, ...]) -> tuple[tuple[Host, ...], tuple[Host, ...]]:
    """The run's hosts (renumbered: node rank, ranks from 0) and the spares, numbered
    after them (they run nothing until one replaces a lost host)."""
    hosts: list[Host] = []
    for h in every:
        if not h.spare:
            hosts.append(replace(h, index=len(hosts),
                                 first_rank=hosts[-1].ranks.stop if hosts else 0))
    if not hosts:
        src.fail(every[0].line, "every host is a spare (`spare: true`): the job has none to run on",
                 "remove `spare: true` from the hosts the job runs on")
    spares = tuple(replace(h, index=len(hosts) + j, first_rank=0)
                   for j, h in enumerate(h for h in every if h.spare))
    return tuple(hosts), spares


def _check_min_hosts(top: Section, hosts: tuple[Host, ...], job: JobSpec) -> None:
    """`job.min_hosts` above the hosts the job runs on could never be met: the run would
    end at the first lost host however many spares there are, which the user did not mean."""
    if job.min_hosts is None or job.min_hosts <= len(hosts):
        return
    sec = Section(top.src, top.node("job"), "job", top.key_line("job"))
    top.src.fail(sec.node("min_hosts"), f"`job.min_hosts` is {job.min_hosts}, more than the "
                 f"{len(hosts)} host{'s' if len(hosts) != 1 else ''} the job runs on "
                 "(spares not counted)",
                 f"write at most `min_hosts: {len(hosts)}`: the fewest hosts the job may go on "
                 "with after a loss")


def _check_gpus_per_task(src: Source, hosts: tuple[Host, ...], job: JobSpec) -> None:
    """Every host of a job array pinned to GPUs has at least one task's worth."""
    spec = job.array
    if spec is None or not spec.gpus_per_task:
        return
    for h in hosts:
        if not h.all_gpus and h.gpus < spec.gpus_per_task:
            src.fail(spec.gpus_line, f"`job.array.gpus_per_task` is {spec.gpus_per_task}, but "
                                     f"host {h.label} (line {h.line}) has gpus: {h.gpus}",
                     f"give that host gpus: {spec.gpus_per_task} or more (or `gpus: all`), "
                     "or lower gpus_per_task")


def _name(top: Section) -> str:
    name = top.text("name")
    if not _NAME_RE.fullmatch(name):
        fixed = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-")[:64] or "my-job"
        top.src.fail(top.node("name"), f"`name` {short(name)!r} may only contain letters, digits, - and _ "
                                       "(at most 64, not starting with -)",
                     f"it names folders on every host; write e.g. `name: {fixed}`")
    return name


# ---- hosts -------------------------------------------------------------------------------

def _hosts(top: Section, base_dir: Path) -> tuple[Host, ...]:
    src = top.src
    node = top.node("hosts")
    items = src.sequence(node, "hosts") if node is not None else []
    if not items:
        src.fail(top.key_line("hosts") if node is not None else 1, "no hosts: `hosts` lists none",
                 "add at least one host, e.g. `hosts: [{address: localhost, connection: local}]`")
    if len(items) > MAX_HOSTS:
        src.fail(items[MAX_HOSTS], f"`hosts` lists more than {MAX_HOSTS} hosts (the limit)", _SPLIT_HINT)
    ssh_section = Section(src, top.node("ssh"), "ssh", top.key_line("ssh"))
    ssh_section.check_keys(SSH_KEYS, _BELONGS)
    defaults = (_ssh_options(ssh_section, DEFAULT_SSH, base_dir), _remote_dir(top, DEFAULT_REMOTE_DIR),
                top.text("python", DEFAULT_PYTHON))
    hosts: list[Host] = []
    names: list[str] = []  # each host as messages name it: `hosts[3]`, or `hosts[3] (gpu02)`
    nodes: list[Node] = []
    seen: dict[tuple[object, ...], int] = {}
    for entry, item in enumerate(items):
        template, addresses = _entry(src, item, entry, MAX_HOSTS - len(hosts), defaults, base_dir)
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


def _entry(src: Source, node: Node, entry: int, room: int,
           defaults: tuple[SSHOptions, str, str], base_dir: Path) -> tuple[Host, list[str]]:
    """One `hosts:` entry: its settings (as a Host for its first address) and its addresses."""
    ssh, remote_dir, python = defaults
    sec, address_node, address = _host_section(src, node, f"hosts[{entry}]")
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


def _host_section(src: Source, node: Node, name: str) -> tuple[Section, Node, str]:
    """A host's settings, its address node and address; `- 10.0.0.8` is short for
    `- address: 10.0.0.8`."""
    line = src.line(node)
    if not isinstance(node, ScalarNode) or node.tag == TAG + "null":
        sec = Section(src, node, name, line)
        sec.check_keys(HOST_KEYS, _BELONGS)
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
    hops = [(hop, item) for value, item in _text_items(sec, "proxy_jump") or []
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


# ---- code, data ---------------------------------------------------------------------------

def _text_items(sec: Section, key: str) -> list[tuple[str, Node]] | None:
    """A list of non-empty strings (one string is a list of one), or None when absent."""
    node = sec.node(key)
    if node is None:
        return None
    one = isinstance(node, ScalarNode) and node.tag == TAG + "str"
    nodes = [node] if one else sec.src.sequence(node, sec.what(key))
    items = []
    for i, item in enumerate(nodes):
        what = f"{sec.what(key)}[{i}]"
        value = sec.src.value(item, what)
        if not isinstance(value, str) or not value.strip():
            sec.src.fail(item, f"`{what}` must be non-empty text, got {sec.src.describe(item)}",
                         f'put it in quotes: "{short(item.value)}"' if item.value else "remove the empty entry")
        check_text(sec.src, item, what, value)
        items.append((value, item))
    return items


def _code(top: Section, base_dir: Path) -> CodeSpec:
    sec = Section(top.src, top.node("code"), "code", top.key_line("code"))
    sec.check_keys(CODE_KEYS, _BELONGS)
    paths: dict[str, str] = {}  # name on the host -> path
    for value, node in _text_items(sec, "paths") or []:
        path = _code_path(sec.src, node, value, base_dir)
        name = PurePosixPath(path).name
        if name in paths:
            sec.src.fail(node, f"`code.paths` {short(path)!r} and {short(paths[name])!r} would both land in the "
                               f"code folder as {short(name)!r}", "rename one, or push their common parent folder")
        paths[name] = path
    sec.refuse_empty("exclude", "write `exclude: []` to push everything, or delete the line "
                                "for the default (" + ", ".join(DEFAULT_EXCLUDE) + ")")
    exclude = _text_items(sec, "exclude")
    for value, node in exclude or []:
        problem = pattern_problem(value)
        if problem is not None:
            sec.src.fail(node, f"`code.exclude` pattern {short(value)!r} is invalid: {problem}",
                         PATTERN_HINT)
    return CodeSpec(tuple(paths.values()),
                    DEFAULT_EXCLUDE if exclude is None else tuple(v for v, _ in exclude))


def _code_path(src: Source, node: Node, value: str, base_dir: Path) -> str:
    pure = PurePosixPath(value)
    if value.startswith("~") or pure.is_absolute() or os.path.isabs(value) or ".." in pure.parts:
        src.fail(node, f"`code.paths` {short(value)!r} is outside the inventory's folder ({base_dir})",
                 "write paths relative to the folder of cluster.yaml, without `..` (move or link "
                 "the code there)")
    if str(pure) == ".":
        src.fail(node, "`code.paths` '.' would push the inventory's whole folder (its .orch/ and data too)",
                 "list the folders and files the job needs, e.g. `paths: [worker]`")
    if not exists(src, node, base_dir / pure):
        src.fail(node, f"`code.paths` {short(value)!r} does not exist (looked for {short(str(base_dir / pure))})",
                 "fix the path (relative to the folder of cluster.yaml) or remove the entry")
    return str(pure)


def _data(top: Section, base_dir: Path) -> DataSpec:
    sec = Section(top.src, top.node("data"), "data", top.key_line("data"))
    sec.check_keys(DATA_KEYS, _BELONGS)
    source, shards = (_folder(sec.text(key, None), base_dir) for key in DATA_KEYS)
    if source is not None and source == shards:
        sec.src.fail(sec.node("shards"), "`data.shards` is the same folder as `data.source`",
                     "write the shards to their own folder, e.g. `shards: data/shards`")
    return DataSpec(source, shards)


def _folder(value: str | None, base_dir: Path) -> Path | None:
    return None if value is None else Path(os.path.normpath(base_dir / os.path.expanduser(value)))


# ---- job ----------------------------------------------------------------------------------

def _job(top: Section, code: CodeSpec, base_dir: Path, max_procs: int) -> JobSpec:
    src = top.src
    if top.node("job") is None:
        src.fail(1, "missing `job:`", "add `job:` with at least `entrypoint: worker.train` "
                                      "(a module) or `entrypoint: train.py` (a script)")
    sec = Section(src, top.node("job"), "job", top.key_line("job"))
    sec.check_keys(JOB_KEYS, _BELONGS)
    pushed = {PurePosixPath(p).name: base_dir / p for p in code.paths}
    return parse_job(sec, pushed, max_procs)


__all__ = [
    "Cluster",
    "CodeSpec",
    "DataSpec",
    "Host",
    "InventoryError",
    "JobSpec",
    "RankSlot",
    "SSHOptions",
    "load",
    "parse",
]
