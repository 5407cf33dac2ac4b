"""What orch does to a host's job folder, end to end over real SSH (the fake sshd cluster).

(a) The job's working folder is code/: what the job writes there (a Lightning
    checkpoint, the DDP tutorial's snapshot.pt, __pycache__ although code.exclude names
    it) survives the next `orch up` byte for byte; a file orch pushed and that is gone
    locally is deleted on the host.
(b) A symbolic link planted in the job folder where orch keeps its own folder or file
    (code, logs, a shard folder, logs/rank-0.log) makes `orch up` stop with exit 3, the
    path and the fix; the folder or file it points to is byte for byte unchanged.
(c) remote_dir itself may be a link (~/orch -> /scratch/orch).

Jobs are plain Python (no torch import); each test proves no process of its job is left.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from helpers import assert_no_job_left, last_sync, orch, plant_link, snapshot
from orchestrator.files import splitdata
from sshd_cluster import SshdCluster

pytestmark = [pytest.mark.ssh, pytest.mark.slow]  # every test runs `orch up`

# Writes what training code writes into its working folder, once (a second run keeps the
# first run's bytes, so the test can tell a kept file from a rewritten one).
WRITER_JOB = """\
import os, helper
outputs = ["lightning_logs/version_0/checkpoints/epoch=0.ckpt", "snapshot.pt", "__pycache__/x.pyc"]
for rel in outputs:
    if not os.path.exists(rel):
        os.makedirs(os.path.dirname(rel) or ".", exist_ok=True)
        with open(rel, "wb") as f:
            f.write(os.urandom(4096))
