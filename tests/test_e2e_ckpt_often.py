"""A checkpoint saved more often than the keeper's settle time, over real SSH: a job that
replaces output/ckpt.pt by write-then-rename every 0.2 s had nothing kept (its mtime was
never a second old), so when its master host died the restart began at step 0 without a
word. Now the renamed file is kept as it is replaced, the spare's rank 0 resumes from it,
and a file that is only ever written in place (so never whole) is named on the restart
line as the reason there is nothing to put back."""
from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import Jobs, assert_nothing_left, wait_until, write_job
from sshd_cluster import SshdCluster, own_cluster
from test_e2e_restarts import kill_host

pytestmark = pytest.mark.ssh

FIRST_OCTET = 110
JOB = """\
import os, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["ORCH_RESTART_COUNT"])
out = os.environ["ORCH_OUTPUT_DIR"]
ckpt = os.path.join(out, "ckpt.pt")
step = 0
if os.path.exists(ckpt):
    words = open(ckpt).read().split()
    step = int(words[1]) if len(words) > 1 else 0   # a half-written one (never kept)
print("rank %d attempt %d resumed at step %d" % (rank, attempt, step), flush=True)
print("python of rank %d: %s" % (rank, os.environ.get("ORCH_PYTHON")), flush=True)
if attempt > 0:
    sys.exit(0)
if sys.argv[1] == "rename" and rank == 0:
    while True:                                   # write beside, then rename: whole
        step += 1
        tmp = ckpt + ".tmp"
        with open(tmp, "w") as f:
            f.write("step %d " % step + "x" * 20000)
        os.replace(tmp, ckpt)
        print("saved step %d" % step, flush=True)
        time.sleep(0.2)
if sys.argv[1] == "inplace" and rank == 0:
    with open(ckpt, "w") as f:                    # in place, never closed: never whole
        while True:
            f.write("x")
            f.flush()
            time.sleep(0.05)
if sys.argv[1] == "inplace" and rank == 1:
    time.sleep(3)
    sys.exit(3)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def cluster2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """2 sshd hosts of this module's own, rank 0's and a spare: the test kills rank 0's."""
    with own_cluster(tmp_path_factory.mktemp("sshd2"), 2, FIRST_OCTET) as cluster:
        yield cluster


def inventory(cluster: SshdCluster, tmp: Path, name: str, mode: str) -> Path:
    """Rank 0's host and a spare: the claim is about rank 0's checkpoint outliving its
    host, which a second host of ranks (another torchrun, twice) would not change."""
    write_job(tmp, JOB)
    entries = [{"address": h.address, "procs": 1, "remote_dir": str(h.remote_dir)}
               for h in cluster.hosts[:1]]
    spare = cluster.hosts[1]
    entries.append({"address": spare.address, "procs": 1, "remote_dir": str(spare.remote_dir),
                    "spare": True})
    return cluster.write_inventory(tmp / f"{name}.yaml", hosts=[], extra_hosts=entries,
                                   name=name, top={"job": {
                                       "entrypoint": "job.py", "args": [mode], "restarts": 1,
                                       "checkpoint": ["output/ckpt.pt"]}})


def test_a_checkpoint_renamed_every_fifth_of_a_second_outlives_its_host(
        cluster2: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    inv = inventory(cluster2, tmp_path, "often", "rename")
    jobs.add(inv, cluster2.hosts, "often")
    run = jobs.start(tmp_path, "up", str(inv), "--no-pull")
    run.wait_for(r"saved step 12\b", timeout=120)
    kept = tmp_path / ".orch" / "often" / "checkpoints" / "output" / "ckpt.pt"
    # waited for while rank 0 saves on (read once after 12 saves, it was not there yet at
    # a load of 20): before the fix nothing was kept however long the job ran
    try:
        wait_until(kept.exists, 120, "rank 0's checkpoint kept while it is replaced every 0.2 s")
    except AssertionError as e:
        raise AssertionError(f"{e}\n{run.text()}") from None
    kill_host(cluster2, 0, "often")
    code = run.finish(180)
    text = run.text()
    assert code == 0, text
    assert "no checkpoint to put back" not in text, text
    assert re.search(r"checkpoint put back on .*output/ckpt\.pt", text), text
    resumed = [int(m) for m in re.findall(r"rank 0 attempt 1 resumed at step (\d+)", text)]
    # before: nothing was ever kept and the restart began at step 0
    assert resumed and resumed[0] > 0, text
    assert_nothing_left([cluster2.hosts[1]], "often")


def test_a_checkpoint_never_whole_is_named_on_the_restart_line(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    # one host of two ranks: rank 1's failure restarts the job, rank 0's checkpoint is
    # named on that host (a second host's torchrun, twice, would prove nothing more)
    hosts = sshd_cluster.hosts[:1]
    write_job(tmp_path, JOB)
    inv = sshd_cluster.write_inventory(
        tmp_path / "inplace.yaml", hosts=hosts, procs=2, name="inplace",
        top={"job": {"entrypoint": "job.py", "args": ["inplace"], "restarts": 1,
                     "checkpoint": ["output/ckpt.pt"]}})
    jobs.add(inv, hosts, "inplace")
    run = jobs.start(tmp_path, "up", str(inv), "--no-pull")
    code = run.finish(120)
    text = run.text()
    assert code == 0, text
    assert re.search(r"restart 1 of 1 in \d+ s after: rank 1 on \S+ failed .*; no checkpoint to "
                     r"put back: output/ckpt\.pt never stayed unchanged for 1 s on "
                     + re.escape(hosts[0].address), text), text
    assert "rank 0 attempt 1 resumed at step 0" in text, text
    # every rank gets ORCH_PYTHON: the inventory's python (the suite's venv) as run there
    pythons = set(re.findall(r"python of rank \d: (\S+)", text))
    assert pythons and all(os.path.samefile(p, sys.executable) for p in pythons), pythons
    assert_nothing_left(hosts, "inplace")
