"""The host-synchronisation budget (ARCHITECTURE.md, "One training step"), counted by the runtime (`stats()["host_reads"]`, `["host_waits"]`).

Per step: one batched host read (the norm's skip/clip verdict with every other per-step scalar: the loss
scale, Zen-auto's means, the scores of a first selection), plus one batched transfer of every matrix's
scores at a boundary that may reselect. Gradient accumulation adds no read: its host work runs on the
accumulate worker and the training thread's wait for it is counted. Eager and compiled alike.
"""

from __future__ import annotations

import pytest
import torch

import zenflow_compile
import zenflow_compile.backend  # noqa: F401  (registers backend="zenflow")
from helpers import loss_fn, make_batches, tiny_model


def per_step_counts(keys: dict, steps: int = 9, backwards: int = 1, compiled: bool = False, scaler: bool = False):
    """host_reads and host_waits of every step, and the step numbers that were update boundaries."""
    torch._dynamo.reset()
    model = tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=1e-2, **keys)
    run = torch.compile(model, backend="zenflow") if compiled else model
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    batches = make_batches(steps * backwards)
    reads, waits, boundaries, reselections = [], [], [], []
    for step in range(steps):
        before = opt.stats()
        for k in range(backwards):
            loss = loss_fn(run, batches[step * backwards + k])
            (grad_scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            grad_scaler.step(opt)
            grad_scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        after = opt.stats()
        reads.append(after["host_reads"] - before["host_reads"])
        waits.append(after["host_waits"] - before["host_waits"])
        if after["cpu_updates"] > before["cpu_updates"]:
            boundaries.append(step)
        if after["reselections"] > before["reselections"]:
            reselections.append(step)
    torch._dynamo.reset()
    return reads, waits, boundaries, reselections


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_int_interval_one_read_per_step_and_one_transfer_where_a_reselection_is_due(compiled):
    keys = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=3, overlap_step=True)
    reads, _, boundaries, reselections = per_step_counts(keys, compiled=compiled)
    assert boundaries == [1, 3, 5, 7] and reselections == [3, 7]
    # step 0 selects for the first time: its scores ride in the step's one read
    assert reads == [2 if step in reselections else 1 for step in range(9)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_defaults_zen_auto_and_auto_reselection(compiled):
    # update_interval="auto" (Zen-auto's means ride in the step's read), select_strategy="auto" (every
    # boundary may reselect: one transfer of all scores there).
    reads, _, boundaries, _ = per_step_counts(dict(topk_ratio=0.25), compiled=compiled)
    assert boundaries, "no Zen-auto boundary in 9 steps: the test would not see the boundary transfer"
    assert reads == [2 if step in boundaries else 1 for step in range(9)]


def test_warm_up_steps_read_once():
    keys = dict(topk_ratio=0.25, update_interval=2, full_warm_up_rounds=3, select_strategy="step",
                select_interval=100)
    reads, _, _, _ = per_step_counts(keys, steps=6)
    assert reads == [1] * 6


def test_grad_scaler_scale_is_read_with_the_norm():
    keys = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=100)
    reads, _, _, _ = per_step_counts(keys, steps=4, scaler=True)
    assert reads == [1] * 4


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradient_accumulation_adds_no_read_and_its_waits_are_counted(compiled):
    keys = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=100,
                overlap_step=False)
    reads, waits, boundaries, _ = per_step_counts(keys, steps=6, backwards=3, compiled=compiled)
    assert reads == [1] * 6
    # The training thread waited for CPU work at most: the fold (its scores), the boundary's update, and the
    # accumulate task of two steps ago before reusing its buffers; every such wait is counted.
    assert all(0 <= w <= 3 for w in waits)
    single_reads, _, single_boundaries, _ = per_step_counts(keys, steps=6, backwards=1, compiled=compiled)
    assert single_reads == reads and single_boundaries == boundaries
