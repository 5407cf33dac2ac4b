"""What fills a Board: the job's events (api.follow's, or an attached run's own), each
GPU's facts sampled every few seconds on the hosts, the curves read from the local
copies of the job's files, a job array's rows. Each feed is a daemon thread that ends
when the `Feeds` is closed; a feed that fails says why on the page and stops, the
others go on."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from orchestrator.api import following, jobs
from orchestrator.config.inventory import Cluster
from orchestrator.dashboard.board import Board
from orchestrator.errors import OrchError
from orchestrator.session import network
from orchestrator.session.session import Session
from orchestrator.session.state import JobState
from orchestrator.watch import events as ev
from orchestrator.watch.curvefetch import CurveFetch

GPU_EVERY = 5.0       # seconds between GPU samples: nvidia-smi on every host each time
CURVES_EVERY = 2.0    # seconds between reads of the curves' local copies
CURVES_LOOK = 0.25    # seconds between looks at whether a fetch changed them
TASKS_EVERY = 5.0
NEXT_RUN_EVERY = 2.0  # seconds between looks at the saved state once a run ended

log = logging.getLogger("orchestrator")


class Feeds:
    """The threads that feed one board; `close()` ends them and the follow's session."""

    def __init__(self, board: Board) -> None:
        self.board = board
        self.done = threading.Event()
        self.session: Session | None = None
        self.fetch: CurveFetch | None = None
        self.threads: list[threading.Thread] = []
        self.runs = RunSessions(board, self)   # `orch up --dashboard`: the run's sessions

    def start(self, name: str, target: Callable[[], None]) -> None:
        def guarded() -> None:
            try:
                target()
            except Exception as e:    # said on the page; the other feeds go on
                self.board.end(f"{name}: {e}") if name == "follow" else self.note(name, e)
                log.debug("dashboard feed %s failed", name, exc_info=True)
        t = threading.Thread(target=guarded, daemon=True, name=f"dashboard-{name}")
        self.threads.append(t)
        t.start()

    def note(self, name: str, e: BaseException) -> None:
        self.board.note(f"{name}: {e}")

    def every(self, seconds: float, step: Callable[[], None]) -> None:
        """`step` now and every `seconds` until closed."""
        while not self.done.is_set():
            step()
            self.done.wait(seconds)

    def close(self) -> None:
        self.done.set()
        if self.fetch is not None:
            self.fetch.stop()
        if self.session is not None:
            self.session.close()


def follow_job(inventory: jobs.Inventory, board: Board, feeds: Feeds,
               gpu_every: float = GPU_EVERY) -> Cluster:
    """`orch dashboard` of a distributed job: api.follow's events into the board; on the
    same session, the GPU samples while the job runs and the curves' files fetched
    (watch/curvefetch.py, as an attached `orch up` does). Once that run ended, a new one
    (a restart, another `orch up`) is followed as it appears in the saved state. A
    mistake (no job started, an array) raises here, before any page is served; returns
    the run's cluster."""
    session, st = following.attach(inventory)
    own_folder(session.cluster, st, board)
    board.set_network(network.load(session.cluster, st.run_id))   # as `up` found it

    def follow() -> None:
        current: tuple[Session, JobState] | None = (session, st)
        while current is not None:
            follow_run(*current, board, feeds, gpu_every)
            current = next_run(inventory, current[1], feeds)
            if current is not None:
                board.reattached(current[0].cluster, current[1].run_id, len(current[1].attempts))
                own_folder(current[0].cluster, current[1], board)
                board.set_network(network.load(current[0].cluster, current[1].run_id))
    feeds.start("follow", follow)
    return session.cluster


def follow_run(session: Session, st: JobState, board: Board, feeds: Feeds,
               gpu_every: float) -> None:
    """One run's events to its end, with its curves' fetch and GPU samples."""
    feeds.session = session
    stream = following.events(session, st)
    fetch = feeds.fetch = CurveFetch(session).start()   # the curves' files, while it runs
    if any(h.gpus for h in session.cluster.hosts):
        feeds.start("gpus", lambda: sample_gpus(session, st, board, feeds, gpu_every))
    for event in stream:
        if isinstance(event, (ev.Succeeded, ev.RootCause)):   # the last: the files' last rows
            fetch.stop(final=True)
        board(event)
        if feeds.done.is_set():
            break
    fetch.stop()
    board.end()


def own_folder(cluster: Cluster, st: JobState, board: Board) -> None:
    """outputs/<name>/ made this run's before its files are fetched, as the pull makes it
    (api/pulling.run_dest): an earlier run's folder renamed aside, the other hosts'
    copies of its files removed, and said on the page (`orch dashboard` prints it too),
    so that no curve mixes two runs."""
    from orchestrator.api import pulling
    try:
        aside = pulling.own_outputs(cluster, st, new_run=False)
    except OrchError as e:   # another pull writes there now: said, the curves may mix
        board.note(f"outputs: {e.message}")
        return
    if aside is not None:
        board.note(f"{rel(cluster, pulling.default_dest(cluster))} held an earlier run's "
                   f"files: moved to {rel(cluster, aside)} (each run keeps its own folder)")


