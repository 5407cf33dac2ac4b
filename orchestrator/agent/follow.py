"""Follow: stream the rank logs, read in place from a byte offset, as output frames;
rank exits, the host's end and a heartbeat as events.

Lines go out whole, grouped into frames of at most protocol.MAX_OUTPUT bytes; a line
longer than that goes out in pieces flagged PARTIAL (the controller prints each piece
with the rank's prefix), so no line is too long to pass and nothing after it is lost.
"""
from __future__ import annotations

import os
import time

from orchestrator.agent import notify
from orchestrator.agent.common import AgentError, job_paths, read_json
from orchestrator.agent.procs import stop_time, supervisor_alive
from orchestrator.wire import protocol, timeouts

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any, BinaryIO, Callable

    from orchestrator.agent.main import Request
    from orchestrator.agent.paths import JobDir

    Send = Callable[[bytes], None]

READ = 1 << 20          # bytes read from a log per pass
CHUNK = protocol.MAX_OUTPUT


def pieces(data: bytes, final: bool) -> tuple[list[Any], int]:
    """([(bytes, partial)], consumed): whole lines grouped up to CHUNK bytes; a line
    longer than CHUNK as CHUNK-sized partial pieces; the unterminated rest only if final."""
    out, pos, n = [], 0, len(data)
    while pos < n:
        last = data.rfind(b"\n", pos, pos + CHUNK)
        if last >= 0:
            out.append((data[pos:last + 1], False))
            pos = last + 1
        elif n - pos >= CHUNK:
            out.append((data[pos:pos + CHUNK], True))
            pos += CHUNK
        elif final:
            out.append((data[pos:], False))
            pos = n
        else:
            break
    return out, pos


def open_log(jd: JobDir, rel: str) -> BinaryIO | None:
    """A log file opened for reading without following a link; None if it cannot be."""
    try:
        return os.fdopen(jd.open_for_read(rel), "rb")
    except OSError:
        return None


class RankLog:
    """A growing log file read in place from a byte offset (no link followed)."""

    def __init__(self, rank: int, jd: JobDir, rel: str, offset: int) -> None:
        self.rank, self.jd, self.rel, self.offset = rank, jd, rel, offset
        self.f: BinaryIO | None = None

    def read(self, final: bool = False) -> list[Any]:
        """The next pieces (see pieces()); [] when nothing complete is there yet."""
        if self.f is None:
            self.f = open_log(self.jd, self.rel)
            if self.f is None:
                return []
        self.f.seek(self.offset)
        data = self.f.read(READ)
        got, used = pieces(data, final and len(data) < READ)
        self.offset += used
        return got


def tail_offset(f: BinaryIO | None, n: int) -> int:
    """Byte offset where the last n lines of open file f start (a final newline ends
    the last line); 0 when f is None."""
    if f is None:
        return 0
    size = os.fstat(f.fileno()).st_size
    if n == 0:
        return size
    end = size
    if size:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            end = size - 1
    pos, seen = end, 0
    while pos > 0:
        step = min(1 << 16, pos)
        pos -= step
        f.seek(pos)
        chunk = f.read(step)
        idx = len(chunk)
        while True:
            idx = chunk.rfind(b"\n", 0, idx)
            if idx < 0:
                break
            seen += 1
            if seen == n:
                return pos + idx + 1
    return 0


def rank_exit(p: dict[str, Any], rank: int, unit: str = "rank") -> dict[str, Any] | None:
    """run/<unit>-<n>.exit (unit "rank", or "task" for a job array)."""
    ex = read_json(p["jd"], "run/%s-%d.exit" % (unit, rank))
    return ex if isinstance(ex, dict) and "code" in ex and "time" in ex else None


