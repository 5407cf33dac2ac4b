"""GPU facts from nvidia-smi, and claims: which job holds which GPU of this host.

A claim is an exclusive flock on a file of the claiming user's own (mode 0600), one per
GPU, named by the GPU's UUID, in a folder of root's that is sticky (CLAIMS_DIR, made once
by an admin): no other ordinary user can open, lock, delete, rename or replace it, and
the folder's owner is root, not whichever user came first. The kernel drops the lock
when the last process holding it ends, so a claim never outlives its job: the agent takes
it at preflight, the job's supervisor inherits it at its fork (agent/supervisor.py) and
holds it until torchrun has ended. Who holds a claim is the file's owner; its job is what
a .info file of the same owner says. A GPU with a compute process on it that no claim
covers is busy too (another user's notebook, a job started by hand). Stdlib only,
Python 3.8; docs/explanation/security.md says what this promises, and against whom."""
from __future__ import annotations

import errno
import os
import time

from orchestrator.wire import jsonc, timeouts

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any

    from orchestrator.agent.main import Request

# made once by an admin (root, 1777) where no cleaner ages files and a reboot keeps it;
# the host's environment may name another (ORCH_GPU_CLAIMS_DIR), checked the same way
CLAIMS_DIR = "/var/lib/orch-gpu-claims"
CLAIMS_PROBLEM = "GPU claims: "   # a ClaimsFolderError's text: this, the problem,
FIX = "; fix: "                   # this, the fix (session/gpuclaims.py splits them)
MAX_NAMES = 100000      # names in the claims folder: more is a flood, refused whole
STALE_S = 60.0          # a temporary name of ours this old was left by a killed agent
CLAIM_TRIES = 5         # claims that met on a GPU and let go: tries before "busy"
MAX_GPUS = 256          # lines of nvidia-smi taken: more is not a real host
MAX_APPS = 4096         # compute processes listed
OUTPUT_CAP = 1 << 20    # bytes of nvidia-smi output read
HOLDER_CAP = 4096       # bytes of a claim's .info read
QUERY_GPU = ["--query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total",
             "--format=csv,noheader,nounits"]
QUERY_APPS = ["--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"]
WAIT_POLL = 0.25        # a claim that waits tries again this often (the kernel tells no one)

HELD = {}   # type: dict[str, list[tuple[int, int]]]  # job dir -> [(GPU index, lock fd)]
FILES = {}  # type: dict[str, list[str]]  # job dir -> its claim files, deleted once free


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

# ---------------------------------------------------------------- the claims folder


class ClaimsFolderError(GpuError):
    """The claims folder cannot be trusted or used. Its text is CLAIMS_PROBLEM, what is
    wrong, FIX, the fix: the controller shows the fix as the message's fix line."""

    def __init__(self, problem: str, fix: str) -> None:
        GpuError.__init__(self, CLAIMS_PROBLEM + problem + FIX + fix)


def claims_dir() -> str:
    """The claims folder, checked before any claim is read or made: root's, sticky (or
    writable by root alone), not a link, below folders only root can change: then only
    a claim's owner and root can delete or rename it. Missing, root's agent makes it;
    anyone else's refuses with the admin's line (a user who made it could delete all)."""
    path = os.path.abspath(os.environ.get("ORCH_GPU_CLAIMS_DIR") or CLAIMS_DIR)
    make = "an admin makes it once: sudo install -d -m 1777 -o root -g root %s" % path
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if os.getuid() != 0:
            raise ClaimsFolderError("the claims folder %s does not exist" % path, make) from None
        st = make_folder(path, make)
    except OSError as e:
        raise ClaimsFolderError("the claims folder %s cannot be read (%s)" % (path, e.strerror),
                                make) from None
    import stat
    if not stat.S_ISDIR(st.st_mode):
        raise ClaimsFolderError("the claims folder %s is not a folder (a link?)" % path,
                                "an admin removes it (sudo rm %s), then %s" % (path, make))
    why = unsafe(st)
    if why:
        raise ClaimsFolderError("the claims folder %s %s" % (path, why), make)
    for parent in parents(path):
        why = unsafe(os.stat(parent))
        if why:
            raise ClaimsFolderError(
                "the claims folder %s is inside %s, which %s" % (path, parent, why),
                "use a folder whose parents only root can change (the default: %s)" % CLAIMS_DIR)
    if not hardlinks_protected():
        raise ClaimsFolderError(
            "fs.protected_hardlinks is 0: a user could link another's claim under a "
            "second GPU's name", "an admin sets it: sudo sysctl -w fs.protected_hardlinks=1")
    return path


