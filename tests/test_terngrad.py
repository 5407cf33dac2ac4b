"""TernGrad: 2-bit codec, unbiasedness, and the DDP hooks in real 2- and 3-process gloo runs."""
from __future__ import annotations

import copy
import math
import os
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers import spawn_ranks, stop_fork_server
from worker import compression as C

SIZE_TO_BINARIZE = 100
SPAWN_TIMEOUT_S = 90


# ---------------------------------------------------------------------------
# Codec (single process)


@pytest.mark.parametrize("numel", [1, 2, 3, 5, 7, 13, 1001])
def test_pack_unpack_round_trip_odd_sizes(numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    codes = torch.randint(0, 3, (numel,), generator=gen, dtype=torch.uint8)
    packed = C.pack_ternary(codes)
    assert packed.dtype == torch.uint8
    assert packed.numel() == math.ceil(numel / 4)
    assert torch.equal(C.unpack_ternary(packed, numel), codes)


@pytest.mark.parametrize("numel", [1, 3, 6, 999])
def test_encode_decode_values(numel: int) -> None:
    # |g| == s everywhere: ternarisation is deterministic, so decode(encode(g)) == g.
    scaler = 0.37
    signs = torch.tensor([1.0, -1.0, 0.0]).repeat(numel)[:numel]
    grad = signs * scaler
    packed = C.encode(grad, scaler, torch.Generator().manual_seed(0))
    assert torch.equal(C.decode(packed, scaler, numel), grad)


@pytest.mark.parametrize("world", [1, 2, 5])
def test_sum_codes_equals_sum_of_unpacked_codes(world: int) -> None:
    numel = 1001
    gen = torch.Generator().manual_seed(world)
    codes = [torch.randint(0, 3, (numel,), generator=gen, dtype=torch.uint8) for _ in range(world)]
    sums = C.sum_codes([C.pack_ternary(c) for c in codes])
    assert sums.dtype == torch.int16 and sums.numel() == 4 * math.ceil(numel / 4)
    assert torch.equal(sums[:numel], torch.stack(codes).sum(dim=0).to(torch.int16))
    assert torch.equal(sums[numel:], torch.full((sums.numel() - numel,), world, dtype=torch.int16))


def test_packing_layout_is_four_codes_per_byte() -> None:
    codes = torch.tensor([2, 0, 1, 2, 1], dtype=torch.uint8)
    packed = C.pack_ternary(codes)
    assert packed.tolist() == [2 | 0 << 2 | 1 << 4 | 2 << 6, 1 | 1 << 2 | 1 << 4 | 1 << 6]


def _mean_of_ternarisations(grad: torch.Tensor, scaler: float, reps: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    codes = C.ternarize(grad.repeat(reps), scaler, gen).view(reps, -1)
    return C.decode_ternary(codes, scaler).mean(dim=0)


def test_ternarisation_is_unbiased() -> None:
    grad = torch.randn(999, generator=torch.Generator().manual_seed(7))
    scaler = C.local_scaler(grad).item()
    reps = 3000
    mean = _mean_of_ternarisations(grad, scaler, reps)
    # Per element the std of the mean is at most s / (2 sqrt(reps)); allow 5 of them.
    tolerance = 5 * scaler / (2 * math.sqrt(reps))
    assert (mean - grad).abs().max().item() < tolerance
    # and the draws are really random: a single ternarisation is far from g
    single = C.decode_ternary(C.ternarize(grad, scaler), scaler)
    assert (single - grad).abs().max().item() > tolerance


def test_clip_factor_scaler_and_clipping() -> None:
    grad = torch.randn(2000, generator=torch.Generator().manual_seed(3))
    grad[0] = 40.0  # an outlier far beyond 2.5 std
    scaler = C.local_scaler(grad, clip_factor=2.5)
    assert scaler.item() == pytest.approx(2.5 * grad.std(correction=0).item(), rel=1e-6)
    assert C.local_scaler(grad).item() == 40.0
    reps = 2000
    mean = _mean_of_ternarisations(grad, scaler.item(), reps)
    expected = grad.clamp(-scaler.item(), scaler.item())  # larger values are clipped to s
    assert (mean - expected).abs().max().item() < 5 * scaler.item() / (2 * math.sqrt(reps))


def test_zero_gradient_and_constant_gradient() -> None:
    zeros = torch.zeros(10)
    assert torch.equal(C.ternarize(zeros, 0.0), torch.ones(10, dtype=torch.uint8))
    constant = torch.full((10,), -0.5)
    # std is 0: the clip-factor scaler falls back to max|g| instead of zeroing the gradient
    assert C.local_scaler(constant, clip_factor=2.5).item() == 0.5


def test_same_generator_seed_gives_same_codes() -> None:
    grad = torch.randn(500)
    first = C.ternarize(grad, 3.0, torch.Generator().manual_seed(5))
    again = C.ternarize(grad, 3.0, torch.Generator().manual_seed(5))
    other = C.ternarize(grad, 3.0, torch.Generator().manual_seed(6))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_unknown_kind_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError,
                       match=r"unknown gradient compression 'int8'.*none, fp16, terngrad"):
        C.install_comm_hook(None, "int8")


# ---------------------------------------------------------------------------
# DDP hooks in real multi-process gloo runs


def _model() -> nn.Module:
    # Odd sizes; weights >= SIZE_TO_BINARIZE are quantised, biases and logits stay float.
    return nn.Sequential(nn.Linear(17, 39), nn.ReLU(), nn.Linear(39, 29), nn.ReLU(),
                         nn.Linear(29, 5))


FLOAT_NAMES = {"0.bias", "2.bias", "4.weight", "4.bias"}


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    # Scale differs per rank so that local scalers differ and the MAX matters.
    return torch.randn(8, 17, generator=gen) * (1 + rank), torch.randint(0, 5, (8,), generator=gen)


def _all_gather(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def _raw_mean_grads(base: nn.Module, rank: int, step: int) -> dict[str, torch.Tensor]:
    """What DDP's fp32 average would be: the mean over ranks of the local gradients."""
    local = copy.deepcopy(base)
    local.zero_grad(set_to_none=True)
    x, y = _batch(rank, step)
    nn.functional.cross_entropy(local(x), y).backward()
    return {n: _all_gather(_grad(p)).mean(dim=0) for n, p in local.named_parameters()}


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None, "backward() gave this parameter no gradient"
    return p.grad


def _ddp_step(ddp: DDP, rank: int, step: int) -> dict[str, torch.Tensor]:
    ddp.zero_grad(set_to_none=True)
    x, y = _batch(rank, step)
    nn.functional.cross_entropy(ddp(x), y).backward()
    return {n: _grad(p).clone() for n, p in ddp.module.named_parameters()}


def _check_terngrad_records(state: C.TernGradState) -> None:
    assert state.records, "the TernGrad hook recorded no bucket"
    for index in sorted(state.records):
        rec = state.records[index]
        # The hook's result is the average of every rank's decoded ternary gradient.
        everyone = _all_gather(rec.local_decoded)
        torch.testing.assert_close(rec.result, everyone.mean(dim=0), rtol=1e-5, atol=1e-7)
        # The scaler is shared: every rank uses the max over ranks of the local scalers.
        locals_ = _all_gather(rec.local_scalers)
        assert torch.equal(rec.shared_scalers, locals_.max(dim=0).values)
        assert torch.equal(_all_gather(rec.shared_scalers).min(dim=0).values, rec.shared_scalers)
        assert not torch.equal(locals_[0], locals_[1]), "test data should give different scalers"
    state.records.clear()


def _check_terngrad_grads(grads: dict[str, torch.Tensor], raw: dict[str, torch.Tensor],
                          world: int) -> None:
    for name, grad in grads.items():
        same = torch.equal(_all_gather(grad).min(dim=0).values, grad)
        assert same, f"{name} differs across ranks"
        if name in FLOAT_NAMES:
            torch.testing.assert_close(grad, raw[name], rtol=1e-5, atol=1e-7)
        else:
            # Mean of W ternaries {-s, 0, s}: at most 2W + 1 distinct values.
            assert grad.unique().numel() <= 2 * world + 1, name
            assert not torch.allclose(grad, raw[name]), f"{name} was not quantised"


def _check_terngrad_bytes(model: nn.Module, sent: int, buckets: int) -> None:
    """Per bucket: the codes (padded to whole bytes), the scalers plus one non-finite
    flag, and the float tensors, 4 bytes each."""
    quant = [p.numel() for n, p in model.named_parameters() if n not in FLOAT_NAMES]
    floats = sum(p.numel() for n, p in model.named_parameters() if n in FLOAT_NAMES)
    low = math.ceil(sum(quant) / 4) + 4 * (len(quant) + buckets) + 4 * floats
    assert low <= sent <= low + 3 * buckets


def _run_terngrad(rank: int, world: int) -> None:
    torch.manual_seed(0)
    base = _model()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.004)
    stats = C.install_comm_hook(ddp, "terngrad", size_to_binarize=SIZE_TO_BINARIZE,
                                logits_param_names={"4.weight", "4.bias"})
    stats.hook_state.record = True
    for step in range(2):  # step 0 uses DDP's initial buckets, step 1 the rebuilt ones
        before = stats.bytes_sent
        grads = _ddp_step(ddp, rank, step)
        _check_terngrad_bytes(base, stats.bytes_sent - before, len(stats.hook_state.records))
        _check_terngrad_records(stats.hook_state)
        _check_terngrad_grads(grads, _raw_mean_grads(base, rank, step), world)
    _check_non_finite_propagates(ddp, rank)


def _check_non_finite_propagates(ddp: DDP, rank: int) -> None:
    """A NaN gradient on one rank must reach every rank as NaN, not as zeros."""
    x, y = _batch(rank, 2)
    if rank == 1:
        x[0, 0] = float("inf")
    ddp.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(ddp(x), y).backward()
    for name, param in ddp.module.named_parameters():
        if name not in FLOAT_NAMES:
            assert torch.isnan(_grad(param)).all(), name


def _run_none_and_fp16(rank: int) -> None:
    torch.manual_seed(0)
    base = _model()
    numel = sum(p.numel() for p in base.parameters())
    raw = _raw_mean_grads(base, rank, 0)
    for kind, nbytes, tol in (("none", 4, 1e-6), ("fp16", 2, 2e-3)):
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.004)
        stats = C.install_comm_hook(ddp, kind)
        grads = _ddp_step(ddp, rank, 0)
        assert stats.bytes_sent == nbytes * numel, kind
        for name, grad in grads.items():
            torch.testing.assert_close(grad, raw[name], rtol=tol, atol=tol)


