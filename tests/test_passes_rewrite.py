"""Unit tests of the backward-graph passes, run eagerly on AOTAutograd graphs (no Inductor lowering).

A capturing backend records a model's real backward graph and the arguments it was called with; the tests
rewrite a copy with `rewrite_backward` and execute it, so every claim (what is handed over, which scores,
what is returned) is checked on numbers, not just on graph text.
"""

import copy
import dataclasses
import logging
import math
import pickle

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

from zenflow_compile import backend as zf_backend
from zenflow_compile.config import ZenFlowConfig
from zenflow_compile.passes import ZenFlowPassContext, is_backward_graph, rewrite_backward
from zenflow_compile.passes.backward_graph import ZenFlowGraphError
from zenflow_compile.runtime import registry
from zenflow_compile.runtime.ops import ACCUMULATE_GRADS

from helpers import run_bound, slot_ids


class RecordingRuntime:
    def __init__(self, config=None, bucket_numel=25_000_000):
        self.config = config or ZenFlowConfig()
        self.bucket_numel = bucket_numel
        self.calls = []  # (pid, grad, scores), in hand-off order
        self.buckets = []  # the pids of each take_grads call

    def take_grads(self, pids, grads, scores=None):
        self.buckets.append(list(pids))
        self.calls.extend((pid, g.clone(), None if s is None else s.clone()) for pid, g, s in zip(pids, grads, scores))


def own(model, runtime):
    return {registry.register_param(p, runtime): name for name, p in model.named_parameters()}


def capture(model, *inputs):
    """Forward + backward through AOTAutograd; return the graphs, the backward's call args and the ctx."""
    rec = {}

    def fw(gm, example_inputs):
        rec["forward"] = copy.deepcopy(gm)
        return make_boxed_func(gm.forward)

    def bw(gm, example_inputs):
        rec["backward"] = copy.deepcopy(gm)

        def run(*args):
            rec["args"] = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            return gm(*args)

        return make_boxed_func(run)

    def backend(gm, example_inputs):
        rec["ctx"] = zf_backend.make_pass_context(gm, example_inputs)
        from torch._inductor.decomposition import select_decomp_table

        return aot_autograd(fw_compiler=fw, bw_compiler=bw, decompositions=select_decomp_table())(
            gm, example_inputs)

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    out.float().pow(2).sum().backward()
    torch._dynamo.reset()
    return rec


def expected_scores(g):
    g = g.float()
    return g.reshape(g.shape[0], -1).pow(2).sum(0) if g.dim() >= 2 else g.pow(2).sum().reshape(1)


class ConvMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, kernel_size=3)  # 3-D weight: columns are its flattened (in, k) pairs
        self.fc = nn.Linear(3 * 4, 5)
        self.norm = nn.LayerNorm(5)

    def forward(self, x):
        return self.norm(self.fc(torch.relu(self.conv(x)).flatten(1)))


@pytest.fixture
def conv_case():
    torch.manual_seed(0)
    model, runtime = ConvMLP(), RecordingRuntime()
    names = own(model, runtime)
    x = torch.randn(2, 2, 6, requires_grad=True)  # a non-parameter input that needs a gradient
    rec = capture(model, x)
    runtime.calls.clear()
    return model, runtime, names, rec


def bucketed(ctx, bucket_numel):
    return ctx if bucket_numel is None else dataclasses.replace(ctx, bucket_numel=bucket_numel)


# ConvMLP's gradients: conv.weight 18, conv.bias 3, fc.weight 60, fc.bias 5, norm.weight 5, norm.bias 5
# elements. None: the default bucket size (one bucket); 1: one bucket per gradient; 30: two.
BUCKET_SIZES = [None, 1, 30]


