"""Tests of the eager `zenflow_compile.ZenFlowAdamW` (post-accumulate-grad hooks + runtime), on the CPU.

Checked against torch.optim.AdamW (docs/semantics.md, invariants 1 and 2) and against the oracle
`zenflow_compile.reference.ZenFlowReference` (every config: overlap, Zen-auto, warm-up, reselection,
clipping, gradient accumulation, param groups + schedulers, bf16), plus checkpoints (invariant 4),
non-finite steps, worker failures, torch.optim conventions and stats().
"""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch

import zenflow_compile
from zenflow_compile import ZenFlowAdamW, ZenFlowConfig
from zenflow_compile.reference import ZenFlowReference
from zenflow_compile.runtime import kernels

from helpers import (TinyRepeated, bf16_ulp_distance, loss_fn, make_batches, max_param_diff, seeded_generator, snapshot,
                     tiny_model, train_steps, value_tolerance)

LR = 1e-2

# fp32 tolerance vs torch.optim.AdamW and vs the reference. The runtime does the same arithmetic in another
# order: the global norm (clip coefficient) is a sum of per-column scores instead of torch's norm of
# per-tensor norms, the device update uses per-column bias-correction tensors (float64 -> fp32 casts) where
# torch uses Python-float scalars, the host columns go through Inductor's CPU AdamW kernel (vectorised, other
# FMA contraction), and accumulated gradients are summed in another order. Each of these is an fp32 ulp or
# two; over 8-12 steps the measured max diff is ~5e-7 (params are O(0.1..1)), so 1e-6 / 1e-5 is tight
# enough to catch any real semantic difference (a wrong lr, count or mean is >= 1e-4 after one step).
ATOL, RTOL = 1e-6, 1e-5
# bf16: the fp32 masters differ by those same roundings (measured ~1.2e-7); casting two masters that differ
# by an fp32 ulp to bf16 can land on neighbouring bf16 values when they straddle a rounding midpoint, so
# device params may differ by one bf16 ulp (measured max: 1 ulp, usually 0).
BF16_MASTER_ATOL = 1e-5
BF16_MAX_ULPS = 1


