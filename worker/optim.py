"""Optimisers and the learning-rate schedule: scaling with the world size, warm-up, and
cosine annealing (plain or with warm restarts)."""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Callable, overload

import torch
from torch.optim import Optimizer


class _PerTensor(Optimizer):
    """An optimiser whose step is one `_update` per parameter tensor with a gradient; its
    settings are checked as Adam's are (lr, eps >= 0; betas in [0, 1))."""

    def __init__(self, name: str, params: Iterable, defaults: dict[str, Any]) -> None:
        lr, betas, eps = defaults["lr"], defaults["betas"], defaults["eps"]
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid {name} settings lr={lr} betas={betas} eps={eps}")
        super().__init__(params, defaults)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        raise NotImplementedError


class NovoGrad(_PerTensor):
    """NovoGrad (Ginsburg et al., 2019): Adam-like, with one second moment per layer.

    Per parameter tensor: v = beta2 * v + (1 - beta2) * ||g||^2 (v = ||g||^2 at the first
    step); m = beta1 * m + (g / (sqrt(v) + eps) + weight_decay * w); w -= lr * m.
    Defaults are the paper's (betas 0.95, 0.98), as in the DDP tutorial.
    """

    def __init__(self, params: Iterable, lr: float = 1e-2,
                 betas: tuple[float, float] = (0.95, 0.98), eps: float = 1e-8,
                 weight_decay: float = 0.0, grad_averaging: bool = False) -> None:
        super().__init__("NovoGrad", params, dict(lr=lr, betas=betas, eps=eps,
                                                  weight_decay=weight_decay,
                                                  grad_averaging=grad_averaging))

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        state = self.state[p]
        norm_sq = grad.float().pow(2).sum()
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = norm_sq.clone()
        else:
            state["exp_avg_sq"].mul_(beta2).add_(norm_sq, alpha=1 - beta2)
        state["step"] += 1
        update = grad / (state["exp_avg_sq"].sqrt() + group["eps"])
        if group["weight_decay"]:
            update = update.add(p, alpha=group["weight_decay"])
        if group["grad_averaging"]:
            update = update.mul(1 - beta1)
        state["exp_avg"].mul_(beta1).add_(update)
        p.add_(state["exp_avg"], alpha=-group["lr"])


class CorrectedAdam(_PerTensor):
    """Adam (torch's, without amsgrad) whose second moment takes, where ``squares`` holds
    one, a given estimate of the gradient's square instead of grad * grad.

    ``squares`` maps a parameter's ``data_ptr()`` to that estimate; TernGrad's hook fills
    it with the variance-corrected square of the decoded mean (worker.compression's
    ``corrected_square``), identical on every rank. With an empty map this is Adam.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__("Adam", params,
                         dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.squares: dict[int, torch.Tensor] = {}

    def _square(self, p: torch.Tensor, raw: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        given = self.squares.get(p.data_ptr())
        if given is None or given.numel() != p.numel():
            return grad * grad
        given = given.view_as(p)
        if grad is raw:
            return given
        # L2 decay d: (g' + d)^2 with g' = sign(g) sqrt(corrected g^2), never negative
        # (g^2 + 2gd + d^2 with the corrected g^2 can be, and Adam takes its root)
        return (torch.sign(raw) * given.sqrt() + (grad - raw)).square()

    def _update(self, p: torch.Tensor, raw: torch.Tensor, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        grad = raw
        if group["weight_decay"]:
            grad = raw.add(p, alpha=group["weight_decay"])
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t = state["step"]
        state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
        state["exp_avg_sq"].mul_(beta2).add_(self._square(p, raw, grad), alpha=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** t)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** t))


def scaled_lr(base_lr: float, world_size: int, scaling: str) -> float:
    """The learning rate for ``world_size`` processes: linear (Goyal et al.), sqrt or none."""
    factor = {"linear": world_size, "sqrt": math.sqrt(world_size), "none": 1.0}[scaling]
    return base_lr * factor


def warmup_factor(step: int, steps_per_epoch: int, warmup_epochs: float, world_size: int) -> float:
    """Multiplier of the scaled lr at ``step``: linear from 1/world_size to 1 over the warm-up.

    The tutorial's (Horovod's) formula, with the epoch counted fractionally per step:
    lr = target / W * (epoch * (W - 1) / warmup_epochs + 1).
    """
    epoch = step / max(1, steps_per_epoch)
    if warmup_epochs <= 0 or epoch >= warmup_epochs:
        return 1.0
    return (epoch * (world_size - 1) / warmup_epochs + 1) / world_size


def make_optimizer(name: str, params: Iterable, lr: float, momentum: float,
                   weight_decay: float, corrected: bool = False) -> Optimizer:
    """``corrected``: Adam as :class:`CorrectedAdam` (for --terngrad-adam-correction)."""
    if name == "adam" and corrected:
        return CorrectedAdam(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    return NovoGrad(params, lr=lr, weight_decay=weight_decay)


SCHEDULES = ("none", "cosine", "warm")


def cosine_factor(step: int, total: int) -> float:
    """Cosine annealing from 1 to 0 over ``total`` steps (torch's CosineAnnealingLR, eta_min 0)."""
    return 0.5 * (1 + math.cos(math.pi * min(step, total) / max(1, total)))


def warm_restarts_factor(step: int, first: int, mult: int = 2) -> float:
    """Cosine annealing with warm restarts (Loshchilov & Hutter; torch's
    CosineAnnealingWarmRestarts, eta_min 0): cycles of ``first``, ``first*mult``, ... steps,
    each from 1 down towards 0, then back to 1."""
    length = max(1, first)
    while step >= length:
        step -= length
        length *= mult
    return 0.5 * (1 + math.cos(math.pi * step / length))


def schedule_factor(step: int, steps_per_epoch: int, warmup_epochs: float, world_size: int,
                    schedule: str = "none", epochs: int = 1, restart_epochs: float = 2) -> float:
    """Multiplier of the scaled lr at ``step``: the warm-up, then the schedule.

    The schedule starts where the warm-up ends (its step 0 is the first step after it) and
    spans the remaining steps of ``epochs``, so a warm-up does not shorten the cosine.
    """
    warm_steps = math.ceil(warmup_epochs * steps_per_epoch) if warmup_epochs > 0 else 0
    if step < warm_steps or schedule == "none":
        return warmup_factor(step, steps_per_epoch, warmup_epochs, world_size)
    after = step - warm_steps
    if schedule == "cosine":
        return cosine_factor(after, epochs * steps_per_epoch - warm_steps)
    return warm_restarts_factor(after, round(restart_epochs * steps_per_epoch))


def make_scheduler(optimizer: Optimizer, steps_per_epoch: int, warmup_epochs: float,
                   world_size: int, schedule: str = "none", epochs: int = 1,
                   restart_epochs: float = 2) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per batch; its state (the step count) goes into checkpoints."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: schedule_factor(step, steps_per_epoch, warmup_epochs, world_size,
                                                schedule, epochs, restart_epochs))
