"""The follow's quiet waits (agent/follow.Quiet, agent/notify.py): with inotify an idle
follow sleeps until a rank writes, a record lands or a beat is due, instead of polling
its logs five times a second; a line and an exit still come at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from orchestrator.agent import follow, notify
from orchestrator.agent.common import job_paths, write_atomic
from orchestrator.agent.procs import proc_start_time
from orchestrator.wire import protocol

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify")


def job(tmp_path: Path) -> Path:
    root = tmp_path / "job"
    for sub in ("run", "logs"):
        (root / sub).mkdir(parents=True)
    return root


def test_a_watch_names_the_folder_and_file_that_changed(tmp_path: Path) -> None:
    root = job(tmp_path)
    fds = [os.open(root / "run", os.O_RDONLY), os.open(root / "logs", os.O_RDONLY)]
    w = notify.watch(fds)
    for fd in fds:
        os.close(fd)                                  # the watch outlives the descriptors
    if w is None:
        pytest.skip("no inotify here (max_user_instances spent?)")
    try:
        assert notify.wait([w.fd], 0.05) == []        # nothing changed: no wake
        (root / "logs" / "rank-0.log").write_bytes(b"a line\n")
        assert notify.wait([w.fd], 5) == [w.fd]
        assert w.drain() == ({follow.LOGS}, {"rank-0.log"})
        write_atomic(job_paths(str(root))["jd"], "run/rank-0.exit", b"{}")
        assert notify.wait([w.fd], 5) == [w.fd]
        folders, names = w.drain()
        assert folders == {follow.RUN} and "rank-0.exit" in names
        assert w.drain() == (set(), set())            # drained: nothing more
    finally:
        w.close()


def test_a_watch_is_none_without_inotify(monkeypatch, tmp_path: Path) -> None:
    """No inotify (here: libc has no such function): None, and the follow polls as
    before. The same folder is watched once libc has it."""
    from orchestrator.agent import libc

    def missing(name: str) -> Any:
        raise OSError(f"{name}: no such function")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with monkeypatch.context() as m:
            m.setattr(libc, "function", missing)
            assert notify.watch([fd]) is None
        got = notify.watch([fd])
        assert got is not None
        got.close()
    finally:
        os.close(fd)


def test_a_watch_and_a_subreaper_import_no_ctypes_package(tmp_path: Path) -> None:
    """libc is called through _ctypes: ctypes' package is 5 ms of CPU at each import, on
    every host at every follow's start (and every launch's supervisor)."""
    code = ("import os, sys\n"
            "from orchestrator.agent import notify, supervisor\n"
            f"fd = os.open({str(tmp_path)!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
            "assert notify.watch([fd]) is not None\n"
            "assert supervisor.become_subreaper()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ctypes'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


class Sent:
    """The frames a follow sends, and when."""

    def __init__(self) -> None:
        self.frames: list[tuple[float, bytes]] = []

    def send(self, frame: bytes) -> None:
        self.frames.append((time.monotonic(), frame))

    def first(self, test: Any, timeout: float = 10) -> float:
        """When the first frame passing `test` came (waits for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, frame in list(self.frames):
                if test(frame):
                    return at
            time.sleep(0.01)
        raise AssertionError(f"no such frame in {len(self.frames)}")


def event(frame: bytes) -> dict[str, Any]:
    kind, size = frame[:1], int.from_bytes(frame[1:5], "big")
    return json.loads(frame[5:5 + size]) if kind == b"J" else {"t": "output"}


def test_an_idle_follow_sleeps_and_a_line_and_exit_still_come_at_once(
        tmp_path: Path, monkeypatch) -> None:
    """A follow of a quiet rank makes a handful of passes in 2 s (the 200 ms poll made
    ten, the 50 ms one forty), yet a line written then is sent within 0.5 s, and the
    rank's exit and the host's end end the follow at once."""
    root = job(tmp_path)
    log = root / "logs" / "rank-0.log"
    log.write_bytes(b"")
    jd = job_paths(str(root))["jd"]
    probe = follow.watch_job(jd, jd.open_dir("run"))
    if probe is None:
        pytest.skip("no inotify here (max_user_instances spent?)")
    probe.close()
    jd = job_paths(str(root))["jd"]
    sup = subprocess.Popen(["sleep", "60"])   # the job's supervisor, alive
    write_atomic(jd, "run/supervisor.json", json.dumps(
        {"pid": sup.pid, "start_ticks": proc_start_time(sup.pid)}).encode())
    try:
        follow_quietly(root, log, jd, monkeypatch)
    finally:
        sup.kill()
        sup.wait()


def follow_quietly(root: Path, log: Path, jd: Any, monkeypatch) -> None:
    passes = [0]
    emit = follow.emit

    def counted(send: Any, lg: Any, final: bool = False) -> int:
        passes[0] += 1
        return emit(send, lg, final)

    monkeypatch.setattr(follow, "emit", counted)
    sent = Sent()
    req = types.SimpleNamespace(out=types.SimpleNamespace(send=sent.send), args={
        "mode": "events", "job_dir": str(root), "ranks": [0], "tail": 0, "beat": 30.0})
    th = threading.Thread(target=follow.run, args=(req,), daemon=True)
    th.start()
    time.sleep(2.0)
    assert passes[0] <= 6, passes[0]
    with log.open("ab") as f:
        wrote = time.monotonic()
        f.write(b"hello\n")
    line = sent.first(lambda fr: fr[:1] == protocol.OUTPUT)
    assert line - wrote < 0.5
    write_atomic(jd, "run/rank-0.exit", json.dumps({"code": 0, "time": time.time()}).encode())
    write_atomic(jd, "run/host.exit", json.dumps({"code": 0, "time": time.time()}).encode())
    ended = time.monotonic()
    done = sent.first(lambda fr: fr[:1] == b"J" and event(fr).get("t") == "done")
    assert done - ended < 1.0
    th.join(5)
    assert not th.is_alive()
    kinds = [event(fr).get("t") for _, fr in sent.frames]
    assert kinds.count("exit") == 1 and kinds[-1] == "done"


def test_a_stopped_hosts_follow_reads_the_stop_and_the_host_end_once(
        tmp_path: Path, monkeypatch) -> None:
    """Two ranks end after this host's stop, then the host: both exits and the host's end
    are tagged after_stop from one read of run/stop.json, and the host's end is read once
    it is there (the pass that finds it hands it to the `done`). 1,000 hosts stopping at
    once each read these on the same cores."""
    root = job(tmp_path)
    for r in (0, 1):
        (root / "logs" / f"rank-{r}.log").write_bytes(b"")
    jd = job_paths(str(root))["jd"]
    sup = subprocess.Popen(["sleep", "60"])   # the job's supervisor, alive
    write_atomic(jd, "run/supervisor.json", json.dumps(
        {"pid": sup.pid, "start_ticks": proc_start_time(sup.pid)}).encode())
    try:
        follow_a_stop(root, jd, monkeypatch)
    finally:
        sup.kill()
        sup.wait()


def inotify_fds() -> int:
    out = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            out += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
        except OSError:
            pass
    return out


def waiting(before: int, timeout: float = 10) -> None:
    """Until a follow started now made its inotify watch (then it takes the supervisor's
    pidfd and sleeps)."""
    deadline = time.monotonic() + timeout
    while inotify_fds() <= before and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)


