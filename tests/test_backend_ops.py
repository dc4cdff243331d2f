"""The `zenflow::accumulate_grads` custom op: schema, fake kernel, side effects, runtime hand-off.

The op carries slots (forward-input indices); the parameter ids of a call are bound to the autograd node of
that call (`registry.bind_param_ids`), as the backend does for AOTAutograd's `CompiledFunction`. Here a
stand-in autograd.Function of the same name calls the op from its backward.
"""

import pytest
import torch
import torch.fx
from torch import nn

from zenflow_compile.config import ZenFlowConfig
from zenflow_compile.runtime import registry
from zenflow_compile.runtime.ops import ACCUMULATE_GRADS


class RecordingRuntime:
    """Stands in for ZenFlowRuntime: records each bucket the op hands over."""

    def __init__(self):
        self.config = ZenFlowConfig()
        self.calls = []

    def take_grads(self, pids, grads, scores=None):
        self.calls.append((list(pids), [g.clone() for g in grads], [s.clone() for s in scores]))


class CompiledFunction(torch.autograd.Function):
    """Named like AOTAutograd's, so `bind_param_ids` finds its node; its backward runs `hand_off(grad)`."""

    @staticmethod
    def forward(ctx, x, hand_off):
        ctx.hand_off = hand_off
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        ctx.hand_off(grad)
        return grad, None


def run_backward(hand_off, param_ids, shape=(3, 2)):
    x = torch.randn(shape, requires_grad=True)
    y = CompiledFunction.apply(x, hand_off)
    registry.bind_param_ids(y, param_ids)
    y.sum().backward()


def test_schema_has_only_tensors_and_int_slots():
    schema = ACCUMULATE_GRADS._schema
    assert str(schema) == ("zenflow::accumulate_grads(Tensor[] grads, Tensor?[] column_scores, int[] slots) -> ()")
    assert not schema.is_mutable
    assert torch.Tag.cudagraph_unsafe in ACCUMULATE_GRADS.tags  # never captured into a CUDA graph
    assert not hasattr(torch.ops.zenflow, "accumulate_grad")  # one hand-off op kind: the bucketed one


def test_op_calls_the_runtime_of_the_parameter_bound_to_the_slot():
    runtimes, params = [RecordingRuntime(), RecordingRuntime()], [nn.Parameter(torch.zeros(3, 2)) for _ in "ab"]
    pids = [registry.register_param(p, r) for p, r in zip(params, runtimes)]
    s = torch.rand(2)
    # The same "graph" (hand off slot 1) bound to different parameters on two calls.
    for bound in ((None, pids[0]), (None, pids[1])):
        run_backward(lambda g: torch.ops.zenflow.accumulate_grads([g], [s], [1]), bound)
    for runtime, pid in zip(runtimes, pids):
        ((got_pids, (got_g,), (got_s,)),) = runtime.calls
        assert got_pids == [pid] and torch.equal(got_g, torch.ones(3, 2)) and torch.equal(got_s, s)


def test_a_bucket_reaches_each_owner_in_one_call_in_bucket_order():
    runtimes = [RecordingRuntime(), RecordingRuntime()]
    params = [nn.Parameter(torch.zeros(3, 2)) for _ in range(4)]
    owners = [runtimes[0], runtimes[1], runtimes[0], runtimes[0]]
    pids = [registry.register_param(p, r) for p, r in zip(params, owners)]
    g = [torch.full((3, 2), float(i)) for i in range(4)]
    s = [torch.full((2,), 10.0 + i) for i in range(4)]
    # slots out of order: the bucket's order (production order), not slot order, is what each owner sees
    run_backward(lambda _: torch.ops.zenflow.accumulate_grads(g, s, [3, 1, 0, 2]), tuple(pids))

    def seen(runtime):
        return [(c[0], [t[0, 0].item() for t in c[1]], [t[0].item() for t in c[2]]) for c in runtime.calls]

    assert seen(runtimes[0]) == [([pids[3], pids[0], pids[2]], [0.0, 2.0, 3.0], [10.0, 12.0, 13.0])]
    assert seen(runtimes[1]) == [([pids[1]], [1.0], [11.0])]


def test_a_resolved_bucket_is_not_reused_after_its_owner_went_away():
    """The registry remembers how a bucket's slots resolved (same bound ids, step after step); unregistering
    an owner's parameter (what deleting the optimizer does) must not leave a stale route to it."""
    runtime, params = RecordingRuntime(), [nn.Parameter(torch.zeros(3, 2)) for _ in range(2)]
    bound = tuple(registry.register_param(p, runtime) for p in params)  # one tuple object, as the backend's
    s = torch.rand(2)
    for _ in range(2):
        run_backward(lambda g: torch.ops.zenflow.accumulate_grads([g, g], [s, s], [0, 1]), bound)
    assert [c[0] for c in runtime.calls] == [list(bound)] * 2
    registry.unregister_param(bound[1])
    with pytest.raises(RuntimeError, match=f"parameter id {bound[1]} has no live optimizer"):
        run_backward(lambda g: torch.ops.zenflow.accumulate_grads([g, g], [s, s], [0, 1]), bound)
    assert len(runtime.calls) == 2


def test_op_outside_a_zenflow_backward_is_a_clear_error():
    with pytest.raises(RuntimeError, match="outside the backward of a graph compiled with backend='zenflow'"):
        torch.ops.zenflow.accumulate_grads([torch.randn(3, 2)], [torch.rand(2)], [0])


