"""worker.train's command line: its options, their types and the checks between them.
Every rank parses the same argv and exits on an error before any rendezvous. worker.hogwild
builds on the same parser pieces."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, NoReturn

from worker.models import ALIASES, DEFAULT_IMAGE_SIZE, MODELS
from worker.optim import SCHEDULES


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # Every rank parses the same argv: each exits here, before any rendezvous.
        rank = os.environ.get("RANK", "0")
        self.exit(2, f"error: rank {rank}: {message} (fix: {self.prog} --help)\n")


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in (0, 1], e.g. 0.95")
    return value


def _positive(kind: type, zero_ok: bool = False) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'>= 0' if zero_ok else '> 0'}, got {text}")
        return value
    return parse


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        # Show a default only where it says something (not None/False, not already in the help).
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) or ""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m worker.train", formatter_class=_Help,
                description="DDP training on each rank's own data shard; run it under torchrun "
                            "(orch up does), or alone as one process.")
    a = p.add_argument
    a("--model", choices=MODELS + tuple(ALIASES), default="lenet",
      help="network to train (vgg: another name for vggf)")
    a("--pretrained", type=Path, metavar="PATH",
      help="weights file to start from (rank 0 reads it; nothing is downloaded)")
    a("--epochs", type=_positive(int), default=10, help="epochs to train at most")
    a("--batch-size", type=_positive(int), default=64, help="images per step and process")
    a("--lr", type=_positive(float), default=0.01, help="base learning rate (for 1 process)")
    a("--lr-scaling", choices=("linear", "sqrt", "none"), default="linear",
      help="lr = base x world size | x sqrt(world size) | x 1")
    a("--momentum", type=_positive(float, zero_ok=True), default=0.9, help="SGD momentum")
    a("--weight-decay", type=_positive(float, zero_ok=True), default=0.0, help="L2 penalty")
    a("--optimizer", choices=("sgd", "adam", "novograd"), default="sgd", help="optimiser")
    a("--warmup-epochs", type=_positive(float, zero_ok=True), default=0.0,
      help="linear warm-up from lr/world size to lr over this many epochs")
    a("--lr-schedule", choices=SCHEDULES, default="none",
      help="after the warm-up: constant | cosine annealing to 0 over the epochs | cosine "
           "annealing with warm restarts (cycles of --restart-epochs, doubling); per step")
    a("--restart-epochs", type=_positive(float), default=2.0,
      help="--lr-schedule warm: length of the first cycle in epochs (T_0; T_mult is 2)")
    a("--folds", type=_positive(int), metavar="K",
      help="K-fold cross-validation of the training set: validate on fold --fold, train on the rest")
    a("--fold", type=_positive(int, zero_ok=True), metavar="k", help="which fold validates (0..K-1)")
    a("--dist-backend", choices=("auto", "nccl", "gloo"), default="auto",
      help="auto: nccl with CUDA, else gloo, and no process group for one process; "
           "nccl or gloo: that backend, with a group even for one process")
    a("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (CUDA only)")
    a("--amp", action="store_true", help="mixed precision (CUDA only)")
    a("--channels-last", action="store_true", help="NHWC memory format (CUDA only)")
    a("--target-accuracy", type=_fraction, metavar="FRACTION",
      help="stop once validation accuracy reaches it (e.g. 0.95) ...")
    a("--patience", type=_positive(int), default=1, help="... for this many epochs in a row")
    a("--seed", type=_positive(int, zero_ok=True), default=0,
      help="seed of weights, shuffling and augmentation")
    a("--image-size", type=_positive(int), metavar="PIXELS",
      help="training image side (default: 224 for vggf and resnet18, 32 otherwise)")
    a("--workers", type=_positive(int, zero_ok=True), default=2,
      help="data-loader processes per rank (0: in-process)")
    a("--data-format", choices=("auto", "packed", "imagefolder"), default="auto",
      help="auto: the shard's packed/ arrays when they match --image-size, else image files")
    a("--checkpoint-every", type=_positive(int, zero_ok=True), default=1,
      help="epochs between checkpoints (0: never)")
    a("--resume", action="store_true", help="continue from the newest checkpoint, if any")
    a("--log-every", type=_positive(int, zero_ok=True), default=0, metavar="STEPS",
      help="rank 0 prints `epoch E step S/T` after every STEPS training steps (0: never)")
    a("--data-dir", type=Path, default=os.environ.get("ORCH_DATA_DIR"), metavar="DIR",
      help="folder of worker_<r>_of_<W> shards (default: $ORCH_DATA_DIR)")
    a("--tensorboard", action="store_true",
      help="rank 0 also writes each epoch's metrics as TensorBoard scalars under "
           "<output-dir>/tensorboard/ (needs the tensorboard package on the hosts)")
    a("--output-dir", type=Path, default=Path(os.environ.get("ORCH_OUTPUT_DIR") or "output"),
      metavar="DIR", help="metrics and checkpoints (default: $ORCH_OUTPUT_DIR, else ./output)")
    a("--grad-compression", choices=("none", "fp16", "terngrad"), default="none",
      help="gradient communication (worker/compression.py)")
    a("--clip-factor", type=_positive(float), help="TernGrad: scaler = c x std(g) (paper: 2.5)")
    a("--size-to-binarize", type=_positive(int), default=256,
      help="TernGrad: tensors with fewer elements stay float")
    a("--quantize-logits", action="store_true", help="TernGrad: quantise the last layer too")
    a("--error-feedback", action="store_true",
      help="TernGrad: add what each rank's last message left out to its next gradient")
    a("--terngrad-adam-correction", action="store_true", default=None,
      help="TernGrad with Adam: feed Adam's second moment a square with the variance of "
           "the ternary draws taken out (the default with --grad-compression terngrad "
           "and --optimizer adam, unless --error-feedback or --amp)")
    a("--no-terngrad-adam-correction", dest="terngrad_adam_correction", action="store_false",
      help="TernGrad with Adam as the paper has it, without the correction (for comparison)")
    return p


def check_folds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.folds is None and args.fold is None:
        return
    if args.folds is None or args.fold is None:
        parser.error("--folds K and --fold k go together (e.g. --folds 3 --fold 0)")
    if args.folds < 2 or args.fold >= args.folds:
        parser.error(f"--folds {args.folds} --fold {args.fold}: need K >= 2 and 0 <= k < K")


def check_error_feedback(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--error-feedback changes TernGrad's codes; it means nothing for the other kinds."""
    if getattr(args, "error_feedback", False) and args.grad_compression != "terngrad":
        parser.error("--error-feedback works with --grad-compression terngrad only")
    if getattr(args, "terngrad_adam_correction", False) is None:
        # unset: on where it applies, since it brings TernGrad with Adam within a point of
        # fp32 at no cost in bytes (docs/explanation/performance.md); off elsewhere
        args.terngrad_adam_correction = (
            args.grad_compression == "terngrad" and getattr(args, "optimizer", "") == "adam"
            and not getattr(args, "error_feedback", False) and not getattr(args, "amp", False))
    if not getattr(args, "terngrad_adam_correction", False):
        return
    if args.grad_compression != "terngrad" or args.optimizer != "adam":
        parser.error("--terngrad-adam-correction works with --grad-compression terngrad "
                     "and --optimizer adam only")
    if args.error_feedback:
        parser.error("--terngrad-adam-correction assumes stochastic ternaries and "
                     "--error-feedback rounds to the nearest: use one of them")
    if args.amp:
        parser.error("--terngrad-adam-correction does not work with --amp (the hook sees "
                     "scaled gradients): drop one of them")


def parse_args(argv: list[str] | None = None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """`parser`: another program's (worker.hogwild), checked and completed the same way."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    check_folds(parser, args)
    check_error_feedback(parser, args)
    args.model = ALIASES.get(args.model, args.model)
    args.image_size = args.image_size or DEFAULT_IMAGE_SIZE[args.model]
    return args
