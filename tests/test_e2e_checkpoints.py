"""Checkpoints that survive the host (#22 item 3) over real SSH (the fake sshd cluster):
the keeper copies rank 0's new checkpoints off its host while the job runs, never a
half-written one; `restore` puts them into another host's job folder (as if rank 0 had
moved there), and the next `orch up` (its code sync) leaves them alone; the same for the
DDP tutorial's `snapshot.pt` in its working folder (code/)."""
from __future__ import annotations

import hashlib
import time
from functools import partial
from pathlib import Path

import pytest

from helpers import Jobs, assert_nothing_left, job_dir, orch, wait_until, write_job
from orchestrator.api import jobs as api_jobs
from orchestrator.config.inventory import Cluster, load
from orchestrator.session import state as job_state
from orchestrator.session.keeper import Keeper, restore
from sshd_cluster import FakeHost, SshdCluster

# rank 0 writes a checkpoint atomically (beside, fsync, rename) each time the test drops
# go-<n> into output/; on go-rewrite it rewrites big.pt in place, slowly, VERSIONS times
WRITER = """\
import os, sys, time
out = os.environ["ORCH_OUTPUT_DIR"]
ck = os.path.join(out, "checkpoints")
VERSIONS, SIZE, CHUNK = 12, 4 << 20, 64 << 10

def atomic(name, data):
    tmp = os.path.join(ck, "." + name + ".tmp-%d" % os.getpid())
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ck, name))

def wait(name):
    while not os.path.exists(os.path.join(out, name)):
        time.sleep(0.05)

if os.environ["RANK"] == "0":
    os.makedirs(ck, exist_ok=True)
    for n in (1, 2):
        wait("go-%d" % n)
        atomic("epoch-%d.pt" % n, (b"epoch %d " % n) * 50000)
        print("wrote", n, flush=True)
    wait("go-rewrite")
    for v in range(VERSIONS):
        with open(os.path.join(ck, "big.pt"), "wb") as f:   # in place: half-written for a while
            for _ in range(SIZE // CHUNK):
                f.write(bytes([65 + v]) * CHUNK)
                f.flush()
                time.sleep(0.004)
            f.write(b"END%05d" % v)
        time.sleep(0.15)
    print("rewrote", flush=True)
wait("stop")
"""

BIG = (4 << 20) + 8


def complete(data: bytes) -> bool:
    """A version of big.pt as the writer finishes it: one byte repeated, then its trailer."""
    if len(data) != BIG or not data.startswith(b"END", BIG - 8):
        return False
    v = int(data[-5:])
    return data[:BIG - 8] == bytes([65 + v]) * (BIG - 8)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def moved(inv: Path, cluster: SshdCluster, host: FakeHost, name: str, **kw: object) -> Cluster:
    """The inventory again on another host: rank 0 has moved there (the job ran on one
    host: what is kept is rank 0's, and a host of other ranks, a torchrun importing torch
    at each up, changed nothing of it)."""
    cluster.write_inventory(inv, hosts=[host], name=name, **kw)  # type: ignore[arg-type]
    return load(inv)


@pytest.mark.ssh
def test_keeper_fetches_new_checkpoints_and_restore_moves_them(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[:2], "e2e-ckpt"
    write_job(tmp_path, WRITER)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts[:1], name=name)
    jobs.add(inv, hosts, name)
    up = orch(tmp_path, "up", str(inv), "--detach")
    assert up.returncode == 0, up.stderr
    out0 = job_dir(hosts[0], name) / "output"
    kept = tmp_path / ".orch" / name / "checkpoints" / "output" / "checkpoints"
    cluster = load(inv)
    session = api_jobs.open_session(cluster, job_state.load(cluster))
    keeper = Keeper(session, cluster, interval=0.5).start()   # settle: 1 s (the default)
    try:
        for n in (1, 2):
            (out0 / f"go-{n}").touch()
            wanted = kept / f"epoch-{n}.pt"
            wait_until((out0 / "checkpoints" / f"epoch-{n}.pt").exists, 60,
                       f"rank 0 to save epoch-{n}.pt (a loaded host starts it late)")
            # kept: the file here and the keeper's record of it, which its round writes
            # just after the file's rename (the file alone raced the record under load)
            wait_until(partial(is_kept, wanted, keeper), 0.5 + 1 + 4,
                       f"{wanted.name} to be kept ({keeper.last_error}, {keeper.fresh})")
            assert (kept / f"epoch-{n}.pt").read_bytes() == (out0 / "checkpoints" / f"epoch-{n}.pt").read_bytes()
        assert set(keeper.latest()) == {"output/checkpoints/epoch-1.pt", "output/checkpoints/epoch-2.pt"}
        assert not list(kept.glob(".*")), "a hidden (half-written) file was kept"

        # big.pt rewritten in place, again and again (pausing between writes: the bytes
        # listed and the bytes sent may agree on a half-written file, which the settle
        # time leaves out): what is kept is always complete, the last version in the end
        (out0 / "go-rewrite").touch()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                data = (kept / "big.pt").read_bytes()
            except FileNotFoundError:
                data = b""
            if data:
                assert complete(data), f"a half-written big.pt was kept ({len(data)} bytes)"
            if b"END00011" in data[-8:]:
                break
            time.sleep(0.02)
        assert (kept / "big.pt").read_bytes() == (out0 / "checkpoints" / "big.pt").read_bytes()
        assert keeper.errors == 0 and keeper.last_error is None, keeper.last_error
    finally:
        keeper.stop()
        session.close()
    assert not keeper.thread or not keeper.thread.is_alive()
    (out0 / "stop").touch()
    stop = orch(tmp_path, "stop", str(inv))
    assert stop.returncode == 0, stop.stderr

    # rank 0 moves to the other host: the kept files are put back there, only once
    there = moved(inv, sshd_cluster, hosts[1], name)
    out1 = job_dir(hosts[1], name) / "output"
    with api_jobs.open_session(there) as s:
        got = restore(s, there)
        assert sorted(got) == ["output/checkpoints/big.pt", "output/checkpoints/epoch-1.pt",
                               "output/checkpoints/epoch-2.pt"]
        for rel in got:
            assert (out1.parent / rel).read_bytes() == (tmp_path / ".orch" / name / "checkpoints" / rel).read_bytes()
        assert restore(s, there) == []
        (out1 / "checkpoints" / "epoch-1.pt").write_bytes(b"damaged")
        assert restore(s, there) == ["output/checkpoints/epoch-1.pt"]
    assert not list(out1.rglob("*.orch-part-*"))
    assert_nothing_left(hosts, name)


