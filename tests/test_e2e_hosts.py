"""`orch up --exclude` over real SSH (issue 21, item 4): a 3-host inventory runs on 2
hosts, the world size follows, the data made by `orch split-data` for 3 workers is split
again for 2 and each host gets its own shard, and `orch status` / `orch stop` act on the
run's 2 hosts only (the third host sees no SSH session); an `up --hosts` of the third
host is refused while the run goes on (it would have started the job twice)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import Jobs, assert_nothing_left, job_dir, orch, sessions_of, wait_until, write_job
from sshd_cluster import SshdCluster

pytestmark = pytest.mark.ssh

JOB = """\
import os, time
data = os.environ["ORCH_DATA_DIR"]
mine = "worker_%s_of_%s" % (os.environ["RANK"], os.environ["WORLD_SIZE"])
print("rank %s of %s reads %s: %s" % (os.environ["RANK"], os.environ["WORLD_SIZE"], mine,
      ",".join(sorted(os.listdir(os.path.join(data, mine))))), flush=True)
time.sleep(120)
"""


def test_up_exclude_runs_on_the_other_hosts_with_the_data_split_again(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    a, b, c = sshd_cluster.hosts[:3]
    name = "sel"
    write_job(tmp_path, JOB)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"train-{i:05d}-of-00006").write_bytes(b"r" * (i + 1))
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=[a, b, c], name=name,
                                       top={"data": {"source": "src", "shards": "shards"}})
    jobs.add(inv, [a, b, c], name)
    split = orch(tmp_path, "split-data", "-c", str(inv))
    assert split.returncode == 0, split.stderr + split.stdout

    up = orch(tmp_path, "up", str(inv), "--detach", "--exclude", c.address, timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    assert (f"data: split {src} again for world size 2 (--exclude {c.address}) -> "
            f"{tmp_path / 'shards'}/worker_*_of_2") in up.stderr
    assert f"preflight: 2 hosts ok, world size 2 (--exclude {c.address})" in up.stderr
    assert "started job 'sel' on 2 hosts (2 ranks" in up.stderr
    assert sorted(json.loads((tmp_path / "shards" / "manifest.json").read_text())["splits"]) \
        == ["2", "3"]
    assert not job_dir(c, name).exists()   # host 2 was never touched
    for rank, host, files in ((0, a, "train-00000-of-00006,train-00001-of-00006,"
                                     "train-00002-of-00006"),
                              (1, b, "train-00003-of-00006,train-00004-of-00006,"
                                     "train-00005-of-00006")):
        assert sorted(p.name for p in (job_dir(host, name) / "data").iterdir()) \
            == [f"worker_{rank}_of_2"]
        log = job_dir(host, name) / "logs" / f"rank-{rank}.log"
        wait_until(lambda: log.exists() and "reads" in log.read_text(), 60,  # noqa: B023
                   f"rank {rank}'s first line")
        assert f"rank {rank} of 2 reads worker_{rank}_of_2: {files}" in log.read_text()

    got: dict = {}

    def status() -> None:
        res = orch(tmp_path, "status", "-c", str(inv), "--json")
        assert res.returncode == 0, res.stderr
        got.update(json.loads(res.stdout))
    assert sessions_of([c], status) == {c.address: 0}
    assert [(r["rank"], r["host"], r["state"]) for r in got["ranks"]] == [
        (0, a.address, "running"), (1, b.address, "running")]

    # a run on the host left out, while this run goes on: refused, and nothing touched
    again = orch(tmp_path, "up", str(inv), "--detach", "--hosts", c.address, timeout=120)
    assert again.returncode == 2, again.stdout + again.stderr
    assert (f"job 'sel' is already running on {a.address}, {b.address} (its last run, "
            "which this one leaves out)") in again.stderr
    assert not job_dir(c, name).exists()

    def stop() -> None:
        res = orch(tmp_path, "stop", "-c", str(inv), "--grace", "1")
        assert res.returncode == 0, res.stderr
        assert "job 'sel' stopped on 2 hosts" in res.stderr
    assert sessions_of([c], stop) == {c.address: 0}
    assert_nothing_left([a, b, c], name)
