"""A parameter's checkpoint entry <-> its `MemberState`: the optimizer state in the parameter's natural layout.

A matrix's entry ([R, C] = [shape[0], rest]): fp32 `master`, `exp_avg`, `exp_avg_sq` [R, C], per-column counts
`step` [C], `selected` (bool [C]), `host_row` (int64 [C]: each host column's row in the host layout, -1 if
selected; a resumed run lays its rows out in that order, so it goes on bitwise as the saving run would have),
the interval's `accumulator` (and `square_accumulator`) over the host columns, `steps_accumulated`, Zen-auto's
sums `zen_auto`, `unapplied` while a CPU update has not reached the device; where the device does not hold the
master cast, `device_columns` (the host columns: an update pending, or after a cast) and `device_selected`
([R, k] param dtype: the selected columns, after a cast until the device update rewrites them). A vector's
entry: master, moments (its shape) and count ([1]). Data parallel, a matrix whose host part another rank owns:
only this rank's device part (`host_owner`, `host_columns`, `selected_*`: `device_part`).

DCP's form (`dcp_form`): DCP loads into the tensors of a template state_dict, so every entry of one parameter has
the same keys, tensors only, and `has_state` (0-d bool) says whether it is a state at all or the template of a
parameter with none yet (`fresh_entry`), which a load skips.
"""

from __future__ import annotations

import torch

from zenflow_compile.runtime.state.layout import host_order, matrix_shape
from zenflow_compile.runtime.state.members import Member, MemberState


def export_entry(member: Member) -> dict:
    """Member's checkpoint entry (call with no CPU work in flight): contiguous tensors of the natural layout."""
    entry = {key: value.contiguous() if isinstance(value, torch.Tensor) else value
             for key, value in _entry(member).items()}
    if member.slab.selected_written is not None:
        entry["device_selected"] = member.slab.selected_written[member.index].cpu()
    return entry


def _entry(member: Member) -> dict:
    slab, i = member.slab, member.index
    if not member.is_matrix:
        state = slab.export_member(i)
        shape = member.param.shape
        return dict(master=state.master.reshape(shape), exp_avg=state.exp_avg.reshape(shape),
                    exp_avg_sq=state.exp_avg_sq.reshape(shape), step=state.step.clone())
    selected = torch.zeros(member.cols, dtype=torch.bool, device="cpu")
    selected[slab.selected_cpu[i]] = True
    selection = dict(selected=selected, steps_accumulated=member.steps_accumulated,
                     zen_auto=torch.tensor([member.sum_selected_score, member.sum_unselected_score],
                                           dtype=torch.float64, device="cpu"))
    if slab.u and not slab.has_host_part:
        exp_avg, exp_avg_sq = slab.moments_for_host()
        return dict(selection, host_owner=member.owner, host_columns=slab.host_columns_cpu[i].clone(),
                    selected_master=slab.master[i].cpu(), selected_exp_avg=exp_avg[i].cpu(),
                    selected_exp_avg_sq=exp_avg_sq[i].cpu(), selected_step=slab.counts[i].cpu(),
                    unapplied=slab.unapplied)
    state = slab.export_member(i)
    entry = dict(master=state.master, exp_avg=state.exp_avg, exp_avg_sq=state.exp_avg_sq, step=state.step,
                 **selection)
    entry["accumulator"] = (state.accumulator if state.accumulator is not None
                            else torch.zeros(member.rows, member.cols, device="cpu"))
    if slab.accumulate_squares:
        entry["square_accumulator"] = (state.square_accumulator if state.square_accumulator is not None
                                       else torch.zeros(member.rows, member.cols, device="cpu"))
    host = slab.host_columns_cpu[i]  # ([u] in row order: `host_row` is each one's row, -1 for a selected column)
    entry["host_row"] = torch.full((member.cols,), -1, dtype=torch.long, device="cpu").scatter_(
        0, host, torch.arange(len(host), device="cpu"))
    if slab.u:  # `device_columns`: only where the device does not hold the master cast
        if state.unapplied or not torch.equal(state.applied[:, host], state.master[:, host].to(slab.dtype)):
            entry["device_columns"] = state.applied
        if state.unapplied:
            entry["unapplied"] = True
    return entry


def _host_columns(entry: dict) -> "torch.Tensor | None":
    """The host columns in row order that an entry's `host_row` gives (None: it gives none, the counts decide)."""
    host_row = entry.get("host_row")
    return None if host_row is None else torch.argsort(host_row, stable=True)[int((host_row < 0).sum()):].clone()


def state_from_entry(member: Member, entry: dict) -> MemberState:
    """The MemberState a checkpoint entry describes (and the member's bookkeeping restored)."""
    R, C = member.rows, member.cols
    written = entry.get("device_selected")
    if not member.is_matrix:
        return MemberState(*(entry[k].float().reshape(R, C) for k in ("master", "exp_avg", "exp_avg_sq")),
                           entry["step"].float().reshape(C), torch.zeros(0, dtype=torch.long, device="cpu"),
                           selected_written=written)
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
        state.selected_written = written
        return state
    return MemberState(*(entry[k].float() for k in ("master", "exp_avg", "exp_avg_sq", "step")), selected,
                       host_columns=_host_columns(entry), accumulator=entry["accumulator"].float(),
                       square_accumulator=(entry["square_accumulator"].float() if "square_accumulator" in entry
                                           else None),
                       applied=entry.get("device_columns"), unapplied=bool(entry.get("unapplied", False)),
                       selected_written=written)


