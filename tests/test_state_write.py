"""A job's records under .orch/<name>/ (session/state.write_record: state.json, an array's
array.json) written whole through a .tmp of each writer's own (config/safefile.write_whole):
two writers of one record at once never make a rename find the other's file gone, and a
failed write leaves no .tmp behind."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from orchestrator.config.safefile import write_whole
from orchestrator.session.state import write_record


def test_two_threads_writing_one_record_at_once(tmp_path: Path) -> None:
    """300 writes each: with one shared .tmp name, one thread's rename finds its file
    already renamed by the other (ENOENT)."""
    path = tmp_path / ".orch" / "j" / "state.json"
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def writer(who: int) -> None:
        start.wait()
        try:
            for n in range(300):
                write_record(path, {"who": who, "n": n, "pad": "x" * 4096}, indent=1)
        except BaseException as exc:   # kept: the main thread fails the test with it
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(who,)) for who in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    doc = json.loads(path.read_text())
    assert doc["n"] == 299 and doc["who"] in (0, 1)   # one writer's last record, whole
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]   # no .tmp left


def test_a_failed_write_leaves_the_record_and_no_tmp(tmp_path: Path) -> None:
    path = tmp_path / "array.json"
    write_record(path, {"n": 1})
    with pytest.raises(TypeError):   # not JSON: nothing is written at all
        write_record(path, {"n": object()})
    target = tmp_path / "busy"
    (target / "inside").mkdir(parents=True)   # a folder in the way: the rename fails
    with pytest.raises(OSError):
        write_whole(target, b"data")
    assert json.loads(path.read_text()) == {"n": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["array.json", "busy"]


def test_results_csv_is_written_whole(tmp_path: Path) -> None:
    """`orch results`' results.csv goes through write_whole too: its rows as before."""
    from orchestrator.arrays.results import write_csv
    from orchestrator.arrays.rows import TaskResult
    rows = [TaskResult(0, "--fold 0", {"fold": "0"}, "exited 0", {"acc": "0.9"}),
            TaskResult(1, "--fold 1", {"fold": "1"}, "failed", {})]
    path = tmp_path / ".orch" / "arr" / "results.csv"
    write_csv(path, rows)
    assert path.read_bytes() == b"task,fold,state,acc\r\n0,0,exited 0,0.9\r\n1,1,failed,\r\n"
    assert [p.name for p in path.parent.iterdir()] == ["results.csv"]