# ---------------------------------------------------------------------------
# Error feedback (same runs)

EF_STEPS = 5
EF_CLIP = 1.0  # clips often: much of each gradient is left out and must come back later


def _local_grads(base: nn.Module, rank: int, step: int) -> dict[str, torch.Tensor]:
    """This rank's own gradient (what reaches the hook), flat, at the base weights."""
    local = copy.deepcopy(base)
    x, y = _batch(rank, step)
    nn.functional.cross_entropy(local(x), y).backward()
    return {n: _grad(p).reshape(-1).clone() for n, p in local.named_parameters()}


def _sent_by_me(state: C.TernGradState, names: dict[int, str]
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per quantised parameter: this rank's decoded ternaries and its local scaler."""
    sent, scalers = {}, {}
    for rec in state.records.values():
        for k, ((o, n), key) in enumerate(zip(rec.layout.quant, rec.layout.keys)):
            sent[names[key]] = rec.local_decoded[o:o + n].clone()
            scalers[names[key]] = rec.local_scalers[k]
    state.records.clear()
    return sent, scalers


def _residual(state: C.TernGradState, param: torch.Tensor) -> torch.Tensor:
    kept = state.residuals.get(param.data_ptr())
    return torch.zeros(param.numel()) if kept is None else kept.clone()


def _ef_step(ddp: DDP, state: C.TernGradState, base: nn.Module, rank: int, step: int,
             sums: dict[str, dict[str, torch.Tensor]]) -> None:
    """One step: check what was quantised and what was kept, and add up the sums."""
    params = dict(ddp.module.named_parameters())
    quant = [n for n in params if n not in FLOAT_NAMES]
    before = {n: _residual(state, params[n]) for n in quant}
    applied = _ddp_step(ddp, rank, step)
    raw = _local_grads(base, rank, step)
    sent, scalers = _sent_by_me(state, {p.data_ptr(): n for n, p in params.items()})
    assert sorted(sent) == sorted(quant)
    for n in quant:
        # The residual was added before quantising: the scaler is that of gradient + residual.
        expected = C.local_scaler(raw[n] + before[n], EF_CLIP)
        torch.testing.assert_close(scalers[n], expected, rtol=1e-5, atol=1e-8)
        # ... and the new residual is what this rank's message left out.
        torch.testing.assert_close(_residual(state, params[n]), raw[n] + before[n] - sent[n],
                                   rtol=1e-5, atol=1e-6)
        for key, value in (("raw", raw[n]), ("sent", sent[n]),
                           ("applied", applied[n].reshape(-1)),
                           ("raw_mean", _all_gather(raw[n]).mean(dim=0))):
            sums[key][n] = sums[key].get(n, torch.zeros_like(value)) + value


def _check_ef_sums(ddp: DDP, state: C.TernGradState,
                   sums: dict[str, dict[str, torch.Tensor]]) -> None:
    params = dict(ddp.module.named_parameters())
    for n, raw_sum in sums["raw"].items():
        residual = _residual(state, params[n])
        # On this rank: everything it sent plus what it still holds = its raw gradients.
        torch.testing.assert_close(sums["sent"][n] + residual, raw_sum, rtol=1e-4, atol=1e-5)
        # Over the ranks: what every rank applied plus the mean residual = the fp32 means.
        torch.testing.assert_close(sums["applied"][n] + _all_gather(residual).mean(dim=0),
                                   sums["raw_mean"][n], rtol=1e-4, atol=1e-5)
        # Without the residual the applied sum is off (clipping at 1 std left much out).
        assert not torch.allclose(sums["applied"][n], sums["raw_mean"][n], atol=1e-3), n
        # Fed back, the residual stays of the order of one gradient (no random walk).
        assert residual.abs().max() <= 3 * raw_sum.abs().max() / EF_STEPS + 1e-6, n
    assert len(state.residuals) == len(sums["raw"])  # the float tensors keep none


def _run_error_feedback(rank: int) -> None:
    torch.manual_seed(0)
    base = _model()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.004)
    stats = C.install_comm_hook(ddp, "terngrad", size_to_binarize=SIZE_TO_BINARIZE,
                                logits_param_names={"4.weight", "4.bias"},
                                clip_factor=EF_CLIP, error_feedback=True)
    state = stats.hook_state
    state.record = True
    sums: dict[str, dict[str, torch.Tensor]] = {k: {} for k in ("raw", "sent", "applied",
                                                                 "raw_mean")}
    # No optimizer step: the weights stay at base, so each step's raw gradient is known.
    # Step 0 uses DDP's initial buckets, later steps the rebuilt ones (residuals survive).
    for step in range(EF_STEPS):
        _ef_step(ddp, state, base, rank, step, sums)
    _check_ef_sums(ddp, state, sums)
    # A non-finite step (inf on rank 1) leaves every rank's residuals as they were.
    kept = {k: v.clone() for k, v in state.residuals.items()}
    state.record = False
    _check_non_finite_propagates(ddp, rank)
    assert all(torch.equal(kept[k], v) for k, v in state.residuals.items())


