"""`--hosts SEL`: the hosts a selection names, in inventory order: indexes, addresses or
labels, and ranges of addresses (127.0.0.[2-3]), comma-separated."""
from __future__ import annotations

from orchestrator.config import hostranges
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import UsageError


def split_selection(text: str) -> list[str]:
    """Comma-separated items; a comma inside a range's brackets (node[1,3]) stays."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    items.append(cur.strip())
    return [i for i in items if i]


def select(cluster: Cluster, text: str | None) -> tuple[Host, ...]:
    """The hosts SEL names, in inventory order: an index, an address or label, or a
    range of addresses. Anything that names no host is a usage error (exit 2)."""
    if text is None:
        return cluster.hosts
    chosen: set[int] = set()
    for item in split_selection(text) or [text]:
        chosen |= _match(cluster, item)
    return tuple(h for h in cluster.hosts if h.index in chosen)


def _match(cluster: Cluster, item: str) -> set[int]:
    if item.isdigit():
        if int(item) < len(cluster.hosts):
            return {int(item)}
        raise UsageError(
            f"--hosts: there is no host {item} (this job has hosts 0 to {len(cluster.hosts) - 1})",
            hint="give an index, an address or a label",
        )
    try:
        names = (
            set(hostranges.expand(item, len(cluster.hosts) * 4 + 64))
            if hostranges.is_range(item)
            else {item}
        )
    except hostranges.BadAddress as e:
        raise UsageError(f"--hosts: {e.message}", hint=e.hint) from None
    found = {h.index for h in cluster.hosts if h.label in names or h.address in names}
    if not found:
        known = ", ".join(h.label for h in cluster.hosts[:8]) + (
            ", ..." if len(cluster.hosts) > 8 else ""
        )
        raise UsageError(
            f"--hosts: {item!r} names no host of job '{cluster.name}'",
            hint=f"give indexes, addresses or labels of its hosts ({known})",
        )
    return found