def host_done(p: dict[str, Any], end: SupervisorEnd | None = None) -> Any:
    """host.exit once the supervisor finished; {"code": None, "lost": True} when it vanished.
    `end`: the follow's pidfd of the supervisor, which says it lives without a read of
    run/supervisor.json and /proc at each pass (a stop's passes, on every host at once)."""
    done = read_json(p["jd"], "run/host.exit")
    if done is not None or (end is not None and end.running()) or supervisor_alive(p):
        return done
    return read_json(p["jd"], "run/host.exit") or {"code": None, "lost": True}


def emit(send: Send, log: RankLog, final: bool = False) -> int:
    """Send what the log holds now; the number of frames sent."""
    total = 0
    while True:
        got = log.read(final)
        if not got:
            return total
        for data, partial in got:
            send(protocol.output(log.rank, data, partial))
        total += len(got)


def exit_event(p: dict[str, Any], rank: int, ex: dict[str, Any]) -> bytes:
    """A rank's exit; tagged after_stop when it came after this host received a stop
    (both times by this host's clock, so no offset is involved)."""
    fields = {"rank": rank, "code": ex["code"], "time": ex["time"]}
    if after_stop(p, ex["time"]):
        fields["after_stop"] = True
    return protocol.event("exit", **fields)


def after_stop(p: dict[str, Any], when: Any) -> bool:
    """`when` (this host's clock) came after this host received a stop during this run.
    torchrun's own end is tagged too: a stop kills torchrun first, so on a host alone
    its end can arrive before any rank's exit, and it is the stop's doing either way.
    The first stop's time, once read, is kept in p (a later stop of the run comes after
    it): one read for the host's exits, not one each, when 1,000 hosts stop at once."""
    stopped = p.get("stopped")
    if stopped is None:
        stopped = p["stopped"] = stop_time(p)
    return stopped is not None and isinstance(when, (int, float)) and when >= stopped


def send_exits(send: Send, p: dict[str, Any], logs: list[Any], reported: set[Any],
               events: bool, unit: str, end: SupervisorEnd | None = None) -> tuple[bool, Any]:
    """Report rank exits as they land; (True once nothing more will come, the host's
    end read for it: finish sends that one, without a second read)."""
    for log in logs:
        if log.rank in reported:
            continue
        ex = rank_exit(p, log.rank, unit)
        if ex is not None:
            reported.add(log.rank)
            emit(send, log)
            if events:
                send(exit_event(p, log.rank, ex))
    done = host_done(p, end)
    return done is not None or (not events and len(reported) == len(logs)), done


def send_starts(send: Send, p: dict[str, Any], logs: list[Any], started: set[Any],
                unit: str = "rank") -> None:
    """A `start` event once per rank, when its wrapper has recorded the rank's pid:
    the controller can show that ranks run before their first line (torch imports).
    A job array's task: when the runner has recorded its start."""
    record = "run/rank-%d.pid" if unit == "rank" else "run/task-%d.start"
    for log in logs:
        if log.rank in started:
            continue
        pid = read_json(p["jd"], record % log.rank)
        if isinstance(pid, dict) and isinstance(pid.get("pid"), int):
            started.add(log.rank)
            send(protocol.event("start", rank=log.rank, pid=pid["pid"]))


def finish(send: Send, p: dict[str, Any], logs: list[Any], mode: str,
           curves: list[str] | None = None, done: Any = None) -> None:
    """The last lines, then `done` (the host's end: read now unless given)."""
    for log in logs:
        emit(send, log, final=True)
    if mode == "events":
        done = (done if done is not None else host_done(p)) or {"code": None}
        fields = {"code": done.get("code"), "time": done.get("time"), "lost": bool(done.get("lost"))}
        if after_stop(p, done.get("time")):
            fields["after_stop"] = True
        if curves is not None:
            fields.update(curves_count(p, curves))
        send(protocol.event("done", **fields))
    else:
        send(protocol.event("done", code=None, snapshot=True))


