"""GPU facts from nvidia-smi, and claims: which job holds which GPU of this host.

A claim is an exclusive flock on one file per GPU (named by its UUID) in a folder every
user of the host can write (CLAIMS_DIR, sticky like /tmp). The kernel drops the lock
when the last process holding it ends, so a claim never outlives its job and is never
stale: the agent takes it at preflight, the job's supervisor inherits it at its fork
(agent/supervisor.py) and holds it until torchrun has ended. The file's content names the
holder (job, user, folder) for whoever finds it busy; it is read, capped, never trusted.
A GPU with a compute process on it that no claim covers is busy too (another user's
notebook, a job started by hand). Stdlib only, Python 3.8."""
from __future__ import annotations

import errno
import json
import os
import time

from orchestrator.wire import timeouts

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any

    from orchestrator.agent.main import Request

CLAIMS_DIR = "/tmp/orch-gpu-claims"   # the host's environment may move it (ORCH_GPU_CLAIMS_DIR)
MAX_GPUS = 256          # lines of nvidia-smi taken: more is not a real host
MAX_APPS = 4096         # compute processes listed
OUTPUT_CAP = 1 << 20    # bytes of nvidia-smi output read
HOLDER_CAP = 4096       # bytes of a claim file read
QUERY_GPU = ["--query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total",
             "--format=csv,noheader,nounits"]
QUERY_APPS = ["--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"]
WAIT_POLL = 0.25        # a claim that waits tries again this often (the kernel tells no one)

HELD = {}   # type: dict[str, list[tuple[int, int]]]  # job dir -> [(GPU index, lock fd)]


class GpuError(Exception):
    """nvidia-smi cannot be run or answers nonsense: the message says which."""


def smi(*queries: list[str]) -> list[str]:
    """nvidia-smi's output for each query, all run at once (each call costs the driver's
    start-up, 0.1-0.5 s on a real host: they overlap)."""
    import subprocess  # only with GPUs asked for: its imports cost more than preflight
    procs = []
    try:
        for args in queries:
            procs.append(subprocess.Popen(["nvidia-smi"] + args, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE))
        return [answer(p) for p in procs]
    except OSError as e:
        raise GpuError("nvidia-smi cannot be run: %s" % (e.strerror or e)) from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def answer(p: Any) -> str:
    import subprocess
    try:
        out, err = p.communicate(timeout=timeouts.NVIDIA_SMI)
    except subprocess.TimeoutExpired:
        raise GpuError("nvidia-smi did not answer within %.0f s" % timeouts.NVIDIA_SMI) from None
    if p.returncode != 0:
        why = err.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise GpuError("nvidia-smi failed (exit %d): %s" % (p.returncode, why[0][:300]))
    text: str = out[:OUTPUT_CAP].decode(errors="replace")
    return text


def number(text: str) -> float | None:
    """A value nvidia-smi may give as `[N/A]` or `[Not Supported]`: None then."""
    try:
        return float(text)
    except ValueError:
        return None


def parse_gpus(text: str) -> list[dict[str, Any]]:
    """`index, uuid, name, util, used, total` per line; a name may hold ", "."""
    gpus = []
    for line in text.splitlines()[:MAX_GPUS]:
        cells = [c.strip() for c in line.split(", ")]   # nvidia-smi's separator
        if len(cells) < 6 or not cells[0].isdigit():
            continue
        gpus.append({"index": int(cells[0]), "uuid": cells[1][:128],
                     "name": ", ".join(cells[2:-3])[:128],
                     "util": number(cells[-3]), "mem_used": number(cells[-2]),
                     "mem_total": number(cells[-1])})
    return sorted(gpus, key=lambda g: g["index"])


def parse_apps(text: str) -> list[dict[str, Any]]:
    apps = []
    for line in text.splitlines()[:MAX_APPS]:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) == 3 and cells[1].isdigit():
            apps.append({"uuid": cells[0][:128], "pid": int(cells[1]), "mem": number(cells[2])})
    return apps


