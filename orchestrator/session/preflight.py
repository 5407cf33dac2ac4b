"""All-or-nothing checks on every host, in parallel, before anything is started."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Callable, TypedDict

from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import HostError, UsageError
from orchestrator.files.localfiles import LocalFile
from orchestrator.files.sync import Same
from orchestrator.remote.fanout import GroupResult, fan_out
from orchestrator.remote.link import Link
from orchestrator.session import gpuclaims, network
from orchestrator.session.replies import NetFacts, PreflightReply
from orchestrator.ui.wording import hint_cmd
from orchestrator.wire import protocol, timeouts


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
    manifests: dict[str, Listed | Same]   # {"code"|"data": ...} of what the host has
    python_missing: str = ""   # `python:` not found (setup may make it): the agent ran with python3
    share_leader: int = -1     # whose preflight marker it found in its job folder (-1: none)
    gpu_ids: tuple[int, ...] | None = None   # the GPUs its agent claimed for the job
    gpu_uuids: tuple[str, ...] = ()          # every GPU's (the order of `up --wait`)
    net: NetFacts | None = None      # its network (agent/network.learn)
    held: bool = False   # running: no process of the job, another `up` holds its folder's lock


@dataclass(frozen=True)
class PreflightReport:
    hosts: dict[int, HostInfo]
    master_port: int
    network: network.NetPlan | None = None   # once the probe has run

    def groups(self) -> list[tuple[int, ...]]:
        """The hosts that share one job folder, each group in inventory order (a host
        with a folder of its own is a group of one); groups ordered by their first host."""
        return list(self._groups)

    def group_of(self, index: int) -> tuple[int, ...]:
        return self._group_index[index]

    # computed once: asked per host, the groups were made again for every host (1,000
    # hosts: a million steps)
    @cached_property
    def _groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(shared_groups({i: inf.share_leader for i, inf in self.hosts.items()}))

    @cached_property
    def _group_index(self) -> dict[int, tuple[int, ...]]:
        return {i: g for g in self._groups for i in g}


def shared_groups(leaders: dict[int, int]) -> list[tuple[int, ...]]:
    """Hosts grouped by the marker each found (its leader); -1 (no marker): alone."""
    by_leader: dict[int, list[int]] = {}
    for i in sorted(leaders):
        key = leaders[i] if leaders[i] >= 0 else -1 - i
        by_leader.setdefault(key, []).append(i)
    return sorted((tuple(g) for g in by_leader.values()), key=lambda g: g[0])


Preflight = PreflightReport


def job_dir(cluster: Cluster, host: Host) -> str:
    return f"{host.remote_dir.rstrip('/')}/{cluster.name}"


def folders(cluster: Cluster) -> list[str]:
    return [f for f, want in (("code", cluster.code.paths), ("data", cluster.data.shards)) if want]


Listed = dict[str, list[Any]]   # a folder as the host listed it: {rel: [size, sha256]} (sync.push)


class PreflightArgs(TypedDict, total=False):
    """The preflight request's optional fields (protocol.py's REQUESTS["preflight"])."""

    warm: dict[str, dict[str, str]]
    expect: dict[str, str]
    share: dict[str, str | int]
    gpus: int | str | list[int]
    net: network.NetArgs


class BusyHost(gpuclaims.GpusBusy):
    """Too few of a host's GPUs free, and its other checks passed: `up --wait` waits
    for its GPUs, and then the host is checked (its HostInfo and reply kept here)."""

    def __init__(self, busy: gpuclaims.GpusBusy, info: HostInfo, reply: PreflightReply) -> None:
        super().__init__(busy.host, busy.busy, busy.hint)
        self.info, self.reply = info, reply


def asks_net(cluster: Cluster) -> bool:
    """Whether preflight asks each host for its network facts."""
    return network.wanted(cluster) or network.named(cluster)


Expected = dict[str, list[LocalFile]]   # {"code"|"data": what the push will make the folder hold}


def check_host(cluster: Cluster, link: Link, warm: dict[str, str] | None = None,
               nonce: str = "", expect: Expected | None = None, *,
               net: bool) -> tuple[HostInfo, PreflightReply]:
    """One request: the checks and the folders' manifests (sent as parts). `warm`: the
    ranks' environment: a host whose own checks pass starts torchrun warm at once
    (agent/warm.py), before its reply. `nonce`: the host leaves this preflight's marker
    in its job folder, or finds another host's there (shared_groups). `expect`: the
    files this host's folders will get; a folder that holds exactly them answers with
    their token instead of its entries (manifests_of). `net`: asks_net(cluster), computed
    once by the caller: it looks at every host (asked per host, 1,000 hosts parsed a
    million addresses)."""
    host = link.host
    sent = time.time()
    extra: PreflightArgs = {"warm": {"env": warm}} if warm is not None else {}
    # a folder with a file not hashed yet (a deferring listing) has no token: the host
    # lists it back (for a first push, an empty folder or none)
    tokens = {f: protocol.manifest_token((x.rel, x.digest) for x in files)
              for f, files in (expect or {}).items()
              if f in folders(cluster) and all(x.digest for x in files)}
    if tokens:
        extra["expect"] = tokens
    if nonce:
        extra["share"] = {"nonce": nonce, "index": host.index}
    if host.gpu_want is not None:
        extra["gpus"] = host.gpu_want
    if net:
        extra["net"] = network.preflight_args(cluster, host, nonce)
    _, pending = link.submit("preflight", job_dir=job_dir(cluster, host),
                             master_port=cluster.job.master_port or 0,
                             want_port=host.index == 0, folders=folders(cluster),
                             want_gpus=host.gpus > 0, **extra)
    r = PreflightReply.of(link.wait(pending, max(timeouts.scaled(timeouts.PREFLIGHT,
                                                                 len(cluster.hosts)),
                                                 host.ssh.connect_timeout * 3)))
    offset = r.time - (sent + time.time()) / 2
    manifests = manifests_of(cluster, pending.parts, tokens, expect or {})
    info = HostInfo(r.job_dir, r.executable, r.torch, r.gpus, offset, r.running,
                    r.ssh_connection, manifests, r.python_missing, r.share_leader, r.gpu_ids,
                    r.gpu_uuids, r.net, r.held)
    problems = host_problems(host, info, r, defer_torch=cluster.setup is not None)
    gpus = gpuclaims.problem(cluster, host, r.gpu_error, r.gpu_busy)
    if isinstance(gpus, gpuclaims.GpusBusy) and not problems:
        raise BusyHost(gpus, info, r)   # alone: `up --wait` may wait for it
    if gpus is not None:
        problems.append((gpus.message.split(": ", 1)[1], gpus.hint))
    if problems:
        raise HostError(f"{host.label}: " + "; ".join(p for p, _ in problems),
                        hint="; ".join(h for _, h in problems if h))
    return info, r


def manifests_of(cluster: Cluster, parts: list[Any], tokens: dict[str, str],
                 expect: Expected) -> dict[str, Listed | Same]:
    """{folder: {rel: [size, digest]}} from the parts. A part that says `same` with the
    token we sent stands for exactly the files we expect (the host computed the token
    over what it holds): sync.Same of those, and the push of them sends and deletes
    nothing."""
    listed: dict[str, Listed] = {f: {} for f in folders(cluster)}
    same: dict[str, Same] = {}
    for part in parts:   # the link's parts, checked by protocol.py's PARTS
        folder = part["folder"]
        if "same" in part:
            if part["same"] != tokens.get(folder):
                raise protocol.ProtocolError(f"manifest of {folder}: a token not asked for")
            same[folder] = Same(expect[folder])
        else:
            listed.setdefault(folder, {}).update(part["files"])
    return {**listed, **same}


def host_problems(host: Host, info: HostInfo, r: PreflightReply,
                  defer_torch: bool = False) -> list[tuple[str, str]]:
    """`defer_torch`: setup may install torch or make the python: checked after it."""
    problems = []
    if info.torch is None and not defer_torch:
        problems.append((f"torch is not installed for {info.executable}",
                         "pip install torch there, or point `python:` at an interpreter that has it"))
    if r.writable:
        problems.append((f"remote_dir not writable: {r.writable}",
                         "choose a remote_dir the SSH user can write"))
    if r.port is not None and not r.port_free:
        problems.append((f"master port {r.port} is already in use",
                         "set job.master_port to a free port, or leave it out to pick one"))
    return problems


def wait_for_gpus(cluster: Cluster, links: dict[int, Link], result: Checked,
                  busy: dict[int, BusyHost], waiting: gpuclaims.Waiting
                  ) -> dict[int, tuple[HostInfo, PreflightReply]]:
    """`up --wait`: every GPU host's claim taken again in the global order; the hosts
    that were busy get their HostInfo (from a preflight without the claim) made whole."""
    for i, err in busy.items():
        waiting.show(f"waiting for GPUs: {err.message}")
        result.ok[i] = (err.info, err.reply)   # its other checks passed
    gpu_hosts = [i for i in result.ok if cluster.hosts[i].gpu_want is not None]
    dirs = {i: result.ok[i][0].job_dir for i in gpu_hosts}
    order = sorted(gpu_hosts, key=lambda i: (min(result.ok[i][0].gpu_uuids or ("",)),
                                             result.ok[i][0].job_dir))
    taken = gpuclaims.wait_in_order(cluster, {i: links[i] for i in gpu_hosts}, dirs, order,
                                    waiting)
    return {i: (replace(result.ok[i][0], gpu_ids=tuple(ids)), result.ok[i][1])
            for i, ids in taken.items()}


def refuse_running(cluster: Cluster, infos: dict[int, HostInfo]) -> None:
    """"Already running" where a process of the job lives; where none does but another
    `up` of the job holds the job folder's lock, that `up` is named instead: `orch stop`
    cannot end it (its agent is no process of the job), only its end frees the folder."""
    running = [cluster.hosts[i].label for i, inf in sorted(infos.items())
               if inf.running and not inf.held]
    if running:
        raise UsageError(f"job '{cluster.name}' is already running on {', '.join(running)}",
                         hint=f"stop it first with `{hint_cmd(cluster, 'stop')}`, "
                              "or give this job another name")
    held = [cluster.hosts[i].label for i, inf in sorted(infos.items()) if inf.held]
    if held:
        idle = f"{timeouts.RECEIVE_IDLE:g} s"
        raise UsageError(
            f"job '{cluster.name}': another `orch up` of it holds its job folder on "
            f"{', '.join(held)}: one still preparing it there, or an earlier one whose "
            f"connection was cut (its agent there gives up after {idle} without data)",
            hint=f"wait for that `orch up` to end (a cut one's agent: {idle}) and run "
                 f"`{hint_cmd(cluster, 'up')}` again; `orch stop` does not end it "
                 "(it is no process of the job)")


def torch_mismatch(cluster: Cluster, infos: dict[int, HostInfo]) -> dict[int, HostError]:
    """Different torch versions deadlock or crash in collectives: refuse them up front."""
    versions = {i: inf.torch for i, inf in infos.items()}
    if len(set(versions.values())) <= 1:
        return {}
    master = versions.get(0) or sorted(v for v in versions.values() if v)[0]
    return {i: HostError(f"{cluster.hosts[i].label}: torch {v}, but host 0 has torch {master}",
                         hint=f"install torch=={master} there (every host needs the same version)")
            for i, v in versions.items() if v != master}


Checked = GroupResult[tuple[HostInfo, PreflightReply]]


def preflight(cluster: Cluster, links: dict[int, Link], failed: dict[int, BaseException],
              done: Callable[[], None] | None = None, checked: Checked | None = None,
              nonce: str = "", waiting: gpuclaims.Waiting | None = None) -> PreflightReport:
    """Check every host whose agent runs; report every failing host together (connection
    failures included), so that one bad host never hides another. `checked`: hosts
    already checked (check_host, as each agent came up); the others are checked now.
    The share markers (`nonce`) stay: the session removes them, with the launch or at
    its close, whatever the verdict (Session.markers)."""
    return judge(cluster, links, failed, done, checked, nonce, waiting)


def unshare(cluster: Cluster, links: dict[int, Link], nonce: str) -> None:
    """The marker's removal, sent and not waited for: the agent serves it before it
    ends, and one of the hosts sharing it removes it. A launch removes it itself (its
    `unshare`): this is for a session that launched none, at its close. Sent only where
    it goes at once (Link.try_submit): a close never waits behind a push stuck on a
    frozen host; a marker left so goes with a later preflight's sweep (an hour old)."""
    for link in links.values():
        try:
            link.try_submit("unshare", job_dir=job_dir(cluster, link.host), nonce=nonce)
        except Exception:  # a lost host: its marker goes with a later preflight's sweep
            pass