def assert_close(actual, expected, what, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def assert_history_close(hist_a, hist_b, names, dtype=torch.float32, atol=ATOL, rtol=RTOL):
    """Params after every step: fp32 within atol/rtol; bf16 within BF16_MAX_ULPS ulps."""
    assert len(hist_a) == len(hist_b)
    for step, (xs, ys) in enumerate(zip(hist_a, hist_b)):
        for name, x, y in zip(names, xs, ys):
            assert x.dtype == y.dtype == dtype
            if dtype == torch.bfloat16:
                ulps = bf16_ulp_distance(x, y)
                assert ulps <= BF16_MAX_ULPS, f"step {step} {name}: {ulps} bf16 ulps apart"
            else:
                assert_close(x, y, f"step {step} {name}", atol, rtol)


def names_of(model):
    return [n for n, _ in model.named_parameters()]


def run_with_timeout(fn, timeout=10.0):
    """Run fn() in a daemon thread; fail (instead of hanging the suite) if it does not finish in time."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed back to the test thread
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"hung for more than {timeout} s"
    if "error" in box:
        raise box["error"]
    return box.get("result")


# ------------------------------------------------------------------------------- invariant 1: AdamW
@pytest.mark.parametrize("topk_ratio", [0.1, 0.5])
@pytest.mark.parametrize("select", [dict(select_strategy="auto"),
                                    dict(select_strategy="step", select_interval=2)], ids=["auto", "step2"])
@pytest.mark.parametrize("warm_up", [0, 2])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_interval_one_equals_adamw(topk_ratio, select, warm_up, clip, device):
    batches = make_batches(8)
    a, b = tiny_model(), tiny_model()
    adam = torch.optim.AdamW(a.parameters(), lr=LR)
    zen = ZenFlowAdamW(b.parameters(), lr=LR, max_grad_norm=clip, topk_ratio=topk_ratio, update_interval=1,
                       overlap_step=False, full_warm_up_rounds=warm_up, **select)
    log_a = train_steps(a, adam, batches, clip=clip)
    log_b = train_steps(b, zen, batches)
    if clip is not None:  # clipping really happens (coef < 1) at least once
        assert any(norm > clip for norm in log_a.grad_norms), log_a.grad_norms
    assert_history_close(log_b.params, log_a.params, names_of(a))
    zen.synchronize()
    for name, p, q in zip(names_of(a), a.parameters(), b.parameters()):
        assert_close(zen.master(q), p.detach().cpu(), f"master {name}")
    st = zen.stats()
    assert st["steps"] == 8 and st["skipped_steps"] == 0
    assert zen.selected_columns(b.fc1.weight).numel() == max(1, int(topk_ratio * 16))


# ------------------------------------------------------------------------------- invariant 2: r = 1
def test_stall_counts_the_selection_moves():
    """A selection's state moves run on the training thread (the device, where there is one, idles through
    them): they are part of stall_seconds. Here no boundary waits for a CPU update (the reselections keep it in
    flight), so the moves are the stall."""
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2, overlap_step=True,
                       select_strategy="step", select_interval=2, overlap_reselect="incoming")
    batches = make_batches(8)
    train_steps(model, opt, batches[:1])  # (the first selection lays the state out: setup, not stall)
    first = opt.stats()
    assert first["selection_seconds"] > 0 and first["stall_seconds"] == 0
    train_steps(model, opt, batches[1:])
    st = opt.stats()
    assert st["reselections"] >= 3
    assert st["stall_seconds"] >= 0.9 * (st["selection_seconds"] - first["selection_seconds"]) > 0


@pytest.mark.parametrize("update_interval", [3, "auto"])
@pytest.mark.parametrize("overlap", [False, True])
def test_ratio_one_equals_adamw(update_interval, overlap, device):
    batches = make_batches(10)
    a, b = tiny_model(), tiny_model()
    adam = torch.optim.AdamW(a.parameters(), lr=LR)
    zen = ZenFlowAdamW(b.parameters(), lr=LR, topk_ratio=1.0, update_interval=update_interval,
                       overlap_step=overlap)
    log_a, log_b = train_steps(a, adam, batches), train_steps(b, zen, batches)
    assert_history_close(log_b.params, log_a.params, names_of(a))
    zen.synchronize()
    for name, p, q in zip(names_of(a), a.parameters(), b.parameters()):
        assert_close(zen.master(q), p.detach().cpu(), f"master {name}")
        assert torch.equal(q.detach().cpu(), zen.master(q))  # fp32: the device copy is the master


# -------------------------------------------------------------------- invariant 3 (eager): reference
def _groups(model):
    return [{"params": list(model.emb.parameters()) + list(model.fc1.parameters()), "lr": 3e-2},
            {"params": list(model.norm.parameters()) + list(model.fc2.parameters()), "weight_decay": 0.1}]


REFERENCE_CASES = {
    "int2": dict(keys=dict(topk_ratio=0.25, update_interval=2)),
    "int3-overlap": dict(keys=dict(topk_ratio=0.25, update_interval=3, overlap_step=True)),
    "auto": dict(keys=dict(topk_ratio=0.25, update_interval="auto")),
    "auto-overlap": dict(keys=dict(topk_ratio=0.25, update_interval="auto", overlap_step=True)),
    "warm-up3": dict(keys=dict(topk_ratio=0.25, update_interval=2, full_warm_up_rounds=3, overlap_step=True)),
    "step3": dict(keys=dict(topk_ratio=0.25, update_interval=1, select_strategy="step", select_interval=3)),
    "step3-int2-overlap": dict(keys=dict(topk_ratio=0.1, update_interval=2, select_strategy="step",
                                         select_interval=3, overlap_step=True)),
    "auto-strategy": dict(keys=dict(topk_ratio=0.5, update_interval=2, select_strategy="auto",
                                    overlap_step=True)),
    "epoch": dict(keys=dict(topk_ratio=0.25, update_interval=2, select_strategy="epoch", select_interval=1,
                            steps_per_epoch=4, overlap_step=True)),
    "clip": dict(keys=dict(topk_ratio=0.25, update_interval=2, overlap_step=True), clip=0.05),
    "clip-auto": dict(keys=dict(topk_ratio=0.25, update_interval="auto"), clip=0.05),
    "grad-accumulation": dict(keys=dict(topk_ratio=0.25, update_interval=2, overlap_step=True),
                              backwards=[1, 2, 1, 2, 2, 1, 1, 2, 1, 1, 2, 1]),
    "grad-accumulation-auto": dict(keys=dict(topk_ratio=0.25, update_interval="auto"),
                                   backwards=[2, 1, 2, 1, 1, 2, 1, 2, 2, 1, 1, 1]),
    "groups-lambdalr": dict(keys=dict(topk_ratio=0.25, update_interval=2, overlap_step=True), groups=True),
    # overlap_reselect="incoming": reselecting boundaries keep their CPU update in flight.
    "incoming-step2": dict(keys=dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=2,
                                     overlap_step=True, overlap_reselect="incoming")),
    "incoming-auto-iau-sm": dict(keys=dict(preset="deepspeed", topk_ratio=0.25, update_interval=2,
                                           select_strategy="auto", interval_aware_update=True,
                                           interval_second_moment=True, overlap_step=True,
                                           overlap_reselect="incoming")),
    "incoming-accumulation-groups-clip": dict(keys=dict(topk_ratio=0.25, update_interval=3, select_strategy="step",
                                                        select_interval=3, overlap_step=True,
                                                        overlap_reselect="incoming"),
                                              backwards=[1, 2, 1, 2, 2, 1, 1, 2, 1, 1, 2, 1], groups=True, clip=0.05),
    "incoming-zen-auto-warm-up2": dict(keys=dict(topk_ratio=0.25, update_interval="auto", full_warm_up_rounds=2,
                                                 select_strategy="step", select_interval=2, overlap_step=True,
                                                 overlap_reselect="incoming")),
    # landing_lag: an overlapped update lands L steps after its boundary (or at the next boundary).
    "lag1-int4-reselect8": dict(keys=dict(topk_ratio=0.25, update_interval=4, select_strategy="step",
                                          select_interval=8, overlap_step=True, interval_aware_update=True,
                                          landing_lag=1)),
    "lag2-incoming-accumulation-groups-clip": dict(keys=dict(topk_ratio=0.25, update_interval=3,
                                                             select_strategy="step", select_interval=3,
                                                             overlap_step=True, overlap_reselect="incoming",
                                                             landing_lag=2),
                                                   backwards=[1, 2, 1, 2, 2, 1, 1, 2, 1, 1, 2, 1], groups=True,
                                                   clip=0.05),
    "lag1-zen-auto": dict(keys=dict(topk_ratio=0.25, update_interval="auto", max_update_interval=4, auto_ratio=0.9,
                                    overlap_step=True, landing_lag=1)),
    # stagger_boundaries: each matrix's boundaries at its phase's steps (Tiny's three matrices, one a phase).
    "stagger-lag1-incoming-step4": dict(keys=dict(topk_ratio=0.25, update_interval=4, select_strategy="step",
                                                  select_interval=4, overlap_step=True, interval_aware_update=True,
                                                  overlap_reselect="incoming", landing_lag=1,
                                                  stagger_boundaries=True)),
    "stagger-wait-accumulation-groups-clip": dict(keys=dict(topk_ratio=0.25, update_interval=3,
                                                            select_strategy="step", select_interval=4,
                                                            overlap_step=True, stagger_boundaries=True),
                                                  backwards=[1, 2, 1, 2, 2, 1, 1, 2, 1, 1, 2, 1], groups=True,
                                                  clip=0.05),
    "stagger-auto-strategy-warm-up2": dict(keys=dict(topk_ratio=0.5, update_interval=2, select_strategy="auto",
                                                     full_warm_up_rounds=2, overlap_step=True,
                                                     stagger_boundaries=True)),
    "stagger-epoch-no-overlap": dict(keys=dict(topk_ratio=0.25, update_interval=3, select_strategy="epoch",
                                               select_interval=1, steps_per_epoch=4, stagger_boundaries=True)),
}


def run_against_reference(case, dtype, steps=12, **runtime_keys):
    """`runtime_keys`: keys of ZenFlowAdamW's alone (where it sums gradients), not the reference's."""
    keys, clip = case["keys"], case.get("clip")
    backwards = case.get("backwards", [1] * steps)
    batches = make_batches(sum(backwards), dtype)
    a, b = tiny_model(dtype), tiny_model(dtype)
    params_a = _groups(a) if case.get("groups") else a.parameters()
    params_b = _groups(b) if case.get("groups") else b.parameters()
    zen = ZenFlowAdamW(params_a, lr=LR, max_grad_norm=clip, **keys, **runtime_keys)
    ref = ZenFlowReference(params_b, lr=LR, max_grad_norm=clip, **keys)
    sched_a = sched_b = None
    if case.get("groups"):
        sched_a = torch.optim.lr_scheduler.LambdaLR(zen, lambda s: 1.0 / (1 + s))
        sched_b = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 1.0 / (1 + s))
    log_a = train_steps(a, zen, batches, backwards, scheduler=sched_a)
    log_b = train_steps(b, ref, batches, backwards, scheduler=sched_b)
    return a, b, zen, ref, log_a, log_b


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(REFERENCE_CASES), ids=list(REFERENCE_CASES))
def test_equals_reference(case, dtype, accumulate_on, device):
    zen = check_equals_reference(case, dtype, accumulate_on=accumulate_on)
    assert zen.stats()["accumulate_on"] == accumulate_on


@pytest.mark.parametrize("case", ["step3", "incoming-step2", "incoming-auto-iau-sm",
                                  "incoming-accumulation-groups-clip"])
def test_the_compiled_cpu_adamw_equals_reference(case, monkeypatch):
    """The small models here take the CPU AdamW and the host accumulation unfused (`kernels.COMPILED_MIN_NUMEL`);
    a model of real size takes Inductor's kernels of the same functions: here each case takes them, reselections
    in flight included (host rows out of count order)."""
    monkeypatch.setattr(kernels, "COMPILED_MIN_NUMEL", 0)
    check_equals_reference(case, torch.float32, accumulate_on="host")


def check_equals_reference(case, dtype, **runtime_keys):
    a, b, zen, ref, log_a, log_b = run_against_reference(REFERENCE_CASES[case], dtype, **runtime_keys)
    names = names_of(a)
    assert_history_close(log_a.params, log_b.params, names, dtype)
    sa, sb = zen.stats(), ref.stats()
    for key in ("steps", "skipped_steps", "reselections", "current_interval"):
        assert sa[key] == sb[key], (key, sa[key], sb[key])
    assert sa["update_pending"] == sb["pending"]
    for p, q in zip(a.parameters(), b.parameters()):
        sel_a, sel_b = zen.selected_columns(p), ref.selected_columns(q)
        assert (sel_a is None) == (sel_b is None) or p.dim() < 2
        if p.dim() >= 2:
            assert torch.equal(sel_a, sel_b)
    zen.synchronize()
    ref.synchronize()
    atol = ATOL if dtype == torch.float32 else BF16_MASTER_ATOL
    for name, p, q in zip(names, a.parameters(), b.parameters()):
        m_a, m_b = zen.master(p), ref.master(q)
        assert m_a.dtype == torch.float32 and m_a.shape == p.shape
        assert_close(m_a, m_b, f"master {name}", atol=atol)
        assert torch.equal(p.detach().cpu(), m_a.to(dtype)), f"{name}: device copy is not the cast master"
    assert_history_close([snapshot(a)], [snapshot(b)], names, dtype)
    return zen


def test_reference_cases_exercise_reselection_and_clipping():
    """The matrix above is not vacuous: reselections happen, and clipping is active (coef < 1)."""
    for case in ("step3", "auto-strategy", "epoch"):
        _, _, zen, ref, _, _ = run_against_reference(REFERENCE_CASES[case], torch.float32)
        assert zen.stats()["reselections"] >= 1 and ref.stats()["reselections"] >= 1, case
    model = tiny_model()
    loss_fn(model, make_batches(1)[0]).backward()
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)) > 2 * 0.05


def test_cpu_updates_counts_boundaries_like_reference_with_warm_up(device):
    """cpu_updates counts update boundaries; warm-up steps are no boundaries (reference.py docstring:
    'Warm-up (t < W): plain AdamW on every parameter, no boundaries'; docs/semantics.md: 'every S steps after warm-up')."""
    _, _, zen, ref, _, _ = run_against_reference(REFERENCE_CASES["warm-up3"], torch.float32)
    assert ref.stats()["cpu_updates"] == (12 - 3) // 2
    assert zen.stats()["cpu_updates"] == ref.stats()["cpu_updates"]


@pytest.mark.parametrize("update_interval", [2, "auto"])
@pytest.mark.parametrize("missing", ["whole-step", "one-matrix"])
def test_steps_without_some_gradients_equal_reference(update_interval, missing, device):
    """A parameter with no gradient at a step (unused in the forward, or the step's grads discarded by
    zero_grad) is skipped for that step and the CPU update uses the mean over the steps that really
    accumulated into it (reference.py docstring: acc_steps, 'equal to the global m_acc unless some grads
    were None')."""
    batches = make_batches(8)
    keys = dict(topk_ratio=0.25, update_interval=update_interval, select_strategy="step", select_interval=100)

    def run(cls):
        model = tiny_model()
        opt = cls(model.parameters(), lr=LR, **keys)
        hist = []
        for i in range(8):
            if missing == "one-matrix" and i in (1, 2, 5):
                model.fc1(model.emb(batches[i][0])).square().mean().backward()  # fc2, norm: no grad
            else:
                loss_fn(model, batches[i]).backward()
            if missing == "whole-step" and i in (1, 4):
                opt.zero_grad()  # this step gets no gradient at all
            opt.step()
            opt.zero_grad()
            hist.append(snapshot(model))
        opt.synchronize()
        return model, opt, hist

    a, zen, hist_a = run(ZenFlowAdamW)
    b, ref, hist_b = run(ZenFlowReference)
    assert_history_close(hist_a, hist_b, names_of(a))
    for name, p, q in zip(names_of(a), a.parameters(), b.parameters()):
        assert_close(zen.master(p), ref.master(q), f"master {name}")


# -------------------------------------------------------------------------- invariant 4: checkpoints
RESUME_CASES = {
    # boundaries at t = 1, 3, 5, ...; saved after t = 4: the t = 3 update is in flight; reselect at t = 5.
    "int2-overlap-pending": dict(dtype=torch.float32, keys=dict(topk_ratio=0.25, update_interval=2,
                                 overlap_step=True, select_strategy="step", select_interval=5), pending=True),
    "int2-reselect3": dict(dtype=torch.float32, keys=dict(topk_ratio=0.25, update_interval=2, overlap_step=True,
                           select_strategy="step", select_interval=3), clip=0.05),
    "auto-overlap": dict(dtype=torch.float32, keys=dict(topk_ratio=0.25, update_interval="auto",
                         overlap_step=True, select_strategy="auto")),
    "bf16-int2-overlap-pending": dict(dtype=torch.bfloat16, keys=dict(topk_ratio=0.25, update_interval=2,
                                      overlap_step=True, select_strategy="step", select_interval=5),
                                      pending=True),
    "bf16-auto": dict(dtype=torch.bfloat16, keys=dict(topk_ratio=0.25, update_interval="auto",
                      overlap_step=True)),
    # Saved mid-interval (t = 3, 4 accumulated) with the t = 2 update in flight: both accumulators are saved.
    "bf16-int3-second-moment-pending": dict(dtype=torch.bfloat16, keys=dict(
        topk_ratio=0.25, update_interval=3, overlap_step=True, select_strategy="step", select_interval=5,
        interval_aware_update=True, interval_second_moment=True), pending=True),
    # Staggered: saved at t = 4 with phase 1's update (boundary 4) and phase 0's (boundary 3, lag 2) in flight,
    # phase 2's interval half summed; reselections after the save.
    "stagger-lag2-incoming-pending": dict(dtype=torch.float32, keys=dict(
        topk_ratio=0.25, update_interval=3, overlap_step=True, select_strategy="step", select_interval=3,
        overlap_reselect="incoming", landing_lag=2, stagger_boundaries=True), pending=True),
}


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("case", list(RESUME_CASES), ids=list(RESUME_CASES))
def test_state_dict_resume_is_exact(case, device):
    spec = RESUME_CASES[case]
    dtype, keys, clip = spec["dtype"], spec["keys"], spec.get("clip")
    N, M = 5, 6
    batches = make_batches(N + M, dtype)
    a = tiny_model(dtype)
    oa = ZenFlowAdamW(a.parameters(), lr=LR, max_grad_norm=clip, **keys)
    train_steps(a, oa, batches[:N])
    if spec.get("pending"):
        assert oa.stats()["update_pending"] is True
    saved_model, saved_opt = _roundtrip(a.state_dict()), _roundtrip(oa.state_dict())
    log_a = train_steps(a, oa, batches[N:])

    b = tiny_model(dtype, seed=1)  # other weights: loading must overwrite them
    ob = ZenFlowAdamW(b.parameters(), lr=LR, max_grad_norm=clip, **keys)
    b.load_state_dict(saved_model)
    ob.load_state_dict(saved_opt)
    log_b = train_steps(b, ob, batches[N:])

    for step, (xs, ys) in enumerate(zip(log_a.params, log_b.params)):
        for name, x, y in zip(names_of(a), xs, ys):
            assert torch.equal(x, y), f"step {N + step} {name}: max diff {max_param_diff(x, y)}"
    for key in ("steps", "cpu_updates", "reselections", "current_interval", "update_pending"):
        assert oa.stats()[key] == ob.stats()[key], key
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(oa.master(p), ob.master(q))
    oa.synchronize()
    ob.synchronize()
    for name, p, q in zip(names_of(a), a.parameters(), b.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(oa.master(p), ob.master(q)), name


def test_resume_cases_cover_reselection_after_the_save():
    spec = RESUME_CASES["int2-overlap-pending"]
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, **spec["keys"])
    train_steps(model, opt, make_batches(5))
    assert opt.stats()["reselections"] == 0
    train_steps(model, opt, make_batches(6, seed=2000))
    assert opt.stats()["reselections"] >= 1


@pytest.mark.parametrize("keys", [dict(topk_ratio=0.25, update_interval=2, overlap_step=True),
                                  dict(topk_ratio=0.25, update_interval="auto", overlap_step=True,
                                       select_strategy="step", select_interval=3)], ids=["int2", "auto"])
def test_saving_does_not_change_the_run(keys, device):
    batches = make_batches(11)
    a, b = tiny_model(), tiny_model()
    oa = ZenFlowAdamW(a.parameters(), lr=LR, **keys)
    ob = ZenFlowAdamW(b.parameters(), lr=LR, **keys)

    def save_sometimes(step):
        if step in (3, 5, 8):
            _roundtrip(oa.state_dict())
            oa.master(a.fc1.weight)

    log_a = train_steps(a, oa, batches, after_backward=save_sometimes)
    log_b = train_steps(b, ob, batches)
    for xs, ys in zip(log_a.params, log_b.params):
        assert all(torch.equal(x, y) for x, y in zip(xs, ys))
    oa.synchronize()
    ob.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q) and torch.equal(oa.master(p), ob.master(q))


