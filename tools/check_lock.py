"""Prove that a venv holds exactly the locked set: every package of the lock at its version,
and nothing else but orch itself. `make install` runs it after installing, so CI on a fresh
clone fails when the lock and what pip installed disagree.

    python tools/check_lock.py requirements.lock
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def canonical(name: str) -> str:
    """PEP 503's normal form: `PyYAML` and `pyyaml`, `types_paramiko` and `types-paramiko` match."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        match = _PIN.match(line.strip())
        if match:
            pins[canonical(match.group(1))] = match.group(2)
    return pins


def installed() -> dict[str, str]:
    found = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}
    found.pop("orch", None)  # the project itself, installed editable
    return found


def differences(want: dict[str, str], have: dict[str, str]) -> list[str]:
    lines = []
    for name in sorted(want.keys() | have.keys()):
        if name not in have:
            lines.append(f"missing: {name}=={want[name]}")
        elif name not in want:
            lines.append(f"not in the lock: {name}=={have[name]}")
        elif want[name] != have[name]:
            lines.append(f"{name}: {have[name]} installed, {want[name]} locked")
    return lines


def main(argv: list[str]) -> int:
    lock = Path(argv[1] if len(argv) > 1 else "requirements.lock")
    pins = locked(lock)
    problems = differences(pins, installed())
    if problems:
        print(f"{sys.prefix} does not hold exactly {lock}:", *problems, sep="\n  ", file=sys.stderr)
        print("fix: rebuild it (rm -rf .venv && make install), or refresh the lock on purpose "
              "(make lock)", file=sys.stderr)
        return 1
    print(f"{sys.prefix}: exactly the {len(pins)} packages of {lock}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
