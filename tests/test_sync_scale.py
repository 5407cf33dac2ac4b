"""The shortcuts that make a push of many small files fast keep every answer and every
safety rule: the host's ledger signature (a nothing-changed manifest from one lstat a
file), the `files` batches of the stream, and the controller's memos (a split checked,
a shard folder's link texts, the digest cache's format and the bytes it holds).

Agent functions are called in this process; the controller's listing runs on a split
made here. The end-to-end push of these paths is in test_sync_cache.py and test_push.py.
"""
from __future__ import annotations

import hashlib
import json
import marshal
import os
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.agent import files, ledger
from orchestrator.agent.paths import PART, JobDir, UnsafePath
from orchestrator.config.inventory import load
from orchestrator.errors import DataError
from orchestrator.files import localfiles, shards, splitdata
from orchestrator.files.localfiles import DigestCache, LocalFile
from orchestrator.files.sync import stream_files
from orchestrator.wire import protocol


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def reader_of(stream: bytes) -> protocol.FrameReader:
    chunks = iter([stream, b""])
    return protocol.FrameReader(lambda n: next(chunks), caps=protocol.CAPS)


def batch(entries: list[list[Any]], data: bytes) -> bytes:
    return protocol.stream_item("files", f=entries) + (protocol.frame(protocol.DATA, data)
                                                       if data else b"")


def end() -> bytes:
    return protocol.stream_item("end", delete=[])


def push(jd: JobDir, named: dict[str, bytes]) -> dict[str, Any]:
    """named pushed as the controller streams them (small files: batches)."""
    local = [LocalFile(rel, "", len(data), 0o644, sha(data), data=data)
             for rel, data in sorted(named.items())]
    sent = bytearray()
    stream_files(sent.extend, local, None)
    return files.receive_into(reader_of(bytes(sent) + end()), jd, "data")


def token_of(named: dict[str, bytes]) -> str:
    return protocol.manifest_token((rel, sha(data)) for rel, data in named.items())


NAMED = {"w0/a/1.bin": b"one", "w0/a/2.bin": b"two", "w0/b/3.bin": b"", "top.bin": b"top"}


@pytest.fixture
def job(tmp_path: Path) -> JobDir:
    jd = JobDir(str(tmp_path / "job"))
    assert push(jd, NAMED) == {"files": 4, "bytes": 9, "deleted": 0}
    return jd


# ---------------------------------------------------------------- the host's signature

def test_nothing_changed_is_answered_from_the_signature_without_reading_the_ledger(
        job: JobDir, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_ledger(*args: Any) -> None:
        raise AssertionError("the ledger was read")
    monkeypatch.setattr(files, "Ledger", no_ledger)
    assert files.manifest(job, "data", token_of(NAMED)) == \
        {"root": job.show("data"), "files": {}, "same": True}
    with pytest.raises(AssertionError):   # another token: the full manifest decides
        files.manifest(job, "data", token_of({"w0/a/1.bin": b"one"}))


def test_a_file_rewritten_on_the_host_with_size_and_mtime_kept_fails_the_signature(
        job: JobDir, tmp_path: Path) -> None:
    path = tmp_path / "job" / "data" / "w0" / "a" / "2.bin"
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"TWO")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert not ledger.same(job, "data", token_of(NAMED))
    got = files.manifest(job, "data", token_of(NAMED))
    assert "same" not in got and got["files"]["w0/a/2.bin"] == [3, sha(b"TWO")]


@pytest.mark.parametrize("spoil", ["gone", "journal", "unsafe name", "unsafe folder",
                                   "not marshal"])
