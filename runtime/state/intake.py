"""Gradients into the slabs, and their sums over an update interval (ARCHITECTURE.md, "One training step").

Whole slabs go in one batched call each (`take_grads`), the rest member by member (`take_grad`, `take_reduced`).
The unselected columns' gradient is staged on the device (`rest_grad`, summed by `accumulate_on_device`, sent
down once per interval by `send_accumulators`) or copied into the pinned `host_grads` and summed by the
accumulate worker (`accumulate`).
"""

from __future__ import annotations

from typing import Optional

import torch

from zenflow_compile.runtime import kernels
from zenflow_compile.runtime.state.members import Member
from zenflow_compile.runtime.state.slab import Slab
from zenflow_compile.runtime.transfers import wait_events

# `Slab.acc_sent` where the device is the host: the copy was made at once, no event to wait for.
_SENT = object()


class BucketPlan:
    """A bucket's gradients (made once per bucket composition and layout): whole slabs in one batched call each
    (`take_grads`), the rest member by member (`take_grad`)."""

    def __init__(self, members: list[Member]):
        by_slab: dict[int, tuple] = {}  # id -> (slab, the bucket's positions of its members)
        for position, member in enumerate(members):
            by_slab.setdefault(id(member.slab), (member.slab, []))[1].append(position)
        self.whole, self.singles = [], []
        for slab, positions in by_slab.values():
            if len(positions) == slab.n:
                positions.sort(key=lambda p: members[p].index)
                self.whole.append((slab, positions))
            else:
                self.singles += [(slab, members[p].index, p) for p in positions]

    def take(self, grads: list[torch.Tensor], scores: Optional[list], grad_slot: int) -> int:
        """Hand the bucket's gradients (and scores, or None) to their slabs; returns the bytes sent down."""
        sent = 0
        for slab, positions in self.whole:
            if slab.members_taken or any(grads[p].dtype != slab.dtype for p in positions):
                for p, member in zip(positions, slab.members):  # a later backward of the step
                    sent += take_grad(slab, member.index, grads[p], None if scores is None else scores[p], grad_slot)
                continue
            sent += take_grads(slab, [grads[p] for p in positions],
                               None if scores is None else [scores[p] for p in positions], grad_slot)
        for slab, i, p in self.singles:
            sent += take_grad(slab, i, grads[p], None if scores is None else scores[p], grad_slot)
        return sent


def rows_taken(slab: Slab) -> Optional[list[int]]:
    """The members of `slab` that took a gradient this step: None for all of them."""
    if slab.members_taken == slab.n:
        return None
    return [i for i, m in enumerate(slab.members) if m.num_grads]


def _plain(grad: torch.Tensor, shape: tuple) -> torch.Tensor:
    """`grad` detached and viewed as `shape` (no call when it already is)."""
    if grad.requires_grad:
        grad = grad.detach()
    return grad if grad.shape == shape else grad.reshape(shape)


def take_grads(slab: Slab, grads: list[torch.Tensor], scores: Optional[list], grad_slot: int) -> int:
    """The first backward's gradient of every member (member order), in a fixed number of calls; returns
    the bytes sent device -> host. Keeps no reference to the gradients (the compiled graph reuses them)."""
    n, R, C = slab.n, slab.R, slab.C
    if n == 1:
        g = _plain(grads[0], (R, C)).unsqueeze(0)
    else:  # (the caller runs without autograd: no detach needed)
        g = torch.stack(grads).reshape(n, R, C)  # (a copy only for non-contiguous gradients: channels-last)
    if scores is not None and scores[0] is not None:
        if n == 1:
            slab.scores.copy_(scores[0].reshape(1, C))
        else:
            torch.stack([s.reshape(C) for s in scores], out=slab.scores)
    else:
        torch.sum(g.float().square(), 1, out=slab.scores)
    return _take_stacked(slab, g, grad_slot)


def take_first_gradient(slab: Slab, grad: torch.Tensor, scores: torch.Tensor, grad_slot: int) -> int:
    """The step's whole gradient of every member ([n, R, C], member order) and its scores ([n, C]), into a
    slab laid out at its members' first selection (`state/pending.py`); returns the bytes sent device -> host."""
    slab.scores.copy_(scores)
    slab.several_backwards = False  # (summed already: its scores are exact)
    return _take_stacked(slab, grad, grad_slot)


