"""The host side of orch: a stdlib-only script that runs on every host.

The controller never installs anything on a host. Each call sends the agent's source
(host/paths.py, host/ledger.py, agent_jobs.py, then this file, as one script) on stdin
to ``python -S -c BOOT <n> <command> ...`` (see ``remote.py``); whatever stdin carries
after those n bytes belongs to the command (file streams, secrets). Python >= 3.8.

This file: common helpers, preflight, files (manifest, receive) and the dispatcher.
Every path inside a job folder goes through host/paths.py's JobDir (no link followed).
Commands print one JSON object (or a line protocol for ``follow``) on stdout.
No ``from __future__`` import here: this file is the last part of the script.
"""

import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import time

try:  # on a host the modules below are parts of this one script; there is no package there
    from orchestrator.host.ledger import Ledger
    from orchestrator.host.paths import (PART, Dirs, JobDir, UnsafePath, create_excl,
                                         lstat_at, not_a, split_parent)
except ImportError:
    pass

UMASK = os.umask(0)
os.umask(UMASK)
STATE_CAP = 1 << 20   # supervisor.json, host.exit, rank-<r>.exit/.pid: tiny when orch wrote them


def out(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def job_paths(job_dir: str) -> dict:
    """The job folder (remote_dir resolved once: it may be a link) and its JobDir ("jd"),
    through which every read, write and delete inside it goes."""
    jd = JobDir(job_dir)
    names = ("code", "data", "logs", "run", "output")
    return dict({"job": jd.path, "jd": jd}, **{n: os.path.join(jd.path, n) for n in names})


def folder_of(root: str) -> tuple:
    """(JobDir, folder name) of a pushed folder given as <job dir>/<folder>."""
    root = os.path.abspath(os.path.expanduser(root)).rstrip("/")
    return JobDir(os.path.dirname(root)), os.path.basename(root)


def read_json(jd, rel: str):
    """A JSON state file of the job, None when missing, unreadable, a link or too big."""
    try:
        data = jd.read(rel, STATE_CAP)
        return json.loads(data.decode()) if data is not None else None
    except (OSError, ValueError):
        return None


def write_atomic(jd, rel: str, data: bytes, mode: int = 0o600) -> None:
    jd.write_file(rel, data, mode)


# ---------------------------------------------------------------- processes

def proc_start_time(pid: int):
    """Field 22 of /proc/<pid>/stat: tells a live pid from a recycled one. None for a
    zombie: a container's init may never reap our double-forked supervisor."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def has_marker(pid: int, marker: bytes) -> bool:
    try:
        if os.stat("/proc/%d" % pid).st_uid != os.getuid():
            return False  # never another user's process, even as root
        with open("/proc/%d/environ" % pid, "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def marked_pids(job_dir: str) -> list:
    """Every process of this job: its environment carries ORCH_JOB_DIR=<abs job dir>.

    torchrun puts each worker in a session of its own, so a process group alone misses
    them; the marker is inherited by torchrun, the workers and their data-loader children.
    """
    marker = ("ORCH_JOB_DIR=" + job_dir).encode()
    me = os.getpid()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return [p for p in pids if p != me and has_marker(p, marker)]


def supervisor_alive(p: dict):
    sup = read_json(p["jd"], "run/supervisor.json")
    if not sup:
        return None
    if not isinstance(sup.get("pid"), int) or proc_start_time(sup["pid"]) != sup.get("start_ticks"):
        return None
    return sup


def signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


# ---------------------------------------------------------------- preflight

def gpu_count() -> int:
    try:
        r = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, timeout=20)
        return sum(1 for l in r.stdout.decode().splitlines() if l.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def torch_version():
    """torch's version from its dist-info folder name: no import (seconds), no
    importlib.metadata scan. The agent runs with -S, so the site folders are computed."""
    import glob
    import site
    dirs = site.getsitepackages() + [site.getusersitepackages()] + sys.path
    venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")):   # -S skipped site's venv set-up
        dirs.insert(0, os.path.join(venv, "lib", "python%d.%d" % sys.version_info[:2],
                                    "site-packages"))
    for d in dirs:
        for info in sorted(glob.glob(os.path.join(d, "torch-*.dist-info"))):
            return os.path.basename(info)[len("torch-"):-len(".dist-info")]
    site.main()   # unusual layouts (eggs, .pth paths): let importlib.metadata search
    try:
        from importlib.metadata import version
        return version("torch")
    except Exception:  # not installed, or no importlib.metadata (Python < 3.8)
        return None


def port_free(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port() -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def dir_writable(p: dict):
    """None when the job folder can be made and written; else why not. A link at the job
    folder or at one of orch's folders or files in it is refused (UnsafePath) instead."""
    jd = p["jd"]
    try:
        jd.fd(create=True)
        jd.check_layout()
        probe = ".orch-write-test-%d" % os.getpid()
        os.close(jd.open_for_write(probe))
        jd.unlink(probe)
        return None
    except UnsafePath:
        raise
    except OSError as e:
        return "%s: %s" % (jd.path, e.strerror or e)


def cmd_preflight(job_dir: str, master_port: str, want_port: str, folders: str = "",
                  want_gpus: str = "0") -> None:
    """Everything preflight checks, plus the manifests of the job's code/ and data/
    folders (named in `folders`), which saves the push a round trip per host."""
    p = job_paths(job_dir)
    port = int(master_port)
    report = {
        "python": sys.version.split()[0], "executable": sys.executable,
        "torch": torch_version(), "job_dir": p["job"],
        "gpus": gpu_count() if want_gpus != "0" else 0,   # nvidia-smi costs 0.1-0.5 s
        "writable": dir_writable(p), "time": time.time(),
        "hostname": socket.gethostname(),
        "ssh_connection": os.environ.get("SSH_CONNECTION", ""),
        "running": bool(supervisor_alive(p)),
        "manifests": {f: manifest(p["jd"], f)["files"] for f in folders.split(",") if f},
    }
    if want_port == "1":
        report["port"] = port if port else free_port()
        report["port_free"] = port_free(report["port"])
    out(report)


# ---------------------------------------------------------------- files

STAGING = ".orch-staging-"


def is_leftover(name: str) -> bool:
    """Names only orch gives: a killed receiver's staging folder or half-written file."""
    return name.startswith(STAGING) or PART in name


def cmd_manifest(root: str) -> None:
    jd, folder = folder_of(root)
    out(manifest(jd, folder))


def manifest(jd, folder: str) -> dict:
    """{relpath: [size, sha256 or "link:<target>"]} of what orch pushed into the folder
    and is still there (host/ledger.py); digests kept by (size, mtime, inode).

    Files the job wrote there are not listed, so the controller never deletes them. A
    receiver that did not finish (its journal is there), or a host upgraded from the old
    digest cache, gets its staging folders and .orch-part- files removed first;
    manifests are made before a push, when no receiver writes here.
    """
    if jd.lstat(folder) is None:
        return {"root": jd.show(folder), "files": {}}
    ledger = Ledger(jd, folder)
    if ledger.interrupted or not ledger.found:
        jd.sweep(folder, is_leftover)
    if not ledger.found:   # the cache of orch before the ledger: every file, the job's too
        jd.unlink("run/%s-digests.json" % folder)
    files = ledger.manifest()
    ledger.save()
    return {"root": jd.show(folder), "files": files}


def receive_file(stream, dirs, base: str, head: dict, ledger, buf, staged: bool = False):
    """Write beside (.orch-part-, O_EXCL, no link followed), hash while writing, verify,
    then rename into place in the same folder descriptor. A staged file (inside a
    staging folder no one reads) is written under its name. Returns (stat, digest)."""
    parent, name = split_parent(base + "/" + head["p"])
    pfd = dirs.fd(parent)
    tmp = name if staged else "%s%s%d" % (name, PART, os.getpid())
    h, mode = hashlib.sha256(), head.get("m", 0o644) & 0o777
    if not isinstance(head["s"], int) or head["s"] < 0:
        raise ValueError("bad size %r for %s" % (head["s"], head["p"]))
    fd = create_excl(pfd, tmp, mode)
    try:
        receive_bytes(stream, fd, h, head["s"], head["p"], buf)
        if mode & UMASK:
            os.fchmod(fd, mode)
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=pfd)   # a broken stream never leaves a half-written file behind
        raise
    os.close(fd)
    if head.get("h") and h.hexdigest() != head["h"]:
        os.unlink(tmp, dir_fd=pfd)
        raise ValueError("digest mismatch for %s" % head["p"])
    if not staged:
        place(dirs.jd, pfd, tmp, name, base + "/" + head["p"])
    return st, h.hexdigest()