def test_a_signature_is_trusted_only_whole_and_alone(job: JobDir, tmp_path: Path,
                                                     spoil: str) -> None:
    run, data = tmp_path / "job" / "run", tmp_path / "job" / "data"
    sig = run / "data-pushed.sig"
    doc = marshal.loads(sig.read_bytes())
    assert ledger.same(job, "data", token_of(NAMED))
    if spoil == "gone":
        (data / "w0" / "b" / "3.bin").unlink()
    elif spoil == "journal":   # a receiver that did not finish
        (run / "data-pushed.journal").write_text("")
    elif spoil in ("unsafe name", "unsafe folder"):   # forged (by the job): keys and all
        outside = tmp_path / "outside.bin"
        outside.write_bytes(b"x")
        (data / "w0" / "a" / "sub").symlink_to(tmp_path)
        keys = ledger.stat_keys(job, "data", doc["folders"])
        assert keys is not None
        st = os.lstat(outside)
        keys.append(f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_dev}:{st.st_ctime_ns}")
        doc["folders"].append(["w0/a", ["sub/outside.bin"]] if spoil == "unsafe name"
                              else ["w0/../..", ["outside.bin"]])
        doc["keys"] = ledger.keys_digest(keys)
        sig.write_bytes(marshal.dumps(doc))
    else:
        sig.write_bytes(b"{not marshal")
    assert not ledger.same(job, "data", token_of(NAMED))


def test_a_missing_signature_is_written_by_the_full_manifest(job: JobDir, tmp_path: Path) -> None:
    (tmp_path / "job" / "run" / "data-pushed.sig").unlink()
    assert files.manifest(job, "data", token_of(NAMED))["same"] is True
    assert ledger.same(job, "data", token_of(NAMED))


# ---------------------------------------------------------------- `files` batches

def test_a_batch_with_a_bad_digest_keeps_the_files_before_it_and_writes_nothing_of_it(
        job: JobDir, tmp_path: Path) -> None:
    entries = [["w0/a/4.bin", 4, sha(b"four"), 0o644], ["w0/a/5.bin", 4, sha(b"nope"), 0o644],
               ["w0/a/6.bin", 3, sha(b"six"), 0o644]]
    with pytest.raises(ValueError, match=r"digest mismatch for w0/a/5\.bin"):
        files.receive_into(reader_of(batch(entries, b"fourfivesix") + end()), job, "data")
    folder = tmp_path / "job" / "data" / "w0" / "a"
    assert sorted(p.name for p in folder.iterdir()) == ["1.bin", "2.bin", "4.bin"]
    assert ledger.Ledger(job, "data").owns("w0/a/4.bin")


@pytest.mark.parametrize("entries,data,error", [
    ([["../evil.bin", 1, sha(b"x"), 0o644]], b"x", UnsafePath),
    ([["w0/../../evil.bin", 1, sha(b"x"), 0o644]], b"x", UnsafePath),
    ([["w0/a/", 1, sha(b"x"), 0o644]], b"x", UnsafePath),
    ([["w0/a/fine.bin", 1, sha(b"x"), 0o644], ["w0/a/..", 1, sha(b"x"), 0o644]], b"xx", UnsafePath),
    ([["w0/a/x.bin", 2, sha(b"xy"), 0o644]], b"xyz", protocol.ProtocolError),
    ([["w0/a/x.bin", -1, sha(b""), 0o644]], b"", protocol.ProtocolError),
    ([["w0/a/x.bin", 1, sha(b"x")]], b"x", protocol.ProtocolError),
    ([["w0/a/x.bin", 0, sha(b""), 0o644]] * (protocol.MAX_BATCH_FILES + 1), b"",
     protocol.ProtocolError),
])
def test_a_batch_refuses_unsafe_paths_and_data_that_is_not_its_files(
        job: JobDir, tmp_path: Path, entries: list[Any], data: bytes, error: type) -> None:
    with pytest.raises(error):
        files.receive_into(reader_of(batch(entries, data) + end()), job, "data")
    assert not (tmp_path / "evil.bin").exists() and not (tmp_path / "job" / "evil.bin").exists()
    assert not (tmp_path / "job" / "data" / "w0" / "a" / "x.bin").exists()