def _take_stacked(slab: Slab, g: torch.Tensor, grad_slot: int) -> int:
    """`take_grads` once the scores are in: the gradient `g` ([n, R, C]) split into the slab's parts."""
    n = slab.n
    if slab.whole:
        slab.grad.copy_(g)
    elif slab.k:
        if n == 1:
            torch.index_select(g[0], 1, slab.selected[0], out=slab.grad[0])
        else:
            torch.gather(g, 2, slab.selected_index, out=slab.grad)
    for member in slab.members:
        member.num_grads = 1
    slab.members_taken = n
    for slot_extras in slab.extra_grads[grad_slot].values():  # (a discarded step's extras)
        slot_extras.clear()
    if not slab.has_host_part:
        return 0
    if slab.accumulates_on_device:  # gathered by column on the device, summed there at step()
        if n == 1:
            torch.index_select(g[0].t(), 0, slab.host_columns[0], out=slab.rest_grad[0])
        else:
            torch.gather(g.transpose(1, 2), 1, slab.host_index.transpose(1, 2), out=slab.rest_grad)
        return 0
    if n == 1:  # gather + transpose straight into the host buffer
        done = slab.transfers.to_host(g[0].t(), slab.host_grads[grad_slot][0], rows=slab.host_columns[0])
    else:
        done = slab.transfers.to_host(torch.gather(g.transpose(1, 2), 1, slab.host_index.transpose(1, 2)),
                                      slab.host_grads[grad_slot])
    slab.offload_done[grad_slot] = [*slab.offload_done[grad_slot], done]
    return slab.host_grad_bytes


def take_grad(slab: Slab, i: int, grad: torch.Tensor, scores: Optional[torch.Tensor], grad_slot: int) -> int:
    """One backward's gradient of member i (a later backward, or a member whose slab did not arrive whole)."""
    member = slab.members[i]
    g = _plain(grad, (slab.R, slab.C))
    first = _count_grad(slab, member)
    if scores is None and first:
        kernels.column_scores(g, out=slab.scores[i])  # straight into the buffer
    else:
        scores = (kernels.column_scores(g) if scores is None else scores).reshape(slab.C)
        slab.scores[i].copy_(scores) if first else slab.scores[i].add_(scores)
    if slab.k:
        chosen = g if slab.whole else g.index_select(1, slab.selected[i])
        slab.grad[i].copy_(chosen) if first else slab.grad[i].add_(chosen)
    if not slab.has_host_part:
        return 0
    return _offload(slab, i, g.t(), first, grad_slot, rows=slab.host_columns[i])


def _count_grad(slab: Slab, member: Member) -> bool:
    """One more backward of `member` this step; whether it is its first."""
    member.num_grads += 1
    if member.num_grads == 1:
        slab.members_taken += 1
        return True
    slab.several_backwards = True
    return False


def _offload(slab: Slab, i: int, rest: torch.Tensor, first: bool, grad_slot: int,
             rows: Optional[torch.Tensor] = None) -> int:
    """Member i's unselected columns ([u, R], or the rows `rows` of `rest`) into host_grads[grad_slot][i];
    a later backward of the step into an extra pinned buffer (reused step after step), summed at step().
    Device accumulation: into (or, a later backward, added to) rest_grad[i], on the device."""
    if slab.accumulates_on_device:
        part = rest if rows is None else rest.index_select(0, rows)
        slab.rest_grad[i].copy_(part) if first else slab.rest_grad[i].add_(part)
        return 0
    extras = slab.extra_grads[grad_slot].setdefault(i, [])
    if first:
        extras.clear()  # (a discarded step's)
        done = slab.transfers.to_host(rest, slab.host_grads[grad_slot][i], rows=rows)
        slab.offload_done[grad_slot] = [*slab.offload_done[grad_slot], done]
        return slab.u * slab.R * slab.host_grads[grad_slot].element_size()
    pool = slab.extra_pool[grad_slot].setdefault(i, [])
    if len(extras) == len(pool):
        pool.append(slab.transfers.host_zeros((slab.u, slab.R), rest.dtype))
    target = pool[len(extras)]
    extras.append(target)
    slab.offload_done[grad_slot] = [*slab.offload_done[grad_slot], slab.transfers.to_host(rest, target, rows=rows)]
    return target.numel() * target.element_size()


def take_reduced(slab: Slab, i: int, replicated: Optional[torch.Tensor], host: Optional[torch.Tensor],
                 grad_slot: int) -> int:
    """Member i's averaged gradient: the selected columns (every rank) and, on the owner, the unselected ones,
    and its scores (the host columns' only on the owner: the runtime all-reduces the scores at the step)."""
    first = _count_grad(slab, slab.members[i])
    scores = torch.zeros(slab.C, device=slab.device)
    if replicated is not None:
        chosen = replicated.view(slab.R, slab.k)
        slab.grad[i].copy_(chosen) if first else slab.grad[i].add_(chosen)
        scores[slab.selected[i]] = chosen.float().pow(2).sum(0)
    rest = None if host is None else host.view(slab.u, slab.R)
    if rest is not None:
        scores[slab.host_columns[i]] = rest.float().pow(2).sum(1)
    slab.scores[i].copy_(scores) if first else slab.scores[i].add_(scores)
    return 0 if rest is None or not slab.has_host_part else _offload(slab, i, rest, first, grad_slot)


