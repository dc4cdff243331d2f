"""Integer ids for optimized parameters: the only thing the compiled graph knows about the runtime.

Custom ops in a compiled backward carry a parameter's id (an int), never a live tensor or object, so a
graph can be cached and replayed. Ids are handed out in registration order, so two identical programs get
the same ids (and hit the same cache entries); the passes put the ids they baked in into the cache key.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from zenflow_compile.runtime.engine import ZenFlowRuntime

_next_id = itertools.count()
_id_of_param: WeakIdKeyDictionary = WeakIdKeyDictionary()
_runtime_of_id: dict[int, "weakref.ReferenceType[ZenFlowRuntime]"] = {}


def register_param(param: torch.Tensor, runtime: "ZenFlowRuntime") -> int:
    """Give `param` an id owned by `runtime`. A parameter can be owned by one optimizer only."""
    if param in _id_of_param:
        other = runtime_of(_id_of_param[param])
        if other is not None and other is not runtime:
            raise ValueError(
                "a parameter of shape {} is already owned by another ZenFlowAdamW; each parameter must "
                "belong to exactly one ZenFlow optimizer".format(tuple(param.shape)))
    pid = next(_next_id)
    _id_of_param[param] = pid
    _runtime_of_id[pid] = weakref.ref(runtime)
    return pid


def unregister_param(pid: int) -> None:
    _runtime_of_id.pop(pid, None)


def param_id(param: torch.Tensor) -> Optional[int]:
    """The id of `param`, or None if no live ZenFlow optimizer owns it."""
    pid = _id_of_param.get(param)
    if pid is None or runtime_of(pid) is None:
        return None
    return pid


def runtime_of(pid: int) -> Optional["ZenFlowRuntime"]:
    ref = _runtime_of_id.get(pid)
    return None if ref is None else ref()


def accumulate_grad(pid: int, grad: torch.Tensor, column_scores: Optional[torch.Tensor] = None) -> None:
    """Hand one backward pass's gradient of parameter `pid` to its runtime.

    `column_scores` is the per-column squared L2 norm of `grad` viewed as [rows, columns] (fp32, one value
    for a vector parameter), when the caller already computed it (the compiled graph does, fused into the
    backward); None makes the runtime compute it.
    """
    runtime = runtime_of(pid)
    if runtime is None:
        raise RuntimeError(
            f"ZenFlow parameter id {pid} has no live optimizer: the ZenFlowAdamW that owned it was deleted. "
            "Recompile the model (torch._dynamo.reset()) after creating a new optimizer.")
    runtime.accumulate_grad(pid, grad, column_scores)
