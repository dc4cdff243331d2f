"""Failures a long training run meets, and the way back: each checked against ZenFlowReference.

- a KeyboardInterrupt part-way through `opt.step()` (after the step started changing state) leaves device
  columns, host work and counters out of step with each other: the next step must refuse to go on (it used
  to continue silently, 3.6e-2 to 4.5e-2 off the reference after 8 more steps), and loading a checkpoint into
  the same optimizer (model and optimizer) must bring it back, equal to the uninterrupted run;
- a CPU worker failure: the same way back (`load_state_dict` used to re-raise the failure, so the advice "restore
  from the last checkpoint" could not be followed in-process), and the failed optimizer must be freeable so a
  new one can own the parameters (the stored exception's traceback kept the training loop's frames, hence the
  optimizer, alive through the parameters' hooks: "already owned by another ZenFlowAdamW");
- a KeyboardInterrupt in the middle of a compiled backward (some buckets handed over), then `zero_grad()` and
  training on: the handed-over part must be dropped, as torch drops `.grad`;
- a Ctrl-C while the training thread only waits for CPU work (state_dict, master, synchronize) is a
  KeyboardInterrupt and changes nothing; one while a reselection's departing columns settle loses none of them;
- a forked child using the optimizer: a clear error there (its parent's worker threads are not in it), never a
  hang, and the parent trains on;
- data parallel (2 gloo ranks): a CPU worker failure on one rank is a RuntimeError there and a
  CollectiveError on the other, never a hang.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

import zenflow_compile
import zenflow_compile.runtime.kernels
from zenflow_compile.reference import ZenFlowReference
from zenflow_compile.runtime.engine import ZenFlowRuntime
from zenflow_compile.runtime import worker
from zenflow_compile.runtime.host_work import HostWork
from helpers import loss_fn, make_batches, max_param_diff, tiny_model

KEYS = dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step", select_interval=2)
LR = 1e-2
ATOL = 1e-5
STEPS = 10


def _train(model, opt, batches, steps):
    for step in steps:
        loss_fn(model, batches[step]).backward()
        opt.step()
        opt.zero_grad()


def _reference_params(batches, keys=KEYS):
    """ZenFlowReference trained STEPS steps without any interruption."""
    model = tiny_model()
    ref = ZenFlowReference(model.parameters(), lr=LR, **keys)
    _train(model, ref, batches, range(STEPS))
    ref.synchronize()
    return [p.detach().clone() for p in model.parameters()]


def _fail_once(monkeypatch, owner, name, error: type, *error_args, at: int = 1):
    """Make owner.name raise `error(*error_args)` at its `at`-th call from now, else behave normally; returns the
    calls. (A new exception object: one held here would keep its traceback's frames alive.)"""
    original = getattr(owner, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise error(*error_args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return calls


def _checkpoint(model, opt):
    return copy.deepcopy(dict(model=model.state_dict(), optimizer=opt.state_dict()))


def _restore(model, opt, checkpoint):
    opt.zero_grad()
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])


def test_an_interrupted_step_refuses_to_go_on_and_a_checkpoint_brings_it_back(monkeypatch, device):
    batches = make_batches(STEPS)
    model = tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, **KEYS)
    _train(model, opt, batches, range(2))
    checkpoint = _checkpoint(model, opt)

    # Ctrl-C at step 3's boundary, after its device update: the CPU update is never launched.
    _train(model, opt, batches, range(2, 3))
    _fail_once(monkeypatch, HostWork, "launch_update", KeyboardInterrupt)
    loss_fn(model, batches[3]).backward()
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    opt.zero_grad()
    assert opt.stats()["steps"] == 3  # stats() still answers: the steps completed before the interrupt
    for call in (lambda: _train(model, opt, batches, range(3, 4)), opt.synchronize, opt.state_dict):
        with pytest.raises(RuntimeError, match="interrupted part-way through step 3.*KeyboardInterrupt"):
            call()

    _restore(model, opt, checkpoint)
    _train(model, opt, batches, range(2, STEPS))
    opt.synchronize()
    assert max_param_diff(list(model.parameters()), _reference_params(batches)) <= ATOL