def start_step(slab: Slab, grad_slot: int) -> None:
    """Forget the copy events of the step two steps ago (its accumulate task has been joined)."""
    slab.offload_done[grad_slot] = []


def end_step(slab: Slab) -> None:
    for member in slab.members:
        member.num_grads = 0
    slab.members_taken, slab.several_backwards = 0, False


def host_step_scores(slab: Slab, grad_slot: int, rows: list[int]) -> None:
    """Accumulate worker, several backwards in one step: fold the extras, then the exact scores of the summed
    gradient's host columns of members `rows`, into the pinned `host_scores`."""
    slab.fold_extra_grads(grad_slot)
    slab.transfers.host_access(reads=[slab.host_grads[grad_slot]], writes=[slab.host_scores])
    for i in rows:
        torch.sum(slab.host_grads[grad_slot][i].float().pow(2), dim=1, out=slab.host_scores[i])


def exact_scores(slab: Slab, rows: list[int]) -> None:
    """The scores of members `rows` that took several backwards this step, recomputed from their summed
    gradient (the host columns' from `host_step_scores`, which must have run)."""
    for i in rows:
        exact = torch.empty(slab.C, device=slab.device)
        exact[slab.selected[i]] = slab.grad[i].float().pow(2).sum(0)
        if slab.u:
            if slab.accumulates_on_device:
                exact[slab.host_columns[i]] = slab.rest_grad[i].float().pow(2).sum(1)
            elif slab.has_host_part:
                exact[slab.host_columns[i]] = slab.transfers.to_device(slab.host_scores[i])[0]
            else:  # the owner reports them
                exact[slab.host_columns[i]] = 0.0
        slab.scores[i].copy_(exact)


def copies_in_flight(slab: Slab, grad_slot: int) -> list:
    """The events of this step's copies into the gradient buffers, for the accumulate task (none: no copies)."""
    return [] if slab.transfers.device_is_host else list(slab.offload_done[grad_slot])


def accumulate_on_device(slab: Slab, rows: Optional[list[int]], coef: float) -> None:
    """At step(): device_acc += coef * rest_grad (and its squares) for members `rows` (None: all)."""
    if slab.acc_sent is not None:  # the first step of an interval: the sums sent at the boundary start over
        sums = slab.device_sums()
        slab.transfers.after_copy_down(slab.acc_sent, sums)
        torch._foreach_zero_(sums)
        slab.acc_sent = None
    pick = (lambda t: [t]) if rows is None else (lambda t: [t[i] for i in rows])
    accs, grads = pick(slab.device_acc), pick(slab.rest_grad)
    torch._foreach_add_(accs, grads, alpha=coef)
    if slab.device_sq_acc is not None:
        torch._foreach_addcmul_(pick(slab.device_sq_acc), grads, grads, value=coef * coef)


def send_accumulators(slab: Slab) -> int:
    """Device accumulation, at a boundary: the interval's sums copied into the pinned accumulators of `acc_slot`
    (`acc_landed[acc_slot]`: the copy's event); returns the bytes sent. The next step's accumulation empties the
    sums (`acc_sent`), its stream waiting for the copy a step later, so the device does not wait for it."""
    if not slab.accumulates_on_device or slab.acc_sent is not None:
        return 0
    targets = slab.host_sums(slab.acc_slot)
    slab.acc_landed[slab.acc_slot] = slab.transfers.to_host_many(slab.device_sums(), targets)
    slab.acc_sent = slab.acc_landed[slab.acc_slot] or _SENT
    return sum(t.numel() * t.element_size() for t in targets)


def wait_for_accumulators(slab: Slab, acc_slot: int) -> None:
    """Before a host thread reads accumulators[acc_slot]: device accumulation's copy has landed."""
    if slab.accumulates_on_device:
        wait_events([slab.acc_landed[acc_slot]])
        slab.transfers.host_access(writes=slab.host_sums(acc_slot))


def accumulate(slab: Slab, rows: Optional[list[int]], grad_slot: int, acc_slot: int, coef: float) -> None:
    """Accumulate worker, once the step's copies landed: acc += coef * g (and its squares) for members `rows`."""
    pick = (lambda t: [t]) if rows is None else (lambda t: [t[i] for i in rows])
    grads = slab.host_grads[grad_slot]
    accs, *squares = slab.host_sums(acc_slot)
    slab.transfers.host_access(reads=[grads])
    kernels.accumulate_scaled_many_(pick(accs), pick(grads), coef, square_accs=pick(squares[0]) if squares else None)


__all__ = ["BucketPlan", "accumulate", "accumulate_on_device", "copies_in_flight", "end_step", "exact_scores",
           "host_step_scores", "rows_taken", "send_accumulators", "start_step", "take_first_gradient", "take_grad",
           "take_grads", "take_reduced", "wait_for_accumulators"]
