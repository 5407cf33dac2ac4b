"""The controller's logic through the fake transport (tests/fake_agent.FakeCluster): the
commands as a user runs them (`orch up`, `orch stop`, restarts, GPU claims), every host an
in-process agent behind the real Link. Fail-fast with several failures, a host lost in
each phase, Ctrl-C during the launch, a stop that one host does not answer, the restart
loop's decisions, the controller's side of GPU claims. No SSH, no process, no real wait
beyond a few hundred milliseconds."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fake_agent import FakeChannel, FakeCluster, ignore, lose, preflight_body
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


def launched(fake: FakeCluster) -> dict[str, list[int]]:
    """Each host's launched ranks, by label."""
    return {m["spec"]["env"]["ORCH_JOB_DIR"]: m["spec"]["ranks"]
            for m in fake.requests("launch")}


# ---------------------------------------------------------------- fail-fast


def test_fail_fast_with_failures_on_several_hosts_names_the_earliest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Ranks 1, 3 and 4 fail on three hosts at once; rank 1 failed first (its exit time)
    but its event comes last. Every host is stopped once; rank 1 is the root cause and
    the two others are listed after it."""
    codes = {1: 7, 3: -6, 4: 1}
    fake = FakeCluster(lambda label, rank, env: codes.get(rank)).install(monkeypatch)
    now = time.time()
    fake.exit_times = {1: now - 0.3, 3: now - 0.2, 4: now - 0.1}
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
    assert "started job" not in err and not fake.requests("follow")
    others = [h for h in HOSTS if h != lost]
    if phase == "launch":
        # the others started, and were stopped at once (grace 0)
        assert fake.asked("launch") == dict.fromkeys(HOSTS, 1)
        assert fake.asked("stop") == dict.fromkeys(others, 1), fake.log
        assert all(m["grace"] == 0 for m in fake.requests("stop"))
    else:
        assert not fake.requests("launch") and not fake.requests("stop"), fake.log
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


@contextlib.contextmanager
def sigint_raises() -> Iterator[None]:
    """Ctrl-C as in a terminal (a test runner's worker may ignore SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


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
        fault) -> None:
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
