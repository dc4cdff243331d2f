"""Tests of the eager oracle ``zenflow_compile.reference.ZenFlowReference`` (docs/semantics.md)."""

import copy
import math

import pytest
import torch
from torch import nn

from zenflow_compile.config import ZenFlowConfig
from helpers import seeded_generator, tiny_model as make_model
from zenflow_compile.reference import ZenFlowReference

# Invariants 1 and 2 compare against torch.optim.AdamW with atol 1e-6, rtol 1e-5 (params are O(0.1..1)).
# The reference repeats torch's single-tensor AdamW op for op with the same fp32 roundings of the Python
# scalars, so the results are bitwise equal in practice; the tolerance only leaves room for (a) SIMD vs scalar
# tails / FMA contraction of the CPU kernels, which may differ by an ulp when columns are gathered into
# smaller tensors, and (b) the clip norm, computed as sqrt(sum of squares) instead of torch's norm of per-tensor
# norms (an ulp on coef). Over 8 steps such ulps stay orders of magnitude below 1e-6.
ATOL, RTOL = 1e-6, 1e-5
LR = 1e-2


def batch(i, dtype=torch.float32):
    g = seeded_generator(1000 + i)
    return torch.randint(0, 32, (8, 6), generator=g), torch.randn(8, 6, 16, generator=g).to(dtype)


def train_step(model, opt, i, clip=None):
    x, y = batch(i, next(model.parameters()).dtype)
    loss = ((model(x).float() - y.float()) ** 2).mean()
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad()


def run_pair(make_ref, steps=8, clip=None, groups=None, sched=None):
    """Run torch AdamW (with clip_grad_norm_ if clip) and a reference on two copies; compare every step."""
    a, b = make_model(), make_model()
    pa = groups(a) if groups else a.parameters()
    pb = groups(b) if groups else b.parameters()
    oa, ob = torch.optim.AdamW(pa, lr=LR), make_ref(pb)
    sa, sb = (sched(oa), sched(ob)) if sched else (None, None)
    for i in range(steps):
        train_step(a, oa, i, clip)
        train_step(b, ob, i)
        if sched:
            sa.step()
            sb.step()
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(q, p, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {i} {name}: {m}")
    return ob


# ------------------------------------------------------------------------------------------ invariant 1
@pytest.mark.parametrize("topk_ratio", [0.1, 0.5])
@pytest.mark.parametrize("select", [dict(select_strategy="auto"),
                                    dict(select_strategy="step", select_interval=2)])
@pytest.mark.parametrize("warm_up", [0, 2])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_interval_one_equals_adamw(topk_ratio, select, warm_up, clip):
    ref = run_pair(lambda ps: ZenFlowReference(ps, lr=LR, max_grad_norm=clip, topk_ratio=topk_ratio,
                                               update_interval=1, overlap_step=False,
                                               full_warm_up_rounds=warm_up, **select),
                   clip=clip)
    st = ref.stats()
    assert st["steps"] == 8 and st["skipped_steps"] == 0 and st["cpu_updates"] == 8 - warm_up


def test_clip_is_active_in_the_clip_cases():
    model = make_model()
    x, y = batch(0)
    ((model(x) - y) ** 2).mean().backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9) > 0.05 * 2


# ------------------------------------------------------------------------------------------ invariant 2
@pytest.mark.parametrize("update_interval", [3, "auto"])
@pytest.mark.parametrize("overlap", [False, True])
def test_ratio_one_equals_adamw(update_interval, overlap):
    run_pair(lambda ps: ZenFlowReference(ps, lr=LR, topk_ratio=1.0, update_interval=update_interval,
                                         overlap_step=overlap))


def test_param_groups_and_lr_scheduler():
    def groups(m):
        return [{"params": list(m.emb.parameters()) + list(m.fc1.parameters()), "lr": 3e-2},
                {"params": list(m.norm.parameters()) + list(m.fc2.parameters()), "weight_decay": 0.1}]

    def sched(o):
        return torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))

    run_pair(lambda ps: ZenFlowReference(ps, lr=LR, topk_ratio=0.25, update_interval=1), groups=groups,
             sched=sched)


# ------------------------------------------------------------------------------- hand-checked semantics
B1, B2, EPS, WD = 0.9, 0.999, 1e-8, 1e-2
P0 = torch.tensor([[0.5, -1.0, 0.25, 2.0], [1.5, 0.75, -0.5, -2.0]])


def adamw64(p, m, v, n, g, lr=LR):
    """One float64 AdamW step on one column (or any tensor): returns (p, m, v)."""
    p, m, v, g = (x.double() for x in (p, m, v, g))
    p = p * (1 - lr * WD)
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    p = p - lr / (1 - B1 ** n) * m / (v.sqrt() / math.sqrt(1 - B2 ** n) + EPS)
    return p, m, v


