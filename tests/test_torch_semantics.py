"""torch.optim semantics where users lean on them, each against torch.optim.AdamW or ZenFlowReference.

- eager `.grad` up to step(): kept after backward, `clip_grad_norm_` returns the true norm and clips what
  the step uses, `zero_grad(set_to_none=False)` moves an unused parameter, edits and hooks of `.grad`
  between backward and step reach the update, GradScaler's unscale_ + clip recipe; compiled: the step's
  norm in `stats()["grad_norm"]`, unscale_ refused (it has no `.grad` to act on);
- gradient hooks on parameters of a compiled model apply as eagerly; one registered after compiling is a
  clear error;
- edits of `param_groups` (remove, move, pop a group, append) take effect at the next step;
- dtypes ZenFlow does not train (complex, fp64, fp8) are refused at construction, and at the step when a
  parameter is cast to one later; layouts it cannot follow (channels_last, transposed storage, a new shape)
  are refused at the step, naming the parameter and the fix;
- compiled autograd trains as eagerly (gradients through `.grad`);
- `copy.deepcopy` and pickling resume exactly; a checkpoint restores its `max_grad_norm`;
- `step()` without a backward does nothing and is not counted.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import zenflow_compile.backend  # noqa: F401  (registers backend="zenflow" without the installed entry point)
from zenflow_compile import ZenFlowAdamW
from zenflow_compile.reference import ZenFlowReference
from helpers import (loss_fn, make_batches, seeded_generator, skip_where_dynamo_misses_parameter_changes, snapshot,
                     tiny_model, train_steps)

LR, WD = 1e-2, 0.01
# update_interval=1, no overlap: ZenFlow equals torch.optim.AdamW step by step (for any topk_ratio).
ADAMW_KEYS = dict(topk_ratio=0.25, update_interval=1, overlap_step=False)
# Boundaries, overlap and reselection inside a short run: compared against ZenFlowReference.
KEYS = dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step", select_interval=2)
ATOL, RTOL = 1e-6, 1e-5

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "device")  # (every workflow on every test device)


def assert_models_close(a: nn.Module, b: nn.Module, what: str, atol=ATOL, rtol=RTOL) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=rtol, msg=lambda m: f"{what} {name}: {m}")


def zenflow_and_adamw(**zen_kwargs):
    a, b = tiny_model(), tiny_model()
    return a, ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, **ADAMW_KEYS, **zen_kwargs), \
        b, torch.optim.AdamW(b.parameters(), lr=LR, weight_decay=WD)


def zenflow_and_reference(model_a=None, model_b=None, **zen_kwargs):
    a, b = model_a or tiny_model(), model_b or tiny_model()
    return a, ZenFlowAdamW(a.parameters(), lr=LR, weight_decay=WD, **KEYS, **zen_kwargs), \
        b, ZenFlowReference(b.parameters(), lr=LR, weight_decay=WD, **KEYS, **zen_kwargs)


# ------------------------------------------------------------------------------ eager: torch's .grad contract
def test_eager_grad_is_kept_after_backward_and_step_until_zero_grad():
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, **KEYS)
    loss_fn(model, make_batches(1)[0]).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_eager_clip_grad_norm_returns_the_true_norm_and_clips_what_the_step_uses():
    a, zen, b, adamw = zenflow_and_adamw()
    for step, batch in enumerate(make_batches(6)):
        norms = []
        for model, opt in ((a, zen), (b, adamw)):
            loss_fn(model, batch).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            opt.step()
            opt.zero_grad()
        assert norms[0] == pytest.approx(norms[1], rel=1e-6) and norms[0] > 0.05  # (clipping is active)
        assert zen.stats()["grad_norm"] == pytest.approx(0.05, rel=1e-4)  # ZenFlow saw the clipped .grad
        assert_models_close(a, b, f"step {step}")


def test_eager_zero_grad_set_to_none_false_moves_an_unused_parameter_as_adamw():
    """fc2 and the norm are unused every other step; their zero-filled .grad still gets momentum and weight
    decay, as with AdamW."""
    a, zen, b, adamw = zenflow_and_adamw()
    for step, batch in enumerate(make_batches(6)):
        for model, opt in ((a, zen), (b, adamw)):
            if step % 2:
                model.fc1(model.emb(batch[0])).square().mean().backward()
            else:
                loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        assert_models_close(a, b, f"step {step}")
    assert a.fc2.weight.grad is not None and not a.fc2.weight.grad.any()


@pytest.mark.parametrize("set_to_none", [False, True])
def test_compiled_zero_grad_set_to_none_false_says_a_frozen_parameter_is_left_alone(set_to_none):
    """Compiled, no `.grad` holds zeros: fc2, frozen from step 2, is left alone (the reference with `.grad`
    set to None), where AdamW would go on stepping it; said once, only where it happens."""
    a, zen, b, ref = zenflow_and_reference()
    run_a = torch.compile(a, backend="zenflow")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, batch in enumerate(make_batches(6)):
            for model, run, opt in ((a, run_a, zen), (b, b, ref)):
                if step == 2:
                    model.fc2.requires_grad_(False)
                loss_fn(run, batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=set_to_none if opt is zen else True)
    zen.synchronize()
    assert_models_close(a, b, "compiled, fc2 frozen from step 2", atol=1e-5, rtol=1e-4)
    said = [str(w.message) for w in caught if "took no gradient this step after zero_grad" in str(w.message)]
    if set_to_none:
        assert not said
    else:
        assert len(said) == 1 and "2 parameter(s) (parameter 5 of param group 0 (shape (16, 24))" in said[0], said


def _edit_grads(model: nn.Module, step: int) -> None:
    """What user code does between backward and step: scale, drop and overwrite gradients."""
    model.fc1.weight.grad.mul_(0.5)
    model.fc2.bias.grad = None
    if step % 2:
        model.norm.weight.grad = torch.full_like(model.norm.weight, 0.1)


def _clamp_grad(param: torch.Tensor) -> None:
    param.grad.clamp_(-0.01, 0.01)


def test_eager_grad_edits_and_hooks_between_backward_and_step_reach_the_update():
    a, zen, b, ref = zenflow_and_reference()
    rows = torch.ones(32, 1)
    rows[:8] = 0.0
    for model in (a, b):
        model.emb.weight.register_hook(lambda g: g * rows)
        model.fc2.weight.register_post_accumulate_grad_hook(_clamp_grad)
    for step, batch in enumerate(make_batches(8)):
        for model, opt in ((a, zen), (b, ref)):
            loss_fn(model, batch).backward()
            _edit_grads(model, step)
            opt.step()
            opt.zero_grad()
        assert_models_close(a, b, f"step {step}")


def test_eager_grad_scaler_unscale_then_clip_equals_adamw():
    a, zen, b, adamw = zenflow_and_adamw()
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)]
    for step, batch in enumerate(make_batches(5)):
        norms = []
        for model, opt, scaler in ((a, zen, scalers[0]), (b, adamw, scalers[1])):
            scaler.scale(loss_fn(model, batch)).backward()
            scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert norms[0] == pytest.approx(norms[1], rel=1e-6)
        assert_models_close(a, b, f"step {step}")


# --------------------------------------------------------------------- compiled: the step's norm, no .grad
def test_compiled_step_norm_is_in_stats_and_clipping_equals_clip_grad_norm_then_adamw():
    a, zen, b, adamw = zenflow_and_adamw(max_grad_norm=0.05)
    compiled = torch.compile(a, backend="zenflow")
    assert zen.stats()["grad_norm"] is None
    for step, batch in enumerate(make_batches(5)):
        loss_fn(compiled, batch).backward()
        assert all(p.grad is None for p in a.parameters())
        zen.step()
        zen.zero_grad()
        loss_fn(b, batch).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05))
        adamw.step()
        adamw.zero_grad()
        assert zen.stats()["grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert_models_close(a, b, f"step {step}", atol=1e-5, rtol=1e-4)


def test_compiled_grad_scaler_unscale_is_refused_naming_max_grad_norm():
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, **KEYS)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_fn(torch.compile(model, backend="zenflow"), make_batches(1)[0])).backward()
    scaler.unscale_(opt)
    with pytest.raises(ValueError, match=r"unscale_\(opt\) found no \.grad.*max_grad_norm"):
        scaler.step(opt)


# ------------------------------------------------------------------- compiled: hooks on parameters apply
@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_compiled_parameter_gradient_hooks_apply_as_eagerly(hook):
    """Rows 0-7 of the embedding are frozen by a hook (only the other tokens train); the compiled model
    equals the eager reference with the same hook, and, without weight decay, the frozen rows never move."""
    a, zen, b, ref = zenflow_and_reference()
    for group in (*zen.param_groups, *ref.param_groups):
        group["weight_decay"] = 0.0
    rows = torch.ones(32, 1)
    rows[:8] = 0.0
    for model in (a, b):
        if hook == "register_hook":
            model.emb.weight.register_hook(lambda g: g * rows)
        else:
            def mask_rows(param):
                param.grad.mul_(rows)

            model.emb.weight.register_post_accumulate_grad_hook(mask_rows)
    frozen = a.emb.weight[:8].detach().clone()
    compiled = torch.compile(a, backend="zenflow")
    for step, batch in enumerate(make_batches(6)):
        loss_fn(compiled, batch).backward()
        assert a.emb.weight.grad is not None and a.fc1.weight.grad is None  # the hooked one goes through .grad
        zen.step()
        zen.zero_grad()
        loss_fn(b, batch).backward()
        ref.step()
        ref.zero_grad()
        assert_models_close(a, b, f"step {step}", atol=1e-5, rtol=1e-4)
    zen.synchronize()
    assert torch.equal(a.emb.weight[:8], frozen)


def after_one_step(compiled: bool):
    """(model, its ZenFlowAdamW, what runs it: the model, or it compiled with backend="zenflow", the batch)
    after one step."""
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, **KEYS)
    run = torch.compile(model, backend="zenflow") if compiled else model
    batch = make_batches(1)[0]
    loss_fn(run, batch).backward()
    opt.step()
    opt.zero_grad()
    return model, opt, run, batch


def test_compiled_hook_registered_after_compiling_is_refused_naming_the_fix():
    model, opt, compiled, batch = after_one_step(compiled=True)
    model.fc1.weight.register_hook(lambda g: g * 0)
    with pytest.raises(RuntimeError, match=r"fc1\.weight.*register_hook.*torch\._dynamo\.reset\(\)"):
        compiled(batch[0])
    torch._dynamo.reset()  # the fix: the recompiled graph passes fc1.weight's gradient through its hook
    loss_fn(compiled, batch).backward()
    assert model.fc1.weight.grad is not None and not model.fc1.weight.grad.any()
    assert model.fc2.weight.grad is None  # (still handed over in the graph)
    opt.step()


# ------------------------------------------------------------------------------ param_groups edits
def _remove(opt, param) -> None:
    for group in opt.param_groups:
        group["params"] = [p for p in group["params"] if p is not param]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_parameter_removed_from_param_groups_is_no_longer_updated(compiled):
    if compiled:
        skip_where_dynamo_misses_parameter_changes()
    a, zen, b, adamw = zenflow_and_adamw()
    run_a = torch.compile(a, backend="zenflow") if compiled else a
    for step, batch in enumerate(make_batches(6)):
        if step == 2:
            _remove(zen, a.fc1.weight)
            _remove(adamw, b.fc1.weight)
            if compiled:  # a trainable parameter no ZenFlowAdamW owns is an error under backend="zenflow"
                a.fc1.weight.requires_grad_(False)
                b.fc1.weight.requires_grad_(False)
            kept = a.fc1.weight.detach().clone()
        for model, opt in ((run_a, zen), (b, adamw)):
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
        assert_models_close(a, b, f"step {step}", atol=1e-5, rtol=1e-4)
    assert torch.equal(a.fc1.weight, kept)


def test_a_parameter_removed_mid_interval_equals_the_reference():
    """Removed with an overlapped CPU update in flight and gradient accumulated for the next one: neither
    reaches it, as with the reference (which, like torch.optim, only looks at the param groups)."""
    a, zen, b, ref = zenflow_and_reference()
    for step, batch in enumerate(make_batches(8)):
        if step == 3:
            _remove(zen, a.fc2.weight)
            _remove(ref, b.fc2.weight)
        for model, opt in ((a, zen), (b, ref)):
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
        assert_models_close(a, b, f"step {step}")
    zen.synchronize()
    ref.synchronize()
    assert_models_close(a, b, "synchronized")


@pytest.mark.parametrize("accumulate_on", ["host", "device"])
@pytest.mark.parametrize("move_at", [2, 5])
def test_a_parameter_moved_to_another_group_mid_interval_keeps_its_accumulated_gradient(accumulate_on, move_at):
    """A parameter moved to another param group mid-interval is laid out again with the gradient its columns
    accumulated so far, whichever interval it is (the host sums in two buffers, one per interval's parity):
    the boundary after the move updates them from every step's gradient, as the reference does."""
    a, b = tiny_model(), tiny_model()

    def groups(m):
        return [{"params": [m.emb.weight, m.fc1.weight, m.fc1.bias, m.norm.weight, m.norm.bias]},
                {"params": [m.fc2.weight, m.fc2.bias], "lr": 3e-3}]

    keys = dict(KEYS, update_interval=4, overlap_step=False, select_interval=100, full_warm_up_rounds=0)
    zen = ZenFlowAdamW(groups(a), lr=LR, weight_decay=WD, accumulate_on=accumulate_on, **keys)
    ref = ZenFlowReference(groups(b), lr=LR, weight_decay=WD, **keys)
    for step, batch in enumerate(make_batches(8)):
        for model, opt in ((a, zen), (b, ref)):
            if step == move_at:  # mid-interval, steps already summed: in the first interval or the second
                _remove(opt, model.fc1.weight)
                opt.param_groups[1]["params"].append(model.fc1.weight)
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
        assert_models_close(a, b, f"step {step}")


class _LikeLayers(nn.Module):
    """Three like [16, 16] matrices: small enough to share one slab, so a removal leaves the others in it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("edit_at", [0, 3], ids=["pending-first-selection", "laid-out"])
def test_compiled_parameter_removed_between_backward_and_step_equals_the_reference(edit_at):
    """The compiled backward hands the gradients over before the edit: removed from the param groups (and
    frozen) between the backward and `step()`, a matrix is not updated by that step or any later one, and the
    like matrices sharing its slab go on as the reference's. At step 0 the matrices wait for their first
    selection with only their gradients (pending); at step 3 they are laid out."""
    skip_where_dynamo_misses_parameter_changes()
    a, zen, b, ref = zenflow_and_reference(_LikeLayers(), _LikeLayers())
    run_a = torch.compile(a, backend="zenflow")
    g = seeded_generator(7)
    for step in range(6):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        for model in (run_a, b):
            ((model(x) - y) ** 2).mean().backward()
        if step == edit_at:
            for opt, model in ((zen, a), (ref, b)):
                _remove(opt, model.layers[1].weight)
                model.layers[1].weight.requires_grad_(False)
            kept = a.layers[1].weight.detach().clone()
        for opt in (zen, ref):
            opt.step()
            opt.zero_grad()
        assert_models_close(a, b, f"step {step}")
    zen.synchronize()
    ref.synchronize()
    assert_models_close(a, b, "synchronized")
    assert torch.equal(a.layers[1].weight, kept)


def test_compiled_removed_parameter_that_still_requires_grad_is_a_clear_error():
    model, opt, compiled, batch = after_one_step(compiled=True)
    _remove(opt, model.fc1.weight)
    opt.step()  # (the edit is taken in at a step)
    with pytest.raises(ValueError, match=r"fc1\.weight.*removed from the optimizer's param_groups.*requires_grad_"):
        compiled(batch[0])


def test_param_group_edits_move_pop_and_append_follow_adamw():
    a, b = tiny_model(), tiny_model()

    def groups(m):
        return [{"params": [m.emb.weight, m.fc1.weight, m.fc1.bias]},
                {"params": [m.norm.weight, m.norm.bias], "lr": 3e-2},
                {"params": [m.fc2.weight], "lr": 5e-3, "weight_decay": 0.1}]

    zen = ZenFlowAdamW(groups(a), lr=LR, weight_decay=WD, **ADAMW_KEYS)
    adamw = torch.optim.AdamW(groups(b), lr=LR, weight_decay=WD)
    for step, batch in enumerate(make_batches(8)):
        for model, opt in ((a, zen), (b, adamw)):
            if step == 2:  # move fc1.weight to the group of lr 3e-2
                _remove(opt, model.fc1.weight)
                opt.param_groups[1]["params"].append(model.fc1.weight)
            if step == 4:  # drop the first group: the later ones change index
                opt.param_groups.pop(0)
            if step == 6:  # fc2.bias was never in the optimizer: now it trains
                opt.param_groups[-1]["params"].append(model.fc2.bias)
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
        assert_models_close(a, b, f"step {step}")


def test_putting_a_removed_parameter_back_is_refused():
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, **KEYS)
    loss_fn(model, make_batches(1)[0]).backward()
    opt.step()
    _remove(opt, model.fc1.weight)
    opt.step()
    opt.param_groups[0]["params"].append(model.fc1.weight)
    with pytest.raises(ValueError, match=r"put back.*dropped its optimizer state.*requires_grad_\(False\)"):
        opt.step()


# -------------------------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype, fix", [(torch.complex64, "view_as_real"), (torch.float64, r"model\.float\(\)"),
                                        (torch.float8_e4m3fn, "cast it")])
@pytest.mark.parametrize("beside_real", [False, True], ids=["alone", "beside-fp32"])
def test_a_dtype_zenflow_does_not_train_is_refused_at_construction(dtype, fix, beside_real):
    odd = nn.Parameter(torch.zeros(4, 3).to(dtype), requires_grad=dtype != torch.float8_e4m3fn)
    params = [nn.Parameter(torch.zeros(4, 3)), odd] if beside_real else [odd]
    with pytest.raises(ValueError, match=rf"parameter {int(beside_real)} of param group 0.*{dtype}.*Fix: .*{fix}"):
        ZenFlowAdamW(params, lr=LR)


def test_integer_parameters_are_still_skipped_as_torch_optim_does():
    counts = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    ZenFlowAdamW([nn.Parameter(torch.zeros(4, 3)), counts], lr=LR)


def test_a_parameter_cast_to_fp64_after_construction_is_refused_at_the_step():
    model, opt, _, batch = after_one_step(compiled=False)
    model.double()
    loss_fn(model, batch).backward()
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 \(shape \(32, 16\)\) was cast to torch\.float64"):
        opt.step()


# ------------------------------------------------------------------------------------ compiled autograd
@pytest.mark.parametrize("backend", ["zenflow", "inductor"])
def test_compiled_autograd_trains_as_the_reference(backend):
    """A training step compiled whole with compiled autograd: the backward is traced by compiled autograd
    (the hand-off is not in its graph), so gradients reach .grad and step() takes them there, as eagerly."""
    a, zen, b, ref = zenflow_and_reference()
    batches = make_batches(6)
    with torch._dynamo.config.patch(compiled_autograd=True):  # (read when torch.compile wraps the function)

        @torch.compile(backend=backend)
        def backward_of(model, batch):
            loss = loss_fn(model, batch)
            loss.backward()
            return loss

        for batch in batches:
            backward_of(a, batch)
            assert a.fc1.weight.grad is not None
            zen.step()
            zen.zero_grad()
    for batch in batches:
        loss_fn(b, batch).backward()
        ref.step()
        ref.zero_grad()
    zen.synchronize()
    ref.synchronize()
    assert_models_close(a, b, "after 6 steps", atol=1e-5, rtol=1e-4)
    assert zen.stats()["steps"] == ref.stats()["steps"] == 6
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] > 0


# ------------------------------------------------------------------------------------------- layouts
class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def conv_model(seed=0):
    torch.manual_seed(seed)
    return Conv()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_channels_last_after_the_first_step_is_refused_then_contiguous_resumes(compiled):
    if compiled:
        skip_where_dynamo_misses_parameter_changes()
    a, zen, b, ref = zenflow_and_reference(conv_model(), conv_model())
    run_a = torch.compile(a, backend="zenflow") if compiled else a
    images = [torch.randn(2, 3, 6, 6, generator=seeded_generator(i)) for i in range(5)]
    message = r"parameter 0 of param group 0 \(shape \(4, 3, 3, 3\)\).*strides \(27, 1, 9, 3\).*contiguous_format"
    for step, x in enumerate(images):
        if step == 2:
            a.to(memory_format=torch.channels_last)
            # (compiled: the recompile for the new strides refuses it; Dynamo wraps the backend's ValueError)
            with pytest.raises((ValueError, torch._dynamo.exc.BackendCompilerFailed), match=message):
                run_a(x).square().mean().backward()
                zen.step()
            zen.zero_grad()
            a.to(memory_format=torch.contiguous_format)
        run_a(x).square().mean().backward()
        zen.step()
        zen.zero_grad()
        b(x).square().mean().backward()
        ref.step()
        ref.zero_grad()
        assert_models_close(a, b, f"step {step}", atol=1e-5, rtol=1e-4)


def test_transposed_storage_and_a_new_shape_are_refused_at_the_step():
    model, opt, _, batch = after_one_step(compiled=False)
    model.fc1.weight.data = model.fc1.weight.data.t().contiguous().t()
    loss_fn(model, batch).backward()
    with pytest.raises(ValueError, match=r"parameter 1 of param group 0 \(shape \(24, 16\)\) is no longer contiguous "
                                         r"\(strides \(1, 24\)"):
        opt.step()
    opt.zero_grad()
    model.fc1.weight.data = torch.zeros(24, 17)
    model.fc1.in_features = 17
    with pytest.raises(ValueError, match=r"was \(24, 16\) when the optimizer took it.*new optimizer"):
        model.fc1(torch.zeros(2, 17)).sum().backward()
        opt.step()


# -------------------------------------------------------------------------------------- copies, pickles
def _train(model, opt, batches, call=None):
    for batch in batches:
        loss_fn(call or model, batch).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_or_unpickled_optimizer_resumes_exactly(how, resumed):
    """Copied after 3 steps (an overlapped CPU update in flight), both go on for 5 more steps alike. `resumed`:
    the optimizer had loaded a checkpoint first (torch.optim's load_state_dict adds its own keys to
    `defaults`, which are not the constructor's)."""
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, max_grad_norm=0.5, **KEYS)
    batches = make_batches(8)
    _train(model, opt, batches[:3])
    if resumed:
        opt.load_state_dict(opt.state_dict())
    if how == "deepcopy":
        copied = copy.deepcopy({"model": model, "opt": opt})
    else:
        buffer = io.BytesIO()
        torch.save({"model": model, "opt": opt}, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    twin, twin_opt = copied["model"], copied["opt"]
    assert {id(p) for p in twin.parameters()} == {id(p) for g in twin_opt.param_groups for p in g["params"]}
    assert twin_opt.max_grad_norm == 0.5 and twin_opt.config == opt.config
    _train(model, opt, batches[3:])
    _train(twin, twin_opt, batches[3:])
    opt.synchronize()
    twin_opt.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert twin_opt.stats()["steps"] == opt.stats()["steps"] == 8


def test_a_shallow_copy_is_refused_naming_deepcopy():
    opt = ZenFlowAdamW(tiny_model().parameters(), lr=LR, **KEYS)
    with pytest.raises(TypeError, match=r"copy\.copy.*shared?.*Fix: copy\.deepcopy"):
        copy.copy(opt)


def test_copying_between_a_compiled_backward_and_step_is_refused():
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, **KEYS)
    loss_fn(torch.compile(model, backend="zenflow"), make_batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"between a backward and step\(\).*state_dict\(\)"):
        copy.deepcopy(opt)


# ------------------------------------------------------------------------------------------ checkpoints
def test_a_checkpoint_restores_its_max_grad_norm():
    """Saved with clipping at 0.05, loaded into an optimizer built without: clipping resumes at 0.05 (as
    torch.optim restores lr and weight_decay), so the run equals the uninterrupted one."""
    batches = make_batches(8)
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=LR, max_grad_norm=0.05, **KEYS)
    _train(model, opt, batches[:4])
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, batches[4:])
    resumed = tiny_model()
    resumed.load_state_dict(saved_model)
    resumed_opt = ZenFlowAdamW(resumed.parameters(), lr=LR, **KEYS)
    resumed_opt.load_state_dict(saved)
    assert resumed_opt.max_grad_norm == 0.05
    _train(resumed, resumed_opt, batches[4:])
    opt.synchronize()
    resumed_opt.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))


