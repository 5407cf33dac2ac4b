"""Gradient compression for DDP: plain allreduce, fp16, and TernGrad (2 bits per value).

TernGrad (Wen et al., NIPS 2017) sends every gradient tensor as {-1, 0, +1} times one
scaler per layer. The reference implementation only simulates it (ternary values stay
32-bit floats); here the ternary codes really travel packed, 4 values per byte.

Per DDP bucket the TernGrad hook does:

1. split the flat bucket into its parameters ("per layer inside the bucket"); tensors
   with fewer than ``size_to_binarize`` elements and the logits layer stay float;
2. compute one scaler per quantised tensor (``max|g|``, or ``clip_factor * std(g)``)
   and share them with one ``all_reduce(MAX)`` per bucket, so every rank uses the
   same scaler (the vector carries one more value, a flag for non-finite gradients);
3. ternarise stochastically: each element becomes ``sign(g) * s`` with probability
   ``min(|g| / s, 1)``, else 0 (unbiased where ``|g| <= s``);
4. pack the codes ``t + 1`` in {0, 1, 2} into 2 bits, append the float tensors' raw
   bytes and ``all_gather`` that one byte buffer (a sum of ternaries does not fit
   in 2 bits, so the codes cannot be allreduced);
5. decode every rank's codes (``(code - 1) * s``), average, and write the result
   back into the bucket. The codes of all ranks are summed in the packed domain
   (a byte -> 4 int16 lanes table), so decoding costs one gather per rank on a
   quarter of the elements.

With ``error_feedback`` (Seide et al. 2014; Karimireddy et al. 2019, "Error Feedback
Fixes SignSGD") each rank keeps, per quantised parameter, what its last message left
out: step 1 adds that residual to the gradient before the scaler is taken, and after
step 3 the residual becomes (gradient + residual) - (this rank's decoded ternaries).
Nothing of a gradient is then lost, only delayed: over any number of steps the sum of
what a rank sent plus its residual equals the sum of its raw gradients, so the clipping
of ``--clip-factor`` and the noise of the draws stop accumulating into the weights. The
residual is local to the rank (it never travels); every rank still applies the same
decoded mean.

With ``squares`` (``--terngrad-adam-correction``) the hook also keeps, per quantised
parameter, a variance-corrected square of the decoded mean m for Adam's second moment
(see :func:`corrected_square`); it uses only m and the shared scalers, so it is the same
on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

KINDS = ("none", "fp16", "terngrad")
_SHIFTS = (0, 2, 4, 6)  # bit offset of the 4 codes inside one byte
_ZERO_CODE = 1  # code of a ternary 0; also used for padding
_SEED_BASE = 0x7E2  # keeps TernGrad's draws apart from seeds the training script uses
# The scaler with error feedback when no clip factor is given: s = 1.5 std(g) puts the
# error of nearest-rounding to {-s, 0, s} near its minimum (about 0.2 of |g|^2 for normal
# values; max|g| would zero almost everything, 2.5 std leaves about 0.5).
EF_CLIP_FACTOR = 1.5


@dataclass
class CommStats:
    """What this rank handed to collectives for gradient communication.

    ``bytes_sent`` counts, per rank and cumulatively, the payload bytes passed to the
    collectives of the communication hook: the bucket for ``none`` (fp32), the
    half-precision bucket for ``fp16``, and for ``terngrad`` the packed 2-bit codes,
    the per-layer scalers (plus one 4-byte flag per bucket) and the tensors kept as
    floats. It does not count what a ring or tree algorithm relays on behalf of other
    ranks, nor what this rank receives.
    """

    kind: str
    bytes_sent: int = 0
    buckets: int = 0  # hook calls, i.e. buckets communicated
    hook_state: Any = field(default=None, repr=False)  # for tests and debugging

    def add(self, nbytes: int) -> None:
        self.bytes_sent += int(nbytes)


# ---------------------------------------------------------------------------
# Encoding: pure tensor functions, usable without torch.distributed.


def local_scaler(grad: torch.Tensor, clip_factor: float | None = None) -> torch.Tensor:
    """This rank's scaler for one tensor: ``max|g|`` or ``clip_factor * std(g)``.

    With a clip factor, a constant tensor has std 0; it then falls back to ``max|g|``
    so that its gradient is not silently zeroed (the reference would send zeros).
    """
    g = grad.detach().reshape(-1).float()
    low, high = torch.aminmax(g)  # no |g| temporary; NaN and inf propagate
    max_abs = torch.maximum(-low, high)
    if clip_factor is None:
        return max_abs
    # Population std, as the reference computes it (sqrt(mean((g - mean)^2))).
    clipped = (clip_factor * g.std(correction=0)).nan_to_num(0.0)
    return torch.where(clipped > 0, clipped, max_abs)


def ternarize(grad: torch.Tensor, scaler: torch.Tensor | float,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Stochastic ternary codes of ``grad`` (flattened) as uint8 in {0, 1, 2}.

    Code ``c`` stands for ``(c - 1) * scaler``: +s with probability min(g/s, 1) where
    g > 0, -s with probability min(-g/s, 1) where g < 0, else 0. ``scaler`` is a
    number or a tensor broadcastable to the flattened gradient.
    """
    g = grad.detach().reshape(-1)
    threshold = torch.rand(g.shape, generator=generator, device=g.device,
                           dtype=torch.float32).mul_(scaler)  # uniform in [0, s)
    # Never fires for g == 0; a NaN scaler gives all-zero codes (the decode then gives NaN).
    up = torch.gt(g, threshold)
    down = torch.lt(g, threshold.neg_())
    return up.to(torch.uint8).add_(_ZERO_CODE).sub_(down.to(torch.uint8))


