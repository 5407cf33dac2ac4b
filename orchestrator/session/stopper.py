"""Stopping a job on every host: SIGTERM, grace, SIGKILL, then verify nothing is left."""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config.inventory import Cluster
from orchestrator.remote.ask import ask_all
from orchestrator.remote.fanout import GroupResult
from orchestrator.remote.link import Body, Link
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


def stop_all(cluster: Cluster, links: dict[int, Link], dirs: dict[int, str],
             grace: float) -> GroupResult[StopReport]:
    """Every reachable host at once (ask_all: each stop is sent before any reply is
    waited for). A host that fails is reported; the rest still stop."""
    return ask_all(links, "stop", lambda i: {"job_dir": dirs[i], "grace": grace},
                   grace + timeouts.STOP_EXTRA, report)