def user_of(uid: int) -> str:
    import pwd
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def pid_user(pid: int) -> str:
    try:
        return user_of(os.stat("/proc/%d" % pid).st_uid)
    except OSError:
        return "?"


# ---------------------------------------------------------------- the claim files


def claims_dir() -> str:
    """The shared folder of claims, made sticky and writable by all when this user makes
    it. A link there, or a folder another user could swap files in (not sticky), is
    refused: another user must not be able to steal or fake a claim."""
    path = os.environ.get("ORCH_GPU_CLAIMS_DIR") or CLAIMS_DIR
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o1777)
    except FileExistsError:
        pass
    except OSError as e:
        raise GpuError("cannot make the GPU claims folder %s: %s" % (path, e.strerror)) from None
    st = os.lstat(path)
    import stat
    if not stat.S_ISDIR(st.st_mode):
        raise GpuError("the GPU claims folder %s is not a folder (a link?)" % path)
    if st.st_uid not in (0, os.getuid()) and not st.st_mode & stat.S_ISVTX:
        raise GpuError("the GPU claims folder %s belongs to another user and is not "
                       "sticky" % path)
    return path


def claim_path(folder: str, uuid: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in uuid)[:128]
    return os.path.join(folder, "gpu-%s.lock" % safe)


def open_claim(path: str) -> int:
    """The claim file, made readable and writable by every user (anyone may need to
    lock it); never through a link."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except PermissionError:   # made by a user who kept it to themself: lockable read-only
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, 0o666)
    except OSError:
        pass
    return fd


def try_lock(fd: int) -> bool:
    import fcntl
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def read_holder(path: str) -> dict[str, Any]:
    """Who wrote the claim (as they said), capped; {} when unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        doc = json.loads(os.read(fd, HOLDER_CAP).decode(errors="replace") or "{}")
    except ValueError:
        return {}
    finally:
        os.close(fd)
    if not isinstance(doc, dict):
        return {}
    return {k: str(doc[k])[:256] for k in ("job", "user", "job_dir", "part") if k in doc}


def write_holder(fd: int, who: dict[str, Any]) -> None:
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(who).encode(), 0)
    except OSError:   # a read-only claim file: the lock is what counts
        pass


def locked_inodes() -> set[tuple[int, int, int]] | None:
    """(major, minor, inode) of every file with a flock on it, from /proc/locks: seeing a
    claim held takes no lock (a test lock could make another job's claim fail)."""
    try:
        with open("/proc/locks") as f:
            lines = f.read(OUTPUT_CAP).splitlines()
    except OSError:
        return None
    found = set()
    for line in lines:
        cells = line.split()
        if len(cells) >= 6 and cells[1] == "FLOCK" and cells[-3].count(":") == 2:
            major, minor, inode = cells[-3].split(":")
            try:
                found.add((int(major, 16), int(minor, 16), int(inode)))
            except ValueError:
                continue
    return found


