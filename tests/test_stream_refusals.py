"""A refused stream never costs a host (agent/streams.py): every request that carries a
stream (`receive`, `keep_receive`, `restore`) refused at its first item, refused in the
middle (a link planted on the way), or out of disk in the middle, between the
controller's real code and a real agent (a `connection: local` host). In each, one
error names the cause, the next request on the same link works, and a `stop` there
ends the job's processes. The controller's side: a stream it gives up on half way
(a file that shrank or cannot be read) ends with `abort`, and a pull whose local
receiver fails leaves the link in step."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from helpers import wait_until_gone
from orchestrator.config.inventory import load, parse
from orchestrator.errors import DataError, OrchError, UsageError
from orchestrator.files import pull
from orchestrator.files.localfiles import DigestCache, LocalFile
from orchestrator.files.sync import Received, Stall, stream_and_wait
from orchestrator.remote.link import Link
from orchestrator.remote.transport import LocalTransport
from orchestrator.session.session import Session
from orchestrator.wire import protocol

MB = 1 << 20
REQUESTS = ("receive", "keep_receive", "restore")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Host:
    link: Link
    job: Path          # the job folder on the "host"
    here: Path         # where this side's files are
    rank: subprocess.Popen   # a process of the job (its marker in its environment)
    close: Callable[[], None]


# every test runs against a `connection: local` host's agent and over real sshd
KINDS = ["local", pytest.param("sshd", marks=pytest.mark.ssh)]


def start(kind: str, tmp_path: Path, remote: Path, request: pytest.FixtureRequest) -> Host:
    """The host's agent on a link, its job folder `remote`/job with a process of the job
    running (a `sleep` carrying the job's marker)."""
    job = remote / "job"
    job.mkdir(parents=True, exist_ok=True)
    here = tmp_path / "here"
    here.mkdir(exist_ok=True)
    rank = subprocess.Popen(["sleep", "300"], env={"ORCH_JOB_DIR": str(job), "PATH": "/usr/bin:/bin"},
                            start_new_session=True)
    if kind == "local":
        text = (f"name: wire\nhosts:\n  - address: localhost\n    connection: local\n"
                f"    remote_dir: {remote}\npython: {sys.executable}\njob:\n  entrypoint: job.py\n")
        link = Link(LocalTransport(parse(text, tmp_path / "cluster.yaml").hosts[0],
                                   cwd=str(tmp_path)))
        link.start(timeout=30)
        proc = link.chan.proc  # type: ignore[union-attr]

        def close() -> None:
            link.close()
            proc.wait(10)   # the agent ended with its stdin
        return Host(link, job, here, rank, close)
    sshd = request.getfixturevalue("sshd_cluster")
    entry = {"address": sshd.hosts[3].address, "procs": 1, "remote_dir": str(remote)}
    (tmp_path / "job.py").write_text("pass\n")
    inv = sshd.write_inventory(tmp_path / "cluster.yaml", hosts=[], extra_hosts=[entry],
                               name="job")
    session = Session(load(inv)).open()
    assert 0 in session.links, session.records[0].error
    return Host(session.links[0], job, here, rank, session.close)


@pytest.fixture(params=KINDS)
def host(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Host]:
    yield from ended(start(request.param, tmp_path, tmp_path / "remote", request))


def ended(h: Host) -> Iterator[Host]:
    try:
        yield h
    finally:
        if h.rank.poll() is None:
            os.killpg(h.rank.pid, 9)
        h.rank.wait(10)
        h.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "orch-test-stream", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def files_of(h: Host, sizes: dict[str, int]) -> list[LocalFile]:
    """Local files to send, named as the request's stream names them."""
    out = []
    for rel, size in sizes.items():
        path = h.here / rel.replace("/", "_")
        data = os.urandom(size)
        path.write_bytes(data)
        out.append(LocalFile(rel, str(path), size, 0o644, sha(data)))
    return out


def send(h: Host, command: str, files: list[LocalFile]) -> Received:
    """The stream of `command` with the controller's own code (sync.stream_and_wait)."""
    job = str(h.job)
    fields: dict[str, Any] = {"job_dir": job} if command != "receive" else {}
    dest = f"{job}/code" if command == "receive" else job
    with Stall(h.link) as stall:
        return stream_and_wait(h.link, stall, dest, files, [], None, command, **fields)


def names(command: str, *rels: str) -> list[str]:
    """Paths as each request's stream names them (receive: relative to code/)."""
    prefix = {"receive": "", "keep_receive": "output/ck/", "restore": "output/ck/"}[command]
    return [prefix + rel for rel in rels]


def folder(h: Host, command: str) -> Path:
    """Where the stream's files land on the host."""
    return {"receive": h.job / "code", "keep_receive": h.job / "checkpoints" / "output" / "ck",
            "restore": h.job / "output" / "ck"}[command]


def still_usable(h: Host) -> None:
    """The next request on the same link is answered, and a stop ends the job's process."""
    assert h.link.dead is None
    assert "time" in h.link.request("clock", 30)
    got = h.link.request("stop", 60, job_dir=str(h.job), grace=2)
    assert got["found"] >= 1 and got["left"] == [], got
    assert wait_until_gone([h.rank.pid], 10) == [] or h.rank.poll() is not None


def plant(h: Host, command: str, rel_folder: str, tmp_path: Path) -> Path:
    """A link planted where a folder of the stream belongs (under its landing folder)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    where = folder(h, command) / rel_folder if rel_folder else folder(h, command)
    where.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(elsewhere, where)
    return elsewhere


@pytest.mark.parametrize("command", REQUESTS)
def test_refused_at_the_first_item(command: str, host: Host, tmp_path: Path) -> None:
    """The folder the stream goes into is a link (keep_receive: the reported case, its
    checkpoints/): refused before the first item is read."""
    top = {"receive": "code", "keep_receive": "checkpoints", "restore": "output"}[command]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, host.job / top)
    sent = files_of(host, dict.fromkeys(names(command, "a/1.bin", "b/2.bin"), 3 * MB))
    with pytest.raises(OrchError) as err:
        send(host, command, sent)
    text = str(err.value)
    assert text.startswith(f"{host.link.name}: {command} failed:") and "link" in text, text
    assert "unknown request" not in text
    assert list(elsewhere.iterdir()) == []
    still_usable(host)


@pytest.mark.parametrize("size", [MB, 10_000], ids=["files", "batched"])
@pytest.mark.parametrize("command", REQUESTS)
def test_refused_in_the_middle(command: str, size: int, host: Host, tmp_path: Path) -> None:
    """A link planted under the landing folder, met at the second file (receive sends
    small files in `files` batches: refused inside a batch)."""
    folder(host, command).mkdir(parents=True, exist_ok=True)
    elsewhere = plant(host, command, "b", tmp_path)
    sent = files_of(host, dict.fromkeys(names(command, "a/1.bin", "b/2.bin", "c/3.bin"), size))
    with pytest.raises(OrchError) as err:
        send(host, command, sent)
    text = str(err.value)
    assert "link" in text and "unknown request" not in text, text
    assert list(elsewhere.iterdir()) == []
    assert (folder(host, command) / "a" / "1.bin").stat().st_size == size   # what landed stays
    assert not (folder(host, command) / "c").exists()
    still_usable(host)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", REQUESTS)
def test_out_of_disk_in_the_middle(command: str, kind: str, tmp_path: Path, small_disk: Path,
                                   request: pytest.FixtureRequest) -> None:
    for h in ended(start(kind, tmp_path, small_disk, request)):
        # 2 MiB of disk: the first file lands, the second does not fit
        sent = files_of(h, dict.fromkeys(names(command, "a/1.bin", "b/2.bin", "c/3.bin"),
                                          5 * MB // 4))
        with pytest.raises(OrchError) as err:
            send(h, command, sent)
        text = str(err.value)
        assert "no space left on device" in text and "2.bin" in text, text
        assert err.value.hint and "free space" in err.value.hint
        assert not list(small_disk.rglob("*.orch-part-*"))
        still_usable(h)


@pytest.mark.parametrize("command", REQUESTS)
def test_a_stream_this_side_gives_up_on_half_way_ends_with_abort(
        command: str, host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """A big file that shrinks while it is sent: the stream is aborted after the bytes
    that were there, the host keeps what landed and drops the half file."""
    sent = files_of(host, dict.fromkeys(names(command, "a/1.bin", "b/2.bin"), 3 * MB))
    with open(sent[1].path, "r+b") as f:   # listed at 3 MB, now 1.5
        f.truncate(3 * MB // 2)
    with pytest.raises(DataError, match="shrank while it was sent"):
        send(host, command, sent)
    assert (folder(host, command) / "a" / "1.bin").stat().st_size == 3 * MB
    assert not list(host.job.rglob("*.orch-part-*"))
    still_usable(host)


@pytest.mark.parametrize("command", REQUESTS)
def test_a_local_file_gone_since_its_listing_is_named_and_the_stream_aborted(
        command: str, host: Host) -> None:
    sent = files_of(host, dict.fromkeys(names(command, "a/1.bin", "b/2.bin"), 10_000))
    os.unlink(sent[1].path)
    with pytest.raises(DataError, match=f"{sent[1].path}: cannot be read"):
        send(host, command, sent)
    assert not list(host.job.rglob("*.orch-part-*"))
    still_usable(host)


def test_a_request_where_an_item_belongs_ends_the_stream_and_is_served(host: Host) -> None:
    """A controller that gave up on a stream without ending it: the host answers the
    stream's request with an error and serves the request that came instead."""
    link = host.link
    _, first = link.submit("keep_receive", job_dir=str(host.job))
    data = os.urandom(1000)
    link.send(protocol.stream_item("file", p="output/x.pt", s=5000, h=sha(data), m=0o644)
              + protocol.frame(protocol.DATA, data))
    _, clock = link.submit("clock")
    with pytest.raises(OrchError, match="keep_receive failed"):
        link.wait(first, 30)
    assert "time" in link.wait(clock, 30)
    assert not list(host.job.rglob("*.orch-part-*"))
    still_usable(host)


# ---------------------------------------------------------------- a pull, this side failing

def host_output(h: Host, sizes: dict[str, int]) -> None:
    for rel, size in sizes.items():
        path = h.job / "output" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))


