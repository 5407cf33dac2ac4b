"""Files made ahead of a write (agent/spares.py) and a stop's look at its processes through
their pidfds (agent/pids.Exits): what a fail-fast on 1,000 hosts at once no longer pays
in the second of the stop (a new inode each file; /proc reads of processes being reaped)."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.agent import pids, spares
from orchestrator.agent.paths import JobDir, UnsafePath

needs_tmpfile = pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="no O_TMPFILE here")


@pytest.fixture(autouse=True)
def no_spares() -> Iterator[None]:
    """Each test starts and ends without spares in this process."""
    spares.drop_all()
    yield
    spares.drop_all()


def job(tmp_path: Path) -> JobDir:
    (tmp_path / "job" / "run").mkdir(parents=True)
    return JobDir(str(tmp_path / "job"))


def spare_inode() -> int:
    (fd,) = spares.SPARES.values()
    return os.fstat(fd).st_ino


@needs_tmpfile
def test_a_write_goes_through_its_spare_made_ahead(tmp_path: Path) -> None:
    """The file a write leaves is the spare's inode, with the bytes and the mode asked,
    replacing what was there; no part file is left and the spare is used once."""
    jd = job(tmp_path)
    jd.write_file("run/host.exit", b"old", 0o644)
    jd.spare("run/host.exit", 0o644)
    assert os.listdir(tmp_path / "job" / "run") == ["host.exit"]   # unnamed until written
    inode = spare_inode()
    jd.write_file("run/host.exit", b'{"code": 0}', 0o644)
    path = tmp_path / "job" / "run" / "host.exit"
    assert path.read_bytes() == b'{"code": 0}' and os.stat(path).st_ino == inode
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644 & ~current_umask()
    assert os.listdir(tmp_path / "job" / "run") == ["host.exit"] and not spares.SPARES
    jd.write_file("run/host.exit", b"again", 0o644)   # without a spare: as before
    assert path.read_bytes() == b"again" and os.stat(path).st_ino != inode


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@needs_tmpfile
def test_a_spare_is_for_its_name_folder_and_mode_only(tmp_path: Path) -> None:
    jd = job(tmp_path)
    jd.spare("run/stop.json", 0o644)
    inode = spare_inode()
    jd.write_file("run/other.json", b"{}", 0o644)
    jd.write_file("run/stop.json", b"{}", 0o600)
    assert len(spares.SPARES) == 1
    jd.write_file("run/stop.json", b"{}", 0o644)
    assert os.stat(tmp_path / "job" / "run" / "stop.json").st_ino == inode


@needs_tmpfile
def test_a_link_at_the_name_is_refused_with_a_spare_too(tmp_path: Path) -> None:
    jd = job(tmp_path)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"theirs")
    (tmp_path / "job" / "run" / "host.exit").symlink_to(target)
    jd.spare("run/host.exit", 0o644)
    with pytest.raises(UnsafePath):
        jd.write_file("run/host.exit", b"ours", 0o644)
    assert target.read_bytes() == b"theirs"


@needs_tmpfile
def test_a_spare_that_cannot_be_named_falls_back_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No /proc/self/fd to link from (a host without /proc mounted): the write makes
    its file as without a spare, and the spare's inode goes with its descriptor."""
    jd = job(tmp_path)
    jd.spare("run/host.exit", 0o644)
    real = os.link

    def no_proc(src: str, dst: str, **kw: object) -> None:
        if src.startswith("/proc/self/fd/"):
            raise FileNotFoundError(src)
        real(src, dst, **kw)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "link", no_proc)
    jd.write_file("run/host.exit", b"{}", 0o644)
    assert (tmp_path / "job" / "run" / "host.exit").read_bytes() == b"{}"
    assert os.listdir(tmp_path / "job" / "run") == ["host.exit"] and not spares.SPARES


def test_without_o_tmpfile_no_spare_is_made(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    jd = job(tmp_path)
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    jd.spare("run/host.exit", 0o644)
    assert not spares.SPARES
    jd.write_file("run/host.exit", b"{}", 0o644)
    assert (tmp_path / "job" / "run" / "host.exit").read_bytes() == b"{}"


@needs_tmpfile
def test_spares_are_capped(tmp_path: Path) -> None:
    jd = job(tmp_path)
    for i in range(spares.MOST + 5):
        jd.spare(f"run/rank-{i}.exit", 0o644)
    assert len(spares.SPARES) == spares.MOST


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfds here")
def test_a_stop_sees_its_processes_end_through_their_pidfds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once its pidfd is held, a watched process's end is known from it: no read of
    /proc/<pid> while its parent reaps it."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        ticks = pids.proc_start_time(child.pid)
        with pids.Exits() as exits:
            exits.sleep({child.pid: ticks}, 0.0, 0.01)   # its pidfd opened
            reads: list[int | str] = []
            real = pids.stat_fields

            def logged(pid: int | str) -> list[str] | None:
                reads.append(pid)
                return real(pid)
            monkeypatch.setattr(pids, "stat_fields", logged)
            assert exits.alive(child.pid, ticks)
            child.send_signal(signal.SIGKILL)
            exits.sleep({child.pid: ticks}, 10.0, 0.01)   # woken by its end
            assert not exits.alive(child.pid, ticks) and reads == []
            assert not exits.alive(os.getpid() + 10**7, None)   # none held: by /proc
    finally:
        child.kill()
        child.wait()
