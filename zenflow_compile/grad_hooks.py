"""How eager gradients reach the runtime, and which gradient hooks are the user's.

Single process (`hand_over_grads`): `.grad` belongs to the user until `step()`, as with torch.optim. Tensor
hooks, `clip_grad_norm_`, edits and `zero_grad(set_to_none=False)` act on it, and `step()` hands the
`.grad` of every parameter in the param groups to `ZenFlowRuntime.take_grads` (`runtime/engine.py`) in one
batched call, leaving it in place for `zero_grad()` to clear. Gradient accumulation is autograd's
own sum into `.grad`.

Data parallel (`DataParallelHooks`): a post-accumulate-grad hook moves each gradient out of `.grad` into the
runtime's reducer as the backward produces it, so the reduction across ranks overlaps the rest of the
backward, and `.grad` is None after the backward (as under torch.compile, where the graph hands gradients
over itself). Tensor hooks (`register_hook`) run before it, so what they return is what gets reduced; a
`.grad` written after the backward is not, and `step()` refuses it (`check_no_late_grads`).
"""

from __future__ import annotations

import operator
import weakref
from typing import TYPE_CHECKING, Optional

import torch

from zenflow_compile.runtime.sharding import local_shard

if TYPE_CHECKING:
    from zenflow_compile.runtime.engine import ZenFlowRuntime

_GRAD = operator.attrgetter("grad")
_LAYOUT = operator.attrgetter("layout")
_BACKWARD_HOOKS = operator.attrgetter("_backward_hooks")
_POST_ACCUMULATE_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


def _dense_only(param: torch.Tensor, grad: torch.Tensor) -> None:
    if grad.layout != torch.strided:
        raise ValueError(
            f"ZenFlowAdamW: a parameter of shape {tuple(param.shape)} got a {grad.layout} gradient "
            "(e.g. nn.Embedding(sparse=True)); ZenFlow needs dense gradients. Fix: use sparse=False for that "
            "module")


def hand_over_grads(runtime: "ZenFlowRuntime", params: list[torch.Tensor], pids: list[int]) -> bool:
    """Hand the `.grad` of `params` (their runtime ids: `pids`) to the runtime in one call; `.grad` is left
    as it is. Returns whether any parameter had one."""
    grads = list(map(_GRAD, params))
    taken = [i for i, grad in enumerate(grads) if grad is not None]
    if not taken:
        return False
    if len(taken) < len(grads):
        params, pids, grads = [params[i] for i in taken], [pids[i] for i in taken], [grads[i] for i in taken]
    if runtime.sharding is not None:  # FSDP2: this rank's rows of the reduce-scattered gradient
        grads = list(map(local_shard, grads))
    if any(layout != torch.strided for layout in map(_LAYOUT, grads)):
        for param, grad in zip(params, grads):
            _dense_only(param, grad)
    runtime.take_grads(pids, grads)
    return True


class DataParallelHooks:
    """One data-parallel optimizer's post-accumulate-grad hooks: each gradient into the reducer during the
    backward. Holds its runtime weakly (the parameters hold the hooks: a deleted optimizer must still be
    freed)."""

    def __init__(self, runtime: "ZenFlowRuntime", param_ids: dict[int, int]):
        self._runtime = weakref.ref(runtime)
        self._param_ids = param_ids  # id(param) -> runtime id (the optimizer's own dict)
        self.taken: set[int] = set()  # id(param) of the gradients taken since the last step or zero_grad

    def hook(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:  # a parameter of a graph compiled with backend="zenflow": handed over by the graph
            return
        _dense_only(param, grad)
        param.grad = None
        self.taken.add(id(param))
        runtime = self._runtime()
        if runtime is not None:
            runtime.take_grads([self._param_ids[id(param)]], [grad])

    def check_no_late_grads(self, params: list[torch.Tensor], names) -> None:
        """Refuse a `.grad` found at `step()` on a parameter whose gradient the hooks already reduced: it was
        written after the backward, and would not be the reduced gradient the update uses."""
        for i, param in enumerate(params):
            if param.grad is not None and id(param) in self.taken:
                raise ValueError(
                    f"ZenFlowAdamW (data parallel): {names(i)} has a .grad at step(), written after the "
                    "backward had averaged its gradient across ranks and handed it to the optimizer, so the "
                    "update would not use it; with data parallelism .grad is None after the backward. (A model "
                    "wrapped in DistributedDataParallel refills .grad this way.) Fix: do not wrap the model in "
                    "DDP, ZenFlowAdamW averages the gradients itself; change gradients with tensor hooks "
                    "(param.register_hook), which run before the reduction; clip with "
                    "ZenFlowAdamW(max_grad_norm=...) and read the step's norm from opt.stats()['grad_norm']")

    def step_done(self) -> None:
        self.taken.clear()


def is_zenflow_hook(hook) -> bool:
    return isinstance(getattr(hook, "__self__", None), DataParallelHooks)


def user_grad_hooks(tensor: torch.Tensor) -> Optional[str]:
    """Which gradient hooks other than ZenFlow's own `tensor` carries ("register_hook",
    "register_post_accumulate_grad_hook"), or None."""
    if tensor._backward_hooks:
        return "register_hook"
    post = tensor._post_accumulate_grad_hooks
    if post and not all(map(is_zenflow_hook, post.values())):
        return "register_post_accumulate_grad_hook"
    return None


def any_user_grad_hooks(tensors: list[torch.Tensor]) -> bool:
    """Whether any of `tensors` carries a gradient hook of the user's (per compiled call: the common case, no
    hooks at all, is two passes of builtins)."""
    if not any(map(_BACKWARD_HOOKS, tensors)) and not any(map(_POST_ACCUMULATE_HOOKS, tensors)):
        return False
    return any(user_grad_hooks(t) is not None for t in tensors)
