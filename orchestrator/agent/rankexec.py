"""Per-rank wrapper that torchrun starts on a host (stdlib only; launch copies it from
the bundle to <job>/run/rankexec.py).

    torchrun ... --no-python <python> -I -S <job>/run/rankexec.py <job dir> module|script <target> [args...]

It sends the rank's stdout and stderr straight into logs/rank-<RANK>.log (the child
writes the file itself: nothing is piped, so nothing is lost when the controller is
gone), records the child's pid, and on exit writes run/rank-<RANK>.exit with the code
and the time, which is how `orch` finds the earliest failure across hosts. It runs once
per rank, so it stays light: fork/exec instead of subprocess, no json module.

For a hang (watch/hang.py), the rank can be asked for its Python stack at no cost while
it runs: the rank's python starts on BOOT, which registers faulthandler on STACK_SIGNAL
(SIGUSR2: torchrun neither sends nor forwards it) writing every thread's stack into
run/stack-<RANK> (an inherited descriptor), then runs the module or script as `-m` or a
plain script would. A rank shows progress by touching run/heartbeat-<RANK>, whose path
it gets in ORCH_HEARTBEAT (created here, so its first touch is a change).

Like the agent (agent/paths.py), it never follows a link inside the job folder: logs/ and
run/ are opened with O_NOFOLLOW relative to the job folder, the log with
O_NOFOLLOW|O_APPEND, and the pid and exit files are written beside (O_EXCL) and renamed
relative to run/'s descriptor.
"""
import importlib
import os
import sys
import time

# the C module: `signal` wraps it in enums, a third of this wrapper's start
signal = importlib.import_module("_signal" if "_signal" in sys.builtin_module_names
                                 else "signal")


def start_ticks(pid):
    # type: (int) -> int | None
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


STACK_SIGNAL = signal.SIGUSR2
# The rank's python runs this with `-c`, then: the stack file's descriptor, module|script,
# the target, its args. Everything in one function deleted from __main__ before the user's
# code runs there: `-m` runs the module in __main__ (runpy, as python does), a script is
# compiled and run in __main__ with python's own sys.path[0] and __file__.
BOOT = """def _orch_rank():
    import faulthandler, os, signal, sys
    fd = int(sys.argv.pop(1))
    os.set_inheritable(fd, False)
    faulthandler.register(signal.SIGUSR2, fd, all_threads=True, chain=False)
    kind, target = sys.argv.pop(1), sys.argv.pop(1)
    main = sys.modules["__main__"]
    del main._orch_rank
    sys.argv[0] = target
    if kind == "module":
        import runpy
        sys.path[0] = os.getcwd()
        return runpy._run_module_as_main(target)
    sys.path[0] = os.path.dirname(os.path.realpath(target))
    main.__file__, main.__cached__ = os.path.abspath(target), None
    with open(target, "rb") as f:
        code = compile(f.read(), main.__file__, "exec")
    exec(code, main.__dict__)
_orch_rank()
"""
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def open_dirs(job_dir):
    # type: (str) -> tuple[int, int]
    """Descriptors of <job>/run (this host's part of it, run/<ORCH_JOB_PART>) and
    <job>/logs, never through a link (the agent made and
    checked them; a link put there since is refused here too: ELOOP)."""
    job = os.open(job_dir, DIR_FLAGS)
    try:
        run = os.open("run", DIR_FLAGS, dir_fd=job)
        part = os.environ.get("ORCH_JOB_PART")   # this host's records: run/<part>/
        if part:
            try:
                part_fd = os.open(part, DIR_FLAGS, dir_fd=run)
            finally:
                os.close(run)
            run = part_fd
        return run, os.open("logs", DIR_FLAGS, dir_fd=job)
    finally:
        os.close(job)


def write_json(run_fd, name, text):
    # type: (int, str, str) -> None
    tmp = "%s.orch-part-%d" % (name, os.getpid())
    try:
        os.unlink(tmp, dir_fd=run_fd)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=run_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=run_fd, dst_dir_fd=run_fd)


def child_argv(kind, target, args, stack_fd):
    # type: (str, str, list[str], int) -> list[str]
    """The rank's command: as torchrun would start it (PYTHON_EXEC is torchrun's own
    override of the interpreter), through BOOT."""
    python = os.environ.get("PYTHON_EXEC") or sys.executable
    return [python, "-u", "-c", BOOT, str(stack_fd), kind, target] + args


def rank_files(run_fd, rank):
    # type: (int, int) -> int
    """Create run/heartbeat-<rank> (empty, mtime now) and open run/stack-<rank> for the
    rank's faulthandler (emptied: a new run's stacks only); the stack file's descriptor."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    os.close(os.open("heartbeat-%d" % rank, flags, 0o644, dir_fd=run_fd))
    return os.open("stack-%d" % rank, flags | os.O_APPEND, 0o644, dir_fd=run_fd)


def heartbeat_path(job_dir, rank):
    # type: (str, int) -> str
    part = os.environ.get("ORCH_JOB_PART")
    run = os.path.join(job_dir, "run", part) if part else os.path.join(job_dir, "run")
    return os.path.join(run, "heartbeat-%d" % rank)


def spawn(argv, logs_fd, log_name, keep_fd=-1):
    # type: (list[str], int, str, int) -> int
    """Fork and exec argv with its output in the log; keep_fd stays open in it."""
    pid = os.fork()
    if pid == 0:
        try:
            fd = os.open(log_name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644,
                         dir_fd=logs_fd)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            if keep_fd >= 0:
                os.set_inheritable(keep_fd, True)
            os.execvp(argv[0], argv)
        except OSError as e:
            os.write(2, ("orch: cannot start %s: %s\n" % (argv[0], e)).encode())
        finally:
            os._exit(127)
    return pid


def wait_code(pid):
    # type: (int) -> int
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
    # type: () -> int
    job_dir, kind, target, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    rank = int(os.environ["RANK"])
    run_fd, logs_fd = open_dirs(job_dir)
    stack_fd = rank_files(run_fd, rank)
    os.environ["ORCH_HEARTBEAT"] = heartbeat_path(job_dir, rank)
    # the inventory's `python:` as this host runs it (what runs the rank): a rank that
    # starts a helper script uses the job's interpreter, not the first python on PATH
    os.environ.setdefault("ORCH_PYTHON", os.environ.get("PYTHON_EXEC") or sys.executable)
    pid = spawn(child_argv(kind, target, args, stack_fd), logs_fd, "rank-%d.log" % rank,
                stack_fd)
    os.close(logs_fd)
    os.close(stack_fd)
    write_json(run_fd, "rank-%d.pid" % rank, '{"pid": %d, "start_ticks": %s, "time": %r}'
               % (pid, start_ticks(pid) or "null", time.time()))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: os.kill(pid, s))
    code = wait_code(pid)
    write_json(run_fd, "rank-%d.exit" % rank, '{"code": %d, "time": %r}' % (code, time.time()))
    # Exit as the child did, so that torchrun sees the same failure.
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
