"""Parameter ownership: which ZenFlow runtime owns a tensor, and which parameters a compiled graph ran with.

Every optimized parameter gets an integer id owned by one runtime (weakly: a deleted optimizer frees its ids).

A compiled backward graph knows no ids: its hand-off op carries the parameter's *slot* (forward-input index),
because one compiled graph serves every model it is called with (Dynamo reuses a graph for another instance
of the same module class). Each call of the compiled forward resolves its slots to ids from the tensors it
was actually called with (`bind_param_ids`) and attaches them to the autograd node that call created; the
backward of that call finds them on the node it is running in (`accumulate_grads_from_graph`). So gradients
reach the owner of the tensors the graph ran with, for any number of models and optimizers in a process.
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
# Bumped by every (un)registration, so callers can cache "which ids do these tensors have" cheaply.
_generation = 0


def generation() -> int:
    """A number that changes whenever a parameter gains or loses an owner."""
    return _generation


def register_param(param: torch.Tensor, runtime: "ZenFlowRuntime") -> int:
    """Give `param` an id owned by `runtime`. A parameter can be owned by one optimizer only."""
    if param in _id_of_param:
        other = runtime_of(_id_of_param[param])
        if other is not None and other is not runtime:
            raise ValueError(
                "a parameter of shape {} is already owned by another ZenFlowAdamW; each parameter must "
                "belong to exactly one ZenFlow optimizer".format(tuple(param.shape)))
    global _generation
    pid = next(_next_id)
    _id_of_param[param] = pid
    _runtime_of_id[pid] = weakref.ref(runtime, _on_runtime_deleted)
    _generation += 1
    return pid


def unregister_param(pid: int) -> None:
    global _generation
    _runtime_of_id.pop(pid, None)
    _generation += 1


def _on_runtime_deleted(_ref) -> None:
    global _generation
    _generation += 1


def param_id(param: torch.Tensor) -> Optional[int]:
    """The id of `param`, or None if no live ZenFlow optimizer owns it."""
    pid = _id_of_param.get(param)
    if pid is None or runtime_of(pid) is None:
        return None
    return pid


def runtime_of(pid: int) -> Optional["ZenFlowRuntime"]:
    ref = _runtime_of_id.get(pid)
    return None if ref is None else ref()


_GRAPH_IDS_KEY = "zenflow_param_ids"
_COMPILED_NODE_NAME = "CompiledFunctionBackward"  # AOTAutograd's autograd.Function for a compiled graph


def bind_param_ids(outputs, param_ids: tuple[Optional[int], ...]) -> None:
    """Attach the parameter ids of one call of a compiled graph (one per forward input, None for
    non-parameters) to the autograd node that the call created."""
    node = _compiled_node(outputs)
    if node is not None:
        node.metadata[_GRAPH_IDS_KEY] = param_ids


def _compiled_node(outputs):
    """The AOTAutograd node behind a compiled call's outputs (outputs that alias an input or another output
    are regenerated outside it, so look a few nodes up)."""
    stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    seen = set()
    for _ in range(64):
        if not stack:
            return None
        node = stack.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == _COMPILED_NODE_NAME:
            return node
        stack.extend(next_node for next_node, _ in node.next_functions)
    return None


def _tensors(outputs):
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [t for t in outputs if isinstance(t, torch.Tensor)]
    return []


# A bucket's slots -> how they were last resolved: (the call's bound ids, registry generation, pids, positions
# per owner). A training loop runs each compiled graph with the same bound ids (`GraphOwnerBinding` reuses
# the tuple) step after step, so resolving a bucket is one lookup; no runtime is referenced from here.
_resolved_buckets: dict[tuple[int, ...], tuple] = {}


def _resolve_bucket(slots: list[int], op: str) -> tuple[list[int], list[list[int]]]:
    """The ids of the parameters in `slots` of the compiled call being differentiated, and their positions
    grouped by owning runtime (in order of first appearance; positions ascending)."""
    node = torch._C._current_autograd_node()
    param_ids = None if node is None else node.metadata.get(_GRAPH_IDS_KEY)
    if param_ids is None:
        raise RuntimeError(
            f"zenflow::{op} ran outside the backward of a graph compiled with backend='zenflow' "
            "(or under compiled autograd, which ZenFlow does not support): no parameters are bound to it")
    key = tuple(slots)
    hit = _resolved_buckets.get(key)
    if hit is not None and hit[0] is param_ids and hit[1] == _generation:
        return hit[2], hit[3]
    pids = [param_ids[slot] for slot in slots]
    if None in pids:
        slot = slots[pids.index(None)]
        raise RuntimeError(f"ZenFlow: forward input {slot} of this graph got a gradient but no ZenFlowAdamW "
                           "owned it when the graph ran")
    groups: dict[int, list[int]] = {}
    for i, pid in enumerate(pids):
        groups.setdefault(id(_live_runtime(pid)), []).append(i)
    _resolved_buckets[key] = (param_ids, _generation, pids, list(groups.values()))
    return pids, list(groups.values())


def accumulate_grads_from_graph(slots: list[int], grads: list[torch.Tensor],
                                column_scores: list[torch.Tensor]) -> None:
    """The compiled backward's hand-off of one bucket: resolve each slot through the call that is being
    differentiated; each owner gets its gradients (in bucket order) in one `accumulate_grads` call."""
    pids, groups = _resolve_bucket(slots, "accumulate_grads")
    if len(groups) == 1:  # the common case: one optimizer owns the whole bucket
        _live_runtime(pids[0]).accumulate_grads(pids, grads, column_scores)
        return
    for positions in groups:
        _live_runtime(pids[positions[0]]).accumulate_grads(
            [pids[i] for i in positions], [grads[i] for i in positions], [column_scores[i] for i in positions])


def reduce_grads_from_graph(slots: list[int], grads: list[torch.Tensor]) -> None:
    """The compiled backward's data-parallel hand-off of one bucket: each owner gets its gradients in order."""
    pids, groups = _resolve_bucket(slots, "reduce_grads")
    for positions in groups:
        _live_runtime(pids[positions[0]]).reduce_grads([pids[i] for i in positions], [grads[i] for i in positions])


def _live_runtime(pid: int) -> "ZenFlowRuntime":
    runtime = runtime_of(pid)
    if runtime is None:
        raise RuntimeError(
            f"ZenFlow parameter id {pid} has no live optimizer: the ZenFlowAdamW that owned it was deleted "
            "while a backward that uses it was still pending. Run the backward before deleting the optimizer.")
    return runtime


def accumulate_grad(pid: int, grad: torch.Tensor, column_scores: Optional[torch.Tensor] = None) -> None:
    """Hand one backward pass's gradient of parameter `pid` to its runtime (the eager hooks' entry).

    `column_scores` is the per-column squared L2 norm of `grad` viewed as [rows, columns] (fp32, one value
    for a vector parameter), when the caller already computed it (the compiled graph does, fused into the
    backward, and hands whole buckets over through `accumulate_grads_from_graph`); None makes the runtime
    compute it.
    """
    _live_runtime(pid).accumulate_grad(pid, grad, column_scores)
