"""Optimizer state in slabs (`runtime/state/slab.py`): like parameters (one param group, dtype, [R, C] shape and
number of selected columns) share one slab, whose tensors hold one row per member.

What the design promises, checked here: like parameters share a slab and a large one gets its own; a
reselection rewrites a slab in place; a step costs a fixed number of torch calls per slab, whatever the
number of its members (the eager hand-off inside step() included); the Triton kernels take slabs as the
torch path does. And every workflow on models of many like layers (repeated blocks, conv stacks, per-block
gates), each compared with the reference after every step: compiled and eager, small buckets flushed during
the backward, gradient accumulation, bf16, a backward that raised, frozen blocks, casts between steps,
checkpoints, param groups, GradScaler.

Found by running these workflows (with the earlier stacked state): a compiled conv stack hands over
channels-last weight gradients (the batched hand-off viewed them as if contiguous), and a model cast to
another dtype between steps lost the gradient its next backward had already handed over (adopting the cast
replaced the gradient buffers) and, cast up, overwrote its fp32 masters with their bf16 roundings (a cast is
adopted elementwise, as any write).
"""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import zenflow_compile
from zenflow_compile.reference import ZenFlowReference
from zenflow_compile.runtime.engine import ZenFlowRuntime
from zenflow_compile.runtime.state import intake
from zenflow_compile.runtime.state.layout import SHARED_SLAB_MAX_NUMEL, top_k_columns
from zenflow_compile.runtime.state.slab import Slab

from helpers import assert_fp32_decides_the_comparison, seeded_generator, skip_where_dynamo_misses_parameter_changes

LR, WD = 1e-2, 0.01
ATOL, RTOL = 1e-6, 1e-5
CONFIGS = {
    # a boundary every other step, each one reselecting (the overlap only between reselections)
    "S2-reselect": dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=2,
                        overlap_step=True),
    "auto": dict(topk_ratio=0.25),
}
# A boundary every two steps after one warm-up step (t = 2, 4, 6, ...), alternately overlapped (its CPU update
# pending until the next boundary) and reselecting (t = 4, 8, ...: slabs rewritten in place): slabs are laid
# out, rewritten and laid out again many times in a few steps.
KEYS = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=4, overlap_step=True,
            full_warm_up_rounds=1)


# -- models and data ----------------------------------------------------------------------------------------


class Blocks(nn.Module):
    """Embedding(32, 16) -> n x (Linear(16, 16), LayerNorm(16)) with residuals -> Linear(16, 8); a block in
    `skip` is left out of the forward (a conditional branch: its parameters get no gradient). Slabs: the n
    block weights; the 3n [16] vectors (Linear biases, LayerNorm weights and biases); the embedding, the head
    weight and the head bias each alone (shapes of their own)."""

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
    """Equal Conv2d(8, 8, 3) layers with ReZero-style scalar gates (0-d parameters): a slab of 4-D matrices
    and a slab of scalars."""

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
    g = seeded_generator(100 + i)
    return torch.randint(0, 32, (4, 5), generator=g), torch.randn(4, 5, 8, generator=g).to(dtype)


def conv_batch(i: int, dtype=torch.float32):
    g = seeded_generator(200 + i)
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


def pair(make, keys, groups=None, **opt_kwargs):
    """Two equal models (`make()`), ZenFlowAdamW on the first and the reference on the second."""
    a, b = models(make)
    opt = zenflow_compile.ZenFlowAdamW(groups(a) if groups else a.parameters(), lr=LR, weight_decay=WD,
                                       **opt_kwargs, **keys)
    ref = ZenFlowReference(groups(b) if groups else b.parameters(), lr=LR, weight_decay=WD,
                           max_grad_norm=opt_kwargs.get("max_grad_norm"), **keys)
    return a, b, opt, ref


