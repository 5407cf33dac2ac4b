"""`api.run`: a job run to its end, restarts included, as one stream of events.

Each attempt is started as `up` does (launching.start), then followed by the policy loop
(watch/monitor.watch: fail fast, the root cause, the hang watch); after a failure,
healing.py decides the next attempt's hosts (strikes, spares, `job.min_hosts`) and after
a short back-off the whole job starts again under the same name (ORCH_RESTART_COUNT=k).
An `orch stop` from elsewhere, Ctrl-C, success, or no restart left end the run.

While an attempt runs, its metrics files come back from every rank's host for live
curves (watch/curvefetch.py), and `job.checkpoint`'s files are kept off rank 0's host
(session/checkpoints.py, their one home); before a restart's launch they are put back
into every job folder of the new run, so a run resumes even when the host that held them
is gone. Everything is emitted as events (watch/events.py); nothing is printed."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from orchestrator.api import healing, jobs, launching
from orchestrator.api.outcomes import AttemptResult, Finished, Pulled, RankEnd, RunResult
from orchestrator.config.hostselect import narrow
from orchestrator.config.inventory import Cluster
from orchestrator.errors import (
    EXIT_JOB_FAILED,
    EXIT_OK,
    GroupError,
    JobError,
    OrchError,
    UsageError,
)
from orchestrator.session import checkpoints
from orchestrator.session.preflight import PreflightReport
from orchestrator.session.session import Session
from orchestrator.watch import events as ev

if TYPE_CHECKING:   # imported when the job runs (api.pulling, the monitor): not before
    from orchestrator.api.outcomes import PullResult  # the first login (tests/test_cli.py)
    from orchestrator.api.pulling import PullShown
    from orchestrator.session.state import JobState
    from orchestrator.watch.curvefetch import CurveFetch
    from orchestrator.watch.monitor import Monitor, Outcome


@dataclass(frozen=True)
class Options:
    """How the run goes: `restarts` after a failure, `setup` forced, `wait` for busy
    GPUs, `pull` rank 0's output/ at the end (`transfer`: the pull's progress)."""

    restarts: int = 0
    setup: bool = False
    wait: bool = False
    pull: bool = True
    transfer: PullShown | None = None
    using: SessionUser | None = None


class SessionUser(Protocol):
    """One more user of each attempt's open session (`orch up --dashboard`'s GPU
    samples: no connection of their own): told once the job started on it, and before
    it closes."""

    def started(self, session: Session, st: JobState) -> None: ...

    def ending(self, session: Session) -> None: ...


class Serial:
    """The reader's `on_event`, called by one thread at a time (the hosts' readers, the
    loop, the spares' thread all emit)."""

    def __init__(self, on_event: ev.Emit) -> None:
        self.on_event, self.lock = on_event, threading.Lock()

    def __call__(self, event: ev.Event) -> None:
        with self.lock:
            self.on_event(event)

    def many(self, events: Sequence[ev.Event]) -> None:
        with self.lock:
            ev.emit_all(self.on_event, events)


def run(inventory: jobs.Inventory, *, restarts: int | None = None,
        hang_timeout: float | None = None, hosts: str | None = None,
        exclude: str | None = None, on_event: ev.Emit | None = None,
        setup: bool = False, wait: bool = False, pull: bool = True) -> RunResult:
    """Run the job to its end: preflight, sync, launch, follow, with fail-fast, the hang
    watch and restarts exactly as an attached `orch up` does; prints nothing.
    `restarts`, `hang_timeout`: over the inventory's job.restarts / job.hang_timeout.
    `on_event`: called with every event (watch/events.py), one at a time.
    Returns the RunResult; a failed job raises JobError (`cause`: the root cause as a
    RootCause; `failures`: every failed rank; `result`: the RunResult). Ctrl-C stops the
    job on every host, then KeyboardInterrupt is raised again."""
    from dataclasses import replace
    cluster = narrow(jobs.cluster_of(inventory), hosts, exclude)
    if cluster.job.array is not None:
        raise jobs.kind_error(cluster, "a job array", "array_up")
    if hang_timeout is not None:
        if not 0 < hang_timeout < float("inf"):
            raise UsageError(f"hang_timeout must be a number of seconds above 0, got "
                             f"{hang_timeout:g}", hint="e.g. hang_timeout=300")
        cluster = replace(cluster, job=replace(cluster.job, hang_timeout=hang_timeout))
    chosen = cluster.job.restarts if restarts is None else restarts
    if chosen < 0:
        raise UsageError(f"restarts={chosen}: must be 0 or more",
                         hint="give the most restarts after a failure, e.g. restarts=3")
    opts = Options(chosen, setup=setup, wait=wait, pull=pull)
    emit = Serial(on_event or (lambda e: None))
    result = run_job(cluster, opts, emit, lambda: EventProgress(emit))
    if result.code != EXIT_OK:
        raise job_error(result)
    return result


