"""The hang watch without real waits: the watchdog on a fake clock, faulthandler's dumps
parsed, the culprit named, the report, `job.hang_timeout`/`--hang-timeout`, the ranks'
NCCL environment, the wire's caps, and the host side (heartbeat files, stacks) on real
child processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import wait_until
from orchestrator.agent import follow as agent_follow
from orchestrator.agent import rankexec
from orchestrator.agent import stacks as agent_stacks
from orchestrator.agent.paths import JobDir
from orchestrator.agent.procs import proc_start_time, stat_fields
from orchestrator.commands.up import with_hang_timeout
from orchestrator.commands.uprender import hang_text
from orchestrator.config.inventory import Cluster, load
from orchestrator.errors import InventoryError, UsageError
from orchestrator.session.launch import dry_run_plan, rank_env
from orchestrator.session.replies import HostStacks
from orchestrator.watch import hang as hang_mod
from orchestrator.watch.hang import (
    Hang,
    HangReport,
    HangWatch,
    RankStack,
    culprits,
    main_thread,
    places,
    rank_stacks,
    reason,
    threads,
)
from orchestrator.watch.monitor import Monitor, hang_event
from orchestrator.wire import protocol


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------- the watchdog

def test_no_hang_before_the_timeout_and_progress_resets_it() -> None:
    clock = FakeClock()
    watch = HangWatch(10, range(3), now=clock)
    clock.t += 9.9
    assert watch.check() is None
    for r in range(3):
        watch.progress(r)
    clock.t += 9.9
    assert watch.check() is None
    clock.t += 0.1
    hang = watch.check()
    assert hang is not None and hang.idle == (0, 1, 2) and hang.everyone
    assert hang.seconds == pytest.approx(10.0)


def test_one_rank_without_progress_while_the_others_go_on() -> None:
    clock = FakeClock()
    watch = HangWatch(5, range(3), now=clock)
    watch.progress(1, heartbeat=True)
    for _ in range(6):
        clock.t += 1
        watch.progress(0)
        watch.progress(2)
    hang = watch.check()
    assert hang is not None and hang.idle == (1,) and not hang.everyone
    assert reason(hang) == ("hang: rank 1 made no progress (output or heartbeat) for 6 s while "
                            "the others did (hang_timeout 5 s)")


def test_a_quiet_rank_without_a_heartbeat_is_no_hang_while_others_print() -> None:
    """Many scripts print on rank 0 only: the other ranks' silence is not a hang."""
    clock = FakeClock()
    watch = HangWatch(5, range(3), now=clock)
    watch.progress(1)   # one line of output, then quiet
    for _ in range(20):
        clock.t += 1
        watch.progress(0)
    assert watch.check() is None


def test_a_rank_whose_heartbeat_stops_first_is_the_one_named() -> None:
    """worker.train: every rank beats; rank 2 stops, the others block a moment later."""
    clock = FakeClock()
    watch = HangWatch(8, range(3), now=clock)
    for r in range(3):
        watch.progress(r, heartbeat=True)
    clock.t += 0.5
    watch.progress(0, heartbeat=True)
    watch.progress(1, heartbeat=True)
    clock.t += 7.5
    hang = watch.check()
    assert hang is not None and hang.idle == (2,) and hang.everyone


def test_ranks_that_went_quiet_a_moment_later_do_not_go_on() -> None:
    """Rank 2 printed just after the others, then stopped: every rank is quiet."""
    clock = FakeClock()
    watch = HangWatch(8, range(3), now=clock)
    for r in range(3):
        watch.progress(r)
    clock.t += 0.3
    watch.progress(2)
    clock.t += 7.8
    assert watch.check() is None   # rank 2 printed 7.8 s ago; no heartbeat kept
    clock.t += 0.2
    hang = watch.check()
    assert hang is not None and hang.idle == (0, 1, 2) and hang.everyone
    assert reason(hang).startswith("hang: no rank made progress (output or heartbeat) for 8 s")


def test_an_exited_rank_is_not_watched_and_unknown_ranks_are_ignored() -> None:
    clock = FakeClock()
    watch = HangWatch(5, range(2), now=clock)
    watch.ended(1)
    watch.progress(7)   # not a rank of the job: nothing changes
    clock.t += 4
    watch.progress(0)
    clock.t += 4
    assert watch.check() is None