def _run_no_feedback_keeps_nothing(rank: int) -> None:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_model())
    stats = C.install_comm_hook(ddp, "terngrad", size_to_binarize=SIZE_TO_BINARIZE)
    _ddp_step(ddp, rank, 0)
    assert stats.hook_state.residuals == {}


ADAM_STEPS = 5


def _adam_run(rank: int, corrected: bool) -> tuple[nn.Module, C.TernGradState]:
    from worker.optim import CorrectedAdam

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.004)
    stats = C.install_comm_hook(ddp, "terngrad", size_to_binarize=SIZE_TO_BINARIZE,
                                clip_factor=2.5, adam_correction=corrected, seed=3)
    opt = CorrectedAdam(ddp.parameters(), lr=0.01, weight_decay=0.01)
    if corrected:
        opt.squares = stats.hook_state.squares
    for step in range(ADAM_STEPS):
        grads = _ddp_step(ddp, rank, step)
        opt.step()
    _check_squares(ddp.module, stats.hook_state, grads)
    return ddp.module, stats.hook_state


def _check_squares(model: nn.Module, state: C.TernGradState,
                   grads: dict[str, torch.Tensor]) -> None:
    if state.squares is None:
        return
    names = {p.data_ptr(): n for n, p in model.named_parameters()}
    assert {names[k] for k in state.squares} == set(names.values()) - FLOAT_NAMES
    for key, square in state.squares.items():
        m = grads[names[key]].reshape(-1)
        # never above m^2 (the draws only add variance; |m| may pass s by a rounding
        # ulp), below it somewhere, the same on every rank
        assert bool((square <= m * m * (1 + 1e-6)).all())
        assert bool((square < 0.9 * m * m).any())
        gathered = _all_gather(square)
        assert all(torch.equal(gathered[0], g) for g in gathered[1:])


