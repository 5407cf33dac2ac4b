"""Launch latency: `orch up` against the pdsh + torchrun baseline on 1, 2, 4 fake hosts.

Both launch the same 1-process-per-host gloo all-reduce (bench/jobs/allreduce.py) on the
same sshd hosts and wait for it to end. Runs are interleaved (pdsh, orch, pdsh, orch...)
so that the noise of this shared machine hits both alike; the figure is the median.

    .venv/bin/python bench/launch.py [--hosts 1 2 4] [--reps 3] [--compare DIR]

--compare DIR also times the orch of another checkout (e.g. `git archive` of an older
commit unpacked in DIR) in the same interleaved loop, so both see the same noise.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from common import (
    ORCH,
    REPO,
    VENV_PY,
    Run,
    SshdCluster,
    clean_env,
    fake_cluster,
    free_port,
    median,
    pdsh_env,
    print_table,
    save_json,
    timed_run,
)

JOB = REPO / "bench" / "jobs" / "allreduce.py"
MASTER = "127.0.0.2"


def pdsh_setup(cluster: SshdCluster, hosts: list) -> dict[str, Path]:
    """Copy the job to every host's dir, outside the timing (as a user would beforehand)."""
    dirs = {}
    for h in hosts:
        d = h.home / "pdsh"
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(JOB, d / JOB.name)
        dirs[h.address] = d
    return dirs


def pdsh_command(cluster: SshdCluster, dirs: dict[str, Path], port: int) -> list[str]:
    """What a run_dist.sh writer would do: one pdsh, node rank and dir picked per host."""
    n = len(dirs)
    cases = " ".join(f"{addr}) R={i}; D={d};;" for i, (addr, d) in enumerate(dirs.items()))
    remote = (f"case %h in {cases} esac; cd $D && {VENV_PY} -m torch.distributed.run "
              f"--nnodes {n} --node-rank $R --nproc-per-node 1 "
              f"--master-addr {MASTER} --master-port {port} {JOB.name}")
    return ["pdsh", "-R", "ssh", "-f", "64", "-w", ",".join(dirs), remote]


def run_pdsh(cluster: SshdCluster, dirs: dict[str, Path]) -> Run:
    port = free_port([MASTER], 29500, 29900)
    return timed_run(pdsh_command(cluster, dirs, port), env=pdsh_env(cluster), timeout=300)


def orch_setup(cluster: SshdCluster, hosts: list, workdir: Path, name: str = "allreduce") -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(JOB, workdir / JOB.name)
    return cluster.write_inventory(workdir / "cluster.yaml", hosts=hosts,
                                   name=f"{name}-n{len(hosts)}", entrypoint=JOB.name,
                                   code_paths=[JOB.name])


def orch_argv() -> tuple[list[str], dict]:
    """The installed `orch`, or the source tree's module before `make install`."""
    if ORCH.exists():
        return [str(ORCH)], clean_env()
    return [str(VENV_PY), "-m", "orchestrator"], clean_env(PYTHONPATH=str(REPO))


def run_orch(inventory: Path, repo: Path | None = None) -> Run:
    argv, env = orch_argv()
    if repo is not None:   # another checkout's orch, with this venv's packages
        argv, env = [str(VENV_PY), "-m", "orchestrator"], clean_env(PYTHONPATH=str(repo))
    return timed_run([*argv, "up", str(inventory)], env=env, cwd=inventory.parent, timeout=300)


def job_ok(run: Run, world: int) -> bool:
    """Exit 0 and rank 0 printed the right sum: the job really ran everywhere."""
    want = f"allreduce sum={4 * world} expected={4 * world}"
    return run.ok and want in run.stdout + run.stderr  # orch prefixes lines; either stream


def bench_hosts(cluster: SshdCluster, n: int, reps: int, workdir: Path,
                compare: Path | None = None) -> dict:
    hosts = cluster.hosts[:n]
    dirs = pdsh_setup(cluster, hosts)
    inventory = orch_setup(cluster, hosts, workdir / f"orch-n{n}")
    # a job name of its own: the two orch versions never share a job folder
    other = orch_setup(cluster, hosts, workdir / f"other-n{n}", "other") if compare else None
    pdsh_s, orch_s, other_s, orch_err = [], [], [], ""
    for rep in range(reps):
        p = run_pdsh(cluster, dirs)
        if not job_ok(p, n):
            sys.exit(f"baseline failed on {n} hosts (exit {p.returncode}): {p.tail()}")
        pdsh_s.append(p.seconds)
        o = run_orch(inventory)
        if job_ok(o, n):
            orch_s.append(o.seconds)
        else:
            orch_err = f"exit {o.returncode}: {o.tail()}"
            print(f"orch failed: {orch_err}", file=sys.stderr)
        line = f"  n={n} rep={rep + 1}: pdsh {p.seconds:.2f} s, orch " + (
            f"{o.seconds:.2f} s" if job_ok(o, n) else "failed")
        if other is not None:
            c = run_orch(other, compare)
            if job_ok(c, n):
                other_s.append(c.seconds)
            line += f", {compare.name} " + (f"{c.seconds:.2f} s" if job_ok(c, n) else "failed")  # type: ignore[union-attr]  # set with other
        print(line, flush=True)
    return {"hosts": n, "pdsh_s": pdsh_s, "orch_s": orch_s, "other_s": other_s,
            "orch_error": orch_err}


def report(results: list[dict], compare: Path | None = None) -> None:
    rows = []
    for r in results:
        p, o = median(r["pdsh_s"]), median(r["orch_s"])
        row = [r["hosts"], p, o, o / p if r["orch_s"] else float("nan"), o - p]
        if compare:
            c = median(r["other_s"])
            row += [c, c / p if r["other_s"] else float("nan")]
        rows.append(row)
    cols = ["hosts", "pdsh+torchrun", "orch up", "orch/pdsh", "orch-pdsh"]
    if compare:
        cols += [f"{compare.name} up", f"{compare.name}/pdsh"]
    print_table("launch + tiny all-reduce, median seconds (lower is better)", cols, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compare", type=Path, metavar="DIR",
                    help="also time the orch of this other checkout, interleaved")
    args = ap.parse_args()
    with fake_cluster(max(args.hosts)) as cluster:
        workdir = cluster.root.parent / "work"
        results = [bench_hosts(cluster, n, args.reps, workdir, args.compare) for n in args.hosts]
    report(results, args.compare)
    print(f"raw samples: {save_json('launch.json', results)}")


if __name__ == "__main__":
    main()
