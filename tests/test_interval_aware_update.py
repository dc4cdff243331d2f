"""The opt-in `interval_aware_update` key (docs/semantics.md, "Updates and boundaries"), against its oracles.

- What it means, on the reference: at a boundary the unselected columns take one AdamW step with the mean of
  the m accumulated gradients and lr * m (weight decay included); with the key off, lr as DeepSpeed's rule says.
  Checked against torch.optim.AdamW run on those columns by hand.
- Invariant 1 still holds with the key on (update_interval=1: m = 1, so it is AdamW).
- Invariant 3 with the key on: compiled and eager ZenFlowAdamW equal ZenFlowReference step by step, for int
  intervals with overlap and warm-up, reselection, and Zen-auto (whose m varies from boundary to boundary).
- `interval_second_moment` (on top of it): the interval step's exp_avg_sq takes the mean of the per-step
  squared gradients; checked on the reference against a float64 recomputation, the host kernels against
  float64, and the runtime (eager, compiled, gradient accumulation, bf16) against the reference.
"""

import math

import pytest
import torch

import zenflow_compile
import zenflow_compile.backend  # noqa: F401  (registers backend="zenflow")
from helpers import seeded_generator, tiny_model
from zenflow_compile.reference import ZenFlowReference

LR, WD, STEPS = 1e-2, 0.1, 7
ATOL, RTOL = 1e-6, 1e-5


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def batch(i):
    g = seeded_generator(2000 + i)
    return torch.randint(0, 32, (8, 6), generator=g), torch.randn(8, 6, 16, generator=g)


def loss_fn(model, i):
    x, y = batch(i)
    return ((model(x) - y) ** 2).mean()


@pytest.mark.parametrize("interval_aware,lr_factor", [(False, 1), (True, 3), ("sqrt", math.sqrt(3))],
                         ids=["off", "lr*m", "lr*sqrt(m)"])
def test_boundary_update_is_adamw_with_lr_times_m(interval_aware, lr_factor, device):
    m, k = 3, 2  # interval, selected columns of 8
    torch.manual_seed(0)
    w0 = torch.randn(5, 8)
    p = torch.nn.Parameter(w0.clone())
    opt = ZenFlowReference([p], lr=LR, weight_decay=WD, topk_ratio=k / 8, update_interval=m,
                           interval_aware_update=interval_aware)
    grads = [torch.randn(5, 8) for _ in range(m)]
    for g in grads:
        p.grad = g.clone()
        opt.step()
    unselected = torch.ones(8, dtype=torch.bool)
    unselected[opt.selected_columns(p)] = False

    # By hand: one torch.optim.AdamW step of the unselected columns from w0 with the mean gradient.
    q = torch.nn.Parameter(w0[:, unselected].clone())
    q.grad = (sum(grads) / m)[:, unselected]
    torch.optim.AdamW([q], lr=LR * lr_factor, weight_decay=WD).step()
    torch.testing.assert_close(p.detach()[:, unselected], q.detach(), atol=1e-7, rtol=1e-6)


def test_interval_one_still_equals_adamw(device):
    a, b = tiny_model(), tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, topk_ratio=0.25,
                                       update_interval=1, interval_aware_update=True)
    oracle = torch.optim.AdamW(b.parameters(), lr=LR, weight_decay=WD)
    for i in range(STEPS):
        for model, o in ((a, opt), (b, oracle)):
            loss_fn(model, i).backward()
            o.step()
            o.zero_grad()
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)


CONFIGS = {
    "interval3-overlap-warmup": dict(topk_ratio=0.1, update_interval=3, overlap_step=True, full_warm_up_rounds=2),
    "interval2-reselect-step": dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=2),
    "auto-interval-overlap": dict(topk_ratio=0.25, update_interval="auto", overlap_step=True, max_update_interval=4),
    "auto-interval-auto-select": dict(topk_ratio=0.5, update_interval="auto", auto_ratio=0.5),
}


def train_beside_reference(keys, compiled, *, dtype=torch.float32, backwards_per_step=1, atol=ATOL, rtol=RTOL):
    """ZenFlowAdamW and ZenFlowReference on the same model, batches and keys for STEPS steps, parameters
    compared after every step. Returns (model, optimizer, reference model, reference)."""
    a, b = tiny_model(dtype), tiny_model(dtype)
    opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, **keys)
    ref = ZenFlowReference(b.parameters(), lr=LR, weight_decay=WD, **keys)
    # Same forward/backward numerics on both sides: Inductor for the oracle when ZenFlow is compiled.
    run_a = torch.compile(a, backend="zenflow") if compiled else a
    run_b = torch.compile(b, backend="inductor") if compiled else b
    for i in range(STEPS):
        for model, o in ((run_a, opt), (run_b, ref)):
            for j in range(backwards_per_step):
                loss_fn(model, backwards_per_step * i + j).backward()
            o.step()
            o.zero_grad()
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=atol, rtol=rtol, msg=lambda msg: f"step {i} {name}: {msg}")
    return a, opt, b, ref


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("keys", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize("second_moment", [False, True], ids=["lr", "lr+second-moment"])
def test_equals_reference_with_key_on(keys, compiled, second_moment, device):
    keys = dict(keys, interval_aware_update=True, interval_second_moment=second_moment)
    a, opt, b, ref = train_beside_reference(keys, compiled)
    opt.synchronize()
    ref.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)
    assert opt.stats()["cpu_updates"] == ref.stats()["cpu_updates"] > 0


