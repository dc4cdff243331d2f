"""Hand gradients over in buckets: cut the parameter gradients into buckets, place one call per bucket.

Both hand-off passes (`insert_grad_accumulate`, single process; `insert_grad_reduce`, data parallel) use it:
one op call per bucket instead of one per gradient, because every custom-op call from Inductor's generated
code costs a Python dispatch and a Python call chain. Buckets follow the order the graph produces the
gradients (the same on every rank) and each call goes right after the last node it uses, so the runtime
gets a bucket as soon as all of it is ready.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch.fx
from torch.utils._pytree import tree_leaves

from zenflow_compile.passes.find_param_grads import ParamGrad
from zenflow_compile.passes.graph_utils import insertion_point

__all__ = ["bucket_param_grads", "insert_bucket_call"]


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


def insert_bucket_call(graph: torch.fx.Graph, target: Callable[..., Any], args: tuple, *,
                       not_before: torch.fx.Node | None = None) -> torch.fx.Node:
    """Insert `target(*args)` (an op that returns nothing) right after the last node among `args`, and
    after `not_before` (the previous bucket's call, so buckets reach the runtime in order)."""
    used = [node for node in tree_leaves(args) if isinstance(node, torch.fx.Node)]
    if not_before is not None:
        used.append(not_before)
    last = max(used)  # FX nodes compare by their position in the graph
    with graph.inserting_after(insertion_point(last)):
        node = graph.call_function(target, args)
    node.meta["val"] = None  # returns nothing
    return node
