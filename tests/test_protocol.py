"""The wire between controller and agent (orchestrator/wire/protocol.py, link.py, agent/):
framing, caps, schemas, and what a rank or a host can send.

A rank's output is data: fake frame bytes, a 10 MB line without a newline and binary
garbage all come through as that rank's bytes, in order, with nothing lost after them.
A host that prints before its agent starts, or without end, or sends replies of the
wrong shape, gets one message naming it and the command; the controller's memory stays
bounded. No SSH here: the agent runs as a local child process (`connection: local`),
exactly as it runs under sshd.
"""
from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import wait_until
from orchestrator.config.inventory import parse
from orchestrator.errors import HostError, OrchError
from orchestrator.remote.bundle import AS_SOURCE, agent_argv, agent_stdin, bundle, sources
from orchestrator.remote.link import HostDone, Link
from orchestrator.remote.transport import LocalTransport
from orchestrator.watch.follow import HostStream, LineSink, follow
from orchestrator.wire import protocol
from sshd_cluster import pid_alive

MB = 1 << 20


# ---------------------------------------------------------------- frames and caps

def reader(data: bytes) -> protocol.FrameReader:
    return protocol.FrameReader(io.BytesIO(data).read)


def frame_of(r: protocol.FrameReader) -> tuple[bytes, bytes | bytearray]:
    got = r.read_frame()
    assert got is not None, "the stream ended early"
    return got


def test_frames_round_trip_in_order() -> None:
    data = (protocol.message("beat") + protocol.output(3, b"a\nb\n") +
            protocol.output(3, b"x" * 10, partial=True) + protocol.frame(protocol.DATA, b"\0\1"))
    r = reader(data)
    assert protocol.decode(frame_of(r), "m") == {"t": "beat"}
    assert protocol.split_output(frame_of(r)[1]) == (3, False, b"a\nb\n")
    assert protocol.split_output(frame_of(r)[1]) == (3, True, b"x" * 10)
    assert r.read_frame() == (protocol.DATA, b"\0\1")
    assert r.read_frame() is None


def test_big_payloads_read_in_place_are_the_same_bytes() -> None:
    payload = os.urandom(protocol.MAX_DATA)
    data = protocol.message("beat") + protocol.frame(protocol.DATA, payload) + protocol.message("beat")
    src = io.BytesIO(data)
    r = protocol.FrameReader(src.read, readinto=src.readinto)
    assert protocol.decode(frame_of(r), "m") == {"t": "beat"}
    assert r.read_frame() == (protocol.DATA, payload)
    assert protocol.decode(frame_of(r), "m") == {"t": "beat"} and r.read_frame() is None
    cut = io.BytesIO(data[:-100_000 - len(protocol.message("beat"))])
    with pytest.raises(protocol.ProtocolError, match="ended inside a frame"):
        r = protocol.FrameReader(cut.read, readinto=cut.readinto)
        r.read_frame()
        r.read_frame()


def test_oversized_frame_refused_before_its_payload_is_read() -> None:
    reads: list[int] = []
    header = protocol.HEADER.pack(protocol.JSON, protocol.MAX_JSON + 1)

    def read(n: int) -> bytes:
        reads.append(n)
        return header if len(reads) == 1 else b"x" * n
    with pytest.raises(protocol.ProtocolError, match="over the limit"):
        protocol.FrameReader(read).read_frame()
    assert len(reads) == 1, "the payload was read although its size was refused"
    for kind, cap in ((protocol.DATA, protocol.MAX_DATA), (protocol.OUTPUT, protocol.MAX_OUTPUT + 5)):
        with pytest.raises(protocol.ProtocolError, match="over the limit"):
            reader(protocol.HEADER.pack(kind, cap + 1)).read_frame()


