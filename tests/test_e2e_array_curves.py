"""Live curves of an attached job array over real SSH (#35): while `orch up` follows the
array, each task's metrics file comes back from the host that runs it (the fetch a
single job has, watch/curvefetch.py), into the copies `orch results` reads; the rows
written last come with the end."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import Jobs, assert_nothing_left, wait_until, write_job
from orchestrator.config.inventory import load
from orchestrator.watch import curves
from sshd_cluster import SshdCluster

pytestmark = pytest.mark.ssh

# each task writes its first row, waits for the test's `go`, then writes its second
TASK = """\
import os, time
out, task = os.environ["ORCH_OUTPUT_DIR"], int(os.environ["ORCH_TASK"])
os.makedirs(out, exist_ok=True)
def row(epoch):
    path = os.path.join(out, "metrics.csv")
    new = not os.path.exists(path)
    with open(path, "a") as f:
        f.write(("epoch,val_acc\\n" if new else "") + "%d,%g\\n" % (epoch, task + epoch / 10))
row(1)
print("epoch 1 written", flush=True)
while not os.path.exists(os.environ["GO"]):
    time.sleep(0.05)
row(2)
print("epoch 2 written", flush=True)
"""


def values(cluster_path: Path, task: int) -> list[float]:
    found = {s.name: s for s in curves.read_curves(load(cluster_path), task=task)}
    return [p.value for p in found["val_acc"].points] if "val_acc" in found else []


def test_an_attached_arrays_task_curves_arrive_while_it_runs(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[:2], "e2e-array-curves"
    write_job(tmp_path, TASK, "task.py")
    go = tmp_path / "go"
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=hosts, procs=[1, 1], name=name, entrypoint="task.py",
        code_paths=["task.py"], env={"GO": str(go)},
        top={"job": {"array": {"matrix": {"fold": [0, 1]}}}})
    jobs.add(inv, hosts, name)
    up = jobs.start(tmp_path, "up", str(inv))
    up.wait_for(r"epoch 1 written", count=2, timeout=120)
    # both tasks' first rows, each from its own host, while both still wait for `go`
    wait_until(lambda: values(inv, 0) == [0.1] and values(inv, 1) == [1.1], 60,
               "each task's first row fetched while the array runs")
    assert up.proc.poll() is None, up.text()
    go.write_text("")
    assert up.finish(120) == 0, up.text()
    assert values(inv, 0) == [0.1, 0.2] and values(inv, 1) == [1.1, 1.2]   # the last rows too
    assert "Traceback" not in up.text()
    assert_nothing_left(hosts, name, wait=10)
    # a second run: the first run's files go aside before any of the new run's arrive
    first = sorted(p.relative_to(tmp_path / "outputs" / name).as_posix()
                   for p in (tmp_path / "outputs" / name).rglob("*") if p.is_file())
    assert first, "the first run's task files are in outputs/<name>/"
    again = jobs.start(tmp_path, "up", str(inv))
    assert again.finish(120) == 0, again.text()
    aside = [p for p in (tmp_path / "outputs").iterdir() if p.name.startswith(name + ".")]
    assert len(aside) == 1, sorted(p.name for p in (tmp_path / "outputs").iterdir())
    assert f"outputs/{name}/ held an earlier run's files: moved to outputs/{aside[0].name}/" \
        in again.text(), again.text()
    assert sorted(p.relative_to(aside[0]).as_posix() for p in aside[0].rglob("*")
                  if p.is_file()) == first
    assert_nothing_left(hosts, name, wait=10)
