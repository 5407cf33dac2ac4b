"""What runs on each host: the torchrun command line and the environment of the ranks."""
from __future__ import annotations

import os
import uuid
from dataclasses import replace
from typing import Any, TypedDict

from orchestrator.config.hostranges import fold
from orchestrator.config.inventory import Cluster, Host
from orchestrator.files.shards import resplit_size
from orchestrator.remote.ask import gather
from orchestrator.remote.bundle import host_python
from orchestrator.remote.early import Begun
from orchestrator.remote.link import Link, Pending
from orchestrator.remote.transport import remote_command
from orchestrator.session import netprobe, network
from orchestrator.session.preflight import HostInfo, PreflightReport, job_dir
from orchestrator.session.replies import Supervisor
from orchestrator.ui.termsafe import escaped
from orchestrator.ui.wording import plural
from orchestrator.wire import timeouts

# On a GPU host, NCCL keeps its last collectives and dumps them when its watchdog times
# out, as <prefix><rank> in this host's run/ (the hang report names it: agent/stacks.py)
NCCL_FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
NCCL_DUMP_PREFIX = "nccl-trace-rank-"


def master_addr(cluster: Cluster, infos: dict[int, HostInfo] | None = None) -> str:
    """Host 0's address as the inventory gives it (session/network.inventory_master)."""
    return network.inventory_master(cluster, {i: inf.ssh_connection
                                              for i, inf in (infos or {}).items()})


def run_master(cluster: Cluster, pre: PreflightReport) -> str:
    """MASTER_ADDR of this run: the one the network probe proved, if it ran."""
    plan: network.NetPlan | None = pre.network
    return plan.master_addr if plan is not None else master_addr(cluster, pre.hosts)


def prove_network(cluster: Cluster, links: dict[int, Link], pre: PreflightReport,
                  run_id: str) -> PreflightReport:
    """The network probe (session/network.py) once every host passed preflight: the
    report then carries the plan (MASTER_ADDR, each host's interface)."""
    if cluster.job.array is not None:
        return pre
    plan = network.prove(cluster, links, {i: inf.net for i, inf in pre.hosts.items()},
                         {i: inf.ssh_connection for i, inf in pre.hosts.items()},
                         pre.master_port, run_id)
    return replace(pre, network=plan)


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
        "--log-dir", f"{job_dir}/run/{host.part}/torchrun",
        # every rank's python starts on orch's rank start, which then runs the user's
        # module or script (agent/rankexec.py); PYTHON_EXEC, torchrun's own choice of the
        # ranks' interpreter, is kept
        "--no-python", dict(job.env).get("PYTHON_EXEC") or python, "-u",
        f"{job_dir}/run/{host.part}/rankexec.py", job_dir, kind, job.entrypoint, *job.args,
    ]


def rank_env(cluster: Cluster, host: Host, job_dir: str, run_id: str) -> dict[str, str]:
    """ORCH_JOB_DIR marks every process of the job (agent/procs.py); ORCH_JOB_PART says
    which host's part of it: hosts sharing the job folder on one machine (a bind mount)
    must not stop each other's processes."""
    env = dict(cluster.job.env)
    env.update(ORCH_JOB=cluster.name, ORCH_JOB_DIR=job_dir, ORCH_JOB_PART=host.part,
               ORCH_RUN_ID=run_id, ORCH_DATA_DIR=f"{job_dir}/data",
               ORCH_OUTPUT_DIR=f"{job_dir}/output", PYTHONUNBUFFERED="1",
               ORCH_RESTART_COUNT=str(cluster.restart))
    if host.gpu_ids is not None:   # the GPUs claimed (agent/gpus.visible_env): those only,
        # numbered as nvidia-smi numbers them (CUDA's own default order is fastest first)
        env.update(CUDA_VISIBLE_DEVICES=",".join(map(str, host.gpu_ids)),
                   CUDA_DEVICE_ORDER="PCI_BUS_ID")
    if host.gpus > 0:   # what the job's env does not set: NCCL's flight recorder, into run/
        for key, value in NCCL_FLIGHT_RECORDER.items():
            env.setdefault(key, value)
        env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                       f"{job_dir}/run/{host.part}/{NCCL_DUMP_PREFIX}")
    return env


class LaunchSpec(TypedDict):
    """The `launch` request's spec (protocol.py's): what the host's supervisor starts."""

    run_id: str
    ranks: list[int]
    argv: list[str]
    env: dict[str, str]


def launch_spec(cluster: Cluster, host: Host, info: HostInfo, addr: str, port: int,
                run_id: str, net: dict[str, str] | None = None) -> LaunchSpec:
    """`net`: the interface variables the network plan sets on this host."""
    return {
        "run_id": run_id, "ranks": list(host.ranks),
        "argv": torchrun_argv(cluster, host, info.executable, info.job_dir, addr, port),
        "env": dict(rank_env(cluster, host, info.job_dir, run_id), **(net or {})),
    }


