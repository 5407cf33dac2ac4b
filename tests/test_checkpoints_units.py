"""`job.checkpoint` (#22 item 3) without a host: the globs checked with file:line, their
matching (wire/globs.py, read by both sides), and the keeper's choices (what to fetch,
what a round prunes) and the agent's side on a local job folder."""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

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
    with pytest.raises(InventoryError, match=r"`job\.checkpoint` has no value"):   # not the default
        load(inventory(tmp_path, "  checkpoint:\n"))
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
    from orchestrator.files.pull import Entry
    from orchestrator.session.keeper import stale

    held = {"checkpoints/epoch-1.pt": sha(b"1"), "checkpoints/epoch-2.pt": sha(b"2")}
    listed = {"checkpoints/epoch-2.pt": Entry(1, sha(b"2")),
              "checkpoints/epoch-3.pt": Entry(1, sha(b"3"))}
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
    with open(job / "output" / "checkpoints" / "epoch-3.pt", "wb") as f:   # being written
        f.write(b"ne")
        f.flush()
        req = Req(folder="output", globs=["checkpoints/*.pt"], settle=5.0)
        reply = agent_pull.run_manifest(req)
        assert reply["fresh"] == 1 and reply["files"] == 1
        assert reply["fresh_paths"] == ["checkpoints/epoch-3.pt"]
        f.write(b"w")
    req = Req(folder="output", globs=["checkpoints/*.pt"], settle=5.0)   # closed: whole
    reply = agent_pull.run_manifest(req)
    assert reply["fresh"] == 0 and reply["files"] == 2
    req = Req(folder="code", globs=["snapshot.pt", "missing/*.pt"], settle=0.0)
    agent_pull.run_manifest(req)
    files = {k: v for p in req.parts for k, v in p["files"].items()}
    assert files == {"snapshot.pt": [4, sha(b"snap")]}


class ManifestReq:
    """An agent request as run_manifest reads it: args, and the parts it sends."""

    def __init__(self, job: Path, **args: object) -> None:
        self.args = {"job_dir": str(job), "paths": [], **args}
        self.parts: list = []

    def part(self, kind: str, body: dict) -> None:
        self.parts.append(body)


def listed(job: Path, settle: float = 5.0) -> tuple[dict, dict]:
    """(reply, {rel: [size, sha256]}) of the keeper's listing of output/ckpt.pt."""
    from orchestrator.agent import pull as agent_pull

    req = ManifestReq(job, folder="output", globs=["ckpt.pt"], settle=settle)
    reply = agent_pull.run_manifest(req)
    return reply, {k: v for p in req.parts for k, v in p["files"].items()}


def job_folder(tmp_path: Path) -> Path:
    job = tmp_path / "job"
    for sub in ("output", "code", "run"):
        (job / sub).mkdir(parents=True)
    return job


def test_a_checkpoint_replaced_by_rename_is_kept_however_often(tmp_path: Path) -> None:
    """A job that saves ckpt.pt by write-then-rename more often than the settle time:
    every listing offers the file there now (a new inode that nobody writes), never
    leaving it out as fresh. Before, its mtime was always under a second old and nothing
    was ever kept."""
    job = job_folder(tmp_path)
    ckpt = job / "output" / "ckpt.pt"
    for step in range(6):
        tmp = job / "output" / ".ckpt.pt.tmp"
        tmp.write_bytes(b"step %d " % step * 1000)
        os.replace(tmp, ckpt)
        reply, files = listed(job)
        assert files == {"ckpt.pt": [len(ckpt.read_bytes()), sha(ckpt.read_bytes())]}, step
        assert reply["fresh"] == 0 and reply["fresh_paths"] == []


def test_a_checkpoint_held_open_for_writing_is_never_offered(tmp_path: Path) -> None:
    """A file a process holds open for writing (torch.save in place, still saving) is
    left out and named in `fresh_paths`, whether it is the inode already there or one
    renamed in; once closed it is offered, with the digest of its whole bytes."""
    job = job_folder(tmp_path)
    ckpt = job / "output" / "ckpt.pt"
    ckpt.write_bytes(b"one" * 100)
    old = time.time() - 100
    os.utime(ckpt, (old, old))
    _, files = listed(job)
    assert files == {"ckpt.pt": [300, sha(b"one" * 100)]}       # settled long ago
    with open(ckpt, "r+b") as f:                                 # the same inode, open
        f.write(b"two")
        f.flush()
        reply, files = listed(job)
        assert files == {} and reply["fresh_paths"] == ["ckpt.pt"] and reply["fresh"] == 1
        _, files = listed(job, settle=0.0)                       # no settle asked: offered
        assert list(files) == ["ckpt.pt"]
    reply, files = listed(job)
    assert files == {"ckpt.pt": [300, sha(b"two" + b"one" * 99)]}
    other = job / "output" / "other.pt"
    with open(other, "wb") as f:
        f.write(b"half")
        f.flush()
        os.replace(other, ckpt)                                  # a new inode, still open
        reply, files = listed(job)
        assert files == {} and reply["fresh_paths"] == ["ckpt.pt"]
    reply, files = listed(job)
    assert files == {"ckpt.pt": [4, sha(b"half")]}


