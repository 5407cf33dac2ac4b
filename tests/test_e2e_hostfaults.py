"""Host and network faults during a push and during a job, over real sshd.

Each host sits in a network namespace of its own behind a veth (tests/netns_hosts.py):
one host's sshd is SIGSTOPped, or its cable pulled, while `orch up` pushes shards to it,
or while the job runs; a host's remote_dir on a tmpfs too small for its shards. Each
time: `orch up` ends in bounded time with exit 3 (1 for a job whose host went silent),
one message naming the host and the fix, no traceback, nothing started anywhere when a
push failed; no half-written file under a real name; once the fault is gone, the next
`orch up` sends only what had not landed (last_sync.json) and `orch stop` leaves nothing
of the job.
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import (
    ORCH,
    agents_of,
    assert_nothing_left,
    file_sha,
    job_pids,
    kill_all,
    last_sync,
    orch,
    rank_pids,
    wait_until,
    wait_until_gone,
    write_job,
)
from netns_hosts import NsHost, NsHosts
from orchestrator.wire import timeouts
from sshd_cluster import SshdCluster, pid_alive
from test_push import Dataset, make_records, split

pytestmark = [pytest.mark.ssh, pytest.mark.slow]
SLEEP_JOB = """\
import os, time
print("rank %s ready" % os.environ["RANK"], flush=True)
time.sleep(600)
"""
RECORD = 256 << 10     # shard files of 256 KiB
RATE = "24mbit"        # the pushed host's cable during a push: about 3 MB/s
LEFTOVER = re.compile(r"\.orch-(part|staging)-")


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NsHosts]:
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True)
    if probe.returncode != 0 or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 (`ip netns`) to put hosts behind a veth")
    cluster = NsHosts(tmp_path_factory.mktemp("nshosts"), 2).start()
    pids = [h.proc.pid for h in cluster.hosts if h.proc is not None]
    yield cluster
    cluster.stop()   # raises if a pid, a namespace or a veth is left
    assert not [p for p in pids if pid_alive(p)]


@pytest.fixture(autouse=True)
def _heal(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails half way leaves no host frozen or cut off."""
    yield
    if "net" in request.fixturenames:
        request.getfixturevalue("net").heal()


# ---------------------------------------------------------------- helpers

def orch_cmd(net: NsHosts, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """orch run in the client namespace, as a user there runs it."""
    return orch(cwd, *args, run=net.run_in_client)


def up_once_the_cut_up_is_gone(net: NsHosts, cwd: Path, inv: Path, silent: NsHost,
                               name: str) -> subprocess.CompletedProcess:
    """The next `orch up --detach` once the stalled one's agent on the silent host has
    ended: it keeps the job folder's lock until its receive stream gives up (RECEIVE_IDLE
    without bytes), and until then preflight refuses a new `up`, naming that host and
    the cut `up` (not "already running": no process of the job lives). After a refusal
    the next try waits for that agent to end (its flock ends with it), where a try every
    2 s was a whole `orch up` each."""
    deadline = time.monotonic() + timeouts.RECEIVE_IDLE + 60
    while True:
        again = orch_cmd(net, cwd, "up", "--detach", str(inv))
        said = one_message(again.stderr)
        if "another `orch up` of it holds its job folder" not in said \
                or time.monotonic() > deadline:
            return again
        assert again.returncode == 2 and f"job folder on {silent.address}:" in said, said
        assert f"gives up after {timeouts.RECEIVE_IDLE:g} s without data" in said, said
        holders = agents_of([silent.remote_dir / name])
        if not holders:   # not seen (gone meanwhile, or not by argv): try again in 2 s
            time.sleep(2)
        left = wait_until_gone(holders, max(1.0, deadline - time.monotonic()))
        assert not left, f"the cut up's agent on {silent.address} did not end: {left}"


def write_inventory(net: NsHosts, base: Path, name: str, data: Dataset | None = None) -> Path:
    write_job(base, SLEEP_JOB)
    doc: dict[str, Any] = {
        "name": name,
        "ssh": {"user": "root", "identity_file": str(net.client_key),
                "known_hosts": str(net.known_hosts), "connect_timeout": 5},
        "hosts": [{"address": h.address, "remote_dir": str(h.remote_dir)} for h in net.hosts],
        "python": sys.executable, "code": {"paths": ["job.py"]},
        "job": {"entrypoint": "job.py"}}
    if data is not None:
        doc["data"] = {"source": str(data.source), "shards": str(data.shards)}
    path = base / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def kill_job(hosts: Sequence[Any], name: str) -> None:
    """A failed test's leftovers (the test has failed already)."""
    kill_all(job_pids(hosts, name))


def complete_files(host: Any, name: str, want: dict[str, str]) -> set[str]:
    """Files of the host's data/ that carry their real name, in place or in a staging
    folder, with all their bytes. Any real-named file there that is not a whole,
    correct shard file fails the test: no half-written file carries a real name."""
    data = host.remote_dir / name / "data"
    done = set()
    for top, _dirs, names in os.walk(data):
        for n in names:
            path = Path(top, n)
            rel = str(path.relative_to(data))
            if LEFTOVER.search(n):
                continue
            rel = re.sub(r"^\.orch-staging-\d+/", "", rel)
            with contextlib.suppress(FileNotFoundError):   # renamed into place meanwhile
                if path.stat().st_size == RECORD and file_sha(path) == want.get(rel):
                    done.add(rel)
    return done


def real_names_are_whole(host: Any, name: str, want: dict[str, str]) -> None:
    data = host.remote_dir / name / "data"
    for path in data.rglob("*"):
        rel = str(path.relative_to(data))
        if path.is_file() and not LEFTOVER.search(rel):
            assert want.get(rel) == file_sha(path), f"{host.address}: {rel} is not a whole shard file"


def shaped(net: NsHosts, h: NsHost, rate: str | None) -> None:
    """Slow the cable to host h (from the client's side) so that a push takes seconds."""
    dev = h.veth[0]
    if rate is None:
        net.run_in_client(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        return
    net.run_in_client(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                       "burst", "64kb", "latency", "500ms"], check=True, capture_output=True)


class Background:
    """An orch command in the client namespace, its output collected as it comes."""

    def __init__(self, net: NsHosts, cwd: Path, *args: str) -> None:
        self.proc = net.popen_in_client(ORCH + list(args), cwd=cwd, env=dict(os.environ),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.errs: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(s, into), daemon=True)
                        for s, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.errs))]
        for th in self.readers:
            th.start()

    @staticmethod
    def _read(stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    @property
    def err(self) -> str:
        return "\n".join(self.errs)

    def finish(self, timeout: float) -> tuple[int, float]:
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"orch still running {timeout} s after the fault\n{self.err}") from None
        for th in self.readers:
            th.join(10)
        return self.proc.returncode, time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def one_message(err: str) -> str:
    assert "Traceback" not in err, err
    return " ".join(err.split())


