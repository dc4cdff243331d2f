"""An emulated asynchronous device over CPU tensors: the runtime's device path, run and checked without a GPU.

`EmulatedStreams` implements the stream API the runtime's `Transfers` calls on an accelerator (streams,
events, non-blocking copies into and out of pinned host buffers), with CPU tensors standing in for device
memory (`transfers.emulate_async_device`):
- each side stream is a worker thread; a copy queued on it lands after a delay (`ZENFLOW_EMULATED_COPY_DELAY_MS`,
  default 1 ms, scaled per copy by a factor in [0.5, 1.5) drawn from `ZENFLOW_EMULATED_SEED`), so a host
  read of a buffer whose copy has not landed sees its old contents, and an upload's target holds NaN until
  its copy lands;
- an event is a completion marker in its stream's queue; `wait_event` / `wait_stream` order queues;
  `Event.synchronize` blocks the host thread until the marker is reached;
- the compute stream is the training thread itself (compute work runs inline), so the compute stream's
  `wait_event` blocks it until the copy has landed.

Delays find a race only when the timing exposes it, so every access is also checked against a
happens-before graph (networkx; reachability is the question). Its nodes are the operations of each actor:
each side stream, the compute stream, each host thread. Its edges: program order within an actor; a host
thread queuing work on a stream; an event recorded on one stream and waited for by another stream or a
host thread; a CPU worker task starting after its submission and a waiter joining a finished task. Every
copy, every host access the runtime declares (`Transfers.host_access`) and every compute access around a
copy is checked when it is made:
- a read must be ordered after the last write of the bytes it reads;
- a write must be ordered after the last write and every read since (a pinned buffer reused before its
  reader is done);
- a device tensor a side-stream copy reads must still be alive when the copy runs (`record_stream`).
The first violation raises `OrderingViolation` in the thread that made the access (a CPU worker's reaches
the training thread as the optimizer's failure) and is kept in `violations`, so a missing wait fails its
test on every run, whatever the delays.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Optional

import networkx as nx
import torch

from zenflow_compile.runtime import transfers


class OrderingViolation(AssertionError):
    """An access the streams, events and host-thread joins do not order after the access it depends on."""


def _actor_of_this_thread() -> str:
    thread = threading.current_thread()
    return f"host:{thread.name}#{thread.ident}"


class HappensBefore:
    """The happens-before graph: one node per operation, edges for every ordering the program makes."""

    def __init__(self):
        self.graph = nx.DiGraph()
        self._last: dict[str, int] = {}  # actor -> its latest node
        self._reached: dict[int, dict[str, int]] = {}  # node -> actor -> earliest node of it known reachable
        self._lock = threading.RLock()

    def point(self, actor: str, label: str, after=()) -> int:
        """A new operation of `actor`, after its previous one and after the nodes `after`."""
        with self._lock:
            node = self.graph.number_of_nodes()
            self.graph.add_node(node, actor=actor, label=label)
            previous = self._last.get(actor)
            if previous is not None:
                self.graph.add_edge(previous, node)
            for source in after:
                if source is not None:
                    self.graph.add_edge(source, node)
            self._last[actor] = node
            return node

    def last(self, actor: str) -> Optional[int]:
        with self._lock:
            return self._last.get(actor)

    def ordered(self, first: int, then: int) -> bool:
        """Whether `first` happens before `then` (or is it)."""
        if first == then:
            return True
        with self._lock:
            actor = self.graph.nodes[then]["actor"]
            reached = self._reached.setdefault(first, {})
            # (program order: reaching one node of an actor reaches all its later ones)
            if reached.get(actor, then + 1) <= then:
                return True
            if not nx.has_path(self.graph, first, then):
                return False
            reached[actor] = min(reached.get(actor, then), then)
            return True

    def describe(self, node: int) -> str:
        with self._lock:
            data = self.graph.nodes[node]
            return f"{data['label']} on {data['actor']}"


@dataclass
class _Access:
    node: int
    is_write: bool
    start: int
    end: int


@dataclass
class _HostBuffer:
    """A pinned host buffer (one storage) and its accesses since the last write of each byte range."""

    name: str
    tensor: torch.Tensor  # held for the emulation's lifetime: no other buffer can reuse its address
    accesses: list = field(default_factory=list)


class _Event:
    """A completion marker: done once every operation queued before it on its stream has run."""

    def __init__(self, device: "EmulatedStreams"):
        self._device = device
        self.node: Optional[int] = None
        self.completed_at: Optional[float] = None
        self._done = threading.Event()
        self._done.set()  # an event never recorded is complete (as on CUDA)

    def record(self, stream=None) -> None:
        stream = stream if stream is not None else self._device.compute
        self.node = self._device.hb.last(stream.actor)
        self._done = threading.Event()
        stream._mark(self)

    def _complete(self) -> None:
        self.completed_at = time.perf_counter()
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait()
        self._device.hb.point(_actor_of_this_thread(), "event synchronize", after=[self.node])

    def query(self) -> bool:
        return self._done.is_set()

    def elapsed_time(self, end: "_Event") -> float:
        """Milliseconds between this event's completion and `end`'s."""
        return (end.completed_at - self.completed_at) * 1e3


class _Stream:
    def wait_stream(self, other) -> None:
        event = _Event(self._device)
        event.record(other)
        self.wait_event(event)


class _ComputeStream(_Stream):
    """The compute stream: the training thread, which runs compute work inline."""

    actor = "compute"

    def __init__(self, device: "EmulatedStreams"):
        self._device = device

    def _mark(self, event: _Event) -> None:
        event._complete()

    def wait_event(self, event: _Event) -> None:
        self._device.hb.point(self.actor, "wait event", after=[event.node])
        event._done.wait()  # the compute work that follows runs inline, now


class _SideStream(_Stream):
    """A copy stream: a worker thread running its queue in order."""

    def __init__(self, device: "EmulatedStreams", name: str):
        self._device = device
        self.actor = f"stream:{name}"
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"emulated-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            operation = self._queue.get()
            if operation is None:
                return
            try:
                operation()
            except BaseException as error:  # (kept: the test fails at teardown)
                self._device.violations.append(f"{self.actor}: {type(error).__name__}: {error}")

    def _mark(self, event: _Event) -> None:
        self._queue.put(event._complete)

    def wait_event(self, event: _Event) -> None:
        self._device.hb.point(self.actor, "wait event", after=[event.node])
        done = event._done
        self._queue.put(done.wait)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class EmulatedStreams:
    """The stream API of the emulated device (see the module docstring)."""

    traced = True  # the runtime declares its host accesses: each is checked

    def __init__(self, delay_ms: Optional[float] = None, seed: Optional[int] = None):
        self.delay_ms = float(os.environ.get("ZENFLOW_EMULATED_COPY_DELAY_MS", "1")) if delay_ms is None else delay_ms
        seed = int(os.environ.get("ZENFLOW_EMULATED_SEED", "0")) if seed is None else seed
        self._random = random.Random(seed)
        self.hb = HappensBefore()
        self.compute = _ComputeStream(self)
        self.violations: list[str] = []
        self._streams: list[_SideStream] = []
        self._host_buffers: dict[int, _HostBuffer] = {}  # storage address -> buffer
        self._device_reads: dict = {}  # id -> [(weakref, node)] since its last write
        self._device_writes: dict[int, tuple] = {}  # id(device tensor) -> (weakref, node of its last write)
        self._latest_copy: dict = {}  # stream -> (device tensors of its latest copy, those kept alive)
        self._lock = threading.RLock()
        # The device memory `free_bytes` reports (what accumulate_on="auto" sizes against): a large device
        # unless a test says otherwise.
        self.free_device_bytes = 1 << 40
        # (thread name, bytes, storage addresses) of every host access the runtime declares: which thread
        # touches which host state.
        self.host_accesses: list[tuple[str, int, tuple[int, ...]]] = []

    # -- the stream API -------------------------------------------------------------------------------------
    def stream(self) -> _SideStream:
        stream = _SideStream(self, f"side{len(self._streams)}")
        self._streams.append(stream)
        return stream

    def current_stream(self) -> _ComputeStream:
        return self.compute

    def event(self, timing: bool = False) -> _Event:
        return _Event(self)  # (every event keeps its completion time)

    def host_zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.zeros(shape, dtype=dtype, device="cpu")
        with self._lock:
            address = tensor.untyped_storage().data_ptr()
            self._host_buffers[address] = _HostBuffer(f"pinned {tuple(shape)} {dtype}", tensor)
        return tensor

    def free_bytes(self) -> int:
        return self.free_device_bytes

    def device_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        # (the emulated device memory is host memory, whatever the default device). What a read before the copy
        # lands sees: NaN, or for integers an index out of any range.
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min if dtype != torch.bool else True
        return torch.full(shape, fill, dtype=dtype, device="cpu")

    def copy_(self, targets, sources, stream: _SideStream) -> None:
        """Queue the copies on `stream`: checked now, landing after a delay."""
        enqueued = self.hb.point(_actor_of_this_thread(), f"queue copy on {stream.actor}")
        node = self.hb.point(stream.actor, "copy", after=[enqueued])
        device_tensors = []
        for tensor in sources:
            if not self._host_access(node, tensor, is_write=False):
                self._device_access(node, tensor, is_write=False)
                device_tensors.append(tensor)
        for tensor in targets:
            if not self._host_access(node, tensor, is_write=True):
                self._device_access(node, tensor, is_write=True)
                device_tensors.append(tensor)
        if not any(self._buffer_of(t) is not None for t in [*targets, *sources]):
            self._violation(node, "a copy between two device tensors on a copy stream: one side must be "
                                  "pinned host memory (Transfers.host_zeros)")
        # The copy runs on aliases of the storage; whether the runtime still holds the device tensors (or
        # kept them alive for the stream) is checked when it lands: a freed one's memory could serve other work.
        pairs = [(t.detach(), s.detach()) for t, s in zip(targets, sources)]
        watched = {id(t): (weakref.ref(t), tuple(t.shape)) for t in device_tensors}
        kept: list = []  # strong references from keep_alive, until the copy has landed
        self._latest_copy[stream] = (watched, kept)
        delay = self.delay_ms * self._random.uniform(0.5, 1.5) / 1e3

        def land():
            time.sleep(delay)
            for ref, shape in watched.values():
                if ref() is None:
                    raise OrderingViolation(
                        f"a device tensor {shape} was freed before the copy on {stream.actor} ran (its memory "
                        "could serve other work meanwhile): keep it alive for that stream (record_stream)")
            for target, source in pairs:
                target.copy_(source)
            kept.clear()  # the copy has landed: the runtime may free them now

        stream._queue.put(land)

    def keep_alive(self, tensors, stream: _SideStream) -> None:
        """The tensors stay allocated until the latest copy queued on `stream` has landed."""
        watched, kept = self._latest_copy.get(stream, ({}, []))
        kept.extend(t for t in tensors if id(t) in watched and watched[id(t)][0]() is t)

    # -- declarations from the runtime ----------------------------------------------------------------------
    def note_host_access(self, reads=(), writes=()) -> None:
        node = self.hb.point(_actor_of_this_thread(), "host access")
        touched = (*reads, *writes)
        self.host_accesses.append((threading.current_thread().name,
                                   sum(t.numel() * t.element_size() for t in touched),
                                   tuple(t.untyped_storage().data_ptr() for t in touched)))
        for tensor in reads:
            self._require_host_buffer(node, tensor)
            self._host_access(node, tensor, is_write=False)
        for tensor in writes:
            self._require_host_buffer(node, tensor)
            self._host_access(node, tensor, is_write=True)

    def note_compute_access(self, reads=(), writes=()) -> None:
        host = self.hb.last(_actor_of_this_thread())
        node = self.hb.point(self.compute.actor, "compute", after=[host])
        for tensor in reads:
            self._device_access(node, tensor, is_write=False)
        for tensor in writes:
            self._device_access(node, tensor, is_write=True)

    def note_compute_synchronized(self) -> None:
        self.hb.point(_actor_of_this_thread(), "read a device value", after=[self.hb.last(self.compute.actor)])

    # -- host-thread order (CPU workers) --------------------------------------------------------------------
    def fork(self) -> int:
        return self.hb.point(_actor_of_this_thread(), "submit task")

    def join(self, node: int) -> None:
        self.hb.point(_actor_of_this_thread(), "join task", after=[node])

    # -- checks ---------------------------------------------------------------------------------------------
    def _buffer_of(self, tensor: torch.Tensor) -> Optional[_HostBuffer]:
        return self._host_buffers.get(tensor.untyped_storage().data_ptr())

    def _require_host_buffer(self, node: int, tensor: torch.Tensor) -> None:
        if self._buffer_of(tensor) is None:
            self._violation(node, f"declared a host access to a tensor {tuple(tensor.shape)} that is not a "
                                  "pinned buffer of this device (Transfers.host_zeros)")

    def _host_access(self, node: int, tensor: torch.Tensor, is_write: bool) -> bool:
        """Check and record an access to a pinned host buffer; False if `tensor` is not one."""
        with self._lock:
            buffer = self._buffer_of(tensor)
            if buffer is None:
                return False
            start, end = _byte_span(tensor)
            kept = []
            for access in buffer.accesses:
                overlaps = access.start < end and start < access.end
                if overlaps and (access.is_write or is_write) and not self.hb.ordered(access.node, node):
                    what = "write" if access.is_write else "read"
                    self._violation(node, f"{'write' if is_write else 'read'} of {buffer.name} bytes "
                                          f"[{start}, {end}) is not ordered after the {what} by "
                                          f"{self.hb.describe(access.node)}: a missing wait")
                if not (is_write and overlaps and start <= access.start and access.end <= end):
                    kept.append(access)  # (a write covering an access makes it redundant: it came first)
            kept.append(_Access(node, is_write, start, end))
            buffer.accesses = kept
            return True

    def _device_access(self, node: int, tensor: torch.Tensor, is_write: bool) -> None:
        """Device tensors are followed by identity: the runtime hands the same tensor to every call. A write
        must also be ordered after every read since the last write (a copy's source overwritten while the copy
        may still read it)."""
        with self._lock:
            last = self._device_writes.get(id(tensor))
            if last is not None and last[0]() is tensor and not self.hb.ordered(last[1], node):
                self._violation(node, f"{'write' if is_write else 'read'} of a device tensor "
                                      f"{tuple(tensor.shape)} is not ordered after its write by "
                                      f"{self.hb.describe(last[1])}: a missing wait")
            reads = self._device_reads.setdefault(id(tensor), [])
            reads[:] = [(ref, read) for ref, read in reads if ref() is tensor]
            if not is_write:
                reads.append((weakref.ref(tensor), node))
                return
            for _, read in reads:
                if not self.hb.ordered(read, node):
                    self._violation(node, f"write of a device tensor {tuple(tensor.shape)} is not ordered after "
                                          f"its read by {self.hb.describe(read)}: a missing wait")
            reads.clear()
            self._device_writes[id(tensor)] = (weakref.ref(tensor), node)

    def _violation(self, node: int, message: str) -> None:
        text = f"{self.hb.describe(node)}: {message}"
        self.violations.append(text)
        raise OrderingViolation(text)

    # -- lifetime -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Let every queued copy land and stop the stream threads."""
        for stream in self._streams:
            stream.close()
        self._streams = []

    def check(self) -> None:
        """Raise the first ordering violation seen anywhere (a stream thread's too)."""
        if self.violations:
            raise OrderingViolation(f"{len(self.violations)} ordering violation(s); first: {self.violations[0]}")


