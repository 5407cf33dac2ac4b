"""The controller's logic through the fake transport (tests/fake_agent.FakeCluster): the
commands as a user runs them (`orch up`, `orch stop`, restarts, GPU claims), every host an
in-process agent behind the real Link. Fail-fast with several failures, a host lost in
each phase, Ctrl-C during the launch, a stop that one host does not answer, the restart
loop's decisions, the controller's side of GPU claims. No SSH, no process, no real wait
beyond a few hundred milliseconds."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import fake_agent
from fake_agent import FakeChannel, FakeCluster, Handler, ignore, lose, preflight_body
from helpers import sigint_raises
from orchestrator import cli
from orchestrator.api import healing
from orchestrator.errors import EXIT_HOST, EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK
from orchestrator.wire import protocol, timeouts

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
THREE = """name: fk
hosts:
  - {address: 127.0.0.1, connection: local, remote_dir: /r1, procs: 2}
  - {address: 127.0.0.2, connection: local, remote_dir: /r2, procs: 2}
  - {address: 127.0.0.3, connection: local, remote_dir: /r3, procs: 2}
code: {paths: [job.py]}
job: {entrypoint: job.py}
"""


def inventory(tmp_path: Path, text: str = THREE) -> str:
    (tmp_path / "job.py").write_text("print('hi')\n")
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return str(path)


def orch(*argv: str) -> int:
    """The CLI as a user runs it; the signal handlers it installs are put back after."""
    kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return cli.cli(list(argv))
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)


def flat(capsys: pytest.CaptureFixture[str]) -> str:
    return " ".join(capsys.readouterr().err.split())


# ---------------------------------------------------------------- fail-fast


def test_fail_fast_with_failures_on_several_hosts_names_the_earliest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Ranks 1, 3 and 4 fail on three hosts at once; rank 1 failed first (its exit time)
    but its event comes last. Every host is stopped once; rank 1 is the root cause and
    the two others are listed after it."""
    codes = {1: 7, 3: -6, 4: 1}
    fake = FakeCluster(lambda label, rank, env: codes.get(rank)).install(monkeypatch)
    now = time.time()
    # a second apart: far beyond the clocks' uncertainty, even on a loaded machine
    fake.exit_times = {1: now - 3.0, 3: now - 2.0, 4: now - 1.0}
    fake.late = {1: 0.3}
    assert orch("up", "-c", inventory(tmp_path), "--no-pull") == EXIT_JOB_FAILED
    err = flat(capsys)
    assert fake.asked("stop") == dict.fromkeys(HOSTS, 1), fake.asked("stop")
    assert all(m["grace"] == timeouts.FAILFAST_GRACE for m in fake.requests("stop"))
    assert "root cause rank 1 on host 127.0.0.1 (local rank 1): exit code 7" in err, err
    assert "rank 3 on 127.0.0.2 (killed by SIGABRT)" in err, err
    assert "rank 4 on 127.0.0.3 (exit code 1)" in err, err
    assert err.index("rank 3 on 127.0.0.2") < err.index("rank 4 on 127.0.0.3"), err
    assert "stopped the job on every host" in err
    # the error file is asked of the root cause's host alone
    assert [m["ranks"] for m in fake.requests("status")] == [[1]]


# ---------------------------------------------------------------- a host lost in each phase

WITH_SETUP = THREE + "setup: {commands: ['pip install -r req.txt']}\n"


def lose_while_running(chan: FakeChannel, msg: dict) -> None:
    """The ranks print their first line, then the host's connection drops."""
    for r in msg["ranks"]:
        chan.push(protocol.output(r, b"rank %d up\n" % r))
    chan.close()


LOST_IN = {   # phase -> what `orch up` says of it
    "connect": "1 of 3 hosts failed preflight: - 127.0.0.2: connection refused",
    "preflight": "1 of 3 hosts failed preflight: - 127.0.0.2: the agent's connection ended",
    "sync": "failed to receive code or data: - 127.0.0.2: the agent's connection ended",
    "setup": "failed setup; nothing was started: - 127.0.0.2: the agent's connection ended",
    "launch": "1 of 3 hosts failed to start: - 127.0.0.2: the agent's connection ended"}


