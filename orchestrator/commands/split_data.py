"""`orch split-data`: split a dataset into one folder of links per worker.

The work is done by orchestrator.files.splitdata; this module parses, resolves defaults, prints."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, TypedDict

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from orchestrator.commands.common import emit_json
from orchestrator.errors import EXIT_OK, DataError, UsageError
from orchestrator.files import splitdata
from orchestrator.ui.wording import plural

DEFAULT_IMAGE_SIZE = 224
# Beyond this many workers the table shows the first and last few rows and a summary line.
FULL_TABLE_ROWS = 32
EDGE_ROWS = 8


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "split-data",
        description="Split a dataset into N worker shards made of symlinks, plus manifest.json. "
                    "Record files (train-00000-of-01024) are split into contiguous runs; an "
                    "ImageFolder tree is split per class, shuffled with --seed.")
    p.add_argument("--workers", "-n", type=int, metavar="N",
                   help="number of shards (default: the inventory's world size)")
    p.add_argument("--source", type=Path, metavar="DIR",
                   help="dataset folder (default: data.source)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="where worker_<i>_of_<N>/ and manifest.json go (default: data.shards)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="shuffle seed for ImageFolder sources (default: 0)")
    p.add_argument("--pack", action="store_true",
                   help="after splitting, pack each shard with worker.pack (ImageFolder only)")
    p.add_argument("--image-size", type=int, metavar="S",
                   help=f"image size for --pack (default: {DEFAULT_IMAGE_SIZE})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    workers, source, out = _resolve(args)
    packer = _packer(args)
    result = splitdata.split(source, out, workers, seed=args.seed, pack=packer)
    if getattr(args, "json", False):
        emit_json(summary(result))
    else:
        print_summary(Console(highlight=False), result)
    return EXIT_OK


class ShardSummary(TypedDict):
    name: str
    files: int
    bytes: int
    classes: dict[str, int]


class Summary(TypedDict):
    """`orch split-data --json` (docs/reference/json.md names its fields)."""

    workers: int
    kind: str
    source: str
    seed: int
    out: str
    manifest: str
    replaced: bool
    seconds: dict[str, float]
    notes: list[str]
    shards: list[ShardSummary]


def summary(result: splitdata.SplitResult) -> Summary:
    """--json: what was written, per shard its counts (not its file list: manifest.json has it)."""
    p = result.plan
    return {"workers": p.workers, "kind": p.kind, "source": str(p.source), "seed": p.seed,
            "out": str(result.out), "manifest": str(result.manifest), "replaced": result.replaced,
            "seconds": result.seconds, "notes": list(p.notes),
            "shards": [{"name": s.name, "files": len(s.files), "bytes": s.bytes,
                        "classes": dict(s.classes)} for s in p.shards]}


def _resolve(args: argparse.Namespace) -> tuple[int, Path, Path]:
    """--workers/--source/--out, falling back to the inventory only for what is missing."""
    workers, source, out = args.workers, args.source, args.out
    if workers is not None and source is not None and out is not None:
        return workers, source, out
    cluster = _load_inventory(Path(getattr(args, "config", None) or "cluster.yaml"), args)
    if workers is None:   # a job array: one task is the world (every host gets all shards)
        workers = cluster.job.array.procs_per_task if cluster.job.array else cluster.world_size
    data = getattr(cluster, "data", None)
    if source is None:
        source = getattr(data, "source", None)
        if source is None:
            raise DataError("no dataset to split: --source is not given and cluster.yaml "
                            "has no data.source",
                            hint="pass --source DIR, or add `data: {source: DIR}` to cluster.yaml")
    if out is None:
        out = getattr(data, "shards", None)
        if out is None:
            raise DataError("nowhere to write the shards: --out is not given and cluster.yaml "
                            "has no data.shards",
                            hint="pass --out DIR, or add `data: {shards: DIR}` to cluster.yaml")
    return workers, Path(source), Path(out)


def _load_inventory(config: Path, args: argparse.Namespace) -> Any:
    given = (("--workers", args.workers), ("--source", args.source), ("--out", args.out))
    missing = [f for f, v in given if v is None]
    if not config.exists():
        raise UsageError(f"{config} not found; it is needed for the defaults of "
                         f"{', '.join(missing)}",
                         hint="pass --workers, --source and --out, "
                              "or -c FILE to name the inventory")
    from orchestrator.config.inventory import (
        load,  # imported late: not needed when all three are given
    )

    return load(config)


def _packer(args: argparse.Namespace) -> splitdata.Packer | None:
    if not args.pack:
        if args.image_size is not None:
            raise UsageError("--image-size only applies together with --pack",
                             hint="add --pack, or drop --image-size")
        return None
    size = DEFAULT_IMAGE_SIZE if args.image_size is None else args.image_size
    if size < 1:
        raise UsageError(f"--image-size must be a positive number of pixels (got {size})",
                         hint="e.g. --image-size 224")
    pack_shard = _import_packer()

    def pack(shard_dir: Path) -> None:
        pack_shard(shard_dir, size)
    return pack


def _import_packer() -> Callable[..., Path]:
    """worker.pack from the current folder, as `python -m worker.pack` would find it: the
    training program is not part of orch's wheel (it ships to the hosts as code)."""
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        from worker.pack import pack_shard
    except ImportError as exc:
        raise DataError(f"--pack needs worker.pack.pack_shard, which cannot be imported ({exc})",
                        hint="run it in the folder that holds worker/ (the orch checkout), with "
                             "the worker extras installed, or drop --pack") from None
    finally:
        if added:
            sys.path.remove(here)
    packer: Callable[..., Path] = pack_shard
    return packer


