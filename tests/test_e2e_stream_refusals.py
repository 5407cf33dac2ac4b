"""The reported case end to end over real SSH: `job.checkpoint_to: host`, and a link
planted in the keeper host's job folder in place of its `checkpoints/`. Every relay
round is refused there (keep_receive), and the host stays what it is: connected and
usable. `orch up` follows the job on (the host is never taken for silent, nothing is
read as `unknown request 'file'`), the refusal is said once with its cause and fix, and
`orch stop` stops everything on both hosts."""
from __future__ import annotations

import os
import time
from pathlib import Path

from helpers import Jobs, assert_nothing_left, orch, write_job
from sshd_cluster import SshdCluster

# rank 0 saves a checkpoint (beside, then renamed) three times a second, for minutes
JOB = """\
import os, time
rank = int(os.environ["RANK"])
ck = os.path.join(os.environ["ORCH_OUTPUT_DIR"], "checkpoints")
os.makedirs(ck, exist_ok=True)
for epoch in range(1000):
    time.sleep(0.3)
    if rank == 0:
        tmp = os.path.join(ck, ".epoch.pt.tmp")
        with open(tmp, "wb") as f:
            f.write(b"epoch %d " % epoch * 1000)
        os.replace(tmp, os.path.join(ck, "epoch-%d.pt" % epoch))
    print("rank %d saved %d" % (rank, epoch), flush=True)
"""


def test_a_link_planted_on_the_keeper_host_costs_no_host_and_stop_stops_everything(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    name = "keep-refused"
    hosts = sshd_cluster.hosts[:2]
    write_job(tmp_path, JOB)
    entries = [{"address": h.address, "procs": 1, "remote_dir": str(h.remote_dir)}
               for h in hosts]
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=[], extra_hosts=entries, name=name,
        top={"job": {"entrypoint": "job.py", "restarts": 1, "checkpoint_to": "host"}})
    keeper_job = hosts[1].remote_dir / name
    keeper_job.mkdir(parents=True, exist_ok=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, keeper_job / "checkpoints")
    jobs.add(inv, hosts, name)
    try:
        run = jobs.start(tmp_path, "up", str(inv), "--no-pull")
        # 4 s: a few relay rounds refused (the time allowed is for a loaded machine)
        run.wait_for(r"rank 0 saved 12\b", timeout=300)
        time.sleep(2)
        text = run.text()
        assert run.proc.poll() is None, text
        assert f"checkpoints kept on {hosts[1].address}" in text, text
        assert "went silent" not in text and "unknown request" not in text, text
        # the real cause, said once, with its fix
        warned = [line for line in run.err if "checkpoints are not being kept" in line]
        assert len(warned) == 1 and "keep_receive failed" in warned[0], text
        assert f"{keeper_job}/checkpoints is a symbolic link" in warned[0], text
        assert "fix: remove it" in warned[0], text
        stop = orch(tmp_path, "stop", str(inv), "--grace", "2")
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert "NOT stopped" not in stop.stdout + stop.stderr
        run.finish(120)
        text = run.text()
        assert "went silent" not in text and "NOT stopped" not in text, text
        assert_nothing_left(hosts, name, wait=10)
        assert list(elsewhere.iterdir()) == []   # never written through
    finally:
        os.unlink(keeper_job / "checkpoints")
