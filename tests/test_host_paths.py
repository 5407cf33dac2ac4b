"""orchestrator/agent/paths.py and agent/ledger.py, the host side's only way into a job folder.

No SSH: a job folder in a temporary directory and, outside it, a victim folder and a
victim file. A link is planted at every name orch expects to be its own (code, data,
run, logs, output, a shard folder, logs/rank-0.log, run/launch.json, a staging folder,
the job folder itself); each operation orch does there is refused with the path and the
fix, or leaves the link alone, and the victims are byte for byte what they were. The
agent's receive and manifest requests run as the controller starts the agent (its bundle).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import pytest

from helpers import plant_link, snapshot, wait_until
from orchestrator.agent.files import manifest
from orchestrator.agent.ledger import Ledger
from orchestrator.agent.paths import JobDir, UnsafePath, check_link_target
from orchestrator.remote import bundle
from orchestrator.wire import protocol

# ---------------------------------------------------------------- helpers

@pytest.fixture
def box(tmp_path: Path) -> Iterator[dict]:
    """A job folder (not made yet), a victim folder and a victim file outside it."""
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "precious.txt").write_bytes(b"do not touch\n")
    (victim / "sub" / "deep.bin").write_bytes(os.urandom(300))
    vfile = tmp_path / "victim-file.txt"
    vfile.write_bytes(b"a file outside the job folder\n")
    before = {**snapshot(victim), **snapshot(vfile)}
    job = tmp_path / "remote" / "job"
    yield {"job": job, "victim": victim, "vfile": vfile}
    after = {**snapshot(victim), **snapshot(vfile)}
    assert after == before, "something outside the job folder changed"


def refused(fn: Callable[[], object], path: Path) -> UnsafePath:
    with pytest.raises(UnsafePath) as info:
        fn()
    e = info.value
    assert str(path) in str(e), str(e)
    assert "symbolic link" in str(e) and "rm " in e.fix and str(path) in e.fix, (str(e), e.fix)
    return e


def request(command: str, *args: str) -> bytes:
    """The request the controller sends for what was once `agent.py COMMAND ARGS...`."""
    if command == "preflight":
        job, port, want_port, folders, gpus = args
        return protocol.request("preflight", 1, job_dir=job, master_port=int(port),
                                want_port=want_port == "1", want_gpus=gpus != "0",
                                folders=[f for f in folders.split(",") if f])
    return protocol.request(command, 1, root=args[0])


def agent(command: str, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """One request to an agent started as the controller starts it (its bundle on stdin).
    Exit 0 and the reply (manifest parts merged into "files"), or 1 and {"error", "fix"}."""
    proc = subprocess.run(bundle.agent_argv(sys.executable), capture_output=True, timeout=30,
                          input=bundle.agent_stdin() + request(command, *args) + stdin)
    reader = protocol.FrameReader(io.BytesIO(proc.stdout).read)
    reader.skip_to_magic()
    reader.read_json("hello")
    files: dict = {}
    while True:
        msg = reader.read_json("the reply")
        if msg["t"] == "part":
            files.update(msg["body"]["files"])
            continue
        break
    if msg["t"] == "error":
        out, code = {"error": msg["message"], "fix": msg.get("fix", "")}, 1
    else:
        out, code = dict(msg["body"], **({"files": files} if command == "manifest" else {})), 0
    return subprocess.CompletedProcess(proc.args, code, json.dumps(out).encode(), proc.stderr)


def reply(res: subprocess.CompletedProcess) -> dict:
    return json.loads(res.stdout.decode().strip().splitlines()[-1])


def frame(rel: str, payload: bytes) -> bytes:
    head = protocol.stream_item("file", p=rel, s=len(payload), m=0o644,
                                h=hashlib.sha256(payload).hexdigest())
    return head + (protocol.frame(protocol.DATA, payload) if payload else b"")


def link_frame(rel: str, target: str) -> bytes:
    return protocol.stream_item("link", p=rel, link=target)


def end(delete=()) -> bytes:
    return protocol.stream_item("end", delete=list(delete))


# ---------------------------------------------------------------- links at orch's names

@pytest.mark.parametrize("folder", ["code", "data", "run", "logs", "output"])
def test_a_link_at_an_orch_folder_is_refused(box: dict, folder: str) -> None:
    job = box["job"]
    job.mkdir(parents=True)
    link = plant_link(job, folder, box["victim"])
    jd = JobDir(str(job))
    refused(lambda: jd.open_dir(folder, create=True), link)
    refused(lambda: jd.write_file(folder + "/x.json", b"{}"), link)
    refused(lambda: jd.open_for_write(folder + "/rank-0.log"), link)
    refused(lambda: jd.open_for_read(folder + "/precious.txt"), link)
    refused(jd.check_layout, link)
    with pytest.raises(UnsafePath):
        jd.unlink(folder + "/precious.txt")
    res = agent("preflight", str(job), "0", "0", "code,data", "0")
    assert res.returncode == 1 and str(link) in reply(res)["error"], res.stdout
    assert f"rm {link}" in reply(res)["fix"]
    assert os.path.islink(link), "the link itself is the user's to remove"


def test_a_link_as_the_job_folder_is_refused(box: dict) -> None:
    job = box["job"]
    job.parent.mkdir(parents=True)
    job.symlink_to(box["victim"])
    jd = JobDir(str(job))
    refused(lambda: jd.fd(create=True), job)
    refused(lambda: jd.write_file("run/launch.json", b"{}"), job)
    res = agent("receive", str(job / "code"), stdin=frame("a.py", b"x") + end())
    assert res.returncode == 1 and "symbolic link" in reply(res)["error"]


def test_a_link_at_a_shard_folder_is_refused(box: dict) -> None:
    job = box["job"]
    link = plant_link(job, "data/worker_0_of_2", box["victim"])
    jd = JobDir(str(job))
    refused(lambda: jd.open_dir("data/worker_0_of_2/cls", create=True), link)
    res = agent("receive", str(job / "data"),
                stdin=frame("worker_0_of_2/precious.txt", b"evil") + end())
    assert res.returncode == 1, res.stdout + res.stderr
    assert str(link) in reply(res)["error"] and f"rm {link}" in reply(res)["fix"]


@pytest.mark.parametrize("rel", ["logs/rank-0.log", "run/launch.json", "run/supervisor.json",
                                 "run/host.exit"])
def test_a_link_at_an_orch_file_is_refused(box: dict, rel: str) -> None:
    job = box["job"]
    link = plant_link(job, rel, box["vfile"])
    jd = JobDir(str(job))
    refused(lambda: jd.write_file(rel, b"{}"), link)
    refused(lambda: jd.open_for_write(rel), link)
    refused(lambda: jd.open_for_write(rel, append=True), link)
    refused(lambda: jd.read(rel, 100), link)
    refused(jd.check_layout, link)
    assert os.path.islink(link)


def test_unlink_and_rmtree_remove_links_never_their_targets(box: dict) -> None:
    job = box["job"]
    plant_link(job, "code/to-dir", box["victim"])
    plant_link(job, "code/to-file", box["vfile"])
    plant_link(job, "code/.orch-staging-1/inner", box["victim"])
    plant_link(job, "code/pkg/.orch-staging-7", box["victim"])   # a link with a staging name
    (job / "code" / "pkg" / "a.py.orch-part-5").symlink_to(box["vfile"])
    jd = JobDir(str(job))
    assert jd.unlink("code/to-file") and jd.unlink("code/to-dir")
    jd.rmtree("code/.orch-staging-1")
    assert jd.sweep("code", lambda n: n.startswith(".orch-staging-") or ".orch-part-" in n) == 2
    assert sorted(os.listdir(job / "code")) == ["pkg"]
    assert os.listdir(job / "code" / "pkg") == []


def test_walk_reports_regular_files_and_enters_no_link(box: dict) -> None:
    job = box["job"]
    (job / "code" / "pkg").mkdir(parents=True)
    (job / "code" / "pkg" / "a.py").write_text("a")
    plant_link(job, "code/pkg/linked-dir", box["victim"])
    plant_link(job, "code/linked-file", box["vfile"])
    assert [rel for rel, _ in JobDir(str(job)).walk("code")] == ["code/pkg/a.py"]


def test_a_fifo_or_a_hard_link_is_never_written(box: dict, tmp_path: Path) -> None:
    job = box["job"]
    (job / "logs").mkdir(parents=True)
    os.mkfifo(job / "logs" / "rank-0.log")
    os.link(box["vfile"], job / "logs" / "rank-1.log")
    jd = JobDir(str(job))
    failed: list[BaseException] = []

    def on_the_fifo() -> None:
        try:
            with pytest.raises(UnsafePath, match="not a file"):
                jd.open_for_write("logs/rank-0.log")
            with pytest.raises(UnsafePath, match="not a file"):
                jd.read("logs/rank-0.log", 10)
        except BaseException as e:
            failed.append(e)
    # a FIFO opened to be used waits for its other end, which never comes here: a call
    # that blocked would still be blocked at the deadline (which only allows for load)
    caller = threading.Thread(target=on_the_fifo, daemon=True)
    caller.start()
    caller.join(30)
    blocked = caller.is_alive()
    if blocked:   # its other end, so that the blocked call returns
        os.close(os.open(job / "logs" / "rank-0.log", os.O_RDWR | os.O_NONBLOCK))
    assert not blocked, "a FIFO must not block the agent"
    if failed:
        raise failed[0]
    with pytest.raises(UnsafePath, match="hard link"):
        jd.open_for_write("logs/rank-1.log")


def test_remote_dir_may_be_a_link(tmp_path: Path) -> None:
    real = tmp_path / "scratch"
    real.mkdir()
    (tmp_path / "orch").symlink_to(real)
    jd = JobDir(str(tmp_path / "orch" / "job"))
    assert jd.path == str(real / "job")
    jd.write_file("run/launch.json", b"{}")
    assert (real / "job" / "run" / "launch.json").read_bytes() == b"{}"


def test_read_is_capped_and_write_file_is_atomic(tmp_path: Path) -> None:
    jd = JobDir(str(tmp_path / "job"))
    jd.write_file("run/big.json", b"x" * 1000, 0o600)
    assert stat.S_IMODE(os.stat(tmp_path / "job" / "run" / "big.json").st_mode) == 0o600
    assert jd.read("run/big.json", 1000) == b"x" * 1000
    with pytest.raises(UnsafePath, match="larger than"):
        jd.read("run/big.json", 999)
    assert jd.read("run/missing.json", 10) is None
    assert os.listdir(tmp_path / "job" / "run") == ["big.json"], "a temporary file was left"


@pytest.mark.parametrize("rel", ["../x", "a/../../x", "/etc/passwd", "a//b", "a/./b", "",
                                 "a/\0b"])
def test_unsafe_relative_paths_are_refused(tmp_path: Path, rel: str) -> None:
    jd = JobDir(str(tmp_path / "job"))
    with pytest.raises(UnsafePath, match="unsafe"):
        jd.write_file(rel or "", b"x")
    assert not (tmp_path / "x").exists()


def test_a_backslash_is_part_of_a_name(tmp_path: Path) -> None:
    """POSIX allows a backslash in a name; it separates nothing, so it cannot leave."""
    jd = JobDir(str(tmp_path / "job"))
    jd.write_file("a\\..\\b", b"x")
    assert (tmp_path / "job" / "a\\..\\b").read_bytes() == b"x"


def test_link_targets_must_stay_inside_the_folder() -> None:
    for rel, target in (("l", "a.py"), ("d/l", "../a.py"), ("d/e/l", "../../x/y"), ("d/l", "x"),
                        ("d/l", "../d")):
        check_link_target(rel, target)
    for rel, target in (("l", "/etc/passwd"), ("l", "../x"), ("d/l", "../../x"), ("l", ""),
                        ("l", "a/../b"), ("l", "./a"), ("l", "a//b"), ("d/l", ".."),
                        ("l", "a/../../x"), ("l", "a\0b")):
        with pytest.raises(UnsafePath, match="unsafe link"):
            check_link_target(rel, target)


# ---------------------------------------------------------------- the ledger through the agent

def test_only_pushed_files_are_reported_and_deleted(tmp_path: Path) -> None:
    job = tmp_path / "job"
    code = job / "code"
    res = agent("receive", str(code), stdin=frame("train.py", b"print(1)\n") +
                frame("pkg/util.py", b"u") + link_frame("pkg/alias.py", "util.py") + end())
    assert res.returncode == 0, res.stdout + res.stderr
    assert os.readlink(code / "pkg" / "alias.py") == "util.py"
    # what the job writes into its working folder
    ckpt = code / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"weights")
    (code / "__pycache__").mkdir()
    (code / "__pycache__" / "x.pyc").write_bytes(b"pyc")
    (code / "pkg" / "job-made.txt").write_text("mine")
    got = reply(agent("manifest", str(code)))["files"]
    assert sorted(got) == ["pkg/alias.py", "pkg/util.py", "train.py"]
    assert got["pkg/alias.py"][1] == "link:util.py"
    # the controller asks to delete all of them; only orch's own go
    asked = ["train.py", "pkg/util.py", "pkg/alias.py", "pkg/job-made.txt", "__pycache__/x.pyc",
             "lightning_logs/version_0/checkpoints/epoch=0.ckpt"]
    res = agent("receive", str(code), stdin=end(asked))
    assert reply(res)["deleted"] == 3, res.stdout
    assert ckpt.read_bytes() == b"weights" and (code / "__pycache__" / "x.pyc").read_bytes() == b"pyc"
    assert (code / "pkg" / "job-made.txt").read_text() == "mine"
    assert not (code / "train.py").exists() and not os.path.lexists(code / "pkg" / "alias.py")
    assert reply(agent("manifest", str(code)))["files"] == {}


def test_a_changed_pushed_file_is_hashed_again_and_a_replaced_one_is_no_longer_orchs(
        tmp_path: Path) -> None:
    code = tmp_path / "job" / "code"
    agent("receive", str(code), stdin=frame("a.py", b"one") + frame("b.py", b"two") + end())
    (code / "a.py").write_bytes(b"ONE!")
    (code / "b.py").unlink()
    (code / "b.py").mkdir()            # the job put a folder where orch had a file
    got = reply(agent("manifest", str(code)))["files"]
    assert got == {"a.py": [4, hashlib.sha256(b"ONE!").hexdigest()]}
    res = agent("receive", str(code), stdin=frame("b.py", b"two") + end())
    assert res.returncode == 1 and "b.py is not a file" in reply(res)["error"], res.stdout
    assert "mv " in reply(res)["fix"]


def test_a_link_entry_leaving_the_folder_is_refused(box: dict) -> None:
    code = box["job"] / "code"
    for target in ("/etc/passwd", "../../victim", "sub/../../x", str(box["victim"])):
        res = agent("receive", str(code), stdin=link_frame("esc", target) + end())
        assert res.returncode == 1 and "unsafe link" in reply(res)["error"], res.stdout
        assert not os.path.lexists(code / "esc")


def test_an_old_digest_cache_makes_nothing_deletable(tmp_path: Path) -> None:
    """A host from before the ledger: its cache lists every file, the job's too."""
    job = tmp_path / "job"
    (job / "code").mkdir(parents=True)
    (job / "run").mkdir()
    (job / "code" / "snapshot.pt").write_bytes(b"snap")
    (job / "code" / "stale.orch-part-42").write_bytes(b"half")
    (job / "run" / "code-digests.json").write_text(json.dumps(
        {"snapshot.pt": ["4:1:1", hashlib.sha256(b"snap").hexdigest()]}))
    assert reply(agent("manifest", str(job / "code")))["files"] == {}
    assert not (job / "code" / "stale.orch-part-42").exists(), "orch's own leftover stays"
    res = agent("receive", str(job / "code"), stdin=end(["snapshot.pt"]))
    assert reply(res)["deleted"] == 0 and (job / "code" / "snapshot.pt").read_bytes() == b"snap"