SQRT_CONFIGS = {
    # the setting "sqrt" is measured for: staggered boundaries landing a step late, arriving columns
    "stagger-lag1-incoming": dict(topk_ratio=0.25, update_interval=4, overlap_step=True, landing_lag=1,
                                  stagger_boundaries=True, overlap_reselect="incoming", select_strategy="step",
                                  select_interval=2),
    "auto-interval-overlap": CONFIGS["auto-interval-overlap"],
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("keys", list(SQRT_CONFIGS.values()), ids=list(SQRT_CONFIGS))
def test_equals_reference_with_sqrt_scale(keys, compiled, device):
    """interval_aware_update="sqrt": the runtime's CPU updates (at boundaries, and of the columns a reselection
    brings to the device) take lr * sqrt(m), as the reference's."""
    a, opt, b, ref = train_beside_reference(dict(keys, interval_aware_update="sqrt"), compiled)
    opt.synchronize()
    ref.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)
    assert opt.stats()["cpu_updates"] == ref.stats()["cpu_updates"] > 0


def test_key_changes_the_trajectory_only_when_on():
    """Off is DeepSpeed's update rule; on gives other weights once a boundary has m > 1."""
    keys = dict(topk_ratio=0.25, update_interval=3)
    models = {flag: tiny_model() for flag in (None, False, True)}
    opts = {None: ZenFlowReference(models[None].parameters(), lr=LR, weight_decay=WD, **keys)}
    for flag in (False, True):
        opts[flag] = ZenFlowReference(models[flag].parameters(), lr=LR, weight_decay=WD,
                                      interval_aware_update=flag, **keys)
    for i in range(3):
        for flag, model in models.items():
            loss_fn(model, i).backward()
            opts[flag].step()
            opts[flag].zero_grad()
    default, off, on = (list(models[f].parameters()) for f in (None, False, True))
    assert all(torch.equal(p, q) for p, q in zip(default, off))
    assert not all(torch.equal(p, q) for p, q in zip(off, on))


# ------------------------------------------------------------------------------- interval_second_moment
def test_second_moment_boundary_update_in_float64():
    """One interval of m steps from w0: the unselected columns take w0 * (1 - lr m wd) - lr m * mean(g) /
    (sqrt(mean(g**2)) + eps) (count 1: the bias corrections cancel), where AdamW's second moment would be
    mean(g)**2 with interval_aware_update alone."""
    m, k, cols = 4, 2, 8
    torch.manual_seed(1)
    w0 = torch.randn(5, cols)
    grads = [torch.randn(5, cols) for _ in range(m)]
    results = {}
    for second_moment in (False, True):
        p = torch.nn.Parameter(w0.clone())
        opt = ZenFlowReference([p], lr=LR, weight_decay=WD, eps=1e-8, topk_ratio=k / cols, update_interval=m,
                               interval_aware_update=True, interval_second_moment=second_moment)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        unselected = torch.ones(cols, dtype=torch.bool)
        unselected[opt.selected_columns(p)] = False
        results[second_moment] = p.detach()[:, unselected]
    g64 = torch.stack([g[:, unselected] for g in grads]).double()
    w = w0[:, unselected].double() * (1 - LR * m * WD)
    with_mean_sq = w - LR * m * g64.mean(0) / (g64.square().mean(0).sqrt() + 1e-8)
    with_sq_mean = w - LR * m * g64.mean(0) / (g64.mean(0).abs() + 1e-8)
    torch.testing.assert_close(results[True].double(), with_mean_sq, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(results[False].double(), with_sq_mean, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_squares_kernel_in_float64(dtype):
    from zenflow_compile.runtime import kernels

    torch.manual_seed(2)
    grads = [torch.randn(3, 7).to(dtype), torch.randn(2, 5).to(dtype)]
    accs, squares = [torch.randn(3, 7), torch.randn(2, 5)], [torch.rand(3, 7), torch.rand(2, 5)]
    expected_accs = [a.double() + 0.5 * g.double() for a, g in zip(accs, grads)]
    expected_squares = [q.double() + (0.5 * g.double()) ** 2 for q, g in zip(squares, grads)]
    kernels.accumulate_scaled_many_(accs, grads, 0.5, square_accs=squares)
    for got, want in zip(accs + squares, expected_accs + expected_squares):
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_second_moment_with_gradient_accumulation_and_bf16_equals_reference(compiled, device):
    """Two backwards per step (the host parts are summed before they are squared) and a bf16 model (the
    converted accumulation path): the runtime against the reference on the same bf16 forward/backward."""
    keys = dict(topk_ratio=0.25, update_interval=3, overlap_step=True, interval_aware_update=True,
                interval_second_moment=True)
    a, opt, b, ref = train_beside_reference(keys, compiled, dtype=torch.bfloat16, backwards_per_step=2,
                                            atol=0, rtol=0)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(opt.master(p), ref.master(q), atol=ATOL, rtol=RTOL)
    assert opt.stats()["cpu_updates"] == ref.stats()["cpu_updates"] > 0


def test_second_moment_rejects_beta2_zero_before_changing_anything():
    model = tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, betas=(0.9, 0.0), topk_ratio=0.25,
                                       update_interval=2, interval_aware_update=True, interval_second_moment=True)
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, 0).backward()
    with pytest.raises(ValueError, match=r"interval_second_moment needs betas\[1\] > 0; param group 0"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert opt.stats()["steps"] == 0


def test_second_moment_host_memory_is_one_more_accumulator_pair():
    """The documented cost: two more fp32 buffers (one per interval parity) per unselected column."""
    bytes_used = {}
    for second_moment in (False, True):
        model = tiny_model()
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2,
                                           interval_aware_update=True, interval_second_moment=second_moment)
        loss_fn(model, 0).backward()
        opt.step()
        bytes_used[second_moment] = opt.stats()["host_state_bytes"]
        host_elements = sum(p.numel() - p.shape[0] * len(opt.selected_columns(p))
                            for p in model.parameters() if p.dim() >= 2)
    assert bytes_used[True] - bytes_used[False] == 2 * 4 * host_elements
