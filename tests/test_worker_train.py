"""worker.train end to end: one process in-process, two processes under torchrun (gloo)."""
from __future__ import annotations

import csv
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from test_worker_common import Torchrun, make_data, split, torchrun  # noqa: F401 (fixture)
from worker import checkpoint, train
from worker.data import EpochSampler
from worker.metrics import COLUMNS
from worker.models import LeNet

# Adam on the demo's colour+shape classes learns in a few epochs even at 16x16.
FAST = ["--model", "lenet", "--image-size", "16", "--batch-size", "16", "--optimizer", "adam",
        "--lr", "0.003", "--workers", "0"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("worker-data")
    data = make_data(root / "demo", classes=3, train=40, val=10)
    return {w: split(data, root / f"shards{w}", w) for w in (1, 2)}


def rows(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def run_main(args: list[str]) -> int:
    return train.main(args)


def lenet_params(classes: int = 3) -> int:
    return sum(p.numel() for p in LeNet(classes).parameters())


# ---------------------------------------------------------------- one process


@pytest.mark.slow
def test_single_process_learns_and_writes_metrics(single, shards, tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = run_main([*FAST, "--epochs", "4", "--data-dir", str(shards[1]), "--output-dir", str(out)])
    assert rc == 0
    table = rows(out)
    assert list(table[0])[:9] == list(COLUMNS[:9])
    assert [int(r["epoch"]) for r in table] == [1, 2, 3, 4]
    assert float(table[-1]["train_loss"]) < float(table[0]["train_loss"])
    for r in table:
        assert 0 <= float(r["train_acc"]) <= 1 and 0 <= float(r["val_acc"]) <= 1
        assert float(r["images_per_s"]) > 0
        assert int(r["grad_bytes"]) == 0  # one process: no process group, nothing sent
    assert float(table[-1]["time_s"]) > float(table[0]["time_s"])
    assert (out / "metrics.png").stat().st_size > 0
    assert [e for e, _ in checkpoint.list_checkpoints(out)] == [3, 4]  # the newest two kept


@pytest.mark.slow
def test_early_stopping_stops_after_patience_epochs_at_target(single, shards,
                                                              tmp_path: Path) -> None:
    out, target, patience = tmp_path / "out", 0.6, 2
    rc = run_main([*FAST, "--epochs", "25", "--target-accuracy", str(target),
                   "--patience", str(patience), "--checkpoint-every", "0",
                   "--data-dir", str(shards[1]), "--output-dir", str(out)])
    assert rc == 0
    accs = [float(r["val_acc"]) for r in rows(out)]
    streak, expected = 0, None
    for epoch, acc in enumerate(accs, 1):
        streak = streak + 1 if acc >= target else 0
        if streak == patience:
            expected = epoch
            break
    assert expected is not None, f"never {patience} epochs at {target}: {accs}"
    assert len(accs) == expected < 25


@pytest.mark.slow
def test_packed_shard_is_used_when_present(single, shards, tmp_path: Path, capsys) -> None:
    from worker.pack import pack_shard

    data = make_data(tmp_path / "d", classes=3, train=10, val=4)
    shard_root = split(data, tmp_path / "shards", 1)
    pack_shard(shard_root / "worker_0_of_1", 16)
    rc = run_main([*FAST, "--epochs", "1", "--data-dir", str(shard_root),
                   "--output-dir", str(tmp_path / "out"), "--data-format", "packed"])
    assert rc == 0 and "(packed)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--model", "alexnet"], "error: rank 0: argument --model: invalid choice: 'alexnet'"),
    (["--target-accuracy", "95"], "error: rank 0: argument --target-accuracy"),
])
def test_bad_options_are_one_line_errors(single, argv, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        train.parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith(message) and err.count("\n") == 1


def test_missing_data_dir_is_one_line_error(single, tmp_path: Path, capsys) -> None:
    rc = run_main(["--output-dir", str(tmp_path / "out"), "--workers", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and err == ("error: rank 0: no data folder: ORCH_DATA_DIR is not set "
                               "(fix: run under `orch up`, or pass --data-dir DIR)\n")


def test_unreadable_image_in_a_loader_worker_is_one_line(single, tmp_path: Path, capsys) -> None:
    data = make_data(tmp_path / "d", classes=2, train=4, val=2)
    shard_root = split(data, tmp_path / "shards", 1)
    bad = shard_root / "worker_0_of_1" / "TrainData" / "circle" / "broken.png"
    bad.write_bytes(b"not a png")
    rc = run_main([*FAST, "--workers", "1", "--epochs", "1", "--data-dir", str(shard_root),
                   "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith(f"error: cannot read image {bad}") and err.count("\n") == 1, err
    # its loader worker is ended as main returns, not by a later garbage collection that
    # waits 5 s for it (data.end_loaders)
    assert not multiprocessing.active_children()


def test_class_missing_on_one_rank_names_the_rank() -> None:
    with pytest.raises(train.WorkerError, match="rank 1 has no images of class b"):
        train._check_classes([(["a", "b"], 5, 1), (["a"], 5, 1)])


def test_unequal_shards_run_the_same_number_of_steps() -> None:
    total = 13
    assert len(EpochSampler(13, 4, 0, 0, total)) == len(EpochSampler(9, 4, 0, 1, total)) == 4


# ---------------------------------------------------------------- two processes (torchrun)


@pytest.mark.slow
def test_two_processes_learn_with_fp16_gradients(torchrun: Torchrun,
                                                 shards: dict[int, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc, output = torchrun.run(2, [*FAST, "--epochs", "3", "--lr-scaling", "none",
                                  "--grad-compression", "fp16"], shards[2], out)
    assert rc == 0, output
    table = rows(out)
    assert [int(r["epoch"]) for r in table] == [1, 2, 3]
    # 60 / 16: 4 fp16 steps
    assert {int(r["grad_bytes"]) for r in table} == {4 * 2 * lenet_params()}
    assert float(table[-1]["train_loss"]) < float(table[0]["train_loss"])
    assert "2 process(es), backend gloo" in torchrun.rank_log(0, "stdout")
    for rank in (0, 1):
        assert f"rank {rank}: 60 train / 15 validation images" in torchrun.rank_log(rank, "stdout")
    assert torchrun.rank_log(1, "stdout").count("epoch ") == 0  # only rank 0 reports epochs
    assert (out / "metrics.png").exists()


@pytest.mark.slow
def test_kill_then_resume_continues_on_both_ranks(torchrun: Torchrun,
                                                  shards: dict[int, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = torchrun.start(2, [*FAST, "--epochs", "200"], shards[2], out)
    deadline = time.monotonic() + 90
    while not checkpoint.list_checkpoints(out) or checkpoint.list_checkpoints(out)[-1][0] < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint of epoch 2"
        time.sleep(0.05)
    torchrun.kill()  # SIGKILL torchrun and both ranks, wherever they are in the epoch
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while torchrun.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not torchrun.alive()
    saved, newest = checkpoint.list_checkpoints(out)[-1]
    assert 2 <= saved < 200
    held = torch.load(newest, weights_only=True)  # a kill never leaves a broken file
    assert {"model", "optimizer", "scheduler", "epoch", "rng"} <= set(held)
    assert len(held["rng"]) == 2
    rc, output = torchrun.run(2, [*FAST, "--epochs", str(saved + 2), "--resume"], shards[2], out)
    assert rc == 0, output
    for rank in (0, 1):
        resumed = f"rank {rank}: resumed from the checkpoint of epoch {saved}\n"
        assert resumed in torchrun.rank_log(rank, "stdout")
    assert [int(r["epoch"]) for r in rows(out)] == list(range(1, saved + 3))
    assert float(rows(out)[-1]["time_s"]) > float(rows(out)[saved - 1]["time_s"])


@pytest.mark.slow
def test_missing_shard_stops_every_rank_with_one_line(torchrun: Torchrun,
                                                      shards: dict[int, Path],
                                                      tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "worker_0_of_2").symlink_to(shards[2] / "worker_0_of_2")
    t0 = time.monotonic()
    rc, output = torchrun.run(2, FAST, data_dir, tmp_path / "out", timeout=60)
    assert rc != 0 and time.monotonic() - t0 < 60
    for rank in (0, 1):
        err = torchrun.rank_log(rank, "stderr")
        missing = f"error: rank 1: shard folder {data_dir}/worker_1_of_2 does not exist"
        assert err.startswith(missing), err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert "exitcode  : 2" in output
