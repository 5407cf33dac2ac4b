"""`orch pull` without SSH: the names a host may send, the destination's link safety
(a planted link is never written through), the incremental plan, the receiver's
checks, the host side (agent/pull.py), and both sides together behind the real Link
with an in-process agent (tests/fake_agent.py)."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fake_agent import FakeTransport
from helpers import FakeClock
from orchestrator.agent import pull as host_pull
from orchestrator.agent.common import AgentError
from orchestrator.config.inventory import parse
from orchestrator.errors import HostError, UsageError
from orchestrator.files import localfiles
from orchestrator.files.localfiles import DigestCache
from orchestrator.files.pull import (
    Entry,
    PullReport,
    Receiver,
    check_manifest,
    check_paths,
    plan,
    raise_failed,
)
from orchestrator.files.pulldest import Dest
from orchestrator.remote.link import PullEnd, PullFile
from orchestrator.session.session import Session
from orchestrator.wire import protocol, timeouts


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entry(data: bytes) -> Entry:
    return Entry(len(data), sha(data))


# ---------------------------------------------------------------- names from the host

HOSTILE = ["/etc/passwd", "../escape", "a/../../escape", "a/./b", "a//b", "", "a\0b",
           "x" * 300, "/".join(["d"] * 600), "a.orch-part-12", "bad\ud800"]
# names a POSIX file system holds: pulled as they are (shown escaped)
ODD = ["a\nb", "a\x1bb", "bad\udcff", "back\\slash", " lead", "-dash", "x" * 255]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_name_in_the_manifest_is_refused(name: str) -> None:
    with pytest.raises(HostError, match="pull manifest is refused"):
        check_manifest("h", {"ok.txt": entry(b"x"), name: entry(b"y")})


@pytest.mark.parametrize("name", ODD)
def test_any_name_a_file_system_holds_is_taken(name: str) -> None:
    check_manifest("h", {"ok.txt": entry(b"x"), name: entry(b"y")})


@pytest.mark.parametrize("value", [[-1, sha(b"")], [protocol.MAX_PULL_SIZE + 1, sha(b"")],
                                   [1, "0" * 63], [1, "G" * 64], [1, sha(b"").upper()]])
def test_sizes_and_digests_out_of_range_are_refused(value: list) -> None:
    with pytest.raises(HostError, match="out of range"):
        check_manifest("h", {"f": Entry(*value)})


def test_a_file_that_is_also_a_folder_and_too_many_files_are_refused(monkeypatch) -> None:
    with pytest.raises(HostError, match="both a file and a folder"):
        check_manifest("h", {"a": entry(b""), "a/b": entry(b"")})
    monkeypatch.setattr(protocol, "MAX_PULL_FILES", 3)
    with pytest.raises(HostError, match=r"4 files, more than 3"):
        check_manifest("h", {str(i): entry(b"") for i in range(4)})


def test_user_paths_are_relative_to_output() -> None:
    assert check_paths(["ckpt/", "./metrics.csv", "ckpt"]) == ["ckpt", "metrics.csv"]
    assert check_paths(["."]) == []
    for bad in ("/etc", "../x", "a/../../b", "a\0b"):
        with pytest.raises(UsageError, match="cannot pull"):
            check_paths([bad])


# ---------------------------------------------------------------- the destination

def receive(dest: Dest, files: dict[str, bytes], digests: dict | None = None,
            cache: DigestCache | None = None) -> PullReport:
    """Feed the receiver a stream as a host would send it."""
    report = PullReport("h", "/job/output", str(dest.root))
    cache = cache or DigestCache(dest.root.parent / "cache.json")
    rx = Receiver(dest, {rel: entry(d) for rel, d in files.items()}, cache, report, None)
    for rel, data in files.items():
        rx.part(PullFile(rel, len(data), 0o644))
        for i in range(0, len(data), 7):
            rx.data(data[i:i + 7])
        rx.part(PullEnd(rel, (digests or {}).get(rel, sha(data))))
    return report


def test_a_link_planted_at_a_file_name_is_replaced_never_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    before = os.stat(victim)
    root = tmp_path / "dest"
    root.mkdir()
    (root / "metrics.csv").symlink_to(victim)
    with Dest(root) as dest:
        report = receive(dest, {"metrics.csv": b"epoch,loss\n"})
    assert report.files == 1 and not report.failed
    assert victim.read_bytes() == b"precious\n"
    assert os.stat(victim).st_mtime_ns == before.st_mtime_ns
    assert not (root / "metrics.csv").is_symlink()
    assert (root / "metrics.csv").read_bytes() == b"epoch,loss\n"


def test_a_link_planted_in_place_of_a_folder_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "dest"
    (root / "ckpt").mkdir(parents=True)
    (root / "ckpt" / "deep").symlink_to(outside)
    with Dest(root) as dest:
        report = receive(dest, {"ckpt/deep/w.bin": b"weights", "ok.txt": b"ok"})
    assert report.files == 1 and (root / "ok.txt").read_bytes() == b"ok"
    assert [f["p"] for f in report.failed] == ["ckpt/deep/w.bin"]
    assert "symbolic link" in report.failed[0]["why"]
    assert list(outside.iterdir()) == [], "a file was written through the link"
    with pytest.raises(UsageError, match=r"could not write ckpt/deep/w\.bin"):
        raise_failed(report)


def test_a_digest_mismatch_leaves_nothing_behind(tmp_path: Path) -> None:
    root = tmp_path / "dest"
    with Dest(root) as dest:
        report = receive(dest, {"a.bin": b"abc"}, digests={"a.bin": sha(b"abd")})
    assert report.files == 0 and report.failed[0]["why"] == "sha256 mismatch after transfer"
    assert list(root.iterdir()) == []


def test_the_receiver_accepts_only_what_was_asked_once_and_no_more_bytes(tmp_path: Path) -> None:
    with Dest(tmp_path / "dest") as dest:
        report = PullReport("h", "", "")
        rx = Receiver(dest, {"a": entry(b"ab")}, DigestCache(tmp_path / "c.json"), report, None)
        with pytest.raises(protocol.ProtocolError, match="not asked for"):
            rx.part(PullFile("../../etc/passwd", 1, 0o644))
        rx.part(PullFile("a", 2, 0o644))
        with pytest.raises(protocol.ProtocolError, match="beyond the announced size"):
            rx.data(b"abc")
        rx.data(b"ab")
        rx.part(PullEnd("a", sha(b"ab")))
        with pytest.raises(protocol.ProtocolError, match="not asked for"):
            rx.part(PullFile("a", 2, 0o644))
        with pytest.raises(protocol.ProtocolError, match="file data"):
            rx.data(b"x")


def test_part_files_of_a_killed_pull_are_swept_and_one_pull_at_a_time(tmp_path: Path) -> None:
    root = tmp_path / "dest"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "big.bin.orch-part-4242").write_bytes(b"half")
    (root / "keep.txt").write_text("mine\n")
    with Dest(root) as dest:
        assert dest.sweep() == 1
        with pytest.raises(UsageError, match="another `orch pull`"):
            Dest(root)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == ["keep.txt", "sub"]


def test_the_plan_asks_only_for_missing_or_different_files(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # files written this instant are not remembered (localfiles.racy): here they may be
    monkeypatch.setattr(localfiles, "RACY_NS", -10**18)
    root = tmp_path / "dest"
    root.mkdir()
    (root / "same.txt").write_bytes(b"same")
    (root / "changed.txt").write_bytes(b"old!")
    (root / "local-only.txt").write_bytes(b"kept")
    remote = {"same.txt": entry(b"same"), "changed.txt": entry(b"new!"), "new/x": entry(b"x")}
    cache = DigestCache(tmp_path / "cache.json")
    with Dest(root) as dest:
        todo = plan(remote, dest, cache)
        assert sorted(todo.fetch) == ["changed.txt", "new/x"] and todo.unchanged == 1
        hashed: list[str] = []
        real = dest.digest

        def counting(rel: str) -> str:
            hashed.append(rel)
            return real(rel)
        dest.digest = counting  # type: ignore[method-assign]
        again = plan(remote, dest, cache)
    assert sorted(again.fetch) == sorted(todo.fetch) and hashed == [], "the cache was not used"
    assert (root / "local-only.txt").read_bytes() == b"kept"


# ---------------------------------------------------------------- the host side

class FakeReq:
    def __init__(self, **args) -> None:
        self.args = args
        self.parts: list[tuple[str, dict[str, Any]]] = []
        self.frames: list[Any] = []
        self.out = SimpleNamespace(send=self.frames.append)

    def part(self, kind: str, body: dict) -> None:
        self.parts.append((kind, body))
        self.frames.append(("part", kind, body))


def make_output(job: Path) -> None:
    out = job / "output"
    (out / "ckpt").mkdir(parents=True)
    (out / "metrics.csv").write_text("epoch\n1\n")
    (out / "ckpt" / "w.bin").write_bytes(b"w" * 3000)
    (out / "escape").symlink_to("/etc/passwd")
    (out / "ckpt" / "linked").symlink_to(out / "ckpt")
    os.mkfifo(out / "pipe")
    (out / "new\nline").write_text("x")          # any name a file system holds is pulled
    (out / "not-utf8-\udcff").write_text("y")


def test_the_host_lists_regular_files_only_and_caches_digests(tmp_path: Path) -> None:
    make_output(tmp_path / "job")
    req = FakeReq(job_dir=str(tmp_path / "job"), paths=[])
    reply = host_pull.run_manifest(req)
    files = {k: Entry(*v) for kind, body in req.parts for k, v in body["files"].items()}
    assert files == {"metrics.csv": entry(b"epoch\n1\n"), "ckpt/w.bin": entry(b"w" * 3000),
                     "new\nline": entry(b"x"), "not-utf8-\udcff": entry(b"y")}
    assert (reply["files"], reply["bytes"], reply["skipped_count"]) == (4, 3010, 3)
    whys = {n["p"]: n["why"] for n in reply["skipped"]}
    assert "symbolic link" in whys["escape"] and "symbolic link" in whys["ckpt/linked"]
    assert whys["pipe"] == "not a regular file"
    assert (tmp_path / "job/run/output-digests.json").exists()
    one = host_pull.run_manifest(FakeReq(job_dir=str(tmp_path / "job"), paths=["ckpt/w.bin"]))
    assert one["files"] == 1
    with pytest.raises(AgentError, match="no such file or folder"):
        host_pull.run_manifest(FakeReq(job_dir=str(tmp_path / "job"), paths=["nope"]))
    empty = host_pull.run_manifest(FakeReq(job_dir=str(tmp_path / "none"), paths=[]))
    assert empty["files"] == 0


def test_the_host_sends_asked_files_and_skips_links(tmp_path: Path) -> None:
    make_output(tmp_path / "job")
    req = FakeReq(job_dir=str(tmp_path / "job"), files=["ckpt/w.bin", "escape", "gone"])
    assert host_pull.run_send(req) == {"files": 1, "bytes": 3000}
    kinds = [f[1] if isinstance(f, tuple) else "data" for f in req.frames]
    assert kinds == ["pull_file", "data", "pull_end", "pull_skip", "pull_skip"]
    assert req.parts[1][1]["h"] == sha(b"w" * 3000)
    assert req.parts[2][1]["p"] == "escape" and req.parts[3][1]["why"] == "gone"


# ---------------------------------------------------------------- both sides, one Link

INVENTORY = """name: fake
hosts:
  - {address: localhost, connection: local, remote_dir: %s}
