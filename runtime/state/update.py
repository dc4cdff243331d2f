"""A slab's AdamW: the device update of its selected columns (every step), the CPU update of its host rows (at a
boundary, on the update worker) and that update applied to the members' parameters."""

from __future__ import annotations

from typing import Optional

import torch

from zenflow_compile.runtime import kernels
from zenflow_compile.runtime.state.columns import settle_departing
from zenflow_compile.runtime.state.intake import wait_for_accumulators
from zenflow_compile.runtime.state.slab import Slab
from zenflow_compile.runtime.transfers import wait_events


def update_on_device(slab: Slab, rows: Optional[list[int]], *, grad_scale, **hyperparameters) -> None:
    """AdamW of the selected columns of members `rows` (None: all), written into their parameters."""
    if not slab.k:
        return
    index = None if rows is None else slab.transfers.indices_to_device([torch.tensor(rows, device="cpu")])[0]
    with slab.moments_on_device():
        kernels.device_adamw_(slab.grad, slab.master, slab.exp_avg, slab.exp_avg_sq, slab.counts,
                              slab.params, slab.selected, rows=rows, index=index, whole=slab.whole,
                              grad_scale=grad_scale, master_rows=slab.master_rows, **hyperparameters)
    if slab.selected_written is not None:  # the update wrote the masters into these members' columns
        if rows is None:
            slab.selected_written = None
        else:
            slab.selected_written[index] = slab.master[index].to(slab.dtype)


def update_host_columns(slab: Slab, members_by_scale: dict[float, list[tuple[int, int]]], acc_slot: int,
                        hyperparameters: dict) -> None:
    """Update worker, at a boundary: the CPU AdamW of the host columns of the members in `members_by_scale`
    (lr multiplier -> [(member index, steps accumulated)]) from their mean gradients, one call over the slab's rows
    whatever their order; the new masters cast into the free weights buffer in the same pass (uploaded at once
    with `upload_early`). Then the accumulators are emptied."""
    wait_for_accumulators(slab, acc_slot)
    sums = slab.host_sums(acc_slot)
    free = slab.weights_slot ^ 1
    wait_events([slab.upload_done[free]])  # (an upload may still read the buffer the update writes)
    slab.transfers.host_access(writes=[slab.host_weights[free]])
    scale, steps = slab.member_rates(members_by_scale)
    rows = lambda t: t.view(slab.n * slab.u, slab.R)
    kernels.cpu_adamw_(rows(slab.host_master), rows(sums[0]), rows(slab.host_exp_avg), rows(slab.host_exp_avg_sq),
                       slab.host_counts.view(-1), lr_scale=scale.repeat_interleave(slab.u),
                       divisor=steps.float().repeat_interleave(slab.u), weights=rows(slab.host_weights[free]),
                       grad_sq=rows(sums[1]) if slab.accumulate_squares else None, **hyperparameters)
    if not slab.accumulates_on_device:  # (device accumulation: the next boundary's copy overwrites them)
        torch._foreach_zero_(sums)
    slab.weights_slot = free
    if slab.upload_early:
        slab.uploaded = slab.transfers.upload_ahead(slab.host_weights[free])
        slab.upload_done[free] = slab.uploaded[1]


def apply_host_columns(slab: Slab, data_parallel=None) -> int:
    """Once the CPU update has finished: its columns into the members' parameters; returns the bytes uploaded.
    Data parallel: each member's owner uploads and broadcasts its columns."""
    settle_departing(slab)
    uploaded, slab.uploaded = slab.uploaded, None
    slab.unapplied = False
    if not slab.u:
        return 0
    if data_parallel is None:
        if uploaded is None:
            values, slab.upload_done[slab.weights_slot] = slab.transfers.to_device(
                slab.host_weights[slab.weights_slot])
        else:
            values = uploaded[0]
            slab.transfers.use_upload(*uploaded)
        kernels.write_columns_(slab.params, slab.host_columns, values.transpose(1, 2))
        return values.numel() * values.element_size()
    uploaded = 0
    for i, member in enumerate(slab.members):
        if slab.has_host_part:
            slot = slab.weights_slot
            values, done = slab.transfers.to_device(slab.host_weights[slot][i])
            slab.upload_done[slot] = done
            uploaded += values.numel() * values.element_size()
        else:
            values = torch.empty(slab.u, slab.R, dtype=slab.dtype, device=slab.device)
        data_parallel.broadcast(values, member.owner)
        kernels.write_columns_([member.as_columns()], slab.host_columns[i:i + 1], values.t().unsqueeze(0))
    return uploaded


__all__ = ["apply_host_columns", "update_host_columns", "update_on_device"]
