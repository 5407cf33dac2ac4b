"""Warm start on one host (orchestrator/agent/warm.py, agent/launcher.py) and the job
folder's lock (host/procs.claim), with real local processes and no sshd.

torch is a stand-in on PYTHONPATH (a few lines; the real import would cost seconds of
CPU per test): its torch.distributed.run, run as __main__, prints what a warm start must
get right (argv, cwd, the marker, sys.path[0]) as a `GO {json}` line, waits until the
test creates its release file, and exits with STANDIN_EXIT. Every test proves that the
supervisor and torchrun it started are gone at its end.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import snapshot, stray_pids, unnamed_in, wait_until
from orchestrator.agent import launcher, preflight, procs, warm
from orchestrator.agent.common import job_paths, read_json, write_atomic
from orchestrator.agent.launch import job_folders
from orchestrator.wire import timeouts
from sshd_cluster import _read_stat, pid_alive

PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]
ARGS = ["--nnodes", "1", "--nproc-per-node", "1", "train.py", "--lr", "0.1"]

STANDIN_RUN = """\
import json, os, sys, time
if __name__ == "__main__":
    print("GO " + json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(),
                              "marker": os.environ.get("ORCH_JOB_DIR"),
                              "path0": sys.path[0]}), flush=True)
    deadline = time.time() + 60
    while not os.path.exists(os.environ["STANDIN_RELEASE"]) and time.time() < deadline:
        time.sleep(0.02)
    sys.exit(int(os.environ.get("STANDIN_EXIT", "0")))
"""
EARLY = "import sys; print('EARLY import output', file=sys.stderr, flush=True)\n"
# the import announces itself, then takes 5 s (a real torch import on a busy host)
# an import that does not end while a test lasts: only the supervisor's death can end it
SLOW = ("import os, time\nopen(os.environ['STANDIN_IMPORTING'], 'w').close()\n"
        "time.sleep(600)\n")
# only the first launcher (the warm one) cannot import torch: the cold one, started after
# it ended, can
WARM_BROKEN = ("import os\nflag = os.environ['STANDIN_RELEASE'] + '.tried'\n"
               "if not os.path.exists(flag):\n"
               "    open(flag, 'w').close()\n"
               "    raise ImportError('no torch for the warm launcher')\n")
ALL_BROKEN = "raise RuntimeError('torch is broken on this host')\n"
# each refused connect of the process that imports it, a line in <release file>.refused
COUNT_REFUSED = """\
import os, socket
class Counted(socket.socket):
    def connect(self, address):
        try:
            return super().connect(address)
        except OSError:
            with open(os.environ["STANDIN_RELEASE"] + ".refused", "a") as f:
                f.write("refused %r\\n" % (address,))
            raise
