"""Tensors that are consecutive rows of one stacked tensor can be processed as that one tensor.

The runtime keeps like parameters' state in stacks (`runtime/stacked_state.py`) and hands the kernels the
per-parameter rows; a torch twin that sees a run of such rows can make one call over the run instead of one
per row (`ReferencePlan`).
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

import torch


_BASE = operator.attrgetter("_base")
_SHAPE = operator.attrgetter("shape")


def rows_of_one_tensor(tensors: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensor whose rows are `tensors`, in order (`stack[i:i + len(tensors)]` of a contiguous stack),
    or None if they are not."""
    first = tensors[0]
    base = first._base
    if base is None or not base.is_contiguous():
        return None
    size, shape, n = first.numel(), first.shape, len(tensors)
    offset = first.storage_offset() - base.storage_offset()
    if size == 0 or offset % size or base.numel() % size:
        return None
    # (builtins over the whole list: this runs over hundreds of rows whenever a layout changes)
    if (not all(b is base for b in map(_BASE, tensors))
            or list(map(torch.Tensor.storage_offset, tensors))
            != list(range(first.storage_offset(), first.storage_offset() + n * size, size))
            or list(map(_SHAPE, tensors)).count(shape) != n or not all(map(torch.Tensor.is_contiguous, tensors))):
        return None
    start = offset // size
    return base.view(-1, *shape)[start:start + n]


class Rows:
    """Tensors of one shape handled as one [n, ...] tensor: the view of their stack when they are its
    consecutive rows (`rows_of_one_tensor`), else through batched calls over the list. Either way it reads
    and writes the tensors themselves, so it stays right when they are rewritten in place (a plan holding a
    `Rows` never holds a stale copy of them)."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = list(tensors)
        self.stacked = rows_of_one_tensor(self.tensors)

    def read(self) -> torch.Tensor:
        return self.stacked if self.stacked is not None else torch.stack(self.tensors)

    def write(self, values: torch.Tensor) -> None:
        """values [n, ...] into the tensors (row i of `values` has tensor i's shape, or its element count when
        the rows are one stack)."""
        if self.stacked is not None:
            self.stacked.view(values.shape).copy_(values)
        else:
            torch._foreach_copy_(self.tensors, values.unbind(0))


def runs_of_rows(tensor_lists: Sequence[Sequence[torch.Tensor]], can_join) -> list[tuple[int, int]]:
    """Split positions 0..n into maximal runs [start, end) over which every list in `tensor_lists` is
    consecutive rows of one tensor and `can_join(i)` holds for every position after the run's first (e.g.
    equal update counts). A stretch of the first list sharing one base is checked whole first (the common
    case: one run), else position by position."""
    lead, n = tensor_lists[0], len(tensor_lists[0])
    runs, start = [], 0
    while start < n:
        base, end = lead[start]._base, start + 1
        while end < n and base is not None and lead[end]._base is base:
            end += 1
        if end - start > 1 and all(can_join(i) for i in range(start + 1, end)) and all(
                rows_of_one_tensor(tensors[start:end]) is not None for tensors in tensor_lists):
            runs.append((start, end))
        else:
            runs += _runs_one_by_one(tensor_lists, can_join, start, end)
        start = end
    return runs


def _runs_one_by_one(tensor_lists, can_join, start: int, end: int) -> list[tuple[int, int]]:
    origin = start
    follows = [_follows_previous(tensors[origin:end]) for tensors in tensor_lists]
    runs = []
    for i in range(start + 1, end + 1):
        if i == end or not (can_join(i) and all(f[i - origin] for f in follows)):
            runs.append((start, i))
            start = i
    return runs


def _follows_previous(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """For each position, whether its tensor is the row right after the previous one in one contiguous
    stack (position 0: False). Builtins over the whole list, then one pass over plain values."""
    bases = list(map(_BASE, tensors))
    offsets = list(map(torch.Tensor.storage_offset, tensors))
    sizes = list(map(torch.Tensor.numel, tensors))
    shapes = list(map(_SHAPE, tensors))
    contiguous = list(map(torch.Tensor.is_contiguous, tensors))
    result = [False]
    for i in range(1, len(tensors)):
        base = bases[i]
        result.append(base is not None and base is bases[i - 1] and shapes[i] == shapes[i - 1]
                      and contiguous[i] and contiguous[i - 1] and sizes[i - 1] > 0
                      and offsets[i] == offsets[i - 1] + sizes[i - 1] and base.is_contiguous())
    return result
