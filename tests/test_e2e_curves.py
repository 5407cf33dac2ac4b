"""Curves from the job's files over real SSH (#35 item 2): a run followed to its end
(`api.run`, what an attached `orch up` runs) brings
every rank's host's metrics files back while the job runs (watch/curvefetch.py), so a
row written on a host is read here (watch/curves.py) before the job ends; the last rows
come with the job's end."""
from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any

import pytest

from helpers import Jobs, assert_nothing_left, job_dir, wait_until, write_job
from orchestrator import api
from orchestrator.config.inventory import load
from orchestrator.watch import curves
from orchestrator.watch import events as ev
from sshd_cluster import SshdCluster

# rank 0 writes metrics.csv as worker.train does, rank 1 a JSON-lines file of its own and
# TensorBoard scalars; each writes its second row only once the test drops `go` into its
# output/. The scalars are written as torch's SummaryWriter writes them: its add_scalar
# puts this Summary in an Event and hands it to tensorboard's EventFileWriter, which it
# wraps (same file name, same records), without the 4.5 s of CPU of importing torch;
# test_curves_units reads a file of torch's own SummaryWriter.
JOB = """\
import json, os, time
out, rank = os.environ["ORCH_OUTPUT_DIR"], int(os.environ["RANK"])
os.makedirs(out, exist_ok=True)

class SummaryWriter:   # torch.utils.tensorboard's add_scalar, flush and close
    def __init__(self, logdir):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        self.writer = EventFileWriter(logdir)

    def add_scalar(self, tag, value, step):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value))])
        self.writer.add_event(Event(summary=summary, wall_time=time.time(), step=int(step)))

    def flush(self):
        self.writer.flush()

    def close(self):
        self.writer.close()

tb = None
if rank == 1:   # and TensorBoard scalars, as a third-party script's SummaryWriter writes them
    tb = SummaryWriter(os.path.join(out, "tb", "rank1"))

def row(epoch):
    if rank == 0:
        path = os.path.join(out, "metrics.csv")
        new = not os.path.exists(path)
        with open(path, "a") as f:
            f.write(("epoch,train_loss,val_acc\\n" if new else "") +
                    "%d,%g,%g\\n" % (epoch, 1.0 / epoch, 0.4 + epoch / 10))
    else:
        with open(os.path.join(out, "rank-%d.jsonl" % rank), "a") as f:
            f.write(json.dumps({"step": epoch * 100, "loss": 2.0 / epoch}) + "\\n")
        tb.add_scalar("tb/acc", 0.25 * epoch, epoch)
        tb.flush()

row(1)
print("epoch 1 written", flush=True)
while not os.path.exists(os.path.join(out, "go")):
    time.sleep(0.05)
row(2)
if tb is not None:
    tb.close()
print("epoch 2 written", flush=True)
"""


@pytest.mark.ssh
@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="the tensorboard package (orch[curves]) is not installed")
def test_a_running_jobs_metrics_arrive_before_it_ends(
        sshd_cluster: SshdCluster, tmp_path: Path, jobs: Jobs) -> None:
    hosts, name = sshd_cluster.hosts[:2], "e2e-curves"
    write_job(tmp_path, JOB)
    inv = sshd_cluster.write_inventory(tmp_path / "cluster.yaml", hosts=hosts, name=name)
    jobs.add(inv, hosts, name)
    cluster = load(inv)
    first, second = cluster.hosts[0].label, cluster.hosts[1].label
    lines: list[str] = []
    ended: list[Any] = []

    def on_event(e: ev.Event) -> None:
        if isinstance(e, ev.RankLine):
            lines.append(e.text)

    def attached() -> None:
        try:
            ended.append(api.run(inv, on_event=on_event))
        except BaseException as e:   # the test's thread reports it
            ended.append(e)
    run = threading.Thread(target=attached, daemon=True)
    run.start()
    wait_until(lambda: lines.count("epoch 1 written") == 2 or ended, 120,
               "both ranks to write their first row")
    assert not ended, ended

    want = {(first, 0): {"train_loss": 1.0, "val_acc": 0.5}, (second, 1): {"loss": 2.0, "tb/acc": 0.25}}
    seen: list = []

    def arrived() -> bool:
        seen[:] = [curves.latest(curves.read_curves(cluster))]
        return seen[0] == want
    try:
        wait_until(arrived, 30, "both ranks' first rows to arrive here")
    except AssertionError as e:
        raise AssertionError(f"{e}; read here: {seen}") from None
    assert run.is_alive() and not ended, "the job ended before its metrics were read"
    ranks = {r.rank: r.metrics for r in api.status(inv).ranks}   # `orch status --json`
    assert ranks == {0: {"train_loss": 1.0, "val_acc": 0.5}, 1: {"loss": 2.0, "tb/acc": 0.25}}
    local = tmp_path / "outputs" / name
    assert (local / "metrics.csv").is_file()
    assert (tmp_path / ".orch" / name / "curves" / second / "rank-1.jsonl").is_file()

    for h in hosts:
        (job_dir(h, name) / "output" / "go").touch()
    run.join(120)
    assert ended and isinstance(ended[0], api.RunResult) and ended[0].code == 0, ended
    series = {(s.host, s.name): s for s in curves.read_curves(cluster)}
    assert [p.epoch for p in series[(first, "train_loss")].points] == [1, 2]
    assert [(p.step, p.value) for p in series[(second, "loss")].points] == [(100, 2.0), (200, 1.0)]
    assert [(p.step, p.value) for p in series[(second, "tb/acc")].points] == [(1, 0.25), (2, 0.5)]
    assert not list(local.rglob("*.orch-part-*"))
    assert_nothing_left(hosts, name)