socket.socket = Counted
"""


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(e.split("=", 1) for e in entries if "=" in e)


def parent_of(pid: int) -> int:
    stat = _read_stat(pid)
    assert stat is not None, f"pid {pid} is gone"
    return stat[0]


def gone(pid: int) -> bool:
    """pid has ended, every thread of it: its main thread a zombie (or reaped) is not
    enough, as the other threads of its exit_group may still run and hold its
    descriptors (the warm launcher's end of the go socket) until they too have ended."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    return not pid_alive(pid) and threads == [str(pid)]


def all_gone(pids: list[int], timeout: float = 5.0) -> None:
    wait_until(lambda: all(gone(p) for p in pids), timeout, f"processes {pids} to end")


class Job:
    """A job folder (its folders made as a launch makes them) with a stand-in torch."""

    def __init__(self, tmp_path: Path, torch_init: str = "", exit_code: int = 0) -> None:
        self.path = tmp_path / "remote" / "warmjob"
        self.path.mkdir(parents=True)
        self.p = job_paths(str(self.path))
        job_folders(self.p["jd"])
        self.code = str(self.path / "code")
        standin = tmp_path / "standin"
        (standin / "torch" / "distributed").mkdir(parents=True)
        (standin / "torch" / "__init__.py").write_text(torch_init)
        (standin / "torch" / "distributed" / "__init__.py").write_text("")
        (standin / "torch" / "distributed" / "run.py").write_text(STANDIN_RUN)
        self.run_py = standin / "torch" / "distributed" / "run.py"
        self.release_file = tmp_path / "release"
        self.importing = tmp_path / "importing"
        self.env = {"ORCH_JOB_DIR": str(self.path), "ORCH_JOB": "warmjob",
                    "PYTHONPATH": str(standin), "STANDIN_RELEASE": str(self.release_file),
                    "STANDIN_IMPORTING": str(self.importing), "STANDIN_EXIT": str(exit_code)}

    def spec(self, argv: list[str] | None = None, env: dict[str, str] | None = None
             ) -> dict[str, Any]:
        return {"run_id": "r1", "ranks": [0], "argv": argv or TORCHRUN + ARGS,
                "env": env or dict(self.env)}

    def release(self) -> None:
        self.release_file.touch()

    def log(self) -> str:
        path = self.path / "run" / "torchrun.log"
        return path.read_text() if path.exists() else ""

    def go_line(self, timeout: float = 10) -> dict[str, Any]:
        line = wait_until(lambda: [x for x in self.log().splitlines() if x.startswith("GO ")],
                          timeout, "the stand-in's GO line in run/torchrun.log")
        assert isinstance(line, list) and len(line) == 1, self.log()
        got: dict[str, Any] = json.loads(line[0][3:])
        return got

    def host_exit(self, timeout: float = 10) -> dict[str, Any]:
        got = wait_until(lambda: read_json(self.p["jd"], "run/host.exit"), timeout,
                         f"run/host.exit; torchrun.log:\n{self.log()}")
        assert isinstance(got, dict)
        return got


@pytest.fixture
def started() -> Iterator[list[int]]:
    """Pids a test started (supervisors, torchruns): whatever a failed test left is
    SIGKILLed (if still the same process), so that later tests are not disturbed."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(OSError):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def start(job: Job, started: list[int], env: dict[str, str] | None = None) -> warm.Warm:
    waiting = warm.start(job.p, PY, env or dict(job.env))
    started += [waiting.launcher, parent_of(waiting.launcher)]
    return waiting


def test_go_runs_torchrun_warm(tmp_path: Path, started: list[int]) -> None:
    job = Job(tmp_path, torch_init=EARLY)
    waiting = start(job, started)
    supervisor = parent_of(waiting.launcher)
    record = waiting.go(job.spec())["supervisor"]
    assert record["pid"] == supervisor and record["torchrun_pid"] == waiting.launcher
    got = job.go_line()
    # the job runs in the process started at preflight: the one tagged for ps
    argv = cmdline(record["torchrun_pid"])
    assert argv[:2] == [PY, "-c"] and argv[-2:] == [warm.TAG, str(job.path)], argv
    assert got == {"argv": ARGS, "cwd": job.code, "marker": str(job.path),
                   "path0": job.code}, got
    job.release()
    assert job.host_exit()["code"] == 0
    # what the import printed before the go is in the log, once, before the job's output
    log = job.log()
    assert log.count("EARLY import output") == 1 and log.index("EARLY") < log.index("GO "), log
    all_gone([supervisor, waiting.launcher])
    assert not stray_pids([job.path], wait=2)


def test_no_marker_before_go_and_cancel_ends_both(tmp_path: Path, started: list[int]) -> None:
    job = Job(tmp_path)
    before = snapshot(job.path)
    waiting = start(job, started)
    supervisor = parent_of(waiting.launcher)
    env = environ(waiting.launcher)
    # no process of the job yet: `stop` and "already running" must not see it
    assert "ORCH_JOB_DIR" not in env and env["ORCH_JOB"] == "warmjob", sorted(env)
    assert procs.marked_pids(str(job.path)) == []
    assert not procs.job_running(job.p)
    assert pid_alive(supervisor) and pid_alive(waiting.launcher)
    waiting.cancel()
    # nothing else ends them: no go comes, and their agent (this process) lives on, so
    # their end is the cancel's; the deadline is only how long a loaded machine may take
    all_gone([supervisor, waiting.launcher], timeout=30)
    assert snapshot(job.path) == before, "a warm start that got no go wrote in the job folder"
    assert not stray_pids([job.path])


def test_the_agents_end_kills_a_warm_torchrun_itself(tmp_path: Path,
                                                     started: list[int]) -> None:
    """An `up` that failed on another host closes this agent and waits for its end: the
    warm torchrun is killed by then, even when its supervisor is slow to run (stopped
    here: on a loaded host it may be scheduled late)."""
    job = Job(tmp_path, torch_init=SLOW)
    waiting = start(job, started)
    supervisor = parent_of(waiting.launcher)
    os.kill(supervisor, signal.SIGSTOP)
    try:
        warm.WAITING[str(job.path)] = waiting
        warm.end_all()
        assert warm.WAITING == {}
        wait_until(lambda: not pid_alive(waiting.launcher), 5, "the warm torchrun's end")
    finally:
        os.kill(supervisor, signal.SIGCONT)
    all_gone([supervisor, waiting.launcher], timeout=30)
    assert not stray_pids([job.path])


def test_supervisor_killed_mid_import_ends_the_launcher(tmp_path: Path,
                                                        started: list[int]) -> None:
    job = Job(tmp_path, torch_init=SLOW)
    waiting = start(job, started)
    supervisor = parent_of(waiting.launcher)
    wait_until(job.importing.exists, 10, "the warm launcher to start importing torch")
    os.kill(supervisor, signal.SIGKILL)
    # the import takes 600 s: a launcher gone within 60 s (a bound that holds at load 8)
    # was ended by its supervisor's death, not by the end of its import
    all_gone([waiting.launcher], timeout=60)
    waiting.cancel()
    all_gone([supervisor])
    assert not stray_pids([job.path])


@pytest.mark.parametrize("differs", ["env", "argv"])
def test_spec_not_the_warm_one_starts_cold(tmp_path: Path, started: list[int],
                                           differs: str) -> None:
    job = Job(tmp_path, exit_code=4)
    waiting = start(job, started)
    supervisor = parent_of(waiting.launcher)
    # env: the job's environment changed between preflight and launch; argv: not
    # torchrun at all (the stand-in run as a plain script)
    spec = (job.spec(env=dict(job.env, EXTRA="1")) if differs == "env"
            else job.spec(argv=[PY, str(job.run_py), *ARGS]))
    record = waiting.go(spec)["supervisor"]
    started.append(record["torchrun_pid"])
    got = job.go_line()
    assert record["torchrun_pid"] != waiting.launcher
    assert not pid_alive(waiting.launcher)
    assert got["argv"] == ARGS and got["cwd"] == job.code and got["marker"] == str(job.path)
    if differs == "env":   # torchrun: a launcher started now, handed the go at once
        assert cmdline(record["torchrun_pid"])[-2:] == [warm.TAG, str(job.path)]
    else:   # not torchrun: started as it is, carrying the marker itself
        assert cmdline(record["torchrun_pid"]) == spec["argv"]
        assert environ(record["torchrun_pid"])["ORCH_JOB_DIR"] == str(job.path)
    job.release()
    assert job.host_exit()["code"] == 4
    all_gone([supervisor, record["torchrun_pid"]])
    assert not stray_pids([job.path], wait=2)


@pytest.mark.parametrize("broken", ["warm only", "everywhere"])
def test_launcher_gone_before_go_starts_cold(tmp_path: Path, started: list[int],
                                             broken: str) -> None:
    job = Job(tmp_path, torch_init=WARM_BROKEN if broken == "warm only" else ALL_BROKEN,
              exit_code=3)
    waiting = start(job, started)
    supervisor = parent_of(waiting.launcher)
    # its import failed: it ended by itself, its socket closed with its last thread
    all_gone([waiting.launcher], timeout=10)
    record = waiting.go(job.spec())["supervisor"]
    started.append(record["torchrun_pid"])
    assert record["torchrun_pid"] != waiting.launcher
    if broken == "warm only":
        # the GO line first: posix_spawn returns once the child has exec'd, but its new
        # /proc/<pid>/cmdline is set up a moment later (empty until then); the stand-in
        # prints GO only once it runs, past its exec
        assert job.go_line()["marker"] == str(job.path)
        assert cmdline(record["torchrun_pid"])[-2:] == [warm.TAG, str(job.path)]
        job.release()
        assert job.host_exit()["code"] == 3
    else:   # the cold torchrun's own error is what the user reads
        assert job.host_exit()["code"] == 1
        assert "RuntimeError: torch is broken on this host" in job.log(), job.log()
    assert "no torch for the warm launcher" not in job.log()
    all_gone([supervisor, record["torchrun_pid"]])
    assert not stray_pids([job.path], wait=2)


# the import announces itself, then fails once the test releases it (after the go)
FAILS_AFTER_GO = ("import os, time\nopen(os.environ['STANDIN_IMPORTING'], 'w').close()\n"
                  "while not os.path.exists(os.environ['STANDIN_RELEASE']):\n"
                  "    time.sleep(0.02)\n"
                  "raise ImportError('torch broke half way through its import')\n")


def test_import_failing_after_the_go_fails_the_job(tmp_path: Path, started: list[int]) -> None:
    """The go reached the launcher mid-import, so it is the job's torchrun; its import
    then fails: the host's exit is 1 with the cause in the log, never 0 (a job that ran
    nothing read as a success)."""
    job = Job(tmp_path, torch_init=FAILS_AFTER_GO)
    waiting = start(job, started)
    supervisor = parent_of(waiting.launcher)
    wait_until(job.importing.exists, 30, "the warm launcher to start importing torch")
    record = waiting.go(job.spec())["supervisor"]
    assert record["torchrun_pid"] == waiting.launcher     # handed over: it is torchrun
    job.release()
    assert job.host_exit(timeout=30)["code"] == 1, job.log()
    assert "could not import torch.distributed.run" in job.log()
    assert "torch broke half way" in job.log()
    all_gone([supervisor, waiting.launcher], timeout=30)
    assert not stray_pids([job.path], wait=2)


# torchrun's way of starting ranks: Popen bound by name at its import (as torch's
# subprocess_handler does); rank 0 ends 3, rank 1 is killed by SIGKILL, rank 2 (no RANK:
# not a rank) ends 0; each is reaped a second after its end, so a record written at the
# reap would be a second late
RANKS_RUN = """\
import json, os, sys, time
from subprocess import Popen
if __name__ == "__main__":
    code = ["import sys; sys.exit(3)", "import os; os.kill(os.getpid(), 9)", "pass"]
    procs = [Popen([sys.executable, "-c", c], env=dict(os.environ, **({"RANK": str(r)}
             if r < 2 else {}))) for r, c in enumerate(code)]
    time.sleep(1.0)
    reaped = [(p.pid, p.wait(), time.time()) for p in procs]
    print("REAPED " + json.dumps(reaped), flush=True)
    sys.exit(1)
