"""`orch up`: preflight, push code and shards, start torchrun everywhere, follow the job
to its end with fail-fast, the hang watch and restarts, and pull rank 0's output/
(api/running.py); `--detach` returns once it started (api.launching).

This module draws the steps (bars, one line each); commands/uprender.py renders what
follows the start from the run's events."""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable

from rich.markup import escape
from rich.progress import Progress, TaskID

from orchestrator.api import launching
from orchestrator.api.jobs import cluster_of
from orchestrator.api.outcomes import ArrayUpResult
from orchestrator.arrays import plan as array_plan
from orchestrator.commands.common import console, emit_json, hint_cmd, inventory_path, plural
from orchestrator.config.hostranges import fold
from orchestrator.config.hostselect import narrow
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import EXIT_OK, UsageError
from orchestrator.files.splitdata import SplitResult
from orchestrator.session.preflight import PreflightReport
from orchestrator.session.shelloutput import Printer
from orchestrator.ui.console import bytes_bar, hosts_bar
from orchestrator.ui.termsafe import plain


def add_parser(sub: Any) -> None:
    p = sub.add_parser("up")
    p.add_argument("file", nargs="?", help="inventory (default: -c, or cluster.yaml)")
    p.add_argument("--detach", action="store_true", help="return once every host has started")
    p.add_argument("--setup", action="store_true",
                   help="run `setup:` on every host even where it ran before, unchanged")
    p.add_argument("--hosts", metavar="SEL",
                   help="run on these hosts only: indexes, addresses, labels, ranges "
                        "(gpu[01-04]), `host:0,1` for GPUs 0 and 1 of a host; the world size follows")
    p.add_argument("--exclude", metavar="SEL", help="leave these hosts (or `host:N` GPUs) out")
    p.add_argument("--restarts", type=int, metavar="N",
                   help="restart the whole job up to N times after a failure (default: job.restarts)")
    p.add_argument("--wait", action="store_true",
                   help="GPUs held by other jobs: wait in line for them instead of exit 3")
    p.add_argument("--dry-run", action="store_true",
                   help="make every local check of `up`, print the plan and each host's command; touch no host")
    p.add_argument("--fail-fast", action="store_true",
                   help="job arrays: the first failing task stops every task (default: the others go on)")
    p.add_argument("--hang-timeout", type=float, metavar="S",
                   help="seconds without progress (a rank's output or heartbeat) after which "
                        "every rank's stack is taken, the culprit named and the job failed "
                        "(default: job.hang_timeout, else off)")
    p.add_argument("--no-pull", action="store_true",
                   help="do not pull rank 0's output/ into outputs/<name>/ when the job ends")
    p.add_argument("--dashboard", action="store_true",
                   help="serve the run's live page (as `orch dashboard`) beside the attached run")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # the whole inventory, not the last run's hosts: this run chooses its own
    cluster = narrow(cluster_of(inventory_path(args)), args.hosts, args.exclude)
    cluster = with_hang_timeout(cluster, args.hang_timeout)
    restarts = checked_restarts(cluster, args.restarts)
    if args.dry_run:
        plan = launching.plan(cluster)
        if args.json:
            emit_json(plan)
        else:
            print(plan.plan)
        return EXIT_OK
    if args.json and not args.detach:
        raise UsageError("`up --json` needs --detach: an attached job streams its ranks' output",
                         hint=f"`{hint_cmd(cluster, 'up --detach --json')}`, then "
                              f"`{hint_cmd(cluster, 'status --json')}`")
    if args.dashboard and (args.detach or cluster.job.array is not None):
        raise UsageError("`up --dashboard` opens the page beside an attached run of a "
                         "distributed job", hint=f"`{hint_cmd(cluster, 'dashboard')}` "
                                                 "once it started")
    if not args.detach and cluster.job.array is None:   # the run to its end, rendered
        from orchestrator.commands import uprender
        if args.dashboard:
            return uprender.with_dashboard(cluster, args, restarts, UpView)
        return uprender.attached(cluster, args, restarts, UpView)
    if restarts and args.detach:
        console.print(f"note: restarts ({restarts}) need an attached `orch up`: this detached run "
                      "will not restart after a failure", markup=False)
    with launching.start(cluster, setup=args.setup, wait=args.wait, progress=UpView()) as started:
        cluster = started.session.cluster   # as claimed: `gpus: all` counted
        if isinstance(started.result, ArrayUpResult):
            return array_started(started, args)
        st = started.state
        started_line(cluster, st)
        if args.detach:
            if cluster.job.hang_timeout:
                console.print("hang_timeout is not watched: an attached `orch up` watches "
                              "for hangs", markup=False)
            console.print(f"detached: follow with `{hint_cmd(cluster, 'logs -f')}`, "
                          f"stop with `{hint_cmd(cluster, 'stop')}`, "
                          f"get its output/ with `{hint_cmd(cluster, 'pull')}`", markup=False)
            if args.json:
                emit_json(started.result)
        return EXIT_OK


