"""Recovery: a real training run (worker.train, torch over gloo) on 4 hosts in network
namespaces with real sshd, `job.restarts: 2` and one spare, faulted mid-epoch; against
an unfaulted run of the same seed and epochs, and against pdsh + torchrun, which loses
the run.

Every host sits in a network namespace of its own behind a veth (tests/netns_hosts.py);
orch runs in the client namespace. The job is `python -m worker.train --model lenet
--image-size 32 ... --checkpoint-every 1 --resume --log-every 1` on demo data
(worker.demo_data, split with `orch split-data --pack`): a checkpoint every epoch, and
rank 0 prints `epoch E step S/T` after each step.

Faults, each injected once rank 0 printed a step of epoch >= 2 half way through the epoch.
A lost host is rank 0's, the only one holding the checkpoint: the restart resumes from
the copy orch kept off it (`job.checkpoint`, #22 item 3), put back on the spare:

- `cut`: host 0's cable pulled (NsHosts.cut): no reset, silence;
- `kill`: every process of host 0's namespace SIGKILLed, sshd included (the host dies);
- `crash`: rank 1's training process SIGKILLed (the host stays: the restart runs on the
  same hosts, no spare);
- `stop`: rank 1 SIGSTOPped: found by hang detection (`job.hang_timeout`).

Per fault (one clock: every "host" is on this machine):

- detect: from the fault to orch's first line about it (the root cause, a lost or
  silent host, a hang, `restart 1 of 2`);
- first step: from the fault to the restarted run's first training step (rank 0's
  `epoch E step 1/T` after `attempt 2 of 3 (ORCH_RESTART_COUNT=1)`), torch's import
  included;
- redone: the epochs trained twice: the last epoch done before the fault, less the
  checkpoint the restart resumed from, plus the part of the interrupted epoch;
- accuracy: the last epoch's val_acc in rank 0's metrics.csv, against the unfaulted run.

The baseline: the same job started with pdsh + torchrun (no restarts), the `kill` fault
injected the same way; the figure is how the run ends (failed, or still hung at --cap),
and that nothing restarts it: the run is lost until someone types a command.

    flock /tmp/orch-sshd.lock .venv/bin/python bench/recovery.py
        [--faults cut kill stop] [--epochs 5] [--no-baseline] [--cap 120] [--hosts 4] [--quick]

--hosts N: the job's hosts (default 4; the spare is one more). --quick: the `kill` fault
only, 3 epochs, one unfaulted run, no baseline (the smoke test's run), on 2 hosts + the
spare and a quarter of the training data (epochs of 125 steps, about 2 s each when the
machine is idle; half the torch starts of 4 hosts: a lost host's restart on the spare
needs one host that stays, not three). The fault also
waits for the copy kept off host 0 to hold the checkpoint of the epoch before
(`.orch/<name>/checkpoints/`, renamed into place only when whole), rather than trusting
half an epoch to be longer than the keeper's round and settle time (1.5 s): the run
still proves that the copy is kept off the host while the job runs and put back on the
spare; how soon after the checkpoint it is held stays the full run's figure. Every
sshd, process and namespace of the run is gone at the end (checked and printed; exit 1
if anything is left). Needs root and iproute2.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common import (
    ORCH,
    OUT_DIR,
    REPO,
    VENV_PY,
    compile_orch,
    kill_pids,
    markdown,
    orch_env,
    save_json,
)
from netns_hosts import NsHosts
from sshd_cluster import pid_alive

FAULTS = ("cut", "kill", "crash", "stop")
LOST_HOST = 0                # cut, kill: rank 0's host, where the checkpoint was written
FAULTED_RANK = 1             # crash, stop: a rank other than 0, its host stays
HOSTS = 4                    # the job's hosts; the spare is the next: rank 0 after a loss
QUICK_HOSTS = 2              # --quick: host 0 lost, host 1 stays, the spare takes rank 0
HANG_TIMEOUT = 15            # job.hang_timeout for the `stop` fault, seconds
TARGET_FIRST_STEP = 30.0     # host loss -> first step of the restarted run, seconds
TARGET_REDONE = 1.0          # work lost: at most one checkpoint interval (epochs)
TARGET_ACC_POINTS = 1.0      # final accuracy within this many points of the unfaulted run
TRAIN_PER_CLASS = 2000       # demo data: 4 classes; 2000 training images each: 250 steps
QUICK_PER_CLASS = 500        # --quick, 2 ranks: 125 steps an epoch, longer than the keeper's lag
BATCH = 8                    # of 8 per rank and epoch, an epoch of seconds here
VAL_PER_CLASS = 250          # 1000 validation images: an image is 0.1 point of accuracy

STEP = re.compile(r"\bepoch (\d+) step (\d+)/(\d+)")
EPOCH_DONE = re.compile(r"\bepoch\s+(\d+)/(\d+)\s+time\b")
RESUMED = re.compile(r"resumed from the checkpoint of epoch (\d+)")
ATTEMPT = re.compile(r"\battempt (\d+) of (\d+) \(ORCH_RESTART_COUNT=(\d+)\)")
RESTART_LINE = re.compile(r"\brestart 1 of \d+ in ")
DETECTED = re.compile(r"root cause|restart 1 of|went silent|\blost\b|\bhang\b|\bhung\b")


# ---------------------------------------------------------------- pure helpers (tested)

@dataclass
class Line:
    t: float        # time.monotonic() when the line arrived
    text: str


@dataclass
class Timeline:
    """What the lines of one faulted run say, times from the fault."""
    detect: float = float("nan")
    restart: float = float("nan")   # orch's `restart 1 of N in S s after: ...` line
    first_step: float = float("nan")
    last_done: int = 0              # the last epoch finished before the fault
    partial: float = 0.0            # the part of the interrupted epoch done (0..1)
    resumed: int | None = None      # the checkpoint's epoch the restart started after
    restarted: bool = False

    @property
    def redone(self) -> float:
        """Epochs trained twice."""
        if self.resumed is None:
            return float("nan")
        return self.last_done - self.resumed + self.partial


def timeline(lines: list[Line], fault: float) -> Timeline:
    """Read one run's lines (orch's and the ranks', as they came) around the fault."""
    tl = Timeline()
    attempt = 0
    for ln in lines:
        if ln.t < fault:
            if m := EPOCH_DONE.search(ln.text):
                tl.last_done, tl.partial = int(m.group(1)), 0.0
            elif m := STEP.search(ln.text):
                tl.partial = int(m.group(2)) / int(m.group(3))
            continue
        if DETECTED.search(ln.text) and tl.detect != tl.detect:
            tl.detect = ln.t - fault
        if RESTART_LINE.search(ln.text) and tl.restart != tl.restart:
            tl.restart = ln.t - fault
        if m := ATTEMPT.search(ln.text):
            attempt = int(m.group(3))
            tl.restarted = tl.restarted or attempt >= 1
        elif attempt >= 1 and (m := RESUMED.search(ln.text)) and tl.resumed is None:
            tl.resumed = int(m.group(1))
        elif attempt >= 1 and STEP.search(ln.text) and tl.first_step != tl.first_step:
            tl.first_step = ln.t - fault
    if tl.restarted and tl.resumed is None:
        tl.resumed = 0   # --resume found no checkpoint: from the start
    return tl


