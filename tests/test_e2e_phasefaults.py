"""SIGKILL of the controller in each phase of `orch up`, and of `orch stop` mid-stop,
over real SSH: the next `orch up`, `orch stop` or `orch status` recovers, or says exactly
where the job is; no half-written file ever carries a real name; nothing is left.

Each phase is found from outside, without a hook in the product: a host that hangs
(its sshd paused) holds `up` in connect/preflight; files in the job folder on the host
show a push under way (`.orch-staging-*`, `*.orch-part-*`) or the launch request
arriving (`run/launch.json`); a setup command and the stop's `run/stop.json` show the
setup and the stop. The shard push and the follow phase are covered by
tests/test_push.py (interrupted push) and tests/test_e2e_lifecycle.py (reattach).
"""
from __future__ import annotations

import json
import os
import signal
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from helpers import (
    Jobs,
    Running,
    agents_of,
    assert_nothing_left,
    file_sha,
    job_dir,
    job_pids,
    kill_all,
    orch,
    part_dir,
    wait_until,
    write_job,
)
from sshd_cluster import FakeHost, SshdCluster, pids_with_env

pytestmark = [pytest.mark.ssh, pytest.mark.slow]

# A rank runs until the go file exists; it ignores SIGTERM when asked to, so that a
# stop has to wait its grace (the window in which `orch stop` is killed).
JOB = """\
import os, signal, sys, time
if sys.argv[2:] == ["stubborn"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("rank %s running" % os.environ["RANK"], flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.1)
print("rank %s done" % os.environ["RANK"], flush=True)
"""
LEFTOVER = (".orch-part-", ".orch-staging-")


# ---------------------------------------------------------------- helpers

def make_code(base: Path, files: int, size: int) -> dict[str, str]:
    """job.py, two big top-level files (written beside: .orch-part-) and pkg/ with many
    files (a new folder: staged). Returns rel -> sha256 of everything pushed."""
    write_job(base, JOB)
    for i in range(2):
        (base / f"blob{i}.bin").write_bytes(os.urandom(32 * size))
    for i in range(files):
        write_job(base, f"# module {i}\nx = {os.urandom(size // 2).hex()!r}\n",
                  f"pkg/m{i:03d}.py")
    return {str(p.relative_to(base)): file_sha(p) for p in sorted(base.rglob("*"))
            if p.is_file() and p.name != "cluster.yaml"}


def host_files(root: Path) -> dict[str, str]:
    """rel -> sha256 of every plain file under root (links and odd files fail)."""
    out = {}
    for top, _dirs, names in os.walk(root):
        for n in names:
            p = Path(top, n)
            assert stat.S_ISREG(os.lstat(p).st_mode), f"{p}: not a plain file"
            out[str(p.relative_to(root))] = file_sha(p)
    return out


def leftovers(hosts: Sequence[FakeHost], name: str) -> list[str]:
    return [str(p) for h in hosts for p in job_dir(h, name).rglob("*")
            if any(mark in p.name for mark in LEFTOVER)]


def agents(hosts: Sequence[FakeHost], name: str) -> list[int]:
    """Live agents serving this job on these hosts."""
    return agents_of(job_dir(h, name) for h in hosts)


def every_agent(run: Running, hosts: Sequence[FakeHost], name: str) -> list[int]:
    """The agents of `run` once one runs on each host (found before a kill that must be
    quick), and their forks: a warm start's waiting supervisor has the agent's argv."""
    def found() -> list[int] | None:
        assert run.proc.poll() is None, run.text()
        each = [agents([h], name) for h in hosts]
        return [p for pids in each for p in pids] if all(each) else None
    return wait_until(found, 30, "an agent on every host")  # type: ignore[return-value]


def staged(code: Path) -> int:
    """Files written so far into the push's staging folders."""
    return sum(1 for d in code.glob(".orch-staging-*") for p in d.rglob("*") if p.is_file())


