"""Hand the parameter gradients and their scores over in buckets: `zenflow::accumulate_grads`.

    zenflow.accumulate_grads([g1, g2, ...], [scores1, scores2, ...], [slot1, slot2, ...])

Gradients are bucketed in the order the graph produces them until a bucket holds `bucket_numel` elements
(the owners' `reduce_bucket_size`); each bucket's op goes right after its last gradient and that
gradient's scores, so the runtime receives (and, on CUDA, starts offloading) a bucket while the rest of the
backward runs. A bucket's gradients stay alive until its op has run; no full gradient outlives it.
"""

from __future__ import annotations

import torch.fx

from zenflow_compile.passes.find_param_grads import ParamGrad
from zenflow_compile.passes.grad_buckets import bucket_param_grads, insert_bucket_call
from zenflow_compile.runtime.ops import ACCUMULATE_GRADS

__all__ = ["insert_grad_accumulate"]


def insert_grad_accumulate(graph: torch.fx.Graph, grads: list[ParamGrad], scores: dict[int, torch.fx.Node],
                           shapes: tuple, bucket_numel: int) -> list[torch.fx.Node]:
    """`scores[slot]` is the norm-proxy node of the gradient in `slot` (`insert_norm_proxy`), or None where the
    runtime scores it. The slots are
    forward-input indices; the runtime resolves them to the parameters the compiled graph was called with."""
    calls: list[torch.fx.Node] = []
    for bucket in bucket_param_grads(graph, grads, shapes, bucket_numel):
        args = ([g.node for g in bucket], [scores[g.slot] for g in bucket], [g.slot for g in bucket])
        calls.append(insert_bucket_call(graph, ACCUMULATE_GRADS, args, not_before=calls[-1] if calls else None))
    return calls
