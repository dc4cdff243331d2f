"""The CPU AdamW of the host rows (`kernels.cpu_adamw_`): each row at its own update count, lr multiplier and
divisor, in any order, against the reference's AdamW; compiled by Inductor into one pass over the rows (above
`kernels.COMPILED_MIN_NUMEL` elements; unfused below it: both are tested here)."""

import gc
import re
import sys
import time
import warnings

import pytest
import torch

from zenflow_compile.reference import adamw_
from zenflow_compile.runtime import kernels
from zenflow_compile.runtime.worker import CpuWorker

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
# Both sides do torch.optim.AdamW's fp32 arithmetic with the same float64 scalars; they may differ in the
# order of a product or in FMA contraction: an fp32 rounding or two of the value (|values| < 8 here).
ULP = torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    """The compiled kernel for the small states here too (a test of the unfused one says `unfused`)."""
    monkeypatch.setattr(kernels, "COMPILED_MIN_NUMEL", 0)


@pytest.fixture(params=["compiled", "unfused"])
def either(request, monkeypatch):
    if request.param == "unfused":
        monkeypatch.setattr(kernels, "COMPILED_MIN_NUMEL", 1 << 62)


def rows_state(rows=37, R=50, seed=0):
    """State in which every row differs: counts 0..60 (bias corrections far apart at small counts), lr
    multipliers with some 0 (rows that take no step), divisors 1..4."""
    g = torch.Generator().manual_seed(seed)
    state = dict(master=torch.randn(rows, R, generator=g), grad=torch.randn(rows, R, generator=g) * 3,
                 exp_avg=torch.randn(rows, R, generator=g) * 0.1, exp_avg_sq=torch.rand(rows, R, generator=g) * 0.1,
                 counts=torch.randint(0, 60, (rows,), generator=g).float())
    state["grad_sq"] = state["grad"].square() + torch.rand(rows, R, generator=g)  # >= grad**2, as sums of squares are
    state["lr_scale"] = torch.rand(rows, generator=g, dtype=torch.float64) * 2
    state["lr_scale"][::5] = 0.0
    state["divisor"] = torch.randint(1, 5, (rows,), generator=g).float()
    return state


def ours(state, squares, order=None):
    s = {name: t.clone() for name, t in state.items()}
    if order is not None:
        s = {name: t[order] for name, t in s.items()}
    weights = torch.empty_like(s["master"], dtype=torch.bfloat16)
    kernels.cpu_adamw_(s["master"], s["grad"], s["exp_avg"], s["exp_avg_sq"], s["counts"], lr_scale=s["lr_scale"],
                       divisor=s["divisor"], weights=weights, grad_sq=s["grad_sq"] if squares else None, **HYPER)
    s["weights"] = weights
    if order is not None:
        s = {name: t[order.argsort()] for name, t in s.items()}
    return s


def reference(state, squares):
    s = {name: t.clone() for name, t in state.items()}
    for i in range(len(s["counts"])):
        scale = float(s["lr_scale"][i])
        if scale == 0.0:
            continue
        column = lambda name: s[name][i].view(-1, 1)  # noqa: E731  (a row is a column of the parameter)
        divisor = s["divisor"][i]
        adamw_(column("master"), column("exp_avg"), column("exp_avg_sq"), s["counts"][i:i + 1],
               column("grad") / divisor, HYPER["lr"] * scale, HYPER["beta1"], HYPER["beta2"], HYPER["eps"],
               HYPER["weight_decay"], grad_sq=column("grad_sq") / divisor if squares else None)
    return s


