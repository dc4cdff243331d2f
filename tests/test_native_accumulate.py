"""The native bf16/fp16 accumulation kernel (runtime/native_accumulate.py) behind
`kernels.accumulate_scaled_many_`: the same numbers as the chunked torch path and a float64 recomputation,
its refusals, and how it is built and loaded (never at import, never in the way, cached, safe across
processes, a failed or impossible build falls back).

The kernel is built once for the session (the `native_op` fixture, ~10 s on 2 cores without a cache) into
torch's extension cache. The subprocess tests use their own empty cache (TORCH_EXTENSIONS_DIR); one of them
builds a variant of the kernel, the others build nothing or fail on purpose."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from zenflow_compile.runtime import kernels, native_accumulate

# Sizes around the vector width (16 floats on AVX512, 8 on AVX2) and across the parallel grain (65536).
ODD_SIZES = (1, 7, 15, 16, 17, 33, 1000, 65536 + 3, 3 * 65536 - 5)
COEFS = (1.0, 0.37)


@pytest.fixture(scope="session")
def native_op():
    op = native_accumulate.wait_until_ready(native_accumulate.BUILD_TIMEOUT_S)
    reason = native_accumulate.unavailable_reason() or ""
    if op is None and ("no C++ compiler" in reason or "ninja not found" in reason):
        pytest.skip(f"{reason}: the runtime keeps the chunked path (tested below)")
    assert op is not None, f"the native kernel did not load: {reason or 'still building'}"
    return op


def _tensors(dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=generator).to(dtype) for n in ODD_SIZES]
    accs = [torch.randn(n, generator=generator) for n in ODD_SIZES]
    squares = [torch.rand(n, generator=generator) for n in ODD_SIZES]
    return accs, grads, squares


def _clone(tensors):
    return [t.clone() for t in tensors]


def _chunked(accs, grads, coef, squares):
    for acc, grad, square in zip(accs, grads, squares or [None] * len(accs)):
        kernels._accumulate_converted_(acc, grad, coef, square)


def _within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int) -> bool:
    spacing = torch.nextafter(expected.abs(), torch.tensor(float("inf"))) - expected.abs()
    return bool(((actual - expected).abs() <= ulps * spacing).all())


def _fused_mul_add_matches_torch() -> bool:
    """torch's CPU addcmul_ is one fma per element where its kernels are built for AVX2/AVX512 (-mfma)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_squares", [False, True])
@pytest.mark.parametrize("coef", COEFS)
def test_native_equals_chunked_path_and_float64(native_op, dtype, with_squares, coef):
    accs, grads, squares = _tensors(dtype)
    native_accs, native_squares = _clone(accs), _clone(squares) if with_squares else None
    chunked_accs, chunked_squares = _clone(accs), _clone(squares) if with_squares else None

    native_op(native_accs, grads, coef, native_squares or [])
    _chunked(chunked_accs, grads, coef, chunked_squares)

    coef32 = float(torch.tensor(coef, dtype=torch.float32))  # the fp32 math both paths do
    coef_sq32 = float(torch.tensor(coef * coef, dtype=torch.float32))
    for k in range(len(ODD_SIZES)):
        assert torch.equal(native_accs[k], chunked_accs[k]), f"acc differs from the chunked path at size {ODD_SIZES[k]}"
        g = grads[k].double()
        assert _within_ulps(native_accs[k], (accs[k].double() + coef32 * g).float(), 1)
        if with_squares:
            if _fused_mul_add_matches_torch():
                assert torch.equal(native_squares[k], chunked_squares[k]), f"square differs at size {ODD_SIZES[k]}"
            else:
                assert _within_ulps(native_squares[k], chunked_squares[k], 1)
            assert _within_ulps(native_squares[k], (squares[k].double() + coef_sq32 * g * g).float(), 1)


def test_native_is_the_same_on_two_threads(native_op):
    accs, grads, squares = _tensors(torch.bfloat16, seed=1)
    one = (_clone(accs), _clone(squares))
    two = (_clone(accs), _clone(squares))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        native_op(one[0], grads, 0.5, one[1])
        torch.set_num_threads(2)  # the split falls inside and across tensors
        native_op(two[0], grads, 0.5, two[1])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one[0] + one[1], two[0] + two[1]))


