"""The device path itself: real copies wherever the device is not the host, one generic stream API, and the
emulated device's ordering checks catching each kind of missing wait (the value suites run on it too, through
the `device` fixture)."""

import re
import threading
import time
from pathlib import Path

import pytest
import torch

from emulated_device import EmulatedStreams, OrderingViolation, PageableUploads
from helpers import TinyRepeated, loss_fn, make_batches, max_param_diff, tiny_model, train_steps, value_tolerance
from zenflow_compile import ZenFlowAdamW
from zenflow_compile.reference import ZenFlowReference
from zenflow_compile.runtime import transfers
from zenflow_compile.runtime.transfers import AcceleratorStreams, Transfers
from zenflow_compile.runtime.worker import CpuWorker, wait_for

RUNTIME = Path(transfers.__file__).resolve().parent


def test_the_runtime_calls_no_cuda_specific_api():
    """The device path is written against torch.accelerator / torch.Stream / torch.Event, so CUDA, ROCm, XPU
    and the emulated device run the same lines."""
    calls = {f"{path.name}:{n}": line.strip() for path in RUNTIME.glob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"torch\.cuda\.", line)}
    assert calls == {}


def test_which_devices_copy():
    assert transfers.streams_for(torch.device("cpu")) is None  # the device is the host: no copies
    for kind in ("cuda", "xpu", "mps"):
        assert isinstance(transfers.streams_for(torch.device(kind)), AcceleratorStreams)
    emulated = EmulatedStreams()
    try:
        with transfers.emulate_async_device(emulated):
            assert transfers.streams_for(torch.device("cpu")) is emulated
        assert transfers.streams_for(torch.device("cpu")) is None
    finally:
        emulated.close()


def test_an_upload_to_a_device_that_is_not_the_host_is_a_copy(emulated_device):
    """A device tensor never aliases a host buffer (on XPU or MPS that would merge a CPU tensor into a device
    parameter); before its copy lands it holds garbage (NaN here), after the compute stream's wait the
    values."""
    moves = Transfers(torch.device("cpu"))
    assert not moves.device_is_host
    pinned = moves.host_zeros((3, 4), torch.float32)
    pinned.copy_(torch.arange(12.0).reshape(3, 4))
    uploaded, done = moves.to_device(pinned)
    assert uploaded.data_ptr() != pinned.data_ptr()
    assert done.query()  # the compute stream waited for it before returning the tensor to its kernels
    assert torch.equal(uploaded, pinned)


def test_a_host_read_before_its_copy_landed_sees_stale_data_and_is_caught(emulated_device):
    emulated_device.delay_ms = 50.0
    moves = Transfers(torch.device("cpu"))
    pinned = moves.host_zeros((4,), torch.float32)
    done = moves.to_host(torch.ones(4), pinned)
    assert torch.equal(pinned, torch.zeros(4))  # not landed yet: the old contents
    with pytest.raises(OrderingViolation, match="read of pinned .* not ordered after the write by copy"):
        moves.host_access(reads=[pinned])
    emulated_device.violations.clear()
    done.synchronize()
    moves.host_access(reads=[pinned])  # ordered now
    assert torch.equal(pinned, torch.ones(4))


def test_reusing_a_buffer_before_its_reader_is_joined_is_caught_whatever_the_timing(emulated_device):
    """A CPU worker reads a pinned buffer; the training thread must join that task before the next copy
    into the buffer. Here the task has really finished (a side channel says so), yet without the join
    nothing orders the copy after the read: caught, deterministically."""
    moves = Transfers(torch.device("cpu"))
    worker = CpuWorker("reader")
    worker.ordering = moves.ordering
    pinned = moves.host_zeros((4,), torch.float32)
    moves.to_host(torch.ones(4), pinned).synchronize()
    finished = threading.Event()

    def read():
        moves.host_access(reads=[pinned])
        finished.set()

    task = worker.submit(read)
    finished.wait()
    time.sleep(0.01)
    with pytest.raises(OrderingViolation, match="write of pinned .* not ordered after the read"):
        moves.to_host(torch.full((4,), 2.0), pinned)
    emulated_device.violations.clear()
    wait_for(task)  # the join the runtime makes before it reuses a buffer
    moves.to_host(torch.full((4,), 2.0), pinned).synchronize()
    worker.shutdown()


