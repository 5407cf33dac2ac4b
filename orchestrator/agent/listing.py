"""The files under a job's folder that a pull or a count names: a walk that follows no
link, with what it skips noted (links, odd names, what is not a regular file).

Apart from pull.py, whose digests import hashlib (OpenSSL: ~5 ms of CPU at its first
use): a follow's `done` counts the curves' files here, at the host's end, which at
1,000 hosts is the end of every host at once.
"""
from __future__ import annotations

import os
import stat as st_mod

from orchestrator.agent.common import AgentError
from orchestrator.agent.paths import DIR_FLAGS, JobDir, UnsafePath
from orchestrator.wire import globs, protocol

MYPY = False
if MYPY:   # annotations only: typing's import (and its `re`) is ~11 ms of CPU in an agent
    from typing import Any, Callable

OUTPUT = "output"


class Notes:
    """What was skipped: the first MAX_PULL_NOTES named, all counted."""

    def __init__(self, wanted: Callable[[str], bool] | None = None) -> None:
        self.items: list[Any] = []
        self.count = 0
        self.wanted = wanted   # with globs: only what they match is worth naming

    def add(self, rel: str, why: str) -> None:
        if self.wanted is not None and not self.wanted(rel):
            return
        self.count += 1
        if len(self.items) < protocol.MAX_PULL_NOTES:
            shown = rel.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            self.items.append({"p": shown[:300], "why": why})


# ---------------------------------------------------------------- the walk

def kind_of(entry: os.DirEntry[str]) -> str:
    if entry.is_symlink():
        return "a symbolic link (links are not pulled)"
    return "not a regular file"


def walk(fd: int, rel: str, found: dict[str, Any], notes: Notes) -> None:
    """Regular files under the folder fd (closed here) into found {rel: None}."""
    try:
        with os.scandir(fd) as it:
            entries = list(it)
        for e in entries:
            path = rel + "/" + e.name if rel else e.name
            why = protocol.pull_path_problem(path)
            if why:
                notes.add(path, why)
            elif e.is_dir(follow_symlinks=False):
                try:
                    child = os.open(e.name, DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue   # replaced or removed meanwhile
                walk(child, path, found, notes)
            elif e.is_file(follow_symlinks=False):
                found[path] = None
                if len(found) > protocol.MAX_PULL_FILES:
                    raise too_many(rel.split("/", 1)[0] or "the folder")
            else:
                notes.add(path, kind_of(e))
    finally:
        os.close(fd)


def too_many(where: str) -> AgentError:
    return AgentError("%s holds more than %d files: more than one pull lists"
                      % (where, protocol.MAX_PULL_FILES), protocol.USAGE)


def list_path(jd: JobDir, path: str, found: dict[str, Any], notes: Notes,
              folder: str = OUTPUT, must: bool = True) -> None:
    """The files of <folder>/<path> (the folder itself when path is ""): a folder walked,
    a file listed, a link skipped. A named path that is not there is a usage error
    (`must`), or nothing (a glob's root)."""
    rel = folder + "/" + path if path else folder
    try:
        st = jd.lstat(rel)
    except UnsafePath as e:   # a link on the way: never followed
        notes.add(path, str(e))
        return
    except (FileNotFoundError, NotADirectoryError):
        st = None
    if st is None:
        if path and must:
            raise AgentError("%s: no such file or folder" % jd.show(rel), protocol.USAGE)
        return
    if st_mod.S_ISDIR(st.st_mode):
        walk(jd.open_dir(rel), path, found, notes)
    elif st_mod.S_ISREG(st.st_mode):
        found[path] = None
    else:
        notes.add(path, "a symbolic link (links are not pulled)" if st_mod.S_ISLNK(st.st_mode)
                  else "not a regular file")


def list_globs(jd: JobDir, rests: list[str], folder: str, notes: Notes) -> dict[str, Any]:
    """{rel: None} of the files under <folder>/ the globs match (links and others noted)."""
    found: dict[str, Any] = {}
    for top in sorted({globs.root(rest) for rest in rests}):   # each folder walked once
        list_path(jd, top, found, notes, folder, must=False)
    return {rel: None for rel in found if globs.matches_any(rests, rel)}


def count_globs(jd: JobDir, rests: list[str]) -> int:
    """How many entries under output/ the globs match, files and what a listing would
    name as skipped alike (a follow's `done` says so: no listing for none)."""
    notes = Notes(lambda rel: globs.matches_any(rests, rel))
    return len(list_globs(jd, rests, OUTPUT, notes)) + notes.count
