"""A hang found, and the culprit named (`job.hang_timeout`).

A rank makes progress when a line of its output arrives or when its host reports that it
touched its heartbeat file (agent/follow.py). `HangWatch` keeps each running rank's last
progress on an injectable clock, from the rank's first (`NOT_STARTED_S` below);
`check()` returns the `Hang` once every rank has gone `timeout` seconds without it, or
once one rank that keeps a heartbeat (it touched its file before) has, while others went
on. A rank's silence alone is no hang: many scripts print on rank 0 only, and a quiet
rank is where the others are; its heartbeat is the rank's own promise of a pulse.

Then every rank's Python stack is taken (agent/stacks.py) and `culprits()` names the
ranks that are not where the others are, in this order:

1. a rank that cannot answer: stopped (SIGSTOP, a debugger) or in uninterruptible sleep;
2. a rank that did not answer while others did;
3. by the innermost frame of each main thread: the ranks outside the largest group (on
   a tie, the groups waiting inside torch's collectives are where the others are);
4. the ranks without progress, when the others went on.

Nothing here stops or restarts the job: the monitor decides what a hang leads to.
"""
from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from orchestrator.session.replies import HostStacks

# a main thread waiting in one of these is waiting for the others (a collective, DDP's
# reducer in backward, a barrier)
WAITING_IN = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")
CANNOT_ANSWER = {
    "stopped": "stopped (SIGSTOP or a debugger): it cannot run",
    "disk-wait": "in uninterruptible sleep (D state: stuck in the kernel, often on I/O)",
}
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


@dataclass(frozen=True)
class Hang:
    """Ranks without progress for `seconds` (the longest of them); `everyone`: no rank
    made any lately (within half the timeout: a rank that printed just before it stopped
    is not one that goes on)."""

    idle: tuple[int, ...]
    seconds: float
    everyone: bool
    timeout: float


# A rank is watched from its first progress (a line, or a touch of its heartbeat), not
# from its process's start: before it, torchrun imports torch and meets the other hosts,
# and the rank's own script imports torch (3-4 s of CPU, tens of seconds on a loaded
# host) and joins the group, often without a line. A job still starting is not
# hung. A rank with no progress yet is hung only this long after the launch (or the
# timeout, the longer): a torchrun wedged before its ranks, a rank stuck in its imports,
# or a script that prints on rank 0 only and keeps no heartbeat (its silent ranks hold a
# hang of every rank back until then); torchrun's own rendezvous timeout may end it first.
NOT_STARTED_S = 300.0


class HangWatch:
    """Each rank's last progress on `now` (a monotonic clock; tests pass a fake), and
    since when the ranks without any yet have been waited for (the launch)."""

    def __init__(self, timeout: float, ranks: Iterable[int],
                 now: Callable[[], float] = time.monotonic) -> None:
        self.timeout, self.now, self.lock = timeout, now, threading.Lock()
        self.launched = now()
        self.waiting = set(ranks)        # no progress yet
        self.last: dict[int, float] = {}
        self.beating: set[int] = set()   # ranks that touched their heartbeat file

    def progress(self, rank: int, heartbeat: bool = False) -> None:
        """A line of the rank's output, or (`heartbeat`) a touch of its file."""
        with self.lock:
            if rank in self.waiting or rank in self.last:   # not an ended or unknown rank
                self.waiting.discard(rank)
                self.last[rank] = self.now()
                if heartbeat:
                    self.beating.add(rank)

    def ended(self, rank: int) -> None:
        """An exited rank is no longer watched."""
        with self.lock:
            self.last.pop(rank, None)
            self.waiting.discard(rank)

    def check(self) -> Hang | None:
        now = self.now()
        with self.lock:
            since = dict(self.last)
            since.update((r, self.launched) for r in self.waiting)
            bound = {r: self.bound(r) for r in since}
            idle = {r: now - t for r, t in since.items() if now - t >= bound[r]}
            everyone = not any(now - t < bound[r] / 2 for r, t in since.items())
            if len(idle) < len(since):   # some went on: only a missed heartbeat counts
                idle = {r: t for r, t in idle.items() if r in self.beating}
        if not idle:
            return None
        return Hang(tuple(sorted(idle)), max(idle.values()), everyone, self.timeout)

    def bound(self, rank: int) -> float:
        """How long `rank` may go without progress (the lock held)."""
        return max(self.timeout, NOT_STARTED_S) if rank in self.waiting else self.timeout


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def short(self) -> str:
        return f"{self.func} ({self.file.rsplit('/', 1)[-1]}:{self.line})"


def threads(text: str) -> list[tuple[str, list[Frame]]]:
    """faulthandler's dump: (header, frames most recent first) per thread."""
    out: list[tuple[str, list[Frame]]] = []
    for line in text.splitlines():
        m = _FRAME.match(line)
        if m and out:
            out[-1][1].append(Frame(m.group(1), int(m.group(2)), m.group(3)))
        elif line and not line[0].isspace() and "most recent call first" in line:
            out.append((line, []))
    return out


def main_thread(text: str) -> list[Frame]:
    """The main thread's frames: the one started by the interpreter (its outermost frame
    is a module's code), else the thread that took the signal, else the first."""
    found = threads(text)
    for _, frames in found:
        if frames and frames[-1].func == "<module>":
            return frames
    for header, frames in found:
        if header.startswith("Current thread"):
            return frames
    return found[0][1] if found else []


