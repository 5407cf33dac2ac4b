"""`orch up` with restarts (`job.restarts`, `--restarts N`): the attached run goes on
after a failure: each attempt is started and followed as `orch up` does, then
api/healing.py decides the next attempt's hosts, and after a short back-off the whole
job starts again under the same name (ORCH_RESTART_COUNT=k). An `orch stop` from
elsewhere, Ctrl-C, success, or no restart left end the run.

While an attempt runs, a Keeper copies `job.checkpoint`'s files off rank 0's host
(session/checkpoints.py); before a restart's launch they are put back into every job
folder of the new run, so that a run resumes even when the host that held them is gone."""
from __future__ import annotations

import argparse
import threading
import time
from typing import Any, Callable

from orchestrator.api import healing, launching
from orchestrator.commands.common import console
from orchestrator.config.inventory import Cluster
from orchestrator.errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK, GroupError
from orchestrator.remote.fanout import fan_out
from orchestrator.session import checkpoints, hostkeep
from orchestrator.session.preflight import PreflightReport
from orchestrator.session.session import Session
from orchestrator.ui.termsafe import plain, plain_lines
from orchestrator.watch.hang import reason
from orchestrator.watch.monitor import Monitor, attach, signal_name

Started = Callable[[Cluster, Any], None]
PullAfter = Callable[[launching.Started, int], int]


def run(cluster: Cluster, args: argparse.Namespace, restarts: int,
        view: Callable[[], launching.UpProgress], started: Started, pull_after: PullAfter) -> int:
    """`view()`: what shows each attempt's steps (`orch up`'s bars and lines)."""
    plan = healing.Plan.first(cluster, restarts)
    ready = Spares(plan)
    last = hostkeep.Kept()
    while True:
        try:
            outcome = attempt(plan, args, view(), started, pull_after, ready.start, last)
        except GroupError as err:   # a restart that could not start: start_failed says why
            if plan.attempt == 0:
                raise
            console.print(plain_lines(f"attempt {plan.attempt + 1} could not start: {err}"))
            outcome = start_failed(plan, err)
        if isinstance(outcome, int):
            return outcome
        last.lost |= outcome.lost
        ready.join()
        nxt = plan.after(outcome.why, outcome.lost, outcome.culprits)
        if nxt is None:
            console.print(plain(f"cannot restart: {plan.ended}"))
            return outcome.code
        delay = healing.backoff(nxt.restart)
        none = f"; no checkpoint to put back: {outcome.no_checkpoint}" if outcome.no_checkpoint else ""
        console.print(plain(f"restart {nxt.restart} of {restarts} in {delay:.0f} s after: "
                            f"{outcome.why}; hosts: {', '.join(h.label for h in nxt.hosts)}"
                            f"{none}"))
        time.sleep(delay)


def start_failed(plan: healing.Plan, err: GroupError) -> Failed:
    """A restart that could not start. Hosts its preflight could not reach are lost; a
    host that answered but failed a later step (its previous attempt's processes still
    ending on a loaded host, a full disk) takes a strike: it is tried once more, and left
    out if it fails again."""
    failed = healing.unreachable(plan.cluster, err)
    names = ", ".join(sorted(err.hosts.values()))
    if err.reached:
        return Failed(f"the start failed on {names}", set(), failed, err.exit_code)
    return Failed(f"preflight failed on {names}", failed, set(), err.exit_code)


class Spares:
    """The spares made ready (preflight, code) beside the first attempt, in a thread: the
    job does not wait for them. One that cannot serve is said and taken out of the plan."""

    def __init__(self, plan: healing.Plan) -> None:
        self.plan = plan
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is None and self.plan.spares:
            self.thread = threading.Thread(target=self.prepare, daemon=True)
            self.thread.start()

    def prepare(self) -> None:
        try:
            verdicts = launching.prepare_spares(self.plan.cluster)
        except Exception as e:   # whatever it is, the job goes on: the spares are tried later
            console.print(plain(f"warning: spares not prepared: {e}"))
            return
        for label, why in verdicts.items():
            if why:
                console.print(plain(f"warning: spare {label} cannot serve: {why}"))
                self.plan.spares = [h for h in self.plan.spares if h.label != label]
        ready = [label for label, why in verdicts.items() if not why]
        if ready:
            console.print(plain(f"spares ready (preflight passed, code pushed): {', '.join(ready)}"))

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


class Failed:
    """An attempt that failed and may be restarted: why, and the hosts to blame."""

    def __init__(self, why: str, lost: set[str], culprits: set[str],
                 code: int = EXIT_JOB_FAILED) -> None:
        self.why, self.lost, self.culprits, self.code = why, lost, culprits, code
        self.no_checkpoint: str | None = None   # why a restart resumes from nothing


