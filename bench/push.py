"""Data push throughput: orch's push engine against `tar -cf - | ssh host tar -xf -`.

One fake sshd host (SshdCluster(n=1)); the same data in the same run; the methods are
interleaved rep by rep (rotating which goes first) so that the noise of this shared
machine hits them alike; figures are medians. Two data sets:
  big    one 1 GiB random file
  small  10,000 files of 10 KiB (100 folders of 100)

Methods, each into a fresh destination folder every rep:
  tar        tar -cf - -C src . | ssh -F <ssh_config> host 'mkdir -p dst && tar -xf - -C dst'
             (OpenSSH's default cipher; the target figure is orch / this)
  tar-gcm    the same with -c aes128-gcm@openssh.com (the cipher orch asks for)
  orch       orchestrator.files.sync.push() over a connection opened by ssh.connect.connect, the file
             list (with sha256) built beforehand; `push` includes the manifest round trip,
             `+connect` adds opening the connection (tar pays for its ssh handshake too)
  orch-nomf  (--floor) push(..., remote={}): the manifest already known, as in `orch up`
             (preflight brings it), so one remote command instead of two
  floor      (--floor) the same number of bytes through orch's transport into
             `cat > /dev/null`: no files, headers or hashing (the engine's ceiling)
  orch-e2e   (--e2e) `orch up` of a 1-worker split to a fresh job name (digests already
             cached locally, as on any second run): the time from its "preflight: ok" line
             to its "sync <host>:" report, i.e. its code + data push (the local file list
             is built before connecting: see the sha256 list figures)

    .venv/bin/python bench/push.py                 # both data sets, 3 reps
    .venv/bin/python bench/push.py --only small --reps 5 --profile
    .venv/bin/python bench/push.py --e2e

Many files (`--many 100000,1000000`, `--imagenet 10000`): ImageFolder-shaped data sets of
tiny files (a few bytes each, 1000 per class folder) or of 110 KB files (ImageNet's mean
JPEG), split by `orch split-data` into one shard, against `rsync -a` and `tar | ssh` of the
same source folder, all in the same run, interleaved:
  orch-first  what `orch up` does up to the launch (local file list with a cold digest
              cache, connect, preflight with the manifests, push) into a new job folder;
              in-process, so without the CLI's start (~0.35 s) and the launch
  orch-again  the same for the same job with nothing changed (digests cached, the host's
              folder answering with its manifest token)
  rsync-first / rsync-again   `rsync -a -e 'ssh -F <config>' src/ host:dst/`, fresh, then again
  tar         tar -cf - -C src . | ssh host 'mkdir -p dst && tar -xf - -C dst'
Use `--dir /dev/shm`: on this machine's disk a file create costs 0.3 ms (100,000 files:
30 s for every method alike, the kernel's, not the tools').

    .venv/bin/python bench/push.py --many 100000 --imagenet 10000 --reps 3 --dir /dev/shm

--profile adds, for the small set: cProfile of the controller side of one push, the
stream built without a network (controller CPU), and the agent's `receive` fed that stream
from a file, timed and profiled (host CPU). Temporary data (over 2 GiB) is removed at the end.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from common import (
    REPO,
    SshdCluster,
    clean_env,
    fake_cluster,
    median,
    print_table,
    save_json,
    timed_run,
)
from sshd_cluster import descendants_of

sys.path.insert(0, str(REPO))

from orchestrator.config.inventory import load
from orchestrator.files import splitdata
from orchestrator.files.localfiles import DigestCache, LocalFile
from orchestrator.files.sync import push, stream_files
from orchestrator.remote.bundle import BOOT, agent_argv, agent_stdin
from orchestrator.remote.link import Link
from orchestrator.ssh.connect import connect as connect_host
from orchestrator.ssh.sshconfig import ssh_config
from orchestrator.wire import protocol

MB = 1e6
TICK = os.sysconf("SC_CLK_TCK")
NAN = float("nan")
TARGET = 0.80


# ---------------------------------------------------------------- data

def make_big(root: Path, mib: int) -> None:
    """One random file; the name is a record name so that `orch split-data` takes it."""
    root.mkdir(parents=True)
    block = 64 << 20
    with open(root / "train-00000-of-00001", "wb") as f:
        left = mib << 20
        while left:
            n = min(block, left)
            f.write(os.urandom(n))
            left -= n


def make_small(root: Path, count: int, kib: int) -> None:
    """count files of kib KiB in folders of 100 (an ImageFolder, for `orch split-data`)."""
    payload = os.urandom(count * kib * 1024)
    per = kib * 1024
    for i in range(count):
        d = root / f"class{i // 100:03d}"
        if i % 100 == 0:
            d.mkdir(parents=True)
        (d / f"img_{i:05d}.bin").write_bytes(payload[i * per:(i + 1) * per])


def local_files(src: Path, cache: DigestCache) -> list[LocalFile]:
    """What sync.push sends: every file under src with its size, mode and sha256."""
    files = []
    for top, dirs, names in os.walk(src):
        dirs.sort()
        for n in sorted(names):
            path = os.path.join(top, n)
            st = os.stat(path)
            rel = os.path.relpath(path, src)
            files.append(LocalFile(rel, path, st.st_size, 0o644, cache.digest(path, st)))
    return files


def tree_size(root: Path) -> tuple[int, int]:
    count = total = 0
    for top, _dirs, names in os.walk(root):
        for n in names:
            if not n.startswith(".orch"):
                count += 1
                total += os.path.getsize(os.path.join(top, n))
    return count, total


@dataclass
class DataSet:
    name: str
    src: Path
    files: int
    bytes: int
    local: list[LocalFile] = field(default_factory=list)
    hash_s: float = float("nan")     # building the file list with a cold digest cache
    cached_s: float = float("nan")   # the same with the digests cached (a second orch up)


def prepare(name: str, src: Path, work: Path) -> DataSet:
    files, total = tree_size(src)
    ds = DataSet(name, src, files, total)
    cache_path = work / f"digests-{name}.json"
    t = time.perf_counter()
    cache = DigestCache(cache_path)
    ds.local = local_files(src, cache)
    ds.hash_s = time.perf_counter() - t
    cache.save()
    t = time.perf_counter()
    local_files(src, DigestCache(cache_path))
    ds.cached_s = time.perf_counter() - t
    return ds


# ---------------------------------------------------------------- CPU accounting

def proc_cpu(pid: int) -> float:
    """utime + stime + reaped children's, of one process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / TICK


