"""`orch up`'s output pinned byte for byte (tests/golden/up-*.txt) on a fake cluster
(tests/fake_agent.FakeCluster): a success, a rank failure, a lost host, a hang, a restart
on a spare. Only what varies from run to run is masked: durations, the temporary folder.
The ranks' lines on stdout come from one thread per host, so their order between hosts
is not pinned: stdout is compared as sorted lines. `UPDATE_GOLDEN=1` writes the files."""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from fake_agent import FakeChannel, FakeCluster
from orchestrator.api import healing
from orchestrator.errors import EXIT_JOB_FAILED, EXIT_OK
from orchestrator.wire import protocol
from test_controller_fake import SPARE, THREE, inventory, lose_while_running, lost_for_good, orch

GOLDEN = Path(__file__).parent / "golden"
HANG = THREE.replace("job: {entrypoint: job.py}", "job: {entrypoint: job.py, hang_timeout: 1}")
IN_ALL_REDUCE = """Current thread 0x1 (most recent call first):
  File "/v/torch/distributed/distributed_c10d.py", line 2050 in all_reduce
  File "/j/code/job.py", line 14 in train_step
"""
ASLEEP = """Current thread 0x1 (most recent call first):
  File "/j/code/job.py", line 11 in train_step
"""


def masked(text: str, tmp_path: Path) -> str:
    text = text.replace(str(tmp_path), "<tmp>")
    text = re.sub(r"\b\d+(\.\d+)? (s|ms)\b", r"<n> \2", text)
    return re.sub(r"run/host-\S+/", "run/<part>/", text)


def floated(err: str) -> str:
    """The spares' line comes from their own thread, any time before the restart's line:
    it is pinned after the rest."""
    lines = err.splitlines(keepends=True)
    spares = [x for x in lines if x.startswith("spares ready")]
    if not spares:
        return err
    restart = next(i for i, x in enumerate(lines) if x.startswith("restart 1 of"))
    assert lines.index(spares[0]) < restart, err
    return "".join(x for x in lines if x not in spares) + "--- from the spares' thread\n" \
        + "".join(spares)


def check(name: str, code: int, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out, err = capsys.readouterr()
    got = (f"exit {code}\n--- stderr\n{floated(masked(err, tmp_path))}--- stdout (sorted)\n"
           + "".join(sorted(masked(out, tmp_path).splitlines(keepends=True))))
    path = GOLDEN / f"up-{name}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(got)
    assert got == path.read_text(), got


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(healing, "backoff", lambda attempt: 0.0)


def test_success(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str]) -> None:
    FakeCluster().install(monkeypatch)
    code = orch("up", "-c", inventory(tmp_path))
    assert code == EXIT_OK
    check("success", code, capsys, tmp_path)


def test_rank_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      capsys: pytest.CaptureFixture[str]) -> None:
    FakeCluster(lambda label, rank, env: 3 if rank == 3 else None).install(monkeypatch)
    code = orch("up", "-c", inventory(tmp_path))
    assert code == EXIT_JOB_FAILED
    check("rank-failure", code, capsys, tmp_path)


def test_lost_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeCluster(lambda label, rank, env: None).install(monkeypatch)
    fake.on("follow", lose_while_running, "127.0.0.2")
    code = orch("up", "-c", inventory(tmp_path), "--no-pull")
    assert code == EXIT_JOB_FAILED
    check("lost-host", code, capsys, tmp_path)


def hung_follow(stopped: threading.Event):   # type: ignore[no-untyped-def]
    """Every rank prints one line, then none makes progress; beats go on until a stop."""
    def follow(chan: FakeChannel, msg: dict) -> None:
        for r in msg["ranks"]:
            chan.push(protocol.output(r, b"rank %d up\n" % r))

        def run() -> None:
            while not chan.stopped.wait(0.2):
                chan.push(protocol.event("beat", time=time.time()))
            for r in msg["ranks"]:
                chan.push(protocol.event("exit", rank=r, code=-15, time=time.time(),
                                         after_stop=True))
            chan.push(protocol.event("done", code=1))
        threading.Thread(target=run, daemon=True).start()
    return follow


def stacks(chan: FakeChannel, msg: dict) -> None:
    ranks = [{"rank": r, "state": "answered", "pid": 100 + r,
              "stack": ASLEEP if r == 3 else IN_ALL_REDUCE} for r in msg["ranks"]]
    dumps = ["nccl-trace-rank-3"] if 3 in msg["ranks"] else []
    chan.push(protocol.reply(msg["id"], {"ranks": ranks, "nccl_dumps": dumps,
                                         "time": time.time()}))


def test_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
              capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeCluster(lambda label, rank, env: None).install(monkeypatch)
    fake.on("follow", hung_follow(threading.Event())).on("stacks", stacks)
    code = orch("up", "-c", inventory(tmp_path, HANG), "--no-pull")
    assert code == EXIT_JOB_FAILED
    check("hang", code, capsys, tmp_path)


def test_restart_on_a_spare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str], no_backoff: None) -> None:
    fake = FakeCluster(lambda label, rank, env: (
        None if env["ORCH_RESTART_COUNT"] == "0" else 0)).install(monkeypatch)
    lost_for_good(fake, "127.0.0.2")
    code = orch("up", "-c", inventory(tmp_path, SPARE), "--restarts", "1", "--no-pull")
    assert code == EXIT_OK
    check("restart-spare", code, capsys, tmp_path)