def single(**keys):
    p = nn.Parameter(P0.clone())
    return p, ZenFlowReference([p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, **keys)


def col_grad(*col_values):
    """2x4 gradient whose column j is col_values[j] in both rows (score 2*v^2)."""
    return torch.tensor(col_values, dtype=torch.float32).expand(2, 4).clone()


def do_step(p, opt, g):
    p.grad = g.clone()
    opt.step()
    p.grad = None


def test_topk_ties_pick_lower_index():
    for values, expected in [((1, 2, 2, 1), [1, 2]), ((3, 3, 3, 3), [0, 1]), ((1, 3, 3, 3), [1, 2]),
                             ((0, 0, 0, 5), [0, 3])]:
        p, opt = single(topk_ratio=0.5, update_interval=4)
        assert opt.selected_columns(p) is None
        do_step(p, opt, col_grad(*values))
        assert opt.selected_columns(p).tolist() == expected


def test_interval_two_mean_gradient():
    p, opt = single(topk_ratio=0.5, update_interval=2, select_strategy="step", select_interval=1000)
    g0, g1 = col_grad(3, 2, 1, 0.5), col_grad(2.5, 3, 0.25, -1)
    do_step(p, opt, g0)
    assert opt.selected_columns(p).tolist() == [0, 1]
    assert torch.equal(p.data[:, 2:], P0[:, 2:]) and not torch.equal(p.data[:, :2], P0[:, :2])
    assert opt.stats()["current_interval"] == 1 and opt.stats()["cpu_updates"] == 0
    do_step(p, opt, g1)
    # unselected columns: one AdamW step (count 1) with the mean gradient
    # (Adam's first step is nearly scale-invariant, so also check the moments: they see the mean, not the sum)
    exp_u, m_u, v_u = adamw64(P0[:, 2:], torch.zeros(2, 2), torch.zeros(2, 2), 1, (g0[:, 2:] + g1[:, 2:]) / 2)
    torch.testing.assert_close(p.data[:, 2:].double(), exp_u, atol=1e-6, rtol=0)
    torch.testing.assert_close(opt.state[p]["exp_avg"][:, 2:].double(), m_u, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"][:, 2:].double(), v_u, atol=1e-9, rtol=1e-6)
    # selected columns: two AdamW steps
    s = adamw64(P0[:, :2], torch.zeros(2, 2), torch.zeros(2, 2), 1, g0[:, :2])
    exp_s, _, _ = adamw64(*s, 2, g1[:, :2])
    torch.testing.assert_close(p.data[:, :2].double(), exp_s, atol=1e-6, rtol=0)
    assert opt.state[p]["count"].tolist() == [2, 2, 1, 1]
    assert opt.stats()["cpu_updates"] == 1 and opt.stats()["current_interval"] == 0
    assert torch.equal(opt.state[p]["acc"], torch.zeros(2, 4))


def test_overlap_applies_at_next_boundary_and_synchronize():
    p, opt = single(topk_ratio=0.5, update_interval=2, select_strategy="step", select_interval=1000,
                    overlap_step=True)
    grads = [col_grad(3, 2, 1, 0.5), col_grad(2.5, 3, 0.25, -1), col_grad(3, 3, 1, 1), col_grad(4, 2, -1, 1)]
    do_step(p, opt, grads[0])
    do_step(p, opt, grads[1])
    m1 = opt.master(p)
    assert not torch.equal(m1[:, 2:], P0[:, 2:])            # master of U changed at step 1 ...
    assert torch.equal(p.data[:, 2:], P0[:, 2:])            # ... the device copy did not
    assert torch.equal(p.data[:, :2], m1[:, :2])            # selected columns are current
    assert opt.stats()["pending"]
    do_step(p, opt, grads[2])
    assert torch.equal(p.data[:, 2:], P0[:, 2:]) and torch.equal(opt.master(p)[:, 2:], m1[:, 2:])
    do_step(p, opt, grads[3])
    m3 = opt.master(p)
    assert torch.equal(p.data[:, 2:], m1[:, 2:])            # step 1's CPU update applied at step 3
    assert not torch.equal(m3[:, 2:], m1[:, 2:])            # step 3's CPU update is in flight
    assert torch.equal(p.data[:, :2], m3[:, :2])
    opt.synchronize()
    assert torch.equal(p.data, m3) and not opt.stats()["pending"]
    opt.synchronize()                                       # idempotent
    assert torch.equal(p.data, m3)


def test_overlap_reselection_boundary_is_fully_applied():
    # select_interval 2: the boundary at t=1 reselects, so its own CPU update is applied at once (no pending)
    p, opt = single(topk_ratio=0.5, update_interval=2, select_strategy="step", select_interval=2,
                    overlap_step=True)
    do_step(p, opt, col_grad(3, 2, 1, 0.5))
    do_step(p, opt, col_grad(0.5, 1, 3, 2))
    assert opt.selected_columns(p).tolist() == [2, 3] and opt.stats()["reselections"] == 1
    assert not opt.stats()["pending"] and torch.equal(p.data, opt.master(p))
    assert (p.data != P0).all()
    # next boundary t=3: 2 steps have run under the selection made at t=1, so it reselects again
    do_step(p, opt, col_grad(0.5, 1, 3, 2))
    do_step(p, opt, col_grad(0.5, 1, 3, 2))
    assert opt.stats()["reselections"] == 2 and torch.equal(p.data, opt.master(p))


def test_warm_up_then_first_selection():
    p, opt = single(topk_ratio=0.5, update_interval=4, full_warm_up_rounds=2)
    before = p.data.clone()
    do_step(p, opt, col_grad(5, 4, 1, 1))
    assert (p.data != before).all() and opt.selected_columns(p) is None
    before = p.data.clone()
    do_step(p, opt, col_grad(5, 4, 1, 1))
    assert (p.data != before).all() and opt.selected_columns(p) is None
    before = p.data.clone()
    do_step(p, opt, col_grad(1, 1, 5, 4))                   # selection from step 2's scores
    assert opt.selected_columns(p).tolist() == [2, 3]
    assert torch.equal(p.data[:, :2], before[:, :2]) and (p.data[:, 2:] != before[:, 2:]).all()
    assert opt.state[p]["count"].tolist() == [2, 2, 3, 3]
    assert opt.stats()["steps"] == 3 and opt.stats()["cpu_updates"] == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_skips_the_step(bad):
    p, opt = single(topk_ratio=0.5, update_interval=3, max_grad_norm=10.0)
    do_step(p, opt, col_grad(3, 2, 1, 0.5))
    do_step(p, opt, col_grad(1, 2, 3, 0.5))
    params, sd, st = p.data.clone(), opt.state_dict(), opt.stats()
    g = col_grad(1, 1, 1, 1)
    g[1, 2] = bad
    do_step(p, opt, g)
    assert torch.equal(p.data, params)
    sd2 = opt.state_dict()
    assert sd2["zenflow"] == {**sd["zenflow"], "skipped_steps": 1}
    for k, v in sd["state"][0].items():
        assert torch.equal(v, sd2["state"][0][k]) if torch.is_tensor(v) else v == sd2["state"][0][k], k
    assert opt.stats() == {**st, "skipped_steps": 1}
    # the next finite step is step 2, the boundary (t - W + 1 == 3)
    do_step(p, opt, col_grad(1, 1, 1, 1))
    assert opt.stats()["cpu_updates"] == 1 and opt.stats()["steps"] == 3


def test_reselection_moves_selection_and_keeps_state():
    p, opt = single(topk_ratio=0.5, update_interval=1, select_strategy="step", select_interval=2)
    q = nn.Parameter(P0.clone())
    adam = torch.optim.AdamW([q], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    grads = [col_grad(3, 2, 1, 0.5), col_grad(0.5, 1, 3, 2), col_grad(1, 2, 3, 4), col_grad(1, 2, 3, 4)]
    expected_s = [[0, 1], [2, 3], [2, 3], [2, 3]]            # reselect at t=1 (from g1) and t=3 (from g3)
    for i, g in enumerate(grads):
        do_step(p, opt, g)
        do_step(q, adam, g)
        assert opt.selected_columns(p).tolist() == expected_s[i]
        # state of each column: exactly AdamW's (nothing reset when the column changes side)
        torch.testing.assert_close(opt.state[p]["exp_avg"], adam.state[q]["exp_avg"], atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], adam.state[q]["exp_avg_sq"], atol=1e-9, rtol=1e-6)
        assert opt.state[p]["count"].tolist() == [i + 1] * 4
        torch.testing.assert_close(p.data, q.data, atol=ATOL, rtol=RTOL)
    assert opt.stats()["reselections"] == 2


def test_auto_strategy_reselects_on_drift():
    p, opt = single(topk_ratio=0.5, update_interval=1, select_strategy="auto")
    do_step(p, opt, col_grad(3, 2, 1, 0.5))
    assert opt.selected_columns(p).tolist() == [0, 1]
    do_step(p, opt, col_grad(3, 0.5, 2, 1))                 # top-k {0, 2}: half of S kept -> not drifted
    assert opt.selected_columns(p).tolist() == [0, 1] and opt.stats()["reselections"] == 0
    do_step(p, opt, col_grad(0.5, 1, 3, 2))                 # top-k {2, 3}: drifted -> reselect
    assert opt.selected_columns(p).tolist() == [2, 3] and opt.stats()["reselections"] == 1


def test_auto_strategy_weighs_drift_by_columns():
    # drift in the 4-column matrix alone (4 of 12 columns) does not reselect; in the 8-column one it does
    def g8(hot):
        g = torch.full((2, 8), 0.1)
        g[:, hot] = 1.0
        return g

    for drift_small, expect in [(True, [0, 1, 2, 3]), (False, [4, 5, 6, 7])]:
        a, b = nn.Parameter(P0.clone()), nn.Parameter(torch.zeros(2, 8))
        opt = ZenFlowReference([a, b], lr=LR, topk_ratio=0.5, update_interval=1, select_strategy="auto")
        a.grad, b.grad = col_grad(3, 2, 1, 0.5), g8([0, 1, 2, 3])
        opt.step()
        if drift_small:
            a.grad, b.grad = col_grad(0.5, 1, 3, 2), g8([0, 1, 2, 3])
        else:
            a.grad, b.grad = col_grad(3, 2, 1, 0.5), g8([4, 5, 6, 7])
        opt.step()
        assert opt.selected_columns(a).tolist() == [0, 1]
        assert opt.selected_columns(b).tolist() == expect
        assert opt.stats()["reselections"] == (0 if drift_small else 1)


def test_state_not_reset_on_reselection_with_interval():
    # update_interval 2: column 0 is selected (device state), then moves to the unselected side
    p, opt = single(topk_ratio=0.5, update_interval=2, select_strategy="step", select_interval=2)
    do_step(p, opt, col_grad(3, 2, 1, 0.5))
    do_step(p, opt, col_grad(0.5, 1, 3, 2))                 # boundary + reselection -> S = [2, 3]
    assert opt.selected_columns(p).tolist() == [2, 3]
    ea = opt.state[p]["exp_avg"].clone()
    assert (ea != 0).all() and opt.state[p]["count"].tolist() == [2, 2, 1, 1]
    do_step(p, opt, col_grad(1, 1, 1, 1))                   # columns 0, 1 now only accumulate
    assert torch.equal(opt.state[p]["exp_avg"][:, :2], ea[:, :2])
    assert not torch.equal(opt.state[p]["exp_avg"][:, 2:], ea[:, 2:])


# ------------------------------------------------------------------------------------------- Zen-auto
def test_zen_auto_boundary_at_max_update_interval():
    p, opt = single(topk_ratio=0.5, update_interval="auto", max_update_interval=3)
    for t in range(3):
        before = p.data.clone()
        do_step(p, opt, col_grad(1, 1, 1e-3, 1e-3))         # U never ripens: sumU = 2e-6 m << K = 2
        if t < 2:
            assert torch.equal(p.data[:, 2:], before[:, 2:]) and opt.stats()["current_interval"] == t + 1
    assert (p.data[:, 2:] != before[:, 2:]).all()
    assert opt.stats()["cpu_updates"] == 1 and opt.stats()["current_interval"] == 0
    assert opt.state[p]["count"].tolist() == [3, 3, 1, 1]


def test_zen_auto_unselected_ripen_early():
    p, opt = single(topk_ratio=0.5, update_interval="auto")
    u = math.sqrt(0.6)                                      # U_t = 1.2 per step, K_t = 2
    do_step(p, opt, col_grad(1, 1, u, u))                   # sumU 1.2 < sumK / 1 = 2
    assert torch.equal(p.data[:, 2:], P0[:, 2:]) and opt.stats()["cpu_updates"] == 0
    do_step(p, opt, col_grad(1, 1, u, u))                   # sumU 2.4 >= sumK / 2 = 2: ripe -> boundary
    assert (p.data[:, 2:] != P0[:, 2:]).all()
    assert opt.stats()["cpu_updates"] == 1 and opt.stats()["reselections"] == 0
    assert opt.state[p]["count"].tolist() == [2, 2, 1, 1]
    assert opt.state[p]["sumK"] == 0.0 and opt.state[p]["sumU"] == 0.0


def test_zen_auto_ratio_over_matrices():
    # two matrices: one ripens at step 1, the other never; auto_ratio 0.5 -> boundary at 1, 0.99 -> not
    for ratio, expect in [(0.5, 1), (0.99, 0)]:
        a, b = nn.Parameter(P0.clone()), nn.Parameter(P0.clone())
        opt = ZenFlowReference([a, b], lr=LR, topk_ratio=0.5, update_interval="auto", auto_ratio=ratio)
        for _ in range(2):
            a.grad, b.grad = col_grad(1, 1, math.sqrt(0.6), math.sqrt(0.6)), col_grad(1, 1, 1e-3, 1e-3)
            opt.step()
        assert opt.stats()["cpu_updates"] == expect


# -------------------------------------------------------------------------------------- mixed precision
@pytest.mark.parametrize("update_interval", [2, "auto"])
def test_bf16_device_copy_is_cast_master(update_interval):
    model = make_model(torch.bfloat16)
    opt = ZenFlowReference(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=update_interval)
    for i in range(6):
        train_step(model, opt, i)
        for p in model.parameters():
            m = opt.master(p)
            assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
            assert torch.equal(p.data, m.to(torch.bfloat16))
    assert any(not torch.equal(opt.master(p), p.float()) for p in model.parameters())


# ------------------------------------------------------------------------------------------ checkpoints
def test_state_dict_resume_is_exact():
    keys = dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step", select_interval=3)
    N, M = 3, 4
    a = make_model()
    oa = ZenFlowReference(a.parameters(), lr=LR, max_grad_norm=1.0, **keys)
    for i in range(N):
        train_step(a, oa, i)
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), oa.state_dict()
    assert saved_opt["zenflow"]["phases"][0]["pending"]     # a CPU update is in flight at the save
    for i in range(N, N + M):
        train_step(a, oa, i)
    assert oa.stats()["reselections"] == 1

    b = make_model()
    with torch.no_grad():
        for p in b.parameters():
            p.add_(1.0)                                     # make sure loading really overwrites
    b.load_state_dict(saved_model)
    ob = ZenFlowReference(b.parameters(), lr=LR, max_grad_norm=1.0, **keys)
    ob.load_state_dict(saved_opt)
    for i in range(N, N + M):
        train_step(b, ob, i)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(oa.master(p), ob.master(q))
        for k, v in oa.state[p].items():
            assert torch.equal(v, ob.state[q][k]) if torch.is_tensor(v) else v == ob.state[q][k]
    assert oa.stats() == ob.stats()
    oa.synchronize(), ob.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_load_keeps_fp32_state_for_bf16_params():
    model = make_model(torch.bfloat16)
    opt = ZenFlowReference(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2)
    train_step(model, opt, 0)
    opt2 = ZenFlowReference(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2)
    opt2.load_state_dict(opt.state_dict())
    for p in model.parameters():
        assert opt2.state[p]["master"].dtype == torch.float32 and opt2.state[p]["count"].dtype == torch.long
        assert torch.equal(opt2.master(p), opt.master(p))


# ------------------------------------------------------------------------------------------ construction
def test_config_or_keys_not_both():
    p = nn.Parameter(P0.clone())
    with pytest.raises(ValueError):
        ZenFlowReference([p], config=ZenFlowConfig(), topk_ratio=0.5)
    with pytest.raises(ValueError, match="topk_ratio"):
        ZenFlowReference([p], topk_ratio=0.0)
    with pytest.raises(ValueError, match="no_such_key"):
        ZenFlowReference([p], no_such_key=1)
    opt = ZenFlowReference([p], config=ZenFlowConfig(topk_ratio=0.5))
    assert opt.config.topk_ratio == 0.5


def test_grad_none_param_is_skipped():
    a, b = nn.Parameter(P0.clone()), nn.Parameter(torch.ones(3))
    opt = ZenFlowReference([a, b], lr=LR, topk_ratio=0.5, update_interval=1)
    b.grad = torch.ones(3)
    opt.step()
    assert torch.equal(a.data, P0) and opt.selected_columns(a) is None and not opt.state[a]
    assert (b.data != 1).all() and opt.selected_columns(b) is None
    a.grad = col_grad(1, 2, 3, 4)
    opt.step()
    assert opt.selected_columns(a).tolist() == [2, 3] and (a.data != P0).all()


# ------------------------------------------------------------------------------------------ landing lag
# One 3x6 matrix fed by a real loss (its gradient depends on the values the forward sees, so a late landing
# changes the result), k = 2 columns selected, lr 0.05 so that the steps matter.
LAG_P0 = torch.tensor([[0.5, -0.3, 0.8, 0.1, -0.7, 0.2], [0.4, 0.9, -0.2, -0.6, 0.3, -0.1],
                       [-0.5, 0.2, 0.6, -0.4, 0.7, 0.3]])
LAG_LR = 0.05


def lag_grad(w, t):
    """Gradient at the values ``w`` (what the forward sees) of step t's loss, a least-squares fit."""
    g = seeded_generator(300 + t)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    w = w.detach().clone().requires_grad_(True)
    ((x @ w.T - y) ** 2).mean().backward()
    return w.grad


def top2(g):
    s = (g ** 2).sum(0).tolist()
    return sorted(sorted(range(6), key=lambda j: (-s[j], j))[:2])


def hand_schedule(S, L, mode, every, iau, steps):
    """The landing lag and the reselection modes scheduled by hand with one torch.optim.AdamW per column (the
    column's state lives in its optimizer, so it moves with the column by construction). Boundaries every S
    steps, a reselection at every `every`-th; a boundary's CPU update lands L steps later. Returns, per step,
    (what the forward of the next step sees, the masters, the selection)."""
    cols = [nn.Parameter(LAG_P0[:, j].clone()) for j in range(6)]
    opts = [torch.optim.AdamW([c], lr=LAG_LR, betas=(B1, B2), eps=EPS, weight_decay=WD) for c in cols]
    visible = LAG_P0.clone()                     # the parameter the forward reads
    acc, n = torch.zeros(3, 6), [0] * 6         # per column: accumulated gradient, steps in it
    selected, land_at, history = None, None, []

    def adamw(j, g, m=1):
        opts[j].param_groups[0]["lr"] = LAG_LR * (m if iau else 1)
        cols[j].grad = g.clone()
        opts[j].step()

    def land():                                  # the unselected columns' masters reach the forward
        for j in set(range(6)) - set(selected):
            visible[:, j] = cols[j].detach()

    def switch(new):                             # joining columns: their accumulation as one update, then current
        for j in set(new) - set(selected):
            if n[j]:
                adamw(j, acc[:, j] / n[j], n[j])
                acc[:, j], n[j] = 0, 0
            visible[:, j] = cols[j].detach()
        return new

    for t in range(steps):
        g = lag_grad(visible, t)
        selected = selected or top2(g)
        for j in range(6):
            if j in selected:
                adamw(j, g[:, j])
                visible[:, j] = cols[j].detach()
            else:
                acc[:, j] += g[:, j]
                n[j] += 1
        if (t + 1) % S == 0:                     # a boundary
            land()                               # the previous update lands at the latest here
            for j in set(range(6)) - set(selected):
                if n[j]:
                    adamw(j, acc[:, j] / n[j], n[j])
                    acc[:, j], n[j] = 0, 0
            new = top2(g) if (t + 1) % (S * every) == 0 else None
            if new and mode == "wait":
                land()
                selected = switch(new)
            else:
                land_at = t + L
                if new:                          # "incoming"
                    selected = switch(new)
        elif t == land_at:
            land()
        history.append((visible.clone(), torch.stack([c.detach() for c in cols], 1), selected))
    return history


def lag_reference(S, L, mode, every, iau, steps, optimizer=ZenFlowReference, **keys):
    """The hand schedule's setting run by `optimizer` (ZenFlowReference, or ZenFlowAdamW: test_landing_lag.py);
    per step (what the forward of the next step sees, the masters, the selection)."""
    p = nn.Parameter(LAG_P0.clone())
    opt = optimizer([p], lr=LAG_LR, betas=(B1, B2), eps=EPS, weight_decay=WD, topk_ratio=0.34, update_interval=S,
                    overlap_step=True, select_strategy="step", select_interval=S * every, interval_aware_update=iau,
                    overlap_reselect=mode, landing_lag=L, **keys)
    history = []
    for t in range(steps):
        do_step(p, opt, lag_grad(p, t))
        history.append((p.detach().clone(), opt.master(p), opt.selected_columns(p).tolist()))
    return p, opt, history


@pytest.mark.parametrize("S,L", [(2, 1), (2, 2), (4, 1), (4, 3), (4, 4)])
@pytest.mark.parametrize("mode,every", [("wait", 1), ("wait", 2), ("incoming", 1), ("incoming", 2)])
@pytest.mark.parametrize("iau", [True, False])
def test_landing_lag_equals_a_hand_schedule_of_adamw_calls(S, L, mode, every, iau):
    expected = hand_schedule(S, L, mode, every, iau, steps=4 * S + 1)
    _, opt, history = lag_reference(S, L, mode, every, iau, steps=4 * S + 1)
    for t, ((device, master, selected), (device_h, master_h, selected_h)) in enumerate(zip(history, expected)):
        assert selected == selected_h, t
        torch.testing.assert_close(master, master_h, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {t}: {m}")
        torch.testing.assert_close(device, device_h, atol=ATOL, rtol=RTOL, msg=lambda m: f"step {t}: {m}")
    assert opt.stats()["reselections"] == 4 // every and opt.stats()["cpu_updates"] == 4


def test_a_shorter_landing_lag_changes_the_result():
    """The hand schedule's premise: the lag is not a no-op (the forward sees the update sooner)."""
    one, four = lag_reference(4, 1, "incoming", 1, True, 9)[2], lag_reference(4, 4, "incoming", 1, True, 9)[2]
    assert torch.equal(one[3][0], four[3][0])          # step 3, a boundary: launched, nowhere landed yet
    assert not torch.equal(one[4][0], four[4][0])      # step 4: landed with L = 1 only
    assert one[3][2] == four[3][2] and one[3][2] != one[2][2]  # the reselection: at its boundary either way


@pytest.mark.parametrize("mode", ["wait", "incoming"])
@pytest.mark.parametrize("S", [2, 4])
def test_landing_lag_equal_to_the_interval_is_the_default_bit_for_bit(mode, S):
    runs = []
    for L in (None, S):
        model = make_model()
        opt = ZenFlowReference(model.parameters(), lr=LR, max_grad_norm=1.0, topk_ratio=0.25, update_interval=S,
                               overlap_step=True, interval_aware_update=True, select_strategy="step",
                               select_interval=S, overlap_reselect=mode, landing_lag=L)
        snapshots = []
        for i in range(3 * S + 1):
            train_step(model, opt, i)
            snapshots += [p.detach().clone() for p in model.parameters()]
            snapshots += [opt.master(p) for p in model.parameters()]
        runs.append((snapshots, opt.stats()))
    assert runs[0][1] == runs[1][1] and runs[0][1]["reselections"] == 3
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))


