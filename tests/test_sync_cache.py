"""A nothing-changed push sends nothing and lists nothing back; a changed file is always
sent, however little of its stat moved (files/localfiles.DigestCache, agent/ledger.py,
the preflight's manifest token).

One `connection: local` host (the real agent as a child process, no sshd): the local
file list, preflight and the push as `orch up` runs them.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.agent.common import job_paths
from orchestrator.agent.files import manifest
from orchestrator.agent.ledger import Ledger
from orchestrator.api import launching
from orchestrator.config.inventory import load
from orchestrator.errors import DataError
from orchestrator.files import localfiles, splitdata
from orchestrator.session import preflight
from orchestrator.session.session import Session, whole


def inventory(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for c in range(2):
        (src / f"class{c}").mkdir(parents=True)
        for i in range(5):
            (src / f"class{c}" / f"img{i}.bin").write_bytes(b"%d-%d-old" % (c, i))
    splitdata.split(src, tmp_path / "shards", 1)
    (tmp_path / "job.py").write_text("print('hi')\n")
    path = tmp_path / "cluster.yaml"
    path.write_text("name: synccache\n"
                    f"hosts:\n  - {{address: localhost, connection: local, remote_dir: {tmp_path}/host}}\n"
                    f"python: {sys.executable}\n"
                    "code: {paths: [job.py]}\n"
                    "job: {entrypoint: job.py}\n"
                    f"data: {{source: {src}, shards: {tmp_path}/shards}}\n")
    return path


class Spy:
    """What one `up`'s sync did: files hashed here, folders the host answered `same`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hashed: list[str] = []
        self.same: list[str] = []
        real_hash, real_manifests = localfiles.sha256_of, preflight.manifests_of

        def hashing(path: str) -> str:
            self.hashed.append(path)
            return real_hash(path)

        def manifests(cluster: Any, parts: list[dict[str, Any]], *rest: Any) -> dict[str, Any]:
            self.same += [p["folder"] for p in parts if "same" in p]
            return real_manifests(cluster, parts, *rest)
        monkeypatch.setattr(localfiles, "sha256_of", hashing)
        monkeypatch.setattr(preflight, "manifests_of", manifests)


def up_sync(inv: Path, spy: Spy) -> dict[str, Any]:
    """`orch up`'s steps up to the push: {"code"|"data": SyncReport}."""
    spy.hashed.clear()
    spy.same.clear()
    cluster = load(inv)
    listing = launching.Listing(cluster, launching.UpProgress())   # as launching.start
    session = Session(cluster, warm=False, expected=listing.first)
    try:
        pre = session.open_and_preflight()
        try:
            reports = session.sync(listing.first(), pre)[0]
        except DataError:
            listing.raise_failure()
            raise
        listing.get()
        return reports
    finally:
        session.close()


def host_bytes(tmp_path: Path, rel: str) -> bytes:
    return (tmp_path / "host" / "synccache" / "data" / "worker_0_of_1" / rel).read_bytes()


@pytest.fixture
def pushed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Spy]:
    # files this test just wrote would never be remembered (localfiles.racy): the
    # cache is what is under test, so it may trust them here
    monkeypatch.setattr(localfiles, "RACY_NS", -10**18)
    monkeypatch.chdir(tmp_path)
    inv, spy = inventory(tmp_path), Spy(monkeypatch)
    first = up_sync(inv, spy)
    assert first["data"].files == 10 and first["code"].files == 1
    return inv, spy


def test_nothing_changed_sends_nothing_and_lists_nothing(pushed: tuple[Path, Spy]) -> None:
    inv, spy = pushed
    again = up_sync(inv, spy)
    assert (again["code"].files, again["data"].files, again["data"].deleted) == (0, 0, 0)
    assert spy.hashed == [], "the digest cache was not used"
    assert sorted(spy.same) == ["code", "data"], "the host listed its files back"


def rewrite_in_place(path: Path, data: bytes, keep_mtime: bool) -> None:
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.write(data)
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert after.st_ino == before.st_ino and after.st_size == before.st_size
    assert keep_mtime == (after.st_mtime_ns == before.st_mtime_ns)


