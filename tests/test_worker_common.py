"""worker/ data path: shards, packed format, sampler, augmentation, demo data.

Also the helpers the other test_worker_* modules import: a tiny demo data set split
into worker shards, and a torchrun launcher that proves its processes are gone.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from sshd_cluster import free_port, pids_with_env
from worker import demo_data, pack
from worker.augment import augment, crop_flip, normalize, resized_crop_flip
from worker.data import EpochSampler, ImageFolderBatches, end_loaders, make_loader, scan_shard
from worker.errors import WorkerError
from worker.packed import PackedBatches, find_packed, read_index

REPO = Path(__file__).resolve().parents[1]
SIZE = 16


# ---------------------------------------------------------------- helpers


def make_data(root: Path, classes: int = 3, train: int = 24, val: int = 6,
              size: int = SIZE) -> Path:
    return demo_data.generate(root, classes=classes, train_per_class=train,
                              val_per_class=val, image_size=size, seed=0)


def split(src: Path, out: Path, workers: int) -> Path:
    """Every k-th file of each class to worker k, as symlinks (orch split-data's layout)."""
    for part in ("TrainData", "ValidationData"):
        for cdir in sorted((src / part).iterdir()):
            files = sorted(cdir.iterdir())
            for w in range(workers):
                dest = out / f"worker_{w}_of_{workers}" / part / cdir.name
                dest.mkdir(parents=True, exist_ok=True)
                for f in files[w::workers]:
                    os.symlink(f.resolve(), dest / f.name)
    return out


class Torchrun:
    """Runs ``torchrun -m worker.train`` with a marker in its environment.

    Every process it starts (torchrun, the ranks, their loaders) inherits the marker, so
    the test can find them all by it, even those that outlived their parent.
    """

    def __init__(self, tmp: Path) -> None:
        self.marker = f"ORCH_WORKER_TEST={uuid.uuid4().hex}"
        self.tmp = tmp
        self.runs = 0

    def start(self, nproc: int, args: list[str], data_dir: Path, out_dir: Path) -> subprocess.Popen:
        self.runs += 1
        log_dir = self.tmp / f"torchrun-logs-{self.runs}"
        port = free_port(["127.0.0.1"], start=29600, stop=29900)
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
        env.update({"ORCH_DATA_DIR": str(data_dir), "ORCH_OUTPUT_DIR": str(out_dir),
                    "PYTHONPATH": str(REPO), self.marker.split("=")[0]: self.marker.split("=")[1]})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "--log-dir", str(log_dir), "--redirects", "3",
               "-m", "worker.train", *args]
        self.log_dir = log_dir
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def run(self, nproc: int, args: list[str], data_dir: Path, out_dir: Path,
            timeout: float = 90) -> tuple[int, str]:
        proc = self.start(nproc, args, data_dir, out_dir)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            proc.communicate()
            pytest.fail(f"torchrun did not finish within {timeout}s (a hang)")
        return proc.returncode, output

    def rank_log(self, rank: int, stream: str) -> str:
        """What rank ``rank`` wrote to stdout/stderr in the latest run (torchrun --redirects)."""
        files = sorted(self.log_dir.glob(f"**/attempt_0/{rank}/{stream}.log"))
        return files[-1].read_text() if files else ""

    def alive(self) -> list[int]:
        return pids_with_env(self.marker)

    def kill(self) -> None:
        for pid in self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


@pytest.fixture
def torchrun(tmp_path: Path) -> Iterator[Torchrun]:
    runner = Torchrun(tmp_path)
    yield runner
    left = runner.alive()
    runner.kill()
    assert not left, f"processes left behind by the test: {left}"


# ---------------------------------------------------------------- demo data


