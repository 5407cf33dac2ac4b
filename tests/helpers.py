"""Helpers shared by the test modules (and defined nowhere else): running orch as a user
does, following a command in the background, finding a job's processes on the fake
hosts and proving none is left, polling, and small file-tree readers.

The fixtures' machinery stays where it is (sshd_cluster.py, netns_cluster.py,
fault_servers.py, fake_agent.py); the fixtures themselves are in conftest.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Callable, Protocol

from sshd_cluster import descendants_of, pid_alive, pids_with_env

ORCH = [sys.executable, "-m", "orchestrator"]
PREFIXED = re.compile(r"^\[r(\d+) (\S+)\] (.*)$")
# What torchrun gives each rank: a test of one plain process removes them.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "ORCH_DATA_DIR", "ORCH_OUTPUT_DIR", "OMP_NUM_THREADS")


class JobHost(Protocol):
    """A host a job runs on: a fake sshd host or a hidden one behind a bastion."""

    @property
    def address(self) -> str: ...

    @property
    def remote_dir(self) -> Path: ...


# ---------------------------------------------------------------- running orch

def orch(cwd: Path, *args: str, timeout: float = 120, env: dict | None = None,
         command: Sequence[str] = ORCH, run: Callable[..., Any] = subprocess.run
         ) -> subprocess.CompletedProcess:
    """One orch command to its end, as a user runs it (a new process, cwd = inventory
    folder, no stdin). `command` replaces `python -m orchestrator` (a console script, a
    wrapper in front); `run` replaces subprocess.run (a network namespace's runner)."""
    return run([*command, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
               env=env if env is not None else dict(os.environ), stdin=subprocess.DEVNULL)


def orch_in_process(cwd: Path, *args: str, env: dict | None = None
                    ) -> subprocess.CompletedProcess:
    """The same command as orch(), run by orch's own `cli()` in this process: what a
    user sees (exit code, stdout, stderr) without the 0.3 s of CPU a new interpreter and
    its imports cost. For what is decided before any host is contacted; a test of the
    process itself (its imports, signals, entry points) starts one with orch(). An
    exception that escapes cli() fails the test, as a traceback on stderr would. What cli()
    changes in the process (cwd, environment, signal handlers, the `orchestrator`
    logger's handlers) is put back, and every process it started (a local host's agent)
    must be gone once it returns."""
    from orchestrator.cli import cli
    # streams with bytes below, as a process's: `orch logs` writes the rank's bytes there
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace",
                           write_through=True)
    signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    log = logging.getLogger("orchestrator")
    handlers, saved_env, here = list(log.handlers), dict(os.environ), os.getcwd()
    before = set(descendants_of(os.getpid()))
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli(list(args))
            except SystemExit as e:   # argparse: --help, --version, a usage error
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved_env)
        log.handlers[:] = handlers
        for sig, handler in signals.items():
            signal.signal(sig, handler)
    left = wait_until_gone(set(descendants_of(os.getpid())) - before, 10)
    kill_all({"here": left})
    assert not left, f"orch {' '.join(args)} left processes: {left}"
    return subprocess.CompletedProcess(["orch", *args], code, _as_text(out), _as_text(err))


def wait_until_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Those of pids still alive after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _as_text(stream: io.TextIOWrapper) -> str:
    """What subprocess.run(text=True) makes of a stream's bytes (universal newlines)."""
    stream.flush()
    data = stream.buffer.getvalue()  # type: ignore[attr-defined]
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read()


