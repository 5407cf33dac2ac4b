"""`job.checkpoint_to: host` end to end over real SSH: 3 hosts, each with a job folder of
its own, `job.restarts: 1`. While the job runs, rank 0's checkpoints are relayed through
the controller to the keeper host (the next host in rank order), into its
`<job dir>/checkpoints/`; the controller keeps none. Rank 0's host is killed after a
checkpoint: the run goes on with the two others (`job.min_hosts: 2`), rank 0 now on the
old keeper host, and every rank resumes from the copy that host kept."""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import Jobs, assert_nothing_left, wait_until, write_job
from sshd_cluster import SshdCluster, own_cluster
from test_e2e_restarts import kill_host

pytestmark = pytest.mark.ssh

FIRST_OCTET = 90
EPOCHS = 200
# rank 0 saves epoch-N.pt each epoch (beside, then renamed) and keeps the four newest
# (the keeper leaves out a file younger than a second: at two saves a second, the older
# two are kept); every rank starts from the newest epoch-*.pt its job folder holds; a
# restart runs fast (no save of it settles), then rank 0 waits 3 s so that its last four
# are relayed (rounds every 0.5 s leave out what is younger than 1 s)
JOB = """\
import glob, os, time
rank = int(os.environ["RANK"])
ck = os.path.join(os.environ["ORCH_OUTPUT_DIR"], "checkpoints")
os.makedirs(ck, exist_ok=True)
have = sorted(int(p.rsplit("-", 1)[1][:-3]) for p in glob.glob(os.path.join(ck, "epoch-*.pt")))
start = have[-1] + 1 if have else 0
print("rank %d resumed from %d" % (rank, start - 1), flush=True)
pause = 0.5 if os.environ["ORCH_RESTART_COUNT"] == "0" else 0.01
for epoch in range(start, EPOCHS):
    time.sleep(pause)
    if rank == 0:
        tmp = os.path.join(ck, ".epoch-%d.pt.tmp" % epoch)
        with open(tmp, "wb") as f:
            f.write(b"epoch %d " % epoch * 1000)
        os.replace(tmp, os.path.join(ck, "epoch-%d.pt" % epoch))
        for old in sorted(glob.glob(os.path.join(ck, "epoch-*.pt")),
                          key=lambda p: int(p.rsplit("-", 1)[1][:-3]))[:-4]:
            os.unlink(old)
if rank == 0:   # the newest set outlives the keeper's settle before the job ends
    time.sleep(3)
print("rank %d done" % rank, flush=True)
""".replace("EPOCHS", str(EPOCHS))


def epochs(folder: Path) -> list[int]:
    return sorted(int(p.name[6:-3]) for p in folder.glob("epoch-*.pt")) if folder.is_dir() else []


@pytest.fixture(scope="module")
def cluster3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """3 sshd hosts of this module's own: the test kills one."""
    with own_cluster(tmp_path_factory.mktemp("sshd3"), 3, FIRST_OCTET) as cluster:
        yield cluster


def test_the_copy_on_the_keeper_host_outlives_rank_0s_host_and_the_run_resumes_from_it(
        cluster3: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    name = "keephost"
    write_job(tmp_path, JOB)
    entries = [{"address": h.address, "procs": 1, "remote_dir": str(h.remote_dir)}
               for h in cluster3.hosts]
    inv = cluster3.write_inventory(
        tmp_path / "cluster.yaml", hosts=[], extra_hosts=entries, name=name,
        top={"job": {"entrypoint": "job.py", "restarts": 1, "min_hosts": 2,
                     "checkpoint_to": "host"}})
    jobs.add(inv, cluster3.hosts, name)
    run = jobs.start(tmp_path, "up", str(inv), "--no-pull")
    h0, h1, h2 = (h.address for h in cluster3.hosts)
    copy = cluster3.hosts[1].remote_dir / name / "checkpoints" / "output" / "checkpoints"
    wait_until(lambda: bool(epochs(copy)) and epochs(copy)[-1] >= 5, 120,
               f"rank 0's checkpoints relayed to the keeper host\n{run.text()}")
    at_kill = epochs(copy)[-1]
    state = tmp_path / ".orch" / name
    assert not epochs(state / "checkpoints" / "output" / "checkpoints")
    assert not (cluster3.hosts[2].remote_dir / name / "checkpoints").exists()
    assert not epochs(cluster3.hosts[1].remote_dir / name / "output" / "checkpoints")
    assert "done" not in run.text(), run.text()
    kill_host(cluster3, 0, name)       # rank 0's host, with the job's own checkpoints, is gone
    code = run.finish(180)
    text = run.text()
    assert code == 0, text
    assert f"checkpoints kept on {h1} (checkpoint_to: host), off rank 0's host {h0}" in text
    assert f"hosts: {h1}, {h2}" in text
    put = re.search(rf"checkpoint put back on (.*) from the copy on {re.escape(h1)}: "
                    r"output/checkpoints/epoch-(\d+)\.pt", text)
    assert put and set(put.group(1).split(", ")) == {h1, h2}, text
    assert f"checkpoints kept on {h2} (checkpoint_to: host), off rank 0's host {h1}" in text
    resumed = sorted(re.findall(r"rank ([01]) resumed from (\d+)", text))   # the restart's
    assert [r for r, _ in resumed] == ["0", "1"], text
    assert resumed[0][1] == resumed[1][1] and int(resumed[0][1]) >= at_kill, text
    assert text.count("rank 0 done") == 1 and text.count("rank 1 done") == 1, text
    # the controller kept nothing, and the staging copy is gone
    assert not list((state / "checkpoints").rglob("*.pt")) and not (state / "checkpoint-relay").exists()
    # the second attempt's keeper host holds rank 0's newest set (up to the last second)
    last = cluster3.hosts[2].remote_dir / name / "checkpoints" / "output" / "checkpoints"
    assert epochs(last) and epochs(last)[0] >= EPOCHS - 4, (epochs(last), text)
    assert_nothing_left(cluster3.hosts[1:], name)
