"""A slab's AdamW: the device update of its selected columns (every step), the CPU update of its host rows
(at a boundary, on the update worker, from the interval's mean gradient) and its result published into the
pinned weights buffer and applied to the members' parameters."""

from __future__ import annotations

from typing import Optional

import torch

from zenflow_compile.runtime import kernels
from zenflow_compile.runtime.state.columns import settle_departing
from zenflow_compile.runtime.state.intake import wait_for_accumulators
from zenflow_compile.runtime.state.slab import Slab
from zenflow_compile.runtime.transfers import wait_events

# Runs of equal update count shorter than this on average (host rows out of count order) are updated apart
# from the most common count: one fused call per run would cost more than gathering them.
SHORT_RUN_ROWS = 64


def update_on_device(slab: Slab, rows: Optional[list[int]], *, grad_scale, **hyperparameters) -> None:
    """AdamW of the selected columns of members `rows` (None: all), written into their parameters."""
    if not slab.k:
        return
    index = None if rows is None else slab.transfers.indices_to_device([torch.tensor(rows, device="cpu")])[0]
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
    """Update worker, at a boundary: the CPU AdamW of the host columns of the members in
    `members_by_scale` (lr multiplier -> [(member index, steps accumulated)], in member order), from the mean
    of each member's accumulated gradients (the kernel divides the sums: one call per lr multiplier and
    number of steps); then empty the accumulators and publish the new columns."""
    wait_for_accumulators(slab, acc_slot)
    sums = slab.host_sums(acc_slot)
    acc, squares = sums[0], (sums[1] if slab.accumulate_squares else None)
    for scale, taking in members_by_scale.items():
        by_steps: dict[int, list[int]] = {}
        for i, steps in taking:
            by_steps.setdefault(steps, []).append(i)
        for steps, rows in by_steps.items():
            everyone = len(rows) == slab.n
            host_adamw_(slab, rows, everyone, acc, squares,
                        dict(hyperparameters, lr=hyperparameters["lr"] * scale, grad_divisor=steps))
            if everyone:
                slab.host_counts.add_(1)
            else:
                slab.host_counts[rows] += 1
    if not slab.accumulates_on_device:  # (device accumulation: the next boundary's copy overwrites them)
        torch._foreach_zero_(sums)
    publish_host_weights(slab)


def host_adamw_(slab: Slab, rows: list[int], everyone: bool, acc: torch.Tensor, squares: Optional[torch.Tensor],
                hyperparameters: dict) -> None:
    """The CPU AdamW of the host columns of members `rows` (gradient `acc`), each row stepping with its own
    update count. Rows in count order form a few runs of equal count: one fused-AdamW tensor each (the
    whole slab is one [n * u, R] tensor whose runs may span members). Out of order (after reselections
    made in flight) runs are many and short: the rows of the most common count then go through the kernel
    in one tensor per block, and the others are gathered by count, updated apart and written back over
    what that call left in their rows (the same arithmetic, row by row)."""
    state = (slab.host_master, acc, slab.host_exp_avg, slab.host_exp_avg_sq, squares)
    views = lambda view: [None if t is None else view(t) for t in state]
    # (block: the row views of `state` one kernel call takes, with the rows' update counts)
    if everyone:
        blocks = [(views(lambda t: t.reshape(slab.n * slab.u, slab.R)), slab.host_counts.reshape(-1))]
    else:
        blocks = [(views(lambda t, i=i: t[i]), slab.host_counts[i]) for i in rows]
    runs = [torch.unique_consecutive(counts, return_counts=True) for _, counts in blocks]
    if sum(len(values) for values, _ in runs) * SHORT_RUN_ROWS <= sum(len(c) for _, c in blocks):
        for (block, _), (values, lengths) in zip(blocks, runs):
            kernels.cpu_adamw_runs_(kernels.cut_rows(block, lengths.tolist()), values, hyperparameters)
        return
    distinct, frequency = torch.unique(torch.cat([counts for _, counts in blocks]), return_counts=True)
    common = distinct[frequency.argmax()]
    # (the rows apart are copied before the common count's call writes over them)
    apart = [(block, kernels.gather_by_count(block, (counts != common).nonzero().squeeze(1), counts))
             for block, counts in blocks]
    kernels.cpu_adamw_runs_([block for block, _ in blocks], common.expand(len(blocks)), hyperparameters)
    for block, taken in apart:
        kernels.cpu_adamw_gathered_(block, taken, hyperparameters)


def publish_host_weights(slab: Slab) -> None:
    """After a CPU update: cast the new masters into the free weights buffer for the next upload. With
    `upload_early`, the upload is queued at once (on the update worker), so that by the apply it has
    landed and the merge does not wait for it."""
    free = slab.weights_slot ^ 1
    wait_events([slab.upload_done[free]])
    slab.transfers.host_access(writes=[slab.host_weights[free]])
    slab.host_weights[free].copy_(slab.host_master)
    slab.weights_slot = free
    if slab.upload_early:
        slab.uploaded = slab.transfers.upload_ahead(slab.host_weights[free])
        slab.upload_done[free] = slab.uploaded[1]


def apply_host_columns(slab: Slab, data_parallel=None) -> int:
    """Write the latest CPU-updated columns into the members' parameters; returns the bytes uploaded.
    Data parallel: each member's owner uploads and broadcasts its columns, the other ranks receive them.
    Called once the update has finished."""
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


__all__ = ["SHORT_RUN_ROWS", "apply_host_columns", "host_adamw_", "publish_host_weights", "update_host_columns",
           "update_on_device"]
