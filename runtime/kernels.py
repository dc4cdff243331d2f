"""The runtime's kernels, each choice behind one function (swap a kernel here and nowhere else).

- `device_adamw_`: AdamW of a slab's selected columns on the device (Triton on CUDA or under
  TRITON_INTERPRET=1, else its torch twin), then the new columns written into the parameters (`write_columns_`).
- `column_scores`: per-column squared norms of a gradient for the eager path (Inductor fuses them when compiled).
- `accumulate_scaled_many_`: the host's `acc += coef * grad` (fp32 accumulator, fp32/bf16/fp16 gradient), where
  `accumulate_on="host"` or the model is on the CPU. From `COMPILED_MIN_NUMEL` elements the torch math
  (`_accumulate_flat`) compiled by Inductor into one pass (1.5-1.7x the eager path on 1 and 2 threads, bf16,
  134M elements); below it, eager.
- `cpu_adamw_`: the host AdamW of the unselected columns, the torch math (`_adamw_rows`) compiled into one pass
  over the host rows, each row at its own update count, lr multiplier and divisor, the cast for the upload in
  the same pass. Reselections leave rows at other counts anywhere: torch's fused CPU AdamW takes one count per
  tensor, and gathering the rows by count made the update 2-10x slower at 5-50% of the rows apart; this kernel
  runs at the same rate in any order (bench_host `update` / `update_apart`), as fast as torch's fused kernel
  plus a cast in count order. Under `COMPILED_MIN_NUMEL` elements the same function runs unfused.

All follow torch.optim.AdamW exactly: decoupled weight decay, then moments, then the bias-corrected step.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

from zenflow_compile.triton_kernels import adamw_slab_, column_sq_norms, triton_available


def device_adamw_(grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  counts: torch.Tensor, params: list[torch.Tensor], columns: torch.Tensor, *,
                  rows: Optional[list[int]], index: Optional[torch.Tensor], whole: bool, grad_scale, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float,
                  master_rows: Optional[list[torch.Tensor]] = None) -> None:
    """AdamW of a slab's selected columns ([n, R, k] state, [n, k] per-column counts), written into columns
    `columns` ([n, k]) of the members' parameters ([R, C] views); `rows`: the members that take part (None:
    all), `index` the same on the device; `whole`: the columns are all of each parameter's, in order;
    `master_rows`: `master.unbind(0)`, if the caller keeps it."""
    adamw_slab_(grad, master, exp_avg, exp_avg_sq, counts, rows=index, grad_scale=grad_scale, lr=lr, beta1=beta1,
                beta2=beta2, eps=eps, weight_decay=weight_decay)
    if rows is not None:
        write_columns_([params[i] for i in rows], columns.index_select(0, index), master.index_select(0, index),
                       whole=whole)
    elif whole and master_rows is not None:
        torch._foreach_copy_(params, master_rows)
    else:
        write_columns_(params, columns, master, whole=whole)


def write_columns_(params: list[torch.Tensor], columns: torch.Tensor, values: torch.Tensor,
                   whole: bool = False) -> None:
    """params[i][:, columns[i]] = values[i] (cast to the parameters' dtype) for n like [R, C] parameters,
    `columns` [n, m], `values` [n, R, m] (any strides), in a fixed number of calls; `whole`: the columns are
    all of them, in order. Several parameters (a shared slab's, small) are gathered into one [n, R, C] buffer,
    scattered into and copied back."""
    if whole:
        torch._foreach_copy_(params, list(values.unbind(0)))
        return
    dtype = params[0].dtype
    if len(params) == 1:
        params[0].index_copy_(1, columns[0], values[0] if values.dtype == dtype else values[0].to(dtype))
        return
    buffer = torch.stack(params)
    buffer.scatter_(2, columns.unsqueeze(1).expand(-1, buffer.shape[1], -1),
                    values if values.dtype == dtype else values.to(dtype))
    torch._foreach_copy_(params, list(buffer.unbind(0)))


def column_scores(grad2d: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`out` (optional, fp32 [C], contiguous): written in full, no temporary (the torch path, per gradient on
    the eager hand-off: one reduction straight into the runtime's score buffer)."""
    if triton_available(grad2d.device):
        return column_sq_norms(grad2d, out=out, use_triton=True)
    return torch.sum((grad2d if grad2d.dtype == torch.float32 else grad2d.float()).square(), 0, out=out)


def _accumulate_flat(acc, grad, coef, square):
    """acc += coef * grad (and square += (coef * grad)**2) over flat tensors, the gradient in any float dtype;
    `coef` a float64 0-d tensor (a Python float would be compiled again for each value)."""
    scaled = grad.float() * coef.float()
    acc.add_(scaled)
    if square is not None:
        square.add_(scaled * scaled)


# Elements per conversion chunk (a 4 MB fp32 scratch): measured here on one thread, 64K / 256K / 1M / 4M
# elements gave 1.56 / 2.42 / 2.56 / 2.30 Gparam/s; fewer, larger chunks also mean fewer parallel regions
# when the worker runs several intra-op threads.
_ACCUMULATE_CHUNK = 1 << 20


def accumulate_scaled_many_(accs: list[torch.Tensor], grads: list[torch.Tensor], coef: float,
                            square_accs: Optional[list[torch.Tensor]] = None) -> None:
    """acc += coef * grad over many tensors: those of `COMPILED_MIN_NUMEL` elements or more one by one in the
    compiled pass; of the others, the same-dtype ones in one `_foreach_add_`, the bf16/fp16 ones chunk by chunk
    through a reused fp32 scratch. `square_accs` (interval_second_moment): also square_acc += (coef * grad)**2,
    one per acc."""
    if square_accs is not None and len(square_accs) != len(accs):
        raise ValueError(f"accumulate_scaled_many_: {len(square_accs)} square_accs for {len(accs)} accs; pass "
                         "one per acc (or None)")
    squares = square_accs if square_accs is not None else [None] * len(accs)
    same, converted, large = [], [], []
    for triple in zip(accs, grads, squares):
        (large if compiles(triple[0].numel()) else same if triple[1].dtype == triple[0].dtype
         else converted).append(triple)
    for acc, grad, square in large + converted:  # (read through flat views)
        if not (acc.is_contiguous() and grad.is_contiguous() and (square is None or square.is_contiguous())):
            raise ValueError(
                f"accumulate_scaled_many_: a {grad.dtype} gradient is accumulated into a {acc.dtype} accumulator "
                f"through a flat view, so both (and the square accumulator) must be contiguous; got strides "
                f"{acc.stride()} and {grad.stride()}. Pass .contiguous() tensors (the runtime's host buffers are).")
    if large:
        coef_tensor = torch.tensor(coef, dtype=torch.float64, device="cpu")
        for acc, grad, square in large:
            _accumulate_kernel(acc.view(-1), grad.view(-1), coef_tensor, None if square is None else square.view(-1))
    if same:
        torch._foreach_add_([a for a, _, _ in same], [g for _, g, _ in same], alpha=coef)
        if square_accs is not None:
            same_grads = [g for _, g, _ in same]
            torch._foreach_addcmul_([q for _, _, q in same], same_grads, same_grads, value=coef * coef)
    for acc, grad, square in converted:
        flat_acc, flat_grad, numel = acc.view(-1), grad.view(-1), acc.numel()
        flat_square = None if square is None else square.view(-1)
        scratch = torch.empty(min(_ACCUMULATE_CHUNK, numel), dtype=acc.dtype, device="cpu")
        for start in range(0, numel, _ACCUMULATE_CHUNK):
            end = min(start + _ACCUMULATE_CHUNK, numel)
            chunk = scratch[:end - start]
            chunk.copy_(flat_grad[start:end])
            flat_acc[start:end].add_(chunk, alpha=coef)
            if flat_square is not None:
                flat_square[start:end].addcmul_(chunk, chunk, value=coef * coef)


def _adamw_rows(master, grad, exp_avg, exp_avg_sq, weights, counts, lr_scale, divisor, lr, beta1, beta2, eps,
                weight_decay, grad_sq):
    """AdamW of [rows, R] fp32 state, each row at its own count, lr multiplier (0: the row takes no step) and
    divisor ([rows] each); the hyperparameters as float64 0-d tensors (no size Dynamo could tie a row count
    to). In torch.optim.AdamW's order, its scalars computed in float64 as torch computes its Python floats; compiled
    by Inductor into one pass over the rows (`weights`, optional, takes the new masters in its dtype)."""
    taking = lr_scale != 0
    counts.add_(taking.to(counts.dtype))
    n = counts.double().clamp(min=1)
    row_lr = lr * lr_scale.double()
    # (per row, returned so that Inductor computes them once per row, not once per element)
    # (the divisor as a reciprocal: a division per element costs the kernel ~8% here; exact for the powers of
    # two an interval usually is, within an ulp of the gradient otherwise)
    rows = torch.stack([1 - row_lr * weight_decay, row_lr / (1 - beta1 ** n), (1 - beta2 ** n).sqrt(),
                        1 / divisor.double()], 1).float()
    decay, step_size, bc2_sqrt, inv_divisor = rows[:, 0:1], rows[:, 1:2], rows[:, 2:3], rows[:, 3:4]
    taking = taking.unsqueeze(1)
    g = grad * inv_divisor
    p = master * decay
    m = exp_avg.lerp(g, (1 - beta1).float())
    if grad_sq is None:
        v = exp_avg_sq * beta2.float() + (1 - beta2).float() * g * g
    else:
        v = exp_avg_sq * beta2.float() + (1 - beta2).float() * (grad_sq * inv_divisor)
    p = p - step_size * m / (v.sqrt() / bc2_sqrt + eps.float())
    p = torch.where(taking, p, master)
    master.copy_(p)
    exp_avg.copy_(torch.where(taking, m, exp_avg))
    exp_avg_sq.copy_(torch.where(taking, v, exp_avg_sq))
    if weights is not None:
        weights.copy_(p.to(weights.dtype))
    return rows


class _CompiledKernel:
    """`fn` (a host kernel's math in torch) compiled once per process (dynamic shapes) with Inductor's C++
    wrapper, which releases the GIL while the kernel runs (the Python wrapper would stop the training thread
    for the worker's whole task), the thread count read where it runs. Where Inductor cannot build it (no C++
    compiler), `fn` runs unfused with one warning: the same arithmetic, several passes slower."""

    def __init__(self, fn, what: str):
        options = {"cpp_wrapper": True}
        if hasattr(torch._inductor.config.cpp, "dynamic_threads"):
            options["cpp.dynamic_threads"] = True
        self.fn, self.what = fn, what
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=True, options=options)
        self.failed = None

    def __call__(self, *args):
        if self.failed is None:
            try:
                # (a user's torch function or dispatch mode around `opt.step()` is not traceable in general, and
                # this kernel is the optimizer's, not the user's computation: it runs outside them)
                with torch.no_grad(), torch._C.DisableTorchFunction(), _disable_current_modes():
                    return self.compiled(*args)
            except RuntimeError as error:  # (Dynamo's and Inductor's errors derive from it)
                if not isinstance(error, torch._dynamo.exc.TorchDynamoException) and "torch.compile" not in str(error):
                    raise  # (the kernel's own error, not the compiler's)
                self.failed = error
                warnings.warn(f"ZenFlow: torch.compile could not build {self.what} ("
                              f"{type(error).__name__}: {str(error).strip().splitlines()[0]}); it runs unfused, "
                              "several times slower. Where the cause is a missing C++ compiler, install one (g++) "
                              "and Python's headers, which torch.compile needs on the CPU.", RuntimeWarning,
                              stacklevel=3)
        self.unfused(*args)

    def unfused(self, *args):
        with torch.no_grad():
            return self.fn(*args)


_rows_kernel = _CompiledKernel(_adamw_rows, "the CPU AdamW")
_accumulate_kernel = _CompiledKernel(_accumulate_flat, "the host accumulation")

# Calls under this many elements (a 1024 x 1024 matrix) run unfused: the compiled kernel costs a process seconds
# at its first call (the compile, or 4-5 s from Inductor's cache), which small models never win back (one core:
# 64K elements 0.43 ms unfused, 0.16 ms compiled; 1M elements 26 ms and 1.1 ms).
COMPILED_MIN_NUMEL = 1 << 20


def compiles(numel: int) -> bool:
    """Whether a call over `numel` elements of host rows takes the compiled kernel."""
    return numel >= COMPILED_MIN_NUMEL


def cpu_adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               counts: torch.Tensor, *, lr_scale: torch.Tensor, divisor: torch.Tensor, lr: float, beta1: float,
               beta2: float, eps: float, weight_decay: float, weights: Optional[torch.Tensor] = None,
               grad_sq: Optional[torch.Tensor] = None, compiled: Optional[bool] = None) -> None:
    """The CPU AdamW of host rows, in place: fp32 [rows, R] `master`, `exp_avg`, `exp_avg_sq` and the
    gradient sums `grad`, each row at its own update count (`counts` fp32 [rows], incremented for the rows that
    step), lr multiplier (`lr_scale` [rows]; 0: no step) and divisor (`divisor` [rows]: the gradient is a sum
    of that many steps). `weights`: [rows, R] in the parameters' dtype, written with every row's new master.
    `grad_sq` (interval_second_moment): exp_avg_sq takes grad_sq / divisor where AdamW takes (grad /
    divisor)**2. `compiled`: Inductor's kernel or the unfused function (None: by size, `compiles`)."""
    if not master.numel():  # (an empty shard's columns: their counts still advance, as every rank's do)
        counts.add_((lr_scale != 0).to(counts.dtype))
        return
    hyperparameters = _float64_scalars(lr, beta1, beta2, eps, weight_decay)
    kernel = _rows_kernel if (compiles(master.numel()) if compiled is None else compiled) else _rows_kernel.unfused
    # (`detach`: the same memory, without the view's base, and the per-row tensors contiguous: the compiled
    # kernel guards on both and would be compiled again for each new base shape or stride)
    kernel(*(None if t is None else t.detach() for t in (master, grad, exp_avg, exp_avg_sq, weights, counts)),
           lr_scale.detach().contiguous(), divisor.detach().contiguous(), *hyperparameters,
           None if grad_sq is None else grad_sq.detach())


