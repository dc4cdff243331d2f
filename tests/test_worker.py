"""The CPU worker: errors reach the training thread, and the interpreter never hangs on exit."""

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from zenflow_compile.runtime.worker import CpuWorker, task_end, wait_for


def test_task_error_is_raised_in_caller():
    worker = CpuWorker("test")

    def boom():
        raise ValueError("disk on fire")

    future = worker.submit(boom)
    with pytest.raises(ValueError, match="disk on fire"):
        future.result(timeout=10)
    with pytest.raises(ValueError, match="disk on fire"):
        worker.raise_if_failed()
    worker.shutdown()


def test_upstream_failure_propagates_to_dependent_task():
    upstream, downstream = CpuWorker("up"), CpuWorker("down")
    ran = []
    first = upstream.submit(lambda: 1 / 0)
    second = downstream.submit(lambda: ran.append(True), after=first)
    with pytest.raises(ZeroDivisionError):
        second.result(timeout=10)
    assert ran == []  # the dependent task never ran on a broken input
    upstream.shutdown()
    downstream.shutdown()


def test_tasks_run_in_order_and_drain_waits():
    worker = CpuWorker("order")
    seen = []
    release = threading.Event()
    worker.submit(lambda: (release.wait(10), seen.append(0)))
    for i in range(1, 5):
        worker.submit(lambda i=i: seen.append(i))
    release.set()
    worker.drain()
    assert seen == [0, 1, 2, 3, 4]
    assert worker.busy_seconds > 0
    worker.shutdown()


def test_interpreter_exits_with_update_in_flight():
    # Overlap leaves a CPU update in flight after the last step; exiting without synchronize() must not hang.
    script = textwrap.dedent("""
        import torch, zenflow_compile
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        opt = zenflow_compile.ZenFlowAdamW(model.parameters(), topk_ratio=0.1, update_interval=2, select_strategy="step",
                                           select_interval=1000, overlap_step=True)
        for _ in range(4):
            model(torch.randn(16, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert opt.stats()["update_pending"]
        print("done")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"


def test_shutdown_does_not_wait_so_the_optimizers_finalizer_cannot_hang():
    """The optimizer's finalizer shuts its workers down wherever the garbage collector runs it: once, in the
    suite, inside threading's bookkeeping of a thread being started, holding threading's shutdown lock, where
    joining a worker thread takes that lock again and hangs both threads. Shutdown under that lock returns."""
    script = textwrap.dedent("""
        import os, threading
        from zenflow_compile.runtime.worker import CpuWorker
        lock = getattr(threading, "_shutdown_locks_lock", None)
        if lock is None:  # (a Python without that lock)
            print("returned"); raise SystemExit(0)
        worker = CpuWorker("probe")
        worker.submit(lambda: None).result(10)
        returned = threading.Event()
        def shut_down_under_the_lock():
            with lock:
                worker.shutdown()
            returned.set()
        threading.Thread(target=shut_down_under_the_lock, daemon=True).start()
        print("returned" if returned.wait(20) else "hung", flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "returned", out.stdout + out.stderr


def test_a_tasks_end_time_is_known_once_its_future_is_waited_for():
    """The landings' timing reads when the CPU update ended right after waiting for it: the time must be set
    before the future says done (a done-callback runs after the waiter may have woken)."""
    worker = CpuWorker("timed")
    try:
        for _ in range(200):
            before = time.perf_counter()
            future = worker.submit(lambda: None)
            wait_for(future)
            ended = task_end(future).at
            assert ended is not None and before <= ended <= time.perf_counter()
    finally:
        worker.shutdown()
