"""`orch pull` over real SSH (the fake sshd cluster): `orch up` pulls rank 0's output/
by itself, a second pull sends nothing, a change is pulled again, --rank of another
host, -o DIR, one session per command, and a pull killed mid-file resumes."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from helpers import (
    Jobs,
    agents_of,
    assert_nothing_left,
    job_dir,
    orch,
    sessions_of,
    wait_until,
    write_job,
)
from sshd_cluster import SshdCluster

WRITER_JOB = """\
import os
out = os.environ["ORCH_OUTPUT_DIR"]
rank = os.environ["RANK"]
os.makedirs(os.path.join(out, "ckpt", "deep"), exist_ok=True)
with open(os.path.join(out, "metrics.csv"), "w") as f:
    f.write("epoch,loss\\n0,1.5\\nrank," + rank + "\\n")
with open(os.path.join(out, "ckpt", "deep", "w-%s.bin" % rank), "wb") as f:
    f.write(bytes(range(256)) * 1000 + rank.encode())
os.symlink("/etc/passwd", os.path.join(out, "escape"))   # never followed, never pulled
print("wrote", rank, flush=True)
"""


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def pull_json(cwd: Path, *args: str) -> dict:
    result = orch(cwd, "pull", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.ssh
def test_up_pulls_then_pull_is_incremental(sshd_cluster: SshdCluster, tmp_path: Path,
                                           jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[:2], "e2e-pull"
    write_job(tmp_path, WRITER_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name)
    jobs.add(inv, hosts, name)
    up = orch(tmp_path, "up", str(inv))
    assert up.returncode == 0, up.stderr
    dest = tmp_path / "outputs" / name
    # metrics.csv came back while the job ran (the curves' fetch): the pull finds it there
    assert "pulled 1 file" in up.stderr and "1 unchanged" in up.stderr, up.stderr
    assert f"outputs/{name}/" in up.stderr, up.stderr
    assert "skipped escape: a symbolic link" in up.stderr, up.stderr
    remote0 = Path(job_dir(hosts[0], name)) / "output"
    assert tree(dest) == tree(remote0) and set(tree(dest)) == {"metrics.csv", "ckpt/deep/w-0.bin"}
    assert not (dest / "escape").exists() and not (dest / "escape").is_symlink()

    # a second pull sends nothing, and takes one session on rank 0's host only
    got: dict = {}
    counts = sessions_of(hosts, lambda: got.update(pull_json(tmp_path)))
    assert counts == {hosts[0].address: 1, hosts[1].address: 0}
    assert (got["files"], got["bytes"], got["unchanged"]) == (0, 0, 2), got

    # a file changed on the host is pulled again, alone
    (remote0 / "metrics.csv").write_text("epoch,loss\n0,1.5\n1,0.7\n")
    got = pull_json(tmp_path)
    assert (got["files"], got["unchanged"]) == (1, 1), got
    assert (dest / "metrics.csv").read_text() == "epoch,loss\n0,1.5\n1,0.7\n"

    # --rank 1 lives on the second host; -o another folder; a PATH below output/
    other = tmp_path / "elsewhere"
    got = pull_json(tmp_path, "--rank", "1", "-o", str(other), "ckpt")
    assert got["host"] == hosts[1].address and got["files"] == 1, got
    assert tree(other) == {"ckpt/deep/w-1.bin": bytes(range(256)) * 1000 + b"1"}
    assert_nothing_left(hosts, name)


@pytest.mark.ssh
def test_pull_killed_mid_file_resumes(sshd_cluster: SshdCluster, tmp_path: Path,
                                      jobs: Jobs) -> None:
    """SIGKILL the controller while a big file is half written: the destination holds
    complete files and a part file only; the next pull sends the rest and sweeps it."""
    host, name = sshd_cluster.hosts[2], "e2e-pull-cut"
    write_job(tmp_path, "print('nothing')\n")
    sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=[host], name=name)
    out = Path(job_dir(host, name)) / "output"
    out.mkdir(parents=True)
    (out / "a-small.txt").write_text("small\n")
    big = os.urandom(1 << 20) * 96          # 96 MiB
    (out / "z-big.bin").write_bytes(big)
    dest = tmp_path / "outputs" / name
    run = jobs.start(tmp_path, "pull")
    def half_written() -> list[Path]:
        found = []
        for p in dest.glob("z-big.bin.orch-part-*"):
            with contextlib.suppress(FileNotFoundError):   # renamed meanwhile
                if p.stat().st_size:
                    found.append(p)
        return found
    part: Any = wait_until(half_written, 60, "the big file to be half written", step=0.005)
    # the host frozen at once: the rest of the 96 MiB cannot come before the kill (no race
    # between seeing the part file and the SIGKILL)
    host.pause()
    try:
        os.kill(run.proc.pid, signal.SIGKILL)
        run.proc.wait(10)
    finally:
        host.resume()
    assert part[0].exists() and 0 < part[0].stat().st_size < len(big), part
    assert not (dest / "z-big.bin").exists(), "a half-written file took its final name"
    assert (dest / "a-small.txt").read_text() == "small\n"
    # the killed pull's agent on the host ends (its connection is gone) before the next
    wait_until(lambda: not agents_of([job_dir(host, name)]), 30, "the killed pull's agent to end")
    got = pull_json(tmp_path)
    assert (got["files"], got["unchanged"]) == (1, 1), got
    pulled = (dest / "z-big.bin").read_bytes()
    assert hashlib.sha256(pulled).digest() == hashlib.sha256(big).digest()
    assert not list(dest.rglob("*.orch-part-*")), "a part file was left"
    (out / "z-big.bin").unlink()


RUN_JOB = """\
import os
with open(os.path.join(os.environ["ORCH_OUTPUT_DIR"], "run.txt"), "w") as f:
    f.write(os.environ["ORCH_RUN_ID"])
"""


@pytest.mark.ssh
def test_a_second_run_does_not_pull_into_the_first_runs_folder(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """Run 1's pulled files are moved to outputs/<name>.<its start>/ before run 2's pull:
    each run's own folder, nothing deleted; `orch pull` of run 2 again pulls in place."""
    hosts, name = sshd_cluster.hosts[:1], "e2e-pull-runs"
    write_job(tmp_path, RUN_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name)
    jobs.add(inv, hosts, name)
    runs = []
    for _ in range(2):
        up = orch(tmp_path, "up", str(inv))
        assert up.returncode == 0, up.stderr
        runs.append(json.loads((tmp_path / ".orch" / name / "state.json").read_text())["run_id"])
    dest = tmp_path / "outputs" / name
    earlier = [p for p in (tmp_path / "outputs").iterdir() if p.name.startswith(f"{name}.")]
    assert len(earlier) == 1, list((tmp_path / "outputs").iterdir())
    assert f"held an earlier run's files: moved to outputs/{earlier[0].name}/" in up.stderr, up.stderr
    assert (earlier[0] / "run.txt").read_text() == runs[0]
    assert (dest / "run.txt").read_text() == runs[1]
    got = pull_json(tmp_path)
    assert got["unchanged"] == 1 and "earlier_run" not in got, got
    assert len(list((tmp_path / "outputs").iterdir())) == 2
    assert_nothing_left(hosts, name)