def run_pair(a, b, opt, ref, steps, batch_of, *, compiled=False, backwards_per_step=1, before_step=None,
             after_step=None, atol=ATOL, rtol=RTOL, dtype=torch.float32):
    """ZenFlowAdamW on `a` beside the reference on `b`, compared after every step; `before_step(step)` runs
    before each step's forward, `after_step(step)` after its comparison."""
    run_a = torch.compile(a, backend="zenflow") if compiled else a
    run_b = torch.compile(b, backend="inductor") if compiled else b
    for step in steps:
        if before_step is not None:
            before_step(step)
        for model, o in ((run_a, opt), (run_b, ref)):
            for j in range(backwards_per_step):
                loss_of(model, batch_of(backwards_per_step * step + j, dtype)).backward()
            o.step()
            o.zero_grad()
        assert_close(a, b, f"step {step}", atol, rtol)
        if after_step is not None:
            after_step(step)
    opt.synchronize()
    ref.synchronize()
    assert_close(a, b, "synchronized", atol, rtol)


def slab_of(opt, param) -> Slab:
    return opt._runtime.members[opt.param_id(param)].slab


# -- what slabs promise -------------------------------------------------------------------------------------


class BlocksAndWide(Blocks):
    """Blocks(4) beside two equal Linear(16, 1040) layers: their weights ([1040, 16], 16640 elements) are above
    the CPU's SHARED_SLAB_MAX_NUMEL, their biases ([1040]) below it."""

    def __init__(self):
        super().__init__()
        self.wide = nn.ModuleList(nn.Linear(16, 1040) for _ in range(2))

    def forward(self, x):
        h = self.emb(x)
        for layer in self.wide:
            h = h + torch.tanh(layer(h)).mean(-1, keepdim=True)
        for block in self.blocks:
            h = torch.tanh(block(h)) + h
        return self.head(h)


def test_like_parameters_share_a_slab_and_a_large_one_has_its_own():
    assert 16 * 16 <= SHARED_SLAB_MAX_NUMEL["cpu"] < 1040 * 16
    torch.manual_seed(0)
    model = BlocksAndWide()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, weight_decay=WD, **KEYS)
    runtime = opt._runtime
    for step in range(3):  # before the first selection (t = 0), after it (t = 1), later (t = 2)
        loss_of(model, blocks_batch(step)).backward()
        opt.step()
        opt.zero_grad()
        weights = [block[0].weight for block in model.blocks]
        vectors = [p for block in model.blocks for p in (block[0].bias, block[1].weight, block[1].bias)]
        (weight_slab,) = {slab_of(opt, p) for p in weights}
        (vector_slab,) = {slab_of(opt, p) for p in vectors}
        assert weight_slab is not vector_slab
        assert weight_slab.n == 4 and [runtime.members[opt.param_id(p)].index for p in weights] == [0, 1, 2, 3]
        assert vector_slab.n == 12 and (vector_slab.R, vector_slab.C, vector_slab.k) == (16, 1, 1)
        assert weight_slab.master.shape == (4, 16, weight_slab.k)
        assert weight_slab.k == (0 if step == 0 else 4)  # (topk_ratio 0.25 of 16 columns)
        wide = [slab_of(opt, layer.weight) for layer in model.wide]
        assert wide[0] is not wide[1] and [s.n for s in wide] == [1, 1]  # same shape, a slab each
        assert [s.key.alone for s in wide] == [opt.param_id(layer.weight) for layer in model.wide]
        (wide_bias,) = {slab_of(opt, layer.bias) for layer in model.wide}
        assert wide_bias.n == 2
        for p in (model.emb.weight, model.head.weight, model.head.bias):  # shapes of their own
            assert slab_of(opt, p).n == 1
        assert len(runtime.slabs) == 8  # the above, and nothing else
        assert {id(s) for s in runtime.slabs} == {id(m.slab) for m in runtime.members.values()}
        assert len(runtime.members) == len(list(model.parameters()))


