"""Host addresses in cluster.yaml: plain ASCII host names or IP addresses, and
pdsh/ClusterShell ranges (`gpu[01-16]`, `10.0.0.[1-8]`) that expand to several.

An address goes into ssh, into ~/.ssh/config lookups, into MASTER_ADDR on every rank:
a look-alike character (a full-width digit, a zero-width space) would silently reach
another machine or none, so only ASCII letters, digits, `.`, `-`, `_` (and IPs) pass.
Ranges are expanded by ClusterShell's NodeSet, after a cheap count of what they would
expand to: NodeSet builds every name in memory, so `n[1-1000000000]` must never reach it.
"""
from __future__ import annotations

import ipaddress
import re
import unicodedata

from ClusterShell.NodeSet import RESOLVER_NOGROUP, NodeSet, NodeSetException

from orchestrator.config.yamlnodes import short

MAX_HOST_NAME = 253  # DNS's limit for a whole name

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*", re.ASCII)
_NUMERIC_RE = re.compile(r"[0-9.]+", re.ASCII)
# A range: name characters (and `:` for IPv6) outside brackets, numbers inside.
_RANGE_RE = re.compile(r"(?:[A-Za-z0-9._:-]|\[[0-9,/-]*\])+", re.ASCII)
_BRACKETS_RE = re.compile(r"\[([^\]]*)\]")
_PIECE_RE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18})(?:/([0-9]{1,18}))?)?", re.ASCII)
RANGE_HINT = ("write a range as a name with numbers in brackets, e.g. `gpu[01-16]`, "
              "`10.0.0.[1-8]` or `node[1,3,5-7]`")


class BadAddress(Exception):
    """What is wrong with an address and the fix; the inventory adds file and line."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message, self.hint = message, hint


def is_range(address: str) -> bool:
    return "[" in address or "]" in address


def expand(address: str, room: int) -> list[str]:
    """The hosts an address stands for, in order: itself, or a range's names ascending.
    `room` is how many hosts may still be added; a bigger range is refused before it is built."""
    _check_ascii(address)
    if not is_range(address):
        check(address)
        return [address]
    if not _RANGE_RE.fullmatch(address):
        hint = RANGE_HINT + (" (an IPv6 address is written without brackets)" if ":" in address else "")
        raise BadAddress(f"{short(address)!r} is not a host range", hint)
    count = range_size(address)
    if count > room:
        raise BadAddress(f"the range {short(address)!r} expands to {count} hosts, more than the "
                         f"{room} that the limit of hosts leaves", "split the job, or list fewer hosts")
    try:
        names = list(NodeSet(address, resolver=RESOLVER_NOGROUP))
    except NodeSetException as exc:
        raise BadAddress(f"the range {short(address)!r} is not valid: {short(str(exc), 120)}", RANGE_HINT) from None
    for name in names:
        check(name)
    return names


def range_size(address: str) -> int:
    """How many names a range makes: the product over its brackets of each bracket's count.
    Also refuses what NodeSet would accept but we do not want: reversed ranges, step 0."""
    total = 1
    for inside in _BRACKETS_RE.findall(address):
        count = 0
        for piece in inside.split(","):
            count += _piece_size(address, piece)
        total *= count
    return total


def _piece_size(address: str, piece: str) -> int:
    match = _PIECE_RE.fullmatch(piece)
    if not match:
        raise BadAddress(f"the range {short(address)!r} has {short(piece)!r} in brackets, which is not "
                         "`a`, `a-b` or `a-b/step`", RANGE_HINT)
    first, last, step = int(match[1]), int(match[2] or match[1]), int(match[3] or 1)
    if last < first:
        raise BadAddress(f"the range {short(address)!r} goes backwards ({short(piece)})",
                         f"write it in ascending order: [{match[2]}-{match[1]}]")
    if step == 0:
        raise BadAddress(f"the range {short(address)!r} has a step of 0 ({short(piece)})", "write a step of 1 or more")
    return (last - first) // step + 1


def check(address: str) -> None:
    """Refuse anything but an ASCII host name, an IP address or an ~/.ssh/config alias."""
    _check_ascii(address)
    if not address.strip() or any(c.isspace() for c in address) or address.startswith("-"):
        raise BadAddress(f"{short(address)!r} is not a host name",
                         "write an IP, a DNS name or an ~/.ssh/config alias")
    if "@" in address:
        user, _, rest = address.rpartition("@")
        raise BadAddress(f"{short(address)!r} contains a user name",
                         f"write `address: {short(rest)}` and `user: {short(user)}`")
    host, sep, port = address.rpartition(":")
    if sep and port.isdigit() and ":" not in host:
        raise BadAddress(f"{short(address)!r} contains a port",
                         f"write `address: {short(host)}` and `port: {short(port)}`")
    if _is_ip(address):
        return
    if ":" in address or _NUMERIC_RE.fullmatch(address):
        raise BadAddress(f"{short(address)!r} is not a valid IP address", "write an IPv4 (10.0.0.8) or IPv6 address")
    bad = next((c for c in address if not (c.isalnum() or c in "._-")), None)
    if bad is not None or not _NAME_RE.fullmatch(address) or len(address) > MAX_HOST_NAME:
        why = f"{bad!r} cannot be in a host name" if bad else \
            f"at most {MAX_HOST_NAME} characters" if len(address) > MAX_HOST_NAME else "it starts with '.'"
        raise BadAddress(f"{short(address)!r} is not a host name ({why})",
                         "use letters, digits, '.', '-' and '_' (an IP, a DNS name or an ~/.ssh/config alias)")


def _check_ascii(address: str) -> None:
    odd = next((c for c in address if not c.isascii()), None)
    if odd is not None:
        name = unicodedata.name(odd, "no name")
        raise BadAddress(f"{short(address)!r} contains the non-ASCII character U+{ord(odd):04X} ({name})",
                         "type the address in plain ASCII: a look-alike character would reach "
                         "another machine, or none")


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


_FOLDABLE_RE = re.compile(r"[A-Za-z0-9._:#-]+", re.ASCII)


def fold(labels: list[str]) -> str:
    """Host labels the way a range is written (`127.0.1.[1-3]`, `gpu[01-04,07]`), by
    ClusterShell as pdsh users read them; labels it could misread: joined with commas."""
    if not all(_FOLDABLE_RE.fullmatch(label) for label in labels):
        return ", ".join(labels)
    try:
        return str(NodeSet.fromlist(labels, resolver=RESOLVER_NOGROUP))
    except NodeSetException:
        return ", ".join(labels)