@functools.lru_cache(maxsize=16)
def _float64_scalars(*values: float) -> tuple[torch.Tensor, ...]:
    """0-d float64 tensors of `values`, made once per set: every slab of a boundary shares its group's (a call
    makes them in ~6 us each, a fifth of a small call's cost). The kernels only read them."""
    return tuple(torch.tensor(x, dtype=torch.float64, device="cpu") for x in values)


def prepare_cpu_adamw(weights_dtype: Optional[torch.dtype], squares: bool) -> None:
    """Build the compiled CPU AdamW for these upload weights (None: none) and square sums on tiny rows that take
    no step (the update worker, at a layout: the first boundary then does not wait for the compile)."""
    rows, R = 3, 48  # (not 0 or 1, not equal, R past a vector: sizes Dynamo would specialise or tie together)
    state = [torch.zeros(rows, R) for _ in range(5)]
    weights = None if weights_dtype is None else torch.zeros(rows, R, dtype=weights_dtype)
    cpu_adamw_(*state[:4], torch.zeros(rows), lr_scale=torch.zeros(rows, dtype=torch.float64),
               divisor=torch.ones(rows), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, weights=weights,
               grad_sq=state[4] if squares else None, compiled=True)


def prepare_accumulate(grad_dtype: torch.dtype, squares: bool) -> None:
    """Build the compiled host accumulation for `grad_dtype` (and square sums) on the accumulate worker, as
    `prepare_cpu_adamw`."""
    size = 144  # (not 0 or 1: a size Dynamo would specialise)
    _accumulate_kernel(torch.zeros(size), torch.zeros(size, dtype=grad_dtype), torch.tensor(0.0, dtype=torch.float64),
                       torch.zeros(size) if squares else None)


def shift_second_moment_(exp_avg_sqs: list[torch.Tensor], grads: list[torch.Tensor], grad_sqs: list[torch.Tensor],
                         beta2: float) -> None:
    """interval_second_moment, before an AdamW kernel that squares the gradient itself: exp_avg_sq += (1 - beta2)
    / beta2 * (grad_sq - grad**2), so that the kernel's beta2 * v + (1 - beta2) * grad**2 lands on
    beta2 * v + (1 - beta2) * grad_sq."""
    if beta2 == 0.0:
        raise ValueError("interval_second_moment needs betas[1] > 0 (with beta2 = 0 AdamW keeps no second "
                         "moment to size); set betas[1] > 0 or interval_second_moment=False")
    shift = (1.0 - beta2) / beta2
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=-shift)
    torch._foreach_add_(exp_avg_sqs, grad_sqs, alpha=shift)
