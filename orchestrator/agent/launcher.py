"""The job's torchrun, started warm (stdlib only; the user's python runs this source).

The supervisor starts it as soon as the host passed preflight, while the controller
still waits for slower hosts: `python -c BOOT orch-warm-torchrun <job dir>` with this
source on stdin, the job's environment but its marker, stdout and stderr kept in
memory, and a Unix socket at descriptor 3. It imports torch.distributed.run (the
seconds a torchrun start costs) and then waits. Nothing of the job runs before the go.

The go is torchrun's arguments (after `-m torch.distributed.run`) and the ranks'
environment (JSON; the marker ORCH_JOB_DIR comes only now) with two descriptors: the
job's run/torchrun.log and its code/ folder, both opened by the agent's JobDir (no link
followed). It then runs torch.distributed.run as `python -m` would, in code/, writing
to the log, and once it returned ends without the interpreter's teardown (`end_now`;
not node 0 of several, which serves torchrun's store: `hosts_store`).
The end of the socket without a go (the job was not started after all) ends it at
once, even mid-import, having run nothing.

It also writes each rank's records in run/<part>/ (`RankRecords`): rank-<r>.pid as
torchrun starts the rank, rank-<r>.exit (code, time) the moment it ends. torchrun's
process is the ranks' parent, so it alone can read a rank's exit status; a thread per rank
waits with waitid(WNOWAIT), which leaves the rank for torchrun to reap, and the time is
the end's, not torchrun's next look (up to 0.1 s later): the first failure across hosts
is decided on those times. torchrun starts ranks through subprocess.Popen, which is
replaced by a subclass before torch.distributed.run is imported (torch binds the name at
its import).
"""
import os
import sys

MYPY = False
if MYPY:   # names for the type comments, never imported by the warm torchrun
    from typing import Any, NoReturn  # noqa: F401

GO_MAX = 1 << 22      # the go's arguments, JSON
EARLY_MAX = 1 << 20   # what the import printed before the go, copied to the log
# how long another node than 0 waits for node 0's store before torchrun's own retries
# (this source runs alone in the job's python: wire/timeouts.py is not there)
STORE_WAIT = 30.0
STORE_POLL = 0.02     # a refused connect: microseconds, however many nodes probe
RECORD_WAIT = 5.0     # the longest wait for a rank's exit record at torchrun's end


def receive(sock):
    # type: (Any) -> tuple[Any, list[int]]
    """(arguments, [log fd, code fd]); (None, []) at the end without a go."""
    import array
    import socket
    fds = array.array("i")
    data, anc, _, _ = sock.recvmsg(65536, socket.CMSG_SPACE(2 * fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    chunks = [data]
    while data and sum(len(c) for c in chunks) <= GO_MAX:
        data = sock.recv(65536)
        chunks.append(data)
    body = b"".join(chunks)
    if not body or len(fds) != 2 or len(body) > GO_MAX:
        return None, list(fds)
    import json
    return json.loads(body.decode()), list(fds)


def wait_for_go(sock):
    # type: (Any) -> dict[str, Any]
    """Receive the go in a thread, beside the import: the end of the socket without a go
    (the supervisor ended or was killed) ends this process at once, even mid-import,
    which may take seconds: nothing of it may outlive its supervisor."""
    import array  # noqa: F401  (imported here, not in the thread, beside torch's imports)
    import json  # noqa: F401
    import threading
    got = {"ready": threading.Event(), "go": None}  # type: dict[str, Any]

    def wait():
        # type: () -> None
        try:
            args, fds = receive(sock)
        except OSError:
            args, fds = None, []
        if args is None:
            os._exit(0)
        sock.close()
        got["go"] = (args, fds)
        got["ready"].set()
    threading.Thread(target=wait, daemon=True).start()
    return got


def import_failed(sock, got, exc):
    # type: (Any, dict[str, Any], BaseException) -> None
    """torch's import failed. Before the go, this process ends and the supervisor, whose
    go then finds the socket shut, starts torchrun cold (a launcher again, handed the go
    at once). A go already handed over made this process the job's torchrun: it must not
    end 0 (a job that ran nothing would read as a success), so the cause goes to the log,
    with its traceback as a cold torchrun's would be, and it ends 1."""
    import socket
    try:
        sock.shutdown(socket.SHUT_RDWR)   # a go not yet sent fails at the supervisor now
    except OSError:
        pass
    if got["ready"].wait(2.0):   # the go came before the shut: it reads it, or the end
        log = got["go"][1][0]
        import traceback
        text = ("orch: torchrun could not import torch.distributed.run: %r\n%s"
                % (exc, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))))
        try:
            os.write(log, text.encode("utf-8", "backslashreplace"))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