def test_slot_without_an_owner_is_a_clear_error():
    runtime, p = RecordingRuntime(), nn.Parameter(torch.zeros(3, 2))
    pid = registry.register_param(p, runtime)
    with pytest.raises(RuntimeError, match="forward input 1 of this graph got a gradient but no ZenFlowAdamW"):
        run_backward(lambda g: torch.ops.zenflow.accumulate_grads([g, g], [g.pow(2).sum(0)] * 2, [0, 1]),
                     (pid, None))
    assert runtime.calls == []  # nothing of a bucket is handed over when part of it cannot be


def test_opcheck_fake_kernel_and_schema():
    runtime, params = RecordingRuntime(), [nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(4, 3))]
    pids = tuple(registry.register_param(p, runtime) for p in params)

    def check(grad):
        torch.library.opcheck(ACCUMULATE_GRADS, ([grad, 2 * grad], [grad.pow(2).sum(0), (2 * grad).pow(2).sum(0)],
                                                 [0, 1]),
                              test_utils=("test_schema", "test_faketensor"))

    run_backward(check, pids, shape=(4, 3))


def test_marked_impure_so_dce_keeps_it():
    from torch._library.utils import is_impure

    assert is_impure(ACCUMULATE_GRADS)
    graph = torch.fx.Graph()
    g = graph.placeholder("g")
    s = graph.placeholder("s")
    call = graph.call_function(ACCUMULATE_GRADS, ([g], [s], [0]))
    graph.output(None)
    assert call.is_impure()
    graph.eliminate_dead_code()
    assert any(n.target is ACCUMULATE_GRADS for n in graph.nodes)


def test_inductor_keeps_and_runs_the_op():
    """Compiled by Inductor with nothing using its (absent) result, the op still runs."""
    runtime, params = RecordingRuntime(), [nn.Parameter(torch.zeros(5, 2)), nn.Parameter(torch.zeros(2))]
    pids = tuple(registry.register_param(p, runtime) for p in params)

    def f(g):
        v = g.sum(0)
        torch.ops.zenflow.accumulate_grads([g * 2, v], [(g * 2).pow(2).sum(0), v.pow(2).sum().reshape(1)], [0, 1])
        return g + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="inductor", fullgraph=True)
    outs = []
    run_backward(lambda g: outs.append(compiled(g)), pids, shape=(5, 2))
    g = torch.ones(5, 2)
    torch.testing.assert_close(outs[0], g + 1)
    ((got_pids, (got_g, got_v), (got_s, got_vs)),) = runtime.calls
    assert got_pids == list(pids)
    torch.testing.assert_close(got_g, g * 2)
    torch.testing.assert_close(got_s, (g * 2).pow(2).sum(0))
    torch.testing.assert_close(got_v, g.sum(0))
    torch.testing.assert_close(got_vs, g.sum(0).pow(2).sum().reshape(1))
    torch._dynamo.reset()


def test_reduce_grads_schema_and_routing_to_each_owner():
    from zenflow_compile.runtime.ops import REDUCE_GRADS

    assert str(REDUCE_GRADS._schema) == "zenflow::reduce_grads(Tensor[] grads, int[] slots) -> ()"
    assert torch.Tag.cudagraph_unsafe in REDUCE_GRADS.tags

    class BucketRuntime(RecordingRuntime):
        def reduce_grads(self, pids, grads):
            self.calls.append((list(pids), [g.clone() for g in grads]))

    runtimes = [BucketRuntime(), BucketRuntime()]
    params = [nn.Parameter(torch.zeros(3, 2)) for _ in range(3)]
    pids = [registry.register_param(p, r) for p, r in zip(params, [runtimes[0], runtimes[1], runtimes[0]])]
    g = [torch.full((3, 2), float(i)) for i in range(3)]
    run_backward(lambda _: torch.ops.zenflow.reduce_grads(g, [0, 1, 2]), tuple(pids))
    # one call per owner, its gradients in bucket order
    assert [(c[0], [t[0, 0].item() for t in c[1]]) for c in runtimes[0].calls] == [([pids[0], pids[2]], [0.0, 2.0])]
    assert [(c[0], [t[0, 0].item() for t in c[1]]) for c in runtimes[1].calls] == [([pids[1]], [1.0])]


def test_a_data_parallel_graph_reused_by_a_single_process_optimizer_takes_each_gradient():
    """Dynamo shares a compiled graph across model instances: a graph rewritten for a data-parallel owner
    (reduce_grads) can run for an optimizer without one, which then takes the gradients one by one."""
    import zenflow_compile

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(4))]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    initial = [p.detach().clone() for p in params]
    opt = zenflow_compile.ZenFlowAdamW(params, lr=0.1, topk_ratio=0.5, update_interval=1)
    reference = zenflow_compile.ZenFlowAdamW(twins, lr=0.1, topk_ratio=0.5, update_interval=1)
    grads = [torch.randn(4, 3), torch.randn(4)]
    run_backward(lambda _: torch.ops.zenflow.reduce_grads(grads, [0, 1]),
                 tuple(opt.param_id(p) for p in params))
    for p, g in zip(twins, grads):
        reference._runtime.take_grads([reference.param_id(p)], [g])
    opt.step()
    reference.step()
    for a, b, before in zip(params, twins, initial):
        assert torch.equal(a, b) and not torch.equal(a, before)