"""


def test_the_launcher_records_each_ranks_pid_and_end(tmp_path: Path,
                                                     started: list[int]) -> None:
    job = Job(tmp_path)
    job.run_py.write_text(RANKS_RUN)
    waiting = start(job, started)
    supervisor = parent_of(waiting.launcher)
    record = waiting.go(job.spec())["supervisor"]
    assert job.host_exit(timeout=30)["code"] == 1, job.log()
    line = wait_until(lambda: [x for x in job.log().splitlines() if x.startswith("REAPED ")],
                      10, "the stand-in's REAPED line")
    assert isinstance(line, list)
    reaped = json.loads(line[0][7:])
    for rank, (pid, code, reaped_at) in enumerate(reaped[:2]):
        pid_record = read_json(job.p["jd"], f"run/rank-{rank}.pid")
        assert pid_record["pid"] == pid, pid_record
        assert isinstance(pid_record["start_ticks"], int), pid_record
        end = read_json(job.p["jd"], f"run/rank-{rank}.exit")
        assert end["code"] == code == (3, -9)[rank], (end, code)
        # the end's time, not the reap's (a second later)
        assert pid_record["time"] <= end["time"] < reaped_at - 0.5, (pid_record, end, reaped_at)
    assert not (job.path / "run" / "rank-2.pid").exists()   # no RANK: not a rank
    assert [n for n in os.listdir(job.path / "run") if ".orch-part-" in n] == []
    all_gone([supervisor, record["torchrun_pid"]])


# rank 0 runs on, rank 1 ends 3 at once; torchrun reaps neither (the stop's SIGKILL
# finds rank 1 a zombie, its record already written)
ORPHANS_RUN = """\
import os, sys, time
from subprocess import Popen
if __name__ == "__main__":
    code = ["import time; time.sleep(120)", "import sys; sys.exit(3)"]
    procs = [Popen([sys.executable, "-c", c], env=dict(os.environ, RANK=str(r)))
             for r, c in enumerate(code)]
    time.sleep(120)