def warm_start(cluster: Cluster) -> bool:
    """torchrun may start warm at preflight unless `setup:` can still change the python
    or torch, the job is an array (its runner starts one torchrun per task), or
    ORCH_WARM_START=0 turns it off."""
    return os.environ.get("ORCH_WARM_START") != "0" and cluster.setup is None \
        and cluster.job.array is None


def warm_env(cluster: Cluster, host: Host, run_id: str) -> dict[str, str]:
    """The ranks' environment as the preflight request carries it for a warm start
    (the job folder as configured; the host puts its resolved path in its place)."""
    return rank_env(cluster, host, job_dir(cluster, host), run_id)


def new_run_id() -> str:
    return uuid.uuid4().hex


def launch_all(cluster: Cluster, links: dict[int, Link], pre: PreflightReport, run_id: str,
               unshare: bool = False, begin: Begun | None = None
               ) -> tuple[str, dict[int, Supervisor]]:
    """Start torchrun on every host in parallel; raise naming every host that failed.
    `unshare`: each host also removes the share marker its preflight left (run_id).
    `begin`: an attached run's follows, each begun as its host's launch is answered
    (remote/early.py); dropped when the launch fails anywhere."""
    addr = run_master(cluster, pre)
    plan: network.NetPlan | None = pre.network
    specs = {h.index: launch_spec(cluster, h, pre.hosts[h.index], addr, pre.master_port, run_id,
                                  plan.env(h.index) if plan else None)
             for h in cluster.hosts}
    if plan is not None:
        network.save(cluster, run_id, plan)

    def fields(i: int) -> dict[str, Any]:
        return {"job_dir": pre.hosts[i].job_dir, "spec": specs[i],
                **({"unshare": run_id} if unshare else {})}

    def read(link: Link, pending: Pending, wait: float, bound: float) -> Supervisor:
        sup = Supervisor.of(link.wait(pending, wait, bound)["supervisor"])
        if begin is not None:
            i = link.host.index
            begin(i, link, pre.hosts[i].job_dir, list(cluster.hosts[i].ranks))
        return sup
    # every host's launch sent before any reply is awaited (gather): in a fan-out's
    # waves the last of 1,000 hosts started its ranks 30 s after the first, and a rank
    # that failed meanwhile was seen only once all had started
    try:
        result = gather({h.index: links[h.index] for h in cluster.hosts},
                        lambda i, link: link.submit("launch", **fields(i))[1],
                        read, timeouts.scaled(timeouts.LAUNCH, len(cluster.hosts)))
        result.raise_failures(cluster.hosts, "to start")
    except BaseException:
        if begin is not None:
            begin.drop()   # the hosts that started are stopped now: nothing may wait
        raise
    return run_id, result.ok