def test_unknown_kind_and_cut_frames_are_refused() -> None:
    with pytest.raises(protocol.ProtocolError, match="unknown frame kind"):
        reader(b"y\n" * 10).read_frame()
    with pytest.raises(protocol.ProtocolError, match="ended inside a frame"):
        reader(protocol.message("beat")[:-2]).read_frame()
    with pytest.raises(protocol.ProtocolError, match="ended inside a frame header"):
        reader(b"J\0").read_frame()


def test_garbage_before_the_hello_is_skipped_up_to_the_limit() -> None:
    hello = protocol.hello("v1")
    r = reader(b"Welcome to host!\n" * 100 + hello)
    assert r.skip_to_magic() == 1700
    assert r.read_json("hello")["version"] == "v1"
    with pytest.raises(protocol.Garbage) as too_much:
        reader(b"z" * (protocol.MAX_GARBAGE + 100) + hello).skip_to_magic()
    assert not too_much.value.ended and too_much.value.sample.startswith(b"zzz")
    with pytest.raises(protocol.Garbage) as ended:
        reader(b"bash: python3: command not found\n").skip_to_magic()
    assert ended.value.ended


def test_schemas_name_the_field_and_refuse_wrong_types() -> None:
    stop = protocol.REPLIES["stop"]
    ok = {"found": 1, "killed": 0, "left": [], "seconds": 0.5}
    assert protocol.check(dict(ok), stop, "x") == ok
    for bad, field in (({**ok, "found": "1"}, "found"), ({**ok, "left": [1, "2"]}, "left"),
                       ({k: v for k, v in ok.items() if k != "killed"}, "killed"),
                       ({**ok, "found": True}, "found")):
        with pytest.raises(protocol.ProtocolError, match=f"'{field}'"):
            protocol.check(bad, stop, "the reply to `stop`")
    manifest = protocol.PARTS["manifest"]
    with pytest.raises(protocol.ProtocolError, match="entry 'a' must be"):
        protocol.check({"folder": "data", "files": {"a": [1]}}, manifest, "m")
    too_many = {str(i): [0, ""] for i in range(protocol.MANIFEST_PART + 1)}
    with pytest.raises(protocol.ProtocolError, match="more than"):
        protocol.check({"folder": "data", "files": too_many}, manifest, "m")


def test_bundle_is_deterministic_and_holds_the_host_package() -> None:
    import zipfile
    data, digest = bundle()
    src, src_digest = sources()
    bundle.cache_clear()
    sources.cache_clear()
    assert bundle() == (data, digest) and sources() == (src, src_digest)
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "orchestrator/wire/protocol.pyc" in names and "orchestrator/agent/main.pyc" in names
    assert "orchestrator/wire/frames.pyc" in names   # protocol.py imports it on the host
    # given as text to the user's python: sent to every host
    assert "orchestrator/agent/rankexec.py" in names and "orchestrator/agent/launcher.py" in names
    assert not [n for n in names if n.endswith(".py") and n not in AS_SOURCE]
    assert not [n for n in names if not n.startswith("orchestrator/")]
    z = zipfile.ZipFile(io.BytesIO(data))
    assert z.read("orchestrator/SOURCES").decode() == src_digest
    shipped = zipfile.ZipFile(io.BytesIO(src)).namelist()
    assert sorted(n + "c" for n in shipped) == sorted(n for n in names if n.endswith(".pyc"))
    assert len(data) < 0.75 * (len(data) + len(src)), "the sources are most of the bundle"


def other_pythons() -> list[str]:
    """CPythons 3.8+ on this machine whose bytecode is not this one's."""
    from test_jsonc import interpreters
    return [p for p in interpreters() if subprocess.run(
        [p, "-c", "import importlib.util,sys;sys.stdout.buffer.write(importlib.util.MAGIC_NUMBER)"],
        capture_output=True, timeout=30).stdout != importlib.util.MAGIC_NUMBER]


