"""Device <-> host copies on a D2H and an H2D stream, ordered by events (ARCHITECTURE.md, "The device path").

Where the device is the host (`Transfers.device_is_host`) nothing is copied: an offload is a plain copy, an
upload hands the host tensor back. Any other device goes through a stream API: `AcceleratorStreams`
(`torch.accelerator`, pinned memory) or, in tests, an emulated asynchronous device (`emulate_async_device`).

Ordering: a copy's stream first waits for the compute stream (its source, or its target's memory, comes from
compute work); its device tensor is kept alive for its stream (`record_stream`) while the copy is in flight; a
host reader waits for a copy down's event, the compute stream for an upload's. The declarations of host
accesses (`host_access`) and host reads (`read_to_host`) are checked by the emulated device only.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
from torch.profiler import record_function


class AcceleratorStreams:
    """The stream API of a real accelerator: `torch.accelerator`, `torch.Stream`, `torch.Event`."""

    traced = False  # no access declarations: the hardware orders what the events order

    def __init__(self, device: torch.device):
        self.device = device

    def stream(self) -> torch.Stream:
        return torch.Stream(self.device)

    def current_stream(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def event(self, timing: bool = False) -> torch.Event:
        return torch.Event(self.device, enable_timing=timing)

    @contextlib.contextmanager
    def _on(self, stream: torch.Stream):
        previous = torch.accelerator.current_stream(self.device)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    def copy_(self, targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], stream: torch.Stream) -> None:
        """`target.copy_(source)` for each pair, queued on `stream` without blocking the host."""
        with self._on(stream):
            if len(targets) == 1:
                targets[0].copy_(sources[0], non_blocking=True)
            else:
                torch._foreach_copy_(list(targets), list(sources), non_blocking=True)

    @staticmethod
    def keep_alive(tensors: Sequence[torch.Tensor], stream: torch.Stream) -> None:
        for tensor in tensors:
            tensor.record_stream(stream)

    def host_zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, pin_memory=True, device="cpu")

    def device_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def free_bytes(self) -> int:
        """Device memory a new tensor can take: free in the driver plus the caching allocator's unused."""
        free, _ = torch.accelerator.get_memory_info(self.device)
        return free + torch.accelerator.memory_reserved(self.device) - torch.accelerator.memory_allocated(self.device)


_emulated_cpu_streams = None  # the stream API serving CPU tensors as a device: set only by tests


@contextlib.contextmanager
def emulate_async_device(streams):
    """Within this block, optimizers built over CPU tensors treat them as living on an asynchronous device
    served by `streams` (the test suite's emulated device)."""
    global _emulated_cpu_streams
    previous, _emulated_cpu_streams = _emulated_cpu_streams, streams
    try:
        yield streams
    finally:
        _emulated_cpu_streams = previous


def streams_for(device: torch.device):
    """The stream API serving `device`, or None where the device is the host."""
    if device.type == "cpu":
        return _emulated_cpu_streams
    return AcceleratorStreams(device)