def started_line(cluster: Cluster, st: Any) -> None:
    console.print(f"started job '{cluster.name}' on {plural(len(cluster.hosts), 'host')} "
                  f"({plural(cluster.world_size, 'rank')}, "
                  f"MASTER_ADDR={st.master_addr}:{st.master_port})")


def checked_restarts(cluster: Cluster, given: int | None) -> int:
    """`--restarts N` over job.restarts; refused below 0, and above 0 for a job array
    (its tasks are independent: nothing would restart)."""
    restarts = cluster.job.restarts if given is None else given
    if restarts < 0:
        raise UsageError(f"--restarts {restarts}: must be 0 or more",
                         hint="give the most restarts after a failure, e.g. --restarts 3")
    if given and cluster.job.array is not None:
        raise UsageError("--restarts restarts one distributed job; this inventory's job is an "
                         "array of independent tasks", hint="leave --restarts out for a job array")
    return restarts


def with_hang_timeout(cluster: Cluster, seconds: float | None) -> Cluster:
    """`--hang-timeout S` over the inventory's job.hang_timeout."""
    if seconds is None:
        return cluster
    if not 0 < seconds < float("inf"):
        raise UsageError(f"--hang-timeout must be a number of seconds above 0, got {seconds:g}",
                         hint="e.g. `--hang-timeout 300`")
    if cluster.job.array is not None:
        raise UsageError("--hang-timeout watches the ranks of one distributed job; this "
                         "inventory's job is an array of independent tasks",
                         hint="leave --hang-timeout out for a job array")
    return replace(cluster, job=replace(cluster.job, hang_timeout=seconds))


def array_started(started: launching.Started, args: argparse.Namespace) -> int:
    """A job array: its runners started on every host; followed until every task ended,
    then its results."""
    cluster, rec = started.session.cluster, started.record
    spec = cluster.job.array
    assert spec is not None and rec is not None
    total = sum(array_plan.slots(h, spec) for h in cluster.hosts)
    from orchestrator.api import pulling
    from orchestrator.commands import render
    aside = pulling.own_outputs(cluster, started.state, new_run=True)   # before any fetch
    if aside is not None:
        render.earlier_outputs(str(pulling.default_dest(cluster)), str(aside))
    console.print(f"started job array '{cluster.name}': {len(rec.host)} tasks on "
                  f"{len(cluster.hosts)} hosts, {total} at a time")
    if args.detach:
        console.print(f"detached: watch with `{hint_cmd(cluster, 'status')}`, "
                      f"`{hint_cmd(cluster, 'logs -f')}`; results with `{hint_cmd(cluster, 'results')}`; "
                      f"stop with `{hint_cmd(cluster, 'stop')}`", markup=False)
        if args.json:
            emit_json(started.result)
        return EXIT_OK
    from orchestrator.api import querying
    from orchestrator.arrays.attach import attach_array
    code = attach_array(started.session, rec, args.fail_fast)
    render.results(querying.results_of(started.session, rec))
    return code


class SyncBar(launching.SyncShown):
    def __init__(self, bar: Progress, task: TaskID, hosts: int) -> None:
        self.bar, self.task, self.hosts = bar, task, hosts
        self.done: list[int] = []   # appended from the hosts' threads (atomic)

    def sent(self, nbytes: int) -> None:
        self.bar.advance(self.task, nbytes)

    def host_done(self, index: int) -> None:
        self.done.append(index)
        self.bar.update(self.task, description=f"sync {len(self.done)}/{plural(self.hosts, 'host')}")