def keep_early_output(log):
    # type: (int) -> None
    """What the import wrote (warnings) goes to the log first, as a cold start's would."""
    try:
        os.lseek(1, 0, os.SEEK_SET)
        early = os.read(1, EARLY_MAX)
    except OSError:
        return
    while early:
        early = early[os.write(log, early):]


def main():
    # type: () -> None
    import socket
    null = os.open(os.devnull, os.O_RDONLY)   # stdin carried this source: done with it
    os.dup2(null, 0)
    os.close(null)
    sock = socket.socket(fileno=3)
    if sys.path and sys.path[0] == "":   # -c: the start folder, not code/ (set at the go)
        sys.path.pop(0)
    ranks = RankRecords()
    ranks.hook()   # before torch's import, which binds subprocess.Popen
    got = wait_for_go(sock)
    try:
        import torch.distributed.run  # noqa: F401  (the warm part)
    except BaseException as e:   # a half-done import is no base to run from
        import_failed(sock, got, e)
    got["ready"].wait()
    go, fds = got["go"]
    os.environ.update(go["env"])   # with the job's marker: the ranks inherit it
    args = go["args"]
    log, code = fds
    keep_early_output(log)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    ranks.open(os.environ)
    os.fchdir(code)
    os.close(code)
    sys.path.insert(0, os.getcwd())   # what `python -m` puts first
    # run as `python -m` runs it: as __main__, never imported under its name (runpy warns
    # otherwise); the packages it imported stay, which is what the warm start kept
    sys.modules.pop("torch.distributed.run", None)
    sys.argv = ["torchrun"] + [str(a) for a in args]
    wait_for_store(args)
    import runpy
    # another exception (a failed rank's ChildFailedError) goes on up: python's own end,
    # its traceback in the log, exit 1, as a cold torchrun's
    try:
        try:
            runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
        finally:
            ranks.settle(RECORD_WAIT)   # every rank's exit record written before the end
    except SystemExit as e:
        if (e.code is not None and not isinstance(e.code, int)) or hosts_store(args):
            raise   # python's own end (a message: printed, exit 1), as a cold torchrun's
        end_now(e.code or 0)
    if not hosts_store(args):
        end_now(0)


class RankRecords:
    """run/<part>/rank-<r>.pid and .exit, written by the ranks' parent (this process)."""

    def __init__(self):
        # type: () -> None
        self.run = -1          # run/<part>/, opened at the go
        self.waiters = []      # type: list[Any]

    def hook(self):
        # type: () -> None
        """subprocess.Popen replaced by a subclass that tells this object of each child."""
        import subprocess
        records = self

        class RankPopen(subprocess.Popen):  # type: ignore[type-arg]
            def __init__(self, *args, **kwargs):
                # type: (*Any, **Any) -> None
                super().__init__(*args, **kwargs)
                try:   # the child runs: torchrun must get its Popen whatever happens here
                    records.started(self, kwargs.get("env"))
                except Exception as e:
                    sys.stderr.write("orch: pid %d's records: %r\n" % (self.pid, e))
        subprocess.Popen = RankPopen  # type: ignore[misc]

    def open(self, env):
        # type: (Any) -> None
        """The job's run/<part>/ (ORCH_JOB_DIR, ORCH_JOB_PART), reached without a link."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
        try:
            job = os.open(env["ORCH_JOB_DIR"], flags)
            try:
                run = os.open("run", flags, dir_fd=job)
            finally:
                os.close(job)
            part = env.get("ORCH_JOB_PART")
            if part:
                try:
                    self.run = os.open(part, flags, dir_fd=run)
                finally:
                    os.close(run)
            else:
                self.run = run
        except (KeyError, OSError) as e:
            sys.stderr.write("orch: the ranks' pid and exit records cannot be written: %r\n"
                             % (e,))

    def started(self, proc, env):
        # type: (Any, Any) -> None
        """A child with RANK in its environment is a rank: its pid now, its end watched."""
        if self.run < 0 or not env or "RANK" not in env:
            return
        import threading
        import time
        rank = int(env["RANK"])
        self.write("rank-%d.pid" % rank, '{"pid": %d, "start_ticks": %s, "time": %r}'
                   % (proc.pid, start_ticks(proc.pid) or "null", time.time()))
        waiter = threading.Thread(target=self.wait, args=(proc, rank), daemon=True)
        waiter.start()
        self.waiters.append(waiter)

    def wait(self, proc, rank):
        # type: (Any, int) -> None
        """Until the rank ends; its code (a signal as minus its number) and the time."""
        import time
        code = None   # type: int | None
        try:
            end = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            when = time.time()
            if end is not None:   # (None only with WNOHANG)
                code = end.si_status if end.si_code == os.CLD_EXITED else -end.si_status
        except ChildProcessError:   # torchrun reaped it first: its Popen has the code
            when = time.time()
            code = reaped_code(proc, when + RECORD_WAIT)
        if code is None:
            return
        self.write("rank-%d.exit" % rank, '{"code": %d, "time": %r}' % (code, when))

    def write(self, name, text):
        # type: (str, str) -> None
        """Written beside (O_EXCL, no link followed) and renamed over the record."""
        tmp = "%s.orch-part-%d" % (name, os.getpid())
        try:
            try:
                os.unlink(tmp, dir_fd=self.run)
            except FileNotFoundError:
                pass
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                         dir_fd=self.run)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=self.run, dst_dir_fd=self.run)
        except OSError as e:
            sys.stderr.write("orch: cannot write run/%s: %r\n" % (name, e))

    def settle(self, limit):
        # type: (float) -> None
        """The waiters' records written (torchrun returned: its ranks have ended)."""
        import time
        end = time.monotonic() + limit
        for waiter in self.waiters:
            waiter.join(max(0.0, end - time.monotonic()))


