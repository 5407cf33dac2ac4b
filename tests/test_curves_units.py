"""Curves from the job's own files (#35 item 2) without SSH: metrics.csv (as worker.train
writes it), JSON lines, TensorBoard event files (written by torch's SummaryWriter, read
by the tensorboard package), hostile files (huge, binary, malformed) noted and skipped,
and the fetch from every rank's host behind the real Link with the real agent/pull.py
(tests/fake_agent.py)."""
from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from fake_agent import FakeTransport, later
from helpers import wait_until
from orchestrator.config.inventory import Cluster, parse
from orchestrator.files.pull import Entry
from orchestrator.remote.link import HostDone
from orchestrator.session.session import Session
from orchestrator.watch import curvefetch, curves
from test_protocol import Collect, started
from test_pull import agent_handlers
from worker import metrics as worker_metrics

INVENTORY = """name: fake
hosts:
  - {address: alpha, connection: local, remote_dir: %(remote)s/a, procs: 2}
  - {address: beta, connection: local, remote_dir: %(remote)s/b, procs: 2}
job: {entrypoint: job.py}
"""


def cluster_at(tmp_path: Path) -> Cluster:
    return parse(INVENTORY % {"remote": tmp_path / "remote"}, tmp_path / "cluster.yaml")


def worker_csv(path: Path, epochs: int) -> None:
    """metrics.csv through worker.train's own writer (worker/metrics.py)."""
    worker_metrics.start(path, None)
    for e in range(1, epochs + 1):
        worker_metrics.append(path, {
            "epoch": e, "time_s": 10.0 * e, "train_loss": 1.0 / e, "train_acc": 0.5 + e / 100,
            "val_loss": 1.1 / e, "val_acc": 0.4 + e / 100, "images_per_s": 1000 + e,
            "lr": 0.1, "grad_bytes": 4096, "epoch_time_s": 10.0})


def series_by_name(got: list[curves.Series]) -> dict[str, curves.Series]:
    return {s.name: s for s in got}


# ---------------------------------------------------------------- parsing

def test_worker_metrics_csv_gives_one_curve_per_column(tmp_path: Path) -> None:
    cluster = cluster_at(tmp_path)
    worker_csv(curves.outputs_dir(cluster) / "metrics.csv", 3)
    notes: list[str] = []
    got = series_by_name(curves.read_curves(cluster, notes=notes))
    assert notes == []
    assert set(got) == {"train_loss", "train_acc", "val_loss", "val_acc", "images_per_s", "lr",
                        "grad_bytes", "epoch_time_s"}      # epoch and time_s are axes
    loss = got["train_loss"]
    assert (loss.host, loss.rank, loss.source) == ("alpha", 0, "metrics.csv")
    assert [(p.epoch, p.step, p.value, p.time) for p in loss.points] == [
        (1, None, 1.0, None), (2, None, 0.5, None), (3, None, pytest.approx(1 / 3), None)]
    assert curves.latest(list(got.values()))[("alpha", 0)]["val_acc"] == pytest.approx(0.43)


def test_a_last_line_still_being_written_is_left_for_later(tmp_path: Path) -> None:
    cluster = cluster_at(tmp_path)
    out = curves.outputs_dir(cluster)
    out.mkdir(parents=True)
    (out / "metrics.csv").write_text("epoch,loss\n1,0.5\n2,0.4\n3,0.3")
    (out / "log.jsonl").write_text('{"step": 1, "loss": 2}\n{"step": 2, "lo')
    got = curves.read_curves(cluster)
    assert [p.value for s in got if s.source == "metrics.csv" for p in s.points] == [0.5, 0.4]
    assert [p.step for s in got if s.source == "log.jsonl" for p in s.points] == [1]


