"""Device <-> host copies: dedicated CUDA streams and events, or plain copies on a CPU-only machine.

On CUDA, gradients go down on a device-to-host stream and updated weights come up on a host-to-device
stream, both into/out of pinned buffers, so neither blocks the compute stream. Ordering is by events:
- a copy's stream first waits for the compute stream (the source has been produced);
- the source/destination device tensor is `record_stream`-ed on the copy stream, so the caching allocator
  does not hand its memory to another kernel while the copy is in flight;
- the returned event tells a host reader (a CPU worker) when the pinned buffer is complete, and an upload's
  event is waited on by the compute stream before any kernel reads the uploaded tensor.
On CPU every copy is synchronous and no events exist.
"""

from __future__ import annotations

from typing import Optional

import torch


class Transfers:
    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.device_to_host = torch.cuda.Stream(device)
            self.host_to_device = torch.cuda.Stream(device)

    def to_host(self, source: torch.Tensor, pinned: torch.Tensor,
                rows: Optional[torch.Tensor] = None) -> Optional["torch.cuda.Event"]:
        """Copy device `source` (or its rows `rows`, gathered on the device) into host `pinned`; returns the
        event a host reader must wait for."""
        if not self.is_cuda:
            if rows is None:
                pinned.copy_(source)
            elif source.dtype == pinned.dtype:
                torch.index_select(source, 0, rows, out=pinned)  # gather straight into the host buffer
            else:
                pinned.copy_(source.index_select(0, rows))
            return None
        if rows is not None:
            source = source.index_select(0, rows)
        stream = self.device_to_host
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            pinned.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        source.record_stream(stream)
        return done

    def to_host_many(self, sources: list, pinned: list) -> Optional["torch.cuda.Event"]:
        """Copy each device tensor of `sources` into the host buffer at the same position, in one batched
        copy; returns the one event a host reader must wait for."""
        if not self.is_cuda:
            torch._foreach_copy_(pinned, sources)
            return None
        stream = self.device_to_host
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            torch._foreach_copy_(pinned, sources, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        for source in sources:
            source.record_stream(stream)
        return done

    def to_device(self, pinned: torch.Tensor) -> tuple[torch.Tensor, Optional["torch.cuda.Event"]]:
        """Upload host `pinned`; the compute stream waits for it. Returns the device tensor and the event
        after which `pinned` may be overwritten."""
        if not self.is_cuda:
            return pinned, None
        compute = torch.cuda.current_stream(self.device)
        target = torch.empty(pinned.shape, dtype=pinned.dtype, device=self.device)
        stream = self.host_to_device
        stream.wait_stream(compute)  # `target`'s memory may still be read by earlier compute work
        with torch.cuda.stream(stream):
            target.copy_(pinned, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        target.record_stream(stream)
        compute.wait_event(done)
        return target, done


def wait_events(events: list) -> None:
    """Block the calling (worker) thread until the given copy events have completed."""
    for event in events:
        if event is not None:
            event.synchronize()


class StallClock:
    """Time the training thread waits for the CPU: wall time on the host, GPU idle time via events.

    On CUDA an event is recorded on the compute stream before and after the host wait; the time between them
    is how long the GPU had nothing to do because of the wait (zero if enough work was queued). Elapsed
    times are read lazily (in `stats()`) so measuring never adds a synchronisation.
    """

    def __init__(self, device: torch.device):
        self.is_cuda = device.type == "cuda"
        self.device = device
        self.host_seconds = 0.0
        self._resolved_gpu_seconds = 0.0
        self._pending: list = []

    def before_wait(self):
        if not self.is_cuda:
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(self.device))
        return start

    def after_wait(self, start, host_seconds: float) -> None:
        self.host_seconds += host_seconds
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self.device))
            self._pending.append((start, end))
            self._resolve_completed()  # keeps the list to the waits the GPU has not reached yet

    def _resolve_completed(self) -> None:
        """Fold the timings of completed event pairs (non-blocking `query`); oldest first, in stream order."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.pop(0)
            self._resolved_gpu_seconds += start.elapsed_time(end) / 1e3

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def gpu_idle_seconds(self) -> Optional[float]:
        if not self.is_cuda:
            return None
        self._resolve_completed()
        return self._resolved_gpu_seconds
