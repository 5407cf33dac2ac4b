"""Preflight: what the controller checks before anything starts (python, torch, GPUs,
remote_dir, master port, a running job) plus the manifests of code/ and data/."""
from __future__ import annotations

# _socket, not socket: socket.py wraps its constants in enums at import (5-7 ms of CPU
# at every host's preflight); binding a port and the host name need only the C module
import _socket
import os
import sys
import time

from orchestrator.agent import gpus, paths, procs
from orchestrator.agent.common import job_paths
from orchestrator.agent.paths import UnsafePath
from orchestrator.agent.procs import job_running
from orchestrator.wire import timeouts

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any

    from orchestrator.agent.main import Request


def gpu_count() -> int:
    import subprocess  # only with GPUs asked for: its imports cost more than preflight
    try:
        r = subprocess.run(["nvidia-smi", "-L"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, timeout=timeouts.NVIDIA_SMI)
        return sum(1 for line in r.stdout.decode().splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


def torch_version() -> str | None:
    """torch's version from its dist-info folder name: no import (seconds), no
    importlib.metadata scan. The agent runs with -S, so the site folders are computed."""
    import site
    dirs = site.getsitepackages() + [site.getusersitepackages()] + sys.path
    venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")):   # -S skipped site's venv set-up
        dirs.insert(0, os.path.join(venv, "lib", "python%d.%d" % sys.version_info[:2],
                                    "site-packages"))
    for d in dirs:
        for info in dist_infos(d, "torch"):
            return info[len("torch-"):-len(".dist-info")]
    site.main()   # unusual layouts (eggs, .pth paths): let importlib.metadata search
    try:
        from importlib.metadata import version
        return version("torch")
    except Exception:  # not installed, or no importlib.metadata (Python < 3.8)
        return None


def dist_infos(folder: str, name: str) -> list[str]:
    """The `<name>-*.dist-info` entries of folder, sorted, as glob.glob finds them; by
    listdir: glob's `re` and `enum` would stay in this agent and in the job's supervisor
    it forks (about 1.2 MiB each, on every host, for the run's length)."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    return sorted(e for e in entries if e.startswith(name + "-") and e.endswith(".dist-info"))


def port_free(port: int) -> bool:
    """Whether torchrun's store can listen there. SO_REUSEADDR as the store sets it: the
    TIME_WAIT a job that just ended leaves on the port does not hold the next one back."""
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    try:
        s.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        s.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port() -> int:
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    s.bind(("", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


def dir_writable(p: dict[str, Any]) -> str | None:
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


RUNNING = "running"   # a process of the job lives here
HELD = "held"         # none does, but another agent holds the job folder's lock


def running(p: dict[str, Any], folder_made: bool) -> str | None:
    """RUNNING: any of the job's processes alive. HELD: none is, but another `up` of this
    job holds the job folder's lock (one under way, or one whose controller was cut off
    and whose agent waits out RECEIVE_IDLE in a receive stream). None: neither; this
    clean answer keeps the lock until this agent ends: its launch then needs no second
    look at every process (agent/launch.py)."""
    claimed = procs.claim(p) if folder_made else None
    if job_running(p):   # an attached `up` holds the lock for the job's life: running
        if claimed:
            procs.release(p["job"])
        return RUNNING
    return HELD if claimed is False else None


SHARE = ".orch-share-"     # a preflight's marker in the job folder: .orch-share-<nonce>
SHARE_STALE = 3600.0       # a marker this old was left by a controller that was killed


def share_leader(p: dict[str, Any], share: dict[str, Any]) -> int:
    """Which host's marker this host finds in its job folder: its own index if it wrote
    the marker first, else the index of the host that did. Hosts that name the same
    leader see one job folder, whatever the mount (NFS, a bind mount, the same path)."""
    nonce = share["nonce"]
    if not nonce.isalnum():
        raise ValueError("bad share nonce %r" % nonce)
    sweep_markers(p["jd"])
    got = p["jd"].create_once(SHARE + nonce, str(share["index"]).encode())
    try:
        return int(got.decode())
    except ValueError:
        return int(share["index"])


def sweep_markers(jd: Any) -> None:
    """Markers of preflights whose controller never cleaned up (it was killed)."""
    now = time.time()
    try:
        with os.scandir(jd.fd()) as it:
            old = [e.name for e in it if e.name.startswith(SHARE)
                   and now - e.stat(follow_symlinks=False).st_mtime > SHARE_STALE]
    except OSError:
        return
    for name in old:
        jd.unlink(name)


def run_unshare(req: Request) -> dict[str, Any]:
    """Every host has answered its preflight: the marker has done its work."""
    return {"removed": unshare(job_paths(req.args["job_dir"]), req.args["nonce"])}


def unshare(p: dict[str, Any], nonce: str) -> bool:
    """This preflight's marker removed (by `unshare`, or by the launch that follows)."""
    return nonce.isalnum() and bool(p["jd"].unlink(SHARE + nonce))


def run(req: Request) -> dict[str, Any]:
    """Everything preflight checks, plus the manifests of the job's folders named in
    `folders` (code, data), which saves the push a round trip per host."""
    a = req.args
    p = job_paths(a["job_dir"])
    report = {
        "python": sys.version.split()[0], "executable": sys.executable,
        "torch": torch_version(), "job_dir": p["job"],
        "gpus": gpu_count() if a["want_gpus"] and "gpus" not in a else 0,   # 0.1-0.5 s
        "writable": dir_writable(p), "time": time.time(),
        "hostname": _socket.gethostname(),
        "ssh_connection": os.environ.get("SSH_CONNECTION", ""),
        "running": False,
    }
    busy = running(p, report["writable"] is None)
    report["running"] = busy is not None
    if busy == HELD:
        report["held"] = True
    if "share" in a and report["writable"] is None:
        report["share_leader"] = share_leader(p, a["share"])
    if "gpus" in a and report["writable"] is None and not report["running"]:
        claim_gpus(p, a["gpus"], report)
    if os.environ.get("ORCH_PYTHON_MISSING"):   # bundle.FALLBACK: `python:` is not there yet
        report["python_missing"] = os.environ["ORCH_PYTHON_MISSING"][:4096]
    # before the manifests and the port: the warm torchrun's seconds of imports begin
    # as early as this host is known to be fit
    if "warm" in a and not report["running"] and report["writable"] is None \
            and report["torch"] and "python_missing" not in report \
            and "gpu_busy" not in report and "gpu_error" not in report:
        from orchestrator.agent import warm
        env = dict(a["warm"]["env"])
        if "gpu_ids" in report:
            env.update(gpus.visible_env(report["gpu_ids"]))
        warm.prewarm(p, a["job_dir"], env)
    # imported after the prewarm: the supervisor it forks does not hold files.py's
    # hashlib (OpenSSL's, ~0.6 MiB) for the run's length
    from orchestrator.agent import files
    for folder in a["folders"]:
        if folder not in ("code", "data"):
            raise ValueError("unknown folder %r" % folder)
        files.send_manifest(req, folder, p["jd"], folder, a.get("expect", {}).get(folder))
    if a["want_port"]:
        port = a["master_port"] or free_port()
        report["port"], report["port_free"] = port, port_free(port)
    if "net" in a:   # after the port check: host 0 then listens on the master port
        from orchestrator.agent import network
        report["net"] = network.learn(a["net"], report.get("port", 0)
                                      if report.get("port_free") else 0)
    return report


def claim_gpus(p: dict[str, Any], want: Any, report: dict[str, Any]) -> None:
    """The job's GPUs, claimed now and held by this agent (then by the supervisor it
    forks) for the job's life: gpu_ids, or gpu_busy with every GPU's holder."""
    try:
        got = gpus.claim(p["job"], want, gpus.holder_of(p, paths.HOST_PART))
    except gpus.GpuError as e:
        report["gpu_error"] = str(e)
        return
    busy = got.get("busy")
    if busy is not None:
        report["gpus"], report["gpu_busy"] = len(busy), busy
    else:
        report["gpus"] = len(got["ids"])
        report["gpu_ids"], report["gpu_uuids"] = got["ids"], got["uuids"]
