"""Core reservation (`pt_reserved_cores_perc`): the split DeepSpeed makes, and that it is really applied to
the worker threads only (their affinity and the thread count their torch ops run with), never to the
training thread or to threads started later."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from helpers import loss_fn, make_batches, tiny_model
from zenflow_compile import ZenFlowAdamW
from zenflow_compile.runtime import cpu_affinity
from zenflow_compile.runtime.worker import CpuWorker

linux_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs Linux thread affinity and at least 2 usable cores")


def _placement_of_current_thread() -> tuple[set[int], int]:
    return set(os.sched_getaffinity(0)), torch.get_num_threads()


def _in_fresh_thread(fn):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()))
    thread.start()
    thread.join()
    return out["value"]


@pytest.mark.parametrize("num_cores", range(1, 17))
@pytest.mark.parametrize("perc", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_split_matches_deepspeed(num_cores, perc):
    zenflow_utils = pytest.importorskip("deepspeed.runtime.zenflow.zenflow_utils")
    cores = list(range(100, 100 + num_cores))
    ds_workers, ds_training = zenflow_utils._split_affinity(cores, perc)
    split = cpu_affinity.split_cores(cores, perc)
    assert (list(split.workers), list(split.training)) == (list(ds_workers), list(ds_training))
    assert split.isolated == (set(ds_workers) != set(cores))


def test_split_rules():
    split = cpu_affinity.split_cores([3, 1, 2, 0], 0.5)
    assert split == cpu_affinity.CoreSplit(training=(0, 1), workers=(2, 3)) and split.isolated
    # the exact decimal: 0.3 of 10 cores reserves 3 (float 0.3 * 10 > 3 would round up to 4)
    assert cpu_affinity.split_cores(range(10), 0.3).training == (0, 1, 2)
    # nothing to isolate: both sides share every core
    for perc in (0.0, 1.0):
        assert cpu_affinity.split_cores([0, 1], perc) == cpu_affinity.CoreSplit((0, 1), (0, 1))
    assert cpu_affinity.split_cores([7], 0.5) == cpu_affinity.CoreSplit((7,), (7,))
    with pytest.raises(ValueError, match="pt_reserved_cores_perc=1.5 is outside"):
        cpu_affinity.split_cores([0, 1], 1.5)


@linux_affinity
def test_worker_is_pinned_and_training_thread_untouched():
    before = _placement_of_current_thread()
    fresh_before = _in_fresh_thread(_placement_of_current_thread)
    expected = cpu_affinity.split_cores(sorted(before[0]), 0.5)

    worker = CpuWorker("probe", pt_reserved_cores_perc=0.5)
    try:
        cores, threads = worker.submit(_placement_of_current_thread).result(30)
        # a torch op that runs in parallel inside the worker, to be sure its thread count is what it uses
        assert worker.submit(lambda: float(torch.ones(1 << 20).add_(1).sum())).result(30) == 2.0 * (1 << 20)
    finally:
        worker.shutdown()
    assert cores == set(expected.workers) and threads == len(expected.workers)
    assert worker.placement == cpu_affinity.ThreadPlacement(expected.workers, len(expected.workers))
    assert _placement_of_current_thread() == before
    # torch.set_num_threads would have changed the process-wide count that new threads start from
    assert _in_fresh_thread(_placement_of_current_thread) == fresh_before


@linux_affinity
def test_openmp_team_of_pinned_thread_stays_on_its_cores():
    last_core = max(os.sched_getaffinity(0))

    def run():
        known = set(os.listdir("/proc/self/task"))
        placement = cpu_affinity.pin_current_thread([last_core], num_threads=2)  # 2 threads on 1 core
        torch.ones(1 << 22).mul_(3)  # large enough to start the thread's own OpenMP team
        new = set(os.listdir("/proc/self/task")) - known
        return placement, {os.sched_getaffinity(int(tid)) == {last_core} for tid in new if
                           os.path.exists(f"/proc/self/task/{tid}")}

    placement, new_threads_pinned = _in_fresh_thread(run)
    assert placement.cores == (last_core,) and placement.num_threads == 2
    assert new_threads_pinned <= {True}


SECOND_OPENMP = "/usr/lib/x86_64-linux-gnu/libgomp.so.1"  # listed before torch's own copy in path order


@linux_affinity
@pytest.mark.skipif(not os.path.exists(SECOND_OPENMP), reason=f"needs the system's libgomp ({SECOND_OPENMP})")
def test_worker_thread_count_holds_beside_a_second_openmp_runtime():
    # A GPU image loads the system's libgomp beside the one torch bundles (as another extension would): the
    # worker's count must be set in the runtime torch uses, whichever is listed first.
    script = f"""
import ctypes, os, torch
ctypes.CDLL({SECOND_OPENMP!r})
from zenflow_compile.runtime.worker import CpuWorker
worker = CpuWorker("probe", pt_reserved_cores_perc=0.5)
print(worker.submit(torch.get_num_threads).result(30), len(worker.cores.workers), worker.placement.notes)
worker.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    threads, cores, notes = out.stdout.split(maxsplit=2)
    assert (threads, notes.strip()) == (cores, "()")


@pytest.mark.parametrize("perc", [None, 0.0, 1.0])
def test_no_isolation_leaves_worker_as_is(perc):
    worker = CpuWorker("probe", pt_reserved_cores_perc=perc)
    try:
        seen = worker.submit(_placement_of_current_thread).result(30)
    finally:
        worker.shutdown()
    assert worker.placement is None
    assert seen == _in_fresh_thread(_placement_of_current_thread)


@linux_affinity
def test_optimizer_workers_follow_the_config():
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, overlap_step=True,
                       pt_reserved_cores_perc=0.5)
    main_before = _placement_of_current_thread()
    for batch in make_batches(4):
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    expected = cpu_affinity.split_cores(sorted(main_before[0]), 0.5).workers
    runtime = opt._runtime
    for worker in runtime.host_work.workers:
        assert worker.submit(_placement_of_current_thread).result(30) == (set(expected), len(expected))
    assert _placement_of_current_thread() == main_before