def test_like_parameters_of_different_param_groups_or_dtypes_do_not_share():
    torch.manual_seed(0)
    model = Blocks()
    model.blocks[3].to(torch.bfloat16)
    model.blocks[3].register_forward_pre_hook(lambda module, args: (args[0].bfloat16(),))
    model.blocks[3].register_forward_hook(lambda module, args, out: out.float())
    even = [p for i, block in enumerate(model.blocks) if i % 2 == 0 for p in block.parameters()]
    rest = [p for i, block in enumerate(model.blocks) if i % 2 == 1 for p in block.parameters()]
    rest += list(model.emb.parameters()) + list(model.head.parameters())
    opt = zenflow_compile.ZenFlowAdamW([dict(params=even), dict(params=rest, lr=3e-2)], lr=LR, **KEYS)
    for step in range(2):
        loss_of(model, blocks_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    slabs = [slab_of(opt, block[0].weight) for block in model.blocks]
    assert slabs[0] is slabs[2] and slabs[0].n == 2  # group 0
    assert slabs[1] is not slabs[0] and slabs[1].n == 1  # group 1, fp32 (block 3 is bf16)
    assert slabs[3] not in slabs[:3] and slabs[3].dtype == torch.bfloat16 and slabs[3].n == 1


def device_tensors(slab: Slab) -> list[tuple[str, int]]:
    return [(f"device {i}", t.data_ptr()) for i, t in enumerate(slab.device_buffers())] + \
        [(f"host {i}", t.data_ptr()) for i, t in enumerate(slab.host_buffers())]


def test_a_reselection_rewrites_the_slab_in_place(device):
    """At a reselecting boundary (t = 4 and 8) the slabs stay the same objects holding the same tensors
    (pointers unchanged) while the block weights' selected columns change; training equals the reference."""
    a, b, opt, ref = pair(Blocks, KEYS)
    runtime = opt._runtime
    seen = {}

    def before(step):
        if step in (4, 8):
            seen[step] = (list(runtime.slabs), {id(s): device_tensors(s) for s in runtime.slabs},
                          [opt.selected_columns(block[0].weight) for block in a.blocks],
                          runtime.counters["reselections"])

    def after(step):
        if step not in seen:
            return
        slabs, pointers, selected, reselections = seen[step]
        assert runtime.counters["reselections"] == reselections + 1, f"step {step} did not reselect"
        assert runtime.slabs == slabs and all(x is y for x, y in zip(runtime.slabs, slabs))
        for slab in slabs:
            assert device_tensors(slab) == pointers[id(slab)], f"step {step}: {slab.key} got new tensors"
        now = [opt.selected_columns(block[0].weight) for block in a.blocks]
        changed = [not torch.equal(x, y) for x, y in zip(selected, now)]
        assert sum(changed) >= 2, f"step {step}: the reselection changed the columns of blocks {changed} only"
        slab = slab_of(opt, a.blocks[0][0].weight)
        assert torch.equal(slab.selected.cpu(), torch.stack(now))  # the device's index rows, rewritten

    run_pair(a, b, opt, ref, range(10), blocks_batch, before_step=before, after_step=after)
    assert sorted(seen) == [4, 8]


class CountOps(TorchDispatchMode):
    """Counts the aten ops run on this thread (the CPU workers' threads are not seen), view ops apart: a view
    (the members' [R, C] views of their parameters and gradients) launches no kernel and copies nothing."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.views: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.views if func.is_view else self.calls)[str(func)] += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(n: int, steps: int, **keys) -> list[tuple[dict, collections.Counter, collections.Counter]]:
    """Blocks(n) trained eagerly: per step, which counters changed and the ops of `opt.step()` (the hand-off
    of the `.grad`s, the device AdamW, a boundary's apply and reselection)."""
    torch.manual_seed(0)
    model = Blocks(n)
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, weight_decay=WD, **{**KEYS, **keys})
    out = []
    for step in range(steps):
        loss_of(model, blocks_batch(step)).backward()
        before = dict(opt._runtime.counters)
        with CountOps() as counted:
            opt.step()
        changed = {k: v - before[k] for k, v in opt._runtime.counters.items() if k in ("cpu_updates", "reselections")}
        out.append((changed, counted.calls, counted.views))
        opt.zero_grad()
    return out


@pytest.mark.parametrize("in_flight", [False, True], ids=["wait", "incoming"])
def test_a_step_costs_a_fixed_number_of_calls_per_slab_whatever_its_members(in_flight, device):
    """Blocks(4) and Blocks(16) have the same slabs (the 16 block weights share one, the 48 [16] vectors
    another). Once every state is laid out (t >= 2: after the warm-up and the first selection, which lay out
    every member anew), opt.step() runs exactly the same aten ops, op by op, for 4 and for 16 blocks: the
    hand-off of the eager `.grad`s, the norm, the device AdamW and, at a boundary, its launch of the CPU
    update (overlapped: pending), at a reselecting boundary the apply of the pending update, the apply of its
    own and the reselection (`incoming`, the defaults' schedule: the arriving columns' CPU AdamW and their
    move while the update runs on, landing one step later); the views too (the members' [R, C] views of their
    parameters are made once per slab). On the emulated device the offloads and uploads are counted too."""
    steps = 10
    keys = dict(overlap_reselect="incoming", landing_lag=1) if in_flight else {}
    small, large = ops_per_step(4, steps, **keys), ops_per_step(16, steps, **keys)
    kinds = set()
    for t in range(2, steps):
        (changed, calls, views), (changed16, calls16, views16) = small[t], large[t]
        assert changed == changed16
        assert calls == calls16, (f"step {t}: ops that differ (4 blocks, 16 blocks): "
                                  f"{ {op: (calls[op], calls16[op]) for op in calls | calls16 if calls[op] != calls16[op]} }")
        assert calls["aten.stack.default"] >= 1  # the hand-off stacks the slabs' gradients
        assert views == views16, f"step {t}: views {dict(views)} vs {dict(views16)}"
        kinds.add((changed["cpu_updates"], changed["reselections"]))
    assert kinds == {(0, 0), (1, 0), (1, 1)}  # plain steps, overlapped boundaries, reselecting boundaries
    # (t < 2 lays the members out one by one, by design: more ops with more members)
    assert sum(large[1][1].values()) > sum(small[1][1].values())


def test_slabs_through_the_triton_kernels(monkeypatch):
    """The device AdamW's Triton kernel (interpreted on CPU, as compiled on CUDA) takes a slab whole: one launch
    per slab, one program per member and tile of columns, and training equals the reference
    (tests/test_transfers.py runs the Tiny model, whose matrices are each alone in their slab)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from zenflow_compile.triton_kernels import adamw_slab, triton_available

    assert triton_available(torch.device("cpu"))
    launched = []
    real = adamw_slab._kernel

    class Recording:
        def on(self, device):
            kernel = real.on(device)

            class Launch:
                def __getitem__(self, grid):
                    def launch(grad, *args, **kwargs):
                        launched.append((tuple(grad.shape), grid, kwargs["HAS_ROWS"]))
                        return kernel[grid](grad, *args, **kwargs)
                    return launch
            return Launch()

    monkeypatch.setattr(adamw_slab, "_kernel", Recording())
    a, b, opt, ref = pair(Blocks, CONFIGS["S2-reselect"])
    run_pair(a, b, opt, ref, range(5), blocks_batch)
    assert ((4, 16, 4), (4,), False) in launched  # the four block weights' selected columns: one launch
    assert opt.stats()["reselections"] > 0


def test_top_k_of_many_matrices_equals_one_by_one():
    """top_k_columns of [n, C] scores (one sort for a slab): each row's top k, as top_k_columns of that row and
    as sorting by (score descending, column), ties to the lower index included."""
    g = seeded_generator(5)
    for scores, k in ((torch.randint(0, 4, (5, 12), generator=g).float(), 3),  # many ties
                      (torch.rand(3, 7, generator=g), 2), (torch.rand(4, 9, generator=g), 9)):
        many = top_k_columns(scores, k)
        assert many.shape == (scores.shape[0], k) and many.dtype == torch.int64
        for columns, row in zip(many, scores):
            assert torch.equal(columns, top_k_columns(row, k))
            expected = sorted(sorted(range(len(row)), key=lambda j: (-float(row[j]), j))[:k])
            assert columns.tolist() == expected


# -- workflows ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("keys", list(CONFIGS.values()), ids=list(CONFIGS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_repeated_layers_equal_reference(keys, compiled, device):
    a, b, opt, ref = pair(Blocks, keys)
    run_pair(a, b, opt, ref, range(8), blocks_batch, compiled=compiled)
    assert opt.stats()["cpu_updates"] > 0


def test_gradient_accumulation_and_bf16(device):
    a, b, opt, ref = pair(Blocks, CONFIGS["S2-reselect"])
    run_pair(a, b, opt, ref, range(8), blocks_batch, backwards_per_step=2)
    a, b, opt, ref = pair(lambda: Blocks().bfloat16(), CONFIGS["S2-reselect"])
    run_pair(a, b, opt, ref, range(8), blocks_batch, dtype=torch.bfloat16, atol=1e-2, rtol=1e-2)


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises when asked: the head's and blocks' gradients are already accumulated
    when it does."""

    fail = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.fail:
            raise RuntimeError("backward failed on purpose")
        return grad


def test_a_backward_that_raised_leaves_nothing_behind(device):
    """The failed backward left the gradients it had produced in `.grad`; zero_grad() drops them, so the next
    step is the reference's (which never saw that backward)."""
    a, b, opt, ref = pair(Blocks, CONFIGS["S2-reselect"])

    def loss_through_gate(model, i):
        x, y = blocks_batch(i)
        h = _FailOnce.apply(model.emb(x))
        for block in model.blocks:
            h = torch.tanh(block(h)) + h
        return ((model.head(h) - y) ** 2).mean()

    for step in range(4):
        if step == 2:
            _FailOnce.fail = True
            try:
                with pytest.raises(RuntimeError, match="on purpose"):
                    loss_through_gate(a, 99).backward()
            finally:
                _FailOnce.fail = False
            opt.zero_grad()
        for model, o in ((a, opt), (b, ref)):
            loss_through_gate(model, step).backward()
            o.step()
            o.zero_grad()
        assert_close(a, b, f"step {step}")


def train_with_frozen(frozen: tuple, first: int, last: int, steps: int):
    """ZenFlowAdamW beside the reference with the submodules `frozen` not requiring grad for steps
    [first, last), parameters compared after every step; returns the optimizer."""
    a, b, opt, ref = pair(Blocks, CONFIGS["S2-reselect"])

    def freeze(step):
        for model in (a, b):
            for name in frozen:
                model.get_submodule(name).requires_grad_(not first <= step < last)

    run_pair(a, b, opt, ref, range(steps), blocks_batch, before_step=freeze)
    return opt


def test_frozen_then_unfrozen_block_in_a_slab(device):
    """A block frozen after two steps (its state stays in the slabs, unstepped: the others step their rows)
    and unfrozen two steps later: the others and then it train as under the reference."""
    train_with_frozen(("blocks.1",), 2, 4, steps=8)


@pytest.mark.parametrize("frozen", [("blocks.0", "blocks.2"), ("blocks.1",)], ids=["one-member-steps", "gap-in-slab"])
def test_reselection_when_part_of_a_slab_is_frozen(frozen, device):
    """Some members of a slab frozen for ten steps, and the unique-shape matrices too: the stepping members
    reselect (their rows of the slab rewritten in place), the frozen ones keep their columns and state."""
    opt = train_with_frozen(frozen + ("emb", "head"), 2, 12, steps=16)
    assert opt.stats()["reselections"] > 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_conv_stack_with_scalar_gates_equals_reference(compiled, device, monkeypatch):
    """Compiled, the conv backward hands over channels-last weight gradients: the slab's hand-off must take
    them as they are (it once viewed them as if contiguous)."""
    layouts = []
    real = intake.take_grads

    def recording(slab, grads, *args, **kwargs):
        layouts.extend(g.is_contiguous() for g in grads if g.dim() == 4)
        return real(slab, grads, *args, **kwargs)

    monkeypatch.setattr(intake, "take_grads", recording)
    a, b, opt, ref = pair(ConvStack, KEYS)
    run_pair(a, b, opt, ref, range(7), conv_batch, compiled=compiled)
    assert opt.stats()["reselections"] > 0
    assert slab_of(opt, a.convs[0].weight).n == 3 and slab_of(opt, a.gates[0]).n == 3
    if compiled and device.type == "cpu":  # (cuDNN's weight gradients are contiguous)
        assert False in layouts  # (channels-last gradients did reach the slabs)


@pytest.mark.parametrize("resumed", [False, True], ids=["", "resumed"])
@pytest.mark.parametrize("where", ["selected-column", "host-column", "bias"])
def test_a_write_after_an_upcast_is_adopted_only_where_it_changed(where, resumed, device):
    """After a bf16 model is cast to fp32 the parameters hold bf16 values beside fp32 masters (an upcast keeps
    every master bit). A later write into one element is adopted there only, whichever side of the selection
    it is on and for vectors too: every other master keeps its bits (before, the selected columns and vectors
    were compared with their masters cast to fp32, so the first write re-adopted all of them as bf16 values).
    Training then matches the reference."""
    keys = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=1000)
    a, b, opt, ref = pair(lambda: nn.Linear(64, 16).to(torch.bfloat16), keys)
    batch = lambda i, dtype: (torch.randn(4, 64, generator=seeded_generator(i)).to(dtype),
                              torch.zeros(4, 16))
    run_pair(a, b, opt, ref, range(2), batch, dtype=torch.bfloat16)  # t = 1: a boundary, masters carry fp32 bits
    a.float()
    b.float()
    before = opt.master(a.weight)
    assert not torch.equal(before, before.bfloat16().float())
    selected = opt.selected_columns(a.weight).tolist()
    param, index = {"selected-column": (lambda m: m.weight, (0, selected[0])),
                    "host-column": (lambda m: m.weight, (0, next(c for c in range(64) if c not in selected))),
                    "bias": (lambda m: m.bias, (3,))}[where]
    if resumed:  # a fresh model and optimizer from a checkpoint taken after the cast
        saved = copy.deepcopy(opt.state_dict())
        a = copy.deepcopy(a)
        opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, **keys)
        opt.load_state_dict(saved)
    masters_before = {name: opt.master(p) for name, p in a.named_parameters()}
    with torch.no_grad():
        for model in (a, b):
            param(model)[index] += 1.0
    for name, p in a.named_parameters():
        changed = opt.master(p) != masters_before[name]
        expected = torch.zeros_like(changed)
        if p is param(a):
            expected[index] = True
        assert torch.equal(changed, expected), f"{name}: {int(changed.sum())} masters re-adopted"
    run_pair(a, b, opt, ref, range(2, 5), batch)


