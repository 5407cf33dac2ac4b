"""Where the controller's CPU goes at scale: `orch up --detach`, `status` and `stop` on N
wide fake hosts (bench/fleet.py's bed), each profiled in its own process.

Each command runs in-process (`cli.cli`) with every thread under cProfile (the profiles
merged), and each thread's own user and system CPU and context switches (its wake-ups:
/proc/thread-self/stat and status, read as it ends) summed by kind (the thread's class
and name, numbers dropped). Prints per command: the process's CPU, the threads by kind,
and the functions with the most cumulative and own time.

    .venv/bin/python bench/fleet_profile.py --hosts 300 [--top 25] [--trees OLD .]
        [--hold 30 [--keepalive-hosts 1000]]   (an idle session's wake-ups by thread kind)
    FLEET_BARE=1 ...   each thread kind's CPU without the profiler (which costs more in
        Python-heavy threads than in those that wait on sockets: its shares mislead)
    FLEET_WAITS=1 ...  also every Event.wait and Condition.wait counted by caller and timeout
    FLEET_DUMP=FILE ...   the merged profile, for pstats
    FLEET_PERF=FILE ...   the command under `perf record` too (FILE.up, ...: `perf report -i`)
    FLEET_GC_TYPES=1 ...  at each full garbage collection, what the heap holds, by type
    (every run prints the garbage collector's runs and wall time by generation)
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
from collections import Counter, defaultdict
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
from scale import HELLO, SLEEPER, wait_started

TICK = os.sysconf("SC_CLK_TCK")


def thread_cost() -> tuple[float, float, float, int, int]:
    """This thread's (CPU s, user s, system s, voluntary, involuntary context switches).
    The CPU is the kernel's exact count (CLOCK_THREAD_CPUTIME_ID); user and system are in
    clock ticks (10 ms), so a short thread's show 0 and only their sums over many mean much."""
    stat = Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()
    status = Path("/proc/thread-self/status").read_text()
    vol = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    inv = int(re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    return time.thread_time(), int(stat[11]) / TICK, int(stat[12]) / TICK, vol, inv


def kind_of(t: threading.Thread) -> str:
    return f"{type(t).__name__}:{re.sub(r'[0-9]+', '#', t.name)}"


def gc_time() -> dict[int, list[float]]:
    """The cyclic garbage collector's runs and their wall time, by generation."""
    import gc
    out: dict[int, list[float]] = defaultdict(lambda: [0, 0.0])
    began: list[float] = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            if info["generation"] == 2 and os.environ.get("FLEET_GC_TYPES"):
                kinds = Counter(type(o).__qualname__ for o in gc.get_objects())
                print(f"gen2 collection: {sum(kinds.values())} objects: " + ", ".join(
                    f"{k} {n}" for k, n in kinds.most_common(12)), flush=True)
            began[0] = time.perf_counter()
        else:
            out[info["generation"]][0] += 1
            out[info["generation"]][1] += time.perf_counter() - began[0]
    gc.callbacks.append(timed)
    return out


def count_waits() -> Counter[tuple[str, object]]:
    """Every Event.wait and Condition.wait of the run counted by its caller (the first
    frame outside threading.py) and timeout: who polls, and how often."""
    counts: Counter[tuple[str, object]] = Counter()
    lock = threading.Lock()

    def counted(real: Callable[..., bool]) -> Callable[..., bool]:
        def wait(self: object, timeout: float | None = None) -> bool:
            f = sys._getframe(1)
            while f.f_code.co_filename == threading.__file__:
                f = f.f_back   # type: ignore[assignment]
            key = (f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno}", timeout)
            with lock:
                counts[key] += 1
            return real(self, timeout)
        return wait
    threading.Event.wait = counted(threading.Event.wait)   # type: ignore[method-assign]
    threading.Condition.wait = counted(threading.Condition.wait)   # type: ignore[method-assign]
    return counts


def one(verb: str, inventory: str, top: int) -> None:
    """Run one orch command in this process with every thread profiled; print the figures."""
    profiles: list[cProfile.Profile] = []
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0, 0])
    lock = threading.Lock()
    inner = threading.Thread._bootstrap_inner   # type: ignore[attr-defined]

    bare = bool(os.environ.get("FLEET_BARE"))   # threads' CPU by kind, no profiler
    waits = count_waits() if os.environ.get("FLEET_WAITS") else None
    collected = gc_time()

    def profiled(kind: Callable[[], str], run: Callable[[], object]) -> None:
        p = cProfile.Profile(time.thread_time)   # CPU, not the waits
        if not bare:
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
    if not bare:
        main.enable()
    detach = ["--detach"] if verb == "up" and not os.environ.get("FLEET_ATTACHED") else []
    code = cli([verb, *detach, "-c", inventory])
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
    print("threads by kind: count, CPU s (exact), user s, sys s (in ticks), voluntary, "
          "involuntary switches")
    for name, k in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:50s} {k[0]:5d} {k[1]:7.3f} {k[2]:7.2f} {k[3]:7.2f} {k[4]:9d} {k[5]:8d}")
    print("garbage collections by generation: count, seconds: " + ", ".join(
        f"gen{g} {n} {t:.3f}" for g, (n, t) in sorted(collected.items())))
    if waits is not None:
        print("waits by caller (Event.wait and Condition.wait): calls, timeout")
        for (where, timeout), n in waits.most_common(20):
            print(f"  {n:8d}  {timeout!s:>6}  {where}")
    if bare:
        sys.stdout.flush()
        os._exit(0)
    out = io.StringIO()
    pstats.Stats(main, stream=out).sort_stats("tottime").print_stats(top)
    print("main thread alone:" + out.getvalue().split("   ncalls", 1)[-1].join(["\n   ncalls", ""]))
    stats = pstats.Stats(main)
    for p in profiles:
        stats.add(p)
    if os.environ.get("FLEET_DUMP"):   # for pstats afterwards: callers, callees
        stats.dump_stats(os.environ["FLEET_DUMP"])
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        stats.stream = out   # type: ignore[attr-defined]
        stats.sort_stats(order).print_stats(top)
        print(out.getvalue().split("   ncalls", 1)[-1].join(["   ncalls", ""])
              if "   ncalls" in out.getvalue() else out.getvalue())
    sys.stdout.flush()
    os._exit(0)