@pytest.mark.parametrize("phase", list(LOST_IN))
def test_a_host_lost_before_the_job_runs_starts_nothing_anywhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        phase: str) -> None:
    """127.0.0.2 gone in one phase: exit 3 with its name; no host runs anything: no
    launch before the launch, and at the launch every host that started is stopped."""
    fake = FakeCluster(lambda label, rank, env: None).install(monkeypatch)
    lost = HOSTS[1]
    request = {"preflight": "preflight", "sync": "receive", "setup": "setup",
               "launch": "launch"}.get(phase)
    if request is None:
        fake.down.add(lost)
    else:
        fake.on(request, lose, lost)
    text = WITH_SETUP if phase == "setup" else THREE
    assert orch("up", "-c", inventory(tmp_path, text), "--no-pull") == EXIT_HOST
    err = flat(capsys)
    assert LOST_IN[phase] in err and "Traceback" not in err, err
    assert "started job" not in err
    others = [h for h in HOSTS if h != lost]
    if phase == "launch":
        # the others started, and were stopped at once (grace 0); their follows, begun
        # as their launches were answered, were dropped (remote/early.py)
        assert fake.asked("launch") == dict.fromkeys(HOSTS, 1)
        assert set(fake.asked("follow")) <= set(others), fake.log
        assert fake.asked("stop") == dict.fromkeys(others, 1), fake.log
        assert all(m["grace"] == 0 for m in fake.requests("stop"))
    else:
        assert not fake.requests("launch") and not fake.requests("stop"), fake.log
        assert not fake.requests("follow")
    if phase in ("connect", "preflight"):   # all or nothing: nothing was pushed either
        assert not fake.requests("receive"), fake.log
    assert not (tmp_path / ".orch" / "fk" / "state.json").exists()


def test_a_host_lost_while_the_job_runs_is_the_root_cause_and_the_others_are_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 1 (the job failed; exit-codes.md: not 3), the lost host named as the cause and
    as NOT stopped with the `orch stop` that finishes; every other host stopped once."""
    fake = FakeCluster(lambda label, rank, env: None).install(monkeypatch)
    lost = HOSTS[1]
    fake.on("follow", lose_while_running, lost)
    path = inventory(tmp_path)
    assert orch("up", "-c", path, "--no-pull") == EXIT_JOB_FAILED
    err = flat(capsys)
    assert f"root cause host {lost}: it went silent before any rank failed" in err, err
    assert f"NOT stopped on {lost}" in err and f"`orch stop -c {path}`" in err, err
    assert fake.asked("stop") == {HOSTS[0]: 1, HOSTS[2]: 1}, fake.log


# ---------------------------------------------------------------- Ctrl-C during the launch


def test_ctrl_c_during_the_launch_stops_every_host_that_started(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C while 127.0.0.3's launch has no reply yet (test_interrupt_units covers an
    attached job's first and second Ctrl-C): exit 130, and every host is sent a kill
    (grace 0): the two that started, and the one whose start may still land."""
    fake = FakeCluster(lambda label, rank, env: None).install(monkeypatch)

    def press(chan: FakeChannel, msg: dict) -> None:
        os.kill(os.getpid(), signal.SIGINT)   # its reply never comes
    fake.on("launch", press, HOSTS[2])
    with sigint_raises():
        assert orch("up", "-c", inventory(tmp_path), "--no-pull") == EXIT_INTERRUPTED
    err = flat(capsys)
    assert "orch: interrupted" in err and "started job" not in err, err
    assert fake.asked("stop") == dict.fromkeys(HOSTS, 1), fake.log
    assert all(m["grace"] == 0 for m in fake.requests("stop"))
    assert not fake.requests("follow") and not fake.requests("pull_manifest")


# ---------------------------------------------------------------- orch stop, one host silent


