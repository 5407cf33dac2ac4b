"""Line rate: many ranks printing fast, through `orch up` and through pdsh + torchrun.

Every rank prints RATE lines a second for SECONDS (BURST lines per write, as a training
loop prints a block of metrics at once; each line about 100 bytes, stamped with the time
it was written). The bench reads the launcher's stdout as it comes, as a terminal or a
`| tee` would, and for every line notes how long after its write it arrived (its lag),
whether any rank's line was lost, doubled or out of order, and the launcher's CPU and
peak RSS. A launcher that falls behind shows a lag that grows with the run; one that
buffers without bound shows an RSS that grows with it.

Ranks live on HOSTS fake hosts (one sshd each, the plain /bin/sh user, the stand-in
torchrun: bench/common.py), PROCS ranks to a host. The baseline is run_dist.sh style:
`pdsh -f N` + the stand-in torchrun, whose ranks write to its stdout, pdsh prefixing each
line with the host.

    cd bench && ../.venv/bin/python linerate.py --layout 10x10 50x20 [--rate 100]
        [--seconds 20] [--burst 10]

Every sshd, job process and file it made is gone at the end (checked and printed).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from common import (
    ORCH,
    Bed,
    bed_cluster,
    compile_orch,
    free_port,
    markdown,
    orch_env,
    pdsh_env,
    remote_base,
    save_json,
)
from fleet import SSH, limit_files

JOB = """\
import os, sys, time
rank = os.environ["RANK"]
rate, burst = int(os.environ["LR_RATE"]), int(os.environ["LR_BURST"])
total, pad = int(rate * float(os.environ["LR_SECONDS"])), "x" * 60
out, period, seq = sys.stdout, burst / rate, 0
due = time.time()
while seq < total:
    now = time.time()
    out.write("".join("lr %s %d %.6f %s\\n" % (rank, seq + i, now, pad) for i in range(burst)))
    out.flush()
    seq += burst
    due += period
    time.sleep(max(0.0, due - time.time()))
print("lr-done", rank, seq, flush=True)
"""


@dataclass
class Tally:
    """What came on one launcher's stdout: per rank the next sequence number expected,
    the lines lost, doubled or out of order; every line's lag; RSS samples."""
    expected: int
    nxt: dict[int, int] = field(default_factory=dict)
    bad: int = 0
    got: int = 0
    lags: array = field(default_factory=lambda: array("d"))
    seen: array = field(default_factory=lambda: array("d"))   # each line's arrival
    rss: list[tuple[float, float]] = field(default_factory=list)   # (seconds, MiB)
    first: float = 0.0

    def line(self, raw: bytes, now: float) -> None:
        at = raw.find(b"lr ")
        if at < 0 or raw.startswith(b"lr-", at):
            return
        parts = raw[at:].split(None, 4)
        rank, seq, stamp = int(parts[1]), int(parts[2]), float(parts[3])
        if self.nxt.get(rank, 0) != seq:
            self.bad += 1
        self.nxt[rank] = seq + 1
        self.got += 1
        self.lags.append(now - stamp)
        self.seen.append(now)
        self.first = self.first or now


def read_lines(stream, tally: Tally) -> None:
    clock = time.time
    for raw in stream:
        tally.line(raw, clock())


def sample_rss(pid: int, tally: Tally, stop: threading.Event, t0: float) -> None:
    """The launcher's RSS (its own process: orch, or pdsh) every 0.5 s."""
    while not stop.wait(0.5):
        try:
            for row in Path(f"/proc/{pid}/status").read_text().splitlines():
                if row.startswith("VmRSS:"):
                    tally.rss.append((time.monotonic() - t0, int(row.split()[1]) / 1024))
        except OSError:
            return