@pytest.mark.parametrize("bucket_numel", BUCKET_SIZES)
def test_rewritten_graph_hands_every_param_grad_and_returns_none(conv_case, bucket_numel):
    model, runtime, names, rec = conv_case
    ctx = bucketed(rec["ctx"], bucket_numel)
    original = rec["backward"](*copy.copy(rec["args"]))
    rewritten = copy.deepcopy(rec["backward"])
    grads = rewrite_backward(rewritten.graph, ctx)
    rewritten.recompile()
    ids = slot_ids(ctx, {name: pid for pid, name in names.items()})
    assert sorted(ids[g.slot] for g in grads) == sorted(names)

    outputs = run_bound(lambda: rewritten(*copy.copy(rec["args"])), ids)
    by_pid = {pid: (g, s) for pid, g, s in runtime.calls}
    assert len(runtime.calls) == len(by_pid) and sorted(by_pid) == sorted(names)  # each parameter exactly once
    calls = [n for n in rewritten.graph.nodes if n.target is ACCUMULATE_GRADS]
    assert len(runtime.buckets) == len(calls)  # one runtime call per bucket op (a single owner)
    assert len(calls) == {None: 1, 1: 6, 30: 2}[bucket_numel]  # 30: norm.*, fc.bias, fc.weight | conv.*
    for index, pid in enumerate(ids):
        if pid is None:
            # other outputs (the input x's gradient) are untouched
            if isinstance(original[index], torch.Tensor):
                torch.testing.assert_close(outputs[index], original[index])
            continue
        assert outputs[index] is None
        grad, scores = by_pid[pid]
        torch.testing.assert_close(grad, original[index])
        assert scores.dtype == torch.float32
        torch.testing.assert_close(scores, expected_scores(original[index]))
    conv_scores = by_pid[next(p for p, n in names.items() if n == "conv.weight")][1]
    assert conv_scores.shape == (2 * 3,)


def test_small_gradients_are_scored_by_the_runtime(conv_case):
    """runtime_scored_numel=18: conv.weight (18), the biases and the norm (3-5) get no norm proxy (None in the
    op's score list), fc.weight (60) keeps its in-graph proxy; the runtime receives None for the small ones."""
    model, runtime, names, rec = conv_case
    ctx = dataclasses.replace(rec["ctx"], runtime_scored_numel=18)
    rewritten = copy.deepcopy(rec["backward"])
    rewrite_backward(rewritten.graph, ctx)
    rewritten.recompile()
    (call,) = [n for n in rewritten.graph.nodes if n.target is ACCUMULATE_GRADS]
    grads, scores, slots = call.args
    proxied = {ctx.name(slot) for slot, score in zip(slots, scores) if score is not None}
    assert proxied == {"fc.weight"}
    ids = slot_ids(ctx, {name: pid for pid, name in names.items()})
    run_bound(lambda: rewritten(*copy.copy(rec["args"])), ids)
    received = {names[pid]: score for pid, _, score in runtime.calls}
    assert {name for name, score in received.items() if score is not None} == {"fc.weight"}


