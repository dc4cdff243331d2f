"""Parameter ownership: which ZenFlow runtime owns a tensor, and which parameters a compiled graph ran with
(ARCHITECTURE.md, "How gradients reach the runtime").

Every optimized parameter gets an integer id owned by one runtime (weakly: a deleted optimizer frees its ids).
Parameters are looked up by `id()` and held by the registry while their runtime lives (as the optimizer holds
them), never weakly: torch refuses to swap the contents of a tensor that has weak references
(`torch.utils.swap_tensors`, which `model.to()` / `model.float()` use for FSDP2's DTensor parameters).

A compiled backward graph knows no ids, only forward-input *slots*, because one compiled graph serves every
model of its class. Each call of the compiled forward resolves its slots to ids (`bind_param_ids`) on the
autograd node it created; the backward of that call finds them on the node it runs in
(`accumulate_grads_from_graph`), so gradients reach the owner of the tensors the graph ran with.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Optional

import torch

# The owner of a parameter id: a ZenFlowRuntime (runtime/engine.py, which imports this module).
Runtime = Any

_next_id = itertools.count()
_param_and_id: dict[int, tuple[torch.Tensor, int]] = {}  # id(param) -> (param, its pid)
_runtime_of_id: dict[int, "weakref.ReferenceType[Runtime]"] = {}
# Bumped by every (un)registration, so callers can cache "which ids do these tensors have" cheaply.
_generation = 0
# Held while the tables change. An optimizer's finalizer unregisters its parameters wherever the garbage
# collector runs it: on a worker thread (the lock keeps the tables whole), or on this thread in the middle
# of a change (re-entrant, so it cannot deadlock; `_forget_params` iterates over a copy, so it cannot break
# the change it interrupts).
_lock = threading.RLock()


def generation() -> int:
    """A number that changes whenever a parameter gains or loses an owner."""
    return _generation


def register_param(param: torch.Tensor, runtime: "Runtime") -> int:
    """Give `param` an id owned by `runtime`. A parameter can be owned by one optimizer only."""
    global _generation
    with _lock:
        entry = _param_and_id.get(id(param))
        if entry is not None:
            other = runtime_of(entry[1])
            if other is not None and other is not runtime:
                raise ValueError(
                    "a parameter of shape {} is already owned by another ZenFlowAdamW, which is still alive: "
                    "each parameter belongs to exactly one ZenFlow optimizer (it takes the parameter's "
                    "gradients and holds its state). Fix: drop the old optimizer before creating the new one "
                    "(`del opt`, e.g. before re-running a notebook cell that creates it), or give this "
                    "parameter to one of them only".format(tuple(param.shape)))
        pid = next(_next_id)
        _param_and_id[id(param)] = (param, pid)
        _runtime_of_id[pid] = weakref.ref(runtime, _on_runtime_deleted)
        _generation += 1
        return pid


def unregister_param(pid: int) -> None:
    with _lock:
        _runtime_of_id.pop(pid, None)
        _forget_params(lambda param_pid: param_pid == pid)


def _on_runtime_deleted(_ref) -> None:
    with _lock:
        _forget_params(lambda pid: runtime_of(pid) is None)


def _forget_params(gone) -> None:
    """Drop the entries whose id is `gone`. Safe against a finalizer doing the same in the middle of it."""
    global _generation
    for key, entry in _param_and_id.copy().items():
        if gone(entry[1]) and _param_and_id.get(key) is entry:
            del _param_and_id[key]
    _generation += 1


def param_id(param: torch.Tensor) -> Optional[int]:
    """The id of `param`, or None if no live ZenFlow optimizer owns it."""
    entry = _param_and_id.get(id(param))
    if entry is None or entry[0] is not param or runtime_of(entry[1]) is None:
        return None
    return entry[1]


def runtime_of(pid: int) -> Optional["Runtime"]:
    ref = _runtime_of_id.get(pid)
    return None if ref is None else ref()


_GRAPH_IDS_KEY = "zenflow_param_ids"
_GRAPH_EDGES_KEY = "zenflow_param_edges"
_COMPILED_NODE_NAME = "CompiledFunctionBackward"  # AOTAutograd's autograd.Function for a compiled graph


def bind_param_ids(outputs, param_ids: tuple[Optional[int], ...],
                   edges: Optional[tuple[Optional[int], ...]] = None, names: tuple = ()) -> None:
    """Attach the parameter ids of one call of a compiled graph (one per forward input, None for
    non-parameters) to the autograd node that the call created.

    `edges`: per forward input, the index of its edge in the node's `next_functions` (only tensor inputs
    have one: SymInts do not), which tells the hand-off whether this backward accumulates the parameter's
    gradient (`_not_accumulated`); None: always hand every gradient over. `names`: per forward input, a
    readable name for error messages.
    """
    node = _compiled_node(outputs)
    if node is not None:
        node.metadata[_GRAPH_IDS_KEY] = param_ids
        if edges is not None:
            node.metadata[_GRAPH_EDGES_KEY] = (edges, names)


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
    grouped by owning runtime (in order of first appearance; positions ascending), leaving out the
    gradients this backward does not accumulate (`_not_accumulated`)."""
    node = torch._C._current_autograd_node()
    param_ids = None if node is None else node.metadata.get(_GRAPH_IDS_KEY)
    if param_ids is None:
        raise RuntimeError(
            f"zenflow::{op} ran outside the backward of a graph compiled with backend='zenflow' "
            "(or under compiled autograd, which ZenFlow does not support): no parameters are bound to it")
    pids, groups = _resolve_slots(slots, param_ids)
    bound = node.metadata.get(_GRAPH_EDGES_KEY)
    skipped = _not_accumulated(node, slots, *bound) if bound is not None else None
    if skipped:
        groups = [kept for kept in ([i for i in positions if i not in skipped] for positions in groups) if kept]
    return pids, groups


