"""Like states share stacked storage, so per-step work over them is a few calls, not a few per state.

On a model of many small tensors (LoRA adapters, biases, norms, a deep stack of equal layers) the work per
step is launch- and dispatch-bound: the hand-off writes each state's gradient, scores and offloaded rows,
the device AdamW reads and writes each state's master, moments and counts. When like states (matrices of
one shape, dtype and selection size; vectors of one size and dtype; small: `STACK_MAX_NUMEL`) keep those
tensors as consecutive rows of one stacked tensor, the hand-off writes the whole group in one call per
tensor kind (`runtime/handoff.py`), the torch twin of the device AdamW updates a run as one tensor
(`triton_kernels/rows.py`), and the CPU-updated columns of a group go into their parameters in one scatter
(`StackedMerge`).

`stack_like_states` moves the tensors of each group into stacks (values kept) and rebinds the states'
attributes to the rows: the states stay the owners and everything else keeps reading `state.dev_master`
etc. The runtime runs it after its layout clock moved (new states, a selection, a checkpoint load: whatever
made a state allocate new tensors), at the first hand-off or step after that. Besides device tensors it
restacks the offloaded gradients' pinned buffers, which only the training thread writes; an accumulate task
still reading the old buffers keeps its own references, and the copies in flight into them are waited for
first.
"""

from __future__ import annotations

import contextlib

import torch

from zenflow_compile.runtime.transfers import wait_events
from zenflow_compile.triton_kernels.rows import Rows, rows_of_one_tensor

# Largest parameter (elements) whose state is stacked with its group: stacking its gradient in the hand-off
# copies it once more, which pays while a tensor costs more in per-call host time than in bandwidth (CPU:
# ~5 us of host time per call vs ~10 GB/s; CUDA: the same host time vs TB/s).
STACK_MAX_NUMEL = {"cpu": 1 << 14, "cuda": 1 << 20}


def stackable(state) -> bool:
    return state.param.numel() <= STACK_MAX_NUMEL.get(state.param.device.type, 0)


def group_key(state):
    """States with equal keys can share stacks (None: never stacked)."""
    if not stackable(state):
        return None
    if state.is_matrix:
        return ("matrix", tuple(state.param.shape), state.dev_grad.dtype, state.num_selected, state.num_host,
                state.param.device)
    return ("vector", state.grad.numel(), state.grad.dtype, state.param.device)


MATRIX_TENSORS = ("scores", "dev_grad", "dev_master", "dev_exp_avg", "dev_exp_avg_sq", "dev_step",
                  "selected_on_device", "host_columns_on_device")  # (the index rows too: see MatrixState.select)
VECTOR_TENSORS = ("grad", "master", "exp_avg", "exp_avg_sq", "step", "score")


def like_groups(states: list) -> list[list[int]]:
    """Positions of the states that can share stacks (two or more of one key), in the order given."""
    groups: dict[tuple, list[int]] = {}
    for position, state in enumerate(states):
        key = group_key(state)
        if key is not None:
            groups.setdefault(key, []).append(position)
    return [positions for positions in groups.values() if len(positions) > 1]


def stack_like_states(states: list, waiting=contextlib.nullcontext) -> bool:
    """Give every group of like states one stack per tensor (rows in group order, values copied); returns
    whether any state's tensors were replaced (then their layout clock has moved on: every plan built on
    the old tensors is rebuilt). `waiting()`: the context a host wait for copies in flight runs in (the
    runtime counts it)."""
    moved = set()
    for positions in like_groups(states):
        group = [states[p] for p in positions]
        names = MATRIX_TENSORS if group[0].is_matrix else VECTOR_TENSORS
        for name in names:
            tensors = [getattr(state, name) for state in group]
            if rows_of_one_tensor(tensors) is not None:
                continue
            for state, row in zip(group, torch.stack(tensors).unbind(0)):
                setattr(state, name, row)
            moved.add(group[0].clock)
        if group[0].is_matrix and _stack_host_grads(group, waiting):
            moved.add(group[0].clock)
        for state in group:  # views derived from the replaced tensors
            if state.is_matrix:
                if state.dev_step_head is not None:
                    state.dev_step_head = state.dev_step[:1]
            else:
                state.grad_flat = state.grad.view(-1)
    for clock in moved:
        clock.bump()
    return bool(moved)