def host_cpu(cluster: SshdCluster) -> float:
    """CPU seconds the fake host has spent so far: its sshd and every session under it
    (sshd, shell, tar or the agent), alive or already reaped into a parent's counters."""
    root = cluster.hosts[0].pid
    return sum(proc_cpu(p) for p in [root, *descendants_of(root)])


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@dataclass
class Sample:
    wall: float
    ctl_cpu: float   # CPU seconds on the controller side (tar + ssh, or orch's process)
    host_cpu: float  # on the host: sshd and what runs under it (tar -x, or the agent)

    @property
    def cpu(self) -> float:
        return self.ctl_cpu + self.host_cpu


# ---------------------------------------------------------------- methods

@dataclass
class Bench:
    cluster: SshdCluster
    work: Path
    dest_root: Path                 # on the fake host
    link: Link | None = None
    connect_s: list[float] = field(default_factory=list)
    counter: int = 0
    e2e: E2E | None = None

    def fresh(self, tag: str) -> Path:
        self.counter += 1
        return self.dest_root / f"{tag}-{self.counter}"

    @property
    def host(self):
        return self.cluster.hosts[0]


def baseline_run(b: Bench, cmd: list[str], what: str) -> Sample:
    """A baseline command timed, with its CPU here (children) and on the host (sshd's)."""
    host0, local0 = host_cpu(b.cluster), children_cpu()
    run = timed_run(cmd, env=clean_env(), timeout=900)
    if not run.ok:
        raise SystemExit(f"{what} failed: {run.tail()}")
    time.sleep(0.2)  # let sshd reap the session, so its CPU is counted
    return Sample(run.seconds, children_cpu() - local0, host_cpu(b.cluster) - host0)


def tar_to_host(b: Bench, src: Path, cipher: str | None = None) -> tuple[Path, Sample]:
    """`tar -cf - | ssh host tar -xf -` of src into a new folder on the host."""
    dst = b.fresh("tar")
    opt = f"-c {cipher} " if cipher else ""
    cmd = (f"set -o pipefail; tar -cf - -C {src} . | ssh -F {b.cluster.ssh_config} {opt}"
           f"{b.host.address} 'mkdir -p {dst} && tar -xf - -C {dst}'")
    return dst, baseline_run(b, ["bash", "-c", cmd], "tar baseline")


