"""Landings: how long an overlapped CPU update takes, in training steps, and what to change when it stalls.

Each landing is timed: the training thread's time per step while the update ran, less its waits; the
update's length in those steps; the wait at its landing. Where, over a window of updates, the waits take more
than a tenth of the time, the optimizer warns once (`take_advice`) with what would not wait. Nothing here
changes the schedule: results never depend on these timings.
"""

from __future__ import annotations

import math
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, NamedTuple, Optional

from zenflow_compile.runtime.worker import TaskEnd, task_end

WINDOW = 4  # updates whose waits are judged together
SKIPPED = 2  # the first updates also build the CPU AdamW and warm the caches: not judged
STALL_SHARE = 0.1  # waits above this share of the training's time are worth a warning
MIN_WAIT_SECONDS = 0.05  # ... and above this much in a window (a tiny model's microsecond waits are not)


class _Flight(NamedTuple):
    step: int  # the boundary's step
    launched_at: float
    stalled_at_launch: float  # the training thread's waits so far
    ended: TaskEnd  # when the update's task ended


class Landings:
    def __init__(self, config, stalled_seconds: Callable[[], float]):
        """`stalled_seconds`: the training thread's waits for ZenFlow so far (not training time)."""
        self.config = config
        self._stalled_seconds = stalled_seconds
        self._flights: dict[int, _Flight] = {}  # per phase: the overlapped update in flight
        self._skipped = 0
        # The last updates timed: (length in training steps, the training thread's wait at its landing).
        self._recent: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._since_judged = 0  # updates timed since the last window was judged
        self._window_started: Optional[float] = None  # the end of the landing before the window's first
        self.wait_seconds = 0.0  # the training thread's waits at landings (part of the stall)
        self._advice: Optional[str] = None
        self._advised = False

    def launched(self, phase: int, step: int, update: Future, overlapped: bool) -> None:
        self._flights.pop(phase, None)
        if overlapped:
            self._flights[phase] = _Flight(step, time.perf_counter(), self._stalled_seconds(), task_end(update))

    def mark(self) -> tuple[float, float]:
        """Taken before a landing's wait: (now, the training thread's waits so far)."""
        return time.perf_counter(), self._stalled_seconds()

    def landed(self, phase: int, step: int, mark: tuple[float, float]) -> None:
        landing_started, stalled = mark
        flight = self._flights.pop(phase, None)
        finished_at = None if flight is None else flight.ended.at
        if finished_at is None or step <= flight.step:
            return
        wait = max(0.0, finished_at - landing_started)
        self.wait_seconds += wait
        if self._skipped < SKIPPED:
            self._skipped += 1
            self._window_started = landing_started + wait
            return
        trained = landing_started - flight.launched_at - (stalled - flight.stalled_at_launch)
        step_seconds = max(trained, 1e-9) / (step - flight.step)
        self._recent.append(((finished_at - flight.launched_at) / step_seconds, wait))
        self._since_judged += 1
        if self._since_judged == WINDOW:  # (then `_recent` holds the window)
            self._judge(landing_started + wait - self._window_started)
            self._since_judged, self._window_started = 0, landing_started + wait

    def forget(self) -> None:
        self._flights.clear()

    @property
    def update_steps(self) -> Optional[float]:
        """The mean length of the last updates timed, in training steps; None before one."""
        return sum(length for length, _ in self._recent) / len(self._recent) if self._recent else None

    def _judge(self, seconds: float) -> None:
        waited = sum(wait for _, wait in self._recent)
        share = waited / max(seconds, 1e-9)
        if self._advised or share <= STALL_SHARE or waited < MIN_WAIT_SECONDS:
            return
        self._advised = True
        cfg, lag = self.config, math.ceil(self.update_steps)
        interval = cfg.update_interval
        landing = f"landing_lag={cfg.landing_lag}" if cfg.landing_lag is not None else "the next boundary"
        fixes = []
        if isinstance(interval, int) and cfg.landing_lag is not None and cfg.landing_lag < lag <= interval:
            fixes.append(f"landing_lag={lag}")
        if not cfg.stagger_boundaries and isinstance(interval, int) and interval > 1:
            sizing = (', best with interval_aware_update="sqrt" on two of the three fine-tunes measured'
                      if cfg.interval_aware_update is True else "")
            fixes.append(f"stagger_boundaries=True (each step then takes 1/{interval} of the update){sizing}")
        if isinstance(interval, int) and lag > interval:
            fixes.append(f"update_interval >= {lag}")
        fixes.append("more cores for the CPU workers (pt_reserved_cores_perc)")
        self._advice = (
            f"ZenFlow: a CPU update takes about {self.update_steps:.1f} training steps here and lands at "
            f"{landing}: the training thread waited {waited / WINDOW:.3f} s for each ({share:.0%} of the "
            f"time). To stop the wait: {'; or '.join(fixes)}. A later landing, staggering and a longer interval "
            "cost accuracy early in a fine-tune (docs/sizing.md). (Said once; opt.stats()['cpu_update_steps'] "
            "is the measured length; to silence: "
            "warnings.filterwarnings('ignore', category=zenflow_compile.LandingStallWarning).)")

    def take_advice(self) -> Optional[str]:
        advice, self._advice = self._advice, None
        return advice


class LandingStallWarning(UserWarning):
    """The training thread waits for overlapped CPU updates for a large share of its time."""


__all__ = ["Landings", "LandingStallWarning"]
