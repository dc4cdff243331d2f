"""Parameter ownership: which ZenFlow runtime owns a tensor, and which parameters a compiled graph ran with
(ARCHITECTURE.md, "How gradients reach the runtime").

Every optimized parameter gets an integer id owned by one runtime (weakly: a deleted optimizer frees its ids).
Parameters are held by the registry while their runtime lives, never weakly: torch refuses to swap the contents
of a tensor that has weak references (`torch.utils.swap_tensors`, which `model.to()` uses for FSDP2's DTensors).

A compiled graph serves every model of its class, so it knows forward-input *slots*, not ids: each call of the
compiled forward binds its slots' ids to the autograd node it created (`bind_param_ids`), and that call's
backward reads them from the node it runs in (`accumulate_grads_from_graph`).
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
_generation = 0  # bumped by every (un)registration: callers cache "which ids do these tensors have" on it
# An optimizer's finalizer unregisters its parameters wherever the garbage collector runs it: on a worker thread
# (the lock keeps the tables whole), or on this thread in the middle of a change (re-entrant, so no deadlock;
# `_forget_params` iterates over a copy, so it cannot break the change it interrupts).
_lock = threading.RLock()


def generation() -> int:
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
    return None if entry is None or entry[0] is not param or runtime_of(entry[1]) is None else entry[1]


def runtime_of(pid: int) -> Optional["Runtime"]:
    ref = _runtime_of_id.get(pid)
    return None if ref is None else ref()


_GRAPH_IDS_KEY = "zenflow_param_ids"
_GRAPH_EDGES_KEY = "zenflow_param_edges"
_COMPILED_NODE_NAME = "CompiledFunctionBackward"  # AOTAutograd's autograd.Function for a compiled graph


def bind_param_ids(outputs, param_ids: tuple[Optional[int], ...],
                   edges: Optional[tuple[Optional[int], ...]] = None, names: tuple = ()) -> None:
    """Attach the parameter ids of one call of a compiled graph (per forward input, None for non-parameters) to
    the autograd node the call created. `edges`: per forward input, the index of its edge in the node's
    `next_functions` (SymInts have none), for `_not_accumulated`; None: hand every gradient over. `names`: per
    forward input, a readable name for error messages."""
    node = _compiled_node(outputs)
    if node is not None:
        node.metadata[_GRAPH_IDS_KEY] = param_ids
        if edges is not None:
            node.metadata[_GRAPH_EDGES_KEY] = (edges, names)


def _compiled_node(outputs):
    """The AOTAutograd node behind a compiled call's outputs (outputs that alias an input or another output
    are regenerated outside it, so look a few nodes up)."""
    outputs = [outputs] if isinstance(outputs, torch.Tensor) else outputs if isinstance(outputs, (list, tuple)) else []
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
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
            f"zenflow::{op} ran outside the backward of a graph compiled with backend='zenflow' (under compiled "
            "autograd, ZenFlow's graphs leave gradients in .grad and never call it): no parameters are bound to it")
    hit = _resolved_buckets.get(key := tuple(slots))
    if hit is None or hit[0] is not param_ids or hit[1] != _generation:
        pids = [param_ids[slot] for slot in slots]
        if None in pids:
            slot = slots[pids.index(None)]
            raise RuntimeError(f"ZenFlow: forward input {slot} of this graph got a gradient but no ZenFlowAdamW "
                               "owned it when the graph ran")
        owners: dict[int, list[int]] = {}
        for i, pid in enumerate(pids):
            owners.setdefault(id(_live_runtime(pid)), []).append(i)
        hit = _resolved_buckets[key] = (param_ids, _generation, pids, list(owners.values()))
    pids, groups = hit[2], hit[3]
    bound = node.metadata.get(_GRAPH_EDGES_KEY)
    skipped = _not_accumulated(node, slots, *bound) if bound is not None else None
    if skipped:
        groups = [kept for kept in ([i for i in positions if i not in skipped] for positions in groups) if kept]
    return pids, groups


def _not_accumulated(node, slots: list[int], edges: tuple, names: tuple) -> Optional[set[int]]:
    """Positions in the bucket whose gradient this backward does not accumulate into the parameter (None: all
    accumulate, the usual `loss.backward()`). The graph computes every parameter gradient, but with
    `torch.autograd.grad(loss, x)` or `loss.backward(inputs=[x])` the parameters' AccumulateGrad nodes do not
    run eagerly, so neither `.grad` nor the optimizer's hooks see a gradient; the hand-off skips them the same
    way. Autograd tells whether a parameter's AccumulateGrad (next function on its edge, `edges[slot]`) runs."""
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


def accumulate_grads_from_graph(slots: list[int], grads: list[torch.Tensor],
                                column_scores: list[torch.Tensor]) -> None:
    """The compiled backward's hand-off of one bucket: each owner gets its gradients (in order) in one call."""
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