def test_same_size_and_mtime_but_another_inode_is_sent(pushed: tuple[Path, Spy],
                                                      tmp_path: Path) -> None:
    inv, spy = pushed
    path = tmp_path / "src" / "class0" / "img1.bin"
    before = os.stat(path)
    new = tmp_path / "new.bin"
    new.write_bytes(b"0-1-NEW")
    os.utime(new, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(new, path)
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert after.st_ino != before.st_ino
    got = up_sync(inv, spy)
    assert got["data"].sent == ("worker_0_of_1/class0/img1.bin",)
    assert host_bytes(tmp_path, "class0/img1.bin") == b"0-1-NEW"


def test_same_inode_but_another_mtime_is_sent(pushed: tuple[Path, Spy], tmp_path: Path) -> None:
    inv, spy = pushed
    path = tmp_path / "src" / "class1" / "img2.bin"
    rewrite_in_place(path, b"1-2-NEW", keep_mtime=False)
    got = up_sync(inv, spy)
    assert got["data"].sent == ("worker_0_of_1/class1/img2.bin",)
    assert host_bytes(tmp_path, "class1/img2.bin") == b"1-2-NEW"


def test_content_touched_with_size_and_mtime_kept_is_sent(pushed: tuple[Path, Spy],
                                                         tmp_path: Path) -> None:
    """rsync's quick check misses this one (size and mtime as before); ctime does not."""
    inv, spy = pushed
    path = tmp_path / "src" / "class1" / "img3.bin"
    rewrite_in_place(path, b"1-3-NEW", keep_mtime=True)
    got = up_sync(inv, spy)
    assert got["data"].sent == ("worker_0_of_1/class1/img3.bin",)
    assert host_bytes(tmp_path, "class1/img3.bin") == b"1-3-NEW"


def test_a_file_changed_on_the_host_is_sent_again(pushed: tuple[Path, Spy],
                                                  tmp_path: Path) -> None:
    """Rewritten there with its size and mtime kept: the ledger's key (ctime, inode)
    sees it, the token differs, and the push puts the controller's bytes back."""
    inv, spy = pushed
    rewrite_in_place(tmp_path / "host" / "synccache" / "data" / "worker_0_of_1" / "class0" /
                     "img0.bin", b"0-0-BAD", keep_mtime=True)
    got = up_sync(inv, spy)
    assert got["data"].sent == ("worker_0_of_1/class0/img0.bin",) and spy.same == ["code"]
    assert host_bytes(tmp_path, "class0/img0.bin") == b"0-0-old"


def test_racy_files_are_not_remembered(tmp_path: Path) -> None:
    """A file changed within the clocks' granularity of its hash could change again with
    every stat field as it was: its digest is not kept."""
    path = tmp_path / "f"
    path.write_bytes(b"one")
    cache = localfiles.DigestCache(tmp_path / "cache.json")
    assert cache.digest(str(path), os.stat(path)) == hashlib.sha256(b"one").hexdigest()
    assert cache.known(str(path), os.stat(path)) is None and not cache.dirty


def test_the_ledger_rehashes_a_replaced_file(tmp_path: Path) -> None:
    """Same size and mtime, another inode: hashed again on the host, never trusted."""
    job = tmp_path / "job"
    (job / "data").mkdir(parents=True)
    f = job / "data" / "a.bin"
    f.write_bytes(b"old")
    jd = job_paths(str(job))["jd"]
    ledger = Ledger(jd, "data")
    ledger.record("a.bin", os.lstat(f), hashlib.sha256(b"old").hexdigest())
    ledger.save()
    st = os.stat(f)
    (job / "b.bin").write_bytes(b"new")
    os.utime(job / "b.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(job / "b.bin", f)
    got = manifest(jd, "data")["files"]
    assert got == {"a.bin": [3, hashlib.sha256(b"new").hexdigest()]}


# ---------------------------------------------------------------- hashing while pushing

def test_a_cold_listing_reads_no_shard_file_and_the_push_remembers_their_digests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first push's shard files are hashed as the push reads them, not before the
    preflight: the listing leaves their digests empty (LocalFile.key), the preflight
    sends no token for data/, and the digests land in the cache for the next `up`."""
    monkeypatch.setattr(localfiles, "RACY_NS", -10**18)
    monkeypatch.chdir(tmp_path)
    inv, spy = inventory(tmp_path), Spy(monkeypatch)
    read: list[str] = []
    real_read = localfiles.read_small

    def spying(path: str, size: int) -> bytes:
        read.append(path)
        return real_read(path, size)
    monkeypatch.setattr(localfiles, "read_small", spying)
    files = launching.local_files(load(inv))
    data = whole(files[0].data) or []
    assert len(data) == 10 and all(f.digest == "" and f.key for f in data)
    assert [p for p in read if "/src/" in p] == [], "the listing read shard files"
    first = up_sync(inv, spy)
    assert first["data"].files == 10 and spy.same == []
    assert host_bytes(tmp_path, "class1/img4.bin") == b"1-4-old"
    again = up_sync(inv, spy)
    assert again["data"].files == 0 and sorted(spy.same) == ["code", "data"]


def test_a_file_unreadable_half_way_ends_the_push_with_its_name_and_keeps_what_landed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read errors of a deferred file come during the push: the stream ends there (no
    deletion), the host records what landed, and the error names the file (exit 2)."""
    monkeypatch.setattr(localfiles, "RACY_NS", -10**18)
    monkeypatch.chdir(tmp_path)
    inv, spy = inventory(tmp_path), Spy(monkeypatch)
    bad = str(tmp_path / "src" / "class1" / "img0.bin")
    real_read = localfiles.read_fd

    def read(fd: int, size: int, path: str) -> bytes:
        if path == bad:
            os.close(fd)
            raise DataError(f"{path}: cannot be read (Permission denied)", hint="x")
        return real_read(fd, size, path)
    monkeypatch.setattr(localfiles, "read_fd", read)
    with pytest.raises(DataError, match=r"img0\.bin: cannot be read") as err:
        up_sync(inv, spy)
    assert err.value.exit_code == 2
    jd = job_paths(str(tmp_path / "host" / "synccache"))["jd"]
    landed = sorted(manifest(jd, "data")["files"])
    assert landed == [f"worker_0_of_1/class0/img{i}.bin" for i in range(5)]
    monkeypatch.setattr(localfiles, "read_fd", real_read)
    again = up_sync(inv, spy)
    assert again["data"].sent == tuple(f"worker_0_of_1/class1/img{i}.bin" for i in range(5))


def test_deferred_files_the_host_holds_at_their_size_are_hashed_before_the_plan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lost digest cache here, the files there: only the one that differs is sent."""
    inv, spy = pushed_again(tmp_path, monkeypatch)
    (tmp_path / ".orch" / "digests.bin").unlink()
    rewrite_in_place(tmp_path / "src" / "class0" / "img2.bin", b"0-2-NEW", keep_mtime=False)
    got = up_sync(inv, spy)
    assert got["data"].sent == ("worker_0_of_1/class0/img2.bin",) and got["data"].deleted == 0
    assert host_bytes(tmp_path, "class0/img2.bin") == b"0-2-NEW"


def pushed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Spy]:
    monkeypatch.setattr(localfiles, "RACY_NS", -10**18)
    monkeypatch.chdir(tmp_path)
    inv, spy = inventory(tmp_path), Spy(monkeypatch)
    assert up_sync(inv, spy)["data"].files == 10
    return inv, spy


def test_two_caches_of_one_file_save_at_once(tmp_path: Path) -> None:
    """The checkpoint keeper's cache and a restart's put-back cache are two objects of one
    file, saved from two threads: a shared .tmp name made one rename find the other's
    file gone (ENOENT, a restart lost in CI). Each save is whole; nothing is left over."""
    import threading

    from orchestrator.files.localfiles import DigestCache, load_cache
    path = tmp_path / ".orch" / "job" / "checkpoint-digests.bin"
    caches = [DigestCache(path), DigestCache(path)]
    errors: list[BaseException] = []

    def save_often(cache: DigestCache, n: int) -> None:
        try:
            for i in range(300):
                cache.memo[f"k{n}"] = i
                cache.dirty = True
                cache.save()
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=save_often, args=(c, n)) for n, c in enumerate(caches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    _, memo = load_cache(path)
    assert memo and set(memo) <= {"k0", "k1"}
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
