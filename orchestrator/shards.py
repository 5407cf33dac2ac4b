"""Which shard files a host receives: only those of its own ranks, read from manifest.json."""
from __future__ import annotations

import json
import os

from orchestrator.errors import DataError
from orchestrator.inventory import Cluster, Host
from orchestrator.sync import DigestCache, LocalFile


def load_split(cluster: Cluster) -> dict:
    """The split made for this job's world size, or a message saying which split to make."""
    shards = cluster.data.shards
    fix = f"run `orch split-data --workers {cluster.world_size}`"
    try:
        manifest = json.loads((shards / "manifest.json").read_text())
    except FileNotFoundError:
        raise DataError(f"{shards}/manifest.json not found: the data has not been split",
                        hint=fix) from None
    except (OSError, ValueError) as e:
        raise DataError(f"{shards}/manifest.json cannot be read: {e}", hint=fix) from None
    split = manifest.get("splits", {}).get(str(cluster.world_size))
    if split is None:
        have = ", ".join(sorted(manifest.get("splits", {}), key=int)) or "none"
        raise DataError(f"{shards} has no split for world size {cluster.world_size} "
                        f"(splits there: {have})", hint=fix)
    check_split(split, cluster.world_size, f"{shards}/manifest.json", fix)
    return split


def check_split(split: dict, world: int, where: str, fix: str) -> None:
    """One shard per rank, named as the ranks read them, each a list of [path, bytes]."""
    shards = split.get("shards")
    if not isinstance(shards, list) or len(shards) != world:
        n = len(shards) if isinstance(shards, list) else 0
        raise DataError(f"{where}: the split for world size {world} lists {n} shards", hint=fix)
    for rank, shard in enumerate(shards):
        want = f"worker_{rank}_of_{world}"
        files = shard.get("files") if isinstance(shard, dict) else None
        if not isinstance(shard, dict) or shard.get("name") != want or not isinstance(files, list) \
                or not all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str)
                           for f in files):
            raise DataError(f"{where}: shard {rank} is not a valid `{want}` entry", hint=fix)


def safe_rel(rel: str, where: str) -> str:
    """A manifest path may not climb out of its shard: no absolute paths, no `..`."""
    if not rel or rel[0] == "/" or "\\" in rel or \
            any(part in ("", ".", "..") for part in rel.split("/")):
        raise DataError(f"{where}: refusing unsafe path {rel!r} in manifest.json",
                        hint="re-create the split with `orch split-data`")
    return rel


def resolve_inside(path: str, roots: tuple[str, ...], where: str) -> str:
    """Links are followed, but only to files inside the split's source folder (or the
    shards folder itself, where `--pack` writes real files). `roots` are resolved and end
    with a slash."""
    real = os.path.realpath(path)
    if not real.startswith(roots):
        raise DataError(f"{where}: {path} points outside the data source ({real})",
                        hint="re-create the split with `orch split-data`")
    return real


def host_files(cluster: Cluster, host: Host, split: dict, cache: DigestCache) -> list[LocalFile]:
    """The real bytes of the host's own shards, as `worker_<r>_of_<W>/<rel>` under data/."""
    roots = tuple(os.path.realpath(r).rstrip("/") + "/"
                  for r in (split["source"], str(cluster.data.shards)))
    files = []
    for rank in host.ranks:
        name = split["shards"][rank]["name"]
        base = f"{cluster.data.shards}/{name}/"
        for rel, _size in split["shards"][rank]["files"]:
            rel = safe_rel(rel, name)
            real = resolve_inside(base + rel, roots, name)
            try:
                st = os.stat(real)
            except FileNotFoundError:
                raise DataError(f"{base + rel}: file missing", hint="re-run `orch split-data`") from None
            files.append(LocalFile(f"{name}/{rel}", real, st.st_size, 0o644,
                                   cache.digest(real, st)))
    return files