def fresh_entry(values: torch.Tensor, accumulate_squares: bool) -> dict:
    """The entry of a parameter (or a sharded one's local rows) before its first gradient, so that a fresh
    optimizer's `state_dict()` is a full template for `dcp.load`."""
    local = values.detach()
    matrix = local.dim() >= 2
    master = (local.reshape(matrix_shape(local)) if matrix else local).float().cpu().clone()
    cols = master.shape[1] if matrix else 1
    entry = dict(master=master, exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master),
                 step=torch.zeros(cols, device="cpu"))
    if matrix:
        entry.update(selected=torch.zeros(cols, dtype=torch.bool, device="cpu"), steps_accumulated=0,
                     zen_auto=torch.zeros(2, dtype=torch.float64, device="cpu"), accumulator=torch.zeros_like(master),
                     host_row=torch.full((cols,), -1, dtype=torch.long, device="cpu"))
        if accumulate_squares:
            entry["square_accumulator"] = torch.zeros_like(master)
    return entry


def dcp_form(entry: dict, dtype: torch.dtype, has_state: bool) -> dict:
    """`entry` (of a parameter of `dtype`) in DCP's form (module docstring), an absent key filled with what it
    means: `device_columns` the master cast (what the device holds), `unapplied` False."""
    out = dict(entry, has_state=torch.tensor(has_state, device="cpu"))
    if "selected" in out:  # a matrix
        if "device_columns" not in out:  # (a copy: DCP loads into each tensor, an fp32 cast would be the master)
            out["device_columns"] = out["master"].to(dtype, copy=True)
        out["unapplied"] = torch.tensor(bool(out.get("unapplied", False)), device="cpu")
        out["steps_accumulated"] = torch.tensor(int(out["steps_accumulated"]), device="cpu")
    return out


def saved_shape(entry: dict) -> "tuple[int, ...] | None":
    """The shape of the state an entry holds, as `expected_shape` gives it; None where the entry does not say."""
    if "master" in entry:
        return tuple(entry["master"].shape)
    if "selected_master" in entry:  # a data-parallel device part
        return entry["selected_master"].shape[0], entry["selected"].numel()
    return None


def host_row_problem(entry: dict) -> "str | None":
    """Why an entry's `host_row` is not an order of its unselected columns (each of them a row 0..u-1 once, -1
    for the selected ones), or None (it is, or the entry has none)."""
    host_row, selected = entry.get("host_row"), entry.get("selected")
    if host_row is None or selected is None:
        return None
    on_host = host_row >= 0
    if (host_row.shape != selected.shape or not torch.equal(on_host, ~selected.bool())
            or not torch.equal(host_row[on_host].sort().values, torch.arange(int(on_host.sum()), device="cpu"))):
        return "its host_row is not an order of its unselected columns (each of them a row 0..u-1 once, -1 else)"
    return None


def expected_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of the state `param` (or a shard's rows) takes: a vector's own, a matrix's [rows, columns]."""
    return matrix_shape(param) if param.dim() >= 2 else tuple(param.shape)


def holds_state(entry: dict) -> bool:
    """Whether a loaded entry is a parameter's state (not empty, not a template of a parameter without one)."""
    return bool(entry) and bool(entry.get("has_state", True))


def device_part(entry: dict, owner: int) -> dict:
    """Data parallel: what every rank's device holds of the state in a matrix's full `entry` (its owner's), in
    the form a non-owner exports and imports (`host_owner`): the selection, the selected columns' state, the
    order of the host columns. A vector's, or a matrix's with every column selected, is all of it."""
    if "selected" not in entry or bool(entry["selected"].all()):
        return entry
    mask = entry["selected"]
    step = entry["step"].float()
    host_columns = _host_columns(entry)
    if host_columns is None:
        host_columns = host_order(step.unsqueeze(0), mask.nonzero().flatten().unsqueeze(0))[0]
    part = dict(selected=mask.clone(), steps_accumulated=entry["steps_accumulated"], zen_auto=entry["zen_auto"],
                host_owner=owner, host_columns=host_columns,
                selected_master=entry["master"][:, mask], selected_exp_avg=entry["exp_avg"][:, mask],
                selected_exp_avg_sq=entry["exp_avg_sq"][:, mask], selected_step=step[mask],
                unapplied=bool(entry.get("unapplied", False)))
    if "device_selected" in entry:
        part["device_selected"] = entry["device_selected"]
    return part


def with_device_parts(owned: dict[int, dict], pids: list[int], data_parallel) -> dict[int, dict]:
    """Data parallel, a load: this rank's own entries (`owned`) and, from their owners, the device part of every
    other parameter's state (one broadcast per rank), in pid order, so every rank builds the same slabs in the
    same order. `pids`: the optimizer's parameters in order (sent by place: ids are each process's own)."""
    place = {pid: i for i, pid in enumerate(pids)}
    rank = data_parallel.rank
    mine = {place[pid]: device_part(entry, rank) for pid, entry in owned.items()}
    entries = dict(owned)
    for sender in range(data_parallel.world_size):
        parts = data_parallel.broadcast_object(mine if sender == rank else None, sender)
        if sender != rank:
            entries.update((pids[index], part) for index, part in parts.items())
    return dict(sorted(entries.items()))


__all__ = ["export_entry", "state_from_entry", "fresh_entry", "dcp_form", "saved_shape", "host_row_problem",
           "expected_shape", "holds_state", "device_part", "with_device_parts"]