# A reselecting boundary ("wait" or "incoming") updates its arriving columns before it launches the rest; where the
# host sums them, on the training thread with the CPU AdamW, so the injected failure is raised there, as the step's
# own error (where the device sums them, their step runs on the device: the worker fails).
@pytest.mark.parametrize("in_flight", [False, True], ids=["wait", "incoming"])
def test_a_worker_failure_is_recovered_from_a_checkpoint_and_the_failed_optimizer_can_be_freed(monkeypatch, in_flight,
                                                                                                device):
    keys = dict(KEYS, overlap_reselect="incoming", landing_lag=1) if in_flight else KEYS
    batches = make_batches(STEPS)
    model = tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, **keys)
    _train(model, opt, batches, range(2))
    on_training_thread = opt.stats()["accumulate_on"] == "host"
    first_error = "injected host failure" if on_training_thread else "ZenFlow CPU worker failed.*injected host failure"
    checkpoint = _checkpoint(model, opt)
    _fail_once(monkeypatch, zenflow_compile.runtime.kernels, "cpu_adamw_", ValueError, "injected host failure")
    with pytest.raises(ValueError if on_training_thread else RuntimeError, match=first_error):
        _train(model, opt, batches, range(2, STEPS))
    with pytest.raises(RuntimeError, match="injected host failure"):  # it keeps raising
        opt.step()

    # The way back: the checkpoint loaded into the same optimizer.
    _restore(model, opt, checkpoint)
    _train(model, opt, batches, range(2, STEPS))
    opt.synchronize()
    assert max_param_diff(list(model.parameters()), _reference_params(batches, keys)) <= ATOL

    # Or a new optimizer: the failed one must not be kept alive by its stored failure.
    _fail_once(monkeypatch, zenflow_compile.runtime.kernels, "cpu_adamw_", ValueError, "injected host failure")
    other = tiny_model()
    failed = zenflow_compile.ZenFlowAdamW(other.parameters(), lr=LR, **keys)
    with pytest.raises(ValueError if on_training_thread else RuntimeError, match="injected host failure"):
        _train(other, failed, batches, range(STEPS))
    alive = weakref.ref(failed)
    del failed
    gc.collect()
    assert alive() is None
    zenflow_compile.ZenFlowAdamW(other.parameters(), lr=LR, **keys)  # may own the parameters now


def test_a_compiled_backward_interrupted_between_buckets_is_dropped_by_zero_grad(monkeypatch, device, fresh_dynamo):
    # (fresh_dynamo: the graph must be compiled for this optimizer's small buckets, not reused from another test)
    batches = make_batches(STEPS)
    model = tiny_model()
    # Small buckets: the backward hands its gradients over in several calls; the interrupt hits the second.
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, reduce_bucket_size=300, **KEYS)
    compiled = torch.compile(model, backend="zenflow")
    for step in range(STEPS):
        if step in (3, 6):
            calls = _fail_once(monkeypatch, ZenFlowRuntime, "take_grads", KeyboardInterrupt, at=2)
            with pytest.raises(KeyboardInterrupt):
                loss_fn(compiled, batches[step]).backward()
            monkeypatch.undo()
            assert len(calls) == 2  # one bucket went in before the interrupt
            opt.zero_grad()
        loss_fn(compiled, batches[step]).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    assert max_param_diff(list(model.parameters()), _reference_params(batches)) <= ATOL


_RANK_SCRIPT = textwrap.dedent("""
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    import zenflow_compile, zenflow_compile.runtime.kernels as kernels
    from helpers import loss_fn, make_batches, tiny_model
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + {init!r}, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    if rank == 0:  # the second CPU AdamW of rank 0's host share fails
        original, calls = kernels.cpu_adamw_, []
        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise ValueError("injected host failure")
            return original(*args, **kwargs)
        kernels.cpu_adamw_ = failing
    model = tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=1e-2, **{keys!r})
    batches = make_batches(12)
    record = dict(error=None, step=None)
    try:
        for step in range(12):
            x, y = batches[step]
            loss_fn(model, (x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
    except Exception as error:
        record.update(error=type(error).__name__ + ": " + str(error), step=step)
        raise
    finally:
        record["steps"] = opt.stats()["steps"]
        with open({out!r} + f".rank{{rank}}.json", "w") as f:
            json.dump(record, f)
""")


@pytest.mark.parametrize("call", ["state_dict", "master", "synchronize"])
def test_a_ctrl_c_while_waiting_for_cpu_work_is_a_keyboard_interrupt_and_changes_nothing(monkeypatch, call, device):
    """A Ctrl-C that reaches the training thread while it waits for a CPU update (in state_dict, master or
    synchronize) is the user's KeyboardInterrupt, not a worker failure: nothing was changed, the optimizer goes
    on (and can be saved) and ends where the uninterrupted run does."""
    batches = make_batches(STEPS)
    model = tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, **KEYS)
    _train(model, opt, batches, range(5))
    wait_for, interrupted = worker.wait_for, []

    def ctrl_c_while_waiting(future):  # (a signal reaches the main thread only)
        if threading.current_thread() is threading.main_thread() and not interrupted:
            interrupted.append(future)
            raise KeyboardInterrupt
        return wait_for(future)

    monkeypatch.setattr(worker, "wait_for", ctrl_c_while_waiting)
    opt._runtime.host_work.workers[0].submit(lambda: time.sleep(0.2))  # (CPU work still running: it is waited for)
    with pytest.raises(KeyboardInterrupt):
        getattr(opt, call)(*([model.fc1.weight] if call == "master" else []))
    monkeypatch.undo()
    assert interrupted
    assert not opt._runtime.failed
    opt.state_dict()
    _train(model, opt, batches, range(5, STEPS))
    opt.synchronize()
    assert max_param_diff(list(model.parameters()), _reference_params(batches)) <= ATOL


