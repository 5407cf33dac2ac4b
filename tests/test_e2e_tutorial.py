"""docs/tutorial.md, run as written against two of the test suite's sshd hosts: its
train.py and its cluster.yaml are read out of the page (only the addresses, the login and
the key files are swapped for the fake hosts'), then its commands: exec, up --dry-run,
up (the sum of ranks, the pulled result.txt), up --detach with 600 steps, status, logs,
the refused second up, stop, pull. A page that drifts from what orch does fails here."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from helpers import Jobs, assert_nothing_left, orch, wait_until
from sshd_cluster import SshdCluster

PAGE = Path(__file__).resolve().parent.parent / "docs" / "tutorial.md"
ADDRESSES = ("10.0.0.8", "10.0.0.9")


def blocks(kind: str) -> list[str]:
    """The page's fenced code blocks of one language, in order."""
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), flags=re.S)


def tutorial_inventory(cluster: SshdCluster, folder: Path, args: list[str]) -> Path:
    """Step 5's cluster.yaml on the fake hosts: the page's keys and values, with the
    addresses, login, key files and each host's remote_dir of the test cluster."""
    doc = yaml.safe_load(next(b for b in blocks("yaml") if "hosts:" in b))
    assert [h["address"] for h in doc["hosts"]] == list(ADDRESSES)
    hosts = cluster.hosts[:2]
    doc["ssh"].update(user="root", identity_file=str(cluster.client_key),
                      known_hosts=str(cluster.known_hosts), port=cluster.port)
    for entry, host in zip(doc["hosts"], hosts):
        entry.update(address=host.address, remote_dir=str(host.remote_dir))
    doc["python"] = sys.executable      # the page's python3 is the hosts' python with torch
    if args:
        doc["job"]["args"] = args
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.ssh
@pytest.mark.slow
def test_the_tutorial_runs_as_written(sshd_cluster: SshdCluster, tmp_path: Path,
                                      jobs: Jobs) -> None:
    program = next(b for b in blocks("python") if "dist.all_reduce" in b)
    (tmp_path / "train.py").write_text(program)
    inv = tutorial_inventory(sshd_cluster, tmp_path, [])
    hosts, name = sshd_cluster.hosts[:2], "hello"
    jobs.add(inv, hosts, name)

    check = orch(tmp_path, "exec", "--", sys.executable, "-c", "import torch; print(torch.__version__)")
    assert check.returncode == 0, check.stderr
    dry = orch(tmp_path, "up", "--dry-run")
    assert dry.returncode == 0 and "world size 4" in dry.stdout + dry.stderr, dry.stderr

    up = orch(tmp_path, "up", timeout=300)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr
    assert len(re.findall(r"step 4: sum of ranks = 6$", up.stdout, flags=re.M)) == 4
    assert (tmp_path / "outputs" / name / "result.txt").read_text() == "world size 4, sum 6\n"

    tutorial_inventory(sshd_cluster, tmp_path, ["600"])   # step 7: a longer run
    detached = orch(tmp_path, "up", "--detach", timeout=300)
    assert detached.returncode == 0 and "detached" in detached.stdout + detached.stderr, detached.stderr
    wait_until(lambda: "step 2:" in orch(tmp_path, "logs", "--rank", "2", "--tail", "3").stdout,
               120, "rank 2's third step")
    status = orch(tmp_path, "status")
    assert status.returncode == 0 and status.stdout.count("running") == 4, status
    assert "running" not in status.stderr, status.stderr   # the table on stdout only
    again = orch(tmp_path, "up")
    assert again.returncode == 2 and "already running" in again.stderr, again.stderr
    stop = orch(tmp_path, "stop")
    assert stop.returncode == 0 and f"job '{name}' stopped on 2 hosts" in stop.stdout + stop.stderr
    assert_nothing_left(hosts, name, wait=10)
    pull = orch(tmp_path, "pull")
    assert pull.returncode == 0, pull.stderr