def test_an_agent_on_this_python_asks_for_no_sources() -> None:
    """The same bytecode: the hello is the agent's first frame; no sources are read."""
    proc = subprocess.run(agent_argv(sys.executable), input=agent_stdin(), capture_output=True,
                          timeout=30)
    r = reader(proc.stdout)
    assert r.skip_to_magic() == 0
    assert r.read_json("hello")["version"] == bundle()[1]


@pytest.mark.parametrize("python", other_pythons()[-2:] or ["none"])
def test_an_agent_on_another_python_asks_for_the_sources_and_starts(tmp_path: Path,
                                                                     python: str) -> None:
    """A host whose Python has other bytecode asks for the sources (a `sources` frame
    before the hello), checks them against the bundle's digest, compiles them, and
    starts; a link serves the ask (two of this machine's other CPythons)."""
    if python == "none":
        pytest.skip("no CPython 3.8+ with other bytecode on this machine")
    proc = subprocess.run(agent_argv(python), input=agent_stdin() + sources()[0],
                          capture_output=True, timeout=60)
    r = reader(proc.stdout)
    assert r.skip_to_magic() == 0 and r.read_json("ask") == {"t": "sources"}
    assert r.skip_to_magic() == 0
    assert r.read_json("hello")["version"] == bundle()[1], proc.stderr
    bad = bytearray(sources()[0])
    bad[100] ^= 1   # one bit of the sources changed on the way: refused, nothing runs
    proc = subprocess.run(agent_argv(python), input=agent_stdin() + bytes(bad),
                          capture_output=True, timeout=60)
    assert b"the sources sent are not the bundle's" in proc.stderr and proc.returncode != 0
    link = started(tmp_path, python)
    try:
        assert link.hello is not None and link.request("clock", 10)["time"] > 0
    finally:
        link.close(5)


def test_host_code_parses_as_python_38() -> None:
    """The hosts need only Python 3.8: no newer syntax in what the bundle carries."""
    import ast

    from orchestrator.remote.bundle import source_files
    shipped = [(name, data) for name, data in source_files() if name.endswith(".py")]
    assert len(shipped) > 15
    for path, data in shipped:
        tree = ast.parse(data, path, feature_version=(3, 8))
        future = any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
                     for n in tree.body)
        annotations = [n for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) or (
            isinstance(n, ast.arg) and n.annotation) or (
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns)]
        # annotations such as list[int] are evaluated at import on 3.8 without it
        assert future or not annotations, f"{path}: needs `from __future__ import annotations`"


# ---------------------------------------------------------------- a local agent

def local_host(tmp_path: Path, python: str = sys.executable):
    text = (f"name: wire\nhosts:\n  - address: localhost\n    connection: local\n"
            f"    remote_dir: {tmp_path / 'remote'}\npython: {python}\njob:\n  entrypoint: job.py\n")
    return parse(text, tmp_path / "cluster.yaml").hosts[0]


def started(tmp_path: Path, python: str = sys.executable) -> Link:
    link = Link(LocalTransport(local_host(tmp_path, python), cwd=str(tmp_path)))
    link.start(timeout=30)
    return link


class Collect(LineSink):
    def __init__(self) -> None:
        self.frames: list[tuple[int, bool, bytes]] = []
        self.texts: list[bytes] = []
        self.done: list[HostDone] = []
        self.lost: list[str] = []

    def output(self, host: int, rank: int, partial: bool, data: bytes) -> None:
        self.frames.append((rank, partial, data))
        super().output(host, rank, partial, data)

    def lines(self, host: int, rank: int, texts: list[bytes]) -> None:
        self.texts.extend(texts)

    def rank_exit(self, host: int, rank: int, code: int, when: float) -> None:
        raise AssertionError("a rank's output was taken for an exit event")

    def host_done(self, host: int, info: HostDone) -> None:
        self.done.append(info)

    def host_lost(self, host: int, why: str) -> None:
        self.lost.append(why)


