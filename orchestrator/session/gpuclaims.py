"""GPU claims, the controller's side: what each host's agent claimed at preflight
(agent/gpus.py), the message when too few GPUs are free, `orch up --wait`'s queue, and
the run's layout once `gpus: all` has become a number."""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Callable

from orchestrator.agent.gpus import CLAIMS_PROBLEM, FIX  # a claims folder refused
from orchestrator.config.inventory import Cluster, Host, RankSlot
from orchestrator.errors import HostError, InventoryError
from orchestrator.remote.link import Link
from orchestrator.session.replies import GpuReply
from orchestrator.ui.termsafe import visible
from orchestrator.wire import timeouts

WAIT_SLICE = 2.0    # one `gpu_claim` waits this long on the host: the live line's refresh


def safe(text: str) -> str:
    return visible(text, keep_sgr=False)


class GpusBusy(HostError):
    """Too few of a host's GPUs are free: `busy` is every GPU with its holder (data)."""

    def __init__(self, host: Host, busy: Sequence[GpuReply], hint: str) -> None:
        free = sum(1 for g in busy if g.holder is None)
        super().__init__(f"{host.label}: {asked(host)}, {free} of {len(busy)} free: "
                         f"{holders_text(busy)}", hint=hint)
        self.host, self.busy = host, busy


def asked(host: Host) -> str:
    if host.gpu_ids is not None:
        return f"GPUs {','.join(map(str, host.gpu_ids))} asked for"
    return "every free GPU asked for (gpus: all)" if host.all_gpus else \
        f"{host.gpus} GPU{'s' if host.gpus != 1 else ''} asked for"


def holder_text(holder: Mapping[str, Any] | None) -> str:   # a claim file's: free-form
    """`job 'x' (user bob)` for an orch claim, `pid 42 (user carol, not an orch job)`
    for a process no claim covers; every value as the host gave it, made printable."""
    if holder is None:
        return "free"
    if "pids" in holder:
        procs = holder.get("pids") or []
        said = ", ".join(f"pid {p.get('pid')} (user {safe(str(p.get('user', '?')))})"
                         for p in procs[:3] if isinstance(p, dict))
        more = f" and {len(procs) - 3} more" if len(procs) > 3 else ""
        return f"{said}{more}, not an orch job"
    return f"job {safe(str(holder.get('job', '?')))!r} (user {safe(str(holder.get('user', '?')))})"


def holders_text(gpus: Sequence[GpuReply]) -> str:
    busy = [g for g in gpus if g.holder is not None]
    return "; ".join(f"GPU {g.index} held by {holder_text(g.holder)}" for g in busy) \
        or "none is held, but not enough are listed"


def busy_hint(cluster: Cluster, host: Host) -> str:
    from orchestrator.ui.wording import hint_cmd
    return (f"wait for them with `{hint_cmd(cluster, 'up')} --wait`, ask for fewer "
            f"(gpus: on line {host.line}), or leave the host out "
            f"(`{hint_cmd(cluster, 'up')} --exclude {host.label}`)")


def problem(cluster: Cluster, host: Host, gpu_error: str | None,
            busy: Sequence[GpuReply] | None) -> HostError | None:
    """What a host's reply says of its GPUs (preflight's gpu_error and gpu_busy, or
    gpu_claim's busy), as the error to report."""
    if gpu_error is not None and gpu_error.startswith(CLAIMS_PROBLEM):
        why, _, fix = gpu_error[len(CLAIMS_PROBLEM):].partition(FIX)
        return HostError(f"{host.label}: {asked(host)}, none can be claimed safely: "
                         f"{safe(why)}", hint=safe(fix))
    if gpu_error is not None:
        return HostError(f"{host.label}: {asked(host)}, 0 found ({gpu_error})",
                         hint=f"set gpus: 0 for this host (line {host.line}), or fix its driver")
    if busy is None:
        return None
    total = len(busy)
    if host.gpu_ids is None and not host.all_gpus and host.gpus > total:
        return HostError(f"{host.label}: {host.gpus} GPUs asked for, {total} found (nvidia-smi)",
                         hint=f"set gpus: {total} for this host, or fix its driver")
    missing = [i for i in host.gpu_ids or () if i not in {g.index for g in busy}]
    if missing:
        return HostError(f"{host.label}: GPU {missing[0]} asked for, nvidia-smi lists "
                         f"GPUs 0 to {total - 1}", hint="name GPUs the host has")
    return GpusBusy(host, busy, busy_hint(cluster, host))


# ---------------------------------------------------------------- orch up --wait


@dataclass
class Waiting:
    """`orch up --wait`: `show(line)` is told who holds what while it waits."""

    show: Callable[[str], None]
    waited: float = 0.0


def wait_in_order(cluster: Cluster, links: dict[int, Link], job_dirs: dict[int, str],
                  order: list[int], waiting: Waiting) -> dict[int, list[int]]:
    """Every claim let go, then taken again host after host in one order that every orch
    job follows (the GPUs' own UUIDs): two jobs that each wait for the other's hosts
    cannot both hold one and wait for the other (no deadlock). Each host waits on its
    own side, so a freed GPU is taken within a quarter second."""
    for i in links:
        links[i].request("gpu_release", timeouts.LAUNCH, job_dir=job_dirs[i])
    t0, taken = time.monotonic(), {}
    for i in order:
        host = cluster.hosts[i]
        while True:
            got = links[i].request("gpu_claim", timeouts.LAUNCH + WAIT_SLICE,
                                   job_dir=job_dirs[i], want=host.gpu_want, wait_s=WAIT_SLICE)
            if "ids" in got:
                taken[i] = got["ids"]
                break
            err = problem(cluster, host, None, [GpuReply.of(g) for g in got.get("busy", [])])
            if not isinstance(err, GpusBusy):   # can never be met: say so, do not wait
                raise err or HostError(f"{host.label}: no GPU answer")
            waiting.show(f"waiting {time.monotonic() - t0:.0f} s for GPUs: {err.message}")
    waiting.waited = time.monotonic() - t0
    return taken


# ---------------------------------------------------------------- the run's layout


def apply(cluster: Cluster, claimed: dict[int, list[int]]) -> Cluster:
    """The run as claimed: each GPU host's gpu_ids (CUDA_VISIBLE_DEVICES), and for
    `gpus: all` without `procs:` one rank per GPU taken; ranks renumbered."""
    hosts: list[Host] = []
    for h in cluster.hosts:
        ids = claimed.get(h.index)
        procs = h.procs
        if ids is not None and h.all_gpus and not h.procs_given:
            procs = len(ids)
        if ids is not None and h.all_gpus and procs > len(ids):
            raise InventoryError(str(cluster.path), h.line,
                                 f"`procs: {procs}` on {h.label}, but only {len(ids)} GPU(s) "
                                 "were free for `gpus: all`: two ranks would share a GPU",
                                 hint="leave `procs:` out to run one rank per free GPU")
        hosts.append(replace(h, first_rank=hosts[-1].ranks.stop if hosts else 0, procs=procs,
                             gpu_ids=tuple(ids) if ids is not None else h.gpu_ids))
    ranks = tuple(RankSlot(r, h.index, r - h.first_rank) for h in hosts for r in h.ranks)
    selection = cluster.selection
    if len(ranks) != cluster.world_size:   # later commands take the run's layout from the state
        selection = "; ".join(s for s in (selection, "gpus: all") if s)
    return replace(cluster, hosts=tuple(hosts), world_size=len(ranks), ranks=ranks,
                   selection=selection)