@dataclass(frozen=True)
class RankStack:
    """One rank's answer to `stacks` (protocol.RANK_STACK) and where it runs."""

    rank: int
    host: int
    state: str
    pid: int | None
    text: str
    frames: tuple[Frame, ...] = ()

    @property
    def where(self) -> str:
        return self.frames[0].short() if self.frames else self.state

    @property
    def key(self) -> tuple[str, str]:
        f = self.frames[0]
        return f.file.rsplit("/", 1)[-1], f.func

    @property
    def waiting(self) -> bool:
        return any(part in f.file for f in self.frames for part in WAITING_IN)


def rank_stacks(replies: dict[int, HostStacks]) -> dict[int, RankStack]:
    """The hosts' replies as RankStacks by rank."""
    out = {}
    for host, reply in replies.items():
        for e in reply.ranks:
            frames = tuple(main_thread(e.stack)) if e.state == "answered" else ()
            out[e.rank] = RankStack(e.rank, host, e.state, e.pid, e.stack, frames)
    return out


@dataclass
class Culprits:
    """The ranks named, why each, and where the others were ("" when not by stack)."""

    why: dict[int, str] = field(default_factory=dict)
    others: str = ""


def by_stack(answered: list[RankStack]) -> Culprits:
    """The ranks outside the largest group of innermost frames."""
    groups: dict[tuple[str, str], list[RankStack]] = {}
    for s in answered:
        groups.setdefault(s.key, []).append(s)
    if len(groups) < 2:
        return Culprits()
    sizes = Counter({k: len(v) for k, v in groups.items()})
    top = max(sizes.values())
    largest = [k for k, n in sizes.items() if n == top]
    if len(largest) > 1:   # a tie: the waiting groups are where the others are
        largest = [k for k in largest if groups[k][0].waiting]
        if len(largest) != 1 or not any(not groups[k][0].waiting for k in groups):
            return Culprits()
    where = groups[largest[0]][0].where
    n = len(groups[largest[0]])
    out = Culprits(others=where)
    for key, members in groups.items():
        if key != largest[0]:
            for s in members:
                out.why[s.rank] = (f"in {s.where} while {n} other rank{'s' if n > 1 else ''} "
                                   f"{'are' if n > 1 else 'is'} in {where}")
    return out


def culprits(hang: Hang, stacks: dict[int, RankStack]) -> Culprits:
    """Who is not where the others are (the module's docstring gives the order)."""
    live = [s for s in stacks.values() if s.state not in ("exited", "gone")]
    stuck = {s.rank: CANNOT_ANSWER[s.state] for s in live if s.state in CANNOT_ANSWER}
    if stuck:
        return Culprits(stuck)
    answered = [s for s in live if s.state == "answered" and s.frames]
    silent = {s.rank: "did not answer the stack request (its SIGUSR2 handler replaced?)"
              for s in live if s.state == "no answer"}
    if silent and answered:
        return Culprits(silent)
    found = by_stack(answered)
    if found.why:
        return found
    if not hang.everyone:
        return Culprits({r: f"no output and no heartbeat for {hang.seconds:.0f} s while the "
                            "others went on" for r in hang.idle})
    return Culprits()


# ---------------------------------------------------------------- the report

STACK_LINES = 12     # the culprit's main thread in the report (its log has every thread)
WHERE_GROUPS = 8     # "where every rank was": at most this many places


@dataclass(frozen=True)
class HangReport:
    """What a hang's investigation found: the monitor prints it, then fails the job."""

    hang: Hang
    stacks: dict[int, RankStack]
    found: Culprits
    nccl_dumps: tuple[str, ...] = ()     # paths on their hosts: "<host>: <path>"
    unreachable: tuple[str, ...] = ()    # "<host>: why" for hosts whose stacks did not come


def reason(hang: Hang) -> str:
    """The banner the hosts write above each stack in the rank's log."""
    if hang.everyone:
        who, rest = "no rank made", ""
    else:
        more = " ..." if len(hang.idle) > 16 else ""
        who = (f"{'ranks' if len(hang.idle) > 1 else 'rank'} "
               f"{', '.join(map(str, hang.idle[:16]))}{more} made no")
        rest = " while the others did"
    return (f"hang: {who} progress (output or heartbeat) for {hang.seconds:.0f} s{rest} "
            f"(hang_timeout {hang.timeout:g} s)")


def places(stacks: dict[int, RankStack]) -> list[str]:
    """Where every rank was, grouped: `ranks 0, 2: all_reduce (distributed_c10d.py:2050)`."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(stacks):
        groups.setdefault(stacks[rank].where, []).append(rank)
    lines = [f"{'ranks' if len(rs) > 1 else 'rank'} {', '.join(map(str, rs[:32]))}"
             f"{' ...' if len(rs) > 32 else ''}: {where}"
             for where, rs in sorted(groups.items(), key=lambda g: -len(g[1]))]
    if len(lines) > WHERE_GROUPS:
        lines = lines[:WHERE_GROUPS] + [f"... and {len(lines) - WHERE_GROUPS} more places"]
    return lines


def user_frames(frames: tuple[Frame, ...]) -> list[Frame]:
    """Without the outermost frames of orch's rank start (run/<part>/rankexec.py) and
    runpy."""
    out = list(frames)
    while out and (out[-1].file.endswith("/rankexec.py") or "runpy" in out[-1].file):
        out.pop()
    return out or list(frames)


def stack_lines(s: RankStack) -> list[str]:
    shown = user_frames(s.frames)
    frames = shown[:STACK_LINES]
    lines = [f'  File "{f.file}", line {f.line} in {f.func}' for f in frames]
    if len(shown) > STACK_LINES:
        lines.append(f"  ... {len(shown) - STACK_LINES} outer frames in the log")
    return lines
