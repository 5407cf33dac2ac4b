"""Training curves from the files a job writes (#35 item 2), read from the local copies
that the pull brought back: `worker.train`'s metrics.csv (or any `metrics*.csv`), any
JSON-lines file (`*.jsonl`, `*.ndjson`: one object per line with `step` or `epoch`), and
TensorBoard event files (`events.out.tfevents.*`, read by the `tensorboard` package's
own reader, an optional extra).

Where the copies are: the host of global rank 0 at `outputs/<name>/` beside the
inventory (where `orch pull` puts rank 0's output/), every other host's metrics files
in orch's own `.orch/<name>/curves/<label>/` (watch/curvefetch.py fetches them while the
job runs; a new run starts that folder afresh).

A file is the job's output: never trusted. Each is capped in size, a series in points
and the whole in series; a file that is too big, binary or malformed is skipped with a
note (`notes`), never raised.
"""
from __future__ import annotations

import csv
import functools
import io
import json
import logging
import math
import os
import re
import shutil
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.config.inventory import Cluster, Host

log = logging.getLogger("orchestrator")

HOSTS_DIR = "curves"            # .orch/<name>/curves/<label>/: the other hosts' copies
MAX_TEXT = 32 << 20             # bytes of one csv or jsonl file read
MAX_EVENTS = 128 << 20          # bytes of one TensorBoard event file read
MAX_FILES = 256                 # metrics files read per job
MAX_SERIES = 1024               # series returned
MAX_POINTS = 20_000             # points of one series (evenly thinned beyond, last kept)
MAX_LINE = 1 << 20              # one jsonl line
MAX_NAME = 200                  # characters of a metric's name
MAX_NOTES = 50
STEP_KEYS = ("step", "global_step", "iteration", "iter")
EPOCH_KEYS = ("epoch",)
TIME_KEYS = ("wall_time", "timestamp", "time")   # unix seconds, when the value looks like one
UNIX_2001 = 978_307_200.0       # a `time` below this is elapsed seconds, not a wall time
RANK_RE = re.compile(r"(?:^|[^a-z0-9])rank[-_]?(\d{1,6})(?:[^0-9]|$)", re.IGNORECASE)
TASK_RE = re.compile(r"^task-(\d+)(?:/|$)")
TB_HINT = "pip install 'orch[curves]' (the tensorboard package reads them)"


@dataclass(frozen=True)
class Point:
    step: int | None      # the row's step (or None)
    epoch: int | None     # the row's epoch (or None)
    value: float
    time: float | None    # wall time (unix seconds) if the file has it


@dataclass(frozen=True)
class Series:
    host: str             # host label as in the inventory
    rank: int | None      # the rank that wrote it, where known (path or file name tells)
    source: str           # the file, relative to the job's output folder on that host
    name: str             # the metric: "loss", "val_acc", "lr", a TensorBoard tag, ...
    points: tuple[Point, ...]


SAID: set[str] = set()          # the notes warned of in this process (each once)


class Notes(list[str]):
    """What was skipped, in words (the first MAX_NOTES). A file's note is also a warning
    of the `orchestrator` logger (the CLI prints it), once per process and `key` (the
    file): `orch status --watch` and a fetch every 2 s do not repeat it; `say=False`: a
    host's failed round, which the run reports its own way."""

    def add(self, text: str, key: str | None = None, say: bool = True) -> None:
        if say and (key or text) not in SAID:
            if len(SAID) < 4096:
                SAID.add(key or text)
                log.warning("%s", text)
        else:
            log.debug("curves: %s", text)
        if len(self) < MAX_NOTES:
            self.append(text)


# ---------------------------------------------------------------- where the copies are

def outputs_dir(cluster: Cluster) -> Path:
    """outputs/<name>/ beside the inventory: `orch pull`'s default destination."""
    return cluster.base_dir / "outputs" / cluster.name


def rank0_host(cluster: Cluster) -> Host | None:
    if cluster.world_size > 0:
        return cluster.host_of(0)
    return cluster.hosts[0] if cluster.hosts else None


