"""`orch results`: a job array's tasks with the last row of each one's metrics.csv, then
grouped over folds (mean ± std); also written to `.orch/<name>/results.csv` (api.results)."""
from __future__ import annotations

import argparse
from typing import Any

from orchestrator.api import querying
from orchestrator.commands import render
from orchestrator.commands.common import emit_json, inventory, warn_unreachable
from orchestrator.errors import EXIT_OK


def add_parser(sub: Any) -> None:
    p = sub.add_parser("results")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    res = querying.results(inventory(args))
    if args.json:
        emit_json(res)
    else:
        warn_unreachable(res.unreached.values())
        render.results(res)
    return EXIT_OK