def place(jd, pfd: int, tmp: str, name: str, rel: str) -> None:
    """Rename tmp over name (a file or link there is replaced, never followed); a folder
    there (the job's) is refused with a fix."""
    try:
        os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
    except OSError:
        os.unlink(tmp, dir_fd=pfd)
        st = lstat_at(pfd, name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise not_a("file", jd.show(rel)) from None
        raise


def receive_link(dirs, base: str, head: dict):
    """{"p": rel, "link": target}: rel becomes a link to target (inside the folder only,
    checked by JobDir.symlink). Returns (stat of the link, "link:<target>")."""
    target = head["link"]
    if not isinstance(target, str):
        raise UnsafePath("unsafe link %r: its target is not a path" % head["p"])
    st = dirs.jd.symlink(base + "/" + head["p"], target)
    return st, "link:" + target


def receive_bytes(stream, fd: int, h, left: int, name: str, buf) -> None:
    view = memoryview(buf)
    while left:
        n = stream.readinto(view[:min(left, len(buf))])
        if not n:
            raise EOFError("stream ended inside %s" % name)
        chunk = view[:n]
        h.update(chunk)
        while chunk:
            chunk = chunk[os.write(fd, chunk):]
        left -= n


def prune_empty_dirs(jd, base: str, removed: list) -> None:
    """Remove the folders that deleting `removed` left empty (never base itself, never a
    folder that still holds anything, such as the job's own files)."""
    parents = set()
    for rel in removed:
        parts = rel.split("/")[:-1]
        parents.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    for d in sorted(parents, key=lambda r: -r.count("/")):
        jd.rmdir(base + "/" + d)


def grow_stdin_pipe() -> None:
    """sshd feeds us through a 64 KiB pipe: one wake-up per 64 KiB. 1 MiB (the default
    pipe-max-size) cut a 1 GiB push by a quarter. Linux only; harmless elsewhere."""
    try:
        import fcntl
        fcntl.fcntl(0, 1031, 1 << 20)   # F_SETPIPE_SZ
    except (OSError, ImportError, AttributeError):
        pass


class Staging:
    """A top-level folder (a shard, a code package) that the host does not have yet is
    written into a staging folder under its final names and renamed into place as a
    whole at the end: one rename per folder instead of one per file. Folders the host
    has are updated file by file (write beside, rename)."""

    def __init__(self, dirs, base: str) -> None:
        self.dirs, self.jd, self.base = dirs, dirs.jd, base
        self.dir = "%s/%s%d" % (base, STAGING, os.getpid())
        self.tops: dict = {}
        self.landed: list = []   # (rel, stat, digest) of staged files: recorded once in place

    def wants(self, rel: str) -> bool:
        top = rel.split("/", 1)[0]
        if top not in self.tops:
            self.tops[top] = "/" in rel and self.jd.lstat(self.base + "/" + top) is None
            if self.tops[top]:
                self.dirs.fd(self.dir)
        return self.tops[top]

    def promote(self, ledger) -> None:
        """Every staged file was verified when written: move the folders into place
        (also after a broken stream, so that a resumed push sends only the rest)."""
        moved = set()
        for top, staged in self.tops.items():
            if staged and self.jd.lstat(self.dir + "/" + top) is not None:
                self.jd.replace(self.dir + "/" + top, self.base + "/" + top)
                moved.add(top)
        ledger.record_many([(rel, st, digest) for rel, st, digest in self.landed
                            if rel.split("/", 1)[0] in moved])
        if any(self.tops.values()):
            self.dirs.close()
            self.jd.rmtree(self.dir)


def receive_stream(stream, dirs, base: str, ledger, staging: Staging) -> tuple:
    buf, decode, count, nbytes = bytearray(1 << 20), json.JSONDecoder().decode, 0, 0
    while True:
        line = stream.readline()
        if not line:
            raise EOFError("stream ended without its end marker")
        head = decode(line.decode())
        if "end" in head:
            return head, count, nbytes
        staged = staging.wants(head["p"])   # the path is checked where it is opened
        where = staging.dir if staged else base
        if "link" in head:
            st, digest = receive_link(dirs, where, head)
        else:
            st, digest = receive_file(stream, dirs, where, head, ledger, buf, staged)
        if staged:
            staging.landed.append((head["p"], st, digest))
        else:
            ledger.record(head["p"], st, digest)
        count, nbytes = count + 1, nbytes + head.get("s", 0)


def apply_deletes(jd, base: str, ledger, delete: list) -> int:
    """Delete only what orch pushed (in the ledger): a file or link the job made, or an
    excluded path, stays whatever the controller asks."""
    removed = []
    for rel in delete:
        split_parent(rel)   # an unsafe path is an error, even when unknown here
        if ledger.owns(rel):
            if jd.unlink(base + "/" + rel):
                removed.append(rel)
            ledger.forget(rel)
    prune_empty_dirs(jd, base, removed)
    return len(removed)


def cmd_receive(root: str) -> None:
    """Apply a stream: JSON header line + raw bytes per file ({"p", "link"} for a link,
    no bytes), then {"end", "delete"}."""
    jd, base = folder_of(root)
    os.close(jd.open_dir(base, create=True))   # a remote_dir under a linked folder is fine
    grow_stdin_pipe()
    ledger, dirs = Ledger(jd, base), Dirs(jd, create=True)
    ledger.begin()
    staging = Staging(dirs, base)
    try:
        try:
            head, count, nbytes = receive_stream(sys.stdin.buffer, dirs, base, ledger, staging)
        finally:
            staging.promote(ledger)   # also after a broken stream: a resumed push sends the rest
        deleted = apply_deletes(jd, base, ledger, head.get("delete", []))
    finally:
        dirs.close()
        ledger.save()   # what did land is known next time
    out({"files": count, "bytes": nbytes, "deleted": deleted})


def main(argv) -> None:
    # on a host the agent is one script (host/paths.py, host/ledger.py, agent_jobs.py, this file)
    commands = {n[4:]: f for n, f in globals().items() if n.startswith("cmd_")}
    try:
        commands[argv[0]](*argv[1:])
    except (BrokenPipeError, KeyboardInterrupt):
        os._exit(1)
    except UnsafePath as e:   # a path orch refuses: the message names it, `fix` says how
        out({"error": str(e), "fix": e.fix})
        sys.exit(1)
    except Exception as e:  # the controller turns this into a message naming the host
        out({"error": "%s: %s" % (type(e).__name__, e)})
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[2:] if sys.argv[1:2] and sys.argv[1].isdigit() else sys.argv[1:])
