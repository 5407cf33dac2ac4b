"""ARCHITECTURE.md's module map names every module of the package, and nothing that is gone:
a newcomer finds where a change belongs from that page alone."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "orchestrator"


def mapped() -> set[str]:
    """Every `path.py` in the module column of the Module map (relative to orchestrator/)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    cells = [row.split("|")[2] for row in section.splitlines() if row.count("|") >= 4]
    return {name for cell in cells for name in re.findall(r"`([\w/]+\.py)`", cell)}


def holds_code(path: Path) -> bool:
    """More than a docstring: a package's __init__ that only describes the package is
    described by the map's rows; one with code (api/__init__.py) is a module of its own."""
    body = ast.parse(path.read_text()).body
    return bool(body[1:] if body and isinstance(body[0], ast.Expr) else body)


def modules() -> set[str]:
    """Every module; a package's __init__ only where it holds code."""
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts
            and (p.name != "__init__.py" or p.parent == PACKAGE or holds_code(p))}


def test_every_module_is_in_the_map() -> None:
    missing = sorted(modules() - mapped())
    assert not missing, f"add these to ARCHITECTURE.md's module map: {missing}"


def test_the_map_names_no_module_that_is_gone() -> None:
    gone = sorted(mapped() - modules())
    assert not gone, f"ARCHITECTURE.md's module map names modules that do not exist: {gone}"


def test_every_package_is_in_the_layout() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    layout = text.split("## The layout", 1)[1].split("\n## ", 1)[0]
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert [p for p in packages if f"{p}/" not in layout] == []
