"""Return None instead of the ZenFlow parameters' gradients, so autograd never materialises `.grad`.

The gradient buffers then die right after their hand-off op: no full gradient persists on the device.
"""

from __future__ import annotations

from typing import Iterable

import torch.fx

from zenflow_compile.passes.find_param_grads import graph_outputs

__all__ = ["drop_param_grads"]


def drop_param_grads(graph: torch.fx.Graph, output_indices: Iterable[int]) -> None:
    dropped = set(output_indices)
    output = graph.output_node()
    outputs = [None if i in dropped else value for i, value in enumerate(graph_outputs(graph))]
    output.args = (tuple(outputs),)
    # Inductor keeps the strides of user-visible outputs; a None output has none.
    visible = output.meta.get("user_visible_output_idxs")
    if visible is not None:
        output.meta["user_visible_output_idxs"] = [i for i in visible if i not in dropped]
