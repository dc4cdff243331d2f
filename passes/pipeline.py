"""The ZenFlow rewrite of one backward graph: the passes, in order, over an explicit context.

For the ZenFlow parameter gradient outputs `g1, g2, ...` (the gradients of forward inputs `slot1, slot2, ...`):

    scores1 = <norm proxy of g1>                               (insert_norm_proxy, right after each g)
    ...
    zenflow.accumulate_grads([g1, g2, ...], [scores1, scores2, ...], [slot1, slot2, ...])
                                                               (insert_grad_accumulate: one per bucket of
                                                                ~ctx.bucket_numel elements, right after its
                                                                last gradient and scores)
    return ..., None, ...                                      (drop_param_grads)

Data parallel (the owners reduce across ranks), instead of the norm proxies and `accumulate_grads`:

    zenflow.reduce_grads([g1, g2, ...], [slot1, slot2, ...])    (insert_grad_reduce, one per bucket)

No optimizer math goes into the graph: the device update of the selected columns runs at `opt.step()` as
one fused multi-parameter update, because skipping a non-finite step and clipping both need the step's
global gradient norm, known only after the last gradient of the step (possibly in another graph, or
another backward with gradient accumulation) has arrived. The graph's job is to hand the gradients and
their norm proxies over early (a bucket as soon as it is complete) and to keep no full gradient alive
past its bucket's hand-off.
"""

from __future__ import annotations

import math

import torch.fx

from zenflow_compile.passes.backward_graph import ParamGrad, find_param_grads, is_backward_graph
from zenflow_compile.passes.context import ZenFlowPassContext
from zenflow_compile.passes.grad_handoff import drop_param_grads, insert_grad_accumulate, insert_grad_reduce
from zenflow_compile.passes.norm_proxy import insert_norm_proxy

__all__ = ["ZenFlowPassContext", "rewrite_backward", "is_backward_graph"]


def rewrite_backward(graph: torch.fx.Graph, ctx: ZenFlowPassContext) -> list[ParamGrad]:
    """Rewrite a backward graph in place; return the parameter gradients handed to the runtime."""
    grads = find_param_grads(graph, ctx)
    if ctx.data_parallel is None:
        scores = {grad.slot: insert_norm_proxy(graph, grad.node)
                  if math.prod(ctx.param_shapes[grad.slot]) > ctx.runtime_scored_numel else None for grad in grads}
        insert_grad_accumulate(graph, grads, scores, ctx.param_shapes, ctx.bucket_numel)
    else:
        insert_grad_reduce(graph, grads, ctx.param_shapes, ctx.bucket_numel)
    drop_param_grads(graph, [grad.output_index for grad in grads])
    graph.lint()
    return grads
