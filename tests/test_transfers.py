"""The offload path: ordering of copies and CPU work, on every test device (cpu, the emulated asynchronous
device, cuda when present).

Results must never depend on timing: a slow CPU worker, a slow device-to-host copy or a slow upload only
makes the training thread wait (counted as stall), never changes a value.
"""

import time

import pytest
import torch

from helpers import bf16_ulp_distance, make_batches, max_param_diff, tiny_model, train_steps
from zenflow_compile import ZenFlowAdamW
from zenflow_compile.reference import ZenFlowReference
from zenflow_compile.runtime import kernels
from zenflow_compile.runtime import transfers
from zenflow_compile.triton_kernels import triton_available

CONFIGS = {
    "overlap-off": dict(topk_ratio=0.25, update_interval=2),
    "overlap-on": dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step",
                       select_interval=4),
    "auto-overlap": dict(topk_ratio=0.25, update_interval="auto", overlap_step=True),
}
def run_pair(config, *, dtype=torch.float32, device=None, steps=8, backwards_per_step=1, compiled=False):
    model, ref_model = tiny_model(dtype, device=device), tiny_model(dtype, device=device)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, **config)
    ref = ZenFlowReference(ref_model.parameters(), lr=1e-2, **config)
    batches = make_batches(steps * backwards_per_step, dtype, device=device)
    run = torch.compile(model, backend="zenflow") if compiled else model
    log = train_steps(run, opt, batches, backwards_per_step)
    ref_log = train_steps(ref_model, ref, batches, backwards_per_step)
    opt.synchronize()
    ref.synchronize()
    return opt, ref, log, ref_log, model, ref_model


def assert_matches_reference(opt, ref, log, ref_log, model, ref_model, dtype):
    for ours, theirs in zip(log.params, ref_log.params):
        if dtype == torch.float32:
            assert max_param_diff(ours, theirs) < 1e-6  # fp32 rounding of reordered reductions
        else:  # masters agree to fp32 rounding, so their casts may land on neighbouring bf16 values
            assert max(bf16_ulp_distance(a, b) for a, b in zip(ours, theirs)) <= 1
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert (opt.master(p).cpu() - ref.master(q).cpu()).abs().max() < 1e-5


@pytest.mark.parametrize("name", CONFIGS)
def test_slow_cpu_worker_changes_nothing_but_stall(name, monkeypatch, device):
    fast = run_pair(CONFIGS[name])
    real_cpu_adamw = kernels.cpu_adamw_

    def slow_cpu_adamw(*args, **kwargs):
        time.sleep(0.05)
        real_cpu_adamw(*args, **kwargs)

    monkeypatch.setattr(kernels, "cpu_adamw_", slow_cpu_adamw)
    slow = run_pair(CONFIGS[name])
    for a, b in zip(fast[2].params, slow[2].params):
        assert max_param_diff(a, b) == 0.0  # deterministic: timing never shows in the values
    assert_matches_reference(*slow, torch.float32)
    stats = slow[0].stats()
    assert stats["stall_seconds"] >= 0.04  # at least one wait for a 50 ms update was measured
    assert stats["cpu_update_seconds"] >= 0.05 * stats["cpu_updates"]


def test_slow_accumulate_worker_never_lets_a_buffer_be_overwritten(monkeypatch, device):
    # The backward of step t+2 refills the host gradient buffer that the accumulate task of step t reads.
    # A slow accumulate must make that backward wait, not lose or mix gradients.
    from zenflow_compile.runtime.state import intake

    real_accumulate = intake.accumulate

    def slow_accumulate(*args):
        time.sleep(0.02)
        real_accumulate(*args)

    monkeypatch.setattr(intake, "accumulate", slow_accumulate)
    assert_matches_reference(*run_pair(CONFIGS["overlap-on"], steps=10), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_in_the_runtime_match_reference(dtype, monkeypatch, device):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the runtime's device kernels run interpreted on CPU
    assert triton_available(torch.device("cpu"))
    assert_matches_reference(*run_pair(CONFIGS["overlap-on"], dtype=dtype, steps=6), dtype)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_and_counts_the_copies(name, dtype, device):
    result = run_pair(CONFIGS[name], dtype=dtype, steps=10)
    assert_matches_reference(*result, dtype)
    stats = result[0].stats()
    assert stats["bytes_device_to_host"] > 0 and stats["bytes_host_to_device"] > 0
    assert stats["stall_seconds"] >= 0.0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gradient_accumulation_matches_reference(compiled, device):
    """Several backwards per step: eagerly they sum in `.grad`; compiled, each backward hands its gradients
    over and the later ones are copied down into extra pinned buffers, summed on the host at the step."""
    opt, *rest = run_pair(CONFIGS["overlap-on"], steps=6, backwards_per_step=3, compiled=compiled)
    assert_matches_reference(opt, *rest, torch.float32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_delayed_on_their_streams_change_nothing(monkeypatch):
    """Every copy starts ~10 ms late on its stream: a reader that did not wait for the copy's event would
    see stale data (the emulated device checks the same orderings on CPU, every run)."""
    real_copy = transfers.AcceleratorStreams.copy_

    def delayed_copy(self, targets, sources, stream):
        with self._on(stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before the copy
        real_copy(self, targets, sources, stream)

    monkeypatch.setattr(transfers.AcceleratorStreams, "copy_", delayed_copy)
    for name in ("overlap-off", "overlap-on"):
        assert_matches_reference(*run_pair(CONFIGS[name], device="cuda", steps=8), torch.float32)


@pytest.mark.parametrize("discard", ["nan-step", "zero_grad"])
def test_a_discarded_accumulation_step_leaves_no_trace(discard, device):
    """Two backwards, then the step is skipped (NaN) or the grads are zeroed: nothing of them may leak into
    the next step (the second backward's offload lives in an extra host buffer until step())."""
    config = CONFIGS["overlap-on"]
    model, ref_model = tiny_model(), tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, **config)
    ref = ZenFlowReference(ref_model.parameters(), lr=1e-2, **config)
    batches = make_batches(15)
    for m, o in ((model, opt), (ref_model, ref)):
        train_steps(m, o, batches[:4])  # past the first selection: the offload path is in use
        for i in (4, 5):
            (m(batches[i][0]).float() - batches[i][1]).square().mean().backward()
        if discard == "nan-step":
            if o is ref:
                m.fc1.weight.grad[0, 0] = float("nan")
                o.step()
            else:  # ZenFlow's grads are in the runtime: poison the next backward instead
                (m(batches[6][0]).float().sum() * float("nan")).backward()
                o.step()
            assert o.stats()["skipped_steps"] == 1
        o.zero_grad()
    log = train_steps(model, opt, batches[7:15], backwards_per_step=2)
    ref_log = train_steps(ref_model, ref, batches[7:15], backwards_per_step=2)
    opt.synchronize()
    ref.synchronize()
    assert_matches_reference(opt, ref, log, ref_log, model, ref_model, torch.float32)
