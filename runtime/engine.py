"""ZenFlowRuntime: the state and schedule of one ZenFlowAdamW (docs/semantics.md), eager and compiled.

Gradients arrive in buckets (`accumulate_grads`: from the compiled graph's custom op per backward, or from
`ZenFlowAdamW.step()`, which hands over the eager `.grad`s; data parallel: `accumulate_grad` from the
post-accumulate-grad hooks, into the reducer). `step()` then makes the step's decisions in this order:
global norm (skip if non-finite, else clip coefficient) -> first selection at t == W -> device AdamW on the
selected columns and vectors -> hand the unselected columns' gradient to the accumulate worker -> update
boundary? (int interval or Zen-auto) -> apply the previous CPU update (overlap) and launch this one ->
reselection (after waiting for and applying the boundary's own update, so state moves fully current).

Data parallel (`data_parallel` set): gradients arrive averaged across ranks (`GradReducer`); the
step all-reduces the column scores first, so the norm, clipping, Zen-auto and every selection are computed
from the same numbers on every rank and every rank issues the same collectives in the same order. Host
state is partitioned by matrix (`DataParallel.assign_owner`): only a matrix's owner accumulates and runs
its CPU AdamW; at the apply the owner broadcasts the updated columns.

Determinism: the device only ever receives a CPU update at a fixed point of the schedule (the boundary
after its launch, or its own boundary without overlap), so results never depend on thread timing; if the
CPU is late the training thread waits, and the wait is counted as stall time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import time
from concurrent.futures import Future
from typing import Callable, Optional

import torch

from zenflow_compile.config import ZenFlowConfig
from zenflow_compile.runtime import kernels
from zenflow_compile.runtime import param_state, registry
from zenflow_compile.runtime.collectives import DataParallel
from zenflow_compile.runtime.grad_reduce import GradReducer
from zenflow_compile.runtime.handoff import HandoffPlan
from zenflow_compile.runtime.stacked_state import stack_like_states, stacked_merges
from zenflow_compile.runtime.param_state import (CanonicalState, MatrixState, VectorState, top_k_columns,
                                                 top_k_columns_many)
from zenflow_compile.runtime.transfers import StallClock, Transfers
from zenflow_compile.runtime.worker import CpuWorker, joined, wait_for


_VERSION = operator.attrgetter("_version")
_DTYPE = operator.attrgetter("dtype")


def _hyperparameters(group: dict) -> dict:
    beta1, beta2 = group["betas"]
    return dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]))


@dataclasses.dataclass
class _StepReadout:
    """What the step's one host read brought back (see `ZenFlowRuntime._read_step_values`)."""

    norm: float  # global L2 norm of the unscaled gradient
    scale: float  # the loss scale the gradients carry (1 without a GradScaler)
    mean_scores: dict = dataclasses.field(default_factory=dict)  # Zen-auto: pid -> (selected, unselected) mean
    selecting_scores: dict = dataclasses.field(default_factory=dict)  # pid -> host scores, first selections


