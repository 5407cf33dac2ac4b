"""Which paths a push leaves out: `code.exclude` and the `.gitignore` beside the
inventory, read as git reads them (pathspec's gitignore patterns); each path left out
is named with the rule that did it (`.gitignore:<line>`, `code.exclude`), for a message
that says why a file was not pushed."""
from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pathspec

from orchestrator.config.patterns import PATTERN_HINT, pattern_problem
from orchestrator.errors import DataError

MAX_GITIGNORE = 16 << 20   # bytes: a .gitignore larger than this is not a .gitignore


@dataclass(frozen=True)
class Rule:
    where: str       # "code.exclude" or "<path>/.gitignore:<line>"
    text: str        # the pattern as written
    pattern: pathspec.Pattern

    def __str__(self) -> str:
        return f"{self.where} `{self.text}`"


def compile_rule(where: str, text: str) -> Rule | None:
    """One gitignore line; None for blank lines and comments."""
    problem = pattern_problem(text)
    if problem is not None:
        raise DataError(f"{where}: invalid pattern {text!r} ({problem})", hint=PATTERN_HINT)
    patterns = pathspec.GitIgnoreSpec.from_lines([text]).patterns
    pattern = next(iter(patterns), None)
    if pattern is None or pattern.include is None:
        return None
    return Rule(where, text, pattern)


class IgnoreRules:
    """`code.exclude` and the `.gitignore` beside the inventory, as git reads them:
    paths are relative to the inventory's folder. code.exclude always wins (its patterns
    also match any single path component); in .gitignore the last matching line wins."""

    def __init__(self, base: Path, exclude: Iterable[str], inventory: str = "") -> None:
        label = f"{inventory}: code.exclude" if inventory else "code.exclude"
        self.exclude = tuple(exclude)
        self.exclude_rules = [r for r in (compile_rule(label, p) for p in self.exclude) if r]
        self.label = label
        self.git_rules = read_gitignore(base / ".gitignore")

    def why(self, rel: str, is_dir: bool = False) -> str | None:
        """The rule that leaves `rel` itself out, or None."""
        path = rel + "/" if is_dir else rel
        for rule in self.exclude_rules:
            if rule.pattern.match_file(path) is not None:
                return str(rule)
        for part in rel.split("/"):
            for pat in self.exclude:
                if fnmatch.fnmatch(part, pat):
                    return f"{self.label} `{pat}`"
        found = None
        for rule in self.git_rules:
            if rule.pattern.match_file(path) is not None:
                found = rule if rule.pattern.include else None
        return str(found) if found else None

    def why_path(self, rel: str, is_dir: bool = False) -> str | None:
        """Like why(), but a path inside a left-out folder is left out too (as in git)."""
        parts = rel.split("/")
        for i in range(1, len(parts)):
            reason = self.why("/".join(parts[:i]), is_dir=True)
            if reason:
                return reason
        return self.why(rel, is_dir)


def read_gitignore(path: Path) -> list[Rule]:
    try:
        if not path.is_file():
            return []
        if path.stat().st_size > MAX_GITIGNORE:
            raise DataError(f"{path}: larger than {MAX_GITIGNORE >> 20} MiB, not a .gitignore",
                            hint="shorten it")
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})",
                        hint="fix its permissions") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x})",
                        hint="save the file as UTF-8") from None
    if "\0" in text:
        line = text.count("\n", 0, text.index("\0")) + 1
        raise DataError(f"{path}:{line}: holds a NUL byte, not a .gitignore",
                        hint="remove that byte")
    rules = (compile_rule(f"{path}:{n}", line) for n, line in enumerate(text.splitlines(), 1))
    return [r for r in rules if r]
