"""The batched hand-off (runtime/handoff.py, zenflow_compile/grad_hooks.py): buckets of gradients taken in a
few stacked torch calls per group of like parameters must leave exactly what each state's own receive_grad
leaves, and training through it must equal the reference in every workflow (buckets flushed mid-backward,
gradient accumulation, bf16, a backward that raised)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zenflow_compile
from zenflow_compile.reference import ZenFlowReference
from zenflow_compile.runtime.handoff import HandoffPlan
from zenflow_compile.runtime.param_state import MatrixState, VectorState, top_k_columns, top_k_columns_many
from zenflow_compile.runtime.transfers import Transfers, wait_events
from zenflow_compile.triton_kernels.rows import rows_of_one_tensor, runs_of_rows
from helpers import TinyRepeated

LR, WD = 1e-2, 0.01


def repeated_model(dtype=torch.float32, seed=0) -> nn.Module:
    """Layers of equal shapes (the case the hand-off stacks) beside unique ones: Embedding(32, 16), three
    Linear(16, 16) + LayerNorm(16), and a Linear(16, 8) head (a shape of its own)."""
    torch.manual_seed(seed)
    return TinyRepeated(out_features=8).to(dtype)


def batch(i: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, 32, (4, 5), generator=g), torch.randn(4, 5, 8, generator=g).to(dtype)


def loss_of(model, i, dtype=torch.float32):
    x, y = batch(i, dtype)
    return ((model(x).float() - y.float()) ** 2).mean()


def _states(seed: int):
    """Four [16, 12] matrices with a selection (three share it, one differs) and four [16] vectors."""
    torch.manual_seed(seed)
    params = [nn.Parameter(torch.randn(16, 12)) for _ in range(4)] + [nn.Parameter(torch.randn(16)) for _ in range(4)]
    transfers = Transfers(torch.device("cpu"))
    matrices = [MatrixState(p, i, 0, transfers) for i, p in enumerate(params[:4])]
    for i, m in enumerate(matrices):
        m.select(torch.tensor([1, 5, 7]) if i < 3 else torch.tensor([0, 2, 11]))
    vectors = [VectorState(p, 4 + i, 0) for i, p in enumerate(params[4:])]
    return matrices + vectors


def _grads(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 12, generator=g) for _ in range(4)] + [torch.randn(16, generator=g) for _ in range(4)]


@pytest.mark.parametrize("with_scores", [False, True], ids=["scores-computed", "scores-given"])
def test_plan_leaves_what_receive_grad_leaves(with_scores, device):
    one_by_one, batched = _states(0), _states(0)
    plan = HandoffPlan(batched)
    assert sorted(len(group.states) for group in plan.groups) == [4, 4]  # the matrices, the vectors
    for backward in range(2):  # the second backward of the step takes the per-state path (sums)
        grads = _grads(backward)
        scores = None
        if with_scores:
            scores = [(g.float() ** 2).sum(0) if g.dim() == 2 else (g.float() ** 2).sum().reshape(1) for g in grads]
        sent_each = sum(s.receive_grad(g, None if scores is None else scores[i], 0)
                        for i, (s, g) in enumerate(zip(one_by_one, grads)))
        assert plan.receive(grads, scores, 0) == sent_each
    for a, b in zip(one_by_one, batched):
        assert a.num_grads == b.num_grads == 2
        if a.is_matrix:
            for state in (a, b):  # read the offloaded gradients as the accumulate worker does: after their copies
                wait_events(state.offload_done[0])
                state.transfers.host_access(reads=[state.host_grads[0], *state.extra_grads[0]])
            torch.testing.assert_close(b.scores, a.scores, rtol=0, atol=0)
            torch.testing.assert_close(b.dev_grad, a.dev_grad, rtol=0, atol=0)
            torch.testing.assert_close(b.host_grads[0], a.host_grads[0], rtol=0, atol=0)
            assert len(b.extra_grads[0]) == len(a.extra_grads[0]) == 1
            torch.testing.assert_close(b.extra_grads[0][0], a.extra_grads[0][0], rtol=0, atol=0)
        else:
            torch.testing.assert_close(b.score, a.score, rtol=0, atol=0)
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0)


def test_plan_takes_a_gradient_of_another_dtype_one_by_one():
    """A bf16 gradient for an fp32 parameter (autocast-style): the group refuses it, each state converts."""
    one_by_one, batched = _states(1), _states(1)
    grads = [g.bfloat16() for g in _grads(3)]
    for s, g in zip(one_by_one, grads):
        s.receive_grad(g, None, 1)
    HandoffPlan(batched).receive(grads, None, 1)
    for a, b in zip(one_by_one, batched):
        if a.is_matrix:
            torch.testing.assert_close(b.dev_grad, a.dev_grad, rtol=0, atol=0)
            torch.testing.assert_close(b.host_grads[1], a.host_grads[1], rtol=0, atol=0)


def train_beside_reference(keys, *, compiled=False, dtype=torch.float32, steps=8, backwards_per_step=1,
                           atol=1e-6, rtol=1e-5, **opt_kwargs):
    a, b = repeated_model(dtype), repeated_model(dtype)
    opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, **opt_kwargs, **keys)
    ref = ZenFlowReference(b.parameters(), lr=LR, weight_decay=WD, **keys)
    run_a = torch.compile(a, backend="zenflow") if compiled else a
    run_b = torch.compile(b, backend="inductor") if compiled else b
    for step in range(steps):
        for model, o in ((run_a, opt), (run_b, ref)):
            for j in range(backwards_per_step):
                loss_of(model, backwards_per_step * step + j, dtype).backward()
            o.step()
            o.zero_grad()
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=atol, rtol=rtol, msg=lambda m: f"step {step} {name}: {m}")
    opt.synchronize()
    ref.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=rtol)
    return opt


KEYS = {
    "S2-reselect": dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=2,
                        overlap_step=True),
    "auto": dict(topk_ratio=0.25),
}


@pytest.mark.parametrize("keys", list(KEYS.values()), ids=list(KEYS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_repeated_layers_equal_reference(keys, compiled, device):
    opt = train_beside_reference(keys, compiled=compiled)
    assert opt.stats()["cpu_updates"] > 0


def test_small_buckets_flush_during_the_backward(device):
    """reduce_bucket_size of 300 elements: several buckets per backward, each handed over when full."""
    train_beside_reference(KEYS["S2-reselect"], reduce_bucket_size=300)


def test_gradient_accumulation_and_bf16(device):
    train_beside_reference(KEYS["S2-reselect"], backwards_per_step=2)
    train_beside_reference(KEYS["S2-reselect"], dtype=torch.bfloat16, atol=1e-2, rtol=1e-2)


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises when asked: the head's gradients are already accumulated (and in the
    bucket) when it does."""

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
    """The bucket holds the gradients the failed backward had produced; zero_grad() drops them, so the next
    step is the reference's (which never saw that backward)."""
    keys = KEYS["S2-reselect"]
    a, b = repeated_model(), repeated_model()
    opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, **keys)
    ref = ZenFlowReference(b.parameters(), lr=LR, weight_decay=WD, **keys)

    def loss_through_gate(model, i):
        x, y = batch(i)
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
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_like_states_share_stacks_and_the_update_joins_them():
    """After the first steps, the three blocks' matrices (and the LayerNorm/bias vectors) keep their device
    state as rows of shared stacks, and the CPU device AdamW updates each stack as one tensor."""
    opt = train_beside_reference(dict(topk_ratio=0.25, update_interval=2, select_strategy="step",
                                      select_interval=1000), steps=3)  # (a reselection unstacks until the next step)
    runtime = opt._runtime
    params = [p for group in opt.param_groups for p in group["params"]]
    blocks = [runtime.states[opt.param_id(p)] for p in params if tuple(p.shape) == (16, 16)]
    assert len(blocks) == 3
    for name in ("dev_master", "dev_exp_avg", "dev_exp_avg_sq", "dev_step", "dev_grad", "scores"):
        tensors = [getattr(state, name) for state in blocks]
        assert rows_of_one_tensor(tensors) is not None, name
    for slot in (0, 1):
        assert rows_of_one_tensor([state.host_grads[slot] for state in blocks]) is not None
    (group_index, args), = runtime._device_args.get([s for s in runtime.states.values()])
    fused = [group for group in args.reference_plan().groups if group.fused]
    assert len(fused[0].uws) < len(fused[0].ws)  # runs of stacked rows joined