def test_a_kernel_reading_an_upload_without_waiting_for_it_is_caught(emulated_device):
    streams = emulated_device
    upload = streams.stream()
    pinned = streams.host_zeros((4,), torch.float32)
    target = streams.device_empty((4,), torch.float32)
    streams.note_compute_access(writes=[target])
    upload.wait_stream(streams.current_stream())
    streams.copy_([target], [pinned], upload)
    with pytest.raises(OrderingViolation, match="read of a device tensor .* not ordered after its write by copy"):
        streams.note_compute_access(reads=[target])  # no compute.wait_event(copy's event) before it
    streams.close()  # (the copy lands while `target` is still held)
    streams.violations.clear()


def test_a_copy_source_freed_before_the_copy_ran_is_caught(emulated_device):
    streams = emulated_device
    streams.delay_ms = 20.0
    down = streams.stream()
    pinned = streams.host_zeros((4,), torch.float32)
    source = torch.ones(4)
    streams.note_compute_access(writes=[source])
    down.wait_stream(streams.current_stream())
    streams.copy_([pinned], [source], down)
    del source  # no keep_alive(record_stream): its memory may serve other work before the copy runs
    streams.close()
    assert any("freed before the copy" in v for v in streams.violations)
    streams.violations.clear()


@pytest.mark.overlap
@pytest.mark.parametrize("update_interval", [2, 4])
def test_the_overlap_hides_copy_and_cpu_delays_that_a_synchronous_schedule_pays(device, update_interval):
    """The design's promise, on a device that is not the host: with copies shorter than a step's own work,
    a boundary's CPU update (and the copies it waits for) runs while training goes on, and the training
    thread barely waits; the synchronous schedule waits at every boundary. Values equal the reference."""
    if device.type == "cpu" and transfers.streams_for(device) is None:
        pytest.skip("the device is the host: no copies to overlap")
    step_work_s = 0.04  # the forward a device step would take (a GPU's time, slept here)

    def forward_then_loss(model, batch):  # the copies of a step's gradients are queued at its backward's end
        time.sleep(step_work_s)
        return loss_fn(model, batch)

    streams = transfers.streams_for(device)
    if isinstance(streams, EmulatedStreams):
        streams.delay_ms = 10.0
    steps, stall, boundaries = 12, {}, {}
    for overlap in (False, True):
        keys = dict(topk_ratio=0.25, update_interval=update_interval, overlap_step=overlap,
                    select_strategy="step", select_interval=100)
        model, ref_model = tiny_model(), tiny_model()
        opt = ZenFlowAdamW(model.parameters(), lr=1e-2, **keys)
        ref = ZenFlowReference(ref_model.parameters(), lr=1e-2, **keys)
        batches = make_batches(steps)
        log = train_steps(model, opt, batches, loss=forward_then_loss)
        ref_log = train_steps(ref_model, ref, batches)
        stats = opt.stats()
        opt.synchronize()
        assert max_param_diff(log.params[-1], ref_log.params[-1]) < value_tolerance(1e-6, 0)["atol"]
        stall[overlap], boundaries[overlap] = stats["stall_seconds"], stats["cpu_updates"]
    assert boundaries[True] == boundaries[False] == steps // update_interval
    # Synchronous: each boundary waits at least for its copies down and its CPU update.
    assert stall[False] >= 0.005 * boundaries[False]
    assert stall[True] < 0.25 * stall[False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_accumulation_sends_the_sums_once_per_interval(dtype, emulated_device):
    """Bytes device -> host: summing on the device, each boundary sends the interval's fp32 sums of the
    unselected columns ((1 - r) x 4 bytes per matrix parameter, once per update_interval S); summing on the host,
    every step sends the step's unselected gradient ((1 - r) x the parameter's bytes). (The first step, whose
    gradient picks the first selection, sends it whole either way: counted from the second step on.)"""
    topk_ratio, interval, steps = 0.25, 4, 9
    sent = {}
    for accumulate_on in ("device", "host"):
        model = tiny_model(dtype)
        opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=topk_ratio, update_interval=interval,
                           overlap_step=True, select_strategy="step", select_interval=100,
                           accumulate_on=accumulate_on)
        batches = make_batches(steps, dtype)
        train_steps(model, opt, batches[:1])
        first = opt.stats()["bytes_device_to_host"]
        train_steps(model, opt, batches[1:])  # boundaries at t = 3 and 7
        assert opt.stats()["accumulate_on"] == accumulate_on
        sent[accumulate_on] = opt.stats()["bytes_device_to_host"] - first
    unselected = sum(p.shape[0] * (p[0].numel() - max(1, int(topk_ratio * p[0].numel())))
                     for p in model.parameters() if p.dim() >= 2)
    assert sent["device"] == 2 * unselected * 4
    assert sent["host"] == (steps - 1) * unselected * torch.finfo(dtype).bits // 8