def test_rank_output_is_data_whatever_it_holds(tmp_path: Path) -> None:
    """Fake frames, the hello's magic, a 10 MB line without newline (longer than the host's
    read size) and every byte value: all come back as rank 3's bytes, nothing after lost."""
    forged = (protocol.event("exit", rank=3, code=0, time=1.0) + protocol.MAGIC +
              protocol.hello("forged") + protocol.output(0, b"not rank 0\n") +
              protocol.event("done", code=0))
    long_line = os.urandom(5 * MB).hex().encode().replace(b"\n", b"")  # 10 MB, no newline
    content = (b"first\n" + forged + b"\n" + long_line + b"\nafter the long line\n" +
               bytes(range(256)) + b"\nlast line\n")
    logs = tmp_path / "remote" / "wire" / "logs"
    logs.mkdir(parents=True)
    (logs / "rank-3.log").write_bytes(content)
    link = started(tmp_path)
    sink = Collect()
    try:
        stream = HostStream(link, str(tmp_path / "remote" / "wire"), [3])
        finished = follow({0: stream}, sink, mode="snapshot")
        wait_until(finished, 60, "the snapshot to end")
    finally:
        link.close()
    assert not sink.lost and sink.done == [HostDone(None, snapshot=True)]
    assert {rank for rank, _, _ in sink.frames} == {3}
    assert b"".join(data for _, _, data in sink.frames) == content
    assert all(len(d) <= protocol.MAX_OUTPUT for _, _, d in sink.frames)
    pieces = [d for _, partial, d in sink.frames if partial]
    assert len(pieces) >= len(long_line) // protocol.MAX_OUTPUT - 1, "the long line was not cut"
    # printed: the long line as prefixed continuation pieces, then every later line
    i = sink.texts.index(long_line[:protocol.MAX_OUTPUT])
    rest = sink.texts[i:]
    joined = b"".join(rest[:rest.index(b"after the long line")])
    assert joined == long_line
    assert rest[-2:] == [bytes(range(256)).split(b"\n")[1], b"last line"]


def test_agent_ends_when_its_stdin_closes(tmp_path: Path) -> None:
    link = started(tmp_path)
    assert link.hello is not None
    pid = link.hello.pid
    assert pid is not None
    assert pid_alive(pid)
    link.close()
    wait_until(lambda: not pid_alive(pid), 10, "the agent to end")


# ---------------------------------------------------------------- hosts that misbehave

def fake_python(tmp_path: Path, script: str) -> str:
    """A "python" on the host that is really a shell script."""
    path = tmp_path / "fake-python"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return str(path)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class PeakRss:
    """The highest RSS (MiB) seen while the block runs, sampled every 2 ms in a thread."""

    def __init__(self) -> None:
        self.mib = rss_mib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            self.mib = max(self.mib, rss_mib())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.mib = max(self.mib, rss_mib())


def test_host_printing_without_end_before_the_agent(tmp_path: Path) -> None:
    """A login shell (here: the "python") that prints endlessly: a clear error naming the
    host and the fix, within the garbage limit; the controller's memory does not grow."""
    python = fake_python(tmp_path, "exec yes 'Welcome! Last login: yesterday'\n")
    before = rss_mib()
    link = Link(LocalTransport(local_host(tmp_path, python), cwd=str(tmp_path)))
    t0 = time.monotonic()
    with pytest.raises(HostError) as err:
        link.start(timeout=30)
    assert time.monotonic() - t0 < 10
    text = str(err.value)
    assert "localhost" in text and "before the agent started" in text and "Welcome!" in text
    assert "fix:" in text and "non-interactive" in text
    proc = link.chan.proc  # type: ignore[union-attr]
    link.close()
    wait_until(lambda: proc.poll() is not None, 10, "the fake python to be ended")
    assert rss_mib() - before < 32, f"controller grew by {rss_mib() - before:.0f} MiB"


