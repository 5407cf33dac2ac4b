"""The host side of orch, part two: launch, follow, status and stop of a job.

Sent to the host together with agent.py as one script (see agent.py); imported from
there when run locally (tests), hence the guarded import below. Every file of the job
folder is reached through its JobDir (p["jd"], host/paths.py): no link is followed.
No ``from __future__`` import: this file is not the first part of that script.
"""
import json
import os
import signal
import subprocess
import sys
import time

try:  # on a host this file is concatenated with agent.py; there is no package there
    from orchestrator.agent import (job_paths, marked_pids, out, proc_start_time, read_json,
                                    signal_all, supervisor_alive, write_atomic)
except ImportError:
    pass

LOG_CAP = 4 << 20     # one read of a log file
ERROR_FILE_CAP = 1 << 20

HEARTBEAT_S = 1.0


# ---------------------------------------------------------------- launch

def clean_run_dir(p: dict) -> None:
    # code/ too: without `code:` in the inventory nothing was pushed, and a missing
    # entrypoint should fail as the rank's own error, not as a missing folder
    jd = p["jd"]
    for d in ("run", "logs", "output", "code"):
        os.close(jd.open_dir(d, create=True))   # a link at any of them is refused
    jd.check_layout()
    with jd.dirfd("run") as fd:
        names = os.listdir(fd)
    for name in names:
        if name.endswith((".exit", ".pid")) or name == "host.exit":
            jd.unlink("run/" + name)


def cmd_launch(job_dir: str, then: str = "") -> None:
    """Start the supervisor fully detached (double fork + setsid), report its pid.
    then="follow": go on as `follow ... events` in this process (saves `orch up` a
    remote command per host)."""
    # The spec (with the job's env: secrets) comes on stdin and is kept 0600. orch starts
    # this agent while preflight still runs; no spec (stdin closed) means: do nothing.
    data = sys.stdin.buffer.read()
    if not data:
        return
    spec = json.loads(data)
    p = job_paths(job_dir)
    if supervisor_alive(p):
        out({"error": "already running"})
        return
    clean_run_dir(p)
    jd = p["jd"]
    rankexec = spec.pop("rankexec")
    write_atomic(jd, "run/launch.json", json.dumps(spec).encode(), 0o600)
    write_atomic(jd, "run/rankexec.py", rankexec.encode(), 0o644)
    for r in spec["ranks"]:
        os.close(jd.open_for_write("logs/rank-%d.log" % r))   # emptied; a link is refused
    rfd, wfd = os.pipe()
    if os.fork() == 0:
        os.close(rfd)
        os.setsid()
        if os.fork() == 0:
            supervise(p, spec, wfd)
        os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd) as r:
        reply = r.read()
    out(json.loads(reply) if reply else {"error": "supervisor did not start"})
    if then == "follow" and reply:
        cmd_follow(job_dir, ",".join(map(str, spec["ranks"])), "-1", "events")


def detach_stdio(jd, log_rel: str) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    log = jd.open_for_write(log_rel, 0o644, append=True)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)


def supervise(p: dict, spec: dict, wfd: int) -> None:
    """Runs torchrun, records its exit code in run/host.exit; never returns."""
    jd = p["jd"]
    detach_stdio(jd, "run/torchrun.log")
    env = dict(os.environ)
    env.update(spec["env"])
    code = 1
    try:
        with jd.dirfd("code") as code_fd:
            os.fchdir(code_fd)   # the cwd of torchrun and the ranks, reached without a link
        proc = subprocess.Popen(spec["argv"], env=env)
        me = os.getpid()
        info = {"pid": me, "pgid": os.getpgid(0), "start_ticks": proc_start_time(me),
                "torchrun_pid": proc.pid, "run_id": spec["run_id"], "started": time.time()}
        write_atomic(jd, "run/supervisor.json", json.dumps(info).encode())
        os.write(wfd, json.dumps(info).encode())
        os.close(wfd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, f: proc.send_signal(s))
        code = proc.wait()
    except BaseException as e:  # anything here must still leave host.exit behind
        sys.stderr.write("orch supervisor: %r\n" % (e,))
        try:
            os.write(wfd, json.dumps({"error": repr(e)}).encode())
        except OSError:
            pass
    try:
        write_atomic(jd, "run/host.exit", json.dumps({"code": code, "time": time.time()}).encode(),
                     0o644)
    except OSError as e:
        sys.stderr.write("orch supervisor: cannot write host.exit: %s\n" % e)
    os._exit(0)


