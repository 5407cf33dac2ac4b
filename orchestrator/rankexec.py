"""Per-rank wrapper that torchrun starts on a host (stdlib only, copied to <job>/run/).

    torchrun ... <job>/run/rankexec.py <job dir> module|script <target> [args...]

It sends the rank's stdout and stderr straight into logs/rank-<RANK>.log (the child
writes the file itself: nothing is piped, so nothing is lost when the controller is
gone), records the child's pid, and on exit writes run/rank-<RANK>.exit with the code
and the time, which is how `orch` finds the earliest failure across hosts.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def start_ticks(pid: int):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def child_argv(kind: str, target: str, args: list) -> list:
    if kind == "module":
        return [sys.executable, "-u", "-m", target] + args
    return [sys.executable, "-u", target] + args


def main() -> int:
    job_dir, kind, target, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    rank = int(os.environ["RANK"])
    run = os.path.join(job_dir, "run")
    log = open(os.path.join(job_dir, "logs", "rank-%d.log" % rank), "ab", buffering=0)
    child = subprocess.Popen(child_argv(kind, target, args), stdout=log, stderr=log,
                             stdin=subprocess.DEVNULL)
    write_json(os.path.join(run, "rank-%d.pid" % rank),
               {"pid": child.pid, "start_ticks": start_ticks(child.pid), "time": time.time()})
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: child.send_signal(s))
    code = child.wait()
    write_json(os.path.join(run, "rank-%d.exit" % rank), {"code": code, "time": time.time()})
    # Exit as the child did, so that torchrun sees the same failure.
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
