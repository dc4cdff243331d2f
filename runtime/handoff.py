"""The hand-off of one bucket of gradients to their states, batched: a fixed number of torch calls per group
of like parameters instead of a few per parameter.

A bucket (the compiled graph's `zenflow::accumulate_grads`, or the eager `.grad`s that `ZenFlowAdamW.step()`
hands over) holds the gradients of one backward (eagerly: of the step) for many parameters. Per parameter, `MatrixState.receive_grad` / `VectorState.receive_grad`
make ~4 small torch calls plus a Python call chain; on a model of many small tensors (LoRA adapters,
biases, norms) that host time, not the kernels, is the step's cost. `HandoffPlan` groups the bucket's
states once per layout (`stacked_state.like_groups`):

- matrices of one shape, dtype and selection size (k selected, u host columns): the gradients are stacked
  ([n, R, C]) and the group takes one score reduction, one gather of the selected columns and one gather +
  copy down of the host columns for all n;
- vectors of one size and dtype: one stacked copy and one score reduction;
- everything else (large tensors, where stacking would cost a full extra pass over the gradient; a
  parameter's later backwards in one step; a gradient whose dtype or shape differs from the state's): each
  state's own `receive_grad`.
Where the group's states already share stacked storage (`runtime/stacked_state.py`: from the first step
on), the results are written straight into the stacks; otherwise through one batched copy per tensor kind.

The result is the same as each state's `receive_grad` (same buffers written, same bookkeeping, bitwise:
`tests/test_batched_handoff.py`).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch

from zenflow_compile.runtime.stacked_state import like_groups
from zenflow_compile.triton_kernels.rows import Rows, rows_of_one_tensor


_NUM_GRADS = operator.attrgetter("num_grads")


def _in_row_order(states: list, positions: list[int], tensor_of) -> list[int]:
    """The group's positions ordered by the storage offset of each state's tensor (stack rows in bucket
    order: gradients arrive in reverse registration order, stacks are in registration order)."""
    return sorted(positions, key=lambda p: tensor_of(states[p]).storage_offset())


class _Group:
    """Like states of one bucket, in stack-row order; `positions`: where their gradients are in the bucket."""

    def __init__(self, states: list, positions: list[int], tensor_of):
        self.positions = _in_row_order(states, positions, tensor_of)
        self.states = [states[p] for p in self.positions]
        self._of_group = operator.itemgetter(*self.positions)  # (a group has two or more: always a tuple)

    def _stacked_grads(self, grads: list, dtype: torch.dtype, row_numel: int) -> Optional[torch.Tensor]:
        """The group's gradients stacked [n, ...], or None when the group must go one by one: a state's
        later backward of the step, or gradients of another dtype or shape."""
        if any(map(_NUM_GRADS, self.states)):
            return None
        try:
            g = torch.stack(self._of_group(grads))
        except RuntimeError:  # shapes differ
            return None
        return g if g.dtype == dtype and g.numel() == row_numel * len(self.positions) else None

    def _received(self) -> None:
        for state in self.states:
            state.num_grads = 1


class _MatrixGroup(_Group):
    """Matrices of one [R, C], dtype and selection size: one stacked gather per side."""

    def __init__(self, states: list, positions: list[int]):
        super().__init__(states, positions, lambda s: s.scores)
        states = self.states
        first = states[0]
        self.rows, self.cols, self.dtype = first.rows, first.cols, first.dev_grad.dtype
        self.shape = first.param.shape
        self.has_selected, self.has_host = first.has_selected, first.has_host
        self.scores = Rows([s.scores for s in states])
        # Advanced-indexing gathers over the stacked, transposed gradients [n, C, R]: row i of the result
        # takes matrix i's columns (index memory: n x columns, not n x columns x R).
        self.matrix_index = torch.arange(len(states), device=first.device).unsqueeze(1)
        if self.has_selected:
            self.selected_columns = Rows([s.selected_on_device for s in states])
            self.dev_grads = Rows([s.dev_grad for s in states])
        if self.has_host:
            self.host_columns = Rows([s.host_columns_on_device for s in states])
            # (under data parallelism only the owner of a matrix holds its host part)
            self.owners = [i for i, s in enumerate(states) if s.owns_host]
            self.all_own = len(self.owners) == len(states)
            self.host_grads = [[states[i].host_grads[slot] for i in self.owners] for slot in (0, 1)]
            # (one pinned stack per slot once the states are stacked: one copy down for the group)
            self.host_stacks = [rows_of_one_tensor(grads) if self.all_own else None for grads in self.host_grads]
            self.host_bytes = sum(states[i].host_grad_bytes for i in self.owners)
        self.transfers = first.transfers

    def receive(self, grads: list, scores: Optional[list], grad_slot: int) -> Optional[int]:
        """None (nothing written) when the group must go one by one (see `_stacked_grads`)."""
        g = self._stacked_grads(grads, self.dtype, self.rows * self.cols)
        if g is None or g.shape[1:] != self.shape:
            return None
        g = g.reshape(-1, self.rows, self.cols)  # (a copy only where the gradients are not contiguous:
        # a compiled conv backward gives channels-last weight gradients, and stack keeps their layout)
        if scores is not None and scores[self.positions[0]] is not None:
            self.scores.write(torch.stack(self._of_group(scores)))
        else:
            self.scores.write((g if g.dtype == torch.float32 else g.float()).square().sum(1))
        columns = g.transpose(1, 2)  # [n, C, R]
        if self.has_selected:
            self.dev_grads.write(columns[self.matrix_index, self.selected_columns.read()].transpose(1, 2))
        sent = 0
        if self.has_host and self.owners:
            rest = columns[self.matrix_index, self.host_columns.read()]  # [n, u, R]: the host layout
            stack = self.host_stacks[grad_slot]
            if stack is not None:
                done = self.transfers.to_host(rest, stack)
            else:
                sources = rest.unbind(0) if self.all_own else [rest[i] for i in self.owners]
                done = self.transfers.to_host_many(sources, self.host_grads[grad_slot])
            done = [done]  # (one list for the group: no state appends to it in place)
            for i in self.owners:
                state = self.states[i]
                state.offload_done[grad_slot] = done
                if state.extra_grads[grad_slot]:  # (a discarded step's extras)
                    state.extra_grads[grad_slot] = []
            sent = self.host_bytes
        self._received()
        return sent


class _VectorGroup(_Group):
    """Vectors of one size and dtype: one stacked copy, one score reduction."""

    def __init__(self, states: list, positions: list[int]):
        super().__init__(states, positions, lambda s: s.grad)
        states = self.states
        first = states[0]
        self.numel, self.dtype = first.grad_flat.numel(), first.grad_flat.dtype
        self.grads = Rows([s.grad_flat for s in states])
        self.scores = Rows([s.score for s in states])

    def receive(self, grads: list, scores: Optional[list], grad_slot: int) -> Optional[int]:
        g = self._stacked_grads(grads, self.dtype, self.numel)
        if g is None:
            return None
        g = g.reshape(-1, self.numel)  # [n, N]
        self.grads.write(g)
        if scores is not None and scores[self.positions[0]] is not None:
            self.scores.write(torch.stack(self._of_group(scores)).view(-1, 1))  # ([1] or [] each)
        else:
            self.scores.write((g if g.dtype == torch.float32 else g.float()).square().sum(1, keepdim=True))
        self._received()
        return 0


class HandoffPlan:
    """How one bucket's states take their gradients: built once per layout and bucket composition."""

    def __init__(self, states: list):
        self.states = states
        self.groups = [(_MatrixGroup if states[positions[0]].is_matrix else _VectorGroup)(states, positions)
                       for positions in like_groups(states)]
        grouped = {p for group in self.groups for p in group.positions}
        self.singles = [p for p in range(len(states)) if p not in grouped]

    def receive(self, grads: list, scores: Optional[list], grad_slot: int) -> int:
        """Give each state its gradient (`scores[i]`: its column scores, or None to compute them); returns
        the bytes sent device -> host."""
        sent = 0
        for group in self.groups:
            group_sent = group.receive(grads, scores, grad_slot)
            sent += group_sent if group_sent is not None else self._one_by_one(group.positions, grads, scores,
                                                                             grad_slot)
        return sent + self._one_by_one(self.singles, grads, scores, grad_slot)

    def _one_by_one(self, positions, grads, scores, grad_slot) -> int:
        sent = 0
        for p in positions:
            sent += self.states[p].receive_grad(grads[p], None if scores is None else scores[p], grad_slot)
        return sent


__all__ = ["HandoffPlan"]