def _not_accumulated(node, slots: list[int], edges: tuple, names: tuple) -> Optional[set[int]]:
    """Positions in the bucket whose gradient this backward does not accumulate into the parameter (None:
    it accumulates them all, the usual `loss.backward()`).

    The graph computes every parameter gradient whenever it runs, but the user may have asked for other
    gradients only: `torch.autograd.grad(loss, x)` or `loss.backward(inputs=[x])` (adversarial inputs,
    input-gradient penalties). Eagerly, the parameters' AccumulateGrad nodes then do not run, so neither
    `.grad` nor the optimizer's hooks see a gradient; the compiled hand-off must skip them the same way.
    Autograd tells, per parameter, whether its AccumulateGrad node (the next function on the parameter's
    edge, `edges[slot]`) runs in this backward.
    """
    next_functions = node.next_functions
    accumulators = [next_functions[edges[slot]][0] for slot in slots]
    try:
        if all(map(_will_run, accumulators)):  # (one C call per parameter: this runs every backward)
            return None
    except (RuntimeError, TypeError):
        pass  # a captured parameter (raised below with the fix) or one that did not require grad
    skipped = set()
    for i, (slot, accumulate) in enumerate(zip(slots, accumulators)):
        if accumulate is None:  # (the parameter did not require grad when the graph ran)
            skipped.add(i)
            continue
        try:
            runs = _will_run(accumulate)
        except RuntimeError as error:
            if "autograd.grad" not in str(error):
                raise
            # The parameter's gradient is captured for torch.autograd.grad, which this graph cannot return.
            name = names[slot] if slot < len(names) and names[slot] else f"forward input {slot}"
            raise RuntimeError(
                f"torch.autograd.grad(..., inputs=[..., {name}, ...]) through a graph compiled with "
                "backend='zenflow': the rewritten backward hands parameter gradients to ZenFlowAdamW instead "
                "of returning them, so it has none to give. Fix: use loss.backward() and let the optimizer "
                "take the gradients, or compile this model with backend='inductor' (ZenFlowAdamW then takes "
                "its gradients through hooks, and torch.autograd.grad works as usual)") from error
        if not runs:
            skipped.add(i)
    return skipped


_will_run = torch._C._will_engine_execute_node


def _resolve_slots(slots: list[int], param_ids: tuple) -> tuple[list[int], list[list[int]]]:
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
    differentiated; each owner gets its gradients (in bucket order) in one `take_grads` call."""
    pids, groups = _resolve_bucket(slots, "accumulate_grads")
    if len(groups) == 1 and len(groups[0]) == len(pids):  # the common case: one optimizer takes the whole bucket
        _live_runtime(pids[0]).take_grads(pids, grads, column_scores)
        return
    for positions in groups:
        _live_runtime(pids[positions[0]]).take_grads(
            [pids[i] for i in positions], [grads[i] for i in positions], [column_scores[i] for i in positions])


def reduce_grads_from_graph(slots: list[int], grads: list[torch.Tensor]) -> None:
    """The compiled backward's data-parallel hand-off of one bucket: each owner gets its gradients in order."""
    pids, groups = _resolve_bucket(slots, "reduce_grads")
    for positions in groups:
        _live_runtime(pids[positions[0]]).reduce_grads([pids[i] for i in positions], [grads[i] for i in positions])


def _live_runtime(pid: int) -> "Runtime":
    runtime = runtime_of(pid)
    if runtime is None:
        raise RuntimeError(
            f"ZenFlow parameter id {pid} has no live optimizer: the ZenFlowAdamW that owned it was deleted "
            "while a backward that uses it was still pending. Run the backward before deleting the optimizer.")
    return runtime