print("CWD " + os.getcwd(), flush=True)
print("HELPER " + helper.WORD, flush=True)
"""
OUTPUTS = ["lightning_logs/version_0/checkpoints/epoch=0.ckpt", "snapshot.pt", "__pycache__/x.pyc"]
PLAIN_JOB = 'import os\nprint("JOBDIR " + os.environ["ORCH_JOB_DIR"] + " CWD " + os.getcwd(), flush=True)\n'


# ---------------------------------------------------------------- (a) the job's own files

def test_files_the_job_writes_into_its_working_folder_survive_the_next_up(
        sshd_cluster: SshdCluster, tmp_path: Path) -> None:
    host, name = sshd_cluster.hosts[0], "hostpaths-keep"
    (tmp_path / "job.py").write_text(WRITER_JOB)
    (tmp_path / "helper.py").write_text('WORD = "one"\n')
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "notes.txt").write_text("pushed, then deleted locally\n")
    (tmp_path / "pkg" / "keep.txt").write_text("stays\n")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "x.pyc").write_bytes(b"the controller's own, excluded")
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=[host], procs=1, name=name,
        code_paths=["job.py", "helper.py", "pkg", "__pycache__"],
        top={"code": {"exclude": ["__pycache__"]}})
    code = host.remote_dir / name / "code"

    first = orch(tmp_path, "up", str(inv))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr
    assert f"CWD {code}" in first.stdout and "HELPER one" in first.stdout, first.stdout[-2000:]
    kept = {rel: (code / rel).read_bytes() for rel in OUTPUTS}
    assert (code / "pkg" / "notes.txt").exists()

    (tmp_path / "pkg" / "notes.txt").unlink()
    (tmp_path / "helper.py").write_text('WORD = "two"\n')
    again = orch(tmp_path, "up", str(inv))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr
    assert "HELPER two" in again.stdout, again.stdout[-2000:]
    sync = last_sync(tmp_path, name)[host.address]["code"]
    assert sync["sent"] == ["helper.py"] and sync["deleted"] == 1, sync
    assert not (code / "pkg" / "notes.txt").exists(), "a file orch pushed, gone locally, stays"
    assert (code / "pkg" / "keep.txt").read_text() == "stays\n"
    for rel, data in kept.items():
        assert (code / rel).read_bytes() == data, f"{rel} was deleted or rewritten"
    # __pycache__ holds the interpreter's own .pyc of helper too: the job's, kept
    assert any(n.startswith("helper.") for n in os.listdir(code / "__pycache__"))
    assert_no_job_left([host.remote_dir / name])


# ---------------------------------------------------------------- (b) planted links

def split_one_shard(base: Path) -> dict:
    """A 2-file dataset split for one worker: the data section of the inventory."""
    src = base / "src"
    src.mkdir()
    for i in range(2):
        (src / f"train-{i:05d}-of-00002").write_bytes(os.urandom(2048))
    splitdata.split(src, base / "shards", 1)
    return {"data": {"source": str(src), "shards": str(base / "shards")}}


PLANTED = {   # where the link goes, what it points to: the victim folder or file
    "code": "victim-dir",
    "logs": "victim-dir",
    "data/worker_0_of_1": "victim-dir",
    "logs/rank-0.log": "victim-file",
}


@pytest.mark.parametrize("where", sorted(PLANTED))
def test_a_link_planted_in_the_job_folder_is_refused_and_not_followed(
        sshd_cluster: SshdCluster, tmp_path: Path, where: str) -> None:
    host = sshd_cluster.hosts[1]
    name = "hostpaths-link-" + where.replace("/", "-").replace(".", "-")
    victims = tmp_path / "outside"
    (victims / "victim-dir" / "sub").mkdir(parents=True)
    (victims / "victim-dir" / "rank-0.log").write_bytes(b"someone else's log\n")
    (victims / "victim-dir" / "job.py").write_bytes(b"# someone else's code\n")
    (victims / "victim-dir" / "sub" / "train-00000-of-00002").write_bytes(os.urandom(512))
    (victims / "victim-file").write_bytes(b"someone else's file\n")
    before = snapshot(victims)

    (tmp_path / "job.py").write_text(PLAIN_JOB)
    top = split_one_shard(tmp_path) if where.startswith("data/") else None
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=[host], procs=1,
                                       name=name, top=top)
    job = host.remote_dir / name
    link = plant_link(job, where, victims / PLANTED[where])

    res = orch(tmp_path, "up", str(inv))
    assert res.returncode == 3, res.stdout[-2000:] + res.stderr
    assert "Traceback" not in res.stderr
    assert f"{link} is a symbolic link" in res.stderr, res.stderr
    assert f"rm {link}" in res.stderr, res.stderr
    assert "JOBDIR" not in res.stdout, "the job ran"
    assert os.path.islink(link), "orch removed the user's link"
    assert snapshot(victims) == before, "orch wrote, deleted or changed something outside the job"
    assert_no_job_left([job])

    link.unlink()   # the fix the message gives: then the job runs
    ok = orch(tmp_path, "up", str(inv))
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr
    assert f"JOBDIR {job} CWD {job}/code" in ok.stdout, ok.stdout[-2000:]
    assert snapshot(victims) == before
    assert_no_job_left([job])


# ---------------------------------------------------------------- (c) remote_dir is a link

def test_a_remote_dir_that_is_a_link_works(sshd_cluster: SshdCluster, tmp_path: Path) -> None:
    host, name = sshd_cluster.hosts[2], "hostpaths-linked-remote"
    real = host.remote_dir / "scratch"
    real.mkdir(parents=True, exist_ok=True)
    linked = host.remote_dir / "orch-link"
    if not os.path.islink(linked):
        linked.symlink_to(real)
    (tmp_path / "job.py").write_text(PLAIN_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=[host], procs=1, name=name)
    doc = yaml.safe_load(inv.read_text())
    doc["hosts"][0]["remote_dir"] = str(linked)
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))

    for attempt in range(2):
        res = orch(tmp_path, "up", str(inv))
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr
        assert f"JOBDIR {real / name} CWD {real / name}/code" in res.stdout, res.stdout[-2000:]
        sent = last_sync(tmp_path, name)[host.address]["code"]["sent"]
        assert sent == (["job.py"] if attempt == 0 else []), sent
    assert (real / name / "code" / "job.py").read_text() == PLAIN_JOB
    assert not os.path.islink(real / name)
    assert_no_job_left([real / name])
