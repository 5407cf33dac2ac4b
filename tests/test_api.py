"""The Python API (orchestrator.api): the README's example run as written against a
`connection: local` host, the typed results behind it, failures as data (GroupError's
`result` and `failures`, JobError's failed ranks), and the --json documents built from
the same results, each with `"version": 1`."""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from fake_agent import session_maker
from orchestrator import api, cli
from orchestrator.api import jobs as api_jobs
from orchestrator.api.outcomes import document
from orchestrator.errors import GroupError, JobError, OrchError
from orchestrator.wire import protocol
from sshd_cluster import pids_with_env

ROOT = Path(__file__).resolve().parent.parent
JOB = 'import os, time\nprint("hello from rank", os.environ["RANK"], flush=True)\ntime.sleep(60)\n'


def inventory(tmp_path: Path) -> Path:
    (tmp_path / "job.py").write_text(JOB)
    path = tmp_path / "cluster.yaml"
    path.write_text("name: apidemo\n"
                    "hosts:\n  - {address: localhost, connection: local, remote_dir: nodes/a}\n"
                    f"python: {sys.executable}\n"
                    "code: {paths: [job.py]}\n"
                    "job: {entrypoint: job.py}\n")
    return path


def readme_example() -> str:
    """The code block of the README's "## Python API" section, as it is written there."""
    section = (ROOT / "README.md").read_text().split("\n## Python API\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_readme_example_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    inv = inventory(tmp_path)
    exec(compile(readme_example(), "README.md", "exec"), {})
    printed = capsys.readouterr()
    out = printed.out.splitlines()
    assert out[0].split()[0] == "1", out                      # world size, MASTER_ADDR
    assert re.fullmatch(r"0 localhost running [\d.]+", out[1]), out
    assert out[2] == "hello from rank 0", out                 # read once it was there
    assert printed.err == "", printed.err                     # stop included: nothing printed
    status = api.status(inv)
    assert [r.state for r in status.ranks] == ["stopped"], status
    assert not pids_with_env(f"ORCH_JOB_DIR={tmp_path}/nodes/a/apidemo")


def readme_run_example() -> str:
    """The README's second Python block: api.run, JobError, api.follow."""
    section = (ROOT / "README.md").read_text().split("\n## Python API\n", 1)[1]
    return section.split("```python\n", 2)[2].split("```", 1)[0]


@pytest.mark.slow
def test_the_readme_run_example_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A rank that fails: api.run raises JobError with its root cause; api.follow then
    yields the ended job's lines."""
    monkeypatch.chdir(tmp_path)
    inventory(tmp_path)
    (tmp_path / "job.py").write_text('print("hello from rank 0", flush=True)\nraise SystemExit(3)\n')
    exec(compile(readme_run_example(), "README.md", "exec"), {})
    printed = capsys.readouterr()
    out = printed.out.splitlines()
    assert out[0] == "failed: rank 0 on localhost failed (exit code 3) ('hello from rank 0',)", out
    assert out[1] == "rank 0: hello from rank 0", out
    assert printed.err == "", printed.err


@pytest.mark.slow
def test_up_status_logs_stop_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    inv = inventory(tmp_path)
    job = api.up(inv)
    assert isinstance(job, api.UpResult) and job.world_size == 1 and job.job == "apidemo", job
    assert [(h.host, h.ranks) for h in job.hosts] == [("localhost", [0])]
    job_dir = job.hosts[0].job_dir
    deadline = time.monotonic() + 60
    while b"hello from rank 0" not in api.logs(inv, rank=0):
        assert time.monotonic() < deadline, api.status(inv)
        time.sleep(0.5)
    running = api.status(inv)
    rank = running.ranks[0]
    assert (rank.rank, rank.host, rank.local_rank, rank.state) == (0, "localhost", 0, "running")
    assert rank.pid and rank.exit_code is None and rank.runtime_s is not None, rank
    assert rank.last_line == "hello from rank 0" and running.unreachable == {}
    assert running.running and not running.failed
    assert api.logs(inv, rank=0) == b"hello from rank 0\n"
    stopped = api.stop(inv, grace=2)
    assert list(stopped.hosts) == ["localhost"] and stopped.failed == {}, stopped
    assert stopped.hosts["localhost"].found >= 1 and not stopped.hosts["localhost"].left
    assert api.status(inv).ranks[0].state == "stopped"
    assert not pids_with_env(f"ORCH_JOB_DIR={job_dir}"), "a process of the job survived"


def test_mistakes_raise_the_cli_error(tmp_path: Path) -> None:
    bad = tmp_path / "cluster.yaml"
    bad.write_text("name: x\nhosts: []\njob: {entrypoint: w}\n")
    with pytest.raises(OrchError) as err:
        api.status(bad)
    assert err.value.exit_code == 2 and str(bad) in str(err.value)
    with pytest.raises(OrchError, match="no such inventory file"):
        api.stop(tmp_path / "missing.yaml")


def test_a_job_array_is_asked_with_the_array_calls(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("name: sweep\nhosts: [{address: localhost, connection: local}]\n"
                    "job: {entrypoint: t.py, array: {matrix: {fold: [0, 1]}}}\n")
    with pytest.raises(OrchError, match="is a job array") as err:
        api.status(path)
    assert "array_status" in err.value.hint
    with pytest.raises(OrchError, match="is a job array"):
        api.up(path)


# ---------------------------------------------------------------- over in-process agents

TWO_HOSTS = """name: apiunit
hosts:
  - {address: localhost, connection: local, remote_dir: /r0, procs: 2}
  - {address: 127.0.0.1, connection: local, remote_dir: /r1, procs: 1}
job: {entrypoint: job.py}
"""


def status_reply(chan, msg: dict) -> None:
    ranks = [{"rank": r, "state": "exited", "code": 3 if r == 1 else 0, "pid": 10 + r,
              "started": 100.0, "ended": 110.5, "last_line": f"bye {r}", "log_bytes": 5}
             for r in msg["ranks"]]
    chan.push(protocol.reply(msg["id"], {"supervisor": {"pid": 9}, "host_exit": None,
                                         "time": time.time(), "ranks": ranks}))


def stop_reply(chan, msg: dict) -> None:
    chan.push(protocol.reply(msg["id"], {"found": 3, "killed": 1, "left": [], "seconds": 0.5}))


@pytest.fixture
def two_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The inventory, and `use(down)`: every api call's hosts are in-process agents."""
    path = tmp_path / "cluster.yaml"
    path.write_text(TWO_HOSTS)

    def use(down: int | None = None) -> None:
        factory = session_maker({"status": status_reply, "stop": stop_reply}, down)
        monkeypatch.setattr(api_jobs, "new_session", factory)
    return path, use


def test_status_is_typed_and_a_failed_rank_is_data(two_hosts) -> None:
    path, use = two_hosts
    use()
    status = api.status(path)   # no state saved: the hosts say that it ran
    assert [(r.rank, r.host, r.local_rank, r.state, r.exit_code, r.runtime_s, r.last_line)
            for r in status.ranks] == [
        (0, "localhost", 0, "exited 0", 0, 10.5, "bye 0"),
        (1, "localhost", 1, "failed (exit code 3)", 3, 10.5, "bye 1"),
        (2, "127.0.0.1", 0, "exited 0", 0, 10.5, "bye 2")]
    assert [r.log_bytes for r in status.ranks] == [5, 5, 5] and status.unreachable == {}
    assert [r.rank for r in status.failed] == [1] and not status.running
    with pytest.raises(JobError) as err:
        status.raise_for_failures()
    assert err.value.exit_code == 1 and list(err.value.failures) == [1]
    assert err.value.failures[1].state == "failed (exit code 3)"


def test_status_names_an_unreachable_host_instead_of_raising(two_hosts) -> None:
    path, use = two_hosts
    use(down=1)
    status = api.status(path)
    assert [r.state for r in status.ranks][2:] == ["unreachable"]
    assert list(status.unreachable) == ["127.0.0.1"] and list(status.unreached) == [1]
    assert "connection refused" in status.unreachable["127.0.0.1"]


def test_stop_raises_group_error_with_every_hosts_outcome(two_hosts) -> None:
    path, use = two_hosts
    use(down=0)
    with pytest.raises(GroupError) as err:
        api.stop(path, grace=0)
    e = err.value
    assert e.exit_code == 3 and list(e.failures) == [0] and e.hosts == {0: "localhost"}
    assert isinstance(e.result, api.StopResult)
    assert list(e.result.hosts) == ["127.0.0.1"] and e.result.hosts["127.0.0.1"].found == 3
    assert list(e.result.failed) == ["localhost"]
    assert "1 of 2 hosts failed to stop" in str(e)   # the CLI's message, unchanged


def test_exec_on_an_unreachable_host_raises_with_every_hosts_line(two_hosts) -> None:
    path, use = two_hosts
    use(down=1)
    with pytest.raises(GroupError) as err:
        api.exec(path, ["true"], hosts="1")
    result = err.value.result
    assert isinstance(result, api.ExecResult) and result.exit_code == 3 and not result.ok
    assert [(h.host, h.exit_code) for h in result.hosts] == [("127.0.0.1", None)]
    assert "connection refused" in (result.hosts[0].error or "")
    assert list(err.value.failures) == [1] and list(result.failures) == [1]


# ---------------------------------------------------------------- --json documents

def rank(r: int, state: str = "running") -> api.RankStatus:
    return api.RankStatus(rank=r, host="h", local_rank=r, pid=7, state=state, exit_code=None,
                          runtime_s=1.5, last_line="x", log_bytes=3)


def test_documents_carry_the_version_and_the_cli_field_names() -> None:
    status = api.Status(job="j", ranks=[rank(0)], unreachable={"h2": "down"},
                        unreached={1: RuntimeError("down")})
    doc = document(status)
    assert list(doc) == ["version", "job", "ranks", "unreachable", "gpus", "gpu_errors",
                         "restarts", "network"] and doc["version"] == 1
    assert doc["network"] is None   # no plan saved: one machine, or not proven
    assert doc["ranks"] == [{"rank": 0, "host": "h", "local_rank": 0, "pid": 7,
                             "state": "running", "code": None, "runtime_s": 1.5,
                             "last_line": "x", "metrics": {}}]   # exit_code is "code"; log_bytes stays out
    json.dumps(doc)   # the exceptions stay out too
    up = api.UpResult("j", "run1", 2, "10.0.0.1", 29500, [api.UpHost("h", "/r/j", [0, 1])])
    assert document(up) == {"version": 1, "job": "j", "run_id": "run1", "world_size": 2,
                            "master_addr": "10.0.0.1", "master_port": 29500,
                            "hosts": [{"host": "h", "job_dir": "/r/j", "ranks": [0, 1]}],
                            "network": None}   # no plan: one machine, or not proven
    stop = api.StopResult("j", {"h": api.StopReport(2, 0, (), 0.1)}, {})
    assert document(stop)["hosts"] == {"h": {"found": 2, "killed": 0, "left": [], "seconds": 0.1}}
    ok = api.HostExec("h", 0, 0, "out\n", False)
    assert "error" not in document(api.ExecResult(["true"], [ok], False, 0))["hosts"][0]
    one = document(api.LogLines(job="j", host="h", lines=["a"], rank=2))
    assert one == {"version": 1, "job": "j", "host": "h", "lines": ["a"], "rank": 2}


def test_the_cli_error_document_has_the_same_version(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    assert cli.JSON_VERSION == api.JSON_VERSION
    cli.json_error(argparse.Namespace(json=True), "bad", 2)
    assert json.loads(capsys.readouterr().out) == {"version": 1, "error": "bad", "exit_code": 2}


def test_stop_says_the_unreached_hosts_ranks_still_run_and_how_to_finish(
        two_hosts, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A host whose sshd is down: its ranks were never signalled. The message says so,
    names them, and gives the `orch stop` (with the inventory) that finishes it; exit 3."""
    path, use = two_hosts
    other = tmp_path / "other.yaml"
    other.write_text(path.read_text())
    use(down=0)
    assert cli.cli(["stop", "-c", str(other), "--grace", "0"]) == 3
    err = capsys.readouterr().err
    assert "1 of 2 hosts failed to stop" in err and "127.0.0.1: stopped" in err, err
    assert "ranks 0-1 on localhost are NOT stopped and may still be running" in err, err
    assert f"`orch stop -c {other}` again finishes the stop" in err, err


def test_stop_prints_nothing_and_warns_through_the_logger(
        two_hosts, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """As the README says: no output from the calls, `stop` included; a warning (here a
    damaged state file) is a record of the `orchestrator` logger."""
    path, use = two_hosts
    use()
    result = api.stop(path, grace=0)
    assert sorted(result.hosts) == ["127.0.0.1", "localhost"] and result.failed == {}
    assert capfd.readouterr() == ("", "")
    state = path.parent / ".orch" / "apiunit" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text('{"name": "apiunit", "hosts": [')
    with caplog.at_level("WARNING", logger="orchestrator"):
        api.stop(path, grace=0)
    assert [r.name for r in caplog.records] == ["orchestrator"], caplog.records
    assert "the job state is damaged" in caplog.records[0].getMessage()
    assert capfd.readouterr().out == ""
