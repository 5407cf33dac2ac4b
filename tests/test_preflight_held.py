"""`orch up` refused at preflight on the fake transport (tests/fake_agent.FakeCluster):
where another `up` of the job holds the job folder's lock and no process of the job
lives (`held`), the refusal names that `up` and its end, not "already running" with
`orch stop` (which cannot end it); a host where the job runs still reads "already
running". Exit 2 either way, nothing pushed or launched."""
from __future__ import annotations

from pathlib import Path

import pytest

from fake_agent import FakeChannel, FakeCluster, Handler, preflight_body
from orchestrator import cli
from orchestrator.errors import EXIT_USAGE
from orchestrator.wire import protocol, timeouts

TWO = """name: fk
hosts:
  - {address: 127.0.0.1, connection: local, remote_dir: /r1}
  - {address: 127.0.0.2, connection: local, remote_dir: /r2}
code: {paths: [job.py]}
job: {entrypoint: job.py}
"""


def inventory(tmp_path: Path) -> str:
    (tmp_path / "job.py").write_text("print('hi')\n")
    path = tmp_path / "cluster.yaml"
    path.write_text(TWO)
    return str(path)


def busy(**extra: bool) -> Handler:
    def answer(chan: FakeChannel, msg: dict) -> None:
        chan.push(protocol.reply(msg["id"], preflight_body(chan, msg, running=True, **extra)))
    return answer


def up(tmp_path: Path, fake: FakeCluster, capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.cli(["up", "-c", inventory(tmp_path), "--no-pull"]) == EXIT_USAGE
    assert not fake.requests("receive") and not fake.requests("launch"), fake.log
    return " ".join(capsys.readouterr().err.split())


def test_a_held_job_folder_names_the_other_up_and_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeCluster().install(monkeypatch)
    fake.on("preflight", busy(held=True), "127.0.0.2")
    err = up(tmp_path, fake, capsys)
    idle = f"{timeouts.RECEIVE_IDLE:g} s"
    assert ("job 'fk': another `orch up` of it holds its job folder on 127.0.0.2: one still "
            "preparing it there, or an earlier one whose connection was cut (its agent there "
            f"gives up after {idle} without data)") in err, err
    assert f"wait for that `orch up` to end (a cut one's agent: {idle})" in err, err
    assert "`orch stop` does not end it" in err and "already running" not in err, err
    assert "127.0.0.1" not in err, err


def test_a_running_host_still_reads_already_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeCluster().install(monkeypatch)
    fake.on("preflight", busy(), "127.0.0.1")
    fake.on("preflight", busy(held=True), "127.0.0.2")
    err = up(tmp_path, fake, capsys)
    assert "job 'fk' is already running on 127.0.0.1 " in err, err
    assert "orch stop" in err and "127.0.0.2" not in err, err
