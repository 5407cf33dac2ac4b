"""What every command needs: the inventory from its arguments, messages, --json."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

from orchestrator.api import jobs
from orchestrator.api.outcomes import JSON_VERSION, document
from orchestrator.config.inventory import Cluster
from orchestrator.ui.console import console, out
from orchestrator.ui.termsafe import plain_lines
from orchestrator.ui.wording import hint_cmd, plural

__all__ = [
    "console",
    "emit_json",
    "hint_cmd",
    "inventory",
    "inventory_path",
    "out",
    "plural",
    "warn",
    "warn_unreachable",
]


def inventory(args: argparse.Namespace) -> Cluster:
    """The inventory a command names (its positional FILE, or -c, default cluster.yaml),
    narrowed to the hosts of the job's last `up` (`up --hosts/--exclude`)."""
    return jobs.run_cluster(inventory_path(args))


def inventory_path(args: argparse.Namespace) -> Path:
    return Path(getattr(args, "file", None) or args.config)


def warn_unreachable(failures: Iterable[BaseException]) -> None:
    """One warning per host that could not be reached (its message names it)."""
    for exc in failures:
        warn(str(exc))


def warn(message: str) -> None:
    """A warning on stderr; host text shown escaped, its lines (a `fix:`) kept apart."""
    console.print("[yellow]warning:[/]", plain_lines(message))


def emit_json_line(obj: Any) -> None:
    """One document per line (`status --watch --json`): for `jq -c`, a log, a pipe."""
    sys.stdout.write(json.dumps(document(obj), default=str) + "\n")
    sys.stdout.flush()


def emit_json_failed(args: argparse.Namespace, result: Any, error: Exception, code: int) -> None:
    """Under --json, a command that failed part way (stop, pull): its one document is what
    was done with the error's `error` and `exit_code` added; the error itself then goes
    to stderr only (cli() writes no second document)."""
    emit_json({**document(result), "error": str(error), "exit_code": code})
    args.json = False


def emit_json(obj: Any) -> None:
    """The one JSON document of a command run with --json, on stdout: an api result
    (its document) or a document built here; either way with its `version` first."""
    doc = document(obj) if is_dataclass(obj) else {"version": JSON_VERSION, **obj}
    sys.stdout.write(json.dumps(doc, indent=1, default=str) + "\n")
    sys.stdout.flush()