def _threads() -> dict[str, list[int]]:
    """Each live thread kind's [count, voluntary context switches so far]."""
    kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for t in threading.enumerate():
        try:
            status = Path(f"/proc/self/task/{t.native_id}/status").read_text()
        except OSError:   # ended meanwhile
            continue
        vol = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M)
        k = kinds["fan-out" if isinstance(t, threading._DummyThread)   # type: ignore[attr-defined]
                  else kind_of(t)]
        k[0] += 1
        k[1] += int(vol.group(1)) if vol else 0
    return kinds


def hold(inventory: str, seconds: float) -> None:
    """An open session left idle for `seconds`: what each thread kind costs while nothing
    happens (the transports' keepalive wakes; the link readers wait on their channels).
    FLEET_KEEPALIVE_HOSTS=N: each connection's keepalive period as with N hosts."""
    from orchestrator.config.inventory import load
    from orchestrator.session.session import Session
    from orchestrator.wire import timeouts
    as_hosts = int(os.environ.get("FLEET_KEEPALIVE_HOSTS") or 0)
    if as_hosts and hasattr(timeouts, "keepalive"):
        period = timeouts.keepalive(as_hosts)
        timeouts.keepalive = lambda hosts: period   # type: ignore[attr-defined]
    cluster = load(inventory)
    session = Session(cluster).open()
    try:
        time.sleep(3)   # the logins' last packets
        before, r0 = _threads(), resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(seconds)
        after, r1 = _threads(), resource.getrusage(resource.RUSAGE_SELF)
    finally:
        session.close()
    hosts = len(session.links)
    print(f"### hold {seconds:g} s, {hosts} hosts open (keepalive as with "
          f"{as_hosts or len(cluster.hosts)}): cpu {r1.ru_utime - r0.ru_utime:.3f} user + "
          f"{r1.ru_stime - r0.ru_stime:.3f} sys, wake-ups {r1.ru_nvcsw - r0.ru_nvcsw} "
          f"voluntary + {r1.ru_nivcsw - r0.ru_nivcsw} involuntary")
    print("threads by kind: count, voluntary switches in the hold, per thread a second")
    for name, (count, vol) in sorted(after.items(), key=lambda kv: -kv[1][1]):
        woke = vol - before.get(name, [0, 0])[1]
        print(f"  {name:50s} {count:5d} {woke:9d} {woke / max(1, count) / seconds:8.3f}")
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
    ap.add_argument("--hold", type=float, default=0, metavar="S",
                    help="also hold an idle session open for S seconds: each thread kind's "
                         "wake-ups (after `up`, before `status`)")
    ap.add_argument("--attached", action="store_true",
                    help="`orch up` followed to its end (a one-line job), not --detach")
    ap.add_argument("--keepalive-hosts", type=int, default=0, metavar="N",
                    help="in --hold: each connection's keepalive period as with N hosts")
    if sys.argv[1:2] == ["one"]:
        one(sys.argv[2], sys.argv[3], int(os.environ.get("FLEET_TOP", "25")))
    if sys.argv[1:2] == ["hold"]:
        hold(sys.argv[3], float(sys.argv[2]))
    args = ap.parse_args()
    compile_orch()
    with bed_cluster(args.hosts, [args.shell], wide=True) as beds:
        sh = beds.shells[args.shell]
        work = beds.cluster.root.parent / "work"
        bed = Bed(beds.cluster, beds.cluster.hosts, sh, beds.python, work,
                  remote_base(beds.cluster, sh) / "prof", ssh=dict(SSH))
        inv = bed.inventory("prof", HELLO if args.attached else SLEEPER)
        for tree, switch in [(t, w) for t in args.trees for w in args.switch]:
            print(f"\n##### orchestrator from {tree}, switch interval {switch or 'default'}",
                  flush=True)
            env = dict(orch_env(), FLEET_TOP=str(args.top), PYTHONPATH=str(tree),
                       FLEET_SWITCH=switch, FLEET_ATTACHED="1" if args.attached else "")
            for verb in ("up",) if args.attached else ("up", "status", "stop"):
                print(f"load {' '.join(f'{v:.1f}' for v in os.getloadavg())}", flush=True)
                if args.plain:   # the `orch` command as a user runs it, its cost by wait4
                    detach = ["--detach"] if verb == "up" and not args.attached else []
                    o, c = measured([str(ORCH), verb, *detach,
                                     "-c", str(inv)], env=env, cwd=inv.parent)
                    print(f"### {verb}: exit {c.code}, {c.seconds:.2f} s, cpu {c.user:.2f} user"
                          f" + {c.system:.2f} sys, rss {c.rss_mib:.0f} MiB, {c.threads} "
                          f"threads, {c.fds} fds", flush=True)
                    if not o.ok:
                        print(o.tail(600))
                    continue
                perf = os.environ.get("FLEET_PERF")   # a perf record of the command too
                wrap = ["perf", "record", "-g", "-F", "499", "-o", f"{perf}.{verb}", "--"] if perf else []
                subprocess.run([*wrap, str(VENV_PY), __file__, "one", verb, str(inv)], env=env,
                               cwd=inv.parent, check=False)
                if verb == "up" and not args.attached and not wait_started(bed, timeout=300):
                    print("not every rank started")
                if verb == "up" and args.hold:
                    print(f"load {' '.join(f'{v:.1f}' for v in os.getloadavg())}", flush=True)
                    subprocess.run([str(VENV_PY), __file__, "hold", str(args.hold), str(inv)],
                                   env=dict(env, FLEET_KEEPALIVE_HOSTS=str(args.keepalive_hosts)),
                                   cwd=inv.parent, check=False)
            kill_pids(bed.left_over())


if __name__ == "__main__":
    main()
