"""The agent's entry: one process per host and orch command serves every step over
stdin/stdout frames (orchestrator/wire/protocol.py).

Requests carry an id; the reply (or an error with its category) carries it back.
`follow` streams events while other requests are served; `stop` runs in a thread the
agent waits for, so a stop ends its work even if the connection drops. The agent ends
at the end of its stdin.
"""
from __future__ import annotations

import importlib
import io
import os
import sys
import threading
import time

from orchestrator.agent import paths, streams
from orchestrator.agent.common import AgentError, StreamIdle
from orchestrator.agent.paths import UnsafePath
from orchestrator.wire import protocol, timeouts

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    import signal
    from typing import Any, BinaryIO, Callable
else:   # signal's enums are 6-8 ms of CPU and ~0.4 MiB in every agent: the C module
    import _signal as signal

# request -> (module of orchestrator.agent, function). A module is imported at its first
# request: an agent runs a few of them, and every import is CPU at every host's start.
HANDLERS = {
    "preflight": ("preflight", "run"),
    "manifest": ("files", "run_manifest"),
    "receive": ("files", "run_receive"),
    "launch": ("launch", "run"),
    "follow": ("follow", "run"),
    "status": ("status", "run"),
    "stop": ("procs", "run_stop"),
    "array_launch": ("array", "run_launch"),
    "array_status": ("array", "run_status"),
    "array_results": ("array", "run_results"),
    "pull_manifest": ("pull", "run_manifest"),
    "pull_send": ("pull", "run_send"),
    "restore_check": ("restore", "run_check"),
    "restore": ("restore", "run_restore"),
    "keep_receive": ("keep", "run_receive"),
    "clock": ("main", "run_clock"),
    "setup": ("shellcmd", "run_setup"),
    "probe": ("shellcmd", "run_probe"),
    "exec": ("shellcmd", "run_exec"),
    "cancel": ("shellcmd", "run_cancel"),
    "unshare": ("preflight", "run_unshare"),
    "gpu_claim": ("gpus", "run_claim"),
    "gpu_release": ("gpus", "run_release"),
    "stacks": ("stacks", "run"),
    "net_probe": ("network", "run_probe"),
    "net_close": ("network", "run_close"),
    "net_waits": ("network", "run_waits"),
    "net_listen": ("network", "run_listen"),
}
# command -> daemon thread (not waited for); setup and exec run beside a `cancel`; a
# pull (the checkpoint keeper's, every few seconds while the job runs) never holds up a
# `stop` behind a big file (the controller runs one data stream per link at a time)
IN_THREAD = {"follow": True, "stop": False, "setup": False, "exec": False,
             "pull_manifest": True, "pull_send": True}


def run_clock(req: Request) -> dict[str, Any]:
    return {"time": time.time()}


def handler(command: str) -> Callable[[Request], Any]:
    module, name = HANDLERS[command]
    found: Callable[[Request], Any] = getattr(
        importlib.import_module("orchestrator.agent." + module), name)
    return found


