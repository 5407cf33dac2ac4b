"""Host replies as dataclasses, decoded where they arrive (the reply's schema is
wire/protocol.py's): the controller past the session reads fields, not dict keys."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Supervisor:
    """A host's supervisor as `launch` (or `array_launch`) reports it and the state
    keeps it: its pid and process group, torchrun's pid, the run, and when it started
    on the host's own clock."""

    pid: int
    pgid: int
    start_ticks: int | None
    torchrun_pid: int
    run_id: str
    started: float

    @classmethod
    def of(cls, reply: Mapping[str, Any]) -> Supervisor:   # checked by protocol.py's SUPERVISOR
        return cls(int(reply["pid"]), int(reply["pgid"]), reply.get("start_ticks"),
                   int(reply["torchrun_pid"]), str(reply["run_id"]), float(reply["started"]))


@dataclass(frozen=True)
class RankStackReply:
    """One rank's answer to `stacks`: `state` "answered" (then `stack`: faulthandler's
    dump), "stopped", "disk-wait", "no answer", ...; its `pid` where known."""

    rank: int
    state: str
    pid: int | None
    stack: str


@dataclass(frozen=True)
class HostStacks:
    """A host's `stacks` reply: each of its ranks, and the NCCL flight recorder dumps
    in its run/ (file names)."""

    ranks: tuple[RankStackReply, ...]
    nccl_dumps: tuple[str, ...]

    @classmethod
    def of(cls, reply: Mapping[str, Any]) -> HostStacks:   # the decoded frame, checked by protocol.py
        ranks = tuple(RankStackReply(r["rank"], r["state"], r.get("pid"), r.get("stack", ""))
                      for r in reply["ranks"])
        return cls(ranks, tuple(reply.get("nccl_dumps", ())))


@dataclass(frozen=True)
class RankReply:
    """One rank in a host's `status` reply (protocol.py's RANK_STATUS); times on the
    host's own clock."""

    rank: int
    state: str
    last_line: str = ""
    pid: int | None = None
    started: float | None = None
    code: int | None = None
    ended: float | None = None
    error_file: str = ""
    log_bytes: int | None = None

    @classmethod
    def of(cls, r: Mapping[str, Any]) -> RankReply:
        return cls(r["rank"], r["state"], r.get("last_line", ""), r.get("pid"), r.get("started"),
                   r.get("code"), r.get("ended"), r.get("error_file", ""), r.get("log_bytes"))


@dataclass(frozen=True)
class GpuProc:
    pid: int
    user: str
    mem: float | None


@dataclass(frozen=True)
class GpuReply:
    """One GPU of a host (protocol.py's GPU): its facts from nvidia-smi, its processes,
    and the claim on it (`holder`: an orch job's claim file, {"pids": ...} for foreign
    processes, None when free), as the agent read them."""

    index: int
    uuid: str
    name: str
    util: float | None
    mem_used: float | None
    mem_total: float | None
    holder: Mapping[str, Any] | None   # a claim file's fields: free-form by design
    procs: tuple[GpuProc, ...]

    @classmethod
    def of(cls, g: Mapping[str, Any]) -> GpuReply:
        procs = tuple(GpuProc(p["pid"], p["user"], p.get("mem")) for p in g["procs"])
        holder = g["holder"] if isinstance(g["holder"], dict) else None
        return cls(g["index"], g["uuid"], g["name"], g["util"], g["mem_used"], g["mem_total"],
                   holder, procs)


@dataclass(frozen=True)
class StatusReply:
    """A host's `status` reply: whether a run left a trace there (a supervisor or its
    exit), the host's clock, each asked rank, its GPUs (the GPU view) or why none."""

    ran: bool
    running: bool             # a supervisor is there now
    time: float
    ranks: tuple[RankReply, ...]
    gpus: tuple[GpuReply, ...] = ()
    gpu_error: str | None = None
    nccl_dumps: tuple[str, ...] = ()

    @classmethod
    def of(cls, reply: Mapping[str, Any]) -> StatusReply:   # checked by protocol.py
        return cls(bool(reply.get("supervisor") or reply.get("host_exit")),
                   bool(reply.get("supervisor")), float(reply["time"]),
                   tuple(RankReply.of(r) for r in reply["ranks"]),
                   tuple(GpuReply.of(g) for g in reply.get("gpus", ())),
                   reply.get("gpu_error"), tuple(reply.get("nccl_dumps", ())))


@dataclass(frozen=True)
class Iface:
    name: str
    addrs: tuple[str, ...]
    up: bool


@dataclass(frozen=True)
class NetFacts:
    """A host's network as its preflight learnt it (agent/network.learn; the reply's
    `net`, checked by protocol.py's NET_FACTS): its interfaces, what its hostname
    resolves to, its route's source toward the master, the interface variables its
    environment sets, and the probe listeners' ports (a ring port; host 0's master port)."""

    interfaces: tuple[Iface, ...]
    resolves: tuple[str, ...] = ()
    route_src: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    port: int | None = None
    master_listen: int | None = None

    @classmethod
    def of(cls, r: Mapping[str, Any]) -> NetFacts:   # the decoded frame's `net`
        ifaces = tuple(Iface(str(i["name"]), tuple(map(str, i["addrs"])), bool(i["up"]))
                       for i in r["interfaces"])
        return cls(ifaces, tuple(map(str, r["resolves"])), str(r["route_src"]),
                   {str(k): str(v) for k, v in r["env"].items()}, r.get("port"),
                   r.get("master_listen"))


