"""Everyday workflows on models whose like parameters share stacked state (`runtime/stacked_state.py`, the
batched hand-off of `runtime/handoff.py`): many equal-shaped small layers (repeated blocks, conv stacks,
per-block gates), reselection every other step, each workflow compared with the reference after every step.

Found by running these workflows: a compiled conv stack hands over channels-last weight gradients (the
stacked hand-off viewed them as if contiguous), and a model cast to another dtype between steps lost the
gradient its next backward had already handed over (adopting the cast replaced the gradient buffers) and,
cast up, overwrote its fp32 masters with their bf16 roundings (a cast is adopted elementwise, as any write).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import zenflow_compile
from zenflow_compile.reference import ZenFlowReference
from zenflow_compile.runtime.handoff import HandoffPlan
from zenflow_compile.runtime.param_state import MatrixState
from zenflow_compile.runtime.transfers import Transfers

LR, WD = 1e-2, 0.01
ATOL, RTOL = 1e-6, 1e-5
# A boundary every two steps after one warm-up step (t = 2, 4, 6, ...), alternately overlapped (its CPU update
# pending until the next boundary) and reselecting (stacked matrices relayouted in place): stacks are built,
# rewritten and restacked many times in a few steps.
KEYS = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=4, overlap_step=True,
            full_warm_up_rounds=1)


class Blocks(nn.Module):
    """Embedding(32, 16) -> n x (Linear(16, 16), LayerNorm(16)) with residuals -> Linear(16, 8); a block in
    `skip` is left out of the forward (a conditional branch: its parameters get no gradient)."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(n))
        self.head = nn.Linear(16, 8)
        self.skip: set[int] = set()

    def forward(self, x):
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                h = torch.tanh(block(h)) + h
        return self.head(h)


class ConvStack(nn.Module):
    """Equal Conv2d(8, 8, 3) layers with ReZero-style scalar gates (0-d parameters): stacked 4-D matrices
    and stacked scalars."""

    def __init__(self, n: int = 3):
        super().__init__()
        self.inp = nn.Conv2d(3, 8, 3, padding=1)
        self.convs = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1) for _ in range(n))
        self.gates = nn.ParameterList(nn.Parameter(torch.full((), 0.5)) for _ in range(n))
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        h = self.inp(x)
        for conv, gate in zip(self.convs, self.gates):
            h = h + gate * torch.tanh(conv(h))
        return self.out(h.mean((2, 3)))


def blocks_batch(i: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, 32, (4, 5), generator=g), torch.randn(4, 5, 8, generator=g).to(dtype)


def conv_batch(i: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(200 + i)
    return torch.randn(4, 3, 6, 6, generator=g).to(dtype), torch.randn(4, 4, generator=g)


def loss_of(model, batch):
    x, y = batch
    return ((model(x).float() - y.float()) ** 2).mean()


def assert_close(a: nn.Module, b: nn.Module, what: str, atol=ATOL, rtol=RTOL):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=rtol, msg=lambda m: f"{what} {name}: {m}")


def models(make, seed=0):
    torch.manual_seed(seed)
    a = make()
    b = copy.deepcopy(a)
    return a, b


def run_pair(a, b, opt, ref, steps, batch_of, *, compiled=False, before_step=None):
    """ZenFlowAdamW on `a` beside the reference on `b`, one backward each per step, compared after every
    step; `before_step(step)` runs before each step's forward."""
    run_a = torch.compile(a, backend="zenflow") if compiled else a
    run_b = torch.compile(b, backend="inductor") if compiled else b
    for step in steps:
        if before_step is not None:
            before_step(step)
        for model, o in ((run_a, opt), (run_b, ref)):
            loss_of(model, batch_of(step)).backward()
            o.step()
            o.zero_grad()
        assert_close(a, b, f"step {step}")
    opt.synchronize()
    ref.synchronize()
    assert_close(a, b, "synchronized")


# -- found bugs ---------------------------------------------------------------------------------------------