def writing(code: Path, name: str) -> bool:
    """`name` is being written beside its final name (a non-empty .orch-part- file)."""
    for part in code.glob(name + ".orch-part-*"):
        try:
            if part.stat().st_size:
                return True
        except FileNotFoundError:   # renamed into place meanwhile
            pass
    return False


def no_agent_left(hosts: Sequence[FakeHost], name: str) -> None:
    """An agent whose controller died ends by itself (end of its stdin, or a reply it
    cannot write); one that does not is killed so later tests are not disturbed."""
    try:
        wait_until(lambda: not agents(hosts, name), 15, f"the agents of {name} to end")
    except AssertionError:
        kill_all({"agents": agents(hosts, name)})
        raise


def kill_when(run: Running, ready: Callable[[], object], what: str,
              also: Sequence[int] = ()) -> None:
    """SIGKILL `orch` as soon as ready() holds (first the pids `also`, if given)."""
    wait_until(lambda: ready() or run.proc.poll() is not None, 60, what, step=0.002)
    assert run.proc.poll() is None, f"orch ended before {what}\n{run.text()}"
    kill_all({"also": also})
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait(10)


def status(cwd: Path, inv: Path) -> tuple[int, list[dict]]:
    res = orch(cwd, "status", "--json", "-c", str(inv))
    assert "Traceback" not in res.stderr, res.stderr
    doc = json.loads(res.stdout) if res.stdout.strip() else {}
    return res.returncode, doc.get("ranks", [])


def up_to_the_end(cwd: Path, inv: Path, go: Path) -> None:
    """The recovery: `orch up` runs the whole job and exits 0."""
    go.touch()
    res = orch(cwd, "up", str(inv), "--no-pull")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr
    assert "Traceback" not in res.stderr


def pushed_exactly(hosts: Sequence[FakeHost], name: str, want: dict[str, str]) -> None:
    for h in hosts:
        got = host_files(job_dir(h, name) / "code")
        assert got == want, (h.address, sorted(set(got.items()) ^ set(want.items()))[:5])


def setup(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs, name: str,
          hosts: Sequence[FakeHost], procs: int = 1, files: int = 0, size: int = 0,
          stubborn: bool = False, top: dict | None = None) -> tuple[Path, Path, dict[str, str]]:
    go = tmp_path / "go"
    want = make_code(tmp_path, files, size) if files else {"job.py": file_sha(write_job(tmp_path, JOB))}
    paths = sorted({rel.split("/")[0] for rel in want})
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=list(hosts), procs=procs, name=name,
        args=[str(go)] + (["stubborn"] if stubborn else []), code_paths=paths, top=top)
    jobs.add(inv, hosts, name)
    return inv, go, want


# ---------------------------------------------------------------- up, before launch

