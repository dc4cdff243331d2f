"""A native one-pass kernel for the host accumulator with bf16 / fp16 gradients, built in the background.

`acc (fp32) += coef * grad` (and, with interval_second_moment, `square += (coef * grad)**2`) for a
low-precision gradient has no fast torch spelling: a mixed-dtype `add_` runs ~4x slower here, so
`kernels.accumulate_scaled_many_` converts the gradient through a reused fp32 scratch (an extra write and
read per element: ~65% of the memory-bandwidth bound on one core). This kernel reads the gradient, converts
it in registers (`at::vec`) and updates the accumulators in one pass, over every tensor of the call in one
`at::parallel_for` (which runs with the calling thread's OpenMP thread count: a pinned worker's own).

Results are bitwise those of the chunked path (same fma order as torch's CPU `add_` and `addcmul_`).

How it gets into the process, never in the user's way:
- Nothing happens at import. The first call of `op()` starts one daemon thread, which loads the library
  from torch's extension cache (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions/...) or, if it
  is not there, first builds it with torch's own `cpp_extension.load` (ninja and the system C++ compiler,
  ~10 s) in a child process, `nice`d, on the calling thread's cores. The extension's name is a hash of the
  source, torch version and flags: any change builds a new library beside the old one.
- Concurrent processes: torch's build holds a lock file in the extension's directory while it runs; the
  others wait for it, then load. The build runs in a child process so that it finishes and removes the lock
  even if this process exits first (a dying thread would leave the lock, and later processes would wait
  on it). A lock left by a killed build ends the wait after BUILD_TIMEOUT_S; the reason names it.
- Until the library is loaded, and wherever it cannot be (no compiler, no ninja, a failed build, not
  Linux, or `ZENFLOW_NATIVE_ACCUMULATE=0`), `op()` returns None and the caller keeps the chunked torch path;
  why is logged once at INFO. Training never waits for the build.
- No Python bindings: the kernel registers `torch.ops.zenflow_native.accumulate_scaled_` (schema-checked,
  the GIL released while it runs), so no pybind11 is compiled.
"""

from __future__ import annotations

import hashlib
import json
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

# The child process: torch's build (under its lock file); the parent loads the library.
_BUILD_SCRIPT = """
import json, os, signal, sys
signal.alarm(int(sys.argv[2]))  # bounds a wait on a lock file left by a killed build
os.nice(10)  # below the training process; ninja and the compiler inherit it
from torch.utils.cpp_extension import load
try:
    load(**json.loads(sys.argv[1]))
except Exception as error:
    sys.exit(f"{type(error).__name__}: {error}")
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
        library = _cached_or_built()
        torch.ops.load_library(str(library))
        _native.library = library
        _native.op = getattr(torch.ops, LIBRARY_NAMESPACE).accumulate_scaled_.default
        log.info("zenflow_compile: native bf16/fp16 gradient accumulation loaded from %s", library)
        _native.done.set()
    except _Unavailable as error:
        _give_up(str(error))
    except Exception as error:  # noqa: BLE001 - any failure means: keep the torch path, say why
        _give_up(f"{type(error).__name__}: {error}")


def _extension() -> tuple[str, Path, list[str]]:
    """The extension's name (keyed by everything the library depends on), directory and compiler flags."""
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in _CAPABILITY_FLAGS:
        capability = "DEFAULT"  # portable build: at::vec's generic implementation
    flags = ["-O3", "-ffp-contract=off", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}",
             *_CAPABILITY_FLAGS.get(capability, [])]
    key = hashlib.sha256("\0".join([SOURCE, torch.__version__, str(torch.version.git_version), *flags]).encode())
    name = f"zenflow_accumulate_{key.hexdigest()[:16]}"
    return name, Path(cpp_extension._get_build_directory(name, verbose=False)), flags


def _cached_or_built() -> Path:
    """The library in torch's extension cache, built first if it is not there."""
    if not sys.platform.startswith("linux"):
        raise _Unavailable(f"built only on Linux (this is {sys.platform})")
    if "OpenMP" not in torch.__config__.parallel_info():
        raise _Unavailable("torch's parallel backend is not OpenMP (the kernel's thread count would not follow "
                           "the worker's)")
    from torch.utils.cpp_extension import LIB_EXT

    name, directory, flags = _extension()
    library, lock = directory / f"{name}{LIB_EXT}", directory / "lock"
    if library.exists() and not lock.exists():
        return library

    path = _tool_path()
    compiler = os.environ.get("CXX", "c++")  # what torch's build runs
    if not shutil.which(compiler, path=path):
        raise _Unavailable(f"no C++ compiler found ({compiler!r}; set CXX or install g++)")
    if not shutil.which("ninja", path=path):
        raise _Unavailable("ninja not found (torch's extension build needs it: pip install ninja)")
    source = directory / f"{name}.cpp"
    if not source.exists():  # written whole, then renamed: a concurrent build never reads half a file
        partial = source.with_name(f"{source.name}.{os.getpid()}.tmp")
        partial.write_text(SOURCE)
        os.replace(partial, source)
    log.info("zenflow_compile: building the native accumulation kernel in the background: %s", library)
    arguments = dict(name=name, sources=[str(source)], extra_cflags=flags, build_directory=str(directory),
                     is_python_module=False)
    seconds = str(max(1, round(BUILD_TIMEOUT_S)))
    build = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, json.dumps(arguments), seconds], capture_output=True,
                           text=True, env={**os.environ, "PATH": path})
    if build.returncode == -signal.SIGALRM:
        raise _Unavailable(f"no library after {BUILD_TIMEOUT_S:.0f} s: the build is still running or a killed "
                           f"build left its lock file (remove {lock} if no build is running)")
    if build.returncode != 0:
        tail = "\n".join(build.stderr.strip().splitlines()[-15:])
        raise _Unavailable(f"the build failed (exit {build.returncode}): {tail}")
    return library


def _tool_path() -> str:
    """PATH with the pip `ninja` package's binary first: found even where its venv is not activated."""
    path = os.environ.get("PATH", os.defpath)
    try:
        import ninja
    except ImportError:
        return path  # a system ninja, if any
    return os.pathsep.join([ninja.BIN_DIR, path])
