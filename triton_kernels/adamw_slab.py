"""AdamW of a slab's selected columns, in place: the math written once in torch, and a Triton kernel of it.

State: `grad` [n, R, k] (param dtype), `master`, `exp_avg`, `exp_avg_sq` fp32 [n, R, k], per-column update
`counts` fp32 [n, k] (incremented); `rows`: an int64 index on the device of the members that take part (None:
all). Per column at count c (after the increment), as torch.optim.AdamW:
    g = grad * grad_scale (fp32); master *= 1 - lr*wd; m = lerp(m, g, 1 - beta1);
    v = beta2*v + (1 - beta2)*g*g; step_size = lr / (1 - beta1**c);
    denom = sqrt(v) / sqrt(1 - beta2**c) + eps; master -= step_size * m / denom
with the bias corrections computed in float64 (torch's Python floats) and rounded to fp32. The caller writes
the new masters into the parameters (`runtime/kernels.py::write_columns_`).

The Triton kernel is one launch for the slab, one program per tile of BLOCK_C columns of one member looping
over the R rows: it reads each count once, computes the bias corrections once per column and writes the
count without racing another program.
"""

from typing import Optional, Union

import torch

from ._triton import HAVE_TRITON, DualKernel, constexpr, f32, split_f64, tl, triton_available

_BLOCK_R = 32
_BLOCK_C = 32


def _adamw_slab_kernel(
    grad_ptr, master_ptr, m_ptr, v_ptr, counts_ptr,  # [n, R, K] contiguous (grad in the param dtype); [n, K]
    rows_ptr,                                        # int64 [programs // tiles]: member of each row of programs
    scale_ptr, scale_val,                            # grad_scale: fp32 0-d tensor (SCALE_IS_PTR) or an fp32 value
    R, K, tiles,                                     # tiles: column tiles per member
    wd_factor, lerp_w, beta2, one_minus_beta2, eps,  # fp32, each rounded as torch rounds its scalar
    lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo,        # fp64 values as fp32 (hi, lo) pairs
    HAS_ROWS: constexpr, SCALE_IS_PTR: constexpr, BLOCK_R: constexpr, BLOCK_C: constexpr,
):
    pid = tl.program_id(0)
    slot = pid // tiles
    c0 = (pid % tiles) * BLOCK_C
    if HAS_ROWS:
        member = tl.load(rows_ptr + slot)
    else:
        member = slot.to(tl.int64)
    base = member * R * K
    offs_c = c0 + tl.arange(0, BLOCK_C).to(tl.int64)
    cmask = offs_c < K

    # Per-column count, incremented (the update uses c after the increment, like torch).
    count_ptrs = counts_ptr + member * K + offs_c
    n = tl.load(count_ptrs, mask=cmask, other=0.0) + 1.0

    # Bias corrections in float64: beta**c by binary exponentiation (only multiplies: exact enough and
    # portable, no fp64 pow/exp2 needed), then the fp32 roundings torch applies to its Python floats.
    b1 = tl.cast(b1_hi, tl.float64) + tl.cast(b1_lo, tl.float64)
    b2 = tl.cast(b2_hi, tl.float64) + tl.cast(b2_lo, tl.float64)
    lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
    e = n.to(tl.int32)
    pw1 = tl.full((BLOCK_C,), 0.0, tl.float64) + b1  # beta1**(2**bit)
    pw2 = tl.full((BLOCK_C,), 0.0, tl.float64) + b2
    b1n = tl.full((BLOCK_C,), 1.0, tl.float64)       # beta1**c
    b2n = tl.full((BLOCK_C,), 1.0, tl.float64)
    for _ in range(31):  # counts are exact integers below 2**24 in fp32; 31 bits covers any int32
        bit = (e & 1) != 0
        b1n = tl.where(bit, b1n * pw1, b1n)
        b2n = tl.where(bit, b2n * pw2, b2n)
        pw1 = pw1 * pw1
        pw2 = pw2 * pw2
        e = e >> 1
    step_size = (lr / (1.0 - b1n)).to(tl.float32)
    bc2_sqrt = tl.sqrt(1.0 - b2n).to(tl.float32)

    if SCALE_IS_PTR:
        scale = tl.load(scale_ptr)  # the clip coefficient, still on the device: no host sync
    else:
        scale = scale_val

    # A while loop, not range(): triton 3.6's interpreter cannot take tensor bounds in range() under numpy >= 2.4.
    r0 = R * 0
    while r0 < R:
        offs_r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        mask = (offs_r < R)[:, None] & cmask[None, :]
        offsets = base + offs_r[:, None] * K + offs_c[None, :]
        g = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale
        w = tl.load(master_ptr + offsets, mask=mask, other=0.0)
        m = tl.load(m_ptr + offsets, mask=mask, other=0.0)
        v = tl.load(v_ptr + offsets, mask=mask, other=0.0)

        w = w * wd_factor
        # torch.lerp's two formulas (the second is more accurate for weights >= 0.5).
        m = tl.where(lerp_w < 0.5, m + lerp_w * (g - m), g - (g - m) * (1.0 - lerp_w))
        v = v * beta2 + one_minus_beta2 * g * g
        # IEEE sqrt/div (Triton's defaults are approximate on NVIDIA) to match torch's fp32 rounding.
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt[None, :]) + eps
        w = w - tl.div_rn(step_size[None, :] * m, denom)

        tl.store(master_ptr + offsets, w, mask=mask)
        tl.store(m_ptr + offsets, m, mask=mask)
        tl.store(v_ptr + offsets, v, mask=mask)
        r0 += BLOCK_R

    tl.store(count_ptrs, n, mask=cmask)