@pytest.mark.parametrize("call", ["state_dict", "master"])
def test_a_ctrl_c_while_departing_columns_settle_loses_none_of_them(call, device):
    """A reselection in flight's departing columns are written into their host rows at the next drain; a
    Ctrl-C part-way through (here at its wait for their copy, where a signal lands) leaves them to the next
    drain, whole: the run ends where the uninterrupted one does."""
    batches = make_batches(STEPS)
    model = tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, **dict(KEYS, overlap_reselect="incoming"))
    _train(model, opt, batches, range(6))  # (step 5: a reselecting boundary; its departing columns in flight)
    assert any(slab.departing is not None for slab in opt._runtime.slabs)

    def interrupt(frame, event, arg):
        if frame.f_code.co_name != "settle_departing":
            return None

        def at_line(frame, event, arg):
            if event == "line" and frame.f_lineno > frame.f_code.co_firstlineno + 5:  # (past its first statements)
                sys.settrace(None)
                raise KeyboardInterrupt
            return at_line
        return at_line

    sys.settrace(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            getattr(opt, call)(*([model.fc1.weight] if call == "master" else []))
    finally:
        sys.settrace(None)
    assert not opt._runtime.failed
    _train(model, opt, batches, range(6, STEPS))
    opt.synchronize()
    assert max_param_diff(list(model.parameters()),
                          _reference_params(batches, dict(KEYS, overlap_reselect="incoming"))) <= ATOL


_CTRL_C_AS_A_WORKER_STARTS = textwrap.dedent("""
    import sys
    import torch
    from zenflow_compile import ZenFlowAdamW

    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8))
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16)).square().mean().backward()

    def ctrl_c(frame, event, arg):  # (where a SIGINT lands: as a worker's Thread.start() returns)
        if event == "return" and frame.f_code.co_name == "start" and \\
                frame.f_back.f_code.co_name == "_adjust_thread_count":
            sys.settrace(None)
            raise KeyboardInterrupt
        return ctrl_c

    sys.settrace(ctrl_c)
    opt.step()  # (the KeyboardInterrupt leaves the script: the interpreter exits)
""")


def test_a_ctrl_c_as_a_worker_thread_starts_does_not_hang_the_exit(tmp_path):
    """concurrent.futures wakes at exit only the threads it registered; one whose start a Ctrl-C interrupted
    is not, and used to be joined forever. The optimizer's workers are told to end before the joins."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(_CTRL_C_AS_A_WORKER_STARTS)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert "KeyboardInterrupt" in result.stderr, result.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_using_the_optimizer_is_told_why_and_the_parent_trains_on():
    """A forked child (an async checkpoint writer) has none of its parent's worker threads: waiting there for an
    update in flight would never end. It is a clear error in the child; the parent goes on as the reference."""
    model, reference_model = tiny_model(), tiny_model()
    keys = dict(KEYS, overlap_reselect="incoming", landing_lag=2)  # (the first boundary's update: in flight)
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, **keys)
    reference = ZenFlowReference(reference_model.parameters(), lr=LR, **keys)
    batches = make_batches(6)
    _train(model, opt, batches, range(2))
    _train(reference_model, reference, batches, range(2))
    assert opt.stats()["update_pending"]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child: report and leave without running the parent's exit handlers)
        try:
            opt.state_dict()
            said = "no error"
        except BaseException as error:  # noqa: BLE001
            said = f"{type(error).__name__}: {error}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    os.waitpid(pid, 0)
    assert said.startswith("ForkedProcessError: ZenFlowAdamW was used in a child process forked"), said
    _train(model, opt, batches, range(2, 6))
    _train(reference_model, reference, batches, range(2, 6))
    opt.synchronize()
    reference.synchronize()
    assert max_param_diff(model, reference_model) <= 1e-5


def test_data_parallel_worker_failure_on_one_rank_raises_on_both_without_a_hang(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT.format(tests=str(Path(__file__).parent), init=str(tmp_path / "rendezvous"),
                                          keys=dict(KEYS, select_interval=100), out=str(tmp_path / "record")))
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, RANK=str(rank), OMP_NUM_THREADS="1")) for rank in range(2)]
    try:
        codes = [proc.wait(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    records = [json.loads((tmp_path / f"record.rank{rank}.json").read_text()) for rank in range(2)]
    assert codes[0] != 0 and codes[1] != 0, records
    assert records[0]["error"].startswith("RuntimeError: ZenFlow CPU worker failed"), records[0]
    assert "injected host failure" in records[0]["error"]
    assert records[1]["error"].startswith("CollectiveError"), records[1]
    assert records[0]["step"] == records[1]["step"]  # the step the failure surfaced at, on both ranks