# ---------------------------------------------------------------- faults during a push

@pytest.mark.parametrize("fault", ["sigstop", "cut"])
def test_a_push_to_a_host_that_goes_silent_ends_and_resumes(
        net: NsHosts, tmp_path: Path, fault: str) -> None:
    """The host's sshd frozen (SIGSTOP) or its cable pulled while shards stream to it:
    `orch up` gives up after PUSH_IDLE with exit 3 naming the host, starts nothing on
    any host; once the host is back, the next `orch up` sends only what had not landed."""
    name, silent = f"hf-push-{fault}", net.hosts[1]
    make_records(tmp_path / "src", 48, RECORD)     # 24 files (6 MiB) per host
    data = split(tmp_path, tmp_path / "src", 2)
    want = {r: data.host_files([r], 2) for r in (0, 1)}
    inv = write_inventory(net, tmp_path, name, data)
    shaped(net, silent, RATE)
    up = Background(net, tmp_path, "up", "--detach", str(inv))
    try:
        wait_until(lambda: len(complete_files(silent, name, want[1])) >= 3 or up.proc.poll() is not None,
                   60, "the first shard files on the host", step=0.01)
        assert up.proc.poll() is None, "the push ended before the fault: " + up.err
        net.pause(1) if fault == "sigstop" else net.cut(1)
        landed = complete_files(silent, name, want[1])
        code, took = up.finish(timeouts.PUSH_IDLE + 40)
    finally:
        up.kill()
        net.heal()
        shaped(net, silent, None)
    report = one_message(up.err)
    assert code == 3, report
    assert f"{silent.address}: the push to" in report and "stalled" in report, report
    assert "nothing was started on any host" in report and "orch up" in report, report
    assert took < timeouts.PUSH_IDLE + 25, f"orch up took {took:.0f} s to give up"
    assert not any(rank_pids(net.hosts, name).values()), "a rank started though a push failed"
    real_names_are_whole(silent, name, want[1])
    assert len(landed) < len(want[1]), "every file had landed before the fault"

    again = up_once_the_cut_up_is_gone(net, tmp_path, inv, silent, name)
    try:
        assert again.returncode == 0, again.stderr
        report_sync = last_sync(tmp_path, name)
        sent = set(report_sync[silent.address]["data"]["sent"])
        assert not sent & landed, f"files that had landed were sent again: {sorted(sent & landed)}"
        assert sent, "nothing was sent again though the push broke off"
        assert report_sync[net.hosts[0].address]["data"]["sent"] == []
        for h, r in zip(net.hosts, (0, 1)):
            data_dir = h.remote_dir / name / "data"
            leftovers = [p for p in data_dir.rglob("*") if LEFTOVER.search(p.name)]
            assert not leftovers, f"{h.address}: {leftovers}"
            assert complete_files(h, name, want[r]) == set(want[r])
        wait_until(lambda: all(job_pids(net.hosts, name).values()), 30, "both ranks running")
        stop = orch_cmd(net, tmp_path, "stop", "--grace", "1", "-c", str(inv))
        assert stop.returncode == 0, stop.stderr
        assert_nothing_left(net.hosts, name, wait=10)
    finally:
        kill_job(net.hosts, name)