def test_resume_is_exact_with_an_update_in_flight_before_its_landing_step():
    keys = dict(topk_ratio=0.25, update_interval=4, overlap_step=True, interval_aware_update=True,
                select_strategy="step", select_interval=4, overlap_reselect="incoming", landing_lag=2)
    N, M = 5, 7                                             # saved after step 4: step 3's update lands at step 5
    a = make_model()
    oa = ZenFlowReference(a.parameters(), lr=LR, **keys)
    for i in range(N):
        train_step(a, oa, i)
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), oa.state_dict()
    assert saved_opt["zenflow"]["phases"] == [dict(sel_start=4, sel_epoch=0, m_acc=1, pending=True, land_at=5)]
    for i in range(N, N + M):
        train_step(a, oa, i)
    b = make_model()
    b.load_state_dict(saved_model)
    ob = ZenFlowReference(b.parameters(), lr=LR, **keys)
    ob.load_state_dict(saved_opt)
    for i in range(N, N + M):
        train_step(b, ob, i)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        for k, v in oa.state[p].items():
            assert torch.equal(v, ob.state[q][k]) if torch.is_tensor(v) else v == ob.state[q][k], k
    assert oa.stats() == ob.stats() and oa.zf == ob.zf and oa.stats()["reselections"] == 3


