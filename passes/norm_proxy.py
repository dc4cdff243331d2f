"""Insert the gradient-norm proxy of one parameter gradient: plain aten reductions Inductor can fuse.

Matrix (dim >= 2, viewed as [rows, columns]): the per-column squared L2 norms, shape [C].
Vector (dim < 2): the squared L2 norm, shape [1]. Always fp32 (the importance scores of docs/semantics.md, "Selection").
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
from torch.utils._pytree import tree_map_only

from zenflow_compile.passes.backward_graph import insertion_point

__all__ = ["insert_norm_proxy"]

aten = torch.ops.aten
prims = torch.ops.prims


def insert_norm_proxy(graph: torch.fx.Graph, grad: torch.fx.Node) -> torch.fx.Node:
    """Insert the scores of `grad` right after it; return the scores node."""
    val = grad.meta["val"]
    x = grad
    after = insertion_point(grad)
    if val.dtype != torch.float32:
        x = after = insert_call(graph, prims.convert_element_type.default, (x, torch.float32), after=after)
    squared = insert_call(graph, aten.pow.Tensor_Scalar, (x, 2), after=after)
    if val.dim() >= 2:
        # Summing over dim 0 then flattening equals reshape(rows, -1).sum(0) without reshaping the gradient.
        scores = insert_call(graph, aten.sum.dim_IntList, (squared, [0]), after=squared)
        if val.dim() > 2:
            scores = insert_call(graph, aten.reshape.default, (scores, [-1]), after=scores)
    else:
        total = insert_call(graph, aten.sum.default, (squared,), after=squared)
        scores = insert_call(graph, aten.reshape.default, (total, [1]), after=total)
    return scores


def insert_call(graph: torch.fx.Graph, target: Callable[..., Any], args: tuple, *,
                after: torch.fx.Node) -> torch.fx.Node:
    """Insert `target(*args)` right after `after`, with `meta["val"]` computed on the args' fake values
    (Inductor's lowering and later post-grad passes read it)."""
    with graph.inserting_after(after):
        node = graph.call_function(target, args)
    fake_args = tree_map_only(torch.fx.Node, lambda n: n.meta["val"], args)
    node.meta["val"] = target(*fake_args)
    return node