def test_a_killed_receiver_leaves_a_journal_of_what_it_placed(tmp_path: Path) -> None:
    code = tmp_path / "job" / "code"
    (code).mkdir(parents=True)
    proc = subprocess.Popen(bundle.agent_argv(sys.executable),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin and proc.stdout and proc.stderr
    try:
        proc.stdin.write(bundle.agent_stdin() + request("receive", str(code)) +
                         frame("done.bin", b"d" * 1000) + frame("big.bin", b"b" * 5000)[:-4000])
        proc.stdin.flush()
        wait_until(lambda: (code / "done.bin").exists() and
                   any(".orch-part-" in n for n in os.listdir(code)), 10, "the first file in place")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdin.close()
        proc.stdout.close()
        proc.stderr.close()
    assert (tmp_path / "job" / "run" / "code-pushed.journal").exists()
    got = reply(agent("manifest", str(code)))["files"]
    assert got == {"done.bin": [1000, hashlib.sha256(b"d" * 1000).hexdigest()]}
    assert sorted(os.listdir(code)) == ["done.bin"], "the half-written file was not removed"
    assert not (tmp_path / "job" / "run" / "code-pushed.journal").exists()


def test_a_tampered_ledger_entry_is_dropped(tmp_path: Path) -> None:
    job = tmp_path / "job"
    (job / "run").mkdir(parents=True)
    (job / "code").mkdir()
    (tmp_path / "outside.txt").write_text("x")
    (job / "run" / "code-pushed.json").write_text(json.dumps({"version": 1, "files": {
        "../../outside.txt": [1, "0" * 64, "1:1:1"], "ok.py": "not a list"}}))
    ledger = Ledger(JobDir(str(job)), "code")
    assert ledger.files == {}
    assert manifest(JobDir(str(job)), "code")["files"] == {}
    assert (tmp_path / "outside.txt").read_text() == "x"


def test_a_file_is_written_beside_under_a_name_that_fits() -> None:
    """A 255-byte name cannot take the `.orch-part-<pid>` suffix: its half-written file
    gets a short name of its own, still one every sweep finds (and distinct per name)."""
    from orchestrator.agent.paths import PART, part_name
    assert part_name("a.txt") == f"a.txt{PART}{os.getpid()}"
    long = "x" * 251 + ".jpg"
    tmp, other = part_name(long), part_name("y" * 255)
    assert len(os.fsencode(tmp)) <= 255 and PART in tmp and tmp != other
    assert part_name("\udcff" * 255).startswith(PART)   # bytes count, not characters


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_held_folder_is_gone_through_and_closes_with_its_jobdir(tmp_path: Path) -> None:
    """hold("run"): every record of run/ is read and written through one descriptor kept
    open (no walk from the job folder each time: a moved job folder is still reached
    through it), a link in it is still refused, and close() (or the JobDir's end) closes
    it with the job folder's own."""
    (tmp_path / "job" / "run").mkdir(parents=True)
    before = open_fds()
    jd = JobDir(str(tmp_path / "job"))
    jd.hold("run")
    jd.write_file("run/host.exit", b'{"code": 0}')
    (tmp_path / "job").rename(tmp_path / "moved")   # a walk from the path would fail now
    assert jd.read("run/host.exit", 100) == b'{"code": 0}'
    os.symlink("/etc/passwd", tmp_path / "moved" / "run" / "link")
    with pytest.raises(UnsafePath):
        jd.read("run/link", 100)
    assert len(open_fds() - before) == 2   # the job folder and run/
    jd.release("run")
    assert len(open_fds() - before) == 1
    jd.hold("run")
    del jd   # a request's JobDir ends with it: nothing of it stays open
    assert open_fds() == before