def test_load_rejects_other_config_and_plain_adamw_checkpoints():
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2)
    train_steps(model, opt, make_batches(2))
    sd = opt.state_dict()
    other = tiny_model()
    with pytest.raises(ValueError, match="update_interval"):
        ZenFlowAdamW(other.parameters(), lr=LR, topk_ratio=0.25, update_interval=3).load_state_dict(sd)
    adam = torch.optim.AdamW(tiny_model().parameters())
    with pytest.raises(ValueError):
        ZenFlowAdamW(tiny_model().parameters(), lr=LR).load_state_dict(adam.state_dict())


def _repeated(out_features: int) -> TinyRepeated:
    torch.manual_seed(0)
    return TinyRepeated(out_features)


def test_a_checkpoint_of_other_shapes_is_refused_naming_the_parameter_and_loses_nothing():
    """A checkpoint of a model whose head has another width: a ValueError naming the parameter, the saved shape
    and the model's, raised before anything changes (the optimizer trains on exactly as an untouched twin);
    dropping the named entries loads the rest. A checkpoint with another number of parameters is refused too."""
    def loss(model, batch):
        return model(batch[0]).float().pow(2).mean()

    keys = dict(topk_ratio=0.25, update_interval=2, overlap_step=True)
    batches = make_batches(6)
    wide = _repeated(16)
    wide_opt = ZenFlowAdamW(wide.parameters(), lr=LR / 2, **keys)
    train_steps(wide, wide_opt, batches[:3], loss=loss)
    saved = copy.deepcopy(wide_opt.state_dict())
    model, twin = _repeated(8), _repeated(8)
    opt, twin_opt = (ZenFlowAdamW(m.parameters(), lr=LR, **keys) for m in (model, twin))
    for m, o in ((model, opt), (twin, twin_opt)):
        train_steps(m, o, batches[:3], loss=loss)  # the last step leaves a CPU update in flight
    before = copy.deepcopy(opt.state_dict())

    with pytest.raises(ValueError) as refused:
        opt.load_state_dict(saved)
    message = str(refused.value)
    assert ("holds state of shape (16, 16) for parameter 13 of param group 0, which has shape (8, 16) in this model"
            in message), message
    assert "Nothing was loaded" in message and "del state_dict['state'][13]" in message
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"] and after["param_groups"][0]["lr"] == LR
    assert after["zenflow"]["step_count"] == before["zenflow"]["step_count"] == 3
    for i, entry in before["state"].items():
        for key, value in entry.items():
            assert (torch.equal(value, after["state"][i][key]) if isinstance(value, torch.Tensor)
                    else value == after["state"][i][key]), (i, key)
    for m, o in ((model, opt), (twin, twin_opt)):
        train_steps(m, o, batches[3:], loss=loss)
    opt.synchronize()
    twin_opt.synchronize()
    assert max_param_diff(model, twin) == 0.0

    del saved["state"][13]  # the head's weight: then its bias, a vector, is named
    with pytest.raises(ValueError, match=r"state of shape \(16,\) for parameter 14 of param group 0, which has "
                                         r"shape \(8,\)"):
        opt.load_state_dict(saved)
    del saved["state"][14]
    opt.load_state_dict(saved)  # the rest loads; the head starts afresh
    assert opt.state_dict()["zenflow"]["step_count"] == 3 and opt.param_groups[0]["lr"] == LR / 2
    train_steps(model, opt, batches[:2], loss=loss)

    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        ZenFlowAdamW(tiny_model().parameters(), lr=LR, **keys).load_state_dict(saved)


