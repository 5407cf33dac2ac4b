"""`orch up`: preflight, push code and shards, start torchrun everywhere, follow the job."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any

from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                           TransferSpeedColumn)

from orchestrator import state as job_state
from orchestrator.commands.common import connected, console, inventory
from orchestrator.commands.monitor import attach
from orchestrator.connect import close_all, fan_out
from orchestrator.errors import EXIT_OK
from orchestrator.inventory import Cluster
from orchestrator.launch import Started, dry_run_plan, launch_all, master_addr, open_launcher
from orchestrator.localfiles import Pushable, check_entrypoint
from orchestrator.preflight import Preflight, job_dir, preflight
from orchestrator.shards import host_files, load_split
from orchestrator.stopper import stop_all
from orchestrator.sync import DigestCache, LocalFile, SyncReport, code_files, push
from orchestrator.transport import Channel, Transport


def add_parser(sub: Any) -> None:
    p = sub.add_parser("up", help="preflight, sync, start the job on every host, follow it")
    p.add_argument("file", nargs="?", help="inventory (default: -c, or cluster.yaml)")
    p.add_argument("--detach", action="store_true", help="return once every host has started")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and each host's command; touch no host")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = inventory(args)
    if args.dry_run:
        print(dry_run_plan(cluster))
        return EXIT_OK
    files = local_files(cluster)   # bad data is refused before any host is touched
    transports, launchers, pre = connect_and_check(cluster, follow=not args.detach)
    try:
        console.print(f"preflight: {len(cluster.hosts)} hosts ok, world size {cluster.world_size}")
        setup_hosts(cluster, transports, files, pre)
        run_id, started = start(cluster, transports, pre, launchers)
        sups = {i: s.supervisor for i, s in started.items()}
        st = job_state.new_state(cluster, run_id, master_addr(cluster, pre.hosts),
                                 pre.master_port, pre.hosts, sups)
        job_state.save(cluster, st)
        console.print(f"started job '{cluster.name}' on {len(cluster.hosts)} hosts "
                      f"({cluster.world_size} ranks, MASTER_ADDR={st.master_addr}:{st.master_port})")
        if args.detach:
            console.print("detached: follow with `orch logs -f`, stop with `orch stop`")
            return EXIT_OK
        return attach(cluster, transports, st, {i: (s.chan, s.pending) for i, s in started.items()})
    finally:
        close_everything(transports, launchers)


def close_everything(transports: dict[int, Transport], launchers: dict[int, Channel]) -> None:
    for chan in launchers.values():
        chan.close()   # a launcher that got no spec sees EOF and exits, touching nothing
    close_all(transports)


def connect_and_check(cluster: Cluster, follow: bool
                      ) -> tuple[dict[int, Transport], dict[int, Channel], Preflight]:
    """Connect to every host and preflight it, all in parallel, with a hosts-done display.
    Each host's launch agent is started alongside and waits for its spec."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("hosts"), console=console, transient=True) as bar:
        task = bar.add_task("connect", total=len(cluster.hosts))
        tick = lambda: bar.advance(task)
        transports, failed = connected(cluster, tick)
        bar.reset(task, description="preflight", total=len(cluster.hosts), completed=len(failed))
        launchers: dict[int, Channel] = {}
        try:
            opened = fan_out(tuple(cluster.hosts[i] for i in transports), lambda h: open_launcher(
                transports[h.index], job_dir(cluster, h), follow))
            launchers = opened.ok
            failed.update(opened.failed)
            return transports, launchers, preflight(cluster, transports, failed, tick)
        except BaseException:
            close_everything(transports, launchers)
            raise


def start(cluster: Cluster, transports: dict[int, Transport], pre: Preflight,
          launchers: dict[int, Channel]) -> tuple[str, dict[int, Started]]:
    """All hosts or none: if one host fails to start (or Ctrl-C comes now), the hosts
    that did start are stopped again before the error is reported."""
    try:
        return launch_all(cluster, transports, pre, launchers)
    except BaseException:
        dirs = {i: info.job_dir for i, info in pre.hosts.items()}
        stop_all(cluster, transports, dirs, 0)
        raise


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), console=console, transient=True)


@dataclass(frozen=True)
class LocalFiles:
    code: list[LocalFile]
    data: dict[int, list[LocalFile]] | None   # per host index; None: no data section


def local_files(cluster: Cluster) -> LocalFiles:
    """What each host must hold, hashed (cached) and checked here, before connecting."""
    split = load_split(cluster) if cluster.data.shards else None
    cache = DigestCache(cluster.state_dir.parent / "digests.json")
    check_entrypoint(cluster.base_dir, cluster.code.paths, cluster.code.exclude,
                     cluster.job.entrypoint, str(cluster.path))
    code = code_files(cluster.base_dir, cluster.code.paths, cluster.code.exclude, cache,
                      str(cluster.path))
    data = {h.index: host_files(cluster, h, split, cache) for h in cluster.hosts} if split else None
    cache.save()
    return LocalFiles(code, data)


def setup_hosts(cluster: Cluster, transports: dict[int, Transport], files: LocalFiles,
                pre: Preflight) -> None:
    """Code to every host, each host its own shards: all hosts in parallel."""
    code, data = files.code, files.data or {}
    # what the ignore rules leave out (a host's __pycache__) is never proposed for deletion
    pushable = Pushable(cluster.base_dir, cluster.code.paths, cluster.code.exclude)
    total = sum(f.size for f in code) * len(cluster.hosts) + sum(
        f.size for files in data.values() for f in files)
    with progress_bar() as bar:
        task = bar.add_task(f"sync 0/{len(cluster.hosts)} hosts", total=total or 1)
        done = []

        def one(h) -> dict[str, SyncReport]:
            t = transports[h.index]
            tick = lambda nbytes, nfiles: bar.advance(task, nbytes)
            out, info = {}, pre.hosts[h.index]
            if cluster.code.paths:
                out["code"] = push(t, f"{info.job_dir}/code", code, tick,
                                   pushable(info.manifests["code"]))
            if files.data is not None:
                out["data"] = push(t, f"{info.job_dir}/data", data[h.index], tick,
                                   info.manifests["data"])
            done.append(h.index)
            bar.update(task, description=f"sync {len(done)}/{len(cluster.hosts)} hosts")
            return out
        result = fan_out(cluster.hosts, one)
    result.raise_failures(cluster.hosts, "to receive code or data")
    report_sync(cluster, result.ok)


def report_sync(cluster: Cluster, reports: dict[int, dict[str, SyncReport]]) -> None:
    """One line per host, and .orch/<name>/last_sync.json with what was sent where."""
    record = {}
    for i, parts in sorted(reports.items()):
        label = cluster.hosts[i].label
        bits = [f"{k} {r.files} files {r.bytes} B sent, {r.deleted} deleted" for k, r in parts.items()]
        if len(cluster.hosts) <= 16 or any(r.files for r in parts.values()):
            console.print(f"sync {label}: " + ("; ".join(bits) or "nothing to push"))
        record[label] = {k: {"files": r.files, "bytes": r.bytes, "deleted": r.deleted,
                             "sent": list(r.sent)} for k, r in parts.items()}
    cluster.state_dir.mkdir(parents=True, exist_ok=True)
    path = cluster.state_dir / "last_sync.json"
    path.write_text(json.dumps(record, indent=1))
    os.chmod(path, 0o600)
