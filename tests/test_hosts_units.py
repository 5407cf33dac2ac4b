"""`orch up --hosts SEL --exclude SEL` (issue 21, item 4): the run's hosts narrowed from
the inventory (ranks renumbered, the world size follows, `host:0,1` GPUs), mistakes as
exit 2, the data split again for the new world size, and the later commands acting on
the hosts the run used (through the saved state), with in-process agents."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fake_agent import session_maker
from orchestrator import api, cli
from orchestrator.api import jobs as api_jobs
from orchestrator.api import launching
from orchestrator.config.hostselect import narrow
from orchestrator.config.inventory import Cluster, load
from orchestrator.errors import DataError, UsageError
from orchestrator.files import splitdata
from orchestrator.files.shards import resplit_size
from orchestrator.session import state as job_state
from orchestrator.session.launch import rank_env
from orchestrator.session.preflight import HostInfo
from orchestrator.session.replies import Supervisor
from orchestrator.session.session import Session
from orchestrator.session.session import whole as whole_list
from test_api import status_reply, stop_reply

THREE = """name: sel
hosts:
  - {address: 10.0.0.1, gpus: 2}
  - {address: 10.0.0.2, gpus: 4, procs: 2}
  - {address: 10.0.0.3, gpus: 2}
job: {entrypoint: job.py}
"""


def inventory(tmp_path: Path, text: str = THREE) -> Path:
    (tmp_path / "job.py").write_text("print('hi')\n")
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def shape(cluster: Cluster) -> list[tuple[int, str, list[int], tuple[int, ...] | None]]:
    return [(h.index, h.label, list(h.ranks), h.gpu_ids) for h in cluster.hosts]


def test_exclude_renumbers_hosts_and_ranks(tmp_path: Path) -> None:
    whole = load(inventory(tmp_path))
    run = narrow(whole, exclude="10.0.0.1")
    assert shape(run) == [(0, "10.0.0.2", [0, 1], None), (1, "10.0.0.3", [2, 3], None)]
    assert run.world_size == 4 and [s.host_index for s in run.ranks] == [0, 0, 1, 1]
    assert run.master.address == "10.0.0.2" and run.selection == "--exclude 10.0.0.1"
    assert narrow(whole, hosts="10.0.0.[1,3]").world_size == 4
    assert shape(narrow(whole, hosts="2,0")) == [(0, "10.0.0.1", [0, 1], None),
                                               (1, "10.0.0.3", [2, 3], None)]
    assert narrow(whole) is whole and narrow(whole, hosts="0,1,2") is whole


def test_gpus_of_a_host_as_deepspeed_writes_them(tmp_path: Path) -> None:
    whole = load(inventory(tmp_path))
    run = narrow(whole, hosts="10.0.0.2:1,3@10.0.0.3:0")
    assert shape(run) == [(0, "10.0.0.2", [0, 1], (1, 3)), (1, "10.0.0.3", [2], (0,))]
    assert run.world_size == 3 and run.selection == "--hosts 10.0.0.2:1,3@10.0.0.3:0"
    env = rank_env(run, run.hosts[0], "/j", "r")
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert "CUDA_VISIBLE_DEVICES" not in rank_env(whole, whole.hosts[0], "/j", "r")
    # excluding a GPU of a whole host keeps as many of the others as it runs ranks
    assert shape(narrow(whole, exclude="10.0.0.2:0")) == [
        (0, "10.0.0.1", [0, 1], None), (1, "10.0.0.2", [2, 3], (1, 2)), (2, "10.0.0.3", [4, 5], None)]
    assert shape(narrow(whole, hosts="1:0,1", exclude="1:1")) == [(0, "10.0.0.2", [0], (0,))]


@pytest.mark.parametrize("hosts,exclude,said", [
    ("10.0.0.9", None, "--hosts: '10.0.0.9' names no host of job 'sel' in cluster.yaml"),
    ("7", None, "--hosts: there is no host 7 in cluster.yaml"),
    (None, "10.0.0.[1-3]", "--exclude 10.0.0.[1-3] leaves no host of job 'sel' in cluster.yaml"),
    ("0", "10.0.0.1", "--hosts 0 --exclude 10.0.0.1 leaves no host"),
    ("10.0.0.1:2", None, "host 10.0.0.1 has no GPU 2: cluster.yaml gives it gpus: 2"),
    (None, "nope:1", "--exclude: 'nope' names no host"),
])
def test_a_selection_of_nothing_is_exit_2_with_the_fix(tmp_path: Path, hosts: str | None,
                                                        exclude: str | None, said: str) -> None:
    with pytest.raises(UsageError) as err:
        narrow(load(inventory(tmp_path)), hosts, exclude)
    assert err.value.exit_code == 2 and said in err.value.message and err.value.hint


def test_gpus_of_a_cpu_host_are_refused(tmp_path: Path) -> None:
    path = inventory(tmp_path, "name: c\nhosts: [a, b]\njob: {entrypoint: job.py}\n")
    with pytest.raises(UsageError, match=r"has no GPUs in cluster\.yaml"):
        narrow(load(path), hosts="a:0")


def test_the_cli_refuses_without_a_traceback_and_dry_run_shows_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = inventory(tmp_path)
    assert cli.cli(["up", "-c", str(path), "--dry-run", "--hosts", "nope"]) == 2
    err = capsys.readouterr().err
    assert "names no host" in err and "Traceback" not in err
    assert cli.cli(["up", "-c", str(path), "--dry-run", "--exclude", "0",
                     "--hosts", "10.0.0.[1-3]"]) == 0
    out = capsys.readouterr().out
    assert "job sel: 2 hosts, world size 4" in out
    assert "hosts of this run: --hosts 10.0.0.[1-3] --exclude 0" in out
    assert "host 0 10.0.0.2 (ssh) ranks 0-1:" in out and "--nnodes 2 --node-rank 1" in out
    assert "10.0.0.1 (ssh)" not in out
    plan = api.plan(path, hosts="1:2,3")
    assert "ranks 0-1, GPUs 2,3 (CUDA_VISIBLE_DEVICES)" in plan.plan


# ---------------------------------------------------------------- the data split again

DATA = """name: d
hosts:
  - {address: localhost, connection: local, remote_dir: n/a}
  - {address: localhost, connection: local, remote_dir: n/b}
  - {address: localhost, connection: local, remote_dir: n/c}
