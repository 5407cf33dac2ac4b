"""What a split-data source holds, found before anything is written: its kind and its
files per group, in sorted order.

  records      sharded record files (`train-00000-of-01024`) at the top: grouped by
               their prefix and total (`train-*-of-01024`).
  imagefolder  class sub-folders, optionally under split folders (TrainData/,
               ValidationData/): every file under each class, recursively.

One walk with os.scandir (one stat per file, for its size; realpath only for links).
A link is followed only inside the source; a broken one, a loop (named with every link
that closes it) or one pointing outside is refused with the fix.
"""
from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from typing import Optional

from orchestrator.errors import DataError

RECORD_RE = re.compile(r"^(?P<prefix>.+?)[-.](?P<index>\d+)-of-(?P<total>\d+)(?P<suffix>\..*)?$")
# Top-level folders that hold splits rather than classes; recognised only when every
# top-level folder is one of them (a dataset with a class called "test" stays an ImageFolder).
SPLIT_DIRS = frozenset({"TrainData", "ValidationData", "TestData",
                        "train", "val", "validation", "test"})
SHOWN_NAMES = 5

FileList = list[tuple[str, int]]   # (path relative to the source, bytes)


def listed(items: list[str]) -> str:
    """The first SHOWN_NAMES of items, and how many more: a message stays one line."""
    shown = ", ".join(items[:SHOWN_NAMES])
    return shown + (f" and {len(items) - SHOWN_NAMES} more" if len(items) > SHOWN_NAMES else "")


Chain = tuple[tuple[str, Optional[str]], ...]   # (real folder, the link that led into it)


def loop_check(link: str, target: str, chain: Chain) -> None:
    """A link to a folder the walk is already inside (or above it) is a loop: named with
    every link that closes it (a/l1 -> ../b and b/l2 -> ../a both), never a walk that
    runs until the path is too long."""
    for i, (real, _) in enumerate(chain):
        if real == target or real.startswith(target + os.sep):
            links = [via for _, via in chain[i + 1:] if via is not None] + [link]
            shown = ", ".join(f"{via} -> {os.readlink(via)}" for via in links)
            what = ("a symlink to one of its own parent folders" if len(links) == 1
                    else f"a symlink loop of {len(links)} links")
            raise DataError(f"{link} leads back into {target}: {what} ({shown})",
                            hint="remove one of the links, or point it outside the loop")


