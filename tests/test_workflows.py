"""Everyday workflows of torch.optim users, compiled and eager, each against torch.optim.AdamW or the reference.

The invariants of docs/semantics.md hold for one model trained from construction on; these are the things users do around
that: weights loaded after the optimizer is built, models re-created in a loop, several models at once, a new
optimizer over a compiled model, LoRA with a frozen base (and an adapter merged into it), unfreezing a layer,
GradScaler with fp16, a Hugging Face model from `from_pretrained`.

Compiled runs compare against an oracle compiled with the stock Inductor backend (same gradients, so what is
compared is the optimizer); eager runs against an eager oracle.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref

import pytest
import torch
from torch import nn

import zenflow_compile
from zenflow_compile import ZenFlowAdamW
from zenflow_compile.reference import ZenFlowReference

from helpers import (assert_fp32_decides_the_comparison, float64_twin_loss, loss_fn, make_batches, seeded_generator,
                     skip_where_dynamo_misses_parameter_changes, tiny_model, value_tolerance)

LR = 1e-2
ATOL, RTOL = 1e-6, 1e-5
ADAMW_KEYS = dict(topk_ratio=1.0, update_interval=1)  # must equal torch.optim.AdamW (invariants 1, 2)
ZENFLOW_KEYS = dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step",
                    select_interval=5)


@pytest.fixture(params=["eager", "compiled"])
def mode(request):
    return request.param


def prepare(model, mode, backend="zenflow"):
    return torch.compile(model, backend=backend) if mode == "compiled" else model


def step(model, opt, batch, scaler=None, loss_of=loss_fn):
    loss = loss_of(model, batch)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()


def assert_models_close(a, b, what, atol=ATOL, rtol=RTOL):
    tolerance = value_tolerance(atol, rtol)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, **tolerance, msg=lambda m: f"{what} {name}: {m}")


class Pair:
    """A ZenFlow side and an oracle side trained in lockstep on the same batches."""

    def __init__(self, mode, make_model, make_opt, make_oracle):
        self.a, self.b = make_model(), make_model()
        self.opt, self.oracle = make_opt(self.a.parameters()), make_oracle(self.b.parameters())
        self.run_a = prepare(self.a, mode)
        self.run_b = prepare(self.b, mode, backend="inductor")

    def train(self, batches, what, scalers=(None, None)):
        for i, batch in enumerate(batches):
            step(self.run_a, self.opt, batch, scalers[0])
            step(self.run_b, self.oracle, batch, scalers[1])
            assert_models_close(self.a, self.b, f"{what} step {i}")


# ------------------------------------------------------------------------------------------ values
def test_weights_loaded_after_the_optimizer_are_what_training_starts_from(mode, device):
    pretrained = tiny_model(seed=7).state_dict()
    pair = Pair(mode, tiny_model, lambda ps: ZenFlowAdamW(ps, lr=1e-4, **ZENFLOW_KEYS),
                lambda ps: ZenFlowReference(ps, lr=1e-4, **ZENFLOW_KEYS))
    pair.a.load_state_dict(pretrained)
    pair.b.load_state_dict(pretrained)
    batches = make_batches(7)
    pair.train(batches[:1], "after load")
    for name, p in pair.a.named_parameters():  # one step at lr=1e-4 moves a weight by about 1e-4
        assert (p - pretrained[name]).abs().max() < 2e-4, name
    pair.train(batches[1:4], "after load")
    # An in-place edit mid-run (an update of the other columns is in flight: overlap, interval 2).
    assert pair.opt.stats()["update_pending"]
    for model in (pair.a, pair.b):
        with torch.no_grad():
            model.fc1.weight[:, :4].mul_(0.5)
            model.norm.weight.fill_(1.5)
    pair.train(batches[4:], "after an in-place edit")
    pair.opt.synchronize()
    pair.oracle.synchronize()
    assert_models_close(pair.a, pair.b, "synchronized")


def test_bf16_weights_loaded_after_the_optimizer_keep_untouched_masters(device):
    pretrained = tiny_model(torch.bfloat16, seed=7).state_dict()
    a, b = tiny_model(torch.bfloat16), tiny_model(torch.bfloat16)
    opt, ref = ZenFlowAdamW(a.parameters(), lr=1e-3, **ZENFLOW_KEYS), ZenFlowReference(b.parameters(), lr=1e-3,
                                                                                      **ZENFLOW_KEYS)
    for model in (a, b):
        model.load_state_dict(pretrained)
    batches = make_batches(5, torch.bfloat16)
    for i, batch in enumerate(batches):
        step(a, opt, batch)
        step(b, ref, batch)
        if i == 2:  # the same values written again: the fp32 masters must survive it
            for model in (a, b):
                model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(opt.master(p), ref.master(q), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------- many models, many optimizers
def test_models_recreated_in_a_loop_each_train_like_adamw(mode, device):
    batches = make_batches(3)
    for round_ in range(3):  # no torch._dynamo.reset(): the compiled graph is shared by every round
        pair = Pair(mode, lambda: tiny_model(seed=round_), lambda ps: ZenFlowAdamW(ps, lr=LR, **ADAMW_KEYS),
                    lambda ps: torch.optim.AdamW(ps, lr=LR))
        pair.train(batches, f"round {round_}")
        del pair
        gc.collect()


def test_a_deleted_model_and_optimizer_free_their_parameters(mode, device):
    pair = Pair(mode, tiny_model, lambda ps: ZenFlowAdamW(ps, lr=LR, **ADAMW_KEYS),
                lambda ps: torch.optim.AdamW(ps, lr=LR))
    pair.train(make_batches(2), "before del")
    params = [weakref.ref(p) for p in pair.a.parameters()]
    del pair
    gc.collect()
    assert [ref() for ref in params] == [None] * len(params)


def test_optimizers_dropped_on_several_threads_at_once_free_their_parameters(monkeypatch):
    """An optimizer's finalizer runs on whichever thread drops it (or runs the garbage collector): several
    threads dropping optimizers at once must each free their parameters, with no error."""
    unraisable = []  # (an error in a finalizer is reported here, not raised)
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes, as on a busy machine
    freed, stop = [], threading.Event()

    def create_and_drop():
        while not stop.is_set():
            params = [nn.Parameter(torch.zeros(2, 2)) for _ in range(20)]
            ZenFlowAdamW(params, lr=LR)  # dropped at once: its finalizer runs here
            freed.extend(weakref.ref(p) for p in params)

    threads = [threading.Thread(target=create_and_drop) for _ in range(3)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(1.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(interval)
    gc.collect()
    assert [u.exc_value for u in unraisable] == []
    assert freed and [ref for ref in freed if ref() is not None] == []


def test_two_models_alive_at_once_each_get_their_own_gradients(mode, device):
    batches = make_batches(4)
    first = Pair(mode, lambda: tiny_model(seed=1), lambda ps: ZenFlowAdamW(ps, lr=LR, **ADAMW_KEYS),
                 lambda ps: torch.optim.AdamW(ps, lr=LR))
    second = Pair(mode, lambda: tiny_model(seed=2), lambda ps: ZenFlowAdamW(ps, lr=2 * LR, **ADAMW_KEYS),
                  lambda ps: torch.optim.AdamW(ps, lr=2 * LR))
    for i, batch in enumerate(batches):  # trained in turn, one shared compiled graph
        first.train([batch], f"first, step {i}")
        second.train([batches[-1 - i]], f"second, step {i}")
    # The first optimizer and model go away; the second goes on.
    del first
    gc.collect()
    second.train(batches[:2], "second alone")


def test_a_new_optimizer_over_an_already_compiled_model(mode, device):
    batches = make_batches(4)
    pair = Pair(mode, tiny_model, lambda ps: ZenFlowAdamW(ps, lr=LR, **ADAMW_KEYS),
                lambda ps: torch.optim.AdamW(ps, lr=LR))
    pair.train(batches[:2], "first optimizer")
    del pair.opt
    gc.collect()
    pair.opt = ZenFlowAdamW(pair.a.parameters(), lr=LR / 2, **ADAMW_KEYS)  # fresh state, other lr
    pair.oracle = torch.optim.AdamW(pair.b.parameters(), lr=LR / 2)
    pair.train(batches[2:], "second optimizer")


# ------------------------------------------------------------------------- frozen and unfrozen weights
class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.t() @ self.lora_b.t()

    @torch.no_grad()
    def merge(self):
        self.base.weight += self.lora_b @ self.lora_a


def lora_model(seed=0):
    model = tiny_model(seed=seed)
    model.fc1 = LoRALinear(model.fc1)
    return model


# A value the optimizer must never write into the frozen base, in tanh's working range: filled with 7.0, fc1's
# outputs (~7 x a sum of 16 embeddings) saturate tanh, the gradients below it are rounding noise, and AdamW, which
# divides a gradient by its own size, turns noise into lr-sized steps. There fp32 decides nothing finer than
# ~1e-2 (the fp32 reference ends 1.2e-2 from its float64 recomputation), so two correct fp32 optimizers differ by
# whatever their last-bit differences grew into: 1.5e-8 on one machine, 3.2e-6 on another.
LORA_BASE_VALUE = 0.0625


def test_lora_frozen_base_is_never_written_and_costs_nothing(mode, device):
    pair = Pair(mode, lora_model, lambda ps: ZenFlowAdamW(ps, lr=LR, **ZENFLOW_KEYS),
                lambda ps: ZenFlowReference(ps, lr=LR, **ZENFLOW_KEYS))
    exact = lora_model().double()
    exact_opt = ZenFlowReference(exact.parameters(), lr=LR, **ZENFLOW_KEYS)
    for model in (pair.a, pair.b, exact):
        with torch.no_grad():
            model.fc1.base.weight.fill_(LORA_BASE_VALUE)  # after the optimizer was built
    batches = make_batches(8)

    def train(part, what):
        pair.train(part, what)
        for batch in part:
            step(exact, exact_opt, batch, loss_of=float64_twin_loss)
        assert_fp32_decides_the_comparison(pair.b, exact, what, ATOL, RTOL)

    train(batches[:4], "lora")  # boundaries at t = 1, 3: the frozen base stays as filled
    assert torch.all(pair.a.fc1.base.weight == LORA_BASE_VALUE)
    base_index = [name for name, _ in pair.a.named_parameters()].index("fc1.base.weight")
    assert base_index not in pair.opt.state_dict()["state"]  # no host state, no transfers for it
    for opt in (pair.opt, pair.oracle, exact_opt):
        opt.synchronize()
    for model in (pair.a, pair.b, exact):
        model.fc1.merge()
    merged = pair.a.fc1.base.weight.detach().clone()
    train(batches[4:], "after merge")
    torch.testing.assert_close(pair.a.fc1.base.weight, merged, atol=0, rtol=0)


def test_a_layer_unfrozen_mid_run_trains_from_then_on(mode, device):
    def frozen_fc1():  # frozen before the optimizer is built, as when fine-tuning the top layers first
        model = tiny_model()
        model.fc1.requires_grad_(False)
        return model

    if mode == "compiled":
        skip_where_dynamo_misses_parameter_changes()
    pair = Pair(mode, frozen_fc1, lambda ps: ZenFlowAdamW(ps, lr=LR, **ZENFLOW_KEYS),
                lambda ps: ZenFlowReference(ps, lr=LR, **ZENFLOW_KEYS))
    batches = make_batches(7)
    frozen = pair.a.fc1.weight.detach().clone()
    pair.train(batches[:3], "frozen")
    assert torch.equal(pair.a.fc1.weight, frozen)
    for model in (pair.a, pair.b):
        model.fc1.requires_grad_(True)
    pair.train(batches[3:], "unfrozen")
    assert not torch.equal(pair.a.fc1.weight, frozen)


# ------------------------------------------------------------------------------------- GradScaler
def test_grad_scaler_with_autocast_fp16_equals_adamw_with_grad_scaler(mode, device):
    """The standard AMP recipe, unchanged: fp32 parameters, fp16 autocast, GradScaler. The first scale is
    large enough that fp16 gradients overflow: those steps are skipped and the scale backs off, as for AdamW."""
    pair = Pair(mode, tiny_model, lambda ps: ZenFlowAdamW(ps, lr=LR, **ADAMW_KEYS),
                lambda ps: torch.optim.AdamW(ps, lr=LR))
    scalers = [torch.amp.GradScaler(device.type, init_scale=2.0 ** 24, backoff_factor=0.125, growth_interval=2)
               for _ in range(2)]
    for i, batch in enumerate(make_batches(8)):
        for model, opt, scaler in ((pair.run_a, pair.opt, scalers[0]), (pair.run_b, pair.oracle, scalers[1])):
            with torch.autocast(device.type, dtype=torch.float16):
                loss = loss_fn(model, batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scalers[0].get_scale() == scalers[1].get_scale(), f"step {i}"
        assert_models_close(pair.a, pair.b, f"step {i}")
    assert 0 < pair.opt.stats()["skipped_steps"] < 8


def test_grad_scaler_fp16_parameters_equal_the_unscaled_reference(device):
    """fp16 parameters (fp32 masters): the loss scale (a power of two) is divided out exactly; overflowing
    steps are skipped. The reference trains on the unscaled loss and takes the steps ZenFlow took."""
    keys = dict(topk_ratio=0.25, update_interval=2)
    a, b = tiny_model(torch.float16), tiny_model(torch.float16)
    opt, ref = ZenFlowAdamW(a.parameters(), lr=LR, **keys), ZenFlowReference(b.parameters(), lr=LR, **keys)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 24, backoff_factor=0.125, growth_interval=3)
    skipped = 0
    for batch in make_batches(10, torch.float16):
        step(a, opt, batch, scaler)
        if opt.stats()["skipped_steps"] > skipped:
            skipped = opt.stats()["skipped_steps"]
            continue
        step(b, ref, batch)
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=2e-3, rtol=2e-3)
    assert 0 < skipped < 10 and scaler.get_scale() < 2.0 ** 24
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(opt.master(p), ref.master(q), atol=1e-4, rtol=1e-3)


# ------------------------------------------------------------------------------------- Hugging Face
def test_hugging_face_model_from_pretrained(tmp_path, mode, device):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32)

    a, b = load(), load()
    opt = ZenFlowAdamW(a.parameters(), lr=LR, **ADAMW_KEYS)
    oracle = torch.optim.AdamW(b.parameters(), lr=LR)
    # Then other pretrained weights are loaded into the models the optimizers already hold.
    torch.manual_seed(1)
    other = transformers.LlamaForCausalLM(config)
    other.save_pretrained(tmp_path)
    a.load_state_dict(load().state_dict())
    b.load_state_dict(load().state_dict())
    run_a, run_b = prepare(a, mode), prepare(b, mode, backend="inductor")
    for i in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=seeded_generator(i))
        for model, optimizer in ((run_a, opt), (run_b, oracle)):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert_models_close(a, b, f"step {i}")


# ------------------------------------------------------------------------------------- bad input
def test_a_refused_construction_keeps_no_parameter_while_its_traceback_lives():
    """A notebook keeps the last exception (and with it the half-built optimizer): the corrected call takes
    the same parameters."""
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 8))
    transposed = nn.Parameter(torch.randn(24, 16).t())
    with pytest.raises(ValueError, match="is not contiguous") as refused:
        ZenFlowAdamW([{"params": model.parameters()}, {"params": [transposed]}], lr=1e-2)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2)
    assert refused.value.__traceback__ is not None and len(opt.param_groups[0]["params"]) == 4


def test_bad_input_is_a_clear_value_error_naming_it():
    w = nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"betas=\('a', 'b'\) is invalid"):
        ZenFlowAdamW([w], betas=("a", "b"))
    for optimizer in (ZenFlowAdamW, ZenFlowReference):  # (the reference refuses what it could not mirror)
        with pytest.raises(ValueError, match=r"parameter 1 of param group 0 \(shape \(0, 4\)\) is an empty matrix"):
            optimizer([w, nn.Parameter(torch.zeros(0, 4))])
        with pytest.raises(ValueError, match=r"shape \(4, 0\)\) is an empty matrix"):
            optimizer([nn.Parameter(torch.zeros(4, 0))])
    with pytest.raises(ValueError, match=r"parameter 1 of param group 0 \(shape \(4, 3\)\) appears more than once"):
        ZenFlowAdamW([w, w])
    opt = ZenFlowAdamW([w])
    with pytest.raises(ValueError, match="appears more than once"):
        opt.add_param_group({"params": [w]})
    assert len(opt.param_groups) == 1


def test_integer_tensors_are_skipped_like_torch_does():
    model = tiny_model()
    codes = torch.arange(6).reshape(2, 3)
    model.register_parameter("codes", nn.Parameter(codes.clone(), requires_grad=False))  # e.g. quantized
    opt = ZenFlowAdamW(model.parameters(), lr=LR, **ZENFLOW_KEYS)
    for batch in make_batches(3):
        step(model, opt, batch)
    assert torch.equal(model.codes, codes)
    opt.state_dict()  # and checkpoints work


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_sparse_embedding_is_a_clear_error(compiled):
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    opt = ZenFlowAdamW(model.parameters(), lr=LR)
    run = torch.compile(model, backend="zenflow") if compiled else model
    with pytest.raises(Exception, match=r"sparse.*gradient.*Fix: use sparse=False") as info:
        run(torch.tensor([1, 2, 3])).sum().backward()  # compiled: refused in the backward's hand-off
        opt.step()  # eager: .grad is the user's until the step, which refuses it
    assert "ValueError" in repr(info.value) or isinstance(info.value, ValueError)
    assert opt.stats()["steps"] == 0


def test_a_tensor_lr_works_as_in_torch_adamw():
    a, b = tiny_model(), tiny_model()
    opt = ZenFlowAdamW(a.parameters(), lr=torch.tensor(LR), **ADAMW_KEYS)
    oracle = torch.optim.AdamW(b.parameters(), lr=torch.tensor(LR))
    for batch in make_batches(3):
        step(a, opt, batch)
        step(b, oracle, batch)
    assert_models_close(a, b, "tensor lr")


# ---------------------------------------------------------------------------------- selection rules
def test_k_is_the_floor_of_the_exact_decimal_product():
    config = zenflow_compile.ZenFlowConfig(topk_ratio=0.29)
    assert config.num_selected(100) == 29
    assert zenflow_compile.ZenFlowConfig(topk_ratio=0.57).num_selected(100) == 57


@pytest.mark.parametrize("opt_class", [ZenFlowAdamW, ZenFlowReference])
def test_epoch_reselection_stays_on_the_epoch_grid(opt_class, device):
    # Epochs of 3 steps end at t = 2, 5, 8, 11; boundaries every 2 steps at t = 1, 3, 5, 7, 9, 11:
    # reselect at the first boundary at or after each epoch end: t = 3, 5, 9, 11.
    model = tiny_model()
    opt = opt_class(model.parameters(), lr=LR, topk_ratio=0.25, update_interval=2, select_strategy="epoch",
                    select_interval=1, steps_per_epoch=3)
    reselected_at, last = [], 0
    for t, batch in enumerate(make_batches(12)):
        step(model, opt, batch)
        if opt.stats()["reselections"] != last:
            reselected_at.append(t)
            last = opt.stats()["reselections"]
    assert reselected_at == [3, 5, 9, 11]


def test_stall_clock_keeps_only_the_waits_the_gpu_has_not_reached():
    from emulated_device import EmulatedStreams
    from zenflow_compile.runtime.transfers import StallClock, Transfers

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

        def elapsed_time(self, end):
            return 2.0  # ms

    clock = StallClock(Transfers(torch.device("cpu"), streams=EmulatedStreams()))
    clock._pending = [(Event(True), Event(True)) for _ in range(1000)] + [(Event(True), Event(False))]
    clock._resolve_completed()
    assert clock.num_pending == 1
    assert clock.device_idle_seconds() == pytest.approx(2.0)