@pytest.mark.parametrize("fault", [ignore, lose], ids=["no-answer", "lost-mid-stop"])
def test_a_stop_one_host_does_not_answer_stops_the_others_and_exits_3(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        fault: Handler) -> None:
    """127.0.0.2 takes the stop and never answers (its wait is grace + STOP_EXTRA), or
    drops its connection: the two others are stopped and said so; exit 3 with its ranks
    named as NOT stopped, and the `orch stop` that finishes."""
    monkeypatch.setattr(timeouts, "STOP_EXTRA", 0.3)
    fake = FakeCluster().install(monkeypatch)
    fake.on("stop", fault, HOSTS[1])
    path = inventory(tmp_path)
    assert orch("stop", "-c", path, "--grace", "0") == EXIT_HOST
    err = flat(capsys)
    assert fake.asked("stop") == dict.fromkeys(HOSTS, 1), fake.log
    for label in (HOSTS[0], HOSTS[2]):
        assert f"{label}: stopped 2 processes; verified none left" in err, err
    assert "1 of 3 hosts failed to stop: - 127.0.0.2: " in err, err
    assert "ranks 2-3 on 127.0.0.2 are NOT stopped and may still be running" in err, err
    assert f"`orch stop -c {path}` again finishes the stop" in err, err


# ---------------------------------------------------------------- restarts

SPARE = THREE.replace("code: ", "  - {address: 127.0.0.9, connection: local, remote_dir: /r9, "
                               "spare: true}\ncode: ")


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(healing, "backoff", lambda attempt: 0.0)


def lost_for_good(fake: FakeCluster, label: str) -> None:
    """`label` is lost while the job runs and cannot be reached again."""
    def gone(chan: FakeChannel, msg: dict) -> None:
        fake.down.add(label)
        lose_while_running(chan, msg)
    fake.on("follow", gone, label)


def attempts(fake: FakeCluster) -> list[dict[str, list[int]]]:
    """Per attempt (ORCH_RESTART_COUNT), each launched host's label -> ranks."""
    out: dict[int, dict[str, list[int]]] = {}
    for label, t, msg in list(fake.log):
        if t == "launch":
            env = msg["spec"]["env"]
            out.setdefault(int(env["ORCH_RESTART_COUNT"]), {})[label] = msg["spec"]["ranks"]
    return [out[k] for k in sorted(out)]


def test_a_failed_rank_restarts_the_whole_job_with_the_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_backoff: None) -> None:
    """Rank 3 fails in the first attempt only: every host is stopped once, then the whole
    job starts again on the same hosts with ORCH_RESTART_COUNT=1, and succeeds."""
    fake = FakeCluster(lambda label, rank, env: (
        3 if rank == 3 and env["ORCH_RESTART_COUNT"] == "0" else
        None if env["ORCH_RESTART_COUNT"] == "0" else 0)).install(monkeypatch)
    assert orch("up", "-c", inventory(tmp_path), "--restarts", "2", "--no-pull") == EXIT_OK
    err = flat(capsys)
    whole = {h: [2 * i, 2 * i + 1] for i, h in enumerate(HOSTS)}
    assert attempts(fake) == [whole, whole], fake.log
    assert fake.asked("stop") == dict.fromkeys(HOSTS, 1)
    assert "restart 1 of 2 in 0 s after: rank 3 on 127.0.0.2 failed (exit code 3)" in err, err
    assert "attempt 2 of 3 (ORCH_RESTART_COUNT=1)" in err and "finished: all 6 ranks" in err