code: {paths: [job.py]}
data: {source: src, shards: shards}
job: {entrypoint: job.py}
"""


def split_for_three(tmp_path: Path) -> Path:
    path = inventory(tmp_path, DATA)
    (tmp_path / "src").mkdir()
    for i in range(6):
        (tmp_path / "src" / f"train-{i:05d}-of-00006").write_bytes(b"x" * (i + 1))
    splitdata.split(tmp_path / "src", tmp_path / "shards", 3, seed=7)
    return path


def splits(tmp_path: Path) -> list[str]:
    return list(json.loads((tmp_path / "shards" / "manifest.json").read_text())["splits"])


class Stop(Exception):
    pass


def test_a_new_world_size_splits_the_data_again_before_the_push(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = split_for_three(tmp_path)
    whole = load(path)
    assert resplit_size(whole) is None   # the inventory's own world size: split already
    run = narrow(whole, exclude="localhost#1")
    assert resplit_size(run) == 2
    assert "split data: " in api.plan(path, exclude="localhost#1").plan and splits(tmp_path) == ["3"]

    told: list[str] = []

    class Seen(launching.UpProgress):
        def resplit(self, cluster: Cluster, result: splitdata.SplitResult) -> None:
            told.append(f"{cluster.selection} -> {result.plan.workers} seed {result.plan.seed}")

    def no_hosts(*args: object, **kwargs: object) -> None:
        raise Stop   # the split is done, and the data checked, before any host is touched
    monkeypatch.setattr(Session, "open_and_preflight", no_hosts)
    with pytest.raises(Stop), launching.start(path, exclude="localhost#1", progress=Seen()):
        pass
    assert told == ["--exclude localhost#1 -> 2 seed 7"] and splits(tmp_path) == ["2", "3"]
    files = launching.local_files(run)
    assert [f.rel for f in whole_list(files[1].data) or []] == ["worker_1_of_2/train-00003-of-00006",
                                                   "worker_1_of_2/train-00004-of-00006",
                                                   "worker_1_of_2/train-00005-of-00006"]
    assert resplit_size(run) is None   # made once


def test_no_source_to_split_again_is_exit_2_with_the_command(tmp_path: Path) -> None:
    path = split_for_three(tmp_path)
    for f in (tmp_path / "src").iterdir():
        f.unlink()
    (tmp_path / "src").rmdir()
    with pytest.raises(DataError) as err:
        api.plan(path, hosts="localhost#0")
    assert err.value.exit_code == 2 and "has no split for world size 1" in err.value.message
    assert "split-data" in (err.value.hint or "") and "--workers 1" in (err.value.hint or "")


# ---------------------------------------------------------------- the later commands


def started(path: Path, selection: str) -> Cluster:
    """What `orch up --exclude ...` leaves in .orch/<name>/state.json."""
    run = narrow(load(path), exclude=selection)
    infos = {h.index: HostInfo(f"/jobs/{h.index}", "python3", "2.3", 0, 0.0, False, "", {})
             for h in run.hosts}
    job_state.save(run, job_state.new_state(run, "run1", "10.0.0.2", 29500, infos,
                                            {h.index: Supervisor(1, 1, None, 2, "run1", 0.0) for h in run.hosts}))
    return run


def test_the_state_keeps_the_runs_hosts(tmp_path: Path) -> None:
    path = inventory(tmp_path)
    started(path, "10.0.0.1,10.0.0.3:1")
    st = job_state.load(load(path))
    assert st is not None and st.selection == "--exclude 10.0.0.1,10.0.0.3:1"
    assert [(h.label, h.ranks, h.gpu_ids) for h in st.hosts] == [
        ("10.0.0.2", [0, 1], None), ("10.0.0.3", [2], [0])]
    run = api_jobs.run_cluster(path)
    assert shape(run) == [(0, "10.0.0.2", [0, 1], None), (1, "10.0.0.3", [2], (0,))]
    assert api_jobs.run_cluster(run) is run
    # a state saved before the selection existed still loads, as the whole inventory
    raw = json.loads(job_state.state_path(run).read_text())
    del raw["selection"]
    for h in raw["hosts"]:
        del h["gpu_ids"]
    job_state.state_path(run).write_text(json.dumps(raw))
    assert api_jobs.run_cluster(path).world_size == 6


def test_stop_status_exec_act_on_the_runs_hosts(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = inventory(tmp_path)
    started(path, "0")
    asked: list[str] = []   # the hosts connected to
    monkeypatch.setattr(api_jobs, "new_session",
                        session_maker({"status": status_reply, "stop": stop_reply}, asked=asked))
    status = api.status(path)
    assert [(r.rank, r.host, r.local_rank) for r in status.ranks] == [
        (0, "10.0.0.2", 0), (1, "10.0.0.2", 1), (2, "10.0.0.3", 0), (3, "10.0.0.3", 1)]
    assert sorted(asked) == ["10.0.0.2", "10.0.0.3"]
    assert list(api.stop(path, grace=0).hosts) == ["10.0.0.2", "10.0.0.3"]
    assert sorted(asked) == ["10.0.0.2", "10.0.0.2", "10.0.0.3", "10.0.0.3"]
    with pytest.raises(UsageError, match="names no host"):
        api.exec(path, ["true"], hosts="10.0.0.1")   # not a host of this run
    with pytest.raises(UsageError, match="ranks 0 to 3"):
        api.logs(path, rank=5)


def test_a_dry_run_makes_every_local_check_of_up(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """World size 4 over a split made for 3: `up` would fail before any host with "has no
    split for world size 4"; the dry run fails the same way, not exit 0."""
    path = split_for_three(tmp_path)
    (tmp_path / "job.py").write_text("print('hi')\n")
    assert cli.cli(["up", "-c", str(path), "--dry-run"]) == 0
    capsys.readouterr()
    path.write_text(DATA.replace("  - {address: localhost, connection: local, remote_dir: n/c}\n",
                                 "  - {address: localhost, connection: local, remote_dir: n/c}\n"
                                 "  - {address: localhost, connection: local, remote_dir: n/d}\n"))
    assert cli.cli(["up", "-c", str(path), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert "has no split for world size 4 (splits there: 3)" in err and "fix: " in err, err
    assert out == "" and "Traceback" not in err
    with pytest.raises(DataError, match="has no split for world size 4"):
        launching.local_files(load(path))   # what `up` says: the same check
    path.write_text(DATA.replace("code: {paths: [job.py]}", "code: {paths: [job.py, gone]}"))
    assert cli.cli(["up", "-c", str(path), "--dry-run"]) == 2
    assert "gone" in capsys.readouterr().err
