"""Stopping a job on every host: SIGTERM, grace, SIGKILL, then verify nothing is left."""
from __future__ import annotations

from orchestrator.connect import GroupResult, fan_out
from orchestrator.inventory import Cluster
from orchestrator.remote import call
from orchestrator.transport import Transport


def stop_host(t: Transport, job_dir: str, grace: float) -> dict:
    return call(t, "stop", job_dir, f"{grace:g}", timeout=grace + 60)


def stop_all(cluster: Cluster, transports: dict[int, Transport], dirs: dict[int, str],
             grace: float) -> GroupResult[dict]:
    """Every reachable host in parallel; a host that fails is reported, the rest still stop."""
    hosts = tuple(h for h in cluster.hosts if h.index in transports)
    return fan_out(hosts, lambda h: stop_host(transports[h.index], dirs[h.index], grace))


def describe(reply: dict) -> str:
    if reply["left"]:
        return f"{len(reply['left'])} processes could not be ended: pids {reply['left']}"
    if not reply["found"]:
        return "nothing was running"
    forced = f", {reply['killed']} needed SIGKILL" if reply["killed"] else ""
    return f"stopped {reply['found']} processes{forced}; verified none left"
