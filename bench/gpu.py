"""Training images/s on one GPU at 224 px: model x batch x precision x input pipeline.

    python bench/gpu.py                       # ResNet-50 and VGG-F, batch 64/128, all modes
    python bench/gpu.py --models resnet50 --batch-sizes 128 --modes amp-cl --workers 12

Without CUDA it says so and exits 0 (``--device cpu`` runs the harness on the CPU, fp32,
for testing it). Every measurement is training steps (forward, backward, SGD with
momentum; ``amp``: autocast fp16 + GradScaler; ``amp-cl``: the same, channels-last)
fed by one input:

- ``synthetic``: normalised float batches already on the GPU: the ceiling;
- ``synthetic-aug``: uint8 batches already on the GPU, augmented and normalised there
  each step, as worker.train does: what augmentation on the GPU costs;
- ``packed``: worker's packed memmap loader (``--workers`` processes writing into a
  page-locked ring shared with this process, copies one step ahead on a side stream),
  then the same augmentation;
- ``packed-torch``: the same files through torch's own path (a shared-memory file per
  batch, then its pin-memory thread): what the ring replaced;
- ``imagefolder``: the same loader over JPEG files decoded with PIL.

The images (``--images`` JPEGs at ``--source-size``, 8 classes) are made in a temp folder
and packed at ``--image-size``, as ``orch split-data --pack`` would. Each measurement runs
``--warmup`` steps, then times a fresh epoch of ``--steps`` steps from an empty prefetch
queue (a full queue would hide a slow loader), with the GPU synchronised at both ends.
Loader efficiency = packed / synthetic images/s (target >= 0.9).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import gputable  # noqa: E402

MODELS = ("resnet50", "vggf", "resnet18", "wrn", "lenet")  # the last three: small, for tests
MODES = ("fp32", "amp", "amp-cl")
INPUTS = ("synthetic", "synthetic-aug", "packed", "packed-torch", "imagefolder")
CLASSES = 8
HEAD = 1000  # ImageNet-sized classifier, as on the real task
DEFAULT_OUT = REPO / "bench" / "out" / "gpu-bench.md"


def _choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{','.join(bad) or repr(text)}: choose from "
                                             f"{','.join(allowed)} (comma-separated)")
        return items
    return parse


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers >= 1, e.g. 64,128")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/gpu.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--models", type=_choices(MODELS), default=["resnet50", "vggf"], help=",".join(MODELS))
    a("--batch-sizes", type=_positive_ints, default=[64, 128], help="images per step, e.g. 64,128")
    a("--modes", type=_choices(MODES), default=list(MODES), help=",".join(MODES))
    a("--inputs", type=_choices(INPUTS), default=list(INPUTS), help=",".join(INPUTS))
    a("--workers", type=_positive, default=min(8, os.cpu_count() or 1),
      help="data-loader processes (packed and imagefolder)")
    a("--image-size", type=_positive, default=224, help="training image side")
    a("--source-size", type=_positive, default=320,
      help="side of the JPEG files (ImageFolder input)")
    a("--images", type=_positive, default=1024,
      help="distinct training images (repeated as needed)")
    a("--steps", type=_positive, default=50, help="timed steps per measurement")
    a("--warmup", type=_positive, default=10, help="untimed steps before (cudnn autotuning)")
    a("--device", choices=("cuda", "cpu"), default="cuda",
      help="cpu: run the harness without a GPU (fp32 only; for tests)")
    a("--out", type=Path, default=DEFAULT_OUT, help="markdown report")
    a("--json", type=Path, help="also write the raw results here")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.device == "cpu" and args.modes != ["fp32"]:
        p.error("--device cpu measures fp32 only: add --modes fp32")
    return args


# ---------------------------------------------------------------------------
# Data: JPEG files, and the same images packed.


def write_images(root: Path, count: int, size: int, seed: int = 0) -> Path:
    """``count`` smooth random JPEGs (compress and decode like photos, unlike pure noise)
    in TrainData/<class>/, plus one validation image per class."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in (("TrainData", count), ("ValidationData", CLASSES)):
        for i in range(n):
            folder = root / split / f"c{i % CLASSES}"
            folder.mkdir(parents=True, exist_ok=True)
            coarse = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
            img = np.asarray(coarse.resize((size, size), Image.Resampling.BICUBIC), dtype=np.int16)
            img = img + rng.integers(-12, 13, img.shape, dtype=np.int16)
            pixels = img.clip(0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{i:06d}.jpg", quality=90)
    return root


def datasets(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from worker.data import ImageFolderBatches, scan_shard
    from worker.pack import pack_shard
    from worker.packed import PackedBatches

    needs = {"packed", "packed-torch", "imagefolder"} & set(args.inputs)
    if not needs:
        return {}
    t0 = time.perf_counter()
    shard = write_images(tmp / "shard", args.images, args.source_size)
    train = scan_shard(shard).train
    out: dict[str, Any] = {"imagefolder": ImageFolderBatches(train, args.image_size)}
    if needs & {"packed", "packed-torch"}:
        packed = pack_shard(shard, args.image_size)
        for name in needs & {"packed", "packed-torch"}:   # one object each: a ring is its own
            out[name] = PackedBatches(packed, "train")
    print(f"data: {args.images} JPEGs {args.source_size}px, packed at {args.image_size}px, "
          f"in {time.perf_counter() - t0:.1f}s", flush=True)
    return out


# ---------------------------------------------------------------------------
# Model and step.


def build_model(name: str) -> Any:
    if name == "resnet50":
        from torchvision.models import resnet50
        return resnet50(weights=None, num_classes=HEAD)
    from worker.models import build_model as worker_model
    return worker_model(name, HEAD)


class Trainer:
    """One model in one precision mode; ``step(x, y)`` is a training step, no host sync
    except GradScaler's own (with amp)."""

    def __init__(self, name: str, mode: str, device: Any) -> None:
        import torch
        self.torch, self.device = torch, device
        self.amp, self.channels_last = mode != "fp32", mode == "amp-cl"
        self.memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        self.model = build_model(name).to(device, memory_format=self.memory_format).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp)
        self.loss = torch.nn.CrossEntropyLoss()

    def step(self, x: Any, y: Any) -> None:
        with self.torch.autocast(self.device.type, dtype=self.torch.float16, enabled=self.amp):
            loss = self.loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()

    def prepare(self, x: Any) -> Any:
        """worker.train's path: NHWC uint8 -> on the device, resized crop + flip, normalised."""
        from worker.augment import augment, normalize
        x = x.to(self.device, non_blocking=True).permute(0, 3, 1, 2)
        return normalize(augment(x, "resized_crop_flip"), self.memory_format)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)


