"""worker/: models, optimisers and schedule, checkpoints, metrics (no process group)."""
from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from worker import checkpoint, metrics, stopping
from worker.errors import WorkerError
from worker.models import LeNet, WideResNet, build_model, load_pretrained, logits_param_names, vggf
from worker.optim import NovoGrad, make_optimizer, make_scheduler, scaled_lr, warmup_factor

# ---------------------------------------------------------------- models


def test_vggf_classifier_is_vgg16_with_the_new_head() -> None:
    with torch.device("meta"):  # shapes and types only: no 550 MB of weights to initialise
        model = vggf(num_classes=5)
    c, features = model.classifier, model.features
    assert isinstance(c, nn.Sequential) and isinstance(features, nn.Sequential)
    assert [type(m) for m in c[:6]] == [nn.Linear, nn.ReLU, nn.Dropout, nn.Linear, nn.ReLU,
                                        nn.Dropout]
    fc6, fc7, head = c[0], c[3], c[6]
    assert isinstance(fc6, nn.Linear) and isinstance(fc7, nn.Linear)
    assert (fc6.in_features, fc6.out_features, fc7.out_features) == (512 * 7 * 7, 4096, 4096)
    assert isinstance(head, nn.Sequential)
    assert [type(m) for m in head] == [nn.Linear, nn.ReLU, nn.Dropout, nn.Linear]
    fc, dropout, out = head[0], head[2], head[3]
    assert isinstance(fc, nn.Linear) and isinstance(dropout, nn.Dropout)
    assert isinstance(out, nn.Linear)
    assert (fc.in_features, fc.out_features) == (4096, 512)
    assert dropout.p == 0.6
    assert (out.in_features, out.out_features) == (512, 5)
    convs = [m for m in features if isinstance(m, nn.Conv2d)]
    assert len(convs) == 13  # VGG-16: 13 conv + 3 fully connected stages
    assert logits_param_names(model) == {"classifier.6.3.weight", "classifier.6.3.bias"}


def test_wrn_is_the_tutorial_network() -> None:
    model = WideResNet(num_classes=4)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert sorted({c.out_channels for c in convs}) == [16, 160, 320, 640]
    assert {m.p for m in model.modules() if isinstance(m, nn.Dropout)} == {0.01}
    assert isinstance(model.features[-2], nn.AdaptiveAvgPool2d)
    assert model(torch.zeros(1, 3, 16, 16)).shape == (1, 4)


@pytest.mark.parametrize("name", ["lenet", "wrn", "mobilenet"])
def test_models_take_any_image_size(name: str) -> None:
    model = build_model(name, 3).eval()
    for size in (16, 40):
        assert model(torch.zeros(2, 3, size, size)).shape == (2, 3)


def test_unknown_model_is_a_user_error() -> None:
    with pytest.raises(WorkerError, match="unknown model 'alexnet'"):  # ('vgg' names vggf)
        build_model("alexnet", 3)


def test_pretrained_loads_matching_tensors_only(tmp_path: Path) -> None:
    src = LeNet(10)
    torch.save(src.state_dict(), tmp_path / "w.pt")  # other head size: the last layer is skipped
    dst = LeNet(3)
    note = load_pretrained(dst, tmp_path / "w.pt")
    assert note.startswith("loaded 8/10 tensors")
    got, had = dst.state_dict(), src.state_dict()
    assert torch.equal(got["features.0.weight"], had["features.0.weight"])
    assert not torch.equal(got["classifier.4.weight"][:3], had["classifier.4.weight"][:3])
    torch.save({"unrelated": torch.zeros(1)}, tmp_path / "x.pt")
    with pytest.raises(WorkerError, match="no tensor matches"):
        load_pretrained(dst, tmp_path / "x.pt")
    with pytest.raises(WorkerError, match="cannot load"):
        load_pretrained(dst, tmp_path / "missing.pt")


# ---------------------------------------------------------------- learning rate and optimisers


def test_lr_scaling() -> None:
    assert scaled_lr(0.1, 4, "linear") == pytest.approx(0.4)
    assert scaled_lr(0.1, 4, "sqrt") == pytest.approx(0.2)
    assert scaled_lr(0.1, 4, "none") == pytest.approx(0.1)


def test_warmup_goes_linearly_from_lr_over_world_size() -> None:
    # World 4, 2 warm-up epochs of 10 steps: 1/4 at step 0, 5/8 after one epoch, then 1.
    assert warmup_factor(0, 10, 2, 4) == pytest.approx(0.25)
    assert warmup_factor(5, 10, 2, 4) == pytest.approx((0.5 * 3 / 2 + 1) / 4)
    assert warmup_factor(10, 10, 2, 4) == pytest.approx(0.625)
    assert warmup_factor(20, 10, 2, 4) == 1.0 and warmup_factor(99, 10, 2, 4) == 1.0
    assert warmup_factor(0, 10, 0, 4) == 1.0  # no warm-up
    assert warmup_factor(0, 10, 2, 1) == 1.0  # one process: nothing to warm up from


def test_scheduler_gives_the_warmup_learning_rates() -> None:
    target = scaled_lr(0.1, 4, "linear")
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=target)
    sched = make_scheduler(opt, steps_per_epoch=4, warmup_epochs=1, world_size=4)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [target * (s / 4 * 3 + 1) / 4 for s in range(4)] + [target, target]
    assert seen == pytest.approx(expected)
    assert seen[0] == pytest.approx(0.1)  # starts at the 1-process lr


