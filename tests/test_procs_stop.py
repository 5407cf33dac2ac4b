"""The agent's stop on real processes (agent/procs.py): the known tree is signalled before
any scan of every process's environment, one marker scan verifies, and what left the
tree (setsid, its parent gone) is still found and ended; another job's or another
part's processes are never touched."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import unnamed_in
from orchestrator.agent import paths, procs, supervisor
from orchestrator.agent.common import job_paths, read_json, write_atomic
from orchestrator.agent.launch import job_folders
from orchestrator.wire import timeouts

# two children that outlive their shell's SIGTERM only as long as sleep does
TREE = "sleep 60 & sleep 60 & wait; :"


def execed(pid: int, name: bytes, timeout: float = 10.0) -> None:
    """Wait until pid runs `name` with its environment in place: in the middle of an
    exec /proc/<pid>/environ reads empty (the new one is not set up yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            comm = Path(f"/proc/{pid}/comm").read_bytes().strip()
        except OSError:
            comm = b""
        if comm == name and procs.read_environ(pid):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never ran {name!r}")


def gone(pid: int, ticks: int | None, timeout: float = 10.0) -> bool:
    """pid has ended (or is a zombie, or another process now): by its start time."""
    deadline = time.monotonic() + timeout
    while procs.proc_start_time(pid) == ticks and time.monotonic() < deadline:
        time.sleep(0.02)
    return procs.proc_start_time(pid) != ticks


class Started:
    """Every process a test starts, ended by its pid (and start time) at the end."""

    def __init__(self) -> None:
        self.pids: dict[int, int] = {}   # what is not our child: pid -> start time
        self.popens: list[subprocess.Popen[bytes]] = []

    def popen(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE)
        self.popens.append(p)   # (ended by its Popen)
        return p

    def escapee(self, env: dict[str, str]) -> int:
        """A sleep that called setsid and whose parent has ended: init's child now."""
        sh = self.popen(["sh", "-c", "setsid sleep 60 & echo $!"], env)
        assert sh.stdout is not None
        pid = int(sh.stdout.readline())
        sh.wait()
        ticks = procs.proc_start_time(pid)
        assert ticks is not None
        self.pids[pid] = ticks
        execed(pid, b"sleep")   # setsid has started sleep
        return pid

    def adopt(self, pids: list[int]) -> None:
        """Processes the test's own children started (a stand-in supervisor's tree)."""
        for pid in pids:
            ticks = procs.proc_start_time(pid)
            if ticks is not None:
                self.pids.setdefault(pid, ticks)

    def end(self) -> None:
        for pid, ticks in self.pids.items():
            if procs.proc_start_time(pid) == ticks:
                os.kill(pid, signal.SIGKILL)
        for p in self.popens:
            p.kill()
            p.wait()
        left = [pid for pid, ticks in self.pids.items() if not gone(pid, ticks)]
        assert not left, [Path(f"/proc/{pid}/stat").read_text() for pid in left]


@pytest.fixture
def started() -> Iterator[Started]:
    s = Started()
    try:
        yield s
    finally:
        s.end()


def job(tmp_path: Path, name: str = "job") -> dict[str, Any]:
    (tmp_path / name / "run").mkdir(parents=True)
    return job_paths(str(tmp_path / name))


def supervise(p: dict[str, Any], started: Started) -> subprocess.Popen[bytes]:
    """A stand-in supervisor (unmarked, like the real one) with two marked children."""
    sup = started.popen(["sh", "-c", f"env ORCH_JOB_DIR=\"$J\" sh -c '{TREE}'; :"],
                        {"J": p["job"]})
    record = {"pid": sup.pid, "start_ticks": procs.proc_start_time(sup.pid),
              "torchrun_pid": None}
    write_atomic(p["jd"], "run/supervisor.json", json.dumps(record).encode())
    deadline = time.monotonic() + 10   # its tree is up: the shell, its two sleeps
    while len(procs.known_tree(p, procs.supervisor_alive(p))) < 4 and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    started.adopt(procs.known_tree(p, procs.supervisor_alive(p)))   # ended even if a stop fails
    return sup


def test_stop_signals_the_tree_first_and_scans_once(
        tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch) -> None:
    p = job(tmp_path)
    supervise(p, started)
    tree = procs.known_tree(p, procs.supervisor_alive(p))
    assert len(tree) == 4, tree   # the supervisor, the marked shell, its two sleeps
    log: list[str] = []
    real_scan, real_signal = procs.marked_pids, procs.signal_all

    def scan(job_dir: str) -> list[Any]:
        log.append("scan")
        return real_scan(job_dir)

    def signal_all(pids: Any, sig: int) -> None:
        pids = list(pids)
        log.extend("signal" for _ in pids)
        real_signal(pids, sig)
    monkeypatch.setattr(procs, "marked_pids", scan)
    monkeypatch.setattr(procs, "signal_all", signal_all)
    report = procs.stop(p["job"], 10.0)
    assert report["found"] == 4 and report["left"] == [], report
    assert log == ["signal"] * 4 + ["scan"], log   # the verify scan only, after the signals
    assert all(procs.proc_start_time(pid) is None for pid in tree)
    assert procs.stop_time(p) is not None


def test_what_left_the_tree_is_found_and_stopped(tmp_path: Path, started: Started) -> None:
    p = job(tmp_path)
    supervise(p, started)
    escapee = started.escapee({"ORCH_JOB_DIR": p["job"]})
    ticks = procs.proc_start_time(escapee)
    assert escapee not in procs.known_tree(p, procs.supervisor_alive(p))
    report = procs.stop(p["job"], 10.0)
    assert report["found"] == 5 and report["left"] == [], report
    assert gone(escapee, ticks, timeout=0)
    assert procs.marked_pids(p["job"]) == []


def test_an_orphan_alone_is_found_without_a_supervisor(tmp_path: Path,
                                                       started: Started) -> None:
    """A stop cut short left a rank that called setsid: no record leads to it."""
    p = job(tmp_path)
    escapee = started.escapee({"ORCH_JOB_DIR": p["job"]})
    ticks = procs.proc_start_time(escapee)
    report = procs.stop(p["job"], 10.0)
    assert report["found"] == 1 and report["left"] == [], report
    assert gone(escapee, ticks, timeout=0)
    assert procs.stop_time(p) is not None   # recorded before its signal


def test_another_jobs_and_another_parts_processes_are_left_alone(
        tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths, "HOST_PART", "h1")
    p = job(tmp_path)
    supervise(p, started)
    mine = started.escapee({"ORCH_JOB_DIR": p["job"], "ORCH_JOB_PART": "h1"})
    others = [started.escapee({"ORCH_JOB_DIR": p["job"] + "x"}),   # a prefix is another job
              started.escapee({"ORCH_JOB_DIR": p["job"], "ORCH_JOB_PART": "h2"})]
    ticks = {pid: procs.proc_start_time(pid) for pid in [mine] + others}
    report = procs.stop(p["job"], 10.0)
    assert report["left"] == [], report
    assert gone(mine, ticks[mine], timeout=0)
    assert all(procs.proc_start_time(pid) == ticks[pid] for pid in others)


def test_a_marker_past_the_first_read_is_found(tmp_path: Path, started: Started) -> None:
    """An environment larger than one read (HPC modules can make it so): read to its end."""
    p = job(tmp_path)
    big = {"FILLER": "x" * (3 * procs.ENVIRON_READ)}
    child = started.popen(["sleep", "60"], {**big, "ORCH_JOB_DIR": p["job"]})
    execed(child.pid, b"sleep")
    env = procs.read_environ(child.pid)
    assert len(env) > 3 * procs.ENVIRON_READ and env.endswith(b"\0ORCH_JOB_DIR=%s\0" % p["job"].encode())
    assert procs.marked_pids(p["job"]) == [child.pid]


def test_a_descendant_without_the_marker_is_still_the_jobs(tmp_path: Path,
                                                           started: Started) -> None:
    """A rank's child started with an environment of its own (no marker) is in the
    supervisor's tree: the stop ends it too."""
    p = job(tmp_path)
    sup = started.popen(["sh", "-c", "env -i sleep 60 & wait; :"], {})
    record = {"pid": sup.pid, "start_ticks": procs.proc_start_time(sup.pid)}
    write_atomic(p["jd"], "run/supervisor.json", json.dumps(record).encode())
    deadline = time.monotonic() + 10
    while len(procs.known_tree(p, procs.supervisor_alive(p))) < 2 and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    [unmarked] = [x for x in procs.known_tree(p, procs.supervisor_alive(p)) if x != sup.pid]
    started.adopt([unmarked])
    ticks = procs.proc_start_time(unmarked)
    report = procs.stop(p["job"], 10.0)
    assert report["found"] == 2 and report["left"] == [], report
    assert gone(unmarked, ticks, timeout=0)


def test_the_up_after_a_verified_stop_scans_nothing(
        tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop that ended verified is recorded for its launch: the next preflight's
    "already running" check needs no scan of every process, until a new launch."""
    p = job(tmp_path)
    write_atomic(p["jd"], "run/launch.json", b"{}")
    supervise(p, started)
    started.escapee({"ORCH_JOB_DIR": p["job"]})
    report = procs.stop(p["job"], 10.0)
    assert report["left"] == [] and procs.stopped_clean(p), report
    scans = no_scan(monkeypatch)
    assert not procs.job_running(p) and scans == []
    write_atomic(p["jd"], "run/launch.json", b"{}")   # a launch since: its processes
    orphan = started.escapee({"ORCH_JOB_DIR": p["job"]})   # (one that lost its records)
    assert not procs.stopped_clean(p)
    assert procs.job_running(p) and scans == [p["job"]]
    assert procs.stop(p["job"], 10.0)["left"] == []
    assert procs.proc_start_time(orphan) is None


def test_a_stop_cut_short_is_no_verified_stop(tmp_path: Path, started: Started) -> None:
    """The stop record written before the signals says nothing of what was left."""
    p = job(tmp_path)
    write_atomic(p["jd"], "run/launch.json", b"{}")
    orphan = started.escapee({"ORCH_JOB_DIR": p["job"]})
    procs.mark_stop(p, time.time())   # a stop killed right after its record
    assert not procs.stopped_clean(p)
    assert procs.job_running(p)
    procs.signal_all([orphan], signal.SIGKILL)


# ------------------------------------------------- a real supervisor: a child subreaper

# torchrun's stand-in: a daemon that called setsid, its parent (a subshell) gone at once,
# then a rank that lives (`exec sleep`) or ends with a code
DAEMON = '(setsid {daemon} & echo $! > "$D"); '
READY = 'until [ -e "$D.ready" ]; do sleep 0.02; done; '   # its traps are set: torchrun may end


def run_supervised(p: dict[str, Any], started: Started, script: str,
                   daemon: str = "sleep 60") -> tuple[dict[str, Any], int]:
    """A real supervisor (agent/supervisor.py, double-forked from this process, a
    subreaper) whose torchrun is `sh -c DAEMON + script` with the job's marker; its
    record and the daemon's pid, once the daemon runs."""
    job_folders(p["jd"])
    write_atomic(p["jd"], "run/launch.json", b"{}")
    pidfile = Path(p["job"]) / "daemon.pid"
    env = {"ORCH_JOB_DIR": p["job"], "D": str(pidfile)}
    argv = ["sh", "-c", DAEMON.format(daemon=daemon) + script]

    def body(p: dict[str, Any], spec: dict[str, Any], wfd: int) -> None:
        def start() -> tuple[int, Any]:
            pid = supervisor.spawn(argv, {**os.environ, **env})
            return pid, lambda: supervisor.wait_for(pid)
        supervisor.run_supervisor(p, spec, wfd, "supervisor", "run/torchrun.log", start)
    sup = supervisor.start_detached(body, p, {"run_id": "r1"}, "supervisor")["supervisor"]
    started.adopt([sup["pid"], sup["torchrun_pid"]])
    text = wait_for_text(pidfile)
    daemon_pid = int(text)
    started.adopt([daemon_pid])
    return sup, daemon_pid


def wait_for_text(path: Path, timeout: float = 10.0, whole: bool = True) -> str:
    """path's text once it is there (and `whole`: ends with a newline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            text = path.read_text()
            if text.endswith("\n") or not whole:
                return text
        time.sleep(0.02)
    raise AssertionError(f"{path} never written")


def no_scan(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every marker scan from now on, logged."""
    scans: list[str] = []
    real = procs.marked_pids

    def scan(job_dir: str) -> list[Any]:
        scans.append(job_dir)
        return real(job_dir)
    monkeypatch.setattr(procs, "marked_pids", scan)
    return scans


def parent(pid: int) -> int:
    fields = procs.stat_fields(pid)
    assert fields is not None, f"{pid} is gone"
    return int(fields[1])


def adopted(pid: int, reaper: int, timeout: float = 10.0) -> None:
    """pid's parent becomes the subreaper (once the subshell that started it ended)."""
    deadline = time.monotonic() + timeout
    while parent(pid) != reaper and time.monotonic() < deadline:
        time.sleep(0.02)
    assert parent(pid) == reaper, (pid, parent(pid), reaper)


def test_a_daemon_is_found_through_the_subreaper_without_a_scan(
        tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's setsid'd double-forked daemon is reparented to the supervisor, not to
    init: the stop finds and ends it in the supervisor's tree, reads no process's
    environment, and is verified by the supervisor's own last word (reaped)."""
    p = job(tmp_path)
    sup, daemon = run_supervised(p, started, "exec sleep 60")
    assert sup["subreaper"] is True
    execed(daemon, b"sleep")
    adopted(daemon, sup["pid"])
    session = [procs.stat_fields(x) or ["?"] * 4 for x in (daemon, sup["pid"])]
    assert session[0][3] != session[1][3]   # it called setsid
    ticks = {x: procs.proc_start_time(x) for x in (sup["pid"], sup["torchrun_pid"], daemon)}
    scans = no_scan(monkeypatch)
    report = procs.stop(p["job"], 10.0)
    assert report["left"] == [] and report["found"] == 3 and report["killed"] == 0, report
    assert scans == [], scans
    assert all(gone(x, t, timeout=0) for x, t in ticks.items())
    done = read_json(p["jd"], "run/host.exit")
    assert done["reaped"] is True and done["pid"] == sup["pid"], done
    # the supervisor's word is the proof: the stop writes no second record of it
    assert procs.reaped(p) and not procs.stopped_clean(p)
    assert not procs.job_running(p) and scans == []
    again = procs.stop(p["job"], 10.0)   # idempotent, and still no scan
    assert again["found"] == 0 and again["left"] == [] and scans == [], again


def test_the_job_ends_with_its_ranks_then_what_they_left_is_stopped(
        tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun ended by itself (code 3), leaving a daemon: the host's end is recorded at
    once; the supervisor then gives the daemon SIGTERM, reaps it once it ended, and says
    that nothing is left. The next `up`'s check needs no scan."""
    monkeypatch.setattr(timeouts, "LEFTOVER_GRACE", 120.0)   # (the forked supervisor's too)
    p = job(tmp_path)
    mark = Path(p["job"]) / "daemon"
    # the daemon notes its SIGTERM, then waits for this test's word to end
    sup, daemon = run_supervised(p, started, READY + "exit 3", daemon=(
        "sh -c 'trap \"touch $D.term\" TERM; touch $D.ready; "
        "while [ ! -e $D.go ]; do sleep 0.05; done'"))
    ticks = procs.proc_start_time(daemon)
    wait_for_text(mark.with_suffix(".pid.term"), timeout=15, whole=False)
    first = read_json(p["jd"], "run/host.exit")
    assert first["code"] == 3 and "reaped" not in first, first
    assert procs.proc_start_time(daemon) == ticks   # the job ended; its leftover not yet
    assert procs.job_running(p)   # (its supervisor lives: no second copy beside it)
    mark.with_suffix(".pid.go").touch()
    last = wait_for_json(p, lambda d: d.get("reaped") is True)
    assert last["code"] == 3 and last["time"] == first["time"], last
    assert gone(daemon, ticks) and gone(sup["pid"], sup["start_ticks"])
    scans = no_scan(monkeypatch)
    assert not procs.job_running(p) and scans == []


def test_during_a_stop_the_host_end_is_said_once_when_the_tree_is_empty(
        tmp_path: Path, started: Started) -> None:
    """A stop SIGKILLs torchrun while the ranks' SIGTERM handlers still run: the stopping
    agent waits for the supervisor's last word, so the host's end is written once, with
    `reaped` (no first record at torchrun's end: on 1,000 hosts stopping at once, a
    second file made and a follow woken on each is seconds of the shared cores)."""
    p = job(tmp_path)
    sup, daemon = run_supervised(p, started, "exec sleep 60", daemon=(
        "sh -c 'trap \"sleep 0.8; exit 0\" TERM; touch $D.ready; "
        "while true; do sleep 0.05; done'"))
    wait_for_text(Path(p["job"]) / "daemon.pid.ready", whole=False)
    ticks = procs.proc_start_time(daemon)
    seen: list[Any] = []
    report: dict[str, Any] = {}
    stopper = threading.Thread(target=lambda: report.update(procs.stop(p["job"], 10.0)))
    stopper.start()
    while stopper.is_alive():
        seen.append(read_json(p["jd"], "run/host.exit"))
        time.sleep(0.01)
    stopper.join()
    assert report["left"] == [] and report["found"] >= 3, report
    ends = [x for x in seen if x is not None]
    assert all(x.get("reaped") is True for x in ends), ends
    done = read_json(p["jd"], "run/host.exit")
    assert done["reaped"] is True and done["code"] == -signal.SIGKILL, done
    assert gone(daemon, ticks, timeout=0) and gone(sup["pid"], sup["start_ticks"], timeout=0)


def test_a_stop_sigkill_cannot_finish_says_the_host_end_once_without_reaped(
        tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch) -> None:
    """Even SIGKILL leaves the supervisor's tree non-empty (a process stuck in the kernel,
    stood in for by one its look keeps finding): the host's end is written once, after
    the stop's SIGKILL and its wait, without `reaped`, and the supervisor still ends."""
    monkeypatch.setattr(timeouts, "STOP_VERIFY", 0.3)   # (the forked supervisor's too)
    monkeypatch.setattr(timeouts, "STOP_WORD_MARGIN", 1.5)   # (a loaded machine)
    stuck = started.escapee({})   # not the job's: only the supervisor's look names it
    monkeypatch.setattr(supervisor, "left_behind", lambda: [stuck])
    p = job(tmp_path)
    sup, _ = run_supervised(p, started, "exec sleep 60")
    inodes: set[int] = set()
    stopper = threading.Thread(target=procs.stop, args=(p["job"], 0.2))
    stopper.start()
    end = Path(p["job"]) / "run" / "host.exit"
    while stopper.is_alive() or not gone(sup["pid"], sup["start_ticks"], timeout=0):
        with contextlib.suppress(OSError):
            inodes.add(os.stat(end).st_ino)
        time.sleep(0.01)
    stopper.join()
    with contextlib.suppress(OSError):   # (written within the last sleep)
        inodes.add(os.stat(end).st_ino)
    done = read_json(p["jd"], "run/host.exit")
    assert done is not None, "the supervisor was ended before its last word"
    assert "reaped" not in done and done["code"] == -signal.SIGKILL, done
    assert len(inodes) == 1, inodes   # said once: not also at torchrun's end
    assert gone(stuck, started.pids[stuck], timeout=0)   # it did get the SIGKILL


def test_a_leftover_that_ignores_sigterm_gets_sigkill(
        tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeouts, "LEFTOVER_GRACE", 0.3)   # (the forked supervisor's too)
    p = job(tmp_path)
    sup, daemon = run_supervised(p, started, READY + "exit 0",
                                 daemon="sh -c 'trap \"\" TERM; touch $D.ready; exec sleep 60'")
    ticks = procs.proc_start_time(daemon)
    done = wait_for_json(p, lambda d: d.get("reaped") is True)
    assert done["code"] == 0 and gone(daemon, ticks) and gone(sup["pid"], sup["start_ticks"])


def wait_for_json(p: dict[str, Any], ok: Any, timeout: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = read_json(p["jd"], "run/host.exit")
        if isinstance(got, dict) and ok(got):
            return got
        time.sleep(0.02)
    raise AssertionError(f"run/host.exit never came as expected: {got!r}")


def test_without_its_supervisor_the_marker_scan_finds_the_daemon(
        tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor was killed (the OOM killer): its tree went to init, and nothing
    says that it was left empty. The stop falls back to the marker scan and ends it."""
    p = job(tmp_path)
    sup, daemon = run_supervised(p, started, "exec sleep 60")
    execed(daemon, b"sleep")
    adopted(daemon, sup["pid"])   # (the subshell between them has ended)
    os.kill(sup["pid"], signal.SIGKILL)
    assert gone(sup["pid"], sup["start_ticks"])
    ticks = procs.proc_start_time(daemon)
    scans = no_scan(monkeypatch)
    assert procs.job_running(p) and scans == [p["job"]]   # an `up` would scan, and refuse
    report = procs.stop(p["job"], 10.0)
    assert report["left"] == [] and report["found"] == 2, report   # the daemon, the rank
    assert len(scans) >= 2 and gone(daemon, ticks, timeout=0)


def test_a_supervisor_killed_during_the_stop_hands_over_to_the_scan(
        tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor dies as the stop begins: it cannot say its tree was left empty, so
    the stop goes on from what it knew with the marker scan, and still ends the daemon
    (which ignores SIGTERM: it gets SIGKILL at the grace)."""
    p = job(tmp_path)
    sup, daemon = run_supervised(p, started, "exec sleep 60",
                                 daemon="sh -c 'trap \"\" TERM; exec sleep 60'")
    execed(daemon, b"sleep")
    ticks = procs.proc_start_time(daemon)
    real_mark = procs.mark_stop

    def mark_and_kill(q: dict[str, Any], when: float, grace: float | None = None) -> None:
        real_mark(q, when, grace)
        os.kill(sup["pid"], signal.SIGKILL)
    monkeypatch.setattr(procs, "mark_stop", mark_and_kill)
    scans = no_scan(monkeypatch)
    report = procs.stop(p["job"], 1.0)
    assert report["left"] == [] and report["killed"] >= 1, report
    assert scans and gone(daemon, ticks, timeout=0)


def test_the_jobs_processes_for_a_network_look_are_the_subreapers_tree(
        tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch) -> None:
    """net_waits (agent/network.py) asks for the job's processes on every look: the
    supervisor's tree, the daemon in it, without reading any environment; the marker's
    without a subreaper."""
    p = job(tmp_path)
    sup, daemon = run_supervised(p, started, "exec sleep 60")
    adopted(daemon, sup["pid"])
    scans = no_scan(monkeypatch)
    assert procs.job_pids(p, sup) == sorted([sup["torchrun_pid"], daemon]) and scans == []
    assert sorted(procs.job_pids(p, dict(sup, subreaper=False))) == \
        sorted([sup["torchrun_pid"], daemon]) and scans == [p["job"]]
    assert procs.stop(p["job"], 10.0)["left"] == []


@pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="no O_TMPFILE here")
def test_the_supervisor_writes_the_host_end_of_a_stop_into_its_spare(
        tmp_path: Path, started: Started) -> None:
    """The supervisor made run/host.exit's inode once the launch was answered
    (agent/spares.py): the stop's host end is that inode, not a new one."""
    p = job(tmp_path)
    sup, _ = run_supervised(p, started, "exec sleep 60")
    run = str(Path(p["job"]) / "run")
    held = unnamed_in(sup["pid"], Path(run))
    assert len(held) == 1, held   # unnamed (O_TMPFILE): "run/#<inode> (deleted)"
    report = procs.stop(p["job"], 10.0)
    assert report["left"] == [] and report["found"] >= 2, report
    done = Path(run) / "host.exit"
    assert read_json(p["jd"], "run/host.exit")["reaped"] is True
    assert os.stat(done).st_ino in held
    assert not [n for n in os.listdir(run) if paths.PART in n]