def test_synchronize_lands_an_update_before_its_landing_step():
    p, opt, history = lag_reference(4, 3, "incoming", 1, True, 5)   # step 3's update lands at step 6
    assert opt.stats()["pending"] and not torch.equal(p.detach(), opt.master(p))
    opt.synchronize()
    assert torch.equal(p.detach(), opt.master(p)) and not opt.stats()["pending"]
    do_step(p, opt, lag_grad(p, 5))
    assert not opt.stats()["pending"] and torch.equal(p.detach(), opt.master(p))  # nothing left to land


def test_zen_auto_lands_at_the_lag_or_at_an_earlier_boundary():
    # U never ripens: boundaries at max_update_interval (steps 3, 7); with L 2 the update of 3 lands at step 5
    p, opt = single(topk_ratio=0.5, update_interval="auto", max_update_interval=4, overlap_step=True,
                    landing_lag=2)
    device = []
    for t in range(6):
        do_step(p, opt, col_grad(1, 1, 1e-3, 1e-3))
        device.append((p.data.clone(), opt.master(p)))
    assert opt.stats()["cpu_updates"] == 1
    assert torch.equal(device[4][0][:, 2:], device[2][0][:, 2:])     # step 4: in flight
    assert not torch.equal(device[5][0][:, 2:], device[4][0][:, 2:])  # step 5: landed
    assert torch.equal(device[5][0], device[5][1]) and not opt.stats()["pending"]
    # U ripe at every step: a boundary at every step, each landing the previous one before L = 2 steps
    p, opt = single(topk_ratio=0.5, update_interval="auto", overlap_step=True, landing_lag=2)
    previous = None
    for t in range(4):
        do_step(p, opt, col_grad(1, 1, 1, 1))                       # sumU = 2 m >= mean K = 2
        assert opt.stats()["cpu_updates"] == t + 1 and opt.stats()["pending"]
        if previous is not None:
            assert torch.equal(p.data[:, 2:], previous[:, 2:])      # the previous step's update, landed
        previous = opt.master(p)