def attempt(plan: healing.Plan, args: argparse.Namespace, view: launching.UpProgress,
            started: Started, pull_after: PullAfter, running: Callable[[], None],
            last: hostkeep.Kept) -> int | Failed:
    """One attempt, started and followed; its exit code when the run ends with it.
    `last`: where the previous attempt kept its checkpoints (`checkpoint_to: host`)."""
    cluster = plan.cluster
    keep = bool(cluster.job.checkpoint) and plan.restarts > 0
    on_host = keep and cluster.job.checkpoint_to == "host"
    pres: list[PreflightReport] = []

    def before(session: Session, pre: PreflightReport) -> None:
        pres.append(pre)
        if plan.attempt and on_host:
            put_back_host(session, pre, last)
        elif plan.attempt:
            put_back(session, pre)

    with launching.start(cluster, setup=args.setup, wait=args.wait, progress=view,
                         attempts=plan.attempts, restart=plan.attempt > 0,
                         before_launch=before if keep else None) as got:
        cluster = got.session.cluster
        if plan.attempt:
            console.print(plain(f"attempt {plan.attempt + 1} of {plan.restarts + 1} "
                                f"(ORCH_RESTART_COUNT={plan.attempt})"))
        started(cluster, got.state)
        running()
        keeper = new_keeper(got.session, cluster, pres[-1], last) if keep else None
        seen: list[Monitor] = []
        try:
            code = attach(got.session, got.state, seen)
        finally:
            if keeper is not None:
                end_keeper(keeper, seen[0] if seen else None, keeper_hosts(cluster, keeper))
        mon = seen[0]
        if code in (EXIT_OK, EXIT_INTERRUPTED) or mon.user_stop or plan.left <= 0:
            if mon.user_stop:
                console.print("stopped with `orch stop`: no restart", markup=False)
            elif code == EXIT_JOB_FAILED:
                console.print(f"no restart left ({plan.restarts} made)", markup=False)
            return code if args.no_pull or code == EXIT_INTERRUPTED else pull_after(got, code)
        failed = blame(cluster, mon)
        failed.no_checkpoint = keeper.nothing_kept() if keeper is not None else None
        return failed


def new_keeper(session: Session, cluster: Cluster, pre: PreflightReport,
               last: hostkeep.Kept) -> checkpoints.Keeper:
    """The attempt's keeper, started: on the controller, or with `checkpoint_to: host` on
    the host `hostkeep.choose` picks (said in a line; the controller when none fits)."""
    if cluster.job.checkpoint_to != "host":
        return checkpoints.Keeper(session, cluster).start()
    choice = hostkeep.choose(cluster, pre.groups())
    console.print(plain(choice.line))
    last.chosen(cluster, choice)
    if choice.host is None:
        return checkpoints.Keeper(session, cluster).start()
    return hostkeep.HostKeeper(session, cluster, choice.host).start()


def keeper_hosts(cluster: Cluster, keeper: checkpoints.Keeper) -> set[int]:
    """The hosts a keeper's round talks to: rank 0's, and the keeper host's."""
    extra = {keeper.keeper.index} if isinstance(keeper, hostkeep.HostKeeper) else set()
    return {cluster.host_of(0).index} | extra


def end_keeper(keeper: checkpoints.Keeper, mon: Monitor | None, hosts: set[int]) -> None:
    """One last round while rank 0's host (and the keeper host) answer. When one is lost
    or silent, a round may be waiting on it: that thread is left to end when the session
    closes the link (before the next attempt puts anything back), not waited for."""
    gone = mon is None or bool(hosts & set(mon.lost)) or (
        mon.cause is not None and bool(hosts & set(mon.cause.silent)))
    keeper.stop(final=not gone, timeout=1.0 if gone else 30.0)


def put_back(session: Session, pre: PreflightReport) -> None:
    """The kept checkpoints into every job folder of the new run (once per shared one),
    those it lacks: rank 0 resumes from them, and so does a script whose every rank
    loads its own copy (the DDP tutorial's snapshot.pt). Said in a line; a host that
    cannot take them fails this attempt's start like any step."""
    cluster = session.cluster
    leaders = tuple(cluster.hosts[g[0]] for g in pre.groups())
    result = fan_out(leaders, lambda h: checkpoints.restore(session, cluster, h.index))
    result.raise_failures(cluster.hosts, "to take the kept checkpoints back")
    sent = sorted({rel for rels in result.ok.values() for rel in rels})
    if sent:
        shown = ", ".join(sent[:3]) + (f" and {len(sent) - 3} more" if len(sent) > 3 else "")
        where = ", ".join(h.label for h in leaders if result.ok.get(h.index))
        console.print(plain(f"checkpoint put back on {where}: {shown}"))


def put_back_host(session: Session, pre: PreflightReport, last: hostkeep.Kept) -> None:
    """`checkpoint_to: host`: put_back from the last attempt's keeper host (or what
    survives it), relayed through the controller; said in a line."""
    sent, where, source = hostkeep.put_back(session, pre, last)
    if sent:
        shown = ", ".join(sent[:3]) + (f" and {len(sent) - 3} more" if len(sent) > 3 else "")
        console.print(plain(f"checkpoint put back on {', '.join(where)} from {source}: {shown}"))
    elif source.startswith("nothing"):
        console.print(plain(f"no checkpoint to put back: {source}"))


def blame(cluster: Cluster, mon: Monitor) -> Failed:
    """What failed, in a line, and which hosts take a strike for it."""
    lost = {cluster.hosts[i].label for i in mon.lost}
    if mon.hang_report is not None:   # the hang's culprits, or every idle rank's host
        report = mon.hang_report
        ranks = sorted(report.found.why) or list(report.hang.idle)
        hosts = {cluster.host_of(r).label for r in ranks}
        return Failed(f"a hang ({reason(report.hang)}; rank "
                      f"{', '.join(map(str, ranks[:8]))})", lost, hosts)
    cause = mon.cause
    if cause is not None and cause.failures:
        f = cause.failures[0]
        label = cluster.hosts[f.host].label
        return Failed(f"rank {f.rank} on {label} failed ({signal_name(f.code)})", lost, {label})
    if cause is not None and cause.silent:
        names = {cluster.hosts[i].label for i in cause.silent}
        return Failed(f"host {', '.join(sorted(names))} went silent", lost | names, names)
    if lost:
        return Failed(f"host {', '.join(sorted(lost))} was lost", lost, set())
    return Failed("the job failed", lost, set())
