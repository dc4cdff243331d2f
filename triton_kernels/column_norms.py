"""Column squared norms of a gradient, `scores[j] = sum_i grad[i, j]**2` in fp32: ZenFlow's column scores
(docs/semantics.md) and, summed, the squared global norm. For the eager path only: compiled, the norm-proxy
pass emits the reduction in aten and Inductor fuses it into the backward kernel that makes the gradient.
"""

from typing import Optional

import torch

from ._triton import HAVE_TRITON, DualKernel, add_combine, constexpr, tl, triton, triton_available

_BLOCK_R = 32
_BLOCK_C = 64


def column_sq_norms_reference(grad: torch.Tensor) -> torch.Tensor:
    """Plain-torch fallback: `(grad.float() ** 2).sum(0)`, fp32 [C]."""
    return grad.float().square().sum(0)


def _column_sq_norms_kernel(
    g_ptr, out_ptr,               # grad [R, C] (any float dtype), out [SPLIT, C] fp32 (contiguous)
    R, C, s_gr, s_gc,             # sizes, grad strides (elements)
    rows_per_split,               # rows handled by one program along axis 1 (multiple of BLOCK_R)
    BLOCK_R: constexpr, BLOCK_C: constexpr,
):
    pid_c = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = offs_c < C
    # 64-bit offsets: R * C may exceed 2**31 elements.
    col_off = offs_c.to(tl.int64) * s_gc
    # Keep a [BLOCK_R, BLOCK_C] fp32 accumulator and reduce it once at the end: shorter fp32 sum chains than
    # a running [BLOCK_C] sum, and the loads stay plain tiles.
    acc = tl.full((BLOCK_R, BLOCK_C), 0.0, tl.float32)
    r0 = pid_s * rows_per_split
    r_end = tl.minimum(r0 + rows_per_split, R)
    # A while loop, not range(): triton 3.6's interpreter cannot take tensor bounds in range() under numpy >= 2.4.
    while r0 < r_end:
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask = (offs_r < r_end)[:, None] & cmask[None, :]
        ptrs = g_ptr + offs_r.to(tl.int64)[:, None] * s_gr + col_off[None, :]
        g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        acc += g * g
        r0 += BLOCK_R
    tl.store(out_ptr + pid_s.to(tl.int64) * C + offs_c, tl.reduce(acc, 0, add_combine), mask=cmask)


_kernel = DualKernel(_column_sq_norms_kernel) if HAVE_TRITON else None


def _default_split(R: int, C: int, device: torch.device) -> int:
    """Row splits so that a GPU gets enough programs (a wide matrix alone fills it; a tall, narrow one does not)."""
    if device.type != "cuda":
        return 1
    col_tiles = triton.cdiv(C, _BLOCK_C)
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(R, _BLOCK_R), triton.cdiv(target, col_tiles)))


def column_sq_norms(grad: torch.Tensor, *, out: Optional[torch.Tensor] = None, split_rows: Optional[int] = None,
                    use_triton: Optional[bool] = None) -> torch.Tensor:
    """`(grad.float() ** 2).sum(0)` for a 2-D `grad` [R, C] (fp32/bf16/fp16, any strides) -> fp32 [C].
    `out`: optional contiguous fp32 [C], written in full. `split_rows`: the rows split over this many programs
    per column tile (partial sums, then one deterministic `.sum(0)`; None: from the device, 1 on the CPU).
    `use_triton`: None = Triton when `triton_available(grad.device)`, else the torch reference."""
    if grad.dim() != 2:
        raise ValueError(f"column_sq_norms: grad must be 2-D [R, C], got shape {tuple(grad.shape)}")
    if not grad.is_floating_point():
        raise ValueError(f"column_sq_norms: grad must be floating point, got {grad.dtype}")
    R, C = grad.shape
    if out is not None:
        if out.shape != (C,) or out.dtype != torch.float32 or out.device != grad.device or not out.is_contiguous():
            raise ValueError(f"column_sq_norms: out must be a contiguous fp32 [{C}] tensor on {grad.device}")
    if use_triton is None:
        use_triton = triton_available(grad.device)
    elif use_triton and not triton_available(grad.device):
        raise RuntimeError(f"column_sq_norms: use_triton=True but Triton cannot run on {grad.device}")
    if not use_triton or R == 0 or C == 0:
        res = column_sq_norms_reference(grad)
        return res if out is None else out.copy_(res)

    split = split_rows if split_rows is not None else _default_split(R, C, grad.device)
    split = max(1, min(int(split), triton.cdiv(R, _BLOCK_R)))
    rows_per_split = triton.cdiv(triton.cdiv(R, split), _BLOCK_R) * _BLOCK_R
    split = triton.cdiv(R, rows_per_split)  # no empty programs
    if split == 1:
        dst = out if out is not None else torch.empty(C, dtype=torch.float32, device=grad.device)
    else:
        dst = torch.empty(split, C, dtype=torch.float32, device=grad.device)
    _kernel.on(grad.device)[(triton.cdiv(C, _BLOCK_C), split)](grad, dst, R, C, grad.stride(0), grad.stride(1),
                                                               rows_per_split, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C)
    if split == 1:
        return dst
    return dst.sum(0) if out is None else torch.sum(dst, 0, out=out)