def test_accumulate_scaled_many_takes_the_native_kernel(native_op, monkeypatch):
    """Mixed fp32 and bf16 gradients, with square accumulators: the runtime's entry point sends the bf16 ones to
    the native kernel in one call (the chunked path is not touched) and the fp32 ones to _foreach_add_."""
    accs, grads, squares = _tensors(torch.bfloat16, seed=2)
    grads[1], grads[4] = grads[1].float(), grads[4].float()
    expected_accs, expected_squares = _clone(accs), _clone(squares)
    for acc, grad, square in zip(expected_accs, grads, expected_squares):
        if grad.dtype == torch.float32:
            acc.add_(grad, alpha=0.25)
            square.addcmul_(grad, grad, value=0.25 * 0.25)
        else:
            kernels._accumulate_converted_(acc, grad, 0.25, square)

    def chunked_path_used(*args, **kwargs):
        raise AssertionError("the chunked path ran although the native kernel is loaded")

    monkeypatch.setattr(kernels, "_accumulate_converted_", chunked_path_used)
    kernels.accumulate_scaled_many_(accs, grads, 0.25, square_accs=squares)
    assert all(torch.equal(a, b) for a, b in zip(accs + squares, expected_accs + expected_squares))


def test_chunked_path_while_the_kernel_is_not_loaded(monkeypatch):
    monkeypatch.setattr(native_accumulate, "op", lambda: None)  # building, or unavailable
    accs, grads, squares = _tensors(torch.float16, seed=3)
    expected_accs, expected_squares = _clone(accs), _clone(squares)
    kernels.accumulate_scaled_many_(accs, grads, 0.37, square_accs=squares)
    coef_sq32 = float(torch.tensor(0.37 * 0.37, dtype=torch.float32))
    for acc, expected, square, expected_square, grad in zip(accs, expected_accs, squares, expected_squares, grads):
        g = grad.double()
        assert _within_ulps(acc, (expected.double() + float(torch.tensor(0.37)) * g).float(), 1)
        assert _within_ulps(square, (expected_square.double() + coef_sq32 * g * g).float(), 1)


def test_refuses_non_contiguous_and_mismatched_arguments(native_op):
    acc = torch.zeros(8, 6)
    grad = torch.randn(6, 8).bfloat16().t()  # [8, 6], not contiguous
    with pytest.raises(ValueError, match="must be contiguous"):
        kernels.accumulate_scaled_many_([acc], [grad], 1.0)
    with pytest.raises(RuntimeError, match=r"accs\[0\] and grads\[0\] must be contiguous"):
        native_op([acc], [grad], 1.0, [])
    with pytest.raises(RuntimeError, match=r"accs\[0\] has 48 elements, grads\[0\] 47"):
        native_op([acc], [torch.zeros(47, dtype=torch.bfloat16)], 1.0, [])
    with pytest.raises(RuntimeError, match=r"grads\[0\] is Float, expected bfloat16 or float16"):
        native_op([acc], [torch.zeros(8, 6)], 1.0, [])
    with pytest.raises(RuntimeError, match=r"1 squares for 2 accs"):
        native_op([acc, acc], [grad.contiguous()] * 2, 1.0, [torch.zeros(8, 6)])
    with pytest.raises(ValueError, match="1 square_accs for 2 accs"):
        kernels.accumulate_scaled_many_([acc, acc], [grad.contiguous()] * 2, 1.0, square_accs=[torch.zeros(8, 6)])


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **env})
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def _probe(setup: str = "") -> str:
    """A process that accumulates before and after the kernel is ready (`setup` runs before the first call)."""
    return textwrap.dedent("""
        import logging, threading, torch
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        from zenflow_compile.runtime import kernels, native_accumulate
        assert not any(t.name == "zenflow-native-build" for t in threading.enumerate()), "started at import"
    """) + textwrap.dedent(setup) + textwrap.dedent("""
        acc, grad = torch.zeros(100), torch.full((100,), 0.5, dtype=torch.bfloat16)
        kernels.accumulate_scaled_many_([acc], [grad], 2.0)  # starts the build or load, runs the chunked path
        op = native_accumulate.wait_until_ready(600)  # (a build on a loaded 2-core machine took over 120 s)
        kernels.accumulate_scaled_many_([acc], [grad], 2.0)
        assert torch.equal(acc, torch.full((100,), 2.0)), acc
        print("native:", op is not None, "| reason:", native_accumulate.unavailable_reason())
    """)


# Another kernel source: another extension, built in the test's own cache.
_VARIANT = 'native_accumulate.SOURCE += "\\n// a variant\\n"\n'
_NO_BUILD_TOOLS = 'import sys; sys.modules["ninja"] = None  # no pip ninja either\n'