"""


def test_ranks_that_outlive_torchrun_are_recorded_by_the_supervisor(
        tmp_path: Path, started: list[int]) -> None:
    """A stop SIGKILLs torchrun and SIGTERMs the ranks (agent/procs.py): a rank then ends
    as the supervisor's child (a subreaper), which writes its exit record; a record the
    launcher wrote already stays as it was."""
    job = Job(tmp_path)
    job.run_py.write_text(ORPHANS_RUN)
    waiting = start(job, started)
    supervisor = parent_of(waiting.launcher)
    record = waiting.go(job.spec())["supervisor"]
    wait_until(lambda: all(read_json(job.p["jd"], f"run/rank-{r}.pid") for r in (0, 1)), 30,
               "the ranks' pid records")
    rank0 = read_json(job.p["jd"], "run/rank-0.pid")
    first = wait_until(lambda: read_json(job.p["jd"], "run/rank-1.exit"), 30,
                       "rank 1's exit record, by the launcher")
    assert isinstance(first, dict) and first["code"] == 3
    spare_inodes = unnamed_in(supervisor, job.path / "run")   # run/host.exit's, rank 0's
    killed_at = time.time()
    os.kill(record["torchrun_pid"], signal.SIGKILL)
    os.kill(rank0["pid"], signal.SIGTERM)
    end = job.host_exit(timeout=30)
    assert end["code"] == -signal.SIGKILL
    got = wait_until(lambda: read_json(job.p["jd"], "run/rank-0.exit"), 30,
                     "rank 0's exit record, by the supervisor")
    assert isinstance(got, dict) and got["code"] == -signal.SIGTERM, got
    assert got["time"] >= killed_at - 1, (got, killed_at)
    # written into the file the supervisor made after the launch (agent/spares.py); its
    # host.exit may be written twice here (torchrun's end, then `reaped`): not checked
    if hasattr(os, "O_TMPFILE"):
        assert len(spare_inodes) == 2, spare_inodes   # rank 0's exit, host.exit
        assert os.stat(job.path / "run" / "rank-0.exit").st_ino in spare_inodes
    assert read_json(job.p["jd"], "run/rank-1.exit") == first   # not written again
    all_gone([supervisor, record["torchrun_pid"]], timeout=30)
    assert not stray_pids([job.path], wait=2)


LEAVER_RUN = """\
import os, sys, time
from subprocess import Popen
if __name__ == "__main__":
    # a rank that leaves a daemon behind (setsid, double fork), then ends well
    leave = "import os, time; os.setsid(); os.fork() and os._exit(0); time.sleep(120)"
    Popen([sys.executable, "-c", leave], env=dict(os.environ, RANK="0")).wait()