def run(cmd: list[str], env: dict, cwd: Path, tally: Tally, limit: bool) -> dict:
    """cmd to its end with its stdout read line by line: wall, exit, CPU, peak RSS."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=limit_files if limit else None)
    stop = threading.Event()
    err: list[bytes] = []
    out, errs = proc.stdout, proc.stderr
    assert out is not None and errs is not None
    threads = [threading.Thread(target=read_lines, args=(out, tally), daemon=True),
               threading.Thread(target=lambda: err.append(errs.read()), daemon=True),
               threading.Thread(target=sample_rss, args=(proc.pid, tally, stop, t0), daemon=True)]
    for th in threads:
        th.start()
    _, status, usage = os.wait4(proc.pid, 0)
    stop.set()
    for th in threads:
        th.join(60)
    return {"seconds": time.monotonic() - t0, "code": os.waitstatus_to_exitcode(status),
            "user": usage.ru_utime, "system": usage.ru_stime,
            "rss_peak_mib": usage.ru_maxrss / 1024,
            "stderr_tail": b"".join(err)[-600:].decode(errors="replace")}


def percentile(ordered: list[float], q: float) -> float:
    """The q-quantile of values sorted ascending (nan for none)."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(side: str, tally: Tally, cost: dict) -> dict:
    """The row: lines, lag at p50/p99/max, the median lag of the last tenth of the lines
    against the first tenth's (a launcher falling behind shows it growing), CPU and RSS.
    The lags are sorted once: 2,000,000 of them take a second to sort."""
    lags = tally.lags
    ordered = sorted(lags)
    tenth = max(1, len(lags) // 10)
    return {"side": side, "lines": tally.got, "expected": tally.expected, "disordered": tally.bad,
            "lag_p50_s": percentile(ordered, 0.5), "lag_p99_s": percentile(ordered, 0.99),
            "lag_max_s": percentile(ordered, 1.0),
            "lag_first_tenth_p50_s": percentile(sorted(lags[:tenth]), 0.5),
            "lag_last_tenth_p50_s": percentile(sorted(lags[-tenth:]), 0.5),
            "rss_mid_mib": mid_rss(tally), "rss_series": tally.rss[::4],
            "by_5s": buckets(tally), **cost}


def buckets(tally: Tally, width: float = 5.0) -> list[tuple[float, int, float]]:
    """(seconds after the first line, lines arrived, their median lag) per `width` s."""
    got: dict[int, list[float]] = {}
    for at, lag in zip(tally.seen, tally.lags):
        got.setdefault(int((at - tally.first) // width), []).append(lag)
    return [(k * width, len(v), sorted(v)[len(v) // 2]) for k, v in sorted(got.items())]


def mid_rss(tally: Tally) -> float:
    return tally.rss[len(tally.rss) // 2][1] if tally.rss else float("nan")


def job_env(args: argparse.Namespace) -> dict[str, str]:
    return {"LR_RATE": str(args.rate), "LR_SECONDS": str(args.seconds), "LR_BURST": str(args.burst)}


def expecting(bed: Bed, procs: int, args: argparse.Namespace) -> Tally:
    """An empty tally of every line the bed's ranks will print."""
    return Tally(bed.n * procs * int(args.rate * args.seconds))


def measure_orch(bed: Bed, procs: int, args: argparse.Namespace) -> dict:
    inv = bed.inventory(f"lr{bed.n}x{procs}", JOB, env=job_env(args), procs=procs)
    tally = expecting(bed, procs, args)
    cost = run([str(ORCH), "up", "-c", str(inv)], orch_env(), inv.parent, tally, limit=True)
    return summary("orch up", tally, cost)


def measure_pdsh(bed: Bed, procs: int, args: argparse.Namespace) -> dict:
    d = bed.pdsh_dir(JOB)
    env = " ".join(f"{k}={v}" for k, v in job_env(args).items())
    port = free_port([bed.hosts[0].address], 29500, 29900)
    remote = bed.torchrun_remote(d, port, env, procs=procs)
    tally = expecting(bed, procs, args)
    cost = run(bed.pdsh_argv(remote), pdsh_env(bed.cluster), Path.cwd(), tally, limit=False)
    return summary("pdsh + torchrun", tally, cost)


MEASURES = {"orch": measure_orch, "pdsh": measure_pdsh}


def show(hosts: int, procs: int, row: dict) -> list:
    print(f"  {row['side']}: {row['lines']}/{row['expected']} lines "
          f"({row['disordered']} out of order), lag p50 {row['lag_p50_s']:.3f} s, p99 "
          f"{row['lag_p99_s']:.3f} s, max {row['lag_max_s']:.3f} s (first tenth "
          f"{row['lag_first_tenth_p50_s']:.3f}, last tenth {row['lag_last_tenth_p50_s']:.3f}); "
          f"{row['seconds']:.1f} s, exit {row['code']}, cpu {row['user']:.2f} + "
          f"{row['system']:.2f} s, rss mid {row['rss_mid_mib']:.0f} peak "
          f"{row['rss_peak_mib']:.0f} MiB", flush=True)
    print("  per 5 s (from the first line: lines, median lag s): " + ", ".join(
        f"{at:.0f}: {n} {lag:.2f}" for at, n, lag in row["by_5s"]), flush=True)
    if row["code"] != 0:
        print(f"  ! {row['stderr_tail']}", flush=True)
    return [hosts * procs, f"{hosts}x{procs}", row["side"], f"{row['lines']}/{row['expected']}",
            row["disordered"], round(row["lag_p50_s"], 3), round(row["lag_p99_s"], 3),
            round(row["lag_max_s"], 3), round(row["lag_last_tenth_p50_s"], 3),
            round(row["user"], 2), round(row["system"], 2), round(row["rss_mid_mib"]),
            round(row["rss_peak_mib"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", nargs="+", default=["10x10", "50x20"], metavar="HOSTSxPROCS")
    ap.add_argument("--rate", type=int, default=100, help="lines a second per rank")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--burst", type=int, default=10, help="lines per write")
    ap.add_argument("--sides", nargs="+", default=["orch", "pdsh"], choices=["orch", "pdsh"])
    args = ap.parse_args()
    layouts = [tuple(int(x) for x in spec.split("x")) for spec in args.layout]
    compile_orch()
    started, table, raw = time.monotonic(), [], []
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    with bed_cluster(max(h for h, _ in layouts), ["plain"], wide=True) as beds:
        sh = beds.shells["plain"]
        for hosts, procs in layouts:
            print(f"\n== {hosts} hosts x {procs} ranks, {args.rate} lines/s each", flush=True)
            bed = Bed(beds.cluster, beds.cluster.hosts[:hosts], sh, beds.python,
                      beds.cluster.root.parent / "work" / f"{hosts}x{procs}",
                      remote_base(beds.cluster, sh) / f"{hosts}x{procs}", ssh=dict(SSH))
            for measure in [MEASURES[side] for side in args.sides]:
                row = measure(bed, procs, args)
                raw.append({"hosts": hosts, "procs": procs, **row})
                table.append(show(hosts, procs, row))
    print(f"\nlinerate: load average {os.getloadavg()}, {time.monotonic() - started:.0f} s "
          f"in all; {args.rate} lines/s per rank for {args.seconds:.0f} s, {args.burst} a write")
    markdown(["ranks", "hosts x procs", "launcher", "lines", "out of order", "lag p50 s",
              "p99 s", "max s", "last tenth p50 s", "user s", "sys s", "RSS mid MiB",
              "RSS peak MiB"], table)
    print(f"raw samples: {save_json('linerate', raw)}")
    if not beds.clean:
        sys.exit(1)


if __name__ == "__main__":
    main()