class _Scanner:
    """Walks the source with os.scandir: one stat per file (for its size), realpath only
    for links."""

    def __init__(self, source: Path) -> None:
        self.root = str(source)
        self.ignored: list[str] = []

    def entries(self, path: str) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(path) as it:
                return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc.strerror}",
                            hint="check the permissions of the source") from None

    @staticmethod
    def loops(path: str) -> bool:
        try:
            os.stat(path)
        except OSError as e:
            return e.errno == errno.ELOOP
        return False

    def check_link(self, path: str) -> str:
        target = os.path.realpath(path)
        if target != self.root and not target.startswith(self.root + os.sep):
            raise DataError(f"{path} is a symlink pointing outside the source (to {target})",
                            hint="copy what it points to into the source, "
                                 "or split that folder instead")
        if not os.path.exists(target):
            if self.loops(path):
                raise DataError(f"{path} is a symlink loop (it leads back to itself)",
                                hint="remove the link, or point it at a file")
            raise DataError(f"{path} is a broken symlink", hint="remove it or fix its target")
        return target

    def walk(self, path: str, rel: str, out: FileList, real: str | None = None,
             chain: Chain = ()) -> FileList:
        """Every file under path, recursively, as (rel + its path below path, bytes).
        `chain`: the real folders above it, each with the link that led into it (if any)."""
        real = real or os.path.realpath(path)
        chain = chain + ((real, path if os.path.islink(path) else None),)
        try:
            with os.scandir(path) as it:
                for e in it:
                    if e.name[0] == ".":
                        continue
                    target = self.check_link(e.path) if e.is_symlink() else None
                    if e.is_dir():
                        self._descend(e, rel, out, chain, target)
                    elif e.is_file():
                        out.append((rel + e.name, e.stat().st_size))
        except OSError as exc:
            raise DataError(f"cannot read {exc.filename or path}: {exc.strerror}",
                            hint="check the permissions of the source") from None
        return out

    def _descend(self, e: os.DirEntry[str], rel: str, out: FileList, chain: Chain,
                 target: str | None) -> None:
        if target is not None:
            loop_check(e.path, target, chain)
        self.walk(e.path, rel + e.name + "/", out, target or chain[-1][0] + os.sep + e.name, chain)

    def records(self, entries: list[os.DirEntry[str]]) -> tuple[dict[str, FileList], list[str]]:
        groups: dict[str, list[tuple[int, str, int]]] = {}
        totals: dict[str, int] = {}
        for e in entries:
            m = RECORD_RE.match(e.name)
            if m is None or not e.is_file():
                self.ignored.append(e.name)
                continue
            if e.is_symlink():
                self.check_link(e.path)
            key = f"{m['prefix']}-*-of-{m['total']}{m['suffix'] or ''}"
            groups.setdefault(key, []).append((int(m["index"]), e.name, e.stat().st_size))
            totals[key] = int(m["total"])
        notes = [f"{key}: {len(items)} files present, the names say {totals[key]}; "
                 f"splitting the {len(items)} present"
                 for key, items in groups.items() if len(items) != totals[key]]
        files = {key: [(name, size) for _, name, size in sorted(items)]
                 for key, items in groups.items()}
        return files, notes

    def classes(self, entries: list[os.DirEntry[str]], prefix: str) -> dict[str, FileList]:
        found: dict[str, FileList] = {}
        for e in entries:
            if not e.is_dir():
                self.ignored.append(prefix + e.name)
                continue
            target = self.check_link(e.path) if e.is_symlink() else None
            # Sorted before the seeded shuffle: scandir order differs between copies of a dataset.
            found[prefix + e.name] = sorted(self.walk(e.path, prefix + e.name + "/", [], target))
        return found


def scan(source: Path) -> tuple[str, dict[str, FileList], list[str]]:
    """(kind, files per class or record group in sorted order, notes) for a resolved source."""
    scanner = _Scanner(source)
    top = scanner.entries(str(source))
    if any(RECORD_RE.match(e.name) and e.is_file() for e in top):
        groups, notes = scanner.records(top)
        kind = "records"
    else:
        groups, notes, kind = _scan_imagefolder(scanner, source, top), [], "imagefolder"
    if scanner.ignored:
        what = "record files" if kind == "records" else "class folders"
        entries = "entry" if len(scanner.ignored) == 1 else "entries"
        notes.append(f"ignored {len(scanner.ignored)} top-level {entries} "
                     f"that are not {what}: {listed(scanner.ignored)}")
    return kind, dict(sorted(groups.items())), notes


def _scan_imagefolder(scanner: _Scanner, source: Path,
                      top: list[os.DirEntry[str]]) -> dict[str, FileList]:
    dirs = [e for e in top if e.is_dir()]
    if not dirs:
        raise DataError(f"{source} holds neither record files (train-00000-of-01024) "
                        "nor class folders",
                        hint="point --source at a folder of sharded record files "
                             "or of class sub-folders")
    if not all(e.name in SPLIT_DIRS for e in dirs):
        return scanner.classes(top, "")
    scanner.ignored.extend(e.name for e in top if not e.is_dir())
    groups: dict[str, FileList] = {}
    for split in dirs:
        if split.is_symlink():
            scanner.check_link(split.path)
        found = scanner.classes(scanner.entries(split.path), split.name + "/")
        if not found:
            raise DataError(f"{split.path} has no class folders",
                            hint="remove it, or put class folders in it")
        groups.update(found)
    return groups
