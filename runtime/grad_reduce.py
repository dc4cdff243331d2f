"""Bucketed, asynchronous reduction of parameter gradients across the data-parallel ranks.

Each gradient is split by where its optimizer state lives: the part every rank updates on its device (a
matrix's selected columns, a whole vector) is averaged with an all-reduce; the host part (a matrix's unselected
columns, already in the host layout) with a reduce into the matrix's owner only. Per bucket: one flat buffer per
collective, one all-reduce plus one reduce per owner, launched asynchronously in backward order (the same on
every rank) and finished before their gradients are consumed: when too many are in flight, and at `opt.step()`.
(NCCL runs on its own streams, `Work.wait()` making the current stream wait; gloo on its own threads.) The
compiled backward hands over whole buckets (`zenflow::reduce_grads`); eager hooks one gradient at a time (`add`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from zenflow_compile.runtime.collectives import DataParallel, collective_failed

if TYPE_CHECKING:
    from zenflow_compile.runtime.state.members import Member as ParamState

MAX_BUCKETS_IN_FLIGHT = 2  # bounds the memory held by gradients being reduced


@dataclass
class _Piece:
    state: "ParamState"
    replicated: Optional[tuple[torch.dtype, int, int]] = None  # (dtype, offset, numel) in the all-reduce buffer
    host: Optional[tuple[tuple[int, torch.dtype], int, int]] = None  # ((owner, dtype), offset, numel)


@dataclass
class _Bucket:
    pieces: list[_Piece]
    replicated: dict[torch.dtype, torch.Tensor]  # the all-reduce's flat buffers, by dtype
    host: dict[tuple[int, torch.dtype], torch.Tensor]  # the reduces' flat buffers, by (owner, dtype)
    works: list = field(default_factory=list)


def _reserve(sizes: dict, key, numel: int):
    """(key, offset, numel) of `numel` elements appended to buffer `key` (running sizes in `sizes`); None for 0."""
    if not numel:
        return None
    offset = sizes.get(key, 0)
    sizes[key] = offset + numel
    return key, offset, numel


class GradReducer:
    def __init__(self, data_parallel: DataParallel, bucket_numel: int, deliver: Callable):
        """`deliver(state, replicated, host)` takes one parameter's averaged pieces (host: None off its owner)."""
        self.dp = data_parallel
        self.bucket_numel = bucket_numel
        self._deliver = deliver
        self._open: list[tuple["ParamState", torch.Tensor]] = []  # eager: gradients waiting for a full bucket
        self._open_numel = 0
        self._in_flight: deque[_Bucket] = deque()

    # -- hand-over ------------------------------------------------------------------------------------------
    def add(self, state: "ParamState", grad: torch.Tensor) -> None:
        """Eager: one gradient; a bucket goes out once it holds `bucket_numel` elements."""
        self._open.append((state, grad))
        self._open_numel += grad.numel()
        if self._open_numel >= self.bucket_numel:
            self.flush()

    def flush(self) -> None:
        if self._open:
            items, self._open, self._open_numel = self._open, [], 0
            self.launch(items)

    def launch(self, items: list[tuple["ParamState", torch.Tensor]]) -> None:
        """Start the collectives of one bucket. Keeps no reference to the gradients (copies the pieces)."""
        self.flush()  # an earlier eager bucket first: every rank launches in the same order
        bucket = self._gather(items)
        for flat in bucket.replicated.values():
            bucket.works.append(self.dp.all_reduce(flat, async_op=True))
        for (owner, _), flat in bucket.host.items():
            bucket.works.append(self.dp.reduce(flat, owner, async_op=True))
        self._in_flight.append(bucket)
        while len(self._in_flight) > MAX_BUCKETS_IN_FLIGHT:
            self._finish(self._in_flight.popleft())

    def finish_all(self) -> None:
        """Wait for every bucket and hand the averaged pieces to their parameter states."""
        self.flush()
        while self._in_flight:
            self._finish(self._in_flight.popleft())

    # -- internals ----------------------------------------------------------------------------------------
    def _gather(self, items) -> _Bucket:
        """Copy each gradient's pieces into the bucket's flat buffers, divided by the world size (sum = mean)."""
        replicated_sizes: dict[torch.dtype, int] = {}
        host_sizes: dict[tuple[int, torch.dtype], int] = {}
        pieces = []
        for state, grad in items:
            replicated_numel, host_numel = state.reduce_split_numel()
            pieces.append(_Piece(state, _reserve(replicated_sizes, grad.dtype, replicated_numel),
                                 _reserve(host_sizes, (state.owner, grad.dtype), host_numel)))
        device = items[0][1].device
        bucket = _Bucket(pieces, {dtype: torch.empty(n, dtype=dtype, device=device)
                                  for dtype, n in replicated_sizes.items()},
                         {key: torch.empty(n, dtype=key[1], device=device) for key, n in host_sizes.items()})
        for piece, (state, grad) in zip(pieces, items):
            state.split_grad_for_reduce(grad.detach(), self._segment(bucket.replicated, piece.replicated),
                                        self._segment(bucket.host, piece.host))
        for flat in [*bucket.replicated.values(), *bucket.host.values()]:
            flat.div_(self.dp.world_size)
        return bucket

    @staticmethod
    def _segment(buffers: dict, where) -> Optional[torch.Tensor]:
        if where is None:
            return None
        key, offset, numel = where
        return buffers[key][offset:offset + numel]

    def _finish(self, bucket: _Bucket) -> None:
        for work in bucket.works:
            try:
                work.wait()
            except Exception as error:
                raise collective_failed(error) from error
        for piece in bucket.pieces:
            replicated = self._segment(bucket.replicated, piece.replicated)
            host = self._segment(bucket.host, piece.host) if piece.state.owner == self.dp.rank else None
            self._deliver(piece.state, replicated, host)
