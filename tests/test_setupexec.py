"""`setup:` and `orch exec` without SSH: the inventory's shapes and errors, the
fingerprint rule, --hosts selections, the output printer, the agent's side (run
directly: real processes, no connection) and the controller over fake agents."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from fake_agent import FakeChannel, FakeTransport
from orchestrator.agent import shellcmd
from orchestrator.config.hostselect import select, split_selection
from orchestrator.config.inventory import parse
from orchestrator.config.setupspec import SetupSpec, fingerprint, named_files
from orchestrator.errors import InventoryError, UsageError
from orchestrator.session.session import Session
from orchestrator.session.shelloutput import HostOutput, Printer
from orchestrator.wire import protocol, timeouts

BASE = """name: sx
hosts:
  - {address: 10.0.0.1}
  - {address: 10.0.0.2}
  - {address: 10.0.0.3}
code: {paths: [job, scripts]}
job: {entrypoint: job/train.py}
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train.py").write_text("print(1)\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text("pip install -r job/requirements.txt\n")
    return tmp_path


def load(folder: Path, extra: str):
    return parse(BASE + extra, folder / "cluster.yaml")


# ---------------------------------------------------------------- inventory


def test_setup_shapes(folder: Path) -> None:
    assert load(folder, "").setup is None
    assert load(folder, "setup: []\n").setup is None
    listed = load(folder, "setup:\n  - pip install -r job/requirements.txt\n  - echo done\n").setup
    assert listed == SetupSpec(("pip install -r job/requirements.txt", "echo done"), None, 8)
    assert load(folder, "setup: make deps\n").setup.commands == ("make deps",)
    script = load(folder, "setup: scripts/setup.sh\n").setup
    assert script.script == "scripts/setup.sh" and script.commands == ()


@pytest.mark.parametrize(
    "extra, line, words",
    [
        ("setup:\n  - echo a\n  - 5\n", 10, "must be a shell command"),
        ('setup:\n  - echo a\n  - ""\n', 10, "must be a shell command"),
        ('setup:\n  - "echo \\0 nul"\n', 9, "NUL"),
        ("setup: missing/setup.sh\n", 8, "not in code.paths"),
        ("setup: ../setup.sh\n", 8, "inside the synced code folder"),
        ("setup: {a: 1}\n", 8, "unknown key `setup.a`"),
            ("setup: {once_per: host}\n", 8, "missing `setup.commands`"),
            ("setup: {commands: [ls], once_per: fs}\n", 8, "must be filesystem or host"),
        ("setpu: [ls]\n", 8, "setup"),
    ],
)
def test_setup_errors_name_the_line(folder: Path, extra: str, line: int, words: str) -> None:
    with pytest.raises(InventoryError) as e:
        load(folder, extra)
    assert e.value.line == line, str(e.value)
    assert words in str(e.value)
    assert e.value.hint


def test_setup_command_count_is_capped(folder: Path) -> None:
    with pytest.raises(InventoryError, match="more than 200"):
        load(folder, "setup:\n" + "  - echo x\n" * 201)


# ---------------------------------------------------------------- fingerprint


def test_fingerprint_follows_named_files_only() -> None:
    spec = SetupSpec(
        ("pip install -r requirements.txt", "pip install --constraint=./c.txt x"), None, 1
    )
    digests = {"requirements.txt": "a", "c.txt": "b", "other.py": "c"}
    assert named_files([spec.text], digests) == {"requirements.txt": "a", "c.txt": "b"}
    first = fingerprint(spec, digests)
    assert fingerprint(spec, dict(digests, **{"other.py": "changed"})) == first
    assert fingerprint(spec, dict(digests, **{"requirements.txt": "changed"})) != first
    assert fingerprint(spec, dict(digests, **{"c.txt": "changed"})) != first
    assert fingerprint(SetupSpec((*spec.commands, "true"), None, 1), digests) != first


def test_fingerprint_of_a_script_covers_it_and_the_files_it_names() -> None:
    spec = SetupSpec((), "scripts/setup.sh", 1)
    digests = {"scripts/setup.sh": "s", "req.txt": "r"}
    first = fingerprint(spec, digests, "pip install -r req.txt 'unclosed\n")
    assert (
        fingerprint(spec, dict(digests, **{"scripts/setup.sh": "t"}), "pip install -r req.txt")
        != first
    )
    assert (
        fingerprint(spec, dict(digests, **{"req.txt": "x"}), "pip install -r req.txt 'unclosed\n")
        != first
    )


# ---------------------------------------------------------------- --hosts


def test_select_hosts(folder: Path) -> None:
    cluster = load(folder, "")
    labels = lambda sel: [h.address for h in select(cluster, sel)]  # noqa: E731
    assert labels(None) == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    assert labels("2,0") == ["10.0.0.1", "10.0.0.3"]
    assert labels("10.0.0.[2-3]") == ["10.0.0.2", "10.0.0.3"]
    assert labels("10.0.0.[1,3]") == ["10.0.0.1", "10.0.0.3"]
    assert labels("10.0.0.2, 1") == ["10.0.0.2"]
    assert split_selection("a[1,2],b") == ["a[1,2]", "b"]
    for bad in ("7", "10.0.0.9", "10.0.0.[5-6]", "x[3-1]"):
        with pytest.raises(UsageError):
            select(cluster, bad)


