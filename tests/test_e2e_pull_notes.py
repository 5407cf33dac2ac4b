"""`orch pull`'s answers on the tutorial's own job (rank 0 writes result.txt), over real
SSH: a PATH the asked host lacks names the host that has it, an empty output/ says
where to look and makes no folder, and a file an earlier run wrote is named as such."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import Jobs, orch, wait_until, write_job
from sshd_cluster import SshdCluster

JOB = """\
import os, time
rank = os.environ["RANK"]
print("rank", rank, flush=True)
if rank == "0" and not os.environ.get("NOWRITE"):
    with open(os.path.join(os.environ["ORCH_OUTPUT_DIR"], "result.txt"), "w") as f:
        f.write("world size 4\\n")
if os.environ.get("LONG"):
    time.sleep(600)
"""


@pytest.mark.ssh
def test_pull_says_what_a_user_can_act_on(sshd_cluster: SshdCluster, tmp_path: Path,
                                          jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[:2], "e2e-pullnotes"
    h0, h1 = (h.address for h in hosts)
    write_job(tmp_path, JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, procs=2, name=name)
    jobs.add(inv, hosts, name)
    up = orch(tmp_path, "up", timeout=300)
    assert up.returncode == 0 and "pulled 1 file" in up.stderr, up.stderr
    assert "before this run started" not in up.stderr, up.stderr   # this run's file

    # the other forms, on this job
    other = orch(tmp_path, "pull", "--rank", "2", "result.txt")
    assert other.returncode == 2, other.stderr
    assert (f"orch: result.txt is not in output/ on {h1} (rank 2's host); {h0} (rank 0's "
            "host) has it\n  fix: pull it from there: `orch pull --rank 0 result.txt`") \
        in other.stderr, other.stderr
    assert "pull_manifest" not in other.stderr
    nowhere = orch(tmp_path, "pull", "nosuch.txt")
    assert nowhere.returncode == 2 and "nosuch.txt is not in output/ on " in nowhere.stderr
    assert "nor on the other host" in nowhere.stderr, nowhere.stderr
    elsewhere = tmp_path / "h2"
    empty = orch(tmp_path, "pull", "--host", h1, "-o", str(elsewhere))
    assert empty.returncode == 0, empty.stderr
    assert "nothing to pull" in empty.stderr and "only rank 0 writes" in empty.stderr
    assert "`orch pull` pulls from " + h0 in empty.stderr, empty.stderr
    assert not elsewhere.exists()

    # a detached run stopped before it wrote anything: the last run's file is named (on
    # rank 0's host, the one this run needs: a second host's torchrun proved nothing more)
    sshd_cluster.write_inventory(inv, hosts=hosts[:1], procs=2, name=name,
                                 env={"LONG": "1", "NOWRITE": "1"})
    assert orch(tmp_path, "up", "--detach", timeout=300).returncode == 0
    wait_until(lambda: orch(tmp_path, "status").stdout.count("running") == 2, 60, "running")
    assert orch(tmp_path, "stop", "--grace", "1").returncode == 0
    pulled = orch(tmp_path, "pull")
    assert pulled.returncode == 0, pulled.stderr
    assert "warning: result.txt was written at " in pulled.stderr, pulled.stderr
    assert f"before this run started on {h0}" in pulled.stderr, pulled.stderr
    assert "an earlier run's file" in pulled.stderr
    one = orch(tmp_path, "pull", "--rank", "0", "result.txt")
    assert one.returncode == 0 and "result.txt was written at " in one.stderr, one.stderr
