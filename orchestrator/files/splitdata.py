"""Split a dataset into per-worker shards of symlinks, as split_dataset.sh did, plus manifest.json.

Two kinds of source:
  records      sharded record files (`train-00000-of-01024`): worker i gets a contiguous
               run of each prefix group's sorted files; the first `total % N` get one more.
  imagefolder  class sub-folders, optionally under split folders (TrainData/, ValidationData/):
               every class is shuffled with the seed and dealt out evenly.

The source is scanned first (splitscan.py), and everything is validated before anything is
written; the shards are built in a temporary folder beside the final ones and renamed into
place, so a failure leaves the old split intact.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypedDict, cast

from orchestrator.errors import DataError
from orchestrator.files.splitscan import FileList, listed, scan

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
LOCK = ".orch-split.lock"
# Above this many files the manifest is written compactly: json's C encoder does not indent.
INDENT_LIMIT = 20_000

Packer = Callable[[Path], None]


class ShardJson(TypedDict):
    """A shard in manifest.json (shards.py reads it back, checked)."""

    name: str
    bytes: int
    files: FileList               # written as [path, bytes] pairs
    classes: dict[str, int]
    digest: str


class SplitJson(TypedDict):
    workers: int
    kind: str
    source: str
    seed: int
    shards: list[ShardJson]


class ManifestJson(TypedDict):
    """manifest.json: a split per worker count, each as split-data wrote it."""

    version: int
    splits: dict[str, SplitJson]


@dataclass
class Shard:
    """One worker's share: files as (path relative to the source, bytes), counts per class."""

    name: str
    files: FileList = field(default_factory=list)
    classes: dict[str, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(size for _, size in self.files)

    def digest(self) -> str:
        lines = sorted(f"{rel}\t{size}\n" for rel, size in self.files)
        return hashlib.sha256("".join(lines).encode("utf-8", "surrogateescape")).hexdigest()

    def to_json(self) -> ShardJson:
        # json writes the (path, bytes) tuples as two-element arrays.
        return {"name": self.name, "bytes": self.bytes, "files": self.files,
                "classes": self.classes, "digest": self.digest()}


@dataclass
class SplitPlan:
    """What a split will write; computed without touching the output folder."""

    kind: str
    source: Path
    workers: int
    seed: int
    shards: list[Shard]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> SplitJson:
        return {"workers": self.workers, "kind": self.kind, "source": str(self.source),
                "seed": self.seed, "shards": [s.to_json() for s in self.shards]}


@dataclass
class SplitResult:
    plan: SplitPlan
    out: Path
    manifest: Path
    replaced: bool
    seconds: dict[str, float]


def shard_name(rank: int, workers: int) -> str:
    return f"worker_{rank}_of_{workers}"


# ---------------------------------------------------------------- validation


def check_paths(source: Path, out: Path) -> tuple[Path, Path]:
    """Resolve source and out, refusing every layout that would make the split unsafe."""
    if not source.exists():
        raise DataError(f"source folder {source} does not exist",
                        hint="pass --source DIR, or set data.source in cluster.yaml")
    if not source.is_dir():
        raise DataError(f"source {source} is not a folder",
                        hint="point --source at the dataset folder")
    src, dst = source.resolve(), out.resolve()
    if dst == src or dst.is_relative_to(src):
        raise DataError(f"output folder {out} is inside the source {source}",
                        hint="write the shards beside the source, e.g. "
                             f"--out {src.parent / (src.name + '-shards')}")
    if src.is_relative_to(dst):
        raise DataError(f"source {source} is inside the output folder {out}",
                        hint="choose an output folder that does not contain the dataset")
    if dst.exists() and not dst.is_dir():
        raise DataError(f"output {out} exists and is not a folder",
                        hint="remove it or choose another --out")
    _check_writable(dst)
    read_manifest(dst / MANIFEST)
    return src, dst


def _check_writable(dst: Path) -> None:
    existing = dst
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise DataError(f"cannot write to {existing}", hint="choose an --out you may write to")


def read_manifest(path: Path) -> ManifestJson:
    """The manifest beside the shards, or an empty one; a damaged one is an error, not
    overwritten."""
    if not path.exists():
        return {"version": MANIFEST_VERSION, "splits": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is not a readable manifest ({exc})",
                        hint="remove it; it is rebuilt by re-running split-data "
                             "for each worker count") from None
    if (not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION
            or not isinstance(data.get("splits"), dict)):
        raise DataError(f"{path} is not an orch manifest (version {MANIFEST_VERSION})",
                        hint="move it away, or choose another --out")
    return cast(ManifestJson, data)   # its version and splits checked: split-data wrote it


def check_counts(groups: dict[str, FileList], workers: int, kind: str) -> None:
    """Every worker must get at least one file of every class / record group."""
    names = ("class", "classes"), ("record group", "record groups")
    what, whats = names[0] if kind == "imagefolder" else names[1]
    empty = [key for key, files in groups.items() if not files]
    if empty:
        raise DataError(f"empty {what} in the source: {listed(empty)}",
                        hint="remove the empty folders, or put files in them")
    small = sorted((len(files), key) for key, files in groups.items() if len(files) < workers)
    if small:
        count, key = small[0]
        raise DataError(f"{what} {key} has {count} file(s), fewer than the {workers} workers "
                        f"({len(small)} {what if len(small) == 1 else whats} too small: "
                        f"{listed([k for _, k in small])})",
                        hint=f"use at most {count} workers, or add files; every worker needs "
                             f"at least one file of every {what}")


# ---------------------------------------------------------------- planning


def even_sizes(total: int, workers: int, offset: int = 0) -> list[int]:
    """total split into workers counts differing by at most 1; the extras start at offset."""
    base, extra = divmod(total, workers)
    sizes = [base] * workers
    for i in range(extra):
        sizes[(offset + i) % workers] += 1
    return sizes


def _deal(shards: list[Shard], key: str, files: FileList, sizes: list[int]) -> None:
    start = 0
    for shard, size in zip(shards, sizes):
        # Sorted chunks make the final per-shard sort a cheap merge of runs.
        shard.files.extend(sorted(files[start:start + size]))
        shard.classes[key] = size
        start += size


def assign(kind: str, groups: dict[str, FileList], workers: int,
           seed: int) -> tuple[list[Shard], list[str]]:
    shards = [Shard(shard_name(i, workers)) for i in range(workers)]
    notes: list[str] = []
    cursor = uneven = 0
    for key, files in groups.items():
        if kind == "records":
            sizes = even_sizes(len(files), workers)
            if len(files) % workers:
                notes.append(_records_imbalance(key, len(files), sizes))
        else:
            files = list(files)
            random.Random(f"{seed}/{key}").shuffle(files)
            # Rotating where the extras go keeps per-worker totals within a file or two.
            sizes = even_sizes(len(files), workers, cursor)
            cursor = (cursor + len(files) % workers) % workers
            uneven += bool(len(files) % workers)
        _deal(shards, key, files, sizes)
    for shard in shards:
        shard.files.sort()
    if uneven:
        totals = [len(s.files) for s in shards]
        what = "class folders" if any("/" in key for key in groups) else "classes"
        notes.append(f"{uneven} of {len(groups)} {what} do not divide by {workers}; "
                     "their extra files rotate across workers "
                     f"(files per worker: {min(totals)}..{max(totals)})")
    return shards, notes


def _span(first: int, last: int) -> str:
    return f"worker {first}" if first == last else f"workers {first}-{last}"


def _records_imbalance(key: str, total: int, sizes: list[int]) -> str:
    extra = total % len(sizes)
    return (f"uneven split of {key}: {total} files over {len(sizes)} workers; "
            f"{_span(0, extra - 1)} get {sizes[0]} files, "
            f"{_span(extra, len(sizes) - 1)} get {sizes[-1]} (split_dataset.sh would refuse this)")


def plan(source: Path, out: Path, workers: int, seed: int = 0) -> SplitPlan:
    """Validate everything and compute the split; writes nothing."""
    if workers < 1:
        raise DataError(f"--workers must be at least 1 (got {workers})",
                        hint="pass --workers N with N >= 1")
    src, _ = check_paths(source, out)
    kind, groups, notes = scan(src)
    check_counts(groups, workers, kind)
    shards, more = assign(kind, groups, workers, seed)
    return SplitPlan(kind, src, workers, seed, shards, notes + more)


# ---------------------------------------------------------------- writing


def _link_shard(shard: Shard, src_prefix: str, dst: str) -> None:
    os.mkdir(dst)
    made: set[str] = set()
    for rel, _ in shard.files:
        parent = rel.rpartition("/")[0]
        if parent and parent not in made:
            os.makedirs(dst + "/" + parent, exist_ok=True)
            made.add(parent)
        os.symlink(src_prefix + rel, dst + "/" + rel)


def link_all(p: SplitPlan, tmp: Path, threads: int) -> None:
    src_prefix = str(p.source) + "/"
    jobs = [(s, src_prefix, str(tmp / s.name)) for s in p.shards]
    if threads <= 1:
        for job in jobs:
            _link_shard(*job)
        return
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(_link_shard, *job) for job in jobs]:
            f.result()


