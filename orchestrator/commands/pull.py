"""`orch pull`: files from a host's job output/ to this machine (outputs/<name>/ beside
the inventory by default), incrementally and verified. `orch up` calls `after_job`."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from orchestrator.commands.common import console, inventory, open_session
from orchestrator.config.inventory import Cluster, Host
from orchestrator.errors import EXIT_OK, OrchError, UsageError
from orchestrator.files.pull import PullReport, check_paths, raise_failed
from orchestrator.session import state as job_state
from orchestrator.session.session import Session
from orchestrator.ui.console import bytes_bar
from orchestrator.ui.termsafe import plain
from orchestrator.ui.wording import hint_cmd


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
    paths = check_paths(args.paths)
    host = pick_host(cluster, args.rank, args.host)
    dest = Path(args.out).absolute() if args.out else default_dest(cluster)
    session = open_session(cluster, job_state.load(cluster), hosts=(host,))
    try:
        session.require_all("to connect")
        report = pull_with_bar(session, host, paths, dest, quiet=args.json)
    finally:
        session.close()
    if args.json:
        print(json.dumps(report.as_json(), indent=1))
    else:
        render(report)
    raise_failed(report)
    return EXIT_OK


def default_dest(cluster: Cluster) -> Path:
    return cluster.base_dir / "outputs" / cluster.name


def pick_host(cluster: Cluster, rank: int | None, name: str | None) -> Host:
    if name is None:
        return cluster.host_of(0 if rank is None else rank)
    found = [h for h in cluster.hosts if name in (h.label, h.address)]
    if len(found) == 1:
        return found[0]
    labels = ", ".join(h.label for h in (found or cluster.hosts))
    if found:
        raise UsageError(f"--host {name} names {len(found)} hosts ({labels})",
                         hint="give one of those labels, or use --rank R")
    raise UsageError(f"--host {name}: no such host in {cluster.path.name}",
                     hint=f"give one of: {labels}")


def pull_with_bar(session: Session, host: Host, paths: list[str], dest: Path,
                  quiet: bool = False) -> PullReport:
    if quiet:
        return session.pull(host, paths, dest)
    with bytes_bar() as bar:
        task = bar.add_task(f"pull {host.label}", total=None)
        return session.pull(host, paths, dest, lambda n: bar.advance(task, n),
                            lambda total: bar.update(task, total=total or 1))


def shown(path: str) -> str:
    """The destination as the user would type it: relative to here when below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path + "/"
    return (path if rel.startswith("..") else rel) + "/"


def render(report: PullReport) -> None:
    where = shown(report.dest)
    if report.files:
        console.print(f"pulled {report.files} files ({report.bytes / 1e6:.1f} MB) to {where}"
                      + (f"; {report.unchanged} unchanged" if report.unchanged else ""))
    elif report.listed:
        console.print(f"{where} is up to date ({report.unchanged} files)")
    else:
        console.print(plain(f"nothing to pull: {report.host}:{report.source} has no files"))
    for note in report.skipped:
        console.print(plain(f"  skipped {note['p']}: {note['why']}"))
    if report.skipped_count > len(report.skipped):
        console.print(f"  ... and {report.skipped_count - len(report.skipped)} more skipped")


def after_job(session: Session, code: int) -> int:
    """`orch up`'s pull of rank 0's output/ when the job ended (succeeded or failed), on
    the up's open links. A failed pull keeps a failed job's code, else it is the code."""
    cluster = session.cluster
    host = cluster.host_of(0)
    try:
        report = pull_with_bar(session, host, [], default_dest(cluster))
        render(report)
        raise_failed(report)
    except OrchError as e:   # the job's outcome is already printed; say why the pull failed
        console.print(plain(f"pull failed: {e}"))
        console.print(f"  get the files later with `{hint_cmd(cluster, 'pull')}`", markup=False)
        return code or e.exit_code
    return code
