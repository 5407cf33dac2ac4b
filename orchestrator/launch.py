"""What runs on each host: the torchrun command line and the environment of the ranks."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from orchestrator.connect import fan_out, resolve_target, ssh_config
from orchestrator.inventory import Cluster, Host
from orchestrator.preflight import HostInfo, Preflight
from orchestrator.remote import RANKEXEC, open_agent, parse_reply
from orchestrator.transport import Channel, Transport, remote_command


def master_addr(cluster: Cluster, infos: dict[int, HostInfo] | None = None) -> str:
    """Host 0's address as the other hosts reach it.

    An ssh master: its resolved HostName (an ~/.ssh/config alias is not a DNS name).
    A local master with only local hosts: loopback. A local master with ssh hosts: this
    machine's address as the first ssh host sees it (SSH_CONNECTION's client field).
    """
    master = cluster.hosts[0]
    if not master.is_local:
        return resolve_target(master, ssh_config()).hostname
    for h in cluster.hosts:
        if not h.is_local and infos and infos.get(h.index) and infos[h.index].ssh_connection:
            return infos[h.index].ssh_connection.split()[0]
    return "127.0.0.1"


def torchrun_argv(cluster: Cluster, host: Host, python: str, job_dir: str,
                  addr: str, port: int | str) -> list[str]:
    job = cluster.job
    kind = "module" if job.is_module else "script"
    return [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(len(cluster.hosts)), "--node-rank", str(host.index),
        "--nproc-per-node", str(host.procs),
        "--master-addr", addr, "--master-port", str(port),
        "--max-restarts", str(job.max_restarts),
        "--log-dir", f"{job_dir}/run/torchrun",
        f"{job_dir}/run/rankexec.py", job_dir, kind, job.entrypoint, *job.args,
    ]


def rank_env(cluster: Cluster, job_dir: str, run_id: str) -> dict[str, str]:
    env = dict(cluster.job.env)
    env.update(ORCH_JOB=cluster.name, ORCH_JOB_DIR=job_dir, ORCH_RUN_ID=run_id,
               ORCH_DATA_DIR=f"{job_dir}/data", ORCH_OUTPUT_DIR=f"{job_dir}/output",
               PYTHONUNBUFFERED="1")
    return env


def launch_spec(cluster: Cluster, host: Host, info: HostInfo, addr: str, port: int,
                run_id: str) -> bytes:
    return json.dumps({
        "run_id": run_id, "ranks": list(host.ranks),
        "argv": torchrun_argv(cluster, host, info.executable, info.job_dir, addr, port),
        "env": rank_env(cluster, info.job_dir, run_id),
        "rankexec": RANKEXEC.decode(),
    }).encode()


def open_launcher(t: Transport, job_dir: str, follow: bool) -> Channel:
    """Start the host's launch agent now; it waits for its spec on stdin. Opened while
    preflight runs, its start-up (login shell, python) is off the critical path."""
    return open_agent(t, "launch", job_dir, "follow" if follow else "", timeout=60)


def launch_host(t: Transport, chan: Channel, spec: bytes) -> Started:
    """Hand the waiting agent its spec. It starts the supervisor, replies with its pid
    and, when it was opened to follow, goes on streaming the job's events (returned)."""
    try:
        chan.write(spec)
        chan.close_stdin()
        head = b""
        while b"\n" not in head:
            block = chan.read()
            if not block:
                break
            head += block
        line, _, rest = head.partition(b"\n")
        if b"\n" not in head:   # no reply line: let parse_reply say what went wrong
            res = chan.finish()
            parse_reply(t, "launch", res.code, head + res.stdout, res.stderr)
        reply = parse_reply(t, "launch", 0, line, b"")
    except BaseException:
        chan.close()
        raise
    chan.settimeout(None)
    return Started(reply, chan, rest)


@dataclass(frozen=True)
class Started:
    supervisor: dict              # pid, pgid, torchrun_pid, run_id, started
    chan: Channel                 # the agent; streaming events when opened to follow
    pending: bytes                # what it streamed after its reply line


def launch_all(cluster: Cluster, transports: dict[int, Transport], pre: Preflight,
               launchers: dict[int, Channel]) -> tuple[str, dict[int, Started]]:
    """Start torchrun on every host in parallel; raise naming every host that failed."""
    run_id = uuid.uuid4().hex
    addr = master_addr(cluster, pre.hosts)
    specs = {h.index: launch_spec(cluster, h, pre.hosts[h.index], addr, pre.master_port, run_id)
             for h in cluster.hosts}
    result = fan_out(cluster.hosts, lambda h: launch_host(
        transports[h.index], launchers[h.index], specs[h.index]))
    if result.failed:
        for started in result.ok.values():
            started.chan.close()
        result.raise_failures(cluster.hosts, "to start")
    return run_id, result.ok


def dry_run_plan(cluster: Cluster) -> str:
    """The plan and the exact command per host, computed without touching any host."""
    addr = master_addr(cluster)
    port = cluster.job.master_port or "<free port on host 0>"
    lines = [f"job {cluster.name}: {len(cluster.hosts)} hosts, world size {cluster.world_size}, "
             f"MASTER_ADDR={addr} MASTER_PORT={port}",
             "preflight on every host, in parallel: connect (host key checked), python runs, "
             "torch version (same everywhere), GPUs, remote_dir writable, master port free"]
    if cluster.code.paths:
        lines.append(f"sync code: {', '.join(cluster.code.paths)} -> <job dir>/code/ (changed files only)")
    if cluster.data.shards:
        lines.append(f"push data: {cluster.data.shards}/worker_<r>_of_{cluster.world_size} -> "
                     "<job dir>/data/ (each host only its own ranks)")
    for h in cluster.hosts:
        job_dir = f"{h.remote_dir.rstrip('/')}/{cluster.name}"
        argv = torchrun_argv(cluster, h, h.python, job_dir, addr, port)
        where = "local" if h.is_local else "ssh"
        lines.append(f"host {h.index} {h.label} ({where}) ranks {h.ranks.start}-{h.ranks.stop - 1}:")
        lines.append("  " + remote_command(argv))   # as the host's shell gets it
    env_keys = ", ".join(k for k, _ in cluster.job.env) or "none"
    lines.append(f"environment of every rank: ORCH_JOB, ORCH_JOB_DIR, ORCH_DATA_DIR, ORCH_OUTPUT_DIR, "
                 f"job env ({env_keys}; values sent in a 0600 file, not shown)")
    return "\n".join(lines)