def check_bucket_placement(graph, ctx):
    """Every bucket op comes after every node it uses, right after the last of them (or the previous bucket's
    op); buckets cover the gradients in production order, each the shortest run reaching ctx.bucket_numel."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    calls = [n for n in graph.nodes if n.target is ACCUMULATE_GRADS]
    produced = []
    previous = None
    for call in calls:
        grads, scores, slots = call.args
        assert len(grads) == len(scores) == len(slots) > 0
        used = [*grads, *scores] + ([previous] if previous is not None else [])
        assert all(order[n] < order[call] for n in used)  # topological
        last = max(used, key=order.__getitem__)
        between = list(graph.nodes)[order[last] + 1:order[call]]
        assert all(n.op == "placeholder" for n in between), between  # right after its last input
        for grad, score in zip(grads, scores):
            assert order[grad] < order[score] and score.meta["val"].dtype == torch.float32
        numel = [math.prod(ctx.param_shapes[slot]) for slot in slots]
        assert call is calls[-1] or (sum(numel) >= ctx.bucket_numel > sum(numel[:-1]))
        produced += [order[g] for g in grads]
        previous = call
    assert produced == sorted(produced)
    return calls


@pytest.mark.parametrize("bucket_numel", BUCKET_SIZES)
def test_each_bucket_goes_right_after_its_last_gradient_and_scores(conv_case, bucket_numel):
    _, _, _, rec = conv_case
    gm = copy.deepcopy(rec["backward"])
    ctx = bucketed(rec["ctx"], bucket_numel)
    grads = rewrite_backward(gm.graph, ctx)  # lints the graph (every node defined before use)
    calls = check_bucket_placement(gm.graph, ctx)
    assert sorted(s for call in calls for s in call.args[2]) == sorted(g.slot for g in grads)
    if bucket_numel == 1:
        # one gradient per bucket: only that gradient's norm-proxy chain sits between its producer and its op
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        for call in calls:
            (grad,), (scores,), _ = call.args
            between = list(gm.graph.nodes)[order[grad] + 1:order[call]]
            assert all(n.op == "call_function" and n.target.__name__.split(".")[0] in
                       ("pow", "sum", "reshape", "convert_element_type") for n in between), between
            assert scores in between


class AddBias(nn.Module):
    """out = x + w: the gradient of `w` is the incoming tangent itself, a graph input (placeholder)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.v = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.v + self.w


def test_a_gradient_that_is_a_graph_input_is_handed_over_after_the_inputs():
    torch.manual_seed(0)
    model, runtime = AddBias(), RecordingRuntime()
    names = own(model, runtime)
    rec = capture(model, torch.randn(3, 4))
    runtime.calls.clear()
    original = rec["backward"](*copy.copy(rec["args"]))
    for bucket_numel in (1, 100):
        runtime.calls.clear()
        gm = copy.deepcopy(rec["backward"])
        ctx = bucketed(rec["ctx"], bucket_numel)
        rewrite_backward(gm.graph, ctx)
        gm.recompile()
        check_bucket_placement(gm.graph, ctx)
        ids = slot_ids(ctx, {n: p for p, n in names.items()})
        assert any(g.op == "placeholder" for call in gm.graph.nodes if call.target is ACCUMULATE_GRADS
                   for g in call.args[0])
        run_bound(lambda: gm(*copy.copy(rec["args"])), ids)
        got = {pid: g for pid, g, _ in runtime.calls}
        for index, pid in enumerate(ids):
            if pid is not None:
                torch.testing.assert_close(got[pid], original[index])


def test_bf16_gradients_get_fp32_scores():
    torch.manual_seed(0)
    model, runtime = nn.Linear(4, 3).to(torch.bfloat16), RecordingRuntime()
    names = own(model, runtime)
    rec = capture(model, torch.randn(2, 4, dtype=torch.bfloat16))
    runtime.calls.clear()
    original = rec["backward"](*copy.copy(rec["args"]))
    gm = copy.deepcopy(rec["backward"])
    rewrite_backward(gm.graph, rec["ctx"])
    gm.recompile()
    run_bound(lambda: gm(*copy.copy(rec["args"])), slot_ids(rec["ctx"], {n: p for p, n in names.items()}))
    assert {s.dtype for _, _, s in runtime.calls} == {torch.float32}
    assert {g.dtype for _, g, _ in runtime.calls} == {torch.bfloat16}
    grads = {tuple(g.shape): (g, s) for _, g, s in runtime.calls}
    for out in original:
        if isinstance(out, torch.Tensor):
            torch.testing.assert_close(grads[tuple(out.shape)][1], expected_scores(out))


def test_pass_leaves_forward_and_inference_graphs_unchanged(conv_case):
    _, _, _, rec = conv_case
    graph_pass = zf_backend.ZenFlowGraphPass(rec["ctx"])
    forward = copy.deepcopy(rec["forward"])
    assert not is_backward_graph(forward.graph)
    before = str(forward.graph)
    graph_pass(forward.graph, is_inference=False)
    assert str(forward.graph) == before
    backward = copy.deepcopy(rec["backward"])
    before = str(backward.graph)
    graph_pass(backward.graph, is_inference=True)
    assert str(backward.graph) == before
    graph_pass(backward.graph, is_inference=False)
    assert str(backward.graph) != before


