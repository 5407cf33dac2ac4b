"""Where and how to connect to one host or bastion: what connect.py builds from
~/.ssh/config and the inventory, and what faults.py names in its messages."""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.wire import timeouts


@dataclass(frozen=True)
class Target:
    """Where and how to connect, after ~/.ssh/config and the inventory are merged."""

    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    known_hosts: str
    policy: str
    timeout: float
    jumps: tuple[Target, ...] = ()   # bastions, first hop first
    name: str = ""                     # as written (a bastion's `user@host:port`)
    keepalive: float = timeouts.KEEPALIVE   # its period once logged in (timeouts.keepalive)
    window: int = 2 << 20   # what a channel may send before we read it (connect.window)

    @property
    def address(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"
