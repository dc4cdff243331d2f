"""A native one-pass kernel for the host accumulator with bf16 / fp16 gradients, built in the background.

`acc (fp32) += coef * grad` (and, with interval_second_moment, `square += (coef * grad)**2`) for a
low-precision gradient has no fast torch spelling: a mixed-dtype `add_` runs ~4x slower here, so
`kernels.accumulate_scaled_many_` converts the gradient through a reused fp32 scratch (an extra write and
read per element: ~65% of the memory-bandwidth bound on one core). This kernel reads the gradient, converts
it in registers (`at::vec`) and updates the accumulators in one pass, over every tensor of the call in one
`at::parallel_for` (which runs with the calling thread's OpenMP thread count: a pinned worker's own).

Results are bitwise those of the chunked path (same fma order as torch's CPU `add_` and `addcmul_`).

How it gets into the process, never in the user's way:
- Nothing happens at import. The first call of `op()` starts one daemon thread that compiles the source
  below with the system C++ compiler in a subprocess (~10 s; it inherits the calling thread's core
  affinity, so from the accumulate worker it runs on the worker cores) into torch's extension cache
  (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions/...), under a name keyed by the source, torch
  version, compiler and flags; the file is written under a temporary name and renamed, so concurrent
  processes never load a half-written library. A cached library is just loaded (`torch.ops.load_library`).
- Until the library is loaded, and wherever it cannot be (no compiler, a failed build, not Linux, or
  `ZENFLOW_NATIVE_ACCUMULATE=0`), `op()` returns None and the caller keeps the chunked torch path; why is
  logged once at INFO. Training never waits for the build.
- No Python bindings: the kernel registers `torch.ops.zenflow_native.accumulate_scaled_` (schema-checked,
  the GIL released while it runs), so no pybind11 and no ninja are needed.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

ENV_SWITCH = "ZENFLOW_NATIVE_ACCUMULATE"  # "0" / "off" / "false": never build or load (the chunked path)
BUILD_TIMEOUT_S = 600.0
LIBRARY_NAMESPACE = "zenflow_native"

# torch's own flags for its per-capability kernels (the at::vec headers pick their implementation from
# CPU_CAPABILITY_*); the build targets the capability torch dispatches to on this machine.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

SOURCE = r"""// acc (fp32) += coef * float(grad), optionally square (fp32) += (coef^2 * float(grad)) * float(grad), for
// bf16 / fp16 gradients in one pass (read grad, read + write acc and square): runtime/native_accumulate.py
// builds and loads this file; kernels.accumulate_scaled_many_ calls it.
//
// Same arithmetic as the chunked torch path it replaces (bitwise, measured): torch's add_(x, alpha=c) is
// fmadd(x, c, acc) per element and its addcmul_(x, x, value=c2) fmadd(c2 * x, x, square); the fmas are
// spelled out and the file is built with -ffp-contract=off, so the compiler fuses nothing else.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using FVec = at::vec::Vectorized<float>;

template <typename scalar_t, bool kSquare>
void accumulate_span(float* acc, const scalar_t* grad, float* square, int64_t n, float coef, float coef_sq) {
  const FVec coef_vec(coef), coef_sq_vec(coef_sq);
  int64_t i = 0;
  for (; i + FVec::size() <= n; i += FVec::size()) {
    FVec g;
    at::vec::load_to_float<scalar_t>(grad + i, g);
    at::vec::fmadd(g, coef_vec, FVec::loadu(acc + i)).store(acc + i);
    if constexpr (kSquare) {
      at::vec::fmadd(coef_sq_vec * g, g, FVec::loadu(square + i)).store(square + i);
    }
  }
  for (; i < n; ++i) {  // the tail: the same operations on scalars
    const float g = static_cast<float>(grad[i]);
    acc[i] = std::fma(g, coef, acc[i]);
    if constexpr (kSquare) {
      square[i] = std::fma(coef_sq * g, g, square[i]);
    }
  }
}

template <bool kSquare>
void accumulate_tensor_span(const at::Tensor& acc, const at::Tensor& grad, const at::Tensor* square, int64_t begin,
                            int64_t end, float coef, float coef_sq) {
  float* acc_ptr = acc.data_ptr<float>() + begin;
  float* square_ptr = kSquare ? square->data_ptr<float>() + begin : nullptr;
  if (grad.scalar_type() == at::kBFloat16) {
    accumulate_span<at::BFloat16, kSquare>(acc_ptr, grad.const_data_ptr<at::BFloat16>() + begin, square_ptr,
                                           end - begin, coef, coef_sq);
  } else {
    accumulate_span<at::Half, kSquare>(acc_ptr, grad.const_data_ptr<at::Half>() + begin, square_ptr, end - begin,
                                       coef, coef_sq);
  }
}

