"""The hand-off of one bucket of gradients to their states, batched: a fixed number of torch calls per group
of like parameters instead of a few per parameter.

A bucket (the compiled graph's `zenflow::accumulate_grads`, or the eager hooks' bucket) holds the gradients
of one backward for many parameters. Per parameter, `MatrixState.receive_grad` / `VectorState.receive_grad`
make ~4 small torch calls plus a Python call chain; on a model of many small tensors (LoRA adapters,
biases, norms) that host time, not the kernels, is the step's cost. `HandoffPlan` groups the bucket's
states once per layout:

- matrices of one shape, dtype and selection size (k selected, u host columns) whose gradients are small:
  the gradients are stacked ([n, R, C]) and the group takes one score reduction, one gather of the selected
  columns and one gather + copy down of the host columns for all n;
- vectors of one size and dtype: one stacked score reduction and one batched copy;
- everything else (large tensors, where stacking would cost a full extra pass over the gradient; a
  parameter's later backwards in one step; a gradient whose dtype or shape differs from the state's): each
  state's own `receive_grad`.

The result is the same as each state's `receive_grad` (same buffers written, same bookkeeping); scores are
the same sums over the same values, in a stacked reduction.
"""

from __future__ import annotations

from typing import Optional

import torch

# Largest gradient (elements) that is stacked with its group: stacking copies it once more, which pays while
# a tensor costs more in per-call host time than in bandwidth (CPU: ~5 us of host time per call vs ~10 GB/s;
# CUDA: the same host time vs TB/s).
STACK_MAX_NUMEL = {"cpu": 1 << 14, "cuda": 1 << 20}


def _stackable(state) -> bool:
    return state.param.numel() <= STACK_MAX_NUMEL.get(state.param.device.type, 0)


class _MatrixGroup:
    """Matrices of one [R, C], dtype and selection size: one stacked gather per side."""

    def __init__(self, states: list, positions: list[int]):
        self.states, self.positions = states, positions
        first = states[0]
        self.rows, self.cols, self.dtype = first.rows, first.cols, first.dev_grad.dtype
        self.shape = tuple(first.param.shape)
        self.has_selected, self.has_host = first.has_selected, first.has_host
        self.scores = [s.scores for s in states]
        # Advanced-indexing gathers over the stacked, transposed gradients [n, C, R]: row i of the result
        # takes matrix i's columns (index memory: n x columns, not n x columns x R).
        self.matrix_index = torch.arange(len(states), device=first.device).unsqueeze(1)
        if self.has_selected:
            self.selected_columns = torch.stack([s.selected_on_device for s in states])
            self.dev_grads = [s.dev_grad for s in states]
        if self.has_host:
            self.host_columns = torch.stack([s.host_columns_on_device for s in states])
            # (under data parallelism only the owner of a matrix holds its host part)
            self.owners = [i for i, s in enumerate(states) if s.owns_host]
            self.all_own = len(self.owners) == len(states)
            self.host_grads = [[states[i].host_grads[slot] for i in self.owners] for slot in (0, 1)]
            self.host_bytes = sum(states[i].host_grad_bytes for i in self.owners)
        self.transfers = first.transfers

    def accepts(self, grads: list) -> bool:
        for state, position in zip(self.states, self.positions):
            grad = grads[position]
            if state.num_grads or grad.dtype != self.dtype or tuple(grad.shape) != self.shape:
                return False
        return True

    def receive(self, grads: list, scores: Optional[list], grad_slot: int) -> int:
        g = torch.stack([grads[p] for p in self.positions]).view(-1, self.rows, self.cols)
        if scores is not None and scores[self.positions[0]] is not None:
            torch._foreach_copy_(self.scores, [scores[p] for p in self.positions])
        else:
            stacked_scores = (g if g.dtype == torch.float32 else g.float()).square().sum(1)
            torch._foreach_copy_(self.scores, stacked_scores.unbind(0))
        columns = g.transpose(1, 2)  # [n, C, R]
        if self.has_selected:
            chosen = columns[self.matrix_index, self.selected_columns]  # [n, k, R]
            torch._foreach_copy_(self.dev_grads, chosen.transpose(1, 2).unbind(0))
        sent = 0
        if self.has_host and self.owners:
            rest = columns[self.matrix_index, self.host_columns]  # [n, u, R]: the host layout
            sources = rest.unbind(0) if self.all_own else [rest[i] for i in self.owners]
            done = self.transfers.to_host_many(sources, self.host_grads[grad_slot])
            for i in self.owners:
                state = self.states[i]
                state.offload_done[grad_slot] = [done]
                state.extra_grads[grad_slot] = []
            sent = self.host_bytes
        for state in self.states:
            state.num_grads = 1
        return sent


