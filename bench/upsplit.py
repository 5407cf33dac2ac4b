"""`orch up` before and after the renderer split: wall time and the controller's CPU.

The split made `orch up` a reader of the run's events (api/running.py and
watch/monitor.watch decide, commands/uprender.py prints) instead of the restart loop of
commands/restarting.py printing as it went. This bench runs the same `orch up` of a
one-line job (bench/scale.HELLO, one rank per host, the stand-in torchrun
bench/torchrun_standin.py) on N fake sshd hosts from two trees:

  before   a `git worktree` of the revision before the split (default: the parent of
           the commit that removed orchestrator/commands/restarting.py; `--before REV`)
  after    this checkout (or `--after REV`, a worktree of it: `--after c1541aa`, the
           split's commit, leaves out what came after it; its parent does not run, the old
           restart loop having been removed a few commits before)

Both run as `python -m orchestrator up` with the same venv's python (PYTHONPATH names the
tree; each tree's bytecode compiled first, as an installed orch has it), each on its own
job name in the same hosts' folders, interleaved (before, after, then after, before, ...)
so the machine's noise hits both alike. Per run: wall seconds and the `orch` process's
user and system CPU (wait4's rusage, exact whatever the load). Printed: the medians per
tree and host count, and the ratio after / before.

    .venv/bin/python bench/upsplit.py --hosts 3 64 [--reps 5] [--shell plain|root]
                                      [--before REV] [--after REV]

Every sshd, job process and file it made is gone at the end (checked and printed), and
the worktree is removed.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import (
    REPO,
    VENV_PY,
    Bed,
    Run,
    bed_cluster,
    kill_pids,
    markdown,
    median,
    orch_env,
    remote_base,
    save_json,
)
from fleet import SSH, Cost, measured
from scale import HELLO, job_ok

SPLIT_GONE = "orchestrator/commands/restarting.py"   # removed by the split


def before_split() -> str:
    """The revision before the split: the parent of the commit that removed the old
    restart loop."""
    gone = subprocess.run(["git", "-C", str(REPO), "log", "--diff-filter=D", "--format=%H",
                           "-1", "--", SPLIT_GONE], capture_output=True, text=True, check=True)
    if not gone.stdout.strip():
        sys.exit(f"no commit removed {SPLIT_GONE}: give the revision with --before REV")
    parent = subprocess.run(["git", "-C", str(REPO), "rev-parse", gone.stdout.strip() + "^"],
                            capture_output=True, text=True, check=True)
    return parent.stdout.strip()


@contextmanager
def worktree(rev: str | None, name: str) -> Iterator[Path]:
    """A detached worktree of rev in a temporary folder, removed on the way out; None:
    this checkout."""
    if rev is None:
        yield REPO
        return
    where = Path(tempfile.mkdtemp(prefix="orch-upsplit-")) / name
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(where),
                    rev], check=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(where)],
                       check=False)
        where.parent.rmdir()


@dataclass
class Tree:
    """One orch to time: its name and where its package is."""
    name: str
    root: Path

    def env(self) -> dict:
        return dict(orch_env(), PYTHONPATH=str(self.root))

    def prepare(self) -> None:
        """Its bytecode compiled; and proof that this tree's package is the one run."""
        subprocess.run([str(VENV_PY), "-m", "compileall", "-q", str(self.root / "orchestrator")],
                       check=True, env=self.env())
        got = subprocess.run([str(VENV_PY), "-c", "import orchestrator; print(orchestrator.__file__)"],
                             env=self.env(), cwd="/", capture_output=True, text=True, check=True)
        if not got.stdout.strip().startswith(str(self.root)):
            sys.exit(f"{self.name}: python imports {got.stdout.strip()}, not {self.root}")

    def up(self, inv: Path) -> tuple[Run, Cost]:
        return measured([str(VENV_PY), "-m", "orchestrator", "up", "-c", str(inv)],
                        env=self.env(), cwd=inv.parent)


