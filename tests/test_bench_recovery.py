"""bench/recovery.py: what it reads from a run's lines and from metrics.csv (fast), and
its --quick run over real sshd in network namespaces with real torch (slow, root)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import recovery  # noqa: E402
from recovery import Line, column, final_accuracy, mid_epoch, timeline, verdict  # noqa: E402

# what `orch up` shows of a run with restarts: orch's lines and rank 0's, prefixed
RUN = [
    (1.0, "[r0 10.251.0.2] worker.train: 4 process(es), backend gloo, model lenet"),
    (5.0, "[r0 10.251.0.2] epoch 1 step 1/10"),
    (8.0, "[r0 10.251.0.2] epoch   1/5  time     3.0s  epoch   3.0s      400 img/s  "
          "train loss 1.2 acc 0.4  val loss 1.1 acc 0.5  lr 0.001"),
    (9.0, "[r0 10.251.0.2] epoch 2 step 4/10"),
    (9.5, "[r0 10.251.0.2] epoch 2 step 5/10"),
    # the fault at 10.0
    (10.6, "root cause host 10.251.1.2: it went silent before any rank failed"),
    (10.9, "restart 1 of 2 in 2 s after: host 10.251.1.2 was lost; hosts: 10.251.0.2, "
           "10.251.4.2"),
    (20.0, "attempt 2 of 3 (ORCH_RESTART_COUNT=1)"),
    (22.0, "[r0 10.251.0.2] rank 0: resumed from the checkpoint of epoch 1"),
    (25.0, "[r0 10.251.0.2] epoch 2 step 1/10"),
    (26.0, "[r0 10.251.0.2] epoch 2 step 2/10"),
]


def lines(rows: list[tuple[float, str]]) -> list[Line]:
    return [Line(t, text) for t, text in rows]


def test_timeline_reads_detection_restart_first_step_and_the_epochs_redone() -> None:
    tl = timeline(lines(RUN), 10.0)
    assert tl.detect == pytest.approx(0.6) and tl.restart == pytest.approx(0.9)
    assert tl.first_step == pytest.approx(15.0)
    assert (tl.last_done, tl.partial, tl.resumed, tl.restarted) == (1, 0.5, 1, True)
    assert tl.redone == pytest.approx(0.5)


def test_timeline_of_a_run_that_never_restarted_has_no_first_step() -> None:
    tl = timeline(lines(RUN[:6]), 10.0)
    assert not tl.restarted and tl.resumed is None
    assert tl.first_step != tl.first_step and tl.redone != tl.redone   # nan


def test_a_restart_without_a_checkpoint_redoes_everything_done() -> None:
    rows = [r for r in RUN if "resumed" not in r[1]]
    assert timeline(lines(rows), 10.0).redone == pytest.approx(1.5)


def test_a_step_before_the_restart_is_not_the_restarted_runs_first_step() -> None:
    rows = [*RUN[:7], (12.0, "[r0 10.251.0.2] epoch 2 step 6/10"), *RUN[7:]]
    assert timeline(lines(rows), 10.0).first_step == pytest.approx(15.0)


def test_mid_epoch_is_half_way_into_epoch_2_or_later() -> None:
    assert not mid_epoch("[r0 h] epoch 1 step 9/10")
    assert not mid_epoch("[r0 h] epoch 2 step 4/10")
    assert mid_epoch("[r0 h] epoch 2 step 5/10") and mid_epoch("epoch 7 step 1/2")
    assert not mid_epoch("[r0 h] epoch   2/5  time 3.0s")


def test_final_accuracy_is_the_last_rows_val_acc() -> None:
    csv = ("epoch,time_s,train_loss,train_acc,val_loss,val_acc,images_per_s,lr,grad_bytes,"
           "epoch_time_s\n1,3.0,1.2,0.4,1.1,0.5,400,0.001,0,3.0\n"
           "2,6.0,0.9,0.6,0.8,0.7125,410,0.001,0,3.0\n")
    assert final_accuracy(csv) == pytest.approx(0.7125)
    assert column(csv, "epoch_time_s") == [3.0, 3.0]
    with pytest.raises(ValueError):
        final_accuracy("epoch,time_s\n")


def test_verdicts() -> None:
    assert verdict(12.0, 30) == "met" and verdict(31.0, 30) == "MISSED"
    assert verdict(float("nan"), 30) == "-"


def test_the_worker_prints_the_step_lines_the_bench_reads(
        capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    import worker.train as train
    from worker.distrib import Ctx

    main = Ctx(0, 4, 0, 1, torch.device("cpu"), "gloo")
    assert list(train.progress([10, 11, 12, 13], 2, 2, main)) == [10, 11, 12, 13]
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["epoch 2 step 1/4", "epoch 2 step 2/4", "epoch 2 step 4/4"]
    assert all(recovery.STEP.search(p) for p in printed)
    assert train.progress([1], 2, 0, main) == [1]   # off: the loader itself
    other = Ctx(1, 4, 1, 1, torch.device("cpu"), "gloo")
    assert train.progress([1], 2, 1, other) == [1]   # only rank 0 prints


@pytest.mark.ssh
@pytest.mark.slow
def test_quick_run_restarts_after_a_host_kill_and_leaves_nothing(tmp_path: Path) -> None:
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True)
    if probe.returncode != 0 or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 (`ip netns`)")
    out = tmp_path / "recovery.json"
    proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "recovery.py"), "--quick",
                             "--json", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:   # a deadline for a loaded machine (it took 730 s at load 20-30), not a bound
        stdout, stderr = proc.communicate(timeout=1500)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)   # its `finally` ends the sshds, deletes the namespaces
        stdout, stderr = proc.communicate(timeout=120)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "0 still running; 0 processes of the benchmark left; namespaces left: none" in r.stdout
    assert "| host killed | exit 0 |" in r.stdout and "load average" in r.stdout
    got = json.loads(out.read_text())
    (kill,) = got["faults"]
    assert kill["fault"] == "kill" and kill["resumed"] >= 1
    assert kill["first_step_s"] > 0 and kill["redone_epochs"] <= 1
    assert got["reference"]["val_acc"] > 0
