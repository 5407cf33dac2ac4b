"""files/feed.py: a host's shard files listed lazily, by the listing thread until a push
takes them over, then by the push; and a first push that starts with the first chunk."""
from __future__ import annotations

import os
import re
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.errors import DataError
from orchestrator.files import localfiles, shards
from orchestrator.files.feed import Feed
from orchestrator.files.localfiles import LocalFile
from test_sync_cache import Spy, host_bytes, inventory, up_sync


def lf(name: str, digest: str = "") -> LocalFile:
    return LocalFile(name, "/nowhere/" + name, 1, 0o644, digest, key=b"k" if not digest else None)


class Source:
    """Chunks of two files each; records which thread made each chunk."""

    def __init__(self, chunks: int, fail_at: int | None = None,
                 error: BaseException | None = None, digest: str = "") -> None:
        self.chunks, self.fail_at, self.error, self.digest = chunks, fail_at, error, digest
        self.made_by: list[str] = []

    def __iter__(self) -> Iterator[list[LocalFile]]:
        for c in range(self.chunks):
            if c == self.fail_at:
                assert self.error is not None
                raise self.error
            self.made_by.append(threading.current_thread().name)
            yield [lf(f"c{c}/a", self.digest), lf(f"c{c}/b", self.digest)]


def names(files: list[LocalFile]) -> list[str]:
    return [f.rel for f in files]


def test_the_listing_runs_ahead_until_a_push_takes_over_and_the_push_lists_the_rest() -> None:
    src = Source(4)
    feed = Feed(8, iter(src))
    assert feed.advance() and src.made_by == ["MainThread"]   # the listing ran ahead once
    got: list[str] = []
    started, go_on = threading.Event(), threading.Event()

    def push() -> None:
        for i, f in enumerate(feed.each()):
            got.append(f.rel)
            if i == 0:
                started.set()
                go_on.wait(5)
    t = threading.Thread(target=push, name="push")
    t.start()
    assert started.wait(5) and feed.claimed
    feed.run_ahead()   # the listing thread: a push took the files, it lists nothing more
    assert src.made_by == ["MainThread"]
    go_on.set()
    t.join(5)
    assert got == [f"c{c}/{x}" for c in range(4) for x in "ab"]
    assert src.made_by == ["MainThread", "push", "push", "push"]
    assert names(feed.whole()) == got


def test_whole_lists_what_is_left_in_order() -> None:
    src = Source(3)
    feed = Feed(6, iter(src))
    feed.advance()
    assert names(feed.whole()) == [f"c{c}/{x}" for c in range(3) for x in "ab"]
    assert feed.whole() is feed.whole() and not feed.advance()


def test_known_stops_at_the_first_unhashed_file_and_gives_a_hashed_list_whole() -> None:
    cold = Source(5)
    feed = Feed(10, iter(cold))
    assert feed.known() is None and len(cold.made_by) == 1, "one chunk decides"
    warm = Feed(10, iter(Source(5, digest="d" * 64)))
    assert names(warm.known() or []) == [f"c{c}/{x}" for c in range(5) for x in "ab"]


def test_empty_waits_for_the_first_chunk_or_the_end() -> None:
    assert Feed(0, iter(Source(0))).empty()
    assert not Feed(2, iter(Source(3))).empty()


def test_a_failed_listing_ends_the_files_after_what_came_before_with_its_error() -> None:
    bad = DataError("shards/worker_0_of_1/c2/a: dangling symlink", hint="re-run split-data")
    feed = Feed(8, iter(Source(4, fail_at=2, error=bad)))
    got: list[str] = []
    with pytest.raises(DataError) as err:
        for f in feed.each():
            got.append(f.rel)
    assert err.value is bad and got == ["c0/a", "c0/b", "c1/a", "c1/b"]
    with pytest.raises(DataError) as again:   # whoever asks later gets the same error
        feed.whole()
    assert again.value is bad


def test_an_error_met_by_another_thread_reaches_the_push_as_a_data_error() -> None:
    feed = Feed(4, iter(Source(2, fail_at=0, error=OSError("disk gone"))))
    with pytest.raises(OSError):
        feed.run_ahead()   # the listing thread met it: raised there
    with pytest.raises(DataError, match="listing the local files failed: disk gone"):
        list(feed.each())


# ---------------------------------------------------------------- through a real agent

