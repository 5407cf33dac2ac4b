"""The documentation: a short README, every page of docs/ in mkdocs.yml's nav (and every
nav entry a page), and a site that builds with `mkdocs build --strict` (broken links,
missing anchors and pages left out of nav are errors there; about 1 s). No network."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README_MAX_LINES = 220


class _Loader(yaml.SafeLoader):
    """mkdocs.yml uses mkdocs' own tags (`!relative`); their values do not matter here."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: None)


def nav_pages(entries: Any) -> list[str]:
    """Every page path in a mkdocs nav (a list of `Title: page`, `page`, or sections)."""
    out: list[str] = []
    if isinstance(entries, str):
        out.append(entries)
    elif isinstance(entries, list):
        for e in entries:
            out += nav_pages(e)
    elif isinstance(entries, dict):
        for value in entries.values():
            out += nav_pages(value)
    return out


def config() -> dict[str, Any]:
    with open(REPO / "mkdocs.yml", encoding="utf-8") as f:
        data = yaml.load(f, Loader=_Loader)
    assert isinstance(data, dict)
    return data


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/")


def test_readme_keeps_the_test_command() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    for command in ("make test", "make test-fast", "make check", "make docs", "## Python API"):
        assert command in text, command


def test_every_page_is_in_nav_and_every_nav_entry_exists() -> None:
    nav = nav_pages(config()["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert pages, "no pages under docs/"
    assert sorted(set(nav)) == sorted(nav), "a page is listed twice in nav"
    missing = [p for p in pages if p not in nav]
    assert not missing, f"pages under docs/ not in mkdocs.yml's nav: {missing}"
    absent = [p for p in nav if not (DOCS / p).is_file()]
    assert not absent, f"nav entries with no page under docs/: {absent}"


def test_strict_validation_is_configured() -> None:
    validation = config()["validation"]
    for key in ("omitted_files", "absolute_links", "unrecognized_links", "anchors"):
        assert validation.get(key) == "warn", key


def test_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site),
         "-f", str(REPO / "mkdocs.yml")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (site / "index.html").is_file()
    assert (site / "worker" / "index.html").is_file()
    assert "HOGWILD!" in (site / "worker" / "index.html").read_text(encoding="utf-8")
