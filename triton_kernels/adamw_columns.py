"""Fused AdamW over the selected (device-resident) columns of many parameters, in one launch per dtype pair.

Per parameter i (all 2-D, any strides):
    grad_i        [R, k]  the selected columns' gradient (param dtype, or any float dtype), or, with
                          `grad_columns_i` [k] int64, the FULL gradient [R, C'] gathered inside the kernel
    master_i, exp_avg_i, exp_avg_sq_i   fp32 [R, k]   (updated in place)
    step_i        fp32 [k]  per-column update counts (incremented in place)
    param_i       [R, C]  the device parameter (fp32/bf16/fp16); columns `columns_i` are overwritten
    columns_i     int64 [k]  which columns of param_i the k state columns are

Math, per column with count n (after the increment), as torch.optim.AdamW (decoupled weight decay):
    g = grad * grad_scale (fp32); master *= 1 - lr*wd; m = lerp(m, g, 1 - beta1);
    v = beta2*v + (1 - beta2)*g*g; step_size = lr / (1 - beta1**n);
    denom = sqrt(v) / sqrt(1 - beta2**n) + eps; master -= step_size * m / denom;
    param[:, columns[j]] = master.to(param.dtype)
with the bias corrections computed in float64 (torch computes them in Python floats) and rounded to fp32.

Launch strategy: parameters are grouped by (param dtype, grad dtype); each group is ONE launch. The group's
per-parameter pointers, sizes and strides are packed in an int64 table (cast back to typed pointers in the
kernel), followed by a flat block table of (parameter index, first column) pairs: one program per tile of
BLOCK_C columns of one parameter, looping over all R rows. A program owns its columns for every row, so it
can read each count once, compute the bias corrections once per column, and write the incremented count
without racing another program.
"""

from typing import List, Optional, Sequence, Tuple, Union

import torch

from ._triton import HAVE_TRITON, TORCH_TO_TL, DualKernel, constexpr, f32, split_f64, tl, triton_available

__all__ = ["adamw_selected_columns_", "adamw_selected_columns_reference_", "adamw_slab_"]

_BLOCK_R = 32
# Checked without triton too: the torch twin serves the same dtypes (TORCH_TO_TL is empty without triton).
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_C = 32

# One row of the per-parameter int64 table (the kernel reads these offsets):
#    0..7   addresses: grad, master, exp_avg, exp_avg_sq, step, param, columns, grad_columns (0: none)
#    8, 9   R, k
#   10..22  strides (elements): grad (row, col), master (row, col), exp_avg (row, col), exp_avg_sq (row, col),
#           step, param (row, col), columns, grad_columns
_NMETA = 24  # row length (padded)


