"""Compiled ZenFlow training (backend="zenflow" + ZenFlowAdamW) against its oracles, step by step:

- invariant 3: equals the eager reference `ZenFlowReference` for the configs of tests/test_reference.py
  (int and auto intervals, overlap on/off, warm-up, reselection by step and by drift, clipping, bf16);
- invariants 1 and 2: equals torch.optim.AdamW (update_interval=1 without overlap; topk_ratio=1).

The oracle's model is compiled too, with the stock "inductor" backend, so both sides see the same forward and
backward numerics (eager aten sums in another order than Inductor's fused kernels, and Adam's first steps
turn a rounding difference in a tiny gradient into a difference of up to 2 * lr); what is compared is then
the optimizer alone, fed through the rewritten graph on one side and through `.grad` on the other.
"""

import pytest
import torch

import zenflow_compile
import zenflow_compile.backend  # noqa: F401  (registers backend="zenflow" without the installed entry point)
from helpers import seeded_generator, tiny_model as make_model
from zenflow_compile import inspect as zf_inspect
from zenflow_compile.reference import ZenFlowReference

ATOL, RTOL = 1e-6, 1e-5
LR = 1e-2
STEPS = 6


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def batch(i, dtype):
    g = seeded_generator(1000 + i)
    return torch.randint(0, 32, (8, 6), generator=g), torch.randn(8, 6, 16, generator=g).to(dtype)


def loss_fn(model, i):
    x, y = batch(i, next(model.parameters()).dtype)
    return ((model(x).float() - y.float()) ** 2).mean()


def run_against(make_oracle, keys, *, dtype=torch.float32, clip=None, atol=ATOL, rtol=RTOL,
                reduce_bucket_size=25_000_000):
    """Train a compiled ZenFlow copy and an oracle copy on the same batches; compare after every step."""
    a, b = make_model(dtype), make_model(dtype)
    opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, max_grad_norm=clip,
                                       reduce_bucket_size=reduce_bucket_size, **keys)
    oracle = make_oracle(b.parameters())
    compiled = torch.compile(a, backend="zenflow")
    compiled_b = torch.compile(b, backend="inductor")
    for i in range(STEPS):
        loss_fn(compiled, i).backward()
        assert all(p.grad is None for p in a.parameters())
        opt.step()
        opt.zero_grad()
        loss_fn(compiled_b, i).backward()
        if clip is not None and isinstance(oracle, torch.optim.AdamW):
            torch.nn.utils.clip_grad_norm_(b.parameters(), clip)
        oracle.step()
        oracle.zero_grad()
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=atol, rtol=rtol, msg=lambda m: f"step {i} {name}: {m}")
    opt.synchronize()
    if isinstance(oracle, ZenFlowReference):
        oracle.synchronize()
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=atol, rtol=rtol)
    return opt, oracle


REFERENCE_CONFIGS = {
    "interval2-reselect-step": dict(topk_ratio=0.25, update_interval=2, select_strategy="step",
                                    select_interval=2),
    "interval2-overlap-reselect": dict(topk_ratio=0.25, update_interval=2, overlap_step=True,
                                       select_strategy="step", select_interval=2),
    "interval3-overlap-warmup": dict(topk_ratio=0.1, update_interval=3, overlap_step=True,
                                     full_warm_up_rounds=2),
    "auto-interval-auto-select": dict(topk_ratio=0.25, update_interval="auto", select_strategy="auto",
                                      max_update_interval=3),
    "auto-interval-overlap": dict(topk_ratio=0.5, update_interval="auto", overlap_step=True, auto_ratio=0.5),
    "interval4-lag1-incoming": dict(topk_ratio=0.25, update_interval=4, overlap_step=True, landing_lag=1,
                                    select_strategy="step", select_interval=4, overlap_reselect="incoming"),
}


@pytest.mark.parametrize("keys", list(REFERENCE_CONFIGS.values()), ids=list(REFERENCE_CONFIGS))
def test_compiled_equals_reference(keys, device):
    opt, ref = run_against(lambda ps: ZenFlowReference(ps, lr=LR, **keys), keys)
    st, rst = opt.stats(), ref.stats()
    for key in ("steps", "skipped_steps", "cpu_updates", "reselections"):
        assert st[key] == rst[key], key


def test_compiled_equals_reference_with_clipping(device):
    keys = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=2)
    run_against(lambda ps: ZenFlowReference(ps, lr=LR, max_grad_norm=0.05, **keys), keys, clip=0.05)


def test_compiled_equals_reference_bf16(device):
    keys = dict(topk_ratio=0.25, update_interval=2)
    run_against(lambda ps: ZenFlowReference(ps, lr=LR, **keys), keys, dtype=torch.bfloat16)


@pytest.mark.parametrize("keys,clip", [
    (dict(topk_ratio=0.1, select_strategy="auto"), None),
    (dict(topk_ratio=0.5, select_strategy="step", select_interval=2, full_warm_up_rounds=2), 0.05),
], ids=["r0.1-auto", "r0.5-step-warmup-clip"])
def test_interval_one_equals_adamw(keys, clip, device):
    keys = dict(keys, update_interval=1, overlap_step=False)
    run_against(lambda ps: torch.optim.AdamW(ps, lr=LR), keys, clip=clip)


