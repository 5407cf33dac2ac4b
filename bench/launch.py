"""Launch latency: `orch up` against the pdsh + torchrun baseline on fake hosts.

Both launch the same gloo job (bench/jobs/firstline.py: each rank prints `first-line`
before importing torch, `imported` and `joined` after, rank 0 the all-reduce's sum) on the
same sshd hosts, --procs ranks per host, and wait for it to end. Runs are interleaved
(pdsh, orch, pdsh, orch...) so that the noise of this shared machine hits both alike;
figures are medians. Each run's output is read line by line as it comes, so that the
timeline says where the time goes, from the command's start:

  first line   orch: its first line (preflight); pdsh prints nothing of its own
  go           orch: the first host's supervisor handed torchrun its go (run/supervisor.json)
  started      orch: `started job ...` (every host launched)
  rank start   orch: torchrun started the first rank (run/rank-<r>.pid, its launcher)
  rank runs    the first rank's own clock at its first line (the job's code began)
  rank seen    that line reaching the command's output (orch: through the agent's follow)
  imported     the last rank done importing torch
  joined       the last rank through init_process_group
  rank ends    the last rank's own clock at its last line (after destroy_process_group:
               what is left is its interpreter's end)
  rank exited  orch: the last rank ended (run/rank-<r>.exit, its launcher)
  torchrun     the last host's torchrun exited (orch: the supervisor's run/host.exit;
               pdsh: the remote shell's clock right after torchrun, `torchrun-exit`)
  end          the command returned

    .venv/bin/python bench/launch.py [--hosts 3] [--procs 2] [--reps 3] [--compare DIR]

--compare DIR also times the orch of another checkout (e.g. `git archive` of an older
commit unpacked in DIR) in the same interleaved loop, so both see the same noise.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from common import (
    ORCH,
    REPO,
    VENV_PY,
    SshdCluster,
    clean_env,
    fake_cluster,
    free_port,
    median,
    pdsh_env,
    print_table,
    save_json,
)

JOB = REPO / "bench" / "jobs" / "firstline.py"
MASTER = "127.0.0.2"
MARKS = ("first line", "go", "started", "rank start", "rank runs", "rank seen", "imported", "joined",
         "rank ends", "rank exited", "torchrun", "end")
STAMP = re.compile(r"(first-line|imported|joined|end|torchrun-exit) (?:rank|node)=\d+ t=(\d+\.\d+)")
LAST = {"imported": "imported", "joined": "joined", "end": "rank ends", "torchrun-exit": "torchrun"}


@dataclass
class Timed:
    """One run read line by line: seconds from its start to each mark."""
    returncode: int
    text: str
    wall0: float
    marks: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.marks["end"]


def stream_run(cmd: list[str], env: dict, cwd: Path | None = None,
               timeout: float = 300) -> Timed:
    """Run cmd; every line of stdout and stderr stamped as it arrives."""
    wall0, t0 = time.time(), time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    lock = threading.Lock()

    def read(stream) -> None:   # type: ignore[no-untyped-def]
        for line in stream:
            with lock:
                lines.append((time.perf_counter() - t0, line))
    readers = [threading.Thread(target=read, args=(s,), daemon=True)
               for s in (proc.stdout, proc.stderr)]
    for th in readers:
        th.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    end = time.perf_counter() - t0
    for th in readers:
        th.join(5)
    lines.sort()
    run = Timed(code, "".join(text for _, text in lines), wall0)
    run.marks = marks_of(lines, wall0)
    run.marks["end"] = end
    return run


def marks_of(lines: list[tuple[float, str]], wall0: float) -> dict[str, float]:
    """The timeline's marks (seconds from the start) found in the stamped lines."""
    out: dict[str, float] = {}
    clocks: dict[str, list[float]] = {k: [] for k in ("first-line", *LAST)}
    for at, text in lines:
        m = STAMP.search(text)
        if m:
            clocks[m.group(1)].append(float(m.group(2)) - wall0)
            if m.group(1) == "first-line":
                out.setdefault("rank seen", at)
            continue
        if "started job" in text:
            out.setdefault("started", at)
        if "allreduce sum=" not in text:
            out.setdefault("first line", at)
    if clocks["first-line"]:
        out["rank runs"] = min(clocks["first-line"])
    for name, mark_name in LAST.items():
        if clocks[name]:
            out[mark_name] = max(clocks[name])
    return out


