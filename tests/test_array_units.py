"""Job arrays without hosts: job.array in the inventory (expansion, every error with its
line), dealing tasks to slots, task command lines, metrics rows and grouping over folds."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from orchestrator.arrays import plan, results
from orchestrator.arrays.rows import MetricStats, TaskResult
from orchestrator.config.arrayspec import MAX_TASKS, expand, task_params
from orchestrator.config.inventory import parse
from orchestrator.errors import InventoryError
from orchestrator.remote.fanout import GroupResult

HEAD = """name: arr
hosts:
  - {address: a, procs: 2}
  - {address: b, procs: 1}
job:
  entrypoint: train.py
  args: [--epochs, "5"]
"""


def load(tmp_path: Path, array: str):
    return parse(HEAD + array, tmp_path / "cluster.yaml")


def test_matrix_expands_row_major_in_key_order(tmp_path: Path) -> None:
    c = load(tmp_path, "  array:\n    matrix: {model: [lenet, vgg], lr-schedule: [cosine, warm], fold: [0, 1, 2]}\n")
    spec = c.job.array
    assert spec is not None and spec.keys == ("model", "lr-schedule", "fold") and spec.procs_per_task == 1
    assert len(spec.tasks) == 12
    assert spec.tasks[0] == ("--model", "lenet", "--lr-schedule", "cosine", "--fold", "0")
    assert spec.tasks[1] == ("--model", "lenet", "--lr-schedule", "cosine", "--fold", "1")
    assert spec.tasks[3] == ("--model", "lenet", "--lr-schedule", "warm", "--fold", "0")
    assert spec.tasks[6][:2] == ("--model", "vgg")
    assert spec.params(5) == {"model": "lenet", "lr-schedule": "warm", "fold": "2"}


def test_expand_is_a_product() -> None:
    assert expand([("a", ["1", "2"]), ("b", ["x"])]) == [("--a", "1", "--b", "x"), ("--a", "2", "--b", "x")]
    assert task_params(["--model", "a", "--flag", "--fold", "0"]) == {"model": "a", "flag": "", "fold": "0"}


def test_task_list_form(tmp_path: Path) -> None:
    c = load(tmp_path, "  array:\n    tasks: [[--model, lenet], [--model, vgg, --fold, '1']]\n"
                       "    procs_per_task: 2\n")
    assert c.job.array is not None
    assert c.job.array.tasks == (("--model", "lenet"), ("--model", "vgg", "--fold", "1"))
    assert c.job.array.keys == () and c.job.array.procs_per_task == 2


@pytest.mark.parametrize("array, line, words", [
    ("  array:\n    matrix: {}\n", 9, "is empty"),
    ("  array:\n    matrix:\n      model: lenet\n", 10, "must be a list"),
    ("  array:\n    matrix:\n      model: []\n", 10, "empty list"),
    ("  array:\n    matrix:\n      model: [[a]]\n", 10, "single value"),
    ("  array:\n    matrix: {fold: [0]}\n    procs_per_task: 3\n", 10, "more than any host's procs"),
    ("  array:\n    matrix: {fold: [0]}\n    procs_per_task: 0\n", 10, "whole number"),
    ("  array:\n    matrix: {fold: [0]}\n    tasks: [[a]]\n", 8, "exactly one of"),
    ("  array:\n    procs_per_task: 1\n", 8, "exactly one of"),
    ("  array:\n    matrix:\n      'bad key': [1]\n", 10, "not an option name"),
    ("  array:\n    matrix:\n      model: [\"a\\0b\"]\n", 10, "NUL"),
    ("  array:\n    matrix: {fold: [0]}\n    procs: 1\n", 10, "unknown key `job.array.procs`"),
    ("  array:\n    tasks: []\n", 9, "empty list"),
    ("  array:\n    tasks: [--model]\n", 9, "must be a list"),
    ("  array: [1, 2]\n", 8, "must be a mapping"),
])
def test_array_errors_name_the_line(tmp_path: Path, array: str, line: int, words: str) -> None:
    with pytest.raises(InventoryError) as exc:
        load(tmp_path, array)
    text = str(exc.value)
    assert f"cluster.yaml:{line}" in text and words in text, text


def test_too_many_tasks_is_refused_before_expanding(tmp_path: Path) -> None:
    ten = "[" + ", ".join(str(i) for i in range(10)) + "]"
    matrix = "".join(f"      k{i}: {ten}\n" for i in range(6))   # 10**6 tasks
    with pytest.raises(InventoryError) as exc:
        load(tmp_path, "  array:\n    matrix:\n" + matrix)
    assert f"more than {MAX_TASKS}" in str(exc.value) and "cluster.yaml:" in str(exc.value)


def test_deal_round_robin_by_slot_share(tmp_path: Path) -> None:
    c = load(tmp_path, "  array:\n    matrix: {fold: [0, 1, 2, 3, 4, 5, 6, 7]}\n")
    assert c.job.array is not None
    assert plan.deal(c, c.job.array) == [0, 1, 0, 0, 1, 0, 0, 1]
    two = load(tmp_path, "  array:\n    matrix: {fold: [0, 1, 2]}\n    procs_per_task: 2\n")
    assert two.job.array is not None
    assert plan.deal(two, two.job.array) == [0, 0, 0]   # host b has no slot of 2 procs


def test_task_argv_direct_or_small_torchrun(tmp_path: Path) -> None:
    c = load(tmp_path, "  array:\n    matrix: {fold: [0, 1]}\n")
    assert plan.task_argv(c, "py", "/j", 1) == ["py", "-u", "train.py", "--epochs", "5", "--fold", "1"]
    two = load(tmp_path, "  array:\n    matrix: {fold: [0, 1]}\n    procs_per_task: 2\n")
    argv = plan.task_argv(two, "py", "/j", 0)
    assert argv[:4] == ["py", "-m", "torch.distributed.run", "--standalone"]
    assert argv[-4:] == ["--epochs", "5", "--fold", "0"] and "--nproc-per-node" in argv


def test_record_round_trip_and_damage(tmp_path: Path) -> None:
    c = load(tmp_path, "  array:\n    matrix: {fold: [0, 1]}\n")
    rec = plan.ArrayRecord("r", ["fold"], [["--fold", "0"], ["--fold", "1"]], [0, 1], 1)
    plan.save(c, rec)
    assert plan.load(c) == rec and rec.tasks_of(1) == [1]
    with pytest.raises(Exception, match="task 5 does not exist"):
        plan.task_of(rec, 5)
    plan.record_path(c).write_text(json.dumps({"run_id": "r", "keys": [], "args": [[]],
                                                 "host": [7], "procs_per_task": 1}))
    with pytest.raises(Exception, match="does not match"):
        plan.load(c)


def test_metrics_last_row_and_groups_over_folds() -> None:
    assert results.parse_metrics("epoch,val_acc", "3,0.9") == {"epoch": "3", "val_acc": "0.9"}
    assert results.parse_metrics("epoch,val_acc", "epoch,val_acc") == {}   # header only
    assert results.parse_metrics(None, None) == {}
    rows = [TaskResult(i, "", {"model": m, "fold": str(f)}, "exited 0",
                       {"val_acc": str(acc), "note": "x"})
            for i, (m, f, acc) in enumerate([("a", 0, 0.5), ("a", 1, 0.7), ("b", 0, 0.9)])]
    rows.append(TaskResult(3, "", {"model": "b", "fold": "1"}, "failed (exit code 1)", {}))
    groups = results.group(rows)
    assert [g.params for g in groups] == [{"model": "a"}, {"model": "b"}]
    a, b = groups
    assert a.metrics["val_acc"].mean == pytest.approx(0.6)
    assert a.metrics["val_acc"].std == pytest.approx(statistics.stdev([0.5, 0.7]))
    assert "note" not in a.metrics           # not a number: not averaged
    assert b.tasks == [2, 3] and b.ok == 1 and b.metrics["val_acc"] == MetricStats(0.9, 0.0, 1)


def test_status_rows_states_and_lost_hosts(tmp_path: Path) -> None:
    c = load(tmp_path, "  array:\n    matrix: {fold: [0, 1, 2]}\n")
    rec = plan.ArrayRecord("r", ["fold"], [["--fold", str(i)] for i in range(3)], [0, 1, 0], 1)
    tasks = [
        {"task": 0, "state": "exited", "code": -15, "started": 1.0, "ended": 3.5, "slot": 1, "last_line": "x"},
        {"task": 2, "state": "queued", "last_line": ""}]
    status = plan.ArrayStatus(0.0, tuple(plan.TaskReply.of(t) for t in tasks))
    rows = results.status_rows(c, rec, GroupResult(ok={0: status}, failed={1: OSError("gone")}))
    assert [r.state for r in rows] == ["failed (killed by SIGTERM)", "unreachable", "queued"]
    assert rows[0].runtime_s == 2.5 and rows[0].slot == 1 and rows[0].args == "--fold 0"
    assert rows[0].exit_code == -15 and rows[1].host == c.hosts[1].label


def test_array_messages_have_schemas_both_ways() -> None:
    from orchestrator.agent import main
    from orchestrator.wire import protocol
    for t in ("array_launch", "array_status", "array_results"):
        assert t in protocol.REQUESTS and t in protocol.REPLIES and t in main.HANDLERS
    assert "task" in protocol.FOLLOW_UNITS and "?unit" in protocol.REQUESTS["follow"]
