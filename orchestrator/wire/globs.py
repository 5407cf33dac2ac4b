"""`job.checkpoint` globs, read the same on both sides: the inventory checks them, the
controller's keeper sends them, the host's agent matches its files against them.

A glob is relative to the job folder and starts with `output/` or `code/`; the rest is
matched one path component at a time, as a shell does: `*`, `?` and `[...]` never cross
a `/`, a name starting with `.` is matched only by a component starting with `.` (a
half-written `.epoch-3.pt.tmp-42` is not a `*.pt`), and a component `**` matches any
number of folders, none included. Stdlib only, Python 3.8 (the agent's bundle carries it).
"""
from __future__ import annotations

MYPY = False
if MYPY:   # annotations only: typing's import is ~9 ms of CPU at every agent start
    from typing import Any

FOLDERS = ("output", "code")      # the job folders a checkpoint may live in
# `job.checkpoint_to: host`: the keeper host's copy, <job dir>/checkpoints/<output|code>/...
# (orch's folder: only orch writes or prunes it, session/hostkeep.py, agent/keep.py)
KEEP = "checkpoints"
MAX_GLOBS = 64                    # globs in job.checkpoint (and in one request)
MAX_GLOB = 1024                   # bytes of one glob
WILD = frozenset("*?[")


def problem(glob: Any) -> str:
    """Why `glob` cannot be a job.checkpoint entry, or "" when it can."""
    if not isinstance(glob, str) or not glob:
        return "an empty glob"
    if len(glob.encode("utf-8", "surrogatepass")) > MAX_GLOB:
        return "longer than %d bytes" % MAX_GLOB
    if glob.startswith(("/", "~")):
        return "an absolute path"
    if any(ord(c) < 32 or ord(c) == 127 for c in glob) or "\\" in glob:
        return "a control character or backslash"
    parts = glob.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "not a plain relative path (no `..`, `.` or empty part)"
    if parts[0] not in FOLDERS or len(parts) < 2:
        return "not under output/ or code/"
    if any("**" in p and p != "**" for p in parts):
        return "`**` must be a whole path component (`output/**/*.pt`)"
    return ""


def split(glob: str) -> tuple[str, str]:
    """("output" or "code", the rest of the glob, relative to that folder)."""
    folder, _, rest = glob.partition("/")
    return folder, rest


def is_wild(part: str) -> bool:
    return any(c in WILD for c in part)


def root(rest: str) -> str:
    """The folder (relative to output/ or code/, "" for itself) below which every match
    of `rest` lies: its leading components with no wildcard. A glob with no wildcard at
    all names one path, which is its own root."""
    parts = rest.split("/")
    fixed: list[str] = []
    for p in parts:
        if is_wild(p):
            break
        fixed.append(p)
    return "/".join(fixed)


def match(rest: str, rel: str) -> bool:
    """Whether `rel` (relative to the same folder) matches the glob's `rest`."""
    return _match(rest.split("/"), rel.split("/"))


def _match(pat: list[str], parts: list[str]) -> bool:
    if not pat:
        return not parts
    head = pat[0]
    if head == "**":
        # zero folders, or one more (never a hidden one) and still `**`
        if _match(pat[1:], parts):
            return True
        return bool(parts) and len(parts) > 1 and not parts[0].startswith(".") \
            and _match(pat, parts[1:])
    if not parts or not _one(head, parts[0]):
        return False
    return _match(pat[1:], parts[1:])


def _one(pattern: str, name: str) -> bool:
    if name.startswith(".") and not pattern.startswith("."):
        return False
    if "[" not in pattern:
        return star_match(pattern, name)
    import fnmatch  # here: its `re` is ~1.2 MiB and 8 ms of an agent (the curves have no `[`)
    return fnmatch.fnmatchcase(name, pattern)


def star_match(pattern: str, name: str) -> bool:
    """fnmatch.fnmatchcase for a pattern of `*`, `?` and plain characters, without `re`:
    the usual greedy walk, going back to the last `*` on a mismatch (at most
    len(pattern) * len(name) steps)."""
    p = n = 0
    star, mark = -1, 0
    while n < len(name):
        if p < len(pattern) and pattern[p] in ("?", name[n]):
            p, n = p + 1, n + 1
        elif p < len(pattern) and pattern[p] == "*":
            star, mark, p = p, n, p + 1
        elif star >= 0:
            mark += 1
            p, n = star + 1, mark
        else:
            return False
    return all(c == "*" for c in pattern[p:])


def matches_any(rests: list[str], rel: str) -> bool:
    return any(match(r, rel) for r in rests)
