"""HostWork: the two CPU workers of one optimizer and what the schedule gives them.

The accumulate worker folds each step's offloaded gradients into the interval's accumulators (one task per
step, every slab in it); the update worker runs the CPU AdamW of every slab's host columns at an update
boundary (one task, after the interval's last accumulation). Two workers, so a long update never delays the
next step's accumulation. The training thread waits for them only at fixed points of the schedule (`wait`,
counted and timed as stall), so results never depend on thread timing. A worker's error marks the optimizer
failed (`failures.Failure`) and is raised in the training thread, then at every later call.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from typing import Callable, Optional

from torch.profiler import record_function

from zenflow_compile.runtime import kernels
from zenflow_compile.runtime.failures import Failure
from zenflow_compile.runtime.state import intake, update
from zenflow_compile.runtime.state.slab import Slab
from zenflow_compile.runtime.transfers import StallClock, Transfers, wait_events
from zenflow_compile.runtime.worker import CpuWorker, is_task_error, joined, wait_for

Stepped = list[tuple[Slab, Optional[list[int]]]]  # slabs with the members that took a gradient (None: all)


def members_by_scale(slab: Slab, lr_scale: Callable[[int], float]) -> dict[float, list[tuple[int, int]]]:
    """The members whose host columns a boundary's CPU update takes, by lr multiplier (`lr_scale`, the config's
    `interval_lr_scale`, of their accumulated steps): [(member index, steps accumulated)]; may be empty."""
    by_scale: dict[float, list[tuple[int, int]]] = {}
    if slab.is_matrix and slab.u:
        for i, m in enumerate(slab.members):
            if m.steps_accumulated:
                by_scale.setdefault(lr_scale(m.steps_accumulated), []).append((i, m.steps_accumulated))
    return by_scale


class HostWork:
    def __init__(self, pt_reserved_cores_perc: Optional[float], counters: dict):
        self.accumulate_worker = CpuWorker("accumulate", pt_reserved_cores_perc=pt_reserved_cores_perc)
        self.update_worker = CpuWorker("update", pt_reserved_cores_perc=pt_reserved_cores_perc)
        self.failure = Failure()
        self.counters = counters  # the runtime's; waits are counted in "host_waits"
        self.stall_clock: Optional[StallClock] = None  # set with the device (`use_device`)
        self._accumulate_done: list[Optional[Future]] = [None, None]  # per grad slot: its buffers' last reader
        self._last_accumulate: Optional[Future] = None
        self._updates: dict[int, Future] = {}  # per phase: its last launched CPU update
        # The accumulate worker's wait for the gradients' copies to land, part of its busy time: tells a
        # worker slowed by the copies from one slowed by its own memory traffic.
        self.copy_wait_seconds = 0.0
        self._prepared: set = set()  # CPU AdamW variants built (`prepare`)

    @property
    def workers(self) -> tuple[CpuWorker, CpuWorker]:
        return self.accumulate_worker, self.update_worker

    def use_device(self, transfers: Transfers) -> None:
        self.stall_clock = StallClock(transfers)
        for worker in self.workers:
            worker.ordering = transfers.ordering

    def accumulate(self, stepped: Stepped, grad_slot: int, coef: float) -> None:
        """Fold this step's offloaded gradients (x `coef`) into the interval's accumulators: one task for every
        slab, run once the step's copies have landed (their events taken now: the next step replaces them)."""
        if not stepped:
            return
        work = [(slab, rows, intake.copies_in_flight(slab, grad_slot), slab.acc_slot) for slab, rows in stepped]

        def accumulate():
            with record_function("zenflow::accumulate"):
                for slab, rows, copies, acc_slot in work:
                    if copies:
                        started = time.perf_counter()
                        wait_events(copies)
                        self.copy_wait_seconds += time.perf_counter() - started
                    intake.accumulate(slab, rows, grad_slot, acc_slot, coef)

        self._accumulate_done[grad_slot] = self._last_accumulate = self.accumulate_worker.submit(accumulate)

    def free_grad_buffers(self, grad_slot: int) -> None:
        """Before a step's first gradient: the accumulate task of two steps ago read the buffers it fills."""
        pending = self._accumulate_done[grad_slot]
        if pending is not None:
            self.wait(pending)

    def fold_backwards(self, folding: list[tuple[Slab, list[int]]], grad_slot: int) -> None:
        """Several backwards in one step: the accumulate worker sums the members' offloaded host parts and scores
        the sum; the training thread waits for it (the norm needs those scores)."""
        def fold():
            with record_function("zenflow::fold_backwards"):
                for slab, rows in folding:
                    intake.host_step_scores(slab, grad_slot, rows)

        self.wait(self.accumulate_worker.submit(fold))

    def prepare(self, slabs: list[Slab]) -> None:
        """After a layout, while the next steps run: the update worker builds the compiled CPU AdamW variants
        the slabs' updates will take (Dynamo keys them on the thread count too: built where they run), the
        accumulate worker the host accumulation, so that no boundary or accumulation waits for a compile.
        (The arriving columns' step where the host sums runs on the training thread: built at a reselection.)"""
        large = [slab for slab in slabs if slab.has_host_part and slab.is_matrix
                 and kernels.compiles(slab.n * slab.u * slab.R)]
        for worker, prepare, chosen in (
                (self.update_worker, kernels.prepare_cpu_adamw, large),
                (self.accumulate_worker, kernels.prepare_accumulate,
                 [slab for slab in large if not slab.accumulates_on_device])):
            variants = {(prepare, slab.dtype, slab.accumulate_squares) for slab in chosen}
            new = sorted(variants - self._prepared, key=str)
            if new:
                self._prepared.update(new)
                worker.submit(lambda new=new: [build(*variant) for build, *variant in new])

    def launch_update(self, phase: int, slabs: list[Slab], hyperparameters: list[dict],
                      lr_scale: Callable[[int], float]) -> Future:
        """One task on the update worker for a boundary of `phase` (its `slabs`; tasks run in launch order): per
        slab, one CPU AdamW over its host rows (`members_by_scale`), with each param group's `hyperparameters`
        at launch; a matrix with no gradient all interval is skipped. The slabs updated are marked `unapplied`
        on every rank: their new columns reach the device at the next `apply_update`."""
        work = []
        for slab in slabs:
            by_scale = members_by_scale(slab, lr_scale)
            if not by_scale:
                continue
            slab.unapplied = True
            if slab.has_host_part:
                work.append((slab, by_scale, slab.acc_slot, hyperparameters[slab.key.group_index]))

        def cpu_update():
            with record_function("zenflow::cpu_adamw"):
                for slab, by_scale, acc_slot, hyper in work:
                    update.update_host_columns(slab, by_scale, acc_slot, hyper)

        self._updates[phase] = self.update_worker.submit(cpu_update, after=self._last_accumulate)
        return self._updates[phase]

    def wait_for_accumulation(self) -> None:
        """The training thread waits until every step's gradients are in the accumulators (counted)."""
        if self._last_accumulate is not None:
            self.wait(self._last_accumulate)

    def apply_update(self, phase: int, slabs: list[Slab], data_parallel=None) -> int:
        """Wait for the last launched CPU update of `phase` and write it into the device parameters of the slabs
        (`slabs`: the phase's) it updated; returns the bytes uploaded. Data parallel: the other ranks wait in the
        owners' broadcasts (counted as stall)."""
        launched = self._updates.pop(phase, None)
        if launched is not None:  # (None right after a checkpoint load: already finished)
            self.wait(launched)
        unapplied = [slab for slab in slabs if slab.unapplied]
        waiting = self.counted_wait() if data_parallel is not None and unapplied else contextlib.nullcontext()
        with waiting:
            return sum(update.apply_host_columns(slab, data_parallel) for slab in unapplied)

    def wait(self, future: Future) -> None:
        """The training thread waits for CPU work: the documented stall, measured."""
        if future.done():
            joined(future)
            if future.exception() is not None:
                self._raise_worker_error(future.exception())
            return
        with self.counted_wait():
            try:
                wait_for(future)
            except BaseException as error:
                self._raise_worker_error(error)

    @contextlib.contextmanager
    def counted_wait(self):
        """The training thread waits for CPU work (here or on another rank): counted and measured as stall."""
        self.counters["host_waits"] += 1
        with self.stalling():
            yield

    @contextlib.contextmanager
    def stalling(self):
        """Training-thread work of ZenFlow's the device may idle through (a selection's state moves): measured
        as stall, not counted as a wait."""
        marker, start = self.stall_clock.before_wait(), time.perf_counter()
        try:
            yield
        finally:
            self.stall_clock.after_wait(marker, time.perf_counter() - start)

    def stalled_seconds(self) -> float:
        """The training thread's waits (and selection moves) so far, host wall time."""
        return self.stall_clock.host_seconds if self.stall_clock is not None else 0.0

    def drain(self) -> None:
        """Wait for every task (a reader or writer of the host state is about to run on this thread)."""
        self._on_each_worker(lambda worker: worker.drain())

    def reset(self) -> None:
        """Every state was replaced (a checkpoint load): no task of the old states is waited for again."""
        self._accumulate_done = [None, None]
        self._last_accumulate = None
        self._updates.clear()

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()

    def record_failure(self, what: str, error: BaseException) -> None:
        """The optimizer failed (the first failure is kept). Its tasks' futures are let go: their exception's
        frames would keep the training loop's locals and this optimizer alive."""
        if self.failure.record(what, error):
            self.reset()
            for worker in self.workers:
                worker.forget_failures()

    def _on_each_worker(self, call) -> None:
        """`call(worker)` for each worker; an error it raises (a task's) fails the optimizer."""
        for worker in self.workers:
            try:
                call(worker)
            except BaseException as error:
                self._raise_worker_error(error)

    def _raise_worker_error(self, error: BaseException):
        if not is_task_error(error):  # (the waiting thread's own, a Ctrl-C or a forked child's refusal: no task failed)
            raise error
        self.record_failure("ZenFlow CPU worker failed", error)
        raise self.failure.error() from error

    def check(self) -> None:
        """Raise if the optimizer failed (also on a step with nothing to do), or a worker's task did."""
        self.failure.raise_if_failed()
        self._on_each_worker(lambda worker: worker.raise_if_failed())

    def settle_after_failure(self) -> None:
        """Before a checkpoint load clears a failure: let the tasks still queued on the old states finish
        (their errors were already reported)."""
        for worker in self.workers:
            worker.wait_all()
            worker.forget_failures()

