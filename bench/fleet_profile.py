"""Where the controller's CPU goes at scale: `orch up --detach`, `status` and `stop` on N
wide fake hosts (bench/fleet.py's bed), each profiled in its own process.

Each command runs in-process (`cli.cli`) with every thread under cProfile (the profiles
merged), and each thread's own user and system CPU and context switches (its wake-ups:
/proc/thread-self/stat and status, read as it ends) summed by kind (the thread's class
and name, numbers dropped). Prints per command: the process's CPU, the threads by kind,
and the functions with the most cumulative and own time.

    .venv/bin/python bench/fleet_profile.py --hosts 300 [--top 25] [--trees OLD .]
    .venv/bin/python bench/fleet_profile.py one VERB INVENTORY   (what each command runs)
"""
from __future__ import annotations

import _thread
import argparse
import cProfile
import io
import os
import pstats
import re
import resource
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

from common import (
    ORCH,
    REPO,
    VENV_PY,
    Bed,
    bed_cluster,
    compile_orch,
    kill_pids,
    orch_env,
    remote_base,
)
from fleet import SSH, measured
from scale import SLEEPER, wait_started

TICK = os.sysconf("SC_CLK_TCK")


def thread_cost() -> tuple[float, float, int, int]:
    """This thread's (user s, system s, voluntary, involuntary context switches)."""
    stat = Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()
    status = Path("/proc/thread-self/status").read_text()
    vol = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    inv = int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    return int(stat[11]) / TICK, int(stat[12]) / TICK, vol, inv


def kind_of(t: threading.Thread) -> str:
    return f"{type(t).__name__}:{re.sub(r'[0-9]+', '#', t.name)}"


def one(verb: str, inventory: str, top: int) -> None:
    """Run one orch command in this process with every thread profiled; print the figures."""
    profiles: list[cProfile.Profile] = []
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0, 0])
    lock = threading.Lock()
    inner = threading.Thread._bootstrap_inner   # type: ignore[attr-defined]

    def profiled(kind: Callable[[], str], run: Callable[[], object]) -> None:
        p = cProfile.Profile(time.thread_time)   # CPU, not the waits
        p.enable()
        try:
            run()
        finally:
            p.disable()
            cost = thread_cost()
            with lock:
                profiles.append(p)
                k = kinds[kind()]
                k[0] += 1
                for i, v in enumerate(cost):
                    k[i + 1] += v

    def bootstrap(self: threading.Thread) -> None:
        profiled(lambda: kind_of(self), lambda: inner(self))

    def start_new_thread(fn: Callable[..., object], args: tuple = (),
                         kwargs: dict | None = None) -> int:
        # remote/fanout starts its threads so (no Thread object): profiled as "fan-out"
        return start_raw(lambda: profiled(lambda: "fan-out", lambda: fn(*args, **(kwargs or {}))), ())
    threading.Thread._bootstrap_inner = bootstrap   # type: ignore[attr-defined]
    start_raw = _thread.start_new_thread
    _thread.start_new_thread = start_new_thread   # type: ignore[assignment]
    from orchestrator import cli as orch_cli  # as `orch` (cli.main) sets it, unless asked
    from orchestrator.cli import cli
    ours: float = getattr(orch_cli, "SWITCH_INTERVAL_S", 0.005)
    sys.setswitchinterval(float(os.environ.get("FLEET_SWITCH") or ours))
    main = cProfile.Profile(time.thread_time)
    t0 = time.perf_counter()
    main.enable()
    code = cli([verb, *(["--detach"] if verb == "up" else []), "-c", inventory])
    main.disable()
    wall = time.perf_counter() - t0
    kinds["main"] = [1, *thread_cost()]
    for t in threading.enumerate():   # threads still running: counted as they are now
        if t is not threading.main_thread():
            kinds[kind_of(t) + " (alive)"][0] += 1
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(f"### {verb}: exit {code}, {wall:.2f} s, cpu {r.ru_utime:.2f} user + "
          f"{r.ru_stime:.2f} sys, rss {r.ru_maxrss / 1024:.0f} MiB, "
          f"wake-ups {r.ru_nvcsw} voluntary + {r.ru_nivcsw} involuntary")
    print("threads by kind: count, user s, sys s, voluntary, involuntary switches")
    for name, k in sorted(kinds.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        print(f"  {name:50s} {k[0]:5d} {k[1]:7.2f} {k[2]:7.2f} {k[3]:9d} {k[4]:8d}")
    out = io.StringIO()
    pstats.Stats(main, stream=out).sort_stats("tottime").print_stats(top)
    print("main thread alone:" + out.getvalue().split("   ncalls", 1)[-1].join(["\n   ncalls", ""]))
    stats = pstats.Stats(main)
    for p in profiles:
        stats.add(p)
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        stats.stream = out   # type: ignore[attr-defined]
        stats.sort_stats(order).print_stats(top)
        print(out.getvalue().split("   ncalls", 1)[-1].join(["   ncalls", ""])
              if "   ncalls" in out.getvalue() else out.getvalue())
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--shell", default="plain", choices=["plain", "root"])
    ap.add_argument("--trees", nargs="+", type=Path, default=[REPO], metavar="DIR",
                    help="folders holding an orchestrator/ to compare (each put first on "
                         "PYTHONPATH), profiled one after the other on the same hosts")
    ap.add_argument("--plain", action="store_true",
                    help="no profiler: each `orch` command's CPU, RSS, threads, fds (wait4)")
    ap.add_argument("--switch", nargs="+", default=[""], metavar="S",
                    help="sys.setswitchinterval values to compare ('': what `orch` sets)")
    if sys.argv[1:2] == ["one"]:
        one(sys.argv[2], sys.argv[3], int(os.environ.get("FLEET_TOP", "25")))
    args = ap.parse_args()
    compile_orch()
    with bed_cluster(args.hosts, [args.shell], wide=True) as beds:
        sh = beds.shells[args.shell]
        work = beds.cluster.root.parent / "work"
        bed = Bed(beds.cluster, beds.cluster.hosts, sh, beds.python, work,
                  remote_base(beds.cluster, sh) / "prof", ssh=dict(SSH))
        inv = bed.inventory("prof", SLEEPER)
        for tree, switch in [(t, w) for t in args.trees for w in args.switch]:
            print(f"\n##### orchestrator from {tree}, switch interval {switch or 'default'}",
                  flush=True)
            env = dict(orch_env(), FLEET_TOP=str(args.top), PYTHONPATH=str(tree),
                       FLEET_SWITCH=switch)
            for verb in ("up", "status", "stop"):
                print(f"load {' '.join(f'{v:.1f}' for v in os.getloadavg())}", flush=True)
                if args.plain:   # the `orch` command as a user runs it, its cost by wait4
                    o, c = measured([str(ORCH), verb, *(["--detach"] if verb == "up" else []),
                                     "-c", str(inv)], env=env, cwd=inv.parent)
                    print(f"### {verb}: exit {c.code}, {c.seconds:.2f} s, cpu {c.user:.2f} user"
                          f" + {c.system:.2f} sys, rss {c.rss_mib:.0f} MiB, {c.threads} "
                          f"threads, {c.fds} fds", flush=True)
                    if not o.ok:
                        print(o.tail(600))
                    continue
                subprocess.run([str(VENV_PY), __file__, "one", verb, str(inv)], env=env,
                               cwd=inv.parent, check=False)
                if verb == "up" and not wait_started(bed, timeout=300):
                    print("not every rank started")
            kill_pids(bed.left_over())


if __name__ == "__main__":
    main()