@pytest.mark.parametrize("when", ["before-backward", "before-step"])
@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
@pytest.mark.parametrize("first, then", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
                         ids=["fp32-to-bf16", "bf16-to-fp32"])
def test_model_cast_between_steps_equals_reference(first, then, overlap, when, device):
    """model.to(dtype) mid-run (slabs laid out, a CPU update pending with overlap). The cast must not lose the
    gradient of the next backward (the replaced buffers zeroed it: masters off by about one update, 0.013);
    like any write it is adopted elementwise where it differs from what the optimizer left (an upcast changes
    nothing: the fp32 masters were overwritten with their bf16 roundings and a pending update was dropped,
    0.008); and it is adopted at that backward's first gradient, so an upcast's gradient is not rounded to the
    old dtype on the way in (4.6e-5 when it was adopted at the step). Cast between a compiled backward and
    the step, the gradients that backward handed over move to the new slabs (their copies down waited for
    first; eagerly they are still in `.grad` and torch casts them)."""
    keys = dict(KEYS, overlap_step=overlap)
    a, b, opt, ref = pair(lambda: Blocks().to(first), keys)
    dtype = first
    # (between a backward and the step only a compiled backward has handed gradients over; the reference's
    # model is then compiled by Inductor too, so both backwards round alike)
    compiled = when == "before-step"
    if compiled:
        skip_where_dynamo_misses_parameter_changes()
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
            torch.testing.assert_close(opt.master(p), ref.master(q), atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"step {step} master of {name}: {m}")
            tolerance = dict(atol=ATOL, rtol=RTOL) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(p, q, **tolerance, msg=lambda m: f"step {step} {name}: {m}")
    assert slab_of(opt, a.blocks[0][0].weight).dtype == then
    opt.synchronize()
    ref.synchronize()
    assert_close(a, b, "synchronized", atol=1e-2 if then == torch.bfloat16 else ATOL)


