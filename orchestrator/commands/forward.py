"""`orch forward [--host H | --rank R] REMOTE_PORT[:LOCAL_PORT] ...`: local ports relayed
to ports on a job's host over orch's SSH connection (api.forward), until Ctrl-C.

Exit codes: 130 when ended with Ctrl-C (the forwards' normal end); 2 bad usage (a port,
a selection, a local port in use); 3 the host could not be reached."""
from __future__ import annotations

import argparse
from typing import Any

from orchestrator.api import forwarding
from orchestrator.commands.common import console, emit_json, inventory
from orchestrator.errors import EXIT_INTERRUPTED
from orchestrator.ui.termsafe import plain


def add_parser(sub: Any) -> None:
    p = sub.add_parser("forward")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--host", metavar="H",
                       help="the host (an address, a label or an index); default: rank 0's")
    where.add_argument("--rank", type=int, metavar="R", help="the host of global rank R")
    p.add_argument("ports", nargs="+", metavar="REMOTE_PORT[:LOCAL_PORT]",
                   help="a port on the host's localhost, and the local one (default: the "
                        "same; 0: any free one); several at once")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = inventory(args)
    with forwarding.forward(cluster, args.ports, host=args.host, rank=args.rank,
                            report=report) as fwd:
        if args.json:
            emit_json(fwd.result)
        for f in fwd.result.forwards:
            console.print(plain(f"forwarding {f.url} -> localhost:{f.remote_port} on "
                                f"{fwd.result.host}"))
        console.print("Ctrl-C ends it", markup=False)
        try:
            fwd.wait()
        except KeyboardInterrupt:
            console.print(plain(f"forwards to {fwd.result.host} closed"))
            return EXIT_INTERRUPTED
    return EXIT_INTERRUPTED


def report(message: str, fix: str) -> None:
    """A connection the host could not take: said, and the forward goes on."""
    console.print(plain(f"warning: {message}"))
    console.print(plain(f"  fix: {fix}"))
