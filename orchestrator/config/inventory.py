"""cluster.yaml: read the inventory, check every field, and freeze it into a `Cluster`.

`load(path)` / `parse(text, path)` raise `InventoryError` (exit code 2) for any
mistake, always as one message `FILE:LINE: what is wrong` plus the fix. Nothing
here touches a host: checks that need one (GPUs present, python runs) are preflight's.

Defaults and decisions (the README states them):

- `name`, `hosts` (at least one) and `job.entrypoint` are required; everything else
  has a default. `name` is letters, digits, `-` and `_` (not starting with `-`), at
  most 64 characters, because it names folders on every host and `.orch/<name>/`.
- `hosts:` and `ssh:` are checked by hostspec.py (a host's address, ranges, GPUs and
  procs, ssh fields, duplicates, a loopback master); `spare: true` hosts are set apart
  here, after the hosts the job runs on.
- Everything is bounded (file, YAML, hosts, procs, ranks, values): see the MAX_* limits.
- `code:` is optional. Without it (or with `paths: []`) nothing is pushed and the
  entrypoint must already be in `<remote_dir>/<name>/code` on every host. Each path
  must exist, be relative to the inventory's folder and stay inside it; it lands in
  the code folder under its own name (`src/job` -> `code/job`), so two paths with
  the same name are refused. Paths are stored normalized (`./worker/` -> `worker`).
- `job:` is checked by jobspec.py (its `array:` by arrayspec.py), `setup:` by setupspec.py.
- `data.source` / `data.shards`: `~` is expanded and relative paths are taken from the
  inventory's folder (absolute allowed).
- A `null` value (`port:` with nothing after it) means "the default" only for fields
  whose default is "unset" (user, port, identity_file, data paths, master_port);
  elsewhere it is refused, so a half-deleted line is not silently ignored.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from yaml.nodes import MappingNode, Node

from orchestrator.config.hostspec import SSH_KEYS, Host, SSHOptions, host_part, parse_hosts
from orchestrator.config.jobspec import JOB_KEYS, JobSpec, parse_job
from orchestrator.config.networkspec import NO_NETWORK, NetworkSpec, parse_network
from orchestrator.config.patterns import PATTERN_HINT, pattern_problem
from orchestrator.config.safefile import FileRefused, read_regular
from orchestrator.config.setupspec import SetupSpec, parse_setup
from orchestrator.config.yamlnodes import Section, Source, exists, short, text_items
from orchestrator.errors import InventoryError, UsageError

TOP_KEYS = ("name", "ssh", "hosts", "remote_dir", "python", "code", "data", "job", "setup",
            "network")
CODE_KEYS = ("paths", "exclude")
DATA_KEYS = ("source", "shards")
DEFAULT_EXCLUDE = ("*.pyc", "__pycache__", ".git")
# sections that `key:` with nothing after it would silently turn off: refused at their line
EMPTY_SECTIONS = {
    "ssh": "indent its settings under it, or delete the line (~/.ssh/config and the defaults apply)",
    "code": "indent `paths: [...]` under it, or delete the line to push nothing",
    "data": "indent `source:` and `shards:` under it, or delete the line to push no data",
    "setup": "give it a command (`setup: pip install -r requirements.txt`), or delete the line",
}

# Limits: far above real clusters, low enough that no inventory makes orch slow or big
# (the hosts' own: hostspec.py).
MAX_FILE_BYTES = 1 << 20  # the inventory file itself

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
    hosts, spares = _split_spares(src, parse_hosts(top, base_dir, _BELONGS))
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


# ---- code, data ---------------------------------------------------------------------------

def _code(top: Section, base_dir: Path) -> CodeSpec:
    sec = Section(top.src, top.node("code"), "code", top.key_line("code"))
    sec.check_keys(CODE_KEYS, _BELONGS)
    paths: dict[str, str] = {}  # name on the host -> path
    for value, node in text_items(sec, "paths") or []:
        path = _code_path(sec.src, node, value, base_dir)
        name = PurePosixPath(path).name
        if name in paths:
            sec.src.fail(node, f"`code.paths` {short(path)!r} and {short(paths[name])!r} would both land in the "
                               f"code folder as {short(name)!r}", "rename one, or push their common parent folder")
        paths[name] = path
    sec.refuse_empty("exclude", "write `exclude: []` to push everything, or delete the line "
                                "for the default (" + ", ".join(DEFAULT_EXCLUDE) + ")")
    exclude = text_items(sec, "exclude")
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


# Host, SSHOptions and host_part are hostspec.py's; named here too, as everything of a
# checked inventory is
__all__ = [
    "Cluster",
    "CodeSpec",
    "DataSpec",
    "Host",
    "InventoryError",
    "JobSpec",
    "RankSlot",
    "SSHOptions",
    "host_part",
    "load",
    "parse",
]
