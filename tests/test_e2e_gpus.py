"""GPU slots over real SSH, with the stand-in nvidia-smi on the hosts' PATH (sshd's
SetEnv): a job claims its GPUs for its whole life and its ranks see only those; two jobs
on one 4-GPU host get disjoint GPUs; a third is refused with the holders named, or waits
(`up --wait`) and starts as soon as they are freed; a process orch did not start makes
its GPU busy; `gpus: all` takes every free one; `orch status` shows every GPU and whose
it is, `--watch` refreshes it, `--json` carries it."""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpu_standin
from helpers import ORCH, Jobs, assert_nothing_left, orch, wait_until, write_job
from sshd_cluster import SshdCluster, free_port, loopback, pid_alive

pytestmark = pytest.mark.ssh

REPO = Path(__file__).resolve().parent.parent

FIRST_OCTET = 60
JOB = """\
import os, sys, time
print("rank %s local %s sees %s order %s" % (os.environ["RANK"], os.environ["LOCAL_RANK"],
      os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER")), flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """2 sshd hosts whose sessions find the stand-in nvidia-smi first on PATH and keep
    their claims in a folder of this module's, made by root's agent, that another user
    (`nobody`) can reach."""
    root = tmp_path_factory.mktemp("gpus")
    gpu_standin.install(root / "bin")
    shared = Path(tempfile.mkdtemp(dir="/tmp", prefix="orch-e2e-claims-"))
    shared.chmod(0o755)
    env = (f"PATH={root / 'bin'}:/usr/local/bin:/usr/bin:/bin ORCH_FAKE_GPUS_DIR={root} "
           f"ORCH_GPU_CLAIMS_DIR={shared / 'claims'}")
    port = free_port([loopback(FIRST_OCTET + i) for i in range(2)])
    cluster = SshdCluster(root / "sshd", 2, port=port, first_octet=FIRST_OCTET,
                          sshd_options={"SetEnv": env}).start()
    cluster.fake_gpus = root   # type: ignore[attr-defined]
    cluster.shared = shared    # type: ignore[attr-defined]
    try:
        yield cluster
    finally:
        pids = [h.pid for h in cluster.all_hosts()]
        cluster.stop()
        shutil.rmtree(shared, ignore_errors=True)
    assert not [p for p in pids if pid_alive(p)], "an sshd of the GPU cluster survived"


def job(cluster: SshdCluster, tmp: Path, name: str, gpus: object, seconds: float,
        host: int = 0, procs: int | None = None) -> Path:
    write_job(tmp, JOB)
    entry: dict = {"address": cluster.hosts[host].address, "gpus": gpus,
                   "remote_dir": str(cluster.hosts[host].remote_dir)}
    if procs is not None:
        entry["procs"] = procs
    return cluster.write_inventory(tmp / f"{name}.yaml", hosts=[], extra_hosts=[entry],
                                   name=name, args=[str(seconds)])


def seen(cluster: SshdCluster, name: str, host: int = 0) -> dict[int, str]:
    """rank -> the CUDA_VISIBLE_DEVICES it printed."""
    logs = cluster.hosts[host].remote_dir / name / "logs"
    out = {}
    for log in logs.glob("rank-*.log"):
        m = re.search(r"rank (\d+) local (\d+) sees (\S+) order (\S+)", log.read_text())
        if m:
            assert m.group(4) == "PCI_BUS_ID"
            out[int(m.group(1))] = m.group(3)
    return out


def test_jobs_share_a_host_on_disjoint_gpus_a_third_waits_for_them(
        gpu_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    host = gpu_cluster.hosts[0]
    gpu_standin.describe(gpu_cluster.fake_gpus, host.address, 4)   # type: ignore[attr-defined]
    first = job(gpu_cluster, tmp_path, "g1", 2, 120)
    second = job(gpu_cluster, tmp_path, "g2", 2, 120)
    third = job(gpu_cluster, tmp_path, "g3", 2, 0)
    for inv, name in ((first, "g1"), (second, "g2"), (third, "g3")):
        jobs.add(inv, [host], name)
    for inv in (first, second):
        up = orch(tmp_path, "up", str(inv), "--detach", timeout=120)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "gpus: claimed for the job's life" in up.stderr
    wait_until(lambda: len(seen(gpu_cluster, "g1")) == 2 and len(seen(gpu_cluster, "g2")) == 2,
               60, "both jobs' ranks print their GPUs")
    assert seen(gpu_cluster, "g1") == {0: "0,1", 1: "0,1"}
    assert seen(gpu_cluster, "g2") == {0: "2,3", 1: "2,3"}

    refused = orch(tmp_path, "up", str(third), "--detach", timeout=120)
    text = refused.stdout + refused.stderr
    assert refused.returncode == 3, text
    assert "2 GPUs asked for, 0 of 4 free: GPU 0 held by job 'g1' (user root)" in text
    assert "GPU 3 held by job 'g2' (user root)" in text and "--wait" in text
    assert "Traceback" not in text

    waiting = jobs.start(tmp_path, "up", str(third), "--wait", "--detach")
    wait_until(lambda: any("waiting" in line for line in waiting.err), 60,
               f"--wait says it waits\n{waiting.text()}")
    stop = orch(tmp_path, "stop", str(first), timeout=60)
    freed = time.monotonic()
    assert stop.returncode == 0, stop.stderr
    wait_until(lambda: any("gpus: claimed" in line for line in waiting.err), 30,
               f"the waiting job claims the freed GPUs\n{waiting.text()}")
    waited = time.monotonic() - freed
    assert waiting.finish(60) == 0, waiting.text()
    print(f"\nup --wait claimed the freed GPUs {waited:.2f} s after `orch stop` returned")
    assert waited < 5.0, f"took {waited:.1f} s after the GPUs were freed"
    wait_until(lambda: len(seen(gpu_cluster, "g3")) == 2, 60, "g3's ranks print")
    assert seen(gpu_cluster, "g3") == {0: "0,1", 1: "0,1"}
    assert orch(tmp_path, "stop", str(second), timeout=60).returncode == 0
    assert_nothing_left([host], "g2", wait=10)
    assert_nothing_left([host], "g3", wait=30)


def test_a_foreign_process_makes_its_gpu_busy_and_status_shows_every_holder(
        gpu_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    host = gpu_cluster.hosts[1]
    foreign = subprocess.Popen(["sleep", "300"])
    try:
        gpu_standin.describe(gpu_cluster.fake_gpus, host.address, 4,   # type: ignore[attr-defined]
                             apps=[{"gpu": 1, "pid": foreign.pid, "mem": 2048}],
                             util=[55, 99, 0, 0], mem_used=[1024, 2048, 0, 0])
        whole = job(gpu_cluster, tmp_path, "whole", 4, 0, host=1)
        refused = orch(tmp_path, "up", str(whole), "--detach", timeout=120)
        text = refused.stdout + refused.stderr
        assert refused.returncode == 3, text
        assert f"GPU 1 held by pid {foreign.pid} (user root), not an orch job" in text

        every = job(gpu_cluster, tmp_path, "every", "all", 120, host=1)
        jobs.add(every, [host], "every")
        up = orch(tmp_path, "up", str(every), "--detach", timeout=120)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "world size 3" in up.stderr, up.stderr
        wait_until(lambda: len(seen(gpu_cluster, "every", 1)) == 3, 60, "3 ranks print")
        assert set(seen(gpu_cluster, "every", 1).values()) == {"0,2,3"}

        status = orch(tmp_path, "status", "-c", str(every), "--json")
        assert status.returncode == 0, status.stderr
        gpus = {g["index"]: g for g in json.loads(status.stdout)["gpus"]}
        assert [gpus[i]["holder"] for i in range(4)] == ["this job", "process", "this job",
                                                         "this job"]
        assert [gpus[i]["ranks"] for i in range(4)] == [[0], [], [1], [2]]
        assert gpus[1]["pids"] == [foreign.pid] and gpus[1]["user"] == "root"
        assert gpus[0]["util"] == 55 and gpus[1]["mem_used"] == 2048

        table = orch(tmp_path, "status", "-c", str(every), env=wide_env())
        shown = table.stdout + table.stderr
        assert "this job, rank 0" in shown and f"pid {foreign.pid} (user root), not an orch job" in shown
        assert_watch_refreshes(tmp_path, every)
    finally:
        foreign.kill()
        foreign.wait()
    assert orch(tmp_path, "stop", str(every), timeout=60).returncode == 0
    assert_nothing_left([host], "every", wait=10)


def wide_env() -> dict:
    return dict(os.environ, COLUMNS="160")


def assert_watch_refreshes(tmp_path: Path, inv: Path) -> None:
    """`status --watch --json`: a document every 2 s until Ctrl-C, then exit 0."""
    proc = subprocess.Popen([*ORCH, "status", "-c", str(inv), "--watch", "--json"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=wide_env())
    assert proc.stdout is not None
    t0 = time.monotonic()
    docs = [json.loads(proc.stdout.readline()) for _ in range(2)]
    took = time.monotonic() - t0
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert all(len(d["gpus"]) == 4 for d in docs) and took >= 1.5, (took, docs)
    assert "Traceback" not in err
    # the tables, redrawn: on a terminal rich's Live draws each round as it comes
    code, shown = watch_on_a_terminal(tmp_path, inv, ("GPUs", "this job, rank 0", "Ctrl-C to end"))
    assert code == 0, shown
    assert all(w in shown for w in ("GPUs", "this job, rank 0", "Ctrl-C to end")), shown
    assert "Traceback" not in shown


ESCAPES = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|\][^\x07]*\x07)")


def watch_on_a_terminal(tmp_path: Path, inv: Path, wanted: tuple[str, ...]) -> tuple[int, str]:
    """`status --watch` on a terminal of 160 columns (a pty): read until every wanted
    text was drawn (at most 120 s: a round is one login and one status, slow only on a
    loaded machine), then Ctrl-C. On a pipe the Live writes only its last table, at the
    end, so a test there could only guess when the first round was done."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    proc = subprocess.Popen([*ORCH, "status", "-c", str(inv), "--watch"], cwd=tmp_path,
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=wide_env())
    os.close(slave)
    raw = b""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
                w in ESCAPES.sub("", raw.decode(errors="replace")) for w in wanted):
            raw += read_some(master, 1.0)
        proc.send_signal(signal.SIGINT)
        while chunk := read_some(master, 30.0):   # to the end: the terminal closes
            raw += chunk
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, ESCAPES.sub("", raw.decode(errors="replace"))