def test_a_rank_is_watched_from_its_first_progress_not_its_start_or_the_launch() -> None:
    """torchrun's own start and the rank's (its `import torch` and init_process_group,
    without a line) are no silence: beside a CPU burner a rank's silent torch import alone
    took 21-25 s, past a 20 s hang_timeout, and the job was called hung in its imports."""
    clock = FakeClock()
    watch = HangWatch(20, range(2), now=clock)
    clock.t += 60          # torchrun's start, then the ranks' silent imports
    assert watch.check() is None
    watch.progress(0)
    watch.progress(1)
    clock.t += 19.9
    assert watch.check() is None   # 79.9 s after the launch, 19.9 s after the first lines
    clock.t += 0.1
    hang = watch.check()
    assert hang is not None and hang.idle == (0, 1) and hang.seconds == pytest.approx(20)


def test_the_monitor_starts_no_ranks_clock_at_its_pid(tmp_path: Path) -> None:
    """The rank's pid comes before its python has imported anything: the monitor passes
    on its lines and heartbeats to the watch, not its start."""
    clock = FakeClock()
    cluster = cluster3(tmp_path)
    mon = Monitor(cluster=cluster, state=SimpleNamespace())  # type: ignore[arg-type]  # a test double
    mon.hang = HangWatch(20, range(cluster.world_size), now=clock)
    for h in cluster.hosts:
        for r in h.ranks:
            mon.rank_start(h.index, r, 1000 + r)
    clock.t += 60          # every rank's silent import torch and init_process_group
    assert mon.hang.check() is None
    for h in cluster.hosts:
        for r in h.ranks:   # a line from some, a heartbeat from the others
            if r % 2:
                mon.lines(h.index, r, [b"epoch 0"])
            else:
                mon.rank_progress(h.index, [r])
    clock.t += 20
    hang = mon.hang.check()
    assert hang is not None and hang.idle == tuple(range(cluster.world_size))


def test_a_heartbeat_is_a_first_progress_too() -> None:
    clock = FakeClock()
    watch = HangWatch(20, range(2), now=clock)
    clock.t += 30
    watch.progress(0, heartbeat=True)
    watch.progress(1, heartbeat=True)
    clock.t += 20
    hang = watch.check()
    assert hang is not None and hang.idle == (0, 1) and hang.seconds == pytest.approx(20)


def test_ranks_that_went_on_waiting_for_one_without_progress_yet_are_no_hang() -> None:
    """Host 0's ranks printed and wait in init_process_group for host 1's, whose torchrun or
    whose ranks' imports are still under way: no hang until the ranks without progress have
    had NOT_STARTED_S from the launch."""
    clock = FakeClock()
    watch = HangWatch(20, range(4), now=clock)
    watch.progress(0)
    watch.progress(1)
    clock.t += hang_mod.NOT_STARTED_S - 1
    assert watch.check() is None
    clock.t += 1
    hang = watch.check()
    assert hang is not None and hang.idle == (0, 1, 2, 3) and hang.everyone
    assert hang.seconds == pytest.approx(hang_mod.NOT_STARTED_S)


def test_a_rank_printing_before_its_silent_import_is_no_hang_while_others_start() -> None:
    """A script that prints its config on rank 0, then imports torch without a line: rank 0
    is watched from that line, but the others have not started: no hang."""
    clock = FakeClock()
    watch = HangWatch(20, range(3), now=clock)
    watch.progress(0)
    clock.t += 60
    assert watch.check() is None
    for r in range(3):
        watch.progress(r)
    clock.t += 20
    hang = watch.check()
    assert hang is not None and hang.idle == (0, 1, 2)


def test_a_rank_that_never_starts_is_a_hang_after_the_longer_bound() -> None:
    clock = FakeClock()
    watch = HangWatch(600, range(1), now=clock)   # a timeout past NOT_STARTED_S rules
    clock.t += 599
    assert watch.check() is None
    clock.t += 1
    assert watch.check() is not None


# ---------------------------------------------------------------- stacks

DUMP_MAIN_IN_ALL_REDUCE = """\
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 2050 in all_reduce
  File "/venv/torch/distributed/c10d_logger.py", line 75 in wrapper
  File "/job/code/job.py", line 14 in train_step
  File "/job/code/job.py", line 30 in <module>
  File "/job/run/host-h0/rankexec.py", line 76 in _orch_rank
  File "/job/run/host-h0/rankexec.py", line 80 in <module>
"""

DUMP_ASLEEP = """\
Current thread 0x00007f0000000002 (most recent call first):
  File "/job/code/job.py", line 11 in train_step
  File "/job/code/job.py", line 30 in <module>
  File "/job/run/host-127.0.0.1/rankexec.py", line 76 in _orch_rank
  File "/job/run/host-127.0.0.1/rankexec.py", line 80 in <module>
"""