def local_root(cluster: Cluster, host: Host) -> Path:
    """Where the copy of `host`'s output/ is on this machine."""
    first = rank0_host(cluster)
    if first is not None and host.label == first.label:
        return outputs_dir(cluster)
    return cluster.state_dir / HOSTS_DIR / host.label


def clear_copies(cluster: Cluster) -> None:
    """A new run: the other hosts' copies of an earlier run's files removed (orch's own
    folder; the hosts keep their files). A link there is removed, never followed."""
    top = cluster.state_dir / HOSTS_DIR
    if top.is_symlink():
        top.unlink()
    elif top.is_dir():
        shutil.rmtree(top, ignore_errors=True)


def kind_of(rel: str) -> str | None:
    """"csv", "jsonl", "tfevents" or None: which metrics file a path is, by its name."""
    name = rel.rsplit("/", 1)[-1]
    if name.startswith("events.out.tfevents."):
        return "tfevents"
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.startswith("metrics") and name.endswith(".csv"):
        return "csv"
    return None


# the globs (relative to output/) the fetch asks each host for: what kind_of knows
GLOBS = ("**/metrics*.csv", "**/*.jsonl", "**/*.ndjson", "**/events.out.tfevents.*")


def files_under(root: Path, notes: Notes) -> Iterator[str]:
    """Metrics files under root (relative, '/'-separated), no link followed, at most
    MAX_FILES."""
    count = 0
    for top, dirs, names in os.walk(root, followlinks=False):
        rel_top = os.path.relpath(top, root).replace(os.sep, "/")
        dirs[:] = sorted(dirs)
        for name in sorted(names):
            rel = name if rel_top == "." else f"{rel_top}/{name}"
            if kind_of(rel) is None or ".orch-part-" in name:
                continue
            count += 1
            if count > MAX_FILES:
                notes.add(f"{root}: more than {MAX_FILES} metrics files; the rest are not read")
                return
            yield rel


# ---------------------------------------------------------------- the public calls

def read_curves(cluster: Cluster, task: int | None = None,
                notes: list[str] | None = None) -> list[Series]:
    """Every curve of the job (or of one array task: the files under `task-<i>/`) from
    the local copies that the pull brought back, capped in size and count. `notes` gets
    a line per file skipped (too big, binary, malformed, no reader installed)."""
    noted = Notes()
    out: list[Series] = []
    first = rank0_host(cluster)
    for host in cluster.hosts:
        root = local_root(cluster, host)
        if not root.is_dir():
            continue
        for rel in files_under(root, noted):
            if task is not None and task_of(rel) != task:
                continue
            out += read_file(root, rel, host.label, noted, first is not None and first.label == host.label)
            if len(out) >= MAX_SERIES:
                noted.add(f"more than {MAX_SERIES} curves; the rest are not read")
                return finish(out[:MAX_SERIES], noted, notes)
    return finish(out, noted, notes)


def finish(out: list[Series], noted: Notes, notes: list[str] | None) -> list[Series]:
    if notes is not None:
        notes.extend(noted)
    return out


def latest(series: list[Series]) -> dict[tuple[str, int | None], dict[str, float]]:
    """(host, rank) -> {metric: last value}: for `orch status` and the dashboard's rank
    table. A metric written by two files of one rank: the one read last wins."""
    out: dict[tuple[str, int | None], dict[str, float]] = {}
    for s in series:
        if s.points:
            out.setdefault((s.host, s.rank), {})[s.name] = s.points[-1].value
    return out


def task_of(rel: str) -> int | None:
    """The array task whose folder (`task-<i>/`, agent/array.py) holds the file."""
    m = TASK_RE.match(rel)
    return int(m.group(1)) if m else None


def rank_of(rel: str, kind: str, first: bool) -> int | None:
    """The rank that wrote the file, where its path tells (`rank3`, `rank-3`, `rank_3`),
    and worker.train's metrics.csv on rank 0's host (rank 0 writes it)."""
    m = RANK_RE.search(rel)
    if m:
        return int(m.group(1))
    if kind == "csv" and first and rel.rsplit("/", 1)[-1] == "metrics.csv":
        return 0
    return None