@pytest.fixture
def lazy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Spy]:
    """The listing thread never runs ahead and chunks hold two files: the push lists."""
    monkeypatch.setattr(localfiles, "RACY_NS", -10**18)
    monkeypatch.setattr(shards, "CHUNK", 2)
    monkeypatch.setattr(Feed, "run_ahead", lambda self: None)
    monkeypatch.chdir(tmp_path)
    return inventory(tmp_path), Spy(monkeypatch)


def test_a_first_push_lists_as_it_sends_and_remembers_every_digest(
        lazy: tuple[Path, Spy], tmp_path: Path) -> None:
    inv, spy = lazy
    first = up_sync(inv, spy)
    assert first["data"].files == 10 and len(first["data"].sent) == 10
    assert host_bytes(tmp_path, "class1/img4.bin") == b"1-4-old"
    again = up_sync(inv, spy)
    assert again["data"].files == 0 and sorted(spy.same) == ["code", "data"]


def test_a_shard_link_out_of_the_source_met_half_way_ends_the_push_at_its_chunk(
        lazy: tuple[Path, Spy], tmp_path: Path) -> None:
    """The listing's own message (exit 2); the chunks listed before its chunk landed
    (two files each: class0/img4 shares the bad file's), and a push after the fix
    sends only the rest."""
    inv, spy = lazy
    (tmp_path / "secret.bin").write_bytes(b"secret")
    link = tmp_path / "shards" / "worker_0_of_1" / "class1" / "img0.bin"
    target = link.readlink()
    link.unlink()
    link.symlink_to(tmp_path / "secret.bin")
    with pytest.raises(DataError, match=r"class1/img0\.bin: symlink pointing outside") as err:
        up_sync(inv, spy)
    assert err.value.exit_code == 2
    assert landed(tmp_path) == [f"worker_0_of_1/class0/img{i}.bin" for i in range(4)]
    link.unlink()
    link.symlink_to(target)
    again = up_sync(inv, spy)
    assert again["data"].sent == ("worker_0_of_1/class0/img4.bin", *(
        f"worker_0_of_1/class1/img{i}.bin" for i in range(5)))


@pytest.mark.parametrize("damage", ["gone", "a folder", "a fifo"])
def test_a_target_gone_or_not_a_file_is_refused_as_the_push_opens_it(
        lazy: tuple[Path, Spy], tmp_path: Path, damage: str) -> None:
    """Listed without its stat (a cold cache), a shard file's target is judged when the
    push opens it: never read through a FIFO (no wait) or a folder; its message names
    the shard file and the target (exit 2); the files before it landed."""
    inv, spy = lazy
    target = tmp_path / "src" / "class1" / "img2.bin"
    target.unlink()
    if damage == "a folder":
        target.mkdir()
    elif damage == "a fifo":
        os.mkfifo(target)
    why = {"gone": "which is missing", "a folder": "not a regular file",
           "a fifo": "not a regular file"}[damage]
    with pytest.raises(DataError, match=rf"shard file worker_0_of_1/class1/img2\.bin links to "
                       rf"{re.escape(str(target))}, .*{why}") as err:
        up_sync(inv, spy)
    assert err.value.exit_code == 2
    assert landed(tmp_path) == [f"worker_0_of_1/class0/img{i}.bin" for i in range(5)] + [
        "worker_0_of_1/class1/img0.bin", "worker_0_of_1/class1/img1.bin"]


def test_a_target_that_is_a_link_inside_the_source_is_pushed_and_one_leaving_it_refused(
        lazy: tuple[Path, Spy], tmp_path: Path) -> None:
    """As the listing with a stat judges it: a link inside the data source is followed
    to its file, one that leaves the source is refused before a byte of it is read."""
    inv, spy = lazy
    target = tmp_path / "src" / "class1" / "img3.bin"
    target.unlink()
    target.symlink_to(tmp_path / "src" / "class0" / "img0.bin")
    first = up_sync(inv, spy)
    assert first["data"].files == 10
    assert host_bytes(tmp_path, "class1/img3.bin") == b"0-0-old"
    shutil.rmtree(tmp_path / "host")
    (tmp_path / ".orch" / "digests.bin").unlink()
    (tmp_path / "secret.bin").write_bytes(b"secret")
    target.unlink()
    target.symlink_to(tmp_path / "secret.bin")
    with pytest.raises(DataError, match="a symlink pointing outside the data source"):
        up_sync(inv, spy)
    assert "worker_0_of_1/class1/img3.bin" not in landed(tmp_path)


def landed(tmp_path: Path) -> list[str]:
    data = tmp_path / "host" / "synccache" / "data"
    return sorted(p.relative_to(data).as_posix() for p in data.rglob("*.bin"))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
