"""The runtime's kernels, each choice behind one function.

- `device_adamw_`: AdamW of a slab's selected columns, in place on the device (every column owns its update
  count), then the new columns written into the members' parameters. The Triton kernel (one launch for the
  slab) on CUDA, or under TRITON_INTERPRET=1; its torch twin otherwise (torch's fused CPU AdamW while the
  slab's counts agree).
- `write_columns_`: write columns into the parameters of a slab (the device AdamW's, the CPU-updated ones),
  in a fixed number of torch calls.
- `column_scores`: per-column squared norms of a gradient, for the eager path (the compiled backward
  computes them itself, fused by Inductor into the kernels that produce the gradient).
- `accumulate_scaled_many_`: the host accumulator's `acc += coef * grad` (fp32 accumulator, fp32/bf16/fp16
  gradient): an fp32 gradient in one fused add; a bf16/fp16 one converted chunk by chunk into a small reused
  fp32 scratch (~65% of the memory-bandwidth bound on one core: a mixed-dtype add_ runs ~4x slower here, and
  `grad.float() * coef` allocates and streams two full-size temporaries). This is the path of a device without
  room for the accumulators (`accumulate_on="host"`); a one-pass native kernel measured 1.3-1.5x faster on one
  thread, not enough to carry a C++ build.
- `cpu_adamw_`: the host AdamW of the unselected columns: torch's fused CPU AdamW kernel (measured ~2
  Gparam/s on 2 cores, as fast as DeepSpeedCPUAdam, no JIT build). Swap the kernel here and nowhere else.
  `cpu_adamw_runs_` takes rows at different update counts, one run of rows per count (`cut_rows`), in one call;
  rows out of count order are gathered by count first and written back (`gather_by_count`, `cpu_adamw_gathered_`).

All follow torch.optim.AdamW exactly: decoupled weight decay, then moments, then the bias-corrected step.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.optim.adamw import adamw as _torch_adamw

from zenflow_compile.triton_kernels import adamw_slab_, column_sq_norms
from zenflow_compile.triton_kernels._triton import triton_available


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
    `columns` [n, m], `values` [n, R, m] (any strides), in a fixed number of calls: one batched copy when
    `whole` (the columns are all of them, in order), an index_copy_ for one parameter, else the parameters
    gathered into one [n, R, C] buffer, the columns scattered in and the buffer copied back (the parameters of
    a shared slab are small)."""
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


# Elements per conversion chunk (a 4 MB fp32 scratch): measured here on one thread, 64K / 256K / 1M / 4M
# elements gave 1.56 / 2.42 / 2.56 / 2.30 Gparam/s; fewer, larger chunks also mean fewer parallel regions
# when the worker runs several intra-op threads.
_ACCUMULATE_CHUNK = 1 << 20


def accumulate_scaled_many_(accs: list[torch.Tensor], grads: list[torch.Tensor], coef: float,
                            square_accs: Optional[list[torch.Tensor]] = None) -> None:
    """acc += coef * grad over many tensors: the same-dtype ones in one `_foreach_add_`, the bf16/fp16 ones
    chunk by chunk through a reused fp32 scratch. `square_accs` (interval_second_moment): also square_acc +=
    (coef * grad)**2, one per acc."""
    if square_accs is not None and len(square_accs) != len(accs):
        raise ValueError(f"accumulate_scaled_many_: {len(square_accs)} square_accs for {len(accs)} accs; pass "
                         "one per acc (or None)")
    squares = square_accs if square_accs is not None else [None] * len(accs)
    same, converted = [], []
    for triple in zip(accs, grads, squares):
        (same if triple[1].dtype == triple[0].dtype else converted).append(triple)
    if same:
        torch._foreach_add_([a for a, _, _ in same], [g for _, g, _ in same], alpha=coef)
        if square_accs is not None:
            same_grads = [g for _, g, _ in same]
            torch._foreach_addcmul_([q for _, _, q in same], same_grads, same_grads, value=coef * coef)
    if not converted:
        return
    for acc, grad, square in converted:
        if not (acc.is_contiguous() and grad.is_contiguous() and (square is None or square.is_contiguous())):
            raise ValueError(
                f"accumulate_scaled_many_: a {grad.dtype} gradient is accumulated into a {acc.dtype} accumulator "
                f"through a flat view, so both (and the square accumulator) must be contiguous; got strides "
                f"{acc.stride()} and {grad.stride()}. Pass .contiguous() tensors (the runtime's host buffers are).")
    for acc, grad, square in converted:
        _accumulate_converted_(acc, grad, coef, square)


def _accumulate_converted_(acc: torch.Tensor, grad: torch.Tensor, coef: float,
                           square: Optional[torch.Tensor] = None) -> None:
    flat_acc, flat_grad = acc.view(-1), grad.view(-1)
    flat_square = None if square is None else square.view(-1)
    scratch = torch.empty(min(_ACCUMULATE_CHUNK, flat_acc.numel()), dtype=acc.dtype, device="cpu")
    for start in range(0, flat_acc.numel(), _ACCUMULATE_CHUNK):
        end = min(start + _ACCUMULATE_CHUNK, flat_acc.numel())
        chunk = scratch[:end - start]
        chunk.copy_(flat_grad[start:end])
        flat_acc[start:end].add_(chunk, alpha=coef)
        if flat_square is not None:
            flat_square[start:end].addcmul_(chunk, chunk, value=coef * coef)


