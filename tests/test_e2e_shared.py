"""Hosts whose job folder is one folder (NFS home folders, a bind mount, the same path)
over real SSH: found at preflight, one job folder with a part per host (run/<part>/),
code pushed once per folder, setup once per folder (or per host), and stop, status,
logs and pull as on private folders; shared and private folders in one job. A stop of
one host's part leaves the other's processes alone (on this machine, both hosts'
processes share ORCH_JOB_DIR)."""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import Jobs, assert_nothing_left, job_pids, last_sync, orch, wait_until, write_job
from orchestrator.config.inventory import host_part
from sshd_cluster import SshdCluster, pids_with_env

pytestmark = pytest.mark.ssh

JOB = """\
import os, sys, time
rank = int(os.environ["RANK"])
print("rank %d part %s" % (rank, os.environ.get("ORCH_JOB_PART")), flush=True)
out = os.environ["ORCH_OUTPUT_DIR"]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "rank-%d.txt" % rank), "w") as f:
    f.write("done %d\\n" % rank)
if len(sys.argv) > 1:
    time.sleep(float(sys.argv[1]))
"""


@dataclass(frozen=True)
class Shared:
    """A host as the test helpers see it (address, remote_dir), with the folder it uses."""

    address: str
    remote_dir: Path


def entry(host, remote_dir: Path, procs: int = 2) -> dict:
    return {"address": host.address, "procs": procs, "remote_dir": str(remote_dir)}


def write(cluster: SshdCluster, path: Path, entries: list[dict], name: str,
          args: tuple[str, ...] = (), top: dict | None = None) -> Path:
    write_job(path.parent, JOB)
    return cluster.write_inventory(path, hosts=[], name=name, args=args,
                                   extra_hosts=entries, top=top)


def part_pids(folder: Path, name: str, address: str) -> set[int]:
    """Live processes of the job's part of host `address` in folder/name."""
    return (set(pids_with_env(f"ORCH_JOB_DIR={folder / name}"))
            & set(pids_with_env(f"ORCH_JOB_PART={host_part(address)}")))


def status(cwd: Path, inv: Path) -> dict:
    got = orch(cwd, "status", "-c", str(inv), "--json")
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


def no_markers(folder: Path) -> bool:
    return not list(folder.glob("*/.orch-share-*"))


# ---------------------------------------------------------------- one remote_dir


