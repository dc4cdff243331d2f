"""Shared plumbing for the Triton kernels: optional import, availability, dual (compiled/interpreted) kernels.

Triton is optional: each kernel module falls back to its torch twin where `triton_available(device)` is False.

`triton.jit` picks compiled or interpreted mode once, at decoration, from `TRITON_INTERPRET`; one process needs
both: compiled for CUDA tensors (the interpreter would be handed device addresses), interpreted for CPU
tensors under `TRITON_INTERPRET=1` (no CPU backend). So each kernel is a plain function wrapped lazily in a
`JITFunction` or an `InterpretedFunction` (`DualKernel`).

Rules for one source to serve both modes (and triton 3.6 as well as 3.9):
- only `triton.language` builtins, plus `add_combine` below: the standard library's @jit helpers (tl.sum,
  tl.zeros, ...) were built for one mode at import time and fail in the other;
- `while` loops where a bound is a runtime value: triton 3.6's interpreter cannot pass tensor bounds to
  `range()` under numpy >= 2.4.

The interpreter patches `triton.language` while a kernel runs: compile no Triton kernel on another thread
meanwhile (the runtime's host workers run no Triton code).
"""

import os
import struct
from typing import Callable, Union

import torch

try:  # optional dependency
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction as _JITFunction
except Exception:  # ImportError, or a broken install (no driver libs, ...)
    triton = tl = _JITFunction = None

try:
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except Exception:
    _InterpretedFunction = None

HAVE_TRITON = triton is not None

# Annotation for kernel meta-parameters. A real object, not a string: kernel modules do not use
# `from __future__ import annotations`, so triton sees the class whatever its version parses.
constexpr = tl.constexpr if HAVE_TRITON else None


def triton_available(device: Union[str, torch.device]) -> bool:
    """Whether the Triton kernels can run on `device`: CUDA (compiled), or the CPU under `TRITON_INTERPRET=1`
    (interpreted: for tests, slow)."""
    if not HAVE_TRITON:
        return False
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type  # (called per tensor)
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "cpu":
        return _InterpretedFunction is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"
    return False


class DualKernel:
    """A Triton kernel (a plain Python function) launched compiled on CUDA and interpreted on CPU:
    `DualKernel(fn).on(device)[grid](*args)`."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self._compiled = self._interpreted = None

    def on(self, device: torch.device):
        if not HAVE_TRITON:
            raise RuntimeError("triton is not importable")
        if device.type == "cpu":
            if self._interpreted is None:
                if _InterpretedFunction is None:
                    raise RuntimeError("this triton has no interpreter")
                self._interpreted = _InterpretedFunction(self.fn)
            return self._interpreted
        if self._compiled is None:
            self._compiled = _JITFunction(self.fn)
        return self._compiled


def _add(a, b):
    return a + b


# The combine function for `tl.reduce` sums (the kernels' one non-builtin: see the module docstring).
add_combine = _JITFunction(_add) if HAVE_TRITON else None


def f32(x: float) -> float:
    """`x` rounded to fp32, as torch rounds a Python scalar operand of an fp32 tensor op."""
    return struct.unpack("f", struct.pack("f", x))[0]


def split_f64(x: float) -> tuple:
    """(hi, lo) fp32 pair with hi + lo == x to ~2**-48 relative: Triton passes Python floats as fp32, and the
    bias corrections need lr and the betas in float64 (as torch's Python floats), rebuilt as hi + lo."""
    hi = f32(x)
    return hi, f32(x - hi)