def cpu_adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_sqs: Optional[list[torch.Tensor]] = None,
    grad_divisor: float = 1.0,
) -> None:
    """Fused CPU AdamW over host tensors; each `steps[i]` is a float32 scalar tensor it increments.

    `grad_divisor`: the gradients are sums of that many steps; the kernel divides them as it reads them (and
    leaves the quotient in `grads`): the same values as dividing first, one pass over them fewer.
    `grad_sqs` (interval_second_moment): exp_avg_sq takes grad_sqs[i] / grad_divisor where AdamW takes
    (grads[i] / grad_divisor)**2, through `shift_second_moment_` (one extra pass over v instead of an unfused
    AdamW)."""
    if not params:
        return
    if grad_sqs is not None:
        shift_second_moment_(exp_avg_sqs, grads, grad_sqs, beta2, grad_divisor)
    grad_scale = None if grad_divisor == 1.0 else torch.tensor(float(grad_divisor), device="cpu")
    _torch_adamw(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        fused=True, amsgrad=False, maximize=False, grad_scale=grad_scale,
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
    )


def shift_second_moment_(exp_avg_sqs: list[torch.Tensor], grads: list[torch.Tensor], grad_sqs: list[torch.Tensor],
                         beta2: float, grad_divisor: float = 1.0) -> None:
    """interval_second_moment, before an AdamW kernel that squares the gradient itself: exp_avg_sq += (1 - beta2)
    / beta2 * (grad_sq - grad**2) (both / grad_divisor), so that the kernel's beta2 * v + (1 - beta2) * grad**2
    lands on beta2 * v + (1 - beta2) * grad_sq."""
    if beta2 == 0.0:
        raise ValueError("interval_second_moment needs betas[1] > 0 (with beta2 = 0 AdamW keeps no second "
                         "moment to size); set betas[1] > 0 or interval_second_moment=False")
    shift = (1.0 - beta2) / beta2
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=-shift / grad_divisor ** 2)
    torch._foreach_add_(exp_avg_sqs, grad_sqs, alpha=shift / grad_divisor)


def cut_rows(tensors: list[Optional[torch.Tensor]], lengths: list[int]) -> list[tuple]:
    """(master, grad, exp_avg, exp_avg_sq, grad_sq) 2-D row tensors cut into runs of `lengths` rows: one tuple
    per run (for `cpu_adamw_runs_`)."""
    return list(zip(*(t.split(lengths) if t is not None else [None] * len(lengths) for t in tensors)))


def cpu_adamw_runs_(runs: list, steps: torch.Tensor, hyperparameters: dict) -> None:
    """One fused CPU AdamW over `runs` ((master, grad, exp_avg, exp_avg_sq, grad_sq) each), run i at update
    count steps[i] (`steps` itself is left as it is)."""
    masters, grads, exp_avgs, exp_avg_sqs, grad_sqs = (list(column) for column in zip(*runs))
    cpu_adamw_(masters, grads, exp_avgs, exp_avg_sqs, steps.clone().unbind(0),  # (incremented in place)
               grad_sqs=None if grad_sqs[0] is None else grad_sqs, **hyperparameters)


class RowsByCount(NamedTuple):
    """Some rows of (master, grad, exp_avg, exp_avg_sq, grad_sq) 2-D row tensors, gathered in update-count
    order (`gather_by_count`): `order` the rows, `values` / `lengths` their runs of equal count."""

    order: torch.Tensor
    values: torch.Tensor
    lengths: list[int]
    gathered: list[Optional[torch.Tensor]]


def gather_by_count(state: list[Optional[torch.Tensor]], rows: torch.Tensor, counts: torch.Tensor) -> RowsByCount:
    """Copies of rows `rows` of the row tensors `state`, in the order of their update counts `counts[row]`."""
    order = rows[counts[rows].argsort(stable=True)]
    values, lengths = torch.unique_consecutive(counts[order], return_counts=True)
    gathered = [None if t is None else t.index_select(0, order) for t in state]
    return RowsByCount(order, values, lengths.tolist(), gathered)


def cpu_adamw_gathered_(state: list[Optional[torch.Tensor]], taken: RowsByCount, hyperparameters: dict) -> None:
    """One fused CPU AdamW over the rows `gather_by_count` took from `state`, one run per count, and their new
    master and moments written back into `state`'s rows."""
    if not taken.order.numel():
        return
    cpu_adamw_runs_(cut_rows(taken.gathered, taken.lengths), taken.values, hyperparameters)
    for target, updated in zip((state[0], state[2], state[3]), (taken.gathered[0], taken.gathered[2],
                                                                taken.gathered[3])):
        target.index_copy_(0, taken.order, updated)
