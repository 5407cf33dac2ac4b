"""Calling the host agent (agent.py) over a transport: the only way orch acts on a host."""
from __future__ import annotations

import json
from pathlib import Path

from orchestrator.errors import HostError
from orchestrator.transport import Channel, Transport

# One script: the path module first (every file access in the job folder goes through
# it), the push ledger, agent_jobs.py's functions, then agent.py, whose main() runs last.
AGENT_PARTS = ("host/paths.py", "host/ledger.py", "agent_jobs.py", "agent.py")
AGENT = b"\n".join((Path(__file__).parent / part).read_bytes() for part in AGENT_PARTS)
RANKEXEC = (Path(__file__).parent / "rankexec.py").read_bytes()
# Reads exactly the agent's source from stdin and runs it; what stdin carries after
# that is the command's own input (file streams, secrets), never the command line.
BOOT = "import sys;n=int(sys.argv[1]);exec(compile(sys.stdin.buffer.read(n),'orch-agent','exec'))"


def agent_argv(python: str, command: str, *args: str) -> list[str]:
    # -S: the agent is stdlib only, and a venv's site set-up (.pth files) costs more than
    # the agent itself; preflight loads site on its own to find torch.
    return [python, "-S", "-c", BOOT, str(len(AGENT)), command, *map(str, args)]


def open_agent(t: Transport, command: str, *args: str, timeout: float | None = None) -> Channel:
    """Start an agent command; the caller may write more stdin, then reads its output."""
    chan = t.open(agent_argv(t.host.python, command, *args), timeout)
    chan.write(AGENT)
    return chan


def parse_reply(t: Transport, command: str, code: int, out: bytes, err: bytes) -> dict:
    lines = out.decode("utf-8", "replace").strip().splitlines()
    reply = None
    if lines:
        try:
            reply = json.loads(lines[-1])
        except ValueError:
            reply = None
    if not isinstance(reply, dict):
        reply = None
    if code == 127 or (code != 0 and b"not found" in err and not lines):
        raise HostError(f"{t.host.label}: python interpreter `{t.host.python}` not found",
                        hint="install python3 there or set `python:` (e.g. a venv's bin/python)")
    if reply is None or code != 0 or "error" in reply:
        why = reply.get("error") if reply else (err.decode("utf-8", "replace").strip()[-800:]
                                                 or f"exit code {code}")
        raise HostError(f"{t.host.label}: {command} failed: {why}",
                        hint=str((reply or {}).get("fix") or "")[:800])
    return reply


def call(t: Transport, command: str, *args: str, stdin: bytes = b"",
         timeout: float | None = 120) -> dict:
    chan = open_agent(t, command, *args, timeout=timeout)
    try:
        if stdin:
            chan.write(stdin)
        chan.close_stdin()
        res = chan.finish()
    except TimeoutError:
        raise HostError(f"{t.host.label}: no answer to `{command}` within {timeout:g} s",
                        hint="check that the host is still reachable") from None
    finally:
        chan.close()
    return parse_reply(t, command, res.code, res.stdout, res.stderr)
