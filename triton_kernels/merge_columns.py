"""Merge the CPU-updated (unselected) columns into a device parameter: `param[:, columns[i]] = values[i]`.

`values` [n, R] holds the host fp32 masters of the unselected columns, one row per column (the layout the host
update produces: a column of the [R, C] parameter is contiguous there), already copied to the device. Only the
listed columns are written; the selected columns, updated on the device, are never touched.
"""

from typing import Optional

import torch

from ._triton import HAVE_TRITON, TORCH_TO_TL, DualKernel, constexpr, tl, triton, triton_available

__all__ = ["merge_host_columns_", "merge_host_columns_reference_"]

_BLOCK_N = 16
_BLOCK_R = 64


def merge_host_columns_reference_(param: torch.Tensor, columns: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Plain-torch fallback: `param.index_copy_(1, columns, values.t().to(param.dtype))`."""
    return param.index_copy_(1, columns, values.t().to(param.dtype))


def _merge_columns_kernel(
    param_ptr, cols_ptr, val_ptr,
    n, R, s_pr, s_pc, s_cols, s_vn, s_vr,
    PARAM_DTYPE: constexpr, BLOCK_N: constexpr, BLOCK_R: constexpr,
):
    # Tile [BLOCK_N columns, BLOCK_R rows]: reads of `values` run along R (contiguous); the writes into
    # `param` are a gather-scatter by nature (one element per row per column).
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    nmask = offs_n < n
    mask = nmask[:, None] & (offs_r < R)[None, :]
    cols = tl.load(cols_ptr + offs_n.to(tl.int64) * s_cols, mask=nmask, other=0)
    vals = tl.load(val_ptr + offs_n.to(tl.int64)[:, None] * s_vn + offs_r[None, :] * s_vr, mask=mask, other=0.0)
    dst = param_ptr + offs_r[None, :] * s_pr + (cols * s_pc)[:, None]
    if PARAM_DTYPE == tl.bfloat16:
        # fp32 -> bf16 round-to-nearest-even by hand (see adamw_columns.py: the interpreter's .to() truncates).
        bits = vals.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = tl.where(vals != vals, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
        out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = vals.to(PARAM_DTYPE)
    tl.store(dst, out, mask=mask)


_kernel = DualKernel(_merge_columns_kernel) if HAVE_TRITON else None


def merge_host_columns_(
    param: torch.Tensor,
    columns: torch.Tensor,
    values: torch.Tensor,
    *,
    use_triton: Optional[bool] = None,
) -> torch.Tensor:
    """`param[:, columns[i]] = values[i].to(param.dtype)` for all i, in place; returns `param`.

    - `param` [R, C] (fp32/bf16/fp16, any strides), `columns` int64 [n] (distinct), `values` [n, R] (fp32,
      any strides), all on one device. Columns not in `columns` keep their exact bits.
    - `use_triton`: None = Triton when `triton_available(param.device)`, else the torch reference.
    """
    if param.dim() != 2:
        raise ValueError(f"merge_host_columns_: param must be 2-D [R, C], got shape {tuple(param.shape)}")
    R = param.shape[0]
    if columns.dim() != 1 or columns.dtype != torch.int64:
        raise ValueError(f"merge_host_columns_: columns must be 1-D int64, got {columns.dtype} {tuple(columns.shape)}")
    n = columns.shape[0]
    if values.shape != (n, R) or not values.is_floating_point():
        raise ValueError(f"merge_host_columns_: values must be floating [{n}, {R}], got {values.dtype} "
                         f"{tuple(values.shape)}")
    if columns.device != param.device or values.device != param.device:
        raise ValueError("merge_host_columns_: param, columns and values must be on the same device")
    if use_triton is None:
        use_triton = triton_available(param.device)
    elif use_triton and not triton_available(param.device):
        raise RuntimeError(f"merge_host_columns_: use_triton=True but Triton cannot run on {param.device}")
    if not use_triton or param.dtype not in TORCH_TO_TL or values.dtype not in TORCH_TO_TL:
        return merge_host_columns_reference_(param, columns, values)
    if n == 0 or R == 0:
        return param
    grid = (triton.cdiv(n, _BLOCK_N), triton.cdiv(R, _BLOCK_R))
    _kernel.on(param.device)[grid](
        param, columns, values, n, R, param.stride(0), param.stride(1), columns.stride(0),
        values.stride(0), values.stride(1), PARAM_DTYPE=TORCH_TO_TL[param.dtype], BLOCK_N=_BLOCK_N, BLOCK_R=_BLOCK_R,
    )
    return param