# ---------------------------------------------------------------- output


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _per_class(shard: splitdata.Shard, kind: str) -> dict[str, int]:
    """Files per class (an ImageFolder's split folders summed) or per record group."""
    if kind != "imagefolder":
        return dict(shard.classes)
    out: dict[str, int] = {}
    for key, count in shard.classes.items():
        name = key.rsplit("/", 1)[-1]
        out[name] = out.get(name, 0) + count
    return out


def _row(shard: splitdata.Shard, kind: str) -> list[str]:
    counts = _per_class(shard, kind).values()
    return [shard.name, str(len(shard.files)), _human(shard.bytes), str(len(counts)),
            f"{min(counts)}..{max(counts)}" if counts else "-"]


def shard_table(p: splitdata.SplitPlan) -> Table:
    unit, units = ("class", "classes") if p.kind == "imagefolder" else ("group", "groups")
    table = Table(title=f"{plural(p.workers, 'shard')} of {escape(str(p.source))} ({p.kind})",
                  title_justify="left")
    table.add_column("shard")
    for col in ("files", "bytes", units, f"files per {unit}"):
        table.add_column(col, justify="right")
    shards = p.shards
    if len(shards) <= FULL_TABLE_ROWS:
        for shard in shards:
            table.add_row(*_row(shard, p.kind))
        return table
    for shard in shards[:EDGE_ROWS]:
        table.add_row(*_row(shard, p.kind))
    table.add_row(f"... {len(shards) - 2 * EDGE_ROWS} more", "", "", "", "")
    for shard in shards[-EDGE_ROWS:]:
        table.add_row(*_row(shard, p.kind))
    return table


def print_summary(console: Console, result: splitdata.SplitResult) -> None:
    p = result.plan
    for note in p.notes:
        console.print(f"note: {note}", markup=False, soft_wrap=True)
    console.print(shard_table(p))
    files = [len(s.files) for s in p.shards]
    sizes = [s.bytes for s in p.shards]
    total_s = sum(result.seconds.values())
    console.print(f"{plural(sum(files), 'file')} in {plural(p.workers, 'shard')}: "
                  f"{min(files)}..{max(files)} files, "
                  f"{_human(min(sizes))}..{_human(max(sizes))} per shard",
                  markup=False, soft_wrap=True)
    verb = "replaced" if result.replaced else "wrote"
    console.print(f"{verb} {result.out}/worker_*_of_{p.workers} and {result.manifest} "
                  f"in {total_s:.1f} s", markup=False, soft_wrap=True)