def _compiles(directory) -> int:
    """How many times ninja compiled the extension in `directory` (its log's entries for the object file)."""
    entries = [line.split("\t") for line in (directory / ".ninja_log").read_text().splitlines()
               if not line.startswith("#")]
    return sum(entry[3].endswith(".o") for entry in entries)


def test_cached_kernel_is_loaded_without_a_build(native_op, tmp_path):
    """A second process loads the session's library as it is: no compiler or ninja reachable, nothing rebuilt."""
    library = native_accumulate.library_path()
    built_at = library.stat().st_mtime_ns
    proc = _run_python(_probe(_NO_BUILD_TOOLS), PATH=str(tmp_path), CXX=str(tmp_path / "c++"))
    assert "native: True" in proc.stdout
    assert f"loaded from {library}" in proc.stderr and "building" not in proc.stderr, proc.stderr
    assert library.stat().st_mtime_ns == built_at


def test_switched_off_keeps_the_chunked_path(tmp_path):
    proc = _run_python(_probe(), ZENFLOW_NATIVE_ACCUMULATE="0", TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert "native: False | reason: ZENFLOW_NATIVE_ACCUMULATE=0" in proc.stdout
    assert "using the chunked torch path" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing built


def test_failed_build_falls_back_and_says_why(tmp_path):
    """A compiler that fails on the source, in an empty cache: torch's build fails, the accumulation stays
    right, the compiler's message is logged once, and the lock is released."""
    real = shutil.which(os.environ.get("CXX", "c++"))
    if real is None:
        pytest.skip("no C++ compiler")
    failing = tmp_path / "bin" / "g++"
    failing.parent.mkdir()
    failing.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) echo "error: broken on purpose" >&2; exit 1;; esac\n'
                       f'exec {real} "$@"\n')
    failing.chmod(0o755)
    cache = tmp_path / "cache"
    proc = _run_python(_probe(), CXX=str(failing), TORCH_EXTENSIONS_DIR=str(cache))
    assert "native: False | reason: the build failed (exit 1)" in proc.stdout
    assert "error: broken on purpose" in proc.stdout
    assert proc.stderr.count("using the chunked torch path") == 1
    assert not list(cache.rglob("*.so")) and not list(cache.rglob("lock"))


def test_without_ninja_keeps_the_chunked_path(tmp_path):
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    proc = _run_python(_probe(_NO_BUILD_TOOLS), PATH=str(tmp_path), CXX=compiler,
                       TORCH_EXTENSIONS_DIR=str(tmp_path / "cache"))
    assert "native: False | reason: ninja not found" in proc.stdout
    assert not list((tmp_path / "cache").rglob("*.cpp"))  # gave up before writing anything


def test_a_lock_left_by_a_killed_build_ends_the_wait(tmp_path):
    proc = _run_python(_probe("""
        native_accumulate.BUILD_TIMEOUT_S = 2
        name, directory, _ = native_accumulate._extension()
        (directory / "lock").touch()  # as torch's build leaves it when killed
    """), TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert "native: False | reason: no library after 2 s" in proc.stdout
    assert f"remove {next(tmp_path.glob('*/lock'))}" in proc.stdout


def test_processes_share_one_build_that_outlives_its_starter(native_op, tmp_path):
    """A changed source builds a new extension. The process that starts its build exits at once; a second one
    arriving meanwhile waits on torch's lock and loads the same library: one compile, no lock left behind."""
    starter = _VARIANT + textwrap.dedent("""
        import time
        native_accumulate.op()
        name, directory, _ = native_accumulate._extension()
        deadline = time.monotonic() + 120
        while not (directory / "lock").exists() and time.monotonic() < deadline:  # the build takes torch's lock
            time.sleep(0.01)
        print("exiting while the build runs" if (directory / "lock").exists() else "no build seen")
    """)
    code = textwrap.dedent("""
        import logging
        logging.basicConfig(level=logging.INFO)
        from zenflow_compile.runtime import native_accumulate
    """) + starter
    assert "exiting while the build runs" in _run_python(code, TORCH_EXTENSIONS_DIR=str(tmp_path)).stdout
    (directory,) = tmp_path.iterdir()
    assert directory.name != native_accumulate.library_path().parent.name  # not the session's library
    assert (directory / "lock").exists()  # the build goes on without the process that started it
    proc = _run_python(_probe(_VARIANT), TORCH_EXTENSIONS_DIR=str(tmp_path))
    assert "native: True" in proc.stdout, proc.stderr
    assert _compiles(directory) == 1
    assert not (directory / "lock").exists() and not list(directory.glob("*.tmp"))
