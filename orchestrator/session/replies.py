"""Host replies as dataclasses, decoded where they arrive (the reply's schema is
wire/protocol.py's): the controller past the session reads fields, not dict keys."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Supervisor:
    """A host's supervisor as `launch` (or `array_launch`) reports it and the state
    keeps it: its pid and process group, torchrun's pid, the run, and when it started
    on the host's own clock."""

    pid: int
    pgid: int
    start_ticks: int | None
    torchrun_pid: int
    run_id: str
    started: float

    @classmethod
    def of(cls, reply: Mapping[str, Any]) -> Supervisor:   # checked by protocol.py's SUPERVISOR
        return cls(int(reply["pid"]), int(reply["pgid"]), reply.get("start_ticks"),
                   int(reply["torchrun_pid"]), str(reply["run_id"]), float(reply["started"]))


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
