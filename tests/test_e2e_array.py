"""Job arrays over real SSH (the fake sshd cluster): more tasks than slots, the queue on
each host, `[t<i> host]` output, a failing task that does not stop the others, results,
status, logs --task; stop and --fail-fast end queued and running tasks, nothing left.

The task is a stand-in script (no torch): it records its start and end times, sleeps,
writes metrics.csv into ORCH_OUTPUT_DIR and prints."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from helpers import Jobs, assert_nothing_left, orch, wait_until, write_job
from orchestrator import api
from sshd_cluster import SshdCluster

pytestmark = [pytest.mark.ssh, pytest.mark.slow]

TASK = r'''
import json, os, sys, time
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
i = int(os.environ["ORCH_TASK"])
rec = {"task": i, "job_dir": os.environ["ORCH_JOB_DIR"], "slot": os.environ["ORCH_TASK_SLOT"],
       "args": os.environ["ORCH_TASK_ARGS"], "world": os.environ.get("WORLD_SIZE"),
       "data": sorted(os.listdir(os.environ["ORCH_DATA_DIR"])), "start": time.time()}
print("task", i, "starts", flush=True)
time.sleep(float(os.environ["TASK_SLEEP"]) * (300 if args.get("--model") == "slow" else 1))
if args.get("--model") == "bad" and args.get("--fold") == "1":
    print("task", i, "fails", flush=True)
    sys.exit(3)
acc = 0.5 + 0.1 * int(args["--fold"])
with open(os.path.join(os.environ["ORCH_OUTPUT_DIR"], "metrics.csv"), "w") as f:
    f.write("epoch,val_acc,val_loss\n1,0.1,2.0\n2,%r,1.0\n" % acc)
rec["end"] = time.time()
with open(os.path.join(os.environ["TRACE"], "task-%d.json" % i), "w") as f:
    json.dump(rec, f)
print("task", i, "done", flush=True)
'''
PREFIX = re.compile(r"^\[t(\d+) (\S+)\] (.*)$")


def inventory(cluster: SshdCluster, tmp_path: Path, name: str, matrix: dict, sleep: float) -> Path:
    write_job(tmp_path, TASK, "task.py")
    (tmp_path / "trace").mkdir()
    # data for an array: one split for procs_per_task (1) that every host gets whole
    shard = tmp_path / "shards" / "worker_0_of_1"
    shard.mkdir(parents=True)
    (shard / "x.bin").write_bytes(b"x" * 100)
    (tmp_path / "shards" / "manifest.json").write_text(json.dumps({"version": 1, "splits": {"1": {
        "kind": "files", "source": str(tmp_path), "seed": 0,
        "shards": [{"name": "worker_0_of_1", "bytes": 100, "files": [["x.bin", 100]]}]}}}))
    return cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=cluster.hosts[:3], procs=[2, 1, 1], name=name,
        entrypoint="task.py", code_paths=["task.py"], args=["--epochs", "1"],
        env={"TRACE": str(tmp_path / "trace"), "TASK_SLEEP": str(sleep)},
        top={"job": {"array": {"matrix": matrix}}, "data": {"shards": "shards"}})


def traces(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "trace").glob("*.json"))]


def most_at_once(spans: list[tuple[float, float]]) -> int:
    points = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    now = top = 0
    for _, step in points:
        now += step
        top = max(top, now)
    return top


def test_array_queue_results_status_logs(sshd_cluster: SshdCluster, tmp_path: Path,
                                         jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[:3], "e2e-array"
    inv = inventory(sshd_cluster, tmp_path, name, {"model": ["good", "bad"], "fold": [0, 1, 2, 3, 4]}, 0.4)
    jobs.add(inv, hosts, name)
    up = orch(tmp_path, "up", str(inv), timeout=180)
    assert up.returncode == 1, up.stdout + up.stderr     # task 6 (bad, fold 1) failed
    assert "task 6 on" in up.stderr and "the others go on" in up.stderr
    lines = [PREFIX.match(l) for l in up.stdout.splitlines() if l.startswith("[t")]
    assert {int(m[1]) for m in lines if m and m[3].endswith("starts")} == set(range(10))

    done = traces(tmp_path)
    assert sorted(t["task"] for t in done) == [i for i in range(10) if i != 6]
    for t in done:   # no torchrun, no group; every host got the whole dataset
        assert t["world"] is None and t["data"] == ["worker_0_of_1"]
    assert done[0]["args"] == "--model good --fold 0"
    by_host: dict[str, list[dict]] = {}
    for t in done:
        by_host.setdefault(t["job_dir"], []).append(t)
    procs = {str(h.remote_dir / name): p for h, p in zip(hosts, [2, 1, 1])}
    assert set(by_host) == set(procs)
    for job_dir, mine in by_host.items():
        assert most_at_once([(t["start"], t["end"]) for t in mine]) <= procs[job_dir]
    first_end = min(t["end"] for t in done)
    assert any(t["start"] >= first_end for t in done), "no task waited in a queue"

    res = orch(tmp_path, "results", "-c", str(inv), "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    rows = {r["task"]: r for r in got["tasks"]}
    assert len(rows) == 10 and rows[6]["state"] == "failed (exit code 3)" and rows[6]["metrics"] == {}
    assert rows[3]["metrics"] == {"epoch": "2", "val_acc": "0.8", "val_loss": "1.0"}
    # each task's curve: its metrics.csv fetched from the host that ran it
    assert (rows[3]["curve_metric"], rows[3]["curve"]) == ("val_acc", [0.1, 0.8])
    assert rows[6]["curve"] == [] and rows[6]["curve_metric"] == ""
    shown = orch(tmp_path, "results", "-c", str(inv),
                 env={**os.environ, "PYTHONIOENCODING": "utf-8", "COLUMNS": "200"})
    assert "▁█ val_acc" in shown.stdout, shown.stdout
    good = next(g for g in got["groups"] if g["params"] == {"model": "good"})
    assert good["tasks"] == [0, 1, 2, 3, 4] and good["metrics"]["val_acc"]["mean"] == pytest.approx(0.7)
    assert good["metrics"]["val_acc"]["std"] == pytest.approx(0.15811, abs=1e-4)
    assert (tmp_path / ".orch" / name / "results.csv").read_text().splitlines()[0] == \
        "task,model,fold,state,epoch,val_acc,val_loss"

    st = json.loads(orch(tmp_path, "status", "-c", str(inv), "--json").stdout)
    assert [r["state"] for r in st["tasks"]].count("exited 0") == 9
    # slots are dealt h0 h1 h2 h0 ...: task 6 ran on the third host
    assert st["tasks"][6]["last_line"] == "task 6 fails"
    assert st["tasks"][6]["host"] == hosts[2].address
    logs = orch(tmp_path, "logs", "-c", str(inv), "--task", "7")
    assert logs.stdout == "task 7 starts\ntask 7 done\n", logs.stdout
    assert_nothing_left(hosts, name)


def test_array_stop_and_fail_fast(sshd_cluster: SshdCluster, tmp_path: Path,
                                  jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[:3], "e2e-array-stop"
    inv = inventory(sshd_cluster, tmp_path, name, {"model": ["slow"], "fold": list(range(8))}, 1.0)
    jobs.add(inv, hosts, name)
    up = orch(tmp_path, "up", str(inv), "--detach")
    assert up.returncode == 0, up.stderr

    def states() -> list[str]:
        return [t.state for t in api.array_status(inv).tasks]
    wait_until(lambda: states().count("running") == 4, 60, "4 tasks running")
    assert states().count("queued") == 4
    stop = orch(tmp_path, "stop", str(inv), "--grace", "2")
    assert stop.returncode == 0, stop.stderr
    assert_nothing_left(hosts, name)
    assert states() == ["stopped"] * 8

    # --fail-fast: the first failure ends every running and queued task
    fail = inventory(sshd_cluster, tmp_path / "ff", name, {"model": ["bad", "slow"], "fold": [1, 2, 3, 4]}, 1.0)
    ff = orch(tmp_path / "ff", "up", str(fail), "--fail-fast", timeout=120)
    assert ff.returncode == 1, ff.stdout + ff.stderr
    assert "--fail-fast: stopping" in ff.stderr
    # tasks 0-3 are "bad" (task 0 fails after 1 s, 1-3 exit 0 after 1 s), tasks 4-7 "slow"
    # (300 s): every slow task, running or still queued, was ended by the stop. (None can
    # have run to its end: the up returned within its 120 s, so no trace line could show it.)
    after = [t.state for t in api.array_status(fail).tasks]
    assert after[0] == "failed (exit code 3)", after
    assert set(after[1:4]) <= {"exited 0", "stopped"}, after
    assert after[4:] == ["stopped"] * 4, after
    assert_nothing_left(hosts, name)


RANK_TASK = r'''
import json, os, time
rank = int(os.environ["RANK"])
rec = {k: os.environ.get(k) for k in ("ORCH_TASK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                      "ORCH_OUTPUT_DIR", "MASTER_PORT")}
rec["data"] = sorted(os.listdir(os.environ["ORCH_DATA_DIR"]))
rec["start"] = time.time()
time.sleep(0.5)
rec["end"] = time.time()
if rank == 0:
    with open(os.path.join(os.environ["ORCH_OUTPUT_DIR"], "metrics.csv"), "w") as f:
        f.write("val_acc\n0.%s\n" % os.environ["ORCH_TASK"])
with open(os.path.join(os.environ["TRACE"], "task-%s-rank-%d.json" % (os.environ["ORCH_TASK"], rank)), "w") as f:
    json.dump(rec, f)
print("rank", rank, "of task", os.environ["ORCH_TASK"], flush=True)
'''


def test_procs_per_task_2_is_a_small_torchrun_per_task(sshd_cluster: SshdCluster, tmp_path: Path,
                                                       jobs: Jobs) -> None:
    """procs_per_task: 2 on one host with procs 2: each task is a torchrun of 2 ranks
    (WORLD_SIZE 2), the tasks run one after another, rank r reads worker_<r>_of_2."""
    host, name = sshd_cluster.hosts[0], "e2e-array-ppt"
    write_job(tmp_path, RANK_TASK, "task.py")
    (tmp_path / "trace").mkdir()
    shards = []
    for r in range(2):
        (tmp_path / "shards" / f"worker_{r}_of_2").mkdir(parents=True)
        (tmp_path / "shards" / f"worker_{r}_of_2" / "x.bin").write_bytes(b"x" * 10)
        shards.append({"name": f"worker_{r}_of_2", "bytes": 10, "files": [["x.bin", 10]]})
    (tmp_path / "shards" / "manifest.json").write_text(json.dumps({"version": 1, "splits": {"2": {
        "kind": "files", "source": str(tmp_path), "seed": 0, "shards": shards}}}))
    inv = sshd_cluster.write_inventory(
        tmp_path / "cluster.yaml", hosts=[host], procs=[2], name=name, entrypoint="task.py",
        code_paths=["task.py"], env={"TRACE": str(tmp_path / "trace")},
        top={"job": {"array": {"matrix": {"fold": [0, 1]}, "procs_per_task": 2}},
             "data": {"shards": "shards"}})
    jobs.add(inv, [host], name)
    up = orch(tmp_path, "up", str(inv), timeout=180)
    assert up.returncode == 0, up.stdout + up.stderr
    recs = traces(tmp_path)
    assert sorted((r["ORCH_TASK"], r["RANK"]) for r in recs) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert {(r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"]) for r in recs} == {("2", "2")}
    assert all(r["data"] == ["worker_0_of_2", "worker_1_of_2"] for r in recs)
    spans = {t: (min(r["start"] for r in recs if r["ORCH_TASK"] == t),
                 max(r["end"] for r in recs if r["ORCH_TASK"] == t)) for t in ("0", "1")}
    assert most_at_once(list(spans.values())) == 1, f"2 slots hold one 2-process task at a time: {spans}"
    res = json.loads(orch(tmp_path, "results", "-c", str(inv), "--json").stdout)
    assert [r["metrics"] for r in res["tasks"]] == [{"val_acc": "0.0"}, {"val_acc": "0.1"}]
    assert_nothing_left([host], name)