def train(run, opt, steps):
    for step in steps:
        loss_of(run, blocks_batch(step)).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_resume_is_exact(compiled, device):
    """state_dict() of an optimizer whose like parameters share slabs, loaded into a fresh optimizer on a fresh
    model (slabs laid out anew from the checkpoint): the next steps are bitwise those of the uninterrupted
    run."""
    keys = CONFIGS["S2-reselect"]

    def make():
        torch.manual_seed(0)
        model = Blocks()
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, weight_decay=WD, **keys)
        return model, opt, (torch.compile(model, backend="zenflow") if compiled else model)

    model, opt, run = make()
    train(run, opt, range(5))  # 5: the reselection at step 4 has just rewritten the slabs (overlap pending)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # (references to live state, as torch.optim's)
    train(run, opt, range(5, 10))
    opt.synchronize()

    model2, opt2, run2 = make()
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    train(run2, opt2, range(5, 10))
    opt2.synchronize()
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_resume_into_an_optimizer_that_already_trained_and_rolling_back_are_exact(compiled, device):
    """A checkpoint taken mid-run (slabs laid out, a CPU update pending) loaded into (1) an optimizer that has
    trained on other data (its own slabs laid out and rewritten) and (2) the optimizer it came from, rolled
    back after more steps: both continue bitwise as the uninterrupted run."""

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
def test_param_groups_splitting_slabs_with_an_lr_schedule_equal_reference(compiled, device):
    """Like parameters in different param groups are in different slabs; each group's update takes its own lr
    and weight decay, which a LambdaLR changes at every step."""
    a, b, opt, ref = pair(Blocks, KEYS, groups=interleaved_groups)

    def schedule(o):
        return torch.optim.lr_scheduler.LambdaLR(o, [lambda s, i=i: 1.0 / (1 + s * (i + 1)) for i in range(3)])

    schedulers = [schedule(opt), schedule(ref)]
    run_pair(a, b, opt, ref, range(7), blocks_batch, compiled=compiled,
             before_step=lambda step: step and [s.step() for s in schedulers])
    assert opt.param_groups[1]["lr"] == ref.param_groups[1]["lr"] < 3e-2
    assert opt.stats()["reselections"] > 0
    even, odd = slab_of(opt, a.blocks[0][0].weight), slab_of(opt, a.blocks[1][0].weight)
    assert even is slab_of(opt, a.blocks[2][0].weight) and odd is slab_of(opt, a.blocks[3][0].weight)
    assert even is not odd