@pytest.mark.parametrize("squares", [False, True], ids=["adamw", "interval_second_moment"])
def test_each_row_steps_at_its_own_count_lr_and_divisor_as_the_reference(squares, either):
    state = rows_state()
    got, want = ours(state, squares), reference(state, squares)
    for name in ("master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(got[name], want[name], rtol=2 * ULP, atol=2 * ULP * 0.1,
                                   msg=lambda m: f"{name}: {m}")
    assert torch.equal(got["counts"], want["counts"])  # +1 exactly where a row stepped
    resting = state["lr_scale"] == 0
    for name in ("master", "exp_avg", "exp_avg_sq"):  # a row that takes no step is left as it was, bit for bit
        assert torch.equal(got[name][resting], state[name][resting])
    assert torch.equal(got["weights"], got["master"].to(torch.bfloat16))  # every row's weights, resting ones too


def test_rows_of_no_length_still_count_their_step(either):
    """A shard that holds none of a parameter's rows (FSDP, more ranks than rows) has its columns' host rows
    empty; their update counts advance with the other ranks' (a checkpoint consolidates them)."""
    counts = torch.tensor([3.0, 5.0, 0.0])
    empty = torch.zeros(3, 0)
    kernels.cpu_adamw_(empty, empty, empty, empty, counts, lr_scale=torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64),
                       divisor=torch.ones(3), weights=torch.zeros(3, 0, dtype=torch.bfloat16), **HYPER)
    assert counts.tolist() == [4.0, 5.0, 1.0]


def test_a_row_gets_the_same_bits_wherever_it_sits(either):
    """Rows out of count order cost nothing and change nothing: the same row, anywhere, same result."""
    state = rows_state(rows=64, R=48, seed=1)
    in_place = ours(state, squares=False)
    shuffled = ours(state, squares=False, order=torch.randperm(64, generator=torch.Generator().manual_seed(2)))
    for name in ("master", "exp_avg", "exp_avg_sq", "counts", "weights"):
        assert torch.equal(in_place[name], shuffled[name]), name


def test_the_kernel_is_compiled_into_one_pass_over_the_rows():
    """Inductor fuses the AdamW, the resting rows and the cast into one loop over the state, which moves each
    tensor once (read master, grad, m, v; write master, m, v, the bf16 weights): the only buffers it allocates
    are the per-row coefficients ([rows, 4]), no full-size temporary (an unfused cast would write the new
    masters into one and read them back: 8 more bytes per parameter)."""
    from torch._inductor.utils import run_and_get_code

    rows, R = 256, 64
    state = rows_state(rows=rows, R=R)
    compiled = torch.compile(kernels._adamw_rows, fullgraph=True, dynamic=True)
    with torch.no_grad():
        _, code = run_and_get_code(
            compiled, state["master"], state["grad"], state["exp_avg"], state["exp_avg_sq"],
            torch.empty(rows, R, dtype=torch.bfloat16), state["counts"], state["lr_scale"], state["divisor"],
            *(torch.tensor(x, dtype=torch.float64) for x in (1e-2, 0.9, 0.99, 1e-8, 0.1)), None)
    shapes = re.findall(r"empty_strided_cpu\(\(([^)]*)\)", "\n".join(code))
    assert shapes and all(shape.endswith(", 4") for shape in shapes), shapes


