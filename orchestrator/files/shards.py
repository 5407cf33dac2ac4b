"""Which shard files a host receives: only those of its own ranks, read from manifest.json.

Nothing in manifest.json is trusted: it is checked for shape, types, NUL bytes, sizes and
paths, and every file must resolve inside its shard folder or inside the inventory's
`data.source` (never the manifest's own `source` field, which anyone can rewrite).
"""
from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypedDict, cast

from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import DataError
from orchestrator.files import splitdata
from orchestrator.files.localfiles import (
    ENTRY,
    KEY,
    UNSTATTED,
    DigestCache,
    LocalFile,
    Resolver,
    inside,
    link_file,
    racy,
    resolve_link,
    stat_key,
)
from orchestrator.ui.wording import hint_cmd

MAX_MANIFEST = 256 << 20       # bytes; orch split-data writes about 50 bytes per file
MAX_FILES = 5_000_000          # entries in one split
MAX_PATH = 4096                # bytes in one manifest path (PATH_MAX)
CHECKS = 1                     # of check_split: a split memo of other checks is not used
CHUNK = 4096                   # files a listing hands to an early push at a time (a `files` batch)


class Manifest:
    """Where manifest.json is and what to tell the user when it is wrong."""

    def __init__(self, cluster: Cluster) -> None:
        self.path = f"{cluster.data.shards}/manifest.json"
        self.world = cluster.world_size
        split = hint_cmd(cluster, f"split-data --workers {self.world}")
        self.fix = f"run `{split}`"
        self.fix_whole = f"move {self.path} away, then run `{split}`"

    def fail(self, what: str, whole: bool = False) -> DataError:
        return DataError(f"{self.path}: {what}", hint=self.fix_whole if whole else self.fix)


class ManifestDoc(TypedDict):
    """manifest.json with its top level checked (parse): its splits by worker count,
    each still as the file holds it until check_split passes it."""

    version: int
    splits: dict[str, object]


class ShardDoc(TypedDict):
    name: str
    bytes: int
    files: list[list[Any]]     # [path, bytes] pairs


class SplitDoc(TypedDict):
    """A split check_split passed (the plain data its memo keeps)."""

    kind: str
    source: str
    seed: int
    shards: list[ShardDoc]


@dataclass(frozen=True)
class Shard:
    """One rank's shard of a checked split: its folder's name (`worker_<r>_of_<W>`), its
    bytes, and its files as the manifest lists them, [path, bytes] pairs (a million of
    them stay the parsed lists: an object each would double a first listing's time)."""

    name: str
    bytes: int
    files: list[list[Any]]


@dataclass(frozen=True)
class Split:
    """The split for the job's world size, checked (check_split): one Shard per rank."""

    kind: str
    source: str
    seed: int
    shards: tuple[Shard, ...]

    @classmethod
    def of(cls, checked: SplitDoc) -> Split:
        return cls(checked["kind"], checked["source"], checked["seed"],
                   tuple(Shard(s["name"], s["bytes"], s["files"]) for s in checked["shards"]))


def load_split(cluster: Cluster, cache: DigestCache | None = None) -> Split:
    """The split made for this job's world size, checked, or a message saying what to do.
    With a cache: a split checked before is taken from its memo while manifest.json's
    stat key stands (a million entries' JSON and checks were a third of a nothing-changed
    listing)."""
    m = Manifest(cluster)
    memo_key = f"split:{CHECKS}:{os.path.abspath(m.path)}:{m.world}"
    try:
        st = os.stat(m.path)
    except OSError:
        st = None   # read() says what is wrong
    hit = cache.memo.get(memo_key) if cache is not None and st is not None else None
    if type(hit) is tuple and len(hit) == 2 and st is not None and hit[0] == stat_key(st):
        return Split.of(cast(SplitDoc, hit[1]))   # it passed check_split when it was kept
    manifest, st = read_with_stat(m)
    splits = manifest["splits"]
    split = splits.get(str(m.world))
    if split is None:
        have = ", ".join(sorted(splits, key=int)) or "none"
        raise DataError(f"{cluster.data.shards} has no split for world size {m.world} "
                        f"(splits there: {have})", hint=m.fix)
    checked = check_split(split, m)
    if cache is not None and not racy(st):   # st: taken before the bytes were read
        key, same_file = stat_key(st), memo_key.rpartition(":")[0] + ":"
        with cache.lock:
            for old in [k for k, v in cache.memo.items() if k.startswith(same_file)
                        and not (type(v) is tuple and len(v) == 2 and v[0] == key)]:
                del cache.memo[old]   # another world size's split of an older manifest
            cache.memo[memo_key] = (key, checked)   # the memo keeps plain data
            cache.dirty = True
    return Split.of(checked)


