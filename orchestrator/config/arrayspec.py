"""`job.array` of cluster.yaml: a matrix (or a list) of argument sets, each an independent
task; every error names the file and line.

    array:
      matrix: {model: [lenet, vgg], fold: [0, 1, 2]}   # or: tasks: [[--model, lenet], ...]
      procs_per_task: 1

Task i is the entrypoint with `job.args`, then `--<key> <value>` for each matrix key in
the matrix's order; tasks are numbered row-major (the last key varies fastest).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from yaml.nodes import Node

from orchestrator.config.yamlnodes import Section, Source, scalar_text, short

ARRAY_KEYS = ("matrix", "tasks", "procs_per_task", "gpus_per_task")
MAX_TASKS = 100_000
MAX_TASK_BYTES = 4 << 20     # every task's own args together: they travel in one launch message
_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class ArraySpec:
    """The tasks of a job array: `tasks[i]` are task i's own args (after job.args)."""

    keys: tuple[str, ...]                  # matrix keys in order; () for a `tasks:` list
    tasks: tuple[tuple[str, ...], ...]
    procs_per_task: int
    gpus_per_task: int = 0    # each task pinned to this many of its host's claimed GPUs
    gpus_line: int = 0        # its line (checked against the hosts' gpus: by the inventory)

    def params(self, i: int) -> dict[str, str]:
        """Task i's `--key value` pairs, as a dict (what results group by)."""
        return task_params(self.tasks[i])


def task_params(args: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        if args[i].startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[args[i][2:]] = args[i + 1]
            i += 2
        else:
            out[args[i].lstrip("-")] = ""
            i += 1
    return out


def expand(matrix: Sequence[tuple[str, Sequence[str]]]) -> list[tuple[str, ...]]:
    """Row-major: the first key varies slowest, the last fastest."""
    tasks: list[tuple[str, ...]] = [()]
    for key, values in matrix:
        tasks = [t + ("--" + key, v) for t in tasks for v in values]
    return tasks


def parse_array(job: Section, max_procs: int) -> ArraySpec | None:
    """The `job.array` section, or None when absent."""
    node = job.node("array")
    if node is None:
        return None
    sec = Section(job.src, node, "job.array", job.key_line("array"))
    sec.check_keys(ARRAY_KEYS, {})
    ppt = sec.integer("procs_per_task", 1, 1, example=1)
    if ppt > max_procs:
        job.src.fail(sec.node("procs_per_task"),
                     f"`job.array.procs_per_task` is {ppt}, more than any host's procs (at most {max_procs})",
                     f"give procs_per_task from 1 to {max_procs}, or raise a host's `procs:`")
    has_m, has_t = sec.node("matrix") is not None, sec.node("tasks") is not None
    if has_m == has_t:
        job.src.fail(sec.line, "`job.array` needs exactly one of `matrix:` and `tasks:`",
                     "write `matrix: {model: [lenet, vgg], fold: [0, 1]}` or "
                     "`tasks: [[--model, lenet], [--model, vgg]]`")
    if has_m:
        keys, tasks = _matrix(sec)
    else:
        keys, tasks = (), _task_list(sec)
    used = sum(len(a.encode()) + 1 for t in tasks for a in t)
    if used > MAX_TASK_BYTES:
        job.src.fail(sec.line, f"the tasks' own args hold {used} bytes in all, more than {MAX_TASK_BYTES}",
                     "use fewer or shorter values")
    gpt = sec.integer("gpus_per_task", 0, 0, max_procs * 64, example=1)
    gpus_line = sec.key_line("gpus_per_task") if sec.node("gpus_per_task") is not None else 0
    return ArraySpec(keys, tuple(tasks), ppt, gpt, gpus_line)


def _matrix(sec: Section) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    src, node = sec.src, sec.node("matrix")
    assert node is not None   # the caller saw the key
    items = src.mapping(node, "job.array.matrix")
    if not items:
        src.fail(node, "`job.array.matrix` is empty", "give at least one key with a list of values, "
                                                       "e.g. `matrix: {fold: [0, 1, 2]}`")
    matrix, count = [], 1
    for key, (key_node, value_node) in items.items():
        if not _KEY_RE.fullmatch(key):
            src.fail(key_node, f"`job.array.matrix` key {short(key)!r} is not an option name",
                     "use letters, digits, - and _ (it becomes `--<key>`)")
        values = _values(src, value_node, f"job.array.matrix.{key}")
        count *= len(values)
        _check_count(src, key_node, count)
        matrix.append((key, values))
    return tuple(k for k, _ in matrix), expand(matrix)


def _values(src: Source, node: Node, what: str) -> list[str]:
    hint = "write a list of values, e.g. `[0, 1, 2]`"
    items = src.sequence(node, what)   # refuses a single value or a mapping
    if not items:
        src.fail(node, f"`{what}` is an empty list", hint)
    return [scalar_text(src, item, f"{what}[{i}]", hint) for i, item in enumerate(items)]


def _task_list(sec: Section) -> list[tuple[str, ...]]:
    src, node = sec.src, sec.node("tasks")
    assert node is not None   # the caller saw the key
    items = src.sequence(node, "job.array.tasks")
    if not items:
        src.fail(node, "`job.array.tasks` is an empty list", "give one list of args per task, "
                                                              "e.g. `tasks: [[--model, lenet]]`")
    _check_count(src, node, len(items))
    tasks = []
    for i, item in enumerate(items):
        what = f"job.array.tasks[{i}]"
        args = src.sequence(item, what)
        tasks.append(tuple(scalar_text(src, a, f"{what}[{j}]", "args are text values")
                           for j, a in enumerate(args)))
    return tasks


def _check_count(src: Source, node: Node, count: int) -> None:
    if count > MAX_TASKS:
        src.fail(node, f"`job.array` makes {count} tasks, more than {MAX_TASKS} (the limit)",
                 "use fewer values, or split the sweep into several inventories")