def column(metrics_csv: str, name: str) -> list[float]:
    """One column of worker.train's metrics.csv, an entry per epoch row."""
    rows = [r for r in metrics_csv.splitlines() if r.strip()]
    header = rows[0].split(",") if rows else []
    if len(rows) < 2 or name not in header:
        raise ValueError(f"metrics.csv has no epoch row with {name}")
    return [float(r.split(",")[header.index(name)]) for r in rows[1:]]


def final_accuracy(metrics_csv: str) -> float:
    """The last row's val_acc, as a fraction."""
    return column(metrics_csv, "val_acc")[-1]


def verdict(value: float, target: float) -> str:
    if value != value:
        return "-"
    return "met" if value <= target else "MISSED"


# ---------------------------------------------------------------- the hosts

class BenchHosts(NsHosts):
    """NsHosts whose host-side veth has the same name in every namespace, so that one
    GLOO_SOCKET_IFNAME serves every host (gloo would bind loopback otherwise: the
    machine's name does not resolve to an address of the namespace)."""

    def __init__(self, root: Path, n: int) -> None:
        super().__init__(root, n)
        self.ifname = f"orb{os.getpid() % 100000}"
        for h in self.hosts:
            h.veth = (h.veth[0], self.ifname)

    def ns_pids(self, i: int) -> list[int]:
        got = subprocess.run(["ip", "netns", "pids", self.hosts[i].ns], capture_output=True,
                             text=True)
        return [int(p) for p in got.stdout.split() if p.isdigit()]

    def kill_host(self, i: int) -> int:
        """The host dies: every process of its namespace (sshd, sessions, the job's
        detached supervisor, torchrun, ranks) SIGKILLed, until none is left."""
        n = 0
        deadline = time.monotonic() + 10
        while (pids := self.ns_pids(i)) and time.monotonic() < deadline:
            kill_pids(pids)
            n += len(pids)
            time.sleep(0.05)
        return n

    def end_all(self) -> None:
        """Every process in every host namespace ended (a cut host's ranks, detached
        supervisors that no sshd holds), before stop() removes the namespaces."""
        self.heal()
        for h in self.hosts:
            self.kill_host(h.index)