def test_demo_data_layout_and_determinism(tmp_path: Path) -> None:
    a = make_data(tmp_path / "a", classes=3, train=4, val=2)
    b = make_data(tmp_path / "b", classes=3, train=5, val=2)
    names = sorted(p.name for p in (a / "TrainData").iterdir())
    assert names == sorted(demo_data.class_names(3))
    assert len(list((a / "ValidationData" / names[0]).glob("*.png"))) == 2
    for f in (a / "TrainData").rglob("*.png"):  # more images per class extend, not change
        assert f.read_bytes() == (b / f.relative_to(a)).read_bytes()


def test_demo_data_cli(tmp_path: Path) -> None:
    rc = demo_data.main(["--out", str(tmp_path / "d"), "--classes", "2", "--train-per-class", "3",
                         "--val-per-class", "1", "--image-size", "8"])
    assert rc == 0
    assert len(list((tmp_path / "d").rglob("*.png"))) == 2 * (3 + 1)


# ---------------------------------------------------------------- shards


def test_scan_shard_layouts(tmp_path: Path) -> None:
    data = make_data(tmp_path / "d", classes=2, train=10, val=3)
    files = scan_shard(data)
    assert files.classes == sorted(demo_data.class_names(2))
    assert (len(files.train), len(files.val)) == (20, 6)
    plain = scan_shard(data / "TrainData")  # a plain ImageFolder: every 10th image held out
    assert (len(plain.train), len(plain.val)) == (18, 2)
    assert not {f for f, _ in plain.train} & {f for f, _ in plain.val}


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "does not exist"),
    (lambda d: (d / "TrainData" / "a").mkdir(parents=True), "holds no training images"),
])
def test_scan_shard_errors(tmp_path: Path, setup, message: str) -> None:
    setup(tmp_path / "s")
    with pytest.raises(WorkerError, match=message):
        scan_shard(tmp_path / "s")


def test_packed_matches_imagefolder(tmp_path: Path) -> None:
    shard = make_data(tmp_path / "s", classes=3, train=7, val=3, size=20)
    out = pack.pack_shard(shard, 16)
    assert out == shard / "packed" and find_packed(shard, 16)[0] == out
    assert find_packed(shard, 32)[0] is None  # another training size: not used
    files = scan_shard(shard)
    assert read_index(out)["classes"] == files.classes
    for split_name, items in (("train", files.train), ("val", files.val)):
        packed, folder = PackedBatches(out, split_name), ImageFolderBatches(items, 16)
        assert len(packed) == len(folder) == len(items)
        for batch in ([0, 1, 2], list(range(len(items)))):
            (pi, pl), (fi, fl) = packed[batch], folder[batch]
            assert pi.dtype == torch.uint8 and pi.shape == (len(batch), 16, 16, 3)
            assert torch.equal(pi, fi) and torch.equal(pl, fl)


