"""Scale: orch against pdsh + torchrun on 16, 64 and 128 fake sshd hosts, in the same run.

One sshd per loopback address (tests/sshd_cluster.py); each host count is a prefix of
the same cluster. Two login shells:

- root: root's own login shell as it is (bash; its .bashrc runs `pyenv init` on every
  remote command, ~100 ms of CPU each);
- plain: the user `orchbench` (created if missing, login shell /bin/sh, the cluster's
  client key added to its ~/.ssh/authorized_keys and removed again at the end).

Real torch at 16 hosts (`orch up` of bench/jobs/allreduce.py, a gloo all-reduce). At 64
and 128 hosts, and for status/stop/rank death everywhere, a STAND-IN torchrun
(bench/torchrun_standin.py: torchrun's arguments and environment, a rendezvous at the
master, nproc children, the worst exit code) is put in front of the hosts' python by a
wrapper script (the inventory's `python:` and the baseline's command both use it), so that
the figures are the launchers' cost rather than 128 torch imports on 2 cores.

Measures per host count and shell, interleaved (baseline, orch, baseline, orch...):
  up      `orch up` to the job's end        vs  pdsh -R ssh -f N ... python -m torch.distributed.run ...
  status  `orch status` of a running job    vs  pdsh -w ... true
  stop    `orch stop` to verified empty     vs  pdsh -w ... true, and pdsh pkill of a sleeper per host
  death   one rank exits 1: seconds from its exit until `orch up` returned, every host stopped
  and the controller's peak RSS (VmHWM) and most threads during `orch up`.

    .venv/bin/python bench/scale.py [--series root:16 root:64 plain:128] [--reps 3]

Every sshd, job process and file it made is gone at the end (checked and printed).
"""
from __future__ import annotations

import argparse
import os
import pwd
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import cpuacct
from common import (
    ORCH,
    VENV_PY,
    Bed,
    Beds,
    Run,
    Shell,
    bed_cluster,
    compile_orch,
    free_port,
    kill_pids,
    markdown,
    median,
    orch_env,
    pdsh_env,
    remote_base,
    save_json,
    scan_marked,
)

BENCH = Path(__file__).resolve().parent
ALLREDUCE = BENCH / "jobs" / "allreduce.py"
FIRST_OCTET = 2
TARGETS = {("root", 64, "up"): 1.0, ("plain", 128, "up"): 1.0,
           ("plain", 128, "status"): 1.2, ("plain", 128, "stop"): 1.2}
HELLO = 'import os\nprint("scale-ok rank=%s world=%s" % (os.environ["RANK"], os.environ["WORLD_SIZE"]), flush=True)\n'
SLEEPER = 'import time\nprint("started", flush=True)\ntime.sleep(600)\n'
CRASH = """\
import os, time
print("started", flush=True)
if os.environ["RANK"] == "1":
    time.sleep(1)
    print("crash_at", repr(time.time()), flush=True)
    os._exit(1)
time.sleep(600)
"""


# ---------------------------------------------------------------- running things


LAST_PID = [0]   # the last command's pid (its process accounting records)
COUNT_CPU = [False]


def timed_probe(cmd: list[str], *, env: dict, cwd: Path, timeout: float = 600) -> tuple[Run, float, float]:
    """Run cmd, timing it and polling its /proc status: (run, peak RSS MiB, most threads)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    LAST_PID[0] = proc.pid
    peak = {"rss": 0.0, "threads": 0}
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            rss, threads = proc_status(proc.pid)
            peak["rss"], peak["threads"] = max(peak["rss"], rss), max(peak["threads"], threads)
            stop.wait(0.05)
    th = threading.Thread(target=poll, daemon=True)
    th.start()
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        code, err = 124, err + f"\ntimed out after {timeout:.0f} s"
    seconds = time.perf_counter() - t0
    stop.set()
    th.join()
    return Run(seconds, code, out, err), peak["rss"], peak["threads"]


def proc_status(pid: int) -> tuple[float, int]:
    """(VmHWM in MiB, Threads) of a live pid; zeros once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0, 0
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    hwm = fields.get("VmHWM", "0 kB").split()[0]
    return int(hwm) / 1024, int(fields.get("Threads", "0").strip() or 0)


