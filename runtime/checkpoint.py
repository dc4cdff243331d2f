"""A parameter's checkpoint entry <-> its `MemberState`: the optimizer state in the parameter's natural layout.

Entry of a matrix ([R, C] = [shape[0], rest]): fp32 `master`, `exp_avg`, `exp_avg_sq` [R, C], per-column
update counts `step` [C], `selected` (bool [C]), the interval's `accumulator` (and `square_accumulator`) over
the host columns, `steps_accumulated`, Zen-auto's sums `zen_auto`, and while a CPU update has not reached the
device `unapplied`; `device_columns`: the host columns as the device holds them, where that is not the
master cast (while an update is pending, or after a cast). A vector's entry holds
its master, moments (its shape) and count ([1]). After a cast, until the device update rewrites them,
`device_selected` ([R, k] in the parameter's dtype): the selected columns as the device holds them. Data parallel, a matrix whose host part another rank owns:
only this rank's device part (`host_owner`, `host_columns`, `selected_*`).
"""

from __future__ import annotations

import torch

from zenflow_compile.runtime.slab import Member, MemberState, Slab


def export_entry(member: Member, acc_slot: int) -> dict:
    """Member's checkpoint entry (call with no CPU work in flight)."""
    entry = _entry(member, acc_slot)
    if member.slab.selected_written is not None:
        entry["device_selected"] = member.slab.selected_written[member.index].cpu()
    return entry


def _entry(member: Member, acc_slot: int) -> dict:
    slab, i = member.slab, member.index
    if not member.is_matrix:
        state = slab.export_member(i, acc_slot)
        shape = member.param.shape
        return dict(master=state.master.reshape(shape), exp_avg=state.exp_avg.reshape(shape),
                    exp_avg_sq=state.exp_avg_sq.reshape(shape), step=state.step.clone())
    selection = _selection_entry(member)
    if slab.u and not slab.has_host_part:
        return dict(selection, host_owner=member.owner, host_columns=slab.host_columns_cpu[i].clone(),
                    selected_master=slab.master[i].cpu(), selected_exp_avg=slab.exp_avg[i].cpu(),
                    selected_exp_avg_sq=slab.exp_avg_sq[i].cpu(), selected_step=slab.counts[i].cpu(),
                    unapplied=slab.unapplied)
    state = slab.export_member(i, acc_slot)
    entry = dict(master=state.master, exp_avg=state.exp_avg, exp_avg_sq=state.exp_avg_sq, step=state.step,
                 **selection)
    entry["accumulator"] = state.accumulator if state.accumulator is not None else torch.zeros(member.rows,
                                                                                               member.cols)
    if slab.accumulate_squares:
        entry["square_accumulator"] = (state.square_accumulator if state.square_accumulator is not None
                                       else torch.zeros(member.rows, member.cols))
    if slab.u:
        # What the device holds for the host columns, where it is not the master cast: until a pending update
        # is applied (overlap), or after a cast.
        host = slab.host_columns_cpu[i]
        if state.unapplied or not torch.equal(state.applied[:, host], state.master[:, host].to(slab.dtype)):
            entry["device_columns"] = state.applied
        if state.unapplied:
            entry["unapplied"] = True
    return entry


def _selection_entry(member: Member) -> dict:
    slab, i = member.slab, member.index
    selected = torch.zeros(member.cols, dtype=torch.bool)
    selected[slab.selected_cpu[i]] = True
    return dict(selected=selected, steps_accumulated=member.steps_accumulated,
                zen_auto=torch.tensor([member.sum_selected_score, member.sum_unselected_score], dtype=torch.float64))


def state_from_entry(member: Member, entry: dict) -> MemberState:
    """The MemberState a checkpoint entry describes (and the member's bookkeeping restored)."""
    state = _state(member, entry)
    state.selected_written = entry.get("device_selected")
    return state


def _state(member: Member, entry: dict) -> MemberState:
    R, C = member.rows, member.cols
    if not member.is_matrix:
        return MemberState(*(entry[k].float().reshape(R, C) for k in ("master", "exp_avg", "exp_avg_sq")),
                           entry["step"].float().reshape(C), torch.zeros(0, dtype=torch.long))
    selected = entry["selected"].nonzero().flatten()
    member.sum_selected_score, member.sum_unselected_score = entry["zen_auto"].tolist()
    member.steps_accumulated = int(entry["steps_accumulated"])
    if "host_owner" in entry:  # a data-parallel share: this rank's device part only
        state = MemberState.unknown(R, C, selected)
        for full, part in ((state.master, "selected_master"), (state.exp_avg, "selected_exp_avg"),
                           (state.exp_avg_sq, "selected_exp_avg_sq")):
            full[:, selected] = entry[part].float()
        state.step[selected] = entry["selected_step"].float()
        state.host_columns = entry["host_columns"].clone()
        state.unapplied = bool(entry.get("unapplied", False))
        return state
    state = MemberState(*(entry[k].float() for k in ("master", "exp_avg", "exp_avg_sq", "step")), selected)
    state.accumulator = entry["accumulator"].float()
    if "square_accumulator" in entry:
        state.square_accumulator = entry["square_accumulator"].float()
    state.unapplied = bool(entry.get("unapplied", False))
    state.applied = entry.get("device_columns")
    return state


__all__ = ["export_entry", "state_from_entry", "Slab"]