def test_output_count_mismatch_leaves_graph_alone(conv_case, caplog):
    _, _, _, rec = conv_case
    ctx = rec["ctx"]
    wrong = ZenFlowPassContext(ctx.param_shapes[:-1])
    gm = copy.deepcopy(rec["backward"])
    before = str(gm.graph)
    with caplog.at_level(logging.WARNING, logger="zenflow_compile.backend"):
        zf_backend.ZenFlowGraphPass(wrong)(gm.graph, is_inference=False)
    assert str(gm.graph) == before and "unchanged" in caplog.text
    with pytest.raises(ZenFlowGraphError, match="inputs"):
        rewrite_backward(gm.graph, wrong)


def test_shape_mismatch_is_an_error(conv_case):
    _, _, _, rec = conv_case
    ctx = rec["ctx"]
    index = next(i for i in range(ctx.num_inputs) if ctx.is_param(i))
    shapes = list(ctx.param_shapes)
    shapes[index] = (99, 99)
    with pytest.raises(ZenFlowGraphError, match="mapping is wrong"):
        rewrite_backward(copy.deepcopy(rec["backward"]).graph, ZenFlowPassContext(tuple(shapes)))


def test_uuid_covers_slots_shapes_configs_buckets_and_pass_sources():
    base = ZenFlowPassContext((None, (2, 2), (2,)), configs=((("topk_ratio", 0.1),),))

    def uuid(ctx):
        return zf_backend.ZenFlowGraphPass(ctx).uuid()

    assert uuid(base) == uuid(copy.deepcopy(base))
    assert uuid(base) == uuid(ZenFlowPassContext(base.param_shapes, ("a", "b", "c"),
                                                 base.configs))  # names are cosmetic
    assert uuid(base) != uuid(ZenFlowPassContext(((2, 2), None, (2,)), configs=base.configs))  # other slots
    assert uuid(base) != uuid(ZenFlowPassContext((None, (4,), (2,)), configs=base.configs))
    assert uuid(base) != uuid(ZenFlowPassContext(base.param_shapes, configs=((("topk_ratio", 0.2),),)))
    assert uuid(base) != uuid(dataclasses.replace(base, bucket_numel=1000))  # other buckets, other ops
    assert uuid(base) != uuid(dataclasses.replace(base, data_parallel=2))
    assert uuid(base) != uuid(dataclasses.replace(base, runtime_scored_numel=16))  # other scores in the graph
    # the pass travels to Inductor compile subprocesses by pickle, keeping its identity
    graph_pass = zf_backend.ZenFlowGraphPass(base, debug_dir="somewhere")
    assert pickle.loads(pickle.dumps(graph_pass)).uuid() == graph_pass.uuid()

    import zenflow_compile.passes as passes_pkg
    from pathlib import Path

    sources = {p.resolve() for p in zf_backend._source_files()}
    for path in Path(passes_pkg.__file__).resolve().parent.glob("*.py"):
        assert path.resolve() in sources
    import zenflow_compile.runtime.ops as ops

    assert Path(ops.__file__).resolve() in sources


def test_pass_context_maps_inputs_by_identity_and_rejects_unowned():
    torch.manual_seed(0)
    model, runtime = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), RecordingRuntime()
    names = own(model, runtime)
    model[1].bias.requires_grad_(False)
    rec = capture(model, torch.randn(2, 3))
    ctx = rec["ctx"]
    named = {ctx.param_names[i]: ctx.param_shapes[i] for i in range(ctx.num_inputs) if ctx.is_param(i)}
    assert named == {name: tuple(p.shape) for name, p in model.named_parameters()}  # the frozen bias too

    stray = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(Exception, match=r"parameter 0\.weight \(shape \(4, 3\).*no ZenFlowAdamW owns it"):
        capture(stray, torch.randn(2, 3))