# ---------------------------------------------------------------- follow

def open_log(jd, rel: str):
    """A log file opened for reading without following a link; None if it cannot be."""
    try:
        return os.fdopen(jd.open_for_read(rel), "rb")
    except OSError:
        return None


class RankLog:
    """A growing log file read in place; yields whole lines only."""

    def __init__(self, rank: int, jd, rel: str, offset: int) -> None:
        self.rank, self.jd, self.rel, self.offset, self.f = rank, jd, rel, offset, None

    def read_lines(self, limit: int = LOG_CAP) -> list:
        if self.f is None:
            self.f = open_log(self.jd, self.rel)
            if self.f is None:
                return []
        self.f.seek(self.offset)
        data = self.f.read(limit)
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        return data[:end].split(b"\n")

    def rest(self) -> bytes:
        """The final unterminated line, once the rank has ended."""
        if self.f is None:
            return b""
        self.f.seek(self.offset)
        data = self.f.read(LOG_CAP)
        self.offset += len(data)
        return data


def tail_offset(f, n: int) -> int:
    """Byte offset where the last n lines of open file f start (a final newline ends
    the last line); 0 when f is None."""
    if f is None:
        return 0
    size = os.fstat(f.fileno()).st_size
    if n == 0:
        return size
    end = size
    if size:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            end = size - 1
    pos, seen = end, 0
    while pos > 0:
        step = min(1 << 16, pos)
        pos -= step
        f.seek(pos)
        chunk = f.read(step)
        idx = len(chunk)
        while True:
            idx = chunk.rfind(b"\n", 0, idx)
            if idx < 0:
                break
            seen += 1
            if seen == n:
                return pos + idx + 1
    return 0


def rank_exit(p: dict, rank: int):
    ex = read_json(p["jd"], "run/rank-%d.exit" % rank)
    return ex if isinstance(ex, dict) and "code" in ex and "time" in ex else None


def host_done(p: dict):
    """host.exit once the supervisor finished; {"code": None} when it vanished."""
    done = read_json(p["jd"], "run/host.exit")
    if done is not None or supervisor_alive(p):
        return done
    return read_json(p["jd"], "run/host.exit") or {"code": None, "lost": True}


def emit_lines(w, log: RankLog, raw: bool) -> int:
    total = 0
    while True:
        lines = log.read_lines()
        if not lines:
            return total
        total += len(lines)
        if raw:
            w.write(b"\n".join(lines) + b"\n")
        else:
            tag = b"L %d " % log.rank
            w.write(b"".join(tag + l + b"\n" for l in lines))


def cmd_follow(job_dir: str, ranks: str, tail: str, mode: str) -> None:
    """Stream rank logs. mode: "events" (tagged lines, exits, heartbeats; until the
    host is done), "tagged" (tagged lines there now, then X), "raw-follow" (raw bytes
    until the ranks end), "raw" (the bytes there now)."""
    p = job_paths(job_dir)
    raw = mode.startswith("raw")
    logs = []
    for r in [int(x) for x in ranks.split(",")]:
        rel = "logs/rank-%d.log" % r
        log = RankLog(r, p["jd"], rel, 0)
        if int(tail) >= 0:
            log.f = open_log(p["jd"], rel)
            log.offset = tail_offset(log.f, int(tail))
        logs.append(log)
    w, reported, beat, idle = sys.stdout.buffer, set(), 0.0, 0
    while True:
        busy = sum(emit_lines(w, log, raw) for log in logs)
        idle = 0 if busy else idle + 1
        done = mode in ("raw", "tagged") or follow_exits(w, p, logs, reported, raw)
        if done:
            for log in logs:
                emit_lines(w, log, raw)
                rest = log.rest()
                if rest:
                    w.write(rest + b"\n" if raw else b"L %d " % log.rank + rest + b"\n")
            if mode == "tagged":
                w.write(b'X {"code": null, "snapshot": true}\n')
            w.flush()
            return
        if not raw and time.time() - beat >= HEARTBEAT_S:
            w.write(b"T\n")
            beat = time.time()
        w.flush()
        if not busy:
            # 50 ms while output flows; 200 ms after a quiet second (a long quiet job
            # should not cost the host CPU; exits are still seen within 0.2 s)
            time.sleep(0.05 if idle < 20 else 0.2)