def test_a_state_dict_saved_before_per_column_counts_resumes():
    """Saved mid-interval by a reference without acc_n, land_at and phases: one count per matrix, no lag, one
    phase."""
    keys = dict(topk_ratio=0.25, update_interval=4, overlap_step=True, interval_aware_update=True,
                select_strategy="step", select_interval=4)
    a = make_model()
    oa = ZenFlowReference(a.parameters(), lr=LR, **keys)
    for i in range(6):
        train_step(a, oa, i)
    sd = oa.state_dict()
    (phase,) = sd["zenflow"].pop("phases")
    del phase["land_at"]
    sd["zenflow"].update(phase)
    for entry in sd["state"].values():
        if "acc_n" in entry:
            assert entry["acc_n"].max() == entry["acc_steps"] == 2
            del entry["acc_n"]
    b = make_model()
    b.load_state_dict(a.state_dict())
    ob = ZenFlowReference(b.parameters(), lr=LR, **keys)
    ob.load_state_dict(sd)
    for i in range(6, 12):
        train_step(a, oa, i)
        train_step(b, ob, i)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q) and torch.equal(oa.master(p), ob.master(q))


def test_over_float64_parameters_the_state_is_float64_and_equals_adamw():
    """The tests' float64 recomputation: over float64 parameters the reference keeps every state, gradient and
    the global norm in float64 (fp32 masters would round where the parameters do not), and with r = 1 it is
    torch.optim.AdamW in float64."""
    a, b = make_model(torch.float64), make_model(torch.float64)
    ref = ZenFlowReference(a.parameters(), lr=1e-2, topk_ratio=1.0, update_interval=1, max_grad_norm=0.5)
    adamw = torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False)
    g = seeded_generator(0)
    for _ in range(4):
        x, y = torch.randint(0, 32, (4, 6), generator=g), torch.randn(4, 6, 16, generator=g, dtype=torch.float64)
        for model, opt in ((a, ref), (b, adamw)):
            ((model(x) - y) ** 2).mean().backward()
            if opt is adamw:
                torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=1e-14, rtol=1e-13)
    assert all(ref.master(p).dtype == torch.float64 for p in a.parameters())
    assert all(t.dtype == torch.float64 for st in ref.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.is_floating_point())