def test_a_checkpoint_resumes_exactly_where_the_gradients_are_summed_elsewhere(device):
    """accumulate_on says where the sums are made, not what they are: a checkpoint taken mid-interval with an
    update in flight, summing on the host, resumes summing on the device (and back) as the run would have
    gone on."""
    keys = dict(topk_ratio=0.25, update_interval=2, overlap_step=True)
    batches = make_batches(8)
    for saved_on, resumed_on in (("host", "device"), ("device", "host")):
        a = tiny_model()
        oa = ZenFlowAdamW(a.parameters(), lr=LR, accumulate_on=saved_on, **keys)
        train_steps(a, oa, batches[:3])  # t = 2: one step summed, the t = 1 update in flight
        sd = _roundtrip(oa.state_dict())
        b = tiny_model()
        b.load_state_dict(a.state_dict())
        ob = ZenFlowAdamW(b.parameters(), lr=LR, accumulate_on=resumed_on, **keys)
        ob.load_state_dict(sd)
        log_a, log_b = train_steps(a, oa, batches[3:]), train_steps(b, ob, batches[3:])
        assert ob.stats()["accumulate_on"] == resumed_on
        assert_history_close(log_b.params, log_a.params, names_of(a))


def _assert_resumes_as_the_saving_run(a, oa, sd, keys, batches):
    """A copy of model `a` with a new optimizer loading `sd` trains on `batches` bit for bit as `a` and `oa` do."""
    b = tiny_model()
    b.load_state_dict(a.state_dict())
    ob = ZenFlowAdamW(b.parameters(), lr=LR, **keys)
    ob.load_state_dict(sd)
    log_a, log_b = train_steps(a, oa, batches), train_steps(b, ob, batches)
    for xs, ys in zip(log_a.params, log_b.params):
        assert all(torch.equal(x, y) for x, y in zip(xs, ys))