class _VectorGroup:
    """Vectors of one size and dtype: one stacked score reduction, one batched copy."""

    def __init__(self, states: list, positions: list[int]):
        self.states, self.positions = states, positions
        first = states[0]
        self.numel, self.dtype = first.grad_flat.numel(), first.grad_flat.dtype
        self.grads = [s.grad_flat for s in states]
        self.scores = [s.score for s in states]

    def accepts(self, grads: list) -> bool:
        for state, position in zip(self.states, self.positions):
            grad = grads[position]
            if state.num_grads or grad.dtype != self.dtype or grad.numel() != self.numel:
                return False
        return True

    def receive(self, grads: list, scores: Optional[list], grad_slot: int) -> int:
        mine = [grads[p].reshape(-1) for p in self.positions]
        torch._foreach_copy_(self.grads, mine)
        if scores is not None and scores[self.positions[0]] is not None:
            torch._foreach_copy_(self.scores, [scores[p].reshape(1) for p in self.positions])
        else:
            g = torch.stack(mine)
            stacked_scores = (g if g.dtype == torch.float32 else g.float()).square().sum(1, keepdim=True)
            torch._foreach_copy_(self.scores, stacked_scores.unbind(0))
        for state in self.states:
            state.num_grads = 1
        return 0


class HandoffPlan:
    """How one bucket's states take their gradients: built once per layout and bucket composition."""

    def __init__(self, states: list):
        self.states = states
        matrices: dict[tuple, list[int]] = {}
        vectors: dict[tuple, list[int]] = {}
        for position, state in enumerate(states):
            if not _stackable(state):
                continue
            if state.is_matrix:
                key = (tuple(state.param.shape), state.dev_grad.dtype, state.num_selected, state.num_host)
                matrices.setdefault(key, []).append(position)
            else:
                vectors.setdefault((state.grad_flat.numel(), state.grad_flat.dtype), []).append(position)
        self.groups = [_MatrixGroup([states[p] for p in positions], positions)
                       for positions in matrices.values() if len(positions) > 1]
        self.groups += [_VectorGroup([states[p] for p in positions], positions)
                        for positions in vectors.values() if len(positions) > 1]
        grouped = {p for group in self.groups for p in group.positions}
        self.singles = [p for p in range(len(states)) if p not in grouped]

    def receive(self, grads: list, scores: Optional[list], grad_slot: int) -> int:
        """Give each state its gradient (`scores[i]`: its column scores, or None to compute them); returns
        the bytes sent device -> host."""
        sent = 0
        for group in self.groups:
            if group.accepts(grads):
                sent += group.receive(grads, scores, grad_slot)
            else:
                sent += self._one_by_one(group.positions, grads, scores, grad_slot)
        return sent + self._one_by_one(self.singles, grads, scores, grad_slot)

    def _one_by_one(self, positions, grads, scores, grad_slot) -> int:
        sent = 0
        for p in positions:
            sent += self.states[p].receive_grad(grads[p], None if scores is None else scores[p], grad_slot)
        return sent


__all__ = ["HandoffPlan", "STACK_MAX_NUMEL"]
