"""The `zenflow::` custom ops the rewritten backward graph calls, one call per bucket of gradients (not per
gradient: the Python dispatch of each call dominates on models of many small tensors).

Schemas carry only tensors and integers, so a compiled graph can be cached, replayed and shared by every model
it is called with: `registry` resolves each slot to the parameter of the call being differentiated.
`accumulate_grads(grads, column_scores, slots)`: `column_scores[i]` is the graph's per-column squared-norm
proxy, or None for a small gradient the runtime scores with its like parameters. `reduce_grads(grads, slots)`,
data parallel: the runtime reduces them across ranks (`runtime/grad_reduce.py`) and scores the mean gradient.

The ops return nothing: `has_side_effect` marks them impure, or FX dead-code elimination and Inductor's scheduler
(which both consult `torch._library.utils.is_impure`) would drop them. An op keeps no reference to its
gradients or scores past the call (Inductor may reuse their buffers once it has run); copy or accumulate.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.node import has_side_effect

from zenflow_compile.runtime import registry

__all__ = ["accumulate_grads", "reduce_grads", "ACCUMULATE_GRADS", "REDUCE_GRADS"]


# Explicit schema: `int[]`, not the SymInt[] custom_op would infer (a slot is never symbolic).
# cudagraph_unsafe: a CUDA graph replay would skip this Python call, silently losing the gradients, so
# Inductor must not capture it (it partitions around it or disables CUDA graphs for that graph).
@torch.library.custom_op("zenflow::accumulate_grads", mutates_args=(),
                         schema="(Tensor[] grads, Tensor?[] column_scores, int[] slots) -> ()",
                         tags=(torch.Tag.cudagraph_unsafe,))
def accumulate_grads(grads: list[torch.Tensor], column_scores: list[Optional[torch.Tensor]],
                     slots: list[int]) -> None:
    """Give the owner of the parameter in each of `slots` this backward's gradient and its column scores."""
    registry.accumulate_grads_from_graph(slots, grads, column_scores)


@accumulate_grads.register_fake
def _accumulate_grads_fake(grads: list[torch.Tensor], column_scores: list[Optional[torch.Tensor]],
                           slots: list[int]) -> None:
    # Nothing to describe: the op produces no tensors.
    return None


@torch.library.custom_op("zenflow::reduce_grads", mutates_args=(),
                         schema="(Tensor[] grads, int[] slots) -> ()",
                         tags=(torch.Tag.cudagraph_unsafe,))
def reduce_grads(grads: list[torch.Tensor], slots: list[int]) -> None:
    """Start the data-parallel reduction of one bucket of gradients (forward-input `slots`)."""
    registry.reduce_grads_from_graph(slots, grads)


@reduce_grads.register_fake
def _reduce_grads_fake(grads: list[torch.Tensor], slots: list[int]) -> None:
    return None


#: The OpOverloads the passes insert into backward graphs, marked impure (see the module docstring).
ACCUMULATE_GRADS = torch.ops.zenflow.accumulate_grads.default
REDUCE_GRADS = torch.ops.zenflow.reduce_grads.default
has_side_effect(ACCUMULATE_GRADS)
has_side_effect(REDUCE_GRADS)