def test_host_printing_without_end_after_its_hello(tmp_path: Path) -> None:
    """A valid hello, then endless bytes: refused as a protocol breach at the first bad
    frame, bounded memory, the host named."""
    blob = tmp_path / "hello.bin"
    blob.write_bytes(protocol.hello(bundle()[1]))
    python = fake_python(tmp_path, f"cat {blob}\nexec cat /dev/zero\n")
    before = rss_mib()
    link = Link(LocalTransport(local_host(tmp_path, python), cwd=str(tmp_path)))
    with PeakRss() as peak, pytest.raises(HostError) as err:   # at the hello, or the request
        link.start(timeout=30)
        link.request("status", 30, job_dir="/nowhere", ranks=[0])
    assert "localhost" in str(err.value) and "does not accept" in str(err.value)
    link.close()
    # the peak while the bytes flood in, sampled: the process's lifetime peak (ru_maxrss)
    # also counts what earlier tests in this process used (torch), which made it flaky
    assert rss_mib() - before < 32 and peak.mib - before < 128, (before, peak.mib)


def test_reply_of_the_wrong_shape_names_host_and_command(tmp_path: Path) -> None:
    hello, answer = tmp_path / "hello.bin", tmp_path / "reply.bin"
    hello.write_bytes(protocol.hello(bundle()[1]))
    answer.write_bytes(protocol.reply(1, {"found": "three", "killed": 0, "left": [], "seconds": 1}))
    asked = len(agent_stdin()) + len(protocol.request("stop", 1, job_dir="/nowhere", grace=1))
    # answers once the request is in (head reads exactly that many bytes of stdin)
    python = fake_python(tmp_path, f"cat {hello}\nhead -c {asked} >/dev/null\ncat {answer}\n"
                                   "exec sleep 30\n")
    link = Link(LocalTransport(local_host(tmp_path, python), cwd=str(tmp_path)))
    link.start(timeout=30)
    with pytest.raises(HostError) as err:
        link.request("stop", 30, job_dir="/nowhere", grace=1)
    text = str(err.value)
    assert text.startswith("localhost:") and "`stop`" in text and "'found'" in text
    link.close(0)


def test_python_missing_is_named(tmp_path: Path) -> None:
    link = Link(LocalTransport(local_host(tmp_path, str(tmp_path / "no" / "python3")),
                               cwd=str(tmp_path)))
    with pytest.raises((HostError, OSError)) as err:
        link.start(timeout=30)
    assert "no/python3" in str(err.value)


def test_error_replies_carry_a_category_and_a_traceback_only_for_debug(tmp_path: Path,
                                                                         monkeypatch) -> None:
    """A failing request: one message with the host and the command; the host's
    traceback only with ORCH_DEBUG=1."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for debug in ("0", "1"):
        monkeypatch.setenv("ORCH_DEBUG", debug)
        link = started(tmp_path)
        try:
            with pytest.raises(OrchError) as usage:
                link.request("follow", 30, job_dir=str(tmp_path), ranks=[0], tail=-1, mode="bogus")
            with pytest.raises(OrchError) as host:
                link.request("receive", 30, root=str(blocker / "data"))
        finally:
            link.close()
        assert usage.value.exit_code == 2 and host.value.exit_code == 3
        text = str(usage.value)
        assert text.startswith("localhost: follow failed:") and "bogus" in text
        assert str(host.value).startswith("localhost: receive failed: ")
        assert "is not a folder" in str(host.value) and "fix: " in str(host.value)
        assert ("Traceback" in str(host.value)) == (debug == "1"), str(host.value)


SECRET = "s3cr3t-token-0x5eed"
SECRET_INVENTORY = f"""name: secretjob
hosts:
  - {{address: localhost, connection: local, remote_dir: /r0, procs: 2}}
  - {{address: 127.0.0.1, connection: local, remote_dir: /r1, procs: 1}}