# ---------------------------------------------------------------------------
# Inputs: each an endless-enough iterator of (batch, labels, needs_prepare).


def synthetic(tr: Trainer, batch: int, size: int, raw: bool) -> Callable[[int], Iterator]:
    torch = tr.torch
    y = torch.randint(0, CLASSES, (batch,), device=tr.device)
    if raw:
        x = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, device=tr.device)
    else:
        x = torch.randn(batch, 3, size, size, device=tr.device)
        x = x.contiguous(memory_format=tr.memory_format)

    def epoch(steps: int) -> Iterator:
        return iter([(x, y)] * steps)
    return epoch


def loader(tr: Trainer, dataset: Any, batch: int, args: argparse.Namespace,
           ring: bool) -> Callable[[int], Iterable]:
    from worker.data import DevicePrefetcher, EpochSampler, make_loader

    total = max(args.steps, args.warmup) * batch
    cuda = tr.device.type == "cuda"
    sampler = EpochSampler(len(dataset), batch, seed=0, rank=0, total=total)
    dl = make_loader(dataset, sampler, args.workers, pin_memory=cuda, ring=ring)
    source = DevicePrefetcher(dl, tr.device) if cuda else dl
    return lambda steps: source


def run_steps(tr: Trainer, batches: Iterable, steps: int, prepare: bool) -> tuple[int, float]:
    """Time ``steps`` steps from a fresh iterator; (images, seconds), GPU synchronised."""
    tr.sync()
    t0, n = time.perf_counter(), 0
    for i, (x, y) in enumerate(batches):
        if i == steps:
            break
        tr.step(tr.prepare(x) if prepare else x, y.to(tr.device, non_blocking=True))
        n += len(y)
    tr.sync()
    return n, time.perf_counter() - t0