def test_a_lost_host_is_replaced_by_the_spare_which_takes_its_ranks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_backoff: None) -> None:
    """127.0.0.2 is lost while the first attempt runs: the restart runs on 127.0.0.1,
    the spare (ranks 2-3, node rank 1) and 127.0.0.3. The lost host cannot be reached
    again (the restart's check that the last run's hosts run nothing does not hold it
    up), and was asked nothing after it was lost."""
    fake = FakeCluster(lambda label, rank, env: (
        None if env["ORCH_RESTART_COUNT"] == "0" else 0)).install(monkeypatch)
    lost_for_good(fake, HOSTS[1])
    assert orch("up", "-c", inventory(tmp_path, SPARE), "--restarts", "1", "--no-pull") == EXIT_OK
    err = flat(capsys)
    first, second = attempts(fake)
    assert first == {HOSTS[0]: [0, 1], HOSTS[1]: [2, 3], HOSTS[2]: [4, 5]}
    assert second == {HOSTS[0]: [0, 1], "127.0.0.9": [2, 3], HOSTS[2]: [4, 5]}
    spare_launch = fake.requests("launch", "127.0.0.9")[0]["spec"]["argv"]
    assert "--node-rank" in spare_launch and spare_launch[spare_launch.index("--node-rank") + 1] == "1"
    lost_at = max(i for i, (label, _, _) in enumerate(fake.log) if label == HOSTS[1])
    assert fake.log[lost_at][1] == "follow", fake.log   # nothing after it was lost
    assert fake.tried.count(HOSTS[1]) == 1, fake.tried   # not even a connection tried
    assert "restart 1 of 1 in 0 s after: host 127.0.0.2 went silent; hosts: 127.0.0.1, " \
           "127.0.0.9, 127.0.0.3" in err, err


def test_a_host_unreachable_at_the_restarts_preflight_is_replaced_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_backoff: None) -> None:
    """Rank 4 fails; by the restart 127.0.0.2 refuses connections: that preflight fails,
    which counts as the host lost (not the run's end); the next attempt has the spare."""
    fake = FakeCluster()

    def ranks(label: str, rank: int, env: dict) -> int | None:
        if env["ORCH_RESTART_COUNT"] != "0":
            return 0
        if rank == 4:
            fake.down.add(HOSTS[1])
            return 1
        return None
    fake.ranks = ranks
    fake.install(monkeypatch)
    assert orch("up", "-c", inventory(tmp_path, SPARE), "--restarts", "2", "--no-pull") == EXIT_OK
    err = flat(capsys)
    assert "restart 2 of 2 in 0 s after: preflight failed on 127.0.0.2" in err, err
    runs = attempts(fake)
    assert len(runs) == 2 and runs[1] == {HOSTS[0]: [0, 1], "127.0.0.9": [2, 3],
                                          HOSTS[2]: [4, 5]}, runs
    spare = fake.requests("launch", "127.0.0.9")[0]["spec"]["env"]
    assert spare["ORCH_RESTART_COUNT"] == "2"   # the attempt that never started counts


def test_a_restart_refused_by_a_host_that_answers_tries_it_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_backoff: None) -> None:
    """Rank 4 fails; at the restart 127.0.0.2 answers preflight but refuses the launch
    once (its last attempt's processes still ending on a loaded host). It is reached, so
    not lost: a strike, the error said, and the next attempt runs on the same hosts,
    the spare left idle."""
    fake = FakeCluster()
    refused: list[int] = []

    def ranks(label: str, rank: int, env: dict) -> int | None:
        return 1 if rank == 4 and env["ORCH_RESTART_COUNT"] == "0" else 0

    def launch_once_refused(chan: FakeChannel, msg: dict) -> None:
        if msg["spec"]["env"]["ORCH_RESTART_COUNT"] == "1" and not refused:
            refused.append(1)
            chan.push(protocol.error(msg["id"], protocol.USAGE, "already running"))
            return
        fake_agent.launch(chan, msg)
    fake.ranks = ranks
    fake.on("launch", launch_once_refused, HOSTS[1])
    fake.install(monkeypatch)
    assert orch("up", "-c", inventory(tmp_path, SPARE), "--restarts", "2", "--no-pull") == EXIT_OK
    err = flat(capsys)
    assert "attempt 2 could not start:" in err and "already running" in err, err
    assert "restart 2 of 2 in 0 s after: the start failed on 127.0.0.2; hosts: 127.0.0.1, " \
           "127.0.0.2, 127.0.0.3" in err, err
    assert not fake.requests("launch", "127.0.0.9"), "the spare was not needed"