def rank_pids(net: BenchHosts, i: int, rank: int) -> list[int]:
    """The training process of one rank on host i: RANK=<rank> in its environment."""
    want = f"\0RANK={rank}\0".encode()
    found = []
    for pid in net.ns_pids(i):
        try:
            env = b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if want in env:
            found.append(pid)
    return found


# ---------------------------------------------------------------- one orch run

class Reader:
    """A process's stdout and stderr lines, each with its arrival time."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: list[Line] = []
        self.cond = threading.Condition()
        self.threads = [threading.Thread(target=self._read, args=(s,), daemon=True)
                        for s in (proc.stdout, proc.stderr) if s is not None]
        for th in self.threads:
            th.start()

    def _read(self, stream: Any) -> None:
        for raw in stream:
            with self.cond:
                self.lines.append(Line(time.monotonic(), raw.rstrip("\n")))
                self.cond.notify_all()

    def wait_for(self, pred: Any, timeout: float) -> Line | None:
        deadline = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                for ln in self.lines[seen:]:
                    if pred(ln.text):
                        return ln
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and all(
                        not th.is_alive() for th in self.threads)):
                    return None
                self.cond.wait(min(left, 0.5))

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        for th in self.threads:
            th.join(5)
        return code

    def text(self) -> str:
        return "\n".join(ln.text for ln in self.lines)


def mid_epoch(text: str) -> bool:
    """A step of epoch >= 2, half way in or more: the last checkpoint (epoch 1's) was
    written half an epoch before, a few seconds, as a real run's minutes would be."""
    m = STEP.search(text)
    if m is None:
        return False
    return int(m.group(1)) >= 2 and int(m.group(2)) * 2 >= int(m.group(3))


@dataclass
class Bed:
    work: Path
    data: Path
    shards: Path
    epochs: int
    per_class: int = TRAIN_PER_CLASS
    logs: Path | None = None         # each run's lines go to recovery-<run>.log there
    wait_kept: bool = False          # a host fault also waits for the checkpoint kept off it
    n_hosts: int = HOSTS             # the job's hosts; the spare, when there is one, is next
    sshds: list[int] = field(default_factory=list)

    def keep_log(self, name: str, run: Reader) -> None:
        if self.logs is not None:
            self.logs.mkdir(parents=True, exist_ok=True)
            (self.logs / f"recovery-{name}.log").write_text(
                "".join(f"{ln.t:.3f} {ln.text}\n" for ln in run.lines))

    def job_args(self) -> list[str]:
        return ["--model", "lenet", "--image-size", "32", "--batch-size", str(BATCH),
                "--optimizer", "adam", "--lr", "0.001", "--lr-schedule", "cosine",
                "--epochs", str(self.epochs),
                "--workers", "0", "--seed", "0", "--checkpoint-every", "1", "--resume",
                "--log-every", "1"]

    def inventory(self, net: BenchHosts, name: str, hosts: int, spare: bool,
                  job: dict | None = None) -> Path:
        folder = self.work / name
        folder.mkdir(parents=True, exist_ok=True)
        code = folder / "worker"
        if not code.exists():
            shutil.copytree(REPO / "worker", code,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        entries: list[dict[str, Any]] = [
            {"address": h.address, "procs": 1, "remote_dir": str(h.remote_dir)}
            for h in net.hosts[:hosts]]
        if spare:
            h = net.hosts[hosts]
            entries.append({"address": h.address, "procs": 1, "remote_dir": str(h.remote_dir),
                            "spare": True})
        doc = {"name": name,
               "ssh": {"user": "root", "identity_file": str(net.client_key),
                       "known_hosts": str(net.known_hosts), "connect_timeout": 5},
               "hosts": entries, "python": str(VENV_PY),
               "code": {"paths": ["worker"], "exclude": ["*.pyc", "__pycache__"]},
               "data": {"source": str(self.data), "shards": str(self.shards)},
               "job": {"entrypoint": "worker.train", "args": self.job_args(),
                       "env": {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": net.ifname},
                       **(job or {})}}
        path = folder / "cluster.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path


@contextlib.contextmanager
def hosts(bed: Bed, tag: str, n: int) -> Iterator[BenchHosts]:
    """n fresh hosts for one run; on the way out every process in them ended, the
    namespaces deleted (stop() raises if a pid, namespace or veth is left)."""
    net = BenchHosts(bed.work / f"net-{tag}", n)
    net.start()
    bed.sshds += [h.proc.pid for h in net.hosts if h.proc is not None]
    try:
        yield net
    finally:
        net.end_all()
        net.stop()


def orch_up(net: BenchHosts, inv: Path) -> Reader:
    proc = net.popen_in_client([str(ORCH), "up", "-c", str(inv)], cwd=inv.parent,
                               env=orch_env(), stdin=subprocess.DEVNULL, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return Reader(proc)


def metrics_of(net: BenchHosts, name: str, host: int = 0) -> str:
    """Rank 0's metrics.csv on the host that ran rank 0 last (the spare after a loss of
    host 0: it holds the epochs from the resumed one on)."""
    return (net.hosts[host].remote_dir / name / "output" / "metrics.csv").read_text()


def reference(bed: Bed, k: int) -> dict[str, Any]:
    """The unfaulted run (the k-th): the same job, seed and epochs."""
    name = f"rec-ref{k}"
    with hosts(bed, f"ref{k}", bed.n_hosts) as net:
        inv = bed.inventory(net, name, bed.n_hosts, spare=False)
        t0 = time.monotonic()
        run = orch_up(net, inv)
        code = run.finish(900)
        bed.keep_log(name, run)
        if code != 0:
            raise SystemExit(f"the unfaulted run failed (exit {code}):\n{run.text()[-3000:]}")
        csv = metrics_of(net, name)
        accs, epoch_s = column(csv, "val_acc"), column(csv, "epoch_time_s")
    mean = sum(epoch_s) / len(epoch_s)
    print(f"  unfaulted {k}: {time.monotonic() - t0:.1f} s, final val_acc {accs[-1]:.4f}, "
          f"{mean:.1f} s an epoch", flush=True)
    return {"fault": "none", "seconds": time.monotonic() - t0, "val_acc": accs[-1],
            "val_accs": accs, "epoch_s": mean, "metrics_csv": csv}


def kept_before(root: Path) -> Callable[[str], bool]:
    """mid_epoch, once the controller's copy (the keeper's folder `root`) holds the
    checkpoint of the epoch before the line's: the restart after a lost host can resume
    from it."""
    def ready(text: str) -> bool:
        m = STEP.search(text)
        if m is None or not mid_epoch(text):
            return False
        kept = root / "output" / "checkpoints" / f"epoch-{int(m.group(1)) - 1:05d}.pt"
        return kept.is_file()
    return ready


def inject(net: BenchHosts, fault: str) -> str:
    if fault == "cut":
        net.cut(LOST_HOST)
        return f"host {LOST_HOST}'s link cut"
    if fault == "kill":
        n = net.kill_host(LOST_HOST)
        return f"host {LOST_HOST} killed ({n} processes, sshd included)"
    pids = rank_pids(net, FAULTED_RANK, FAULTED_RANK)   # one rank per host: host i, rank i
    if fault == "crash":
        kill_pids(pids)
        return f"rank {FAULTED_RANK} SIGKILLed (pids {pids})"
    kill_pids_sig(pids, signal.SIGSTOP)
    return f"rank {FAULTED_RANK} SIGSTOPped (pids {pids})"


def kill_pids_sig(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def faulted(bed: Bed, fault: str) -> dict[str, Any]:
    name = f"rec-{fault}"
    job: dict[str, Any] = {"restarts": 2}
    if fault == "stop":
        job["hang_timeout"] = HANG_TIMEOUT
    with hosts(bed, fault, bed.n_hosts + 1) as net:
        inv = bed.inventory(net, name, bed.n_hosts, spare=True, job=job)
        run = orch_up(net, inv)
        ready: Callable[[str], bool] = mid_epoch
        if bed.wait_kept and fault in ("cut", "kill"):
            ready = kept_before(inv.parent / ".orch" / name / "checkpoints")
        at = run.wait_for(ready, 600)
        if at is None:
            run.finish(5)
            held = " with the checkpoint before it kept off the host" if ready is not mid_epoch else ""
            raise SystemExit(f"{fault}: no step of epoch >= 2 came{held}:\n{run.text()[-3000:]}")
        t_fault = time.monotonic()
        what = inject(net, fault)
        print(f"  {fault}: {what} at '{at.text.strip()}'", flush=True)
        code = run.finish(600)
        bed.keep_log(name, run)
        if fault == "stop":
            kill_pids_sig(rank_pids(net, FAULTED_RANK, FAULTED_RANK), signal.SIGCONT)
        tl = timeline(run.lines, t_fault)
        try:
            csv = metrics_of(net, name, bed.n_hosts if fault in ("cut", "kill") else 0)
            accs = column(csv, "val_acc")
        except (OSError, ValueError, IndexError):
            csv, accs = "", [float("nan")]
        acc = accs[-1]
        if code != 0 or not tl.restarted:
            print(f"  {fault}: orch up exited {code}, restarted={tl.restarted}\n"
                  + run.text()[-3000:], flush=True)
    row = {"fault": fault, "exit": code, "detect_s": tl.detect, "restart_line_s": tl.restart,
           "first_step_s": tl.first_step,
           "last_done": tl.last_done, "partial": tl.partial, "resumed": tl.resumed,
           "redone_epochs": tl.redone, "val_acc": acc, "val_accs": accs, "metrics_csv": csv}
    print(f"  {fault}: exit {code}, detect {tl.detect:.1f} s, restart line {tl.restart:.1f} s, "
          f"first step {tl.first_step:.1f} s, "
          f"epoch {tl.last_done} done + {tl.partial:.2f}, resumed from {tl.resumed}, "
          f"val_acc {acc:.4f}", flush=True)
    return row


# ---------------------------------------------------------------- the baseline

def baseline(bed: Bed, cap: float) -> dict[str, Any]:
    """pdsh + torchrun, the same job and the `kill` fault: how the run ends."""
    n = bed.n_hosts
    with hosts(bed, "base", n) as net:
        d = bed.work / "base"
        if not (d / "worker").exists():
            shutil.copytree(REPO / "worker", d / "worker",
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        master = net.hosts[0].address
        # the node rank from the address: 10.251.<i>.2 is host i
        remote = (f"h=%h; t=${{h%.*}}; R=${{t##*.}}; cd {d} && OMP_NUM_THREADS=1 "
                  f"GLOO_SOCKET_IFNAME={net.ifname} {VENV_PY} -m torch.distributed.run "
                  f"--nnodes {n} --node-rank $R --nproc-per-node 1 --master-addr {master} "
                  f"--master-port 29500 -m worker.train --data-dir {bed.shards} "
                  f"--output-dir {d}/out$R " + " ".join(bed.job_args()))
        argv = ["pdsh", "-S", "-R", "ssh", "-f", str(n), "-l", "root",
                "-w", ",".join(h.address for h in net.hosts), remote]
        env = dict(orch_env(), PDSH_SSH_ARGS_APPEND=(
            f"-i {net.client_key} -o UserKnownHostsFile={net.known_hosts} "
            "-o StrictHostKeyChecking=yes -o BatchMode=yes -F /dev/null"))
        proc = net.popen_in_client(argv, env=env, stdin=subprocess.DEVNULL, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        run = Reader(proc)
        at = run.wait_for(mid_epoch, 600)
        if at is None:
            run.finish(5)
            raise SystemExit(f"baseline: no step of epoch >= 2 came:\n{run.text()[-3000:]}")
        t_fault = time.monotonic()
        inject(net, "kill")
        try:
            code: int | None = proc.wait(cap)
            ended = time.monotonic() - t_fault
        except subprocess.TimeoutExpired:
            code, ended = None, float("nan")
        net.end_all()
        run.finish(10)
        done = [int(m.group(1)) for ln in run.lines if (m := EPOCH_DONE.search(ln.text))]
    finished = bool(done) and max(done) == bed.epochs
    how = ("finished all epochs (not lost)" if finished
           else f"ended failed (pdsh -S exit {code}) {ended:.1f} s after the fault" if code
           else f"still hung {cap:g} s after the fault" if code is None
           else f"pdsh exit 0 {ended:.1f} s after the fault, epochs unfinished")
    print(f"  pdsh + torchrun, kill: {how}; no restart: "
          f"{'run lost' if not finished else 'run done'} (last epoch done {max(done or [0])} "
          f"of {bed.epochs})", flush=True)
    return {"fault": "kill", "exit": code, "ended_s": ended, "last_done": max(done or [0]),
            "finished": finished, "how": how, "tail": run.text()[-1500:]}


# ---------------------------------------------------------------- main

def make_data(bed: Bed, net_for_split: Path) -> None:
    """Demo data (4 classes, small) and its shards for the job's ranks, packed at 32 px."""
    subprocess.run([str(VENV_PY), "-m", "worker.demo_data", "--out", str(bed.data),
                    "--classes", "4", "--train-per-class", str(bed.per_class),
                    "--val-per-class", str(VAL_PER_CLASS), "--seed", "0"], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    doc = {"name": "split", "hosts": [{"address": f"10.251.{i}.2"} for i in range(bed.n_hosts)],
           "python": str(VENV_PY),
           "data": {"source": str(bed.data), "shards": str(bed.shards)},
           "job": {"entrypoint": "worker.train"}}
    net_for_split.write_text(yaml.safe_dump(doc, sort_keys=False))
    subprocess.run([str(ORCH), "split-data", "-c", str(net_for_split), "--pack",
                    "--image-size", "32"], check=True, env=orch_env(),
                   stdout=subprocess.DEVNULL)


def leftovers(bed: Bed) -> tuple[list[int], list[int], list[str]]:
    """sshds alive, processes naming the bench's folder, the bench's namespaces."""
    alive = [p for p in bed.sshds if pid_alive(p)]
    needle = str(bed.work).encode()
    procs = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            blob = Path(f"/proc/{name}/environ").read_bytes()
            blob += Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if needle in blob and pid_alive(int(name)):
            procs.append(int(name))
    tag = f"{os.getpid() % 100000}"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [ln.split()[0] for ln in listed.splitlines() if ln.split()]
    spaces = [n for n in names if n == f"orch-fc{tag}" or n.startswith(f"orch-fh{tag}-")]
    return alive, procs, spaces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--reference-runs", type=int, default=2,
                    help="unfaulted runs: the first is the reference, the others show how "
                         "far two runs of the same seed differ")
    ap.add_argument("--train-per-class", type=int,
                    help="demo images per class (4 classes) to train on: the epoch's length "
                         f"(default {TRAIN_PER_CLASS}; --quick: {QUICK_PER_CLASS})")
    ap.add_argument("--hosts", type=int, default=HOSTS,
                    help=f"the job's hosts, a rank each (the spare is one more; "
                         f"--quick: {QUICK_HOSTS})")
    ap.add_argument("--cap", type=float, default=120.0,
                    help="the baseline's wait for its end after the fault, seconds")
    ap.add_argument("--quick", action="store_true",
                    help="the kill fault only, 3 epochs, one unfaulted run, no baseline, "
                         f"{QUICK_HOSTS} hosts, {QUICK_PER_CLASS} images per class")
    ap.add_argument("--json", type=Path,
                    help="where the raw results go (default: bench/out/recovery.json)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/recovery.py needs root (network namespaces, sshd)")
    if args.quick:
        args.faults, args.epochs, args.no_baseline = ["kill"], 3, True
        args.reference_runs = 1
        args.train_per_class = args.train_per_class or QUICK_PER_CLASS
        args.hosts = QUICK_HOSTS
    if args.epochs < 3:
        raise SystemExit("--epochs must be at least 3 (a fault in epoch 2, then a restart)")
    if args.hosts < 2:
        raise SystemExit("--hosts must be at least 2 (host 0 lost, rank 1 faulted on host 1)")
    compile_orch()
    work = Path(tempfile.mkdtemp(prefix="orch-recovery-"))
    bed = Bed(work, work / "data", work / "shards", args.epochs,
              args.train_per_class or TRAIN_PER_CLASS, args.json.parent if args.json else OUT_DIR,
              wait_kept=args.quick, n_hosts=args.hosts)
    rows: list[list[object]] = []
    result: dict[str, Any] = {"epochs": args.epochs, "faults": [], "baseline": None}
    t0 = time.monotonic()
    ok = True
    try:
        make_data(bed, work / "split.yaml")
        print(f"  data: {4 * bed.per_class} training images made and packed for {bed.n_hosts} ranks in "
              f"{time.monotonic() - t0:.1f} s", flush=True)
        refs = [reference(bed, k) for k in range(1, args.reference_runs + 1)]
        ref = result["reference"] = refs[0]
        result["references"] = refs
        for k, other in enumerate(refs[1:], 2):
            points = 100 * (other["val_acc"] - ref["val_acc"])
            rows.append([f"none (unfaulted run {k}: the noise)", "exit 0", "-", "-", "-", "-",
                         "-", f"{other['val_acc']:.4f} vs {ref['val_acc']:.4f} "
                         f"({points:+.1f} points)", "none"])
        for fault in args.faults:
            r = faulted(bed, fault)
            r["lost_s"] = r["redone_epochs"] * ref["epoch_s"]   # training time done twice
            result["faults"].append(r)
            ok = ok and r["exit"] == 0
            points = 100 * (r["val_acc"] - ref["val_acc"])
            rows.append([
                {"cut": "link cut", "kill": "host killed", "crash": "rank killed",
                 "stop": "rank SIGSTOPped"}[fault],
                f"exit {r['exit']}", r["detect_s"], r["restart_line_s"],
                f"{r['first_step_s']:.1f} ({verdict(r['first_step_s'], TARGET_FIRST_STEP)})",
                f"{r['last_done']} + {r['partial']:.2f} / {r['resumed']}",
                f"{r['redone_epochs']:.2f}, {r['lost_s']:.1f} s "
                f"({verdict(r['redone_epochs'], TARGET_REDONE)})",
                f"{r['val_acc']:.4f} vs {ref['val_acc']:.4f} "
                f"({verdict(abs(points), TARGET_ACC_POINTS)})",
                "none" if r["exit"] == 0 else "run failed"])
        if not args.no_baseline:
            b = baseline(bed, args.cap)
            result["baseline"] = b
            rows.append(["host killed, pdsh + torchrun", b["how"], "-", "-", "never (no restart)",
                         f"{b['last_done']} / -", "the run (lost)", "-",
                         "pdsh + torchrun again, by hand"])
    finally:
        alive, procs, spaces = leftovers(bed)
        kill_pids(procs)
        print(f"cleanup: {len(bed.sshds)} sshd started, {len(alive)} still running; "
              f"{len(procs)} processes of the benchmark left; namespaces left: "
              f"{spaces or 'none'}", flush=True)
        clean = not alive and not procs and not spaces
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    steps = -(-4 * bed.per_class // bed.n_hosts // BATCH)   # 4 classes over the ranks
    print(f"\nrecovery: {bed.n_hosts} hosts + 1 spare in network namespaces, real sshd, worker.train "
          f"(lenet, gloo), {args.epochs} epochs of {steps} steps, "
          f"checkpoint every epoch, job.restarts 2 "
          f"({time.monotonic() - t0:.0f} s; load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}, {os.cpu_count()} cores)")
    print(f"targets: fault -> first step of the restarted run <= {TARGET_FIRST_STEP:g} s "
          f"(torch's import included); epochs redone <= {TARGET_REDONE:g} (one checkpoint "
          f"interval); final accuracy within {TARGET_ACC_POINTS:g} point of the unfaulted "
          f"run; no command typed\n")
    markdown(["fault", "run", "fault -> detected s", "fault -> `restart 1` s",
              "fault -> first step s (<= 30)",
              "epochs done before / resumed from", "epochs redone, training s lost (<= 1 epoch)",
              "final val_acc vs unfaulted (1 point)", "command typed"], rows)
    result["load_average"] = list(load)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(f"raw results: {args.json or save_json('recovery.json', result)}")
    if not clean or not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
