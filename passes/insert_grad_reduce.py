"""Data parallel: hand the parameter gradients over in buckets, `zenflow::reduce_grads(grads, slots)`.

Gradients are bucketed in the order the graph produces them (the same on every rank, so every rank starts
the same collectives in the same order) until a bucket holds `bucket_numel` elements; each bucket's op goes
right after its last gradient is produced, so its reduction overlaps the rest of the backward. No norm
proxy is inserted: the scores must be those of the gradient averaged across ranks, which the runtime
computes from the reduced pieces.
"""

from __future__ import annotations

import math

import torch.fx

from zenflow_compile.passes.find_param_grads import ParamGrad
from zenflow_compile.runtime.ops import REDUCE_GRADS

__all__ = ["insert_grad_reduce", "bucket_param_grads"]


def bucket_param_grads(graph: torch.fx.Graph, grads: list[ParamGrad],
                       shapes: tuple, bucket_numel: int) -> list[list[ParamGrad]]:
    """Gradients in production order, cut into buckets of at least `bucket_numel` elements (the last may
    be smaller)."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    buckets, current, numel = [], [], 0
    for grad in sorted(grads, key=lambda g: (position[g.node], g.slot)):
        current.append(grad)
        numel += math.prod(shapes[grad.slot])
        if numel >= bucket_numel:
            buckets.append(current)
            current, numel = [], 0
    if current:
        buckets.append(current)
    return buckets


def insert_grad_reduce(graph: torch.fx.Graph, grads: list[ParamGrad], shapes: tuple,
                       bucket_numel: int) -> list[torch.fx.Node]:
    position = {node: i for i, node in enumerate(graph.nodes)}
    calls = []
    for bucket in bucket_param_grads(graph, grads, shapes, bucket_numel):
        last = max((grad.node for grad in bucket), key=position.__getitem__)
        with graph.inserting_after(last):
            node = graph.call_function(REDUCE_GRADS, ([g.node for g in bucket], [g.slot for g in bucket]))
        node.meta["val"] = None  # returns nothing
        calls.append(node)
    return calls