def _rescan_packed(shard: Shard, shard_dir: Path) -> None:
    """After packing, the shard is what is on disk: links keep their source sizes, new
    files add theirs."""
    sizes = dict(shard.files)
    found: FileList = []
    for dirpath, _dirnames, filenames in os.walk(shard_dir):
        rel_dir = os.path.relpath(dirpath, shard_dir)
        prefix = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        for name in filenames:
            rel = prefix + name
            path = os.path.join(dirpath, name)
            linked = os.path.islink(path) and rel in sizes
            found.append((rel, sizes[rel] if linked else os.path.getsize(path)))
    shard.files = sorted(found)


@contextmanager
def _locked(out: Path) -> Iterator[None]:
    """One split-data at a time per output folder: the manifest is read-modify-write."""
    with open(out / LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _clear_leftovers(out: Path, workers: int) -> None:
    """What a killed run left behind; safe to remove under the lock."""
    for stale in out.glob(f".split-{workers}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in out.glob(f".{MANIFEST}.tmp-*"):
        stale.unlink(missing_ok=True)


def _swap_in(out: Path, tmp: Path, old: Path, names: list[str]) -> bool:
    """Rename the new folders over the old ones; on failure, put the old ones back."""
    retired: list[str] = []
    installed: list[str] = []
    try:
        for name in names:
            if os.path.lexists(out / name):
                os.rename(out / name, old / name)
                retired.append(name)
            os.rename(tmp / name, out / name)
            installed.append(name)
    except OSError:
        for name in installed:
            os.rename(out / name, tmp / name)
        for name in retired:
            os.rename(old / name, out / name)
        raise
    return bool(retired)


def _dumps(data: ManifestJson, files: int) -> str:
    """Readable (one file per line) when small; compact, by json's fast C encoder, when large."""
    if files > INDENT_LIMIT:
        return json.dumps(data, separators=(",", ":"))
    lists: list[FileList] = []  # each shard's "files", written in by hand below

    def marked(shard: ShardJson) -> dict[str, object]:
        lists.append(shard["files"])
        return {**shard, "files": f"\0files{len(lists) - 1}"}
    shown = {**data, "splits": {n: {**split, "shards": [marked(s) for s in split["shards"]]}
                                for n, split in data["splits"].items()}}
    text = json.dumps(shown, indent=1)
    for i, pairs in enumerate(lists):
        body = ",\n".join(json.dumps(pair) for pair in pairs)
        text = text.replace(json.dumps(f"\0files{i}"), f"[\n{body}\n]" if pairs else "[]", 1)
    return text


def stage_manifest(out: Path, p: SplitPlan) -> Path:
    """Write the updated manifest (other worker counts kept) to a temp file; os.replace()
    it later."""
    data = read_manifest(out / MANIFEST)
    data["splits"][str(p.workers)] = p.to_json()
    data["splits"] = dict(sorted(data["splits"].items(), key=lambda kv: int(kv[0])))
    files = sum(len(s["files"]) for split in data["splits"].values() for s in split["shards"])
    staged = out / f".{MANIFEST}.tmp-{os.getpid()}"
    staged.write_text(_dumps(data, files) + "\n", encoding="utf-8")
    return staged


@contextmanager
def _timed(seconds: dict[str, float], phase: str) -> Iterator[None]:
    t = time.perf_counter()
    try:
        yield
    finally:
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - t


def _build(p: SplitPlan, tmp: Path, pack: Packer | None, threads: int,
           seconds: dict[str, float]) -> None:
    with _timed(seconds, "link"):
        link_all(p, tmp, threads)
    if pack is None:
        return
    with _timed(seconds, "pack"):
        for shard in p.shards:
            pack(tmp / shard.name)
            _rescan_packed(shard, tmp / shard.name)


def write(p: SplitPlan, out: Path, *, pack: Packer | None = None, threads: int = 1) -> SplitResult:
    """Build the shards in a temp folder beside the old ones, swap them in, replace the manifest.

    threads > 1 links shards in parallel (symlink() releases the GIL, each shard has its own
    folder); bench/split.py found no measurable gain on tmpfs or ext4, hence the default of 1.
    """
    seconds: dict[str, float] = {}
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".split-{p.workers}.tmp-{os.getpid()}"
    old = out / f".split-{p.workers}.old-{os.getpid()}"
    staged = out / f".{MANIFEST}.tmp-{os.getpid()}"
    with _locked(out):
        _clear_leftovers(out, p.workers)
        try:
            tmp.mkdir()
            old.mkdir()
            _build(p, tmp, pack, threads, seconds)
            with _timed(seconds, "manifest"):
                stage_manifest(out, p)
                replaced = _swap_in(out, tmp, old, [s.name for s in p.shards])
                os.replace(staged, out / MANIFEST)
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename else ""
            raise DataError(f"could not write the shards to {out}: {exc.strerror or exc}{where}",
                            hint="check free space, inodes and permissions there; "
                                 "the previous split is unchanged") from None
        finally:
            with _timed(seconds, "cleanup"):
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(old, ignore_errors=True)
                if staged.exists():
                    staged.unlink()
    return SplitResult(p, out, out / MANIFEST, replaced, seconds)


def split(source: Path, out: Path, workers: int, *, seed: int = 0, pack: Packer | None = None,
          threads: int = 1) -> SplitResult:
    """Plan (validate + scan + assign) then write; nothing is written if planning fails."""
    t = time.perf_counter()
    p = plan(Path(source), Path(out), workers, seed)
    planned = time.perf_counter() - t
    if pack is not None and p.kind != "imagefolder":
        raise DataError(f"--pack works on ImageFolder sources; {p.source} holds record files",
                        hint="drop --pack: record files are already packed")
    result = write(p, Path(out).resolve(), pack=pack, threads=threads)
    result.seconds = {"scan+plan": planned, **result.seconds}
    return result
