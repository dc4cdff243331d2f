"""Optimizer state born flat: n like parameters (one param group, dtype and [R, C] shape, k selected columns
each, u = C - k) share every state tensor, row i member i's (ARCHITECTURE.md, "The slabs"):

    device  grad [n, R, k] (param dtype)      master, exp_avg, exp_avg_sq [n, R, k] fp32      counts [n, k] fp32
            selected [n, k], host_columns [n, u] int64      scores [n, C] fp32 (this step's squared column norms)
    host    master, exp_avg, exp_avg_sq [n, u, R] fp32       host_counts [n, u] fp32
            accumulators, square_accumulators [n, u, R] fp32: two by interval parity (the worker adds into one
            while the update reads the other), one where the device sums
            host_grads[2] (by step parity), host_weights[2] (by update parity) [n, u, R] pinned, param dtype;
            host_scores [n, u] pinned

`offload`: the selected columns' moments live in pinned `parked_moments` [2, n, R, k], on the device only inside
`moments_on_device`. Where the device sums (`accumulate_on`), the unselected gradient is gathered into
`rest_grad` [n, u, R] (param dtype) and added into `device_acc` (`device_sq_acc`) [n, u, R] fp32, copied into
the pinned accumulators once per interval (no host_grads). k = 0 (warm-up) sums on the host. Data parallel:
only the owner of the members holds the host part (`owns_host`). What runs over a slab: `state/intake.py`,
`state/update.py`, `state/columns.py`, `state/watch.py`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from zenflow_compile.runtime.state.layout import (SlabKey, columns_as_rows, columns_index, device_columns, host_order,
                                                   param_columns)
from zenflow_compile.runtime.state.members import Member, MemberState
from zenflow_compile.runtime.transfers import Transfers, wait_events


class Slab:
    """The state of n like parameters (see the module docstring)."""

    def __init__(self, key: SlabKey, members: list[Member], states: list[MemberState], transfers: Transfers,
                 accumulate_squares: bool, accumulate_on_device: bool = False, upload_early: bool = False,
                 offload_moments: bool = False):
        self.key, self.members, self.transfers = key, members, transfers
        self.n, self.R, self.C, self.k = len(members), members[0].rows, key.cols, key.num_selected
        self.u = self.C - self.k
        self.dtype, self.device = key.dtype, members[0].param.device
        self.is_matrix = members[0].is_matrix
        self.owns_host = members[0].owns_host
        self.accumulate_squares = accumulate_squares
        for i, member in enumerate(members):
            member.slab, member.index = self, i
        n, R, C, k, u, dev = self.n, self.R, self.C, self.k, self.u, self.device
        if k == C:  # every column selected (vectors): the device layout is the parameter's own
            selected = torch.arange(C, device="cpu").expand(n, C).contiguous()
        elif k:
            selected = torch.stack([s.selected for s in states])
        else:
            selected = torch.zeros(n, 0, dtype=torch.long, device="cpu")
        counts = torch.stack([s.step for s in states])
        # The host columns: a given order (a checkpoint's, or decided by counts unknown here), else by count.
        given = [s.host_columns for s in states]
        if not all(g is not None and len(g) in (0, u) for g in given):
            host_columns = host_order(counts, selected)
        elif given and given[0].numel():
            host_columns = torch.stack(given)
        else:
            host_columns = torch.zeros(n, u, dtype=torch.long, device="cpu")
        self.selected_cpu, self.host_columns_cpu = selected, host_columns
        self.has_host_part = self.owns_host and u > 0
        self.accumulates_on_device = accumulate_on_device and self.has_host_part and k > 0
        # `uploaded`: (device tensor, event) the update worker uploaded once it published, until the apply merges it
        self.upload_early = upload_early and self.has_host_part and not transfers.device_is_host
        self.uploaded = None
        self.parks_moments = offload_moments and k > 0 and not transfers.device_is_host
        self.moments_resident = not self.parks_moments
        self.parked_moments = self.moments_parked = None  # (pinned [2, n, R, k]; the event of its last copy down)
        self.bytes_up = self.bytes_down = 0  # moments' visits and columns changing sides, since the engine counted
        self._lay_out_columns(states, counts)
        self.grad = torch.zeros(n, R, k, dtype=self.dtype, device=dev)
        self.scores = torch.zeros(n, C, device=dev)
        self.selected, self.host_columns = selected.to(dev), host_columns.to(dev)
        # gather indexes of the selected and the host columns over [n, R, C] (views: they follow `selected`)
        self.selected_index, self.host_index = columns_index(self.selected, R), columns_index(self.host_columns, R)
        self.whole = k == C  # no gather: the device layout is the parameter's
        self.offload_done: list[list] = [[], []]  # copy events into host_grads[slot] (and a step's extras)
        self.upload_done: list = [None, None]  # upload events of host_weights[slot]
        self.extra_grads: list[dict] = [{}, {}]  # later backwards of a step: member index -> [host buffers]
        self.extra_pool: list[dict] = [{}, {}]  # the pinned buffers extra_grads reuses, per member
        self.weights_slot = 0  # which host_weights holds the latest CPU-updated columns
        self.unapplied = any(s.unapplied for s in states)
        self.departing = None  # a reselection in flight's departing columns (`columns.settle_departing`)
        self._params = None  # see `params`
        self.master_rows = list(self.master.unbind(0))  # (the tensors are rewritten in place, never replaced)
        # This step: how many members took a gradient, and whether any took several backwards.
        self.members_taken = sum(1 for s in states if s.step_grad is not None)
        self.several_backwards = any(m.num_grads > 1 for m in members)
        step_grads = [s.step_grad for s in states]  # (a layout at step(): the step's gradient and scores come along)
        if any(g is not None for g in step_grads):
            self.grad.copy_(device_columns(step_grads, self.dtype, selected, dev))
            for i, s in enumerate(states):
                if s.step_scores is not None:
                    self.scores[i].copy_(s.step_scores)
        self.device_acc = self.device_sq_acc = self.rest_grad = None
        self.acc_slot = 0  # the accumulators this interval fills (a new slab's members' sums are in 0)
        self.acc_landed: list = [None, None]  # device accumulation: the copy events into accumulators[slot]
        self.acc_sent = None  # device accumulation: the sums were sent at a boundary, not yet emptied (an event)
        self._lay_out_host_part(states, counts)

    def _lay_out_columns(self, states: list[MemberState], counts: torch.Tensor) -> None:
        """Masters and moments: the selected columns on the device (`offload`: the moments parked on the host), the
        host rows (`host_master`, ...; None without a host part); the selected columns' counts."""
        n, R, k, u, dev, transfers = self.n, self.R, self.k, self.u, self.device, self.transfers
        selected, host_columns = self.selected_cpu, self.host_columns_cpu if self.has_host_part else None
        for name in ("master", "exp_avg", "exp_avg_sq"):
            moments_on = "cpu" if self.parks_moments and name != "master" else dev
            naturals = [getattr(s, name) for s in states]
            if name == "master" and any(t is None for t in naturals):  # fresh: the parameters' values
                if not all(t is None for t in naturals):
                    raise RuntimeError("internal: fresh and laid-out states in one slab")
                on_device, on_host = param_columns([m.as_columns() for m in self.members], selected, host_columns,
                                                   dev)
            elif all(t is None for t in naturals):  # fresh moments: zeros, laid out directly
                on_device = torch.zeros(n, R, k, device=moments_on)
                on_host = None if host_columns is None else torch.zeros(n, u, R, device="cpu")
            else:
                on_device = device_columns(naturals, torch.float32, selected, moments_on)
                on_host = None if host_columns is None else columns_as_rows(naturals, torch.float32, host_columns)
            setattr(self, name, on_device)
            setattr(self, "host_" + name, on_host)
        if self.parks_moments:
            self.parked_moments = transfers.host_zeros((2, n, R, k), torch.float32)
            transfers.host_access(writes=[self.parked_moments])
            torch.stack([self.exp_avg, self.exp_avg_sq], out=self.parked_moments)
            self.exp_avg, self.exp_avg_sq = self.parked_moments.unbind(0)
        self.counts = counts.gather(1, selected).to(dev)
        # What the members' selected columns hold where it is not their master in the slab's dtype (after a
        # cast: an upcast leaves bf16 values beside fp32 masters), until the device update rewrites them.
        self.selected_written: Optional[torch.Tensor] = None
        written = [s.selected_written for s in states]
        if k and any(w is not None for w in written):
            cast = self.master.to(self.dtype)
            written = torch.stack([c if w is None else w.to(dev, self.dtype) for c, w in zip(cast, written)])
            if not torch.equal(written, cast):
                self.selected_written = written

    def _lay_out_host_part(self, states: list[MemberState], counts: torch.Tensor) -> None:
        """The host counts, the interval's sums, the gradients' landing buffers and the weights buffers for the
        upload (none without a host part)."""
        if not self.has_host_part:
            self.host_counts = None
            self.accumulators, self.square_accumulators, self.host_grads, self.host_weights = [], [], [], []
            self.host_grad_bytes = 0
            return
        n, R, u, dev, host_zeros = self.n, self.R, self.u, self.device, self.transfers.host_zeros
        host_columns, accumulate_squares = self.host_columns_cpu, self.accumulate_squares
        step_grads = [s.step_grad for s in states]
        has_step_grad = any(g is not None for g in step_grads)
        self.host_counts = counts.gather(1, host_columns)
        on_device = self.accumulates_on_device
        # The accumulators: where the worker adds, or where a boundary's copy of the device sums lands (one serves
        # every interval there: the update that read it has landed before the next boundary's copy).
        landing = (lambda: host_zeros((n, u, R), torch.float32)) if on_device else (
            lambda: torch.zeros(n, u, R, device="cpu"))
        buffers = 1 if on_device else 2
        self.accumulators = [landing() for _ in range(buffers)]
        self.square_accumulators = [landing() for _ in range(buffers)] if accumulate_squares else []
        if on_device:
            self.device_acc = torch.zeros(n, u, R, device=dev)
            self.device_sq_acc = torch.zeros(n, u, R, device=dev) if accumulate_squares else None
            self.rest_grad = torch.zeros(n, u, R, dtype=self.dtype, device=dev)
        sums = [self.device_acc, self.device_sq_acc] if on_device else [self.accumulators[0],
                                                                         (self.square_accumulators or [None])[0]]
        for target, name in zip(sums, ("accumulator", "square_accumulator")):
            saved = [getattr(s, name) for s in states]
            if target is not None and any(a is not None for a in saved):
                target.copy_(columns_as_rows(saved, torch.float32, host_columns))
        self.host_grads = [] if on_device else [host_zeros((n, u, R), self.dtype) for _ in range(2)]
        self.host_grad_bytes = 0 if on_device else self.host_grads[0].numel() * self.host_grads[0].element_size()
        if has_step_grad:
            if on_device:
                self.rest_grad.copy_(columns_as_rows(step_grads, self.dtype, host_columns))
            else:
                columns_as_rows(step_grads, self.dtype, host_columns, out=self.host_grads[0])
                self.host_grads[1].copy_(self.host_grads[0])
        # host_weights[0]: the latest CPU update (a member's pending one, else what the device holds);
        # host_weights[1]: what the device holds (the applied weights while an update is pending).
        self.host_weights = [host_zeros((n, u, R), self.dtype) for _ in range(2)]
        applied = [s.applied for s in states]
        if any(a is None for a in applied):  # what the device holds is the master, cast
            self.host_weights[1].copy_(self.host_master)
        if any(a is not None for a in applied):
            given = columns_as_rows(applied, self.dtype, host_columns)
            given_rows = torch.tensor([a is not None for a in applied], device="cpu").view(n, 1, 1)
            torch.where(given_rows, given, self.host_weights[1], out=self.host_weights[1])
        if any(s.unapplied for s in states):
            pending = torch.tensor([s.unapplied for s in states], device="cpu").view(n, 1, 1)
            self.host_weights[0].copy_(torch.where(pending, self.host_master.to(self.dtype), self.host_weights[1]))
        else:
            self.host_weights[0].copy_(self.host_weights[1])
        self.host_scores = host_zeros((n, u), torch.float32)

    # -- what the slab holds --------------------------------------------------------------------------------
    @property
    def params(self) -> list[torch.Tensor]:
        """The members' parameters as [R, C] views (made once; again after a parameter's storage changed)."""
        if self._params is None:
            self._params = [m.as_columns() for m in self.members]
        return self._params

    def forget_param_views(self) -> None:
        """A member's parameter may have new storage: `params` makes its views again."""
        self._params = None

    def device_buffers(self) -> list[torch.Tensor]:
        """What the slab holds on the device between steps."""
        written = [] if self.selected_written is None else [self.selected_written]
        staging = [] if self.rest_grad is None else [self.rest_grad]
        moments = [] if self.parks_moments else [self.exp_avg, self.exp_avg_sq]
        return [self.master, *moments, self.counts, self.grad, self.scores, self.selected, self.host_columns,
                *written, *self.device_sums(), *staging]

    def host_buffers(self) -> list[torch.Tensor]:
        parked = [] if self.parked_moments is None else [self.parked_moments]
        if not self.has_host_part:
            return parked
        return [self.host_master, self.host_exp_avg, self.host_exp_avg_sq, *self.host_grads, *self.accumulators,
                *self.square_accumulators, *self.host_weights, *parked]

    @contextlib.contextmanager
    def moments_on_device(self):
        """The selected columns' moments on the device inside the block. `offload`: up after their last copy down
        (the compute stream waits), down after the block (not waited for): one slab's moments at a time."""
        if self.moments_resident:
            yield
            return
        moments, _ = self.transfers.to_device(self.parked_moments, after=self.moments_parked)
        self.exp_avg, self.exp_avg_sq = moments.unbind(0)
        self.moments_resident = True
        try:
            yield
        finally:
            self.moments_parked = self.transfers.to_host_many([self.exp_avg, self.exp_avg_sq],
                                                              list(self.parked_moments.unbind(0)))
            self.exp_avg, self.exp_avg_sq = self.parked_moments.unbind(0)
            self.moments_resident = False
            moved = self.parked_moments.numel() * self.parked_moments.element_size()
            self.bytes_up, self.bytes_down = self.bytes_up + moved, self.bytes_down + moved

    def moments_for_host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The selected columns' exp_avg and exp_avg_sq for a host read (parked: once their copy down landed)."""
        if not self.moments_resident:
            wait_events([self.moments_parked])
            self.transfers.host_access(reads=[self.parked_moments])
        return self.exp_avg, self.exp_avg_sq

    def applied_weights(self) -> torch.Tensor:
        """[n, u, R]: the host columns as the device holds them (the last uploaded CPU update)."""
        return self.host_weights[self.weights_slot ^ 1 if self.unapplied else self.weights_slot]

    def device_sums(self) -> list[torch.Tensor]:
        """Device accumulation's sums: device_acc (and device_sq_acc)."""
        return [t for t in (self.device_acc, self.device_sq_acc) if t is not None]

    def member_rates(self, members_by_scale: dict[float, list[tuple[int, int]]]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per member (`members_by_scale`: lr multiplier -> [(member index, steps accumulated)]): its host columns'
        lr multiplier (float64 [n]; 0: no step) and the steps its sums hold (int64 [n]; 1 where none)."""
        scale, steps = [0.0] * self.n, [1] * self.n  # (lists: two tensors in all, whatever n)
        for multiplier, taking in members_by_scale.items():
            for i, held in taking:
                scale[i], steps[i] = multiplier, held
        return (torch.tensor(scale, dtype=torch.float64, device="cpu"),
                torch.tensor(steps, dtype=torch.long, device="cpu"))

    def host_sums(self, acc_slot: int) -> list[torch.Tensor]:
        """The host accumulators of interval slot `acc_slot` (and their squares)."""
        slot = acc_slot % len(self.accumulators)
        return [self.accumulators[slot], *self.square_accumulators[slot:slot + 1]]

    def fold_extra_grads(self, grad_slot: int) -> None:
        """Sum the later backwards' offloaded gradients into host_grads[grad_slot], once their copies landed
        (the accumulate worker, or an export of the step's gradient); a no-op once done."""
        extras = {i: buffers for i, buffers in self.extra_grads[grad_slot].items() if buffers}
        if not extras:
            return
        wait_events(self.offload_done[grad_slot])
        target = self.host_grads[grad_slot]
        self.transfers.host_access(reads=[b for buffers in extras.values() for b in buffers], writes=[target])
        for i, buffers in extras.items():
            for extra in buffers:
                target[i].add_(extra)
            buffers.clear()

    # -- export: the members' state in transit form -----------------------------------------------------------
    def natural(self, i: int, device_part: Optional[torch.Tensor], host_part: Optional[torch.Tensor],
                dtype=torch.float32, missing: float = math.nan) -> torch.Tensor:
        """Member i's [R, C] tensor from its device columns ([n, R, k]) and host rows ([n, u, R]) (None: `missing`
        there): the transpose of a [C, R] tensor built by column, the layout a new slab gathers from."""
        by_column = torch.empty(self.C, self.R, dtype=dtype, device="cpu")
        for columns, part, column_rows in ((self.selected_cpu[i], device_part, False),
                                           (self.host_columns_cpu[i], host_part, True)):
            if part is None:
                by_column.index_fill_(0, columns, missing)
            else:
                by_column.index_copy_(0, columns, (part[i] if column_rows else part[i].t()).to("cpu", dtype))
        return by_column.t()

    def export_member(self, i: int, with_step_grad: Optional[int] = None) -> MemberState:
        """Member i's whole state on the host (after the CPU work that touches it is done; NaN where this rank does
        not hold the host part). `with_step_grad`: the grad slot whose gradient (this step's) goes along."""
        if self.departing is not None:
            raise RuntimeError("internal: a slab's state was read before its departing columns were settled")
        exp_avg, exp_avg_sq = self.moments_for_host()
        master, exp_avg, exp_avg_sq = (self.natural(i, device_part, host_part) for device_part, host_part in
                                       ((self.master, self.host_master), (exp_avg, self.host_exp_avg),
                                        (exp_avg_sq, self.host_exp_avg_sq)))
        step = torch.full((self.C,), math.nan, device="cpu")
        step[self.selected_cpu[i]] = self.counts[i].cpu()
        if self.host_counts is not None:
            step[self.host_columns_cpu[i]] = self.host_counts[i]
        state = MemberState(master, exp_avg, exp_avg_sq, step, self.selected_cpu[i].clone(),
                            host_columns=None if self.has_host_part else self.host_columns_cpu[i].clone(),
                            unapplied=self.unapplied)
        if self.selected_written is not None:
            state.selected_written = self.selected_written[i].cpu()
        if self.has_host_part:
            self.transfers.host_access(reads=self.host_weights)
            if self.accumulates_on_device:  # (sent at a boundary: nothing accumulated since)
                sums = (None, None) if self.acc_sent is not None else (self.device_acc, self.device_sq_acc)
            else:
                sums = (*self.host_sums(self.acc_slot), None)
            state.accumulator = self.natural(i, None, sums[0], missing=0.0)
            if self.accumulate_squares:
                state.square_accumulator = self.natural(i, None, sums[1], missing=0.0)
            state.applied = self.natural(i, None, self.applied_weights(), self.dtype, missing=0.0)
        if with_step_grad is not None and self.members[i].num_grads:
            state.step_grad = self.step_grad(i, with_step_grad)
            state.step_scores = self.scores[i].clone()
        return state

    def step_grad(self, i: int, grad_slot: int) -> torch.Tensor:
        """Member i's gradient of this step in [R, C] layout on the host (waits for its offload)."""
        if self.accumulates_on_device:
            return self.natural(i, self.grad, self.rest_grad, self.dtype, missing=0.0)
        self.fold_extra_grads(grad_slot)
        wait_events(self.offload_done[grad_slot])
        if self.has_host_part:
            self.transfers.host_access(reads=[self.host_grads[grad_slot]])
        host_part = self.host_grads[grad_slot] if self.has_host_part else None
        return self.natural(i, self.grad, host_part, self.dtype, missing=0.0)


__all__ = ["Slab"]
