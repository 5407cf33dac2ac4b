"""How counts and hints read: `plural(1, "host")` is "1 host"; every `orch ...` hint names
the inventory it was printed for, so that it works as printed (SPEC: hints keep -c FILE)."""
from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

IRREGULAR = {"process": "processes", "class": "classes"}


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
    command's first word, then -c FILE (omitted for ./cluster.yaml), then the rest."""
    verb, _, tail = rest.partition(" ")
    inv = inventory_arg(cluster.path)
    parts = ["orch", verb] + (["-c", shlex.quote(inv)] if inv else []) + ([tail] if tail else [])
    return " ".join(parts)