def test_jsonl_steps_epochs_wall_time_nested_and_bad_lines(tmp_path: Path) -> None:
    cluster = cluster_at(tmp_path)
    beta = curves.local_root(cluster, cluster.hosts[1])
    assert beta == tmp_path / ".orch" / "fake" / "curves" / "beta"
    (beta / "logs").mkdir(parents=True)
    lines = [{"step": 10, "loss": 2.5, "time": 1_800_000_000.5, "val": {"acc": 0.25}},
             "not json", [1, 2], {"loss": 1.0},   # no step or epoch
             {"epoch": 2, "loss": 1.5, "ok": True, "name": "x", "big": float("inf")}]
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    (beta / "logs" / "rank3.jsonl").write_text(text)
    notes: list[str] = []
    got = series_by_name(curves.read_curves(cluster, notes=notes))
    assert set(got) == {"loss", "val/acc"}      # bools, strings and inf are no values
    loss = got["loss"]
    assert (loss.host, loss.rank, loss.source) == ("beta", 3, "logs/rank3.jsonl")
    assert [(p.step, p.epoch, p.value, p.time) for p in loss.points] == [
        (10, None, 2.5, 1_800_000_000.5), (None, 2, 1.5, None)]
    assert notes == ["beta: output/logs/rank3.jsonl: 3 lines not a JSON object with `step` "
                     "or `epoch` (first: line 2); skipped"]
    assert curves.latest(list(got.values())) == {("beta", 3): {"loss": 1.5, "val/acc": 0.25}}


def test_huge_binary_and_malformed_files_are_notes_never_errors(tmp_path: Path,
                                                                monkeypatch) -> None:
    cluster = cluster_at(tmp_path)
    out = curves.outputs_dir(cluster)
    out.mkdir(parents=True)
    monkeypatch.setattr(curves, "MAX_TEXT", 1000)
    (out / "metrics.csv").write_text("epoch,loss\n" + "1,0.5\n" * 500)        # 3 kB
    (out / "metrics-bin.csv").write_bytes(b"epoch,loss\n\0\0\xff\xfe" * 10)
    (out / "deep.jsonl").write_text("[" * 900 + "\n")                     # nested past reason
    (out / "metrics-quote.csv").write_text('epoch,loss\n1,"unclosed\n')
    (out / "events.out.tfevents.1.h.1.0").write_bytes(os.urandom(4096))       # not records
    (out / "other.txt").write_text("epoch,loss\n1,2\n")                       # not a metrics file
    notes: list[str] = []
    got = curves.read_curves(cluster, notes=notes)
    assert [s.source for s in got] == []
    text = "\n".join(notes)
    assert "output/metrics.csv: 3011 bytes, more than 1000 (not read)" in text, text
    assert "output/metrics-bin.csv: binary" in text, text
    assert "output/deep.jsonl: 1 line not a JSON object" in text, text


def test_series_points_and_counts_are_capped(tmp_path: Path, monkeypatch) -> None:
    cluster = cluster_at(tmp_path)
    out = curves.outputs_dir(cluster)
    out.mkdir(parents=True)
    monkeypatch.setattr(curves, "MAX_POINTS", 100)
    (out / "metrics.csv").write_text("step,loss\n" + "".join(f"{i},{i}\n" for i in range(1000)))
    (loss,) = curves.read_curves(cluster)
    assert len(loss.points) == 100 and loss.points[0].step == 0 and loss.points[-1].step == 999
    monkeypatch.setattr(curves, "MAX_SERIES", 5)
    cols = ",".join(f"m{i}" for i in range(20))
    (out / "metrics.csv").write_text(f"step,{cols}\n0,{','.join('1' * 20)}\n")
    notes: list[str] = []
    assert len(curves.read_curves(cluster, notes=notes)) == 5


def test_array_task_curves_are_those_under_its_folder(tmp_path: Path) -> None:
    cluster = cluster_at(tmp_path)
    out = curves.outputs_dir(cluster)
    for task in (0, 1, 12):
        worker_csv(out / f"task-{task}" / "metrics.csv", task + 1)
    one = curves.read_curves(cluster, task=12)
    assert {s.source for s in one} == {"task-12/metrics.csv"}
    assert len(one[0].points) == 13
    assert curves.task_of("task-3/x/metrics.csv") == 3 and curves.task_of("metrics.csv") is None