def test_a_pull_refused_by_the_host_at_its_first_item(
        tmp_path: Path, host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's output/ becomes a link between its listing and the send: every file is
    refused there (named, never read through the link), and the link stays in step."""
    host_output(host, {"a/1.bin": MB, "b/2.bin": MB})
    elsewhere = tmp_path / "elsewhere"

    def swap(dest: Any, fetch: Any) -> None:   # after the plan, before the files are asked
        os.rename(host.job / "output", elsewhere)
        os.symlink(elsewhere, host.job / "output")
    monkeypatch.setattr(pull, "check_space", swap)
    cache = DigestCache(tmp_path / "digests.bin")
    report = pull.pull(host.link, str(host.job), [], tmp_path / "out", cache)
    assert report.files == 0 and report.skipped_count == 2, report
    assert all("symbolic link" in s["why"] for s in report.skipped), report.skipped
    still_usable(host)


def test_a_pull_out_of_local_disk_half_way_leaves_the_link_in_step(
        tmp_path: Path, host: Host, small_disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up while the files come (another writer; the space was there when
    the pull checked): the files that fit land, the others are named with the cause."""
    host_output(host, dict.fromkeys(("a/1.bin", "b/2.bin", "c/3.bin"), 5 * MB // 4))
    monkeypatch.setattr(pull, "check_space", lambda dest, fetch: None)
    cache = DigestCache(tmp_path / "digests.bin")
    report = pull.pull(host.link, str(host.job), [], small_disk / "out", cache)
    assert report.files >= 1 and report.failed, report
    assert "No space left on device" in report.failed[0]["why"], report.failed
    with pytest.raises(UsageError, match="could not write"):
        pull.raise_failed(report)
    assert not list(small_disk.rglob("*.orch-part-*"))
    still_usable(host)


def test_a_link_planted_in_the_destination_half_way_through_a_pull(
        tmp_path: Path, host: Host) -> None:
    """A link appears in place of a folder of the destination while the files come: the
    file under it is refused (never written through), the rest land, the link stays in
    step."""
    host_output(host, {"a/1.bin": MB, "b/2.bin": MB, "c/3.bin": MB})
    root, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()

    def planted(nbytes: int) -> None:
        if not (root / "b").is_symlink():
            os.symlink(elsewhere, root / "b")
    cache = DigestCache(tmp_path / "digests.bin")
    report = pull.pull(host.link, str(host.job), [], root, cache, progress=planted)
    assert report.files == 2 and [f["p"] for f in report.failed] == ["b/2.bin"], report
    assert "symbolic link" in report.failed[0]["why"]
    assert list(elsewhere.iterdir()) == []
    still_usable(host)


def test_a_receiver_that_fails_unexpectedly_costs_the_pull_not_the_host(
        tmp_path: Path, host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever this side's receiver raises (here a bug: a RuntimeError) ends that pull
    with its cause once the host's reply came; the host is not declared lost."""
    host_output(host, {"a/1.bin": MB, "b/2.bin": MB})

    def broken(self: pull.Receiver, payload: bytes) -> None:
        raise RuntimeError("the receiver broke")
    monkeypatch.setattr(pull.Receiver, "data", broken)
    cache = DigestCache(tmp_path / "digests.bin")
    with pytest.raises(OrchError, match="the receiver broke") as err:
        pull.pull(host.link, str(host.job), [], tmp_path / "out", cache)
    assert "connection lost" not in str(err.value)
    still_usable(host)


def test_a_refused_stream_is_cut_short_by_this_side(host: Host, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The host answers a refusal at once: this side stops sending at the next frame and
    ends the stream with `abort`, instead of sending (and the host skipping) the rest."""
    os.symlink(tmp_path, host.job / "checkpoints")
    big = host.here / "big.pt"
    with open(big, "wb") as f:
        f.truncate(256 * MB)   # sparse: read fast, nothing on disk
    sent: list[int] = []
    real = Stall.send

    def counted(self: Stall, data: bytes | memoryview) -> None:
        sent.append(len(data))
        real(self, data)
    monkeypatch.setattr(Stall, "send", counted)
    with pytest.raises(OrchError, match="symbolic link"):
        send(host, "keep_receive", [LocalFile("output/ck/big.pt", str(big), 256 * MB, 0o644,
                                              "0" * 64)])
    assert sum(sent) < 128 * MB, sum(sent)
    still_usable(host)


# ---------------------------------------------------------------- the same class elsewhere

def test_a_host_lost_to_its_follow_alone_is_still_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that answered its follow with an error (a log it cannot read) is lost to
    the follow, not to its link: the fail-fast stop (Session.stop with the lost hosts
    skipped) still reaches it, so its ranks never run on, on a reachable host. A host
    whose link is gone is skipped."""
    import fake_agent

    fake = fake_agent.FakeCluster(lambda label, rank, env: None).install(monkeypatch)
    (tmp_path / "job.py").write_text("print('hi')\n")
    inv = tmp_path / "cluster.yaml"
    inv.write_text("name: fk\nhosts:\n"
                   + "".join(f"  - {{address: 127.0.0.{i}, connection: local, remote_dir: /r{i}}}\n"
                             for i in (1, 2, 3))
                   + "code: {paths: [job.py]}\njob: {entrypoint: job.py}\n")
    session = Session(load(inv)).open()
    try:
        session.links[2].lost("no answer for 15 s")   # lost for real: its link is gone
        # host 1 is lost to its follow only: its link is up
        result = session.stop(1.0, skip={1, 2})
        assert sorted(result.ok) == [0, 1], result
        assert fake.asked("stop") == {"127.0.0.1": 1, "127.0.0.2": 1}, fake.log
    finally:
        session.close()


def test_a_receive_lock_is_the_owners_alone(tmp_path: Path) -> None:
    """Any user who can open a file can flock it: a receive lock others could open would
    let one keep every push out of the folder. It is made 0600, and an older one is
    made so."""
    import stat

    from orchestrator.agent import files
    from orchestrator.agent.paths import JobDir

    jd = JobDir(str(tmp_path / "job"))
    os.close(files.receive_lock(jd, "code"))
    lock = tmp_path / "job" / "run" / "code-receive.lock"
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    lock.chmod(0o644)
    os.close(files.receive_lock(jd, "code"))
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600


def test_a_keeper_host_that_refuses_the_copy_is_said_once_and_not_asked_every_round(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`checkpoint_to: host` with a link in place of the keeper host's checkpoints/: the
    round fails with the host's own words, one warning says it with the fix, the next
    rounds fetch nothing from rank 0's host until the retry time, and the keeper host's
    link stays usable (its job can be stopped)."""
    from orchestrator.session import hostkeep
    from test_hostkeep_units import CK, inventory, job_of, write

    cluster = load(inventory(tmp_path))
    session = Session(cluster).open()
    try:
        write(job_of(tmp_path, 0) / CK / "epoch-1.pt", b"one")
        (job_of(tmp_path, 1)).mkdir(parents=True, exist_ok=True)
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        os.symlink(elsewhere, job_of(tmp_path, 1) / "checkpoints")
        keeper = hostkeep.HostKeeper(session, cluster, cluster.hosts[1])
        sent: list[str] = []
        submit = session.links[0].submit

        def counted(t: str, *a: Any, **k: Any) -> Any:
            sent.append(t)
            return submit(t, *a, **k)
        session.links[0].submit = counted  # type: ignore[method-assign,assignment]
        with caplog.at_level("WARNING", logger="orchestrator"):
            assert not keeper.round()
            assert not keeper.round()
        assert "symbolic link" in (keeper.last_error or ""), keeper.last_error
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and said[0].startswith(
            f"checkpoints are not being kept on {cluster.hosts[1].label}: "), said
        assert "fix: remove it" in said[0], said
        assert sent.count("pull_send") == 1, sent   # the second round fetched nothing
        assert list(elsewhere.iterdir()) == []
        klink = session.links[1]
        assert klink.dead is None and "time" in klink.request("clock", 30)
        os.unlink(job_of(tmp_path, 1) / "checkpoints")
        keeper.retry_at = 0.0   # the retry time has come
        with caplog.at_level("WARNING", logger="orchestrator"):
            assert keeper.round(), keeper.last_error
        assert (job_of(tmp_path, 1) / "checkpoints" / CK / "epoch-1.pt").read_bytes() == b"one"
        assert caplog.records[-1].getMessage().endswith("kept on " + cluster.hosts[1].label
                                                        + " again")
    finally:
        session.close()


def test_orch_up_stops_a_host_whose_follow_was_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The same through `orch up`: the refusal is named, the host is stopped with the
    others and never said NOT stopped."""
    import fake_agent
    from orchestrator import cli
    from orchestrator.errors import EXIT_JOB_FAILED

    fake = fake_agent.FakeCluster(lambda label, rank, env: None).install(monkeypatch)
    hosts = ("127.0.0.1", "127.0.0.2")

    def refused(chan: fake_agent.FakeChannel, msg: dict) -> None:
        chan.push(protocol.error(msg["id"], protocol.HOST, "logs/rank-2.log is a symbolic link"))
    fake.on("follow", refused, hosts[1])
    (tmp_path / "job.py").write_text("print('hi')\n")
    inv = tmp_path / "cluster.yaml"
    inv.write_text("name: fk\nhosts:\n"
                   + "".join(f"  - {{address: {a}, connection: local, remote_dir: /r{i}, procs: 2}}\n"
                             for i, a in enumerate(hosts))
                   + "code: {paths: [job.py]}\njob: {entrypoint: job.py}\n")
    assert cli.cli(["up", "-c", str(inv), "--no-pull"]) == EXIT_JOB_FAILED
    err = " ".join(capsys.readouterr().err.split())
    assert "logs/rank-2.log is a symbolic link" in err, err
    assert "NOT stopped" not in err, err
    assert fake.asked("stop") == dict.fromkeys(hosts, 1), fake.log