def test_grad_scaler_skipped_step_and_accumulation_with_part_of_a_slab_unused(device):
    """torch.amp.GradScaler on CPU with an inf gradient at step 3 (skipped; the scale halves), gradient
    accumulation over two micro-batches of which the first leaves blocks 1 and 3 out (only part of a
    slab's members take a gradient, then all of them), and one block's weight written at step 5: equal to
    the reference fed the unscaled gradients. The batches start at 50: from 0, one element's accumulated
    gradient cancels to near AdamW's eps at step 1, and there fp32 rounding alone moves its update by ~1e-5
    (the premise check below fails on them)."""
    a, b, opt, ref = pair(Blocks, KEYS)
    exact = copy.deepcopy(b).double()
    exact_ref = ZenFlowReference(exact.parameters(), lr=LR, weight_decay=WD, **KEYS)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    micro = 50
    for step in range(8):
        if step == 5:
            for model in (a, b, exact):
                with torch.no_grad():
                    model.blocks[2][0].weight.mul_(0.5)
        for model in (a, b, exact):
            for j in range(2):
                model.skip = {1, 3} if j == 0 else set()
                x, y = blocks_batch(micro + j)
                if step == 3 and j == 1:
                    y = y.clone()
                    y[0, 0, 0] = float("inf")
                loss = ((model(x) - y.to(model.head.weight.dtype)) ** 2).mean()
                (scaler.scale(loss) if model is a else loss).backward()
        micro += 2
        with warnings.catch_warnings():  # (torch's FutureWarning about GradScaler passing itself)
            warnings.simplefilter("ignore", FutureWarning)
            scaler.step(opt)
        scaler.update()
        for o in (ref, exact_ref):
            o.step()
        for o in (opt, ref, exact_ref):
            o.zero_grad()
        assert_close(a, b, f"step {step}")
        assert_fp32_decides_the_comparison(b, exact, f"step {step}", ATOL, RTOL)
    assert opt.stats()["skipped_steps"] == ref.stats()["skipped_steps"] == 1
    assert scaler.get_scale() == 2.0 ** 9
    opt.synchronize()
    ref.synchronize()
    assert_close(a, b, "synchronized")


