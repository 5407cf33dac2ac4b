"""Which followed hosts are lost: the rule of follow.watchdog, without its thread.

A host is lost once it sent nothing, not even a heartbeat, for `bound` seconds
(timeouts.host_lost: 15 s, longer when many hosts beat more slowly) of the controller's
own running time. Two silences are the controller's, not the hosts':

- Its watchdog looked late: the process did not run for a while (a starved machine, a
  paused VM), and the frames that came meanwhile are still unread. A gap between two
  looks counts in full up to ON_TIME seconds, beyond that as ON_TIME.
- Most hosts went silent together: at least QUORUM hosts, and more than half of those
  still followed, missed two beats. The controller's readers are behind (or its own
  network is down): a host is then lost only after twice the bound.

A host silent among talking ones, with the controller running, is lost after the bound.
"""
from __future__ import annotations

from dataclasses import dataclass

TICK = 0.25      # between two looks: checking is cheap, and a loss is seen this late at most
ON_TIME = 1.0    # a look this long after the last one is on time; a later one, a stall
QUORUM = 3       # fewer silent hosts say nothing of the controller (a job of two: one lost)


@dataclass
class Heard:
    """One host as the last look saw it."""

    seen: float      # its link's last frame (the watchdog's clock)
    quiet: float     # seconds of silence counted since then


class Silence:
    """Each followed host's silence, counted look by look on the controller's time."""

    def __init__(self, bound: float, period: float, now: float) -> None:
        self.bound, self.period, self.last = bound, period, now
        self.heard: dict[int, Heard] = {}

    def look(self, now: float, seen: dict[int, float]) -> list[tuple[int, str]]:
        """`seen`: each host still followed -> its last frame. The hosts lost now, with
        why; each is named once only if the caller stops passing it."""
        counted, before = max(0.0, min(now - self.last, ON_TIME)), self.last
        self.last = now
        for host, at in seen.items():
            self.count(host, at, before, counted)
        return self.judge(list(seen))

    def judge(self, hosts: list[int]) -> list[tuple[int, str]]:
        """The hosts past the bound, unless most went silent together (then twice it)."""
        late = [h for h in hosts if self.heard[h].quiet > self.bound]
        if not late:
            return []
        behind = sum(self.heard[h].quiet > 2 * self.period for h in hosts)
        if behind >= QUORUM and 2 * behind > len(hosts):
            why = (f"no answer for {2 * self.bound:.0f} s (nor from {behind - 1} of the "
                   f"{len(hosts) - 1} other hosts)")
            return [(h, why) for h in late if self.heard[h].quiet > 2 * self.bound]
        return [(h, f"no answer for {self.bound:.0f} s") for h in late]

    def count(self, host: int, at: float, before: float, counted: float) -> None:
        """A frame not seen at the last look (or a host new to it): its silence is what
        came before that look plus this look's counted time, never more than the real
        one; no new frame: the counted time adds to what was."""
        was = self.heard.get(host)
        if was is not None and at == was.seen:
            was.quiet += counted
            return
        real = self.last - at                 # self.last: this look's time
        self.heard[host] = Heard(at, max(0.0, min(real, max(0.0, before - at) + counted)))
