"""`api.follow`: a running job's events, as an iterator, from any process.

It attaches to the job the inventory last started (its saved state), reads every
rank's log from its start and what comes after, and yields the same events `api.run`
delivers (watch/events.py): RankLine, RankExited, HostLost, then Succeeded or the
RootCause once the job has ended. It only watches: it stops nothing, and a hang is the
attached run's to find (`api.run`, `orch up`)."""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from orchestrator.api import jobs
from orchestrator.session.session import Session
from orchestrator.session.state import JobState
from orchestrator.watch import events as ev

_END = object()


def follow(inventory: jobs.Inventory) -> Iterator[ev.Event]:
    """Every event of the running (or ended) job until it ends; a host not reached is a
    HostLost at once. Leaving the loop early closes the connections; the job goes on."""
    session, st = attach(inventory)
    yield from events(session, st)


def attach(inventory: jobs.Inventory) -> tuple[Session, JobState]:
    """The job's session, its agents started (what `follow` reads from; the dashboard
    asks its GPU samples on the same connections). A mistake raises here."""
    cluster = jobs.run_cluster(inventory)
    if cluster.job.array is not None:
        raise jobs.kind_error(cluster, "a job array", "logs")
    st = jobs.require_state(cluster)
    return jobs.open_job(cluster, st), st


def events(session: Session, st: JobState, tail: int = -1) -> Iterator[ev.Event]:
    """`follow`'s events from an attached session, which is closed at the end; `tail`:
    each rank's last lines only (`orch logs -f --tail N`), -1 from its log's start."""
    from orchestrator.watch.monitor import watch
    got: queue.Queue[object] = queue.Queue()

    def run() -> None:
        try:
            watch(session, st, got.put, decide=False, tail=tail)
        except BaseException as e:   # handed to the reader, raised there
            got.put(e)
        finally:
            got.put(_END)
    threading.Thread(target=run, daemon=True, name="follow").start()
    try:
        while (item := got.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, ev.Event)
            yield item
    finally:
        session.close()