def curves_count(p: dict[str, Any], rests: list[str]) -> dict[str, Any]:
    """{"curves": n}: the files under output/ the follow's `curves` globs match, so that
    the controller's last look at a host let go is skipped where there are none (1,000
    listings at the end of a job on 1,000 hosts); {} when they cannot be counted (the
    controller then looks, as without the count)."""
    # imported here: a follow without `curves` never loads it (one with them did so at
    # its start); not pull.py, whose hashlib is ~5 ms of CPU on every host at the end
    try:
        from orchestrator.agent import listing
        return {"curves": min(listing.count_globs(p["jd"], rests), protocol.MAX_PULL_FILES)}
    except Exception:  # a count is a hint: the host's end is said without it
        return {}


class RunDir:
    """Whether run/ changed since the last look (its mtime: every record lands by a
    rename there), so that a poll reads the pid, exit and host.exit records only then,
    and at least once a second (a supervisor that vanished). At 20 polls a second on
    every host, reading them every time was most of a follow's CPU. A change within the
    last 0.1 s counts as new: the filesystem's clock may be coarser than two renames."""

    RECENT_NS, EVERY = 100_000_000, 1.0

    def __init__(self, jd: JobDir) -> None:
        try:   # held by the JobDir: every record is read through it, not by a walk
            self.fd: int | None = jd.hold("run")
        except OSError:   # not launched here: every poll reads the records
            self.fd = None
        self.jd, self.mtime, self.checked = jd, -1, 0.0

    def changed(self) -> bool:
        if self.fd is None:
            return True
        now, mtime = time.time(), os.fstat(self.fd).st_mtime_ns
        fresh = (mtime != self.mtime or time.time_ns() - mtime < self.RECENT_NS
                 or now - self.checked >= self.EVERY)
        self.mtime = mtime
        if fresh:
            self.checked = now
        return fresh

    def close(self) -> None:
        if self.fd is not None:
            self.jd.release("run")
            self.fd = None


class SupervisorEnd:
    """The supervisor's exit (right after it wrote run/host.exit) as a descriptor that
    becomes readable then: a pidfd (Linux 5.3, Python 3.9). Once every rank of this host
    ended, the follow sleeps on it, so the host's end reaches the controller when
    torchrun exits, not up to a 200 ms poll later (at the end of every job, on the
    slowest host). Without a pidfd, or with no supervisor alive, it sleeps as before."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.tried = self.ended = False

    def watch(self, p: dict[str, Any], last: bool = True) -> None:
        """Open the supervisor's pidfd if it runs. `last`: every rank ended, so no
        supervisor now means none will come (a watched follow also asks before that)."""
        if self.tried or self.fd is not None:
            return
        self.tried = last
        sup = supervisor_alive(p)
        opener = getattr(os, "pidfd_open", None)
        if sup is None or opener is None:
            return
        try:
            fd = opener(sup["pid"])
        except OSError:   # gone already, or no pidfd in this kernel
            return
        if supervisor_alive(p) != sup:   # it ended before the open: the pid is not its own
            os.close(fd)
            return
        self.fd = fd

    def sleep(self, seconds: float, also: int | None = None) -> None:
        """Up to `seconds`, less when the supervisor ends (or `also` is readable);
        `ended` says it did (once: then the records are read, and the sleeps are plain
        again)."""
        self.ended = False
        fds = [fd for fd in (self.fd, also) if fd is not None]
        if not fds:
            time.sleep(max(0.0, seconds))
            return
        if self.fd in notify.wait(fds, seconds):
            self.ended = self.tried = True
            self.close()

    def running(self) -> bool:
        """The supervisor lives, by its pidfd (not ready at the last sleep); False when
        none is held (then the records and /proc tell)."""
        return self.fd is not None and not self.ended

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Heartbeats:
    """The ranks' heartbeat files (run/heartbeat-<r>, rankexec.py), looked at every
    HEARTBEAT_POLL seconds: the ranks whose file's mtime changed since the last look.
    The first look only records: the wrapper made the file at the rank's start."""

    def __init__(self, rundir: RunDir, ranks: list[int]) -> None:
        self.rundir, self.ranks = rundir, ranks
        self.seen = {}   # type: dict[int, int]
        self.checked = 0.0

    def next_look(self) -> float:
        """Seconds until touched() looks again."""
        return self.checked + timeouts.HEARTBEAT_POLL - time.monotonic()

    def touched(self) -> list[int]:
        now = time.monotonic()
        if self.rundir.fd is None or now - self.checked < timeouts.HEARTBEAT_POLL:
            return []
        self.checked, out = now, []
        for r in self.ranks:
            try:
                mtime = os.stat("heartbeat-%d" % r, dir_fd=self.rundir.fd,
                                follow_symlinks=False).st_mtime_ns
            except OSError:
                continue
            if r in self.seen and mtime != self.seen[r]:
                out.append(r)
            self.seen[r] = mtime
        return out


