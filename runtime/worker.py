"""A background CPU worker: one thread, FIFO tasks, errors surfaced to the training thread.

A task's exception stays in its Future; the runtime checks at every step and re-raises it there. Tasks are
finite and every worker is told to end before the interpreter joins its threads, so exit never hangs. With
`pt_reserved_cores_perc` the thread is pinned to the cores left after the training thread's reserve
(cpu_affinity.py). For the emulated device's happens-before record
(`ordering`, None elsewhere): a task starts after what its submitter did before submitting it, and whoever
waits for its future (`wait_for`) is after everything it did.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, Callable, Optional

from zenflow_compile.runtime import cpu_affinity


class ForkedProcessError(RuntimeError):
    """A forked child used a worker of its parent: the thread is not there to run the tasks."""


_WORKERS: "weakref.WeakSet[CpuWorker]" = weakref.WeakSet()


def _in_forked_child() -> None:
    for worker in list(_WORKERS):
        worker.forked = True


os.register_at_fork(after_in_child=_in_forked_child)


def _at_exit() -> None:
    """Before the interpreter joins its threads: every worker's thread told to end. concurrent.futures wakes
    only the threads it registered, and a Ctrl-C landing as one starts leaves it unregistered, idle forever."""
    for worker in list(_WORKERS):
        worker.shutdown()


threading._register_atexit(_at_exit)  # (as concurrent.futures registers its own: before the joins)


class CpuWorker:
    def __init__(self, name: str, pt_reserved_cores_perc: Optional[float] = None):
        """`pt_reserved_cores_perc`: fraction of this thread's cores kept for training (None: no pinning)."""
        self.name = name
        self.cores: Optional[cpu_affinity.CoreSplit] = None
        self.placement: Optional[cpu_affinity.ThreadPlacement] = None  # set once the thread has started
        initializer = None
        if pt_reserved_cores_perc is not None:
            self.cores = cpu_affinity.worker_split(pt_reserved_cores_perc)
            if self.cores.isolated:
                initializer = self._pin
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"zenflow-{name}",
                                            initializer=initializer)
        self._futures: list[Future] = []
        self.ordering = None  # set by the runtime where its device records host-thread order
        self.busy_seconds = 0.0  # wall time in tasks
        self.busy_cpu_seconds = 0.0  # this thread's CPU time in tasks (unaffected by other processes)
        self.forked = False  # this is a forked child's copy: its thread stayed in the parent
        _WORKERS.add(self)

    def _check_not_forked(self) -> None:
        """Waiting in a forked child for a task the parent's thread owns would never end: say so instead."""
        if self.forked:
            raise ForkedProcessError(
                "ZenFlowAdamW was used in a child process forked from the one that built it (os.fork, or "
                "multiprocessing's 'fork' start method): its CPU worker threads stayed in the parent, so nothing "
                "would run its work. Use the optimizer in the process that built it (a DataLoader's forked "
                "workers that do not touch it are fine), or build a new one in the child; to checkpoint from "
                "another process, pass it opt.state_dict() taken in the parent")

    def _pin(self) -> None:
        """Runs first on the worker thread (a failure here would break the executor: pinning never raises)."""
        cores = self.cores.workers
        self.placement = cpu_affinity.pin_current_thread(cores, num_threads=len(cores))
        if self.placement.notes:
            warnings.warn(f"ZenFlow {self.name} worker: core reservation only partly applied: "
                          f"{'; '.join(self.placement.notes)}", RuntimeWarning)

    def submit(self, task: Callable[[], Any], after: Optional[Future] = None) -> Future:
        """Run `task` on the worker thread, once `after` (a future of another worker) has finished; the
        future holds what the task returns."""
        self._check_not_forked()
        ordering = self.ordering
        submitted = ordering.fork() if ordering is not None else None
        finished: list = []  # the task's last point in the host-thread order, for `wait_for`
        ended = TaskEnd()

        def run():
            if ordering is not None:
                ordering.join(submitted)
            if after is not None:
                wait_for(after)  # re-raises the upstream failure here too
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return task()
            except BaseException as error:
                error.zenflow_worker_task = True  # (a task's error, not one of the thread that waits for it)
                raise
            finally:
                ended.at = time.perf_counter()
                self.busy_seconds += ended.at - start
                self.busy_cpu_seconds += time.thread_time() - start_cpu
                if ordering is not None:
                    finished.append(ordering.fork())

        future = self._executor.submit(run)
        future.zenflow_finished = (ordering, finished)
        future.zenflow_ended = ended
        self._futures.append(future)
        return future

    def raise_if_failed(self) -> None:
        """Re-raise, in the calling (training) thread, the first error of a finished task."""
        self._check_not_forked()
        still_running = []
        for future in self._futures:
            if not future.done():
                still_running.append(future)
                continue
            joined(future)  # (seen finished: what the task did is now behind the caller)
            if future.exception() is not None:
                raise future.exception()
        self._futures = still_running

    def forget_failures(self) -> None:
        """Drop the finished tasks that failed (the runtime has recorded their errors)."""
        self._futures = [f for f in self._futures if not (f.done() and f.exception() is not None)]

    def wait_all(self) -> None:
        """Wait for every submitted task, failed or not (errors stay in their futures)."""
        self._check_not_forked()
        futures_wait(self._futures)
        for future in self._futures:
            joined(future)

    def drain(self) -> None:
        """Wait for every submitted task; re-raise the first error."""
        self._check_not_forked()
        for future in self._futures:
            wait_for(future)
        self._futures = []

    def shutdown(self) -> None:
        """Take no more tasks; the thread ends after the one it runs. Never waits: the optimizer's finalizer
        calls this wherever the garbage collector runs it, also inside threading's bookkeeping of a thread
        being started, which holds threading's shutdown lock that joining a thread takes again (a hang)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def is_task_error(error: BaseException) -> bool:
    """Whether `error` is a worker task's (its future holds it), not one raised in the thread that waited for
    the task (a Ctrl-C while it waited)."""
    return getattr(error, "zenflow_worker_task", False)


def joined(future: Future) -> None:
    """The calling thread has seen `future` finish: it is now after everything the task did."""
    ordering, finished = getattr(future, "zenflow_finished", (None, ()))
    if ordering is not None and finished:
        ordering.join(finished[0])


class TaskEnd:
    """When a task of `CpuWorker.submit` ended (`time.perf_counter()`; None before), set before its future says
    done. Nothing else: a failed task's future holds frames that would keep the training loop alive."""

    __slots__ = ("at",)

    def __init__(self):
        self.at: Optional[float] = None


def task_end(future: Future) -> TaskEnd:
    return future.zenflow_ended


def wait_for(future: Future) -> Any:
    """`future.result()` (re-raising the task's error), the caller then ordered after the task."""
    try:
        return future.result()
    finally:
        joined(future)