def test_after_a_stop_a_file_once_written_in_place_is_never_taken(tmp_path: Path) -> None:
    """Once a stop came (or a rank ended), a writer may have died half way through a
    save: a file seen held open for writing is left out even when closed and settled;
    one renamed in whole still waits for the settle time."""
    job = job_folder(tmp_path)
    ckpt = job / "output" / "ckpt.pt"
    with open(ckpt, "wb") as f:
        f.write(b"half")
        f.flush()
        assert listed(job)[0]["fresh_paths"] == ["ckpt.pt"]      # seen written in place
    (job / "run" / "stop.json").write_text('{"time": 1}')
    assert listed(job)[0]["fresh_paths"] == ["ckpt.pt"]          # closed by a killed writer?
    old = time.time() - 100
    os.utime(ckpt, (old, old))
    assert listed(job)[0]["fresh_paths"] == ["ckpt.pt"]          # settled, but seen written
    renamed = job / "output" / "ckpt.tmp"
    renamed.write_bytes(b"whole")
    os.replace(renamed, ckpt)
    assert listed(job)[0]["fresh_paths"] == ["ckpt.pt"]          # fresh: waits after a stop
    os.utime(ckpt, (old, old))
    assert listed(job)[1] == {"ckpt.pt": [5, sha(b"whole")]}


def test_why_nothing_was_kept_is_said(tmp_path: Path) -> None:
    """The restart line's reason when the keeper holds nothing: the file never stayed
    unchanged, the globs matched nothing, or the host was never reached."""
    from types import SimpleNamespace

    from orchestrator.files.pull import ManifestReply
    from orchestrator.session.keeper import Keeper

    cluster = load(inventory(tmp_path, "  checkpoint: [output/ckpt.pt]\n"))
    keeper = Keeper(SimpleNamespace(links={}, records={}), cluster)  # type: ignore[arg-type]
    keeper.rounds = 3
    assert keeper.nothing_kept() == "job.checkpoint (output/ckpt.pt) matched no file on localhost"
    keeper.saw("output", ManifestReply("output", (), 0, ("ckpt.pt",)), {})
    assert keeper.nothing_kept() == (
        "output/ckpt.pt never stayed unchanged for 1 s on localhost (written in place at "
        "every look; write it beside and rename it)")
    keeper.held = {"output/ckpt.pt": "0" * 64}
    assert keeper.nothing_kept() is None
    keeper = Keeper(SimpleNamespace(links={}, records={}), cluster)  # type: ignore[arg-type]
    keeper.round()
    assert keeper.nothing_kept() == "no round of the keeper ended well: localhost: not connected"


def test_a_kept_copy_that_cannot_be_listed_is_not_nothing_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier attempt's copy in a folder this user cannot list (root reads anything,
    so the listing's error is made here) is said as such, with the fix; not "matched no
    file", which would send the user to their globs."""
    from types import SimpleNamespace

    from orchestrator.session.keeper import Keeper

    cluster = load(inventory(tmp_path, "  checkpoint: [output/ckpt.pt]\n"))
    keeper = Keeper(SimpleNamespace(links={}, records={}), cluster)  # type: ignore[arg-type]
    keeper.rounds = 3
    hidden = keeper.root / "output"
    hidden.mkdir(parents=True)
    (hidden / "ckpt.pt").write_bytes(b"kept")
    assert keeper.nothing_kept() is None   # listed: a copy is held from before
    real = os.scandir

    def refused(path: str = ".") -> Any:
        if os.fspath(path) == str(hidden):
            raise PermissionError(13, "Permission denied", str(hidden))
        return real(path)
    monkeypatch.setattr(os, "scandir", refused)
    why = keeper.nothing_kept()
    assert why == (f"this machine's copy of the kept checkpoints cannot be read: {hidden}: "
                   f"Permission denied (give your user access to it: `chmod -R u+rwX "
                   f"{keeper.root}`)"), why


def test_exact_receiver_drops_bytes_other_than_listed(tmp_path: Path) -> None:
    """A file rewritten between the listing and the send (even to the same size, its
    bytes whole and verified in transit) is not kept by the keeper's receiver; `orch
    pull`'s receiver keeps the newer one."""
    from orchestrator.files.localfiles import DigestCache
    from orchestrator.files.pull import Entry, PullReport, Receiver
    from orchestrator.files.pulldest import Dest
    from orchestrator.remote.link import PullEnd, PullFile
    from orchestrator.session.keeper import KeptReceiver

    listed, sent = b"old!", b"new!"
    for cls, kept in ((KeptReceiver, False), (Receiver, True)):
        root = tmp_path / cls.__name__
        with Dest(root) as dest:
            report = PullReport("h", "output", str(root))
            rx = cls(dest, {"a.pt": Entry(4, sha(listed))}, DigestCache(tmp_path / "c.json"),
                     report, None)
            rx.part(PullFile("a.pt", 4, 0o644))
            rx.data(sent)
            rx.part(PullEnd("a.pt", sha(sent)))
        assert (root / "a.pt").exists() is kept
        assert not list(root.glob("*.orch-part-*"))
        if not kept:
            assert report.skipped[0]["why"].startswith("changed on the host")


def test_keeper_records_a_lost_host_and_never_raises(tmp_path: Path) -> None:
    """No link to rank 0's host (lost, or released), or a link that fails: each round is
    recorded as failed and tried again; start/stop never raise."""
    from types import SimpleNamespace

    from orchestrator.session.keeper import Keeper, restore

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
