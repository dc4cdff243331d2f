"""Eager hand-off: post-accumulate-grad hooks fill a bucket; the runtime takes it in one batched call.

A hook per parameter is how an eager backward tells the optimizer that a gradient is ready, but handing each
gradient to the runtime from its hook costs a Python call chain and several small torch calls per tensor.
Instead the hook only records the parameter in the optimizer's open bucket; the flush moves the bucket's
gradients out of `.grad` (so after a backward `.grad` is None, as before) and hands them to
`ZenFlowRuntime.accumulate_grads` (batched, `runtime/handoff.py`) when it holds `bucket_numel` elements (so
on a large model the offload of early gradients still overlaps the rest of the backward) and at the end of
the backward (a callback queued on the autograd engine, as DDP does). `ZenFlowAdamW.step()` and
`zero_grad()` flush or drop whatever a backward that did not finish left behind.

Data parallel: the runtime's own `GradReducer` buckets the gradients for their collectives, so the hook hands
each gradient over at once.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zenflow_compile.runtime.engine import ZenFlowRuntime


class GradBucket:
    """One optimizer's open bucket of eager gradients: the parameters whose gradient is ready, in the order
    autograd produced them. Holds its runtime weakly (the hooks hold the bucket, the parameters hold the
    hooks: a deleted optimizer must still be freed)."""

    def __init__(self, runtime: "ZenFlowRuntime", bucket_numel: int, param_ids: dict[int, int]):
        self._runtime = weakref.ref(runtime)
        self.bucket_numel = bucket_numel
        self._param_ids = param_ids  # id(param) -> runtime id (the optimizer's own dict)
        self.ready: list[torch.Tensor] = []
        self.numel = 0
        self._flush_queued = False

    def hook(self, param: torch.Tensor) -> None:
        """The post-accumulate-grad hook (per parameter and backward: kept to the minimum; the gradient is
        taken out of `.grad` at the flush). It also fires, with no gradient, for the parameters of a graph
        compiled with backend="zenflow", whose backward hands gradients over itself."""
        if param.grad is None:
            return
        self.ready.append(param)
        self.numel += param.numel()
        if self.numel >= self.bucket_numel:
            self.flush()
        elif not self._flush_queued:
            self._queue_flush()

    def hook_data_parallel(self, param: torch.Tensor) -> None:
        """Data parallel: each gradient to the runtime's reducer at once (it buckets for the collectives)."""
        runtime = self._runtime()
        pids, grads = self._take_grads([param])
        if runtime is not None and pids:
            runtime.accumulate_grad(pids[0], grads[0], None)

    def _queue_flush(self) -> None:
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        except RuntimeError:  # not inside a backward (a hook called directly): step() flushes
            return
        self._flush_queued = True

    def _end_of_backward(self) -> None:
        self._flush_queued = False
        self.flush()

    def _take_grads(self, params: list) -> tuple[list[int], list[torch.Tensor]]:
        """Move the parameters' gradients out of `.grad` (a parameter listed twice, after a backward that
        raised before its flush, has its summed gradient taken once)."""
        pids, grads = [], []
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            if grad.layout != torch.strided:
                raise ValueError(
                    f"ZenFlowAdamW: a parameter of shape {tuple(param.shape)} got a {grad.layout} gradient "
                    "(e.g. nn.Embedding(sparse=True)); ZenFlow needs dense gradients. Fix: use sparse=False "
                    "for that module")
            param.grad = None
            pids.append(self._param_ids[id(param)])
            grads.append(grad)
        return pids, grads

    def flush(self) -> None:
        """Hand the open bucket to the runtime."""
        if not self.ready:
            return
        ready, self.ready, self.numel = self.ready, [], 0
        pids, grads = self._take_grads(ready)
        runtime = self._runtime()
        if runtime is not None and pids:
            runtime.accumulate_grads(pids, grads)

    def finish(self) -> None:
        """Between backwards (step()): hand over what a backward left (one that raised runs no callback)."""
        self._flush_queued = False
        self.flush()

    def drop(self) -> None:
        """Between backwards (zero_grad(), which also clears `.grad`): forget the open bucket."""
        self._flush_queued = False
        self.ready, self.numel = [], 0