job: {entrypoint: job.py}
"""


def agent_handlers(tweak=None) -> dict:
    """The real agent/pull.py behind an in-process channel; `tweak(kind, body)` may
    rewrite the parts it sends."""
    def serve(fn):
        def handler(chan, msg: dict) -> None:
            send = chan.push

            def part(kind: str, body: dict) -> None:
                send(protocol.part(msg["id"], kind, tweak(kind, body) if tweak else body))
            req = SimpleNamespace(args=msg, out=SimpleNamespace(send=send), part=part)
            try:
                send(protocol.reply(msg["id"], fn(req)))
            except AgentError as e:
                send(protocol.error(msg["id"], e.category, str(e)))
        return handler
    return {"pull_manifest": serve(host_pull.run_manifest), "pull_send": serve(host_pull.run_send)}


def session(tmp_path: Path, handlers: dict) -> Session:
    cluster = parse(INVENTORY % (tmp_path / "remote"), tmp_path / "cluster.yaml")
    return Session(cluster, connector=lambda h: FakeTransport(h, handlers)).open()


def test_pull_over_a_link_then_nothing_then_the_change(tmp_path: Path) -> None:
    job = tmp_path / "remote" / "fake"
    make_output(job)
    (job / "output" / "big.bin").write_bytes(os.urandom(3 << 20))
    dest = tmp_path / "outputs" / "fake"
    with session(tmp_path, agent_handlers()) as s:
        host = s.cluster.hosts[0]
        first = s.pull(host, [], dest)
        assert (first.files, first.unchanged, first.skipped_count) == (5, 0, 3)
        assert (dest / "big.bin").read_bytes() == (job / "output" / "big.bin").read_bytes()
        assert os.fsencode("not-utf8-\udcff") in os.listdir(os.fsencode(dest))
        assert (dest / "new\nline").read_text() == "x"
        again = s.pull(host, [], dest)
        assert (again.files, again.unchanged) == (0, 5)
        (job / "output" / "metrics.csv").write_text("epoch\n1\n2\n")
        third = s.pull(host, [], dest)
        assert (third.files, third.unchanged) == (1, 4)
    assert (dest / "metrics.csv").read_text() == "epoch\n1\n2\n"
    assert not list(dest.rglob("*.orch-part-*"))


def test_a_file_changed_on_the_host_while_sent_is_dropped_then_pulled_next_time(
        tmp_path: Path) -> None:
    """The job shrinks big.bin on the host while the real agent sends it (after its size
    was announced): the agent pads the stream and sends no digest; the controller keeps
    nothing of it (no file, no part file), says why, and pulls it whole the next time."""
    job = tmp_path / "remote" / "fake"
    make_output(job)
    big = job / "output" / "big.bin"
    big.write_bytes(os.urandom(3 << 20))
    cut: list[int] = []

    def shrink(kind: str, body: dict) -> dict:
        if kind == "pull_file" and body["p"] == "big.bin" and not cut:
            cut.append(body["s"])
            os.truncate(big, 1 << 20)   # rewritten by the job while it is being sent
        return body
    dest = tmp_path / "outputs" / "fake"
    with session(tmp_path, agent_handlers(shrink)) as s:
        host = s.cluster.hosts[0]
        first = s.pull(host, [], dest)
        assert cut == [3 << 20]
        assert {"p": "big.bin", "why": "changed on the host while it was sent; pull again"} \
            in first.skipped, first.skipped
        assert first.files == 4 and not first.failed, first
        assert not (dest / "big.bin").exists() and not list(dest.rglob("*.orch-part-*"))
        again = s.pull(host, [], dest)
        assert (again.files, again.unchanged) == (1, 4), again
    assert (dest / "big.bin").read_bytes() == big.read_bytes() and len(big.read_bytes()) == 1 << 20


def test_a_pull_from_a_host_gone_silent_ends_after_pull_idle_on_a_fake_clock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host lists its files, then sends nothing: the pull gives up after PULL_IDLE
    (60 s of fake time, no real wait), not a check before; no part file is left."""
    clock = FakeClock()
    monkeypatch.setattr(timeouts, "CLOCK", clock)
    job = tmp_path / "remote" / "fake"
    make_output(job)
    dest = tmp_path / "outputs" / "fake"
    caught: list[BaseException] = []
    handlers = dict(agent_handlers(), pull_send=lambda chan, msg: None)   # silent from now on
    with session(tmp_path, handlers) as s:
        def pull() -> None:
            try:
                s.pull(s.cluster.hosts[0], [], dest)
            except BaseException as e:
                caught.append(e)
        puller = threading.Thread(target=pull, daemon=True)
        puller.start()
        clock.wait_for_checks(1)
        for _ in range(int(timeouts.PULL_IDLE / 0.5) - 1):   # to PULL_IDLE - 0.5 s: waits on
            clock.step(0.5, puller.is_alive)
        assert puller.is_alive() and not caught, caught
        clock.step(1.0, puller.is_alive)                      # past PULL_IDLE: given up
        puller.join(30)
    assert not puller.is_alive() and len(caught) == 1, caught
    assert isinstance(caught[0], HostError) and "the pull stalled" in str(caught[0]), caught
    assert not list(dest.rglob("*.orch-part-*"))


