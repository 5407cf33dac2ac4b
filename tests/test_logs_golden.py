"""`orch logs -f`'s output pinned byte for byte (tests/golden/logs-f-*.txt) on a fake
cluster (tests/fake_agent.FakeCluster), a job started with `up --detach` and then
followed: a success, a rank failure, a host lost while followed, a host not reached,
a rank's line that is not UTF-8 and carries a control sequence. The ranks' lines come
from one thread per host, so their order between hosts is not pinned: stdout is compared
as sorted lines, bytes that are not UTF-8 shown escaped. `UPDATE_GOLDEN=1` writes the files."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fake_agent import FakeChannel, FakeCluster
from orchestrator.api import reading
from orchestrator.errors import EXIT_HOST, EXIT_OK
from orchestrator.wire import protocol
from test_controller_fake import inventory, lose_while_running, orch
from test_up_golden import masked

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(autouse=True)
def events_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The files were written by the line sink's `logs -f` (api.reading.follow_logs);
    they are now matched by the reader of api.following's events, and by it alone."""
    def line_sink(*args: object, **kwargs: object) -> None:
        raise AssertionError("logs -f read through the line sink, not the events")
    monkeypatch.setattr(reading, "follow_logs", line_sink)


def followed(tmp_path: Path, fake: FakeCluster, capsysbinary: pytest.CaptureFixture[bytes],
             *extra: str) -> int:
    """`orch logs -f` of a job started detached; what `up` printed is left out."""
    inv = inventory(tmp_path)
    assert orch("up", "-c", inv, "--detach") == EXIT_OK
    capsysbinary.readouterr()
    return orch("logs", "-f", "-c", inv, *extra)


def check(name: str, code: int, capsysbinary: pytest.CaptureFixture[bytes], tmp_path: Path) -> None:
    raw_out, raw_err = capsysbinary.readouterr()
    # the bytes as they came, not UTF-8 ones shown escaped: compared exactly
    out, err = (b.decode("utf-8", "backslashreplace") for b in (raw_out, raw_err))
    got = (f"exit {code}\n--- stderr\n{masked(err, tmp_path)}--- stdout (sorted)\n"
           + "".join(sorted(masked(out, tmp_path).splitlines(keepends=True))))
    path = GOLDEN / f"logs-f-{name}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(got)
    assert got == path.read_text(), got


def test_success(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    fake = FakeCluster(lambda label, rank, env: 0).install(monkeypatch)
    code = followed(tmp_path, fake, capsysbinary)
    assert code == EXIT_OK
    check("success", code, capsysbinary, tmp_path)


def test_rank_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    fake = FakeCluster(lambda label, rank, env: 3 if rank == 3 else 0).install(monkeypatch)
    code = followed(tmp_path, fake, capsysbinary)
    assert code == EXIT_OK   # logs only shows: a rank's failure is `orch status`'s to say
    check("rank-failure", code, capsysbinary, tmp_path)


def test_lost_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                   capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    fake = FakeCluster(lambda label, rank, env: 0).install(monkeypatch)
    fake.on("follow", lose_while_running, "127.0.0.2")
    code = followed(tmp_path, fake, capsysbinary)
    assert code == EXIT_HOST
    check("lost-host", code, capsysbinary, tmp_path)


def test_host_not_reached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    fake = FakeCluster(lambda label, rank, env: 0).install(monkeypatch)
    inv = inventory(tmp_path)
    assert orch("up", "-c", inv, "--detach") == EXIT_OK
    capsysbinary.readouterr()
    fake.down.add("127.0.0.3")
    code = orch("logs", "-f", "-c", inv)
    assert code == EXIT_HOST
    check("not-reached", code, capsysbinary, tmp_path)


def odd_lines(chan: FakeChannel, msg: dict) -> None:
    """Bytes that are not UTF-8 and an escape sequence, then every rank ends well."""
    for r in msg["ranks"]:
        chan.push(protocol.output(r, b"caf\xe9 \x1b[2J r%d\nsecond\n" % r))
        chan.push(protocol.event("exit", rank=r, code=0, time=0.0))
    chan.push(protocol.event("done", code=0, time=0.0))


def test_bytes_as_they_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    fake = FakeCluster(lambda label, rank, env: 0).install(monkeypatch)
    fake.on("follow", odd_lines)
    code = followed(tmp_path, fake, capsysbinary)
    assert code == EXIT_OK
    check("bytes", code, capsysbinary, tmp_path)


def test_tail_reaches_every_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    fake = FakeCluster(lambda label, rank, env: 0).install(monkeypatch)
    assert followed(tmp_path, fake, capsysbinary, "--tail", "5") == EXIT_OK
    asked = fake.requests("follow")
    assert len(asked) == 3 and {m["tail"] for m in asked} == {5}
    assert {m["mode"] for m in asked} == {"events"}
