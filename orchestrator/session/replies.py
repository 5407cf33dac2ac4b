"""Host replies as dataclasses, decoded where they arrive (the reply's schema is
wire/protocol.py's): the controller past the session reads fields, not dict keys."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankStackReply:
    """One rank's answer to `stacks`: `state` "answered" (then `stack`: faulthandler's
    dump), "stopped", "disk-wait", "no answer", ...; its `pid` where known."""

    rank: int
    state: str
    pid: int | None
    stack: str


@dataclass(frozen=True)
class HostStacks:
    """A host's `stacks` reply: each of its ranks, and the NCCL flight recorder dumps
    in its run/ (file names)."""

    ranks: tuple[RankStackReply, ...]
    nccl_dumps: tuple[str, ...]

    @classmethod
    def of(cls, reply: dict[str, Any]) -> HostStacks:   # the decoded frame, checked by protocol.py
        ranks = tuple(RankStackReply(r["rank"], r["state"], r.get("pid"), r.get("stack", ""))
                      for r in reply["ranks"])
        return cls(ranks, tuple(reply.get("nccl_dumps", ())))