class Wide(nn.Module):
    """A weight above the CPU's SHARED_SLAB_MAX_NUMEL (256 x 128 = 32K elements: scored in the graph) beside
    small layers (scored by the runtime, batched with their slab)."""

    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(128, 256)
        self.small = nn.ModuleList(nn.Linear(256, 8) if i == 0 else nn.Linear(8, 8) for i in range(3))

    def forward(self, x):
        h = torch.tanh(self.wide(x))
        for layer in self.small:
            h = torch.tanh(layer(h))
        return h.square().mean()


def test_compiled_large_gradients_scored_in_the_graph_small_ones_by_the_runtime():
    from zenflow_compile import inspect as zf_inspect

    assert 8 * 8 <= SHARED_SLAB_MAX_NUMEL["cpu"] < 128 * 256
    keys = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=2)
    torch.manual_seed(0)
    a = Wide()
    b = Wide()
    b.load_state_dict(a.state_dict())
    opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, **keys)
    ref = ZenFlowReference(b.parameters(), lr=LR, weight_decay=WD, **keys)
    run_a, run_b = torch.compile(a, backend="zenflow"), torch.compile(b, backend="inductor")
    exact = copy.deepcopy(b).double()
    exact_ref = ZenFlowReference(exact.parameters(), lr=LR, weight_decay=WD, **keys)
    x = torch.randn(6, 128, generator=seeded_generator(3))
    # The loss x 1000: with its gradients near 4e-4, one weight's two accumulated gradients cancelled to
    # ~3 x eps, and AdamW's update of it was decided by rounding (2.4e-5 between correct fp32 runs).
    with zf_inspect.capture() as graphs:
        for step in range(5):
            for model, o in ((run_a, opt), (run_b, ref), (exact, exact_ref)):
                (1000 * model(x.to(model.wide.weight.dtype) * (1 + step))).backward()
                o.step()
                o.zero_grad()
            # (2e-5, 1e-4: among 32K small gradients, some accumulated pair still cancels to a few times eps;
            # the premise check says fp32 decides the result to a fraction of it.)
            for p, q in zip(a.parameters(), b.parameters()):
                torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4)
            assert_fp32_decides_the_comparison(b, exact, f"step {step}", 2e-5, 1e-4)
    (graph,) = graphs
    (call,) = [n for n in graph.after.graph.nodes if n.target is torch.ops.zenflow.accumulate_grads.default]
    _, scores, slots = call.args
    assert [graph.param_names[slot] for slot, s in zip(slots, scores) if s is not None] == ["wide.weight"]
    assert slab_of(opt, a.small[1].weight) is slab_of(opt, a.small[2].weight)


def test_small_buckets_flush_during_the_backward(monkeypatch, device, fresh_dynamo):
    """reduce_bucket_size of 300 elements: the compiled backward hands its gradients over in several buckets,
    each as it fills (a slab's members arriving in different buckets). (Dynamo's caches emptied: a graph it
    compiled for another test's optimizer, in one bucket, would be reused.)"""
    buckets = []
    real = ZenFlowRuntime.take_grads

    def counting(self, pids, grads, scores=None):
        buckets.append(len(pids))
        return real(self, pids, grads, scores)

    monkeypatch.setattr(ZenFlowRuntime, "take_grads", counting)
    a, b, opt, ref = pair(Blocks, CONFIGS["S2-reselect"], reduce_bucket_size=300)
    run_pair(a, b, opt, ref, range(8), blocks_batch, compiled=True)
    assert len(buckets) >= 3 * 8 and sum(buckets) == 8 * len(list(a.parameters()))
