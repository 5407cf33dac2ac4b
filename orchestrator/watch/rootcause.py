"""Which failure caused a job's end: never orch's own stop, and never a guess finer than
the clocks allow.

- An exit the host tagged `after_stop` (it came after that host received a stop, by that
  host's own clock) is a consequence, never the cause.
- Failures on different hosts are ordered on our clock through each host's measured
  offset (clock.py); two failures closer than their clocks' uncertainty are reported
  together, not ordered.
- A host that went silent before the first failure is the cause: its ranks could not
  report, and the others' failures followed from its silence.

A hang has no failed exit to order: its cause is named from the ranks' stacks (hang.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.watch.clock import HostClock
from orchestrator.wire import timeouts

SAME_HOST = 0.001     # two exits on one host: one clock, ordered to the millisecond


@dataclass(frozen=True)
class Exit:
    """A rank's exit as its host reported it."""

    host: int
    rank: int
    code: int
    host_time: float
    after_stop: bool = False


@dataclass(frozen=True)
class Failure:
    """A failed rank's exit on our clock, give or take `uncertainty` seconds."""

    host: int
    rank: int
    code: int
    at: float
    uncertainty: float


@dataclass(frozen=True)
class Verdict:
    """The cause: `silent` hosts (went quiet before any rank failed), else `failures`
    (the first failing rank and any failing within the clocks' uncertainty of it);
    `later` are failures after the cause, `also_lost` hosts lost after it."""

    failures: tuple[Failure, ...]
    silent: tuple[int, ...]
    later: tuple[Failure, ...]
    also_lost: tuple[int, ...]


def candidates(exits: list[Exit], clocks: dict[int, HostClock],
               stop_started: float | None) -> list[Failure]:
    """Non-zero exits that may be a cause, earliest first on our clock; at equal times a
    real exit code goes before a rank killed by a signal (usually its consequence)."""
    out = []
    for e in exits:
        if e.code == 0 or e.after_stop:
            continue
        clock = clocks.get(e.host) or HostClock()
        unc = min(clock.uncertainty, 3600.0)
        at = clock.ours(e.host_time)
        # an older agent does not tag: an exit surely after our stop began is ours
        if stop_started is not None and at - unc > stop_started:
            continue
        out.append(Failure(e.host, e.rank, e.code, at, unc))
    return sorted(out, key=lambda f: (f.at, f.code < 0, f.rank))


def together(a: Failure, b: Failure) -> bool:
    """Too close to tell which came first."""
    if a.host == b.host:
        return abs(a.at - b.at) < SAME_HOST
    return abs(a.at - b.at) <= a.uncertainty + b.uncertainty


def first_failures(cands: list[Failure]) -> tuple[list[Failure], list[Failure]]:
    """(the first failure and those that cannot be told from it, the rest)."""
    if not cands:
        return [], []
    first = cands[0]
    tied = [f for f in cands[1:] if together(first, f)]
    return [first, *tied], [f for f in cands[1:] if f not in tied]


def verdict(exits: list[Exit], clocks: dict[int, HostClock], stop_started: float | None,
            lost: dict[int, float], beat: float = timeouts.HEARTBEAT) -> Verdict:
    """`lost`: each lost host's last frame, on our clock; `beat`: the hosts' heartbeat
    period (timeouts.heartbeat)."""
    first, rest = first_failures(candidates(exits, clocks, stop_started))
    if not lost:
        return Verdict(tuple(first), (), tuple(rest), ())
    if not first:
        return Verdict((), tuple(sorted(lost, key=lost.get)), (), ())  # type: ignore[arg-type]
    start = first[0].at - first[0].uncertainty
    # its last heartbeat may be up to a period before it really went quiet
    silent = tuple(sorted((h for h, t in lost.items() if t + beat < start),
                          key=lost.get))  # type: ignore[arg-type]
    if silent:
        return Verdict((), silent, tuple(first + rest), tuple(h for h in lost if h not in silent))
    return Verdict(tuple(first), (), tuple(rest), tuple(sorted(lost)))