class Out:
    """Whole frames to stdout, one writer at a time (follow runs beside other requests)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream, self.lock = stream, threading.Lock()

    def send(self, data: bytes) -> None:
        with self.lock:
            self.stream.write(data)
            self.stream.flush()


class Request:
    def __init__(self, msg: dict[str, Any], out: Out, reader: protocol.FrameReader,
                 debug: bool) -> None:
        self.t, self.id, self.args = msg["t"], msg.get("id"), msg
        self.out, self.reader, self.debug = out, reader, debug
        self.stream: Any = None   # the stream that follows it (agent/streams.py), if any

    def part(self, kind: str, body: dict[str, Any]) -> None:
        self.out.send(protocol.part(self.id, kind, body))


def serve(req: Request) -> None:
    """Answer one request. One a stream follows is answered, then its stream read to
    its end whatever happened (agent/streams.py): the next frame is the next request."""
    if req.t not in streams.STREAMED:
        return answer(req)
    with streams.StreamReader(req.reader, timeouts.RECEIVE_IDLE) as req.stream:
        answer(req)
        streams.drain(req.stream)


def answer(req: Request) -> None:
    try:
        protocol.check(req.args, {"id": int}, "request " + req.t)
        protocol.check(req.args, protocol.REQUESTS[req.t], "request " + req.t)
        body = handler(req.t)(req)
        if body is not None:
            req.out.send(protocol.reply(req.id, body))
    except (BrokenPipeError, KeyboardInterrupt):
        os._exit(1)   # the controller is gone
    except StreamIdle:
        raise   # the stream stopped half way: no later frame can be read; the agent ends
    except Exception as e:  # every failure becomes an error reply naming its command
        category = e.category if isinstance(e, AgentError) else protocol.HOST
        known = isinstance(e, (AgentError, UnsafePath))   # messages written for the user
        text = str(e) if known else "%s: %s" % (type(e).__name__, e)
        tb = ""
        if req.debug:
            import traceback  # its imports (tokenize...) cost 20 ms at every start
            tb = traceback.format_exc()
        try:
            req.out.send(protocol.error(req.id, category, text, tb, getattr(e, "fix", "")))
        except BrokenPipeError:
            os._exit(1)


def grow_stdin_pipe() -> None:
    """sshd feeds us through a 64 KiB pipe: one wake-up per 64 KiB. 1 MiB (the default
    pipe-max-size) cut a 1 GiB push by a quarter. Linux only; harmless elsewhere."""
    try:
        import fcntl
        fcntl.fcntl(0, 1031, 1 << 20)   # F_SETPIPE_SZ
    except (OSError, ImportError, AttributeError):
        pass


def dispatch(msg: dict[str, Any], out: Out, reader: protocol.FrameReader, debug: bool,
             waited: list[threading.Thread]) -> None:
    req = Request(msg, out, reader, debug)
    if req.t not in HANDLERS:
        out.send(protocol.error(req.id, protocol.USAGE, "unknown request %r" % req.t))
    elif req.t in IN_THREAD:
        th = threading.Thread(target=serve, args=(req,), daemon=IN_THREAD[req.t])
        th.start()
        if not th.daemon:
            waited.append(th)
    else:
        serve(req)


def main(version: str, argv: list[Any]) -> None:
    # Ctrl-C on the controller's terminal (a local host) or a hang-up must not end the
    # agent: it still has to stop the job. It ends at the end of its stdin.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    grow_stdin_pipe()
    out = Out(sys.stdout.buffer)
    stdin: io.BufferedReader = sys.stdin.buffer  # type: ignore[assignment]  # read1/readinto1
    reader = protocol.FrameReader(stdin.read1, caps=protocol.CAPS, readinto=stdin.readinto1)
    debug = "debug" in argv
    for arg in argv:   # this host's part of a job folder that hosts may share (paths.HOST_PART)
        if arg.startswith("part="):
            paths.HOST_PART = arg[len("part="):]
    waited: list[threading.Thread] = []
    out.send(protocol.hello(version, pid=os.getpid(), python=sys.version.split()[0]))
    try:
        while True:
            got = reader.read_frame()
            if got is None:
                break
            dispatch(protocol.decode(got, "request"), out, reader, debug, waited)
    except (protocol.ProtocolError, EOFError) as e:
        out.send(protocol.error(None, protocol.HOST, "agent: %s" % e))
    except BrokenPipeError:
        pass
    if "orchestrator.agent.shellcmd" in sys.modules:   # a setup or exec does not outlive
        sys.modules["orchestrator.agent.shellcmd"].end_all()   # the controller
    if "orchestrator.agent.warm" in sys.modules:   # a warm torchrun without its go ends
        sys.modules["orchestrator.agent.warm"].end_all()   # before the agent's own end
    for th in waited:
        th.join()
    if "orchestrator.agent.procs" in sys.modules:   # locks end; unused parts go
        sys.modules["orchestrator.agent.procs"].release_all()
    sys.stdout.flush()
    os._exit(0)
