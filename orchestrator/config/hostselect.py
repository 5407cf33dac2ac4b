"""Host selections: `orch exec --hosts SEL`, and `orch up --hosts SEL --exclude SEL`.

A selection names hosts in inventory order: indexes, addresses or labels, and ranges of
addresses (127.0.0.[2-3]), separated by commas (or `@`, as DeepSpeed separates hosts).
`host:0,1` names GPUs 0 and 1 of that host, as DeepSpeed's --include writes it: digits
after a `host:N` item are more GPUs of the same host.

`narrow` turns `up`'s selection into the run's `Cluster`: the chosen hosts only, their
indexes and ranks renumbered in inventory order, so everything downstream (preflight,
launch, the state) sees just the run.
"""
from __future__ import annotations

from dataclasses import replace

from orchestrator.config import hostranges
from orchestrator.config.inventory import Cluster, Host, RankSlot
from orchestrator.errors import UsageError

# inventory index -> the GPUs of this run there (None: the host as the inventory gives it)
Picks = dict[int, "tuple[int, ...] | None"]


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


def select(cluster: Cluster, text: str | None, flag: str = "--hosts") -> tuple[Host, ...]:
    """The hosts SEL names, in inventory order: an index, an address or label, or a
    range of addresses. Anything that names no host is a usage error (exit 2)."""
    if text is None:
        return cluster.hosts
    chosen = pick(cluster, text, flag)
    return tuple(h for h in cluster.hosts if h.index in chosen)


def pick(cluster: Cluster, text: str, flag: str) -> Picks:
    """Each host SEL names and its GPUs (None: all of the host's)."""
    picks: Picks = {}
    for group in _groups(text):
        gpu_host: set[int] | None = None   # the hosts of the last `host:N` item
        for item in split_selection(group) or [group]:
            if item.isdigit() and gpu_host is not None:
                _add(picks, {i: (int(item),) for i in gpu_host})
                _check_gpus(cluster, gpu_host, int(item), item, flag)
                continue
            found, gpu = _item(cluster, item, flag)
            gpu_host = set(found) if gpu is not None else None
            if gpu is not None:
                _check_gpus(cluster, found, gpu, item, flag)
            _add(picks, {i: None if gpu is None else (gpu,) for i in found})
    return picks


