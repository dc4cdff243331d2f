"""Setup: the first step lays each matrix's state out once, selected, and holds no more host memory than that
state while it does.

A matrix whose first gradient comes once warm-up is over is selected at that step: it waits for the
selection holding only the step's gradient and its scores (`runtime/state/pending.py`), and its slab is laid
out once, straight from the parameter, with its k selected columns. What a user can observe: each slab is
built once (not first with no column selected, then again), the step's peak host memory is about the state
it leaves, and the values are the reference's in every workflow that meets a pending matrix (several
backwards before the first step, a parameter group edited, a zero_grad or a skipped step before it, a write
into the parameter, compiled and eager).
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import zenflow_compile
from zenflow_compile.reference import ZenFlowReference
from zenflow_compile.runtime.state import slab as slab_module

from helpers import loss_fn, make_batches, tiny_model

LR = 1e-2
KEYS = dict(topk_ratio=0.25, update_interval=2, overlap_step=True)


def _count_slab_layouts(monkeypatch) -> list:
    built = []
    init = slab_module.Slab.__init__

    def counting_init(self, key, members, *args, **kwargs):
        built.append(tuple(m.pid for m in members))
        init(self, key, members, *args, **kwargs)

    monkeypatch.setattr(slab_module.Slab, "__init__", counting_init)
    return built


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_first_step_lays_each_slab_out_once(compiled, device, monkeypatch):
    built = _count_slab_layouts(monkeypatch)
    model = tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, **KEYS)
    run = torch.compile(model, backend="zenflow") if compiled else model
    batch = make_batches(1)[0]
    loss_fn(run, batch).backward()
    opt.step()
    laid_out = sorted(pid for pids in built for pid in pids)
    assert laid_out == sorted(set(laid_out)), f"a parameter's state was laid out more than once: {built}"
    assert len(laid_out) == len(list(model.parameters()))
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            assert opt.selected_columns(p) is not None, name


def test_warm_up_selects_at_step_w(monkeypatch):
    """With warm-up rounds, a matrix is laid out with no column selected for them, and once more at step W."""
    built = _count_slab_layouts(monkeypatch)
    model = tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=LR, full_warm_up_rounds=1, **KEYS)
    for batch in make_batches(2):
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    assert all(opt.selected_columns(p) is not None for p in matrices)
    assert sum(len(pids) for pids in built) == len(list(model.parameters())) + len(matrices)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak resident set is read from /proc")
def test_the_first_steps_peak_memory_is_about_the_state_it_leaves(emulated_device):
    """Emulated device (its device memory is host memory too): the resident memory the first step adds at its
    peak is the state it leaves (host and device) plus the step's gradient held until the selection, within
    a small margin; laying the state out twice took about twice that."""
    torch.manual_seed(0)
    rows = cols = 1024
    params = [nn.Parameter(torch.randn(rows, cols).bfloat16()) for _ in range(8)]
    numel = sum(p.numel() for p in params)
    opt = zenflow_compile.ZenFlowAdamW(params, lr=LR, topk_ratio=0.05, update_interval=4)
    for p in params:
        p.grad = torch.randn(rows, cols).bfloat16()
    resident = _status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # the peak (VmHWM) starts again from here
    except OSError:
        pytest.skip("this kernel does not reset the peak resident set")
    opt.step()
    growth = (_status_kib("VmHWM") - resident) * 1024 / numel
    stats = opt.stats()
    state = (stats["host_state_bytes"] + stats["device_state_bytes"]) / numel
    gradient = 2.0  # the step's bf16 gradient, held on the device until the selection
    assert growth <= state + gradient + 4.0, f"first step peak +{growth:.1f} B/param for {state:.1f} B/param of state"
    opt.synchronize()


def _groups(model):
    params = list(model.parameters())
    return [{"params": params[:-1]}, {"params": params[-1:], "lr": LR / 2}]  # (fc2.bias in a group of its own)


def _edit_groups(opt):
    """Between the first backward and the first step: fc2.weight moves to the second group."""
    opt.param_groups[1]["params"].append(opt.param_groups[0]["params"].pop(5))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("workflow", ["several-backwards", "groups-edited", "zero-grad-first", "skipped-first",
                                      "written-before-step"])
def test_a_pending_matrix_equals_the_reference(workflow, compiled, device):
    a, b = tiny_model(), tiny_model()
    opt = zenflow_compile.ZenFlowAdamW(_groups(a), lr=LR, **KEYS)
    ref = ZenFlowReference(_groups(b), lr=LR, **KEYS)
    run = torch.compile(a, backend="zenflow") if compiled else a
    batches = make_batches(12)
    first = 0
    if workflow == "zero-grad-first":  # a backward whose gradients are dropped before any step
        for model, o in ((run, opt), (b, ref)):
            loss_fn(model, batches[0]).backward()
            o.zero_grad()
        first = 1
    for step, batch in enumerate(batches[first:first + 6]):
        backwards = 2 if workflow == "several-backwards" and step == 0 else 1
        for model, o in ((run, opt), (b, ref)):
            for _ in range(backwards):
                loss = loss_fn(model, batch)
                if workflow == "skipped-first" and step == 0:
                    loss = loss * float("inf")
                loss.backward()
        if step == 0 and workflow == "groups-edited":
            _edit_groups(opt)
            _edit_groups(ref)
        if step == 0 and workflow == "written-before-step":
            with torch.no_grad():
                for model in (a, b):
                    model.fc1.weight.mul_(0.5)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m: f"step {step}, {name}: {m}")
    assert opt.stats()["steps"] == ref.stats()["steps"]
    assert opt.stats()["skipped_steps"] == ref.stats()["skipped_steps"]
