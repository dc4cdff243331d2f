"""The landing lag in ZenFlowAdamW: a boundary's overlapped CPU update lands at the end of step b + landing_lag
(or at the next boundary if that comes first), as ZenFlowReference and the hand schedule of torch.optim.AdamW
calls in test_reference.py say; a late CPU makes the training thread wait at the landing, counted as stall,
and never changes a value."""

import copy
import math
import re
import time
import warnings

import pytest
import torch

from helpers import loss_fn, make_batches, tiny_model, train_steps
from test_reference import ATOL, RTOL, hand_schedule, lag_reference
from zenflow_compile import LandingStallWarning, ZenFlowAdamW
from zenflow_compile.reference import ZenFlowReference
from zenflow_compile.runtime import kernels
from zenflow_compile.runtime.state import update


def lag_runtime(S, L, mode, every, iau, steps, **keys):
    return lag_reference(S, L, mode, every, iau, steps, optimizer=ZenFlowAdamW, **keys)


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
@pytest.mark.parametrize("S,L", [(2, 1), (4, 1), (4, 3), (4, 4)])
@pytest.mark.parametrize("mode,every", [("wait", 2), ("incoming", 1)])
@pytest.mark.parametrize("iau", [True, False], ids=["iau", "no-iau"])
def test_the_runtime_lands_as_the_hand_schedule(S, L, mode, every, iau, accumulate_on, device):
    steps = 4 * S + 1
    expected = hand_schedule(S, L, mode, every, iau, steps=steps)
    _, opt, history = lag_runtime(S, L, mode, every, iau, steps, accumulate_on=accumulate_on)
    for t, ((visible, master, selected), (visible_h, master_h, selected_h)) in enumerate(zip(history, expected)):
        assert selected == selected_h, t
        torch.testing.assert_close(master, master_h, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {t}: {m}")
        torch.testing.assert_close(visible.cpu(), visible_h, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {t}: {m}")
    stats = opt.stats()
    assert stats["cpu_updates"] == 4 and stats["reselections"] == 4 // every
    # Every boundary without a reselection overlaps; "incoming" overlaps the reselecting ones too.
    assert stats["overlapped_boundaries"] == (4 if mode == "incoming" else 4 - 4 // every)


def test_a_landing_step_shows_the_update_to_the_next_forward():
    """The premise of the hand-schedule test: with L = 1 the step after a boundary already shows its update."""
    one, four = lag_runtime(4, 1, "wait", 2, True, 6)[2], lag_runtime(4, 4, "wait", 2, True, 6)[2]
    assert torch.equal(one[3][0], four[3][0])          # step 3, a boundary: launched, nowhere landed yet
    assert not torch.equal(one[4][0], four[4][0])      # step 4: landed with L = 1 only
    assert torch.equal(one[4][0], one[4][1])           # ... and the forward sees the masters


LAG_KEYS = dict(topk_ratio=0.25, update_interval=4, overlap_step=True, interval_aware_update=True,
                select_strategy="step", select_interval=8, landing_lag=2)


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_resume_from_a_checkpoint_taken_before_the_landing_is_exact(accumulate_on, device):
    """Saved at the end of step 4 (step 3's update in flight, landing at the end of step 5); the resumed run
    lands it at step 5 as the uninterrupted one does, and equals the reference."""
    N, M = 5, 7
    batches = make_batches(N + M, torch.float32)
    a = tiny_model(torch.float32)
    oa = ZenFlowAdamW(a.parameters(), lr=1e-2, accumulate_on=accumulate_on, **LAG_KEYS)
    train_steps(a, oa, batches[:N])
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), copy.deepcopy(oa.state_dict())
    assert saved_opt["zenflow"]["update_pending"] == [True] and saved_opt["zenflow"]["land_at"] == [5]
    train_steps(a, oa, batches[N:])
    b = tiny_model(torch.float32)
    b.load_state_dict(saved_model)
    ob = ZenFlowAdamW(b.parameters(), lr=1e-2, accumulate_on=accumulate_on, **LAG_KEYS)
    ob.load_state_dict(saved_opt)
    train_steps(b, ob, batches[N:])
    ref_model = tiny_model(torch.float32)
    ref = ZenFlowReference(ref_model.parameters(), lr=1e-2, **LAG_KEYS)
    train_steps(ref_model, ref, batches)
    for p, q, r in zip(a.parameters(), b.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
        torch.testing.assert_close(p.detach().cpu(), r.detach(), atol=ATOL, rtol=RTOL)
    assert oa.stats()["cpu_updates"] == ob.stats()["cpu_updates"] == 3


def test_a_late_cpu_update_is_waited_for_at_its_landing_and_counted(monkeypatch, device):
    """L = 1: the training thread waits for a slow CPU update at the step after its boundary; the values are
    those of a fast run, bit for bit, and the wait is stall."""
    keys = dict(LAG_KEYS, landing_lag=1)
    batches = make_batches(9, torch.float32)

    def run():
        model = tiny_model(torch.float32)
        opt = ZenFlowAdamW(model.parameters(), lr=1e-2, **keys)
        return train_steps(model, opt, batches), opt

    fast, _ = run()
    real_cpu_adamw = kernels.cpu_adamw_

    def slow_cpu_adamw(*args, **kwargs):
        time.sleep(0.1)
        real_cpu_adamw(*args, **kwargs)

    monkeypatch.setattr(kernels, "cpu_adamw_", slow_cpu_adamw)
    slow, opt = run()
    for a, b in zip(fast.params, slow.params):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    stats = opt.stats()
    assert stats["overlapped_boundaries"] == stats["cpu_updates"] - 1 == 1  # step 7 reselects and waits
    assert stats["stall_seconds"] >= 0.08 * stats["cpu_updates"]  # both updates waited for, at b + 1 or b


SLOW_CPU_KEYS = dict(topk_ratio=0.25, update_interval=4, overlap_step=True, select_strategy="step",
                     select_interval=8, overlap_reselect="incoming")


def train_beside_a_slow_cpu(monkeypatch, update_seconds, step_seconds, steps=30, **keys):
    """Eager training whose steps take about `step_seconds` (a sleep standing in for the device's step) while
    each CPU update takes about `update_seconds` (the host AdamW slowed); returns the optimizer and the
    LandingStallWarnings its steps gave."""
    model = tiny_model(torch.float32)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, **dict(SLOW_CPU_KEYS, **keys))
    real_update = update.update_host_columns

    def slow_update(slab, *args):
        slabs = [s for s in opt._runtime.slabs if s.has_host_part and s.is_matrix and s.u]
        time.sleep(update_seconds / len(slabs))  # (the update's slabs share its time)
        real_update(slab, *args)

    monkeypatch.setattr(update, "update_host_columns", slow_update)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in make_batches(steps, torch.float32):
            loss_fn(model, batch).backward()
            time.sleep(step_seconds)
            opt.step()
            opt.zero_grad()
    monkeypatch.setattr(update, "update_host_columns", real_update)
    return opt, [w for w in caught if issubclass(w.category, LandingStallWarning)]


def test_a_landing_that_waits_is_said_once_with_the_lag_that_would_not(monkeypatch, device):
    """An update 2-5 steps long (5 on an idle machine, less where other work slows the steps) landing one
    step after its boundary: the training thread waits at every landing. The optimizer says so once, from
    the caller's line, with the measured length and the landing_lag that covers it; with that lag the waits
    all but stop and nothing is said."""
    slow = dict(update_seconds=0.1, step_seconds=0.02, steps=50, update_interval=8, select_interval=16,
                interval_aware_update=True)
    opt, said = train_beside_a_slow_cpu(monkeypatch, landing_lag=1, **slow)
    measured, waited = opt.stats()["cpu_update_steps"], opt.stats()["landing_wait_seconds"]
    assert 1.0 < measured < 8.0, measured
    assert len(said) == 1 and said[0].filename == __file__
    message = str(said[0].message)
    advised = int(re.search(r"To stop the wait: landing_lag=(\d+);", message).group(1))
    assert abs(advised - math.ceil(measured)) <= 1  # (the advice's length is the first window's, `measured` the last's)
    assert "lands at landing_lag=1" in message
    assert ('stagger_boundaries=True (each step then takes 1/8 of the update), best with interval_aware_update="sqrt"'
            in message)  # (said where interval_aware_update=True: "sqrt" is what staggering was measured with)
    assert waited > 0.2

    opt, said = train_beside_a_slow_cpu(monkeypatch, landing_lag=advised, **slow)
    assert said == []
    assert opt.stats()["landing_wait_seconds"] < waited / 4


def test_an_update_longer_than_its_interval_is_told_to_stagger_or_lengthen_it(monkeypatch):
    """Landing at the next boundary (no lag) and still waited for: no lag can help, the interval can."""
    opt, said = train_beside_a_slow_cpu(monkeypatch, update_seconds=0.3, step_seconds=0.02, landing_lag=None)
    measured = opt.stats()["cpu_update_steps"]
    assert measured > 4.0, measured
    assert len(said) == 1
    message = str(said[0].message)
    assert "lands at the next boundary" in message and "landing_lag=" not in message.split("To stop")[1]
    assert re.search(r"update_interval >= (\d+)", message) and "stagger_boundaries=True" in message