# ---------------------------------------------------------------- printing


class Tty(io.BytesIO):
    def isatty(self) -> bool:
        return True


def test_host_output_lines_tail_and_terminal_safety() -> None:
    out = Tty()
    host = HostOutput(Printer(out), "[setup h1]", tail=2, keep=10)
    host.feed(b"one\ntw")
    host.feed(b"o\r\n\x1b]0;title\x07three\nrest")
    assert out.getvalue() == b"[setup h1] one\n[setup h1] two\n[setup h1] \\x1b]0;title\\x07three\n"
    host.flush()
    assert out.getvalue().endswith(b"[setup h1] rest\n")
    assert host.tail_text() == ["\\x1b]0;title\\x07three", "rest"]
    assert host.text() == "three\nrest" and host.dropped > 0
    piped = io.BytesIO()
    HostOutput(Printer(piped), "[h]").feed(b"\x1b[31mred\n")
    assert piped.getvalue() == b"[h] \x1b[31mred\n"  # not a terminal: bytes as they are


# ---------------------------------------------------------------- the agent's side


class Req:
    """What the agent's dispatcher hands a command: args, an id, an output sink."""

    ids = iter(range(1000, 10**6))

    def __init__(self, t: str, **args: Any) -> None:
        protocol.check(args, cast(dict, protocol.REQUESTS[t]), t)
        self.t, self.args, self.id = t, args, next(self.ids)
        self.frames: list[bytes] = []
        self.out = self

    def send(self, data: bytes) -> None:
        self.frames.append(data)

    def output(self) -> bytes:
        reader = protocol.FrameReader(
            io.BytesIO(b"".join(self.frames)).read, caps={protocol.STREAM_OUT: 1 << 20}
        )
        data = b""
        while (got := reader.read_frame()) is not None:
            assert got[0] == protocol.STREAM_OUT
            rid, _, piece = protocol.split_output(got[1])
            assert rid == self.id
            data += piece
        return data


def setup_req(job_dir: Path, commands_: list[str], digest: str = "f1", force: bool = False) -> Req:
    return Req(
        "setup",
        job_dir=str(job_dir),
        commands=commands_,
        script=None,
        env={"FOO": "bar"},
        fingerprint=digest,
        force=force,
    )


def test_agent_setup_runs_in_code_logs_and_skips(tmp_path: Path) -> None:
    job = tmp_path / "job"
    req = setup_req(job, ["echo $FOO > made.txt", "pwd"])
    reply = shellcmd.run_setup(req)
    protocol.check(reply, cast(dict, protocol.REPLIES["setup"]), "setup")
    assert reply["code"] == 0 and not reply["skipped"]
    assert (job / "code" / "made.txt").read_text() == "bar\n"
    assert req.output() == f"$ echo $FOO > made.txt\n$ pwd\n{job / 'code'}\n".encode()
    assert (job / "logs" / "setup.log").read_bytes() == req.output()
    assert json.loads((job / "run" / "setup.json").read_text())["fingerprint"] == "f1"
    assert shellcmd.run_setup(setup_req(job, ["false"]))["skipped"] is True
    forced = shellcmd.run_setup(setup_req(job, ["echo again"], force=True))
    assert not forced["skipped"] and forced["code"] == 0


def test_agent_setup_failure_stops_and_forgets_the_fingerprint(tmp_path: Path) -> None:
    job = tmp_path / "job"
    assert shellcmd.run_setup(setup_req(job, ["true"]))["code"] == 0
    req = setup_req(job, ["echo before", "exit 4", "echo never"], digest="f2")
    reply = shellcmd.run_setup(req)
    assert (reply["code"], reply["failed"]) == (4, "exit 4")
    assert b"never" not in req.output()
    assert not (job / "run" / "setup.json").exists()  # the next up runs it again


def test_agent_setup_refuses_a_link_for_its_log(tmp_path: Path) -> None:
    job = tmp_path / "job"
    (job / "logs").mkdir(parents=True)
    (tmp_path / "elsewhere").write_text("keep")
    os.symlink(tmp_path / "elsewhere", job / "logs" / "setup.log")
    with pytest.raises(OSError):
        shellcmd.run_setup(setup_req(job, ["echo x"]))
    assert (tmp_path / "elsewhere").read_text() == "keep"


def test_agent_exec_folder_and_exit_code(tmp_path: Path) -> None:
    req = Req(
        "exec",
        job_dir=str(tmp_path / "nojob"),
        argv=["sh", "-c", "pwd; echo $FOO; exit 3"],
        env={"FOO": "bar"},
    )
    reply = shellcmd.run_exec(req)
    assert reply["code"] == 3 and reply["cwd"] == str(tmp_path)  # no job folder: remote_dir
    assert req.output() == f"{tmp_path}\nbar\n".encode()
    (tmp_path / "job").mkdir()
    req = Req("exec", job_dir=str(tmp_path / "job"), argv=["pwd"], env={})
    assert shellcmd.run_exec(req)["cwd"] == str(tmp_path / "job")
    missing = Req("exec", job_dir=str(tmp_path / "job"), argv=["no-such-command-x"], env={})
    assert shellcmd.run_exec(missing)["code"] == 127
    assert b"cannot run" in missing.output()


