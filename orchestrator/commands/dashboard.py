"""`orch dashboard [-c FILE] [--port P] [--no-open]`: the job's live page on 127.0.0.1,
behind a token in its URL, which is printed; served until Ctrl-C (exit 130, as `orch
forward`). A job not started, or a port in use, is a usage error (exit 2) and serves
nothing."""
from __future__ import annotations

import argparse
import threading
from typing import Any

from orchestrator.commands.common import console, emit_json, inventory_path
from orchestrator.dashboard import page
from orchestrator.errors import EXIT_INTERRUPTED
from orchestrator.ui.termsafe import plain


def add_parser(sub: Any) -> None:
    p = sub.add_parser("dashboard")
    p.add_argument("file", nargs="?", help="inventory (default: -c, or cluster.yaml)")
    p.add_argument("--port", type=int, default=0, metavar="P",
                   help="the local port (default: any free one)")
    p.add_argument("--no-open", action="store_true", help="print the URL, open no browser")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    opened = page.open_for_job(inventory_path(args), port=args.port)
    try:
        if args.json:   # for a script that opens the page itself
            emit_json({"url": opened.url, "port": opened.server.port})
        say_url(opened.url, args.no_open or args.json)
        for line in list(opened.board.notes):   # an earlier run's files set aside, as the pull says it
            console.print(plain(line), soft_wrap=True)
        console.print("Ctrl-C ends it", markup=False)
        hold()
    except KeyboardInterrupt:
        console.print("dashboard closed", markup=False)
    finally:
        opened.close()
    return EXIT_INTERRUPTED


def hold() -> None:
    """Until Ctrl-C: the page is served by its own threads."""
    threading.Event().wait()


def say_url(url: str, no_open: bool) -> None:
    console.print(plain(f"dashboard: {url}"), soft_wrap=True)   # one line to copy
    if not no_open:
        page.open_browser(url, lambda line: console.print(plain(line)))
