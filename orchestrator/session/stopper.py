"""Stopping a job on every host: SIGTERM, grace, SIGKILL, then verify nothing is left."""
from __future__ import annotations

import time
from dataclasses import dataclass

from orchestrator.config.inventory import Cluster
from orchestrator.remote.fanout import GroupResult
from orchestrator.remote.link import Body, Link, Pending
from orchestrator.wire import timeouts


@dataclass(frozen=True)
class StopReport:
    """What one host's agent did: processes found, how many needed SIGKILL, the pids
    that survived even that, and how long it took."""

    found: int
    killed: int
    left: tuple[int, ...]
    seconds: float

    def describe(self) -> str:
        if self.left:
            return f"{len(self.left)} processes could not be ended: pids {list(self.left)}"
        if not self.found:
            return "nothing was running"
        forced = f", {self.killed} needed SIGKILL" if self.killed else ""
        return f"stopped {self.found} processes{forced}; verified none left"


def report(r: Body) -> StopReport:
    return StopReport(r["found"], r["killed"], tuple(r["left"]), r["seconds"])


def answer(link: Link, pending: Pending, deadline: float, bound: float) -> Body:
    """The stop's reply by the deadline they all share; a late one is named with the bound."""
    return link.wait(pending, max(0.0, deadline - time.monotonic()), bound)


def stop_all(cluster: Cluster, links: dict[int, Link], dirs: dict[int, str],
             grace: float) -> GroupResult[StopReport]:
    """Every reachable host at once: each stop is sent on the host's open link before any
    reply is waited for, then the replies are read. No thread per host and no waves: at
    300 hosts a fan-out's 256 threads sent the last 44 stops only as the first hosts
    answered (theirs after their grace and verify), and starting the threads took its own
    scheduling slots on a loaded controller. A host that fails is reported; the rest
    still stop."""
    result: GroupResult[StopReport] = GroupResult()
    sent: dict[int, Pending] = {}
    for h in cluster.hosts:
        if h.index not in links:
            continue
        try:
            sent[h.index] = links[h.index].submit("stop", job_dir=dirs[h.index], grace=grace)[1]
        except Exception as exc:   # its link is gone: reported with the others
            result.failed[h.index] = exc
    bound = grace + timeouts.STOP_EXTRA
    deadline = time.monotonic() + bound
    for i, pending in sent.items():
        try:
            result.ok[i] = report(answer(links[i], pending, deadline, bound))
        except Exception as exc:  # collected: reported together, per host
            result.failed[i] = exc
    result.ok, result.failed = dict(sorted(result.ok.items())), dict(sorted(result.failed.items()))
    return result