def run(req: Request) -> None:
    """mode: "events" (lines, exits, heartbeats until the host is done), "snapshot"
    (the lines there now), "raw-follow" (until the ranks end), "raw" (what is there now).
    `unit` "task" follows a job array's task logs and exits instead of the ranks'.
    Ends with a `done` event in every mode."""
    a, send = req.args, req.out.send
    mode = a["mode"]
    if mode not in protocol.FOLLOW_MODES:
        raise AgentError("unknown follow mode %r" % mode, protocol.USAGE)
    unit = a.get("unit", "rank")
    if unit not in protocol.FOLLOW_UNITS:
        raise AgentError("unknown follow unit %r" % unit, protocol.USAGE)
    p = job_paths(a["job_dir"])
    logs = []
    for r in a["ranks"]:
        log = RankLog(r, p["jd"], "logs/%s-%d.log" % (unit, r), 0)
        if a["tail"] >= 0:
            log.f = open_log(p["jd"], log.rel)
            log.offset = tail_offset(log.f, a["tail"])
        logs.append(log)
    reported: set[int] = set()
    beat, idle = Beat(a.get("beat", timeouts.HEARTBEAT)), 0
    started = set()  # type: set[Any]
    rundir = RunDir(p["jd"])
    beats = Heartbeats(rundir, a["ranks"]) if a.get("heartbeats") and mode == "events" \
        else None
    end = SupervisorEnd()
    quiet = Quiet(p, rundir, end)
    if a.get("curves") is not None:
        # loaded now, at the follow's start: not at the host's end, when every host of a
        # stopped job counts at once
        from orchestrator.agent import listing  # noqa: F401
    try:
        while True:
            records = rundir.changed() or end.ended or quiet.records()
            if records and mode == "events" and len(started) < len(logs):
                send_starts(send, p, logs, started, unit)
            busy = sum(emit(send, log) for log in logs)
            idle = 0 if busy else idle + 1
            if mode in ("raw", "snapshot"):
                return finish(send, p, logs, mode)
            over, done = send_exits(send, p, logs, reported, mode == "events", unit, end) \
                if records else (False, None)
            if over:
                return finish(send, p, logs, mode, a.get("curves"), done)
            if mode == "events" and len(reported) == len(logs):
                end.watch(p)   # every rank ended: the host's end is torchrun's, soon
            if mode == "events":
                beat.due(send, busy > 0)
            touched = beats.touched() if beats is not None else []
            if touched:
                send(protocol.event("progress", ranks=touched))
            if not busy:
                quiet.wait(idle, beat if mode == "events" else None, beats)
    finally:
        rundir.close()
        end.close()
        quiet.close()


