"""Shared helpers for the benchmarks: timing, tables, a fake SSH cluster."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the fake cluster lives beside the tests

from sshd_cluster import SshdCluster, free_port  # noqa: E402

VENV = REPO / ".venv"
VENV_PY = VENV / "bin" / "python"
ORCH = VENV / "bin" / "orch"
OUT_DIR = REPO / "bench" / "out"


@dataclass
class Run:
    """One timed command: wall seconds, exit code, output."""
    seconds: float
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def tail(self, n: int = 800) -> str:
        return (self.stderr.strip() or self.stdout.strip())[-n:]


def timed_run(cmd: Sequence[str], *, env: dict | None = None, cwd: Path | None = None,
              timeout: float = 300) -> Run:
    """Run cmd to completion and time it; a timeout counts as a failed run."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(list(cmd), env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        return Run(time.perf_counter() - t0, p.returncode, p.stdout, p.stderr)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Run(time.perf_counter() - t0, 124, out, f"timed out after {timeout:.0f} s")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_of(fn: Callable[[], float], k: int = 3) -> tuple[float, list[float]]:
    """Median of k calls of fn (each returns seconds), and all k samples."""
    samples = [fn() for _ in range(k)]
    return median(samples), samples


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A table with rich when it is installed, aligned plain text otherwise."""
    cells = [[_fmt(c) for c in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
        print(title)
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        for r in cells:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        return
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right")
    for r in cells:
        table.add_row(*r)
    Console().print(table)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return "-" if value != value else f"{value:.2f}"
    return str(value)


@contextmanager
def fake_cluster(n: int, root: Path | None = None, first_octet: int = 2,
                 sshd_options: dict | None = None) -> Iterator[SshdCluster]:
    """A started n-host SshdCluster under a temp dir, stopped (and checked) on exit."""
    with tempfile.TemporaryDirectory(prefix="orch-bench-") as tmp:
        base = Path(root) if root else Path(tmp)
        addresses = [f"127.0.0.{first_octet + i}" for i in range(n)]
        cluster = SshdCluster(base / "cluster", n, port=free_port(addresses),
                              first_octet=first_octet, sshd_options=sshd_options)
        with cluster:
            yield cluster


def clean_env(**extra: str) -> dict:
    """The environment for commands under test: no user ssh config, no colour."""
    env = dict(os.environ, ORCH_SSH_CONFIG=os.devnull, ORCH_NO_COLOR="1")
    env.update(extra)
    return env


def save_json(name: str, data: object) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / name
    path.write_text(json.dumps(data, indent=2))
    return path
