"""The host side of orch: a stdlib-only script that runs on every host.

The controller never installs anything on a host. Each call sends the agent's source
(agent_jobs.py, then this file, as one script) on stdin to ``python -S -c BOOT <n>
<command> ...`` (see ``remote.py``); whatever stdin carries after those n bytes belongs
to the command (file streams, secrets). Python >= 3.8.

This file: common helpers, preflight, files (manifest, receive) and the dispatcher.
Commands print one JSON object (or a line protocol for ``follow``) on stdout.
No ``from __future__`` import here: this file is the second part of the script.
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
import time



UMASK = os.umask(0)
os.umask(UMASK)


def out(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def job_paths(job_dir: str) -> dict:
    job = os.path.abspath(os.path.expanduser(job_dir))
    names = ("code", "data", "logs", "run", "output")
    return dict({"job": job}, **{n: os.path.join(job, n) for n in names})


def read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    tmp = "%s.tmp-%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


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


def supervisor_alive(run_dir: str):
    sup = read_json(os.path.join(run_dir, "supervisor.json"))
    if not sup:
        return None
    if proc_start_time(sup["pid"]) != sup.get("start_ticks"):
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


def dir_writable(path: str):
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".orch-write-test-%d" % os.getpid())
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)
        return None
    except OSError as e:
        return "%s: %s" % (path, e.strerror or e)


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
        "writable": dir_writable(p["job"]), "time": time.time(),
        "hostname": socket.gethostname(),
        "ssh_connection": os.environ.get("SSH_CONNECTION", ""),
        "running": bool(supervisor_alive(p["run"])),
        "manifests": {f: manifest(p[f])["files"] for f in folders.split(",") if f},
    }
    if want_port == "1":
        report["port"] = port if port else free_port()
        report["port_free"] = port_free(report["port"])
    out(report)


# ---------------------------------------------------------------- files

def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_path(root: str) -> str:
    """<job>/run/<folder>-digests.json: beside, not inside, the folder it describes
    (data/ holds the shards and nothing else)."""
    root = root.rstrip("/")
    return os.path.join(os.path.dirname(root), "run", os.path.basename(root) + "-digests.json")


def load_cache(root: str) -> dict:
    return read_json(cache_path(root)) or {}


def save_cache(root: str, cache: dict) -> None:
    path = cache_path(root)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, json.dumps(cache).encode(), 0o644)
    except OSError:
        pass


def walk_files(root: str):
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(root, rel)))
        except OSError:
            continue
        for e in entries:
            r = rel + "/" + e.name if rel else e.name
            if e.is_dir(follow_symlinks=False) and e.name.startswith(STAGING):
                import shutil   # a killed receiver's staging folder: never promoted
                shutil.rmtree(e.path, ignore_errors=True)
            elif e.is_dir(follow_symlinks=False):
                stack.append(r)
            elif ".orch-part-" in e.name:
                # left by a receiver that was killed (SIGKILL, host crash); manifests are
                # made before a push, when no receiver writes here
                os.unlink(e.path)
            elif e.is_file(follow_symlinks=False):
                yield r, e.stat(follow_symlinks=False)


def cmd_manifest(root: str) -> None:
    out(manifest(root))


def manifest(root: str) -> dict:
    """{relpath: [size, sha256]} of a folder; digests cached by (size, mtime, inode).

    A file changed by hand gets a new mtime and is hashed again; the cache makes a
    second `orch up` with nothing to send cost a stat per file, not a read.
    """
    root = os.path.realpath(os.path.expanduser(root))   # the same cache as receive's
    cache, fresh, files = load_cache(root), {}, {}
    for rel, st in walk_files(root):
        key = "%d:%d:%d" % (st.st_size, st.st_mtime_ns, st.st_ino)
        digest = cache.get(rel, [None, None])
        digest = digest[1] if digest[0] == key else sha256_file(os.path.join(root, rel))
        fresh[rel] = [key, digest]
        files[rel] = [st.st_size, digest]
    if os.path.isdir(root):
        save_cache(root, fresh)
    return {"root": root, "files": files}


def safe_join(root: str, rel: str, checked: set) -> str:
    """Refuse any path that would land outside root (absolute, .., links). `checked`
    holds the parent folders (relative) already verified, so a stream of many files in
    few folders checks and resolves each folder once."""
    if not rel or rel[0] == "/" or "\\" in rel or "\0" in rel:
        raise ValueError("unsafe path %r" % rel)
    parent_rel, _, name = rel.rpartition("/")
    if name in ("", ".", ".."):
        raise ValueError("unsafe path %r" % rel)
    if parent_rel not in checked:
        if parent_rel and any(p in ("", ".", "..") for p in parent_rel.split("/")):
            raise ValueError("unsafe path %r" % rel)
        parent = root + "/" + parent_rel if parent_rel else root
        # resolve before creating: makedirs through a planted link would escape
        real_parent = os.path.realpath(parent)
        if real_parent != root and not real_parent.startswith(root + os.sep):
            raise ValueError("path %r leaves %s" % (rel, root))
        os.makedirs(parent, exist_ok=True)
        checked.add(parent_rel)
    return root + "/" + rel


def receive_file(stream, root: str, head: dict, cache: dict, checked: set, buf,
                 staged: bool = False) -> None:
    """Write beside (.orch-part-), hash while writing, verify, then rename into place.
    A staged file (inside a staging folder no one reads) is written under its name."""
    path = safe_join(root, head["p"], checked)
    tmp = path if staged else "%s.orch-part-%d" % (path, os.getpid())
    h, mode = hashlib.sha256(), head.get("m", 0o644)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        receive_bytes(stream, fd, h, head["s"], head["p"], buf)
        if mode & UMASK:
            os.fchmod(fd, mode)
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)   # a broken stream never leaves a half-written file behind
        raise
    os.close(fd)
    if head.get("h") and h.hexdigest() != head["h"]:
        os.unlink(tmp)
        raise ValueError("digest mismatch for %s" % head["p"])
    if not staged:
        os.replace(tmp, path)
    cache[head["p"]] = ["%d:%d:%d" % (st.st_size, st.st_mtime_ns, st.st_ino), h.hexdigest()]


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


def prune_empty_dirs(root: str) -> None:
    for d, subdirs, files in os.walk(root, topdown=False):
        if d != root and not os.listdir(d):
            os.rmdir(d)


def grow_stdin_pipe() -> None:
    """sshd feeds us through a 64 KiB pipe: one wake-up per 64 KiB. 1 MiB (the default
    pipe-max-size) cut a 1 GiB push by a quarter. Linux only; harmless elsewhere."""
    try:
        import fcntl
        fcntl.fcntl(0, 1031, 1 << 20)   # F_SETPIPE_SZ
    except (OSError, ImportError, AttributeError):
        pass


STAGING = ".orch-staging-"


class Staging:
    """A top-level folder (a shard, a code package) that the host does not have yet is
    written into a staging folder under its final names and renamed into place as a
    whole at the end: one rename per folder instead of one per file. Folders the host
    has are updated file by file (write beside, rename)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.dir = "%s/%s%d" % (root, STAGING, os.getpid())
        self.tops: dict = {}
        self.checked: set = set()

    def wants(self, rel: str) -> bool:
        top = rel.split("/", 1)[0]
        if top not in self.tops:
            self.tops[top] = "/" in rel and not os.path.lexists(self.root + "/" + top)
            if self.tops[top]:
                os.makedirs(self.dir, exist_ok=True)
        return self.tops[top]

    def promote(self) -> None:
        """Every staged file was verified when written: move the folders into place
        (also after a broken stream, so that a resumed push sends only the rest)."""
        for top, staged in self.tops.items():
            if staged and os.path.lexists(self.dir + "/" + top):
                os.rename(self.dir + "/" + top, self.root + "/" + top)
        if os.path.isdir(self.dir):
            import shutil
            shutil.rmtree(self.dir, ignore_errors=True)