class UpView(launching.UpProgress):
    """Each step of `up` on stderr: a bar while it runs, a line when it is done."""

    bar: tuple[Progress, TaskID] | None = None   # the preflight's, while it runs

    @contextmanager
    def preflight(self, hosts: int) -> Iterator[Callable[[], None]]:
        with hosts_bar() as bar:
            task = bar.add_task("connect + preflight", total=hosts)
            self.bar = (bar, task)
            try:
                yield lambda: bar.advance(task)
            finally:
                self.bar = None

    said = ""   # the holders last printed (piped output: a line when they change)

    def gpu_wait(self, line: str) -> None:
        if self.bar is not None and console.is_terminal:   # the bar's line: the queue's live line
            self.bar[0].update(self.bar[1], description=escape(line[:200]))
            return
        holders = line.split("GPUs: ", 1)[-1]
        if holders != self.said:
            self.said = holders
            console.print(plain(line))

    def gpus_claimed(self, cluster: Cluster, waited: float) -> None:
        said = "; ".join(f"{h.label} GPUs {','.join(map(str, h.gpu_ids))}"
                         for h in cluster.hosts[:8] if h.gpu_ids is not None)
        more = " ..." if len(cluster.hosts) > 8 else ""
        after = f", after waiting {waited:.1f} s" if waited else ""
        console.print(plain(f"gpus: claimed for the job's life{after}: {said}{more}"))

    def resplit(self, cluster: Cluster, result: SplitResult) -> None:
        console.print(f"data: split {result.plan.source} again for world size "
                      f"{result.plan.workers} ({cluster.selection}) -> "
                      f"{result.out}/worker_*_of_{result.plan.workers}", markup=False)

    def preflight_done(self, cluster: Cluster, pre: PreflightReport) -> None:
        size = "a job array" if cluster.job.array else f"world size {cluster.world_size}"
        chosen = f" ({cluster.selection})" if cluster.selection else ""
        console.print(f"preflight: {plural(len(cluster.hosts), 'host')} ok, {size}{chosen}",
                      markup=False)
        if pre.network is not None:   # the network plan (session/network.py), as proven
            for line in pre.network.lines():
                console.print(line, markup=False)

    @contextmanager
    def sync(self, hosts: int, total: int) -> Iterator[launching.SyncShown]:
        with bytes_bar() as bar:
            task = bar.add_task(f"sync 0/{plural(hosts, 'host')}", total=total or 1)
            yield SyncBar(bar, task, hosts)

    def synced(self, cluster: Cluster, reports: launching.SyncReports,
               shared: dict[int, list[str]]) -> None:
        for line in sync_lines(cluster, reports, shared):
            console.print(line, markup=False)

    def python_missing(self, host: Host, python: str) -> None:
        console.print(f"{escape(host.label)}: python {escape(python)} "
                      "is not there yet; checked after setup")

    def setup_printer(self) -> Printer:
        return Printer()

    def setup_done(self, cluster: Cluster, skipped: int, ran: int, seconds: float,
                   covered: int = 0) -> None:
        if skipped:
            console.print(f"setup: skipped on {plural(skipped, 'host')} (unchanged since it last "
                          f"succeeded there; `{hint_cmd(cluster, 'up --setup')}` runs it again)",
                          markup=False)
        if ran:
            console.print(f"setup: done on {plural(ran, 'host')} "
                          f"({seconds:.1f} s; logs/setup.log on each host)")
        if covered:
            console.print(f"setup: {plural(covered, 'host')} share a job folder with a host "
                          "that ran it (setup.once_per: filesystem)", markup=False)


SYNC_LINES_MAX = 16   # past this many lines, the rest is one sum


def sync_lines(cluster: Cluster, reports: launching.SyncReports,
               shared: dict[int, list[str]]) -> list[str]:
    """What the push did, a line per job folder up to 16 hosts; past that, only the
    hosts that got files or share a folder, those whose lines read the same as one
    (`sync 127.0.1.[1-300]: code 1 file 57 B sent, 0 deleted`), and past 16 lines one
    sum: a first push to 1,000 hosts was 1,000 lines."""
    alike: dict[str, list[int]] = {}
    lines: list[tuple[list[int], str]] = []
    for i, parts in sorted(reports.items()):
        others = shared.get(i, [])
        text = "; ".join(f"{k} {plural(r.files, 'file')} {r.bytes} B sent, {r.deleted} deleted"
                         for k, r in parts.items()) or "nothing to push"
        if len(cluster.hosts) <= SYNC_LINES_MAX or others:
            note = f" (job folder shared with {', '.join(others)}: pushed once)" if others else ""
            lines.append(([i], f"sync {cluster.hosts[i].label}{note}: {text}"))
        elif any(r.files for r in parts.values()):
            alike.setdefault(text, []).append(i)
    lines += [(m, f"sync {fold([cluster.hosts[i].label for i in m])}: {text}")
              for text, m in alike.items()]
    lines.sort()
    if len(lines) <= SYNC_LINES_MAX:
        return [line for _, line in lines]
    shown, summed = lines[:SYNC_LINES_MAX - 1], lines[SYNC_LINES_MAX - 1:]
    hosts = [i for members, _ in summed for i in members]
    rest = [r for i in hosts for r in reports[i].values()]
    return [line for _, line in shown] + [
        f"sync: {plural(len(hosts), 'host')} more got {plural(sum(r.files for r in rest), 'file')}, "
        f"{sum(r.bytes for r in rest)} B in all"]