class Running:
    """An orch command in the background; its stdout and stderr lines are collected as
    they come, so a test can wait for a line, signal the process, then collect the rest."""

    def __init__(self, cwd: Path, *args: str) -> None:
        self.proc = subprocess.Popen(ORCH + list(args), cwd=cwd, env=dict(os.environ),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, l), daemon=True)
                         for s, l in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for th in self._readers:
            th.start()

    @staticmethod
    def _read(stream: IO[bytes], into: list[str]) -> None:
        for raw in iter(stream.readline, b""):
            into.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def text(self) -> str:
        return "--- stdout:\n" + "\n".join(self.out[-50:]) + "\n--- stderr:\n" + "\n".join(self.err)

    def wait_for(self, pattern: str, count: int = 1, timeout: float = 90) -> list[str]:
        """Wait until `count` stdout lines match `pattern`; fail if orch ends first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in list(self.out) if regex.search(line)]
            if len(found) >= count:
                return found
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the readers take the last lines
                found = [line for line in list(self.out) if regex.search(line)]
                if len(found) >= count:
                    return found
                raise AssertionError(f"orch ended ({self.proc.returncode}) before {count} lines "
                                     f"matched {pattern!r}\n{self.text()}")
            time.sleep(0.05)
        raise AssertionError(f"no {count} lines matched {pattern!r} in {timeout} s\n{self.text()}")

    def finish(self, timeout: float = 60) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"orch still running after {timeout} s\n{self.text()}") from None
        for th in self._readers:
            th.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def prefixed(lines: Sequence[str]) -> list[tuple[int, str, str]]:
    """(rank, host label, text) of every `[r<rank> <host>] text` line; others fail."""
    parsed = []
    for line in lines:
        m = PREFIXED.match(line)
        assert m, f"stdout line without a rank prefix: {line!r}"
        parsed.append((int(m[1]), m[2], m[3]))
    return parsed


# ---------------------------------------------------------------- a job's processes

def job_dir(host: JobHost, name: str) -> Path:
    """The job's folder on the host (the fake hosts share this machine's file system)."""
    return host.remote_dir / name


def part_dir(host: JobHost, name: str) -> Path:
    """The host's part of the job folder, run/host-<label>/: its records (the fake hosts'
    labels are their addresses)."""
    from orchestrator.config.inventory import host_part
    return job_dir(host, name) / "run" / host_part(host.address)


def marker(host: JobHost, name: str) -> str:
    """What every process of the job carries in its environment."""
    return f"ORCH_JOB_DIR={job_dir(host, name)}"


def job_pids(hosts: Sequence[JobHost], name: str) -> dict[str, list[int]]:
    """Live processes of the job, per host; empty lists when nothing is left. A warm
    torchrun too (found by argv: its marker is set in memory at the go)."""
    found = job_processes([job_dir(h, name) for h in hosts])
    return {h.address: found[str(job_dir(h, name))] for h in hosts}


def job_processes(job_dirs: Iterable[Path | str]) -> dict[str, list[int]]:
    """Live processes of each job folder: those carrying its marker, and a warm torchrun
    waiting for its go (found by argv). One pass over /proc for every folder, where a pass
    per folder made a 16-host check seconds long on a busy machine."""
    dirs = [str(d) for d in job_dirs]
    markers = {f"ORCH_JOB_DIR={d}".encode(): d for d in dirs}
    warm = {d.encode(): d for d in dirs}
    found: dict[str, list[int]] = {d: [] for d in dirs}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        hit = _job_of(pid, markers, warm)
        if hit is not None and pid_alive(pid):
            found[hit].append(pid)
    return found


def _job_of(pid: int, markers: dict[bytes, str], warm: dict[bytes, str]) -> str | None:
    """The job folder whose marker pid's environment holds, or whose warm torchrun it is."""
    hit = next((markers[e] for e in _proc_list(pid, "environ") if e in markers), None)
    argv = _proc_list(pid, "cmdline") if hit is None else []
    if argv[-3:-2] == [b"orch-warm-torchrun"]:
        hit = warm.get(argv[-2])
    return hit