def test_a_checkpoint_saved_before_the_landing_lag_key_existed_resumes():
    """Its config has no landing_lag: it ran the key's default (None), so it is not another config."""
    keys = dict(topk_ratio=0.25, update_interval=2, overlap_step=True)
    batches = make_batches(7)
    a = tiny_model()
    oa = ZenFlowAdamW(a.parameters(), lr=LR, **keys)
    train_steps(a, oa, batches[:3])
    sd = _roundtrip(oa.state_dict())
    del sd["zenflow"]["config"]["landing_lag"]
    _assert_resumes_as_the_saving_run(a, oa, sd, keys, batches[3:])
    sd["zenflow"]["config"]["landing_lag"] = 1  # but a checkpoint that names another value is another config
    with pytest.raises(ValueError, match=r"it has landing_lag=1, this optimizer landing_lag=None\. Construct the "
                                         r"optimizer with the saved values \(landing_lag=1\)"):
        ZenFlowAdamW(tiny_model().parameters(), lr=LR, **keys).load_state_dict(sd)


def test_a_checkpoint_saved_before_the_stagger_key_existed_resumes():
    """Saved before stagger_boundaries: no such config key (it ran unstaggered), one number per phase key."""
    keys = dict(topk_ratio=0.25, update_interval=3, overlap_step=True, landing_lag=2, select_strategy="step",
                select_interval=3, overlap_reselect="incoming")
    batches = make_batches(9)
    a = tiny_model()
    oa = ZenFlowAdamW(a.parameters(), lr=LR, **keys)
    train_steps(a, oa, batches[:4])
    sd = _roundtrip(oa.state_dict())
    zf = sd["zenflow"]
    del zf["config"]["stagger_boundaries"]
    for key in ("update_pending", "land_at", "selection_start", "selection_epoch", "steps_accumulated"):
        (zf[key],) = zf[key]
    assert zf["update_pending"] and zf["land_at"] == 4
    _assert_resumes_as_the_saving_run(a, oa, sd, keys, batches[4:])
    with pytest.raises(ValueError, match=r"it has stagger_boundaries=False, this optimizer "
                                         r"stagger_boundaries=True"):
        ZenFlowAdamW(tiny_model().parameters(), lr=LR, stagger_boundaries=True, **keys).load_state_dict(sd)


def test_a_checkpoint_saved_before_the_host_row_order_was_saved_resumes():
    """A checkpoint without `host_row` (each host column's row) lays the host rows out in update-count order:
    it loads, and the run goes on as the saving one, to the rounding that a row's place in the CPU AdamW's
    fused call may change (the order is saved so that a resume is bitwise)."""
    keys = dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step", select_interval=2,
                overlap_reselect="incoming")
    batches = make_batches(14)
    a = tiny_model()
    oa = ZenFlowAdamW(a.parameters(), lr=LR, **keys)
    train_steps(a, oa, batches[:8])  # reselections made in flight: rows out of count order
    assert oa.stats()["reselections"] >= 3
    sd = _roundtrip(oa.state_dict())
    matrices = {i: entry for i, entry in sd["state"].items() if "selected" in entry}
    assert matrices and all(entry["host_row"].shape == entry["selected"].shape for entry in matrices.values())
    b = tiny_model(seed=1)
    b.load_state_dict(a.state_dict())
    ob = ZenFlowAdamW(b.parameters(), lr=LR, **keys)
    # A damaged order (two host columns on one row) is refused, naming the entry, before anything changes.
    i, entry = next(iter(matrices.items()))
    intact = entry["host_row"].clone()
    on_host = (intact >= 0).nonzero().flatten()
    entry["host_row"][on_host[1]] = intact[on_host[0]]
    with pytest.raises(ValueError, match=rf"checkpoint entry of parameter {i} of param group 0 is damaged: its "
                                         r"host_row is not an order of its unselected columns.*Nothing was loaded"):
        ob.load_state_dict(sd)
    assert ob.state_dict()["state"] == {} and ob.state_dict()["zenflow"]["step_count"] == 0
    for entry in matrices.values():
        del entry["host_row"]
    ob.load_state_dict(sd)
    log_a, log_b = train_steps(a, oa, batches[8:]), train_steps(b, ob, batches[8:])
    for xs, ys in zip(log_a.params, log_b.params):
        assert max_param_diff(xs, ys) <= value_tolerance(1e-6, 0)["atol"]
    assert ob.stats()["reselections"] == oa.stats()["reselections"]


# ------------------------------------------------------------------------------------- non-finite
def _flat_state(sd):
    out = {}
    for i, entry in sd["state"].items():
        for k, v in entry.items():
            out[(i, k)] = v
    return out


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_gradient_skips_the_step(bad, device):
    keys = dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step", select_interval=4)
    batches = make_batches(10)
    BAD = 3  # the 4th step would be the boundary t = 3

    def run(cls):
        model = tiny_model()
        opt = cls(model.parameters(), lr=LR, max_grad_norm=1.0, **keys)
        poison = {"on": False}

        def hook(grad):
            if poison["on"]:
                grad = grad.clone()
                grad[2, 5] = bad
            return grad

        model.fc1.weight.register_hook(hook)
        train_steps(model, opt, batches[:BAD])
        before = dict(params=snapshot(model), masters=[opt.master(p) for p in model.parameters()],
                      state=opt.state_dict(), stats=opt.stats())
        poison["on"] = True
        train_steps(model, opt, batches[BAD:BAD + 1])
        poison["on"] = False
        after = dict(params=snapshot(model), masters=[opt.master(p) for p in model.parameters()],
                     state=opt.state_dict(), stats=opt.stats())
        log = train_steps(model, opt, batches[BAD + 1:])
        opt.synchronize()
        return model, opt, before, after, log

    model, zen, before, after, log_a = run(ZenFlowAdamW)
    for x, y in zip(before["params"], after["params"]):
        assert torch.equal(x, y)
    for x, y in zip(before["masters"], after["masters"]):
        assert torch.equal(x, y)
    flat_before, flat_after = _flat_state(before["state"]), _flat_state(after["state"])
    assert flat_before.keys() == flat_after.keys()
    for k, v in flat_before.items():
        assert torch.equal(v, flat_after[k]) if torch.is_tensor(v) else v == flat_after[k], k
    zb, za = before["state"]["zenflow"], after["state"]["zenflow"]
    for key in ("step_count", "selection_start", "steps_accumulated", "update_pending"):
        assert za[key] == zb[key], key
    assert after["stats"]["skipped_steps"] == before["stats"]["skipped_steps"] + 1 == 1
    for key in ("steps", "cpu_updates", "reselections", "current_interval", "update_pending"):
        assert after["stats"][key] == before["stats"][key], key
    assert after["stats"]["steps"] == BAD

    ref_model, ref, _, _, log_b = run(ZenFlowReference)
    assert_history_close(log_a.params, log_b.params, names_of(model))
    assert zen.stats()["skipped_steps"] == ref.stats()["skipped_steps"] == 1
    assert zen.stats()["steps"] == ref.stats()["steps"] == 9
    for name, p, q in zip(names_of(model), model.parameters(), ref_model.parameters()):
        assert_close(zen.master(p), ref.master(q), f"master {name}")