def tar_once(b: Bench, ds: DataSet, cipher: str | None) -> Sample:
    dst, sample = tar_to_host(b, ds.src, cipher)
    check_dest(dst, ds)
    return sample


def connect(b: Bench) -> Link:
    """A fresh connection and agent for every orch rep, timed (tar pays for its ssh
    handshake too)."""
    if b.link is not None:
        b.link.close()
        b.link.transport.close()
    (b.work / "job.py").write_text(E2E_JOB)
    inv = b.cluster.write_inventory(b.work / "bench-cluster.yaml", name="bench-push")
    cluster = load(inv)
    t = time.perf_counter()
    b.link = Link(connect_host(cluster.hosts[0], ssh_config(), cluster.base_dir))
    b.link.start()
    b.connect_s.append(time.perf_counter() - t)
    return b.link


def orch_once(b: Bench, ds: DataSet, remote: dict | None = None) -> Sample:
    """push() as the brief's library call (remote=None: it asks the host for its manifest
    first), or with remote={} as `orch up` calls it (preflight brought the manifest)."""
    t_conn = connect(b)
    dst = b.fresh("orch")
    host0, local0 = host_cpu(b.cluster), time.process_time()
    t = time.perf_counter()
    report = push(t_conn, str(dst), ds.local, remote=remote)
    seconds = time.perf_counter() - t
    ctl, host = time.process_time() - local0, host_cpu(b.cluster) - host0
    if report.files != ds.files or report.bytes != ds.bytes:
        raise SystemExit(f"orch push reported {report.files} files {report.bytes} B, "
                         f"expected {ds.files} / {ds.bytes}")
    check_dest(dst, ds)
    return Sample(seconds, ctl, host)


def floor_once(b: Bench, ds: DataSet) -> Sample:
    """The transport alone: as many bytes through the same kind of channel into
    `cat > /dev/null` (no files, no headers, no hashing): orch's ceiling."""
    t_conn = connect(b)
    view = memoryview(bytes(1 << 20))
    host0, local0 = host_cpu(b.cluster), time.process_time()
    t = time.perf_counter()
    chan = t_conn.transport.open(["sh", "-c", "cat > /dev/null"], timeout=600)
    left = ds.bytes
    while left:
        n = min(left, len(view))
        chan.write(view[:n])
        left -= n
    chan.close_stdin()
    res = chan.finish()
    chan.close()
    seconds = time.perf_counter() - t
    if res.code != 0:
        raise SystemExit(f"cat > /dev/null failed: {res.stderr[-300:]!r}")
    return Sample(seconds, time.process_time() - local0, host_cpu(b.cluster) - host0)


def check_dest(dst: Path, ds: DataSet) -> None:
    got = tree_size(dst)
    if got != (ds.files, ds.bytes):
        raise SystemExit(f"{dst}: {got[0]} files {got[1]} B, expected {ds.files} / {ds.bytes}")
    if ds.files > 100:
        return  # removing 10,000 files slows the next run's creates: done after the set
    shutil.rmtree(dst)


# ---------------------------------------------------------------- end to end (orch up)

E2E_JOB = "import os\nprint('rank', os.environ['RANK'], 'ok', flush=True)\n"


@dataclass
class E2E:
    inventory: Path
    base: Path
    runs: int = 0
    totals: list[float] = field(default_factory=list)   # whole `orch up` runs


def e2e_setup(b: Bench, ds: DataSet) -> E2E:
    """A 1-worker split of the data set; one untimed `orch up` warms the digest cache."""
    base = b.work / f"e2e-{ds.name}"
    base.mkdir()
    splitdata.split(ds.src, base / "shards", 1)
    (base / "job.py").write_text(E2E_JOB)
    e = E2E(base / "cluster.yaml", base)
    up_fresh(b, ds, e)
    return e


def write_e2e_inventory(b: Bench, ds: DataSet, e: E2E, name: str) -> None:
    b.cluster.write_inventory(e.inventory, name=name, entrypoint="job.py", code_paths=["job.py"],
                              top={"data": {"source": str(ds.src),
                                            "shards": str(e.base / "shards")}})


