"""Whole-job restarts: `job.restarts: N` / `orch up --restarts N` (an attached `up`).

After a failure (a rank's non-zero exit, a lost host, a hang) the failed attempt has
already been stopped everywhere (watch/monitor.fail_fast). This module decides what the
next attempt runs on, waits a short back-off and starts the whole job again under the
same name, with ORCH_RESTART_COUNT=k; the program resumes from its last checkpoint.

Which hosts the next attempt gets (`Healer.after`):
- a host that was lost, or that held the root cause, takes a strike; a host with two
  strikes is left out for the rest of the run;
- a lost host, or one left out, is replaced by a spare (`hosts[].spare: true`), which
  takes its ranks (and, at the next push, its shards);
- with no spare left, the job goes on with fewer hosts where `job.min_hosts` allows: the
  world size shrinks, and data made by `orch split-data` is split again for it;
- otherwise the run ends with the failure it had.
A host that cannot be reached at the restart's preflight counts as lost the same way.

An `orch stop` from elsewhere, or Ctrl-C, ends the whole run, restarts included; so does
this controller's end: restarts need the attached `orch up` (a detached run says so)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from orchestrator.config.inventory import Cluster, Host, RankSlot
from orchestrator.errors import GroupError
from orchestrator.session.state import Attempt

BACKOFF_FIRST = 2.0     # seconds before the first restart; doubled each time
BACKOFF_MAX = 30.0


def backoff(attempt: int) -> float:
    return min(BACKOFF_MAX, BACKOFF_FIRST * 2.0 ** (attempt - 1))


@dataclass
class Healer:
    """The run across its attempts: what runs now, the spares left, the strikes."""

    cluster: Cluster                      # what the current attempt runs on
    restarts: int                         # the most restarts allowed
    spares: list[Host] = field(default_factory=list)
    strikes: dict[str, int] = field(default_factory=dict)    # host label -> failures
    attempts: list[Attempt] = field(default_factory=list)   # one per restart
    ended: str = ""                       # why the run cannot go on (after() gave None)

    @classmethod
    def first(cls, cluster: Cluster, restarts: int) -> Healer:
        return cls(cluster, restarts, spares=list(cluster.spares))

    @property
    def attempt(self) -> int:
        return self.cluster.restart

    @property
    def left(self) -> int:
        return self.restarts - self.attempt

    def strike(self, labels: set[str]) -> None:
        for label in labels:
            self.strikes[label] = self.strikes.get(label, 0) + 1

    def after(self, why: str, lost: set[str], culprits: set[str]) -> Cluster | None:
        """The next attempt's cluster, or None when the run cannot go on (its reason in
        `self.ended`). `lost`: hosts gone now; `culprits`: hosts that held the cause."""
        self.strike(lost | culprits)
        out = {h.label for h in self.cluster.hosts
               if h.label in lost or self.strikes.get(h.label, 0) >= 2}
        hosts = self.replaced(out)
        if hosts is None:
            return None
        attempt = self.attempt + 1
        self.attempts.append(Attempt(attempt, self.restarts, why, time.time(),
                                     tuple(h.label for h in hosts)))
        self.cluster = relaid(self.cluster, hosts, attempt, out)
        return self.cluster

    def replaced(self, out: set[str]) -> list[Host] | None:
        """Every host of the run, those in `out` replaced by spares (the spare takes the
        host's place and ranks) or dropped where job.min_hosts allows."""
        hosts: list[Host] = []
        dropped: list[str] = []
        for h in self.cluster.hosts:
            if h.label not in out:
                hosts.append(h)
            elif self.spares:
                spare = self.spares.pop(0)   # its own GPUs and folders; the lost host's ranks
                hosts.append(replace(spare, index=h.index, first_rank=h.first_rank,
                                     procs=h.procs, procs_given=True, gpu_ids=None, spare=False))
            else:
                dropped.append(h.label)
        floor = self.cluster.job.min_hosts or len(self.cluster.hosts)
        if dropped and len(hosts) < floor:
            self.ended = (f"{', '.join(dropped)} cannot be replaced (no spare left) and "
                          f"{len(hosts)} host{'s' if len(hosts) != 1 else ''} are fewer than "
                          f"job.min_hosts ({floor})")
            return None
        return hosts


def relaid(cluster: Cluster, hosts: list[Host], attempt: int, out: set[str]) -> Cluster:
    """The hosts renumbered (node rank in order, ranks from 0), the attempt counted; a
    changed world size marks the run as a selection, which splits the data again."""
    laid: list[Host] = []
    for h in hosts:
        laid.append(replace(h, index=len(laid), first_rank=laid[-1].ranks.stop if laid else 0))
    ranks = tuple(RankSlot(r, h.index, r - h.first_rank) for h in laid for r in h.ranks)
    selection = cluster.selection
    if out:
        selection = "; ".join(s for s in (cluster.selection, f"restart {attempt} without "
                                          f"{', '.join(sorted(out))}") if s)
    return replace(cluster, hosts=tuple(laid), world_size=len(ranks), ranks=ranks,
                   restart=attempt, selection=selection)


def unreachable(cluster: Cluster, err: GroupError) -> set[str]:
    """The hosts a restart's preflight could not reach or use: lost for the plan."""
    return {cluster.hosts[i].label for i in err.failures if 0 <= i < len(cluster.hosts)}