# ---------------------------------------------------------------------------------- worker failure
class InjectedKernelFailure(Exception):
    pass


def _crashing_cpu_adamw(*args, **kwargs):
    raise InjectedKernelFailure("injected cpu_adamw_ failure")


def _one_step(model, opt, batch):
    loss_fn(model, batch).backward()
    opt.step()
    opt.zero_grad()


def test_worker_failure_surfaces_at_the_boundary_without_overlap(monkeypatch, device):
    monkeypatch.setattr(zenflow_compile.runtime.kernels, "cpu_adamw_", _crashing_cpu_adamw)
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2, overlap_step=False)
    batches = make_batches(4)
    run_with_timeout(lambda: _one_step(model, opt, batches[0]))  # t = 0: no boundary, no CPU AdamW
    with pytest.raises(RuntimeError, match="injected cpu_adamw_ failure") as info:
        run_with_timeout(lambda: _one_step(model, opt, batches[1]))  # t = 1: the boundary waits for it
    assert "InjectedKernelFailure" in str(info.value)
    # later calls keep raising, quickly
    with pytest.raises(RuntimeError, match="injected cpu_adamw_ failure"):
        run_with_timeout(opt.step)
    with pytest.raises(RuntimeError, match="injected cpu_adamw_ failure"):
        run_with_timeout(opt.synchronize)
    with pytest.raises(RuntimeError, match="injected cpu_adamw_ failure"):
        run_with_timeout(lambda: _one_step(model, opt, batches[2]))


def test_worker_failure_surfaces_at_next_step_or_synchronize_with_overlap(monkeypatch, device):
    monkeypatch.setattr(zenflow_compile.runtime.kernels, "cpu_adamw_", _crashing_cpu_adamw)
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2, overlap_step=True)
    batches = make_batches(6)
    run_with_timeout(lambda: _one_step(model, opt, batches[0]))
    run_with_timeout(lambda: _one_step(model, opt, batches[1]))  # t = 1: launches the CPU update, no wait
    seen = None
    try:  # the next step (its backward hook or its step()) may already see the failure ...
        run_with_timeout(lambda: _one_step(model, opt, batches[2]))
    except RuntimeError as error:
        seen = error
    if seen is None:  # ... and synchronize() certainly does
        with pytest.raises(RuntimeError) as info:
            run_with_timeout(opt.synchronize)
        seen = info.value
    assert "injected cpu_adamw_ failure" in str(seen) and "InjectedKernelFailure" in str(seen)
    for call in (opt.synchronize, opt.step, lambda: _one_step(model, opt, batches[3]),
                 lambda: opt.master(model.fc1.weight), opt.state_dict):
        with pytest.raises(RuntimeError, match="injected cpu_adamw_ failure"):
            run_with_timeout(call)


# --------------------------------------------------------------------------- torch.optim conventions
def test_param_groups_with_different_lr_and_weight_decay_equal_adamw(device):
    batches = make_batches(8)
    a, b = tiny_model(), tiny_model()
    adam = torch.optim.AdamW(_groups(a), lr=LR)
    zen = ZenFlowAdamW(_groups(b), lr=LR, topk_ratio=0.25, update_interval=1)
    assert [g["lr"] for g in zen.param_groups] == [3e-2, LR]
    assert [g["weight_decay"] for g in zen.param_groups] == [1e-2, 0.1]
    assert_history_close(train_steps(b, zen, batches).params, train_steps(a, adam, batches).params, names_of(a))


def test_add_param_group_after_construction(device):
    batches = make_batches(8)
    a, b = tiny_model(), tiny_model()
    first = lambda m: list(m.emb.parameters()) + list(m.fc1.parameters())  # noqa: E731
    rest = lambda m: list(m.norm.parameters()) + list(m.fc2.parameters())  # noqa: E731
    adam = torch.optim.AdamW(first(a), lr=LR)
    adam.add_param_group({"params": rest(a), "lr": 5e-3, "weight_decay": 0.05})
    zen = ZenFlowAdamW(first(b), lr=LR, topk_ratio=0.25, update_interval=1)
    zen.add_param_group({"params": rest(b), "lr": 5e-3, "weight_decay": 0.05})
    initial = snapshot(rest(b))
    log_a, log_b = train_steps(a, adam, batches), train_steps(b, zen, batches)
    assert_history_close(log_b.params, log_a.params, names_of(a))
    assert all(not torch.equal(x, y) for x, y in zip(initial, rest(b)))  # the added params trained
    assert b.fc2.weight.grad is None and zen.selected_columns(b.fc2.weight) is not None


def test_step_lr_scheduler_changes_the_lr_used(device):
    batches = make_batches(8)
    a, b, c = tiny_model(), tiny_model(), tiny_model()
    adam = torch.optim.AdamW(a.parameters(), lr=LR)
    zen = ZenFlowAdamW(b.parameters(), lr=LR, topk_ratio=0.25, update_interval=1)
    plain = ZenFlowAdamW(c.parameters(), lr=LR, topk_ratio=0.25, update_interval=1)
    sa = torch.optim.lr_scheduler.StepLR(adam, step_size=2, gamma=0.1)
    sb = torch.optim.lr_scheduler.StepLR(zen, step_size=2, gamma=0.1)
    log_a = train_steps(a, adam, batches, scheduler=sa)
    log_b = train_steps(b, zen, batches, scheduler=sb)
    log_c = train_steps(c, plain, batches)
    assert zen.param_groups[0]["lr"] == pytest.approx(LR * 1e-4)
    assert_history_close(log_b.params, log_a.params, names_of(a))
    assert all(torch.equal(x, y) for x, y in zip(log_b.params[1], log_c.params[1]))  # same lr for 2 steps
    assert max_param_diff(log_b.params[2], log_c.params[2]) > 1e-4  # then the scheduled lr is used


@pytest.mark.parametrize("keys", [dict(topk_ratio=0.25, update_interval=1),
                                  dict(topk_ratio=0.25, update_interval=2, overlap_step=True)],
                         ids=["int1", "int2-overlap"])
def test_zero_grad_between_backward_and_step_discards_that_gradient(keys, device):
    batches = make_batches(8)
    extra = make_batches(8, seed=5000)
    a, b = tiny_model(), tiny_model()
    oa = ZenFlowAdamW(a.parameters(), lr=LR, **keys)
    ob = ZenFlowAdamW(b.parameters(), lr=LR, **keys)
    for i in range(8):
        if i % 3 == 1:
            loss_fn(a, extra[i]).backward()  # discarded below
            oa.zero_grad()
        loss_fn(a, batches[i]).backward()
        oa.step()
        oa.zero_grad()
    log_b = train_steps(b, ob, batches)
    assert all(torch.equal(x, y) for x, y in zip(snapshot(a), log_b.params[-1]))
    oa.synchronize()
    ob.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(oa.master(p), ob.master(q))