TUTORIAL = """\
import os, sys, time
# the DDP tutorial's way: snapshot.pt in the working folder (code/), saved in place
rank = os.environ["RANK"]
out = os.environ["ORCH_OUTPUT_DIR"]
epoch = 0
if os.path.exists("snapshot.pt"):
    epoch = int(open("snapshot.pt").read().split()[1])
    print("resumed at", epoch, "on", rank, flush=True)
if len(sys.argv) > 1:
    sys.exit(0)
if rank == "0":
    for e in (epoch + 1, epoch + 2):
        if e == epoch + 2:
            time.sleep(0.5)   # the keeper may see epoch 1 before it is rewritten in place
        with open("snapshot.pt", "w") as f:
            f.write("epoch %d " % e + "x" * 100000)
        print("saved", e, flush=True)
while not os.path.exists(os.path.join(out, "stop")):
    time.sleep(0.05)
"""


@pytest.mark.ssh
def test_tutorial_snapshot_in_code_survives_and_code_sync_keeps_it(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[2:4], "e2e-ckpt-snap"
    write_job(tmp_path, TUTORIAL)
    top = {"job": {"entrypoint": "job.py", "args": [], "env": {},
                   "checkpoint": ["code/snapshot.pt"]}}
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts[:1], name=name,
                                       top=top)
    jobs.add(inv, hosts, name)
    up = orch(tmp_path, "up", str(inv), "--detach")
    assert up.returncode == 0, up.stderr
    code0 = job_dir(hosts[0], name) / "code"
    kept = tmp_path / ".orch" / name / "checkpoints" / "code" / "snapshot.pt"
    cluster = load(inv)
    assert cluster.job.checkpoint == ("code/snapshot.pt",)
    session = api_jobs.open_session(cluster, job_state.load(cluster))
    keeper = Keeper(session, cluster, interval=0.3).start()
    try:
        saved = code0 / "snapshot.pt"
        wait_until(lambda: saved.exists() and saved.read_text().startswith("epoch 2 "), 60,
                   "rank 0 to save epoch 2 (a loaded host starts it late)")
        wait_until(lambda: kept.exists() and kept.read_text().startswith("epoch 2 "), 5,
                   "snapshot.pt of epoch 2 to be kept")
        assert kept.read_bytes() == (code0 / "snapshot.pt").read_bytes()
        # the keeper's record follows its copy (written, then recorded): wait for it
        wait_until(lambda: keeper.latest() == {"code/snapshot.pt": sha(kept.read_bytes())}, 10,
                   "the keeper to record the copy of epoch 2 it wrote")
    finally:
        keeper.stop(final=True)
        session.close()
    (job_dir(hosts[0], name) / "output" / "stop").touch()
    assert orch(tmp_path, "stop", str(inv)).returncode == 0

    # the host that held it is gone: rank 0 on the other host finds it and resumes
    args = {"job": {**top["job"], "args": ["--once"]}}
    there = moved(inv, sshd_cluster, hosts[1], name, top=args)
    code1 = job_dir(hosts[1], name) / "code"
    assert not code1.joinpath("snapshot.pt").exists()
    with api_jobs.open_session(there) as s:
        assert restore(s, there) == ["code/snapshot.pt"]
    assert (code1 / "snapshot.pt").read_bytes() == kept.read_bytes()
    up = orch(tmp_path, "up", str(inv))          # a code sync, then the job once
    assert up.returncode == 0, up.stderr
    assert "resumed at 2 on 0" in up.stdout, up.stdout
    assert (code1 / "snapshot.pt").read_bytes() == kept.read_bytes(), "the code sync touched it"
    assert_nothing_left(hosts, name)


def is_kept(path: Path, keeper: Keeper) -> bool:
    return path.exists() and f"output/checkpoints/{path.name}" in keeper.latest()