def test_tensorboard_scalars_from_summary_writer(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter
    cluster = cluster_at(tmp_path)
    logdir = curves.local_root(cluster, cluster.hosts[1]) / "tb" / "rank-2"
    with SummaryWriter(str(logdir)) as w:
        for step in range(5):
            w.add_scalar("train/loss", 1.0 / (step + 1), step)
            w.add_scalar("lr", 0.1, step)
    notes: list[str] = []
    got = series_by_name(curves.read_curves(cluster, notes=notes))
    assert notes == [] and set(got) == {"train/loss", "lr"}
    loss = got["train/loss"]
    assert (loss.host, loss.rank) == ("beta", 2)
    assert loss.source.startswith("tb/rank-2/events.out.tfevents.")
    assert [p.step for p in loss.points] == [0, 1, 2, 3, 4]
    assert loss.points[-1].value == pytest.approx(0.2) and loss.points[0].time is not None
    # a file cut short (still being written) gives what it holds
    path = logdir / loss.source.rsplit("/", 1)[-1]
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 7])
    cut = series_by_name(curves.read_curves(cluster))    # the last record was lr's
    assert (len(cut["train/loss"].points), len(cut["lr"].points)) == (5, 4)


def test_no_tensorboard_installed_is_one_note_with_the_fix(tmp_path: Path, monkeypatch) -> None:
    cluster = cluster_at(tmp_path)
    out = curves.outputs_dir(cluster)
    out.mkdir(parents=True)
    (out / "events.out.tfevents.1.h.1.0").write_bytes(b"x" * 64)
    real = builtins.__import__

    def no_tb(name: str, *args: Any, **kw: Any) -> Any:
        if name.startswith("tensorboard"):
            raise ImportError(name)
        return real(name, *args, **kw)
    monkeypatch.setattr(builtins, "__import__", no_tb)
    notes: list[str] = []
    assert curves.read_curves(cluster, notes=notes) == []
    assert notes == ["alpha: output/events.out.tfevents.1.h.1.0: a TensorBoard event file, "
                     "not read: pip install 'orch[curves]' (the tensorboard package reads them)"]


# ---------------------------------------------------------------- the fetch, fake hosts

def session(tmp_path: Path, handlers: dict) -> Session:
    cluster = cluster_at(tmp_path)
    return Session(cluster, connector=lambda h: FakeTransport(h, handlers)).open()