def test_stacked_handoff_takes_channels_last_gradients():
    """A compiled conv backward produces channels-last weight gradients; the stacked hand-off must leave what
    each state's own receive_grad leaves (it used to view the stacked gradients as if contiguous: error)."""
    torch.manual_seed(0)
    transfers = Transfers(torch.device("cpu"))
    params = [nn.Parameter(torch.randn(8, 8, 3, 3)) for _ in range(3)]

    def states():
        made = [MatrixState(p, i, 0, transfers) for i, p in enumerate(params)]
        for m in made:
            m.select(torch.tensor([3, 9, 40, 71]))
        return made

    one_by_one, batched = states(), states()
    grads = [torch.randn(8, 8, 3, 3).contiguous(memory_format=torch.channels_last) for _ in params]
    assert not grads[0].is_contiguous()
    sent = sum(s.receive_grad(g, None, 0) for s, g in zip(one_by_one, grads))
    assert HandoffPlan(batched).receive(grads, None, 0) == sent
    for a, b in zip(one_by_one, batched):
        torch.testing.assert_close(b.scores, a.scores, rtol=0, atol=0)
        torch.testing.assert_close(b.dev_grad, a.dev_grad, rtol=0, atol=0)
        torch.testing.assert_close(b.host_grads[0], a.host_grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_conv_stack_with_scalar_gates_equals_reference(compiled, device):
    a, b = models(ConvStack)
    opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, **KEYS)
    ref = ZenFlowReference(b.parameters(), lr=LR, weight_decay=WD, **KEYS)
    run_pair(a, b, opt, ref, range(7), conv_batch, compiled=compiled)
    assert opt.stats()["reselections"] > 0


@pytest.mark.parametrize("when", ["before-backward", "before-step"])
@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
@pytest.mark.parametrize("first, then", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["fp32-to-bf16", "bf16-to-fp32"])
def test_model_cast_between_steps_equals_reference(first, then, overlap, when, device):
    """model.to(dtype) mid-run (after stacking, a CPU update pending with overlap). The cast must not lose the
    gradient of the next backward (the replaced buffers zeroed it: masters off by about one update, 0.013);
    like any write it is adopted elementwise where it differs from what the optimizer left (an upcast changes
    nothing: the fp32 masters were overwritten with their bf16 roundings and a pending update was dropped,
    0.008); and it is adopted at that backward's first gradient, so an upcast's gradient is not rounded to the
    old dtype on the way in (4.6e-5 when it was adopted at the step). Cast between a compiled backward and
    the step, the gradients that backward handed over move to the new buffers (their copies down waited for
    first; eagerly they are still in `.grad` and torch casts them)."""
    keys = dict(KEYS, overlap_step=overlap)
    master_atol = ATOL
    a, b = models(lambda: Blocks().to(first))
    opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, **keys)
    ref = ZenFlowReference(b.parameters(), lr=LR, weight_decay=WD, **keys)
    dtype = first
    # (between a backward and the step only a compiled backward has handed gradients over; the reference's
    # model is then compiled by Inductor too, so both backwards round alike)
    compiled = when == "before-step"
    run_a = torch.compile(a, backend="zenflow") if compiled else a
    run_b = torch.compile(b, backend="inductor") if compiled else b
    for step in range(7):
        cast = step == 4
        if cast and when == "before-backward":
            a.to(then)
            b.to(then)
            dtype = then
        for model, run, o in ((a, run_a, opt), (b, run_b, ref)):
            loss_of(run, blocks_batch(step, dtype)).backward()
            if cast and when == "before-step":
                model.to(then)  # (torch casts .grad along with the parameter)
            o.step()
            o.zero_grad()
        dtype = then if step >= 4 else first  # (what the parameters hold now)
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(opt.master(p), ref.master(q), atol=master_atol, rtol=RTOL,
                                       msg=lambda m: f"step {step} master of {name}: {m}")
            tolerance = dict(atol=master_atol, rtol=RTOL) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(p, q, **tolerance, msg=lambda m: f"step {step} {name}: {m}")
    opt.synchronize()
    ref.synchronize()
    assert_close(a, b, "synchronized", atol=1e-2 if then == torch.bfloat16 else master_atol)


# -- workflows that hold (kept so they keep holding) -----------------------------------------------------


