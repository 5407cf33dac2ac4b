"""The root cause at 16 hosts on a busy machine, over real sshd: once every rank runs,
both cores are made busy and one rank exits 3; every other rank dies of orch's stop.
The failing rank is always named (three runs), never a rank the stop killed, and nothing
of the job is left."""
from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import Jobs, assert_nothing_left, orch, write_job
from sshd_cluster import SshdCluster, own_cluster, pid_alive

pytestmark = [pytest.mark.ssh, pytest.mark.slow]
HOSTS = 16
FIRST_OCTET = 40      # 127.0.0.40-55: apart from the session cluster's addresses

JOB = """\
import os, sys, time
rank = int(os.environ["RANK"])
print("rank %d started" % rank, flush=True)
if rank == int(os.environ["FAIL_RANK"]):
    while not os.path.exists(os.environ["FAIL_NOW"]):   # the test's go: the cores are busy
        time.sleep(0.05)
    print("failing now", flush=True)
    sys.exit(3)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def big_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    with own_cluster(tmp_path_factory.mktemp("sshd16"), HOSTS, FIRST_OCTET) as cluster:
        yield cluster


@contextmanager
def busy_cores() -> Iterator[None]:
    """Both cores busy with spinning processes until the block ends."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for p in spin:
            p.kill()
            p.wait(10)
    assert all(p.poll() is not None and not pid_alive(p.pid) for p in spin)


@pytest.mark.parametrize("fail_rank", [9, 2, 15])
def test_the_failing_rank_is_named_at_16_hosts_on_a_busy_machine(
        big_cluster: SshdCluster, tmp_path: Path, jobs: Jobs, fail_rank: int) -> None:
    """The cores are busy from the moment every rank runs until nothing of the job is
    left: the failure, its detection, the stop and the report. Preflight and torchrun's
    16 imports run before, on a machine only as busy as it is (they name nothing)."""
    hosts, name, go = big_cluster.hosts, f"rc16-{fail_rank}", tmp_path / "fail-now"
    write_job(tmp_path, JOB)
    inv = big_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name,
                                      env={"FAIL_RANK": str(fail_rank), "FAIL_NOW": str(go)})
    jobs.add(inv, hosts, name)
    run = jobs.start(tmp_path, "up", str(inv))
    run.wait_for(r"\] rank \d+ started$", count=HOSTS, timeout=240)
    with busy_cores():
        go.touch()
        code = run.finish(timeout=120)
        report = " ".join("\n".join(run.err).split())
        assert code == 1, run.text()
        address = re.escape(hosts[fail_rank].address)
        cause = rf"root cause rank {fail_rank} on host {address} .*exit code 3"
        assert re.search(cause, report), report
        assert "SIGTERM" not in report.split("stopped the job")[0], report
        assert "stopped the job on every host" in report, report
        assert_nothing_left(hosts, name)


SLEEP_JOB = """\
import os, time
print("rank %s ready" % os.environ["RANK"], flush=True)
time.sleep(600)
"""


def test_a_frozen_host_is_named_and_finished_once_it_is_back(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """sshd and the agent SIGSTOPped mid-job (the job itself runs on, detached): the
    frozen host is the root cause, the report says it was not stopped and how to finish
    it; status exits 3 while it is away; `orch stop -c` finishes it once it is back."""
    hosts, name = sshd_cluster.hosts[:2], "rc-frozen"
    frozen = hosts[1]
    write_job(tmp_path, SLEEP_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name)
    jobs.add(inv, hosts, name)
    up = jobs.start(tmp_path, "up", str(inv))
    up.wait_for(r"\] rank \d ready$", count=2)
    frozen.pause()
    try:
        code = up.finish(timeout=60)
        report = " ".join("\n".join(up.err).split())
        status = orch(tmp_path, "status", "-c", str(inv))
    finally:
        frozen.resume()
    assert code == 1, up.text()
    silent = f"root cause host {frozen.address}: it went silent before any rank failed"
    assert silent in report, report
    assert f"NOT stopped on {frozen.address}" in report and "every host" not in report, report
    assert "`orch stop" in report and "ends them once the host is reachable again" in report, report
    assert status.returncode == 3, status.stdout + status.stderr
    stop = orch(tmp_path, "stop", "-c", str(inv), "--grace", "2")
    assert stop.returncode == 0, stop.stderr
    assert_nothing_left(hosts, name)


DUMP_JOB = """\
import os, sys, time
rank = int(os.environ["RANK"])
print("rank %d started" % rank, flush=True)
if rank == 1:   # what NCCL's watchdog leaves before the process is torn down
    run = os.path.join(os.environ["ORCH_JOB_DIR"], "run", os.environ["ORCH_JOB_PART"])
    with open(os.path.join(run, "nccl-trace-rank-1"), "wb") as f:
        f.write(b"trace")
    sys.exit(4)
time.sleep(600)
"""


def test_a_failed_ranks_nccl_flight_recorder_dump_is_named(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """NCCL's watchdog dumps its flight recorder, then tears the process down (its
    default): the failure's report names the dump on that rank's host."""
    hosts = sshd_cluster.hosts[:2]
    write_job(tmp_path, DUMP_JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name="ncclfail")
    jobs.add(inv, hosts, "ncclfail")
    run = jobs.start(tmp_path, "up", str(inv))
    assert run.finish(timeout=120) == 1, run.text()
    report = " ".join("\n".join(run.err).split())
    assert re.search(r"root cause rank 1 on host \S+ .*exit code 4", report), report
    named = re.findall(r"NCCL flight recorder dump: (\S+): (\S+/nccl-trace-rank-1) ", report)
    assert named and named[0][0] == hosts[1].address, report
    assert Path(named[0][1]).read_bytes() == b"trace"   # the host's folder, seen from here
    assert_nothing_left(hosts, "ncclfail")
