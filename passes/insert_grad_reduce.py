"""Data parallel: hand the parameter gradients over in buckets, `zenflow::reduce_grads(grads, slots)`.

Gradients are bucketed in the order the graph produces them (the same on every rank, so every rank starts
the same collectives in the same order) until a bucket holds `bucket_numel` elements; each bucket's op goes
right after its last gradient is produced, so its reduction overlaps the rest of the backward. No norm
proxy is inserted: the scores must be those of the gradient averaged across ranks, which the runtime
computes from the reduced pieces.
"""

from __future__ import annotations

import torch.fx

from zenflow_compile.passes.find_param_grads import ParamGrad
from zenflow_compile.passes.grad_buckets import bucket_param_grads, insert_bucket_call
from zenflow_compile.runtime.ops import REDUCE_GRADS

__all__ = ["insert_grad_reduce"]


def insert_grad_reduce(graph: torch.fx.Graph, grads: list[ParamGrad], shapes: tuple,
                       bucket_numel: int) -> list[torch.fx.Node]:
    calls: list[torch.fx.Node] = []
    for bucket in bucket_param_grads(graph, grads, shapes, bucket_numel):
        args = ([g.node for g in bucket], [g.slot for g in bucket])
        calls.append(insert_bucket_call(graph, REDUCE_GRADS, args, not_before=calls[-1] if calls else None))
    return calls