@pytest.mark.parametrize("update_interval,overlap", [(3, True), ("auto", False)])
def test_ratio_one_equals_adamw(update_interval, overlap, device):
    keys = dict(topk_ratio=1.0, update_interval=update_interval, overlap_step=overlap)
    run_against(lambda ps: torch.optim.AdamW(ps, lr=LR), keys)


# Tiny's gradients in the order the backward produces them: fc2.weight 384, fc2.bias 16, norm.weight 24,
# norm.bias 24, fc1.weight 384, fc1.bias 24, emb.weight 512 elements.
@pytest.mark.parametrize("reduce_bucket_size,buckets", [(1, 7), (600, 2), (25_000_000, 1)])
def test_compiled_in_buckets_equals_reference(reduce_bucket_size, buckets, device):
    """The backward hands gradients over in buckets of `reduce_bucket_size` elements; training is the same."""
    keys = REFERENCE_CONFIGS["interval2-overlap-reselect"]
    with zf_inspect.capture() as graphs:
        run_against(lambda ps: ZenFlowReference(ps, lr=LR, **keys), keys, reduce_bucket_size=reduce_bucket_size)
    (graph,) = graphs
    calls = [n for n in graph.after.graph.nodes if n.target is torch.ops.zenflow.accumulate_grads.default]
    assert len(calls) == buckets
    handed = [graph.param_names[slot] for call in calls for slot in call.args[2]]
    assert sorted(handed) == sorted(name for name, _ in make_model().named_parameters())  # each once


def test_one_graph_owned_by_two_optimizers_routes_each_gradient_to_its_owner(device):
    """Matrices and vectors of one model in two ZenFlowAdamW (other lr and interval): the graph's buckets
    mix both owners' gradients, each owner gets its own, and each side equals its own reference."""
    a, b = make_model(), make_model()

    def split(model):
        return ([p for p in model.parameters() if p.dim() >= 2], [p for p in model.parameters() if p.dim() < 2])

    keys = [dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=2),
            dict(topk_ratio=0.5, update_interval=3, overlap_step=True)]
    lrs = [LR, 3 * LR]
    opts = [zenflow_compile.ZenFlowAdamW(ps, lr=lr, reduce_bucket_size=600, **k)
            for ps, lr, k in zip(split(a), lrs, keys)]
    refs = [ZenFlowReference(ps, lr=lr, **k) for ps, lr, k in zip(split(b), lrs, keys)]
    compiled, compiled_b = torch.compile(a, backend="zenflow"), torch.compile(b, backend="inductor")
    with zf_inspect.capture() as graphs:
        for i in range(STEPS):
            loss_fn(compiled, i).backward()
            loss_fn(compiled_b, i).backward()
            for opt in [*opts, *refs]:
                opt.step()
                opt.zero_grad()
            for (name, p), q in zip(a.named_parameters(), b.parameters()):
                torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {i} {name}: {m}")
    (graph,) = graphs
    (first, *_) = [n for n in graph.after.graph.nodes if n.target is torch.ops.zenflow.accumulate_grads.default]
    names = [graph.param_names[slot] for slot in first.args[2]]
    assert any(n.endswith("weight") and n != "norm.weight" for n in names) and "fc2.bias" in names  # mixed
    assert [opt.stats()["steps"] for opt in opts] == [STEPS, STEPS]


def test_owners_of_one_graph_must_agree_on_the_bucket_size():
    model = make_model()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    opts = [zenflow_compile.ZenFlowAdamW(matrices, lr=LR, reduce_bucket_size=600),
            zenflow_compile.ZenFlowAdamW(vectors, lr=LR, reduce_bucket_size=1000)]
    with pytest.raises(Exception, match=r"disagree on how gradients are handed over.*reduce_bucket_size 1000.*"
                                        r"Fix: give them the same reduce_bucket_size"):
        loss_fn(torch.compile(model, backend="zenflow"), 0).backward()
    del opts


def test_a_graph_compiled_for_one_bucket_size_refuses_a_model_whose_optimizer_uses_another():
    """A graph is compiled once per module class: a second model of the class runs the first one's graph, which
    hands gradients over in the first optimizer's buckets (in data parallel, with its reduction). An owner
    that hands over otherwise is told so at the call, not run with settings it did not ask for."""
    first = make_model()
    opt_first = zenflow_compile.ZenFlowAdamW(first.parameters(), lr=LR, reduce_bucket_size=600)
    loss_fn(torch.compile(first, backend="zenflow"), 0).backward()
    opt_first.step()
    second = make_model()
    opt_second = zenflow_compile.ZenFlowAdamW(second.parameters(), lr=LR, reduce_bucket_size=300)
    with pytest.raises(ValueError, match=r"compiled, \(world size 1, reduce_bucket_size 600\), but the ZenFlowAdamW "
                                         r"owning the parameters it now runs with uses \(world size 1, "
                                         r"reduce_bucket_size 300\).*torch._dynamo.reset\(\)"):
        loss_fn(torch.compile(second, backend="zenflow"), 0)
    assert opt_second.stats()["steps"] == 0 and all(p.grad is None for p in second.parameters())
    torch._dynamo.reset()  # the fix the error names: the second model's graph is compiled for its optimizer
    loss_fn(torch.compile(second, backend="zenflow"), 0).backward()
    opt_second.step()
    assert opt_second.stats()["steps"] == 1