job: {{entrypoint: job.py, env: {{HF_TOKEN: {SECRET}}}}}
"""


def test_agent_argv_holds_no_secret_and_the_bundle_is_the_version(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """The job's env (a secret among it) reaches every host's launch on the agent's
    stdin and never its command line (what `ps` shows every user of the host)."""
    from fake_agent import FakeTransport
    from orchestrator.session.preflight import HostInfo, PreflightReport
    from orchestrator.session.session import Session

    argvs: list[list[str]] = []
    launches: list[dict] = []

    def launch(chan, msg: dict) -> None:
        launches.append(msg)
        chan.push(protocol.reply(msg["id"], {"supervisor": {
            "pid": 10, "pgid": 10, "start_ticks": None, "torchrun_pid": 11,
            "run_id": msg["spec"]["run_id"], "started": time.time()}}))

    class Recording(FakeTransport):
        def open(self, argv: list[str], timeout: float | None = None):
            argvs.append(list(argv))
            return super().open(argv, timeout)
    monkeypatch.setenv("ORCH_DEBUG", "1")   # every optional word of the argv
    cluster = parse(SECRET_INVENTORY, tmp_path / "cluster.yaml")
    session = Session(cluster, None, connector=lambda h: Recording(h, {"launch": launch})).open()
    try:
        infos = {h.index: HostInfo(f"/r{h.index}/secretjob", "/usr/bin/python3", "2.0", 0, 0.0,
                                   False, "", {}) for h in cluster.hosts}
        session.launch(PreflightReport(infos, 29500))
    finally:
        session.close()
    assert len(argvs) == 2 and len(launches) == 2
    for msg in launches:   # the secret was passed in: it travels in the launch request
        assert msg["spec"]["env"]["HF_TOKEN"] == SECRET, msg["spec"]["env"]
        assert SECRET not in " ".join(msg["spec"]["argv"])
    for argv in argvs:
        assert not any(SECRET in word for word in argv), argv
        assert argv[1:3] == ["-S", "-c"] and "orch-agent" in argv

    argv = agent_argv(sys.executable, "/job")
    proc = subprocess.run(argv, input=agent_stdin(), capture_output=True, timeout=30)
    r = reader(proc.stdout)
    assert r.skip_to_magic() == 0
    assert r.read_json("hello")["version"] == bundle()[1]


def test_parts_beyond_the_cap_are_refused(tmp_path: Path) -> None:
    """A host that sends manifest parts without end: refused after MAX_PARTS, by name."""
    from fake_agent import FakeTransport

    def manifest(chan, msg: dict) -> None:
        for i in range(protocol.MAX_PARTS + 1):
            chan.push(protocol.part(msg["id"], "manifest", {"folder": "", "files": {str(i): [1, "x"]}}))
        chan.push(protocol.reply(msg["id"], {"root": "/"}))
    link = Link(FakeTransport(local_host(tmp_path), {"manifest": manifest}))
    link.start(timeout=10)
    with pytest.raises(HostError) as err:
        link.request("manifest", 10, root="/data")
    assert str(err.value).startswith("localhost:") and "`manifest`" in str(err.value)
    link.close(0)


def test_a_glob_list_found_good_is_known_and_a_bad_one_still_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The curves' globs, sent at every follow and listing, are checked once; a list
    with a bad glob is refused every time; the known lists are capped."""
    from orchestrator.wire import globs
    monkeypatch.setattr(protocol, "GLOBS_OK", set())
    checked: list[str] = []
    real = globs.problem

    def problem(glob: str) -> str:
        checked.append(glob)
        return real(glob)
    monkeypatch.setattr(globs, "problem", problem)
    good = ["**/metrics*.csv", "**/*.jsonl"]
    for _ in range(5):
        assert protocol.glob_list(list(good)) is None
    assert checked == ["output/**/metrics*.csv", "output/**/*.jsonl"]
    for _ in range(2):
        assert "not a plain relative path" in (protocol.glob_list(good + ["../x"]) or "")
    for i in range(protocol.GLOBS_KNOWN + 10):
        assert protocol.glob_list([f"run{i}/*.csv"]) is None
    assert len(protocol.GLOBS_OK) == protocol.GLOBS_KNOWN