def _run_adam_correction(rank: int) -> None:
    """With the correction every rank applies the same update (the replicas stay equal),
    and the update differs from plain Adam's on the same codes."""
    corrected, _ = _adam_run(rank, corrected=True)
    plain, _ = _adam_run(rank, corrected=False)
    for (n, p), q in zip(corrected.named_parameters(), plain.parameters()):
        gathered = _all_gather(p.detach())
        assert all(torch.equal(gathered[0], g) for g in gathered[1:]), n
        if n not in FLOAT_NAMES:
            assert not torch.equal(p, q), n


def _worker(rank: int, world: int, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        _run_terngrad(rank, world)
        _run_error_feedback(rank)
        _run_no_feedback_keeps_nothing(rank)
        _run_none_and_fp16(rank)
        _run_adam_correction(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Every check passed. Leave without C++ static destructors: gloo's threads can still
    # be joinable at interpreter exit, which aborts the process (a rare SIGABRT, seen in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def rank_modules() -> Iterator[tuple[str, ...]]:
    """What the ranks of both runs need, imported once in a fork server that each rank is
    forked from (spawned, each of the 5 ranks imported torch and torch._dynamo itself:
    ~6 s of CPU apiece). Each rank still makes its own process group and model from its
    seed, as a spawned one did. The server ends with the module."""
    yield ("torch", "torch._dynamo", "torch.distributed", __name__)
    stop_fork_server()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_hooks_in_multiprocess_gloo_run(world: int, rank_modules: tuple[str, ...]) -> None:
    spawn_ranks(_worker, world, SPAWN_TIMEOUT_S, preload=rank_modules)


# ---------------------------------------------------------------------------
# The training program's option


def test_error_feedback_option_is_for_terngrad_only(capsys: pytest.CaptureFixture[str]) -> None:
    from worker import train

    assert train.parse_args(["--grad-compression", "terngrad", "--error-feedback"]).error_feedback
    assert not train.parse_args(["--grad-compression", "terngrad"]).error_feedback
    with pytest.raises(SystemExit) as stop:
        train.parse_args(["--grad-compression", "fp16", "--error-feedback"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: rank 0: --error-feedback works with --grad-compression "
                          "terngrad only (fix: ") and "Traceback" not in err


def test_nearest_rounding_contracts_where_random_draws_do_not() -> None:
    """Why feedback uses nearest rounding: its error is below the gradient's own size."""
    grad = torch.randn(100_000, generator=torch.Generator().manual_seed(1))
    s = 1.5 * grad.std(correction=0)
    nearest = C.decode_ternary(C.ternarize_nearest(grad, s), s)
    assert set(torch.unique(nearest / s).tolist()) == {-1.0, 0.0, 1.0}
    assert torch.equal(nearest == 0, grad.abs() <= s / 2)
    assert ((nearest - grad) ** 2).sum() < 0.25 * (grad ** 2).sum()
    wide = 2.5 * grad.std(correction=0)
    drawn = C.decode_ternary(C.ternarize(grad, wide, torch.Generator().manual_seed(2)), wide)
    assert ((drawn - grad) ** 2).sum() > 0.9 * (grad ** 2).sum()


# ---------------------------------------------------------------------------
# The Adam correction (single process; the multiprocess run checks the ranks agree)


def test_corrected_square_is_the_plain_square_where_the_quantiser_is_exact() -> None:
    s = 0.37
    m = torch.tensor([s, -s, 0.0, s, 0.0])  # every rank sent exactly +-s or 0, as one
    assert torch.equal(C.corrected_square(m, s, 2), m * m)
    half = torch.tensor([s / 2])  # two ranks differ: one +s, one 0 -> the floor m^2 / W^2
    assert torch.allclose(C.corrected_square(half, s, 2), half * half / 4)


def test_corrected_square_removes_most_of_the_variance_of_the_draws() -> None:
    world, reps, s = 2, 20_000, 1.0
    g = torch.tensor([0.05, 0.2, -0.3, 0.6])
    gen = torch.Generator().manual_seed(5)
    draws = C.decode_ternary(C.ternarize(g.repeat(world * reps), s, gen), s)
    m = draws.view(reps, world, -1).mean(dim=1)
    plain = (m * m).mean(dim=0)
    corrected = C.corrected_square(m, s, world).mean(dim=0)
    # E[m^2] = g^2 + (s|g| - g^2) / W; for W = 2 the correction leaves a quarter of that
    # excess (the floor m^2 / 4 where one rank drew s and the other 0)
    assert torch.allclose(plain, g * g + (s * g.abs() - g * g) / world, rtol=0.05)
    excess = (s * g.abs() - g * g) / 8
    torch.testing.assert_close(corrected, g * g + excess, rtol=0.1, atol=1e-4)
    assert bool((corrected - g * g < 0.35 * (plain - g * g)).all())


def test_corrected_adam_is_adam_without_squares_and_with_exact_squares() -> None:
    from worker.optim import CorrectedAdam

    torch.manual_seed(0)
    ref, mine, exact = (nn.Linear(6, 3) for _ in range(3))
    mine.load_state_dict(ref.state_dict())
    exact.load_state_dict(ref.state_dict())
    opts = [torch.optim.Adam(ref.parameters(), lr=0.05, weight_decay=0.1),
            CorrectedAdam(mine.parameters(), lr=0.05, weight_decay=0.1),
            CorrectedAdam(exact.parameters(), lr=0.05, weight_decay=0.1)]
    for step in range(6):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for model, opt in zip((ref, mine, exact), opts):
            opt.zero_grad()
            model(x).square().sum().backward()
        # an exact quantiser: the corrected square of the decoded mean is grad^2
        grads = [_grad(p) for p in exact.parameters()]
        squares = {p.data_ptr(): C.corrected_square(g, g.abs(), 2)
                   for p, g in zip(exact.parameters(), grads)}
        opts[2].squares = squares  # type: ignore[attr-defined]
        for opt in opts:
            opt.step()
    for a, b, c in zip(ref.parameters(), mine.parameters(), exact.parameters()):
        torch.testing.assert_close(b, a)
        torch.testing.assert_close(c, a)


@pytest.mark.parametrize("extra", [["--optimizer", "sgd"], ["--error-feedback"],
                                   ["--grad-compression", "fp16"]])
def test_adam_correction_option_needs_terngrad_adam_and_draws(
        extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from worker import train

    base = ["--grad-compression", "terngrad", "--optimizer", "adam",
            "--terngrad-adam-correction"]
    assert train.parse_args(base).terngrad_adam_correction
    with pytest.raises(SystemExit) as stop:
        train.parse_args(base + extra)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--terngrad-adam-correction" in err and "Traceback" not in err


@pytest.mark.parametrize("extra, on", [
    ([], True),                                          # TernGrad + Adam: corrected
    (["--no-terngrad-adam-correction"], False),          # the paper's, asked for
    (["--error-feedback"], False),                       # rounds to the nearest: no draws
    (["--optimizer", "sgd"], False),                     # no second moment to correct
])
def test_adam_correction_is_the_default_where_it_applies(extra: list[str], on: bool) -> None:
    from worker import train

    base = ["--grad-compression", "terngrad", "--optimizer", "adam"]
    assert train.parse_args(base + extra).terngrad_adam_correction is on
    assert train.parse_args(["--optimizer", "adam"]).terngrad_adam_correction is False