def test_pack_cli_and_repack(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    shard = make_data(tmp_path / "s", classes=2, train=3, val=1)
    assert pack.main(["--src", str(shard), "--image-size", "8"]) == 0
    assert pack.main(["--src", str(shard), "--image-size", "12"]) == 0  # replaces the old one
    assert read_index(shard / "packed")["image_size"] == 12
    assert [p.name for p in shard.iterdir() if p.name.startswith(".")] == []
    assert pack.main(["--src", str(tmp_path / "nope"), "--image-size", "8"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_packed_dataset_survives_pickling(tmp_path: Path) -> None:
    import pickle

    shard = make_data(tmp_path / "s", classes=2, train=3, val=1)
    ds = PackedBatches(pack.pack_shard(shard, 8), "train")
    ds[[0]]
    clone = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker receives
    assert clone._images is None and torch.equal(clone[[1, 2]][0], ds[[1, 2]][0])


@pytest.mark.parametrize("workers", [1, 2])
def test_ring_batches_are_the_sampled_images_and_slots_go_round(tmp_path: Path,
                                                                 workers: int) -> None:
    """The loader processes write each batch into its ring slot (shared memory, no pin on
    the CPU); what arrives is exactly images[indices] and labels[indices], over two epochs
    (persistent workers), a short last batch included; the slots go round in order."""
    from worker.ring import SLACK, PinnedRing, RingBatch, SlotSampler

    shard = make_data(tmp_path / "s", classes=3, train=9, val=1)
    ds, ref = (PackedBatches(pack.pack_shard(shard, 8), "train") for _ in range(2))
    sampler = EpochSampler(len(ds), 4, seed=0, rank=0, total=len(ds) + 2)
    slots = 2 * workers + SLACK
    ds.use_ring(PinnedRing(slots, 4, ds.item_shape, pin=False))
    assert ds.ring is not None and not ds.ring.pinned
    loader = torch.utils.data.DataLoader(ds, sampler=SlotSampler(sampler, slots), batch_size=None,
                                         num_workers=workers, persistent_workers=True,
                                         prefetch_factor=2)
    try:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            want = list(sampler)
            got = []
            for k, batch in enumerate(loader):
                assert isinstance(batch, RingBatch) and batch.slot == k % slots
                x, y = ds.ring.view(batch)
                got.append((x.clone(), y.clone()))  # a consumer copies it at once
            assert len(got) == len(want) == len(sampler)
            for (x, y), idx in zip(got, want):
                wx, wy = ref[idx]
                assert torch.equal(x, wx) and torch.equal(y, wy)
    finally:
        end_loaders()


def test_without_a_gpu_make_loader_keeps_torchs_path(tmp_path: Path) -> None:
    shard = make_data(tmp_path / "s", classes=2, train=3, val=1)
    ds = PackedBatches(pack.pack_shard(shard, 8), "train")
    loader = make_loader(ds, EpochSampler(len(ds), 2, 0, 0), 1, pin_memory=False, ring=True)
    try:
        assert ds.ring is None and isinstance(loader.sampler, EpochSampler)
        assert [len(y) for _, y in loader] == [2, 2, 2]
    finally:
        end_loaders()


# ---------------------------------------------------------------- sampler and augmentation


def test_sampler_pads_to_total_and_reshuffles() -> None:
    s = EpochSampler(n=10, batch_size=4, seed=0, rank=1, total=13)
    batches = list(s)
    assert len(batches) == len(s) == 4 and sum(map(len, batches)) == 13
    assert {i for b in batches for i in b} == set(range(10))
    assert all(b == sorted(b) for b in batches)
    assert list(s) == batches  # deterministic for a given epoch
    s.set_epoch(1)
    assert list(s) != batches


def test_crop_flip_is_a_shifted_or_flipped_copy() -> None:
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.int64).remainder(251).to(torch.uint8)
    x = x.view(2, 3, 8, 8)
    gen = torch.Generator().manual_seed(0)
    out = crop_flip(x, pad=0, gen=gen)  # no padding: either the image or its mirror
    for i in range(2):
        assert torch.equal(out[i], x[i]) or torch.equal(out[i], x[i].flip(-1))
    padded = crop_flip(x, pad=2, gen=torch.Generator().manual_seed(1))
    assert padded.shape == x.shape and padded.dtype == torch.uint8


def test_augment_policies_shapes_and_normalize() -> None:
    x = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    for policy in ("none", "crop_flip", "resized_crop_flip"):
        out = augment(x, policy, torch.Generator().manual_seed(0))
        assert out.shape == x.shape and float(out.min()) >= 0 and float(out.max()) <= 255
    # The whole image at scale 1 and ratio 1: each sample comes back as is or mirrored.
    full = resized_crop_flip(x, torch.Generator().manual_seed(0), scale=(1.0, 1.0),
                             ratio=(1.0, 1.0))
    for i in range(4):
        assert torch.equal(full[i], x[i]) or torch.equal(full[i], x[i].flip(-1))
    norm = normalize(torch.full((1, 3, 1, 1), 255, dtype=torch.uint8))
    assert torch.allclose(norm.view(3), torch.tensor([(1 - m) / s for m, s in
                                                      zip((0.485, 0.456, 0.406),
                                                          (0.229, 0.224, 0.225))]))
    assert np.isfinite(norm.numpy()).all()