def ternarize_nearest(grad: torch.Tensor, scaler: torch.Tensor | float) -> torch.Tensor:
    """Deterministic ternary codes: the nearest of {-s, 0, +s} (0 where |g| <= s/2).

    Used with error feedback, which needs a contracting quantiser (its error smaller than
    the gradient itself). The stochastic draws of :func:`ternarize` do not contract: with
    s = 2.5 std their error is about as large as the gradient, so a residual fed back
    grows step after step instead of shrinking.
    """
    g = grad.detach().reshape(-1)
    half = torch.as_tensor(scaler, dtype=g.dtype, device=g.device) / 2
    up = torch.gt(g, half)
    down = torch.lt(g, -half)
    return up.to(torch.uint8).add_(_ZERO_CODE).sub_(down.to(torch.uint8))


def corrected_square(mean: torch.Tensor, scaler: torch.Tensor | float,
                     world: int) -> torch.Tensor:
    """``max(m^2 - (s|m| - m^2) / (W - 1), m^2 / W^2)``: the square of the decoded mean
    ``m`` of W stochastic ternaries, less an estimate of the variance the draws added.

    A draw q of a value g with scaler s has E[q^2] = s|g|, not g^2: its variance is
    s|g| - g^2, and the mean of W independent draws carries 1/W of it. Adam's second
    moment fed with m^2 therefore grows with s|g| and its steps shrink. The variance is
    estimated from values every rank holds (m and the shared s), so every rank computes
    the same square: E[s|m| - m^2] is (W - 1) times the variance of m where the ranks'
    gradients agree in sign, hence the division by W - 1 (for W = 2 it is the product
    of the two ranks' draws, an unbiased estimate of g1 g2). The floor m^2 / W^2 keeps
    Adam's denominator away from 0 where m is not (one rank drew a value, the others
    0), which would make a huge step. Where the quantiser is exact (|m| in {0, s}) it
    is m^2.
    """
    square = mean * mean
    excess = (torch.abs(mean) * scaler - square) / max(1, world - 1)
    return torch.maximum(square - excess, square / (world * world))


def pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes in {0, 1, 2} into bytes, 4 per byte (element 4j+k at bits 2k of byte j)."""
    codes = codes.reshape(-1).to(torch.uint8)
    pad = (-codes.numel()) % 4
    if pad:
        codes = torch.cat([codes, codes.new_full((pad,), _ZERO_CODE)])
    quads = codes.view(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def unpack_ternary(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_ternary`; works on a leading batch dimension too.

    ``packed`` of shape (..., B) gives codes of shape (..., numel).
    """
    # Python-int shifts: no small tensor copied from the host (a sync on CUDA) per call.
    codes = torch.stack([(packed >> s) & 3 for s in _SHIFTS], dim=-1)
    return codes.flatten(-2)[..., :numel]


def _lane_table(device: torch.device) -> torch.Tensor:
    """Byte -> its 4 codes as int16 lanes of one int64 (native byte order).

    Adding table[byte] over ranks adds the 4 codes lane by lane without carries
    (each lane holds at most 2 W), so W ranks' codes are summed with one gather
    and one add per rank on a quarter of the elements.
    """
    key = str(device)
    if key not in _LANE_TABLES:
        byte = torch.arange(256, dtype=torch.int16, device=device)
        lanes = torch.stack([(byte >> s) & 3 for s in _SHIFTS], dim=1)
        _LANE_TABLES[key] = lanes.contiguous().view(torch.int64).reshape(256)
    return _LANE_TABLES[key]


_LANE_TABLES: dict[str, torch.Tensor] = {}


def sum_codes(packed: list[torch.Tensor]) -> torch.Tensor:
    """Element-wise sum of the codes of several packed tensors (one per rank), as int16.

    Returns 4 values per byte (padding included); the sum of the ternaries is
    ``result - len(packed)``. Exact for up to 16383 ranks.
    """
    table = _lane_table(packed[0].device)
    acc = torch.index_select(table, 0, packed[0].int())
    for more in packed[1:]:
        acc += torch.index_select(table, 0, more.int())
    return acc.view(torch.int16)