def _stack_host_grads(group: list, waiting) -> bool:
    """The offloaded gradients' pinned buffers (`host_grads[slot]`, [u, R] each) as rows of one pinned stack
    per slot, so the hand-off sends a group down in one copy. Only the training thread writes them (the
    hand-off) and their old values are read at most by the accumulate task already running, which keeps its
    own references; the copies still in flight into the old buffers are waited for first."""
    if not all(m.owns_host and m.num_host for m in group):
        return False
    moved = False
    for slot in (0, 1):
        buffers = [m.host_grads[slot] for m in group]
        if rows_of_one_tensor(buffers) is not None:
            continue
        in_flight = [event for m in group for event in m.offload_done[slot] if event is not None]
        if in_flight:
            with waiting():
                wait_events(in_flight)
        first, transfers = buffers[0], group[0].transfers
        transfers.host_access(reads=buffers)
        stack = transfers.host_zeros((len(group), *first.shape), first.dtype)
        torch.stack(buffers, out=stack)
        for m, row in zip(group, stack.unbind(0)):
            m.host_grads[slot] = row
        moved = True
    return moved


class StackedMerge:
    """At a boundary, on CPU: write the CPU-updated columns of like matrices into their parameters in a
    fixed number of calls (the parameters gathered into a reused [n, R, C] buffer, the host columns
    scattered in with one index_put_, the buffer copied back in one batched copy), instead of one
    `MatrixState.apply_host_columns` (an upload and a merge) each."""

    def __init__(self, matrices: list):
        self.matrices = matrices
        first = matrices[0]
        self.params = [m.as_columns() for m in matrices]  # [R, C] views of the parameters
        self.buffer = torch.empty((len(matrices), first.rows, first.cols), dtype=first.param.dtype)
        self.buffer_rows = list(self.buffer.unbind(0))
        self.columns = Rows([m.host_columns_on_device for m in matrices])  # [n, u] (CPU)
        self.which = torch.arange(len(matrices)).unsqueeze(1)
        self.bytes = sum(m.host_weights[0].numel() * m.host_weights[0].element_size() for m in matrices)

    @staticmethod
    def applies_to(m) -> bool:
        """Matrices this merge can take: host-resident columns where the device is the host, this rank's own."""
        return m.transfers.device_is_host and m.owns_host and m.num_host > 0 and stackable(m)

    def apply(self) -> int:
        """Returns the bytes "uploaded" (the host weights read, as `apply_host_columns` counts them)."""
        values = torch.stack([m.host_weights[m.weights_slot] for m in self.matrices])  # [n, u, R]
        torch.stack(self.params, out=self.buffer)
        self.buffer.transpose(1, 2).index_put_((self.which, self.columns.read()), values)
        torch._foreach_copy_(self.params, self.buffer_rows)
        for m in self.matrices:
            m.unapplied = False
        return self.bytes


def stacked_merges(matrices: list) -> tuple[list[StackedMerge], list]:
    """(merges for the groups of like matrices `StackedMerge` can take, the other matrices)."""
    takers = [m for m in matrices if StackedMerge.applies_to(m)]
    merges, grouped = [], set()
    for positions in like_groups(takers):
        merges.append(StackedMerge([takers[p] for p in positions]))
        grouped.update(id(takers[p]) for p in positions)
    return merges, [m for m in matrices if id(m) not in grouped]


__all__ = ["like_groups", "stack_like_states", "stacked_merges", "StackedMerge", "stackable", "STACK_MAX_NUMEL"]
