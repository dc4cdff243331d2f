"""Columns changing sides: a reselection moves each arriving column's state (master, moments, update count)
from its host row onto the device and each departing column's into the host row its member's arriving column
left, in place, in a fixed number of calls per slab (k and u stay), while the boundary's CPU update runs on:
the arriving columns take their share of it first (`take_arriving`), the device side moves
(`_move_device_columns`), and the departing columns wait for that update to finish (`settle_departing`). Host
rows stay out of update-count order (`kernels.cpu_adamw_` takes them in any order; re-sorting would copy the
whole host state). Data parallel, the owner of a slab's host part broadcasts the arriving columns' state."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from zenflow_compile.runtime import kernels
from zenflow_compile.runtime.state.intake import wait_for_accumulators
from zenflow_compile.runtime.state.layout import columns_index, columns_not_in, host_order
from zenflow_compile.runtime.state.members import Member, MemberState
from zenflow_compile.runtime.state.slab import Slab
from zenflow_compile.runtime.transfers import wait_events

_STATE = ("master", "exp_avg", "exp_avg_sq")


class MovingColumns(NamedTuple):
    """Some columns' whole state, one row each (column j of member `member[j]`): `place` is its device slot
    (arriving columns) or host row (departing ones)."""

    member: torch.Tensor  # [m] int64
    place: torch.Tensor  # [m] int64
    master: torch.Tensor  # [m, R] fp32, on the host
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    counts: torch.Tensor  # [m] fp32
    weights: Optional[torch.Tensor] = None  # [m, R] param dtype: what the parameter holds (departing columns)
    on_device: bool = False  # the state tensors are on the device (else on the host)


class DepartingCopy(NamedTuple):
    """A reselection in flight's departing columns on their way to the host: `rows` (`_pack`ed, with the
    weights their parameters hold) is a host copy that `done` completes; `place` is each one's host row."""

    member: torch.Tensor  # [m] int64
    place: torch.Tensor  # [m] int64
    rows: torch.Tensor  # [m, 4R + 1] fp32
    done: object  # (None: already there)


