"""Markdown tables of the GPU check (`make gpu-check`) and of `bench/gpu.py`.

Standard library only: `bench/gpu_check.py` renders its report with any Python, also one
without torch, and the tests exercise every table on a machine without a GPU.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TARGET = 0.9  # packed loader images/s over synthetic images/s, per model/batch/precision
SYNTHETIC, PACKED, FOLDER = "synthetic", "packed", "imagefolder"
TORCH_PATH = "packed-torch"  # the packed files through torch's own pin-memory path


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A GitHub markdown table; a `|` inside a cell is escaped."""
    def cell(value: object) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# pytest's junit XML -> one row per test


@dataclass
class TestResult:
    name: str
    outcome: str  # passed | failed | error | skipped: <reason>
    seconds: float
    detail: str = ""


def _outcome(case: ET.Element) -> tuple[str, str]:
    for tag in ("failure", "error"):
        found = case.find(tag)
        if found is not None:
            first = (found.get("message") or found.text or "").strip().splitlines()
            return ("failed" if tag == "failure" else "error"), (first[0] if first else "")[:200]
    skipped = case.find("skipped")
    if skipped is not None:
        reason = (skipped.get("message") or "").strip()
        # pytest writes "Skipped: <reason>" for pytest.skip() and the bare reason for skipif
        reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
        return f"skipped: {reason}", ""
    return "passed", ""


def tests_from_junit(path: Path) -> list[TestResult]:
    """Every test case of a pytest ``--junitxml`` file, in file order."""
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = (case.get("classname") or "").rsplit(".", 1)[-1]
        outcome, detail = _outcome(case)
        results.append(TestResult(f"{module}::{case.get('name')}", outcome,
                                  float(case.get("time") or 0.0), detail))
    return results


def tests_table(results: Sequence[TestResult]) -> str:
    if not results:
        return "(no test was collected)"
    return markdown_table(["check (pytest -m gpu)", "result", "seconds", "detail"],
                          [(r.name, r.outcome, f"{r.seconds:.1f}", r.detail) for r in results])


def tests_summary(results: Sequence[TestResult]) -> str:
    counts: dict[str, int] = {}
    for r in results:
        key = r.outcome.split(":")[0]
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests"


# ---------------------------------------------------------------------------
# bench/gpu.py results -> throughput and loader-efficiency tables


def _key(r: dict[str, Any]) -> tuple:
    return r["model"], r["batch"], r["mode"]


def _rate(r: dict[str, Any]) -> float | None:
    return None if r.get("error") else r.get("images_per_s")


def synthetic_rates(results: Sequence[dict[str, Any]]) -> dict[tuple, float]:
    return {_key(r): r["images_per_s"] for r in results
            if r["input"] == SYNTHETIC and _rate(r) is not None}


def _ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}"


def throughput_table(results: Sequence[dict[str, Any]]) -> str:
    base = synthetic_rates(results)
    rows = []
    for r in results:
        rate = _rate(r)
        shown = f"{rate:.0f}" if rate is not None else f"({r.get('error')})"
        rows.append((r["model"], r["batch"], r["mode"], r["input"], shown,
                     _ratio(rate, base.get(_key(r)))))
    return markdown_table(["model", "batch", "precision", "input", "images/s", "/ synthetic"], rows)


def efficiency_rows(results: Sequence[dict[str, Any]],
                    target: float = TARGET) -> list[tuple[object, ...]]:
    """Per model/batch/precision: synthetic images/s, packed and ImageFolder as fractions of it."""
    by_key: dict[tuple, dict[str, float | None]] = {}
    for r in results:
        by_key.setdefault(_key(r), {})[r["input"]] = _rate(r)
    rows = []
    for key, rates in by_key.items():
        base, packed = rates.get(SYNTHETIC), rates.get(PACKED)
        verdict = "-" if packed is None or not base else (
            "met" if packed / base >= target else "NOT met")
        rows.append((*key, "-" if base is None else f"{base:.0f}", _ratio(packed, base),
                     verdict, _ratio(rates.get(TORCH_PATH), base), _ratio(rates.get(FOLDER), base)))
    return rows


def efficiency_table(results: Sequence[dict[str, Any]], target: float = TARGET) -> str:
    return markdown_table(["model", "batch", "precision", "synthetic images/s",
                           "packed / synthetic", f"packed >= {target}",
                           "torch's pin path / synthetic", "ImageFolder / synthetic"],
                          efficiency_rows(results, target))


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def efficiency_summary(results: Sequence[dict[str, Any]], target: float = TARGET) -> str:
    """One sentence: where packed and ImageFolder land against synthetic, over all configs."""
    base = synthetic_rates(results)
    fractions: dict[str, list[float]] = {PACKED: [], FOLDER: []}
    for r in results:
        rate = _rate(r)
        if r["input"] in fractions and rate is not None and base.get(_key(r)):
            fractions[r["input"]].append(rate / base[_key(r)])
    packed, folder = fractions[PACKED], fractions[FOLDER]
    if not packed and not folder:
        return "No loader was measured against synthetic."
    parts = []
    if packed:
        met = sum(f >= target for f in packed)
        parts.append(f"Packed loader: {_span(packed)} of synthetic (target >= {target}: "
                     f"met in {met} of {len(packed)}).")
    if folder:
        parts.append(f"ImageFolder + PIL: {_span(folder)} of synthetic.")
    return " ".join(parts)


def bench_markdown(report: dict[str, Any]) -> str:
    """The whole bench/gpu.py section: set-up line, throughput, loader efficiency."""
    env, cfg = report.get("env", {}), report.get("config", {})
    setup = ", ".join(f"{k} {v}" for k, v in {**env, **cfg}.items())
    return "\n\n".join([
        f"Set-up: {setup}.",
        "Images/s of training steps (forward, backward, SGD step) at the given batch per step.",
        throughput_table(report["results"]),
        f"Loader efficiency (target: packed >= {TARGET} of synthetic):",
        efficiency_table(report["results"]),
        efficiency_summary(report["results"])])


def write_markdown(path: Path, title: str, sections: Sequence[tuple[str, str]]) -> str:
    """Write ``# title`` and ``## heading`` + body per section to ``path``; returns the text."""
    text = f"# {title}\n" + "".join(f"\n## {h}\n\n{body.rstrip()}\n" for h, body in sections)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a reader (or a cut-off run) sees the old report or the new one
    return text