# ---------------------------------------------------------------- a cut link during a job

def test_a_host_cut_off_mid_job_is_named_and_stop_finishes_it(net: NsHosts, tmp_path: Path) -> None:
    """The cable of host 1 pulled while the ranks run (the job runs on there): the host
    is the root cause, the report says it was not stopped and how to finish it; status
    exits 3 while it is away; with the cable back, `orch stop` leaves nothing of the job."""
    name, cut = "hf-job-cut", net.hosts[1]
    inv = write_inventory(net, tmp_path, name)
    up = Background(net, tmp_path, "up", str(inv))
    try:
        try:
            wait_until(lambda: sum("ready" in line for line in up.out) >= 2 or up.proc.poll() is not None,
                       60, "both ranks ready", step=0.05)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{up.out[-20:]}\n{up.err}") from None
        assert up.proc.poll() is None, up.err
        net.cut(1)
        code, took = up.finish(timeouts.HOST_LOST + 40)
        status = orch_cmd(net, tmp_path, "status", "-c", str(inv))
        net.restore(1)
        report = one_message(up.err)
        assert code == 1, report
        assert f"root cause host {cut.address}: it went silent before any rank failed" in report, report
        assert f"NOT stopped on {cut.address}" in report and "every host" not in report, report
        assert "`orch stop" in report and "ends them once the host is reachable again" in report, report
        assert took < timeouts.HOST_LOST + 25, f"orch up took {took:.0f} s to notice"
        assert status.returncode == 3, status.stdout + status.stderr
        assert cut.address in status.stderr and "Traceback" not in status.stderr, status.stderr
        assert job_pids([cut], name)[cut.address], "the job on the cut-off host should run on"
        stop = orch_cmd(net, tmp_path, "stop", "--grace", "2", "-c", str(inv))
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert_nothing_left(net.hosts, name, wait=10)
    finally:
        up.kill()
        kill_job(net.hosts, name)


# ---------------------------------------------------------------- a full disk

@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "orch-test-full", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
    assert not os.path.ismount(mount)


def test_a_full_disk_is_named_and_the_push_resumes_once_there_is_room(
        sshd_cluster: SshdCluster, tmp_path: Path, small_disk: Path) -> None:
    """Host 1's remote_dir on a 3 MiB tmpfs, 6 MiB of shards for it: exit 3, one line with
    the host, the file, `no space left` and the fix; no job anywhere; the files that fit
    are kept; with room made, the next `orch up` sends only the rest."""
    hosts, name = sshd_cluster.hosts[2:4], "hf-full-disk"
    make_records(tmp_path / "src", 48, RECORD)
    data = split(tmp_path, tmp_path / "src", 2)
    want = {r: data.host_files([r], 2) for r in (0, 1)}
    write_job(tmp_path, SLEEP_JOB)
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=list(hosts), name=name,
        top={"data": {"source": str(data.source), "shards": str(data.shards)}})
    doc = yaml.safe_load(inv.read_text())
    doc["hosts"][1]["remote_dir"] = str(small_disk)
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    full = type("Full", (), {"address": hosts[1].address, "remote_dir": small_disk})()
    everyone = [hosts[0], full]
    try:
        up = orch(tmp_path, "up", "--detach", str(inv))
        report = one_message(up.stderr)
        assert up.returncode == 3, report
        line = next((x for x in up.stderr.splitlines() if "no space left" in x), up.stderr)
        assert hosts[1].address in line and "data/worker_1_of_2/train-" in line, line
        assert str(small_disk / name / "data") in line, line
        assert "fix:" in report and "remote_dir" in report and "sends only the rest" in report, report
        assert not any(rank_pids(everyone, name).values()), "a rank started though a push failed"
        real_names_are_whole(full, name, want[1])
        kept = complete_files(full, name, want[1])
        assert kept and len(kept) < len(want[1]), kept

        subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
        again = orch(tmp_path, "up", "--detach", str(inv))
        assert again.returncode == 0, again.stderr
        sent = set(last_sync(tmp_path, name)[hosts[1].address]["data"]["sent"])
        assert sent == set(want[1]) - kept, sorted(sent ^ (set(want[1]) - kept))
        assert complete_files(full, name, want[1]) == set(want[1])
        wait_until(lambda: all(job_pids(everyone, name).values()), 30, "both ranks running")
        stop = orch(tmp_path, "stop", "--grace", "1", "-c", str(inv))
        assert stop.returncode == 0, stop.stderr
        assert_nothing_left(everyone, name, wait=10)
    finally:
        kill_job(everyone, name)