def _pack(state: list[torch.Tensor], counts: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Columns' master, exp_avg, exp_avg_sq ([m, R] each) and counts ([m]) as one [m, 3R + 1] tensor (into `out`)."""
    return torch.cat([*state, counts.unsqueeze(1)], 1, out=out)


def _unpack(rows: torch.Tensor, R: int, member: torch.Tensor, place: torch.Tensor,
            weights_dtype: Optional[torch.dtype] = None) -> MovingColumns:
    """`_pack`'s rows (on the host) as MovingColumns; `weights_dtype`: [m, R] weights follow the counts."""
    weights = None if weights_dtype is None else rows[:, 3 * R + 1:].to(weights_dtype)
    return MovingColumns(member, place, rows[:, :R], rows[:, R:2 * R], rows[:, 2 * R:3 * R], rows[:, 3 * R], weights)


def take_arriving(slab: Slab, selected: torch.Tensor, members_by_scale: dict[float, list[tuple[int, int]]],
                  hyperparameters: dict, data_parallel=None) -> Optional[MovingColumns]:
    """Before this boundary's CPU update is launched, with no CPU work in flight: the AdamW step of the columns
    `selected` ([n, k]) brings onto the device, from their host rows and the interval's sums (the launched update
    redoes those rows, unused). Where the device sums, it runs there (their rows go up in one copy, nothing is
    read back); else a CPU AdamW on copies of their rows. `members_by_scale` as in `update_host_columns`.
    Returns their state for `reselect_in_flight` (None: no column arrives); data parallel, the owner's."""
    member, slot = columns_not_in(selected, slab.selected_cpu).nonzero(as_tuple=True)
    if not member.numel():
        return None
    arriving = None
    if slab.has_host_part:
        row = _host_position(slab)[member, selected[member, slot]]
        state = MovingColumns(member, slot, *(getattr(slab, "host_" + name)[member, row] for name in _STATE),
                              slab.host_counts[member, row])  # (copies: advanced indexing)
        scale, steps = slab.member_rates(members_by_scale)
        row_scale, steps = scale[member], steps[member].unsqueeze(1)
        update_arriving = _update_arriving_on_device if slab.accumulates_on_device else _update_arriving_on_host
        arriving = update_arriving(slab, state, row, row_scale, steps, hyperparameters)
    return arriving if data_parallel is None else _rows_from_owner(slab, data_parallel, member, slot, arriving)


def _update_arriving_on_host(slab: Slab, state: MovingColumns, row: torch.Tensor, row_scale: torch.Tensor,
                             steps: torch.Tensor, hyperparameters: dict) -> MovingColumns:
    """`take_arriving` from the host's sums: the CPU AdamW of the arriving columns on copies of their rows (one
    call, each row with its own count, lr multiplier and divisor)."""
    wait_for_accumulators(slab, slab.acc_slot)
    grad, *grad_sq = (sums[state.member, row] for sums in slab.host_sums(slab.acc_slot))
    kernels.cpu_adamw_(state.master, grad, state.exp_avg, state.exp_avg_sq, state.counts, lr_scale=row_scale,
                       divisor=steps.squeeze(1).float(), grad_sq=grad_sq[0] if grad_sq else None, **hyperparameters)
    return state


def _update_arriving_on_device(slab: Slab, state: MovingColumns, row: torch.Tensor, row_scale: torch.Tensor,
                               steps: torch.Tensor, hyperparameters: dict) -> MovingColumns:
    """`take_arriving` from the device's sums: the arriving rows go up and take their AdamW step there, each
    column a member of k = 1 for the slab kernel, one call per lr multiplier."""
    up = _upload(slab, state)
    m, R = len(state.member), slab.R
    scales = [scale for scale in row_scale.unique().tolist() if scale != 0.0]
    taking = [(row_scale == scale).nonzero().squeeze(1) for scale in scales]
    member, row, divisor, *taking = slab.transfers.indices_to_device([state.member, row, steps, *taking])
    sums = [s[member, row] for s in slab.device_sums()]  # [m, R] each (copies: advanced indexing)
    for s in sums:
        s.div_(divisor.float())  # the interval's mean, as the update computes it
    grad = sums[0].view(m, R, 1)
    master, exp_avg, exp_avg_sq = (t.contiguous().view(m, R, 1) for t in (up.master, up.exp_avg, up.exp_avg_sq))
    counts = up.counts.contiguous().view(m, 1)
    if len(sums) > 1:  # interval_second_moment: the second moment takes the mean of the squares
        kernels.shift_second_moment_([exp_avg_sq], [grad], [sums[1].view(m, R, 1)], hyperparameters["beta2"])
    for scale, rows in zip(scales, taking):
        kernels.adamw_slab_(grad, master, exp_avg, exp_avg_sq, counts, rows=rows,
                            **dict(hyperparameters, lr=hyperparameters["lr"] * scale))
    return MovingColumns(state.member, state.place, master.view(m, R), exp_avg.view(m, R), exp_avg_sq.view(m, R),
                         counts.view(m), on_device=True)


def _upload(slab: Slab, moving: MovingColumns) -> MovingColumns:
    """Columns' state on the device: `_pack`ed into a pinned buffer, one copy up that the compute stream waits for."""
    if moving.on_device:
        return moving
    slab.bytes_up += len(moving.member) * (3 * slab.R + 1) * 4  # (counted where the device is the host too)
    if slab.transfers.device_is_host:
        return moving
    pinned = slab.transfers.host_zeros((len(moving.member), 3 * slab.R + 1), torch.float32)
    slab.transfers.host_access(writes=[pinned])
    _pack([moving.master, moving.exp_avg, moving.exp_avg_sq], moving.counts, out=pinned)
    rows, _ = slab.transfers.to_device(pinned)
    return _unpack(rows, slab.R, moving.member, moving.place)._replace(on_device=True)


def reselect_in_flight(slab: Slab, selected: torch.Tensor, arriving: Optional[MovingColumns]) -> int:
    """Make `selected` the device columns while this boundary's CPU update (launched after `take_arriving`)
    runs over the host rows: the arriving columns take `arriving` and their masters are written into the
    parameters; each departing column takes the host row its member's arriving column leaves, its state kept
    aside (`departing`) until `settle_departing`. Returns how many columns changed sides."""
    if arriving is None:
        return 0
    old_selected, n, C, k = slab.selected_cpu, slab.n, slab.C, slab.k
    leaving = columns_not_in(old_selected, selected)  # [n, k] of the old slots
    departing_member, departing_slot = leaving.nonzero(as_tuple=True)  # (member by member, as arriving's)
    row = _host_position(slab)[arriving.member, selected[arriving.member, arriving.place]]
    host_columns = slab.host_columns_cpu.clone()
    host_columns[arriving.member, row] = old_selected[departing_member, departing_slot]
    old_slot = torch.zeros(n, C, dtype=torch.long, device="cpu")
    old_slot.scatter_(1, old_selected, torch.arange(k, device="cpu").expand(n, k))
    stay = old_slot.gather(1, selected)  # (an arriving column's entry is overwritten)
    at = MoveIndices(*slab.transfers.indices_to_device([stay, departing_member, departing_slot, arriving.member,
                                                        arriving.place, selected, host_columns, leaving.any(1)]))
    in_param = slab.master.to(slab.dtype) if slab.selected_written is None else slab.selected_written
    weights = in_param.transpose(1, 2)[at.departing_member, at.departing_slot]
    with slab.moments_on_device():
        departing = _move_device_columns(slab, at, arriving)
    if slab.has_host_part:  # (data parallel: the owner alone has host rows to settle them into)
        # Copied down on the copy stream, not read here: nothing needs them before the update has finished.
        rows, done = slab.transfers.copy_to_host(torch.cat([departing, weights.float()], 1))
        slab.departing = DepartingCopy(departing_member, row, rows, done)
        slab.bytes_down += rows.numel() * rows.element_size()
    # The new column sets; members whose columns changed hold their masters in every selected column from now
    # on. The step's gradients, gathered by the old columns, stay: the boundary's update took them, and a step's
    # first backward overwrites a member's gradient buffers before anything reads them.
    slab.selected_cpu, slab.host_columns_cpu = selected, host_columns
    slab.selected.copy_(at.selected)
    slab.host_columns.copy_(at.host_columns)
    if slab.selected_written is not None:
        slab.selected_written = torch.where(at.changed.view(-1, 1, 1), slab.master.to(slab.dtype),
                                            slab.selected_written)
    for slot_extras in slab.extra_grads:
        slot_extras.clear()
    kernels.write_columns_(slab.params, slab.selected, slab.master.to(slab.dtype) if slab.selected_written is None
                           else slab.selected_written)
    return 2 * int(departing_member.numel())


def settle_departing(slab: Slab) -> None:
    """The departing columns' state into the host rows they took, once the CPU update that ran over those
    rows has finished (call with no CPU work in flight); the host weights get what their parameters hold."""
    copy = slab.departing
    if copy is None:
        return
    wait_events([copy.done])
    slab.transfers.host_access(reads=[copy.rows])
    d = _unpack(copy.rows, slab.R, copy.member, copy.place, weights_dtype=slab.dtype)
    for name in _STATE:
        getattr(slab, "host_" + name)[d.member, d.place] = getattr(d, name)
    slab.host_counts[d.member, d.place] = d.counts
    wait_events(slab.upload_done)  # an upload may still read the weights of these rows
    slab.transfers.host_access(writes=slab.host_weights)
    for weights in slab.host_weights:
        weights[d.member, d.place] = d.weights
    slab.uploaded = None  # (an upload made before these rows changed: the apply uploads them again)
    slab.departing = None  # (last: a settle interrupted part-way, by a Ctrl-C, is done again whole by the next)


class MoveIndices(NamedTuple):
    """A move's indices on the device (`_move_device_columns`); `changed`: the members whose columns changed."""

    stay: torch.Tensor  # [n, k]
    departing_member: torch.Tensor  # [m]
    departing_slot: torch.Tensor
    arriving_member: torch.Tensor  # [m]
    arriving_place: torch.Tensor
    selected: torch.Tensor  # [n, k]
    host_columns: torch.Tensor  # [n, u]
    changed: torch.Tensor  # [n] bool


def _move_device_columns(slab: Slab, at: MoveIndices, arriving: MovingColumns) -> torch.Tensor:
    """The device side of a move: each new slot i of member j takes old slot at.stay[j, i], then the arriving
    columns' state is written in. Returns the departing columns' state, `_pack`ed on the device before any
    write (the caller copies it to the host)."""
    arriving = _upload(slab, arriving)
    departing_at, arriving_at = (at.departing_member, at.departing_slot), (at.arriving_member, at.arriving_place)
    outgoing = _pack([getattr(slab, name).transpose(1, 2)[departing_at] for name in _STATE],
                     slab.counts[departing_at])
    for name in _STATE:
        device_state = getattr(slab, name)
        by_column = device_state.transpose(1, 2)  # [n, k, R]: a column per row, like the host
        device_state.copy_(device_state.gather(2, columns_index(at.stay, slab.R)))
        by_column.index_put_(arriving_at, getattr(arriving, name))
    counts = slab.counts.gather(1, at.stay)
    counts[arriving_at] = arriving.counts
    slab.counts.copy_(counts)
    return outgoing


def _rows_from_owner(slab: Slab, data_parallel, member: torch.Tensor, place: torch.Tensor,
                     moving: Optional[MovingColumns]) -> MovingColumns:
    """Data parallel: columns' state, which only the owner of the slab's host part holds (`moving`; None
    elsewhere), on every rank: one broadcast."""
    if slab.has_host_part:
        data_parallel.broadcast(_pack([moving.master, moving.exp_avg, moving.exp_avg_sq], moving.counts)
                                .to(slab.device), slab.key.owner)
        return moving
    rows = torch.empty(len(member), 3 * slab.R + 1, device=slab.device)
    data_parallel.broadcast(rows, slab.key.owner)
    return _unpack(rows, slab.R, member, place)._replace(on_device=True)  # (moved in on the device, as they came)


def share_first_selection(member: Member, state: MemberState, data_parallel) -> None:
    """Data parallel, a first selection (made from the same scores on every rank): the owner's state and step
    gradient of the selected columns, and the order of the others, reach every rank (two broadcasts)."""
    columns = state.selected
    grad = state.step_grad if state.step_grad is not None else torch.zeros(member.rows, member.cols,
                                                                            dtype=member.param.dtype, device="cpu")
    packed = torch.cat([_pack([state.master[:, columns].t(), state.exp_avg[:, columns].t(),
                               state.exp_avg_sq[:, columns].t()], state.step[columns]),
                        grad[:, columns].t().float()], 1).to(member.param.device)
    data_parallel.broadcast(packed, member.owner)
    order = host_order(state.step.unsqueeze(0), columns.unsqueeze(0))[0].to(member.param.device)
    data_parallel.broadcast(order, member.owner)
    state.host_columns = order.cpu()
    if member.owns_host:
        return
    rows = packed.cpu()
    arrived = _unpack(rows, member.rows, columns, columns)
    for name in _STATE:
        getattr(state, name)[:, columns] = getattr(arrived, name).t()
    state.step[columns] = arrived.counts
    state.step_grad = grad  # (zeros where it had none)
    state.step_grad[:, columns] = rows[:, 3 * member.rows + 1:].t()  # (after the packed state: the gradient)


def _host_position(slab: Slab) -> torch.Tensor:
    """[n, C]: the host row of each host column (-1 for the selected ones)."""
    position = torch.full((slab.n, slab.C), -1, dtype=torch.long, device="cpu")
    return position.scatter_(1, slab.host_columns_cpu, torch.arange(slab.u, device="cpu").expand(slab.n, slab.u))


__all__ = ["DepartingCopy", "MovingColumns", "reselect_in_flight", "settle_departing", "share_first_selection",
           "take_arriving"]
