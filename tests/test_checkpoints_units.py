"""`job.checkpoint` (#22 item 3) without a host: the globs checked with file:line, their
matching (wire/globs.py, read by both sides), and the keeper's choices (what to fetch,
what a round prunes) and the agent's side on a local job folder."""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from orchestrator.config.inventory import load
from orchestrator.config.jobspec import DEFAULT_CHECKPOINT
from orchestrator.errors import InventoryError
from orchestrator.wire import globs

BASE = """\
name: demo
hosts:
  - address: localhost
    connection: local
job:
  entrypoint: worker.train
"""


def inventory(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(BASE + extra)
    return path


def test_default_is_worker_train_checkpoints(tmp_path: Path) -> None:
    assert load(inventory(tmp_path, "")).job.checkpoint == DEFAULT_CHECKPOINT
    assert load(inventory(tmp_path, "  checkpoint:\n")).job.checkpoint == DEFAULT_CHECKPOINT
    assert DEFAULT_CHECKPOINT == ("output/checkpoints/*.pt",)


def test_globs_parsed_as_written(tmp_path: Path) -> None:
    got = load(inventory(tmp_path, "  checkpoint: [output/*.pt, code/snapshot.pt, output/*.pt]\n"))
    assert got.job.checkpoint == ("output/*.pt", "code/snapshot.pt")
    one = load(inventory(tmp_path, "  checkpoint: output/**/last.ckpt\n"))
    assert one.job.checkpoint == ("output/**/last.ckpt",)
    assert load(inventory(tmp_path, "  checkpoint: []\n")).job.checkpoint == ()


@pytest.mark.parametrize("glob, why", [
    ("data/x.pt", "not under output/ or code/"),
    ("/abs/output/x.pt", "an absolute path"),
    ("~/x.pt", "an absolute path"),
    ("output/../x.pt", "not a plain relative path"),
    ("output/./x.pt", "not a plain relative path"),
    ("output", "not under output/ or code/"),
    ("run/host.json", "not under output/ or code/"),
    ("output/a**b", "`**` must be a whole path component"),
    ("'output/x\\\\y.pt'", "a control character or backslash"),
])
def test_bad_globs_name_file_and_line(tmp_path: Path, glob: str, why: str) -> None:
    path = inventory(tmp_path, f"  checkpoint:\n    - output/fine.pt\n    - {glob}\n")
    with pytest.raises(InventoryError) as info:
        load(path)
    text = str(info.value)
    assert f"{path}:9" in text and why in text and "job.checkpoint" in text, text
    assert "output/checkpoints/*.pt" in (info.value.hint or ""), info.value.hint


def test_nested_and_too_many_refused(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match=r"cluster.yaml:8.*single value"):
        load(inventory(tmp_path, "  checkpoint:\n    - {a: 1}\n"))
    many = "".join(f"    - output/f{i}.pt\n" for i in range(globs.MAX_GLOBS + 1))
    with pytest.raises(InventoryError, match="more than 64"):
        load(inventory(tmp_path, "  checkpoint:\n" + many))


@pytest.mark.parametrize("rest, rel, hit", [
    ("checkpoints/*.pt", "checkpoints/epoch-00003.pt", True),
    ("checkpoints/*.pt", "checkpoints/.epoch-00003.pt.tmp-42", False),
    ("checkpoints/*.pt", "checkpoints/deep/epoch-1.pt", False),
    ("*.pt", "checkpoints/epoch-1.pt", False),
    ("*.pt", "last.pt", True),
    ("**/*.pt", "last.pt", True),
    ("**/*.pt", "a/b/c.pt", True),
    ("**/*.pt", ".hidden/c.pt", False),
    ("snapshot.pt", "snapshot.pt", True),
    ("snapshot.pt", "snapshot.pt.orch-part-1", False),
    ("ckpt/epoch-[0-9].pt", "ckpt/epoch-7.pt", True),
    ("ckpt/.*", "ckpt/.state", True),
])
def test_glob_match(rest: str, rel: str, hit: bool) -> None:
    assert globs.match(rest, rel) is hit


def test_glob_root_is_the_fixed_folder() -> None:
    assert globs.root("checkpoints/*.pt") == "checkpoints"
    assert globs.root("*.pt") == ""
    assert globs.root("snapshot.pt") == "snapshot.pt"
    assert globs.root("a/b/**/x.pt") == "a/b"
    assert globs.split("code/snapshot.pt") == ("code", "snapshot.pt")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_prune_keeps_a_complete_round_only(tmp_path: Path) -> None:
    """What the keeper removes locally: files the host no longer has, and only after a
    round in which every listed file is held (never when the host lists nothing)."""
    from orchestrator.session.checkpoints import stale

    held = {"checkpoints/epoch-1.pt": sha(b"1"), "checkpoints/epoch-2.pt": sha(b"2")}
    listed = {"checkpoints/epoch-2.pt": [1, sha(b"2")], "checkpoints/epoch-3.pt": [1, sha(b"3")]}
    assert stale(held, listed) == []      # epoch-3 is not held yet: keep everything
    held["checkpoints/epoch-3.pt"] = sha(b"3")
    assert stale(held, listed) == ["checkpoints/epoch-1.pt"]
    assert stale(held, {}) == []          # a host that lists nothing wipes nothing
    held["checkpoints/epoch-2.pt"] = sha(b"old")
    assert stale(held, listed) == []      # epoch-2 differs: not complete yet


def test_agent_manifest_with_globs_and_settle(tmp_path: Path) -> None:
    """The agent lists only what the globs match, under code/ too, never a link, and
    leaves out what was written less than `settle` seconds ago."""
    from orchestrator.agent import pull as agent_pull

    job = tmp_path / "job"
    (job / "output" / "checkpoints").mkdir(parents=True)
    (job / "code").mkdir()
    (job / "run").mkdir()
    (job / "output" / "checkpoints" / "epoch-1.pt").write_bytes(b"one")
    (job / "output" / "checkpoints" / ".epoch-2.pt.tmp-9").write_bytes(b"half")
    (job / "output" / "metrics.csv").write_text("x\n")
    (job / "code" / "snapshot.pt").write_bytes(b"snap")
    (job / "code" / "train.py").write_text("")
    os.symlink("/etc/passwd", job / "output" / "checkpoints" / "evil.pt")
    old = os.stat(job / "code" / "snapshot.pt").st_mtime - 100
    for p in (job / "output" / "checkpoints" / "epoch-1.pt", job / "code" / "snapshot.pt"):
        os.utime(p, (old, old))

    class Req:
        def __init__(self, **args: object) -> None:
            self.args = {"job_dir": str(job), "paths": [], **args}
            self.parts: list = []

        def part(self, kind: str, body: dict) -> None:
            self.parts.append(body)

    req = Req(folder="output", globs=["checkpoints/*.pt"], settle=5.0)
    reply = agent_pull.run_manifest(req)
    files = {k: v for p in req.parts for k, v in p["files"].items()}
    assert files == {"checkpoints/epoch-1.pt": [3, sha(b"one")]}
    assert reply["skipped_count"] == 1 and "link" in reply["skipped"][0]["why"]
    (job / "output" / "checkpoints" / "epoch-3.pt").write_bytes(b"new")   # just written
    req = Req(folder="output", globs=["checkpoints/*.pt"], settle=5.0)
    reply = agent_pull.run_manifest(req)
    assert reply["fresh"] == 1 and reply["files"] == 1
    req = Req(folder="code", globs=["snapshot.pt", "missing/*.pt"], settle=0.0)
    agent_pull.run_manifest(req)
    files = {k: v for p in req.parts for k, v in p["files"].items()}
    assert files == {"snapshot.pt": [4, sha(b"snap")]}


def test_exact_receiver_drops_bytes_other_than_listed(tmp_path: Path) -> None:
    """A file rewritten between the listing and the send (even to the same size, its
    bytes whole and verified in transit) is not kept by the keeper's receiver; `orch
    pull`'s receiver keeps the newer one."""
    from orchestrator.files.localfiles import DigestCache
    from orchestrator.files.pull import PullReport, Receiver
    from orchestrator.files.pulldest import Dest
    from orchestrator.session.checkpoints import KeptReceiver

    listed, sent = b"old!", b"new!"
    for cls, kept in ((KeptReceiver, False), (Receiver, True)):
        root = tmp_path / cls.__name__
        with Dest(root) as dest:
            report = PullReport("h", "output", str(root))
            rx = cls(dest, {"a.pt": [4, sha(listed)]}, DigestCache(tmp_path / "c.json"), report, None)
            rx.part("pull_file", {"p": "a.pt", "s": 4, "m": 0o644})
            rx.data(sent)
            rx.part("pull_end", {"p": "a.pt", "h": sha(sent)})
        assert (root / "a.pt").exists() is kept
        assert not list(root.glob("*.orch-part-*"))
        if not kept:
            assert report.skipped[0]["why"].startswith("changed on the host")


def test_keeper_records_a_lost_host_and_never_raises(tmp_path: Path) -> None:
    """No link to rank 0's host (lost, or released), or a link that fails: each round is
    recorded as failed and tried again; start/stop never raise."""
    from types import SimpleNamespace

    from orchestrator.session.checkpoints import Keeper, restore

    cluster = load(inventory(tmp_path, ""))

    class Broken:
        name = "localhost"

        def submit(self, *a: object, **k: object) -> None:
            raise ConnectionResetError("the connection was reset")

    session = SimpleNamespace(links={}, records={0: SimpleNamespace(job_dir="/nowhere/demo")})
    keeper = Keeper(session, cluster, interval=0.01)  # type: ignore[arg-type]
    assert keeper.round() is False and "not connected" in (keeper.last_error or "")
    session.links[0] = Broken()
    keeper.start()
    deadline = time.monotonic() + 5
    while keeper.errors < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    keeper.stop(final=True)
    assert keeper.errors >= 3 and "reset" in (keeper.last_error or "")
    assert keeper.latest() == {} and keeper.thread is not None and not keeper.thread.is_alive()
    # nothing kept: no request at all
    assert restore(session, cluster) == []  # type: ignore[arg-type]