def test_killed_in_preflight(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """A host hangs: `up` waits in connect/preflight (all or nothing) and is killed
    there. Nothing was pushed or started; the agent it started elsewhere ends; the next
    `up` runs the job."""
    hosts, name = sshd_cluster.hosts[:2], "fault-preflight"
    inv, go, want = setup(sshd_cluster, tmp_path, jobs, name, hosts)
    hosts[1].pause()
    try:
        run = jobs.start(tmp_path, "up", str(inv))
        kill_when(run, lambda: agents(hosts[:1], name), "the agent on the answering host")
    finally:
        hosts[1].resume()
    no_agent_left(hosts, name)
    for h in hosts:
        assert not (job_dir(h, name) / "code").exists(), f"{h.address}: pushed before preflight"
    assert not (tmp_path / ".orch" / name / "state.json").exists()
    code, rows = status(tmp_path, inv)
    assert code == 2 and not rows, "a job never started is not reported as one"
    up_to_the_end(tmp_path, inv, go)
    pushed_exactly(hosts, name, want)
    assert not leftovers(hosts, name)
    assert_nothing_left(hosts, name)
    no_agent_left(hosts, name)


@pytest.mark.parametrize("agent_too", [False, True], ids=["controller", "controller+agent"])
def test_killed_in_code_push(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs,
                             agent_too: bool) -> None:
    """`up` killed while the code goes out (a big tree). Only the controller: the agent
    sees the end of its stream, drops the file it was writing and keeps what was
    complete. The agent killed too (the host lost it): its staging folder or
    `.orch-part-` file stays, under a name no one reads. Either way, every file under
    its real name is whole, and the next `up` sends only the rest and sweeps the rest.
    One host: each host's push is its own stream to its own agent, so what one host
    holds after the kill is the claim, which a second host's stream would not change."""
    hosts = sshd_cluster.hosts[2:3]
    name = f"fault-codepush-{'agent' if agent_too else 'ctl'}"
    inv, go, want = setup(sshd_cluster, tmp_path, jobs, name, hosts, files=48, size=1 << 17)
    run = jobs.start(tmp_path, "up", str(inv))
    code = job_dir(hosts[0], name) / "code"
    if agent_too:   # killed while a file is written beside its final name
        kill_when(run, lambda: (code / "blob0.bin").exists() and writing(code, "blob1.bin"),
                  "blob1.bin to be written", also=every_agent(run, hosts, name))
    else:           # killed while a new folder is written into its staging folder
        kill_when(run, lambda: staged(code) >= 2, "pkg/ to be staged")
    no_agent_left(hosts, name)
    real = {rel: d for rel, d in host_files(code).items()
            if not any(m in rel for m in LEFTOVER)}
    assert real, "nothing had landed when the push was killed"
    bad = {rel for rel, d in real.items() if want.get(rel) != d}
    assert not bad, f"half-written or foreign files under their real names: {sorted(bad)}"
    assert len(real) < len(want), "the whole tree was pushed before the kill"
    if agent_too:
        assert leftovers(hosts[:1], name), "the killed agent left nothing to sweep"
    else:   # the staged files that were whole were moved into place
        assert any(rel.startswith("pkg/") for rel in real), sorted(real)
        assert not leftovers(hosts, name), "the agent did not clean up after its stream ended"

    up_to_the_end(tmp_path, inv, go)
    sync = json.loads((tmp_path / ".orch" / name / "last_sync.json").read_text())
    sent = sync[hosts[0].address]["code"]["sent"]
    assert not set(sent) & set(real), "files already whole on the host were sent again"
    pushed_exactly(hosts, name, want)
    assert not leftovers(hosts, name), "the next push did not sweep the leftovers"
    assert_nothing_left(hosts, name)


def test_killed_in_setup(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """`up` killed while `setup:` runs: the setup command ends with its agent, nothing
    started, and the next `up` runs setup again (it never succeeded) and the job."""
    hosts, name = sshd_cluster.hosts[:1], "fault-setup"
    mark = f"ORCH_FAULT_SETUP={name}"
    go = tmp_path / "go"
    inv, go, want = setup(sshd_cluster, tmp_path, jobs, name, hosts, top={
        "setup": [f"test -e {go} || env {mark} sleep 60"]})
    run = jobs.start(tmp_path, "up", str(inv))
    kill_when(run, lambda: pids_with_env(mark), "the setup command to run")
    wait_until(lambda: not pids_with_env(mark), 15, "the setup command to end with its agent")
    no_agent_left(hosts, name)
    assert not (part_dir(hosts[0], name) / "launch.json").exists()
    up_to_the_end(tmp_path, inv, go)
    assert (part_dir(hosts[0], name) / "setup.json").exists(), "setup did not run again"
    pushed_exactly(hosts, name, want)
    assert_nothing_left(hosts, name)
    no_agent_left(hosts, name)


# ---------------------------------------------------------------- launch

def test_killed_at_launch(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """`up` killed once its launch request reached the host: the job runs all the same
    (the supervisor is detached). The state may not be saved (the kill can come before
    it is; it is removed here so the recovery always faces that case): `status` still
    shows the job, `up` refuses to start a second copy, `stop` ends it."""
    hosts, name = sshd_cluster.hosts[2:3], "fault-launch"
    inv, go, _ = setup(sshd_cluster, tmp_path, jobs, name, hosts, procs=2)
    run = jobs.start(tmp_path, "up", str(inv))
    launch = part_dir(hosts[0], name) / "launch.json"
    kill_when(run, launch.exists, "the launch request on the host")
    (tmp_path / ".orch" / name / "state.json").unlink(missing_ok=True)

    def running() -> list[dict] | None:
        code, rows = status(tmp_path, inv)
        return rows if code == 0 and [r["state"] for r in rows] == ["running"] * 2 else None
    rows: list[dict] = wait_until(running, 30, "status to show both ranks running",  # type: ignore[assignment]
                                  step=0.5)
    before = set(job_pids(hosts, name)[hosts[0].address])
    assert {r["pid"] for r in rows} <= before, (rows, before)
    logs = orch(tmp_path, "logs", "-c", str(inv), "--rank", "1")   # found without the state too
    assert logs.returncode == 0 and "rank 1 running" in logs.stdout, logs.stdout + logs.stderr

    again = orch(tmp_path, "up", str(inv))
    assert again.returncode == 2, again.stderr
    assert f"job '{name}' is already running on {hosts[0].address}" in again.stderr
    assert "orch stop" in again.stderr and "Traceback" not in again.stderr
    assert set(job_pids(hosts, name)[hosts[0].address]) == before, "a second copy started"

    stop = orch(tmp_path, "stop", str(inv), "--grace", "2")
    assert stop.returncode == 0, stop.stderr
    assert_nothing_left(hosts, name)
    code, rows = status(tmp_path, inv)
    assert code == 0 and [r["state"] for r in rows] == ["stopped"] * 2, rows
    up_to_the_end(tmp_path, inv, go)
    assert_nothing_left(hosts, name)
    no_agent_left(hosts, name)


# ---------------------------------------------------------------- stop

def test_stop_killed_mid_stop(sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    """`orch stop` killed while it waits out the grace of ranks that ignore SIGTERM:
    `status` tells which ranks still run, a new `orch stop` finishes, nothing is left.
    One host of two ranks: what the killed stop leaves is each host's own (its stop
    request, its ranks in their grace), which a second host's torchrun did not change."""
    hosts, name = sshd_cluster.hosts[:1], "fault-stop"
    inv, _go, _ = setup(sshd_cluster, tmp_path, jobs, name, hosts, procs=2, stubborn=True)
    up = orch(tmp_path, "up", str(inv), "--detach")
    assert up.returncode == 0, up.stderr
    wait_until(lambda: [r["state"] for r in status(tmp_path, inv)[1]] == ["running"] * 2,
               30, "both ranks running", step=0.5)
    stops = [part_dir(h, name) / "stop.json" for h in hosts]
    run = jobs.start(tmp_path, "stop", str(inv), "--grace", "30")
    kill_when(run, lambda: all(p.exists() for p in stops), "the stop on every host")
    alive = job_pids(hosts, name)
    assert all(alive.values()), f"the ranks should wait out their grace: {alive}"

    code, rows = status(tmp_path, inv)
    assert code == 0, rows
    for r in rows:   # the truth: a rank reads running exactly while its process lives
        assert (r["state"] == "running") == (r["pid"] in alive[r["host"]]), (r, alive)
    # torchrun is gone, the ranks are not (nor their supervisor, which waits for them to
    # end): no second copy beside them
    up = orch(tmp_path, "up", str(inv), "--detach")
    assert up.returncode == 2 and "is already running on" in up.stderr, up.stdout + up.stderr
    assert job_pids(hosts, name) == alive, "a second copy started beside the stopping one"

    again = orch(tmp_path, "stop", str(inv), "--grace", "1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"job '{name}' stopped on 1 host" in again.stderr, again.stderr
    assert_nothing_left(hosts, name)
    code, rows = status(tmp_path, inv)
    assert code == 0 and [r["state"] for r in rows] == ["stopped"] * 2, rows
    no_agent_left(hosts, name)   # the first stop's agents end once their stop is done
    assert orch(tmp_path, "stop", str(inv)).returncode == 0   # idempotent
    assert_nothing_left(hosts, name)
