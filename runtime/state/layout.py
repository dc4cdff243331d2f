"""How a slab lays out its members' state: grouping keys, shapes, column orders, and the gathers between a
parameter's natural [R, C] layout and a slab's device columns ([n, R, k]) and host rows ([n, u, R])."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

# Largest parameter (elements) that shares a slab with others: stacking its gradient in the hand-off copies it
# once more, which pays while a tensor costs more in per-call host time than in bandwidth.
SHARED_SLAB_MAX_NUMEL = {"cpu": 1 << 14, "cuda": 1 << 20}


def top_k_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores (of each row), ties to the lower index, in ascending order, on the host."""
    order = torch.sort(scores.detach().cpu(), dim=-1, descending=True, stable=True).indices
    return order[..., :k].sort(dim=-1).values


def host_order(counts: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """[n, u]: each row's unselected columns ordered by update count (stable: ties by column; an unknown,
    NaN, count orders as 0), from counts [n, C] and the selected columns [n, k]."""
    keys = torch.nan_to_num(counts, nan=0.0).scatter(1, selected, math.inf)  # selected columns sort last
    return torch.sort(keys, dim=1, stable=True).indices[:, :counts.shape[1] - selected.shape[1]].contiguous()


def matrix_shape(param: torch.Tensor) -> tuple[int, int]:
    """[R, C] of a parameter as the state sees it: a matrix [shape[0], rest], a vector [N, 1]."""
    if param.dim() >= 2:
        return param.shape[0], math.prod(param.shape[1:])  # (a rank's shard may hold no rows)
    return param.numel(), 1


def columns_not_in(columns: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """[n, k] bool: whether columns[i, j] is not among others[i] (two members' selections compared row by row)."""
    return ~(columns.unsqueeze(2) == others.unsqueeze(1)).any(2)


class SlabKey(NamedTuple):
    group_index: int
    dtype: torch.dtype
    rows: int  # (sharded parameters: the global rows; the slab holds this rank's share of them)
    cols: int
    num_selected: int  # k (0 before a matrix's first selection; a vector's is its one column)
    owner: int  # the rank holding the members' host parts (data parallel; else 0)
    alone: Optional[int]  # the pid of a parameter too large to share its slab, else None
    phase: int  # its members' phase (stagger_boundaries; else 0): a slab reaches its boundaries as one


def columns_index(columns: torch.Tensor, rows: int) -> torch.Tensor:
    """[n, k] column indices as a gather index over [n, R, C] (an expanded view: no memory)."""
    return columns.unsqueeze(1).expand(-1, rows, -1)


def columns_as_rows(naturals: list[Optional[torch.Tensor]], dtype: torch.dtype, columns: torch.Tensor,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[n, m, R] on the host (into `out` if given): the columns `columns` ([n, m]) of each of n [R, C] tensors
    (None: zeros) as rows. One pass per member where its tensor is by column already (`Slab.natural`) or
    `columns` is every column in order; else torch's blocked transpose, then the gather."""
    n, m = columns.shape
    rows = next(t for t in naturals if t is not None).shape[0]
    out = torch.empty(n, m, rows, dtype=dtype, device="cpu") if out is None else out
    every = torch.arange(m, device="cpu")
    for row, natural, cols in zip(out, naturals, columns):
        if natural is None:
            row.zero_()
        elif natural.t().is_contiguous():
            torch.index_select(natural.t().to(dtype), 0, cols, out=row)
        elif m == natural.shape[1] and torch.equal(cols, every):
            row.copy_(natural.t())
        else:
            torch.index_select(natural.to(dtype).t().contiguous(), 0, cols, out=row)
    return out


# Elements of a parameter `param_columns` transposes at a time: a block of whole rows (torch's blocked transpose
# beats a narrower block or a strided gather) bounds the transient copy to a few MB.
PARAM_BLOCK_ELEMENTS = 1 << 20


def param_columns(params: list[torch.Tensor], selected: torch.Tensor, host_columns: Optional[torch.Tensor],
                  device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Fresh fp32 masters from the parameters ([R, C] views, on `device`): the columns `selected` ([n, k]) as
    [n, R, k] on the device, the columns `host_columns` ([n, u]; None: none) as host rows [n, u, R]. Each element
    is read and cast once, with no [R, C] copy in between."""
    n, k = selected.shape
    rows, cols = params[0].shape
    on_device = torch.empty(n, rows, k, device=device)
    if k:
        chosen = selected.to(device)
        for out, param, columns in zip(on_device, params, chosen):
            out.copy_(param if k == cols else param.index_select(1, columns))
    if host_columns is None:
        return on_device, None
    host = torch.empty(n, host_columns.shape[1], rows, device="cpu")
    block = max(1, PARAM_BLOCK_ELEMENTS // max(1, cols))
    for out, param, columns in zip(host, params, host_columns.to(device)):
        for start in range(0, rows, block):
            transposed = param[start:start + block].t().contiguous()  # [C, block]
            out[:, start:start + block].copy_(transposed.index_select(0, columns).to("cpu"))
    return on_device, host


def device_columns(naturals: list[Optional[torch.Tensor]], dtype: torch.dtype, columns: torch.Tensor,
                    device: torch.device) -> torch.Tensor:
    """[n, R, k] on `device`: the columns `columns` ([n, k]) of each of n [R, C] tensors (None: zeros)."""
    return columns_as_rows(naturals, dtype, columns).to(device).transpose(1, 2).contiguous()


def accumulator_bytes(params: list[torch.Tensor], config) -> int:
    """Device bytes that summing on the device needs for the trained matrices of `params`: per unselected
    element an fp32 sum (two with interval_second_moment) and its gradient's staging in the parameter's dtype."""
    sums = 8 if config.interval_second_moment else 4
    total = 0
    for param in params:
        if param.requires_grad and param.dim() >= 2:
            rows, cols = matrix_shape(param)
            total += rows * (cols - config.num_selected(cols)) * (sums + param.element_size())
    return total


__all__ = ["PARAM_BLOCK_ELEMENTS", "SHARED_SLAB_MAX_NUMEL", "SlabKey", "accumulator_bytes", "columns_as_rows",
           "columns_index", "columns_not_in", "device_columns", "host_order", "matrix_shape", "param_columns",
           "top_k_columns"]