# ---------------------------------------------------------------- one file

def read_file(root: Path, rel: str, host: str, notes: Notes, first: bool) -> list[Series]:
    """The curves of one file (`first`: on rank 0's host)."""
    kind = kind_of(rel) or ""
    cap = MAX_EVENTS if kind == "tfevents" else MAX_TEXT
    path = root / rel
    try:
        st = os.lstat(path)
    except OSError:
        return []
    if not stat.S_ISREG(st.st_mode):
        return []
    shown = f"{host}: output/{rel}"
    if st.st_size > cap:
        notes.add(f"{shown}: {st.st_size} bytes, more than {cap} (not read)", shown)
        return []
    key = Seen(str(path), st.st_size, st.st_mtime_ns, st.st_ino, host, first)
    hit = PARSED.get(key)
    if hit is not None:
        return hit
    before = len(notes)
    try:
        rows = parse(path, kind, notes, shown)
    except Exception as e:  # hostile or broken input: a note, never a crash
        notes.add(f"{shown}: not read ({type(e).__name__}: {str(e)[:200]})", shown)
        return []
    rank = rank_of(rel, kind, first)
    got = [Series(host, rank, rel, name, thin(points)) for name, points in rows.items()]
    if len(notes) == before:   # a file with a note is read again: its note is said again
        remember(key, got)
    return got


@dataclass(frozen=True)
class Seen:
    """A file as last read: its stat, and how its series were labelled."""

    path: str
    size: int
    mtime_ns: int
    inode: int
    host: str
    first: bool


# what each file held when last read, by its stat: the dashboard and `status --watch`
# read every few seconds, and only the files the fetch changed are parsed again
PARSED: dict[Seen, list[Series]] = {}
PARSED_CAP = 2 * MAX_FILES


def remember(key: Seen, got: list[Series]) -> None:
    if len(PARSED) >= PARSED_CAP:
        PARSED.clear()
    PARSED[key] = got


Rows = dict[str, list[Point]]
# one row of a metrics file as decoded: a CSV row's cells (text), or a JSON object's
# values (flattened); the job's data, so each value is looked at, never assumed
Row = dict[str, object]


def parse(path: Path, kind: str, notes: Notes, shown: str) -> Rows:
    if kind == "tfevents":
        return parse_events(path, notes, shown)
    with open(path, "rb") as f:
        raw = f.read(MAX_TEXT + 1)
    if b"\0" in raw[:65536]:
        notes.add(f"{shown}: binary, not a text metrics file (not read)", shown)
        return {}
    text = raw.decode("utf-8", "replace")
    return parse_csv(text, notes, shown) if kind == "csv" else parse_jsonl(text, notes, shown)


def number(value: object) -> float | None:
    """A finite float from a cell or a JSON value; None for anything else (bools too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return out if math.isfinite(out) else None


def whole(value: object) -> int | None:
    got = number(value)
    return int(got) if got is not None and got == int(got) and abs(got) < 1 << 62 else None


def first_of(row: Row, keys: tuple[str, ...]) -> object:
    for k in keys:
        if k in row:
            return row[k]
    return None


def axes(row: Row) -> tuple[int | None, int | None, float | None]:
    """(step, epoch, wall time) of a row or a JSON object."""
    step, epoch = whole(first_of(row, STEP_KEYS)), whole(first_of(row, EPOCH_KEYS))
    t = number(first_of(row, TIME_KEYS))
    return step, epoch, t if t is not None and t >= UNIX_2001 else None


AXES = frozenset(STEP_KEYS + EPOCH_KEYS + TIME_KEYS + ("time_s",))


def add_row(rows: Rows, row: Row) -> None:
    step, epoch, t = axes(row)
    for key, value in row.items():
        if not isinstance(key, str) or key in AXES:
            continue
        got = number(value)
        if got is not None:
            name = clean_name(key)
            if name and (name in rows or len(rows) < MAX_SERIES):
                rows.setdefault(name, []).append(Point(step, epoch, got, t))


@functools.lru_cache(maxsize=4096)   # the same few keys on every row
def clean_name(key: str) -> str:
    """A metric's name as text only (no control character), capped."""
    return "".join(c for c in key.strip() if c.isprintable())[:MAX_NAME]