def test_a_host_that_sends_an_unasked_name_is_cut_off(tmp_path: Path) -> None:
    """The agent is swapped for one that renames what it sends to ../../escaped: the link
    ends with a protocol error, and nothing lands outside the destination."""
    job = tmp_path / "remote" / "fake"
    make_output(job)

    def evil(kind: str, body: dict) -> dict:
        return dict(body, p="../../escaped") if kind == "pull_file" else body
    dest = tmp_path / "outputs" / "fake"
    with session(tmp_path, agent_handlers(evil)) as s, \
            pytest.raises(HostError, match="not asked for"):
        s.pull(s.cluster.hosts[0], ["metrics.csv"], dest)
    assert not (tmp_path / "escaped").exists() and not list(tmp_path.rglob("escaped"))
    assert not list(dest.rglob("*.orch-part-*"))


def test_each_runs_pull_keeps_its_own_folder(tmp_path: Path) -> None:
    """outputs/<name>/ holds one run's files: a later run's pull first renames it to
    outputs/<name>.<when that run started>/ (nothing deleted); the same run pulls in place."""
    from orchestrator.api.pulling import run_dest
    from orchestrator.session.state import JobState
    cluster = parse("name: keep\nhosts: [{address: localhost, connection: local}]\n"
                    "job: {entrypoint: job.py}\n", tmp_path / "cluster.yaml")
    t1 = time.mktime((2026, 11, 25, 19, 30, 5, 0, 0, -1))
    first = JobState("keep", "a" * 32, "cluster.yaml", t1, 1, "127.0.0.1", 29500, [])
    second = dataclasses.replace(first, run_id="b" * 32, started=t1 + 3600)
    dest, aside = run_dest(cluster, first)
    assert dest == tmp_path / "outputs" / "keep" and aside is None
    dest.mkdir(parents=True)
    (dest / "metrics.png").write_text("run 1")
    assert run_dest(cluster, first) == (dest, None)       # the same run: pulled in place
    dest, aside = run_dest(cluster, second)
    assert aside == tmp_path / "outputs" / "keep.20261125-193005", aside
    assert (aside / "metrics.png").read_text() == "run 1" and not dest.exists()
    dest.mkdir()
    (dest / "metrics.png").write_text("run 2")
    assert run_dest(cluster, second) == (dest, None)
    dest, aside = run_dest(cluster, first)                 # any other run: set aside again
    assert aside == tmp_path / "outputs" / "keep.20261125-203005"
    assert (aside / "metrics.png").read_text() == "run 2"