"""


def test_a_stderr_the_fork_closed_does_not_end_the_supervisor(
        tmp_path: Path, started: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor says on its stderr that it stops what the ranks left. It is forked
    from the agent, whose sys.stderr here writes to a descriptor the fork closes: the
    line goes to descriptor 2 (the log) and the supervisor still stops the daemon and
    says in host.exit that nothing is left."""
    monkeypatch.setattr(timeouts, "LEFTOVER_GRACE", 0.5)   # (the forked supervisor's too)
    fd = os.open(tmp_path / "agent-stderr", os.O_WRONLY | os.O_CREAT, 0o600)
    monkeypatch.setattr(sys, "stderr", os.fdopen(fd, "w", buffering=1))   # as stderr is
    job = Job(tmp_path)
    job.run_py.write_text(LEAVER_RUN)
    waiting = start(job, started)
    supervisor = parent_of(waiting.launcher)
    waiting.go(job.spec())
    done = wait_until(lambda: (read_json(job.p["jd"], "run/host.exit") or {}).get("reaped"),
                      30, "host.exit saying that nothing is left")
    assert done is True
    assert "stopping what they left" in job.log(), job.log()
    all_gone([supervisor, waiting.launcher], timeout=30)
    assert not stray_pids([job.path], wait=2)


def test_a_rank_reaped_first_is_recorded_with_the_code_torchrun_read(tmp_path: Path) -> None:
    """torchrun's own wait may reap the rank before the record's waitid looks: the code
    is then the one torchrun's Popen read."""
    run = tmp_path / "run"
    run.mkdir()
    records = launcher.RankRecords()
    records.open({"ORCH_JOB_DIR": str(tmp_path)})
    proc = subprocess.Popen([PY, "-c", "import sys; sys.exit(5)"])
    assert proc.wait(30) == 5
    records.wait(proc, 7)
    got = json.loads((run / "rank-7.exit").read_text())
    assert got["code"] == 5 and abs(got["time"] - time.time()) < 30, got
    os.close(records.run)