def train_with_frozen(frozen: tuple, first: int, last: int, steps: int):
    """ZenFlowAdamW beside the reference with the submodules `frozen` not requiring grad for steps
    [first, last), parameters compared after every step; returns the optimizer."""
    keys = KEYS["S2-reselect"]
    a, b = repeated_model(), repeated_model()
    opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, **keys)
    ref = ZenFlowReference(b.parameters(), lr=LR, weight_decay=WD, **keys)
    for step in range(steps):
        for model in (a, b):
            for name in frozen:
                model.get_submodule(name).requires_grad_(not first <= step < last)
        for model, o in ((a, opt), (b, ref)):
            loss_of(model, step).backward()
            o.step()
            o.zero_grad()
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m: f"step {step} {name}: {m}")
    return opt


def test_frozen_then_unfrozen_block_with_stacks(device):
    """A block frozen after two steps (its state stays in the stacks, unstepped) and unfrozen two steps
    later: the others and then it train as under the reference."""
    train_with_frozen(("blocks.1",), 2, 4, steps=8)


def test_rows_of_one_tensor():
    stack = torch.zeros(4, 3, 2)
    rows = list(stack.unbind(0))
    assert rows_of_one_tensor(rows[1:3]).data_ptr() == stack[1].data_ptr()
    assert rows_of_one_tensor(rows[1:3]).shape == (2, 3, 2)
    assert rows_of_one_tensor([rows[0], rows[2]]) is None  # a gap
    assert rows_of_one_tensor([rows[1], rows[0]]) is None  # out of order
    assert rows_of_one_tensor([torch.zeros(3, 2), torch.zeros(3, 2)]) is None  # separate storages
    assert runs_of_rows([rows], can_join=lambda i: i != 2) == [(0, 2), (2, 4)]
    six = list(torch.zeros(6, 2).unbind(0))
    gap = [six[0], six[1], six[2], six[4], six[5]]  # one stack with a row missing: checked row by row
    assert runs_of_rows([gap], can_join=lambda i: True) == [(0, 3), (3, 5)]
    assert runs_of_rows([gap, gap], can_join=lambda i: i != 4) == [(0, 3), (3, 4), (4, 5)]
    assert runs_of_rows([[six[0], six[2], six[3], six[4]]], can_join=lambda i: True) == [(0, 1), (1, 4)]


