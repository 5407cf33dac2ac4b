"""`orch up`: preflight, push code and shards, start torchrun everywhere, follow the job.

One session per host serves every step (Session); this module renders the steps."""
from __future__ import annotations

import argparse
import json
import os
import time
from types import ModuleType
from typing import Any

from rich.markup import escape

from orchestrator.commands.common import console, emit_json, hint_cmd, inventory, plural
from orchestrator.commands.pull import after_job
from orchestrator.config.inventory import Cluster
from orchestrator.errors import EXIT_INTERRUPTED, EXIT_OK, UsageError
from orchestrator.files.localfiles import DigestCache, check_entrypoint, code_files
from orchestrator.files.shards import host_files, load_split
from orchestrator.files.sync import SyncReport
from orchestrator.session import state as job_state
from orchestrator.session.launch import dry_run_plan, master_addr
from orchestrator.session.preflight import PreflightReport
from orchestrator.session.session import HostFiles, Session, group_files
from orchestrator.session.setupstep import needs_check
from orchestrator.session.shelloutput import Printer
from orchestrator.ui.console import bytes_bar, hosts_bar
from orchestrator.watch.monitor import attach


def add_parser(sub: Any) -> None:
    p = sub.add_parser("up")
    p.add_argument("file", nargs="?", help="inventory (default: -c, or cluster.yaml)")
    p.add_argument("--detach", action="store_true", help="return once every host has started")
    p.add_argument("--setup", action="store_true",
                   help="run `setup:` on every host even where it ran before, unchanged")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and each host's command; touch no host")
    p.add_argument("--fail-fast", action="store_true",
                   help="job arrays: the first failing task stops every task (default: the others go on)")
    p.add_argument("--no-pull", action="store_true",
                   help="do not pull rank 0's output/ into outputs/<name>/ when the job ends")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = inventory(args)
    if args.dry_run:
        plan = array_up().array_plan(cluster) if cluster.job.array else dry_run_plan(cluster)
        if args.json:
            emit_json({"job": cluster.name, "plan": plan})
        else:
            print(plan)
        return EXIT_OK
    if args.json and not args.detach:
        raise UsageError("`up --json` needs --detach: an attached job streams its ranks' output",
                         hint=f"`{hint_cmd(cluster, 'up --detach --json')}`, then "
                              f"`{hint_cmd(cluster, 'status --json')}`")
    files = local_files(cluster)   # bad data is refused before any host is touched
    session = Session(cluster)
    try:
        pre = connect_and_check(session)
        size = "a job array" if cluster.job.array else f"world size {cluster.world_size}"
        console.print(f"preflight: {plural(len(cluster.hosts), 'host')} ok, {size}")
        sync(session, files, pre)
        pre = setup_and_check(session, files, pre, args.setup)
        if cluster.job.array is not None:
            code: int = array_up().up_array(session, pre, args)
            return code
        run_id, sups = session.launch(pre)
        st = job_state.new_state(cluster, run_id, master_addr(cluster, pre.hosts),
                                 pre.master_port, pre.hosts, sups)
        job_state.save(cluster, st)
        console.print(f"started job '{cluster.name}' on {plural(len(cluster.hosts), 'host')} "
                      f"({plural(cluster.world_size, 'rank')}, "
                      f"MASTER_ADDR={st.master_addr}:{st.master_port})")
        if args.detach:
            console.print(f"detached: follow with `{hint_cmd(cluster, 'logs -f')}`, "
                          f"stop with `{hint_cmd(cluster, 'stop')}`, "
                          f"get its output/ with `{hint_cmd(cluster, 'pull')}`", markup=False)
            if args.json:
                emit_json(detached_doc(cluster, st))
            return EXIT_OK
        code = attach(session, st)
        if args.no_pull or code == EXIT_INTERRUPTED:
            return code
        return after_job(session, code)
    finally:
        session.close()


def array_up() -> ModuleType:
    """Job arrays' module, imported for an array only (its imports cost every `up`)."""
    from orchestrator.commands import array_up
    return array_up


def detached_doc(cluster: Cluster, st: job_state.JobState) -> dict[str, Any]:
    """`up --detach --json`: where the job runs."""
    return {"job": cluster.name, "run_id": st.run_id, "world_size": cluster.world_size,
            "master_addr": st.master_addr, "master_port": st.master_port,
            "hosts": [{"host": h.label, "job_dir": h.job_dir, "ranks": list(h.ranks)}
                      for h in st.hosts]}