def _groups(text: str) -> list[str]:
    """`a:0,1@b:0` -> ["a:0,1", "b:0"] (`@` outside brackets, as DeepSpeed writes it)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "@" and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [g for g in [*out, cur] if g.strip()] or [text]


def _add(picks: Picks, more: Picks) -> None:
    """Union: a whole host stays whole; GPUs of one host add up (sorted, each once)."""
    for i, gpus in more.items():
        if gpus is None or (i in picks and picks[i] is None):
            picks[i] = None
        else:
            picks[i] = tuple(sorted(set(picks.get(i) or ()) | set(gpus or ())))


def _item(cluster: Cluster, item: str, flag: str) -> tuple[set[int], int | None]:
    """The hosts one item names, and the GPU it names on them (None: no `:N`). A label
    with a port (`10.0.0.8:2222`) is a host first; only then is `:N` read as a GPU."""
    try:
        return _match(cluster, item, flag), None
    except UsageError:
        head, sep, tail = item.rpartition(":")
        if not (sep and head and tail.isdigit()):
            raise
    return _match(cluster, head, flag), int(tail)


def _check_gpus(cluster: Cluster, found: set[int], gpu: int, item: str, flag: str) -> None:
    for i in sorted(found):
        h = cluster.hosts[i]
        if h.gpus == 0:
            raise UsageError(f"{flag} {item!r}: host {h.label} has no GPUs in "
                             f"{cluster.path.name} (gpus: 0)",
                             hint=f"name the host without `:GPU`, or set `gpus:` on it (line {h.line})")
        if gpu >= h.gpus:
            raise UsageError(f"{flag} {item!r}: host {h.label} has no GPU {gpu}: "
                             f"{cluster.path.name} gives it gpus: {h.gpus} (GPUs 0 to {h.gpus - 1})",
                             hint=f"name GPUs 0 to {h.gpus - 1}, or raise `gpus:` on line {h.line}")


def _match(cluster: Cluster, item: str, flag: str = "--hosts") -> set[int]:
    if item.isdigit():
        if int(item) < len(cluster.hosts):
            return {int(item)}
        raise UsageError(
            f"{flag}: there is no host {item} in {cluster.path.name} "
            f"(job '{cluster.name}' has hosts 0 to {len(cluster.hosts) - 1})",
            hint="give an index, an address or a label",
        )
    try:
        names = (
            set(hostranges.expand(item, len(cluster.hosts) * 4 + 64))
            if hostranges.is_range(item)
            else {item}
        )
    except hostranges.BadAddress as e:
        raise UsageError(f"{flag}: {e.message}", hint=e.hint) from None
    found = {h.index for h in cluster.hosts if h.label in names or h.address in names}
    if not found:
        known = ", ".join(h.label for h in cluster.hosts[:8]) + (
            ", ..." if len(cluster.hosts) > 8 else ""
        )
        raise UsageError(
            f"{flag}: {item!r} names no host of job '{cluster.name}' in {cluster.path.name}",
            hint=f"give indexes, addresses or labels of its hosts ({known})",
        )
    return found


# ---------------------------------------------------------------- `orch up`'s hosts


def narrow(cluster: Cluster, hosts: str | None = None, exclude: str | None = None) -> Cluster:
    """The run's cluster: `hosts` (default: every host) less `exclude`. Exit 2 when
    nothing is left. The whole inventory comes back unchanged (selection "")."""
    if hosts is None and exclude is None:
        return cluster
    picks: Picks = pick(cluster, hosts, "--hosts") if hosts is not None \
        else {h.index: None for h in cluster.hosts}
    out: Picks = pick(cluster, exclude, "--exclude") if exclude is not None else {}
    for i, gpus in out.items():
        if i not in picks:
            continue
        if gpus is None:
            del picks[i]
            continue
        h = cluster.hosts[i]
        have = picks[i]
        left = tuple(g for g in (have if have is not None else range(h.gpus)) if g not in gpus)
        # from the whole host, as many GPUs as it runs ranks: procs may be below gpus
        picks[i] = left if have is not None else left[:h.procs]
        if not picks[i]:
            del picks[i]
    flags = " ".join(f"{f} {v}" for f, v in (("--hosts", hosts), ("--exclude", exclude))
                     if v is not None)
    if not picks:
        raise UsageError(f"{flags} leaves no host of job '{cluster.name}' in {cluster.path.name}",
                         hint="name at least one of its hosts with --hosts, or exclude fewer")
    if all(picks.get(h.index, 0) is None for h in cluster.hosts):
        return cluster
    return narrowed(cluster, picks, flags)


def narrowed(cluster: Cluster, picks: Picks, selection: str) -> Cluster:
    """The hosts in `picks`, renumbered in inventory order (index = node rank, ranks
    contiguous from 0); each keeps its label, which names its part of the job folder."""
    hosts: list[Host] = []
    for h in cluster.hosts:
        if h.index not in picks:
            continue
        gpus = picks[h.index]
        hosts.append(replace(h, index=len(hosts), first_rank=hosts[-1].ranks.stop if hosts else 0,
                             procs=h.procs if gpus is None else len(gpus), gpu_ids=gpus,
                             display=h.label))
    ranks = tuple(RankSlot(r, h.index, r - h.first_rank) for h in hosts for r in h.ranks)
    spec = cluster.job.array
    if spec is not None and spec.procs_per_task > max(h.procs for h in hosts):
        raise UsageError(f"{selection}: no host left runs {spec.procs_per_task} processes, "
                         "which one task of the job array needs (job.array.procs_per_task)",
                         hint="keep a host with enough procs (or GPUs) in the run")
    return replace(cluster, hosts=tuple(hosts), world_size=len(ranks), ranks=ranks,
                   selection=selection)