@pytest.mark.parametrize("overlap_reselect", ["wait", "incoming"])
@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_the_byte_counters_count_the_columns_a_reselection_moves(accumulate_on, overlap_reselect, device):
    """A reselection moves each arriving column's state up (fp32 master, moments and update count: 3R + 1 values)
    and each departing one's down (the same and the R weights its parameter holds: 4R + 1): the counters of a
    run that reselects exceed those of the same schedule that never does by exactly that, column by column
    (on the CPU too, where the device is the host, as the gradients' bytes are)."""
    counted, moved_up, moved_down = {}, 0, 0
    for select_interval in (2, 1000):
        model = tiny_model()
        opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, select_strategy="step",
                           select_interval=select_interval, overlap_step=True, overlap_reselect=overlap_reselect,
                           accumulate_on=accumulate_on)
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        selected = None
        for batch in make_batches(9):
            train_steps(model, opt, [batch])
            now = [set(opt.selected_columns(p).tolist()) for p in matrices]
            if selected is not None and select_interval == 2:
                for p, before, after in zip(matrices, selected, now):
                    moving = len(after - before)
                    moved_up += moving * (3 * p.shape[0] + 1) * 4
                    moved_down += moving * (4 * p.shape[0] + 1) * 4
            selected = now
        opt.synchronize()
        counted[select_interval] = (opt.stats()["bytes_host_to_device"], opt.stats()["bytes_device_to_host"])
    assert opt.stats()["reselections"] == 0 and moved_up > 0
    assert counted[2][0] - counted[1000][0] == moved_up
    assert counted[2][1] - counted[1000][1] == moved_down


@pytest.mark.parametrize("offload", [False, True], ids=["", "offload"])
@pytest.mark.parametrize("overlap_reselect", ["wait", "incoming"])
@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_the_training_thread_touches_no_host_state_unless_the_selection_changes(accumulate_on, overlap_reselect,
                                                                                 offload, emulated_device):
    """Plain steps and update boundaries (overlapped or not) leave the host state to the workers and the copy
    streams: the training thread touches none of it (it writes only small staging buffers of indices). A
    reselection that waits for its update moves host rows on it, one made in flight none; neither touches the
    gradient buffers (a step's first backward overwrites them). With `offload`, the selected columns' moments
    in host memory too: they travel on the copy streams."""
    model = tiny_model()
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, overlap_step=True,
                       select_strategy="step", select_interval=6, accumulate_on=accumulate_on,
                       overlap_reselect=overlap_reselect, offload=offload)
    batches = make_batches(6)
    train_steps(model, opt, batches[:1])  # the first selection lays the state out
    storage = lambda tensors: {t.untyped_storage().data_ptr() for t in tensors}
    grad_buffers = storage(t for slab in opt._runtime.slabs for t in slab.host_grads)
    host_state = storage(t for slab in opt._runtime.slabs for t in slab.host_buffers())
    training_thread = threading.current_thread().name
    touched_here = lambda: set().union(*(storages for thread, _, storages in emulated_device.host_accesses
                                         if thread == training_thread))
    emulated_device.host_accesses.clear()
    train_steps(model, opt, batches[1:5])  # plain steps and boundaries at t = 1 and 3
    assert opt.stats()["cpu_updates"] == 2 and opt.stats()["reselections"] == 0
    assert not touched_here() & (host_state | grad_buffers)
    assert {s for _, _, storages in emulated_device.host_accesses for s in storages} & host_state  # (the workers')
    emulated_device.host_accesses.clear()
    train_steps(model, opt, batches[5:])  # t = 5: a reselecting boundary
    assert opt.stats()["reselections"] == 1 and opt.stats()["selection_churn"] > 0
    touched = touched_here()
    if overlap_reselect == "wait":  # the host rows re-sorted and the host weights rewritten here
        assert touched & host_state
    else:  # made in flight: the arriving columns go up through a staging buffer of their own, the departing
        assert not touched & host_state  # ones down on the copy stream, into their rows at the apply
    assert not touched & grad_buffers


