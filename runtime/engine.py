"""ZenFlowRuntime: the state and schedule of one ZenFlowAdamW (docs/semantics.md), eager and compiled.

Every gradient source (the compiled graph's op, the eager `.grad`s at `step()`, the data-parallel reducer)
arrives through `take_grads`. `step()` then decides, in this order (ARCHITECTURE.md, "One training step"):
global norm (skip if non-finite, else clip) -> first selection -> device AdamW of the selected columns ->
the unselected columns' gradient summed -> update boundary? -> land the previous CPU update and launch this
one -> reselection, while that update runs on.

Data parallel and sharded: the column scores are all-reduced first, so every rank decides from the same
numbers and issues the same collectives in the same order. Determinism: a CPU update reaches the device only
at a fixed point of the schedule (end of step b + landing_lag, or the next boundary), never by thread timing;
a late CPU makes the training thread wait, counted as stall.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Callable, Optional

import torch
from torch.profiler import record_function

from zenflow_compile.runtime import checkpoint, registry
from zenflow_compile.runtime.collectives import DataParallel
from zenflow_compile.runtime.grad_reduce import GradReducer
from zenflow_compile.runtime.host_reads import HostReads, StepReadout
from zenflow_compile.runtime.host_work import HostWork, Stepped, members_by_scale
from zenflow_compile.runtime.landings import Landings
from zenflow_compile.runtime.placement import Placement
from zenflow_compile.runtime.schedule import Schedule, per_phase
from zenflow_compile.runtime.state import columns as column_moves, intake, update
from zenflow_compile.runtime.state.intake import BucketPlan, rows_taken
from zenflow_compile.runtime.state.members import Member, written_externally
from zenflow_compile.runtime.state.slab import Slab
from zenflow_compile.runtime.transfers import Transfers

# Config keys that say where work runs, not what it computes: a checkpoint resumes across them.
PLACEMENT_KEYS = ("accumulate_on", "offload")
# What a key a checkpoint lacks meant when it was saved (before the key existed); other keys: None.
_BEFORE_THE_KEY = dict(stagger_boundaries=False)


def _hyperparameters(group: dict) -> dict:
    beta1, beta2 = group["betas"]
    return dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]))


class ZenFlowRuntime:
    def __init__(self, config, max_grad_norm: Optional[float],
                 data_parallel: Optional[DataParallel] = None, reduce_bucket_numel: int = 25_000_000,
                 sharding=None):
        self.config = config
        self.max_grad_norm = max_grad_norm
        self.data_parallel = data_parallel
        self.sharding = sharding  # FSDP2 (runtime/sharding.py); exclusive with data_parallel
        self.bucket_numel = reduce_bucket_numel  # gradient hand-off buckets (compiled graphs; reducer)
        self.reducer = (GradReducer(data_parallel, reduce_bucket_numel, self._take_reduced)
                        if data_parallel is not None else None)
        self.placement = Placement(config, data_parallel, sharded=sharding is not None)
        self._planned_version = 0  # the placement's layout that _plans and host_reads were made for
        self.params, self.owners, self.pending = self.placement.params, self.placement.owners, self.placement.pending
        self.rank = self.placement.rank
        self._plans: dict[tuple, BucketPlan] = {}  # bucket's pids -> plan, for the current slabs
        self.step_count = 0  # t: completed (non-skipped) steps
        self.schedule = Schedule(config)  # boundaries and reselections: when they come
        # Per phase: a launched CPU update not yet on the device, and the step at whose end it lands.
        self.update_pending = [False] * config.num_phases
        self.land_at: list[Optional[int]] = [None] * config.num_phases
        self.grad_slot = 0  # which host-gradient buffer this step's backward fills
        self._step_open = False
        self.transfers: Optional[Transfers] = None  # set by the first parameter: one device per optimizer
        self.counters = dict(steps=0, skipped_steps=0, cpu_updates=0, reselections=0, host_reads=0, host_waits=0,
                             bytes_device_to_host=0, bytes_host_to_device=0, selection_churn=0.0,
                             overlapped_boundaries=0)  # boundaries whose CPU update ran on into the next steps
        self.selection_seconds = 0.0  # the training thread's time moving state for (re)selections (not saved)
        self.host_work = HostWork(config.pt_reserved_cores_perc, self.counters)
        self.host_reads = HostReads(self.counters)
        # (No reference back to the runtime: a constructor that raises frees it, and its parameters, at once.)
        self.landings = Landings(config, self.host_work.stalled_seconds)
        self.grad_norm: Optional[float] = None  # the last step's global gradient norm, before clipping
        self.last_step_pids: set[int] = set()  # the parameters that took a gradient in the last step
        if config.accumulate_on == "device" and data_parallel is not None:
            raise ValueError(
                "ZenFlowConfig.accumulate_on='device' is not implemented with ZenFlow's own data parallelism "
                "(process_group=...: each rank's host columns are summed on the rank that owns them); use "
                "accumulate_on='auto' or 'host' there")
        # Called with the parameters written by someone else before their values are adopted: the optimizer
        # refuses layouts and dtypes the states cannot follow.
        self.check_written_params: Callable[[list[torch.Tensor]], None] = lambda params: None

    # -- parameters ---------------------------------------------------------------------------------------
    def check_device(self, param: torch.Tensor) -> None:
        if self.transfers is not None and param.device != self.transfers.device:
            raise ValueError(f"all parameters of one ZenFlowAdamW must be on one device; got {param.device} "
                             f"and {self.transfers.device}. Use one optimizer per device.")

    def add_param(self, param: torch.Tensor, group_index: int) -> int:
        self.check_device(param)
        if self.transfers is None:
            self.transfers = self.host_reads.transfers = self.placement.transfers = Transfers(param.device)
            self.host_work.use_device(self.transfers)
        pid = registry.register_param(param, self)
        self.params[pid] = (param, group_index)
        self.placement.assign_phase(pid, param)
        if param.requires_grad:  # (data parallel: every owner known before any step, see collectives.py)
            self.placement.owner(pid, param)
        return pid

    def follow_param_groups(self, group_of: dict[int, int]) -> None:
        """Param groups were edited (`group_of`: every id still in them -> its group). A removed id's state is
        dropped, unapplied work included (torch.optim leaves a removed parameter alone); a moved one takes its
        new group's hyperparameters from the next update on."""
        self._drain()  # CPU work in flight reads the states
        for pid in [pid for pid in self.params if pid not in group_of]:
            del self.params[pid]
            registry.unregister_param(pid)
        for pid, group_index in group_of.items():
            param, _ = self.params[pid]
            self.params[pid] = (param, group_index)
        if self.pending.members:
            self.pending.follow_param_groups(group_of)
            self._layout_changed()
        changed = [m for m in self.members.values() if m.pid not in group_of or m.group_index != group_of[m.pid]]
        if not changed:
            return
        slabs = {id(m.slab): m.slab for m in changed}
        keep = [m for slab in slabs.values() for m in slab.members if m.pid in group_of]
        states = [m.slab.export_member(m.index, with_step_grad=self.grad_slot) for m in keep]
        for pid in [m.pid for m in changed if m.pid not in group_of]:
            del self.members[pid]
        for member in keep:
            member.group_index = group_of[member.pid]
        self.placement.replace_slabs(list(slabs.values()), keep, states)
        self._follow_layout()

    @property
    def members(self) -> dict[int, Member]:
        return self.placement.members

    @property
    def slabs(self) -> list[Slab]:
        return self.placement.slabs

    def _member(self, pid: int) -> Member:
        member = self.members.get(pid)
        return member if member is not None else self._create_members([pid])[0]

    def _create_members(self, pids: list[int]) -> list[Member]:
        members = self.placement.create_members(pids, selects_now=self.step_count >= self.config.full_warm_up_rounds)
        self._follow_layout()
        return members

    def _follow_layout(self) -> None:
        if self.placement.version != self._planned_version:
            self._planned_version = self.placement.version
            self._layout_changed()

    def _layout_changed(self) -> None:
        self._plans.clear()
        self.host_reads.forget_layout()
        self.host_work.prepare(self.slabs)

    # -- gradients ----------------------------------------------------------------------------------------
    def take_grads(self, pids: list[int], grads: list[torch.Tensor],
                   scores: "list[Optional[torch.Tensor]] | None" = None) -> None:
        """One bucket of backward gradients (compiled graph, eager `.grad`s, a data-parallel hook); `scores`:
        per gradient, its column scores or None. Data parallel: they join the reducer's open bucket."""
        self._open_step()
        if self.reducer is not None:
            for pid, grad in zip(pids, grads):
                self.reducer.add(self._member(pid), grad)
            return
        key = tuple(pids)
        plan = self._plans.get(key)
        if plan is None:
            members = self._create_members(list(pids))
            plan = self._plans[key] = BucketPlan(members)
        with torch.no_grad():  # (a backward with create_graph=True runs its hooks with grad mode on)
            self.counters["bytes_device_to_host"] += plan.take(grads, scores, self.grad_slot)

    def reduce_grads(self, pids: list[int], grads: list[torch.Tensor]) -> None:
        """Data parallel, compiled: one bucket of gradients, reduced asynchronously. Dynamo shares graphs across
        instances, so an optimizer without data parallelism can get here too: it takes them as usual."""
        self._open_step()
        if self.reducer is None:
            self.take_grads(pids, grads)
            return
        self.reducer.launch([(self._member(pid), grad) for pid, grad in zip(pids, grads)])

    def _open_step(self) -> None:
        if not self._step_open:  # once per step: a worker failure surfaces at the step's first gradient
            self.check_failure()
            self.host_work.free_grad_buffers(self.grad_slot)
            for slab in self.slabs:
                intake.start_step(slab, self.grad_slot)
            self.placement.adopt_casts(self.grad_slot, self.check_written_params, self._drain)
            self._follow_layout()
            self._step_open = True

    def _take_reduced(self, member: Member, replicated: Optional[torch.Tensor], host: Optional[torch.Tensor]) -> None:
        sent = intake.take_reduced(member.slab, member.index, replicated, host, self.grad_slot)
        self.counters["bytes_device_to_host"] += sent

    def _all_reduce_scores(self, slabs: list[Slab]) -> None:
        """One all-reduce makes every rank's scores the full ones: data parallel, the slab's owner contributes
        those of the averaged gradient (others zeros); sharded, the ranks' partial sums over their rows add."""
        for slab in slabs:
            if slab.key.owner != self.rank:
                slab.scores.zero_()
        group = self.data_parallel if self.data_parallel is not None else self.sharding.collectives
        group.all_reduce_packed([slab.scores for slab in slabs])

    @property
    def holds_step_grads(self) -> bool:
        """A backward handed over gradients since the last step or zero_grad."""
        return self._step_open

    def discard_step_grads(self) -> None:
        if self.reducer is not None:
            self.reducer.finish_all()  # every rank runs the same collectives, used or not
        for slab in self.slabs:
            intake.end_step(slab)
        if self.pending.members:  # (dropped before their first selection: no state made)
            self.pending.clear()
            self._layout_changed()
        self._step_open = False

    # -- the step -----------------------------------------------------------------------------------------
    def step(self, param_groups: list[dict], grad_scale: Optional[torch.Tensor] = None) -> bool:
        """One optimizer step; False if skipped for a non-finite gradient. `grad_scale`: the loss scale the
        gradients carry (torch.amp.GradScaler), divided out here."""
        self.check_failure()
        self._check_hyperparameters(param_groups)
        if self.reducer is not None:
            self.reducer.finish_all()
        self._adopt_external_writes()
        # (a pending matrix's master is read from its parameter when it is laid out: a write needs only the checks)
        written_externally(self.pending.members.values(), self.check_written_params)
        cfg, t = self.config, self.step_count
        stepped = [(slab, rows_taken(slab)) for slab in [*self.slabs, *self.pending.slabs] if slab.members_taken]
        self._fold_accumulated_grads(stepped)
        if stepped and (self.data_parallel is not None or self.sharding is not None):
            self._all_reduce_scores([slab for slab, _ in stepped])
        warmed_up = t >= cfg.full_warm_up_rounds
        stepped_members = [m for slab, _ in stepped for m in slab.members if m.num_grads]
        self.last_step_pids = {m.pid for m in stepped_members}
        # First selection (a matrix's first gradient at t >= W), before the updates.
        selecting = [m for m in stepped_members
                     if warmed_up and m.is_matrix and (not m.slab.k or m.pid in self.pending)]
        zen_auto = [(slab, rows) for slab, rows in stepped
                    if warmed_up and cfg.auto_update and slab.is_matrix and slab.k and slab.u]
        readout = self.host_reads.step_values(stepped, grad_scale, zen_auto, selecting)
        self.grad_norm = readout.norm
        if not math.isfinite(readout.norm):
            self.counters["skipped_steps"] += 1
            self.discard_step_grads()
            return False
        coef = 1.0 if self.max_grad_norm is None else min(1.0, self.max_grad_norm / (readout.norm + 1e-6))
        coef /= readout.scale  # the clip coefficient of the unscaled gradient, applied to the scaled one
        # From here the step changes state in several places: an exception part-way (KeyboardInterrupt, out of
        # memory, a worker failure) leaves them inconsistent, so the optimizer refuses to go on until a
        # checkpoint is loaded.
        try:
            self._apply_step(t, param_groups, stepped_members, selecting, readout, coef, warmed_up)
        except BaseException as error:
            self.host_work.record_failure(f"ZenFlowAdamW.step() was interrupted part-way through step {t}", error)
            raise
        return True

    def _apply_step(self, t: int, param_groups: list[dict], stepped_members: list[Member], selecting: list[Member],
                    readout: StepReadout, coef: float, warmed_up: bool) -> None:
        cfg = self.config
        if t == cfg.full_warm_up_rounds:
            self.schedule.selection_start = [t] * cfg.num_phases
        if selecting:
            with self._selection_moves(stall=False):  # (laying the state out: the first step's setup)
                sent = self.placement.select_first(selecting, readout, self.grad_slot)
                self.counters["bytes_device_to_host"] += sent
                self._follow_layout()
        stepped = [(slab, rows_taken(slab)) for slab in self.slabs if slab.members_taken]
        hyperparameters = [_hyperparameters(group) for group in param_groups]
        for slab, rows in stepped:
            update.update_on_device(slab, rows, grad_scale=coef, **hyperparameters[slab.key.group_index])
        with record_function("zenflow::accumulate_on_device"):
            for slab, rows in stepped:
                if slab.accumulates_on_device:
                    intake.accumulate_on_device(slab, rows, coef)
        self.host_work.accumulate([(slab, rows) for slab, rows in stepped
                                   if slab.has_host_part and not slab.accumulates_on_device],
                                  self.grad_slot, coef)
        stepped_matrices = [m for m in stepped_members if m.is_matrix]
        for m in stepped_matrices:
            m.steps_accumulated += 1
        self.schedule.step_accumulated()

        schedule = self.schedule
        boundaries = schedule.boundaries(t, self.placement.phases_in_use, stepped_matrices,
                                         list(self.members.values()), readout.mean_scores, coef)
        for phase in boundaries:
            # A boundary that may reselect: the phase's stepped matrices' scores come to the host in one transfer.
            reselecting = [(slab, rows) for slab, rows in stepped
                           if slab.is_matrix and slab.k and slab.u and slab.key.phase == phase]
            may_reselect = warmed_up and schedule.may_reselect(t, phase)
            host_scores = self.host_reads.scores(reselecting) if may_reselect else None
            reselect = host_scores is not None and schedule.should_reselect(reselecting, host_scores)
            chosen = schedule.chosen_selections(reselecting, host_scores) if reselect else []
            # Reselecting, the arriving columns take their share of the update before its launch and the
            # columns move while it runs; it lands as usual ("incoming") or right after the move ("wait").
            arriving = [(slab, selected) for (slab, _), selected in zip(reselecting, chosen)]
            overlap = cfg.overlap_step and warmed_up and (not reselect or cfg.overlap_reselect == "incoming")
            arrived = self._update_boundary(t, phase, hyperparameters, overlap=overlap, arriving=arriving)
            self.counters["cpu_updates"] += warmed_up  # warm-up steps are plain AdamW, not boundaries
            if reselect:
                with self._selection_moves():
                    self._reselect(t, phase, reselecting, chosen, arrived)
                    if not overlap:
                        self._apply_host_columns(phase)
        for phase, pending in enumerate(self.update_pending):
            if pending and t == self.land_at[phase]:  # landing_lag: the update lands at the end of b + L
                self._apply_host_columns(phase, landing_step=t)

        for slab in self.slabs:  # (offload: the moments' visits; a reselection: the columns changing sides)
            self.counters["bytes_host_to_device"] += slab.bytes_up
            self.counters["bytes_device_to_host"] += slab.bytes_down
            slab.bytes_up = slab.bytes_down = 0
        self.step_count += 1
        self.counters["steps"] += 1
        self.grad_slot ^= 1
        self.discard_step_grads()

    @contextlib.contextmanager
    def _selection_moves(self, stall: bool = True):
        """The training thread moves state for a selection: timed, and part of the stall if `stall`."""
        started = time.perf_counter()
        try:
            with (self.host_work.stalling() if stall else contextlib.nullcontext()), \
                    record_function("zenflow::selection_moves"):
                yield
        finally:
            self.selection_seconds += time.perf_counter() - started

    def _check_hyperparameters(self, param_groups: list[dict]) -> None:
        """Param groups change at any time: refuse values the config cannot work with, before any change."""
        if self.config.interval_second_moment:
            for g, group in enumerate(param_groups):
                if not group["betas"][1] > 0.0:
                    raise ValueError(
                        f"interval_second_moment needs betas[1] > 0; param group {g} has betas "
                        f"{tuple(group['betas'])}. Set betas[1] > 0, or interval_second_moment=False")

    def _adopt_external_writes(self) -> None:
        self.placement.adopt_external_writes(self.grad_slot, self.check_written_params, self._drain)
        self._follow_layout()

    # -- boundaries ---------------------------------------------------------------------------------------
    def _fold_accumulated_grads(self, stepped: Stepped) -> None:
        """Several backwards in one step: the accumulate worker sums the offloaded host parts (the training
        thread waits, counted), then every such member's scores are made exact for the norm."""
        several = [(slab, [i for i, m in enumerate(slab.members) if m.num_grads > 1])
                   for slab, _ in stepped if slab.several_backwards]
        several = [(slab, rows) for slab, rows in several if rows]
        if not several:
            return
        folding = [(slab, rows) for slab, rows in several if slab.has_host_part and not slab.accumulates_on_device]
        if folding:
            self.host_work.fold_backwards(folding, self.grad_slot)
        for slab, rows in several:
            intake.exact_scores(slab, rows)

    def _phase_slabs(self, phase: int) -> list[Slab]:
        return [slab for slab in self.slabs if slab.key.phase == phase]

    def _update_boundary(self, t: int, phase: int, hyperparameters: list[dict], overlap: bool,
                         arriving: list[tuple[Slab, torch.Tensor]]) -> list:
        """A boundary of `phase`: land the previous update if pending, launch this one (overlapped: it lands at
        step t + landing_lag or the next boundary; else now, or after the reselection). `arriving`: the
        reselecting slabs and their new selections; their arriving columns are updated first, from this step's
        sums. Returns that state, slab by slab (`columns.take_arriving`)."""
        if self.update_pending[phase]:  # overlap: the previous boundary's update lands, before the next launch
            self._apply_host_columns(phase, landing_step=t)
        slabs = self._phase_slabs(phase)
        # Device accumulation: the sums go down into the accumulators the update reads (their last reader
        # landed just above at the latest).
        with record_function("zenflow::send_accumulators"):
            self.counters["bytes_device_to_host"] += sum(intake.send_accumulators(slab) for slab in slabs)
        arrived = []
        if arriving:
            with self._selection_moves():
                self.host_work.wait_for_accumulation()
                arrived = [column_moves.take_arriving(slab, selected,
                                                      members_by_scale(slab, self.config.interval_lr_scale),
                                                      hyperparameters[slab.key.group_index], self.data_parallel)
                           for slab, selected in arriving]
        launched = self.host_work.launch_update(phase, slabs, hyperparameters, self.config.interval_lr_scale)
        self.landings.launched(phase, t, launched, overlapped=overlap)
        self.schedule.interval_started(phase, list(self.members.values()))
        for slab in slabs:
            slab.acc_slot ^= 1
        self.update_pending[phase] = True
        lag = self.config.landing_lag
        self.land_at[phase] = t + lag if overlap and lag is not None else None
        self.counters["overlapped_boundaries"] += overlap
        if not overlap and not arriving:
            self._apply_host_columns(phase)
        return arrived

    def _apply_host_columns(self, phase: int, landing_step: Optional[int] = None) -> None:
        """The last CPU update of `phase`, waited for, into the device parameters; `landing_step`: a scheduled
        landing (timed by `Landings`), not a synchronize."""
        mark = self.landings.mark()
        with record_function("zenflow::apply_update"):
            self.counters["bytes_host_to_device"] += self.host_work.apply_update(phase, self._phase_slabs(phase),
                                                                                  self.data_parallel)
        self.update_pending[phase] = False
        self.land_at[phase] = None
        if landing_step is not None:
            self.landings.landed(phase, landing_step, mark)

    def _reselect(self, t: int, phase: int, slabs: list, chosen: list[torch.Tensor], arrived: list) -> None:
        """The chosen selections take effect while the boundary's update runs on (`arrived`: from
        `_update_boundary`)."""
        moved = total = 0
        for (slab, rows), selected, arriving in zip(slabs, chosen, arrived):
            total += slab.k * (slab.n if rows is None else len(rows))
            moved += column_moves.reselect_in_flight(slab, selected, arriving)
        self._layout_changed()
        self.schedule.reselected(t, phase)
        self.counters["reselections"] += 1
        self.counters["selection_churn"] = moved / (2 * total) if total else 0.0

    # -- failures (runtime/failures.py) ----------------------------------------------------------------------
    @property
    def failed(self) -> bool:
        return self.host_work.failure.failed

    def check_failure(self) -> None:
        """Raise if a worker failed or a step was interrupted (until a checkpoint is loaded)."""
        self.host_work.check()

    def settle_after_failure(self) -> None:
        self.host_work.settle_after_failure()

    def clear_failure(self) -> None:
        self.host_work.failure.clear()

    def _drain(self) -> None:
        """Wait for all CPU work; departing columns are then in their host rows."""
        self.host_work.drain()
        for slab in self.slabs:
            column_moves.settle_departing(slab)

    def synchronize(self) -> None:
        """Wait for all CPU work and apply any in-flight update to the device parameters."""
        self.check_failure()
        self._drain()
        self._adopt_external_writes()
        for phase, pending in enumerate(self.update_pending):
            if pending:
                self._apply_host_columns(phase)

    def close(self) -> None:
        self.host_work.shutdown()
        for pid in self.params:
            registry.unregister_param(pid)

    # -- inspection and checkpoints -----------------------------------------------------------------------
    def stats(self) -> dict:
        stats = dict(self.counters)  # (what each means: docs/stats.md)
        steps = max(1, self.counters["steps"])
        stats["bytes_device_to_host_per_step"] = self.counters["bytes_device_to_host"] / steps
        stats["bytes_host_to_device_per_step"] = self.counters["bytes_host_to_device"] / steps
        clock, workers = self.host_work.stall_clock, self.host_work
        host_wait = workers.stalled_seconds()
        device_idle = clock.device_idle_seconds() if clock else None
        stats["host_wait_seconds"] = host_wait
        stats["stall_seconds"] = host_wait if device_idle is None else device_idle
        stats["selection_seconds"] = self.selection_seconds
        stats["cpu_update_seconds"] = workers.update_worker.busy_seconds
        stats["accumulate_seconds"] = workers.accumulate_worker.busy_seconds
        stats["accumulate_copy_wait_seconds"] = workers.copy_wait_seconds  # (included in accumulate_seconds)
        stats["cpu_update_thread_seconds"] = workers.update_worker.busy_cpu_seconds
        stats["accumulate_thread_seconds"] = workers.accumulate_worker.busy_cpu_seconds
        stats["accumulate_on"] = self.placement.accumulate_on
        stats["cpu_update_steps"] = self.landings.update_steps
        stats["landing_wait_seconds"] = self.landings.wait_seconds
        stats["current_interval"] = max(self.schedule.steps_accumulated[q] for q in self.placement.phases_in_use)
        stats["update_pending"] = any(self.update_pending)
        stats["host_state_bytes"] = sum(t.numel() * t.element_size() for s in self.slabs for t in s.host_buffers())
        stats["device_state_bytes"] = sum(t.numel() * t.element_size() for s in self.slabs
                                          for t in s.device_buffers())
        if self.data_parallel is not None:
            stats.update(self.data_parallel.stats())
        return stats

    def selected_columns(self, pid: int) -> Optional[torch.Tensor]:
        member = self.members.get(pid)
        if member is None or not member.is_matrix or not member.slab.k:
            return None
        return member.slab.selected_cpu[member.index].clone()

    def has_state(self, pid: int) -> bool:
        return pid in self.members

    def export_state(self, pid: int) -> dict:
        """Checkpoint entry of one parameter (call after `quiesce`): natural layout, host tensors."""
        return checkpoint.export_entry(self.members[pid])

    def import_states(self, entries: dict[int, dict]) -> None:
        """Checkpoint entries (pid -> entry), after `import_globals`. Data parallel: every rank calls it
        together; an owner's entries give every rank the device part of its parameters' state."""
        if self.data_parallel is not None:
            # A parameter frozen when the optimizer took it has no owner yet: every rank assigns the same, in
            # order of place (ids are each process's own).
            pids = list(self.params)
            place = {pid: i for i, pid in enumerate(pids)}
            unowned = [place[pid] for pid in entries if pid not in self.owners]
            for index in sorted(set().union(*self.data_parallel.all_gather_object(unowned))):
                self.placement.owner(pids[index], self.params[pids[index]][0])
            entries = checkpoint.with_device_parts({pid: entry for pid, entry in entries.items()
                                                    if self.owners[pid] == self.rank}, list(self.params),
                                                   self.data_parallel)
        members, states = [], []
        for pid, entry in entries.items():
            member = self.placement.new_member(pid)
            members.append(member)
            states.append(checkpoint.state_from_entry(member, entry))
        if members:
            self.placement.add_slabs(members, states)
            self._follow_layout()

    def quiesce(self) -> None:
        """Finish all CPU work, applying nothing to the device (a checkpoint must not change the run)."""
        self.check_failure()
        self._drain()
        self._adopt_external_writes()

    def export_globals(self) -> dict:
        return dict(step_count=self.step_count, **self.schedule.export(), update_pending=list(self.update_pending),
                    land_at=list(self.land_at), counters=dict(self.counters), config=self.config.to_dict(),
                    max_grad_norm=self.max_grad_norm)

    def import_globals(self, saved: dict) -> None:
        """The schedule of a checkpoint (`export_globals`); the states follow (`import_states`)."""
        mine = self.config.to_dict()
        saved_config = {**_BEFORE_THE_KEY, **saved["config"]}
        differing = sorted(k for k in {*saved_config, *mine}
                           if k not in PLACEMENT_KEYS and saved_config.get(k) != mine.get(k))
        if differing:
            saved_keys = ", ".join(f"{k}={saved_config.get(k)!r}" for k in differing)
            these = ", ".join(f"{k}={mine.get(k)!r}" for k in differing)
            raise ValueError(f"checkpoint was saved with a different ZenFlow config: it has {saved_keys}, this "
                             f"optimizer {these}. Construct the optimizer with the saved values ({saved_keys}) "
                             "to resume exactly")
        self.step_count = saved["step_count"]
        self.schedule.load(saved)
        self.update_pending, self.land_at = per_phase(saved["update_pending"]), per_phase(saved.get("land_at"))
        self.counters.update(saved["counters"])
        # States are re-created from the checkpoint (owners stay this optimizer's: see collectives.py).
        self.placement.clear()
        self._follow_layout()
        self.grad_slot = 0
        self.host_work.reset()
        self.landings.forget()