def make_folder(path: str, make: str) -> os.stat_result:
    """Root's agent makes the folder as the admin's line would."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o1777)
    except FileExistsError:
        pass
    except OSError as e:
        raise ClaimsFolderError("the claims folder %s cannot be made (%s)" % (path, e.strerror),
                                make) from None
    return os.lstat(path)


def unsafe(st: os.stat_result) -> str | None:
    """Why an ordinary user could delete or swap what is in this folder; None if none can."""
    import stat
    if st.st_uid != 0:
        return "belongs to user %s, who could delete anyone's claims" % user_of(st.st_uid)
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return "is writable by other users and not sticky: any of them could delete claims"
    return None


def parents(path: str) -> list[str]:
    """The folders above `path`, links resolved (each is checked as the kernel finds it)."""
    out = [os.path.realpath(os.path.dirname(path))]
    while out[-1] != os.path.dirname(out[-1]):
        out.append(os.path.dirname(out[-1]))
    return out


def hardlinks_protected() -> bool:
    """A hard link to another user's file would show their claim under a second name.
    Unreadable (no /proc/sys): taken as the distributions' setting, 1."""
    try:
        with open("/proc/sys/fs/protected_hardlinks") as f:
            return f.read(8).strip() != "0"
    except OSError:
        return True


# ---------------------------------------------------------------- claim files and locks
#
# A claim is a file of its user's, mode 0600 (only its owner's processes can open, so
# lock, it), named gpu-<uuid>.<token>.claim, made under a temporary name, locked, then
# renamed into place: a claim name is locked from its first moment. What it says about
# its job is in <name>.info beside it (0644), trusted only when both have one owner, and
# only for the job's name unless that owner is this user. A GPU is held while any claim
# file of its UUID is locked (/proc/locks: the kernel's word, read without touching the
# file). Two claims that meet each lock first, then look: the later one always sees the
# earlier, and lets go (both may; they try again).


def token() -> str:
    return os.urandom(12).hex()   # unguessable: no one can take a name before its owner


def uuid_key(uuid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in uuid)[:128]


def claim_key(name: str) -> str | None:
    """The UUID key of a claim file's name; None for any other name."""
    if not (name.startswith("gpu-") and name.endswith(".claim")):
        return None
    key, _, tok = name[4:-6].rpartition(".")
    return key if key and tok else None


def listing(folder: str) -> list[tuple[str, os.stat_result]]:
    """Every name in the folder with its lstat. A folder flooded past MAX_NAMES is
    refused, never read in part: a claim not read would be a GPU taken twice."""
    out = []   # type: list[tuple[str, os.stat_result]]
    try:
        with os.scandir(folder) as it:
            for entry in it:
                if len(out) >= MAX_NAMES:
                    raise ClaimsFolderError(
                        "the claims folder %s holds over %d names" % (folder, MAX_NAMES),
                        "an admin removes the files of whoever filled it (ls -l shows them)")
                try:
                    out.append((entry.name, entry.stat(follow_symlinks=False)))
                except OSError:
                    continue   # gone since listed
    except OSError as e:
        raise GpuError("cannot read the GPU claims folder %s: %s" % (folder, e.strerror)) from None
    return out


def read_locks() -> list[tuple[int, int, int, int]]:
    """(pid, major, minor, inode) of every flock held, from /proc/locks (waiters' `->`
    lines left out). Read whole: a lock missed would be a claim missed."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise GpuError("cannot read /proc/locks (%s): no claim can be seen" % e.strerror) from None
    found = []
    for line in lines:
        cells = line.split()
        if len(cells) >= 6 and cells[1] == "FLOCK" and cells[-3].count(":") == 2:
            major, minor, inode = cells[-3].split(":")
            try:
                found.append((int(cells[4]), int(major, 16), int(minor, 16), int(inode)))
            except ValueError:
                continue
    return found


def locked_inodes(folder_dev: int, own: set[int]) -> set[int]:
    """Inodes of the folder's file system that a flock holds. /proc/locks names the file
    system's device, which stat may not (btrfs gives each subvolume its own): the device
    of our own locks in the folder (`own`) counts as the folder's too."""
    locks = read_locks()
    devs = {(os.major(folder_dev), os.minor(folder_dev))}
    devs |= {(ma, mi) for pid, ma, mi, ino in locks if ino in own and pid == os.getpid()}
    held = {ino for _, ma, mi, ino in locks if (ma, mi) in devs}
    if own - held:   # this file system's locks cannot be read: every claim would look free
        raise ClaimsFolderError(
            "locks on files in the claims folder do not show in /proc/locks as this "
            "process took them (a network file system, or another PID namespace's /proc?)",
            "an admin makes the folder on a local file system of the host")
    return held