def rel(cluster: Cluster, path: Path) -> str:
    """A folder as the pull's line names it: beside the inventory, with a slash."""
    return (str(path.relative_to(cluster.base_dir)) if path.is_relative_to(cluster.base_dir) else str(path)) + "/"


def next_run(inventory: jobs.Inventory, last: JobState, feeds: Feeds,
             every: float | None = None) -> tuple[Session, JobState] | None:
    """The job's next run once its saved state names one (a new run id, or one more
    restart), attached; None once the page is closed."""
    seen = (last.run_id, len(last.attempts))
    while not feeds.done.wait(every or NEXT_RUN_EVERY):
        try:
            st = jobs.saved_state(jobs.run_cluster(inventory))
            if st is not None and (st.run_id, len(st.attempts)) != seen:
                return following.attach(inventory)
        except OrchError as e:   # a damaged state, a host not reached: said, tried again
            feeds.note("next run", e)
    return None


def sample_gpus(session: Session, st: JobState | None, board: Board, feeds: Feeds,
                every: float) -> None:
    """Each GPU's utilisation, memory and holder, as `orch status` asks them, while the
    run of this session goes on."""
    from orchestrator.api import querying
    while not feeds.done.is_set() and feeds.session in (None, session) and not board.ended:
        status = querying.status_of(session, st, session.status())
        board.gpu_sample(time.time(), status.gpus, status.gpu_errors)
        feeds.done.wait(every)


class RunSessions:
    """`orch up --dashboard`'s GPU samples, asked on the attached run's own session of
    each attempt (handed over by api/running.py: `Options.using`), so the page opens no
    connection of its own. A sample that comes back after its attempt ended is dropped
    (that session was closing)."""

    def __init__(self, board: Board, feeds: Feeds, every: float | None = None) -> None:
        self.board, self.feeds, self.every = board, feeds, every or GPU_EVERY
        self.lock = threading.Lock()
        self.current: tuple[Session, JobState] | None = None

    def started(self, session: Session, st: JobState) -> None:
        with self.lock:
            self.current = (session, st)

    def ending(self, session: Session) -> None:
        with self.lock:
            if self.current is not None and self.current[0] is session:
                self.current = None

    def sample(self) -> None:
        """A sample every `every` seconds while an attempt runs, until the page closes."""
        from orchestrator.api import querying
        while not self.feeds.done.is_set():
            with self.lock:
                now = self.current
            if now is None:    # before the job started, between attempts, after the run
                self.feeds.done.wait(min(self.every, 0.5))
                continue
            try:
                status = querying.status_of(now[0], now[1], now[0].status())
            except Exception:
                if self.current is now:
                    raise           # said on the page
                continue            # its session closed under it: the attempt ended
            with self.lock:
                if self.current is now:
                    self.board.gpu_sample(time.time(), status.gpus, status.gpu_errors)
            self.feeds.done.wait(self.every)


def read_curves(cluster: Cluster, board: Board, feeds: Feeds,
                every: float = CURVES_EVERY) -> None:
    """The curves from the local copies of the job's metrics files, re-read while the
    page is open (watch/curves.py caps what it reads): at once when this page's own
    fetch brought a changed file (`feeds.fetch.version`), else every `every` seconds
    (an attached run's fetch writes them)."""
    from orchestrator.watch import curves
    seen = [-1, 0.0]     # the fetch's version read last, and when

    def step() -> None:
        version = feeds.fetch.version if feeds.fetch is not None else -1
        if version == seen[0] and time.monotonic() - seen[1] < every:
            return
        seen[:] = [version, time.monotonic()]
        series = curves.read_curves(cluster, notes=[])
        board.set_curves(series, curves.latest(series))
    feeds.every(CURVES_LOOK, step)


def array_tasks(inventory: jobs.Inventory, board: Board, feeds: Feeds,
                every: float | None = None) -> None:
    """A job array's tasks and their groups over folds, as `orch results` shows them."""
    from orchestrator import api

    def step() -> None:
        try:
            results = api.results(inventory)
        except OrchError as e:
            board.set_tasks({"error": e.message})
            return
        board.set_tasks(api.document(results))
    feeds.every(every or TASKS_EVERY, step)


def start_all(inventory: jobs.Inventory, board: Board, feeds: Feeds,
              gpu_every: float = GPU_EVERY) -> Cluster:
    """Every feed of `orch dashboard` for the inventory's job (an array: its tasks). A
    mistake (no job started) raises here, before any page is served."""
    cluster = jobs.run_cluster(inventory)
    if cluster.job.array is not None:
        from orchestrator import api
        board.set_tasks(api.document(api.results(cluster)))
        feeds.start("tasks", lambda: array_tasks(cluster, board, feeds))
    else:
        cluster = follow_job(cluster, board, feeds, gpu_every)
    feeds.start("curves", lambda: read_curves(cluster, board, feeds))
    return cluster
