"""All-or-nothing checks on every host, in parallel, before anything is started."""
from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator.connect import GroupResult, fan_out
from orchestrator.errors import HostError, OrchError
from orchestrator.inventory import Cluster, Host
from orchestrator.remote import call
from orchestrator.transport import Transport


@dataclass(frozen=True)
class HostInfo:
    """What preflight learnt about one host and what later steps need from it."""

    job_dir: str          # absolute, as the host resolves it
    executable: str       # absolute python path (torchrun is started with it)
    torch: str | None
    gpus: int
    clock_offset: float   # host clock minus ours: corrects exit times for root cause
    running: bool
    ssh_connection: str
    manifests: dict       # {"code"|"data": {rel: [size, sha256]}} of what the host has


def job_dir(cluster: Cluster, host: Host) -> str:
    return f"{host.remote_dir.rstrip('/')}/{cluster.name}"


def check_host(cluster: Cluster, t: Transport) -> tuple[HostInfo, dict]:
    host = t.host
    master = host.index == 0
    sent = time.time()
    folders = ",".join(f for f, want in (("code", cluster.code.paths),
                                         ("data", cluster.data.shards)) if want)
    r = call(t, "preflight", job_dir(cluster, host), cluster.job.master_port or 0,
             "1" if master else "0", folders, host.gpus,
             timeout=max(60.0, host.ssh.connect_timeout * 3))
    offset = r["time"] - (sent + time.time()) / 2
    info = HostInfo(r["job_dir"], r["executable"], r["torch"], r["gpus"], offset,
                    r["running"], r["ssh_connection"], r["manifests"])
    problems = host_problems(host, info, r)
    if problems:
        raise HostError(f"{host.label}: " + "; ".join(p for p, _ in problems),
                        hint="; ".join(h for _, h in problems if h))
    return info, r


def host_problems(host: Host, info: HostInfo, r: dict) -> list[tuple[str, str]]:
    problems = []
    if info.torch is None:
        problems.append((f"torch is not installed for {info.executable}",
                         "pip install torch there, or point `python:` at an interpreter that has it"))
    if host.gpus > info.gpus:
        problems.append((f"{host.gpus} GPUs asked for, {info.gpus} found (nvidia-smi -L)",
                         f"set gpus: {info.gpus} for this host, or fix its driver"))
    if r["writable"]:
        problems.append((f"remote_dir not writable: {r['writable']}",
                         "choose a remote_dir the SSH user can write"))
    if "port" in r and not r["port_free"]:
        problems.append((f"master port {r['port']} is already in use",
                         "set job.master_port to a free port, or leave it out to pick one"))
    return problems


def torch_mismatch(cluster: Cluster, infos: dict[int, HostInfo]) -> dict[int, HostError]:
    """Different torch versions deadlock or crash in collectives: refuse them up front."""
    versions = {i: inf.torch for i, inf in infos.items()}
    if len(set(versions.values())) <= 1:
        return {}
    master = versions.get(0) or sorted(v for v in versions.values() if v)[0]
    return {i: HostError(f"{cluster.hosts[i].label}: torch {v}, but host 0 has torch {master}",
                         hint=f"install torch=={master} there (every host needs the same version)")
            for i, v in versions.items() if v != master}


@dataclass(frozen=True)
class Preflight:
    hosts: dict[int, HostInfo]
    master_port: int


def preflight(cluster: Cluster, transports: dict[int, Transport],
              failed: dict[int, BaseException], done=None) -> Preflight:
    """Check every connected host; report every failing host together (connection
    failures included), so that one bad host never hides another."""
    result: GroupResult = fan_out(tuple(cluster.hosts[i] for i in transports),
                                  lambda h: check_host(cluster, transports[h.index]), done=done)
    failures = dict(failed)
    failures.update(result.failed)
    infos = {i: v[0] for i, v in result.ok.items()}
    failures.update(torch_mismatch(cluster, infos))
    if failures:
        GroupResult(failed=failures).raise_failures(cluster.hosts, "preflight")
    running = [cluster.hosts[i].label for i, inf in infos.items() if inf.running]
    if running:
        raise OrchError(f"job '{cluster.name}' is already running on {', '.join(running)}",
                        hint=f"stop it first with `orch stop {cluster.path.name}`, or give this job another name")
    return Preflight(infos, result.ok[0][1]["port"])
