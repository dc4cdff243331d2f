"""The `zenflow::accumulate_grad` custom op: schema, fake kernel, side effects, runtime hand-off."""

import torch
import torch.fx
from torch import nn

from zenflow_compile.config import ZenFlowConfig
from zenflow_compile.runtime import registry
from zenflow_compile.runtime.ops import ACCUMULATE_GRAD


class RecordingRuntime:
    """Stands in for ZenFlowRuntime: records what the op hands over."""

    def __init__(self):
        self.config = ZenFlowConfig()
        self.calls = []

    def accumulate_grad(self, pid, grad, scores):
        self.calls.append((pid, grad.clone(), None if scores is None else scores.clone()))


def test_schema_has_only_tensors_and_an_int_id():
    schema = ACCUMULATE_GRAD._schema
    assert str(schema) == "zenflow::accumulate_grad(Tensor grad, Tensor column_scores, int param_id) -> ()"
    assert not schema.is_mutable
    assert torch.Tag.cudagraph_unsafe in ACCUMULATE_GRAD.tags  # never captured into a CUDA graph


def test_op_calls_the_runtime_of_the_id():
    runtime, p = RecordingRuntime(), nn.Parameter(torch.zeros(3, 2))
    pid = registry.register_param(p, runtime)
    g, s = torch.randn(3, 2), torch.rand(2)
    torch.ops.zenflow.accumulate_grad(g, s, pid)
    ((got_pid, got_g, got_s),) = runtime.calls
    assert got_pid == pid and torch.equal(got_g, g) and torch.equal(got_s, s)


def test_opcheck_fake_kernel_and_schema():
    runtime, p = RecordingRuntime(), nn.Parameter(torch.zeros(4, 3))
    pid = registry.register_param(p, runtime)
    torch.library.opcheck(ACCUMULATE_GRAD, (torch.randn(4, 3), torch.rand(3), pid),
                          test_utils=("test_schema", "test_faketensor"))


def test_marked_impure_so_dce_keeps_it():
    from torch._library.utils import is_impure

    assert is_impure(ACCUMULATE_GRAD)
    graph = torch.fx.Graph()
    g = graph.placeholder("g")
    s = graph.placeholder("s")
    call = graph.call_function(ACCUMULATE_GRAD, (g, s, 0))
    graph.output(None)
    assert call.is_impure()
    graph.eliminate_dead_code()
    assert any(n.target is ACCUMULATE_GRAD for n in graph.nodes)


def test_inductor_keeps_and_runs_the_op():
    """Compiled by Inductor with nothing using its (absent) result, the op still runs."""
    runtime, p = RecordingRuntime(), nn.Parameter(torch.zeros(5, 2))
    pid = registry.register_param(p, runtime)

    def f(g):
        torch.ops.zenflow.accumulate_grad(g * 2, (g * 2).pow(2).sum(0), pid)
        return g + 1

    torch._dynamo.reset()
    g = torch.randn(5, 2)
    out = torch.compile(f, backend="inductor", fullgraph=True)(g)
    torch.testing.assert_close(out, g + 1)
    ((got_pid, got_g, got_s),) = runtime.calls
    assert got_pid == pid
    torch.testing.assert_close(got_g, g * 2)
    torch.testing.assert_close(got_s, (g * 2).pow(2).sum(0))
    torch._dynamo.reset()