def test_without_a_spare_min_hosts_lets_the_run_go_on_with_fewer_hosts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_backoff: None) -> None:
    """No spare, job.min_hosts 2: the lost host is dropped, the world size shrinks to 4
    and the hosts are numbered again (127.0.0.3 is node rank 1 with ranks 2-3)."""
    text = THREE.replace("job: {entrypoint: job.py}", "job: {entrypoint: job.py, min_hosts: 2}")
    fake = FakeCluster(lambda label, rank, env: (
        None if env["ORCH_RESTART_COUNT"] == "0" else 0)).install(monkeypatch)
    lost_for_good(fake, HOSTS[1])
    assert orch("up", "-c", inventory(tmp_path, text), "--restarts", "1", "--no-pull") == EXIT_OK
    err = flat(capsys)
    assert attempts(fake)[1] == {HOSTS[0]: [0, 1], HOSTS[2]: [2, 3]}, fake.log
    argv = fake.requests("launch", HOSTS[2])[-1]["spec"]["argv"]
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == "1"
    assert "finished: all 4 ranks exited 0" in err, err


def test_a_host_failing_twice_is_left_out_and_the_spare_takes_its_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_backoff: None) -> None:
    """Rank 4 on 127.0.0.3 fails in attempts 1 and 2: the first strike keeps the host, the
    second leaves it out; the third attempt runs on the spare and succeeds."""
    def ranks(label: str, rank: int, env: dict) -> int | None:
        if env["ORCH_RESTART_COUNT"] == "2":
            return 0
        return 1 if rank == 4 else None
    fake = FakeCluster(ranks).install(monkeypatch)
    assert orch("up", "-c", inventory(tmp_path, SPARE), "--restarts", "3", "--no-pull") == EXIT_OK
    runs = attempts(fake)
    assert [sorted(a) for a in runs] == [sorted(HOSTS), sorted(HOSTS),
                                         sorted([HOSTS[0], HOSTS[1], "127.0.0.9"])], runs
    assert runs[2]["127.0.0.9"] == [4, 5]
    err = flat(capsys)
    assert err.count("after: rank 4 on 127.0.0.3 failed (exit code 1)") == 2, err


def test_no_restart_left_ends_with_the_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_backoff: None) -> None:
    """Rank 0 fails in every attempt: one restart, then exit 1 with the reason."""
    fake = FakeCluster(lambda label, rank, env: 2 if rank == 0 else None).install(monkeypatch)
    assert orch("up", "-c", inventory(tmp_path), "--restarts", "1",
                "--no-pull") == EXIT_JOB_FAILED
    err = flat(capsys)
    assert len(attempts(fake)) == 2 and "no restart left (1 made)" in err, err
    assert fake.asked("stop") == dict.fromkeys(HOSTS, 2)


# ---------------------------------------------------------------- GPU claims

GPUS = """name: fk
hosts:
  - {address: 127.0.0.1, connection: local, remote_dir: /r1, gpus: all}
  - {address: 127.0.0.2, connection: local, remote_dir: /r2, gpus: 2}
code: {paths: [job.py]}
job: {entrypoint: job.py}
"""


def gpu(index: int, holder: dict | None) -> dict:
    return {"index": index, "uuid": f"GPU-{index}", "name": "Fake GPU", "util": 0,
            "mem_used": 0, "mem_total": 80, "holder": holder, "procs": []}


def claims(taken: dict[str, list[int]], busy: dict[str, list[dict]] | None = None) -> Handler:
    """A preflight whose GPU claim takes `taken[label]`, or finds `busy[label]`."""
    def answer(chan: FakeChannel, msg: dict) -> None:
        label = chan.host.label
        if busy and label in busy:
            extra = {"gpus": len(busy[label]), "gpu_busy": busy[label]}
        else:
            extra = {"gpus": 4, "gpu_ids": taken[label],
                     "gpu_uuids": [f"GPU-{i}" for i in range(4)]}
        chan.push(protocol.reply(msg["id"], preflight_body(chan, msg, **extra)))
    return answer