def test_novograd_step_matches_the_formula() -> None:
    w = nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = NovoGrad([w], lr=0.1, betas=(0.9, 0.5), weight_decay=0.0)
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 1.0])]
    m, v, expected = torch.zeros(2), None, w.detach().clone()
    for g in grads:
        w.grad = g.clone()
        opt.step()
        norm = float(g.pow(2).sum())
        v = norm if v is None else 0.5 * v + 0.5 * norm
        m = 0.9 * m + g / (math.sqrt(v) + 1e-8)
        expected -= 0.1 * m
    assert torch.allclose(w.detach(), expected)


@pytest.mark.parametrize("name", ["sgd", "adam", "novograd"])
def test_optimisers_minimise_a_quadratic(name: str) -> None:
    w = nn.Parameter(torch.tensor([3.0, -2.0]))
    opt = make_optimizer(name, [w], lr=0.05, momentum=0.9, weight_decay=0.0)
    for _ in range(300):
        opt.zero_grad()
        (w ** 2).sum().backward()
        opt.step()
    assert float(w.detach().abs().max()) < 0.1


# ---------------------------------------------------------------- checkpoints and metrics


def test_atomic_save_never_leaves_a_broken_file(tmp_path: Path, monkeypatch) -> None:
    path = checkpoint.path_for(tmp_path, 1)
    checkpoint.atomic_save({"epoch": 1}, path)
    real_save = torch.save

    def killed_midway(obj, f, *a, **kw) -> None:
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # stands in for a kill during the write

    monkeypatch.setattr(torch, "save", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.atomic_save({"epoch": 2}, path)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(path, weights_only=True) == {"epoch": 1}
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_stop_during_a_checkpoint_write_is_taken_once_the_file_is_in_place(
        tmp_path: Path, monkeypatch) -> None:
    """SIGTERM in the middle of torch.save: the checkpoint is finished and renamed, then the
    stop comes (Stopped), not torch's zip-writer error (a traceback and exit 1)."""
    path = checkpoint.path_for(tmp_path, 1)
    real_save = torch.save

    def stopped_midway(obj, f, *a, **kw) -> None:
        f.write(b"x" * 100)
        os.kill(os.getpid(), signal.SIGTERM)   # the handler runs here, in this thread
        time.sleep(0.01)
        f.seek(0)
        f.truncate()
        real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", stopped_midway)
    previous = signal.signal(signal.SIGTERM, stopping.on_sigterm)
    saved_hook = threading.excepthook
    try:
        with pytest.raises(stopping.Stopped):
            checkpoint.atomic_save({"epoch": 1}, path)
        with pytest.raises(stopping.Stopped):   # outside a save a stop is taken at once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    finally:
        signal.signal(signal.SIGTERM, previous)
        threading.excepthook = saved_hook
    assert torch.load(path, weights_only=True) == {"epoch": 1}
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_rng_state_round_trip_and_weights_only(tmp_path: Path) -> None:
    torch.manual_seed(3)
    state = checkpoint.rng_state()
    checkpoint.atomic_save({"rng": [state]}, tmp_path / "c.pt")
    expected = torch.rand(3)
    torch.manual_seed(99)
    checkpoint.set_rng_state(torch.load(tmp_path / "c.pt", weights_only=True)["rng"][0])
    assert torch.equal(torch.rand(3), expected)


def test_list_and_prune_checkpoints(tmp_path: Path) -> None:
    for e in (1, 2, 10):
        checkpoint.atomic_save({"epoch": e}, checkpoint.path_for(tmp_path, e))
    assert [e for e, _ in checkpoint.list_checkpoints(tmp_path)] == [1, 2, 10]
    checkpoint.prune(tmp_path, keep=2)
    assert [e for e, _ in checkpoint.list_checkpoints(tmp_path)] == [2, 10]


def test_metrics_csv_restarts_and_keeps_rows_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    row = {c: 0.5 for c in metrics.COLUMNS}
    metrics.start(path, None)
    for e in (1, 2, 3):
        metrics.append(path, {**row, "epoch": e})
    metrics.start(path, 2)  # resumed from epoch 2: epoch 3 runs again
    assert [r["epoch"] for r in metrics.read_rows(path)] == ["1", "2"]
    assert path.read_text().splitlines()[0] == ",".join(metrics.COLUMNS)
    metrics.start(path, None)
    assert metrics.read_rows(path) == []
    metrics.append(path, {**row, "epoch": 1})
    metrics.plot(path, tmp_path / "metrics.png")
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def _hook_args(filename: str, exc: type[BaseException]) -> threading.ExceptHookArgs:
    """What threading passes its excepthook for `exc` raised in code from `filename`."""
    code = compile("raise exc('peer gone')", filename, "exec")
    try:
        exec(code, {"exc": exc})
    except exc as e:
        return threading.ExceptHookArgs([exc, e, e.__traceback__, None])  # type: ignore[call-arg]
    raise AssertionError("not raised")


def test_a_broken_fd_sharing_thread_is_quiet_any_other_thread_error_is_printed(capsys) -> None:
    """The data loader's resource_sharer thread breaks when its loader process is gone
    (a stop ends both): no traceback; the same error elsewhere is printed."""
    from worker.stopping import quiet_sys_hook, quiet_thread_hook
    sharer = os.path.join("lib", "multiprocessing", "resource_sharer.py")
    for exc in (BrokenPipeError, ConnectionResetError):
        quiet_thread_hook(_hook_args(sharer, exc))
        a = _hook_args(sharer, exc)   # the sharer itself reports through sys.excepthook
        quiet_sys_hook(a.exc_type, a.exc_value, a.exc_traceback)
    assert capsys.readouterr().err == ""
    for args in (_hook_args(sharer, ValueError), _hook_args("mine.py", BrokenPipeError)):
        quiet_thread_hook(args)
        quiet_sys_hook(args.exc_type, args.exc_value, args.exc_traceback)
    err = capsys.readouterr().err
    assert err.count("Traceback") == 4 and "ValueError" in err and "BrokenPipeError" in err