def decode_ternary(codes: torch.Tensor, scaler: torch.Tensor | float,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of ternary codes: ``(code - 1) * scaler``."""
    return (codes.to(dtype) - _ZERO_CODE) * scaler


def encode(grad: torch.Tensor, scaler: torch.Tensor | float,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Ternarise and pack: ``ceil(numel / 4)`` bytes."""
    return pack_ternary(ternarize(grad, scaler, generator))


def decode(packed: torch.Tensor, scaler: torch.Tensor | float, numel: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack and decode ``numel`` values (flat)."""
    return decode_ternary(unpack_ternary(packed, numel), scaler, dtype)


# ---------------------------------------------------------------------------
# Hook states and hooks.


@dataclass
class _CountingState:
    process_group: Any
    stats: CommStats

    @property
    def group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)


@dataclass
class _Layout:
    """Where the quantised and float tensors sit inside one flat bucket."""

    quant: list[tuple[int, int]]  # (offset, numel) per quantised tensor
    floats: list[tuple[int, int]]
    keys: list[int] = field(default_factory=list)  # data_ptr of each quantised parameter

    @property
    def quant_numel(self) -> int:
        return sum(n for _, n in self.quant)


@dataclass
class BucketRecord:
    """Debug record of one bucket (kept only with ``TernGradState.record``)."""

    local_scalers: torch.Tensor
    shared_scalers: torch.Tensor
    local_decoded: torch.Tensor  # this rank's contribution, decoded, bucket-shaped
    result: torch.Tensor  # the averaged bucket the hook returned
    layout: _Layout  # where each parameter's values sit in the bucket


@dataclass
class TernGradState(_CountingState):
    clip_factor: float | None = None
    size_to_binarize: int = 256
    float_params: frozenset[int] = frozenset()  # data_ptr of parameters kept float
    seed: int = 0
    error_feedback: bool = False
    # Per quantised parameter (by data_ptr): what this rank's messages have left out so
    # far, flat, in the gradient's dtype. Local to the rank; empty without error feedback.
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    # Per quantised parameter (by data_ptr): corrected_square of the last decoded mean,
    # for worker.optim.CorrectedAdam; None: not kept.
    squares: dict[int, torch.Tensor] | None = None
    record: bool = False
    records: dict[int, BucketRecord] = field(default_factory=dict)
    _generators: dict[str, torch.Generator] = field(default_factory=dict)

    def generator(self, device: torch.device) -> torch.Generator:
        """One generator per device, seeded by rank: reproducible, independent per rank."""
        key = str(device)
        if key not in self._generators:
            gen = torch.Generator(device=device)
            gen.manual_seed(_SEED_BASE + 1_000_003 * self.seed + dist.get_rank())
            self._generators[key] = gen
        return self._generators[key]

    def layout(self, bucket: dist.GradBucket) -> _Layout:
        # Gradients lie back to back in the bucket in the order of bucket.parameters().
        out = _Layout(quant=[], floats=[])
        offset = 0
        for param in bucket.parameters():
            n = param.numel()
            keep_float = n < self.size_to_binarize or param.data_ptr() in self.float_params
            (out.floats if keep_float else out.quant).append((offset, n))
            if not keep_float:
                out.keys.append(param.data_ptr())
            offset += n
        return out


def _comm_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give a hook real (not string) annotations: DDP compares them to the classes,
    and ``from __future__ import annotations`` turns them into strings."""
    fn.__annotations__.update(bucket=dist.GradBucket, state=Any,
                              **{"return": torch.futures.Future[torch.Tensor]})
    return fn


@_comm_hook
def _allreduce_hook(state: _CountingState, bucket: dist.GradBucket
                    ) -> torch.futures.Future[torch.Tensor]:
    """DDP's default semantics (sum, divided by world size), with the bytes counted."""
    buf = bucket.buffer()
    state.stats.add(buf.numel() * buf.element_size())
    state.stats.buckets += 1
    buf.div_(state.world_size)
    work = dist.all_reduce(buf, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@_comm_hook
def _fp16_hook(state: _CountingState, bucket: dist.GradBucket
               ) -> torch.futures.Future[torch.Tensor]:
    state.stats.add(bucket.buffer().numel() * 2)
    state.stats.buckets += 1
    return default_hooks.fp16_compress_hook(state.process_group, bucket)


def _gather_segments(buf: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    if not segments:
        return buf.new_empty(0)
    return torch.cat([buf[o:o + n] for o, n in segments])


def _scatter_segments(buf: torch.Tensor, segments: list[tuple[int, int]],
                      flat: torch.Tensor) -> None:
    pos = 0
    for o, n in segments:
        buf[o:o + n].copy_(flat[pos:pos + n])
        pos += n


def _shared_scalers(state: TernGradState, buf: torch.Tensor,
                    layout: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(local, shared) scalers: one all_reduce(MAX) for the whole bucket.

    One more element flags a non-finite gradient on any rank. The shared scalers are
    then NaN, so the layers decode to NaN as they would without compression (AMP's
    GradScaler sees it and skips the step) instead of silently becoming zeros.
    """
    local = torch.stack([local_scaler(buf[o:o + n], state.clip_factor)
                         for o, n in layout.quant])
    flag = (~torch.isfinite(local)).any().to(local.dtype).reshape(1)
    reduced = torch.cat([local, flag])
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=state.group)
    state.stats.add(reduced.numel() * reduced.element_size())
    return local, torch.where(reduced[-1] > 0, float("nan"), reduced[:-1])


def _ternarize_layers(state: TernGradState, buf: torch.Tensor, layout: _Layout,
                      shared: torch.Tensor) -> torch.Tensor:
    if state.error_feedback:
        return torch.cat([ternarize_nearest(buf[o:o + n], shared[k])
                          for k, (o, n) in enumerate(layout.quant)])
    gen = state.generator(buf.device)
    return torch.cat([ternarize(buf[o:o + n], shared[k], gen)
                      for k, (o, n) in enumerate(layout.quant)])


@_comm_hook
def _terngrad_hook(state: TernGradState, bucket: dist.GradBucket
                   ) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    layout = state.layout(bucket)
    if not layout.quant:
        return _allreduce_hook(state, bucket)
    state.stats.buckets += 1
    if state.error_feedback:
        _add_residuals(state, buf, layout)
    local, shared = _shared_scalers(state, buf, layout)
    codes = _ternarize_layers(state, buf, layout, shared)
    if state.error_feedback:
        _keep_residuals(state, buf, layout, codes, shared)
    floats = _gather_segments(buf, layout.floats)
    # One message per rank: the packed codes, then the float tensors' raw bytes.
    payload = torch.cat([pack_ternary(codes), floats.contiguous().view(torch.uint8)])
    state.stats.add(payload.numel())
    gathered = [torch.empty_like(payload) for _ in range(state.world_size)]
    work = dist.all_gather(gathered, payload, group=state.group, async_op=True)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()  # re-raises a failed all_gather instead of averaging garbage
        _average_into(buf, gathered, layout, shared)
        if state.squares is not None:
            _keep_squares(state.squares, buf, layout, shared, state.world_size)
        if state.record:
            _record(state, bucket.index(), buf, layout, codes, floats, local, shared)
        return buf

    return work.get_future().then(finish)


def _add_residuals(state: TernGradState, buf: torch.Tensor, layout: _Layout) -> None:
    """Gradient + what the previous messages left out, in place (the bucket is
    overwritten with the decoded mean afterwards anyway)."""
    for (o, n), key in zip(layout.quant, layout.keys):
        residual = state.residuals.get(key)
        if residual is not None:
            buf[o:o + n].add_(residual)


def _keep_residuals(state: TernGradState, buf: torch.Tensor, layout: _Layout,
                    codes: torch.Tensor, shared: torch.Tensor) -> None:
    """Residual = (gradient + old residual) - this rank's decoded ternaries.

    A step with a non-finite gradient on any rank (shared scalers NaN) keeps the old
    residuals: the step is skipped (AMP) or already ruined, and a NaN residual would
    poison every later step.
    """
    pos = 0
    for k, ((o, n), key) in enumerate(zip(layout.quant, layout.keys)):
        left_out = buf[o:o + n] - decode_ternary(codes[pos:pos + n], shared[k], buf.dtype)
        residual = state.residuals.get(key)
        if residual is None or residual.numel() != n:
            residual = state.residuals[key] = torch.zeros_like(left_out)
        # torch.where, not an `if`: no host sync per layer on a GPU
        residual.copy_(torch.where(torch.isfinite(shared[k]), left_out, residual))
        pos += n


def _keep_squares(squares: dict[int, torch.Tensor], buf: torch.Tensor, layout: _Layout,
                  shared: torch.Tensor, world: int) -> None:
    for k, ((o, n), key) in enumerate(zip(layout.quant, layout.keys)):
        squares[key] = corrected_square(buf[o:o + n], shared[k].to(buf.dtype), world)


def _average_into(buf: torch.Tensor, gathered: list[torch.Tensor], layout: _Layout,
                  shared: torch.Tensor) -> None:
    """Decode every rank's message and write the mean into the bucket."""
    world, n_packed = len(gathered), (layout.quant_numel + 3) // 4
    sums = sum_codes([g[:n_packed] for g in gathered])
    pos = 0
    for k, (o, n) in enumerate(layout.quant):
        # mean of the ternaries = (sum of codes - W) * s / W
        factor = (shared[k] / world).to(buf.dtype)
        torch.mul(sums[pos:pos + n] - world * _ZERO_CODE, factor, out=buf[o:o + n])
        pos += n
    if layout.floats:
        floats = torch.stack([g[n_packed:] for g in gathered]).view(buf.dtype)
        _scatter_segments(buf, layout.floats, floats.sum(dim=0) / world)


def _record(state: TernGradState, index: int, buf: torch.Tensor, layout: _Layout,
            codes: torch.Tensor, floats: torch.Tensor, local: torch.Tensor,
            shared: torch.Tensor) -> None:
    mine, pos = torch.empty_like(buf), 0
    for k, (o, n) in enumerate(layout.quant):
        mine[o:o + n] = decode_ternary(codes[pos:pos + n], shared[k], buf.dtype)
        pos += n
    _scatter_segments(mine, layout.floats, floats)
    state.records[index] = BucketRecord(local, shared, mine, buf.clone(), layout)


# ---------------------------------------------------------------------------
# Installation.


def _logits_params(module: torch.nn.Module, names: set[str] | frozenset[str]
                   ) -> list[torch.nn.Parameter]:
    """Parameters of the logits layer: the named ones, else the last module owning any."""
    named = dict(module.named_parameters())
    if names:
        unknown = sorted(set(names) - set(named))
        if unknown:
            raise ValueError(f"logits_param_names not in the model: {', '.join(unknown)}; "
                             f"the model has: {', '.join(named)}")
        return [named[n] for n in names]
    owners = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    return list(owners[-1].parameters(recurse=False)) if owners else []


def _terngrad_state(ddp_model: Any, stats: CommStats, process_group: Any,
                    clip_factor: float | None, size_to_binarize: int,
                    quantize_logits: bool, logits_param_names: set[str] | frozenset[str],
                    seed: int, error_feedback: bool = False,
                    adam_correction: bool = False) -> TernGradState:
    if clip_factor is not None and not clip_factor > 0:
        raise ValueError(f"clip_factor must be > 0 (the paper uses 2.5), got {clip_factor}")
    if size_to_binarize < 1:
        raise ValueError(f"size_to_binarize must be >= 1, got {size_to_binarize}")
    logits = [] if quantize_logits else _logits_params(ddp_model.module, logits_param_names)
    if error_feedback and adam_correction:
        raise ValueError("the Adam correction assumes stochastic ternaries; error feedback "
                         "rounds to the nearest: use one of them")
    if error_feedback and clip_factor is None:
        clip_factor = EF_CLIP_FACTOR
    return TernGradState(process_group, stats, clip_factor=clip_factor,
                         size_to_binarize=size_to_binarize,
                         float_params=frozenset(p.data_ptr() for p in logits), seed=seed,
                         error_feedback=error_feedback,
                         squares={} if adam_correction else None)


def install_comm_hook(ddp_model: Any, kind: str, *, clip_factor: float | None = None,
                      size_to_binarize: int = 256, quantize_logits: bool = False,
                      logits_param_names: set[str] | frozenset[str] = frozenset(),
                      process_group: Any = None, seed: int = 0,
                      error_feedback: bool = False,
                      adam_correction: bool = False) -> CommStats:
    """Register the gradient communication hook ``kind`` on a DDP model.

    ``kind``: ``none`` (fp32 allreduce, DDP's default semantics), ``fp16`` (torch's
    ``fp16_compress_hook``) or ``terngrad``. Returns the :class:`CommStats` whose
    ``bytes_sent`` grows by the payload this rank hands to the collectives (per rank,
    not counting the relaying done by ring/tree algorithms).

    TernGrad options: ``clip_factor`` (scaler ``c * std(g)`` instead of ``max|g|``),
    ``size_to_binarize`` (smaller tensors stay float), ``quantize_logits`` (otherwise
    the logits layer stays float: the parameters named in ``logits_param_names``, or,
    if none are named, those of the last module that owns parameters), ``seed`` (the
    random draws of rank r are seeded from ``seed`` and r), ``error_feedback`` (keep
    each quantised parameter's residual on this rank and add it to the next gradient),
    ``adam_correction`` (keep the corrected squares in ``stats.hook_state.squares`` for
    :class:`worker.optim.CorrectedAdam`).

    Call it once, after wrapping the model in DDP and before the first backward.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown gradient compression {kind!r}; choose one of: "
                         f"{', '.join(KINDS)}")
    stats = CommStats(kind=kind)
    hooks: dict[str, Callable[..., torch.futures.Future]] = {
        "none": _allreduce_hook, "fp16": _fp16_hook, "terngrad": _terngrad_hook}
    if kind == "terngrad":
        state: _CountingState = _terngrad_state(
            ddp_model, stats, process_group, clip_factor, size_to_binarize,
            quantize_logits, logits_param_names, seed, error_feedback, adam_correction)
    else:
        state = _CountingState(process_group, stats)
    stats.hook_state = state
    ddp_model.register_comm_hook(state, hooks[kind])
    return stats