def test_threads_are_parsed_and_the_main_thread_found() -> None:
    found = threads(DUMP_MAIN_IN_ALL_REDUCE)
    assert [len(frames) for _, frames in found] == [2, 6]
    main = main_thread(DUMP_MAIN_IN_ALL_REDUCE)
    assert main[0].func == "all_reduce" and main[0].short() == "all_reduce (distributed_c10d.py:2050)"
    # the signal taken by another thread: the main one is still the one with module code
    swapped = DUMP_MAIN_IN_ALL_REDUCE.replace("Current thread", "Thread").replace(
        "Thread 0x00007f0000000001", "Current thread 0x00007f0000000001")
    assert main_thread(swapped)[0].func == "all_reduce"
    assert main_thread("") == [] and main_thread("garbage\n  no frames\n") == []


def stack(rank: int, state: str = "answered", text: str = "", host: int = 0) -> RankStack:
    reply = {"ranks": [{"rank": rank, "state": state, "pid": 10 + rank, "stack": text}]}
    return rank_stacks({host: HostStacks.of(reply)})[rank]


def hang(idle: tuple[int, ...] = (0, 1, 2), everyone: bool = True) -> Hang:
    return Hang(idle, 12.0, everyone, 10.0)


def test_a_stopped_rank_is_the_culprit_whatever_the_others_show() -> None:
    stacks = {0: stack(0, text=DUMP_MAIN_IN_ALL_REDUCE), 1: stack(1, "stopped"),
              2: stack(2, "disk-wait"), 3: stack(3, "exited")}
    found = culprits(hang(), stacks)
    assert set(found.why) == {1, 2}
    assert found.why[1].startswith("stopped") and "uninterruptible" in found.why[2]


def test_the_rank_not_where_the_others_are_is_named() -> None:
    stacks = {0: stack(0, text=DUMP_MAIN_IN_ALL_REDUCE), 1: stack(1, text=DUMP_ASLEEP),
              2: stack(2, text=DUMP_MAIN_IN_ALL_REDUCE)}
    found = culprits(hang(), stacks)
    assert list(found.why) == [1]
    assert found.why[1] == ("in train_step (job.py:11) while 2 other ranks are in "
                            "all_reduce (distributed_c10d.py:2050)")
    assert places(stacks) == ["ranks 0, 2: all_reduce (distributed_c10d.py:2050)",
                              "rank 1: train_step (job.py:11)"]


def test_two_ranks_one_waiting_in_a_collective_the_other_is_named() -> None:
    stacks = {0: stack(0, text=DUMP_MAIN_IN_ALL_REDUCE), 1: stack(1, text=DUMP_ASLEEP)}
    assert list(culprits(hang((0, 1)), stacks).why) == [1]


def test_every_rank_in_one_place_names_none_unless_some_went_on() -> None:
    stacks = {r: stack(r, text=DUMP_MAIN_IN_ALL_REDUCE) for r in range(3)}
    assert culprits(hang(), stacks).why == {}
    found = culprits(hang((2,), everyone=False), stacks)
    assert list(found.why) == [2] and "while the others went on" in found.why[2]


def test_a_rank_that_does_not_answer_while_others_do_is_named() -> None:
    stacks = {0: stack(0, text=DUMP_MAIN_IN_ALL_REDUCE), 1: stack(1, "no answer")}
    assert list(culprits(hang(), stacks).why) == [1]


def cluster3(tmp_path: Path) -> Cluster:
    path = tmp_path / "cluster.yaml"
    path.write_text("name: demo\nhosts:\n  - address: h0\n    procs: 2\n"
                    "  - address: 127.0.0.1\n"
                    "job:\n  entrypoint: worker.train\n  hang_timeout: 10\n")
    return load(path)


