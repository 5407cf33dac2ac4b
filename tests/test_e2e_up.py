"""`orch up` over real SSH (the fake sshd cluster): placement, environment, secrets,
output, incremental sync, preflight, host keys, --dry-run, broken inventories.

The helpers (running orch as a subprocess, proving that nothing of a job is left) are in
helpers.py. Jobs are plain Python except the one test
that is about collectives: every rank that imports torch costs seconds of CPU here.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from helpers import (
    Jobs,
    assert_nothing_left,
    job_dir,
    marker,
    orch,
    orch_in_process,
    prefixed,
    sessions_of,
    write_job,
)
from sshd_cluster import FakeHost, SshdCluster, ssh_cmd

CORPUS = Path(__file__).parent / "inventories"


# ---------------------------------------------------------------- the whole path

ALLREDUCE_JOB = """\
import hashlib, json, os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "ORCH_JOB", "ORCH_JOB_DIR", "ORCH_DATA_DIR", "ORCH_OUTPUT_DIR")
info = {k: os.environ.get(k) for k in keys}
info.update(cwd=os.getcwd(), allreduce=total.item(),
            secret_sha=hashlib.sha256(os.environ.get("SECRET", "").encode()).hexdigest())
print("INFO " + json.dumps(info), flush=True)
for i in range(200):
    print("line %d %03d" % (rank, i))