def held(path: str, locks: set[tuple[int, int, int]] | None) -> bool:
    """Another process holds this claim."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if locks is not None:
        return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in locks
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:   # no /proc/locks: a test lock, let go at once
        import fcntl
        if try_lock(fd):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------- what is free, and taking it


def survey() -> dict[str, Any]:
    """Every GPU with its facts and its holder: {"job", "user", "job_dir", "part"} for an
    orch claim, {"pids": [...]} for compute processes no claim covers, None when free."""
    gpus_text, apps_text = smi(QUERY_GPU, QUERY_APPS)
    gpus, apps = parse_gpus(gpus_text), parse_apps(apps_text)
    folder = claims_dir()
    locks = locked_inodes()
    for g in gpus:
        path = claim_path(folder, g["uuid"])
        procs = [{"pid": a["pid"], "mem": a["mem"], "user": pid_user(a["pid"])}
                 for a in apps if a["uuid"] == g["uuid"]][:64]
        holder = None   # type: Any
        if held(path, locks):
            holder = read_holder(path) or {"job": "?", "user": "?"}
        elif procs:
            holder = {"pids": procs}
        g["holder"], g["procs"] = holder, procs
    return {"gpus": gpus, "time": time.time()}


def claim(job_dir: str, want: Any, who: dict[str, Any]) -> dict[str, Any]:
    """Take the GPUs `want` asks for: a count, "all" (every free one, at least one) or a
    list of indexes. All or nothing: {"ids": [...]} taken (held by this agent until it
    ends or its supervisor inherits them), or {"busy": survey's GPUs} with none taken."""
    release(job_dir)
    found = survey()["gpus"]
    free = [g for g in found if g["holder"] is None]
    if isinstance(want, list):
        pick = [g for g in found if g["index"] in want]
        ok = len(pick) == len(want) and all(g["holder"] is None for g in pick)
    elif want == "all":
        pick, ok = free, bool(free)
    else:
        pick, ok = free[:int(want)], len(free) >= int(want)
    if not ok:
        return {"busy": found}
    return take(job_dir, pick, found, who)


def take(job_dir: str, pick: list[dict[str, Any]], found: list[dict[str, Any]],
         who: dict[str, Any]) -> dict[str, Any]:
    """The locks, in index order (two orch jobs taking the same GPUs meet at the first);
    one taken under us by another job since the survey: all let go, busy."""
    folder = claims_dir()
    got = []   # type: list[tuple[int, int]]
    for g in pick:
        fd = open_claim(claim_path(folder, g["uuid"]))
        if not try_lock(fd):
            os.close(fd)
            for _, other in got:
                os.close(other)
            return {"busy": found}
        write_holder(fd, who)
        got.append((g["index"], fd))
    HELD[job_dir] = got
    return {"ids": [i for i, _ in got], "uuids": [g["uuid"] for g in found]}


def release(job_dir: str) -> bool:
    """Let go of this agent's claims for the job (its supervisor, once forked, keeps
    its own copy of each lock until it ends)."""
    got = HELD.pop(job_dir, [])
    for _, fd in got:
        os.close(fd)
    return bool(got)


def claim_waiting(job_dir: str, want: Any, who: dict[str, Any], wait_s: float) -> dict[str, Any]:
    """`claim`, tried again every WAIT_POLL for up to wait_s (`orch up --wait`): the
    controller shows the holders between tries."""
    deadline = time.monotonic() + wait_s
    while True:
        got = claim(job_dir, want, who)
        if "ids" in got or time.monotonic() >= deadline:
            return got
        time.sleep(WAIT_POLL)


def visible_env(ids: list[int]) -> dict[str, str]:
    """What the ranks see: only the claimed GPUs, numbered as nvidia-smi numbers them
    (PCI bus order: CUDA's default order is fastest first, which differs on mixed boxes)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def holder_of(p: dict[str, Any], part: str) -> dict[str, Any]:
    return {"job": os.path.basename(p["job"]), "user": user_of(os.getuid()),
            "job_dir": p["job"], "part": part, "pid": os.getpid(), "since": time.time()}


# ---------------------------------------------------------------- requests


def run_claim(req: Request) -> dict[str, Any]:
    """`orch up --wait`: claim (again), waiting up to wait_s on this host."""
    from orchestrator.agent import paths
    from orchestrator.agent.common import job_paths
    a = req.args
    p = job_paths(a["job_dir"])
    return claim_waiting(p["job"], a["want"], holder_of(p, paths.HOST_PART), a["wait_s"])


def run_release(req: Request) -> dict[str, Any]:
    """Let go of the claims (a wait for another host's GPUs starts over in order); a
    supervisor started warm inherited them, so it is cancelled too."""
    from orchestrator.agent import warm
    from orchestrator.agent.common import job_paths
    p = job_paths(req.args["job_dir"])
    waiting = warm.take(p["job"])
    if waiting is not None:
        waiting.cancel()
    return {"released": release(p["job"])}