def parse_csv(text: str, notes: Notes, shown: str) -> Rows:
    """A header row, then one row per step or epoch; cells that are no number (an empty
    one of Lightning's CSVLogger) are left out; a last line still being written too."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith(("\n", "\r")):
        lines.pop()   # being written: the next fetch brings it whole
    try:
        reader = csv.DictReader(io.StringIO("".join(lines)))
        rows: Rows = {}
        for row in reader:
            add_row(rows, {k: v for k, v in row.items() if k is not None})
    except csv.Error as e:
        notes.add(f"{shown}: not a CSV file ({e})", shown)
        return {}
    if not reader.fieldnames:
        return {}
    return rows


def parse_jsonl(text: str, notes: Notes, shown: str) -> Rows:
    """One JSON object per line with `step` or `epoch`; other lines are counted and
    named once (a last line still being written is not one of them)."""
    rows: Rows = {}
    bad, first_bad = 0, 0
    lines = text.split("\n")
    complete = lines[:-1] if lines and lines[-1] else lines
    for number_, line in enumerate(complete, 1):
        if not line.strip():
            continue
        obj = json_object(line)
        if obj is None or not any(k in obj for k in STEP_KEYS + EPOCH_KEYS):
            bad += 1
            first_bad = first_bad or number_
            continue
        add_row(rows, flatten(obj))
    if bad:
        notes.add(f"{shown}: {bad} line{'s' if bad != 1 else ''} not a JSON object with "
                  f"`step` or `epoch` (first: line {first_bad}); skipped", shown)
    return rows


def json_object(line: str) -> Row | None:
    if len(line) > MAX_LINE:
        return None
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def flatten(obj: Row, prefix: str = "", depth: int = 0) -> Row:
    """{"val": {"loss": 1}} -> {"val/loss": 1}, two levels deep at most."""
    out: Row = {}
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and depth < 2:
            out.update(flatten(v, key + "/", depth + 1))
        else:
            out[key] = v
    return out


# ---------------------------------------------------------------- TensorBoard

def parse_events(path: Path, notes: Notes, shown: str) -> Rows:
    """The scalars of one event file, by the tensorboard package's own reader (its
    EventFileLoader: a record cut short at the end, the file still being written, ends
    the read there); no tensorboard here: one note."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    except ImportError:
        notes.add(f"{shown}: a TensorBoard event file, not read: {TB_HINT}", "tensorboard")
        return {}
    rows: Rows = {}
    for event in EventFileLoader(str(path)).Load():
        for value in event.summary.value:
            got = scalar(value, tensor_util)
            name = clean_name(value.tag)
            if got is not None and name and (name in rows or len(rows) < MAX_SERIES):
                rows.setdefault(name, []).append(
                    Point(int(event.step), None, got, number(event.wall_time)))
    return rows


def scalar(value: Any, tensor_util: Any) -> float | None:
    """A summary value's scalar: `simple_value` (old writers) or a one-number tensor
    (the loader migrates scalars to tensors)."""
    if value.HasField("simple_value"):
        return number(value.simple_value)
    if value.HasField("tensor"):
        arr = tensor_util.make_ndarray(value.tensor)
        if arr.size == 1 and arr.dtype.kind in "fiu":
            return number(float(arr.reshape(-1)[0]))   # a numpy scalar: a Python float
    return None


# ---------------------------------------------------------------- caps

def thin(points: Iterable[Point]) -> tuple[Point, ...]:
    """At most MAX_POINTS, evenly spaced, the last one always kept."""
    got = list(points)
    if len(got) <= MAX_POINTS:
        return tuple(got)
    stride = len(got) / (MAX_POINTS - 1)
    picked = [got[int(i * stride)] for i in range(MAX_POINTS - 1)]
    return tuple(picked + [got[-1]])