def connect_and_check(session: Session) -> PreflightReport:
    """Connect to every host, start its agent and preflight it, all in parallel (a host
    is checked as soon as its agent is up), with a hosts-done display."""
    n = len(session.cluster.hosts)
    with hosts_bar() as bar:
        task = bar.add_task("connect + preflight", total=n)
        return session.open_and_preflight(checked=lambda: bar.advance(task))


def setup_and_check(session: Session, files: dict[int, HostFiles], pre: PreflightReport,
                    force: bool) -> PreflightReport:
    """`setup:` everywhere (all or nothing), then the python, torch and entrypoint check
    where setup may have changed them, or where nothing was pushed."""
    cluster = session.cluster
    for i, info in sorted(pre.hosts.items()):
        if info.python_missing:
            console.print(f"{escape(cluster.hosts[i].label)}: python {escape(info.python_missing)} "
                          "is not there yet; checked after setup")
    if cluster.setup is not None:
        t0 = time.monotonic()
        replies = session.setup(pre, files[0].code, force, Printer())
        skipped = sum(1 for r in replies.values() if r["skipped"])
        if skipped:
            console.print(f"setup: skipped on {plural(skipped, 'host')} (unchanged since it last "
                          f"succeeded there; `{hint_cmd(cluster, 'up --setup')}` runs it again)",
                          markup=False)
        if skipped < len(replies):
            console.print(f"setup: done on {plural(len(replies) - skipped, 'host')} "
                          f"({time.monotonic() - t0:.1f} s; logs/setup.log on each host)")
        covered = len(cluster.hosts) - len(replies)
        if covered:
            console.print(f"setup: {plural(covered, 'host')} share a job folder with a host "
                          "that ran it (setup.once_per: filesystem)", markup=False)
    return session.check_ready(pre) if needs_check(cluster) else pre


def local_files(cluster: Cluster) -> dict[int, HostFiles]:
    """What each host must hold, hashed (cached) and checked here, before connecting."""
    if cluster.job.array is not None:
        files: dict[int, HostFiles] = array_up().array_files(cluster)
        return files
    split = load_split(cluster) if cluster.data.shards else None
    cache = DigestCache(cluster.state_dir.parent / "digests.json")
    check_entrypoint(cluster.base_dir, cluster.code.paths, cluster.code.exclude,
                     cluster.job.entrypoint, str(cluster.path))
    code = code_files(cluster.base_dir, cluster.code.paths, cluster.code.exclude, cache,
                      str(cluster.path))
    files = {h.index: HostFiles(code, host_files(cluster, h, split, cache) if split else None)
             for h in cluster.hosts}
    cache.save()
    return files


def sync(session: Session, files: dict[int, HostFiles], pre: PreflightReport) -> None:
    cluster = session.cluster
    total = sum(sum(f.size for f in hf.code) + sum(f.size for f in hf.data or ())
                for hf in group_files(files, pre).values())
    with bytes_bar() as bar:
        task = bar.add_task(f"sync 0/{plural(len(cluster.hosts), 'host')}", total=total or 1)
        done: list[int] = []

        def host_done(index: int) -> None:
            done.append(index)
            bar.update(task, description=f"sync {len(done)}/{plural(len(cluster.hosts), 'host')}")
        reports = session.sync(files, pre, lambda n: bar.advance(task, n), host_done)
    report_sync(cluster, reports, pre)


def report_sync(cluster: Cluster, reports: dict[int, dict[str, SyncReport]],
                pre: PreflightReport) -> None:
    """One line per job folder (hosts sharing one are named together), and
    .orch/<name>/last_sync.json with what was sent where."""
    record: dict[str, Any] = {}
    for i, parts in sorted(reports.items()):
        label = cluster.hosts[i].label
        others = [cluster.hosts[m].label for m in pre.group_of(i) if m != i]
        shared = f" (job folder shared with {', '.join(others)}: pushed once)" if others else ""
        bits = [f"{k} {plural(r.files, 'file')} {r.bytes} B sent, {r.deleted} deleted"
                for k, r in parts.items()]
        if len(cluster.hosts) <= 16 or any(r.files for r in parts.values()) or others:
            console.print(f"sync {label}{shared}: " + ("; ".join(bits) or "nothing to push"),
                          markup=False)
        record[label] = {k: {"files": r.files, "bytes": r.bytes, "deleted": r.deleted,
                             "sent": list(r.sent)} for k, r in parts.items()}
        if others:
            record[label]["shared_with"] = others
        for other in others:
            record[other] = {"pushed_by": label}
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    path = cluster.state_dir / "last_sync.json"
    path.write_text(json.dumps(record, indent=1))
    os.chmod(path, 0o600)
