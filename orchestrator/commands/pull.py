"""`orch pull`: files from a host's job output/ to this machine (outputs/<name>/ beside
the inventory by default), incrementally and verified (api.pull)."""
from __future__ import annotations

import argparse
from typing import Any

from orchestrator.api import pulling
from orchestrator.api.outcomes import PullResult
from orchestrator.commands import render
from orchestrator.commands.common import (
    console,
    emit_json,
    emit_json_failed,
    hint_cmd,
    inventory,
    warn,
)
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import EXIT_OK, OrchError
from orchestrator.ui.termsafe import plain


def add_parser(sub: Any) -> None:
    p = sub.add_parser("pull")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="files or folders relative to the job's output/ (default: all of it)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, metavar="R", help="the host that runs global rank R "
                       "(default: rank 0)")
    which.add_argument("--host", metavar="H", help="that host (its address or label)")
    p.add_argument("-o", "--out", metavar="DIR",
                   help="destination folder (default: outputs/<name>/ beside the inventory)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = inventory(args)
    try:
        result = pulling.pull(cluster, args.paths, rank=args.rank, host=args.host, dest=args.out,
                              progress=pulling.quiet if args.json else render.pull_bar,
                              warn=warn)
    except OrchError as e:   # files that could not be written: what was pulled, then why
        if isinstance(e.result, PullResult) and args.json:
            emit_json_failed(args, e.result, e, e.exit_code)
        elif isinstance(e.result, PullResult):
            show(result=e.result, as_json=args.json)
        raise
    show(result, args.json)
    if not args.json and not result.listed and not result.skipped_count:
        console.print(plain(empty(cluster, pulling.pick_host(cluster, args.rank, args.host))))
    return EXIT_OK


def empty(cluster: Cluster, source: Host) -> str:
    """Why a host's output/ may hold nothing, and where to look instead."""
    if 0 in source.ranks:
        return (f"  the job wrote nothing to $ORCH_OUTPUT_DIR on {source.label} "
                "(yet); no folder was made here")
    master = cluster.host_of(0)
    return (f"  {source.label} runs {pulling.whose(source, None)}; in most jobs only rank 0 "
            f"writes output: `{hint_cmd(cluster, 'pull')}` pulls from {master.label} "
            "(rank 0's host); no folder was made here")


def show(result: PullResult, as_json: bool) -> None:
    if as_json:
        emit_json(result)
    else:
        render.pulled(result)
