"""Tensors that are consecutive rows of one stacked tensor can be processed as that one tensor.

The runtime keeps like parameters' state in stacks (`runtime/stacked_state.py`) and hands the kernels the
per-parameter rows; a torch twin that sees a run of such rows can make one call over the run instead of one
per row (`ReferencePlan`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def rows_of_one_tensor(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensor whose rows are `tensors`, in order (`stack[i:i + len(tensors)]` of a contiguous stack),
    or None if they are not."""
    first = tensors[0]
    base = first._base
    if base is None or not base.is_contiguous() or not first.is_contiguous():
        return None
    size, offset, shape = first.numel(), first.storage_offset() - base.storage_offset(), first.shape
    if size == 0 or offset % size or base.numel() % size:
        return None
    for j, t in enumerate(tensors):
        if (t._base is not base or t.shape != shape or not t.is_contiguous()
                or t.storage_offset() - base.storage_offset() != offset + j * size):
            return None
    start = offset // size
    return base.view(-1, *shape)[start:start + len(tensors)]


def runs_of_rows(tensor_lists: Sequence[Sequence[torch.Tensor]], can_join) -> list[tuple[int, int]]:
    """Split positions 0..n into maximal runs [start, end) over which every list in `tensor_lists` is
    consecutive rows of one tensor and `can_join(i)` holds for every position after the run's first (e.g.
    equal update counts). Linear: each position is compared with its predecessor only."""
    n = len(tensor_lists[0])
    runs, start = [], 0
    for i in range(1, n + 1):
        if i == n or not (can_join(i) and all(_next_row(tensors[i - 1], tensors[i]) for tensors in tensor_lists)):
            runs.append((start, i))
            start = i
    return runs


def _next_row(previous: torch.Tensor, row: torch.Tensor) -> bool:
    """Whether `row` is the row right after `previous` in one contiguous stack."""
    base = previous._base
    return (base is not None and row._base is base and base.is_contiguous() and row.shape == previous.shape
            and previous.is_contiguous() and row.is_contiguous()
            and row.storage_offset() == previous.storage_offset() + previous.numel() and previous.numel() > 0)
