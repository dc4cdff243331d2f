"""The opt-in `interval_aware_update` key (SPEC §3 "Opt-in extension"), against its oracles.

- What it means, on the reference: at a boundary the unselected columns take one AdamW step with the mean of
  the m accumulated gradients and lr * m (weight decay included); with the key off, lr as SPEC §3 says.
  Checked against torch.optim.AdamW run on those columns by hand.
- Invariant 1 still holds with the key on (update_interval=1: m = 1, so it is AdamW).
- Invariant 3 with the key on: compiled and eager ZenFlowAdamW equal ZenFlowReference step by step, for int
  intervals with overlap and warm-up, reselection, and Zen-auto (whose m varies from boundary to boundary).
"""

import pytest
import torch

import zenflow_compile
import zenflow_compile.backend  # noqa: F401  (registers backend="zenflow")
from helpers import tiny_model
from zenflow_compile.reference import ZenFlowReference

LR, WD, STEPS = 1e-2, 0.1, 7
ATOL, RTOL = 1e-6, 1e-5


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def batch(i):
    g = torch.Generator().manual_seed(2000 + i)
    return torch.randint(0, 32, (8, 6), generator=g), torch.randn(8, 6, 16, generator=g)


def loss_fn(model, i):
    x, y = batch(i)
    return ((model(x) - y) ** 2).mean()


@pytest.mark.parametrize("interval_aware", [False, True])
def test_boundary_update_is_adamw_with_lr_times_m(interval_aware):
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
    torch.optim.AdamW([q], lr=LR * (m if interval_aware else 1), weight_decay=WD).step()
    torch.testing.assert_close(p.detach()[:, unselected], q.detach(), atol=1e-7, rtol=1e-6)


def test_interval_one_still_equals_adamw():
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


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("keys", list(CONFIGS.values()), ids=list(CONFIGS))
def test_equals_reference_with_key_on(keys, compiled):
    keys = dict(keys, interval_aware_update=True)
    a, b = tiny_model(), tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, **keys)
    ref = ZenFlowReference(b.parameters(), lr=LR, weight_decay=WD, **keys)
    # Same forward/backward numerics on both sides: Inductor for the oracle when ZenFlow is compiled.
    run_a = torch.compile(a, backend="zenflow") if compiled else a
    run_b = torch.compile(b, backend="inductor") if compiled else b
    for i in range(STEPS):
        for model, o in ((run_a, opt), (run_b, ref)):
            loss_fn(model, i).backward()
            o.step()
            o.zero_grad()
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL, msg=lambda msg: f"step {i} {name}: {msg}")
    opt.synchronize()
    ref.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)
    assert opt.stats()["cpu_updates"] == ref.stats()["cpu_updates"] > 0


def test_key_changes_the_trajectory_only_when_on():
    """Off is SPEC §3 as written (DeepSpeed's behaviour); on gives other weights once a boundary has m > 1."""
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
