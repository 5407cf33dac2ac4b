"""Fleet: orch at 64, 300 and 1,000 hosts against pdsh + torchrun, with the controller's cost.

bench/scale.py's sibling for host counts past one /24: one sshd per loopback address from
127.0.1.1 on (250 to a /24: 1,000 hosts are 127.0.1.1-127.0.4.250, common.wide_address),
the plain login user (`orchbench`, /bin/sh) and/or root's own shell, the stand-in torchrun
(bench/torchrun_standin.py, run straight from its venv, a rendezvous at the master that
blocks while it waits) behind both orch and the baseline. The controller runs under the
open-file limit of a default login session (soft 1,024: `--nofile`; orch raises its soft
limit to the hard one, and says so when even that is too low).

Per host count and shell, each orch command is timed and its controller measured: wall
seconds; CPU user and system seconds (wait4's rusage of the `orch` process: its threads
all counted, exact whatever the machine's load); peak RSS (ru_maxrss); the most threads and
open descriptors seen (/proc, every 0.1 s):

  up        `orch up` of a one-line job, to its end   vs  pdsh -f N + torchrun
  status    `orch status` of a running job            vs  pdsh -f N true
  logs      `orch logs --rank 0` of it                 (no baseline)
  stop      `orch stop`, every process checked gone   vs  pdsh -f N true
  failfast  `orch up` of a job whose rank 1 exits 3 s after starting: seconds from that
            exit to orch's line that every host is stopped (verified; of it, orch's own
            count from its decision to stop, on that line), and to orch's
            end (the curves' last round, rank 0's pull, every agent closed; the whole
            up's wall and CPU beside it)
  failfast-running  the same, rank 1 exiting 3 s after every rank started (a crash in
            a running job, not amid 1,000 ranks starting on 2 cores)

    .venv/bin/python bench/fleet.py --hosts 64 300 [--shells plain root] [--reps 1]
        [--measures up running failfast failfast-running]

Every sshd, job process and file it made is gone at the end (checked and printed).
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import hostmem
from common import (
    ORCH,
    Bed,
    Beds,
    Run,
    bed_cluster,
    compile_orch,
    free_port,
    kill_pids,
    markdown,
    median,
    orch_env,
    pdsh_env,
    prepare_remote,
    remote_base,
    save_json,
)
from scale import HELLO, SLEEPER, job_ok, wait_started

CRASH = """\
import os, time
print("started", flush=True)
if os.environ["RANK"] == "1":
    time.sleep(3)
    print("crash_at", repr(time.time()), flush=True)
    os._exit(1)
time.sleep(600)
"""

# fail-fast in a running job: every rank marks its start in a folder all the fake hosts
# see; rank 1 exits 3 s after the last rank started (the job is up on every host, as a
# crash in training is), not while 999 others still start on the same 2 cores
CRASH_RUNNING = """\
import os, time
D = {started!r}
open(os.path.join(D, os.environ["RANK"]), "w").close()
print("started", flush=True)
if os.environ["RANK"] == "1":
    while len(os.listdir(D)) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.5)
    time.sleep(3)
    print("crash_at", repr(time.time()), flush=True)
    os._exit(1)