def test_the_hook_records_ranks_and_never_fails_torchruns_popen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The Popen torchrun gets is a working one whatever the records meet (here a RANK
    that is no number: said on stderr, nothing recorded)."""
    (tmp_path / "run").mkdir()
    monkeypatch.setattr(subprocess, "Popen", subprocess.Popen)   # put back at the end
    records = launcher.RankRecords()
    records.hook()
    records.open({"ORCH_JOB_DIR": str(tmp_path)})
    odd = subprocess.Popen([PY, "-c", "pass"], env=dict(os.environ, RANK="x"))
    rank = subprocess.Popen([PY, "-c", "import sys; sys.exit(6)"], env=dict(os.environ, RANK="4"))
    assert odd.wait(30) == 0 and rank.wait(30) == 6
    records.settle(10)
    assert "records: ValueError" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "rank-4.exit").read_text())["code"] == 6
    assert sorted(os.listdir(tmp_path / "run")) == ["rank-4.exit", "rank-4.pid"]
    os.close(records.run)


def test_the_records_are_not_written_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "run").symlink_to(victim)
    records = launcher.RankRecords()
    records.open({"ORCH_JOB_DIR": str(tmp_path / "job")})
    assert records.run == -1 and os.listdir(victim) == []


HOLDER = """\
import sys
import threading
from orchestrator.agent import paths, procs
from orchestrator.agent.common import job_paths
paths.HOST_PART = sys.argv[2] if len(sys.argv) > 2 else ""
print(procs.claim(job_paths(sys.argv[1])), flush=True)
sys.stdin.read()
"""


def hold_lock(job: Path, part: str = "") -> subprocess.Popen[str]:
    """Another agent: claims the job folder (this host's part of it, run/<part>/, as
    the controller's agents do) and keeps it until its stdin closes."""
    holder = subprocess.Popen([PY, "-c", HOLDER, str(job), part], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "True"
    return holder


def end(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait(10) == 0
    assert not pid_alive(holder.pid)


def test_claim_refused_while_another_agent_holds_the_lock(tmp_path: Path) -> None:
    job = Job(tmp_path)
    p = job.p
    holder = hold_lock(job.path)
    try:
        assert procs.claim(p) is False
        assert preflight.running(p, True) == preflight.HELD   # another `up`'s lock
        assert str(job.path) not in procs.LOCKED
    finally:
        end(holder)
    try:
        assert procs.claim(p) is True and str(job.path) in procs.LOCKED
        assert procs.claim(p) is True   # this agent's own lock: claimed again
        assert preflight.running(p, True) is None   # and kept for its launch
        assert str(job.path) in procs.LOCKED
        other = subprocess.run([PY, "-c", HOLDER, str(job.path)], input="",
                               capture_output=True, text=True, timeout=30)
        assert other.stdout.strip() == "False", other
    finally:
        procs.release(str(job.path))
    assert str(job.path) not in procs.LOCKED
    end(hold_lock(job.path))   # released: another agent gets it


def test_running_job_releases_the_lock(tmp_path: Path) -> None:
    job = Job(tmp_path)
    me = os.getpid()
    # a live supervisor of the job (this process stands in for it)
    record = {"pid": me, "start_ticks": procs.proc_start_time(me), "torchrun_pid": None}
    write_atomic(job.p["jd"], "run/supervisor.json", json.dumps(record).encode())
    try:
        assert preflight.running(job.p, True) == preflight.RUNNING
        assert str(job.path) not in procs.LOCKED   # a job found running: no lock kept
    finally:
        procs.release(str(job.path))
    end(hold_lock(job.path))


def test_held_lock_with_the_job_alive_is_running_not_held(tmp_path: Path) -> None:
    """An attached `up` keeps the job folder's lock for the job's life: while its
    processes live, another `up` is told "already running" (which `orch stop` ends),
    not that an `up` holds the folder."""
    job = Job(tmp_path)
    me = os.getpid()
    record = {"pid": me, "start_ticks": procs.proc_start_time(me), "torchrun_pid": None}
    write_atomic(job.p["jd"], "run/supervisor.json", json.dumps(record).encode())
    holder = hold_lock(job.path)
    try:
        assert preflight.running(job.p, True) == preflight.RUNNING
        assert str(job.path) not in procs.LOCKED
    finally:
        end(holder)


def test_resolved_puts_the_hosts_path_for_the_configured_one() -> None:
    configured, job = "~/orch/j", "/home/u/orch/j"
    assert warm.resolved("~/orch/j", configured, job) == job
    assert warm.resolved("~/orch/j/data", configured, job) == job + "/data"
    assert warm.resolved("~/orch/jx", configured, job) == "~/orch/jx"   # not the folder
    assert warm.resolved("x ~/orch/j", configured, job) == "x ~/orch/j"
    assert warm.resolved("", configured, job) == ""
    assert warm.resolved("/elsewhere", configured, job) == "/elsewhere"


def test_stop_finds_the_unmarked_warm_torchrun(tmp_path: Path, started: list[int]) -> None:
    job = Job(tmp_path)
    waiting = start(job, started)
    supervisor = parent_of(waiting.launcher)
    record = waiting.go(job.spec())["supervisor"]
    job.go_line()   # running, and never released
    torchrun = record["torchrun_pid"]
    assert torchrun == waiting.launcher and parent_of(torchrun) == supervisor
    # its marker came with the go, after its exec: not in /proc/<pid>/environ
    assert "ORCH_JOB_DIR" not in environ(torchrun)
    assert torchrun not in procs.marked_pids(str(job.path))
    report = procs.stop(str(job.path), 2.0)
    assert report["found"] == 2 and report["left"] == [], report
    all_gone([supervisor, torchrun], timeout=2)
    assert not stray_pids([job.path])


# torchrun's end as the warm launcher runs it: what torch/distributed/run.py does last
ENDING = """\
import atexit, os, sys, threading, time
import torch
class Teardown:   # only the interpreter's teardown frees it (torch is never freed);
    # builtins and globals may be gone by then: what it needs is bound now
    def __del__(self, path=os.environ["STANDIN_TEARDOWN"], mkfile=os.open, close=os.close,
                flags=os.O_CREAT | os.O_WRONLY):
        close(mkfile(path, flags))
if __name__ == "__main__":
    torch.kept = Teardown()
    atexit.register(lambda: print("ATEXIT ran"))
    threading.Thread(target=lambda: (time.sleep(0.3), print("THREAD done"))).start()
    print("LAST unflushed")   # stdout is the log, a file: block-buffered
    end = os.environ["STANDIN_END"]
    if end == "exit3":
        sys.exit(3)
    if end == "raise":
        raise RuntimeError("a rank failed")
"""


@pytest.mark.parametrize(("end", "code"), [("return", 0), ("exit3", 3), ("raise", 1)])
def test_warm_torchrun_ends_without_the_teardown(tmp_path: Path, started: list[int],
                                                 end: str, code: int) -> None:
    """Once torchrun returned, the launcher does what a normal exit does that matters
    (joins the threads, runs atexit, flushes) and exits with torchrun's code, skipping
    the interpreter's teardown (seconds with torch loaded); an exception other than
    SystemExit takes python's own end: its traceback in the log, exit 1."""
    job = Job(tmp_path)
    job.run_py.write_text(ENDING)
    teardown = tmp_path / "teardown"
    env = dict(job.env, STANDIN_TEARDOWN=str(teardown), STANDIN_END=end)
    waiting = start(job, started, env)
    supervisor = parent_of(waiting.launcher)
    waiting.go(job.spec(env=env))
    assert job.host_exit()["code"] == code, job.log()
    log = job.log()
    for line in ("LAST unflushed", "THREAD done", "ATEXIT ran"):
        assert line in log, log
    assert teardown.exists() == (end == "raise"), log
    assert ("RuntimeError: a rank failed" in log) == (end == "raise"), log
    all_gone([supervisor, waiting.launcher])
    assert not stray_pids([job.path], wait=2)


def test_node_zero_of_several_keeps_pythons_end(tmp_path: Path, started: list[int]) -> None:
    """Node 0 of several serves torchrun's store, which the other nodes may still read
    the exit barrier's answer from: its torchrun takes python's own end (the teardown
    runs), with the same exit code; one node alone, or node 1, ends at once."""
    from orchestrator.agent import launcher
    assert launcher.hosts_store(["--nnodes", "3", "--node-rank", "0", "x.py"])
    assert launcher.hosts_store(["--nnodes=2", "--node-rank=0"])
    assert not launcher.hosts_store(["--nnodes", "3", "--node-rank", "1", "x.py"])
    assert not launcher.hosts_store(["--nnodes", "1", "--node-rank", "0"])
    job = Job(tmp_path)
    job.run_py.write_text(ENDING)
    teardown = tmp_path / "teardown"
    env = dict(job.env, STANDIN_TEARDOWN=str(teardown), STANDIN_END="exit3")
    waiting = start(job, started, env)
    supervisor = parent_of(waiting.launcher)
    args = ["--nnodes", "2", "--node-rank", "0", "train.py"]
    waiting.go(job.spec(argv=TORCHRUN + args, env=env))
    assert job.host_exit()["code"] == 3, job.log()
    assert "ATEXIT ran" in job.log() and teardown.exists(), job.log()
    all_gone([supervisor, waiting.launcher])
    assert not stray_pids([job.path], wait=2)


def free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_store_address_only_for_the_other_nodes_of_a_static_rendezvous() -> None:
    from orchestrator.agent import launcher
    two = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "29501"]
    assert launcher.store_address([*two, "--node-rank", "1", "x.py"]) == ("10.0.0.1", "29501")
    assert launcher.store_address(["--nnodes=3", "--node-rank=2", "--master-addr=h",
                                   "--master-port=7"]) == ("h", "7")
    assert launcher.store_address([*two, "--node-rank", "0"]) is None     # it serves it
    assert launcher.store_address(["--nnodes", "1", "--node-rank", "1"]) is None
    assert launcher.store_address([*two, "--node-rank", "1", "--rdzv-backend", "c10d"]) is None
    # the job's own arguments come after torchrun's: the first one found is torchrun's
    assert launcher.store_address([*two, "--node-rank", "1", "x.py", "--master-port", "1"]
                                  ) == ("10.0.0.1", "29501")


class PollClock:
    """The `time` that launcher.wait_for_store imports when called: `monotonic` reads a
    fake time that only its `sleep` moves, and each sleep then runs `at_sleep(now)`. The
    polls are counted, not timed: a busy machine changes nothing."""

    def __init__(self, at_sleep: Any = None) -> None:
        self.now, self.reads = 0.0, 0
        self.sleeps: list[float] = []
        self.at_sleep = at_sleep or (lambda now: None)
        self.module = types.ModuleType("time")
        self.module.monotonic = self.monotonic   # type: ignore[attr-defined]
        self.module.sleep = self.sleep           # type: ignore[attr-defined]

    def monotonic(self) -> float:
        self.reads += 1
        assert self.reads < 10_000, "polled without sleeping"
        return self.now

    def sleep(self, seconds: float) -> None:
        self.reads = 0
        self.sleeps.append(seconds)
        self.now += seconds
        self.at_sleep(self.now)


def test_wait_for_store_returns_once_node_zero_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused while nothing listens (the poll goes on, one connect every STORE_POLL),
    True at the first poll after the listen; False at the first poll past the limit,
    when torchrun's own retries take over. Real connects, on a fake clock."""
    from orchestrator.agent import launcher
    port = free_local_port()
    args = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "x.py"]
    clock = PollClock()
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "time", clock.module)
        assert launcher.wait_for_store(args, limit=0.3) is False
    assert set(clock.sleeps) == {launcher.STORE_POLL}, clock.sleeps
    # ended at the first poll past the limit: the one before it was still within
    assert clock.now - clock.sleeps[-1] < 0.3 <= clock.now, clock.sleeps
    listened: list[float] = []
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))

        def listen_at(now: float) -> None:
            if now >= 0.4 and not listened:
                srv.listen(8)
                listened.append(now)
        clock = PollClock(listen_at)
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "time", clock.module)
            assert launcher.wait_for_store(args, limit=10) is True
    # refused before the listen (it polled on past 0.4 s), answered at the first poll
    # after it: no sleep since
    assert listened == [clock.now] and clock.now >= 0.4, (listened, clock.now)
    assert set(clock.sleeps) == {launcher.STORE_POLL}, clock.sleeps
    node0 = ["--nnodes", "2", "--node-rank", "0", "--master-port", str(port)]
    assert launcher.wait_for_store(node0, limit=10) is False   # node 0: no wait


def test_other_node_starts_torchrun_once_the_store_listens(tmp_path: Path,
                                                          started: list[int]) -> None:
    """The warm torchrun of node 1 runs torchrun (the stand-in's GO) only once node 0's
    store accepts connections, not before."""
    port = free_local_port()
    job = Job(tmp_path, torch_init=COUNT_REFUSED)
    refused = Path(str(job.release_file) + ".refused")
    waiting = start(job, started)
    supervisor = parent_of(waiting.launcher)
    args = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "train.py"]

    def refusals() -> int:
        return len(refused.read_text().splitlines()) if refused.exists() else 0
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        waiting.go(job.spec(argv=TORCHRUN + args))
        # the launcher polls the store, refused: torchrun has not run, and a refusal
        # after this look shows it was still waiting when the log was read
        wait_until(lambda: refusals() >= 3, 30, "the launcher's connects to be refused")
        seen = refusals()
        assert "GO " not in job.log(), job.log()
        wait_until(lambda: refusals() > seen, 30, "the launcher to poll on")
        srv.listen(8)
        assert job.go_line()["argv"] == args
    job.release()
    assert job.host_exit()["code"] == 0
    all_gone([supervisor, waiting.launcher])
    assert not stray_pids([job.path], wait=2)