def orch_up(e: E2E) -> tuple[float, float]:
    """Run `orch up`; (seconds from its "preflight: ... ok" line to its first "sync <host>:"
    line, i.e. the whole push phase as a user sees it; total seconds)."""
    argv = [sys.executable, "-m", "orchestrator", "up", str(e.inventory)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=e.base, env=clean_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marks: dict[str, float] = {}
    lines = []
    assert proc.stderr is not None  # stderr=PIPE
    for line in proc.stderr:
        lines.append(line)
        for key in ("preflight:", "sync "):
            if line.startswith(key) and key not in marks:
                marks[key] = time.perf_counter()
    code = proc.wait(900)
    total = time.perf_counter() - t0
    if code != 0 or len(marks) < 2:
        raise SystemExit(f"orch up failed ({code}): {''.join(lines)[-800:]}")
    return marks["sync "] - marks["preflight:"], total


def up_fresh(b: Bench, ds: DataSet, e: E2E) -> Sample:
    """`orch up` of a new job name: everything is pushed (digests are cached locally)."""
    e.runs += 1
    name = f"e2e-{ds.name}-{e.runs}"
    write_e2e_inventory(b, ds, e, name)
    sync_s, total = orch_up(e)
    e.totals.append(total)
    check_dest_job(b.host.remote_dir / name / "data", ds)
    if ds.files <= 100:
        shutil.rmtree(b.host.remote_dir / name)
    return Sample(sync_s, NAN, NAN)


def check_dest_job(data: Path, ds: DataSet) -> None:
    got = tree_size(data)
    if got != (ds.files, ds.bytes):
        raise SystemExit(f"{data}: {got[0]} files {got[1]} B, expected {ds.files} / {ds.bytes}")


# ---------------------------------------------------------------- the run

Method = Callable[[], Sample]


def methods_for(b: Bench, ds: DataSet, args: argparse.Namespace) -> dict[str, Method]:
    out: dict[str, Method] = {
        "tar": lambda: tar_once(b, ds, None),
        "orch": lambda: orch_once(b, ds),
    }
    if not args.no_gcm:
        out["tar-gcm"] = lambda: tar_once(b, ds, "aes128-gcm@openssh.com")
    if args.floor:
        out["orch-nomf"] = lambda: orch_once(b, ds, remote={})
        out["floor"] = lambda: floor_once(b, ds)
    if args.e2e:
        e = b.e2e = e2e_setup(b, ds)
        out["orch-e2e"] = lambda: up_fresh(b, ds, e)
    return out


def interleave(methods: dict[str, Method], reps: int) -> dict[str, list[Sample]]:
    """Rep by rep, every method once, rotating which goes first."""
    names = list(methods)
    samples: dict[str, list[Sample]] = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for n in order:
            s = methods[n]()
            samples[n].append(s)
            print(f"  rep {rep + 1}/{reps} {n:9s} {s.wall:7.2f} s wall, "
                  f"CPU {s.ctl_cpu:5.2f} s here + {s.host_cpu:5.2f} s on the host"
                  f" (load {os.getloadavg()[0]:.1f})", flush=True)
    return samples


def run_set(b: Bench, ds: DataSet, args: argparse.Namespace) -> dict:
    print(f"{ds.name}: {ds.files} files, {ds.bytes / MB:.0f} MB; file list with sha256 "
          f"{ds.hash_s:.2f} s cold, {ds.cached_s:.2f} s cached", flush=True)
    b.connect_s.clear()
    b.e2e = None
    load_before = os.getloadavg()
    samples = interleave(methods_for(b, ds, args), args.reps)
    shutil.rmtree(b.dest_root, ignore_errors=True)
    med = {n: median([x.wall for x in v]) for n, v in samples.items()}
    cpu = {n: [median([x.ctl_cpu for x in v]), median([x.host_cpu for x in v])]
           for n, v in samples.items()}
    conn = median(b.connect_s)
    return {"set": ds.name, "files": ds.files, "bytes": ds.bytes,
            "samples": {n: [[x.wall, x.ctl_cpu, x.host_cpu] for x in v]
                        for n, v in samples.items()},
            "median_s": med, "median_cpu_s": cpu, "connect_s": conn, "hash_s": ds.hash_s,
            "cached_s": ds.cached_s,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "orch_up_total_s": median(b.e2e.totals) if b.e2e else NAN}


def rows_for(res: dict) -> list[list]:
    mb = res["bytes"] / MB
    med, tar = res["median_s"], res["median_s"]["tar"]
    cpu = res["median_cpu_s"]
    rows = []
    for name, s in med.items():
        rows.append([res["set"], name, s, mb / s, tar / s, *cpu[name]])
    plus = med["orch"] + res["connect_s"]
    rows.append([res["set"], "orch+connect", plus, mb / plus, tar / plus, NAN, NAN])
    hashed = plus + res["hash_s"]
    rows.append([res["set"], "orch+connect+hash", hashed, mb / hashed, tar / hashed, NAN, NAN])
    return rows


# ---------------------------------------------------------------- profile

class Sink:
    """A channel that keeps nothing: the stream built with no network behind it."""

    def __init__(self, keep: io.BufferedWriter | None = None) -> None:
        self.keep, self.bytes = keep, 0

    def write(self, data) -> None:
        self.bytes += len(data)
        if self.keep:
            self.keep.write(data)


def profile(b: Bench, ds: DataSet) -> dict:
    """Where the CPU of one push goes: the controller's stream with no network behind it,
    the agent's receive fed that stream from a file, and the controller over SSH."""
    out: dict = {}
    t = time.process_time()
    stream_files(Sink().write, ds.local, None)
    out["controller_stream_cpu_s"] = time.process_time() - t
    stream = b.work / f"stream-{ds.name}.bin"
    with open(stream, "wb") as f:
        stream_files(Sink(f).write, ds.local, None)
        f.write(protocol.stream_item("end", delete=[]))
    out["receiver_wall_s"], out["receiver_cpu_s"] = agent_receive(stream, b.work / "recv", False)
    print("\n--- agent receive (host side), fed from a file; CPU profile by tottime:")
    agent_receive(stream, b.work / "recv", True)
    stream.unlink()
    print("\n--- controller side of one push over SSH; CPU profile by tottime:")
    out.update(profile_push(b, ds))
    return out


def profile_push(b: Bench, ds: DataSet) -> dict:
    prof = cProfile.Profile(time.process_time)
    t_conn = connect(b)
    dst = b.fresh("prof")
    host0, cpu0, t = host_cpu(b.cluster), time.process_time(), time.perf_counter()
    prof.enable()
    push(t_conn, str(dst), ds.local)
    prof.disable()
    out = {"push_wall_s": time.perf_counter() - t,
           "push_controller_cpu_s": time.process_time() - cpu0,
           "push_host_cpu_s": host_cpu(b.cluster) - host0}
    check_dest(dst, ds)
    pstats.Stats(prof).sort_stats("tottime").print_stats(16)
    return out


# Runs the agent as BOOT does, under a CPU-time profiler printed when the agent exits.
PROFILED_AGENT = """
import cProfile, os, pstats, sys, time
p = cProfile.Profile(time.process_time)
real_exit = os._exit
def report(code):
    p.disable()
    pstats.Stats(p, stream=sys.stderr).sort_stats("tottime").print_stats(14)
    sys.stderr.flush()
    real_exit(code)
os._exit = report
p.enable()
""" + BOOT


def agent_receive(stream: Path, dest: Path, profile: bool) -> tuple[float, float]:
    """The agent's `receive` (the same bundle the hosts get) fed a stream from a file."""
    shutil.rmtree(dest, ignore_errors=True)
    fed = stream.with_name("agent-stdin.bin")
    with open(fed, "wb") as f, open(stream, "rb") as src:
        f.write(agent_stdin() + protocol.request("receive", 1, root=str(dest)))
        shutil.copyfileobj(src, f, 1 << 20)
    argv = agent_argv(sys.executable)
    if profile:
        argv[3] = PROFILED_AGENT
    cpu0 = children_cpu()
    with open(fed, "rb") as f:
        t = time.perf_counter()
        p = subprocess.run(argv, stdin=f, capture_output=True)
        wall = time.perf_counter() - t
    fed.unlink()
    if p.returncode != 0 or b'"t": "error"' in p.stdout:
        raise SystemExit(f"agent receive failed: {p.stdout[-500:]!r} {p.stderr[-500:]!r}")
    if profile:
        print("\n".join(p.stderr.decode().splitlines()[:26]))
    shutil.rmtree(dest)
    return wall, children_cpu() - cpu0


# ---------------------------------------------------------------- many files

IMAGENET_BYTES = 110_000   # ImageNet train: 1.28 M JPEGs, about 140 GB


def make_many(root: Path, count: int, size: int) -> None:
    """count files in class folders of 1000: `size` bytes each, or a few bytes (0)."""
    payload = os.urandom(size) if size else b""
    for i in range(count):
        d = root / f"n{i // 1000:05d}"
        if i % 1000 == 0:
            d.mkdir(parents=True)
        (d / f"img_{i:07d}.JPEG").write_bytes(payload[:size - 8] + i.to_bytes(8, "big")
                                              if size else b"%d" % i)


@dataclass
class Many:
    name: str
    src: Path
    files: int
    bytes: int
    inventory: Path
    runs: int = 0


def many_setup(b: Bench, name: str, count: int, size: int) -> Many:
    src = b.work / name / "src"
    make_many(src, count, size)
    splitdata.split(src, b.work / name / "shards", 1)
    (b.work / name / "job.py").write_text(E2E_JOB)
    files, total = tree_size(src)
    # data written this instant is never remembered (localfiles.racy): a user's data is
    # older than two seconds, and so is this set when its first push starts
    time.sleep(2.1)
    return Many(name, src, files, total, b.work / name / "cluster.yaml")


def warm_imports() -> None:
    """What the `orch` command has done before its first connect, done once before the
    reps: its imports (the CLI's start, which orch_sync leaves out) and the agent's
    bundle. Without it the first orch rep alone carries them (0.3-0.5 s)."""
    from orchestrator.api import launching  # noqa: F401
    from orchestrator.remote.bundle import bundle
    from orchestrator.session import session  # noqa: F401
    from orchestrator.ssh import connect, sshconfig, sshtransport  # noqa: F401
    bundle()


def orch_sync(b: Bench, m: Many, fresh: bool) -> Sample:
    """`orch up`'s steps up to the launch, in this process: a new job (cold digest cache)
    when fresh, else the last one again with nothing changed."""
    from orchestrator.api import launching
    from orchestrator.session.session import Session
    if fresh:
        m.runs += 1
        for cache in ("digests.bin", "digests.json"):   # cold: no digest, no memo
            (m.inventory.parent / ".orch" / cache).unlink(missing_ok=True)
    name = f"{m.name}-{m.runs}"
    b.cluster.write_inventory(m.inventory, name=name, entrypoint="job.py", code_paths=["job.py"],
                              top={"data": {"source": str(m.src),
                                            "shards": str(m.inventory.parent / "shards")}})
    host0, cpu0, t = host_cpu(b.cluster), time.process_time(), time.perf_counter()
    cluster = load(m.inventory)
    listing = launching.Listing(cluster, launching.UpProgress())   # as launching.start
    session = Session(cluster)
    session.warm, session.expected = False, listing.first
    try:
        pre = session.open_and_preflight()
        sent = session.sync(listing.first(), pre)[0]["data"].files
        listing.get()
    finally:
        session.close()
    seconds = time.perf_counter() - t
    if sent != (m.files if fresh else 0):
        raise SystemExit(f"orch sent {sent} files, expected {m.files if fresh else 0}")
    if fresh:
        check_many(b.host.remote_dir / name / "data" / "worker_0_of_1", m)
    return Sample(seconds, time.process_time() - cpu0, host_cpu(b.cluster) - host0)


def rsync_once(b: Bench, m: Many, fresh: bool) -> Sample:
    dst = b.fresh("rsync") if fresh else b.dest_root / f"rsync-{b.counter}"
    cmd = ["rsync", "-a", "-e", f"ssh -F {b.cluster.ssh_config}", f"{m.src}/",
           f"{b.host.address}:{dst}/"]
    sample = baseline_run(b, cmd, "rsync")
    if fresh:
        check_many(dst, m)
    return sample


def tar_many(b: Bench, m: Many) -> Sample:
    dst, sample = tar_to_host(b, m.src)
    check_many(dst, m)
    shutil.rmtree(dst)
    return sample


def check_many(dst: Path, m: Many) -> None:
    got = tree_size(dst)
    if got != (m.files, m.bytes):
        raise SystemExit(f"{dst}: {got[0]} files {got[1]} B, expected {m.files} / {m.bytes}")


def run_many(b: Bench, m: Many, reps: int) -> dict:
    """Rep by rep: each first push (rotating which goes first), then each nothing-changed
    one; an rsync-again follows its own rsync-first, orch-again its own orch-first."""
    print(f"{m.name}: {m.files} files, {m.bytes / MB:.0f} MB", flush=True)
    warm_imports()
    load_before = os.getloadavg()
    first = {"orch-first": lambda: orch_sync(b, m, True),
             "rsync-first": lambda: rsync_once(b, m, True), "tar": lambda: tar_many(b, m)}
    again = {"orch-again": lambda: orch_sync(b, m, False),
             "rsync-again": lambda: rsync_once(b, m, False)}
    samples: dict[str, list[Sample]] = {n: [] for n in [*first, *again]}
    for rep in range(reps):
        names = list(first)
        names = names[rep % 3:] + names[:rep % 3]
        for n in names:
            samples[n].append(first[n]())
            if n == "rsync-first":
                samples["rsync-again"].append(again["rsync-again"]())
                shutil.rmtree(b.dest_root / f"rsync-{b.counter}")
            elif n == "orch-first":
                samples["orch-again"].append(again["orch-again"]())
                shutil.rmtree(b.host.remote_dir / f"{m.name}-{m.runs}")
        print(f"  rep {rep + 1}/{reps}: " + ", ".join(f"{n} {v[-1].wall:.2f} s"
                                                     for n, v in samples.items())
              + f" (load {os.getloadavg()[0]:.1f})", flush=True)
    return {"set": m.name, "files": m.files, "bytes": m.bytes,
            "samples": {n: [[x.wall, x.ctl_cpu, x.host_cpu] for x in v]
                        for n, v in samples.items()},
            "median_s": {n: median([x.wall for x in v]) for n, v in samples.items()},
            "median_cpu_s": {n: [median([x.ctl_cpu for x in v]), median([x.host_cpu for x in v])]
                             for n, v in samples.items()},
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}


def report_many(results: list[dict], reps: int) -> None:
    rows = []
    for res in results:
        med, cpu = res["median_s"], res["median_cpu_s"]
        best_first = min(med["rsync-first"], med["tar"])
        for n, s in med.items():
            base = best_first if n.endswith("first") or n == "tar" else med["rsync-again"]
            rows.append([res["set"], n, s, base / s, *cpu[n]])
    print_table(f"many files, 1 fake sshd host, median of {reps} interleaved reps",
                ["data", "method", "wall s", "best baseline / this", "CPU here", "CPU host"], rows)
    for res in results:
        med = res["median_s"]
        first = min(med["rsync-first"], med["tar"]) / med["orch-first"]
        extra = med["orch-again"] - med["rsync-again"]
        print(f"{res['set']}: first push {first:.2f} of the better of rsync and tar "
              f"({'meets' if first >= 0.9 else 'BELOW'} 0.9); nothing changed: orch "
              f"{med['orch-again']:.2f} s = rsync {med['rsync-again']:.2f} s "
              f"{extra:+.2f} s ({'meets' if extra <= 1.0 else 'ABOVE'} +1 s); load average "
              f"{fmt_load(res['loadavg_before'])} -> {fmt_load(res['loadavg_after'])}")


def main_many(args: argparse.Namespace) -> int:
    os.environ.update(ORCH_SSH_CONFIG=os.devnull, ORCH_NO_COLOR="1")
    work = Path(tempfile.mkdtemp(prefix="orch-bench-many-", dir=args.dir))
    sets = [(f"tiny-{n}", n, 0) for n in args.many] + \
        [(f"imagenet-{n}", n, IMAGENET_BYTES) for n in args.imagenet]
    results = []
    try:
        with fake_cluster(1, root=work / "cluster-root") as cluster:
            b = Bench(cluster, work, cluster.hosts[0].remote_dir / "bench")
            for name, count, size in sets:
                b.dest_root.mkdir(parents=True, exist_ok=True)   # rsync makes only dst
                m = many_setup(b, name, count, size)
                results.append(run_many(b, m, args.reps))
                shutil.rmtree(work / name)
                shutil.rmtree(b.dest_root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report_many(results, args.reps)
    path = save_json("push-many.json", {"results": results, "argv": sys.argv[1:]})
    print(f"raw samples: {path}")
    return 0


# ---------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--only", choices=("big", "small"), help="one data set only")
    p.add_argument("--big-mib", type=int, default=1024)
    p.add_argument("--small-count", type=int, default=10_000)
    p.add_argument("--small-kib", type=int, default=10)
    p.add_argument("--no-gcm", action="store_true", help="skip the tar + aes128-gcm run")
    p.add_argument("--e2e", action="store_true", help="also time `orch up` end to end")
    p.add_argument("--floor", action="store_true",
                   help="also time orch's transport alone (bytes into `cat > /dev/null`)")
    p.add_argument("--profile", action="store_true", help="profile one small-file push")
    p.add_argument("--many", type=counts, default=[],
                   help="file counts of tiny-file sets (e.g. 100000,1000000): orch up's "
                        "first and nothing-changed push against rsync -a and tar | ssh")
    p.add_argument("--imagenet", type=counts, default=[],
                   help="file counts of 110 KB-file sets (ImageNet-shaped), as --many")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                   help="where the temporary data goes (default: %(default)s)")
    return p.parse_args()


def counts(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x]


def build_sets(work: Path, args: argparse.Namespace) -> list[DataSet]:
    sets = []
    if args.only in (None, "big"):
        make_big(work / "big", args.big_mib)
        sets.append(prepare("big", work / "big", work))
    if args.only in (None, "small"):
        make_small(work / "small", args.small_count, args.small_kib)
        sets.append(prepare("small", work / "small", work))
    return sets


def main() -> int:
    args = parse_args()
    if args.many or args.imagenet:
        return main_many(args)
    os.environ.update(ORCH_SSH_CONFIG=os.devnull, ORCH_NO_COLOR="1")
    work = Path(tempfile.mkdtemp(prefix="orch-bench-push-", dir=args.dir))
    results, profiled = [], {}
    try:
        sets = build_sets(work, args)
        with fake_cluster(1, root=work / "cluster-root") as cluster:
            b = Bench(cluster, work, cluster.hosts[0].remote_dir / "bench")
            for ds in sets:
                results.append(run_set(b, ds, args))
            small = [ds for ds in sets if ds.name == "small"]
            if args.profile and small:
                profiled = profile(b, small[0])
            if b.link is not None:   # the last orch rep's connection (connect() closes the others)
                b.link.close()
                b.link.transport.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results, profiled, args)
    return 0