def blocks_pair(keys=KEYS, groups=None, **opt_kwargs):
    a, b = models(Blocks)
    opt = zenflow_compile.ZenFlowAdamW(groups(a) if groups else a.parameters(), lr=LR, weight_decay=WD,
                                       **opt_kwargs, **keys)
    ref = ZenFlowReference(groups(b) if groups else b.parameters(), lr=LR, weight_decay=WD,
                           max_grad_norm=opt_kwargs.get("max_grad_norm"), **keys)
    return a, b, opt, ref


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_resume_into_an_optimizer_that_already_stacked_and_rolling_back_are_exact(compiled, device):
    """A checkpoint taken mid-run (stacks built, a CPU update pending) loaded into (1) an optimizer that has
    trained on other data (its own stacks built and relayouted) and (2) the optimizer it came from, rolled
    back after more steps: both continue bitwise as the uninterrupted run."""

    def train(run, opt, steps):
        for step in steps:
            loss_of(run, blocks_batch(step)).backward()
            opt.step()
            opt.zero_grad()

    def make():
        model = Blocks()
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, weight_decay=WD, **KEYS)
        return model, opt, (torch.compile(model, backend="zenflow") if compiled else model)

    torch.manual_seed(0)
    model, opt, run = make()
    train(run, opt, range(4))
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    train(run, opt, range(4, 9))
    opt.synchronize()
    expected = [p.detach().clone() for p in model.parameters()]

    other, other_opt, other_run = make()
    train(other_run, other_opt, range(50, 55))
    model.load_state_dict(saved_model)  # (2) rolled back
    opt.load_state_dict(saved_opt)
    other.load_state_dict(saved_model)  # (1)
    other_opt.load_state_dict(saved_opt)
    for m, o, r in ((model, opt, run), (other, other_opt, other_run)):
        train(r, o, range(4, 9))
        o.synchronize()
        for (name, p), q in zip(m.named_parameters(), expected):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda msg: f"{name}: {msg}")


def interleaved_groups(model):
    """Even blocks, odd blocks (like parameters split across groups) and the rest, each its own lr and wd."""
    even = [p for i, block in enumerate(model.blocks) if i % 2 == 0 for p in block.parameters()]
    odd = [p for i, block in enumerate(model.blocks) if i % 2 == 1 for p in block.parameters()]
    rest = list(model.emb.parameters()) + list(model.head.parameters())
    return [dict(params=even), dict(params=odd, lr=3e-2, weight_decay=0.1), dict(params=rest, lr=5e-3, weight_decay=0.0)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_param_groups_splitting_stacks_with_an_lr_schedule_equal_reference(compiled, device):
    """Like parameters in different param groups share stacks; each group's update takes its own lr and
    weight decay, which a LambdaLR changes at every step."""
    a, b, opt, ref = blocks_pair(groups=interleaved_groups)

    def schedule(o):
        return torch.optim.lr_scheduler.LambdaLR(o, [lambda s, i=i: 1.0 / (1 + s * (i + 1)) for i in range(3)])

    schedulers = [schedule(opt), schedule(ref)]
    run_pair(a, b, opt, ref, range(7), blocks_batch, compiled=compiled,
             before_step=lambda step: step and [s.step() for s in schedulers])
    assert opt.param_groups[1]["lr"] == ref.param_groups[1]["lr"] < 3e-2
    assert opt.stats()["reselections"] > 0


def test_grad_scaler_skipped_step_and_accumulation_with_part_of_a_stack_unused(device):
    """torch.amp.GradScaler on CPU with an inf gradient at step 3 (skipped; the scale halves), gradient
    accumulation over two micro-batches of which the first leaves blocks 1 and 3 out (only part of a
    stack's gradients in a bucket, then all of them), and one block's weight written at step 5: equal to
    the reference fed the unscaled gradients."""
    a, b, opt, ref = blocks_pair()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    micro = 0
    for step in range(8):
        if step == 5:
            for model in (a, b):
                with torch.no_grad():
                    model.blocks[2][0].weight.mul_(0.5)
        for model in (a, b):
            for j in range(2):
                model.skip = {1, 3} if j == 0 else set()
                x, y = blocks_batch(micro + j)
                if step == 3 and j == 1:
                    y = y.clone()
                    y[0, 0, 0] = float("inf")
                loss = ((model(x) - y) ** 2).mean()
                (scaler.scale(loss) if model is a else loss).backward()
        micro += 2
        with warnings.catch_warnings():  # (torch's FutureWarning about GradScaler passing itself)
            warnings.simplefilter("ignore", FutureWarning)
            scaler.step(opt)
        scaler.update()
        ref.step()
        for o in (opt, ref):
            o.zero_grad()
        assert_close(a, b, f"step {step}")
    assert opt.stats()["skipped_steps"] == ref.stats()["skipped_steps"] == 1
    assert scaler.get_scale() == 2.0 ** 9
    opt.synchronize()
    ref.synchronize()
    assert_close(a, b, "synchronized")
