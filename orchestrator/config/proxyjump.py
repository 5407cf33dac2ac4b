"""`proxy_jump` values: `[user@]host[:port]`, one bastion or a comma-separated chain.

Shared by the inventory (which checks what is written) and the connection layer
(which also reads `ProxyJump` from ~/.ssh/config), so both accept the same text.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

# user: no @ : or space; host: a name, an IPv4 address or a bracketed IPv6 address
_JUMP_RE = re.compile(r"(?:(?P<user>[^@\s:\[\]]+)@)?"
                      r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)"
                      r"(?::(?P<port>[0-9]{1,5}))?")


@dataclass(frozen=True)
class Jump:
    """One bastion as written; None: ~/.ssh/config, then the defaults, decide."""

    user: str | None
    host: str
    port: int | None

    def __str__(self) -> str:
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"{user}{self.host}{port}"


def parse_jump(text: str) -> Jump:
    """One `[user@]host[:port]`; ValueError says what is wrong with it."""
    text = text.strip()
    if text.startswith("ssh://"):
        text = text[len("ssh://"):]  # OpenSSH also accepts its URI form
    m = _JUMP_RE.fullmatch(text)
    if not m or m["host"].startswith("-"):
        raise ValueError(f"{text!r} is not [user@]host[:port]")
    port = int(m["port"]) if m["port"] else None
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{text!r}: port {port} is not from 1 to 65535")
    return Jump(m["user"], m["host"].strip("[]"), port)


def split_jumps(value: str | Sequence[str]) -> tuple[str, ...]:
    """The hops of a chain, first bastion first; `none` (as in ssh_config) means direct."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    hops = tuple(p.strip() for p in parts)
    if len(hops) == 1 and hops[0].lower() == "none":
        return ()
    return hops


def parse_chain(value: str | Sequence[str]) -> tuple[Jump, ...]:
    return tuple(parse_jump(hop) for hop in split_jumps(value))