@pytest.mark.parametrize("kwargs, name", [(dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), "betas"),
                                          (dict(max_grad_norm=0), "max_grad_norm"), (dict(eps=-1e-8), "eps"),
                                          (dict(weight_decay=-0.1), "weight_decay"),
                                          (dict(lr=float("nan")), "lr"),
                                          (dict(topk_ratio=0.0), "topk_ratio"),
                                          (dict(update_interval=0), "update_interval")])
def test_invalid_hyperparameters_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ZenFlowAdamW(tiny_model().parameters(), **kwargs)


def test_config_and_keys_together_is_an_error():
    with pytest.raises(ValueError):
        ZenFlowAdamW(tiny_model().parameters(), config=ZenFlowConfig(topk_ratio=0.5), update_interval=2)
    opt = ZenFlowAdamW(tiny_model().parameters(), config=ZenFlowConfig(topk_ratio=0.5, update_interval=2))
    assert opt.config.topk_ratio == 0.5 and opt.config.update_interval == 2


def test_a_parameter_owned_by_two_optimizers_is_an_error():
    model = tiny_model()
    first = ZenFlowAdamW(model.parameters(), lr=LR)
    with pytest.raises(ValueError):
        ZenFlowAdamW([model.fc1.weight], lr=LR)
    second = ZenFlowAdamW([tiny_model().fc1.weight], lr=LR)
    with pytest.raises(ValueError):
        second.add_param_group({"params": [model.fc2.weight]})
    assert first.param_groups  # keep `first` alive until here


# ------------------------------------------------------------------------------------------- stats
def test_stats_counters(device):
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=3, overlap_step=True,
                       full_warm_up_rounds=2, select_strategy="step", select_interval=100)
    expected_keys = {"steps", "skipped_steps", "cpu_updates", "reselections", "bytes_device_to_host",
                     "bytes_host_to_device", "stall_seconds", "cpu_update_seconds", "accumulate_seconds",
                     "current_interval", "update_pending", "selection_churn", "selection_seconds",
                     "accumulate_copy_wait_seconds"}
    assert expected_keys <= set(opt.stats())
    batches = make_batches(11)
    train_steps(model, opt, batches[:2])  # warm-up
    st = opt.stats()
    assert st["steps"] == 2 and st["current_interval"] == 0
    d2h_after_warm_up = st["bytes_device_to_host"]
    intervals, updates = [], []
    for i in range(2, 11):
        train_steps(model, opt, batches[i:i + 1])
        st = opt.stats()
        intervals.append(st["current_interval"])
        updates.append(st["cpu_updates"])
        if i == 2:
            assert st["bytes_device_to_host"] > d2h_after_warm_up  # unselected columns were offloaded
    # boundaries at t = 4, 7, 10 (t - W + 1 divisible by 3): current_interval resets there
    assert intervals == [1, 2, 0, 1, 2, 0, 1, 2, 0]
    # cpu_updates counts boundaries only (the warm-up steps are none: see the warm-up test above)
    assert [u - updates[0] for u in updates] == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert st["steps"] == 11 and st["skipped_steps"] == 0 and st["reselections"] == 0
    assert st["selection_seconds"] > 0  # the first selection (t = 2) moved the selected columns' state
    assert st["update_pending"] is True  # overlap: t = 10's update is in flight
    assert st["bytes_host_to_device"] > 0  # t = 4's update was applied at t = 7
    assert st["cpu_update_seconds"] >= 0 and st["accumulate_seconds"] >= 0 and st["stall_seconds"] >= 0
    opt.synchronize()
    assert opt.stats()["update_pending"] is False


def test_stats_accumulate_copy_wait():
    """Host accumulation: the accumulate worker's wait for the gradients' copies is reported apart from its busy
    time: about the copies' landing delay on a device whose copies are slow, none where the device is the host."""
    from emulated_device import emulated_async_device

    def copy_wait(emulated_delay_ms):
        model = tiny_model()
        opt = ZenFlowAdamW(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2, accumulate_on="host")
        train_steps(model, opt, make_batches(4))
        opt.synchronize()
        st = opt.stats()
        assert 0 <= st["accumulate_copy_wait_seconds"] <= st["accumulate_seconds"]
        return st["accumulate_copy_wait_seconds"]

    assert copy_wait(None) == 0.0
    with emulated_async_device(delay_ms=50):  # each copy lands 25-75 ms after it is queued
        waited = copy_wait(50)
    assert waited >= 4 * 0.015, waited  # 4 steps, each waiting for copies queued moments before


@pytest.mark.parametrize("update_interval", [3, "auto"])
def test_cpu_updates_counts_boundaries(update_interval, device):
    """Without warm-up: one CPU update per boundary (int: every 3 steps; auto: as the reference decides)."""
    batches = make_batches(9)
    a, b = tiny_model(), tiny_model()
    zen = ZenFlowAdamW(a.parameters(), lr=LR, topk_ratio=0.25, update_interval=update_interval)
    ref = ZenFlowReference(b.parameters(), lr=LR, topk_ratio=0.25, update_interval=update_interval)
    counts_a, counts_b = [], []
    for i in range(9):
        train_steps(a, zen, batches[i:i + 1])
        train_steps(b, ref, batches[i:i + 1])
        counts_a.append(zen.stats()["cpu_updates"])
        counts_b.append(ref.stats()["cpu_updates"])
        assert zen.stats()["current_interval"] == ref.stats()["current_interval"]
    assert counts_a == counts_b
    if update_interval == 3:
        assert counts_a == [0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert zen.stats()["bytes_device_to_host"] > 0 and zen.stats()["bytes_host_to_device"] > 0


def test_backward_with_create_graph_equals_reference(device):
    """A gradient that carries autograd history (`backward(create_graph=True)`, e.g. for a gradient penalty)
    is handed off detached: the run equals the reference on the same gradients."""
    keys = dict(topk_ratio=0.25, update_interval=2, overlap_step=True)
    batches = make_batches(6)
    models = [tiny_model(), tiny_model()]
    opts = [ZenFlowAdamW(models[0].parameters(), lr=LR, **keys), ZenFlowReference(models[1].parameters(), lr=LR, **keys)]
    for batch in batches:
        for model, opt in zip(models, opts):
            loss_fn(model, batch).backward(create_graph=True)
            opt.step()
            opt.zero_grad()
    for opt in opts:
        opt.synchronize()
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_input_gradient_penalty_equals_reference(device):
    """A gradient penalty on the input (`torch.autograd.grad(loss, x, create_graph=True)`, then the penalised
    loss's backward): the first call hands nothing to the optimizer, the second its whole gradient, as the
    reference sees it through `.grad`."""
    keys = dict(topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=4, overlap_step=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref_model = copy.deepcopy(model)
    opt, ref = ZenFlowAdamW(model.parameters(), lr=LR, **keys), ZenFlowReference(ref_model.parameters(), lr=LR, **keys)
    for step in range(8):
        x = torch.randn(6, 8, generator=seeded_generator(step))
        for m, o in ((model, opt), (ref_model, ref)):
            inputs = x.clone().requires_grad_()
            loss = m(inputs).pow(2).mean()
            (grad_x,) = torch.autograd.grad(loss, inputs, create_graph=True)
            if o is opt:
                assert not opt._runtime.holds_step_grads  # the input gradient reached no parameter
            (loss + 0.5 * grad_x.pow(2).sum()).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    ref.synchronize()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    assert opt.stats()["reselections"] == ref.stats()["reselections"] > 0


def test_load_between_a_compiled_backward_and_step_is_refused_and_loses_nothing(fresh_dynamo, device):
    """A compiled backward's gradients already live in the optimizer's states, which loading re-creates:
    refused with the fix named; the step then applies them as if nothing had been tried."""
    model, ref_model = tiny_model(), tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2)
    ref = ZenFlowAdamW(ref_model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2)
    compiled, compiled_ref = torch.compile(model, backend="zenflow"), torch.compile(ref_model, backend="zenflow")
    batches = make_batches(4)
    train_steps(compiled, opt, batches[:2])
    train_steps(compiled_ref, ref, batches[:2])
    saved = opt.state_dict()
    for m in (compiled, compiled_ref):
        loss_fn(m, batches[2]).backward()
    with pytest.raises(RuntimeError, match=r"between a backward and step\(\).*zero_grad"):
        opt.load_state_dict(saved)
    opt.step()
    ref.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):  # bitwise, but on CUDA (atomic adds)
        torch.testing.assert_close(p, q, **value_tolerance(0, 0))
    opt.zero_grad()
    loss_fn(compiled, batches[3]).backward()
    opt.zero_grad()
    opt.load_state_dict(saved)  # after zero_grad: allowed


