"""Eager hand-off: post-accumulate-grad hooks fill a bucket; the runtime takes it in one batched call.

A hook per parameter is how an eager backward tells the optimizer that a gradient is ready, but handing each
gradient to the runtime from its hook costs a Python call chain and several small torch calls per tensor.
Instead the hook only moves the gradient out of `.grad` into the optimizer's open bucket; the bucket goes to
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
    """One optimizer's open bucket of eager gradients. Holds its runtime weakly (the hooks hold the bucket,
    the parameters hold the hooks: a deleted optimizer must still be freed)."""

    def __init__(self, runtime: "ZenFlowRuntime", bucket_numel: int):
        self._runtime = weakref.ref(runtime)
        self.bucket_numel = bucket_numel
        self.pids: list[int] = []
        self.grads: list[torch.Tensor] = []
        self.numel = 0
        self._flush_queued = False

    def hook(self, param: torch.Tensor, pid: int) -> None:
        """The post-accumulate-grad hook of parameter `pid`."""
        grad = param.grad
        if grad is None:
            return
        if grad.layout != torch.strided:
            raise ValueError(
                f"ZenFlowAdamW: a parameter of shape {tuple(param.shape)} got a {grad.layout} gradient "
                "(e.g. nn.Embedding(sparse=True)); ZenFlow needs dense gradients. Fix: use sparse=False "
                "for that module")
        param.grad = None
        runtime = self._runtime()
        if runtime is None:
            return
        if runtime.reducer is not None:
            runtime.accumulate_grad(pid, grad, None)
            return
        self.pids.append(pid)
        self.grads.append(grad)
        self.numel += grad.numel()
        if self.numel >= self.bucket_numel:
            self.flush()
        elif not self._flush_queued:
            self._queue_flush()

    def _queue_flush(self) -> None:
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        except RuntimeError:  # not inside a backward (a hook called directly): step() flushes
            return
        self._flush_queued = True

    def _end_of_backward(self) -> None:
        self._flush_queued = False
        self.flush()

    def flush(self) -> None:
        """Hand the open bucket to the runtime."""
        if not self.pids:
            return
        pids, grads = self.pids, self.grads
        self.pids, self.grads, self.numel = [], [], 0
        runtime = self._runtime()
        if runtime is not None:
            runtime.accumulate_grads(pids, grads)

    def finish(self) -> None:
        """Between backwards (step()): hand over what a backward left (one that raised runs no callback)."""
        self._flush_queued = False
        self.flush()

    def drop(self) -> None:
        """Between backwards (zero_grad()): forget the open bucket."""
        self._flush_queued = False
        self.pids, self.grads, self.numel = [], [], 0