def test_the_report_names_the_culprit_with_its_stack(tmp_path: Path) -> None:
    cluster = cluster3(tmp_path)
    stacks = {0: stack(0, text=DUMP_MAIN_IN_ALL_REDUCE), 1: stack(1, text=DUMP_MAIN_IN_ALL_REDUCE),
              2: stack(2, text=DUMP_ASLEEP, host=1)}
    report = HangReport(hang(), stacks, culprits(hang(), stacks),
                        ("127.0.0.1: /j/run/host-127.0.0.1/nccl-trace-rank-2",))
    text = hang_text(cluster, hang_event(cluster, report))
    assert "no rank made progress (output or heartbeat) for 12 s (hang_timeout 10 s)" in text
    assert "root cause rank 2 on host 127.0.0.1 (local rank 0): in train_step" in text
    assert 'File "/job/code/job.py", line 11 in train_step' in text
    assert "_orch_rank" not in text and "rankexec.py" not in text   # orch's own frames
    assert "NCCL flight recorder dump: 127.0.0.1: /j/run/host-127.0.0.1/nccl-trace-rank-2" in text
    assert "--rank 2`" in text
    none = hang_text(cluster, hang_event(cluster, HangReport(hang(), {}, culprits(hang(), {}))))
    assert "no rank stands out" in none


# ---------------------------------------------------------------- settings

def test_hang_timeout_is_read_and_checked_with_its_line(tmp_path: Path) -> None:
    assert cluster3(tmp_path).job.hang_timeout == 10.0
    path = tmp_path / "bad.yaml"
    base = "name: demo\nhosts: [{address: localhost, connection: local}]\njob:\n  entrypoint: w\n"
    for value in ("0", "-3", "soon", "true"):
        path.write_text(base + f"  hang_timeout: {value}\n")
        with pytest.raises(InventoryError, match=r"bad.yaml:5: `job.hang_timeout` must be a "
                                                 r"number of seconds above 0"):
            load(path)
    path.write_text(base + "  hang_timeout: 5\n  array: {matrix: {fold: [0, 1]}}\n")
    with pytest.raises(InventoryError, match=r"bad.yaml:5: `job.hang_timeout` watches the ranks"):
        load(path)
    path.write_text(base)
    assert load(path).job.hang_timeout is None


def test_the_flag_overrides_the_inventory(tmp_path: Path) -> None:
    cluster = cluster3(tmp_path)
    assert with_hang_timeout(cluster, None) is cluster
    assert with_hang_timeout(cluster, 2.5).job.hang_timeout == 2.5
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="--hang-timeout must be a number of seconds"):
            with_hang_timeout(cluster, bad)


