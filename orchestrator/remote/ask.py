"""One request to many hosts at once, on their open links (`ask_all`): every request is
sent before any reply is waited for, and the replies are read by one deadline they
share. No thread per host and no waves: fan_out's 256 threads sent the last hosts'
requests only as the first hosts answered (at 1,000 hosts a launch went out in four
waves), and starting the threads took scheduling slots of their own on a loaded
controller."""
from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

from orchestrator.remote.fanout import GroupResult
from orchestrator.remote.link import Body, Link

T = TypeVar("T")


def ask_all(links: dict[int, Link], command: str, fields: Callable[[int], dict[str, Any]],
            timeout: float, decode: Callable[[Body], T]) -> GroupResult[T]:
    """`command` with `fields(host)` to every link, each reply decoded (`decode`, whose
    failure is the host's), all by one deadline `timeout` seconds after the last was
    sent. A host whose link is gone, or whose reply is late or an error, is in `failed`;
    the others still answer. Sorted by host."""
    result: GroupResult[T] = GroupResult()
    sent = {}
    for i, link in links.items():
        try:
            sent[i] = link.submit(command, **fields(i))[1]
        except Exception as exc:   # its link is gone: reported with the others
            result.failed[i] = exc
    deadline = time.monotonic() + timeout
    for i, pending in sent.items():
        try:
            result.ok[i] = decode(links[i].wait(pending, max(0.0, deadline - time.monotonic()),
                                                timeout))
        except Exception as exc:  # collected: reported together, per host
            result.failed[i] = exc
    result.ok, result.failed = dict(sorted(result.ok.items())), dict(sorted(result.failed.items()))
    return result