def holders(folder: str, own: set[int]) -> dict[str, dict[str, Any]]:
    """UUID key -> the holder of a held claim, leaving out our own (`own` inodes)."""
    import stat
    names = listing(folder)
    held = locked_inodes(os.stat(folder).st_dev, own)
    out = {}   # type: dict[str, dict[str, Any]]
    for name, st in names:
        key = claim_key(name)
        if key is None or key in out or not stat.S_ISREG(st.st_mode) \
                or st.st_ino not in held or st.st_ino in own:
            continue
        out[key] = holder_from(os.path.join(folder, name), st.st_uid)
    return out


def holder_from(claim: str, uid: int) -> dict[str, Any]:
    """The user is the claim file's owner (the kernel's word); the job is what its .info
    says, if the same user wrote it. Another user's folder and part are left out: a
    claim could otherwise pass for this user's own job in `orch status`."""
    info = read_info(claim[:-len(".claim")] + ".info", uid)
    who = {"job": info.get("job", "?"), "user": user_of(uid)}
    if uid == os.getuid():
        who.update((k, info[k]) for k in ("job_dir", "part") if k in info)
    return who


def read_info(path: str, uid: int) -> dict[str, str]:
    """A claim's .info, capped; {} when missing, not a regular file, or another user's."""
    import stat
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return {}
        doc = jsonc.loads(os.read(fd, HOLDER_CAP).decode(errors="replace") or "{}")
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    if not isinstance(doc, dict):
        return {}
    return {k: str(doc[k])[:256] for k in ("job", "job_dir", "part") if k in doc}


def try_lock(fd: int) -> bool:
    import fcntl
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def new_private(folder: str, prefix: str) -> tuple[int, str]:
    """A new file of ours (0600, exclusive, no link followed), locked."""
    path = os.path.join(folder, prefix + token())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    if not try_lock(fd):   # no one else can open it: root only
        os.close(fd)
        os.unlink(path)
        raise OSError(errno.EAGAIN, "a new claim file was locked by another process")
    return fd, path