def _train_after_the_layout(device: str, accumulate_on: str, overlap_reselect: str, guard, offload: bool) -> dict:
    """TinyRepeated on `device`: the first step lays the state out; then 13 steps and `synchronize()`, each
    inside `guard` (plain steps, boundaries, landings, reselecting boundaries at t = 5 and 11, and at t = 2,
    5, 8, 11 a member of the blocks' slab without a gradient: its slab updated in part). Returns stats()."""
    torch.manual_seed(0)
    model = TinyRepeated().to(device)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, overlap_step=True,
                       select_strategy="step", select_interval=6, accumulate_on=accumulate_on,
                       overlap_reselect=overlap_reselect, offload=offload)
    batches = make_batches(14, device=device)
    train_steps(model, opt, batches[:1])
    for t, batch in enumerate(batches[1:], start=1):
        loss_fn(model, batch).backward()
        if t % 3 == 2:
            model.blocks[1][0].weight.grad = None
        with guard:
            opt.step()
        opt.zero_grad()
    with guard:
        opt.synchronize()
    return opt.stats()


@pytest.mark.parametrize("offload", [False, True], ids=["", "offload"])
@pytest.mark.parametrize("overlap_reselect", ["wait", "incoming"])
@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_after_the_layout_no_step_makes_a_pageable_upload(accumulate_on, overlap_reselect, offload, emulated_device):
    """Once the first selection has laid the state out, what the runtime computes on the host for the device
    (a reselection's indices and column sets, the members a partial step updates) goes up in pinned copies the
    compute stream waits for: on a GPU a pageable `.to(device)` blocks the training thread until the compute
    stream drains, once per tensor."""
    uploads = PageableUploads()
    stats = _train_after_the_layout("cpu", accumulate_on, overlap_reselect, uploads, offload)
    assert uploads.calls == []
    assert stats["reselections"] == 2 and stats["selection_churn"] > 0


@pytest.mark.cuda
@pytest.mark.parametrize("offload", [False, True], ids=["", "offload"])
@pytest.mark.parametrize("overlap_reselect", ["wait", "incoming"])
@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_after_the_layout_the_training_thread_synchronises_only_to_read(accumulate_on, overlap_reselect, offload,
                                                                         monkeypatch):
    """The same steps on CUDA under `torch.cuda.set_sync_debug_mode("error")`: any call that synchronises with
    a stream raises, except the step's counted blocking reads (`Transfers.read_to_host`)."""
    read_to_host = Transfers.read_to_host

    def counted_read(self, tensor):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return read_to_host(self, tensor)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(Transfers, "read_to_host", counted_read)

    class SyncsRaise:
        def __enter__(self):
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc):
            torch.cuda.set_sync_debug_mode(0)

    stats = _train_after_the_layout("cuda", accumulate_on, overlap_reselect, SyncsRaise(), offload)
    assert stats["reselections"] == 2 and stats["selection_churn"] > 0