def _adamw_columns_kernel(
    meta_ptr, blocks_ptr,          # int64 tables (see _build_table)
    scale_ptr, scale_val,          # grad_scale: fp32 0-d tensor (SCALE_IS_PTR) or an fp32 value
    wd_factor, lerp_w, beta2, one_minus_beta2, eps,   # fp32, each rounded as torch rounds its scalar
    lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo,         # fp64 values as fp32 (hi, lo) pairs
    PARAM_DTYPE: constexpr, GRAD_DTYPE: constexpr, SCALE_IS_PTR: constexpr,
    BLOCK_R: constexpr, BLOCK_C: constexpr,
):
    pid = tl.program_id(0)
    p = tl.load(blocks_ptr + 2 * pid)
    c0 = tl.load(blocks_ptr + 2 * pid + 1)
    row = meta_ptr + p * 24  # 24 == _NMETA

    grad_ptr = tl.load(row + 0).to(tl.pointer_type(GRAD_DTYPE))
    master_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    step_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    param_ptr = tl.load(row + 5).to(tl.pointer_type(PARAM_DTYPE))
    cols_ptr = tl.load(row + 6).to(tl.pointer_type(tl.int64))
    gcols_addr = tl.load(row + 7)
    R = tl.load(row + 8)
    K = tl.load(row + 9)
    s_gr = tl.load(row + 10)
    s_gc = tl.load(row + 11)
    s_mr = tl.load(row + 12)
    s_mc = tl.load(row + 13)
    s_ar = tl.load(row + 14)
    s_ac = tl.load(row + 15)
    s_qr = tl.load(row + 16)
    s_qc = tl.load(row + 17)
    s_step = tl.load(row + 18)
    s_pr = tl.load(row + 19)
    s_pc = tl.load(row + 20)
    s_cols = tl.load(row + 21)
    s_gcols = tl.load(row + 22)

    offs_c = c0 + tl.arange(0, BLOCK_C)  # int64 (c0 is)
    cmask = offs_c < K

    # Per-column count, incremented (the update uses n after the increment, like torch).
    n = tl.load(step_ptr + offs_c * s_step, mask=cmask, other=0.0) + 1.0

    # Bias corrections in float64: beta**n by binary exponentiation (only multiplies: exact enough and
    # portable, no fp64 pow/exp2 needed), then the fp32 roundings torch applies to its Python floats.
    b1 = tl.cast(b1_hi, tl.float64) + tl.cast(b1_lo, tl.float64)
    b2 = tl.cast(b2_hi, tl.float64) + tl.cast(b2_lo, tl.float64)
    lr = tl.cast(lr_hi, tl.float64) + tl.cast(lr_lo, tl.float64)
    e = n.to(tl.int32)
    pw1 = tl.full((BLOCK_C,), 0.0, tl.float64) + b1  # beta1**(2**bit)
    pw2 = tl.full((BLOCK_C,), 0.0, tl.float64) + b2
    b1n = tl.full((BLOCK_C,), 1.0, tl.float64)       # beta1**n
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

    # Which parameter column each state column writes, and which gradient column it reads
    # (the state column itself, or grad_columns[j] when the full gradient was passed).
    pcol = tl.load(cols_ptr + offs_c * s_cols, mask=cmask, other=0)
    gather = gcols_addr != 0
    gcols_ptr = gcols_addr.to(tl.pointer_type(tl.int64))
    k_gather = tl.where(gather, K, 0)  # mask is all-false without grad_columns: the null address is never read
    gcol = tl.load(gcols_ptr + offs_c * s_gcols, mask=offs_c < k_gather, other=0)
    gcol = tl.where(gather, gcol, offs_c)

    if SCALE_IS_PTR:
        scale = tl.load(scale_ptr)  # the clip coefficient, still on the device: no host sync
    else:
        scale = scale_val

    # A while loop, not range(): triton 3.6's interpreter cannot take tensor bounds in range() under numpy >= 2.4.
    # (No software pipelining is lost that matters: ~4 programs per SM keep enough loads in flight.)
    r0 = R * 0
    while r0 < R:
        offs_r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        mask = (offs_r < R)[:, None] & cmask[None, :]
        g_ptrs = grad_ptr + offs_r[:, None] * s_gr + (gcol * s_gc)[None, :]
        w_ptrs = master_ptr + offs_r[:, None] * s_mr + (offs_c * s_mc)[None, :]
        m_ptrs = m_ptr + offs_r[:, None] * s_ar + (offs_c * s_ac)[None, :]
        v_ptrs = v_ptr + offs_r[:, None] * s_qr + (offs_c * s_qc)[None, :]
        p_ptrs = param_ptr + offs_r[:, None] * s_pr + (pcol * s_pc)[None, :]

        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32) * scale
        w = tl.load(w_ptrs, mask=mask, other=0.0)
        m = tl.load(m_ptrs, mask=mask, other=0.0)
        v = tl.load(v_ptrs, mask=mask, other=0.0)

        w = w * wd_factor
        # torch.lerp's two formulas (the second is more accurate for weights >= 0.5).
        m = tl.where(lerp_w < 0.5, m + lerp_w * (g - m), g - (g - m) * (1.0 - lerp_w))
        v = v * beta2 + one_minus_beta2 * g * g
        # IEEE sqrt/div (Triton's defaults are approximate on NVIDIA) to match torch's fp32 rounding.
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt[None, :]) + eps
        w = w - tl.div_rn(step_size[None, :] * m, denom)

        tl.store(w_ptrs, w, mask=mask)
        tl.store(m_ptrs, m, mask=mask)
        tl.store(v_ptrs, v, mask=mask)
        if PARAM_DTYPE == tl.bfloat16:
            # fp32 -> bf16 round-to-nearest-even by hand: the same bits as torch's cast, compiled (where
            # .to() is cvt.rn as well) and interpreted (where .to() truncates).
            bits = w.to(tl.uint32, bitcast=True)
            bits = tl.where(w != w, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))  # NaN: torch's quiet NaN
            w_out = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            w_out = w.to(PARAM_DTYPE)
        tl.store(p_ptrs, w_out, mask=mask)
        r0 += BLOCK_R

    tl.store(step_ptr + offs_c * s_step, n, mask=cmask)


_kernel = DualKernel(_adamw_columns_kernel) if HAVE_TRITON else None

# Device tables keyed by everything they encode (addresses, sizes, strides): a hit is correct by construction,
# even if a tensor was freed and another took its address. Small FIFO, so it does not pin memory forever.
_TABLE_CACHE: dict = {}
_TABLE_CACHE_SIZE = 64


