"""worker.train --tensorboard (#35 item 2): rank 0's epoch rows as TensorBoard scalars,
read back by orch's curves reader; without the tensorboard package, one line, exit 2."""
from __future__ import annotations

import builtins
from pathlib import Path
from typing import Any

import pytest

from orchestrator.watch import curves
from test_worker_common import make_data, split
from worker import metrics, train

FAST = ["--model", "lenet", "--image-size", "16", "--batch-size", "16", "--workers", "0",
        "--checkpoint-every", "0"]


@pytest.fixture(scope="module")
def shard_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tb-data")
    return split(make_data(root / "demo", classes=3, train=20, val=4), root / "shards", 1)


@pytest.mark.slow   # trains
def test_scalars_match_metrics_csv(single, shard_root: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    out = tmp_path / "out"
    rc = train.main([*FAST, "--epochs", "2", "--tensorboard", "--data-dir", str(shard_root),
                     "--output-dir", str(out)])
    assert rc == 0
    rows = metrics.read_rows(out / "metrics.csv")
    (event,) = (out / metrics.TENSORBOARD_DIR).glob("events.out.tfevents.*")
    notes = curves.Notes()
    got = curves.parse_events(event, notes, "h")
    assert notes == [] and {"train_loss", "val_acc", "images_per_s", "lr"} <= set(got)
    assert [p.step for p in got["val_acc"]] == [1, 2]
    assert [p.value for p in got["train_loss"]] == pytest.approx(
        [float(r["train_loss"]) for r in rows], rel=1e-6)


def test_without_tensorboard_one_line_and_exit_2(single, shard_root: Path, tmp_path: Path,
                                                 monkeypatch, capsys) -> None:
    real = builtins.__import__

    def no_tb(name: str, *args: Any, **kw: Any) -> Any:
        if name.startswith(("torch.utils.tensorboard", "tensorboard")):
            raise ImportError(name)
        return real(name, *args, **kw)
    monkeypatch.setattr(builtins, "__import__", no_tb)
    rc = train.main([*FAST, "--epochs", "1", "--tensorboard", "--data-dir", str(shard_root),
                     "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "--tensorboard: the tensorboard package is not installed" in err
    assert "Traceback" not in err