def test_two_hosts_one_remote_dir(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    a, b = sshd_cluster.hosts[:2]
    shared, name = tmp_path / "home" / "orch", "nfs"
    inv = write(sshd_cluster, tmp_path / "cluster.yaml", [entry(a, shared), entry(b, shared)],
                name, top={"setup": {"commands": ["echo ran >> ../setup-count"]}})
    jobs.add(inv, [Shared(a.address, shared), Shared(b.address, shared)], name)
    up = orch(tmp_path, "up", str(inv), timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"sync {a.address} (job folder shared with {b.address}: pushed once)" in up.stderr
    sync = last_sync(tmp_path, name)
    assert sync[a.address]["code"]["sent"] == ["job.py"], sync
    assert sync[b.address] == {"pushed_by": a.address}, sync
    assert (shared / name / "setup-count").read_text() == "ran\n", "setup ran once per filesystem"
    job = shared / name
    assert (job / "run" / host_part(a.address)).is_dir()
    assert (job / "run" / host_part(b.address)).is_dir()
    assert no_markers(shared), "the preflight markers are removed"
    for r, host in ((0, a), (1, a), (2, b), (3, b)):
        assert f"rank {r} part {host_part(host.address)}" in (job / "logs" / f"rank-{r}.log").read_text()
    doc = status(tmp_path, inv)
    assert [(r["rank"], r["state"]) for r in doc["ranks"]] == \
        [(0, "exited 0"), (1, "exited 0"), (2, "exited 0"), (3, "exited 0")], doc
    logs = orch(tmp_path, "logs", "-c", str(inv), "--rank", "3")
    assert logs.returncode == 0 and "rank 3 part" in logs.stdout, logs.stderr
    assert (tmp_path / "outputs" / name / "rank-0.txt").read_text() == "done 0\n"
    pull = orch(tmp_path, "pull", "-c", str(inv), "--host", b.address, "-o", str(tmp_path / "pb"))
    assert pull.returncode == 0, pull.stderr
    assert (tmp_path / "pb" / "rank-3.txt").read_text() == "done 3\n"
    ex = orch(tmp_path, "exec", "-c", str(inv), "--", "ls", "run")
    assert ex.returncode == 0 and host_part(b.address) in ex.stdout, ex.stdout + ex.stderr
    again = orch(tmp_path, "up", str(inv), timeout=180)   # name reuse: not "already running"
    assert again.returncode == 0, again.stdout + again.stderr
    assert (shared / name / "setup-count").read_text() == "ran\n", "unchanged setup is skipped"
    assert_nothing_left([Shared(a.address, shared)], name)


def test_setup_once_per_host(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    a, b = sshd_cluster.hosts[:2]
    shared, name = tmp_path / "orch", "perhost"
    setup = {"commands": ["echo ran >> ../setup-count"], "once_per": "host"}
    inv = write(sshd_cluster, tmp_path / "cluster.yaml", [entry(a, shared, 1), entry(b, shared, 1)],
                name, top={"setup": setup})
    jobs.add(inv, [Shared(a.address, shared)], name)
    up = orch(tmp_path, "up", str(inv), "--detach", timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    assert (shared / name / "setup-count").read_text() == "ran\nran\n"
    for h in (a, b):
        assert (shared / name / "logs" / f"setup-{host_part(h.address)}.log").exists()
    # the job's end is seen here (no process of it left: its supervisors have written the
    # ranks' records; a look over /proc every 0.5 s), then `orch status` reads it: polling
    # status was an orch run (two logins) after another until then
    folder = [Shared(a.address, shared)]
    wait_until(lambda: not any(job_pids(folder, name).values()), 60, "the job to end", step=0.5)
    assert_nothing_left(folder, name)
    wait_until(lambda: [r["state"] for r in status(tmp_path, inv)["ranks"]] == ["exited 0"] * 2,
               30, "both ranks to exit 0", step=2)


# ---------------------------------------------------------------- two jobs, stop one part


def test_two_jobs_in_one_shared_folder_and_a_stop_of_one_part(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """Two long jobs in one shared folder of hosts a and b. A second up of the first is
    refused while it runs; a stop of b's part of the first leaves a's part and the other
    job alone; a stop of the first job leaves the second running. (One pair of jobs
    serves both claims: a job of its own for the part's stop was two more torchruns.)
    The second job also has host c, with a folder of its own: shared and private folders
    in one job (found at preflight, pushed once to the shared one and to c's), which was
    a 3-host job of its own (three torchruns; here, one more)."""
    a, b, c = sshd_cluster.hosts[:3]
    shared = tmp_path / "orch"
    invs = {}
    for name, entries in (("first", [entry(a, shared), entry(b, shared)]),
                          ("second", [entry(a, shared, 1), entry(b, shared, 1),
                                      entry(c, c.remote_dir, 1)])):
        inv = write(sshd_cluster, tmp_path / name / "cluster.yaml", entries, name, args=("600",))
        jobs.add(inv, [Shared(a.address, shared)] + [c] * (name == "second"), name)
        if name == "second":
            dry = orch(inv.parent, "up", str(inv), "--dry-run")
            assert dry.returncode == 0 and "found at preflight" in dry.stdout, dry.stdout
        up = orch(inv.parent, "up", str(inv), "--detach", timeout=180)
        assert up.returncode == 0, up.stdout + up.stderr
        invs[name] = inv
    first, second = invs["first"], invs["second"]
    sync = last_sync(second.parent, "second")
    assert sync[a.address]["shared_with"] == [b.address], sync
    assert sync[b.address] == {"pushed_by": a.address}, sync
    assert sync[c.address]["code"]["sent"] == ["job.py"], sync
    assert "shared_with" not in sync[c.address], sync
    assert (c.remote_dir / "second" / "run" / host_part(c.address)).is_dir()

    def both_run(name: str) -> bool:
        on_c = name != "second" or pids_with_env(f"ORCH_JOB_DIR={c.remote_dir / name}")
        return bool(on_c) and all(part_pids(shared, name, h.address) for h in (a, b))
    wait_until(lambda: len(part_pids(shared, "first", a.address)) >= 2
               and len(part_pids(shared, "first", b.address)) >= 2, 60, "ranks of both parts",
               step=0.25)
    wait_until(lambda: both_run("second"), 60, "second's ranks on its three hosts", step=0.25)
    doc = status(first.parent, first)
    assert [r["state"] for r in doc["ranks"]] == ["running"] * 4, doc
    doc = status(second.parent, second)
    assert [r["state"] for r in doc["ranks"]] == ["running"] * 3, doc
    busy = orch(first.parent, "up", str(first), timeout=120)
    assert busy.returncode == 2 and "already running" in busy.stderr, busy.stderr

    # b's part of the first alone: an inventory of b only (its label, so its part, is the same)
    only_b = write(sshd_cluster, tmp_path / "b" / "cluster.yaml", [entry(b, shared)], "first",
                   args=("600",))
    stop_b = orch(only_b.parent, "stop", str(only_b), "--grace", "1")
    assert stop_b.returncode == 0, stop_b.stderr
    assert not part_pids(shared, "first", b.address), "b's part is stopped"
    assert len(part_pids(shared, "first", a.address)) >= 2, "a's ranks are left alone"
    assert both_run("second"), "the other job's parts are left alone"

    stop = orch(first.parent, "stop", str(first), "--grace", "1")
    assert stop.returncode == 0, stop.stderr
    assert_nothing_left([Shared(a.address, shared)], "first")
    assert both_run("second"), "the other job runs on"
    stop = orch(second.parent, "stop", str(second), "--grace", "1")
    assert stop.returncode == 0, stop.stderr
    assert_nothing_left([Shared(a.address, shared), c], "second")


# ---------------------------------------------------------------- a bind mount


@pytest.fixture
def bind_mount(tmp_path: Path):
    real, seen = tmp_path / "real", tmp_path / "bind"
    real.mkdir()
    seen.mkdir()
    done = subprocess.run(["mount", "--bind", str(real), str(seen)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount --bind does not work here ({done.stderr.strip()}); a symlinked "
                    "remote_dir is no stand-in: it resolves to one path")
    yield real, seen
    subprocess.run(["umount", str(seen)], check=True)


def test_bind_mount(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs, bind_mount) -> None:
    a, b = sshd_cluster.hosts[:2]
    real, seen = bind_mount
    name = "bound"
    inv = write(sshd_cluster, tmp_path / "cluster.yaml", [entry(a, real), entry(b, seen)], name)
    jobs.add(inv, [Shared(a.address, real), Shared(b.address, seen)], name)
    up = orch(tmp_path, "up", str(inv), timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    assert last_sync(tmp_path, name)[b.address] == {"pushed_by": a.address}
    assert [r["state"] for r in status(tmp_path, inv)["ranks"]] == ["exited 0"] * 4
    assert no_markers(real)