def pdsh_setup(hosts: list) -> dict[str, Path]:
    """Copy the job to every host's dir, outside the timing (as a user would beforehand)."""
    dirs = {}
    for h in hosts:
        d = h.home / "pdsh"
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(JOB, d / JOB.name)
        dirs[h.address] = d
    return dirs


def pdsh_command(cluster: SshdCluster, dirs: dict[str, Path], port: int, procs: int) -> list[str]:
    """What a run_dist.sh writer would do: one pdsh, node rank and dir picked per host,
    every host at once (-f at least the host count), ssh's options on its command line.
    The remote shell stamps torchrun's exit (bash's clock: no process started for it)."""
    n = len(dirs)
    cases = " ".join(f"{addr}) R={i}; D={d};;" for i, (addr, d) in enumerate(dirs.items()))
    remote = (f"case %h in {cases} esac; cd $D && {VENV_PY} -m torch.distributed.run "
              f"--nnodes {n} --node-rank $R --nproc-per-node {procs} "
              f"--master-addr {MASTER} --master-port {port} {JOB.name}; c=$?; "
              "echo torchrun-exit node=$R t=${EPOCHREALTIME:-$(date +%s.%N)}; exit $c")
    return ["pdsh", "-R", "ssh", "-f", str(max(256, n)), "-w", ",".join(dirs), remote]


def run_pdsh(cluster: SshdCluster, dirs: dict[str, Path], procs: int) -> Timed:
    port = free_port([MASTER], 29500, 29900)
    return stream_run(pdsh_command(cluster, dirs, port, procs), env=pdsh_env(cluster))


def orch_setup(cluster: SshdCluster, hosts: list, workdir: Path, procs: int,
               name: str = "firstline") -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(JOB, workdir / JOB.name)
    return cluster.write_inventory(workdir / "cluster.yaml", hosts=hosts, procs=procs,
                                   name=f"{name}-n{len(hosts)}", entrypoint=JOB.name,
                                   code_paths=[JOB.name])


def orch_argv() -> tuple[list[str], dict]:
    """The installed `orch`, or the source tree's module before `make install`."""
    env = clean_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)   # as installed: orch's bytecode is kept
    if ORCH.exists():
        return [str(ORCH)], env
    return [str(VENV_PY), "-m", "orchestrator"], dict(env, PYTHONPATH=str(REPO))


def run_orch(inventory: Path, hosts: list, repo: Path | None = None) -> Timed:
    argv, env = orch_argv()
    if repo is not None:   # another checkout's orch, with this venv's packages
        argv, env = [str(VENV_PY), "-m", "orchestrator"], dict(env, PYTHONPATH=str(repo))
    run = stream_run([*argv, "up", str(inventory)], env=env, cwd=inventory.parent)
    name = yaml.safe_load(inventory.read_text())["name"]
    records = [p for h in hosts for p in (h.remote_dir / name / "run").glob("*/*")]
    for mark_name, pattern, key, pick in (("go", "supervisor.json", "started", min),
                                          ("rank start", "rank-*.pid", "time", min),
                                          ("rank exited", "rank-*.exit", "time", max),
                                          ("torchrun", "host.exit", "time", max)):
        times = [json.loads(p.read_text())[key] for p in records if p.match(pattern)]
        if times:
            run.marks[mark_name] = pick(times) - run.wall0
    return run


def job_ok(run: Timed, world: int) -> bool:
    """Exit 0 and rank 0 printed the right sum: the job really ran everywhere."""
    return run.returncode == 0 and f"allreduce sum={4 * world} expected={4 * world}" in run.text


def tail(run: Timed) -> str:
    return f"exit {run.returncode}: {run.text.strip()[-800:]}"


