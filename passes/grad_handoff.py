"""Hand the parameter gradients to the runtime in buckets, and return None in their place.

Single process (`insert_grad_accumulate`), each gradient with its scores (`insert_norm_proxy`):

    zenflow.accumulate_grads([g1, g2, ...], [scores1, scores2, ...], [slot1, slot2, ...])

Data parallel (`insert_grad_reduce`), no scores: they must be those of the gradient averaged across ranks,
which the runtime computes from the reduced pieces:

    zenflow.reduce_grads([g1, g2, ...], [slot1, slot2, ...])

Both cut the gradients into buckets in the order the graph produces them (the same on every rank, so every
rank starts the same collectives in the same order) until a bucket holds `bucket_numel` elements (the
owners' `reduce_bucket_size`), and place one op call per bucket instead of one per gradient, because every
custom-op call from Inductor's generated code costs a Python dispatch and a Python call chain. Each call goes
right after the last node it uses, so the runtime receives (and, on CUDA, starts offloading or reducing) a
bucket while the rest of the backward runs. Then `drop_param_grads` makes the graph return None for those
gradients: a bucket's gradients stay alive until its op has run, and no full gradient outlives it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch.fx
from torch.utils._pytree import tree_leaves

from zenflow_compile.passes.backward_graph import ParamGrad, graph_outputs, insertion_point
from zenflow_compile.runtime.ops import ACCUMULATE_GRADS, REDUCE_GRADS

__all__ = ["bucket_param_grads", "insert_bucket_call", "insert_grad_accumulate", "insert_grad_reduce",
           "drop_param_grads"]


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


def insert_grad_accumulate(graph: torch.fx.Graph, grads: list[ParamGrad], scores: dict[int, torch.fx.Node],
                           shapes: tuple, bucket_numel: int) -> list[torch.fx.Node]:
    """One `zenflow::accumulate_grads` per bucket, right after its last gradient and that gradient's scores.

    `scores[slot]` is the norm-proxy node of the gradient in `slot` (`insert_norm_proxy`), or None where the
    runtime scores it. The slots are forward-input indices; the runtime resolves them to the parameters the
    compiled graph was called with."""
    calls: list[torch.fx.Node] = []
    for bucket in bucket_param_grads(graph, grads, shapes, bucket_numel):
        args = ([g.node for g in bucket], [scores[g.slot] for g in bucket], [g.slot for g in bucket])
        calls.append(insert_bucket_call(graph, ACCUMULATE_GRADS, args, not_before=calls[-1] if calls else None))
    return calls


def insert_grad_reduce(graph: torch.fx.Graph, grads: list[ParamGrad], shapes: tuple,
                       bucket_numel: int) -> list[torch.fx.Node]:
    """Data parallel: one `zenflow::reduce_grads` per bucket, right after its last gradient, so the bucket's
    reduction overlaps the rest of the backward."""
    calls: list[torch.fx.Node] = []
    for bucket in bucket_param_grads(graph, grads, shapes, bucket_numel):
        args = ([g.node for g in bucket], [g.slot for g in bucket])
        calls.append(insert_bucket_call(graph, REDUCE_GRADS, args, not_before=calls[-1] if calls else None))
    return calls


def drop_param_grads(graph: torch.fx.Graph, output_indices: Iterable[int]) -> None:
    """Return None instead of the handed-over gradients, so autograd never materialises `.grad` and each
    gradient buffer dies right after its bucket's op."""
    dropped = set(output_indices)
    output = graph.output_node()
    outputs = [None if i in dropped else value for i, value in enumerate(graph_outputs(graph))]
    output.args = (tuple(outputs),)
    # Inductor keeps the strides of user-visible outputs; a None output has none.
    visible = output.meta.get("user_visible_output_idxs")
    if visible is not None:
        output.meta["user_visible_output_idxs"] = [i for i in visible if i not in dropped]