def _proc_list(pid: int, name: str) -> list[bytes]:
    """/proc/<pid>/<name> split at its NULs; [] when pid vanished or is not ours to read."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().split(b"\0")
    except OSError:
        return []


def rank_pids(hosts: Sequence[JobHost], name: str) -> dict[str, list[int]]:
    """Live processes carrying the job's marker (ranks and their children): what runs
    once a launch happened; a warm torchrun waiting for its go has no marker."""
    return {h.address: pids_with_env(marker(h, name)) for h in hosts}


def stray_pids(job_dirs: Iterable[Path | str], wait: float = 0.0) -> dict[str, list[int]]:
    """Live processes carrying each job folder's marker, by folder; polled for up to `wait`
    seconds until none is left (a finished job's supervisor may take a moment)."""
    dirs = [str(d) for d in job_dirs]

    def left() -> dict[str, list[int]]:
        return {d: p for d, p in job_processes(dirs).items() if p}
    deadline = time.monotonic() + wait
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    return left()


def assert_no_job_left(job_dirs: Iterable[Path | str], wait: float = 10.0,
                       kill: bool = True) -> None:
    """No process carries the markers of job_dirs (after up to `wait` s). With `kill`,
    leftovers are SIGKILLed so that later tests are not disturbed; the test fails."""
    stray = stray_pids(job_dirs, wait)
    if kill:
        kill_all(stray)
    assert not stray, f"processes of the job are left: {stray}"


def assert_nothing_left(hosts: Sequence[JobHost], name: str, wait: float = 0.0,
                        kill: bool = False) -> None:
    """No process of job `name` on any of hosts. Without `kill`, the `jobs` fixture's
    teardown stops what is left (`orch stop`, then SIGKILL)."""
    assert_no_job_left([job_dir(h, name) for h in hosts], wait=wait, kill=kill)


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def argv_pids(match: Callable[[list[bytes]], bool]) -> list[int]:
    """Live pids whose command line (split at its NULs) `match` accepts."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if match(argv) and pid_alive(pid):
            found.append(pid)
    return found


def warm_pids(job_dir: Path | str) -> list[int]:
    """A warm-started torchrun of this job folder (agent/warm.py): before its go it has no
    marker, so `argv` (orch-warm-torchrun <job dir>) is how it is found."""
    want = [b"orch-warm-torchrun", str(job_dir).encode()]
    return argv_pids(lambda argv: argv[-3:-1] == want)


def agents_of(job_dirs: Iterable[Path | str]) -> list[int]:
    """Live orch agents serving any of these job folders (their argv names the folder)."""
    dirs = {str(d).encode() for d in job_dirs}
    return argv_pids(lambda argv: b"orch-agent" in argv and bool(dirs & set(argv)))


def kill_all(pids_by_host: dict) -> None:
    """SIGKILL every pid of {host: [pids]} (a test's own leftovers, after it failed)."""
    for pids in pids_by_host.values():
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class Jobs:
    """Teardown for every test that starts a job (the `jobs` fixture): if anything of it
    is still alive, `orch stop` it (then SIGKILL what even that left, so later tests are
    not disturbed), and fail. Background orch processes are killed too."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Path, Sequence[JobHost], str]] = []
        self.running: list[Running] = []

    def add(self, inventory: Path, hosts: Sequence[JobHost], name: str) -> None:
        self.jobs.append((inventory, hosts, name))

    def start(self, cwd: Path, *args: str) -> Running:
        run = Running(cwd, *args)
        self.running.append(run)
        return run

    def cleanup(self) -> list[str]:
        for run in self.running:
            run.kill()
        problems = []
        for inventory, hosts, name in self.jobs:
            if not any(job_pids(hosts, name).values()):
                continue
            stop = orch(inventory.parent, "stop", str(inventory), "--grace", "1")
            left = {a: p for a, p in job_pids(hosts, name).items() if p}
            problems.append(f"job {name} was still running at teardown (orch stop: "
                            f"{stop.returncode}; still left after it: {left})")
            kill_all(left)
        return problems


# ---------------------------------------------------------------- sshd sessions

def session_counts(hosts: Sequence[Any]) -> dict[str, int]:
    return {h.address: h.sessions() for h in hosts}


def sessions_of(hosts: Sequence[Any], command: Callable[[], object]) -> dict[str, int]:
    """Exec sessions each host's sshd started while `command()` ran (sshd logs each at
    LogLevel VERBOSE; the log is written before the session runs)."""
    before = session_counts(hosts)
    command()
    after = session_counts(hosts)
    return {a: after[a] - before[a] for a in after}


# ---------------------------------------------------------------- waiting, files

def wait_until(predicate: Callable[[], object], timeout: float, what: str,
               step: float = 0.05) -> object:
    """Poll until predicate() is truthy; its value, or AssertionError after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class FakeClock:
    """A stand-in for `timeouts.CLOCK` (monkeypatched in): its time moves only when a test
    calls `advance`, and a watchdog's wait between checks returns when the fake time
    reaches its end (or its event is set). `checks` counts the waits begun: a test that
    advances and then waits for `checks` to grow knows the watchdog has looked."""

    def __init__(self, start: float | None = None) -> None:
        # the real clock's reading by default: a Link's last_seen stamps stay comparable
        self.t = time.monotonic() if start is None else start
        self.cond = threading.Condition()
        self.checks = 0

    def now(self) -> float:
        with self.cond:
            return self.t

    def wait(self, event: threading.Event, seconds: float) -> bool:
        with self.cond:
            self.checks += 1
            self.cond.notify_all()
            end = self.t + seconds
            real_end = time.monotonic() + 60   # never hang a test that forgot to advance
            while not event.is_set() and self.t < end and time.monotonic() < real_end:
                self.cond.wait(0.01)   # an event set from outside is seen within 10 ms
            return event.is_set()

    def advance(self, seconds: float) -> None:
        with self.cond:
            self.t += seconds
            self.cond.notify_all()

    def step(self, seconds: float, alive: Callable[[], bool] = lambda: True,
             timeout: float = 30) -> None:
        """Advance, then wait until the watchdog has checked at the new time (it waits
        again) or has ended (`alive()` false)."""
        with self.cond:
            seen = self.checks
            self.t += seconds
            self.cond.notify_all()
            deadline = time.monotonic() + timeout
            while self.checks == seen and alive() and time.monotonic() < deadline:
                self.cond.wait(0.01)
            assert self.checks > seen or not alive(), "the watchdog did not check again"

    def wait_for_checks(self, count: int, timeout: float = 30) -> None:
        with self.cond:
            deadline = time.monotonic() + timeout
            while self.checks < count and time.monotonic() < deadline:
                self.cond.wait(0.01)
            assert self.checks >= count, f"the watchdog made {self.checks} of {count} checks"


def write_job(tmp_path: Path, source: str, name: str = "job.py") -> Path:
    """Write a job script (dedented by the caller if needed) and return its path."""
    path = Path(tmp_path) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return path


def last_sync(base: Path, name: str) -> dict:
    """What the last `orch up` of job `name` pushed (.orch/<name>/last_sync.json)."""
    return json.loads((base / ".orch" / name / "last_sync.json").read_text())


def snapshot(root: Path) -> dict:
    """Every entry under root (root included): kind, bytes or link target, mode, mtime;
    links are never followed (what a planted link points to must stay unchanged)."""
    out: dict[str, tuple[object, ...]] = {}
    entries = [root, *sorted(root.rglob("*"))] if root.is_dir() else [root]
    for p in entries:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            out[str(p)] = ("link", os.readlink(p))
        elif stat.S_ISREG(st.st_mode):
            out[str(p)] = ("file", p.read_bytes(), st.st_mode, st.st_mtime_ns)
        else:
            out[str(p)] = ("dir", st.st_mode)
    return out


def plant_link(job: Path, rel: str, target: Path) -> Path:
    """A symbolic link at job/rel (its folders made) pointing to target."""
    link = job / rel
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_ranks(fn: Callable[..., None], world: int, timeout: float,
                preload: Sequence[str] = ()) -> None:
    """Run fn(rank, world, port) in `world` spawned processes (port: a free rendezvous
    port); fail on any error or when they do not finish in `timeout` s; none survives.
    With `preload`, the ranks are forked from multiprocessing's fork server, which imports
    those modules once for every later call: a spawned rank imports torch on its own
    (~3.5 s of CPU, and ~2.6 s more for torch._dynamo at its first DDP). The caller stops
    the server (stop_fork_server)."""
    import multiprocessing

    import torch.multiprocessing as mp  # here: most test modules never load torch

    if preload:   # read when the server starts: a running one keeps what it has
        multiprocessing.set_forkserver_preload(list(preload))
    ctx = mp.start_processes(fn, args=(world, loopback_port()), nprocs=world, join=False,
                             start_method="forkserver" if preload else "spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise AssertionError(f"{world}-process run did not finish in {timeout} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        assert not any(p.is_alive() for p in ctx.processes), "a worker process survived"


def stop_fork_server() -> None:
    """End multiprocessing's fork server (spawn_ranks' `preload`) and prove it gone. Its
    stop is private: the standard library has no public one (its own tests call this)."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver   # type: ignore[attr-defined]
    pid = server._forkserver_pid
    server._stop()   # closes its alive pipe and reaps it
    assert pid is None or not pid_alive(pid), f"the fork server {pid} survived"


@contextlib.contextmanager
def sigint_raises() -> Iterator[None]:
    """Ctrl-C as in a terminal (a test runner's worker may ignore SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def unnamed_in(pid: int, folder: Path) -> set[int]:
    """The inodes of the unnamed files (O_TMPFILE, agent/spares.py) process pid holds in
    folder."""
    out, real = set(), os.path.realpath(folder)
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"{real}/#"):
                out.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    return out
