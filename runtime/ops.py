"""The `zenflow::` custom ops that the rewritten backward graph calls.

Schemas carry only tensors and integers (never a live object), so a compiled graph can be cached, replayed
and shared by every model it is called with; `zenflow_compile.runtime.registry` resolves the integer at run
time.

    zenflow::accumulate_grad(Tensor grad, Tensor column_scores, int slot) -> ()

hands one backward's gradient of the parameter in forward-input `slot` (and its per-column squared-norm
proxy, computed by fused aten reductions in the graph) to the runtime that owns that parameter in the call
being differentiated.

    zenflow::reduce_grads(Tensor[] grads, int[] slots) -> ()

data parallel (SPEC §5): hands one bucket of gradients over at once; the runtime starts their asynchronous
reduction across ranks (`runtime/grad_reduce.py`) and computes the column scores from the averaged
gradient, so the graph computes no norm proxy for them. The op returns nothing, so both FX dead-code elimination and
Inductor's scheduler would drop it as unused: `torch.fx.node.has_side_effect` marks it impure, which is the
one registry both consult (`torch._library.utils.is_impure`, used by `Node.is_impure` and by Inductor's
`FallbackKernel.has_side_effects`).

Contract with the runtime: the op must not keep references to `grad` or `column_scores` past the call
(Inductor may reuse their buffers for later kernels once the op has run); copy or accumulate instead.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from zenflow_compile.runtime import registry

__all__ = ["accumulate_grad", "reduce_grads", "ACCUMULATE_GRAD", "REDUCE_GRADS"]


# Explicit schema: `int`, not the SymInt custom_op would infer (an id is never symbolic).
# cudagraph_unsafe: a CUDA graph replay would skip this Python call, silently losing the gradient, so
# Inductor must not capture it (it partitions around it or disables CUDA graphs for that graph).
@torch.library.custom_op("zenflow::accumulate_grad", mutates_args=(),
                         schema="(Tensor grad, Tensor column_scores, int slot) -> ()",
                         tags=(torch.Tag.cudagraph_unsafe,))
def accumulate_grad(grad: torch.Tensor, column_scores: torch.Tensor, slot: int) -> None:
    """Give the owner of the parameter in `slot` this backward's gradient and its column scores."""
    registry.accumulate_grad_from_graph(slot, grad, column_scores)


@accumulate_grad.register_fake
def _accumulate_grad_fake(grad: torch.Tensor, column_scores: torch.Tensor, slot: int) -> None:
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


#: The OpOverloads the passes insert into backward graphs.
ACCUMULATE_GRAD = torch.ops.zenflow.accumulate_grad.default
REDUCE_GRADS = torch.ops.zenflow.reduce_grads.default

# Without this, the ops (no outputs, no mutated args) look pure and would be dead-code eliminated.
has_side_effect(ACCUMULATE_GRAD)
has_side_effect(REDUCE_GRADS)