_kernel = DualKernel(_adamw_slab_kernel) if HAVE_TRITON else None


def adamw_slab_torch_(grad, master, exp_avg, exp_avg_sq, counts, *, lr, beta1, beta2, eps, weight_decay,
                      grad_scale=1.0) -> None:
    """The math in torch over [n, R, k] state and [n, k] counts (or [R, k] and [k]), every member; on the CPU,
    where the counts all agree, torch's fused CPU AdamW as one tensor."""
    if master.device.type == "cpu" and counts.numel() and bool((counts == counts.reshape(-1)[0]).all()):
        g = grad if grad.dtype == torch.float32 else grad.float()
        if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
            g = g * grad_scale
        count = counts.reshape(-1)[:1] + 1  # the kernel's count, already incremented
        torch._fused_adamw_([master], [g], [exp_avg], [exp_avg_sq], [], [count.reshape(())], lr=lr, beta1=beta1,
                            beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        counts.add_(1)
        return
    adamw_columns_torch_(grad, master, exp_avg, exp_avg_sq, counts, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay, grad_scale=grad_scale)


def adamw_columns_torch_(grad, master, exp_avg, exp_avg_sq, counts, *, lr, beta1, beta2, eps, weight_decay,
                         grad_scale=1.0) -> None:
    """The per-column math in plain torch (each column its own count): what Inductor would compile."""
    g = grad if grad.dtype == torch.float32 else grad.float()
    if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
        g = g * grad_scale
    counts.add_(1)
    n64 = counts.double()
    step_size = (lr / (1 - beta1 ** n64)).float().unsqueeze(-2)  # [n, 1, k]: per column, over the rows
    bc2_sqrt = (1 - beta2 ** n64).sqrt().float().unsqueeze(-2)
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = exp_avg_sq.sqrt().div_(bc2_sqrt).add_(eps)
    master.sub_(step_size * exp_avg / denom)


def adamw_slab_(grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                counts: torch.Tensor, *, rows: Optional[torch.Tensor] = None, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, grad_scale: Union[float, torch.Tensor] = 1.0,
                use_triton: Optional[bool] = None) -> None:
    """One AdamW step of the selected columns of members `rows` (None: all) of a slab, in place (see the module
    docstring). `grad_scale`: a Python float or a 0-d fp32 tensor on the device (read inside the kernel: no
    host sync). `use_triton`: None = the kernel when `triton_available(device)`, else the torch twin."""
    n, R, k = master.shape
    device = master.device
    for name, t in zip(("grad", "master", "exp_avg", "exp_avg_sq"), (grad, master, exp_avg, exp_avg_sq)):
        if t.shape != (n, R, k) or not t.is_contiguous() or t.device != device:
            raise ValueError(f"adamw_slab_: {name} must be a contiguous [{n}, {R}, {k}] tensor on {device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    if counts.shape != (n, k) or counts.dtype != torch.float32 or not counts.is_contiguous():
        raise ValueError(f"adamw_slab_: counts must be contiguous fp32 [{n}, {k}], got {counts.dtype} "
                         f"{tuple(counts.shape)}")
    hyperparameters = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if use_triton is None:
        use_triton = triton_available(device)
    elif use_triton and not triton_available(device):
        raise RuntimeError(f"adamw_slab_: use_triton=True but Triton cannot run on {device}")
    if not use_triton:
        if rows is None:
            adamw_slab_torch_(grad, master, exp_avg, exp_avg_sq, counts, grad_scale=grad_scale, **hyperparameters)
            return
        state = [t.index_select(0, rows) for t in (master, exp_avg, exp_avg_sq, counts)]  # gathered, updated,
        adamw_slab_torch_(grad.index_select(0, rows), *state, grad_scale=grad_scale, **hyperparameters)
        for full, part in zip((master, exp_avg, exp_avg_sq, counts), state):  # scattered back
            full.index_copy_(0, rows, part)
        return
    members = n if rows is None else rows.numel()
    if not (members and k and R):
        return
    scale_is_tensor = isinstance(grad_scale, torch.Tensor)
    if scale_is_tensor:
        if grad_scale.numel() != 1 or grad_scale.device != device:
            raise ValueError(f"adamw_slab_: grad_scale tensor must be one element on {device}")
        scale_args = (grad_scale.reshape(()).to(torch.float32), 1.0)
    else:
        scale_args = (counts, float(grad_scale))  # any pointer: not read
    tiles = -(-k // _BLOCK_C)
    _kernel.on(device)[(members * tiles,)](
        grad, master, exp_avg, exp_avg_sq, counts, counts if rows is None else rows, *scale_args, R, k, tiles,
        f32(1 - lr * weight_decay), f32(1 - beta1), f32(beta2), f32(1 - beta2), f32(eps),
        *split_f64(lr), *split_f64(beta1), *split_f64(beta2),
        HAS_ROWS=rows is not None, SCALE_IS_PTR=scale_is_tensor, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C,
    )
