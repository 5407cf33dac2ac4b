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
from orchestrator.remote.link import Body, Link, Pending

T = TypeVar("T")


def ask_all(links: dict[int, Link], command: str, fields: Callable[[int], dict[str, Any]],
            timeout: float, decode: Callable[[Body], T]) -> GroupResult[T]:
    """`command` with `fields(host)` to every link, each reply decoded (`decode`, whose
    failure is the host's): `gather` of one request each."""
    return gather(links, lambda i, link: link.submit(command, **fields(i))[1],
                  lambda link, pending, wait, bound: decode(link.wait(pending, wait, bound)),
                  timeout)


def gather(links: dict[int, Link], submit: Callable[[int, Link], Pending],
           read: Callable[[Link, Pending, float, float], T], timeout: float) -> GroupResult[T]:
    """`submit(host, link)` on every link, then `read(link, pending, wait, bound)` of each,
    all by one deadline `timeout` seconds after the last was sent (`wait`: what is left of
    it; `bound`: the whole, as a late host's error says it). A host whose link is gone, or
    whose reply is late, an error or unreadable, is in `failed`; the others still answer.
    Sorted by host."""
    result: GroupResult[T] = GroupResult()
    sent = {}
    for i, link in links.items():
        try:
            sent[i] = submit(i, link)
        except Exception as exc:   # its link is gone: reported with the others
            result.failed[i] = exc
    deadline = time.monotonic() + timeout
    for i, pending in sent.items():
        try:
            result.ok[i] = read(links[i], pending, max(0.0, deadline - time.monotonic()), timeout)
        except Exception as exc:  # collected: reported together, per host
            result.failed[i] = exc
    result.ok, result.failed = dict(sorted(result.ok.items())), dict(sorted(result.failed.items()))
    return result