class EventProgress(launching.UpProgress):
    """The steps before the launch, as events: what each job folder received."""

    def __init__(self, emit: ev.Emit) -> None:
        self.emit = emit

    def synced(self, cluster: Cluster, reports: launching.SyncReports,
               shared: dict[int, list[str]]) -> None:
        for i, parts in sorted(reports.items()):
            self.emit(ev.Synced(time.time(), cluster.hosts[i].label,
                                sum(r.files for r in parts.values()),
                                sum(r.bytes for r in parts.values()),
                                sum(r.deleted for r in parts.values())))


def job_error(result: RunResult) -> OrchError:
    cause = result.attempts[-1].cause if result.attempts else None
    if cause is None:   # the job ended well; its pull failed
        err = OrchError(f"job '{result.job}': {result.pull_error}")
        err.exit_code = result.code
        err.result = result
        return err
    failed = {e.rank: e for e in result.ranks if e.failed and not e.after_stop}
    return JobError(f"job '{result.job}' failed: {cause.summary()}", failures=failed,
                    cause=cause, result=result)


def run_job(cluster: Cluster, opts: Options, emit: ev.Emit,
            view: Callable[[], launching.UpProgress]) -> RunResult:
    """The run across its attempts; `view()`: what shows each attempt's steps."""
    plan = healing.Healer.first(cluster, opts.restarts)
    ready = Spares(plan, emit)
    run = Run(plan, opts, emit, view, checkpoints.Checkpointing(), ready.start)
    while True:
        try:
            outcome = run.attempt()
        except GroupError as err:   # a restart that could not start: start_failed says why
            if plan.attempt == 0:
                raise
            emit(ev.StartFailed(time.time(), plan.attempt, f"{err}"))
            outcome = start_failed(plan, err)
        if isinstance(outcome, RunResult):
            emit(Finished(time.time(), outcome))
            return outcome
        run.kept.lost(outcome.lost)
        ready.join()
        nxt = plan.after(outcome.why, outcome.lost, outcome.culprits)
        if nxt is None:
            emit(ev.NoRestart(time.time(), "cannot", plan.restarts, plan.ended))
            result = run.result(outcome.code, None)
            emit(Finished(time.time(), result))
            return result
        delay = healing.backoff(nxt.restart)
        emit(ev.Restarting(time.time(), nxt.restart, plan.restarts, outcome.why,
                           tuple(h.label for h in nxt.hosts), delay,
                           outcome.no_checkpoint or ""))
        time.sleep(delay)


class Failed:
    """An attempt that failed and may be restarted: why, and the hosts to blame."""

    def __init__(self, why: str, lost: set[str], culprits: set[str],
                 code: int = EXIT_JOB_FAILED) -> None:
        self.why, self.lost, self.culprits, self.code = why, lost, culprits, code
        self.no_checkpoint: str | None = None   # why a restart resumes from nothing


def start_failed(plan: healing.Healer, err: GroupError) -> Failed:
    """A restart that could not start. Hosts its preflight could not reach are lost; a
    host that answered but failed a later step (its previous attempt's processes still
    ending on a loaded host, a full disk) takes a strike: it is tried once more, and left
    out if it fails again."""
    failed = healing.unreachable(plan.cluster, err)
    names = ", ".join(sorted(err.hosts.values()))
    if err.reached:
        return Failed(f"the start failed on {names}", set(), failed, err.exit_code)
    return Failed(f"preflight failed on {names}", failed, set(), err.exit_code)