def test_gpu_hosts_get_the_nccl_flight_recorder_unless_the_job_sets_it(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("name: demo\nhosts:\n  - {address: a, gpus: 2}\n  - {address: b}\n"
                    "job:\n  entrypoint: w\n  env: {TORCH_NCCL_TRACE_BUFFER_SIZE: '50'}\n")
    cluster = load(path)
    gpu = rank_env(cluster, cluster.hosts[0], "/j", "id")
    assert gpu["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and gpu["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert gpu["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/j/run/host-a/nccl-trace-rank-"
    cpu = rank_env(cluster, cluster.hosts[1], "/j", "id")
    assert not any(k.startswith("TORCH_NCCL_") for k in cpu if k != "TORCH_NCCL_TRACE_BUFFER_SIZE")


# ---------------------------------------------------------------- the wire

def test_a_stacks_reply_over_its_caps_is_refused() -> None:
    schema = protocol.REPLIES["stacks"]
    ok = {"ranks": [{"rank": 0, "state": "answered", "pid": 5, "stack": "x"}],
          "nccl_dumps": [], "time": 1.0}
    protocol.check(ok, schema, "stacks")
    big = dict(ok, ranks=[{"rank": 0, "state": "answered", "pid": 5,
                           "stack": "x" * (protocol.MAX_STACK + 1)}])
    with pytest.raises(protocol.ProtocolError, match="stack limits"):
        protocol.check(big, schema, "stacks")
    with pytest.raises(protocol.ProtocolError, match="at most 64 names"):
        protocol.check(dict(ok, nccl_dumps=["n"] * 65), schema, "stacks")
    with pytest.raises(protocol.ProtocolError):
        protocol.check({"ranks": ["x"]}, protocol.EVENTS["progress"], "progress")


# ---------------------------------------------------------------- the host side

def job_folder(tmp_path: Path) -> JobDir:
    for d in ("run", "logs"):
        (tmp_path / "job" / d).mkdir(parents=True)
    return JobDir(str(tmp_path / "job"))


def test_heartbeat_files_report_the_ranks_that_touched_them(tmp_path: Path) -> None:
    jd = job_folder(tmp_path)
    run = tmp_path / "job" / "run"
    for r in (0, 1):
        (run / f"heartbeat-{r}").touch()
    rundir = agent_follow.RunDir(jd)
    try:
        beats = agent_follow.Heartbeats(rundir, [0, 1, 2])
        assert beats.touched() == []          # the first look only records
        os.utime(run / "heartbeat-1", ns=(1, time.time_ns() + 10**9))
        assert beats.touched() == []          # not yet time for another look
        beats.checked = 0.0
        assert beats.touched() == [1]
        beats.checked = 0.0
        assert beats.touched() == []
    finally:
        rundir.close()


CHILD = """\
import sys, time
def waiting_here():
    print("ready", flush=True)
    time.sleep(60)
waiting_here()
"""


def rank_process(tmp_path: Path, rank: int) -> subprocess.Popen:
    """A rank as torchrun starts it under orch (run/rankexec.py, then the script), and
    its pid record (the launcher's)."""
    run = tmp_path / "job" / "run"
    (tmp_path / f"r{rank}.py").write_text(CHILD)
    proc = subprocess.Popen([sys.executable, "-u", rankexec.__file__, str(tmp_path / "job"),
                             "script", str(tmp_path / f"r{rank}.py")],
                            env=dict(os.environ, RANK=str(rank)))
    log = tmp_path / "job" / "logs" / f"rank-{rank}.log"
    wait_until(lambda: log.exists() and log.read_bytes() == b"ready\n", 30, "the rank ready")
    (run / f"rank-{rank}.pid").write_text(json.dumps(
        {"pid": proc.pid, "start_ticks": proc_start_time(proc.pid), "time": time.time()}))
    return proc


def test_the_host_takes_each_ranks_stack_or_says_why_not(tmp_path: Path) -> None:
    job_folder(tmp_path)
    procs = [rank_process(tmp_path, r) for r in (0, 1)]
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs.append(plain)   # rank 3: no SIGUSR2 handler (it would die of the signal)
    (tmp_path / "job" / "run" / "rank-3.pid").write_text(json.dumps(
        {"pid": plain.pid, "start_ticks": proc_start_time(plain.pid), "time": time.time()}))
    os.kill(procs[1].pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10   # the stop lands asynchronously
    while (stat_fields(procs[1].pid) or ["?"])[0] != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        req = SimpleNamespace(args={"job_dir": str(tmp_path / "job"), "ranks": [0, 1, 2, 3],
                                    "reason": "hang: test"})
        reply = agent_stacks.run(req)  # type: ignore[arg-type]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    protocol.check(reply, protocol.REPLIES["stacks"], "stacks")
    by_rank = {e["rank"]: e for e in reply["ranks"]}
    assert by_rank[0]["state"] == "answered" and "in waiting_here" in by_rank[0]["stack"]
    assert main_thread(by_rank[0]["stack"])[0].func == "waiting_here"
    assert by_rank[1]["state"] == "stopped" and by_rank[1]["stack"] == ""
    assert by_rank[2]["state"] == "gone"
    assert by_rank[3]["state"] == "no answer" and procs[2].returncode == -signal.SIGKILL
    log0 = (tmp_path / "job" / "logs" / "rank-0.log").read_text()
    assert log0.startswith("ready\norch: hang: test; the stack of rank 0 (pid ")
    assert "in waiting_here" in log0
    log1 = (tmp_path / "job" / "logs" / "rank-1.log").read_text()
    assert log1 == f"ready\norch: hang: test; rank 1 (pid {procs[1].pid}) gave no stack: stopped\n"
    assert procs[0].returncode == -signal.SIGKILL   # SIGUSR2 did not end it


def test_the_dry_run_says_hangs_are_watched(tmp_path: Path) -> None:
    plan = dry_run_plan(cluster3(tmp_path))
    assert "hang watch: a rank without output or heartbeat for 10 s" in plan
    assert "ORCH_HEARTBEAT" in plan


def test_worker_train_touches_its_heartbeat_at_most_every_two_seconds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.train import Heartbeat
    beat_file = tmp_path / "heartbeat-0"
    beat_file.touch()
    os.utime(beat_file, (1, 1))
    monkeypatch.setenv("ORCH_HEARTBEAT", str(beat_file))
    beat = Heartbeat()
    beat()
    assert beat_file.stat().st_mtime > 1
    os.utime(beat_file, (1, 1))
    beat()                                   # within EVERY of the last touch: nothing
    assert beat_file.stat().st_mtime == 1
    beat_file.unlink()
    beat.last = 0.0
    beat()                                   # gone: no error, and no more tries
    assert beat.path is None
    monkeypatch.delenv("ORCH_HEARTBEAT")
    Heartbeat()()                            # not under orch: nothing to touch
