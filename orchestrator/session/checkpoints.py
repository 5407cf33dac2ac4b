"""Checkpoints that survive the host (#22 item 3): the controller's one home for them.

For one run (`Checkpointing`), attempt after attempt, it decides and does everything
about `job.checkpoint`'s files:

- whether they are kept at all (`wanted`: globs given and a restart left to use them);
- where each attempt keeps its copy (`start`): on the controller (`keeper.Keeper`,
  session/keeper.py), or with `checkpoint_to: host` on the keeper host `hostkeep.choose`
  picks, relayed through the controller (`hostkeep.HostKeeper`);
- the attempt's last round when it ends, while rank 0's host (and the keeper host)
  answer, and what is then held (`end`: the files of the `CheckpointKept` event);
- why a restart would resume from nothing (`nothing_kept`);
- the copy put back into every job folder of the next attempt's run before its launch,
  a spare that takes a lost host's place among them (`put_back`: the files, the hosts
  that took them and where they came from, for the `CheckpointRestored` event).

It prints and emits nothing: api/running.py turns what it returns into events."""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from orchestrator.config.inventory import Cluster
from orchestrator.remote.fanout import fan_out
from orchestrator.session import hostkeep
from orchestrator.session.keeper import Keeper, raise_put_back_failures, restore
from orchestrator.session.preflight import PreflightReport
from orchestrator.session.session import Session


def wanted(cluster: Cluster, restarts: int) -> bool:
    """Whether a run keeps checkpoints: only a restart puts them back."""
    return bool(cluster.job.checkpoint) and restarts > 0


@dataclass(frozen=True)
class Restored:
    """Kept checkpoints put back before a restart's launch (`source`: the keeper host,
    or empty for the controller); `nothing`: why there was nothing to put back."""

    hosts: tuple[str, ...]
    files: tuple[str, ...]
    source: str = ""
    nothing: str = ""


class Checkpointing:
    """One run's checkpoints across its attempts: the attempt's keeper, and where the
    last attempt kept its copy (what a restart puts back from)."""

    def __init__(self) -> None:
        self.last = hostkeep.Kept()
        self.keeper: Keeper | None = None   # the running (or last) attempt's

    def lost(self, labels: Collection[str]) -> None:
        """Hosts lost by an attempt: a keeper host among them is not asked again."""
        self.last.lost |= set(labels)

    def start(self, session: Session, pre: PreflightReport,
              chosen: Callable[[str, str], None]) -> None:
        """The attempt's keeper, started: on the controller, or with `checkpoint_to: host`
        on the host `hostkeep.choose` picks (the controller when none fits), `chosen`
        told first (the keeper host's label, empty for the controller, and the line
        that says it)."""
        cluster = session.cluster
        if cluster.job.checkpoint_to != "host":
            self.keeper = Keeper(session, cluster).start()
            return
        choice = hostkeep.choose(cluster, pre.groups())
        chosen(choice.host.label if choice.host else "", choice.line)
        self.last.chosen(cluster, choice)
        if choice.host is None:
            self.keeper = Keeper(session, cluster).start()
            return
        self.keeper = hostkeep.HostKeeper(session, cluster, choice.host).start()

    def end(self, lost: Collection[int] | None) -> tuple[str, ...]:
        """One last round while rank 0's host (and the keeper host) answer (`lost`: the
        hosts the attempt lost; None: not known, none asked). When one is lost or silent,
        a round may be waiting on it: that thread is left to end when the session closes
        the link (before the next attempt puts anything back). Returns the files held."""
        keeper = self.keeper
        if keeper is None:
            return ()
        extra = {keeper.keeper.index} if isinstance(keeper, hostkeep.HostKeeper) else set()
        hosts = {keeper.cluster.host_of(0).index} | extra
        gone = lost is None or bool(hosts & set(lost))
        keeper.stop(final=not gone, timeout=1.0 if gone else 30.0)
        return tuple(sorted(keeper.held))

    def nothing_kept(self) -> str | None:
        """Why a restart would resume from nothing (None: a checkpoint is held)."""
        return self.keeper.nothing_kept() if self.keeper is not None else None

    def put_back(self, session: Session, pre: PreflightReport) -> Restored | None:
        """The kept checkpoints into every job folder of the new run (once per shared
        one), those it lacks: rank 0 resumes from them, and so does a script whose every
        rank loads its own copy. A host that cannot take them fails this attempt's start
        like any step. `checkpoint_to: host`: from the last attempt's keeper host (or what
        survives it), relayed through the controller. None: nothing to say."""
        cluster = session.cluster
        if cluster.job.checkpoint_to == "host":
            sent, where, source = hostkeep.put_back(session, pre, self.last)
            if sent or source.startswith("nothing"):
                return Restored(tuple(where), tuple(sent), source if sent else "",
                                "" if sent else source)
            return None
        leaders = tuple(cluster.hosts[g[0]] for g in pre.groups())
        result = fan_out(leaders, lambda h: restore(session, cluster, h.index))
        raise_put_back_failures(result, cluster.hosts)
        files = tuple(sorted({rel for rels in result.ok.values() for rel in rels}))
        if not files:
            return None
        return Restored(tuple(h.label for h in leaders if result.ok.get(h.index)), files)
