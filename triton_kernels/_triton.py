"""Shared plumbing for the Triton kernels: optional import, availability, dual (compiled/interpreted) kernels.

Triton is optional. Every kernel module keeps a plain-torch reference beside its kernel and falls back to it
when `triton_available(device)` is False.

Why kernels are built twice: `triton.jit` picks compiled or interpreted mode once, at decoration time, from
`TRITON_INTERPRET`. We want both in one process: compiled kernels for CUDA tensors (the interpreter runs on the
host and would be handed device addresses), and interpreted kernels for CPU tensors
(there is no CPU backend) when the user opted in with `TRITON_INTERPRET=1`. So each kernel is a plain Python
function wrapped lazily in a `JITFunction` (CUDA) or an `InterpretedFunction` (CPU), whatever the environment
said when triton was imported.

Rules the kernels follow so that one source serves both modes (and triton 3.6 as well as 3.9):
- only `triton.language` builtins, plus `add_combine` below: the standard library's @jit helpers (tl.sum,
  tl.zeros, ...) were built compiled or interpreted at import time and fail in the other mode;
- `while` loops where a bound is a runtime value: triton 3.6's interpreter cannot pass tensor bounds to
  `range()` under numpy >= 2.4.

Caveat: the interpreter patches `triton.language` while an interpreted kernel runs; do not compile Triton
kernels on another thread at the same time (the runtime's host worker runs no Triton code).
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
    triton = None
    tl = None
    _JITFunction = None

try:
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except Exception:
    _InterpretedFunction = None

HAVE_TRITON = triton is not None

# Annotation for kernel meta-parameters. A real object, not a string: kernel modules do not use
# `from __future__ import annotations`, so triton sees the class whatever its version parses.
constexpr = tl.constexpr if HAVE_TRITON else None

DeviceLike = Union[str, torch.device]

__all__ = ["HAVE_TRITON", "triton", "tl", "constexpr", "triton_available", "DualKernel", "add_combine", "f32",
           "split_f64"]


def triton_available(device: DeviceLike) -> bool:
    """Whether the Triton kernels can run on `device`.

    True on CUDA when triton is importable (compiled kernels), or on CPU when triton is importable and
    `TRITON_INTERPRET=1` is set (the interpreter runs the same kernels on CPU tensors: for tests, slow).
    """
    if not HAVE_TRITON:
        return False
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type  # (called per tensor)
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "cpu":
        return _InterpretedFunction is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"
    return False


class DualKernel:
    """A Triton kernel (a plain Python function) launched compiled on CUDA and interpreted on CPU.

    `kernel[grid](*args)` with `kernel = DualKernel(fn).on(device)`.
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self._compiled = None
        self._interpreted = None

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


# The combine function for `tl.reduce` sums. Kernels use only builtins and this: the standard library's own
# @jit helpers (tl.sum, tl.zeros, ...) were built compiled or interpreted according to the environment at
# import time, so they cannot serve both modes.
add_combine = _JITFunction(_add) if HAVE_TRITON else None


def f32(x: float) -> float:
    """`x` rounded to fp32, as torch rounds a Python scalar operand of an fp32 tensor op."""
    return struct.unpack("f", struct.pack("f", x))[0]


def split_f64(x: float) -> tuple:
    """(hi, lo) fp32 pair with hi + lo == x to ~2**-48 relative.

    Triton passes Python floats as fp32; the bias corrections need lr and the betas in float64 (as
    torch.optim.AdamW computes them in Python floats), so the kernels rebuild them as fp64(hi) + fp64(lo).
    """
    hi = f32(x)
    return hi, f32(x - hi)