def resplit_size(cluster: Cluster) -> int | None:
    """The run's world size when its data must be split again before the push: the run
    uses only some hosts (`up --hosts/--exclude`), and data.shards holds a manifest of
    `orch split-data` with no split for that size. None: nothing to do (a missing
    manifest is load_split's to report). DataError when data.source is not there."""
    if not cluster.selection or cluster.data.shards is None or cluster.job.array is not None:
        return None
    m = Manifest(cluster)
    if not os.path.exists(m.path) or str(m.world) in read(m)["splits"]:
        return None
    source = cluster.data.source
    if source is None or not source.is_dir():
        where = f"data.source {source} is not there" if source else "data.source is not set"
        split = hint_cmd(cluster, f"split-data --workers {m.world}"
                         + ("" if source else " --source DIR"))
        raise DataError(f"{cluster.data.shards} has no split for world size {m.world} "
                        f"({cluster.selection}), and it cannot be made: {where}",
                        hint=f"run `{split}` with the dataset that was split")
    return m.world


def resplit(cluster: Cluster) -> splitdata.SplitResult:
    """The split for the run's world size, as `orch split-data --workers N` makes it, with
    the seed of the splits already there (an ImageFolder is dealt out the same way)."""
    m = Manifest(cluster)
    assert cluster.data.source is not None and cluster.data.shards is not None
    seeds = [s["seed"] for s in read(m)["splits"].values()
             if isinstance(s, dict) and type(s.get("seed")) is int]
    return splitdata.split(cluster.data.source, cluster.data.shards, m.world,
                           seed=seeds[0] if seeds else 0)


def read(m: Manifest) -> ManifestDoc:
    """The parsed manifest, its top level checked: {"version": 1, "splits": {"<N>": ...}}."""
    return read_with_stat(m)[0]