def test_top_k_of_many_matrices_equals_one_by_one():
    """One sort for matrices of one size and k: the same columns as top_k_columns each, ties to the lower
    index included."""
    g = torch.Generator().manual_seed(5)
    scores = [torch.randint(0, 4, (12,), generator=g).float() for _ in range(5)]  # many ties
    scores += [torch.rand(7, generator=g) for _ in range(3)]
    ks = [3, 3, 3, 5, 3, 2, 2, 7]
    for columns, row, k in zip(top_k_columns_many(scores, ks), scores, ks):
        assert torch.equal(columns, top_k_columns(row, k))


def test_stacked_state_through_the_triton_kernels(monkeypatch):
    """The device AdamW's Triton kernel (interpreted on CPU) takes the stacks' rows as its per-parameter
    tensors, as on CUDA."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from zenflow_compile.triton_kernels import triton_available
    assert triton_available(torch.device("cpu"))
    train_beside_reference(KEYS["S2-reselect"], steps=5)


class Wide(nn.Module):
    """A weight above the CPU stacking size (256 x 128 = 32K elements: scored in the graph) beside small
    layers (scored by the runtime)."""

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
    from zenflow_compile.runtime.stacked_state import STACK_MAX_NUMEL

    assert 8 * 8 <= STACK_MAX_NUMEL["cpu"] < 128 * 256
    keys = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=2)
    torch.manual_seed(0)
    a = Wide()
    b = Wide()
    b.load_state_dict(a.state_dict())
    opt = zenflow_compile.ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, **keys)
    ref = ZenFlowReference(b.parameters(), lr=LR, weight_decay=WD, **keys)
    run_a, run_b = torch.compile(a, backend="zenflow"), torch.compile(b, backend="inductor")
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3))
    with zf_inspect.capture() as graphs:
        for step in range(5):
            for model, o in ((run_a, opt), (run_b, ref)):
                model(x * (1 + step)).backward()
                o.step()
                o.zero_grad()
            for p, q in zip(a.parameters(), b.parameters()):  # (differently fused backward kernels: ulps,
                torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4)  # which Adam's normalisation can grow)
    (graph,) = graphs
    (call,) = [n for n in graph.after.graph.nodes if n.target is torch.ops.zenflow.accumulate_grads.default]
    _, scores, slots = call.args
    assert [graph.param_names[slot] for slot, s in zip(slots, scores) if s is not None] == ["wide.weight"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_resume_with_stacked_state_is_exact(compiled, device):
    """state_dict() of an optimizer whose like states share stacks, loaded into a fresh optimizer on a fresh
    model (states rebuilt, then stacked again): the next steps are bitwise those of the uninterrupted run."""
    keys = KEYS["S2-reselect"]

    def make():
        model = repeated_model()
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, weight_decay=WD, **keys)
        return model, opt, (torch.compile(model, backend="zenflow") if compiled else model)

    def train(run, opt, steps):
        for step in steps:
            loss_of(run, step).backward()
            opt.step()
            opt.zero_grad()

    model, opt, run = make()
    train(run, opt, range(5))  # 5: the last reselection at step 4 has just relayouted (overlap pending)
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


def test_restacking_waits_for_copies_in_flight_inside_the_counted_wait():
    """CUDA's offloads into the old pinned buffers may still be in flight when like matrices are restacked:
    their events are waited for first, inside the caller's (counted) wait context; none, no wait."""
    import contextlib
    from zenflow_compile.runtime.stacked_state import stack_like_states

    class Event:
        synchronized = 0

        def synchronize(self):
            Event.synchronized += 1

    entered = []

    @contextlib.contextmanager
    def waiting():
        entered.append(True)
        yield

    states = _states(7)
    matrices = [s for s in states if s.is_matrix][:3]  # (the three with one selection: one group)
    for m in matrices:
        m.offload_done[0] = [Event()]
    assert stack_like_states(matrices, waiting=waiting)
    assert Event.synchronized == 3 and len(entered) == 1
    assert rows_of_one_tensor([m.host_grads[0] for m in matrices]) is not None
    assert not stack_like_states(matrices, waiting=waiting) and len(entered) == 1  # already stacked