class PauseAtStop:
    """The emit given to the watch: at the job's stop (fail-fast, a hang, Ctrl-C) the
    curves' fetch starts no new round. Its rounds ask every host, every few seconds: at
    300 hosts one ran beside the stop, on the cores the hosts share, and the last round
    (after the watch) then waited behind it."""

    def __init__(self, emit: ev.Emit, fetch: CurveFetch | None) -> None:
        self.emit, self.fetch = emit, fetch

    def __call__(self, event: ev.Event) -> None:
        if isinstance(event, ev.Stopping) and self.fetch is not None:
            self.fetch.stop(timeout=0)   # no wait: a round in flight ends by itself
        self.emit(event)

    def many(self, events: Sequence[ev.Event]) -> None:
        ev.emit_all(self.emit, events)


class Spares:
    """The spares made ready (preflight, code) beside the first attempt, in a thread: the
    job does not wait for them. One that cannot serve is said and taken out of the plan."""

    def __init__(self, plan: healing.Healer, emit: ev.Emit) -> None:
        self.plan, self.emit = plan, emit
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is None and self.plan.spares and self.plan.restarts > 0:
            self.thread = threading.Thread(target=self.prepare, daemon=True)
            self.thread.start()

    def prepare(self) -> None:
        try:
            verdicts = launching.prepare_spares(self.plan.cluster)
        except Exception as e:   # whatever it is, the job goes on: the spares are tried later
            self.emit(ev.Spares(time.time(), (), error=str(e)))
            return
        refused = tuple((label, why) for label, why in verdicts.items() if why)
        bad = {label for label, _ in refused}
        self.plan.spares = [h for h in self.plan.spares if h.label not in bad]
        ready = tuple(label for label, why in verdicts.items() if not why)
        self.emit(ev.Spares(time.time(), ready, refused))

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