@contextlib.contextmanager
def emulated_async_device(delay_ms: Optional[float] = None):
    """CPU tensors served by a new EmulatedStreams within the block; on the way out its copies land and the
    first ordering violation seen anywhere is raised."""
    emulated = EmulatedStreams(delay_ms=delay_ms)
    with transfers.emulate_async_device(emulated):
        try:
            yield emulated
        finally:
            emulated.close()
    emulated.check()


class PageableUploads(torch.overrides.TorchFunctionMode):
    """Records the calls of the thread that enters it which, on a GPU, copy a host-made tensor to the device
    from pageable memory and block that thread until the compute stream has drained: `Tensor.to(<device>)`,
    `Tensor.cuda()`, `torch.tensor` / `torch.as_tensor` with a device. On the emulated device the device is
    the CPU, so such a call copies nothing here; the runtime's uploads go through `Transfers` (pinned
    buffers, events) instead. The string "cpu" names the host (the runtime makes its host tensors with
    `device="cpu"`, whatever the default device), so it is not an upload. `calls`: (function, where in the
    runtime it was made)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self._thread = threading.get_ident()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if threading.get_ident() == self._thread and self._uploads(func, args, kwargs):
            self.calls.append((getattr(func, "__name__", str(func)), _runtime_caller()))
        return func(*args, **kwargs)

    @staticmethod
    def _uploads(func, args, kwargs) -> bool:
        names_device = lambda d: d is not None and not isinstance(d, torch.dtype) and d != "cpu"
        if func in (torch.tensor, torch.as_tensor):
            return names_device(kwargs.get("device"))
        if func is torch.Tensor.cuda:
            return True
        if func is torch.Tensor.to:
            return names_device(kwargs.get("device")) or any(
                isinstance(a, (torch.device, str)) and names_device(a) for a in args[1:])
        return False


def _runtime_caller() -> str:
    """file:line of the innermost frame in the runtime."""
    for frame in reversed(traceback.extract_stack()):
        if f"{os.sep}runtime{os.sep}" in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "?"


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of the storage this view can touch."""
    size = tensor.element_size()
    start = tensor.storage_offset() * size
    if tensor.numel() == 0:
        return start, start
    reach = sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (reach + 1) * size