def measure(tr: Trainer, inp: str, batch: int, args: argparse.Namespace,
            data: dict[str, Any]) -> dict[str, Any]:
    epoch: Callable[[int], Iterable[Any]]
    if inp in ("synthetic", "synthetic-aug"):
        epoch = synthetic(tr, batch, args.image_size, raw=inp == "synthetic-aug")
    else:
        epoch = loader(tr, data[inp], batch, args, ring=inp == "packed")
    prepare = inp != "synthetic"
    ring = None
    try:
        run_steps(tr, epoch(args.warmup), args.warmup, prepare)
        images, seconds = run_steps(tr, epoch(args.steps), args.steps, prepare)
        ring = getattr(data.get(inp), "ring", None)
    finally:
        del epoch
        release(data.get(inp))
    pinned = {} if ring is None else {"ring_pinned": ring.pinned}
    return {"images": images, "seconds": round(seconds, 4), "images_per_s": images / seconds,
            **pinned}


def release(dataset: Any) -> None:
    """A measurement's loader processes, and its dataset's ring, go now, not at exit."""
    from worker.data import end_loaders
    end_loaders()
    if getattr(dataset, "ring", None) is not None:
        dataset.use_ring(None)


def measure_safely(tr: Trainer, inp: str, batch: int, args: argparse.Namespace,
                   data: dict[str, Any]) -> dict[str, Any]:
    try:
        return measure(tr, inp, batch, args, data)
    except tr.torch.cuda.OutOfMemoryError:
        tr.torch.cuda.empty_cache()
        return {"error": "out of GPU memory"}
    except Exception as e:  # e.g. a loader worker died: report it in the table, go on
        return {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"}


def run_all(args: argparse.Namespace, device: Any, data: dict[str, Any]) -> list[dict[str, Any]]:
    results = []
    for name in args.models:
        for mode in args.modes:
            tr = Trainer(name, mode, device)
            for batch in args.batch_sizes:
                for inp in args.inputs:
                    r = {"model": name, "batch": batch, "mode": mode, "input": inp,
                         **measure_safely(tr, inp, batch, args, data)}
                    ok = "images_per_s" in r
                    shown = f"{r['images_per_s']:.0f} images/s" if ok else r["error"]
                    print(f"{name} batch {batch} {mode} {inp}: {shown}", flush=True)
                    results.append(r)
            del tr
            if device.type == "cuda":
                import torch
                torch.cuda.empty_cache()
    return results


def environment(args: argparse.Namespace, device: Any) -> dict[str, str]:
    import torch
    env = {"torch": torch.__version__, "cpus": str(os.cpu_count())}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=str(torch.version.cuda),
                   cudnn=str(torch.backends.cudnn.version()))
    return env


def config(args: argparse.Namespace) -> dict[str, str]:
    return {"device": args.device, "image size": f"{args.image_size}px",
            "loader workers": str(args.workers), "timed steps": str(args.steps),
            "warm-up steps": str(args.warmup),
            "ImageFolder files": f"{args.images} JPEG {args.source_size}px"}


def report(args: argparse.Namespace, env: dict[str, str], results: list[dict[str, Any]]) -> str:
    rep = {"env": env, "config": config(args), "results": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rep, indent=1))
    return gputable.write_markdown(args.out, "GPU training throughput (bench/gpu.py)",
                                   [("Throughput", gputable.bench_markdown(rep))])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print(f"error: torch is not installed for {sys.executable} "
              "(fix: make install, then .venv/bin/python bench/gpu.py)", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: skipping bench/gpu.py (it measures training on a GPU; "
              "--device cpu runs the harness on the CPU)")
        return 0
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    with tempfile.TemporaryDirectory(prefix="orch-bench-gpu-") as tmp:
        data = datasets(args, Path(tmp))
        results = run_all(args, device, data)
    print(report(args, environment(args, device), results))
    print(f"wrote {args.out}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