class Transfers:
    """One optimizer's copies between its device and host memory."""

    def __init__(self, device: torch.device, streams=None):
        self.device = device
        self.streams = streams if streams is not None else streams_for(device)
        self.device_is_host = self.streams is None
        self.traced = not self.device_is_host and self.streams.traced
        if not self.device_is_host:
            self.device_to_host = self.streams.stream()
            self.host_to_device = self.streams.stream()

    def free_device_bytes(self) -> int:
        return self.streams.free_bytes()

    def host_zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer that copies read or write: pinned where the device is not the host."""
        if self.device_is_host:
            return torch.zeros(shape, dtype=dtype, device="cpu")
        return self.streams.host_zeros(shape, dtype)

    def host_access(self, reads: Sequence[torch.Tensor] = (), writes: Sequence[torch.Tensor] = ()) -> None:
        """The calling host thread is about to read / write these host buffers (after waiting for their copies)."""
        if self.traced:
            self.streams.note_host_access(reads, writes)

    @property
    def ordering(self):
        """What orders host threads in the emulated device's record (the CPU workers' tasks); None elsewhere."""
        return self.streams if self.traced else None

    def to_host(self, source: torch.Tensor, pinned: torch.Tensor, rows: Optional[torch.Tensor] = None):
        """Copy device `source` (or its rows `rows`, gathered on the device) into host `pinned`; returns the
        event a host reader must wait for (None where the device is the host: the copy is done)."""
        if self.device_is_host:
            if rows is None:
                pinned.copy_(source)
            elif source.dtype == pinned.dtype:
                torch.index_select(source, 0, rows, out=pinned)  # gather straight into the host buffer
            else:
                pinned.copy_(source.index_select(0, rows))
            return None
        if rows is not None:
            source = source.index_select(0, rows)  # on the compute stream
        return self._copy_down([source], [pinned])

    def copy_to_host(self, source: torch.Tensor):
        """A host copy of device `source` on the copy stream: (host tensor, the event a host reader must wait
        for); where the device is the host, (`source`, None)."""
        if self.device_is_host:
            return source, None
        pinned = self.host_zeros(source.shape, source.dtype)
        return pinned, self._copy_down([source], [pinned])

    def to_host_many(self, sources: Sequence[torch.Tensor], pinned: Sequence[torch.Tensor]):
        """`to_host` of each pair in one batched copy; returns the one event a host reader must wait for."""
        if self.device_is_host:
            torch._foreach_copy_(list(pinned), list(sources))
            return None
        return self._copy_down(sources, pinned)

    def _copy_down(self, sources: Sequence[torch.Tensor], pinned: Sequence[torch.Tensor]):
        streams, stream = self.streams, self.device_to_host
        if self.traced:
            streams.note_compute_access(writes=sources)  # the sources were produced by compute work
        stream.wait_stream(streams.current_stream())
        with record_function("zenflow::copy_down"):
            streams.copy_(pinned, sources, stream)
        done = streams.event()
        done.record(stream)
        streams.keep_alive(sources, stream)
        return done

    def after_copy_down(self, done, sources: Sequence[torch.Tensor]) -> None:
        """The compute stream is about to overwrite the device `sources` of a copy down (`done`): it waits for
        the copy first (on the device, not the host)."""
        if self.device_is_host:
            return
        self.streams.current_stream().wait_event(done)
        if self.traced:
            self.streams.note_compute_access(writes=sources)

    def to_device(self, pinned: torch.Tensor, after=None):
        """Upload host `pinned` (after the copy event `after`, if any: a copy down into it); the compute stream
        waits for it. Returns the device tensor and the event after which `pinned` may be overwritten (None
        where the device is the host: `pinned` itself)."""
        target, done = self.upload_ahead(pinned, after)
        self.use_upload(target, done)
        return target, done

    def indices_to_device(self, indices: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Small host-made integer or bool tensors (indices, masks) on the device, in their dtypes and shapes:
        packed into one pinned buffer, one upload the compute stream waits for. A pageable `.to(device)`
        would block the training thread until the compute stream drains, once per tensor."""
        if self.device_is_host:
            return list(indices)
        if any(t.is_floating_point() or t.is_complex() for t in indices):
            raise TypeError("indices_to_device takes integer and bool tensors")
        sizes = [t.numel() for t in indices]
        pinned = self.host_zeros((sum(sizes),), torch.int64)
        self.host_access(writes=[pinned])
        torch.cat([t.reshape(-1).to(torch.int64) for t in indices], out=pinned)
        packed, _ = self.to_device(pinned)
        return [part.view(t.shape).to(t.dtype) for part, t in zip(packed.split(sizes), indices)]

    def upload_ahead(self, pinned: torch.Tensor, after=None):
        """Queue the upload of host `pinned` (from any host thread; after the copy event `after`, if any)
        without making the compute stream wait: `use_upload` does, before the first kernel that reads the
        target. Returns (target, event)."""
        if self.device_is_host:
            return pinned, None
        streams, stream = self.streams, self.host_to_device
        target = streams.device_empty(pinned.shape, pinned.dtype)
        if self.traced:
            streams.note_compute_access(writes=[target])  # its memory may have served earlier compute work
        stream.wait_stream(streams.current_stream())
        if after is not None:
            stream.wait_event(after)
        with record_function("zenflow::upload"):
            streams.copy_([target], [pinned], stream)
        done = streams.event()
        done.record(stream)
        streams.keep_alive([target], stream)  # (dropped unmerged, as when the slab is replaced, its memory waits)
        return target, done

    def use_upload(self, target: torch.Tensor, done) -> None:
        """The compute stream waits for an upload (`upload_ahead`) before its kernels read the target."""
        if self.device_is_host:
            return
        self.streams.current_stream().wait_event(done)
        if self.traced:
            self.streams.note_compute_access(reads=[target])  # the caller's kernels read it next

    def read_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A blocking read of a device value (on an accelerator, a synchronisation with the compute stream)."""
        if self.traced:
            self.streams.note_compute_synchronized()
        return tensor.cpu()


def wait_events(events: list) -> None:
    """Block the calling host thread until the given copy events have completed."""
    for event in events:
        if event is not None:
            event.synchronize()


class StallClock:
    """Time the training thread waits for the CPU, or moves state for a selection: wall time on the host, and
    device idle time between timing events recorded on the compute stream before and after the wait (zero if
    enough work was queued). Elapsed times are read lazily (in `stats()`): measuring never synchronises.
    """

    def __init__(self, transfers: Transfers):
        self.streams = transfers.streams  # None where the device is the host
        self.host_seconds = 0.0
        self._depth = 0  # waits in progress (nested ones are measured by the outermost)
        self._resolved_device_seconds = 0.0
        self._pending: list = []

    def before_wait(self):
        """Mark the start of a wait; a nested one (a selection's move waiting for a worker) is the outer's."""
        self._depth += 1
        if self.streams is None or self._depth > 1:
            return None
        start = self.streams.event(timing=True)
        start.record(self.streams.current_stream())
        return start

    def after_wait(self, start, host_seconds: float) -> None:
        self._depth -= 1
        if self._depth:
            return
        self.host_seconds += host_seconds
        if start is not None:
            end = self.streams.event(timing=True)
            end.record(self.streams.current_stream())
            self._pending.append((start, end))
            self._resolve_completed()  # keeps the list to the waits the device has not reached yet

    def _resolve_completed(self) -> None:
        """Fold the timings of completed event pairs (non-blocking `query`); oldest first, in stream order."""
        while self._pending and self._pending[0][1].query():
            start, end = self._pending.pop(0)
            self._resolved_device_seconds += start.elapsed_time(end) / 1e3

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def device_idle_seconds(self) -> Optional[float]:
        """None where the device is the host (the host wait is the stall)."""
        if self.streams is None:
            return None
        self._resolve_completed()
        return self._resolved_device_seconds
