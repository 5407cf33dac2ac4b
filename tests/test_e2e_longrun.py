"""A long attached `orch up` over real SSH: what the controller asks every host again
and again while the job runs (the curves' listing every 2 s, the checkpoint keeper's
every half second on rank 0's host) leaves nothing open on the hosts. One descriptor
left per request ran every host's agent out of a login's 1,024 within minutes, and then
each host's job read as lost."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from helpers import Jobs, assert_nothing_left, job_dir, wait_until, write_job
from sshd_cluster import SshdCluster

# every rank appends a metrics line (the curves' files), rank 0 rewrites a checkpoint
# (the keeper's), every 0.2 s, until the test drops `stop` into output/
JOB = """\
import json, os, time
out = os.environ["ORCH_OUTPUT_DIR"]
os.makedirs(out, exist_ok=True)
step = 0
while not os.path.exists(os.path.join(out, "stop")):
    if os.environ["RANK"] == "0":
        with open(os.path.join(out, "ckpt.tmp"), "wb") as f:
            f.write(b"%d" % step)
        os.replace(os.path.join(out, "ckpt.tmp"), os.path.join(out, "ckpt.pt"))
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "loss": 1.0 / (step + 1)}) + "\\n")
    step += 1
    time.sleep(0.2)
print("done", step, flush=True)
"""


def agents_fds(name: str) -> dict[int, int]:
    """{pid: open descriptors} of this job's agents and supervisors (their argv names the
    job folder and orch-agent)."""
    out = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"orch-agent" in args and f"/{name}".encode() in args:
                out[int(pid)] = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
    return out


@pytest.mark.ssh
def test_a_long_run_leaves_no_descriptor_open_on_its_hosts(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[:2], "e2e-longrun"
    write_job(tmp_path, JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name,
                                       top={"job": {"entrypoint": "job.py", "args": [], "env": {},
                                                    "restarts": 1, "checkpoint_to": "host",
                                                    "checkpoint": ["output/*.pt"]}})
    jobs.add(inv, hosts, name)
    up = jobs.start(tmp_path, "up", str(inv))
    out0 = job_dir(hosts[0], name) / "output"
    # the keeper host (the job's other host) holds the copy, in its job folder
    kept = job_dir(hosts[1], name) / "checkpoints" / "output" / "ckpt.pt"
    wait_until(kept.exists, 90, "the keeper host's first copy of rank 0's checkpoint")
    before = agents_fds(name)
    assert len(before) >= 2, before   # each host's agent (and supervisor)
    time.sleep(12)   # 6 curve rounds on each host, 24 keeper rounds on rank 0's
    after = agents_fds(name)
    grown = {pid: after[pid] - n for pid, n in before.items() if pid in after}
    assert grown and all(d <= 3 for d in grown.values()), (before, after)
    for h in hosts:
        (job_dir(h, name) / "output" / "stop").touch()
    assert up.finish(60) == 0, up.text()
    # a version rank 0 wrote, whole (the last one may be left out: a file written within
    # the keeper's settle time of its last round is not copied half-written)
    assert kept.read_bytes().isdigit() and int(kept.read_bytes()) <= int((out0 / "ckpt.pt").read_bytes())
    assert_nothing_left(hosts, name)
