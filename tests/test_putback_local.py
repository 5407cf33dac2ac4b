"""A restart's put-back of the kept checkpoints (session/checkpoints.Checkpointing.put_back)
when this machine's copy fails (a file the controller cannot read, its digest cache that
cannot be written): said once as the controller's own file, with its path, the cause and
the fix, never as a host's lost connection, and no host blamed for it. Real agents of
`connection: local` hosts, each with a job folder of its own."""
from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.config.inventory import Cluster, load
from orchestrator.errors import GroupError
from orchestrator.files.localfiles import DigestCache
from orchestrator.session.checkpoints import Checkpointing
from orchestrator.session.keeper import LocalCopyError
from orchestrator.session.session import Session

CK = "output/checkpoints"


@pytest.fixture
def run(tmp_path: Path) -> Iterator[tuple[Cluster, Session, Path]]:
    """Two hosts, and the controller's copy of one kept checkpoint."""
    (tmp_path / "job.py").write_text("print('hi')\n")
    hosts = "".join(f"  - {{address: localhost, connection: local, remote_dir: {tmp_path}/h{i}}}\n"
                    for i in range(2))
    inv = tmp_path / "cluster.yaml"
    inv.write_text(f"name: pb\nhosts:\n{hosts}code: {{paths: [job.py]}}\n"
                   "job:\n  entrypoint: job.py\n  restarts: 1\n")
    cluster = load(inv)
    copy = cluster.state_dir / "checkpoints" / CK / "epoch-1.pt"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(b"one")
    session = Session(cluster).open()
    try:
        yield cluster, session, copy
    finally:
        session.close()


def put_back(session: Session, groups: tuple[tuple[int, ...], ...] = ((0,), (1,))
             ) -> LocalCopyError:
    pre: Any = SimpleNamespace(groups=lambda: list(groups))
    with pytest.raises(Exception) as got:
        Checkpointing().put_back(session, pre)
    assert not isinstance(got.value, GroupError), got.value   # no host failed
    assert isinstance(got.value, LocalCopyError), got.value
    assert "connection" not in str(got.value), got.value
    assert "the controller's own file, not a host's" in got.value.message
    assert got.value.exit_code == 2
    return got.value


def test_a_kept_file_this_machine_cannot_read(
        tmp_path: Path, run: tuple[Cluster, Session, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    cluster, session, copy = run

    def refused(self: DigestCache, path: str, st: Any) -> str:
        raise PermissionError(errno.EACCES, "Permission denied", path)
    monkeypatch.setattr(DigestCache, "digest", refused)   # as for a user without root
    err = put_back(session)
    root = cluster.state_dir / "checkpoints"
    assert err.message == (f"this machine's copy of the kept checkpoints failed: {copy}: "
                           "Permission denied (the controller's own file, not a host's), so "
                           "the restart cannot put it back")
    assert err.hint.startswith(f"give your user access to it (`chmod -R u+rwX {root}`), "
                               "then run `orch up"), err.hint
    assert not (tmp_path / "h0" / "pb" / CK).exists()   # nothing sent


def test_a_full_disk_for_the_digests(run: tuple[Cluster, Session, Path],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cluster, session, _ = run
    cache = cluster.state_dir / "checkpoint-digests.bin"

    def full(self: DigestCache) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(cache))
    monkeypatch.setattr(DigestCache, "save", full)
    err = put_back(session)
    root = cluster.state_dir / "checkpoints"
    assert f"failed: {cache}: No space left on device (the controller's own" in err.message
    assert err.hint.startswith(f"free space on the disk that holds it (`df -h {root}`)")


def test_a_kept_file_gone_before_it_was_sent(
        run: tuple[Cluster, Session, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Listed and hashed, then removed before the stream reads it: the stream's own
    error (a real one) is this machine's too. One host: with two, the other's listing,
    in a thread of its own, may find the file gone first and fail there instead."""
    _, session, copy = run
    digest = DigestCache.digest

    def then_removed(self: DigestCache, path: str, st: Any) -> str:
        got = digest(self, path, st)
        Path(path).unlink()
        return got
    monkeypatch.setattr(DigestCache, "digest", then_removed)
    err = put_back(session, ((0,),))
    assert f"failed: {copy}: cannot be read (No such file or directory)" in err.message, err
    assert err.hint.startswith("check it on this machine, then run `orch up"), err.hint
