"""Core reservation: keep the host workers off the cores the training thread needs (`pt_reserved_cores_perc`).

As DeepSpeed ZenFlow (`deepspeed/runtime/zenflow/zenflow_utils.py::_split_affinity`): of the cores this process
may run on, the first ceil(perc * n) are the training thread's, the rest the host workers'; a reserve of no core
or of every core isolates nothing (both sides share all cores). The workers are threads, so only they are
pinned: the training thread and its intra-op pool keep their affinity and thread count.

Per thread (Linux, torch's OpenMP backend): `os.sched_setaffinity(0, cores)` binds the calling thread, and the
OpenMP team it creates inherits the mask. `torch.set_num_threads` would also set a process-wide value that
threads started later read, so the count is set with `omp_set_num_threads` (per thread; torch reads it back
as `omp_get_max_threads()`), after torch's per-thread lazy initialisation, which would overwrite it.
Best effort: what could not be applied is said in `ThreadPlacement.notes`.
"""

from __future__ import annotations

import ctypes
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class CoreSplit:
    """Which cores the training thread keeps and which the host workers may use."""

    training: tuple[int, ...]
    workers: tuple[int, ...]

    @property
    def isolated(self) -> bool:
        """True when the workers are kept off the training cores (False: both share every core)."""
        return not set(self.training) & set(self.workers)


@dataclass(frozen=True)
class ThreadPlacement:
    """What `pin_current_thread` applied to the calling thread (None: left as it was)."""

    cores: Optional[tuple[int, ...]]
    num_threads: Optional[int]
    notes: tuple[str, ...] = ()


def available_cores() -> tuple[int, ...]:
    """The cores the calling thread may run on (its affinity), or all logical cores where that is unknown."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def split_cores(cores: Sequence[int], pt_reserved_cores_perc: float) -> CoreSplit:
    """Reserve the first ceil(perc * n) of `cores` for training, the rest for the workers, the product taken
    as the exact decimal (0.3 of 10 cores reserves 3, not float rounding's 4), like the top-k count."""
    if not 0.0 <= pt_reserved_cores_perc <= 1.0:
        raise ValueError(f"pt_reserved_cores_perc={pt_reserved_cores_perc!r} is outside [0, 1]: pass the fraction "
                         "of cores reserved for the training thread, e.g. 0.5")
    cores = tuple(sorted(cores))
    if not cores:
        raise ValueError("split_cores needs at least one core")
    reserved = math.ceil(Fraction(str(pt_reserved_cores_perc)) * len(cores))
    if 0 < reserved < len(cores):
        return CoreSplit(training=cores[:reserved], workers=cores[reserved:])
    return CoreSplit(training=cores, workers=cores)


def worker_split(pt_reserved_cores_perc: float) -> CoreSplit:
    """The split of the calling (training) thread's cores: what the runtime's workers are pinned to."""
    return split_cores(available_cores(), pt_reserved_cores_perc)


def _openmp_runtimes() -> list[ctypes.CDLL]:
    """The OpenMP runtimes mapped into this process (libgomp, libiomp5, libomp): there can be several (torch's
    bundled libgomp beside the system's); the one torch uses is found by setting each."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return []
    runtimes = []
    for path in sorted(paths):
        name = os.path.basename(path)
        if name.startswith(("libgomp", "libiomp", "libomp")) and ".so" in name:
            try:
                library = ctypes.CDLL(path)
                library.omp_set_num_threads.argtypes = [ctypes.c_int]
                runtimes.append(library)
            except (OSError, AttributeError):
                continue
    return runtimes


def pin_current_thread(cores: Sequence[int], num_threads: int) -> ThreadPlacement:
    """Bind the calling thread to `cores` and make its torch ops use `num_threads` threads (this thread only).
    Call it first on a fresh thread (before any parallel torch op creates its OpenMP team). Never raises."""
    notes = []
    applied_cores: Optional[tuple[int, ...]] = None
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, set(cores))
            applied_cores = tuple(sorted(os.sched_getaffinity(0)))
        except OSError as error:
            notes.append(f"affinity not set ({error})")
    else:
        notes.append("affinity not set: os.sched_setaffinity is not available on this platform")

    applied_threads: Optional[int] = None
    torch.get_num_threads()  # torch's per-thread lazy init first: it would reset the count set below
    if "OpenMP" in torch.__config__.parallel_info():
        runtimes = _openmp_runtimes()
        for runtime in runtimes:  # until torch reads the count back: the runtime torch was linked with
            runtime.omp_set_num_threads(int(num_threads))
            applied_threads = torch.get_num_threads()
            if applied_threads == num_threads:
                break
        if not runtimes:
            notes.append("thread count not set: torch's OpenMP runtime was not found among the loaded libraries")
        elif applied_threads != num_threads:
            notes.append(f"asked for {num_threads} intra-op threads, torch reports {applied_threads} after setting "
                         f"each of the {len(runtimes)} OpenMP runtimes loaded")
    else:
        notes.append("thread count not set: torch's parallel backend is not OpenMP (its count is process-wide)")
    return ThreadPlacement(cores=applied_cores, num_threads=applied_threads, notes=tuple(notes))