time.sleep(600)
"""


@dataclass
class Cost:
    """One command: its wall time and what its process used."""
    seconds: float
    code: int
    user: float = 0.0
    system: float = 0.0
    rss_mib: float = 0.0
    threads: int = 0
    fds: int = 0
    fd_limit: int = 0   # the process's own soft open-file limit, last read while it ran
    said_stopped: float = float("nan")   # wall time orch said every host was stopped
    # seconds from the command's start to each of orch up's step lines (MARKS)
    marks: dict[str, float] = field(default_factory=dict)
    # CPU seconds the whole machine was busy meanwhile (/proc/stat): the command and
    # everything it made the hosts do, on the cores they share
    machine: float = float("nan")


@dataclass
class Sample:
    measure: str
    orch: Cost
    base: float = float("nan")   # the baseline's wall seconds
    extra: float = float("nan")  # failfast: seconds from the rank's exit to every host stopped
    end: float = float("nan")    # failfast: seconds from the rank's exit to orch's end
    stop: float = float("nan")   # failfast: orch's decision to stop -> every host stopped


@dataclass
class Series:
    shell: str
    n: int
    samples: list[Sample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # "orch"/"pdsh" -> kind -> (processes per host, PSS MiB per host) while a job runs
    memory: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)

    def fail(self, what: str, r: Run) -> None:
        note = f"{what} failed (exit {r.returncode}): {r.tail(600)}"
        self.notes.append(note)
        print(f"  ! {note}", flush=True)


# ---------------------------------------------------------------- running one command

NOFILE = [1024]
# the tests' 5 s is too short for a key exchange when 1,000 hosts share 2 cores with the
# controller (and the machine's other users): a slow host is not what is measured here
SSH = {"connect_timeout": 60}


def limit_files() -> None:
    """In the child before exec: the soft open-file limit of a login session (the hard
    one is left as it is, as a login session's is)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(NOFILE[0], hard), hard))


def peaks(pid: int, got: dict[str, int], stop: threading.Event) -> None:
    """The most threads and descriptors pid had, sampled every 0.1 s until stop, and its
    soft open-file limit (orch raises the one it was started under: this shows it did)."""
    while not stop.is_set():
        try:
            got["fds"] = max(got["fds"], len(os.listdir(f"/proc/{pid}/fd")))
            got["threads"] = max(got["threads"], len(os.listdir(f"/proc/{pid}/task")))
            got["fd_limit"] = soft_nofile(Path(f"/proc/{pid}/limits").read_text())
        except OSError:
            return
        stop.wait(0.1)


def soft_nofile(limits: str) -> int:
    """The soft 'Max open files' of a /proc/PID/limits text (0: unlimited or unread)."""
    for line in limits.splitlines():
        if line.startswith("Max open files"):
            soft = line.split()[3]
            return int(soft) if soft.isdigit() else 0
    return 0


def measured(cmd: list[str], *, env: dict, cwd: Path, timeout: float = 900,
             limit: bool = True) -> tuple[Run, Cost]:
    """Run cmd to its end: the run, and its cost (wait4's rusage: exact CPU and RSS);
    limit: under the login session's open-file limit (orch; pdsh keeps the bench's own:
    it holds three pipes per host)."""
    t0, busy0 = time.perf_counter(), machine_busy()
    said: dict[str, float] = {}   # the wall time each SAID text first came on stderr
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=limit_files if limit else None)
    got, stop = {"fds": 0, "threads": 0, "fd_limit": 0}, threading.Event()
    outs: dict[str, bytes] = {}
    out, err = proc.stdout, proc.stderr
    assert out is not None and err is not None
    readers = [threading.Thread(target=lambda: outs.__setitem__("out", out.read()), daemon=True),
               threading.Thread(target=read_err, args=(err, outs, said), daemon=True)]
    poll = threading.Thread(target=peaks, args=(proc.pid, got, stop), daemon=True)
    for th in (*readers, poll):
        th.start()
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    _, status, usage = os.wait4(proc.pid, 0)
    timer.cancel()
    seconds, busy = time.perf_counter() - t0, machine_busy() - busy0
    proc.returncode = os.waitstatus_to_exitcode(status)
    stop.set()
    for th in (*readers, poll):
        th.join()
    run = Run(seconds, proc.returncode, outs.get("out", b"").decode(errors="replace"),
              outs.get("err", b"").decode(errors="replace"))
    t_wall = time.time() - seconds
    marks = {k: round(said[k] - t_wall, 2) for k in MARKS if k in said}
    return run, Cost(seconds, proc.returncode, usage.ru_utime, usage.ru_stime,
                     usage.ru_maxrss / 1024, got["threads"], got["fds"], got["fd_limit"],
                     said.get("stopped", float("nan")), marks, busy)