@dataclass
class Series:
    n: int
    costs: dict[str, list[Cost]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def run_series(bed: Bed, trees: list[Tree], reps: int) -> Series:
    s = Series(bed.n, {t.name: [] for t in trees})
    invs, dirs = {}, []
    for t in trees:   # each tree its own job on the same hosts' folders
        invs[t.name] = bed.inventory(f"{t.name}{bed.n}", HELLO)
        dirs += bed.dirs
    bed.dirs = dirs   # left_over looks at both jobs
    for rep in range(reps):
        order = trees if rep % 2 == 0 else trees[::-1]
        for t in order:
            run, cost = t.up(invs[t.name])
            if not job_ok(bed, run):
                note = f"{t.name} rep {rep + 1}: exit {cost.code}: {run.tail(400)}"
                s.notes.append(note)
                print(f"  ! {note}", flush=True)
                continue
            s.costs[t.name].append(cost)
            print(f"  {bed.n} hosts, {t.name}: {cost.seconds:.2f} s, cpu {cost.user:.2f} user "
                  f"+ {cost.system:.2f} sys", flush=True)
    left = bed.left_over()
    if left:
        s.notes.append(f"{len(left)} job processes left: killed")
        kill_pids(left)
    return s


def report(series: list[Series], rev: str, started: float) -> None:
    print(f"\nupsplit: medians, before = {rev} (load "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}, {time.monotonic() - started:.0f} s)")
    rows = []
    for s in series:
        mid = {name: (median([c.seconds for c in cs]), median([c.user + c.system for c in cs]),
                      median([c.user for c in cs]), median([c.system for c in cs]), len(cs))
               for name, cs in s.costs.items() if cs}
        for name, (wall, cpu, user, system, k) in mid.items():
            rows.append([s.n, name, k, wall, user, system, cpu])
        if {"before", "after"} <= mid.keys():
            b, a = mid["before"], mid["after"]
            rows.append([s.n, "after / before", "", a[0] / b[0], a[2] / b[2] if b[2] else float("nan"),
                         a[3] / b[3] if b[3] else float("nan"), a[1] / b[1]])
    markdown(["hosts", "tree", "runs", "wall s", "user s", "sys s", "user+sys s"], rows)
    for s in series:
        for note in s.notes:
            print(f"note ({s.n} hosts): {note[:300]}")
    data = [{"hosts": s.n, "before": rev, "notes": s.notes,
             "costs": {k: [asdict(c) for c in v] for k, v in s.costs.items()}} for s in series]
    print(f"raw samples: {save_json('upsplit.json', data)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[3, 64], metavar="N")
    ap.add_argument("--reps", type=int, default=5, help="runs of each tree per host count")
    ap.add_argument("--before", metavar="REV", help="the tree before the split "
                    "(default: the parent of the commit that removed commands/restarting.py)")
    ap.add_argument("--after", metavar="REV", help="the tree after it (default: this checkout)")
    ap.add_argument("--shell", default="plain", choices=["plain", "root"])
    args = ap.parse_args()
    rev = args.before or before_split()
    started = time.monotonic()
    series: list[Series] = []
    with worktree(rev, "before") as old, worktree(args.after, "after") as new:
        trees = [Tree("before", old), Tree("after", new)]
        for t in trees:
            t.prepare()
        with bed_cluster(max(args.hosts), [args.shell], wide=True) as beds:
            sh = beds.shells[args.shell]
            work = beds.cluster.root.parent / "work"
            for n in sorted(args.hosts):
                print(f"\n== {n} hosts, {args.shell} shell ({sh.user})", flush=True)
                bed = Bed(beds.cluster, beds.cluster.hosts[:n], sh, beds.python, work / f"n{n}",
                          remote_base(beds.cluster, sh) / f"n{n}", ssh=dict(SSH))
                series.append(run_series(bed, trees, args.reps))
        report(series, f"{rev}, after = {args.after or 'this checkout'}", started)
    if not beds.clean:
        sys.exit(1)


if __name__ == "__main__":
    main()
