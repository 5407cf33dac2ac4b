"""Per-rank wrapper that torchrun starts on a host (stdlib only; launch copies it from
the bundle to <job>/run/rankexec.py).

    torchrun ... <job>/run/rankexec.py <job dir> module|script <target> [args...]

It sends the rank's stdout and stderr straight into logs/rank-<RANK>.log (the child
writes the file itself: nothing is piped, so nothing is lost when the controller is
gone), records the child's pid, and on exit writes run/rank-<RANK>.exit with the code
and the time, which is how `orch` finds the earliest failure across hosts. It runs once
per rank, so it stays light: fork/exec instead of subprocess, no json module.
"""
import os
import signal
import sys
import time


def start_ticks(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def write_json(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def child_argv(kind, target, args):
    if kind == "module":
        return [sys.executable, "-u", "-m", target] + args
    return [sys.executable, "-u", target] + args


def spawn(argv, log_path):
    pid = os.fork()
    if pid == 0:
        try:
            fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.execv(argv[0], argv)
        except OSError as e:
            os.write(2, ("orch: cannot start %s: %s\n" % (argv[0], e)).encode())
        finally:
            os._exit(127)
    return pid


def wait_code(pid):
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def main():
    job_dir, kind, target, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    rank = int(os.environ["RANK"])
    run = os.path.join(job_dir, "run")
    pid = spawn(child_argv(kind, target, args),
                os.path.join(job_dir, "logs", "rank-%d.log" % rank))
    write_json(os.path.join(run, "rank-%d.pid" % rank), '{"pid": %d, "start_ticks": %s, "time": %r}'
               % (pid, start_ticks(pid) or "null", time.time()))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: os.kill(pid, s))
    code = wait_code(pid)
    write_json(os.path.join(run, "rank-%d.exit" % rank),
               '{"code": %d, "time": %r}' % (code, time.time()))
    # Exit as the child did, so that torchrun sees the same failure.
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