def dry_run_plan(cluster: Cluster) -> str:
    """The plan and the exact command per host, computed without touching any host."""
    addr = master_addr(cluster)
    port = cluster.job.master_port or "<free port on host 0>"
    # `gpus: all` without `procs:`: that host's ranks are its GPUs free at preflight
    counted = [h.label for h in cluster.hosts if h.all_gpus and not h.procs_given]
    world = f"world size counted at preflight (every free GPU of {', '.join(counted[:4])}" \
        f"{' ...' if len(counted) > 4 else ''})" if counted else f"world size {cluster.world_size}"
    lines = [f"job {cluster.name}: {plural(len(cluster.hosts), 'host')}, {world}, "
             f"MASTER_ADDR={addr} MASTER_PORT={port}",
             "preflight on every host, in parallel: connect (host key checked), python runs, "
             "torch version (same everywhere), GPUs, remote_dir writable, master port free"]
    gpu_hosts = [h for h in cluster.hosts if h.gpu_want is not None]
    if gpu_hosts:
        lines.append(f"claim GPUs for the job's life on {len(gpu_hosts)} host(s) (nvidia-smi; "
                     "busy GPUs are refused, or waited for with --wait); the ranks see only "
                     "the claimed ones (CUDA_VISIBLE_DEVICES)")
    if cluster.selection:
        lines.insert(1, f"hosts of this run: {cluster.selection} (the other hosts of "
                        f"{cluster.path.name} are left alone)")
    if cluster.code.paths:
        lines.append(f"sync code: {', '.join(cluster.code.paths)} -> <job dir>/code/ (changed files only)")
    if cluster.data.shards:
        size = "<W>" if counted else cluster.world_size
        lines.append(f"push data: {cluster.data.shards}/worker_<r>_of_{size} -> "
                     "<job dir>/data/ (each host only its own ranks"
                     + ("; the split for W checked once the GPUs are counted)" if counted else ")"))
        if not counted and resplit_size(cluster) is not None:
            lines.insert(-1, f"split data: {cluster.data.source} again for world size "
                             f"{cluster.world_size} into {cluster.data.shards} (as `orch "
                             f"split-data --workers {cluster.world_size}`), before the push")
    for h in cluster.hosts:
        job_dir = f"{h.remote_dir.rstrip('/')}/{cluster.name}"
        python = host_python(h, job_dir, str(cluster.base_dir))
        argv = torchrun_argv(cluster, h, python, job_dir, addr, port)
        if h.label in counted:   # its ranks: one per GPU free at preflight
            argv[argv.index("--nproc-per-node") + 1] = "<free GPUs>"
        where = "local" if h.is_local else "ssh"
        gpus = "" if h.gpu_ids is None else \
            f", GPUs {','.join(map(str, h.gpu_ids))} (CUDA_VISIBLE_DEVICES)"
        ranks = "ranks counted at preflight" if counted else \
            f"ranks {h.ranks.start}-{h.ranks.stop - 1}"
        lines.append(f"host {h.index} {h.label} ({where}) {ranks}{gpus}:")
        # as the host's shell gets it; a line break or an escape in an arg shown escaped
        lines.append("  " + escaped(remote_command(argv)))
    lines.append(sharing_plan(cluster))
    lines.extend(network_plan(cluster, addr))
    if cluster.job.hang_timeout:
        lines.append(f"hang watch: a rank without output or heartbeat for "
                     f"{cluster.job.hang_timeout:g} s: every rank's stack taken, the culprit "
                     "named, the job failed")
    env_keys = ", ".join(k for k, _ in cluster.job.env) or "none"
    lines.append(f"environment of every rank: ORCH_JOB, ORCH_JOB_DIR, ORCH_DATA_DIR, ORCH_OUTPUT_DIR, "
                 "ORCH_HEARTBEAT, ORCH_PYTHON, "
                 f"job env ({env_keys}; values sent in a 0600 file, not shown)")
    return "\n".join(lines)


def network_plan(cluster: Cluster, addr: str) -> list[str]:
    """What preflight will prove about the network, without touching a host."""
    net = cluster.network
    if not network.wanted(cluster):
        why = "one host" if len(cluster.hosts) == 1 else "one machine"
        if not network.named(cluster):
            return [f"network: MASTER_ADDR={addr} ({why}: nothing probed, interfaces left "
                    "to torch)"]
        return [f"network: MASTER_ADDR={addr} ({why}: nothing probed)",
                *interface_lines(cluster, named_only=True)]
    where = "network.master_addr" if net.master_addr else \
        "the inventory's address, else an address of host 0 that every host reaches"
    lines = [f"network: MASTER_ADDR={addr} ({where}; proven at preflight)"
             if net.check else f"network: MASTER_ADDR={addr} (network.check: false: not probed)"]
    lines.extend(interface_lines(cluster))
    if net.check:
        lines.append("  probe at preflight: every host to host 0 on the master port, each "
                     "to its ring neighbour on a port the OS picks "
                     f"({netprobe.bound(len(cluster.hosts)):g} s bound; a blocked path: exit 3)")
    return lines


def interface_lines(cluster: Cluster, named_only: bool = False) -> list[str]:
    """Each host's interface as the inventory asks it (`auto` or names), folded."""
    net = cluster.network
    by: dict[str, list[str]] = {}
    for h in cluster.hosts:
        names = h.interface if h.interface is not None else net.interface
        name = ",".join(names) if names else "auto"
        by.setdefault(name, []).append(h.label)
    lines = []
    for name, labels in by.items():
        if name == "auto" and named_only:
            lines.append(f"  interface on {fold(labels)}: left to torch")
            continue
        shown = "the one that reaches the master" if name == "auto" else name
        lines.append(f"  interface on {fold(labels)}: {shown} -> GLOO_SOCKET_IFNAME, "
                     "NCCL_SOCKET_IFNAME (unless job.env or the host sets them)")
    return lines


def sharing_plan(cluster: Cluster) -> str:
    """Which hosts share a job folder, as far as the inventory tells without touching a
    host (the same address and remote_dir); preflight finds the rest (NFS, bind mounts)."""
    seen: dict[tuple[str, str], list[str]] = {}
    for h in cluster.hosts:
        seen.setdefault((h.address, h.remote_dir.rstrip("/")), []).append(h.label)
    known = [labels for labels in seen.values() if len(labels) > 1]
    said = "; ".join(f"{', '.join(labels)} share one job folder" for labels in known)
    return ("shared job folders: " + (said + "; " if said else "") +
            "hosts that share theirs (NFS, a bind mount) are found at preflight: "
            "code pushed once per folder, each shard once, setup once per folder "
            "(setup.once_per), run/<host part>/ records per host")