void check_pair(const at::Tensor& acc, const at::Tensor& grad, const at::Tensor* square, size_t index) {
  TORCH_CHECK(acc.device().is_cpu() && grad.device().is_cpu(), "accumulate_scaled_: tensor pair ", index,
              " is not on the CPU");
  TORCH_CHECK(acc.scalar_type() == at::kFloat, "accumulate_scaled_: accs[", index, "] is ", acc.scalar_type(),
              ", expected float32");
  TORCH_CHECK(grad.scalar_type() == at::kBFloat16 || grad.scalar_type() == at::kHalf, "accumulate_scaled_: grads[",
              index, "] is ", grad.scalar_type(), ", expected bfloat16 or float16");
  TORCH_CHECK(acc.numel() == grad.numel(), "accumulate_scaled_: accs[", index, "] has ", acc.numel(),
              " elements, grads[", index, "] ", grad.numel());
  TORCH_CHECK(acc.is_contiguous() && grad.is_contiguous(), "accumulate_scaled_: accs[", index, "] and grads[", index,
              "] must be contiguous");
  if (square != nullptr) {
    TORCH_CHECK(square->device().is_cpu() && square->scalar_type() == at::kFloat &&
                    square->numel() == acc.numel() && square->is_contiguous(),
                "accumulate_scaled_: squares[", index, "] must be a contiguous CPU float32 tensor of ", acc.numel(),
                " elements");
  }
}

template <bool kSquare>
void accumulate_all(at::TensorList accs, at::TensorList grads, at::TensorList squares, float coef, float coef_sq) {
  // One parallel region over all tensors' elements, end to end (the calling thread's OpenMP thread count:
  // a pinned worker's own).
  std::vector<int64_t> offsets(accs.size() + 1, 0);
  for (size_t k = 0; k < accs.size(); ++k) {
    offsets[k + 1] = offsets[k] + accs[k].numel();
  }
  at::parallel_for(0, offsets.back(), /*grain_size=*/1 << 16, [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    for (; k < accs.size() && offsets[k] < end; ++k) {
      const int64_t lo = std::max(begin, offsets[k]) - offsets[k];
      const int64_t hi = std::min(end, offsets[k + 1]) - offsets[k];
      if (lo < hi) {
        accumulate_tensor_span<kSquare>(accs[k], grads[k], kSquare ? &squares[k] : nullptr, lo, hi, coef, coef_sq);
      }
    }
  });
}

void accumulate_scaled_(at::TensorList accs, at::TensorList grads, double coef, at::TensorList squares) {
  TORCH_CHECK(accs.size() == grads.size(), "accumulate_scaled_: ", accs.size(), " accs but ", grads.size(), " grads");
  const bool with_squares = !squares.empty();
  TORCH_CHECK(!with_squares || squares.size() == accs.size(), "accumulate_scaled_: ", squares.size(),
              " squares for ", accs.size(), " accs (pass one per acc, or none)");
  for (size_t k = 0; k < accs.size(); ++k) {
    check_pair(accs[k], grads[k], with_squares ? &squares[k] : nullptr, k);
  }
  // As torch's Scalar -> float conversions: alpha = float(coef), value = float(coef * coef) (product in double).
  const float coef_f = static_cast<float>(coef), coef_sq_f = static_cast<float>(coef * coef);
  if (with_squares) {
    accumulate_all<true>(accs, grads, squares, coef_f, coef_sq_f);
  } else {
    accumulate_all<false>(accs, grads, squares, coef_f, coef_sq_f);
  }
}

}  // namespace

TORCH_LIBRARY(zenflow_native, m) {
  m.def("accumulate_scaled_(Tensor(a!)[] accs, Tensor[] grads, float coef, Tensor(b!)[] squares) -> ()");
}

TORCH_LIBRARY_IMPL(zenflow_native, CPU, m) {
  m.impl("accumulate_scaled_", &accumulate_scaled_);
}
"""


class _Native:
    """The kernel's process-wide state: not started, building, ready (op set) or unavailable (reason set)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.started = False
        self.done = threading.Event()
        self.op: Optional[Callable[..., None]] = None
        self.reason: Optional[str] = None
        self.library: Optional[Path] = None
        self.build_process: Optional[subprocess.Popen] = None


_native = _Native()


def op() -> Optional[Callable[..., None]]:
    """The loaded kernel, `op(accs, grads, coef, squares)` (squares: [] for none); None while it is not
    (yet) available. The first call starts the background build or load and returns at once."""
    if _native.op is None and not _native.started:
        _start()
    return _native.op