# ----------------------------------------------------------------------------------------- stagger_boundaries
class _Separate(nn.Module):
    """Matrices that never meet: each one's gradient depends only on itself (its own input and target), so a
    matrix's run does not depend on when the others are updated."""

    def __init__(self, shapes):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(cols, rows, bias=False) for rows, cols in shapes)

    def loss(self, i):
        g = seeded_generator(3000 + i)
        total = 0.0
        for layer in self.layers:
            x = torch.randn(8, layer.in_features, generator=g)
            total = total + ((layer(x) - torch.randn(8, layer.out_features, generator=g)) ** 2).mean()
        return total


STAGGER_KEYS = dict(topk_ratio=0.25, update_interval=3, overlap_step=True, landing_lag=1, select_strategy="step",
                    select_interval=100)


def _unselected_changes(shapes, steps=10, **keys):
    """Per step, which matrices' unselected columns changed on the device during it."""
    torch.manual_seed(0)
    model = _Separate(shapes)
    opt = ZenFlowReference(model.parameters(), lr=LR, **keys)
    changes = []
    for i in range(steps):
        before = [layer.weight.detach().clone() for layer in model.layers]
        model.loss(i).backward()
        opt.step()
        opt.zero_grad()
        changed = []
        for j, (layer, old) in enumerate(zip(model.layers, before)):
            unselected = torch.ones(layer.weight.shape[1], dtype=torch.bool)
            unselected[opt.selected_columns(layer.weight)] = False
            changed.append(bool((layer.weight.detach() != old)[:, unselected].any()))
        changes.append(changed)
    return changes