def group_alive(pgid: int) -> bool:
    """A live (not zombie) process in the group: the container's init may reap late."""
    return shellcmd.group_alive(pgid)


def test_agent_cancel_ends_the_whole_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A command and its children: cancel SIGTERMs the group, then SIGKILLs what ignores it."""
    monkeypatch.setattr(timeouts, "COMMAND_GRACE", 0.5)
    req = Req(
        "exec",
        job_dir=str(tmp_path),
        env={},
        argv=["sh", "-c", "trap '' TERM; sleep 300 & echo started; wait"],
    )
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(shellcmd.run_exec(req)))
    th.start()
    deadline = time.monotonic() + 10
    while req.id not in shellcmd._running and time.monotonic() < deadline:
        time.sleep(0.02)
    pgid = shellcmd._running[req.id].pid
    while b"started" not in req.output() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert shellcmd.run_cancel(Req("cancel", request=req.id)) == {"found": True}
    th.join(10)
    assert result["code"] == -signal.SIGKILL
    assert not group_alive(pgid)
    assert shellcmd.run_cancel(Req("cancel", request=req.id)) == {"found": False}


# ---------------------------------------------------------------- controller, fake agents


def test_session_exec_streams_and_collects(tmp_path: Path) -> None:
    cluster = parse(
        "name: fx\nhosts:\n  - {address: localhost, connection: local, remote_dir: /a}\n"
        "  - {address: localhost, connection: local, remote_dir: /b}\n"
        "job: {entrypoint: job.py, env: {K: v}}\n",
        tmp_path / "cluster.yaml",
    )
    seen: list[dict] = []

    def exec_(chan: FakeChannel, msg: dict) -> None:
        seen.append(msg)
        chan.push(
            protocol.command_output(msg["id"], b"out of " + msg["job_dir"].encode() + b"\npart")
        )
        chan.push(
            protocol.reply(
                msg["id"], {"code": int(msg["job_dir"] == "/b/fx"), "cwd": "/", "seconds": 0.1}
            )
        )

    session = Session(cluster, connector=lambda h: FakeTransport(h, {"exec": exec_})).open()
    out = io.BytesIO()
    printer = Printer(out)
    outputs = {h.index: HostOutput(printer, f"[{h.label}]") for h in cluster.hosts}
    try:
        outcome = session.exec(["echo", "hi"], outputs)
    finally:
        session.close()
    assert {i: r.code for i, r in outcome.ok.items()} == {0: 0, 1: 1}
    assert not outcome.failed and not outcome.interrupted
    lines = sorted(out.getvalue().decode().splitlines())
    assert lines == [
        "[localhost#0] out of /a/fx",
        "[localhost#0] part",
        "[localhost#1] out of /b/fx",
        "[localhost#1] part",
    ]
    assert all(
        m["argv"] == ["echo", "hi"] and m["env"]["K"] == "v" and "ORCH_JOB_DIR" not in m["env"]
        for m in seen
    )


def test_command_output_for_no_command_is_refused(tmp_path: Path) -> None:
    cluster = parse(
        "name: fx\nhosts: [{address: localhost, connection: local}]\njob: {entrypoint: job.py}\n",
        tmp_path / "cluster.yaml",
    )

    def status(chan: FakeChannel, msg: dict) -> None:
        chan.push(protocol.command_output(999, b"forged\n"))

    session = Session(cluster, connector=lambda h: FakeTransport(h, {"status": status})).open()
    try:
        with pytest.raises(Exception, match="runs no command"):
            session.links[0].request("status", 5, job_dir="/x", ranks=[0])
    finally:
        session.close()


def test_agent_end_of_input_ends_every_running_command(tmp_path: Path) -> None:
    """The controller is gone (its channel closed): no setup or exec goes on without it."""
    reqs = [
        Req("exec", job_dir=str(tmp_path), env={}, argv=["sh", "-c", "echo started; sleep 300"])
        for _ in range(2)
    ]
    threads = [threading.Thread(target=shellcmd.run_exec, args=(r,)) for r in reqs]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 10
    while not all(b"started" in r.output() for r in reqs) and time.monotonic() < deadline:
        time.sleep(0.02)
    pgids = [shellcmd._running[r.id].pid for r in reqs]
    try:
        shellcmd.end_all()
        for th in threads:
            th.join(10)
        assert not any(group_alive(p) for p in pgids)
        with pytest.raises(Exception, match="controller is gone"):
            shellcmd.run_exec(Req("exec", job_dir=str(tmp_path), env={}, argv=["true"]))
    finally:
        shellcmd._closing.clear()
