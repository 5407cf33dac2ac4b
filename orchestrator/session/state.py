"""Job state in `.orch/<name>/state.json` beside the inventory (mode 0600).

Everything a later `orch stop|logs|status` needs from the `orch up` that started the
job: a new controller process reads it, so the first one may be closed or killed.
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Protocol, cast

from orchestrator.config import hostselect
from orchestrator.config.inventory import Cluster, host_part
from orchestrator.config.safefile import write_whole
from orchestrator.errors import UsageError
from orchestrator.session.replies import Supervisor
from orchestrator.ui.wording import hint_cmd
from orchestrator.wire.protocol import SUPERVISOR


class StateDamaged(UsageError):
    """state.json exists but cannot be used (truncated, not JSON, wrong shape): exit 2."""


@dataclass(frozen=True)
class HostState:
    index: int
    label: str
    job_dir: str            # absolute on the host
    ranks: list[int]
    clock_offset: float
    supervisor: Supervisor
    gpu_ids: list[int] | None = None   # the GPUs `up --hosts host:0,1` named there


@dataclass(frozen=True)
class Attempt:
    """One restart of the run (api/healing.py): attempt `attempt` of `of`, begun at `at`
    (epoch seconds) on `hosts`, after `why`."""

    attempt: int
    of: int
    why: str
    at: float
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class JobState:
    name: str
    run_id: str
    inventory: str
    started: float
    world_size: int
    master_addr: str
    master_port: int
    hosts: list[HostState]
    # `up --hosts/--exclude` when the run used only some of the inventory's hosts: the
    # later commands act on the state's hosts then (run_cluster); "" for every host
    selection: str = ""
    # one entry per restart of this run (api/healing.py): attempt, of, why, at, hosts
    attempts: list[Attempt] = field(default_factory=list)

    def host(self, index: int) -> HostState:
        return self.hosts[index]


def state_path(cluster: Cluster) -> Path:
    return cluster.state_dir / "state.json"


def save(cluster: Cluster, state: JobState) -> None:
    write_record(state_path(cluster), asdict(state), indent=1)


def write_record(path: Path, data: Any, indent: int | None = None) -> None:
    """A job's record under .orch/<name>/ as JSON: private (0600), and replaced whole, so
    that a crash while writing leaves the previous record (arrays/plan.py's too); two
    writers at once each write through a .tmp of their own (write_whole)."""
    write_whole(path, json.dumps(data, indent=indent).encode(), 0o600)


def load(cluster: Cluster) -> JobState | None:
    """The job's state; None before the first `up`. StateDamaged when it cannot be used."""
    path = state_path(cluster)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise damaged(cluster,
                      f"cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        return _from_json(json.loads(text))
    except ValueError as exc:
        raise damaged(cluster, str(exc)) from None


def load_or_warn(cluster: Cluster, warn: Callable[[str], None]) -> JobState | None:
    """For `orch stop`, which must work without a usable state: None (and a warning)."""
    try:
        return load(cluster)
    except StateDamaged as exc:
        warn(f"{exc.message}; stopping by the inventory's job folders instead")
        return None


def damaged(cluster: Cluster, why: str) -> StateDamaged:
    path = state_path(cluster)
    return StateDamaged(
        f"{path}: the job state is damaged: {why}",
        hint=f"`{hint_cmd(cluster, 'stop')}` still stops the job (it finds its processes on every "
             f"host without the state); then remove {path} and start again with "
             f"`{hint_cmd(cluster, 'up')}`")


def _check(raw: Any, cls: type, what: str) -> dict[str, Any]:   # JSON values, checked
    """Every field of cls present with the type it is saved with; ValueError otherwise:
    the fields' values, each of its own type (_TYPES), that cls is then built from."""
    if not isinstance(raw, dict):
        raise ValueError(f"{what} is {type(raw).__name__}, not an object")
    for f in fields(cls):
        if f.name not in raw:
            if f.default is not MISSING or f.default_factory is not MISSING:
                # added later: a state saved before has none
                continue
            raise ValueError(f"{what} has no `{f.name}`")
        kinds = _TYPES[f.name]
        value = raw[f.name]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ValueError(f"{what}.{f.name} is {type(value).__name__} {value!r:.40}")
    return {f.name: raw[f.name] for f in fields(cls) if f.name in raw}


Kind = type | tuple[type, ...]   # what isinstance takes: a saved field's JSON type(s)
_NUMBER = (int, float)
_TYPES: dict[str, Kind] = {
    "name": str, "run_id": str, "inventory": str, "started": _NUMBER, "world_size": int,
    "master_addr": str, "master_port": int, "hosts": list, "index": int, "label": str,
    "job_dir": str, "ranks": list, "clock_offset": _NUMBER, "supervisor": dict,
    "selection": str, "gpu_ids": (list, type(None)), "attempts": list,
}
ATTEMPT: dict[str, Kind] = {"attempt": int, "of": int, "why": str, "at": (int, float),
                            "hosts": list}


def _from_json(raw: Any) -> JobState:
    top = _check(raw, JobState, "the state")
    hosts = []
    for i, h in enumerate(top["hosts"]):
        item = _check(h, HostState, f"hosts[{i}]")
        if item["index"] != i or not all(isinstance(r, int) and not isinstance(r, bool)
                                         for r in [*item["ranks"], *(item.get("gpu_ids") or ())]):
            raise ValueError(f"hosts[{i}] has a wrong index or ranks")
        hosts.append(HostState(**dict(item, supervisor=supervisor_of(item["supervisor"], i))))
    top["hosts"] = hosts
    for a in top.get("attempts", []):
        if not (isinstance(a, dict) and all(isinstance(a.get(k), t) for k, t in ATTEMPT.items())
                and all(isinstance(h, str) for h in a["hosts"])):
            raise ValueError("an entry of `attempts` has a wrong shape")
    top["attempts"] = [Attempt(a["attempt"], a["of"], a["why"], a["at"], tuple(a["hosts"]))
                       for a in top.get("attempts", [])]
    return JobState(**top)


def supervisor_of(raw: Mapping[str, object], i: int) -> Supervisor:
    """A saved supervisor, checked as the launch reply is (protocol.py's SUPERVISOR)."""
    bad = [k for k, t in SUPERVISOR.items() if not isinstance(raw.get(k), cast(Kind, t))]
    if bad:
        raise ValueError(f"hosts[{i}].supervisor has a wrong `{bad[0]}`")
    return Supervisor.of(raw)


def job_dirs(cluster: Cluster, state: JobState | None) -> dict[int, str]:
    """Absolute job dirs from the state; before any `up`, the inventory's (~ expands there)."""
    if state and len(state.hosts) == len(cluster.hosts):
        return {h.index: h.job_dir for h in state.hosts}
    return {h.index: f"{h.remote_dir.rstrip('/')}/{cluster.name}" for h in cluster.hosts}


def job_parts(cluster: Cluster, state: JobState | None) -> dict[int, str]:
    """Each host's part of its job folder (run/<part>/): named after the label the host
    had at `up` (the state's), so that an edited inventory still finds its records."""
    if state and len(state.hosts) == len(cluster.hosts):
        return {h.index: host_part(h.label) for h in state.hosts}
    return {h.index: h.part for h in cluster.hosts}


class HostFacts(Protocol):
    """What the state keeps of a host's preflight answer."""

    @property
    def job_dir(self) -> str: ...

    @property
    def clock_offset(self) -> float: ...


def new_state(cluster: Cluster, run_id: str, addr: str, port: int,
              infos: Mapping[int, HostFacts], supervisors: Mapping[int, Supervisor],
              attempts: list[Attempt] | None = None, started: float | None = None
              ) -> JobState:
    """`started`: when the launch was sent (a rank may end before every host answered
    it, and its runtime counts from there); now by default."""
    hosts = [HostState(h.index, h.label, infos[h.index].job_dir, list(h.ranks),
                       infos[h.index].clock_offset, supervisors[h.index],
                       None if h.gpu_ids is None else list(h.gpu_ids)) for h in cluster.hosts]
    return JobState(cluster.name, run_id, str(cluster.path),
                    time.time() if started is None else started, cluster.world_size,
                    addr, port, hosts, cluster.selection, list(attempts or []))


def run_cluster(cluster: Cluster, state: JobState | None) -> Cluster:
    """The hosts the saved run used (`up --hosts/--exclude`), as `up` numbered them:
    what stop, status, logs, pull and exec act on. The whole inventory when the run used
    every host, when there is no state, or when the inventory no longer holds the run's
    hosts as they were (then, as before, every host is asked)."""
    if state is None or not state.selection or cluster.selection:
        return cluster
    by_label = {h.label: h.index for h in cluster.hosts}
    picks: hostselect.Picks = {}
    for h in state.hosts:
        if h.label not in by_label:
            return cluster
        picks[by_label[h.label]] = None if h.gpu_ids is None else tuple(h.gpu_ids)
    try:
        run = hostselect.narrowed(cluster, picks, state.selection)
    except UsageError:
        return cluster
    same = [list(h.ranks) for h in run.hosts] == [h.ranks for h in state.hosts]
    return run if same else cluster
