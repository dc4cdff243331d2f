"""Read a backward graph: which output is each ZenFlow parameter's gradient, and where new nodes can go.

AOTAutograd's partitioned backward graph returns one value per forward input (None where there is no
gradient), in forward-input order; tangents come in as placeholders named `tangents_*` (AOTAutograd's own
convention, `_is_tangent`). Forward and inference graphs have no tangents, which is how the passes tell the
graphs apart: both go through the same Inductor post-grad hook.
"""

from __future__ import annotations

import dataclasses

import torch.fx
from torch._functorch._aot_autograd.utils import _is_tangent

from zenflow_compile.passes.context import ZenFlowPassContext

__all__ = ["ParamGrad", "ZenFlowGraphError", "is_backward_graph", "graph_outputs", "find_param_grads",
           "insertion_point"]


class ZenFlowGraphError(RuntimeError):
    """The backward graph does not have the shape the ZenFlow passes rely on."""


@dataclasses.dataclass(frozen=True)
class ParamGrad:
    output_index: int  # position in the backward graph's outputs (= forward input index = the slot)
    node: torch.fx.Node  # the node producing the gradient

    @property
    def slot(self) -> int:
        return self.output_index


def is_backward_graph(graph: torch.fx.Graph) -> bool:
    return any(_is_tangent(node) for node in graph.find_nodes(op="placeholder"))


def graph_outputs(graph: torch.fx.Graph) -> tuple:
    (outputs,) = graph.output_node().args
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def find_param_grads(graph: torch.fx.Graph, ctx: ZenFlowPassContext) -> list[ParamGrad]:
    """The gradient node of every ZenFlow parameter that gets a gradient from this graph."""
    outputs = graph_outputs(graph)
    if len(outputs) != ctx.num_inputs:
        raise ZenFlowGraphError(
            f"ZenFlow: the backward graph returns {len(outputs)} values but its forward graph had "
            f"{ctx.num_inputs} inputs, so gradients cannot be matched to parameters (an AOTAutograd input "
            "transformation, e.g. duplicated or aliased inputs, is not supported)")
    found = []
    for index, node in enumerate(outputs):
        if not ctx.is_param(index) or not isinstance(node, torch.fx.Node):
            continue  # not a ZenFlow parameter, or no gradient flows to it in this graph
        val = node.meta.get("val")
        expected = ctx.param_shapes[index]
        if val is not None and val.layout != torch.strided:
            raise ValueError(
                f"ZenFlow: {ctx.name(index)} gets a {val.layout} gradient (e.g. nn.Embedding(sparse=True)); "
                "ZenFlow needs dense gradients. Fix: use sparse=False for that module (ZenFlow already keeps "
                "only the selected columns on the device)")
        if val is not None and tuple(val.shape) != tuple(expected):
            raise ZenFlowGraphError(
                f"ZenFlow: backward output {index} has shape {tuple(val.shape)} but {ctx.name(index)} "
                f"has shape {tuple(expected)}: the gradient-to-parameter mapping is wrong")
        found.append(ParamGrad(index, node))
    return found


def insertion_point(node: torch.fx.Node) -> torch.fx.Node:
    """The node after which work on `node`'s value can go: `node` itself, or the last placeholder when
    `node` is a placeholder (placeholders stay together at the top of the graph)."""
    if node.op != "placeholder":
        return node
    return list(node.graph.find_nodes(op="placeholder"))[-1]
