"""Per-parameter optimizer state, split between the device and host memory.

A *matrix* (dim >= 2, viewed as [R, C]) keeps the state of its selected columns on the device and the state
of the others in host memory; a *vector* keeps all of its state on the device. Every column owns an fp32
master, two moments and an update count; when the selection changes the state moves with its column.

Host buffers are stored transposed, [columns, R], so one column is one contiguous row: the offload of the
unselected columns is one contiguous copy and the CPU AdamW runs over whole rows. Host columns are ordered
by update count, so the columns sharing a count form contiguous runs, one fused-AdamW "tensor" each (all
host columns are updated at every boundary, so the runs stay runs until the next reselection).

Double buffers (index = parity) let the CPU work on one while the next step fills the other:
`host_grads` by step, `accumulators` (and, with interval_second_moment, `square_accumulators`: the sum of
the per-step squared gradients) by interval, `host_weights` (the CPU-updated columns, cast to the parameter
dtype, read by the upload) by CPU update.

Data parallel: every rank holds the device part of every matrix (the same selection, the same
values); only the matrix's `owner` holds its host part (`owns_host`). The other ranks know which columns are
unselected but keep no host buffers: their gradient goes to the owner, and they receive the owner's updated
columns (`apply_host_columns`) and the state of newly selected columns (`select`) by broadcast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from zenflow_compile.runtime import kernels
from zenflow_compile.runtime.kernels import DeviceUpdate
from zenflow_compile.runtime.transfers import Transfers, wait_events

HostRun = tuple[int, int, torch.Tensor]  # rows [start, end) of the host buffers and their shared count


class LayoutClock:
    """Counts layout changes of one optimizer's states: bumped whenever a state replaces a tensor that a
    plan hands out (a new state, a new selection, a cast, a loaded checkpoint, a parameter whose storage
    changed, stacking). Plans built from the states (`PerLayout`) are reused while it stands still; one
    clock per runtime, so one optimizer's relayout never invalidates another's plans."""

    def __init__(self):
        self.generation = 0

    def bump(self) -> None:
        self.generation += 1


# States made outside a runtime (tests, benchmarks) share this one.
_SHARED_CLOCK = LayoutClock()


class PerLayout:
    """A value derived from some states' layout alone (argument lists, plans): `build(states)` runs again
    only when those states or any state's layout (on `clock`) changed since the last `get`."""

    def __init__(self, build, clock: LayoutClock):
        self._build, self._clock = build, clock
        self._generation, self._states, self._value = None, None, None

    def get(self, states: list, extra=None):
        """`extra`: anything else the value depends on (compared by equality)."""
        key = (self._clock.generation, extra)
        if self._generation != key or self._states != states:  # (states compare by identity)
            self._value, self._states, self._generation = self._build(states), list(states), key
        return self._value


@dataclass
class CanonicalState:
    """A parameter's whole optimizer state in its natural layout, on the host (for moves and checkpoints)."""

    master: torch.Tensor  # fp32 [R, C] (vectors: the parameter's shape)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor  # fp32 [C] per-column update counts (vectors: [1])

    @classmethod
    def unknown(cls, rows: int, cols: int) -> "CanonicalState":
        """All NaN: a rank that does not hold a matrix's host part fills in only what it knows."""
        return cls(*(torch.full((rows, cols), math.nan) for _ in range(3)), torch.full((cols,), math.nan))


def top_k_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, ties to the lower index, in ascending order (on the host). `scores`
    may be [n, C]: the top k of each row (one sort for n matrices of C columns)."""
    order = torch.sort(scores.detach().cpu(), dim=-1, descending=True, stable=True).indices
    return order[..., :k].sort(dim=-1).values


def top_k_columns_many(scores: list[torch.Tensor], ks: list[int]) -> list[torch.Tensor]:
    """`top_k_columns` of each (scores, k) pair; pairs of one size and k share one sort."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (row, k) in enumerate(zip(scores, ks)):
        groups.setdefault((row.numel(), k), []).append(i)
    result: list = [None] * len(scores)
    for (_, k), members in groups.items():
        chosen = top_k_columns(torch.stack([scores[i] for i in members]), k)
        for i, columns in zip(members, chosen.unbind(0)):
            result[i] = columns
    return result


def _plain(grad: torch.Tensor, shape: tuple) -> torch.Tensor:
    """`grad` detached and viewed as `shape`, without the calls when it already is (per gradient: the eager
    hook's and the graph's gradients carry no autograd history unless the backward built a graph)."""
    if grad.requires_grad:
        grad = grad.detach()
    return grad if grad.shape == shape or (len(shape) == 1 and grad.ndim == 1) else grad.reshape(shape)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