def read_with_stat(m: Manifest) -> tuple[ManifestDoc, os.stat_result]:
    """read(), and the file's stat taken before its bytes (the key a memo may keep)."""
    try:
        with open(m.path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_size > MAX_MANIFEST:
                raise m.fail(f"{st.st_size} bytes, more than the {MAX_MANIFEST >> 20} MiB "
                             "a manifest may have", whole=True)
            data = f.read(MAX_MANIFEST + 1)
    except FileNotFoundError:
        raise DataError(f"{m.path} not found: the data has not been split", hint=m.fix) from None
    except OSError as e:
        raise m.fail(f"cannot be read ({e.strerror})", whole=True) from None
    return parse(data, m), st


def parse(data: bytes, m: Manifest) -> ManifestDoc:
    if b"\0" in data:
        line = data.count(b"\n", 0, data.index(b"\0")) + 1
        raise m.fail(f"line {line} holds a NUL byte: not a manifest written by orch", whole=True)
    try:
        manifest = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise m.fail(f"line {line} is not UTF-8", whole=True) from None
    except json.JSONDecodeError as e:
        raise m.fail(f"line {e.lineno}: not valid JSON ({e.msg})", whole=True) from None
    except RecursionError:
        raise m.fail("nested too deeply: not a manifest written by orch", whole=True) from None
    if not isinstance(manifest, dict) or manifest.get("version") != 1:
        raise m.fail("not an orch manifest (version 1)", whole=True)
    splits = manifest.get("splits")
    if not isinstance(splits, dict) or not all(k.isdigit() and k.isascii() for k in splits):
        raise m.fail("`splits` must map worker counts to splits", whole=True)
    return cast(ManifestDoc, manifest)   # the fields checked above


def check_split(split: object, m: Manifest) -> SplitDoc:
    """kind, source, seed, and one shard per rank named as the ranks read them, each
    listing its files as [path, bytes] with safe, distinct paths. Returns the split."""
    where = f"split for world size {m.world}"
    if not isinstance(split, dict):
        raise m.fail(f"the {where} is not an object")
    for key, kind in (("kind", str), ("source", str), ("seed", int), ("shards", list)):
        if not isinstance(split.get(key), kind) or isinstance(split.get(key), bool):
            raise m.fail(f"the {where} has no valid `{key}` ({kind.__name__})")
    shards = split["shards"]
    if len(shards) != m.world:
        raise m.fail(f"the {where} lists {len(shards)} shards")
    total = 0
    for rank, shard in enumerate(shards):
        total += check_shard(shard, rank, m)
        if total > MAX_FILES:
            raise m.fail(f"the {where} lists more than {MAX_FILES} files")
    return cast(SplitDoc, split)   # every field checked above


def check_shard(shard: object, rank: int, m: Manifest) -> int:
    want = f"worker_{rank}_of_{m.world}"
    files = shard.get("files") if isinstance(shard, dict) else None
    if not isinstance(shard, dict) or shard.get("name") != want or not isinstance(files, list) \
            or not is_count(shard.get("bytes")):
        raise m.fail(f"shard {rank} is not a valid `{want}` entry (name, bytes, files)")
    if len(files) > MAX_FILES:
        raise m.fail(f"shard {want} lists more than {MAX_FILES} files")
    if plain_entries(files):
        return len(files)
    seen: set[str] = set()
    for i, entry in enumerate(files):
        if not (type(entry) is list and len(entry) == 2 and type(entry[0]) is str
                and type(entry[1]) is int and entry[1] >= 0):   # type(): a bool is no count
            raise m.fail(f"shard {want}, file {i}: not a [path, bytes] pair")
        rel = safe_rel(entry[0], f"{m.path}: shard {want}, file {i}", m.fix)
        if rel in seen:
            raise m.fail(f"shard {want}, file {i}: {rel!r} is listed twice")
        seen.add(rel)
    return len(files)


def plain_entries(files: list[Any]) -> bool:
    """True when every entry is a [path, bytes] pair with an ASCII path that safe_rel
    takes, no path twice: the checks of a whole shard at once (a regex over the paths
    joined by NUL, which no path may hold), a tenth of their time one entry at a time
    (a first listing of a million files). False: the entries are judged one by one,
    which names the one that is wrong."""
    if not all(type(e) is list and len(e) == 2 for e in files):
        return False
    rels, sizes = [e[0] for e in files], [e[1] for e in files]
    if not (all(type(r) is str for r in rels) and all(type(n) is int for n in sizes)
            and min(sizes, default=0) >= 0 and len(set(rels)) == len(rels)):
        return False
    joined = "\0".join(rels)
    return joined.isascii() and max(map(len, rels), default=0) <= MAX_PATH and \
        joined.count("\0") == max(len(rels) - 1, 0) and not UNSAFE_JOINED.search(joined)


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# an empty, `.` or `..` part (also a leading or trailing slash), or a NUL; a backslash
# is an ordinary character of a POSIX name (it separates nothing) and round-trips
UNSAFE = re.compile(r"(?:^|/)\.{0,2}(?:/|$)|\0")
UNSAFE_JOINED = re.compile(r"(?:^|/|\0)\.{0,2}(?:/|\0|$)")   # the same, over paths joined by NUL


def safe_rel(rel: str, where: str, fix: str = "re-create the split with `orch split-data`") -> str:
    """A manifest path may not climb out of its shard: no absolute paths, no `..`."""
    if rel.isascii():
        size = len(rel)
    else:
        try:   # names split-data could not decode are written as surrogate escapes
            size = len(rel.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:
            size = MAX_PATH + 1
    if size > MAX_PATH or UNSAFE.search(rel):
        raise DataError(f"{where}: refusing unsafe path {rel[:200]!r} in manifest.json "
                        "(absolute, `..`, empty, overlong or not a file name)", hint=fix)
    return rel


# ---------------------------------------------------------------- the host's files

def host_files(cluster: Cluster, host: Host, split: Split,
               cache: DigestCache) -> list[LocalFile]:
    """The host's own shards, as `worker_<r>_of_<W>/<rel>` under data/: the bytes of files
    and of links into data.source; links inside a shard stay links."""
    files: list[LocalFile] = []
    for chunk in host_chunks(cluster, host, split, cache, MAX_FILES):
        files += chunk
    return files


def host_chunks(cluster: Cluster, host: Host, split: Split, cache: DigestCache,
                step: int | None = None) -> Iterator[list[LocalFile]]:
    """host_files() as it is made, `step` (CHUNK) files at a time (files.feed: a push that
    starts before the list is whole)."""
    step = step or CHUNK
    source = os.path.realpath(cluster.data.source) if cluster.data.source else None
    resolver, fix = Resolver(), shard_fix(cluster, source)
    for rank in host.ranks:
        shard = split.shards[rank]
        folder = shard_folder(cluster, shard.name)
        listed = Listed(shard.files)
        where = Where(f"{cluster.data.shards}/{shard.name}/", folder, shard.name, source, fix)
        entries = shard.files
        for lo in range(0, len(entries), step):
            yield shard_files(where, entries[lo:lo + step], listed, cache, resolver)


def shard_bytes(split: Split, host: Host) -> int:
    """The bytes the split says the host's shards hold (a push's total before the list is)."""
    return sum(split.shards[rank].bytes for rank in host.ranks)


class Listed:
    """The paths a shard lists, as a set made only when a link inside the shard asks."""

    def __init__(self, entries: list[Any]) -> None:
        self.entries = entries
        self.set: set[str] | None = None

    def __contains__(self, rel: object) -> bool:
        if self.set is None:
            self.set = {rel for rel, _size in self.entries}
        return rel in self.set

    def __iter__(self) -> Iterator[str]:
        return (rel for rel, _size in self.entries)


class LinkTexts:
    """What the links of a shard's folders say, remembered in the digest cache's memo by
    the folder's stat key: a link's text cannot change in place (a new link is a new
    entry, which moves its folder's mtime and ctime), so while a folder's key stands, a
    nothing-changed listing reads no link of it. {folder: (key, {name: text})}."""

    def __init__(self, cache: DigestCache) -> None:
        memo = cache.memo.get("links")
        self.cache = cache
        self.memo: dict[str, object] = memo if isinstance(memo, dict) else {}
        cache.memo["links"] = self.memo

    def of(self, folder: str) -> dict[str, str]:
        """The texts known for folder (a dict that fills as links are read: kept when
        the folder is a real one not changed within the clocks' granularity)."""
        try:
            st = os.lstat(folder)
        except OSError:
            return {}
        if not stat.S_ISDIR(st.st_mode) or racy(st):
            return {}
        key, hit = stat_key(st), self.memo.get(folder)
        if type(hit) is tuple and len(hit) == 2 and hit[0] == key and type(hit[1]) is dict:
            return hit[1]
        texts: dict[str, str] = {}
        self.memo[folder] = (key, texts)
        self.cache.dirty = True
        return texts


def forget_gone_folders(cache: DigestCache) -> int:
    """Link memos of shard folders that are gone (a split for another world size,
    removed) dropped from the cache, once a listing: they would be kept, and loaded by
    every `up`, forever. A folder still there stays remembered, also one of another
    job sharing the cache. Returns how many were dropped."""
    memo = cache.memo.get("links")
    if not isinstance(memo, dict):
        return 0
    gone = [folder for folder in memo if not os.path.isdir(folder)]
    for folder in gone:
        del memo[folder]
    cache.dirty = cache.dirty or bool(gone)
    return len(gone)


def shard_files(w: Where, entries: list[Any], listed: Listed, cache: DigestCache,
                resolver: Resolver) -> list[LocalFile]:
    """shard_file() of every entry, with link_into_source's common case written out in
    the loop: at a million files, each function call and attribute look-up per file is
    most of a nothing-changed `up`'s local part (a link read only when its folder
    changed: LinkTexts; the digest cache's entry compared inline, as DigestCache.known
    does). Anything unusual goes to shard_file."""
    out: list[LocalFile] = []
    readlink, lstat, isreg = os.readlink, os.lstat, stat.S_ISREG
    hashed, cached, folders, folder_of = cache.hashed, cache.entries.get, resolver.folders, \
        resolver.folder
    prefix, name, append, new, pack = w.prefix, w.name + "/", out.append, tuple.__new__, KEY.pack
    inside_shard, inside_source = w.folder.rstrip("/") + "/", (w.source or "").rstrip("/") + "/"
    texts, at, links, defer = LinkTexts(cache), None, {}, cache.defer
    # a cold file listed without its lstat: only for a push that reads it right away
    lazy, known, source = cache.defer and cache.lazy and w.source is not None, cache.entries, \
        w.source
    for rel, _size in entries:
        path = prefix + rel
        parent, _, base = path.rpartition("/")
        if parent != at:
            at, links = parent, texts.of(parent)
        text = links.get(base)
        try:
            if text is None:
                text = links[base] = readlink(path)
            hop = text if text[:1] == "/" else parent + "/" + text
            head, _, tail = hop.rpartition("/")
            if head and tail not in ("", ".", ".."):
                real = folders.get(head)
                hop = (real if real is not None else folder_of(head)) + "/" + tail
            else:
                hop = ""
            if lazy and hop and hop not in known and hop.startswith(inside_source) \
                    and not hop.startswith(inside_shard):
                # not in the cache, so nothing to compare a stat with: the push opens it
                # (no link followed) and takes its stat then (localfiles.open_listed)
                append(new(LocalFile, (name + rel, hop, _size, 0o644, "", None, None,
                                       UNSTATTED, source)))
                continue
            st = lstat(hop) if hop and w.source else None
        except OSError:
            st = None
        if st is None or not isreg(st.st_mode) or hop.startswith(inside_shard) \
                or not hop.startswith(inside_source):
            append(shard_file(w, rel, listed, cache, resolver))
            continue
        hit = cached(hop)
        if type(hit) is bytes and len(hit) == ENTRY and hit[:KEY.size] == pack(
                st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns):
            # tuple.__new__: LocalFile's own __new__ is a Python function, 3 µs a file
            append(new(LocalFile, (name + rel, hop, st.st_size, 0o644, hit[KEY.size:].hex(),
                                   None, None, None, None)))
        elif defer:   # hashed by the push as it reads the file (localfiles.fill)
            append(new(LocalFile, (name + rel, hop, st.st_size, 0o644, "", None, None, pack(
                st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns), None)))
        else:
            if hop == text:   # the very string the link memo keeps: marshal writes it once
                hop = text
            digest, data = hashed(hop, st)
            append(LocalFile(name + rel, hop, st.st_size, 0o644, digest, None, data))
    return out


def shard_fix(cluster: Cluster, source: str | None) -> str:
    """The fix for a bad shard file: made once per host, not once per file (a million
    files made it a third of a nothing-changed `up`)."""
    fix = f"re-run `{hint_cmd(cluster, f'split-data --workers {cluster.world_size}')}`"
    if source is None:
        fix += ("; links into the dataset need data.source in cluster.yaml, "
                "the folder that was split")
    return fix


@dataclass(frozen=True)
class Where:
    """One shard: its path as the user wrote it (with a trailing slash), resolved, its
    name, the resolved data source and the fix for its files."""
    prefix: str
    folder: str
    name: str
    source: str | None
    fix: str


def shard_folder(cluster: Cluster, name: str) -> str:
    """The shard's folder, resolved; it must be a real folder where split-data puts it."""
    path = f"{cluster.data.shards}/{name}"
    real = os.path.realpath(path)
    fix = f"run `{hint_cmd(cluster, f'split-data --workers {cluster.world_size}')}`"
    expected = os.path.join(os.path.realpath(str(cluster.data.shards)), name)
    if os.path.islink(path) or real != expected:
        raise DataError(f"{path}: the shard folder is a symlink (to {real})", hint=fix)
    if not os.path.isdir(real):
        raise DataError(f"{path}: shard folder missing", hint=fix)
    return real


def shard_file(w: Where, rel: str, listed: Listed, cache: DigestCache,
               resolver: Resolver) -> LocalFile:
    """One listed file: content when it is (or links to) a file in the shard or the data
    source; a link when it links to a listed path of the same shard; else refused."""
    path, folder, source, fix = w.prefix + rel, w.folder, w.source, w.fix
    fast = link_into_source(path, w, resolver)
    if fast is not None:
        return LocalFile(f"{w.name}/{rel}", fast[0], fast[1].st_size, 0o644,
                         cache.digest(*fast))
    try:
        st = os.lstat(path)
    except OSError:
        raise DataError(f"{path}: file missing", hint=fix) from None
    if stat.S_ISLNK(st.st_mode):
        res = resolve_link(path, folder, fix, content_root=source, resolver=resolver)
        if res.target is not None:
            return shard_link(f"{w.name}/{rel}", path, res.to, res.target, folder, listed, fix)
        real = res.to
    else:
        head, _, tail = path.rpartition("/")
        real = resolver.folder(head) + "/" + tail   # not a link itself: only its folders can be
        if not inside(real, folder) and not (source and inside(real, source)):
            raise DataError(f"{path}: reached through a linked folder, outside {folder} and the "
                            f"data source (to {real})", hint=fix)
    try:
        st = os.stat(real)
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})", hint=fix) from None
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{path}: not a regular file ({real})", hint=fix)
    return LocalFile(f"{w.name}/{rel}", real, st.st_size, 0o644, cache.digest(real, st))