def report(results: list[dict], profiled: dict, args: argparse.Namespace) -> None:
    rows = [r for res in results for r in rows_for(res)]
    print_table(f"data push, 1 fake sshd host, median of {args.reps} interleaved reps",
                ["data", "method", "wall s", "MB/s", "vs tar", "CPU here", "CPU host"], rows)
    for res in results:
        ratio = res["median_s"]["tar"] / res["median_s"]["orch"]
        verdict = "meets" if ratio >= TARGET else "BELOW"
        print(f"{res['set']}: orch/tar throughput {ratio:.2f} ({verdict} target {TARGET}); "
              f"connect {res['connect_s']:.2f} s; sha256 list {res['hash_s']:.2f} s cold, "
              f"{res['cached_s']:.2f} s cached; load average {fmt_load(res['loadavg_before'])}"
              f" -> {fmt_load(res['loadavg_after'])} ({os.cpu_count()} cores)")
        if res["orch_up_total_s"] == res["orch_up_total_s"]:
            print(f"{res['set']}: whole `orch up` (push + torchrun launch + job) median "
                  f"{res['orch_up_total_s']:.2f} s")
    if profiled:
        print("profile (small set): " + ", ".join(f"{k} {v:.2f}" for k, v in profiled.items()))
    path = save_json("push.json", {"results": results, "profile": profiled, "argv": sys.argv[1:]})
    print(f"raw samples: {path}")


def fmt_load(load: tuple) -> str:
    return "/".join(f"{x:.1f}" for x in load)


if __name__ == "__main__":
    sys.exit(main())
