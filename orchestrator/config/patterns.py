"""Ignore patterns (`code.exclude`, `.gitignore`): whether one can be used at all.
orch reads each pattern two ways (files/ignore.py): as a gitignore line (pathspec)
and, for code.exclude, as a name pattern for every path component (fnmatch)."""
from __future__ import annotations

import fnmatch
import re
import warnings

import pathspec

# Python's re warns (FutureWarning, with pathspec's or fnmatch's source line) about a
# pattern such as `[[a]` or `[a--b]` whose meaning a future Python may change. Today's
# meaning is the one gitignore gives it, and the user can do nothing about a library's
# source line: only these messages are silenced, everywhere orch compiles a pattern.
warnings.filterwarnings("ignore", category=FutureWarning,
                        message=r"Possible (nested set|set (difference|union|intersection|"
                                r"symmetric difference))")


def pattern_problem(text: str) -> str | None:
    """Why the pattern cannot be used (a bad character range `[z-a]`, a lone escape), or
    None. Both readings are compiled here, before any file is matched."""
    try:
        pathspec.GitIgnoreSpec.from_lines([text])
        re.compile(fnmatch.translate(text))
    except (ValueError, re.error) as e:   # re.error is not a ValueError
        return re.sub(r" at position \d+$", "", str(e))   # a position in orch's regex, not the pattern
    return None


PATTERN_HINT = "fix or remove that pattern (gitignore syntax: a range is written low to high, `[a-z]`)"