def follow_exits(w, p: dict, logs: list, reported: set, raw: bool) -> bool:
    """Report rank exits as they land; True once nothing more will come."""
    for log in logs:
        if log.rank in reported:
            continue
        ex = rank_exit(p, log.rank)
        if ex is not None:
            reported.add(log.rank)
            emit_lines(w, log, raw)
            if not raw:
                w.write(b"E %d %s %r\n" % (log.rank, str(ex["code"]).encode(), ex["time"]))
    done = host_done(p)
    if done is None:
        return raw and len(reported) == len(logs)
    if not raw:
        w.write(("X %s\n" % json.dumps(done)).encode())
    return True


# ---------------------------------------------------------------- status / stop

def last_line(jd, rel: str) -> str:
    f = open_log(jd, rel)
    if f is None:
        return ""
    with f:
        f.seek(tail_offset(f, 1))
        return f.read(4096).decode("utf-8", "replace").strip()


def error_file(p: dict, local_rank: int) -> str:
    """torchrun's error file of a rank (written when the script uses @record)."""
    for rel, _ in p["jd"].walk("run/torchrun"):
        if rel.endswith("/%d/error.json" % local_rank):
            try:
                data = p["jd"].read(rel, ERROR_FILE_CAP) or b""
            except OSError:
                return ""
            return data.decode("utf-8", "replace")[-4000:]
    return ""


def rank_status(p: dict, rank: int, local_rank: int, sup) -> dict:
    info = {"rank": rank, "last_line": last_line(p["jd"], "logs/rank-%d.log" % rank)}
    pid = read_json(p["jd"], "run/rank-%d.pid" % rank)
    pid = pid if isinstance(pid, dict) and isinstance(pid.get("pid"), int) else {}
    info["pid"], info["started"] = pid.get("pid"), pid.get("time")
    ex = rank_exit(p, rank)
    if ex is not None:
        info.update(state="exited", code=ex["code"], ended=ex["time"])
        info["error_file"] = error_file(p, local_rank) if ex["code"] != 0 else ""
    elif pid and proc_start_time(pid["pid"]) == pid.get("start_ticks"):
        info["state"] = "running"
    elif pid:
        info["state"] = "lost"      # vanished without an exit code (e.g. the wrapper was killed)
    else:
        info["state"] = "starting" if sup else "lost"
    return info


def cmd_status(job_dir: str, ranks: str) -> None:
    p = job_paths(job_dir)
    sup = supervisor_alive(p)
    out({"supervisor": sup, "host_exit": read_json(p["jd"], "run/host.exit"),
         "time": time.time(),
         "ranks": [rank_status(p, int(r), i, sup) for i, r in enumerate(ranks.split(","))]})


def wait_gone(job_dir: str, sup, deadline: float) -> list:
    while True:
        left = marked_pids(job_dir)
        if sup and proc_start_time(sup["pid"]) == sup.get("start_ticks"):
            left.append(sup["pid"])
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.05)


def cmd_stop(job_dir: str, grace: str) -> None:
    """SIGTERM every process of the job, wait up to grace, SIGKILL the rest, verify."""
    # A stop runs to the end even if the controller (and so the SSH session) goes away.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    p = job_paths(job_dir)
    sup = supervisor_alive(p)
    t0 = time.time()
    found = marked_pids(p["job"]) + ([sup["pid"]] if sup else [])
    # torchrun itself has nothing to save, and its own SIGTERM shutdown takes seconds;
    # the ranks (the user's code) get SIGTERM from us directly and the full grace.
    torchrun = sup.get("torchrun_pid") if sup else None
    signal_all([torchrun] if torchrun in found else [], signal.SIGKILL)
    signal_all([x for x in found if x != torchrun], signal.SIGTERM)
    left = wait_gone(p["job"], sup, time.time() + float(grace))
    killed = list(left)
    signal_all(left, signal.SIGKILL)
    left = wait_gone(p["job"], sup, time.time() + 5)
    out({"found": len(found), "killed": len(killed), "left": left,
         "seconds": round(time.time() - t0, 3)})
