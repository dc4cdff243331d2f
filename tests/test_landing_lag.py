"""The landing lag in ZenFlowAdamW: a boundary's overlapped CPU update lands at the end of step b + landing_lag
(or at the next boundary if that comes first), as ZenFlowReference and the hand schedule of torch.optim.AdamW
calls in test_reference.py say; a late CPU makes the training thread wait at the landing, counted as stall,
and never changes a value."""

import copy
import time

import pytest
import torch

from helpers import make_batches, tiny_model, train_steps
from test_reference import ATOL, RTOL, hand_schedule, lag_reference
from zenflow_compile import ZenFlowAdamW
from zenflow_compile.reference import ZenFlowReference
from zenflow_compile.runtime import kernels


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