def test_staggered_matrices_land_their_updates_at_their_phases_steps():
    """Three matrices of one size take phases 0, 1, 2 (each to the phase holding the fewest elements); phase q's
    boundaries are those of step t + q, so its unselected columns change only at the end of b + L."""
    changes = _unselected_changes([(6, 8)] * 3, stagger_boundaries=True, **STAGGER_KEYS)
    for q in range(3):
        landings = {t for t in range(10) if changes[t][q]}
        boundaries = [t for t in range(10) if (t + q + 1) % 3 == 0]
        assert landings == {b + 1 for b in boundaries if b + 1 < 10}, (q, landings)
    unstaggered = _unselected_changes([(6, 8)] * 3, **STAGGER_KEYS)
    assert all(row == [t in (3, 6, 9)] * 3 for t, row in enumerate(unstaggered))


def test_phases_balance_the_elements_in_the_order_the_optimizer_takes_the_matrices():
    """A large matrix first takes phase 0; the next ones fill the other phases, each to the lightest."""
    # sizes 96, 16, 16, 48, 32: phases get [96], [16, 48], [16, 32] -> phase of each: 0, 1, 2, 1, 2
    changes = _unselected_changes([(12, 8), (2, 8), (2, 8), (6, 8), (4, 8)], stagger_boundaries=True,
                                  **STAGGER_KEYS)
    for j, q in enumerate([0, 1, 2, 1, 2]):
        first = min(t for t in range(10) if changes[t][j])
        assert first == 3 - q, (j, first)


