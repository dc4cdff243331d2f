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
                        slot: int) -> torch.fx.Node:
    """`slot` is the parameter's forward-input index; the runtime resolves it to the parameter that the
    compiled graph was actually called with."""
    with graph.inserting_after(scores):
        node = graph.call_function(ACCUMULATE_GRAD, (grad, scores, slot))
    node.meta["val"] = None  # returns nothing
    return node
