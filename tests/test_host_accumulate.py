"""The host accumulation (`kernels.accumulate_scaled_many_`, the accumulate worker's kernel where the device
has no room for the sums, or the model is on the CPU): acc += coef * grad (and square += (coef * grad)**2)
against a float64 recomputation, for fp32 gradients in one fused add and bf16/fp16 ones converted chunk by chunk
below `kernels.COMPILED_MIN_NUMEL` elements, Inductor's one-pass kernel from it; and its refusals."""

from __future__ import annotations

import threading

import pytest
import torch

from zenflow_compile.runtime import kernels

# Sizes around the vector width, across a conversion chunk (`kernels._ACCUMULATE_CHUNK`), and past
# `kernels.COMPILED_MIN_NUMEL` (the compiled kernel).
SIZES = (1, 7, 17, 1000, kernels._ACCUMULATE_CHUNK - 1, kernels.COMPILED_MIN_NUMEL + 5)


def _tensors(dtypes, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=generator).to(dtype) for n, dtype in zip(SIZES, dtypes)]
    accs = [torch.randn(n, generator=generator) for n in SIZES]
    squares = [torch.rand(n, generator=generator) for n in SIZES]
    return accs, grads, squares


def _spacing(x: torch.Tensor) -> torch.Tensor:
    """fp32's spacing (one ulp) at the magnitude of each element of `x` (float64)."""
    x = x.float().abs()
    return (torch.nextafter(x, torch.tensor(float("inf"))) - x).double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("coef", [1.0, 0.37])
def test_accumulation_equals_a_float64_recomputation(dtype, coef):
    """Every gradient of the call in one dtype; then fp32 and `dtype` mixed in one call (each kind takes its
    own path, in one call of the worker). The bounds are the roundings each path makes: below
    COMPILED_MIN_NUMEL one fused multiply-add (half an ulp of the result; a square, its two), from it the
    compiled kernel rounds coef * grad first, as `ZenFlowReference` does (and half an ulp of that product
    more; its square's, two)."""
    for dtypes in ([dtype] * len(SIZES), [dtype, torch.float32] * (len(SIZES) // 2)):
        accs, grads, squares = _tensors(dtypes)
        before_accs, before_squares = [a.clone() for a in accs], [s.clone() for s in squares]
        kernels.accumulate_scaled_many_(accs, grads, coef, square_accs=squares)
        coef32 = float(torch.tensor(coef, dtype=torch.float32))  # the fp32 math the kernel does
        coef_sq32 = float(torch.tensor(coef * coef, dtype=torch.float32))
        for acc, before, square, before_square, grad in zip(accs, before_accs, squares, before_squares, grads):
            g = grad.double()
            scaled = coef32 * g
            expected_acc, expected_square = before.double() + scaled, before_square.double() + coef_sq32 * g * g
            acc_bound, square_bound = 0.5 * _spacing(expected_acc), 2 * _spacing(expected_square)
            if kernels.compiles(acc.numel()):
                acc_bound = acc_bound + 0.5 * _spacing(scaled)
                square_bound = square_bound + 2 * _spacing(scaled * scaled)
            assert ((acc.double() - expected_acc).abs() <= acc_bound).all(), (acc.numel(), dtype)
            assert ((square.double() - expected_square).abs() <= square_bound).all(), (acc.numel(), dtype)


def test_refuses_non_contiguous_and_mismatched_arguments():
    acc = torch.zeros(8, 6)
    grad = torch.randn(6, 8).bfloat16().t()  # [8, 6], not contiguous
    with pytest.raises(ValueError, match="must be contiguous"):
        kernels.accumulate_scaled_many_([acc], [grad], 1.0)
    with pytest.raises(ValueError, match="1 square_accs for 2 accs"):
        kernels.accumulate_scaled_many_([acc, acc], [grad.contiguous()] * 2, 1.0, square_accs=[torch.zeros(8, 6)])
    assert torch.equal(acc, torch.zeros(8, 6))  # (refused before anything was written)


@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_the_workers_build_their_compiled_kernels_at_the_layout(accumulate_on, monkeypatch, emulated_device):
    """Once the first selection lays a large slab out, each worker builds the compiled kernel it will run on its
    own thread, before any boundary: the update worker the CPU AdamW, the accumulate worker the host
    accumulation where the host sums (not where the device does)."""
    from zenflow_compile import ZenFlowAdamW
    from helpers import loss_fn, make_batches, tiny_model

    built = []
    monkeypatch.setattr(kernels, "COMPILED_MIN_NUMEL", 0)  # (the tiny model's slabs count as large)
    monkeypatch.setattr(kernels, "prepare_cpu_adamw",
                        lambda *variant: built.append(("cpu_adamw", variant, threading.current_thread().name)))
    monkeypatch.setattr(kernels, "prepare_accumulate",
                        lambda *variant: built.append(("accumulate", variant, threading.current_thread().name)))
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=4,
                       accumulate_on=accumulate_on)
    loss_fn(model, make_batches(1)[0]).backward()
    opt.step()  # the first selection: the layout
    opt.synchronize()
    assert opt.stats()["cpu_updates"] == 0
    workers = {kind: {thread for k, _, thread in built if k == kind} for kind in ("cpu_adamw", "accumulate")}
    assert {variant for k, variant, _ in built if k == "cpu_adamw"} == {(torch.float32, False)}
    assert workers["cpu_adamw"] and all("update" in thread for thread in workers["cpu_adamw"])
    if accumulate_on == "host":
        assert {variant for k, variant, _ in built if k == "accumulate"} == {(torch.float32, False)}
        assert workers["accumulate"] and all("accumulate" in thread for thread in workers["accumulate"])
    else:
        assert not workers["accumulate"]
