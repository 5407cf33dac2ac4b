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