@pytest.mark.parametrize("accumulate_on", ["host", "device"])
@pytest.mark.parametrize("topk_ratio", [0.1, 0.25])
def test_device_state_bytes_is_the_selected_share_of_adamw_state(topk_ratio, accumulate_on, device):
    """stats()["device_state_bytes"] is what the optimizer's state holds on the device, recomputed from the
    shapes: per matrix [R, k] master, moments and gradient, k counts, C scores and C column indices; per
    vector everything. For matrices that is about topk_ratio x AdamW's 12 bytes per parameter (plus the
    selected columns' gradient). Accumulating on the device adds, per unselected element, its fp32 sum and
    its gradient's staging in the parameter's dtype."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(128, 64), torch.nn.LayerNorm(64)).to(device)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=topk_ratio, update_interval=2,
                       accumulate_on=accumulate_on)
    for x in torch.randn(3, 8, 256).to(device):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    expected, matrix_params, vector_total, accumulation = 0, 0, 0, 0
    for p in model.parameters():
        if p.dim() >= 2:
            rows, cols = p.shape[0], p.numel() // p.shape[0]
            k = max(1, int(topk_ratio * cols))
            expected += rows * k * (3 * 4 + p.element_size()) + k * 4 + cols * 4 + cols * 8
            accumulation += rows * (cols - k) * (4 + p.element_size())
            matrix_params += p.numel()
        else:
            vector_bytes = p.numel() * (3 * 4 + p.element_size()) + 4 + 4 + 8  # (+ its count, score, index)
            expected += vector_bytes
            vector_total += vector_bytes
    stats = opt.stats()
    assert stats["accumulate_on"] == accumulate_on
    assert stats["device_state_bytes"] == expected + (accumulation if accumulate_on == "device" else 0)
    assert topk_ratio <= (expected - vector_total) / (12 * matrix_params) < 1.6 * topk_ratio


@pytest.mark.parametrize("accumulate_on", ["host", "device"])
def test_host_state_bytes_per_unselected_element(accumulate_on, emulated_device):
    """stats()["host_state_bytes"] recomputed from the shapes, per unselected element: fp32 master and moments
    (12), the fp32 accumulators (two, by interval parity, where the host sums: its worker adds into one while
    the update reads the other; one where the device sums, since the update that read it has landed before
    the next boundary's copy), the new weights for upload (two, in the parameter's dtype) and, where the host
    sums, the offloaded gradients (two, by step parity)."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(128, 64, bias=False)).to(torch.bfloat16)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-2, topk_ratio=0.25, update_interval=2, overlap_step=True,
                       accumulate_on=accumulate_on)
    for x in torch.randn(5, 8, 256, dtype=torch.bfloat16):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    per_element = 12 + 2 * 2 + (4 if accumulate_on == "device" else 2 * 4 + 2 * 2)  # state, weights, sums(, grads)
    expected = 0
    for p in model.parameters():
        rows, cols = p.shape[0], p.numel() // p.shape[0]
        unselected = cols - max(1, int(0.25 * cols))
        expected += rows * unselected * per_element
    assert opt.stats()["host_state_bytes"] == expected


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_host_state_stays_on_the_host_whatever_the_default_device(compiled, device):
    """Users build models on the GPU with `torch.set_default_device("cuda")`; the runtime's host buffers, masters
    and indices must still land in host memory (on an H100 they once landed on the GPU and the first step
    failed). Here the default device is `meta` once the test's own tensors are made (on the test device), so
    any tensor the runtime creates without naming its device is a meta tensor, and training fails or goes
    wrong."""
    keys = dict(topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step", select_interval=2)
    model, ref_model = tiny_model(), tiny_model()
    batches = make_batches(6)
    ref = ZenFlowReference(ref_model.parameters(), lr=1e-2, **keys)
    ref_log = train_steps(ref_model, ref, batches)
    with torch.device("meta"):
        opt = ZenFlowAdamW(model.parameters(), lr=1e-2, **keys)
        log = train_steps(torch.compile(model, backend="zenflow") if compiled else model, opt, batches)
        opt.synchronize()
        masters = [opt.master(p) for p in model.parameters()]
        state = opt.state_dict()
    ref.synchronize()
    assert opt.stats()["reselections"] > 0 and opt.stats()["cpu_updates"] > 0
    assert max_param_diff(log.params[-1], ref_log.params[-1]) < value_tolerance(1e-6, 0)["atol"]
    assert all(m.device.type == "cpu" for m in masters)
    assert all(t.device.type == "cpu" for entry in state["state"].values() for t in entry.values()
               if isinstance(t, torch.Tensor))


def test_every_device_mutation_still_applies_to_the_runtime():
    """tests/device_mutations.py edits one line per wait; a line the runtime moved or re-indented would make
    its mutation miss, or match a longer line and break the module, and the wait would go unguarded."""
    import device_mutations

    problems = {m.key: device_mutations.why_not_applicable(m) for m in device_mutations.MUTATIONS}
    assert {key: why for key, why in problems.items() if why is not None} == {}


class _TwoLayers(torch.nn.Module):
    """Two matrices of one shape (one slab); the second takes part only when asked."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(16, 16, generator=generator) / 4)
        self.b = torch.nn.Parameter(torch.randn(16, 16, generator=generator) / 4)

    def forward(self, x, with_b: bool):
        y = x @ self.a.t()
        return (y @ self.b.t() if with_b else y).square().mean()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backwards,compiled", [(1, False), (2, False), (2, True)], ids=["eager", "eager-2", "compiled-2"])
def test_host_sums_of_members_handed_over_apart_wait_for_each_copy(backwards, compiled, emulated_device):
    """One slab whose members arrive apart (one of the two has no gradient at every other step; compiled with
    two backwards a step, each backward hands its gradients over and the later ones go to extra buffers, which
    the step sums): summing on the host, the workers read each offloaded gradient only after its copy's event
    (the emulated device reports a read before its copy landed), and the values equal the reference's."""
    import zenflow_compile.backend  # noqa: F401  (registers backend="zenflow")

    models = [_TwoLayers(), _TwoLayers()]
    keys = dict(lr=1e-2, topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step",
                select_interval=4)
    opts = [ZenFlowAdamW(models[0].parameters(), accumulate_on="host", **keys),
            ZenFlowReference(models[1].parameters(), **keys)]
    runs = ([torch.compile(models[0], backend="zenflow"), torch.compile(models[1], backend="inductor")]
            if compiled else models)  # (the reference compiled by Inductor: the same forward/backward numerics)
    generator = torch.Generator().manual_seed(1)
    for step in range(8):
        xs = [torch.randn(8, 16, generator=generator) for _ in range(backwards)]
        for run, opt in zip(runs, opts):
            for x in xs:
                run(x, with_b=step % 2 == 0).backward()
            opt.step()
            opt.zero_grad()
    assert opts[0].stats()["accumulate_on"] == "host" and opts[0].stats()["cpu_updates"] == 4
    for opt in opts:
        opt.synchronize()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, **value_tolerance(1e-6, 1e-5))


def test_weights_written_after_a_synchronize_wait_for_the_upload_it_queued(emulated_device):
    """A reselection in flight rewrites host rows, so the update it overlaps is uploaded at its apply, here
    by `synchronize()`; weights the user writes next are adopted into the same pinned buffer at the next
    step, which first waits for that upload (the emulated device reports a write under a pending copy). The
    values equal the reference's."""
    emulated_device.delay_ms = 5.0
    keys = dict(lr=1e-2, topk_ratio=0.25, update_interval=2, overlap_step=True, select_strategy="step",
                select_interval=2, overlap_reselect="incoming")
    models = [tiny_model(), tiny_model()]
    opts = [ZenFlowAdamW(models[0].parameters(), accumulate_on="device", **keys),
            ZenFlowReference(models[1].parameters(), **keys)]
    batches = make_batches(8)
    for step, batch in enumerate(batches):
        for model, opt in zip(models, opts):
            loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
            if step in (1, 5):  # a reselecting boundary, its update in flight
                opt.synchronize()
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.5)
    assert opts[0].stats()["reselections"] == 4 and opts[0].stats()["overlapped_boundaries"] == 4
    for opt in opts:
        opt.synchronize()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, **value_tolerance(1e-6, 1e-5))