def test_reselection_of_stacked_matrices_rewrites_them_in_place(monkeypatch, device):
    """Stacked matrices keep their tensors (and so their stacks and every plan built on them) through a
    reselection that moves columns: the layout is written in place; training still equals the reference."""
    in_place = []
    original = MatrixState._relayout_in_place

    def recording(self, *args, **kwargs):
        in_place.append((self.pid, self.dev_master.data_ptr(), self.selected_on_device.data_ptr()))
        original(self, *args, **kwargs)
        assert (self.dev_master.data_ptr(), self.selected_on_device.data_ptr()) == in_place[-1][1:]

    monkeypatch.setattr(MatrixState, "_relayout_in_place", recording)
    opt = train_beside_reference(KEYS["S2-reselect"], steps=10)
    assert opt.stats()["reselections"] > 0 and in_place
    params = [p for group in opt.param_groups for p in group["params"]]
    block_ids = {opt.param_id(p) for p in params if tuple(p.shape) == (16, 16)}
    assert {pid for pid, _, _ in in_place} <= block_ids  # (the unique-shape matrices are laid out anew)


@pytest.mark.parametrize("frozen", [("blocks.0", "blocks.2"), ("blocks.1",)], ids=["one-row-steps", "gap-in-stack"])
def test_in_place_reselection_when_part_of_a_stack_is_frozen(frozen, device):
    """Some rows of a stack frozen for ten steps, and the unique-shape matrices too (their new layouts would
    otherwise rebuild every plan at each reselection): the stepping rows' reselections, written in place,
    must reach every plan built on them: a lone stacked matrix never takes the fused update on a count that
    may change in place, and index rows are read from the states, never kept as a copy."""
    opt = train_with_frozen(frozen + ("emb", "head"), 2, 12, steps=16)
    assert opt.stats()["reselections"] > 0