class ParamWatch:
    """Tells whether anyone but the optimizer wrote a parameter since the optimizer last looked.

    The optimizer writes through `param.data` and raw pointers, which leave the parameter's version counter
    alone; an in-place write by anyone else (`load_state_dict`, an init routine, `p.copy_`) bumps it, and
    `p.data = other` changes its storage.
    """

    def __init__(self, param: torch.Tensor):
        self.param = param
        self.remember()

    def remember(self) -> None:
        """Called by the states whenever they also mark a layout change (the runtime checks all parameters
        at once against what their watches saw, per layout)."""
        self.seen = (self.param._version, self.param.data_ptr(), self.param.dtype)

    def written_externally(self) -> bool:
        return (self.param._version, self.param.data_ptr(), self.param.dtype) != self.seen


def _adopt(current: torch.Tensor, last_written: torch.Tensor, master: torch.Tensor) -> None:
    """master := current where current differs from what the optimizer last wrote (elementwise), so
    untouched elements keep their fp32 master bits (a bf16 parameter cannot hold them)."""
    changed = current != last_written
    master.copy_(torch.where(changed, current.float(), master))


class VectorState:
    """A bias or norm weight: a full AdamW on the device every step (one column of an [N, 1] view)."""

    is_matrix = False

    def __init__(self, param: torch.Tensor, pid: int, group_index: int, owner: int = 0,
                 clock: Optional[LayoutClock] = None):
        self.param, self.pid, self.group_index = param, pid, group_index
        self.clock = clock if clock is not None else _SHARED_CLOCK
        self.owner = owner  # data parallel: the rank that reports its score and saves its state
        device = param.device
        self.master = param.detach().float().reshape(-1, 1).clone()
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.step = torch.zeros(1, device=device)
        self.grad = torch.zeros(self.master.shape, dtype=param.dtype, device=device)
        self.grad_flat = self.grad.view(-1)  # what receive_grad writes (a view made once, not per gradient)
        self.score = torch.zeros(1, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.num_grads = 0
        self.watch = ParamWatch(param)
        self.clock.bump()

    def written_externally(self) -> bool:
        return self.watch.written_externally()

    def device_buffers(self) -> list[torch.Tensor]:
        """The device memory this vector's state holds (all of it)."""
        return [self.master, self.exp_avg, self.exp_avg_sq, self.step, self.grad, self.score, self.column]

    def adopt_param_values(self) -> None:
        self.clock.bump()  # the parameter's storage (its view in device_update) or the grad buffer may be new
        current = self.param.detach().reshape(-1, 1)
        left = self.master.to(self.grad.dtype)  # what the optimizer left in the parameter (its dtype until now)
        if current.dtype != self.grad.dtype:  # the parameter was cast (model.to(dtype)): a buffer of its dtype
            # (usually adopted at the step's first gradient, with nothing received yet; a cast between a
            # backward and the step keeps the gradient that backward handed over)
            self.grad = self.grad.to(current.dtype, memory_format=torch.contiguous_format)
            self.grad_flat = self.grad.view(-1)
        _adopt(current, left, self.master)  # (an upcast changes no value: every master bit is kept)
        self.watch.remember()

    def receive_grad(self, grad: torch.Tensor, score: Optional[torch.Tensor], grad_slot: int) -> int:
        grad = _plain(grad, (-1,))  # (flat: a 1-D reduction costs less host time than one over [N, 1])
        if self.num_grads == 0:
            self.grad_flat.copy_(grad)
            if score is not None:
                self.score.copy_(score.reshape(1))
            else:  # the full sum of squares, straight into the score (one op less per vector and step)
                torch.sum(_fp32(grad).square(), 0, keepdim=True, out=self.score)
        else:
            self.grad_flat.add_(grad)
        self.num_grads += 1
        return 0

    def reduce_split_numel(self) -> tuple[int, int]:
        """(elements averaged on every rank, elements reduced into the owner) of a gradient."""
        return self.master.numel(), 0

    def split_grad_for_reduce(self, grad: torch.Tensor, replicated: torch.Tensor, host) -> None:
        replicated.copy_(grad.reshape(-1))

    def step_scores(self, grad_slot: int) -> torch.Tensor:
        """This step's squared norm ([1]); exact when several backwards were summed."""
        if self.num_grads > 1:  # the sum of squares of a sum needs the summed gradient
            self.score.copy_(self.grad.float().pow(2).sum().reshape(1))
        return self.score

    def device_update(self) -> Optional[DeviceUpdate]:
        return DeviceUpdate(self.grad, self.master, self.exp_avg, self.exp_avg_sq, self.step,
                            self.param.data.view(-1, 1), self.column, count_head=self.step)

    def canonical(self) -> CanonicalState:
        shape = self.param.shape
        return CanonicalState(self.master.cpu().reshape(shape), self.exp_avg.cpu().reshape(shape),
                              self.exp_avg_sq.cpu().reshape(shape), self.step.cpu().clone())

    def load_canonical(self, state: CanonicalState) -> None:
        for mine, saved in ((self.master, state.master), (self.exp_avg, state.exp_avg),
                            (self.exp_avg_sq, state.exp_avg_sq), (self.step, state.step)):
            mine.copy_(saved.reshape(mine.shape))
        self.clock.bump()
        self.watch.remember()  # a later write into the parameter (model.load_state_dict) is compared to it


class AccumulateBatch:
    """The accumulate worker's task for fixed matrices and slots: acc += coef * g (and, with
    interval_second_moment, square_acc += (coef * g)**2) once the step's offloads have landed. The runtime
    builds one per layout and slot pair, so the task is one batched add (few Python iterations on the
    worker: the training thread waits less for the GIL)."""

    def __init__(self, matrices: "list[MatrixState]", grad_slot: int, acc_slot: int):
        self.matrices, self.grad_slot = matrices, grad_slot
        self.accs = [m.accumulators[acc_slot] for m in matrices]
        self.grads = [m.host_grads[grad_slot] for m in matrices]
        self.squares = [m.square_accumulators[acc_slot] for m in matrices if m.accumulate_squares] or None
        self.transfers = matrices[0].transfers  # (one device per optimizer)

    def copies_in_flight(self) -> list:
        """The events of this step's copies into the gradient buffers (none where the device is the host:
        its copies are done on return). Taken when the task is submitted: the next step replaces them."""
        if self.transfers.device_is_host:
            return []
        return [event for m in self.matrices for event in m.offload_done[self.grad_slot]]

    def run(self, coef: float, copies: list) -> None:
        wait_events(copies)
        self.transfers.host_access(reads=self.grads)
        kernels.accumulate_scaled_many_(self.accs, self.grads, coef, square_accs=self.squares)


class MatrixState:
    """A weight matrix: selected columns' state on the device, the rest's in (pinned) host memory."""

    is_matrix = True

    def __init__(self, param: torch.Tensor, pid: int, group_index: int, transfers: Transfers,
                 owner: int = 0, owns_host: bool = True, accumulate_squares: bool = False,
                 clock: Optional[LayoutClock] = None):
        if not param.is_contiguous():
            raise ValueError(
                f"ZenFlowAdamW needs contiguous parameters; got one of shape {tuple(param.shape)} with strides "
                f"{param.stride()}. Make it contiguous (param.data = param.data.contiguous()) first.")
        self.param, self.pid, self.group_index = param, pid, group_index
        self.clock = clock if clock is not None else _SHARED_CLOCK
        self.owner, self.owns_host = owner, owns_host
        self.accumulate_squares = accumulate_squares  # interval_second_moment
        self.transfers = transfers
        self.rows = param.shape[0]
        self.cols = param.numel() // self.rows
        self.shape2d = (self.rows, self.cols)
        self.device = param.device
        self.scores = torch.zeros(self.cols, device=self.device)
        self.num_grads = 0
        self.steps_accumulated = 0  # steps whose gradient went into the accumulator since the last update
        # Zen-auto: mean selected / unselected scores summed since the last CPU update.
        self.sum_selected_score = 0.0
        self.sum_unselected_score = 0.0
        self.unapplied = False  # a launched CPU update of its host columns has not reached the device yet
        self.watch = ParamWatch(param)
        master = param.detach().reshape(self.rows, self.cols).float().cpu()
        zeros = torch.zeros_like(master)
        self._distribute(torch.zeros(0, dtype=torch.long),
                         CanonicalState(master, zeros, zeros.clone(), torch.zeros(self.cols)))

    # -- layout -------------------------------------------------------------------------------------------
    def as_columns(self) -> torch.Tensor:
        """The device parameter viewed as [R, C] (a view: writes land in the parameter)."""
        return self.param.data.view(self.rows, self.cols)

    def _host_order(self, selected: torch.Tensor, state: CanonicalState) -> torch.Tensor:
        """The unselected columns, ordered by update count (runs of equal counts are contiguous)."""
        unselected_mask = torch.ones(self.cols, dtype=torch.bool)
        unselected_mask[selected] = False
        unselected = unselected_mask.nonzero().flatten()
        return unselected[torch.sort(state.step[unselected], stable=True).indices]

    def _distribute(self, selected: torch.Tensor, state: CanonicalState,
                    step_grad: Optional[torch.Tensor] = None, host_columns: Optional[torch.Tensor] = None) -> None:
        """Lay `state` out for selection `selected` (ascending host LongTensor); `step_grad` moves with it.
        `host_columns`: the order of the unselected columns, when the counts that decide it are not here."""
        if host_columns is None:
            host_columns = self._host_order(selected, state)

        self.clock.bump()
        dev, dtype, host_zeros = self.device, self.param.dtype, self.transfers.host_zeros
        self.selected, self.selected_on_device = selected, selected.to(dev)
        self.dev_master = state.master[:, selected].to(dev)
        self.dev_exp_avg = state.exp_avg[:, selected].to(dev)
        self.dev_exp_avg_sq = state.exp_avg_sq[:, selected].to(dev)
        counts = state.step[selected]
        self.dev_step = counts.to(dev)
        # (read here, on the host: NaN, unknown, never agrees)
        uniform = counts.numel() > 0 and bool((counts == counts[0]).all())
        self.dev_step_head = self.dev_step[:1] if uniform else None
        self.dev_grad = torch.zeros(self.rows, selected.numel(), device=dev, dtype=dtype)

        self.host_columns, self.host_columns_on_device = host_columns, host_columns.to(dev)
        # Read per gradient and step: plain attributes (no numel() call each time).
        self.num_selected, self.num_host = selected.numel(), host_columns.numel()
        self.has_selected, self.has_host = self.num_selected > 0, self.num_host > 0
        self.host_grad_bytes = 0  # one offloaded gradient (owner only)
        self.upload_done: list = [None, None]  # upload events of host_weights[slot]
        self.offload_done: list[list] = [[], []]  # D2H events of host_grads[slot] (and its extras)
        self.extra_grads: list[list[torch.Tensor]] = [[], []]  # later backwards of a step, summed at step()
        self.extra_pool: list[list[torch.Tensor]] = [[], []]  # the pinned buffers extra_grads reuses
        if step_grad is not None:
            self.dev_grad.copy_(step_grad[:, selected].to(dev))
        if not self.owns_host:  # another rank holds the host part
            self.host_master = self.host_exp_avg = self.host_exp_avg_sq = None
            self.host_runs, self.host_grads, self.accumulators, self.host_weights = [], [], [], []
            self.square_accumulators = []
            return
        shape = (host_columns.numel(), self.rows)
        self.host_master = torch.zeros(shape)  # (host-only: never copied, so not pinned)
        self.host_master.copy_(state.master[:, host_columns].t())
        self.host_exp_avg = torch.zeros(shape)  # (host-only: never copied, so not pinned)
        self.host_exp_avg.copy_(state.exp_avg[:, host_columns].t())
        self.host_exp_avg_sq = torch.zeros(shape)  # (host-only: never copied, so not pinned)
        self.host_exp_avg_sq.copy_(state.exp_avg_sq[:, host_columns].t())
        self.host_runs = self._runs_of_equal_count(state.step[host_columns])
        self.host_grads = [host_zeros(shape, dtype) for _ in range(2)]
        self.host_grad_bytes = self.host_grads[0].numel() * self.host_grads[0].element_size()
        self.accumulators = [torch.zeros(shape) for _ in range(2)]
        self.square_accumulators = ([torch.zeros(shape) for _ in range(2)]
                                    if self.accumulate_squares else [])
        self.host_weights = [host_zeros(shape, dtype) for _ in range(2)]
        for weights in self.host_weights:
            weights.copy_(self.host_master)
        self.weights_slot = 0  # which host_weights holds the latest CPU-updated columns
        self.host_scores = host_zeros((host_columns.numel(),), torch.float32)  # see host_step_scores
        if step_grad is not None:
            for buffer in self.host_grads:
                buffer.copy_(step_grad[:, host_columns].t())

    @staticmethod
    def _runs_of_equal_count(counts: torch.Tensor) -> list[HostRun]:
        runs, start = [], 0
        values, lengths = torch.unique_consecutive(counts, return_counts=True)
        for value, length in zip(values.tolist(), lengths.tolist()):
            runs.append((start, start + length, torch.tensor(float(value))))
            start += length
        return runs

    def canonical(self) -> CanonicalState:
        """The whole state in [R, C] layout on the host (on a rank that does not own the host part, those
        columns are NaN)."""
        state = CanonicalState.unknown(self.rows, self.cols)
        for full, dev, host in ((state.master, self.dev_master, self.host_master),
                                (state.exp_avg, self.dev_exp_avg, self.host_exp_avg),
                                (state.exp_avg_sq, self.dev_exp_avg_sq, self.host_exp_avg_sq)):
            full[:, self.selected] = dev.cpu()
            if host is not None:
                full[:, self.host_columns] = host.t()
        state.step[self.selected] = self.dev_step.cpu()
        for start, end, count in self.host_runs:
            state.step[self.host_columns[start:end]] = count
        return state

    def load_canonical(self, state: CanonicalState, selected: torch.Tensor,
                       host_columns: Optional[torch.Tensor] = None) -> None:
        """Lay a checkpointed state out for selection `selected` (accumulators empty); `host_columns`: the
        saved order of the unselected columns, when this rank has not their update counts."""
        self._distribute(selected, state, host_columns=host_columns)
        self.unapplied = False
        self.watch.remember()

    def device_buffers(self) -> list[torch.Tensor]:
        """The device memory this matrix's state holds: its selected columns' state and gradient, its column
        scores and the column indices."""
        return [self.dev_master, self.dev_exp_avg, self.dev_exp_avg_sq, self.dev_step, self.dev_grad, self.scores,
                self.selected_on_device, self.host_columns_on_device]

    def host_buffers(self) -> list[torch.Tensor]:
        """The host memory this matrix holds (none on a rank that does not own its host part)."""
        if not self.owns_host:
            return []
        return [self.host_master, self.host_exp_avg, self.host_exp_avg_sq, *self.host_grads, *self.accumulators,
                *self.square_accumulators, *self.host_weights]

    # -- values written by others (docs/semantics.md, "Values written by the user") ----------------------
    def written_externally(self) -> bool:
        return self.watch.written_externally()

    def _applied_weights(self) -> torch.Tensor:
        """The host columns as the device holds them: the last uploaded CPU update (or the initial values)."""
        return self.host_weights[self.weights_slot ^ 1 if self.unapplied else self.weights_slot]

    def adopt_param_values(self) -> None:
        """The parameter was written by someone else: where it differs from what the optimizer left in it,
        its values become the master (call with no CPU work in flight)."""
        self.clock.bump()  # its storage (the view in device_update) may be new
        current = self.as_columns().detach()
        if current.dtype != self.dev_grad.dtype:  # cast (model.to(dtype)): buffers anew in its dtype
            self._adopt_cast(current)
            return
        if self.num_selected:
            _adopt(current.index_select(1, self.selected_on_device), self.dev_master.to(current.dtype),
                   self.dev_master)
        if self.num_host and self.owns_host:
            wait_events(self.upload_done)  # an upload may still be reading the host weights
            self.transfers.host_access(writes=self.host_weights)
            host_now = current.t().index_select(0, self.host_columns_on_device).cpu()
            applied = self._applied_weights()
            _adopt(host_now, applied, self.host_master)
            applied.copy_(host_now)
            if self.unapplied:  # the pending update now carries the written values where they changed
                self.host_weights[self.weights_slot].copy_(self.host_master)
        self.watch.remember()

    def _adopt_cast(self, current: torch.Tensor) -> None:
        """The parameter was cast: the state is laid out again in buffers of its new dtype. As with any write,
        its values become the master elementwise where they differ from what the optimizer left in it (in the
        old dtype): an upcast keeps every master bit, a downcast adopts the values it rounded. What the old
        buffers hold moves over: the accumulators, a pending CPU update (still applied at the next apply),
        and any gradient this step's backwards already handed over (the runtime adopts a cast at the step's
        first gradient, before any arrives; a cast between a backward and the step is adopted at the step:
        that backward's copies down land first; later backwards' extras stay as they are)."""
        old_dtype = self.dev_grad.dtype
        wait_events(self.upload_done)  # an upload may still be reading the host weights
        for slot in (0, 1):
            wait_events(self.offload_done[slot])
        self.transfers.host_access(reads=[*self.host_grads, *self.host_weights])
        state = self.canonical()
        left = torch.zeros(self.rows, self.cols, dtype=old_dtype)  # what the optimizer left in the parameter
        left[:, self.selected] = self.dev_master.cpu().to(old_dtype)
        if self.owns_host:
            left[:, self.host_columns] = self._applied_weights().t()
        current = current.cpu()
        _adopt(current, left, state.master)
        kept = [t.clone() for t in self.accumulators + self.square_accumulators]  # (none on a non-owner)
        dev_grad, host_grads, extra_grads, unapplied = self.dev_grad, self.host_grads, self.extra_grads, self.unapplied
        self._distribute(self.selected, state, host_columns=self.host_columns)
        for mine, saved in zip(self.accumulators + self.square_accumulators, kept):
            mine.copy_(saved)
        self.dev_grad.copy_(dev_grad)
        for mine, received in zip(self.host_grads, host_grads):
            mine.copy_(received)
        self.extra_grads = extra_grads
        self.unapplied = unapplied  # (host_weights[weights_slot] holds the masters: the pending update)
        if self.owns_host and self.num_host:
            self._applied_weights().copy_(current.t()[self.host_columns])  # what the device holds
        self.watch.remember()

    def device_columns(self) -> torch.Tensor:
        """[R, C] in the parameter's dtype: the host columns as the device holds them (checkpoints)."""
        view = torch.zeros(self.rows, self.cols, dtype=self.param.dtype)
        self.transfers.host_access(reads=self.host_weights)  # (an upload in flight only reads them too)
        view[:, self.host_columns] = self._applied_weights().t()
        return view

    def load_device_columns(self, view: torch.Tensor) -> None:
        """Restore a checkpoint taken while this matrix's CPU update was pending (after load_canonical)."""
        self.unapplied = True
        wait_events(self.upload_done)
        self.transfers.host_access(writes=self.host_weights)
        self._applied_weights().copy_(view[:, self.host_columns].t())

    def _step_grad(self, grad_slot: int) -> torch.Tensor:
        """This step's gradient in [R, C] layout on the host (waits for its offload)."""
        self.fold_extra_grads(grad_slot)
        wait_events(self.offload_done[grad_slot])  # the first backward's copy may still be in flight
        step_grad = torch.zeros(self.rows, self.cols, dtype=self.param.dtype)
        step_grad[:, self.selected] = self.dev_grad.cpu()
        if self.owns_host:
            self.transfers.host_access(reads=[self.host_grads[grad_slot]])
            step_grad[:, self.host_columns] = self.host_grads[grad_slot].t()
        return step_grad

    def select(self, selected: torch.Tensor, grad_slot: Optional[int] = None, data_parallel=None) -> int:
        """Make `selected` the device-resident columns, moving state (and this step's grad if `grad_slot`).

        Returns how many columns changed sides. Accumulators must be empty (they are at every reselection
        boundary, and before the first selection). Data parallel: the state of the newly selected columns
        (and their gradient) comes from the owner's host to every rank.
        """
        if grad_slot is None and selected.shape == self.selected.shape and torch.equal(selected, self.selected):
            return 0  # the same columns (see below), found in one comparison
        arriving = selected[~torch.isin(selected, self.selected)]
        moved = arriving.numel() + self.num_selected - (selected.numel() - arriving.numel())
        if moved == 0 and grad_slot is None:
            # The same columns: the layout stands (every host column took the same updates since it was made,
            # so its runs still share their counts). Every rank decides alike: the selections are identical.
            return 0
        step_grad = self._step_grad(grad_slot) if grad_slot is not None else None
        state = self.canonical()
        host_columns = None
        if data_parallel is not None:
            if arriving.numel():
                self._broadcast_columns(data_parallel, arriving, state, step_grad)
            # Only the owner knows the host columns' update counts, which order them: everyone takes its order.
            host_columns = self._host_order(selected, state).to(self.device)
            data_parallel.broadcast(host_columns, self.owner)
            host_columns = host_columns.cpu()
        if self._can_relayout_in_place(selected, host_columns):
            self._relayout_in_place(selected, state, step_grad, host_columns)
        else:
            self._distribute(selected, state, step_grad, host_columns)
        return moved

    def _can_relayout_in_place(self, selected: torch.Tensor, host_columns: Optional[torch.Tensor]) -> bool:
        """A reselection of a matrix whose state shares stacks (`stacked_state`) keeps its k selected and u
        host columns, so the new layout can be written into the existing tensors: nothing is replaced, the
        stacks and every plan built on them stay valid (their index rows are rewritten in place too)."""
        return (selected.numel() == self.num_selected and self.num_selected > 0 and self.dev_master._base is not None
                and self.selected_on_device._base is not None and self.host_columns_on_device._base is not None
                and (host_columns is None or host_columns.numel() == self.num_host))

    def _relayout_in_place(self, selected: torch.Tensor, state: CanonicalState, step_grad: Optional[torch.Tensor],
                           host_columns: Optional[torch.Tensor]) -> None:
        """`_distribute`'s result, written into the tensors this state already has (same shapes). Called at a
        reselection boundary, after the boundary's CPU update was waited for and applied: no worker reads
        these buffers now (the update ran after every accumulate task)."""
        if host_columns is None:
            host_columns = self._host_order(selected, state)
        self.selected = selected
        self.selected_on_device.copy_(selected)
        self.dev_master.copy_(state.master[:, selected])
        self.dev_exp_avg.copy_(state.exp_avg[:, selected])
        self.dev_exp_avg_sq.copy_(state.exp_avg_sq[:, selected])
        counts = state.step[selected]
        self.dev_step.copy_(counts)
        uniform = bool((counts == counts[0]).all())
        self.dev_step_head = self.dev_step[:1] if uniform else None
        self.dev_grad.zero_() if step_grad is None else self.dev_grad.copy_(step_grad[:, selected])
        self.host_columns = host_columns
        self.host_columns_on_device.copy_(host_columns)
        self.offload_done = [[], []]
        self.extra_grads = [[], []]
        if not self.owns_host:
            return
        wait_events(self.upload_done)  # an upload may still read the host weights rewritten below
        self.upload_done = [None, None]
        self.transfers.host_access(writes=[*self.host_grads, *self.host_weights])
        self.host_master.copy_(state.master[:, host_columns].t())
        self.host_exp_avg.copy_(state.exp_avg[:, host_columns].t())
        self.host_exp_avg_sq.copy_(state.exp_avg_sq[:, host_columns].t())
        self.host_runs = self._runs_of_equal_count(state.step[host_columns])
        for buffer in self.accumulators + self.square_accumulators:
            buffer.zero_()
        for buffer in self.host_grads:
            buffer.zero_() if step_grad is None else buffer.copy_(step_grad[:, host_columns].t())
        for weights in self.host_weights:
            weights.copy_(self.host_master)
        self.weights_slot = 0

    def _broadcast_columns(self, data_parallel, columns: torch.Tensor, state: CanonicalState,
                           step_grad: Optional[torch.Tensor]) -> None:
        """The owner's state (and step gradient) of `columns` into every rank's `state` / `step_grad`."""
        parts = [state.master[:, columns], state.exp_avg[:, columns], state.exp_avg_sq[:, columns],
                 state.step[columns].reshape(1, -1)]
        if step_grad is not None:
            parts.append(step_grad[:, columns].float())  # exact for bf16/fp16 gradients
        packed = torch.cat(parts).to(self.device)
        data_parallel.broadcast(packed, self.owner)
        if self.owns_host:
            return
        packed = packed.cpu()
        R = self.rows
        state.master[:, columns] = packed[:R]
        state.exp_avg[:, columns] = packed[R:2 * R]
        state.exp_avg_sq[:, columns] = packed[2 * R:3 * R]
        state.step[columns] = packed[3 * R]
        if step_grad is not None:
            step_grad[:, columns] = packed[3 * R + 1:].to(step_grad.dtype)

    # -- one step -----------------------------------------------------------------------------------------
    def receive_grad(self, grad: torch.Tensor, scores: Optional[torch.Tensor], grad_slot: int) -> int:
        """Take one backward's gradient: keep the selected columns on the device, offload the rest.

        Returns the bytes sent device -> host. Keeps no reference to `grad` (the compiled graph reuses it).
        """
        g = _plain(grad, self.shape2d)
        first = self.num_grads == 0
        self.num_grads += 1
        if scores is None and first:
            kernels.column_scores(g, out=self.scores)  # straight into the buffer
        else:
            scores = kernels.column_scores(g) if scores is None else scores
            self.scores.copy_(scores) if first else self.scores.add_(scores)
        if self.has_selected:
            if first and g.dtype == self.dev_grad.dtype:
                torch.index_select(g, 1, self.selected_on_device, out=self.dev_grad)
            else:
                chosen = g.index_select(1, self.selected_on_device)
                self.dev_grad.copy_(chosen) if first else self.dev_grad.add_(chosen)
        if not self.has_host:
            return 0
        # Gather + transpose: one contiguous row per column, a single contiguous copy down.
        return self._offload(g.t(), first, grad_slot, rows=self.host_columns_on_device)

    def reduce_split_numel(self) -> tuple[int, int]:
        """Data parallel: (elements averaged on every rank, elements reduced into the owner) of a gradient."""
        return self.rows * self.num_selected, self.rows * self.num_host

    def split_grad_for_reduce(self, grad: torch.Tensor, replicated: Optional[torch.Tensor],
                              host: Optional[torch.Tensor]) -> None:
        """Copy the selected columns ([R, k]) and the unselected ones (transposed, [u, R]: the host layout)
        into the reduction buffers."""
        g = grad.reshape(self.rows, self.cols)
        if replicated is not None:
            torch.index_select(g, 1, self.selected_on_device, out=replicated.view(self.rows, self.num_selected))
        if host is not None:
            torch.index_select(g.t(), 0, self.host_columns_on_device, out=host.view(self.num_host, self.rows))

    def receive_reduced(self, replicated: Optional[torch.Tensor], host: Optional[torch.Tensor],
                        grad_slot: int) -> int:
        """Take one backward's averaged gradient: the selected columns (every rank) and, on the owner, the
        unselected ones. Scores are those of the averaged gradient (the host columns' only on the owner:
        the runtime all-reduces the scores at the step). Returns the bytes sent device -> host."""
        first = self.num_grads == 0
        self.num_grads += 1
        scores = torch.zeros(self.cols, device=self.device)
        if replicated is not None:
            chosen = replicated.view(self.rows, self.num_selected)
            self.dev_grad.copy_(chosen) if first else self.dev_grad.add_(chosen)
            scores[self.selected_on_device] = chosen.float().pow(2).sum(0)
        rest = None if host is None else host.view(self.num_host, self.rows)
        if rest is not None:
            scores[self.host_columns_on_device] = rest.float().pow(2).sum(1)
        self.scores.copy_(scores) if first else self.scores.add_(scores)
        return 0 if rest is None else self._offload(rest, first, grad_slot)

    def _offload(self, rest: torch.Tensor, first: bool, grad_slot: int, rows: Optional[torch.Tensor] = None) -> int:
        """Send the unselected columns' gradient ([u, R], or the rows `rows` of `rest`) to
        host_grads[grad_slot] (later backwards of the same step: to extra buffers, summed at step())."""
        if first:  # (also forgets the extras of a step that was discarded or skipped)
            self.offload_done[grad_slot] = [self.transfers.to_host(rest, self.host_grads[grad_slot], rows=rows)]
            self.extra_grads[grad_slot] = []
            return self.host_grad_bytes
        # Later backwards: summed on the host (accumulate worker) at step(), in pinned buffers reused step
        # after step.
        pool, index = self.extra_pool[grad_slot], len(self.extra_grads[grad_slot])
        if index == len(pool):
            pool.append(self.transfers.host_zeros(self.host_grads[grad_slot].shape, rest.dtype))
        target = pool[index]
        self.extra_grads[grad_slot].append(target)
        # (a new list, never an append: a batched hand-off gives like states one shared list)
        self.offload_done[grad_slot] = [*self.offload_done[grad_slot], self.transfers.to_host(rest, target, rows=rows)]
        return target.numel() * target.element_size()

    def fold_extra_grads(self, grad_slot: int) -> None:
        """Sum the later backwards' offloaded gradients into host_grads[grad_slot] (waits for their copies).
        Runs on the accumulate worker (`host_step_scores`); a no-op once done."""
        if self.extra_grads[grad_slot]:
            wait_events(self.offload_done[grad_slot])
            self.transfers.host_access(reads=self.extra_grads[grad_slot], writes=[self.host_grads[grad_slot]])
            for extra in self.extra_grads[grad_slot]:
                self.host_grads[grad_slot].add_(extra)
            self.extra_grads[grad_slot] = []
            self.offload_done[grad_slot] = []

    def host_step_scores(self, grad_slot: int) -> torch.Tensor:
        """Accumulate worker, several backwards in one step: fold the extras, then the exact scores of the
        summed gradient's host columns, into a pinned buffer (uploaded without blocking by `step_scores`;
        the step's host read orders that upload before the buffer's next use)."""
        self.fold_extra_grads(grad_slot)
        self.transfers.host_access(reads=[self.host_grads[grad_slot]], writes=[self.host_scores])
        torch.sum(self.host_grads[grad_slot].float().pow(2), dim=1, out=self.host_scores)
        return self.host_scores

    def step_scores(self, grad_slot: int) -> torch.Tensor:
        """This step's column scores ([C]); recomputed exactly when several backwards were summed (the host
        columns' from `host_step_scores`, which must have run)."""
        if self.num_grads > 1:
            exact = torch.empty(self.cols, device=self.device)
            exact[self.selected_on_device] = self.dev_grad.float().pow(2).sum(0)
            if self.owns_host:
                exact[self.host_columns_on_device] = self.transfers.to_device(self.host_scores)[0]
            else:  # the owner reports them
                exact[self.host_columns_on_device] = 0.0
            self.scores.copy_(exact)
        return self.scores

    def device_update(self) -> Optional[DeviceUpdate]:
        if not self.num_selected:
            return None
        return DeviceUpdate(self.dev_grad, self.dev_master, self.dev_exp_avg, self.dev_exp_avg_sq,
                            self.dev_step, self.as_columns(), self.selected_on_device, count_head=self.dev_step_head,
                            counts_fixed=False)

    # -- host side (CPU worker threads) -------------------------------------------------------------------
    def host_adamw_batch(self, acc_slot: int):
        """Fused-AdamW arguments for the boundary update of the host columns, per run (the accumulators
        already divided into the mean gradient and, with interval_second_moment, the mean squared gradient:
        the run's last item, else None)."""
        acc = self.accumulators[acc_slot]
        squares = self.square_accumulators[acc_slot] if self.accumulate_squares else None
        for start, end, count in self.host_runs:
            yield (self.host_master[start:end], acc[start:end], self.host_exp_avg[start:end],
                   self.host_exp_avg_sq[start:end], count, None if squares is None else squares[start:end])

    @staticmethod
    def update_host_columns(matrices: "list[MatrixState]", acc_slot: int, steps_accumulated: list[int],
                            hyperparameters: dict) -> None:
        """Update worker, at a boundary: the CPU AdamW of the matrices' host columns (one param group, one
        lr), from the mean of the interval's `steps_accumulated` gradients; then empty the accumulators and
        publish the new columns for the upload."""
        emptied, by_steps = [], {}
        for m, steps in zip(matrices, steps_accumulated):
            sums = [m.accumulators[acc_slot]] + ([m.square_accumulators[acc_slot]] if m.accumulate_squares else [])
            by_steps.setdefault(steps, []).extend(sums)
            emptied += sums
        for steps, sums in by_steps.items():
            torch._foreach_div_(sums, steps)
        batch = [item for m in matrices for item in m.host_adamw_batch(acc_slot)]
        masters, grads, exp_avgs, exp_avg_sqs, counts, grad_sqs = (list(column) for column in zip(*batch))
        kernels.cpu_adamw_(masters, grads, exp_avgs, exp_avg_sqs, counts,
                           grad_sqs=None if grad_sqs[0] is None else grad_sqs, **hyperparameters)
        torch._foreach_zero_(emptied)
        MatrixState.publish_host_weights(matrices)

    @staticmethod
    def publish_host_weights(matrices: "list[MatrixState]") -> None:
        """After a CPU update: cast the new masters into each matrix's free weights buffer for the next
        upload (one batched copy)."""
        free = [m.host_weights[m.weights_slot ^ 1] for m in matrices]
        for m in matrices:
            wait_events([m.upload_done[m.weights_slot ^ 1]])
        matrices[0].transfers.host_access(writes=free)
        torch._foreach_copy_(free, [m.host_master for m in matrices])
        for m in matrices:
            m.weights_slot ^= 1

    # -- training thread ----------------------------------------------------------------------------------
    def apply_host_columns(self, merge_columns, data_parallel=None) -> int:
        """Write the latest CPU-updated columns into the device parameter; returns the bytes uploaded.
        Data parallel: the owner uploads and broadcasts them, every other rank receives them."""
        if not self.num_host:
            self.unapplied = False
            return 0
        uploaded = 0
        if self.owns_host:
            slot = self.weights_slot
            values, self.upload_done[slot] = self.transfers.to_device(self.host_weights[slot])
            uploaded = values.numel() * values.element_size()
        else:
            values = torch.empty(self.num_host, self.rows, dtype=self.param.dtype, device=self.device)
        if data_parallel is not None:
            data_parallel.broadcast(values, self.owner)
        merge_columns(self.as_columns(), self.host_columns_on_device, values)
        self.unapplied = False
        return uploaded