class ZenFlowRuntime:
    def __init__(self, config: ZenFlowConfig, max_grad_norm: Optional[float],
                 data_parallel: Optional[DataParallel] = None, reduce_bucket_numel: int = 25_000_000):
        self.config = config
        self.max_grad_norm = max_grad_norm
        self.data_parallel = data_parallel
        self.rank = data_parallel.rank if data_parallel is not None else 0
        self.bucket_numel = reduce_bucket_numel  # gradient hand-off buckets (compiled graphs; reducer)
        self.reducer = (GradReducer(data_parallel, reduce_bucket_numel, self._receive_reduced)
                        if data_parallel is not None else None)
        self.owners: dict[int, int] = {}  # data parallel: pid -> rank holding its host state (set at creation)
        self.params: dict[int, tuple[torch.Tensor, int]] = {}  # every owned parameter: id -> (param, group)
        # Optimizer state exists only for parameters that got a gradient: a frozen (or never used) parameter
        # costs no host memory and no transfers, and is never written.
        self.states: dict[int, MatrixState | VectorState] = {}
        self.step_count = 0  # t: completed (non-skipped) steps
        self.selection_start = 0  # first step run under the current selection
        self.selection_epoch = 0  # select_strategy="epoch": epoch-grid points passed at the last selection
        self.steps_accumulated = 0  # steps since the last update boundary
        self.update_pending = False  # overlap: a launched CPU update not yet applied to the device
        self.grad_slot = 0  # which host-gradient buffer this step's backward fills
        self.acc_slot = 0  # which accumulator this interval fills
        self.accumulate_worker = CpuWorker("accumulate", pt_reserved_cores_perc=config.pt_reserved_cores_perc)
        self.update_worker = CpuWorker("update", pt_reserved_cores_perc=config.pt_reserved_cores_perc)
        self._accumulate_done: list[Optional[Future]] = [None, None]
        self._last_accumulate: Optional[Future] = None
        self._update_future: Optional[Future] = None
        self._step_open = False
        self._failure: Optional[tuple[str, str]] = None  # (what failed, its cause), see _fail
        # Built once per layout (param_state.PerLayout), used every step:
        self.layout_clock = param_state.LayoutClock()  # this optimizer's states' layout changes
        self._device_args = param_state.PerLayout(self._device_adamw_args, self.layout_clock)
        self._accumulate_batches = param_state.PerLayout(lambda matrices: {}, self.layout_clock)  # slots -> batch
        self._zen_auto_plan = param_state.PerLayout(self._zen_auto_segments, self.layout_clock)
        self._stacked_merges = param_state.PerLayout(stacked_merges, self.layout_clock)
        # (every ParamWatch.remember() comes with a layout change: what each watch saw is fixed per layout)
        self._watched_params = param_state.PerLayout(
            lambda states: ([s.watch.param for s in states], [s.watch.seen for s in states],
                            [s.watch.seen[2] for s in states]), self.layout_clock)
        self._handoff_plans: dict[tuple, HandoffPlan] = {}  # bucket's pids -> plan, for one layout generation
        self._handoff_generation = None
        self._stacked_generation = None  # the layout generation stack_like_states last saw
        self.transfers: Optional[Transfers] = None  # set by the first parameter: one device per optimizer
        self.stall_clock: Optional[StallClock] = None
        self.counters = dict(steps=0, skipped_steps=0, cpu_updates=0, reselections=0, host_reads=0, host_waits=0,
                             bytes_device_to_host=0, bytes_host_to_device=0, selection_churn=0.0)
        self.grad_norm: Optional[float] = None  # the last step's global gradient norm, before clipping
        # Called with the parameters written by someone else, before their values are adopted (the owner
        # refuses layouts and dtypes the states cannot follow).
        self.check_written_params: Callable[[list[torch.Tensor]], None] = lambda params: None

    # -- parameters ---------------------------------------------------------------------------------------
    def check_device(self, param: torch.Tensor) -> None:
        if self.transfers is not None and param.device != self.transfers.device:
            raise ValueError(f"all parameters of one ZenFlowAdamW must be on one device; got {param.device} "
                             f"and {self.transfers.device}. Use one optimizer per device.")

    def add_param(self, param: torch.Tensor, group_index: int) -> int:
        self.check_device(param)
        if self.transfers is None:
            self.transfers = Transfers(param.device)
            self.stall_clock = StallClock(self.transfers)
            for worker in (self.accumulate_worker, self.update_worker):
                worker.ordering = self.transfers.ordering
        pid = registry.register_param(param, self)
        self.params[pid] = (param, group_index)
        return pid

    def follow_param_groups(self, group_of: dict[int, int]) -> None:
        """The optimizer's param groups were edited: `group_of` maps every id still in them to its group. An id
        left out is no longer optimized (its state is dropped, with its accumulated gradient and any CPU update
        not yet applied, as torch.optim leaves a removed parameter alone); a moved one takes its new group's
        hyperparameters from the next update on."""
        self._drain()  # CPU work in flight reads the states
        for pid in [pid for pid in self.params if pid not in group_of]:
            del self.params[pid]
            self.states.pop(pid, None)
            registry.unregister_param(pid)
        for pid, group_index in group_of.items():
            param, _ = self.params[pid]
            self.params[pid] = (param, group_index)
            if pid in self.states:
                self.states[pid].group_index = group_index
        self.layout_clock.bump()

    def _state(self, pid: int) -> MatrixState | VectorState:
        """The parameter's optimizer state, created from its current values at its first gradient."""
        state = self.states.get(pid)
        if state is None:
            param, group_index = self.params[pid]
            owner = self._owner(pid, param)
            if param.dim() >= 2:
                state = MatrixState(param, pid, group_index, self.transfers, owner=owner,
                                    owns_host=owner == self.rank,
                                    accumulate_squares=self.config.interval_second_moment, clock=self.layout_clock)
            else:
                state = VectorState(param, pid, group_index, owner=owner, clock=self.layout_clock)
            self.states[pid] = state
            # Registration order (ids grow with it), not gradient order: the global norm sums the scores in
            # this order, so a resumed run (states created by load_state_dict) must use the same one.
            self.states = dict(sorted(self.states.items()))
        return state

    def _owner(self, pid: int, param: torch.Tensor) -> int:
        """The rank that holds the parameter's host state: decided when its state is created, in the same
        order on every rank (a checkpoint's assignment is restored through `owners`)."""
        if self.data_parallel is None:
            return 0
        if pid not in self.owners:
            self.owners[pid] = self.data_parallel.assign_owner(param.numel())
        return self.owners[pid]

    @property
    def matrices(self) -> list[MatrixState]:
        return [s for s in self.states.values() if s.is_matrix]

    # -- gradients ----------------------------------------------------------------------------------------
    def accumulate_grad(self, pid: int, grad: torch.Tensor, scores: Optional[torch.Tensor]) -> None:
        """One backward's gradient of one parameter (the data-parallel eager hooks; `reduce_grads` of a graph
        compiled for a data-parallel owner, run by one without). Data parallel: it joins the reducer's open
        bucket (`scores` are of the local gradient, unused)."""
        if not self._step_open:  # (called per parameter and backward: the common case stays short)
            self._open_step()
        state = self.states.get(pid) or self._state(pid)
        if self.reducer is not None:
            self.reducer.add(state, grad)
            return
        self.counters["bytes_device_to_host"] += state.receive_grad(grad, scores, self.grad_slot)

    def accumulate_grads(self, pids: list[int], grads: list[torch.Tensor],
                         scores: "list[Optional[torch.Tensor]] | None" = None) -> None:
        """One bucket of backward gradients (the compiled graph's `zenflow::accumulate_grads`, or the eager
        `.grad`s handed over at `step()`), as `accumulate_grad` for each but batched (`runtime/handoff.py`); the plan for a
        bucket's states is built once per layout. `scores`: per gradient, its column scores or None."""
        if not self._step_open:
            self._open_step()
        if self.reducer is not None:
            for pid, grad in zip(pids, grads):
                self.reducer.add(self.states.get(pid) or self._state(pid), grad)
            return
        if self._handoff_generation != self.layout_clock.generation:
            self._stack_like_states()  # now, not at the step: the plans below are then built once
            self._handoff_plans.clear()
            self._handoff_generation = self.layout_clock.generation
        key = tuple(pids)
        plan = self._handoff_plans.get(key)
        if plan is None:
            states = [self.states.get(pid) or self._state(pid) for pid in pids]  # (may create states)
            plan = self._handoff_plans[key] = HandoffPlan(states)
            self._handoff_generation = self.layout_clock.generation
        with torch.no_grad():  # (a backward with create_graph=True runs its hooks with grad mode on)
            self.counters["bytes_device_to_host"] += plan.receive(grads, scores, self.grad_slot)

    def reduce_grads(self, pids: list[int], grads: list[torch.Tensor]) -> None:
        """Data parallel, compiled: one bucket of gradients (graph order), reduced asynchronously. A graph
        compiled for a data-parallel owner can be reused (Dynamo shares graphs across instances) by an
        optimizer without one: its gradients are then taken one by one, as the single-process graph would."""
        self._open_step()
        if self.reducer is None:
            for pid, grad in zip(pids, grads):
                self.accumulate_grad(pid, grad, None)
            return
        self.reducer.launch([(self._state(pid), grad) for pid, grad in zip(pids, grads)])

    def _open_step(self) -> None:
        if not self._step_open:  # once per step: a worker failure surfaces at the step's first gradient
            self.check_failure()
            # The accumulate task of two steps ago read the buffers this step fills.
            pending = self._accumulate_done[self.grad_slot]
            if pending is not None:
                self._wait(pending)
            self._adopt_casts()
            self._step_open = True

    def _receive_reduced(self, state, replicated: Optional[torch.Tensor], host: Optional[torch.Tensor]) -> None:
        if state.is_matrix:
            sent = state.receive_reduced(replicated, host, self.grad_slot)
        else:
            sent = state.receive_grad(replicated, None, self.grad_slot)
        self.counters["bytes_device_to_host"] += sent

    def _all_reduce_scores(self, stepped: list, scores: list[torch.Tensor]) -> None:
        """Every rank's scores become the full scores of the averaged gradient: each state's owner reports
        it (the others contribute zeros), one all-reduce for all of them."""
        mine = [t if s.owner == self.rank else torch.zeros_like(t) for s, t in zip(stepped, scores)]
        packed = torch.cat(mine)
        self.data_parallel.all_reduce(packed)
        for t, reduced in zip(scores, packed.split([t.numel() for t in scores])):
            t.copy_(reduced)

    @property
    def holds_step_grads(self) -> bool:
        """Gradients of this step have been handed over (a backward ran since the last step / zero_grad)."""
        return self._step_open

    def discard_step_grads(self) -> None:
        if self.reducer is not None:
            self.reducer.finish_all()  # every rank runs the same collectives, used or not
        for state in self.states.values():
            state.num_grads = 0
        self._step_open = False

    # -- the step -----------------------------------------------------------------------------------------
    def step(self, param_groups: list[dict], grad_scale: Optional[torch.Tensor] = None) -> bool:
        """One optimizer step; False if it was skipped for a non-finite gradient.

        `grad_scale`: the loss scale the gradients carry (torch.amp.GradScaler), divided out here.
        """
        self.check_failure()
        self._check_hyperparameters(param_groups)
        if self.reducer is not None:
            self.reducer.finish_all()
        self._adopt_external_writes()
        cfg, t = self.config, self.step_count
        stepped = [s for s in self.states.values() if s.num_grads]
        self._fold_accumulated_grads(stepped)
        scores = [s.step_scores(self.grad_slot) for s in stepped]
        if self.data_parallel is not None and stepped:
            self._all_reduce_scores(stepped, scores)
        stepped_matrices = [s for s in stepped if s.is_matrix]
        warmed_up = t >= cfg.full_warm_up_rounds
        # First selection (a matrix's first gradient at t >= W), before the updates: needs its scores here.
        selecting = [m for m in stepped_matrices if warmed_up and not m.num_selected]
        zen_auto = [m for m in stepped_matrices if warmed_up and cfg.auto_update and m.num_selected and m.num_host]
        readout = self._read_step_values(scores, grad_scale, zen_auto, selecting)
        self.grad_norm = readout.norm
        if not math.isfinite(readout.norm):
            self.counters["skipped_steps"] += 1
            self.discard_step_grads()
            return False
        coef = 1.0 if self.max_grad_norm is None else min(1.0, self.max_grad_norm / (readout.norm + 1e-6))
        coef /= readout.scale  # the clip coefficient of the unscaled gradient, applied to the scaled one
        # From here on the step changes state (device columns, host work, selections, counters) in several
        # places: an exception part-way (KeyboardInterrupt, out of memory, a worker failure) leaves them
        # out of step with each other, so the optimizer refuses to go on until a checkpoint is loaded.
        try:
            self._apply_step(t, param_groups, stepped, stepped_matrices, selecting, readout, coef, warmed_up)
        except BaseException as error:
            if self._failure is None:
                self._failure = (f"ZenFlowAdamW.step() was interrupted part-way through step {t}",
                                 f"{type(error).__name__}: {error}")
                self._forget_failed_tasks()
            raise
        return True

    def _apply_step(self, t: int, param_groups: list[dict], stepped: list, stepped_matrices: list[MatrixState],
                    selecting: list[MatrixState], readout: "_StepReadout", coef: float, warmed_up: bool) -> None:
        """Everything a finite step changes, in order (see the module docstring)."""
        cfg = self.config
        if t == cfg.full_warm_up_rounds:
            self.selection_start = t
        for m in selecting:
            host_scores = readout.selecting_scores[m.pid]
            m.select(top_k_columns(host_scores, cfg.num_selected(m.cols)), grad_slot=self.grad_slot,
                     data_parallel=self.data_parallel)
            if cfg.auto_update and m.num_host:
                readout.mean_scores[m.pid] = (float(host_scores[m.selected].mean()),
                                              float(host_scores[m.host_columns].mean()))

        self._stack_like_states()
        self._update_on_device(stepped, param_groups, coef)
        self._submit_accumulate([m for m in stepped_matrices if m.num_host and m.owns_host], coef)
        for m in stepped_matrices:
            m.steps_accumulated += 1
        self.steps_accumulated += 1

        if self._is_update_boundary(t, stepped_matrices, readout.mean_scores, coef):
            # A boundary that may reselect: every matrix's scores come to the host in one transfer.
            host_scores = self._host_scores(stepped_matrices) if warmed_up and self._may_reselect(t) else None
            reselect = host_scores is not None and self._should_reselect(t, stepped_matrices, host_scores)
            self._update_boundary(param_groups, overlap=cfg.overlap_step and warmed_up and not reselect)
            self.counters["cpu_updates"] += warmed_up  # warm-up steps are plain AdamW, not boundaries
            if reselect:
                self._reselect(t, stepped_matrices, host_scores)

        self.step_count += 1
        self.counters["steps"] += 1
        self.grad_slot ^= 1
        self.discard_step_grads()

    def _check_hyperparameters(self, param_groups: list[dict]) -> None:
        """Before anything changes: values the config cannot work with (param groups change at any time)."""
        if self.config.interval_second_moment:
            for g, group in enumerate(param_groups):
                if not group["betas"][1] > 0.0:
                    raise ValueError(
                        f"interval_second_moment needs betas[1] > 0; param group {g} has betas "
                        f"{tuple(group['betas'])}. Set betas[1] > 0, or interval_second_moment=False")

    def _adopt_external_writes(self) -> None:
        """The parameter is the source of truth (docs/semantics.md). Values written into it by anyone else
        since the optimizer's last write (its version counter or storage changed) become the master."""
        states = list(self.states.values())
        params, seen, _ = self._watched_params.get(states)
        # (one pass of builtins over every parameter: the common case, nothing written, costs ~0.1 us each)
        if list(zip(map(_VERSION, params), map(torch.Tensor.data_ptr, params), map(_DTYPE, params))) == seen:
            return
        written = [s for s in states if s.written_externally()]
        if written:
            self.check_written_params([s.param for s in written])
            self._drain()  # CPU work in flight reads and writes the host masters
            for state in written:
                state.adopt_param_values()

    def _adopt_casts(self) -> None:
        """A parameter cast since the last step (model.to(dtype)) gets its state's buffers in the new dtype
        before the step's first gradient lands in them (else an upcast's gradient is rounded to the old dtype
        on the way in); any other write is adopted at the step, as usual."""
        states = list(self.states.values())
        params, _, dtypes = self._watched_params.get(states)
        if list(map(_DTYPE, params)) != dtypes:
            self._adopt_external_writes()

    def _stack_like_states(self) -> None:
        """Like states share stacked device storage (`runtime/stacked_state.py`), redone after any layout
        change: at the next hand-off (before its plans are built) or at the step before the device update
        (after this step's first selections), whichever comes first. Values are copied, so a bucket already
        handed over in this backward keeps its gradients."""
        if self._stacked_generation != self.layout_clock.generation:
            # (on CUDA, restacking the offload buffers first waits for the copies in flight: a counted wait)
            stack_like_states(list(self.states.values()), waiting=self._counted_wait)
            self._stacked_generation = self.layout_clock.generation

    def _update_on_device(self, stepped: list, param_groups: list[dict], coef: float) -> None:
        """The selected columns and the vectors: one fused device AdamW per param group."""
        for group_index, args in self._device_args.get(stepped):
            kernels.device_adamw_(args, grad_scale=coef, **_hyperparameters(param_groups[group_index]))

    @staticmethod
    def _device_adamw_args(stepped: list) -> list:
        """[(param group, its device AdamW's argument lists)] for these states."""
        by_group: dict[int, list] = {}
        for state in stepped:
            update = state.device_update()
            if update is not None:
                by_group.setdefault(state.group_index, []).append(update)
        return [(g, kernels.DeviceAdamWArgs(updates)) for g, updates in by_group.items()]

    def _submit_accumulate(self, matrices: list[MatrixState], coef: float) -> None:
        if not matrices:
            return
        grad_slot, acc_slot = self.grad_slot, self.acc_slot
        batches = self._accumulate_batches.get(matrices)
        batch = batches.get((grad_slot, acc_slot))
        if batch is None:
            batch = batches[grad_slot, acc_slot] = param_state.AccumulateBatch(matrices, grad_slot, acc_slot)
        copies = batch.copies_in_flight()  # this step's copies down, taken now: the lists are replaced next step
        future = self.accumulate_worker.submit(lambda: batch.run(coef, copies))
        self._accumulate_done[grad_slot] = future
        self._last_accumulate = future

    # -- boundaries ---------------------------------------------------------------------------------------
    def _fold_accumulated_grads(self, stepped: list) -> None:
        """Gradient accumulation (several backwards in one step): the accumulate worker sums the offloaded
        host parts and scores them (the norm needs the scores of the summed gradient); the training thread
        only waits, counted."""
        folding = [s for s in stepped if s.is_matrix and s.num_grads > 1 and s.owns_host and s.num_host]
        if folding:
            grad_slot = self.grad_slot
            self._wait(self.accumulate_worker.submit(lambda: [m.host_step_scores(grad_slot) for m in folding]))

    def _read_step_values(self, scores: list[torch.Tensor], grad_scale: Optional[torch.Tensor],
                          zen_auto: list[MatrixState], selecting: list[MatrixState]) -> "_StepReadout":
        """The step's one host read: the squared norm (one reduction over every score), the loss scale,
        Zen-auto's mean scores (selected, unselected) per matrix, and the scores of the matrices selecting
        for the first time."""
        if not scores:
            return _StepReadout(norm=0.0, scale=1.0)
        parts = [torch.cat(scores).sum().float().reshape(1)]
        if grad_scale is not None:
            parts.append(grad_scale.to(parts[0].device).float().reshape(1))
        if zen_auto:
            parts.append(self._zen_auto_means(zen_auto))
        parts += [m.scores for m in selecting]
        values = self._read_to_host(torch.cat(parts))
        scale = 1.0 if grad_scale is None else float(values[1])
        readout = _StepReadout(norm=math.sqrt(float(values[0])) / scale, scale=scale)
        offset = 1 if grad_scale is None else 2
        means = values[offset:offset + 2 * len(zen_auto)].tolist()
        readout.mean_scores = {m.pid: (means[2 * i], means[2 * i + 1]) for i, m in enumerate(zen_auto)}
        offset += 2 * len(zen_auto)
        for m in selecting:
            readout.selecting_scores[m.pid] = values[offset:offset + m.cols]
            offset += m.cols
        return readout

    def _zen_auto_means(self, matrices: list[MatrixState]) -> torch.Tensor:
        """[2n]: each matrix's mean score over its selected, then its unselected columns, in a fixed number
        of ops: the scores concatenated, permuted so that every (matrix, side) is one contiguous segment, and
        segment means (deterministic on CUDA, unlike an index_add). The permutation is rebuilt only when the
        matrices or a layout change."""
        # (a reselection may rewrite the selections in place, without a layout change)
        order, lengths = self._zen_auto_plan.get(matrices, extra=self.counters["reselections"])
        scores = torch.cat([m.scores for m in matrices])
        return torch.segment_reduce(scores[order], "mean", lengths=lengths)

    @staticmethod
    def _zen_auto_segments(matrices: list[MatrixState]) -> tuple[torch.Tensor, torch.Tensor]:
        """(permutation of the concatenated scores, segment lengths) for `_zen_auto_means`."""
        order, lengths, offset = [], [], 0
        for m in matrices:
            order += [m.selected + offset, m.host_columns + offset]
            lengths += [m.num_selected, m.num_host]
            offset += m.cols
        device = matrices[0].scores.device
        return torch.cat(order).to(device), torch.tensor(lengths, device=device)

    def _read_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A blocking device -> host read (on CUDA, a synchronisation): every one the step makes goes
        through here and is counted."""
        self.counters["host_reads"] += 1
        return self.transfers.read_to_host(tensor)

    def _host_scores(self, matrices: list[MatrixState]) -> dict[int, torch.Tensor]:
        """Every matrix's step scores on the host, in one transfer."""
        if not matrices:
            return {}
        flat = self._read_to_host(torch.cat([m.scores for m in matrices]))
        return dict(zip((m.pid for m in matrices), flat.split([m.cols for m in matrices])))

    def _is_update_boundary(self, t: int, stepped_matrices: list[MatrixState],
                            mean_scores: dict[int, tuple[float, float]], coef: float) -> bool:
        cfg = self.config
        if t < cfg.full_warm_up_rounds:
            return True  # warm-up: a plain synchronous AdamW of every column, every step
        if not cfg.auto_update:
            return (t - cfg.full_warm_up_rounds + 1) % cfg.update_interval == 0
        # Zen-auto: a matrix is ripe once its unselected columns' mean score, summed over the interval,
        # reaches the interval's average of its selected columns' mean score (scores of the clipped gradient).
        for m in stepped_matrices:
            if m.pid in mean_scores:
                selected_mean, unselected_mean = mean_scores[m.pid]
                m.sum_selected_score += selected_mean * coef * coef
                m.sum_unselected_score += unselected_mean * coef * coef
        accumulating = [m for m in self.matrices if m.steps_accumulated > 0]
        ripe = sum(1 for m in accumulating if not m.num_host
                   or m.sum_unselected_score >= m.sum_selected_score / m.steps_accumulated)
        return (not accumulating or ripe >= cfg.auto_ratio * len(accumulating)
                or self.steps_accumulated >= cfg.max_update_interval)

    def _may_reselect(self, t: int) -> bool:
        """Whether this boundary reselects, or ("auto") must look at the scores to decide."""
        cfg = self.config
        if cfg.select_strategy == "epoch":  # the first boundary at or after each point of the epoch grid
            return self._epoch_grid_point(t) > self.selection_epoch
        if cfg.reselect_every is not None:
            return t - self.selection_start + 1 >= cfg.reselect_every
        return True

    def _should_reselect(self, t: int, stepped_matrices: list[MatrixState],
                         host_scores: dict[int, torch.Tensor]) -> bool:
        cfg = self.config
        if cfg.select_strategy == "epoch" or cfg.reselect_every is not None:
            return True  # _may_reselect decided
        # "auto": reselect once matrices holding half of the columns kept fewer than half of S in the top-k.
        drifted_columns = 0
        tops = top_k_columns_many([host_scores[m.pid] for m in stepped_matrices],
                                  [m.num_selected for m in stepped_matrices])
        for m, top in zip(stepped_matrices, tops):
            if 2 * int(torch.isin(top, m.selected).sum()) < m.num_selected:
                drifted_columns += m.cols
        total_columns = sum(m.cols for m in stepped_matrices)
        return total_columns > 0 and 2 * drifted_columns >= total_columns

    def _epoch_grid_point(self, t: int) -> int:
        """How many multiples of select_interval * steps_per_epoch steps (from W) have completed by step t."""
        cfg = self.config
        if cfg.select_strategy != "epoch":
            return 0
        return (t - cfg.full_warm_up_rounds + 1) // cfg.reselect_every

    def _update_boundary(self, param_groups: list[dict], overlap: bool) -> None:
        if self.update_pending:  # overlap: the previous boundary's update lands now, before the next launch
            if self._update_future is not None:  # None right after a checkpoint load: already finished
                self._wait(self._update_future)
            self._apply_host_columns()
        self._update_future = self._launch_cpu_update(param_groups)
        self.steps_accumulated = 0
        self.acc_slot ^= 1
        for m in self.matrices:
            m.sum_selected_score = m.sum_unselected_score = 0.0
            m.steps_accumulated = 0
        self.update_pending = overlap
        if not overlap:
            self._wait(self._update_future)
            self._apply_host_columns()

    def _launch_cpu_update(self, param_groups: list[dict]) -> Future:
        acc_slot = self.acc_slot
        # One fused CPU AdamW per (param group, lr multiplier). The multiplier is 1, or with the opt-in
        # interval_aware_update the matrix's m accumulated steps (its update stands for m steps).
        by_group: dict[tuple[int, int], list[MatrixState]] = {}
        for m in self.matrices:
            if m.num_host and m.steps_accumulated:  # a matrix that got no gradient all interval is skipped
                scale = m.steps_accumulated if self.config.interval_aware_update else 1
                by_group.setdefault((m.group_index, scale), []).append(m)
        hyper = {}  # the group's values at launch
        for g, scale in by_group:
            hyper[g, scale] = _hyperparameters(param_groups[g])
            hyper[g, scale]["lr"] *= scale
        num_steps = {m.pid: m.steps_accumulated for members in by_group.values() for m in members}
        for members in by_group.values():
            for m in members:
                m.unapplied = True  # its new columns reach the device at the next apply

        owned = {key: [m for m in members if m.owns_host] for key, members in by_group.items()}

        def cpu_update():
            for g, members in owned.items():
                if members:
                    MatrixState.update_host_columns(members, acc_slot, [num_steps[m.pid] for m in members],
                                                    hyper[g])

        return self.update_worker.submit(cpu_update, after=self._last_accumulate)

    def _apply_host_columns(self) -> None:
        """Write the last launched CPU update into the device parameters of the matrices it updated."""
        unapplied = [m for m in self.matrices if m.unapplied]
        # Data parallel: the other ranks wait in the broadcast for the owners' CPU updates (counted as stall).
        waiting = self._counted_wait() if self.data_parallel is not None and unapplied else contextlib.nullcontext()
        with waiting:
            if self.data_parallel is None:  # like CPU matrices in a few stacked calls
                merges, unapplied = self._stacked_merges.get(unapplied)
                for merge in merges:
                    self.counters["bytes_host_to_device"] += merge.apply()
            for m in unapplied:
                self.counters["bytes_host_to_device"] += m.apply_host_columns(kernels.merge_columns_,
                                                                              self.data_parallel)
        self.update_pending = False

    def _reselect(self, t: int, matrices: list[MatrixState], host_scores: dict[int, torch.Tensor]) -> None:
        moved = total = 0
        chosen = top_k_columns_many([host_scores[m.pid] for m in matrices],
                                    [self.config.num_selected(m.cols) for m in matrices])
        for m, columns in zip(matrices, chosen):
            total += m.num_selected
            moved += m.select(columns, data_parallel=self.data_parallel)
        self.selection_start = t + 1
        self.selection_epoch = self._epoch_grid_point(t)
        self.counters["reselections"] += 1
        self.counters["selection_churn"] = moved / (2 * total) if total else 0.0

    # -- waiting, errors ----------------------------------------------------------------------------------
    def _wait(self, future: Future) -> None:
        """The training thread waits for CPU work: the documented stall, measured."""
        if future.done():
            joined(future)
            if future.exception() is not None:
                self._fail(future.exception())
            return
        with self._counted_wait():
            try:
                wait_for(future)
            except BaseException as error:
                self._fail(error)

    @contextlib.contextmanager
    def _counted_wait(self):
        """Time the training thread spends waiting for CPU work (here or on another rank): counted and
        measured as stall."""
        self.counters["host_waits"] += 1
        marker, start = self.stall_clock.before_wait(), time.perf_counter()
        try:
            yield
        finally:
            self.stall_clock.after_wait(marker, time.perf_counter() - start)

    def _fail(self, error: BaseException):
        """Record a CPU worker's failure and raise it in the training thread (and at every later call)."""
        if self._failure is None:
            self._failure = ("ZenFlow CPU worker failed", f"{type(error).__name__}: {error}")
            self._forget_failed_tasks()
        raise RuntimeError(self._failure_message()) from error

    def _failure_message(self) -> str:
        what, cause = self._failure
        return (f"{what}; the optimizer state is no longer consistent. Restore from the last checkpoint "
                "(model.load_state_dict(...) and opt.load_state_dict(...), after opt.zero_grad()), or build a "
                f"new optimizer. Cause: {cause}")

    def _forget_failed_tasks(self) -> None:
        """The failure is kept as text: a stored exception (or a future holding it) keeps its traceback's
        frames alive, and with them the training loop's locals and this optimizer, for as long as the
        parameters' hooks hold this runtime (the optimizer could then never be freed or replaced)."""
        self._accumulate_done = [None, None]
        self._last_accumulate = self._update_future = None
        for worker in (self.accumulate_worker, self.update_worker):
            worker.forget_failures()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def settle_after_failure(self) -> None:
        """Before a checkpoint load clears a failure: let the tasks still queued on the old states finish
        (their errors were already reported)."""
        for worker in (self.accumulate_worker, self.update_worker):
            worker.wait_all()
            worker.forget_failures()

    def clear_failure(self) -> None:
        """A checkpoint load replaced every state: the optimizer is consistent again."""
        self._failure = None

    def check_failure(self) -> None:
        """Raise if the optimizer failed (a worker's error, an interrupted step), also on a step with
        nothing to do: a failed optimizer refuses to go on until a checkpoint is loaded."""
        if self._failure is not None:
            raise RuntimeError(self._failure_message())
        for worker in (self.accumulate_worker, self.update_worker):
            try:
                worker.raise_if_failed()
            except BaseException as error:
                self._fail(error)

    def synchronize(self) -> None:
        """Wait for all CPU work and apply any in-flight update to the device parameters."""
        self.check_failure()
        self._drain()
        self._adopt_external_writes()
        if self.update_pending:
            self._apply_host_columns()

    def _drain(self) -> None:
        for worker in (self.accumulate_worker, self.update_worker):
            try:
                worker.drain()
            except BaseException as error:
                self._fail(error)

    def close(self) -> None:
        for worker in (self.accumulate_worker, self.update_worker):
            worker.shutdown()
        for pid in self.params:
            registry.unregister_param(pid)

    # -- inspection and checkpoints -----------------------------------------------------------------------
    def stats(self) -> dict:
        stats = dict(self.counters)
        steps = max(1, self.counters["steps"])
        stats["bytes_device_to_host_per_step"] = self.counters["bytes_device_to_host"] / steps
        stats["bytes_host_to_device_per_step"] = self.counters["bytes_host_to_device"] / steps
        host_wait = self.stall_clock.host_seconds if self.stall_clock else 0.0
        device_idle = self.stall_clock.device_idle_seconds() if self.stall_clock else None
        stats["host_wait_seconds"] = host_wait
        # Device idle caused by waiting for the CPU (events on the compute stream); where the device is the
        # host, the host wait.
        stats["stall_seconds"] = host_wait if device_idle is None else device_idle
        stats["cpu_update_seconds"] = self.update_worker.busy_seconds
        stats["accumulate_seconds"] = self.accumulate_worker.busy_seconds
        # CPU time of the worker threads (with torch's intra-op threads at 1, all of the work; on a shared
        # machine the wall times above also count waiting for a core).
        stats["cpu_update_thread_seconds"] = self.update_worker.busy_cpu_seconds
        stats["accumulate_thread_seconds"] = self.accumulate_worker.busy_cpu_seconds
        stats["current_interval"] = self.steps_accumulated
        stats["update_pending"] = self.update_pending
        # Host memory held for optimizer state (data parallel: this rank's share).
        stats["host_state_bytes"] = sum(t.numel() * t.element_size() for m in self.matrices for t in m.host_buffers())
        # Device memory held for optimizer state: selected columns' and vectors' state, gradients, scores,
        # indices (the uploads' staging tensors live only until their merge).
        stats["device_state_bytes"] = sum(t.numel() * t.element_size() for s in self.states.values()
                                          for t in s.device_buffers())
        if self.data_parallel is not None:
            stats.update(self.data_parallel.stats())
        return stats

    def selected_columns(self, pid: int) -> Optional[torch.Tensor]:
        state = self.states.get(pid)
        if state is None or not state.is_matrix or (state.num_selected == 0):
            return None
        return state.selected.clone()

    def has_state(self, pid: int) -> bool:
        return pid in self.states

    def export_state(self, pid: int) -> dict:
        """Checkpoint entry of one parameter (call after `quiesce`): canonical layout, host tensors. Data
        parallel, a matrix whose host part another rank owns: only what this rank holds (its device part)."""
        state = self.states[pid]
        if state.is_matrix and not state.owns_host:
            return self._export_device_part(state)
        canonical = state.canonical()
        entry = dict(master=canonical.master, exp_avg=canonical.exp_avg, exp_avg_sq=canonical.exp_avg_sq,
                     step=canonical.step)
        if state.is_matrix:
            accumulator = torch.zeros(state.rows, state.cols)
            accumulator[:, state.host_columns] = state.accumulators[self.acc_slot].t()
            entry.update(self._selection_entry(state), accumulator=accumulator)
            if state.accumulate_squares:
                square_accumulator = torch.zeros(state.rows, state.cols)
                square_accumulator[:, state.host_columns] = state.square_accumulators[self.acc_slot].t()
                entry.update(square_accumulator=square_accumulator)
            if state.unapplied:  # overlap: what the device holds until the pending update is applied
                entry.update(unapplied=True, device_columns=state.device_columns())
        return entry

    @staticmethod
    def _selection_entry(state: MatrixState) -> dict:
        """A matrix's selection and interval bookkeeping, as every checkpoint entry of a matrix holds it."""
        selected = torch.zeros(state.cols, dtype=torch.bool)
        selected[state.selected] = True
        return dict(selected=selected, steps_accumulated=state.steps_accumulated,
                    zen_auto=torch.tensor([state.sum_selected_score, state.sum_unselected_score],
                                          dtype=torch.float64))

    @classmethod
    def _export_device_part(cls, state: MatrixState) -> dict:
        return dict(cls._selection_entry(state), host_owner=state.owner, host_columns=state.host_columns.clone(),
                    selected_master=state.dev_master.cpu(),
                    selected_exp_avg=state.dev_exp_avg.cpu(), selected_exp_avg_sq=state.dev_exp_avg_sq.cpu(),
                    selected_step=state.dev_step.cpu(), unapplied=state.unapplied)

    def import_state(self, pid: int, entry: dict) -> None:
        state = self._state(pid)
        if "host_owner" in entry:  # a data-parallel share: this rank's device part only
            canonical = CanonicalState.unknown(state.rows, state.cols)
            selected = entry["selected"].nonzero().flatten()
            for full, part in ((canonical.master, "selected_master"), (canonical.exp_avg, "selected_exp_avg"),
                               (canonical.exp_avg_sq, "selected_exp_avg_sq")):
                full[:, selected] = entry[part].float()
            canonical.step[selected] = entry["selected_step"].float()
        else:
            canonical = CanonicalState(*(entry[k].float() for k in ("master", "exp_avg", "exp_avg_sq", "step")))
            selected = entry["selected"].nonzero().flatten() if state.is_matrix else None
        if not state.is_matrix:
            state.load_canonical(canonical)
            return
        state.load_canonical(canonical, selected, entry.get("host_columns"))
        if state.owns_host:
            state.accumulators[0].copy_(entry["accumulator"][:, state.host_columns].t())
            if state.accumulate_squares:
                state.square_accumulators[0].copy_(entry["square_accumulator"][:, state.host_columns].t())
        state.sum_selected_score, state.sum_unselected_score = entry["zen_auto"].tolist()
        state.steps_accumulated = int(entry["steps_accumulated"])
        if entry.get("unapplied", False):
            if state.owns_host:
                state.load_device_columns(entry["device_columns"])
            else:
                state.unapplied = True  # it receives the owner's pending update at the next apply

    def quiesce(self) -> None:
        """Finish all CPU work without applying anything to the device (a checkpoint must not change the run)."""
        self.check_failure()
        self._drain()
        self._adopt_external_writes()

    def export_globals(self) -> dict:
        return dict(step_count=self.step_count, selection_start=self.selection_start,
                    selection_epoch=self.selection_epoch, steps_accumulated=self.steps_accumulated, update_pending=self.update_pending,
                    counters=dict(self.counters), config=self.config.to_dict(),
                    max_grad_norm=self.max_grad_norm)

    def import_globals(self, saved: dict, owners: Optional[dict[int, int]] = None) -> None:
        """`owners`: pid -> rank for a data-parallel share saved at this world size (None: assign afresh)."""
        if saved["config"] != self.config.to_dict():
            differing = sorted(k for k, v in saved["config"].items() if self.config.to_dict().get(k) != v)
            raise ValueError(f"checkpoint was saved with a different ZenFlow config (keys {differing}); "
                             "construct the optimizer with the saved config to resume exactly")
        self.step_count = saved["step_count"]
        self.selection_start = saved["selection_start"]
        self.selection_epoch = saved.get("selection_epoch", 0)
        self.steps_accumulated = saved["steps_accumulated"]
        self.update_pending = saved["update_pending"]
        self.counters.update(saved["counters"])
        # States are re-created from the checkpoint (with the checkpoint's owners, if it is a rank's share).
        self.states = {}
        self.owners = dict(owners or {})
        if self.data_parallel is not None:
            self.data_parallel.reset_ownership()
            for pid, owner in self.owners.items():
                self.data_parallel.claim(owner, self.params[pid][0].numel())
        self.grad_slot = self.acc_slot = 0
        self._accumulate_done = [None, None]
        self._last_accumulate = self._update_future = None