def judge(cluster: Cluster, links: dict[int, Link], failed: dict[int, BaseException],
          done: Callable[[], None] | None, checked: Checked | None,
          nonce: str, waiting: gpuclaims.Waiting | None = None) -> PreflightReport:
    result: Checked = checked if checked is not None else GroupResult()
    todo = tuple(cluster.hosts[i] for i in links
                 if i not in result.ok and i not in result.failed)
    net = asks_net(cluster)
    rest = fan_out(todo, lambda h: check_host(cluster, links[h.index], nonce=nonce, net=net),
                   done=done)
    result.ok.update(rest.ok)
    result.failed.update(rest.failed)
    failures = dict(failed)
    failures.update(result.failed)
    busy = {i: e for i, e in failures.items() if isinstance(e, BusyHost)}
    if busy and len(busy) == len(failures) and waiting is not None:
        failures = {}
        result.ok.update(wait_for_gpus(cluster, links, result, busy, waiting))
    infos = {i: v[0] for i, v in result.ok.items()}
    if cluster.setup is None:   # with setup, checked after it (hostsetup.check_ready)
        failures.update(torch_mismatch(cluster, infos))
    if failures:
        GroupResult(failed=failures).raise_failures(cluster.hosts, "preflight")
    refuse_running(cluster, infos)
    port = result.ok[0][1].port
    if port is None:
        raise HostError(f"{cluster.hosts[0].label}: preflight did not report a master port")
    return PreflightReport(infos, port)