def remote_out(tmp_path: Path, label: str) -> Path:
    out = tmp_path / "remote" / ("a" if label == "alpha" else "b") / "fake" / "output"
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_fetch_brings_every_hosts_metrics_files_only_and_then_only_changes(
        tmp_path: Path, monkeypatch) -> None:
    a, b = remote_out(tmp_path, "alpha"), remote_out(tmp_path, "beta")
    worker_csv(a / "metrics.csv", 1)
    (a / "checkpoints").mkdir()
    (a / "checkpoints" / "epoch-1.pt").write_bytes(b"w" * 5000)       # not a metrics file
    (b / "rank-3.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    monkeypatch.setattr(curves, "MAX_TEXT", 10_000)
    monkeypatch.setattr(curves, "MAX_EVENTS", 30_000)
    (b / "metrics-huge.csv").write_text("epoch,loss\n" + "1,1\n" * 5000)  # over the cap
    (b / "events.out.tfevents.1.h.2.0").write_bytes(b"x" * 40_000)       # the host hashes not
    with session(tmp_path, agent_handlers()) as s:
        notes = curves.Notes()
        assert curvefetch.once(s, notes) == 2
        assert sorted(notes) == [
            "beta: output/events.out.tfevents.1.h.2.0: larger than 30000 bytes (not hashed)",
            "beta: output/metrics-huge.csv: 20011 bytes, more than 10000 (not fetched)"]
        cluster = s.cluster
        local = curves.outputs_dir(cluster)
        assert (local / "metrics.csv").read_bytes() == (a / "metrics.csv").read_bytes()
        assert not (local / "checkpoints").exists()
        assert (cluster.state_dir / "curves" / "beta" / "rank-3.jsonl").exists()
        assert curvefetch.once(s) == 0                      # nothing changed: nothing sent
        worker_metrics.append(a / "metrics.csv", {"epoch": 2, "train_loss": 0.25})
        assert curvefetch.once(s) == 1
        got = curves.latest(curves.read_curves(cluster))
        assert got[("alpha", 0)]["train_loss"] == 0.25
        assert got[("beta", 3)] == {"loss": 3.0}
    assert not list(local.rglob("*.orch-part-*"))


def test_the_fetch_thread_rounds_and_the_checkpoint_keeper_share_one_link(
        tmp_path: Path) -> None:
    """A curves round and a checkpoint keeper's round at once on the same links: file
    data carries no request id, so their pull streams take turns (Link.pull_lock)."""
    from dataclasses import replace

    from orchestrator.session.keeper import Keeper
    a = remote_out(tmp_path, "alpha")
    remote_out(tmp_path, "beta")
    (a / "checkpoints").mkdir()
    for i in range(8):
        (a / "checkpoints" / f"e{i}.pt").write_bytes(os.urandom(300_000))
        (a / f"m{i}.jsonl").write_bytes(b'{"step": 1, "x": 1}\n' * 20_000)
    with session(tmp_path, agent_handlers()) as s:
        s.cluster = replace(s.cluster, job=replace(s.cluster.job,
                                                   checkpoint=("output/checkpoints/*.pt",)))
        keeper = Keeper(s, s.cluster, interval=0.05, settle=0.0)
        fetch = curvefetch.CurveFetch(s, interval=0.05)
        errors: list[str] = []
        threads = [threading.Thread(target=lambda: errors.append(str(keeper.round()))),
                   threading.Thread(target=lambda: errors.append(str(fetch.round())))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert keeper.last_error is None and fetch.notes == [], (keeper.last_error, fetch.notes)
        assert len(keeper.latest()) == 8 and fetch.version == 1


# ---------------------------------------------------------------- the terminal

def test_status_shows_a_loss_and_an_accuracy_per_rank_only_when_written() -> None:
    import io

    from rich.console import Console

    from orchestrator.api.outcomes import RankStatus
    from orchestrator.commands import status
    assert status.metric_text({"train_loss": 0.23456, "val_acc": 0.9, "lr": 0.1}) == \
        "train_loss 0.2346  val_acc 0.9"
    assert status.metric_text({"my/Loss_x": 2.0}) == "my/Loss_x 2"
    assert status.metric_text({"lr": 0.1}) == ""

    def shown(metrics: dict[str, float]) -> str:
        r = RankStatus(rank=0, host="h", local_rank=0, pid=1, state="running", exit_code=None,
                       runtime_s=1.0, last_line="epoch 1", metrics=metrics)
        con = Console(file=io.StringIO(), width=120, record=True)
        con.print(status.table("j", [r], width=120))
        return con.export_text()
    assert "metric" in shown({"loss": 0.5}) and "loss 0.5" in shown({"loss": 0.5})
    assert "metric" not in shown({})
    # a metric's name is the job's text: shown escaped, never a terminal sequence
    assert "\x1b" not in shown({"\x1b[31mloss": 1.0})


def test_sparkline_scales_between_min_and_max() -> None:
    from orchestrator.commands.render import sparkline
    assert sparkline([0.1, 0.5, 0.8]) == "\u2581\u2585\u2588"
    assert sparkline([1.0, 1.0]) == "\u2584\u2584" and sparkline([]) == ""
    assert len(sparkline([float(i) for i in range(100)])) == 24


def test_a_files_note_is_warned_once_per_process(tmp_path: Path, monkeypatch, caplog) -> None:
    """`orch status --watch` reads every 2 s: a bad file is said once, not every time."""
    monkeypatch.setattr(curves, "SAID", set())
    cluster = cluster_at(tmp_path)
    out = curves.outputs_dir(cluster)
    out.mkdir(parents=True)
    (out / "log.jsonl").write_text("oops\n")
    with caplog.at_level("WARNING", logger="orchestrator"):
        for lines in ("oops\n", "oops\nagain\n"):
            (out / "log.jsonl").write_text(lines)
            curves.read_curves(cluster)
        notes = curves.Notes()
        notes.add("beta: connection lost", say=False)   # a host's round: not a warning
    said = [r.getMessage() for r in caplog.records]
    assert said == ["alpha: output/log.jsonl: 1 line not a JSON object with `step` or "
                    "`epoch` (first: line 1); skipped"], said


def test_a_hosts_listing_is_capped_in_files_and_each_round_in_bytes(monkeypatch) -> None:
    monkeypatch.setattr(curves, "SAID", set())
    monkeypatch.setattr(curves, "MAX_FILES", 3)
    digest = "0" * 64
    remote = {f"m{i}.jsonl": Entry(10, digest) for i in range(5)}
    remote.update({"model.pt": Entry(10, digest),
                   "events.out.tfevents.1": Entry(curves.MAX_EVENTS + 1, digest)})
    notes = curves.Notes()
    got = curvefetch.capped(remote, notes, "h")
    assert list(got) == ["m0.jsonl", "m1.jsonl", "m2.jsonl"]       # no checkpoint, no giant
    assert any("events.out.tfevents.1" in n and "not fetched" in n for n in notes), notes
    assert any("more than 3 metrics files" in n for n in notes), notes
    monkeypatch.setattr(curvefetch, "MAX_ROUND", 25)
    assert list(curvefetch.within_round(got)) == ["m0.jsonl", "m1.jsonl"]   # the rest next round
    assert list(curvefetch.within_round({"big": Entry(100, digest)})) == ["big"]  # always one


def test_a_round_starts_no_thread_for_a_host_with_nothing_listed(tmp_path: Path,
                                                                monkeypatch) -> None:
    """Every host's listing is asked before any is read; only a host whose listing
    names a file gets a fetch thread (at 1,000 hosts: not 1,000 threads every round)."""
    a = remote_out(tmp_path, "alpha")
    remote_out(tmp_path, "beta")
    threaded: list[list[str]] = []
    from orchestrator.remote.fanout import fan_out as real

    def counted(hosts, fn):   # type: ignore[no-untyped-def]
        threaded.append([h.label for h in hosts])
        return real(hosts, fn)
    monkeypatch.setattr(curvefetch, "fan_out", counted)
    with session(tmp_path, agent_handlers()) as s:
        assert curvefetch.once(s) == 0 and threaded == [[]]
        worker_csv(a / "metrics.csv", 1)
        assert curvefetch.once(s) == 1 and threaded[-1] == ["alpha"]


def test_a_host_let_go_gets_its_last_look_in_the_background(tmp_path: Path) -> None:
    """release() returns at once; the last look at the host (its rows written as its
    ranks ended) runs in the release's thread, and the fetch's final stop waits for it."""
    a = remote_out(tmp_path, "alpha")
    worker_csv(a / "metrics.csv", 2)
    handlers = agent_handlers()
    slow = handlers["pull_manifest"]

    def late(chan, msg: dict) -> None:   # the host takes a while to list
        later(0.5, lambda: slow(chan, msg))
    handlers["pull_manifest"] = late
    with session(tmp_path, handlers) as s:
        fetch = curvefetch.CurveFetch(s, interval=3600)
        fetch.done.set()   # no rounds of its own: only the last look and the final one
        s.before_release.append(fetch.last_look)
        t0 = time.monotonic()
        s.release(0)
        assert time.monotonic() - t0 < 0.3 and fetch.looking == 1
        fetch.stop(final=True)
        assert fetch.looking == 0 and fetch.version == 1
    local = curves.outputs_dir(s.cluster) / "metrics.csv"
    assert local.read_bytes() == (a / "metrics.csv").read_bytes()


def listings_counted() -> tuple[dict, list[int]]:
    """The fake agents' handlers, each listing (`pull_manifest`) recorded by host index."""
    handlers = agent_handlers()
    listing, asked = handlers["pull_manifest"], []

    def counted(chan, msg: dict) -> None:
        asked.append(chan.host.index)
        listing(chan, msg)
    handlers["pull_manifest"] = counted
    return handlers, asked


def test_a_host_whose_done_counted_no_curves_file_gets_no_last_look(tmp_path: Path) -> None:
    """The follow's `done` counts the curves' files there (HostDone.curves): a host with
    none is let go without a listing (1,000 of them ended a job on 1,000 hosts); one
    with files gets its look."""
    handlers, asked = listings_counted()
    with session(tmp_path, handlers) as s:
        fetch = curvefetch.CurveFetch(s, interval=3600)
        fetch.done.set()   # no rounds of its own: only the last looks
        s.before_release.append(fetch.last_look)
        s.links[0].ended = HostDone(0, curves=0)
        s.links[1].ended = HostDone(0, curves=2)
        s.release(0)
        s.release(1)
        fetch.stop(final=True)
    assert asked == [1]


def ended(sink: Collect) -> Callable[[], bool]:
    return lambda: bool(sink.done or sink.lost)


def test_a_real_agents_done_counts_the_files_the_curves_globs_match(tmp_path: Path) -> None:
    """Over pipes, a real agent's follow of a job that never ran: its `done` counts the
    matching files under output/ and the links a listing would name; without `curves`
    asked, no count."""
    out = tmp_path / "output"
    (out / "sub").mkdir(parents=True)
    worker_csv(out / "metrics.csv", 1)
    (out / "sub" / "rank-1.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("not a curve\n")
    (out / "events.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    link = started(tmp_path)
    try:
        got = []
        for extra in ({"curves": list(curves.GLOBS)}, {}):
            sink = Collect()
            link.follow(sink, job_dir=str(tmp_path), ranks=[0], tail=-1, mode="events", **extra)
            wait_until(ended(sink), 30, "the follow's end")
            got.append(sink.done[0].curves)
    finally:
        link.close()
    assert got == [3, None]


def test_a_fetch_of_a_job_just_launched_waits_its_interval_before_the_first_round(
        tmp_path: Path) -> None:
    """`start(wait_first=True)` (a run's attempt, an array: just launched, nothing
    written yet): no listing until the interval passed or the final round; `start()`
    (the dashboard on a running job): a round at once."""
    handlers, asked = listings_counted()
    with session(tmp_path, handlers) as s:
        fetch = curvefetch.CurveFetch(s, interval=3600).start(wait_first=True)
        time.sleep(0.5)
        assert asked == []
        fetch.stop(final=True)
        assert sorted(asked) == [0, 1] and fetch.rounds == 1
        now = curvefetch.CurveFetch(s, interval=3600).start()
        wait_until(lambda: len(asked) == 4, 10, "a round at once")
        now.stop()


def test_a_follows_count_of_the_curves_loads_no_hashlib(tmp_path: Path) -> None:
    """The count at a host's end walks output/ without pull.py: its hashlib (OpenSSL) was
    ~5 ms of CPU on every host, all at once when a job of 1,000 hosts stopped."""
    (tmp_path / "output").mkdir()
    worker_csv(tmp_path / "output" / "metrics.csv", 1)
    code = ("import sys\n"
            "from orchestrator.agent import follow\n"
            f"p = follow.job_paths({str(tmp_path)!r})\n"
            f"print(follow.curves_count(p, {list(curves.GLOBS)!r}), 'hashlib' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["{'curves':", "1}", "False"], out.stdout