# ------------------------------------------------------------------------------------ step() with no grads
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_step_without_a_backward_does_nothing_and_is_not_counted(compiled):
    a, zen, b, ref = zenflow_and_reference()
    run_a = torch.compile(a, backend="zenflow") if compiled else a
    for step, batch in enumerate(make_batches(6)):
        loss_fn(run_a, batch).backward()
        zen.step()
        zen.zero_grad()
        before = snapshot(a)
        zen.step()  # no backward since the last step: as AdamW, nothing happens
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), before))
        loss_fn(b, batch).backward()
        ref.step()
        ref.zero_grad()
        assert_models_close(a, b, f"step {step}", atol=1e-5, rtol=1e-4)
    assert zen.stats()["steps"] == 6


# ------------------------------------------------------------------------------ named parameters (torch >= 2.6)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_named_parameters_train_as_plain_ones_and_keep_their_names(compiled):
    named, plain = tiny_model(), tiny_model()
    names = [name for name, _ in named.named_parameters()]
    second = [p for name, p in named.named_parameters() if name.startswith("fc2")]
    zen = ZenFlowAdamW([{"params": [(n, p) for n, p in named.named_parameters() if not n.startswith("fc2")]}],
                       lr=LR, weight_decay=WD, **KEYS)
    zen.add_param_group({"params": [(n, p) for n, p in named.named_parameters() if n.startswith("fc2")],
                         "lr": LR / 2})
    ref = ZenFlowReference([{"params": [p for n, p in plain.named_parameters() if not n.startswith("fc2")]},
                            {"params": [p for n, p in plain.named_parameters() if n.startswith("fc2")],
                             "lr": LR / 2}], lr=LR, weight_decay=WD, **KEYS)
    assert second and [n for g in zen.param_groups for n in g["param_names"]] == \
        [n for n in names if not n.startswith("fc2")] + [n for n in names if n.startswith("fc2")]
    run = torch.compile(named, backend="zenflow") if compiled else named
    batches = make_batches(6)
    train_steps(run, zen, batches[:4])
    train_steps(plain, ref, batches[:4])
    saved = zen.state_dict()
    assert [g["param_names"] for g in saved["param_groups"]] == [g["param_names"] for g in zen.param_groups]
    resumed_model = copy.deepcopy(named)
    resumed = ZenFlowAdamW([{"params": [(n, p) for n, p in resumed_model.named_parameters()
                                        if not n.startswith("fc2")]}], lr=LR, weight_decay=WD, **KEYS)
    resumed.add_param_group({"params": [(n, p) for n, p in resumed_model.named_parameters() if n.startswith("fc2")],
                             "lr": LR / 2})
    resumed.load_state_dict(saved)
    train_steps(resumed_model, resumed, batches[4:])
    train_steps(plain, ref, batches[4:])
    resumed.synchronize()
    assert_models_close(resumed_model, plain, "named, resumed", atol=1e-5, rtol=1e-4)


def test_named_and_plain_param_groups_mixed_are_torchs_error_and_change_nothing():
    model = tiny_model()
    params = list(model.named_parameters())
    zen = ZenFlowAdamW([p for _, p in params[:2]], lr=LR, **KEYS)
    with pytest.raises(ValueError, match="with/without names"):
        zen.add_param_group({"params": params[2:]})
    zen.add_param_group({"params": [p for _, p in params[2:]]})  # (nothing of the refused group was taken)
    assert len(zen.param_groups) == 2