def run(cmd: list[str], *, env: dict, cwd: Path | None = None, timeout: float = 600) -> Run:
    return timed_probe(cmd, env=env, cwd=cwd or Path.cwd(), timeout=timeout)[0]


def orch(bed: Bed, verb: str, inventory: Path, *extra: str,
         env: dict | None = None) -> tuple[Run, float, float]:
    return timed_probe([str(ORCH), verb, *extra, "-c", str(inventory)],
                       env=dict(orch_env(), **(env or {})), cwd=inventory.parent)


def pdsh(bed: Bed, remote: str, timeout: float = 600) -> Run:
    """pdsh over ssh to every host of the bed at once (-f N), as the bed's user."""
    return run(bed.pdsh_argv(remote), env=pdsh_env(bed.cluster), timeout=timeout)


# ---------------------------------------------------------------- jobs and inventories

def job_ok(bed: Bed, r: Run) -> bool:
    text = r.stdout + r.stderr
    if bed.real_torch:
        return r.ok and f"allreduce sum={4 * bed.n} expected={4 * bed.n}" in text
    return r.ok and len(set(re.findall(r"scale-ok rank=(\d+)", text))) == bed.n


def wait_started(bed: Bed, timeout: float = 180) -> bool:
    """Every rank printed `started` (rank r runs on host r)."""
    deadline = time.monotonic() + timeout
    logs = [Path(d) / "logs" / f"rank-{r}.log" for r, d in enumerate(bed.dirs)]
    while time.monotonic() < deadline:
        if all(p.exists() and b"started" in p.read_bytes() for p in logs):
            return True
        time.sleep(0.2)
    return False


# ---------------------------------------------------------------- the measures

@dataclass
class Series:
    shell: str
    n: int
    torch: str
    samples: dict = field(default_factory=dict)   # measure -> {"orch": [...], "base": [...]}
    cpu: dict = field(default_factory=dict)       # "orch"/"base" -> [{kind: [cpu s, ...]}]
    notes: list = field(default_factory=list)
    rss_mib: float = 0.0
    threads: int = 0

    def add(self, measure: str, who: str, value: float) -> None:
        self.samples.setdefault(measure, {}).setdefault(who, []).append(value)

    def fail(self, what: str, r: Run) -> None:
        note = f"{what} failed (exit {r.returncode}): {r.tail(600)}"
        self.notes.append(note)
        print(f"  ! {note}", flush=True)


@contextmanager
def counted(bed: Bed, s: Series, who: str) -> Iterator[None]:
    """With --cpu (plain shell only: its uid tells the hosts' processes from the
    machine's others), the command's CPU seconds per process kind (bench/cpuacct.py)."""
    if not COUNT_CPU[0] or bed.shell.user == "root":
        yield
        return
    with cpuacct.Accounting() as acct:
        yield
    sshds = {h.pid for h in bed.hosts}
    k = cpuacct.kinds(acct.records, sshds, pwd.getpwnam(bed.shell.user).pw_uid, LAST_PID[0],
                      "orch" if who == "orch" else "pdsh")
    s.cpu.setdefault(who, []).append(k)
    print(f"  cpu {who}: " + ", ".join(f"{name} {n} x {c:.2f} s"
                                       for name, n, c in cpuacct.summary(k)), flush=True)


def count_ssh_true(bed: Bed, s: Series) -> None:
    """--cpu: what one `ssh host true` per host costs, counted as `up` is (the yardstick
    for orch's own processes per host)."""
    with counted(bed, s, "ssh true"):
        t = pdsh(bed, "true")
    if not t.ok:
        s.fail("pdsh true", t)