print("to stderr %d" % rank, file=sys.stderr, flush=True)
sys.stdout.flush()
time.sleep(3)  # the test scans every command line while the ranks are alive
dist.destroy_process_group()
"""


def scan_cmdlines(needle: bytes, markers: Sequence[bytes]) -> tuple[list[int], int]:
    """Pids whose command line holds `needle`, and how many live processes carry one of
    `markers` in their environment (proves the scan saw the job running)."""
    hits, alive = [], 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if needle in f.read():
                    hits.append(int(name))
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        alive += any(m in env for m in markers)
    return hits, alive


@pytest.mark.ssh
def test_allreduce_two_hosts_two_procs(sshd_cluster: SshdCluster, tmp_path: Path,
                                       jobs: Jobs) -> None:
    """Two hosts of two ranks: the master's host and another, local ranks 0 and 1 on
    each, a collective across hosts (each rank imports torch: a third host was 3 more
    torch starts and proved nothing two do not)."""
    hosts, name = sshd_cluster.hosts[:2], "e2e-allreduce"
    secret = "S3CR3T-" + secrets.token_hex(16)
    write_job(tmp_path, ALLREDUCE_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, procs=2,
                                       name=name, env={"SECRET": secret})
    jobs.add(inv, hosts, name)
    run = jobs.start(tmp_path, "up", str(inv))
    markers = [marker(h, name).encode() for h in hosts]
    scans_while_sleeping, leaks = 0, set()
    while run.proc.poll() is None:
        # every rank has printed its last line and sleeps: the whole job is up
        done = sum(1 for line in list(run.out) if re.search(r"\] line \d 199$", line))
        hits, alive = scan_cmdlines(secret.encode(), markers)
        leaks.update(hits)
        scans_while_sleeping += alive >= 4 and done == 4
        time.sleep(0.2)
    code = run.finish()
    assert code == 0, run.text()
    assert not leaks, f"the secret is on the command line of pids {sorted(leaks)}"
    assert scans_while_sleeping >= 1, "the scan never saw the ranks running"
    assert secret not in "\n".join(run.out + run.err)
    check_allreduce_output(run.out, hosts, name, secret)
    assert_nothing_left(hosts, name)


def check_allreduce_output(out: list[str], hosts: Sequence[FakeHost], name: str,
                           secret: str) -> None:
    by_rank: dict[int, list[str]] = {r: [] for r in range(4)}
    for rank, label, text in prefixed(out):
        host = hosts[rank // 2]   # ranks 0,1 on host 0, 2,3 on host 1
        assert label == host.address, f"rank {rank} printed as {label}"
        by_rank[rank].append(text)
    for rank, texts in by_rank.items():
        info = json.loads(next(t for t in texts if t.startswith("INFO "))[5:])
        host, local = hosts[rank // 2], rank % 2
        jd = str(job_dir(host, name))
        assert info == {
            "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2),
            "MASTER_ADDR": hosts[0].address, "MASTER_PORT": info["MASTER_PORT"],
            "ORCH_JOB": name, "ORCH_JOB_DIR": jd, "ORCH_DATA_DIR": jd + "/data",
            "ORCH_OUTPUT_DIR": jd + "/output", "cwd": jd + "/code", "allreduce": 10.0,
            "secret_sha": hashlib.sha256(secret.encode()).hexdigest()}, info
        numbered = [t for t in texts if t.startswith("line ")]
        assert numbered == [f"line {rank} {i:03d}" for i in range(200)], \
            f"rank {rank}: {len(numbered)} numbered lines, not 200 in order once each"
        assert f"to stderr {rank}" in texts
    ports = {json.loads(t[5:])["MASTER_PORT"] for r in by_rank.values() for t in r
             if t.startswith("INFO ")}
    assert len(ports) == 1 and ports.pop().isdigit()


# ---------------------------------------------------------------- incremental sync

QUICK_JOB = "import os\nprint('rank', os.environ['RANK'], 'ok', flush=True)\n"


def make_code_tree(base: Path) -> None:
    files = {
        "pkg/main.py": QUICK_JOB, "pkg/a.py": "A = 1\n", "pkg/b.py": "B = 1\n",
        "pkg/notes.txt": "notes\n", "pkg/sub/c.py": "C = 1\n", "pkg/sub/d.txt": "d\n",
        "pkg/__pycache__/a.cpython-311.pyc": "x", "pkg/sub/e.pyc": "x",  # code.exclude
        "pkg/run.log": "log\n", "pkg/scratch/big.bin": "0" * 4096,   # .gitignore
    }
    for rel, text in files.items():
        write_job(base, text, rel)
    (base / ".gitignore").write_text("*.log\nscratch/\n")


def remote_files(host: FakeHost, name: str) -> set[str]:
    root = Path(job_dir(host, name)) / "code"
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and not p.name.startswith(".orch")}


def up_counting_sessions(hosts: Sequence[FakeHost], cwd: Path,
                         inv: Path) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    """`orch up` and the SSH sessions it opened on each host."""
    done: list[subprocess.CompletedProcess] = []
    sessions = sessions_of(hosts, lambda: done.append(orch(cwd, "up", str(inv))))
    return done[0], sessions


@pytest.mark.ssh
def test_second_up_sends_only_changed_files(sshd_cluster: SshdCluster, tmp_path: Path,
                                            jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[1:2], "e2e-sync"   # one host: the push is per host
    make_code_tree(tmp_path)
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=hosts, name=name, entrypoint="pkg/main.py",
        code_paths=["pkg"], top={"code": {"paths": ["pkg"], "exclude": ["*.pyc", "__pycache__"]}})
    jobs.add(inv, hosts, name)
    kept = {"pkg/main.py", "pkg/a.py", "pkg/b.py", "pkg/notes.txt", "pkg/sub/c.py", "pkg/sub/d.txt"}
    first, sessions = up_counting_sessions(hosts, tmp_path, inv)
    assert first.returncode == 0, first.stderr
    assert sessions == {hosts[0].address: 1}, "a first up: one SSH session on its host"
    report = json.loads((tmp_path / ".orch" / name / "last_sync.json").read_text())
    assert set(report) == {h.address for h in hosts}
    for h in hosts:
        assert sorted(report[h.address]["code"]["sent"]) == sorted(kept)
        assert remote_files(h, name) == kept, "code.exclude or .gitignore not honoured"

    (tmp_path / "pkg/b.py").write_text("B = 2  # changed\n")
    (tmp_path / "pkg/sub/d.txt").unlink()
    second, sessions = up_counting_sessions(hosts, tmp_path, inv)
    assert second.returncode == 0, second.stderr
    # the repeat up of test_one_session_per_host_per_command, with a file to send and one
    # to delete: still one session (preflight, sync, launch, follow)
    assert sessions == {hosts[0].address: 1}, "a repeat up: one SSH session on its host"
    report = json.loads((tmp_path / ".orch" / name / "last_sync.json").read_text())
    for h in hosts:
        code = report[h.address]["code"]
        assert code["sent"] == ["pkg/b.py"] and code["files"] == 1, code
        assert code["deleted"] == 1, code
        assert remote_files(h, name) == kept - {"pkg/sub/d.txt"}
        remote_b = Path(job_dir(h, name)) / "code/pkg/b.py"
        assert remote_b.read_text() == "B = 2  # changed\n"
    assert_nothing_left(hosts, name)


# ---------------------------------------------------------------- preflight

@pytest.mark.ssh
def test_preflight_names_unreachable_and_untrusted_hosts(
        sshd_cluster: SshdCluster, untrusted_host: FakeHost, tmp_path: Path, jobs: Jobs) -> None:
    healthy, name = sshd_cluster.hosts[0], "e2e-preflight"
    address, port = sshd_cluster.unreachable()
    write_job(tmp_path, QUICK_JOB)
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=[healthy], name=name, extra_hosts=[
            {"address": address, "port": port, "remote_dir": str(tmp_path / "r1")},
            {"address": untrusted_host.address, "remote_dir": str(untrusted_host.remote_dir)}])
    jobs.add(inv, [healthy, untrusted_host], name)
    result = orch(tmp_path, "up", str(inv))
    assert result.returncode == 3, result.stderr
    assert address in result.stderr
    untrusted_lines = [l for l in result.stderr.splitlines() if untrusted_host.address in l]
    assert any("SHA256:" in l for l in untrusted_lines), result.stderr
    assert "Traceback" not in result.stderr
    fixes = [l.strip() for l in result.stderr.splitlines() if l.strip().startswith("fix:")]
    assert len(fixes) == len(set(fixes)) == 2, f"each host's fix once:\n{result.stderr}"
    for host in (healthy, untrusted_host):
        jd = Path(job_dir(host, name))
        assert not (jd / "run").exists() and not (jd / "logs").exists()
        assert not (jd / "code").exists()
    assert not (tmp_path / ".orch" / name / "state.json").exists()
    assert_nothing_left([healthy, untrusted_host], name)


@pytest.mark.ssh
def test_torch_or_python_missing(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    no_torch = shutil.which("python3", path="/usr/bin")
    if no_torch is None or subprocess.run([no_torch, "-c", "import torch"],
                                          capture_output=True).returncode == 0:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")],
                       check=True)
        no_torch = str(tmp_path / "venv/bin/python")
    hosts, name = sshd_cluster.hosts[:3], "e2e-notorch"
    write_job(tmp_path, QUICK_JOB)
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=hosts[:1], name=name, extra_hosts=[
            {"address": h.address, "procs": 1, "python": python, "remote_dir": str(h.remote_dir)}
            for h, python in ((hosts[1], no_torch), (hosts[2], "/nonexistent/bin/python3"))])
    jobs.add(inv, hosts, name)
    result = orch(tmp_path, "up", str(inv))
    assert result.returncode == 3, result.stderr
    lines = result.stderr.splitlines()
    assert any(hosts[1].address in l and "torch" in l for l in lines), result.stderr
    assert any(hosts[2].address in l and "/nonexistent/bin/python3" in l and "not found" in l
               for l in lines), result.stderr
    assert "2 of 3 hosts failed" in result.stderr and "Traceback" not in result.stderr
    for h in hosts:
        assert not (Path(job_dir(h, name)) / "run").exists()
    assert_nothing_left(hosts, name)


# ---------------------------------------------------------------- host keys

@pytest.mark.ssh
def test_accept_new_records_key_and_refuses_changed_key(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    host, other, name = sshd_cluster.hosts[3], sshd_cluster.hosts[0], "e2e-acceptnew"
    known = tmp_path / "known_hosts"
    lines = sshd_cluster.known_hosts.read_text().splitlines()
    known.write_text("".join(l + "\n" for l in lines if l != host.known_hosts_line()))
    write_job(tmp_path, QUICK_JOB)
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=[host], name=name,
        top={"ssh": {"host_key_policy": "accept-new", "known_hosts": str(known)}})
    jobs.add(inv, [host], name)
    result = orch(tmp_path, "up", str(inv))
    assert result.returncode == 0, result.stderr
    assert f"[r0 {host.address}] rank 0 ok" in result.stdout.splitlines()
    recorded = known.read_text().splitlines()
    assert recorded.count(host.known_hosts_line()) == 1, recorded
    shown = subprocess.run(["ssh-keygen", "-lf", "-"], input=host.host_key_pub, text=True,
                           capture_output=True, check=True).stdout.split()[1]
    added = [line for line in result.stderr.splitlines() if "permanently added" in line]
    assert added == [f"warning: permanently added the host key of [{host.address}]:{host.port} "
                     f"({host.host_key_pub.split()[0]} {shown}) to {known}"], result.stderr

    # The same name now offers another key: refused, whatever the policy.
    wrong = f"[{host.address}]:{host.port} {other.host_key_pub}"
    known.write_text("".join(l + "\n" for l in lines if l != host.known_hosts_line()) + wrong + "\n")
    result = orch(tmp_path, "up", str(inv))
    assert result.returncode == 3, result.stderr
    assert "HOST KEY CHANGED" in result.stderr and host.address in result.stderr
    assert known.read_text().splitlines()[-1] == wrong, "the changed key must not be replaced"
    assert_nothing_left([host], name)


# ---------------------------------------------------------------- --dry-run

@pytest.mark.ssh
def test_dry_run_prints_commands_and_touches_no_host(sshd_cluster: SshdCluster,
                                                     tmp_path: Path) -> None:
    real, name = sshd_cluster.hosts[0], "e2e-dryrun"
    address, port = sshd_cluster.unreachable()
    write_job(tmp_path, QUICK_JOB)
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=[real], procs=2, name=name, args=["--epochs", "3"],
        env={"SECRET": "dry-run-secret-value"},
        extra_hosts=[{"address": address, "port": port, "procs": 3,
                      "remote_dir": str(tmp_path / "r1")}],
        top={"job": {"entrypoint": "job.py", "args": ["--epochs", "3"],
                     "env": {"SECRET": "dry-run-secret-value"}, "master_port": 29555}})
    started = time.monotonic()
    result = orch(tmp_path, "up", str(inv), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 15
    commands = [shlex.split(l) for l in result.stdout.splitlines()
                if "torch.distributed.run" in l]
    assert len(commands) == 2, result.stdout
    for node, (argv, procs) in enumerate(zip(commands, (2, 3))):
        assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
        opts = dict(zip(argv[3:13:2], argv[4:14:2]))
        assert opts == {"--nnodes": "2", "--node-rank": str(node), "--nproc-per-node": str(procs),
                        "--master-addr": real.address, "--master-port": "29555",
                        }, opts
        assert argv[-3:] == ["job.py", "--epochs", "3"]
    assert "dry-run-secret-value" not in result.stdout + result.stderr
    assert not Path(job_dir(real, name)).exists(), "--dry-run created the job dir"
    assert not (tmp_path / ".orch" / name / "state.json").exists()


# ---------------------------------------------------------------- broken inventories

BROKEN = ["yaml_syntax", "unknown_top_key", "port_too_big", "duplicate_top_key", "procs_zero"]


@pytest.mark.parametrize("stem", BROKEN)
def test_broken_inventory_through_cli(stem: str, tmp_path: Path) -> None:
    path = CORPUS / f"{stem}.yaml"
    expect = re.fullmatch(r"# expect: (\d+) (.+)", path.read_text().splitlines()[0])
    assert expect, path
    result = orch_in_process(tmp_path, "up", str(path))
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith(f"orch: {path}:{expect[1]}: "), result.stderr
    assert expect[2].strip() in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("orch:") == 1
    assert not (tmp_path / ".orch").exists() and not (CORPUS / ".orch").exists()


# ---------------------------------------------------------------- one login per host

@pytest.mark.ssh
def test_one_session_per_host_per_command(sshd_cluster: SshdCluster, tmp_path: Path,
                                          jobs: Jobs) -> None:
    """orch up (preflight, sync, launch, follow) = 1 session per host, stop, status, logs
    and exec = 1 each (a repeat up: test_second_up_sends_only_changed_files, whose second
    up is one; up with setup: test_e2e_setupexec.py). Two hosts: each command's one
    session is per host, and `logs --rank 1` touches only rank 1's host (a third host was
    a torchrun more for each up, proving nothing more; a repeat up here, two more)."""
    hosts, name = sshd_cluster.hosts[:2], "e2e-sessions"
    write_job(tmp_path, QUICK_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name)
    jobs.add(inv, hosts, name)
    ones = {h.address: 1 for h in hosts}

    def ok(*args: str):
        def run() -> None:
            result = orch(tmp_path, *args)
            assert result.returncode == 0, result.stderr
        return run
    # the log is readable, and it counts: one command run on one host is one session there
    assert sessions_of(hosts, lambda: subprocess.run(
        [*ssh_cmd(sshd_cluster), hosts[0].address, "true"], check=True, timeout=30)) == {
        h.address: int(i == 0) for i, h in enumerate(hosts)}
    assert sessions_of(hosts, ok("up", str(inv))) == ones
    assert sessions_of(hosts, ok("status", "-c", str(inv))) == ones
    assert sessions_of(hosts, ok("logs", "-c", str(inv))) == ones
    assert sessions_of(hosts, ok("logs", "-c", str(inv), "--rank", "1")) == {
        h.address: int(i == 1) for i, h in enumerate(hosts)}
    assert sessions_of(hosts, ok("exec", "-c", str(inv), "--", "true")) == ones
    assert sessions_of(hosts, ok("stop", str(inv))) == ones
    assert_nothing_left(hosts, name)