def read_some(fd: int, wait: float) -> bytes:
    """What the terminal has within `wait` s; b"" once it is closed (EIO) or silent."""
    if not select.select([fd], [], [], wait)[0]:
        return b""
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


TASK = """\
import os, sys, time
print("task %s slot %s sees %s" % (os.environ["ORCH_TASK"], os.environ["ORCH_TASK_SLOT"],
      os.environ.get("CUDA_VISIBLE_DEVICES")), flush=True)
time.sleep(1)
"""


def test_job_array_tasks_are_pinned_to_gpus_of_their_own(
        gpu_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """4 GPUs, 2 per task: 2 tasks at a time, each on a pair of its own; the others
    wait for a pair as they wait for a slot."""
    host = gpu_cluster.hosts[0]
    gpu_standin.describe(gpu_cluster.fake_gpus, host.address, 4)   # type: ignore[attr-defined]
    write_job(tmp_path, TASK)
    entry = {"address": host.address, "gpus": 4, "remote_dir": str(host.remote_dir)}
    inv = gpu_cluster.write_inventory(
        tmp_path / "arr.yaml", hosts=[], extra_hosts=[entry], name="garr",
        top={"job": {"entrypoint": "job.py", "args": [],
                     "array": {"tasks": [["a"], ["b"], ["c"], ["d"], ["e"]],
                               "gpus_per_task": 2}}})
    jobs.add(inv, [host], "garr")
    up = orch(tmp_path, "up", str(inv), timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "5 tasks on 1 hosts, 2 at a time" in up.stderr, up.stderr
    logs = host.remote_dir / "garr" / "logs"
    seen_by = {}
    for i in range(5):
        m = re.search(r"task (\d) slot (\d) sees (\S+)", (logs / f"task-{i}.log").read_text())
        assert m, (logs / f"task-{i}.log").read_text()
        seen_by[i] = (int(m.group(2)), m.group(3))
    assert {slot: gpus for slot, gpus in seen_by.values()} == {0: "0,1", 1: "2,3"}
    assert_nothing_left([host], "garr", wait=10)


PRE_CREATE = """
import os, sys
folder, uuids = sys.argv[1], sys.argv[2:]
for uuid in uuids:   # every name a claim of these GPUs might have, as far as one can guess
    for name in ["gpu-%s.lock" % uuid] + ["gpu-%s.%s.claim" % (uuid, t) for t in "01x"]:
        os.close(os.open(os.path.join(folder, name), os.O_RDWR | os.O_CREAT, 0o666))
"""

ATTACK = """
import json, os, sys
from orchestrator.agent import gpus
folder, uuids = sys.argv[1], sys.argv[2:]
broke = []
def tried(what, act):
    try:
        act()
        broke.append(what)
    except OSError:
        pass
for name in sorted(os.listdir(folder)):
    path = os.path.join(folder, name)
    if os.lstat(path).st_uid == os.getuid():   # its own, made first: the reported exploit
        os.unlink(path)                        # when the job had locked one of them
        continue
    tried("unlink " + name, lambda: os.unlink(path))
    tried("rename " + name, lambda: os.rename(path, path + ".moved"))
    mine = os.path.join(folder, ".mine")
    open(mine, "w").close()
    tried("replace " + name, lambda: os.rename(mine, path))
    os.unlink(mine)
got = gpus.claim("/tmp/nobody-job", len(uuids), {"job": "theirs"})
print(json.dumps({"broke": broke, "ids": got.get("ids"),
                  "holders": [g["holder"] for g in got.get("busy", [])]}), flush=True)
"""


def as_nobody(env: dict[str, str], code: str, *args: str) -> str:
    done = subprocess.run(["/usr/sbin/runuser", "-u", "nobody", "--", "/usr/bin/python3",
                           "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(not Path("/usr/sbin/runuser").exists() or os.getuid() != 0,
                    reason="needs root and runuser to act as another user")
def test_another_user_cannot_free_a_running_jobs_gpus(
        gpu_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """The reported double booking, over sshd. A claims folder an ordinary user owns is
    refused (exit 3, the admin's line). In root's folder, `nobody` makes every claim name
    it can guess before root's job h1 starts, then deletes its own files (the reported
    exploit) and tries to delete, rename and replace h1's, then claims the GPUs itself:
    refused, naming h1; root's next job is refused (exit 3) naming h1 too. Once h1 ends,
    nobody's leftovers hold nothing."""
    host = gpu_cluster.hosts[0]
    gpu_standin.describe(gpu_cluster.fake_gpus, host.address, 2)   # type: ignore[attr-defined]
    first = job(gpu_cluster, tmp_path, "h1", 2, 120)
    second = job(gpu_cluster, tmp_path, "h2", 2, 0)
    jobs.add(first, [host], "h1")
    jobs.add(second, [host], "h2")
    claims = gpu_cluster.shared / "claims"   # type: ignore[attr-defined]
    claims.mkdir(exist_ok=True)
    claims.chmod(0o1777)
    os.chown(claims, 65534, 65534)
    refused = orch(tmp_path, "up", str(first), "--detach", timeout=120)
    text = refused.stdout + refused.stderr
    assert refused.returncode == 3, text
    assert f"none can be claimed safely: the claims folder {claims} belongs to user nobody" \
        in " ".join(text.split()), text
    assert f"sudo install -d -m 1777 -o root -g root {claims}" in text and "Traceback" not in text
    os.chown(claims, 0, 0)

    shared = gpu_cluster.shared   # type: ignore[attr-defined]
    gpu_standin.install(shared / "bin", "/usr/bin/python3")   # one `nobody` may run
    gpu_standin.describe(shared, host.address, 2)
    env = {"PATH": f"{shared / 'bin'}:/usr/bin:/bin", "ORCH_FAKE_GPUS_DIR": str(shared),
           "ORCH_GPU_CLAIMS_DIR": str(claims), "PYTHONPATH": str(REPO),
           "SSH_CONNECTION": f"127.0.0.1 1 {host.address} 22"}   # the stand-in's host
    uuids = [f"GPU-fake-{host.address}-{i}" for i in range(2)]
    keys = [u.replace(".", "_") for u in uuids]   # as a claim's name spells a UUID
    as_nobody(env, PRE_CREATE, str(claims), *keys)
    made = [p for k in keys for p in claims.glob(f"gpu-{k}.*.claim") if p.stat().st_uid != 0]
    assert len(made) == 6   # root's own, left by the module's earlier jobs, aside
    up = orch(tmp_path, "up", str(first), "--detach", timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr

    seen_by_nobody = json.loads(as_nobody(env, ATTACK, str(claims), *uuids))
    assert seen_by_nobody["broke"] == [] and seen_by_nobody["ids"] is None
    assert seen_by_nobody["holders"] == [{"job": "h1", "user": "root"}] * 2
    refused = orch(tmp_path, "up", str(second), "--detach", timeout=120)
    text = refused.stdout + refused.stderr
    assert refused.returncode == 3, text
    assert "GPU 0 held by job 'h1' (user root); GPU 1 held by job 'h1' (user root)" in text

    assert orch(tmp_path, "stop", str(first), timeout=60).returncode == 0
    assert_nothing_left([host], "h1", wait=10)
    as_nobody(env, PRE_CREATE, str(claims), *keys)
    again = orch(tmp_path, "up", str(second), timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert_nothing_left([host], "h2", wait=10)