def median_kinds(ks: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """The repetition whose host-side total is the median one."""
    def total(k: dict[str, list[float]]) -> float:
        return sum(sum(v) for name, v in k.items() if name != "controller")
    ordered = sorted(ks, key=total)
    return ordered[len(ordered) // 2]


IMPORT_DELAY = [0.0]   # --import-delay: the stand-in torch's import, in seconds of latency


def measure_up(bed: Bed, s: Series, reps: int, clock: Clock) -> None:
    source = ALLREDUCE if bed.real_torch else HELLO
    delay = IMPORT_DELAY[0] if not bed.real_torch else 0.0
    env = {"BENCH_TORCH_IMPORT_DELAY": f"{delay:g}"} if delay else None
    inv, d = bed.inventory(f"up{bed.n}", source, env), bed.pdsh_dir(source)
    for rep in range(reps):
        if rep and clock.over():
            break
        port = free_port([bed.hosts[0].address], 29500, 29900)
        with counted(bed, s, "base"):
            p = pdsh(bed, bed.torchrun_remote(d, port, f"BENCH_TORCH_IMPORT_DELAY={delay:g}"
                                              if delay else ""))
        if job_ok(bed, p):
            s.add("up", "base", p.seconds)
        else:
            s.fail("baseline up", p)
        with counted(bed, s, "orch"):
            o, rss, threads = orch(bed, "up", inv)
        s.rss_mib, s.threads = max(s.rss_mib, rss), max(s.threads, int(threads))
        if job_ok(bed, o):
            s.add("up", "orch", o.seconds)
        else:
            s.fail("orch up", o)
        if COUNT_CPU[0]:
            count_ssh_true(bed, s)
        print(f"  up rep {rep + 1}: pdsh {p.seconds:.2f} s, orch {o.seconds:.2f} s "
              f"(rss {rss:.0f} MiB, {threads} threads)", flush=True)
        if delay:   # the same with torchrun started cold (after every host's preflight)
            c, _, _ = orch(bed, "up", inv, env={"ORCH_WARM_START": "0"})
            if job_ok(bed, c):
                s.add("up-cold", "orch", c.seconds)
                s.add("up-cold", "base", p.seconds)
            else:
                s.fail("orch up (ORCH_WARM_START=0)", c)
            print(f"  up rep {rep + 1}, warm start off: orch {c.seconds:.2f} s", flush=True)


def start_detached(bed: Bed, s: Series, inv: Path) -> bool:
    o, _, _ = orch(bed, "up", inv, "--detach")
    if not o.ok:
        s.fail("orch up --detach", o)
        return False
    if not wait_started(bed):
        s.notes.append("the sleeper job did not start on every host")
        return False
    return True


def measure_status_stop(bed: Bed, s: Series, reps: int, clock: Clock) -> None:
    inv = bed.inventory(f"sleep{bed.n}", SLEEPER)
    if not start_detached(bed, s, inv):
        return
    for rep in range(reps):
        if rep and clock.over():
            break
        t = pdsh(bed, "true")
        s.add("status", "base", t.seconds) if t.ok else s.fail("pdsh true", t)
        o, _, _ = orch(bed, "status", inv)
        s.add("status", "orch", o.seconds) if o.ok else s.fail("orch status", o)
        print(f"  status rep {rep + 1}: pdsh true {t.seconds:.2f} s, orch {o.seconds:.2f} s",
              flush=True)
    for rep in range(reps):
        if rep and (clock.over() or not start_detached(bed, s, inv)):
            break
        t = pdsh(bed, "true")
        s.add("stop", "base", t.seconds) if t.ok else s.fail("pdsh true", t)
        o, _, _ = orch(bed, "stop", inv)
        left = bed.left_over()
        if o.ok and not left:
            s.add("stop", "orch", o.seconds)
        else:
            s.fail(f"orch stop (left {len(left)} processes)", o)
            kill_pids(left)
        k = pdsh_pkill(bed, s)
        print(f"  stop rep {rep + 1}: pdsh true {t.seconds:.2f} s, orch {o.seconds:.2f} s "
              f"(verified empty: {not left}), pdsh pkill {k:.2f} s", flush=True)


def pdsh_pkill(bed: Bed, s: Series) -> float:
    """The naive stop: a sleeper per host started by pdsh, then `pdsh pkill -f` of it
    (no verification). The bracket keeps pkill from matching the shell that runs it."""
    tag = f"orchscale{os.getpid()}x{bed.n}"
    d = bed.pdsh_dir(SLEEPER)
    start = pdsh(bed, f"cd {d} && (setsid {bed.python} -c 'import time; time.sleep(600)' "
                      f"{tag}-%h-end </dev/null >/dev/null 2>&1 &)")
    deadline = time.monotonic() + 60
    while len(scan_marked([f"{tag}-"])) < bed.n and time.monotonic() < deadline:
        time.sleep(0.2)
    k = pdsh(bed, f"pkill -f '[{tag[0]}]{tag[1:]}-%h-end'")
    time.sleep(0.5)
    left = scan_marked([f"{tag}-"])
    if start.ok and k.ok and not left:
        s.add("stop", "pkill", k.seconds)
    else:
        s.fail(f"pdsh pkill (left {len(left)})", k if start.ok else start)
    kill_pids(left)
    return k.seconds


def measure_death(bed: Bed, s: Series, reps: int, clock: Clock) -> None:
    inv = bed.inventory(f"crash{bed.n}", CRASH)
    for rep in range(reps):
        if rep and clock.over():
            break
        o, _, _ = orch(bed, "up", inv)
        ended = time.time()
        left = bed.left_over()
        m = re.search(r"crash_at (\d+\.\d+)", o.stdout)
        if o.returncode == 1 and m and not left:
            s.add("death", "orch", ended - float(m.group(1)))
            print(f"  death rep {rep + 1}: every host stopped {ended - float(m.group(1)):.2f} s "
                  "after the rank's exit", flush=True)
        else:
            s.fail(f"orch up with a rank death (left {len(left)})", o)
            kill_pids(left)


class Clock:
    """The benchmark's time budget: later reps are skipped once it is spent."""

    def __init__(self, budget: float) -> None:
        self.t0, self.budget = time.monotonic(), budget

    def over(self) -> bool:
        return time.monotonic() - self.t0 > self.budget

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


# ---------------------------------------------------------------- report

def rows_of(s: Series) -> list[list]:
    rows = []
    for measure, base in (("up", "base"), ("up-cold", "base"), ("status", "base"),
                          ("stop", "base"), ("stop", "pkill"), ("death", None)):
        got = s.samples.get(measure, {})
        if not got:
            continue
        o = median(got.get("orch", []))
        b = median(got.get(base, [])) if base else float("nan")
        ratio = o / b if base and got.get("orch") and got.get(base) else float("nan")
        target = TARGETS.get((s.shell, s.n, measure)) if base == "base" else None
        met = "-" if target is None else ("yes" if ratio <= target else "NO")
        if target is not None and not got.get("orch"):
            met = "NO (failed)"
        torch = s.torch + (f", torch import {IMPORT_DELAY[0]:g} s" if IMPORT_DELAY[0]
                           and s.torch.startswith("stand-in") else "")
        what = {"up": f"up ({torch})", "up-cold": f"up, warm start off ({torch})",
                "status": "status", "stop": "stop", "death": "rank death -> all stopped"}[measure]
        bname = {"up": "pdsh+torchrun", "base": "pdsh true", "pkill": "pdsh pkill",
                 None: "-"}[base if not measure.startswith("up") else "up"]
        rows.append([s.n, s.shell, what, o, bname, b, ratio,
                     "-" if target is None else f"<= {target:g}", met])
    return rows


def report(series: list[Series], clock: Clock) -> None:
    rows = [r for s in series for r in rows_of(s)]
    print(f"\nscale: median seconds (load {os.getloadavg()[0]:.1f}, {clock.elapsed():.0f} s in all)")
    markdown(["hosts", "shell", "measure", "orch s", "baseline", "baseline s", "orch/baseline",
              "target", "met?"], rows)
    print("\ncontroller during `orch up`")
    markdown(["hosts", "shell", "peak RSS MiB", "threads"],
             [[s.n, s.shell, s.rss_mib, s.threads] for s in series])
    cpu_rows = [[s.n, s.shell, who, *row, float(row[2]) / s.n * 1000]  # type: ignore[arg-type]
                for s in series for who, ks in s.cpu.items()
                for row in cpuacct.summary(median_kinds(ks))]
    if cpu_rows:
        print(f"\nCPU seconds per `up` by process kind (process accounting, median of the reps; "
              f"load {os.getloadavg()[0]:.1f})")
        markdown(["hosts", "shell", "side", "kind", "processes", "CPU s", "ms per host"],
                 cpu_rows)
    for s in series:
        for note in s.notes:
            print(f"note ({s.shell}, {s.n} hosts): {note[:300]}")
    data = [{"shell": s.shell, "hosts": s.n, "torch": s.torch, "samples": s.samples,
             "rss_mib": s.rss_mib, "threads": s.threads, "notes": s.notes,
             "cpu": s.cpu} for s in series]
    print(f"raw samples: {save_json('scale.json', data)}")


# ---------------------------------------------------------------- main

def parse_series(specs: list[str]) -> list[tuple[str, int]]:
    out = []
    for spec in specs:
        shell, _, n = spec.partition(":")
        if shell not in ("root", "plain") or not n.isdigit():
            sys.exit(f"--series {spec}: write SHELL:HOSTS, SHELL root or plain (e.g. plain:128)")
        out.append((shell, int(n)))
    return out


def run_series(beds: Beds, shell: Shell, n: int, work: Path,
               args: argparse.Namespace, clock: Clock) -> Series:
    cluster, python = beds.cluster, beds.python
    # the plain shell too with --cpu: its counts are per host, whatever the load
    real = n <= args.real_torch_max and (shell.user == "root" or args.cpu)
    torch = "real torch" if real else "stand-in torchrun"
    print(f"\n== {n} hosts, {shell.name} shell ({shell.user}), {torch} "
          f"[{clock.elapsed():.0f} s]", flush=True)
    reps = args.reps if n < 128 else args.reps_big
    real_python = str(VENV_PY) if shell.user == "root" else beds.torch_python
    bed = Bed(cluster, cluster.hosts[:n], shell, real_python if real else python,
              work / f"{shell.name}{n}", remote_base(cluster, shell) / f"n{n}", real)
    s = Series(shell.name, n, torch)
    measure_up(bed, s, args.reps_real if real else reps, clock)
    if args.up_only:
        return s
    bed.python, bed.real_torch = python, False   # the rest runs on the stand-in
    measure_status_stop(bed, s, reps, clock)
    measure_death(bed, s, max(1, reps - 1), clock)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # the targets first: once the budget is spent, later series are skipped
    ap.add_argument("--series", nargs="+", default=["plain:128", "root:64", "root:16",
                                                    "root:128"],
                    metavar="SHELL:HOSTS", help="root or plain, and a host count")
    ap.add_argument("--reps", type=int, default=2, help="repetitions below 128 hosts")
    ap.add_argument("--reps-big", type=int, default=2, help="repetitions at 128 hosts and more")
    ap.add_argument("--reps-real", type=int, default=1,
                    help="repetitions of `up` with real torch (70 s each at 16 hosts here)")
    ap.add_argument("--real-torch-max", type=int, default=16,
                    help="real torch up to this many hosts (root shell), the stand-in above")
    ap.add_argument("--budget", type=float, default=600,
                    help="seconds; once spent, later reps and series are skipped")
    ap.add_argument("--cpu", action="store_true",
                    help="count CPU seconds per process kind of each `up` (plain shell series; "
                         "process accounting, root only)")
    ap.add_argument("--up-only", action="store_true", help="measure `up` only")
    ap.add_argument("--import-delay", type=float, default=0.0, metavar="S",
                    help="the stand-in torch's import takes S seconds (a sleep: the latency "
                         "of a host's own torch import, which on a real cluster every host "
                         "pays on its own CPU and disk); adds `up` with ORCH_WARM_START=0")
    args = ap.parse_args()
    COUNT_CPU[0] = args.cpu
    IMPORT_DELAY[0] = args.import_delay
    plan = parse_series(args.series)
    compile_orch()
    clock = Clock(args.budget)
    series: list[Series] = []
    with bed_cluster(max(n for _, n in plan), [sh for sh, _ in plan],
                     first_octet=FIRST_OCTET) as beds:
        work = beds.cluster.root.parent / "work"
        for shell_name, n in plan:
            if series and clock.over():
                print(f"\n(budget spent: {shell_name}:{n} skipped)")
                continue
            series.append(run_series(beds, beds.shells[shell_name], n, work, args, clock))
    report(series, clock)
    if not beds.clean:
        sys.exit(1)


if __name__ == "__main__":
    main()
