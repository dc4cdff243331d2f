"""Small helpers shared by the passes: insert a call node with its fake value, find insertion points."""

from __future__ import annotations

from typing import Any, Callable

import torch.fx
from torch.utils._pytree import tree_map_only

__all__ = ["insert_call", "insertion_point"]


def insertion_point(node: torch.fx.Node) -> torch.fx.Node:
    """The node after which work on `node`'s value can go: `node` itself, or the last placeholder when
    `node` is a placeholder (placeholders stay together at the top of the graph)."""
    if node.op != "placeholder":
        return node
    return list(node.graph.find_nodes(op="placeholder"))[-1]


def insert_call(graph: torch.fx.Graph, target: Callable[..., Any], args: tuple, *,
                after: torch.fx.Node) -> torch.fx.Node:
    """Insert `target(*args)` right after `after`, with `meta["val"]` computed on the args' fake values
    (Inductor's lowering and later post-grad passes read it)."""
    with graph.inserting_after(after):
        node = graph.call_function(target, args)
    fake_args = tree_map_only(torch.fx.Node, lambda n: n.meta["val"], args)
    node.meta["val"] = target(*fake_args)
    return node