def test_load_between_an_eager_backward_and_step_keeps_grad_as_torch_does():
    """Eagerly the gradients stay in .grad until step(), as with torch.optim: loading in between is allowed and
    the step applies them to the loaded state."""
    model, other = tiny_model(), tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2)
    batches = make_batches(4)
    train_steps(model, opt, batches[:2])
    saved = copy.deepcopy(opt.state_dict())
    other.load_state_dict(model.state_dict())
    loss_fn(model, batches[2]).backward()
    opt.load_state_dict(saved)
    opt.step()
    resumed = ZenFlowAdamW(other.parameters(), lr=LR, topk_ratio=0.25, update_interval=2)
    resumed.load_state_dict(saved)
    loss_fn(other, batches[2]).backward()
    resumed.step()
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_config_as_a_dict_of_zenflow_keys_and_a_clear_error_for_a_path():
    a, b = tiny_model(), tiny_model()
    from_dict = ZenFlowAdamW(a.parameters(), lr=LR, config={"topk_ratio": 0.25, "update_interval": 2})
    from_keys = ZenFlowAdamW(b.parameters(), lr=LR, topk_ratio=0.25, update_interval=2)
    assert from_dict.config == from_keys.config
    batches = make_batches(4)
    train_steps(a, from_dict, batches)
    train_steps(b, from_keys, batches)
    assert max_param_diff(a, b) == 0.0
    with pytest.raises(TypeError, match=r"config= expects a ZenFlowConfig or a dict.*from_deepspeed\(path\)"):
        ZenFlowAdamW(tiny_model().parameters(), lr=LR, config="ds_config.json")
    with pytest.raises(ValueError, match="topk_ration"):
        ZenFlowAdamW(tiny_model().parameters(), lr=LR, config={"topk_ration": 0.1})


def test_zenflow_keys_in_a_param_group_are_refused_not_ignored():
    model = tiny_model()
    params = list(model.parameters())
    with pytest.raises(ValueError, match=r"param group 1 sets ZenFlow key\(s\) \['topk_ratio'\].*whole optimizer"):
        ZenFlowAdamW([{"params": params[:2]}, {"params": params[2:], "topk_ratio": 0.5}], lr=LR)
    opt = ZenFlowAdamW(params[:2], lr=LR)
    with pytest.raises(ValueError, match=r"\['update_interval'\]"):
        opt.add_param_group({"params": params[2:], "update_interval": 2})
    opt.add_param_group({"params": params[2:], "lr": LR / 2, "name": "rest"})  # torch's own keys stay allowed


def test_recreating_an_optimizer_while_the_old_one_lives_names_the_fix():
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match=r"already owned by another ZenFlowAdamW.*`del opt`"):
        ZenFlowAdamW(model.parameters(), lr=LR)  # a notebook cell run twice
    del opt
    ZenFlowAdamW(model.parameters(), lr=LR)  # the fix the message names


@pytest.mark.parametrize("select", [dict(select_strategy="step", select_interval=100),
                                    dict(select_strategy="step", select_interval=2)], ids=["never", "every2"])
@pytest.mark.parametrize("overlap", [True, False])
def test_stats_counts_overlapped_boundaries_like_reference(select, overlap, device):
    """stats()["overlapped_boundaries"]: boundaries whose CPU update stayed in flight into the next steps. A
    reselecting boundary waits for its own update (docs/semantics.md, "Overlap"), so with select_interval =
    update_interval none overlaps; warm-up steps are no boundaries."""
    batches = make_batches(11)
    a, b = tiny_model(), tiny_model()
    keys = dict(topk_ratio=0.25, update_interval=2, overlap_step=overlap, full_warm_up_rounds=1, **select)
    zen, ref = ZenFlowAdamW(a.parameters(), lr=LR, **keys), ZenFlowReference(b.parameters(), lr=LR, **keys)
    counts = []
    for i in range(11):
        train_steps(a, zen, batches[i:i + 1])
        train_steps(b, ref, batches[i:i + 1])
        counts.append(zen.stats()["overlapped_boundaries"])
        assert counts[-1] == ref.stats()["overlapped_boundaries"]
    assert zen.stats()["cpu_updates"] == 5  # boundaries at t = 2, 4, 6, 8, 10
    expected = {(True, "never"): [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5], (True, "every2"): [0] * 11}
    assert counts == expected.get((overlap, "never" if select["select_interval"] == 100 else "every2"), [0] * 11)


def test_the_runtime_work_shows_in_a_profiler_trace_on_its_threads():
    """torch.profiler (profile_all_threads: the workers are threads of their own) shows the runtime's work as
    named ranges: the CPU AdamW and the accumulation on the worker threads, the update's apply and the
    selection moves on the training thread, so a trace in Perfetto or TensorBoard shows what overlaps what."""
    from torch._C._profiler import _ExperimentalConfig

    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2, overlap_step=True,
                       select_strategy="step", select_interval=4, accumulate_on="host")
    batches = make_batches(8)
    train_steps(model, opt, batches[:1])  # (threads started before profiling, as in a training run)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        train_steps(model, opt, batches[1:])
        opt.synchronize()
    threads: dict[str, set] = {}
    for event in prof.events():
        if event.name.startswith("zenflow::"):
            threads.setdefault(event.name, set()).add(event.thread)
    training_thread = threads["zenflow::apply_update"]
    assert threads["zenflow::selection_moves"] == training_thread
    for on_a_worker in ("zenflow::cpu_adamw", "zenflow::accumulate"):
        assert threads[on_a_worker] and not threads[on_a_worker] & training_thread, (on_a_worker, threads)