def _build_table(entries: List[Tuple], device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(meta [P, _NMETA] int64, blocks [NB, 2] int64, NB) for the group's parameters on `device`."""
    # The stream is part of the key: a table is copied and first read on one stream; reusing it from another
    # stream would neither be ordered after its copy nor known to the caching allocator.
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (device, stream, tuple(entries))
    hit = _TABLE_CACHE.get(key)
    if hit is not None:
        return hit
    meta, blocks = [], []
    for i, e in enumerate(entries):
        meta.extend(e)
        meta.extend([0] * (_NMETA - len(e)))
        K = e[9]
        blocks.extend(x for c0 in range(0, K, _BLOCK_C) for x in (i, c0))
    flat = torch.tensor(meta + blocks, dtype=torch.int64)
    if device.type == "cuda":
        # Pinned + non_blocking: no host sync; the caching host allocator keeps the pinned buffer alive
        # until the copy has run.
        flat = flat.pin_memory().to(device, non_blocking=True)
    n_meta = len(meta)
    res = (flat[:n_meta].view(-1, _NMETA), flat[n_meta:].view(-1, 2), len(blocks) // 2)
    if len(_TABLE_CACHE) >= _TABLE_CACHE_SIZE:
        _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
    _TABLE_CACHE[key] = res
    return res


def _check(i, grad, master, exp_avg, exp_avg_sq, step, param, cols, gcols, device):
    def bad(msg):
        raise ValueError(f"adamw_selected_columns_: parameter {i}: {msg}")

    named = [("grad", grad), ("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("step", step),
             ("param", param), ("columns", cols)] + ([("grad_columns", gcols)] if gcols is not None else [])
    for name, t in named:
        if t.device != device:
            bad(f"{name} is on {t.device}, expected {device}")
    if param.dim() != 2:
        bad(f"param must be 2-D [R, C], got shape {tuple(param.shape)}")
    R = param.shape[0]
    if cols.dim() != 1 or cols.dtype != torch.int64:
        bad(f"columns must be 1-D int64, got {cols.dtype} {tuple(cols.shape)}")
    k = cols.shape[0]
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or t.shape != (R, k):
            bad(f"{name} must be fp32 [{R}, {k}], got {t.dtype} {tuple(t.shape)}")
    if step.dtype != torch.float32 or step.shape != (k,):
        bad(f"step must be fp32 [{k}], got {step.dtype} {tuple(step.shape)}")
    if param.dtype not in _FLOAT_DTYPES or grad.dtype not in _FLOAT_DTYPES:
        bad(f"param/grad dtype must be fp32, bf16 or fp16, got {param.dtype}/{grad.dtype}")
    if grad.dim() != 2 or grad.shape[0] != R:
        bad(f"grad must be 2-D with {R} rows, got {tuple(grad.shape)}")
    if gcols is None:
        if grad.shape[1] != k:
            bad(f"grad must be [{R}, {k}] (or pass grad_columns), got {tuple(grad.shape)}")
    elif gcols.dtype != torch.int64 or gcols.shape != (k,):
        bad(f"grad_columns must be int64 [{k}], got {gcols.dtype} {tuple(gcols.shape)}")


def adamw_slab_(grad, master, exp_avg, exp_avg_sq, counts, *, lr, beta1, beta2, eps, weight_decay,
                grad_scale=1.0) -> None:
    """The kernel's math in plain torch over a slab: `grad`, `master`, `exp_avg`, `exp_avg_sq` [n, R, k] (or
    [R, k]) and per-column counts `counts` [n, k] (or [k]), in place. On the CPU, where reading the counts costs
    nothing, a slab whose counts all agree takes torch's fused CPU AdamW as one tensor."""
    g = grad if grad.dtype == torch.float32 else grad.float()
    if isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0:
        g = g * grad_scale
    if master.device.type == "cpu" and counts.numel() and bool((counts == counts.reshape(-1)[0]).all()):
        count = counts.reshape(-1)[:1] + 1  # the kernel's count, already incremented
        torch._fused_adamw_([master], [g], [exp_avg], [exp_avg_sq], [], [count.reshape(())], lr=lr, beta1=beta1,
                            beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        counts.add_(1)
        return
    counts.add_(1)
    n64 = counts.double()
    step_size = (lr / (1 - beta1 ** n64)).float().unsqueeze(-2)  # [n, 1, k]: per column, over the rows
    bc2_sqrt = (1 - beta2 ** n64).sqrt().float().unsqueeze(-2)
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = exp_avg_sq.sqrt().div_(bc2_sqrt).add_(eps)
    master.sub_(step_size * exp_avg / denom)


def adamw_selected_columns_reference_(
    grads, masters, exp_avgs, exp_avg_sqs, steps, params, columns,
    *, lr, beta1, beta2, eps, weight_decay, grad_scale=1.0, grad_columns=None,
) -> None:
    """Plain-torch twin of `adamw_selected_columns_` (same arguments, same math), one parameter at a time."""
    for i in range(len(grads)):
        if not columns[i].numel():
            continue
        g = grads[i] if grad_columns is None or grad_columns[i] is None else grads[i][:, grad_columns[i]]
        adamw_slab_(g, masters[i], exp_avgs[i], exp_avg_sqs[i], steps[i], lr=lr, beta1=beta1, beta2=beta2,
                    eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
        params[i].index_copy_(1, columns[i], masters[i].to(params[i].dtype))


def adamw_selected_columns_(
    grads: Sequence[torch.Tensor],
    masters: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    columns: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: Union[float, torch.Tensor] = 1.0,
    grad_columns: Optional[Sequence[Optional[torch.Tensor]]] = None,
    use_triton: Optional[bool] = None,
    validate: bool = True,
) -> None:
    """One AdamW step on the selected columns of many parameters (one param group), in place.

    See the module docstring for shapes and math. `grad_scale` is a Python float or a 0-d fp32 tensor on the
    device (read inside the kernel: no host sync). `grad_columns[i]` (optional, int64 [k_i]): `grads[i]` is
    then the full gradient and its columns `grad_columns[i]` are gathered. Columns in `columns[i]` must be
    distinct. `use_triton`: None = Triton when `triton_available(device)`, else the torch reference.
    `validate=False` skips the per-parameter argument checks (for callers that build the arguments
    themselves, once per step, like the runtime).
    """
    P = len(params)
    lists = (grads, masters, exp_avgs, exp_avg_sqs, steps, columns)
    if any(len(x) != P for x in lists) or (grad_columns is not None and len(grad_columns) != P):
        raise ValueError("adamw_selected_columns_: all per-parameter lists must have the same length")
    if P == 0:
        return
    device = params[0].device
    gcols_list = list(grad_columns) if grad_columns is not None else [None] * P
    if validate:
        for i in range(P):
            _check(i, grads[i], masters[i], exp_avgs[i], exp_avg_sqs[i], steps[i], params[i], columns[i],
                   gcols_list[i], device)
    scale_is_tensor = isinstance(grad_scale, torch.Tensor)
    if scale_is_tensor and (grad_scale.numel() != 1 or grad_scale.device != device):
        raise ValueError(f"adamw_selected_columns_: grad_scale tensor must be one element on {device}")
    if use_triton is None:
        use_triton = triton_available(device)
    elif use_triton and not triton_available(device):
        raise RuntimeError(f"adamw_selected_columns_: use_triton=True but Triton cannot run on {device}")
    if not use_triton:
        adamw_selected_columns_reference_(
            grads, masters, exp_avgs, exp_avg_sqs, steps, params, columns, lr=lr, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=weight_decay, grad_scale=grad_scale, grad_columns=grad_columns)
        return

    # Group by (param dtype, grad dtype): the kernel's pointer element types are compile-time constants.
    groups: dict = {}
    for i in range(P):
        if columns[i].numel() == 0:
            continue
        g, gc = grads[i], gcols_list[i]
        entry = (
            g.data_ptr(), masters[i].data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(),
            steps[i].data_ptr(), params[i].data_ptr(), columns[i].data_ptr(), gc.data_ptr() if gc is not None else 0,
            params[i].shape[0], columns[i].shape[0],
            g.stride(0), g.stride(1), masters[i].stride(0), masters[i].stride(1),
            exp_avgs[i].stride(0), exp_avgs[i].stride(1), exp_avg_sqs[i].stride(0), exp_avg_sqs[i].stride(1),
            steps[i].stride(0), params[i].stride(0), params[i].stride(1), columns[i].stride(0),
            gc.stride(0) if gc is not None else 0,
        )
        groups.setdefault((params[i].dtype, g.dtype), []).append(entry)

    if scale_is_tensor:
        scale_t = grad_scale.reshape(()).to(torch.float32)
        scale_args = (scale_t, 1.0)
    lr_hi, lr_lo = split_f64(lr)
    b1_hi, b1_lo = split_f64(beta1)
    b2_hi, b2_lo = split_f64(beta2)
    kernel = _kernel.on(device)
    for (pdtype, gdtype), entries in groups.items():
        meta, blocks, nblocks = _build_table(entries, device)
        if not scale_is_tensor:
            scale_args = (meta, float(grad_scale))  # any pointer: not read
        kernel[(nblocks,)](
            meta, blocks, *scale_args,
            f32(1 - lr * weight_decay), f32(1 - beta1), f32(beta2), f32(1 - beta2), f32(eps),
            lr_hi, lr_lo, b1_hi, b1_lo, b2_hi, b2_lo,
            PARAM_DTYPE=TORCH_TO_TL[pdtype], GRAD_DTYPE=TORCH_TO_TL[gdtype], SCALE_IS_PTR=scale_is_tensor,
            BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C,
        )
