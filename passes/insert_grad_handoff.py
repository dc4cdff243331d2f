"""Insert the hand-off of one parameter gradient to the runtime: `zenflow::accumulate_grad`.

It goes right after the scores, which come right after the gradient's producer, so the runtime receives
each gradient as soon as it is ready (and, on CUDA, can start offloading it while the rest of the backward
runs) instead of at the end of the graph.
"""

from __future__ import annotations

import torch.fx

from zenflow_compile.runtime.ops import ACCUMULATE_GRAD

__all__ = ["insert_grad_handoff"]


def insert_grad_handoff(graph: torch.fx.Graph, grad: torch.fx.Node, scores: torch.fx.Node,
                        param_id: int) -> torch.fx.Node:
    with graph.inserting_after(scores):
        node = graph.call_function(ACCUMULATE_GRAD, (grad, scores, param_id))
    node.meta["val"] = None  # returns nothing
    return node