def receive_stream(stream, root: str, cache: dict, checked: set, staging: Staging) -> tuple:
    buf, decode, count, nbytes = bytearray(1 << 20), json.JSONDecoder().decode, 0, 0
    while True:
        line = stream.readline()
        if not line:
            raise EOFError("stream ended without its end marker")
        head = decode(line.decode())
        if "end" in head:
            return head, count, nbytes
        if staging.wants(head["p"]):
            receive_file(stream, staging.dir, head, cache, staging.checked, buf, staged=True)
        else:
            receive_file(stream, root, head, cache, checked, buf)
        count, nbytes = count + 1, nbytes + head["s"]


def cmd_receive(root: str) -> None:
    """Apply a stream: JSON header line + raw bytes per file, then {"end", "delete"}."""
    root = os.path.expanduser(root)
    os.makedirs(root, exist_ok=True)
    root = os.path.realpath(root)   # a remote_dir under a linked folder is fine
    grow_stdin_pipe()
    cache, checked, staging = load_cache(root), set(), Staging(root)
    try:
        head, count, nbytes = receive_stream(sys.stdin.buffer, root, cache, checked, staging)
    except BaseException:
        staging.promote()
        save_cache(root, cache)   # what did land is known next time
        raise
    staging.promote()
    for rel in head.get("delete", []):
        path = safe_join(root, rel, checked)
        if os.path.lexists(path):
            os.unlink(path)
        cache.pop(rel, None)
    if head.get("delete"):
        prune_empty_dirs(root)
    save_cache(root, cache)
    out({"files": count, "bytes": nbytes, "deleted": len(head.get("delete", []))})


def main(argv) -> None:
    # on a host the agent is one script (agent_jobs.py's source, then this file's)
    commands = {n[4:]: f for n, f in globals().items() if n.startswith("cmd_")}
    try:
        commands[argv[0]](*argv[1:])
    except (BrokenPipeError, KeyboardInterrupt):
        os._exit(1)
    except Exception as e:  # the controller turns this into a message naming the host
        out({"error": "%s: %s" % (type(e).__name__, e)})
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[2:] if sys.argv[1:2] and sys.argv[1].isdigit() else sys.argv[1:])
