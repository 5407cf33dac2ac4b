"""Job state in `.orch/<name>/state.json` beside the inventory (mode 0600).

Everything a later `orch stop|logs|status` needs from the `orch up` that started the
job: a new controller process reads it, so the first one may be closed or killed.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from orchestrator.inventory import Cluster


@dataclass(frozen=True)
class HostState:
    index: int
    label: str
    job_dir: str            # absolute on the host
    ranks: list[int]
    clock_offset: float
    supervisor: dict


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

    def host(self, index: int) -> HostState:
        return self.hosts[index]


def state_path(cluster: Cluster) -> Path:
    return cluster.state_dir / "state.json"


def save(cluster: Cluster, state: JobState) -> None:
    path = state_path(cluster)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(state), f, indent=1)
    os.replace(tmp, path)


def load(cluster: Cluster) -> JobState | None:
    try:
        raw = json.loads(state_path(cluster).read_text())
    except (OSError, ValueError):
        return None
    raw["hosts"] = [HostState(**h) for h in raw["hosts"]]
    return JobState(**raw)


def job_dirs(cluster: Cluster, state: JobState | None) -> dict[int, str]:
    """Absolute job dirs from the state; before any `up`, the inventory's (~ expands there)."""
    if state and len(state.hosts) == len(cluster.hosts):
        return {h.index: h.job_dir for h in state.hosts}
    return {h.index: f"{h.remote_dir.rstrip('/')}/{cluster.name}" for h in cluster.hosts}


def new_state(cluster: Cluster, run_id: str, addr: str, port: int, infos: dict,
              supervisors: dict) -> JobState:
    hosts = [HostState(h.index, h.label, infos[h.index].job_dir, list(h.ranks),
                       infos[h.index].clock_offset, supervisors[h.index]) for h in cluster.hosts]
    return JobState(cluster.name, run_id, str(cluster.path), time.time(), cluster.world_size,
                    addr, port, hosts)