@dataclass(frozen=True)
class Waiting:
    """A connection of the job that gets no answer (protocol.py's NET_WAIT): the rank
    whose it is (None: torchrun's), the address and port it tries, its SYNs sent again."""

    rank: int | None
    addr: str
    port: int
    tries: int


@dataclass(frozen=True)
class NetWaitsReply:
    """A host's `net_waits` reply: its waiting connections, its interfaces (to name the
    peer of a connection), and its failed connects so far (None: not counted there)."""

    waits: tuple[Waiting, ...]
    interfaces: tuple[Iface, ...]
    fails: int | None

    @classmethod
    def of(cls, r: Mapping[str, Any]) -> NetWaitsReply:   # checked by protocol.py
        waits = tuple(Waiting(w["rank"], str(w["addr"]), int(w["port"]), int(w["tries"]))
                      for w in r["waits"])
        ifaces = tuple(Iface(str(i["name"]), tuple(map(str, i["addrs"])), bool(i["up"]))
                       for i in r["interfaces"])
        fails = r.get("fails")
        return cls(waits, ifaces, fails if isinstance(fails, int) else None)


@dataclass(frozen=True)
class Target:
    """One connection of the probe (protocol.py's net_probe target): `group` m is host
    0 on the master port, r the ring neighbour; the agent answers each group's best."""

    addr: str
    port: int
    token: str
    group: str


@dataclass(frozen=True)
class Probed:
    """A target as probed: `group` m or r, `why` the agent's cause where not ok,
    `bound` the seconds it was given, `first` the bound of a first try that got no
    answer (this is the second)."""

    addr: str
    port: int
    token: str
    group: str
    ok: bool
    why: str
    src: str
    ms: float
    bound: float
    first: float | None = None


@dataclass(frozen=True)
class PreflightReply:
    """A host's `preflight` reply (protocol.py's REPLIES["preflight"]): the host's checks,
    its GPUs' claim or every GPU and its holder (`gpu_busy`, None when not listed), its
    network; `port` only from host 0 (the master port it found, and whether it is free)."""

    python: str
    executable: str
    torch: str | None
    job_dir: str
    gpus: int
    writable: str | None      # why remote_dir is not writable (None: it is)
    time: float
    hostname: str
    ssh_connection: str
    running: bool
    port: int | None = None
    port_free: bool = False
    python_missing: str = ""
    share_leader: int = -1
    gpu_ids: tuple[int, ...] | None = None
    gpu_uuids: tuple[str, ...] = ()
    gpu_busy: tuple[GpuReply, ...] | None = None
    gpu_error: str | None = None
    net: NetFacts | None = None
    held: bool = False        # running because another `up` holds the job folder's lock

    @classmethod
    def of(cls, r: Mapping[str, Any]) -> PreflightReply:   # checked by protocol.py
        busy = tuple(GpuReply.of(g) for g in r["gpu_busy"]) if "gpu_busy" in r else None
        return cls(r["python"], r["executable"], r["torch"], r["job_dir"], r["gpus"],
                   r["writable"], float(r["time"]), r["hostname"], r["ssh_connection"],
                   r["running"], r.get("port"), bool(r.get("port_free")),
                   r.get("python_missing", ""), r.get("share_leader", -1),
                   tuple(r["gpu_ids"]) if "gpu_ids" in r else None,
                   tuple(r.get("gpu_uuids") or [g.uuid for g in busy or ()]), busy,
                   r.get("gpu_error"), NetFacts.of(r["net"]) if "net" in r else None,
                   bool(r.get("held", False)))


@dataclass(frozen=True)
class CommandReply:
    """A host's reply to `setup` or `exec` (protocol.py's): the command's exit status
    (negative: the signal), and for setup whether it was skipped (its fingerprint
    unchanged) and the command that failed."""

    code: int
    seconds: float
    skipped: bool = False
    failed: str | None = None

    @classmethod
    def of(cls, r: Mapping[str, Any]) -> CommandReply:   # checked by protocol.py
        return cls(int(r["code"]), float(r["seconds"]), bool(r.get("skipped", False)),
                   r.get("failed"))


@dataclass(frozen=True)
class ProbeReply:
    """A host's `probe` reply after setup: its python (None: it does not run, `error`
    says why), that python's torch, and why the entrypoint is not there (None: it is)."""

    executable: str | None
    torch: str | None
    entrypoint: str | None
    error: str | None

    @classmethod
    def of(cls, r: Mapping[str, Any]) -> ProbeReply:   # checked by protocol.py
        return cls(r["executable"], r["torch"], r["entrypoint"], r["error"])