def follow_a_stop(root: Path, jd: Any, monkeypatch) -> None:
    from orchestrator.agent import procs
    reads: dict[str, int] = {}

    def counting(module: Any) -> None:
        real = module.read_json

        def read(d: Any, rel: str) -> Any:
            got = real(d, rel)
            if got is not None:
                reads[rel] = reads.get(rel, 0) + 1
            return got
        monkeypatch.setattr(module, "read_json", read)
    counting(follow)
    counting(procs)
    sent = Sent()
    req = types.SimpleNamespace(out=types.SimpleNamespace(send=sent.send), args={
        "mode": "events", "job_dir": str(root), "ranks": [0, 1], "tail": 0, "beat": 30.0})
    th = threading.Thread(target=follow.run, args=(req,), daemon=True)
    stopped = time.time()
    write_atomic(jd, procs.STOP_FILE, json.dumps({"time": stopped}).encode())
    base = inotify_fds()
    th.start()
    waiting(base)   # the follow waits: its watch made, the supervisor's pidfd held
    before = reads.get("run/supervisor.json", 0)
    for r in (0, 1):
        write_atomic(jd, f"run/rank-{r}.exit",
                     json.dumps({"code": -15, "time": stopped + 0.1}).encode())
        time.sleep(0.3)
    write_atomic(jd, "run/host.exit", json.dumps({"code": -9, "time": stopped + 0.2}).encode())
    sent.first(lambda fr: fr[:1] == b"J" and event(fr).get("t") == "done")
    th.join(5)
    assert not th.is_alive()
    got = [event(fr) for _, fr in sent.frames if fr[:1] == b"J" and event(fr)["t"] != "beat"]
    assert [e["t"] for e in got] == ["exit", "exit", "done"], got   # (a beat may come first)
    assert all(e.get("after_stop") is True for e in got), got
    assert reads[procs.STOP_FILE] == 1 and reads["run/host.exit"] == 1, reads
    assert reads.get("run/supervisor.json", 0) == before, reads   # its pidfd says it lives