def new_claim(folder: str, uuid: str, who: dict[str, Any]) -> tuple[int, str]:
    """A claim on one GPU: locked, then given its name; its .info after."""
    fd, tmp = new_private(folder, ".new-")
    claim = os.path.join(folder, "gpu-%s.%s.claim" % (uuid_key(uuid), token()))
    try:
        os.rename(tmp, claim)
    except OSError:
        os.close(fd)
        os.unlink(tmp)
        raise
    try:
        info = os.open(claim[:-len(".claim")] + ".info",
                       os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.fchmod(info, 0o644)   # readable by all, whatever this user's umask
            os.write(info, jsonc.dumps(who).encode())
        finally:
            os.close(info)
    except OSError:   # the lock is the claim: without its .info the job shows as "?"
        pass
    return fd, claim


def remove_claim(claim: str) -> None:
    for path in (claim, claim[:-len(".claim")] + ".info"):
        unlink_quietly(path)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:   # gone already
        pass


def remove_if_free(claim: str) -> None:
    """Our claim file, deleted when no process holds it any more: a supervisor that
    inherited it keeps it (and its name) until it ends. Nothing locks a claim file again
    once let go, so a free one stays free."""
    try:
        fd = os.open(claim, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if os.fstat(fd).st_uid == os.getuid() and try_lock(fd):
            remove_claim(claim)
    finally:
        os.close(fd)


def sweep(folder: str, names: list[tuple[str, os.stat_result]]) -> None:
    """This user's claims left by ended jobs, and temporary names left by a killed agent
    (older than STALE_S), deleted. Other users' files are theirs to delete."""
    uid, now = os.getuid(), time.time()
    claims = {name for name, _ in names if claim_key(name) is not None}
    for name, st in names:
        if st.st_uid != uid:
            continue
        if name in claims:
            remove_if_free(os.path.join(folder, name))
        elif now - st.st_mtime > STALE_S and (name.startswith((".new-", ".probe-")) or (
                name.endswith(".info") and name[:-5] + ".claim" not in claims)):
            unlink_quietly(os.path.join(folder, name))


# ---------------------------------------------------------------- what is free, and taking it


def survey() -> dict[str, Any]:
    """Every GPU with its facts and its holder: {"job", "user", ...} for an orch claim,
    {"pids": [...]} for compute processes no claim covers, None when free."""
    return {"gpus": survey_in(claims_dir()), "time": time.time()}


def survey_in(folder: str) -> list[dict[str, Any]]:
    gpus_text, apps_text = smi(QUERY_GPU, QUERY_APPS)
    gpus, apps = parse_gpus(gpus_text), parse_apps(apps_text)
    claimed = probed_holders(folder)
    for g in gpus:
        procs = [{"pid": a["pid"], "mem": a["mem"], "user": pid_user(a["pid"])}
                 for a in apps if a["uuid"] == g["uuid"]][:64]
        holder = claimed.get(uuid_key(g["uuid"]))   # type: Any
        if holder is None and procs:
            holder = {"pids": procs}
        g["holder"], g["procs"] = holder, procs
    return gpus


def probed_holders(folder: str) -> dict[str, dict[str, Any]]:
    """holders(), with a lock of our own in the folder (a probe file) to learn the
    device /proc/locks names it by; a folder this user cannot write goes without."""
    try:
        fd, path = new_private(folder, ".probe-")
    except OSError:
        return holders(folder, set())
    try:
        return holders(folder, {os.fstat(fd).st_ino})
    finally:
        os.close(fd)
        os.unlink(path)


def choose(found: list[dict[str, Any]], want: Any) -> list[dict[str, Any]] | None:
    """The GPUs `want` asks for among the free ones: a count, "all" (at least one) or
    indexes; None when they are not free."""
    free = [g for g in found if g["holder"] is None]
    if isinstance(want, list):
        pick = [g for g in found if g["index"] in want]
        ok = len(pick) == len(want) and all(g["holder"] is None for g in pick)
    elif want == "all":
        pick, ok = free, bool(free)
    else:
        pick, ok = free[:int(want)], len(free) >= int(want)
    return pick if ok else None


def claim(job_dir: str, want: Any, who: dict[str, Any]) -> dict[str, Any]:
    """Take the GPUs `want` asks for. All or nothing: {"ids": [...]} taken (held by this
    agent until it ends or its supervisor inherits them), or {"busy": survey's GPUs}
    with none taken. A claim that met another's on a GPU tries again after a pause of
    its own length: the survey then shows who won."""
    release(job_dir)
    folder = claims_dir()
    sweep(folder, listing(folder))
    for _ in range(CLAIM_TRIES):
        found = survey_in(folder)
        pick = choose(found, want)
        if pick is None:
            return {"busy": found}
        got = take(folder, job_dir, pick, who)
        if got is not None:
            return dict(got, uuids=[g["uuid"] for g in found])
        time.sleep(0.01 + os.urandom(1)[0] / 255 * 0.05)
    return {"busy": survey_in(folder)}


def take(folder: str, job_dir: str, pick: list[dict[str, Any]],
         who: dict[str, Any]) -> dict[str, Any] | None:
    """Our claims on `pick`, each locked before it has its name; then, only then, a look
    for another held claim on the same GPUs: one found, ours are let go (None)."""
    mine = []   # type: list[tuple[int, int, str]]
    try:
        for g in pick:
            mine.append((g["index"],) + new_claim(folder, g["uuid"], who))
    except OSError as e:
        undo(mine)
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise ClaimsFolderError(
                "this user cannot make a claim in the claims folder %s (%s)" % (folder, e.strerror),
                "an admin lets every GPU user write it: sudo chmod 1777 %s" % folder) from None
        raise GpuError("cannot make a claim in the GPU claims folder %s: %s"
                       % (folder, e.strerror or e)) from None
    try:
        rivals = set(holders(folder, {os.fstat(fd).st_ino for _, fd, _ in mine}))
    except GpuError:
        undo(mine)
        raise
    if rivals & {uuid_key(g["uuid"]) for g in pick}:
        undo(mine)
        return None
    HELD[job_dir] = [(i, fd) for i, fd, _ in mine]
    FILES[job_dir] = [path for _, _, path in mine]
    return {"ids": [i for i, _, _ in mine]}


def undo(mine: list[tuple[int, int, str]]) -> None:
    """Claims this agent made and no process of ours inherited: closed and deleted."""
    for _, fd, path in mine:
        os.close(fd)
        remove_claim(path)


def release(job_dir: str) -> bool:
    """Let go of this agent's claims for the job. A supervisor it forked keeps its own
    copy of each lock until it ends: such a claim's file stays (remove_if_free)."""
    got = HELD.pop(job_dir, [])
    for _, fd in got:
        os.close(fd)
    for path in FILES.pop(job_dir, []):
        remove_if_free(path)
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