def bench_hosts(cluster: SshdCluster, n: int, procs: int, reps: int, workdir: Path,
                compare: Path | None = None) -> dict:
    hosts = cluster.hosts[:n]
    dirs = pdsh_setup(hosts)
    inventory = orch_setup(cluster, hosts, workdir / f"orch-n{n}", procs)
    # a job name of its own: the two orch versions never share a job folder
    other = orch_setup(cluster, hosts, workdir / f"other-n{n}", procs, "other") \
        if compare else None
    got: dict[str, list[dict[str, float]]] = {"pdsh": [], "orch": [], "other": []}
    errors: list[str] = []
    for rep in range(reps):
        runs = [("pdsh", run_pdsh(cluster, dirs, procs)), ("orch", run_orch(inventory, hosts))]
        if other is not None:
            runs.append(("other", run_orch(other, hosts, compare)))
        for who, r in runs:
            if job_ok(r, n * procs):
                got[who].append(r.marks)
            else:
                errors.append(f"{who}: {tail(r)}")
                print(f"{who} failed: {tail(r)}", file=sys.stderr)
        print(f"  n={n} x {procs} rep={rep + 1}: " + "; ".join(
            f"{who} " + " ".join(f"{k} {r.marks[k]:.2f}" for k in MARKS if k in r.marks)
            for who, r in runs), flush=True)
    return {"hosts": n, "procs": procs, "runs": got, "errors": errors,
            "load": os.getloadavg()[0]}


def mark(runs: list[dict[str, float]], name: str) -> float:
    return median([r[name] for r in runs if name in r])


def report(results: list[dict], compare: Path | None = None) -> None:
    rows = []
    for r in results:
        p, o = r["runs"]["pdsh"], r["runs"]["orch"]
        row = [f"{r['hosts']} x {r['procs']}", mark(p, "end"), mark(o, "end"),
               mark(o, "end") / mark(p, "end") if p and o else float("nan")]
        if compare:
            row.append(mark(r["runs"]["other"], "end"))
        rows.append(row)
    cols = ["hosts x ranks", "pdsh+torchrun", "orch up", "orch/pdsh"]
    if compare:
        cols.append(f"{compare.name} up")
    print_table("launch + tiny all-reduce, median seconds (lower is better)", cols, rows)
    for r in results:
        who = ["pdsh", "orch"] + (["other"] if compare else [])
        print_table(f"timeline, {r['hosts']} hosts x {r['procs']} ranks: median seconds from "
                    f"the command's start (load {r['load']:.1f})", ["mark", *who],
                    [[m, *(mark(r["runs"][w], m) for w in who)] for m in MARKS])
        o = r["runs"]["orch"]
        print(f"orch: first line -> ranks' first output {between(o, 'first line', 'rank seen'):.2f} s, "
              f"started -> ranks' first output {between(o, 'started', 'rank seen'):.2f} s; "
              f"pdsh + torchrun: start -> ranks' first output "
              f"{mark(r['runs']['pdsh'], 'rank seen'):.2f} s")
        for side in ("pdsh", "orch"):
            w = r["runs"][side]
            print(f"{side}: the end: last rank's last line -> torchrun exited "
                  f"{between(w, 'rank ends', 'torchrun'):.2f} s -> returned "
                  f"{between(w, 'torchrun', 'end'):.2f} s (last line -> returned "
                  f"{between(w, 'rank ends', 'end'):.2f} s)")


def between(runs: list[dict[str, float]], a: str, b: str) -> float:
    return median([r[b] - r[a] for r in runs if a in r and b in r])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[3])
    ap.add_argument("--procs", type=int, default=2, help="ranks per host")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compare", type=Path, metavar="DIR",
                    help="also time the orch of this other checkout, interleaved")
    args = ap.parse_args()
    with fake_cluster(max(args.hosts)) as cluster:
        workdir = cluster.root.parent / "work"
        results = [bench_hosts(cluster, n, args.procs, args.reps, workdir, args.compare)
                   for n in args.hosts]
    report(results, args.compare)
    print(f"raw samples: {save_json('launch.json', results)}")


if __name__ == "__main__":
    main()