def wait_until_ready(timeout: Optional[float] = None) -> Optional[Callable[..., None]]:
    """`op()`, after waiting up to `timeout` seconds for the build (benchmarks and tests; the runtime never
    waits)."""
    op()
    _native.done.wait(timeout)
    return _native.op


def unavailable_reason() -> Optional[str]:
    """Why the kernel is not used (None while building or once loaded)."""
    return _native.reason


def library_path() -> Optional[Path]:
    return _native.library


def _start() -> None:
    with _native.lock:
        if _native.started:
            return
        _native.started = True
    switch = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if switch in ("0", "off", "false", "no"):
        _give_up(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]}")
        return
    threading.Thread(target=_build_and_load, name="zenflow-native-build", daemon=True).start()


def _give_up(reason: str) -> None:
    _native.reason = reason
    log.info("zenflow_compile: native bf16/fp16 gradient accumulation not used (%s); using the chunked torch path",
             reason)
    _native.done.set()


class _Unavailable(Exception):
    pass


def _build_and_load() -> None:
    try:
        library = _build_plan()
        if not library["path"].exists():
            _compile(library)
        torch.ops.load_library(str(library["path"]))
        _native.library = library["path"]
        _native.op = getattr(torch.ops, LIBRARY_NAMESPACE).accumulate_scaled_.default
        log.info("zenflow_compile: native bf16/fp16 gradient accumulation loaded from %s", library["path"])
        _native.done.set()
    except _Unavailable as error:
        _give_up(str(error))
    except Exception as error:  # noqa: BLE001 - any failure means: keep the torch path, say why
        _give_up(f"{type(error).__name__}: {error}")


def _build_plan() -> dict:
    """Compiler command and cache location; the name is keyed by everything the binary depends on."""
    if not sys.platform.startswith("linux"):
        raise _Unavailable(f"built only on Linux (this is {sys.platform})")
    if "OpenMP" not in torch.__config__.parallel_info():
        raise _Unavailable("torch's parallel backend is not OpenMP (the kernel's thread count would not follow "
                           "the worker's)")
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler or not shutil.which(compiler):
        raise _Unavailable("no C++ compiler found (set CXX or install g++)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise _Unavailable(f"{compiler} --version failed: {error}")
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _CAPABILITY_FLAGS:
        capability = "DEFAULT"  # portable build: at::vec's generic implementation
    flags = ["-O3", "-std=c++20", "-fPIC", "-shared", "-ffp-contract=off", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}", *_CAPABILITY_FLAGS.get(capability, [])]
    flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    libraries = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu"]
    key = hashlib.sha256("\0".join([SOURCE, torch.__version__, str(torch.version.git_version), compiler, version,
                                     *flags, *libraries]).encode()).hexdigest()[:16]
    name = f"zenflow_accumulate_{key}"
    directory = Path(cpp_extension._get_build_directory("zenflow_accumulate", verbose=False))
    return dict(name=name, path=directory / f"{name}.so", source=directory / f"{name}.cpp", compiler=compiler,
                flags=flags, libraries=libraries)


def _compile(library: dict) -> None:
    suffix = f".tmp{os.getpid()}.{threading.get_ident()}"
    source_tmp = library["source"].with_name(library["source"].name + suffix)
    source_tmp.write_text(SOURCE)
    os.replace(source_tmp, library["source"])
    output_tmp = library["path"].with_name(library["path"].name + suffix)
    command = [library["compiler"], *library["flags"], str(library["source"]), "-o", str(output_tmp),
               *library["libraries"]]
    if shutil.which("nice"):
        command = ["nice", "-n", "10", *command]  # below the training process
    log.info("zenflow_compile: building the native accumulation kernel in the background: %s", library["path"])
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # its own group: stopped with its children at exit
    _native.build_process = process
    try:
        output, _ = process.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop_build()
        output_tmp.unlink(missing_ok=True)
        raise _Unavailable(f"the build took over {BUILD_TIMEOUT_S:.0f} s and was stopped")
    finally:
        _native.build_process = None
    if process.returncode != 0:
        output_tmp.unlink(missing_ok=True)
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise _Unavailable(f"the build failed (exit {process.returncode}): {tail}")
    os.replace(output_tmp, library["path"])  # atomic: other processes see no file or a whole one


@atexit.register
def _stop_build() -> None:
    """Stop a build still running (the compiler and its children), so none outlives the process."""
    process = _native.build_process
    if process is not None and process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass
        process.wait()