def machine_busy() -> float:
    """CPU seconds this machine's cores were busy since boot (/proc/stat's first line:
    every field but idle and iowait; guest time is inside user's already)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(f) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


# orch up's line after a verified stop; the step lines, whose times say where `up` went
MARKS = {"preflight": "preflight: ", "network": "network: ", "synced": "sync ",
         "started": "started job", "finished": "finished: "}
SAID = {"stopped": "stopped the job on every host", **MARKS}


def read_err(f, outs: dict[str, bytes], said: dict[str, float]) -> None:
    """stderr line by line, noting when each SAID text first came."""
    lines = []
    for line in f:
        lines.append(line)
        for key, text in SAID.items():
            if key not in said and text.encode() in line:
                said[key] = time.time()
    outs["err"] = b"".join(lines)


def orch(inv: Path, verb: str, *extra: str) -> tuple[Run, Cost]:
    return measured([str(ORCH), verb, *extra, "-c", str(inv)], env=orch_env(), cwd=inv.parent)


def pdsh(bed: Bed, remote: str) -> Run:
    run, cost = measured(bed.pdsh_argv(remote), env=pdsh_env(bed.cluster), cwd=Path.cwd(),
                         limit=False)
    run.machine = cost.machine
    return run


def show(label: str, c: Cost, base: float = float("nan")) -> None:
    vs = f" (baseline {base:.2f} s)" if base == base else ""
    print(f"  {label}: {c.seconds:.2f} s{vs}, cpu {c.user:.2f} user + {c.system:.2f} sys, "
          f"rss {c.rss_mib:.0f} MiB, {c.threads} threads, {c.fds} fds "
          f"(soft limit {c.fd_limit or 'unlimited'}), the machine's cpu {c.machine:.1f} s",
          flush=True)
    if c.marks:
        print("    steps (s from the start): "
              + ", ".join(f"{k} {v:.1f}" for k, v in c.marks.items()), flush=True)


# ---------------------------------------------------------------- the measures

def measure_up(bed: Bed, s: Series) -> None:
    inv, d = bed.inventory(f"up{bed.n}", HELLO), bed.pdsh_dir(HELLO)
    p = pdsh(bed, bed.torchrun_remote(d, free_port([bed.hosts[0].address], 29500, 29900)))
    if not job_ok(bed, p):
        s.fail("baseline up", p)
    o, c = orch(inv, "up")
    if not job_ok(bed, o):
        s.fail("orch up", o)
    s.samples.append(Sample("up", c, p.seconds if job_ok(bed, p) else float("nan")))
    show("up", c, p.seconds)
    print(f"    the machine's cpu under the baseline: {p.machine:.1f} s", flush=True)


def measure_running(bed: Bed, s: Series) -> None:
    """status, logs and stop of one running (sleeping) job."""
    inv = bed.inventory(f"sleep{bed.n}", SLEEPER)
    o, c = orch(inv, "up", "--detach")
    show("up --detach", c)
    if not o.ok or not wait_started(bed, timeout=300):
        s.fail("orch up --detach (or not every rank started)", o)
        return
    for verb, extra in (("status", ()), ("logs", ("--rank", "0"))):
        t = pdsh(bed, "true") if verb == "status" else None
        o, c = orch(inv, verb, *extra)
        if not o.ok:
            s.fail(f"orch {verb}", o)
        s.samples.append(Sample(verb, c, t.seconds if t and t.ok else float("nan")))
        show(verb, c, s.samples[-1].base)
    t = pdsh(bed, "true")
    o, c = orch(inv, "stop")
    left = bed.left_over()
    if not o.ok or left:
        s.fail(f"orch stop (left {len(left)} processes)", o)
        kill_pids(left)
    s.samples.append(Sample("stop", c, t.seconds if t.ok else float("nan")))
    show("stop", c, t.seconds)


def measure_failfast(bed: Bed, s: Series) -> None:
    failfast(bed, s, "failfast", bed.inventory(f"crash{bed.n}", CRASH))


def measure_failfast_running(bed: Bed, s: Series) -> None:
    started = bed.remote / f"started{bed.n}"
    shutil.rmtree(started, ignore_errors=True)
    prepare_remote(started, bed.shell)
    try:
        failfast(bed, s, "failfast-running",
                 bed.inventory(f"crashrun{bed.n}", CRASH_RUNNING.format(started=str(started))))
    finally:
        shutil.rmtree(started, ignore_errors=True)


def failfast(bed: Bed, s: Series, measure: str, inv: Path) -> None:
    o, c = orch(inv, "up")
    ended = time.time()
    left = bed.left_over()
    m = re.search(r"crash_at (\d+\.\d+)", o.stdout)
    after = ended - float(m.group(1)) if m else float("nan")
    if o.returncode != 1 or not m or left:
        s.fail(f"orch up with a rank's exit (left {len(left)})", o)
        kill_pids(left)
    said = c.said_stopped - float(m.group(1)) if m else float("nan")
    # orch's own count, from its decision to stop to every host stopped: the rest of
    # `said` is the exit's way to the controller (the rank, its host's agent, sshd)
    own = re.search(r"stopped the job on every host in (\d+\.\d+) s", o.stderr)
    stop = float(own.group(1)) if own else float("nan")
    s.samples.append(Sample(measure, c, extra=said, end=after, stop=stop))
    show(f"{measure} (stopped {said:.2f} s after the exit, of which the stop {stop:.1f} s; "
         f"orch ended {after:.2f} s after it)", c)


def measure_memory(bed: Bed, s: Series) -> None:
    """Memory per host while a sleeping job runs: under `orch up` (attached), then
    under pdsh + torchrun (bench/hostmem.py)."""
    inv = bed.inventory(f"mem{bed.n}", SLEEPER)
    proc = subprocess.Popen([str(ORCH), "up", "-c", str(inv)], env=orch_env(), cwd=inv.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=limit_files)
    low = hostmem.mem_available_mib()
    try:
        s.memory["orch"] = hostmem.orch_memory(bed, proc)
        low = min(low, hostmem.mem_available_mib())
    except RuntimeError as e:
        s.notes.append(str(e))
    finally:
        orch(inv, "stop")
        proc.wait(300)
    d = bed.pdsh_dir(SLEEPER)
    try:
        s.memory["pdsh"] = hostmem.pdsh_memory(
            bed, bed.torchrun_remote(d, free_port([bed.hosts[0].address], 29500, 29900)))
    except RuntimeError as e:
        s.notes.append(str(e))
    for side, kinds in s.memory.items():
        print(f"  memory per host under {side}: " + ", ".join(
            f"{k} {n:.2f} x {m:.2f} MiB" for k, (n, m) in kinds.items()), flush=True)
    print(f"  MemAvailable at its lowest under orch: {low:.0f} MiB", flush=True)


# ---------------------------------------------------------------- report

HEADERS = ["hosts", "shell", "command", "orch s", "baseline s", "ratio", "user s", "sys s",
           "RSS MiB", "threads", "fds", "exit -> stopped s", "of it orch's stop s",
           "exit -> end s"]


def mid(got: list[Sample], f: Callable[[Sample], float]) -> float:
    """The median of one field over the reps."""
    return median([f(x) for x in got])


def rows(series: list[Series]) -> list[list]:
    out = []
    for s in series:
        for measure in ("up", "status", "logs", "stop", "failfast", "failfast-running"):
            got = [x for x in s.samples if x.measure == measure]
            if not got:
                continue
            o, b = mid(got, lambda x: x.orch.seconds), mid(got, lambda x: x.base)
            out.append([s.n, s.shell, measure, o, b, o / b if b == b else float("nan"),
                        mid(got, lambda x: x.orch.user), mid(got, lambda x: x.orch.system),
                        max(x.orch.rss_mib for x in got), max(x.orch.threads for x in got),
                        max(x.orch.fds for x in got), mid(got, lambda x: x.extra),
                        mid(got, lambda x: x.stop), mid(got, lambda x: x.end)])
    return out


def report(series: list[Series], started: float) -> None:
    print(f"\nfleet: medians (load {' '.join(f'{v:.1f}' for v in os.getloadavg())}, "
          f"{time.monotonic() - started:.0f} s in all, controller soft nofile {NOFILE[0]})")
    markdown(HEADERS, rows(series))
    for s in series:
        for note in s.notes:
            print(f"note ({s.shell}, {s.n} hosts): {note[:300]}")
    data = [{"shell": s.shell, "hosts": s.n, "notes": s.notes, "memory": s.memory,
             "samples": [asdict(x) for x in s.samples]} for s in series]
    print(f"raw samples: {save_json('fleet.json', data)}")


# ---------------------------------------------------------------- main

MEASURES = {"up": measure_up, "running": measure_running, "failfast": measure_failfast,
            "failfast-running": measure_failfast_running, "memory": measure_memory}


def run_series(beds: Beds, shell: str, n: int, reps: int, work: Path,
               measures: list[str]) -> Series:
    sh = beds.shells[shell]
    print(f"\n== {n} hosts, {shell} shell ({sh.user}), stand-in torchrun", flush=True)
    bed = Bed(beds.cluster, beds.cluster.hosts[:n], sh, beds.python, work / f"{shell}{n}",
              remote_base(beds.cluster, sh) / f"n{n}", ssh=dict(SSH))
    s = Series(shell, n)
    for rep in range(reps):
        print(f" rep {rep + 1}", flush=True)
        for name in measures:
            MEASURES[name](bed, s)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[64, 300], metavar="N",
                    help="host counts, each a prefix of one cluster (1000: about 30 minutes)")
    ap.add_argument("--shells", nargs="+", default=["plain"], choices=["plain", "root"])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--measures", nargs="+", default=list(MEASURES), choices=list(MEASURES),
                    help="up; running (status, logs, stop of one job); failfast; "
                         "failfast-running (the crash once every rank started); memory "
                         "(per host while a job runs, orch and pdsh)")
    ap.add_argument("--nofile", type=int, default=1024,
                    help="the controller's soft open-file limit (a login session's default)")
    args = ap.parse_args()
    NOFILE[0] = args.nofile
    compile_orch()
    started = time.monotonic()
    series: list[Series] = []
    with bed_cluster(max(args.hosts), args.shells, wide=True) as beds:
        print(f"{max(args.hosts)} sshd up in {time.monotonic() - started:.0f} s", flush=True)
        work = beds.cluster.root.parent / "work"
        for n in sorted(args.hosts):
            for shell in args.shells:
                series.append(run_series(beds, shell, n, args.reps, work, args.measures))
    report(series, started)
    if not beds.clean:
        sys.exit(1)


if __name__ == "__main__":
    main()
