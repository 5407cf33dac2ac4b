"""`orch up`'s lines for the push (commands/up.sync_lines): a line per host up to 16
hosts; past that, hosts whose lines read the same folded into one, and past 16 lines
one sum, so a first push to 1,000 hosts is not 1,000 lines."""
from __future__ import annotations

from pathlib import Path

from orchestrator.commands.up import SYNC_LINES_MAX, sync_lines
from orchestrator.config import inventory
from orchestrator.files.sync import SyncReport


def cluster(tmp_path: Path, n: int) -> inventory.Cluster:
    hosts = "".join(f"  - address: 10.0.{i // 250}.{i % 250 + 1}\n" for i in range(n))
    path = tmp_path / "cluster.yaml"
    path.write_text(f"name: j\nhosts:\n{hosts}job:\n  entrypoint: train.py\n")
    return inventory.load(path)


def code(files: int, size: int = 57) -> dict[str, SyncReport]:
    return {"code": SyncReport(files, size * files, 0, ())}


def test_a_few_hosts_get_a_line_each(tmp_path: Path) -> None:
    c = cluster(tmp_path, 3)
    lines = sync_lines(c, {0: code(1), 1: code(0), 2: code(1)}, {})
    assert lines == ["sync 10.0.0.1: code 1 file 57 B sent, 0 deleted",
                     "sync 10.0.0.2: code 0 files 0 B sent, 0 deleted",
                     "sync 10.0.0.3: code 1 file 57 B sent, 0 deleted"]


def test_a_thousand_hosts_that_got_the_same_are_one_line(tmp_path: Path) -> None:
    c = cluster(tmp_path, 1000)
    reports = {i: code(1) for i in range(1000)}
    reports[7] = code(2)        # one host got more
    reports[8] = code(0)        # one got nothing: not shown past 16 hosts
    lines = sync_lines(c, reports, {3: ["10.0.0.5"]})
    assert lines[0] == ("sync 10.0.[1-3].[1-250],10.0.0.[1-3,5-7,10-250]: "   # ClusterShell's
                        "code 1 file 57 B sent, 0 deleted")
    assert lines[1] == "sync 10.0.0.4 (job folder shared with 10.0.0.5: pushed once): " \
                       "code 1 file 57 B sent, 0 deleted"
    assert lines[2] == "sync 10.0.0.8: code 2 files 114 B sent, 0 deleted"
    assert len(lines) == 3


def test_past_sixteen_lines_the_rest_is_one_sum(tmp_path: Path) -> None:
    c = cluster(tmp_path, 40)
    lines = sync_lines(c, {i: code(1, size=100 + i) for i in range(40)}, {})   # all differ
    assert len(lines) == SYNC_LINES_MAX
    assert lines[0] == "sync 10.0.0.1: code 1 file 100 B sent, 0 deleted"
    rest = range(SYNC_LINES_MAX - 1, 40)
    assert lines[-1] == (f"sync: {len(rest)} hosts more got {len(rest)} files, "
                         f"{sum(100 + i for i in rest)} B in all")