def test_without_a_cpp_compiler_the_same_arithmetic_runs_unfused_with_one_warning(monkeypatch, fresh_dynamo):
    from torch._inductor import config

    state = rows_state()
    want = ours(state, squares=True)
    torch._dynamo.reset()  # (compiled again, by the compiler below)
    monkeypatch.setattr(kernels, "_rows_kernel", kernels._CompiledKernel(kernels._adamw_rows, "the CPU AdamW"))
    with config.patch({"cpp.cxx": (None, "/nonexistent/g++"), "fx_graph_cache": False}):
        with pytest.warns(RuntimeWarning, match=r"could not build the CPU AdamW \(.*No working C\+\+ compiler.*\); "
                                                r"it runs unfused.*install one \(g\+\+\)"):
            first = ours(state, squares=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (once: the next calls go straight to the unfused function)
            second = ours(state, squares=True)
    for name in ("master", "exp_avg", "exp_avg_sq", "counts"):
        torch.testing.assert_close(first[name], want[name], rtol=2 * ULP, atol=2 * ULP * 0.1)
        assert torch.equal(first[name], second[name])


def test_the_kernel_lets_the_training_thread_run_while_it_updates():
    """The update runs on a worker thread while the training thread launches the next steps: the kernel must
    not hold the GIL for its length (Inductor's Python wrapper does; its C++ wrapper lets go). Measured as the
    longest pause of a Python loop on this thread while the worker updates 16M parameters, against the length
    of one update (the GIL's switch interval set to 1 ms, well below it)."""
    rows, R = 16384, 1024
    state = {name: t for name, t in rows_state(rows=rows, R=8).items() if t.dim() == 1}
    master, grad, exp_avg, exp_avg_sq = (torch.rand(rows, R) for _ in range(4))
    weights = torch.empty(rows, R, dtype=torch.bfloat16)

    def update():
        kernels.cpu_adamw_(master, grad, exp_avg, exp_avg_sq, state["counts"], lr_scale=state["lr_scale"],
                           divisor=state["divisor"], weights=weights, **HYPER)

    # (on the runtime's update worker: pinned to the cores the training thread does not keep, so a core is free
    # for this thread and only the GIL could stop it)
    worker = CpuWorker("update", pt_reserved_cores_perc=0.5)
    try:
        worker.submit(update).result()  # (compiled, warm)
        started = time.perf_counter()
        worker.submit(update).result()
        one_update = time.perf_counter() - started
        previous = sys.getswitchinterval()
        sys.setswitchinterval(0.001)
        gc.disable()  # (a collection in a long test session pauses this thread too)
        try:
            updates = [worker.submit(update) for _ in range(3)]
            ticks = []
            while not updates[-1].done():
                ticks.append(time.perf_counter())
        finally:
            gc.enable()
            sys.setswitchinterval(previous)
    finally:
        worker.shutdown()
    longest_pause = max(b - a for a, b in zip(ticks, ticks[1:]))
    assert one_update > 0.005  # (long enough to tell a held GIL from a switch)
    assert longest_pause < one_update / 2, (longest_pause, one_update)


def test_a_users_torch_modes_around_the_step_leave_the_kernel_compiled():
    """A user's TorchDispatchMode or TorchFunctionMode around `opt.step()` (a FLOP counter, a debug mode) is
    not traceable by torch.compile in general; the kernel is the optimizer's own work and runs outside them,
    compiled, with no warning (it would otherwise fall back to the unfused function for the whole process)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Watching(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    state = rows_state()
    want = ours(state, squares=False)
    torch._dynamo.reset()  # (compiled again, under the modes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Counting(), Watching():
            got = ours(state, squares=False)
    assert kernels._rows_kernel.failed is None
    for name in ("master", "exp_avg", "exp_avg_sq", "counts", "weights"):
        assert torch.equal(got[name], want[name]), name


def test_a_layout_has_the_update_worker_build_the_kernel_ahead(fresh_dynamo):
    """The first update of a large slab would otherwise wait for the compile (seconds, at a boundary: stall);
    after a layout the update worker builds the variants the slabs' updates need while the steps go on, and no
    later update compiles anything, through reselections (the device sums here: where the host sums, the
    arriving columns take their step on the training thread, a variant built at the first reselection)."""
    from torch._dynamo.utils import counters

    from zenflow_compile import ZenFlowAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(48, 8, bias=False))
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.25, update_interval=2, select_interval=2,
                       accumulate_on="device")

    def step():
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    opt.synchronize()
    built = counters["stats"]["unique_graphs"]
    assert built >= 1
    for _ in range(12):  # (boundaries, each an update on the worker, and reselections)
        step()
    opt.synchronize()
    assert counters["stats"]["unique_graphs"] == built
    assert kernels._rows_kernel.failed is None