class Run:
    """The attempts of one run, and what each did."""

    def __init__(self, plan: healing.Healer, opts: Options, emit: ev.Emit,
                 view: Callable[[], launching.UpProgress], kept: checkpoints.Checkpointing,
                 running: Callable[[], None]) -> None:
        self.plan, self.opts, self.emit, self.view = plan, opts, emit, view
        self.kept, self.running = kept, running
        self.attempts: list[AttemptResult] = []
        self.ranks: tuple[RankEnd, ...] = ()
        self.pulled: PullResult | None = None
        self.pull_error, self.pull_seconds = "", 0.0
        self.aside: Path | None = None   # where the run's start moved an earlier run's outputs
        self.job = plan.cluster.name

    def result(self, code: int, outcome: Outcome | None) -> RunResult:
        if outcome is not None:
            self.ranks = tuple(RankEnd(e.rank, e.host, e.code, e.signal, e.runtime, e.after_stop)
                               for e in outcome.exits)
        return RunResult(self.job, code, self.ranks, tuple(self.attempts), self.pulled,
                         self.pull_error, self.pull_seconds)

    def attempt(self) -> RunResult | Failed:
        """One attempt, started and followed: the RunResult when the run ends with it."""
        plan, opts = self.plan, self.opts
        cluster = plan.cluster
        keep = checkpoints.wanted(cluster, plan.restarts)
        pres: list[PreflightReport] = []

        def before(session: Session, pre: PreflightReport) -> None:
            pres.append(pre)
            if plan.attempt:
                self.put_back(session, pre)
        t0 = time.monotonic()
        with launching.start(cluster, setup=opts.setup, wait=opts.wait, progress=self.view(),
                             attempts=plan.attempts, restart=plan.attempt > 0,
                             before_launch=before if keep else None,
                             begin_follows=True) as got:
            cluster, st = got.session.cluster, got.state
            self.emit(ev.Started(time.time(), cluster.name, st.run_id, tuple(
                ev.StartedHost(h.label, h.job_dir, tuple(h.ranks)) for h in st.hosts),
                cluster.world_size, st.master_addr, st.master_port, plan.attempt,
                plan.restarts + 1))
            started = time.monotonic() - t0
            self.running()
            if keep:
                self.kept.start(got.session, pres[-1], self.chosen)
            fetch = self.new_fetch(got.session, st) if opts.pull else None
            if opts.using is not None:
                opts.using.started(got.session, st)
            from orchestrator.watch.monitor import watch
            mons: list[Monitor] = []
            try:
                outcome = watch(got.session, st, PauseAtStop(self.emit, fetch), mons.append)
            except BaseException:   # Ctrl-C, a failed follow: no last round, out at once
                if fetch is not None:
                    fetch.stop(timeout=1.0)
                    fetch = None
                raise
            finally:
                if opts.using is not None:
                    opts.using.ending(got.session)
                if keep:
                    self.end_keeper(mons[0] if mons else None)
                if fetch is not None:
                    fetch.stop(final=True, timeout=30.0)
            self.attempts.append(AttemptResult(
                plan.attempt, tuple(h.label for h in st.hosts), outcome.cause,
                outcome.cause.summary() if outcome.cause else "", started,
                time.monotonic() - t0 - started))
            user_stop = outcome.cause is not None and outcome.cause.user_stop
            if outcome.code == EXIT_OK or user_stop or plan.left <= 0:
                if user_stop:
                    self.emit(ev.NoRestart(time.time(), "user_stop", plan.restarts))
                elif outcome.code == EXIT_JOB_FAILED and plan.restarts:
                    self.emit(ev.NoRestart(time.time(), "none_left", plan.restarts))
                code = self.pull(got.session, outcome.code) if opts.pull else outcome.code
                return self.result(code, outcome)
            self.result(outcome.code, outcome)
            failed = blame(cluster, outcome)
            failed.no_checkpoint = self.kept.nothing_kept() if keep else None
            return failed

    def pull(self, session: Session, code: int) -> int:
        """Rank 0's output/ on the attempt's open links. A failed pull keeps a failed
        job's code, else it is the code."""
        from orchestrator.api import pulling
        t0 = time.monotonic()
        try:
            self.pulled = pulling.job_output(session, self.opts.transfer or pulling.quiet,
                                             self.aside)
            self.emit(Pulled(time.time(), self.pulled))
        except OrchError as e:
            self.pulled, self.pull_error = e.result, str(e)
            self.emit(Pulled(time.time(), e.result, str(e)))
            code = code or e.exit_code
        finally:
            self.pull_seconds = time.monotonic() - t0
        return code

    def new_fetch(self, session: Session, st: JobState) -> CurveFetch:
        """The attempt's metrics files fetched from every rank's host while it runs
        (watch/curvefetch.py), into this run's outputs/<name>/ (an earlier run's folder
        set aside first, as the pull at the end would; said by that pull)."""
        from orchestrator.api import pulling
        from orchestrator.watch.curvefetch import CurveFetch
        if self.plan.attempt == 0:
            self.aside = pulling.own_outputs(session.cluster, st, new_run=True)
        else:   # a restart: the same run's folder, its earlier attempts' files kept
            pulling.adopt(session.cluster, st)
        return CurveFetch(session).start(wait_first=True)   # just launched: nothing yet

    def chosen(self, host: str, line: str) -> None:
        """`checkpoint_to: host`: where this attempt keeps its checkpoints, said."""
        self.emit(ev.KeeperChosen(time.time(), host, line))

    def end_keeper(self, mon: Monitor | None) -> None:
        """The keeper's last round (the hosts the monitor saw lost are not asked), and
        what it holds said."""
        held = self.kept.end(None if mon is None else mon.lost)
        if held:
            self.emit(ev.CheckpointKept(time.time(), held))

    def put_back(self, session: Session, pre: PreflightReport) -> None:
        """The kept checkpoints into every job folder of the new run (checkpoints.py)."""
        got = self.kept.put_back(session, pre)
        if got is not None:
            self.emit(ev.CheckpointRestored(time.time(), got.hosts, got.files, got.source,
                                            got.nothing))

def blame(cluster: Cluster, outcome: Outcome) -> Failed:
    """What failed, in a line, and which hosts take a strike for it."""
    lost = {cluster.hosts[i].label for i in outcome.lost}
    cause = outcome.cause
    why = cause.summary() if cause is not None else "the job failed"
    if cause is not None and cause.hang is not None:   # its culprits, or every idle rank's host
        ranks = [c.rank for c in cause.hang.culprits] or list(cause.hang.report.hang.idle)
        return Failed(why, lost, {cluster.host_of(r).label for r in ranks})
    if cause is not None and cause.failures:
        return Failed(why, lost, {cause.failures[0].host})
    if cause is not None and cause.silent:
        names = set(cause.silent)
        return Failed(why, lost | names, names)
    return Failed(why, lost, set())
