"""The agent's bundle kept between commands (remote/bundlecache.py): read back only
where intact and private to this user, built again otherwise, the same bytes either
way."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from orchestrator.remote import bundle, bundlecache


class Builds:
    """A build that counts its calls."""

    def __init__(self, data: bytes = b"zip bytes\n\x00\xff") -> None:
        self.data, self.calls = data, 0
        self.got = (data, hashlib.sha256(data).hexdigest())   # what cached() returns

    def __call__(self) -> tuple[bytes, str]:
        self.calls += 1
        return self.got


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "cache"
    monkeypatch.setenv("ORCH_CACHE_DIR", str(where))
    return where


def only_file(where: Path) -> Path:
    files = sorted(where.glob("bundle-*.zip"))
    assert len(files) == 1, files
    return files[0]


def test_a_bundle_is_built_once_then_read_back(cache: Path) -> None:
    build = Builds()
    assert bundlecache.cached([b"a", b"b"], build) == build.got
    assert bundlecache.cached([b"a", b"b"], build) == build.got
    assert build.calls == 1
    kept = only_file(cache)
    assert kept.stat().st_mode & 0o777 == 0o600 and cache.stat().st_mode & 0o777 == 0o700
    assert not [p for p in cache.iterdir() if p.name.startswith(".part-")]
    assert bundlecache.cached([b"a", b"c"], build) == build.got and build.calls == 2
    assert bundlecache.cached([b"ab"], build) == build.got and build.calls == 3   # not [a, b]


def test_a_changed_byte_is_built_again_and_mended(cache: Path) -> None:
    build = Builds()
    bundlecache.cached([b"k"], build)
    kept = only_file(cache)
    raw = bytearray(kept.read_bytes())
    raw[-1] ^= 1
    kept.write_bytes(bytes(raw))
    assert bundlecache.cached([b"k"], build) == build.got and build.calls == 2
    assert bundlecache.cached([b"k"], build) == build.got and build.calls == 2
    kept.write_bytes(b"")   # truncated
    assert bundlecache.cached([b"k"], build) == build.got and build.calls == 3


def test_a_file_or_folder_others_could_write_is_never_read(cache: Path) -> None:
    build = Builds()
    bundlecache.cached([b"k"], build)
    kept = only_file(cache)
    kept.chmod(0o620)
    assert bundlecache.cached([b"k"], build) == build.got and build.calls == 2
    assert kept.stat().st_mode & 0o777 == 0o600   # written again, ours
    cache.chmod(0o777)
    bundlecache.cached([b"k"], build)
    bundlecache.cached([b"k"], build)
    assert build.calls == 4   # neither read nor kept in a folder others write
    cache.chmod(0o700)
    if os.geteuid() == 0:   # a file of another user's, in our folder
        os.chown(kept, 65534, 65534)
        assert bundlecache.cached([b"k"], build) == build.got and build.calls == 5
        assert kept.stat().st_uid == 0


def test_a_link_is_not_followed_and_its_target_is_left_alone(cache: Path,
                                                             tmp_path: Path) -> None:
    build = Builds()
    bundlecache.cached([b"k"], build)
    kept = only_file(cache)
    target = tmp_path / "elsewhere"
    target.write_bytes(kept.read_bytes())   # an intact cache file, behind a link
    kept.unlink()
    kept.symlink_to(target)
    assert bundlecache.cached([b"k"], build) == build.got and build.calls == 2
    assert not kept.is_symlink() and target.read_bytes().endswith(build.data)


def test_too_big_a_file_is_not_read(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build = Builds(b"x" * 100)
    bundlecache.cached([b"k"], build)
    monkeypatch.setattr(bundlecache, "MAX_BYTES", 50)
    assert bundlecache.cached([b"k"], build) == build.got and build.calls == 2


def test_off_or_a_relative_folder_keeps_nothing(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    build = Builds()
    for value in ("off", "relative/cache"):
        monkeypatch.setenv("ORCH_CACHE_DIR", value)
        assert bundlecache.folder() is None
        bundlecache.cached([b"k"], build)
        bundlecache.cached([b"k"], build)
    assert build.calls == 4 and list(tmp_path.iterdir()) == []
    monkeypatch.delenv("ORCH_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert bundlecache.folder() == tmp_path / "xdg" / "orch"
    monkeypatch.setenv("XDG_CACHE_HOME", "rel")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert bundlecache.folder() == tmp_path / "home" / ".cache" / "orch"


def test_only_the_newest_bundles_are_kept(cache: Path) -> None:
    build = Builds()
    for i in range(bundlecache.KEEP + 3):
        bundlecache.cached([str(i).encode()], build)
        newest = max(cache.glob("bundle-*.zip"), key=lambda p: p.stat().st_mtime_ns)
        os.utime(newest, ns=(i * 10**9, i * 10**9))   # an order the clock cannot tie
    assert len(list(cache.glob("bundle-*.zip"))) == bundlecache.KEEP
    assert build.calls == bundlecache.KEEP + 3


def test_the_kept_bundle_is_the_bundle_built(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same bytes and digest from the cache as from a build; a changed shipped
    source is another key."""
    bundle.bundle.cache_clear()
    try:
        kept = bundle.bundle()
        bundle.bundle.cache_clear()
        assert bundle.bundle() == kept and only_file(cache).read_bytes().endswith(kept[0])
        monkeypatch.setenv("ORCH_CACHE_DIR", "off")
        bundle.bundle.cache_clear()
        assert bundle.bundle() == kept
        monkeypatch.setenv("ORCH_CACHE_DIR", str(cache))
        files = bundle.source_files()
        changed = files[:-1] + ((files[-1][0], files[-1][1] + b"\nCHANGED = 1\n"),)
        monkeypatch.setattr(bundle, "source_files", lambda: changed)
        bundle.bundle.cache_clear()
        bundle.sources.cache_clear()
        other = bundle.bundle()
        assert other[1] != kept[1] and len(list(cache.glob("bundle-*.zip"))) == 2
    finally:
        bundle.bundle.cache_clear()
        bundle.sources.cache_clear()