@pytest.mark.parametrize("shapes,interval", [([(6, 8)], 3), ([(6, 8), (4, 8)], 1)], ids=["one-matrix", "S1"])
def test_one_phase_in_use_is_the_unstaggered_schedule_bit_for_bit(shapes, interval):
    keys = dict(STAGGER_KEYS, update_interval=interval, select_interval=2, overlap_reselect="incoming")
    runs = []
    for stagger in (False, True):
        torch.manual_seed(0)
        model = _Separate(shapes)
        opt = ZenFlowReference(model.parameters(), lr=LR, stagger_boundaries=stagger, **keys)
        for i in range(12):
            model.loss(i).backward()
            opt.step()
            opt.zero_grad()
        runs.append(([p.detach().clone() for p in model.parameters()], opt.stats()))
    assert runs[0][1] == runs[1][1] and runs[0][1]["reselections"] >= 3
    assert all(torch.equal(p, q) for p, q in zip(runs[0][0], runs[1][0]))


def test_a_matrix_of_phase_0_runs_as_unstaggered():
    """Matrices that never meet: the phase-0 matrix of a staggered run equals the same matrix unstaggered
    (phase 0's clock is the step's), reselections included."""
    keys = dict(STAGGER_KEYS, select_interval=4, overlap_reselect="incoming")
    weights = []
    for stagger in (False, True):
        torch.manual_seed(0)
        model = _Separate([(6, 8), (6, 8), (6, 8)])
        opt = ZenFlowReference(model.parameters(), lr=LR, stagger_boundaries=stagger, **keys)
        for i in range(12):
            model.loss(i).backward()
            opt.step()
            opt.zero_grad()
        weights.append([layer.weight.detach().clone() for layer in model.layers])
    assert torch.equal(weights[0][0], weights[1][0])
    assert not torch.equal(weights[0][1], weights[1][1])  # (the others do run on other steps)
