"""A command on many hosts at once through their open agents (setup, exec): submit one
request per host, stream each host's output into its HostOutput, wait for every reply;
Ctrl-C sends `cancel` to every host still running (the host ends the command's process
group) and waits briefly for their replies."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

from orchestrator.errors import HostError, OrchError
from orchestrator.remote.link import Link, Pending
from orchestrator.session.replies import CommandReply
from orchestrator.session.shelloutput import HostOutput
from orchestrator.wire import timeouts


@dataclass
class Running:
    link: Link
    id: int
    pending: Pending
    output: HostOutput


@dataclass
class Outcome:
    ok: dict[int, CommandReply]  # host index -> reply
    failed: dict[int, BaseException]  # host index -> why there is no reply
    interrupted: bool = False


def submit_all(
    links: dict[int, Link],
    command: str,
    outputs: dict[int, HostOutput],
    fields: Callable[[int], dict[str, object]],   # a host's request fields, sent as JSON
) -> tuple[dict[int, Running], dict[int, BaseException]]:
    running: dict[int, Running] = {}
    failed: dict[int, BaseException] = {}
    for i, link in links.items():
        try:
            id, p = link.submit(command, stream=outputs[i], **fields(i))
            running[i] = Running(link, id, p, outputs[i])
        except Exception as e:  # that host's link is gone: reported with the others
            failed[i] = e
    return running, failed


def wait_all(
    running: dict[int, Running],
    timeout: float | None,
    failed: dict[int, BaseException] | None = None,
) -> Outcome:
    """Every reply (or its failure); Ctrl-C cancels what still runs and says so."""
    out = Outcome({}, dict(failed or {}))
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        for r in running.values():
            while not r.pending.done.wait(0.2):
                if deadline is not None and time.monotonic() > deadline:
                    break
    except KeyboardInterrupt:
        out.interrupted = True
        cancel_all(running)
    for i, r in running.items():
        r.output.flush()
        if not r.pending.done.is_set():
            why = "interrupted" if out.interrupted else f"no answer within {timeout:g} s"
            out.failed[i] = HostError(f"{r.link.name}: {r.pending.command}: {why}")
            continue
        try:
            out.ok[i] = CommandReply.of(r.link.wait(r.pending, 0))
        except Exception as e:  # no reply: the host's error or a lost connection
            out.failed[i] = e
    return out


def cancel_all(running: dict[int, Running]) -> None:
    """Ask every host whose command still runs to end it, then wait for the replies."""
    for r in running.values():
        if not r.pending.done.is_set():
            # a lost host: its agent ends the command at the end of its input
            with contextlib.suppress(OrchError):
                r.link.submit("cancel", request=r.id)
    deadline = time.monotonic() + timeouts.CANCEL
    for r in running.values():
        r.pending.done.wait(max(0.0, deadline - time.monotonic()))