def test_a_batch_replaces_a_link_at_a_files_name_and_never_writes_through_it(
        job: JobDir, tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep")
    planted = tmp_path / "job" / "data" / "w0" / "a" / "1.bin"
    planted.unlink()
    planted.symlink_to(outside)
    push(job, {"w0/a/1.bin": b"ONE"})
    assert outside.read_bytes() == b"keep" and not planted.is_symlink()
    assert planted.read_bytes() == b"ONE"
    # a link where a folder of the batch goes is refused, not entered
    (tmp_path / "job" / "data" / "w0" / "c").symlink_to(tmp_path)
    with pytest.raises(UnsafePath, match="symbolic link"):
        push(job, {"w0/c/outside.bin": b"evil"})
    assert outside.read_bytes() == b"keep"


def test_names_of_any_bytes_round_trip_through_a_batch(tmp_path: Path) -> None:
    named = {"w0/caf\udce9.bin": b"latin-1", "w0/line\nbreak.bin": b"nl", "w0/back\\slash": b""}
    jd = JobDir(str(tmp_path / "job"))
    push(jd, named)
    got = sorted(os.listdir(os.fsencode(tmp_path / "job" / "data" / "w0")))
    assert got == sorted(os.fsencode(rel.split("/")[1]) for rel in named)
    assert files.manifest(jd, "data", token_of(named))["same"] is True


def test_a_journal_of_batch_lines_and_a_torn_last_line_is_replayed(job: JobDir,
                                                                  tmp_path: Path) -> None:
    entry = [3, sha(b"new"), "3:1:2:3:4"]
    lines = [json.dumps([["w0/x.bin", entry], ["w0/y.bin", entry]]),
             json.dumps(["w0/old-style.bin", entry]), '[["w0/torn.bin", [3, "ab']
    (tmp_path / "job" / "run" / "data-pushed.journal").write_text("\n".join(lines))
    got = ledger.Ledger(job, "data")
    assert got.interrupted
    assert all(got.owns(rel) for rel in ("w0/x.bin", "w0/y.bin", "w0/old-style.bin", "w0/a/1.bin"))
    assert not got.owns("w0/torn.bin")


# ---------------------------------------------------------------- a receiver killed at its end

class Killed(BaseException):
    """A SIGKILL at that point: nothing after it runs (no except, no cleanup of orch's)."""


def kill_at(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str) -> None:
    def killed(*args: Any, **kwargs: Any) -> None:
        raise Killed(name)
    monkeypatch.setattr(obj, name, killed)


def test_a_receiver_killed_after_its_new_folders_moved_into_place_but_before_their_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The staged files are in place and recorded nowhere (not journaled: the ledger
    written at promote is their record): never reported, so never deleted, and the
    next push sends them again and records them. top.bin, written in place, is
    journaled as it lands and known."""
    jd = JobDir(str(tmp_path / "job"))
    with monkeypatch.context() as m:
        kill_at(m, ledger.Ledger, "save")
        with pytest.raises(Killed):
            push(jd, NAMED)
    run, data = tmp_path / "job" / "run", tmp_path / "job" / "data"
    assert (data / "w0" / "a" / "1.bin").read_bytes() == b"one"
    assert not (run / "data-pushed.json").exists()
    assert "w0/" not in (run / "data-pushed.journal").read_text()   # no line of the staged
    assert files.manifest(jd, "data")["files"] == {"top.bin": [3, sha(b"top")]}
    staged = [rel for rel in NAMED if rel != "top.bin"]
    gone = files.receive_into(reader_of(protocol.stream_item("end", delete=staged)), jd, "data")
    assert gone["deleted"] == 0 and all((data / rel).exists() for rel in staged)
    push(jd, NAMED)
    assert files.manifest(jd, "data", token_of(NAMED))["same"] is True


def test_a_receiver_killed_after_the_record_of_its_new_folders_keeps_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jd = JobDir(str(tmp_path / "job"))
    with monkeypatch.context() as m:
        kill_at(m, files, "apply_deletes")
        with pytest.raises(Killed):
            push(jd, NAMED)
    run = tmp_path / "job" / "run"
    assert (run / "data-pushed.json").exists() and not (run / "data-pushed.journal").exists()
    assert files.manifest(jd, "data", token_of(NAMED))["same"] is True
    assert files.manifest(jd, "data")["files"] == {rel: [len(b), sha(b)] for rel, b in NAMED.items()}


def test_a_first_push_writes_its_ledger_once_and_journals_nothing_it_staged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journaled: list[Any] = []
    real = ledger.Ledger.save

    def save(self: ledger.Ledger) -> bool:
        journaled.append(self.jd.read(self.journal_path, 1 << 20))
        return real(self)
    monkeypatch.setattr(ledger.Ledger, "save", save)
    push(JobDir(str(tmp_path / "job")), {"w0/a/1.bin": b"one", "w1/2.bin": b"two"})
    assert journaled == [b"", None]   # written at promote; the end's save has nothing to do
    assert not (tmp_path / "job" / "run" / "data-pushed.journal").exists()


# ---------------------------------------------------------------- the signature's form

def test_the_signature_lists_a_folder_again_after_a_sub_folder_sorting_inside_its_names(
        tmp_path: Path) -> None:
    named = {"w0/b-1": b"1", "w0/b/x": b"x", "w0/b0": b"0", "w0/b/y": b"y", "w1/z": b"z"}
    jd = JobDir(str(tmp_path / "job"))
    push(jd, named)
    doc = marshal.loads((tmp_path / "job" / "run" / "data-pushed.sig").read_bytes())
    assert doc["folders"] == [["w0", ["b-1"]], ["w0/b", ["x", "y"]], ["w0", ["b0"]],
                              ["w1", ["z"]]]
    assert doc["token"] == token_of(named) and ledger.same(jd, "data", token_of(named))
    (tmp_path / "job" / "data" / "w0" / "b0").write_bytes(b"0")   # rewritten: ctime moved
    assert not ledger.same(jd, "data", token_of(named))


@pytest.mark.parametrize("count", [0, 1, 65536, 65537 + 3])
def test_the_token_of_sorted_paths_is_the_manifest_token(count: int) -> None:
    pairs = sorted((f"w{i % 7}/caf\udce9-{i:06d}", sha(str(i).encode())) for i in range(count))
    assert protocol.sorted_token([p for p, _ in pairs], [d for _, d in pairs]) == \
        protocol.manifest_token(reversed(pairs))
    if count:   # every field counts
        assert protocol.sorted_token([p for p, _ in pairs], [d for _, d in pairs][:-1] + ["x"]) \
            != protocol.manifest_token(pairs)


# ---------------------------------------------------------------- the small-file loop

def test_a_short_write_of_a_small_file_is_completed(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, bytes(data[:1])))
    named = {"w0/a.bin": b"several bytes", "w0/b.bin": b"", "top.bin": b"in place"}
    jd = JobDir(str(tmp_path / "job"))
    push(jd, named)
    monkeypatch.setattr(os, "write", real)
    assert all((tmp_path / "job" / "data" / rel).read_bytes() == b for rel, b in named.items())
    assert files.manifest(jd, "data", token_of(named))["same"] is True


def test_a_link_left_at_a_part_name_is_replaced_never_written_through(
        job: JobDir, tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep")
    part = tmp_path / "job" / "data" / "w0" / "a" / ("1.bin" + PART + str(os.getpid()))
    part.symlink_to(outside)
    push(job, {"w0/a/1.bin": b"ONE"})
    assert outside.read_bytes() == b"keep" and not part.exists() and not part.is_symlink()
    assert (tmp_path / "job" / "data" / "w0" / "a" / "1.bin").read_bytes() == b"ONE"


# ---------------------------------------------------------------- the controller's memos

@pytest.fixture
def split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A one-worker split of 2 classes of 3 files, and an inventory naming it."""
    monkeypatch.setattr(localfiles, "RACY_NS", -10**18)   # files written just now may be memoized
    source = tmp_path / "src"
    for c in range(2):
        (source / f"c{c}").mkdir(parents=True)
        for i in range(3):
            (source / f"c{c}" / f"{i}.bin").write_bytes(b"%d-%d" % (c, i))
    splitdata.split(source, tmp_path / "shards", 1)
    inv = tmp_path / "cluster.yaml"
    inv.write_text("name: scale\nhosts:\n  - {address: localhost, connection: local}\n"
                   "job: {entrypoint: job.py}\n"
                   f"data: {{source: {source}, shards: {tmp_path}/shards}}\n")
    return inv


def listing(inv: Path) -> list[LocalFile]:
    cluster = load(inv)
    cache = DigestCache(inv.parent / ".orch" / "digests.bin")
    got = shards.host_files(cluster, cluster.hosts[0], shards.load_split(cluster, cache), cache)
    cache.save()
    return got


def test_a_second_listing_reads_no_link_and_checks_no_split(
        split: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = listing(split)
    read: list[str] = []
    real = os.readlink

    def readlink(path: Any, *args: Any, **kw: Any) -> Any:
        read.append(str(path))
        return real(path, *args, **kw)
    monkeypatch.setattr(os, "readlink", readlink)
    monkeypatch.setattr(shards, "check_split", lambda *a: pytest.fail("checked again"))
    monkeypatch.setattr(localfiles, "sha256_of", lambda p: pytest.fail(f"hashed {p}"))
    assert listing(split) == first and read == []
    # a link replaced in one folder: that folder's links are read again, its new target used
    link = split.parent / "shards" / "worker_0_of_1" / "c1" / "2.bin"
    link.unlink()
    link.symlink_to(split.parent / "src" / "c0" / "0.bin")
    monkeypatch.setattr(localfiles, "sha256_of", real_sha256_of)
    again = {f.rel: f for f in listing(split)}
    assert again["worker_0_of_1/c1/2.bin"].digest == sha(b"0-0")
    assert read and all("/c1/" in p for p in read)


real_sha256_of = localfiles.sha256_of


def test_link_memos_of_shard_folders_that_are_gone_are_dropped(split: Path) -> None:
    """A split for another world size, then removed: its folders' link memos go at the
    next listing (they were kept forever); the folders still there keep theirs."""
    source = split.parent / "src"
    splitdata.split(source, split.parent / "shards", 2)
    cluster = load(split)
    cache = DigestCache(split.parent / ".orch" / "digests.bin")
    two = replace(cluster, world_size=2)
    for rank in (0, 1):   # host_files asks a host only for its ranks
        host: Any = SimpleNamespace(ranks=(rank,))
        shards.host_files(two, host, shards.load_split(two, cache), cache)
    cache.save()
    listing(split)   # the one-worker split's folders, remembered beside them
    memo = DigestCache(split.parent / ".orch" / "digests.bin").memo["links"]
    assert isinstance(memo, dict)
    assert any("worker_1_of_2" in folder for folder in memo)
    for name in ("worker_0_of_2", "worker_1_of_2"):
        shutil.rmtree(split.parent / "shards" / name)
    cache = DigestCache(split.parent / ".orch" / "digests.bin")
    assert shards.forget_gone_folders(cache) == sum("_of_2/" in f for f in memo)
    cache.save()
    kept = DigestCache(split.parent / ".orch" / "digests.bin").memo["links"]
    assert isinstance(kept, dict) and kept and all("worker_0_of_1" in folder for folder in kept)
    assert shards.forget_gone_folders(DigestCache(split.parent / ".orch" / "digests.bin")) == 0


def test_a_changed_manifest_is_checked_again(split: Path) -> None:
    listing(split)
    path = split.parent / "shards" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["splits"]["1"]["shards"][0]["files"][0][0] = "../../etc/passwd"
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="unsafe path"):
        listing(split)


@pytest.mark.parametrize("content", [b"", b"garbage", b'{"/x": ["1:2:3:4:5", "ab"]}',
                                     marshal.dumps({"version": 2, "entries": [], "memo": {}})])
def test_a_digest_cache_that_is_not_one_is_empty(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "digests.bin"
    path.write_bytes(content)
    cache = DigestCache(path)
    assert cache.entries == {} and cache.memo == {}


def test_the_cache_keeps_the_bytes_it_hashed_for_small_files_within_its_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(localfiles, "RACY_NS", -10**18)
    small, big = tmp_path / "small", tmp_path / "big"
    small.write_bytes(b"s" * 100)
    big.write_bytes(b"b" * (localfiles.HOLD_FILE + 1))
    cache = DigestCache(tmp_path / "c.bin", hold=150)
    assert cache.hashed(str(small), os.stat(small)) == (sha(b"s" * 100), b"s" * 100)
    assert cache.hashed(str(big), os.stat(big))[1] is None        # too big to keep
    assert cache.hashed(str(small), os.stat(small))[1] is None    # known: not read again
    other = tmp_path / "other"
    other.write_bytes(b"o" * 100)
    assert cache.hashed(str(other), os.stat(other)) == (sha(b"o" * 100), None)   # over budget


def test_batches_of_long_names_stay_under_the_json_frame_limit() -> None:
    """4096 paths of 1000 non-ASCII characters are 24 MB of JSON: split into batches
    that the host's frame reader takes (MAX_JSON), every file in one of them."""
    name = "\u00e9" * 1000
    local = [LocalFile(f"w{i}/{name}", "", 1, 0o644, sha(b"x"), data=b"x") for i in range(4096)]
    sent = bytearray()
    stream_files(sent.extend, local, None)
    reader = reader_of(bytes(sent))
    got, heads = [], 0
    while (frame := reader.read_frame()) is not None:
        if frame[0] == protocol.JSON:
            heads += 1
            got += [e[0] for e in protocol.decode(frame, "test")["f"]]
    assert got == [f.rel for f in local] and heads > 1


# ---------------------------------------------------------------- fresh digests

def test_a_fresh_digest_is_taken_as_sent_and_any_other_is_verified(
        job: JobDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fresh` (the controller hashed the very bytes it sent): the host records the
    digest without hashing again; without it a digest that does not match is refused."""
    hashed: list[int] = []
    real = hashlib.sha256

    def counting(data: Any = b"") -> Any:
        hashed.append(len(data))
        return real(data)
    # every caller of hashlib.sha256 passes through here (the receive, and the ledger)
    entries = [["w0/f/1.bin", 3, sha(b"one"), 0o644], ["w0/f/2.bin", 3, sha(b"two"), 0o644]]
    fresh = protocol.stream_item("files", f=entries, fresh=True) + protocol.frame(
        protocol.DATA, b"onetwo")
    big = protocol.stream_item("file", p="w0/f/3.bin", s=5, h=sha(b"three"), m=0o644,
                               fresh=True) + protocol.frame(protocol.DATA, b"three")
    monkeypatch.setattr(hashlib, "sha256", counting)
    files.receive_into(reader_of(fresh + big + end()), job, "data")
    # (the ledger's signature hashes too: its token and keys, hundreds of bytes)
    assert not [n for n in hashed if n in (3, 5, 6)], "a file's bytes were hashed again"
    assert (tmp_path / "job" / "data" / "w0" / "f" / "3.bin").read_bytes() == b"three"
    assert ledger.Ledger(job, "data").manifest()["w0/f/3.bin"] == [5, sha(b"three")]
    wrong = protocol.stream_item("file", p="w0/f/4.bin", s=4, h=sha(b"nope"), m=0o644) + \
        protocol.frame(protocol.DATA, b"four")
    with pytest.raises(ValueError, match=r"digest mismatch for w0/f/4\.bin"):
        files.receive_into(reader_of(wrong + end()), job, "data")
    assert not (tmp_path / "job" / "data" / "w0" / "f" / "4.bin").exists()


def test_the_controller_says_fresh_only_of_digests_it_took_from_the_bytes_it_sends(
        tmp_path: Path) -> None:
    """A deferred file (hashed as it is read for the stream) is fresh; a digest from
    the cache, whose bytes are read now and may have changed since, is not; a batch is
    fresh only when all its files are."""
    for name, data in (("cold.bin", b"cold"), ("warm.bin", b"warm"), ("big.bin", b"b" * 70000)):
        (tmp_path / name).write_bytes(data)
    cold = LocalFile("d/cold.bin", str(tmp_path / "cold.bin"), 4, 0o644, "", key=b"k" * 40)
    warm = LocalFile("d/warm.bin", str(tmp_path / "warm.bin"), 4, 0o644, sha(b"warm"))
    big = LocalFile("d/big.bin", str(tmp_path / "big.bin"), 70000, 0o644, "", key=b"k" * 40)

    def heads(local: list[LocalFile]) -> list[dict[str, Any]]:
        sent = bytearray()
        stream_files(sent.extend, local, None)
        reader, out = reader_of(bytes(sent)), []
        while (frame := reader.read_frame()) is not None:
            if frame[0] == protocol.JSON:
                out.append(protocol.decode(frame, "test"))
        return out
    (tmp_path / "grown.bin").write_bytes(b"g" * (2 << 20))   # listed at 10 bytes, then grew
    grown = LocalFile("d/grown.bin", str(tmp_path / "grown.bin"), 10, 0o644, "", key=b"k" * 40)
    assert [h.get("fresh") for h in heads([cold, big])] == [True, True]
    assert [h.get("fresh") for h in heads([grown])] == [None], "read again to be sent"
    assert [h.get("fresh") for h in heads([cold, warm])] == [None]
    assert [h.get("fresh") for h in heads([warm])] == [None]