class Quiet:
    """How a follow waits after a pass that found nothing new.

    Watched (notify.watch over logs/ and run/, where inotify can be had): until a rank
    writes, a heartbeat is touched, a record lands, the supervisor ends, or the next beat
    is due; an idle follow costs its host nothing. Passes stay at least GAP apart while
    output flows, QUIET_GAP otherwise, so a rank that prints without pause, or a storm
    of record changes (a stop), costs no more than the poll did.

    Polled (no inotify): 50 ms for a quiet second while output flows, then 200 ms (exits
    are still seen within 0.2 s)."""

    GAP = 0.05         # between two passes while output flows (and for a second after)
    QUIET_GAP = 0.2    # otherwise: a storm of changes (a stop) costs what the poll did
    LONGEST = 5.0   # a watched wait with no beat to send (raw-follow): a backstop only

    def __init__(self, p: dict[str, Any], rundir: RunDir, end: SupervisorEnd) -> None:
        self.p, self.rundir, self.end = p, rundir, end
        self.watch = None   # type: notify.Watch | None
        self.tried = self.run_changed = False
        self.woke = self.flowing = 0.0
        self.beat_event = -1.0   # when a heartbeat was touched that no look has seen

    def records(self) -> bool:
        """A record may have landed in run/ since the last pass (read them again)."""
        changed, self.run_changed = self.run_changed, False
        return changed

    def wait(self, idle: int, beat: Beat | None, beats: Heartbeats | None) -> None:
        """`beat`: the events' beat (its period bounds the wait), None in other modes."""
        if not self.tried:   # at the first wait: a snapshot never gets here
            self.tried = True
            self.watch = watch_job(self.p["jd"], self.rundir.fd)
            if self.watch is not None:
                self.end.watch(self.p, last=False)   # a killed supervisor, seen at once
        if self.watch is None:
            self.end.sleep(0.05 if idle < 20 else 0.2)
            return
        now = time.monotonic()
        if idle <= 1:   # the pass before this one sent output
            self.flowing = now + 1.0
        gap = self.GAP if now < self.flowing else self.QUIET_GAP
        if now - self.woke < gap:
            time.sleep(gap - (now - self.woke))
        timeout = beat.remaining() if beat is not None else self.LONGEST
        if beats is not None and self.beat_event > beats.checked:
            timeout = min(timeout, beats.next_look())
        self.end.sleep(timeout, self.watch.fd)
        self.woke = time.monotonic()
        folders, names = self.watch.drain()
        self.run_changed = RUN in folders
        if self.run_changed and self.end.fd is None:
            self.end.watch(self.p, last=False)   # the supervisor's record came since
        if beats is not None and self.beat_event <= beats.checked and any(
                n.startswith("heartbeat-") for n in names):
            self.beat_event = self.woke

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()


RUN, LOGS = 0, 1   # the watched folders, in notify.watch's order


def watch_job(jd: JobDir, run_fd: int | None) -> notify.Watch | None:
    """A watch over run/ (this host's) and logs/, or None (then the follow polls)."""
    if run_fd is None:
        return None
    try:
        logs_fd = jd.open_dir("logs")
    except OSError:
        return None
    try:
        return notify.watch([run_fd, logs_fd])   # a watch outlives the descriptor
    finally:
        os.close(logs_fd)


class Beat:
    """The `beat` event: sent once `period` seconds (the follow's `beat`, set by the
    controller for its host count) passed without a frame, since any frame tells the
    controller this host lives. The first one comes at a random point of the first
    period, so that a thousand hosts that began together do not beat together."""

    def __init__(self, period: float) -> None:
        self.period = period
        spread = int.from_bytes(os.urandom(2), "big") / 65536.0   # random: no import
        self.last = time.monotonic() - spread * period

    def remaining(self) -> float:
        """Seconds until a beat is due if nothing is sent meanwhile."""
        return self.last + self.period - time.monotonic()

    def due(self, send: Send, sent: bool) -> None:
        """After each poll; `sent`: this poll sent frames already."""
        now = time.monotonic()
        if sent:
            self.last = now
        elif now - self.last >= self.period:
            send(protocol.event("beat", time=time.time()))
            self.last = now