def reaped_code(proc, deadline):
    # type: (Any, float) -> int | None
    """The code torchrun's Popen read when it reaped the rank (set just after)."""
    import time
    while proc.returncode is None and time.time() < deadline:
        time.sleep(0.001)
    code = proc.returncode   # type: int | None
    return code


def start_ticks(pid):
    # type: (int) -> int | None
    """Field 22 of /proc/<pid>/stat: tells a live pid from a recycled one."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def option(args, flag, default):
    # type: (list[Any], str, str) -> str
    """torchrun's option `flag` (`--flag value` or `--flag=value`): orch's own come
    before the entrypoint, so the first one found is torchrun's."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return str(args[i + 1])
        if str(a).startswith(flag + "="):
            return str(a)[len(flag) + 1:]
    return default


def hosts_store(args):
    # type: (list[Any]) -> bool
    """Node 0 of several: its process serves torchrun's store, and the other nodes may
    still be reading the exit barrier's answer from it when its own barrier returns (an
    exit then is "Error waiting on exit barrier" in their logs, and their slow end). It
    keeps python's own end, whose teardown gives them the time, as a cold torchrun's."""
    return option(args, "--node-rank", "0") == "0" and option(args, "--nnodes", "1") != "1"


def store_address(args):
    # type: (list[Any]) -> Any
    """Where node 0's store listens (torchrun's static rendezvous at --master-addr and
    --master-port), for the other nodes of several; None on node 0, on a single node,
    or with another rendezvous."""
    if option(args, "--nnodes", "1") == "1" or option(args, "--node-rank", "0") == "0" \
            or option(args, "--rdzv-backend", "static") != "static":
        return None
    return option(args, "--master-addr", "127.0.0.1"), option(args, "--master-port", "29500")


def wait_for_store(args, limit=STORE_WAIT, every=STORE_POLL):
    # type: (list[Any], float, float) -> bool
    """Another node than 0: wait until node 0's store accepts a connection, then start
    torchrun. Its store client, started before the store listens, retries with a
    growing back-off: the whole job's ranks started up to 0.5 s after the last node
    was ready, whenever node 0 finished importing torch after another node (which host
    logs in first is chance). A refused connect costs microseconds; torchrun's own
    store takes the probe's empty connection as any closed client. After `limit`
    seconds (node 0 failed or is slow), torchrun's own retries and timeout take over.
    True once the store answered."""
    where = store_address(args)
    if where is None:
        return False
    import socket
    import time
    try:
        addrs = socket.getaddrinfo(where[0], int(where[1]), 0, socket.SOCK_STREAM)
    except (OSError, ValueError):   # torchrun reports a bad address in its own words
        return False
    end = time.monotonic() + limit
    while True:
        for family, kind, proto, _, address in addrs:
            s = socket.socket(family, kind, proto)
            s.settimeout(1.0)
            try:
                s.connect(address)
                return True
            except OSError:
                pass
            finally:
                s.close()
        if time.monotonic() >= end:
            return False
        time.sleep(every)


def end_now(code):
    # type: (int) -> NoReturn
    """torchrun returned (its ranks ended, every node passed its exit barrier): what a
    normal exit does that matters here (non-daemon threads joined, the atexit handlers,
    logging's flush among them, stdio flushed), then the exit itself, without the
    interpreter's teardown. With torch loaded that teardown is 0.5-1 s of CPU (seconds
    on a loaded host) after the job is over, and the job's end is its slowest host's."""
    import atexit
    import threading
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # closed, or the log's disk is full: nothing to save
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
