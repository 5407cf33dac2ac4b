"""How counts and hints read: `plural(1, "host")` is "1 host"; every `orch ...` hint names
the inventory it was printed for, so that it works as printed (SPEC: hints keep -c FILE)."""
from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

IRREGULAR = {"process": "processes", "class": "classes"}
_current: list[Path] = []   # the inventory of the running command (commands.common.inventory)


def set_inventory(path: Path | str) -> None:
    """Called once a command knows its inventory: hints raised deep below (a connection
    lost, a push broken off), which have no Cluster at hand, name it too."""
    _current[:] = [Path(path)]


def plural(n: int, word: str) -> str:
    """`plural(1, "host")` -> "1 host", `plural(3, "process")` -> "3 processes"."""
    return f"{n} {word if n == 1 else IRREGULAR.get(word, word + 's')}"


def inventory_arg(path: Path | str) -> str:
    """The inventory as a hint names it: relative when it is under the current folder,
    absolute otherwise; "" for ./cluster.yaml (the default needs no -c)."""
    path = Path(os.path.abspath(path))
    cwd = Path(os.getcwd())
    try:
        rel = path.relative_to(cwd)
    except ValueError:
        return str(path)
    return "" if str(rel) == "cluster.yaml" else str(rel)


def hint_cmd(cluster: Any, rest: str) -> str:
    """`hint_cmd(cluster, "logs --rank 2")` -> "orch logs -c runs/a.yaml --rank 2": the
    command's first word, then -c FILE (omitted for ./cluster.yaml), then the rest.
    cluster None: the running command's inventory (set_inventory)."""
    verb, _, tail = rest.partition(" ")
    path = cluster.path if cluster is not None else (_current[0] if _current else None)
    inv = inventory_arg(path) if path is not None else ""
    parts = ["orch", verb] + (["-c", shlex.quote(inv)] if inv else []) + ([tail] if tail else [])
    return " ".join(parts)