def test_busy_gpus_are_refused_with_every_holder_and_nothing_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """127.0.0.2 asks for 2 GPUs; one is another job's, one a process no claim covers:
    exit 3 naming both holders and the fixes; nothing pushed or started anywhere."""
    busy = [gpu(0, {"job": "theirs", "user": "bob"}),
            gpu(1, {"pids": [{"pid": 77, "user": "carol"}]}), gpu(2, None)]
    fake = FakeCluster().install(monkeypatch)
    fake.on("preflight", claims({HOSTS[0]: [0, 1]}, {HOSTS[1]: busy}))
    assert orch("up", "-c", inventory(tmp_path, GPUS), "--no-pull") == EXIT_HOST
    err = flat(capsys)
    assert ("127.0.0.2: 2 GPUs asked for, 1 of 3 free: GPU 0 held by job 'theirs' (user bob); "
            "GPU 1 held by pid 77 (user carol), not an orch job") in err, err
    assert "--wait" in err and "--exclude 127.0.0.2" in err, err
    asked = {label: m.get("gpus") for label, t, m in fake.log if t == "preflight"}
    assert asked == {HOSTS[0]: "all", HOSTS[1]: 2}, asked   # each claim as the inventory says
    assert not fake.requests("receive") and not fake.requests("launch"), fake.log


def test_gpus_all_lays_the_world_out_from_the_claims(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`gpus: all` on 127.0.0.1 gets GPUs 0, 2 and 3 (GPU 1 is another job's): three ranks
    there, two on 127.0.0.2 (GPUs 1, 3): world size 5, each host's ranks see only its
    claimed GPUs (CUDA_VISIBLE_DEVICES in the launch's environment)."""
    fake = FakeCluster().install(monkeypatch)
    fake.on("preflight", claims({HOSTS[0]: [0, 2, 3], HOSTS[1]: [1, 3]}))
    assert orch("up", "-c", inventory(tmp_path, GPUS), "--no-pull") == EXIT_OK
    err = flat(capsys)
    specs = {label: m["spec"] for label, t, m in fake.log if t == "launch"}
    assert specs[HOSTS[0]]["ranks"] == [0, 1, 2] and specs[HOSTS[1]]["ranks"] == [3, 4]
    assert specs[HOSTS[0]]["env"]["CUDA_VISIBLE_DEVICES"] == "0,2,3"
    assert specs[HOSTS[1]]["env"]["CUDA_VISIBLE_DEVICES"] == "1,3"
    argv = specs[HOSTS[1]]["argv"]
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert "gpus: claimed for the job's life: 127.0.0.1 GPUs 0,2,3; 127.0.0.2 GPUs 1,3" in err
    assert "started job 'fk' on 2 hosts (5 ranks" in err and "all 5 ranks exited 0" in err, err


def test_up_wait_queues_for_busy_gpus_then_starts_on_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`--wait`: 127.0.0.2's GPUs are busy at preflight. Every claim is let go and taken
    again host after host; 127.0.0.2's first claim is still refused (the holder said),
    its second takes GPUs 2, 3, which its ranks then see."""
    busy = [gpu(0, {"job": "theirs", "user": "bob"}), gpu(1, {"job": "theirs", "user": "bob"}),
            gpu(2, None), gpu(3, None)]
    fake = FakeCluster().install(monkeypatch)
    fake.on("preflight", claims({HOSTS[0]: [0, 1, 2, 3]}, {HOSTS[1]: busy[:2]}))
    tries: list[str] = []

    def claim(chan: FakeChannel, msg: dict) -> None:
        tries.append(chan.host.label)
        if chan.host.label == HOSTS[1] and tries.count(HOSTS[1]) == 1:
            body: dict = {"busy": busy[:2]}
        else:
            body = {"ids": [0, 1, 2, 3] if chan.host.label == HOSTS[0] else [2, 3]}
        chan.push(protocol.reply(msg["id"], body))
    fake.on("gpu_claim", claim)
    assert orch("up", "-c", inventory(tmp_path, GPUS), "--wait", "--no-pull") == EXIT_OK
    err = flat(capsys)
    assert fake.asked("gpu_release") == dict.fromkeys(HOSTS[:2], 1)
    assert tries == [HOSTS[0], HOSTS[1], HOSTS[1]], tries   # one order: no deadlock
    assert "held by job 'theirs' (user bob)" in err, err
    spec = fake.requests("launch", HOSTS[1])[0]["spec"]
    assert spec["env"]["CUDA_VISIBLE_DEVICES"] == "2,3" and spec["ranks"] == [4, 5]