def link_into_source(path: str, w: Where, resolver: Resolver) -> tuple[str, os.stat_result] | None:
    """The common case of a split, in two system calls: a link (as `orch split-data`
    makes them) straight to a regular file in the data source. (its path, its stat);
    None for anything else, which shard_file then judges in full (same answer, more
    calls). The same rule as resolve_link: one hop, the target's folder resolved."""
    if w.source is None:
        return None
    try:
        text = os.readlink(path)
        # os.path.join(dirname(path), text) as plain string work (an absolute target wins)
        hop = text if text[:1] == "/" else path.rpartition("/")[0] + "/" + text
        head, _, tail = hop.rpartition("/")
        if tail in ("", ".", "..") or not head:
            return None
        hop = resolver.folder(head) + "/" + tail
        st = os.lstat(hop)
    except OSError:
        return None   # not a link, or dangling: judged (and named) in full
    if not stat.S_ISREG(st.st_mode) or inside(hop, w.folder) or not inside(hop, w.source):
        return None
    return hop, st


def shard_link(dest: str, path: str, real: str, target: str, folder: str, listed: Listed,
               fix: str) -> LocalFile:
    """A link inside the shard stays a link, if what it points to is pushed with it."""
    sub = os.path.relpath(real, folder)
    if sub not in listed and not any(r.startswith(sub + "/") for r in listed):
        raise DataError(f"{path}: symlink to {real}, which the manifest does not list for this "
                        "shard: it would dangle on the host", hint=fix)
    return link_file(dest, path, target)
