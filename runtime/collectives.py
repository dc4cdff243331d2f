"""The data-parallel group of one ZenFlowAdamW: collectives, ownership of host state, byte counts (plain
torch.distributed: NCCL on CUDA, gloo on CPU; ARCHITECTURE.md, "Data parallel").

Host state is partitioned by whole matrices (vectors too: their owner reports their score and saves their
state): each lives on one rank, its *owner*, chosen greedily by size when the optimizer takes its parameters,
the same on every rank, so owners are known before any step and match a saved run's at the same world size.
Whole matrices, not column shards: a matrix's unselected gradient is one `reduce` to one rank (gloo has no
reduce-scatter), a reselection moves state only between the devices and the owner's host, and a model's many
matrices of similar size split evenly.

Every collective goes through `DataParallel`, which counts its payload bytes per kind for `opt.stats()`: sent =
what this rank contributes, received = what it gets back. All ranks must issue the same collectives in the
same order; the runtime decides everything from reduced (identical) quantities.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["DataParallel", "data_parallel_group", "CollectiveError"]


class CollectiveError(RuntimeError):
    """A collective across the data-parallel group failed: a rank died, or the group's timeout passed."""


def data_parallel_group(process_group: Any) -> Optional["DataParallel"]:
    """The DataParallel for `process_group` (None = the default group), or None when there is nothing to
    reduce: torch.distributed not initialised, or a group of one rank."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    return None if dist.get_world_size(process_group) == 1 else DataParallel(process_group)


class DataParallel:
    def __init__(self, group: "dist.ProcessGroup"):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._owned_elements = [0] * self.world_size
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.bytes_received: dict[str, int] = defaultdict(int)

    # -- ownership ----------------------------------------------------------------------------------------
    def assign_owner(self, numel: int) -> int:
        owner = min(range(self.world_size), key=lambda r: (self._owned_elements[r], r))
        self._owned_elements[owner] += numel
        return owner

    # -- collectives (payload counted) --------------------------------------------------------------------
    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def _count(self, kind: str, tensor: torch.Tensor, sent: bool, received: bool) -> None:
        size = tensor.numel() * tensor.element_size()
        self.bytes_sent[kind] += size if sent else 0
        self.bytes_received[kind] += size if received else 0

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Sum over ranks, in place."""
        self._count("all_reduce", tensor, True, True)
        return self._run(dist.all_reduce, tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_reduce_packed(self, tensors: list[torch.Tensor]) -> None:
        """Sum over ranks of every tensor in `tensors`, in place, in one all-reduce of them packed (same shapes
        in the same order on every rank)."""
        packed = torch.cat([t.reshape(-1) for t in tensors])
        self.all_reduce(packed)
        for tensor, reduced in zip(tensors, packed.split([t.numel() for t in tensors])):
            tensor.copy_(reduced.view_as(tensor))

    def reduce(self, tensor: torch.Tensor, owner: int, async_op: bool = False):
        """Sum over ranks into `owner`'s tensor (the others' tensors are left undefined)."""
        self._count("reduce", tensor, owner != self.rank, owner == self.rank)
        return self._run(dist.reduce, tensor, dst=self._global(owner), op=dist.ReduceOp.SUM, group=self.group,
                         async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, owner: int) -> None:
        """`owner`'s tensor into every rank's."""
        self._count("broadcast", tensor, owner == self.rank, owner != self.rank)
        self._run(dist.broadcast, tensor, src=self._global(owner), group=self.group)

    def broadcast_object(self, obj: Any, owner: int) -> Any:
        """`owner`'s picklable object (tensors on the host) on every rank; the others pass None."""
        objects = [obj if owner == self.rank else None]
        self._run(dist.broadcast_object_list, objects, src=self._global(owner), group=self.group)
        return objects[0]

    def all_gather_object(self, obj: Any) -> list:
        gathered: list = [None] * self.world_size
        self._run(dist.all_gather_object, gathered, obj, group=self.group)
        return gathered

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[list]:
        gathered = [None] * self.world_size if self.rank == dst else None
        self._run(dist.gather_object, obj, gathered, dst=self._global(dst), group=self.group)
        return gathered

    @staticmethod
    def _run(collective, *args, **kwargs):
        try:
            return collective(*args, **kwargs)
        except (RuntimeError, dist.DistError) as error:
            raise collective_failed(error) from error

    def stats(self) -> dict:
        kinds = sorted(set(self.bytes_sent) | set(self.bytes_received))
        return dict(world_size=self.world_size, rank=self.rank,
                    comm_bytes_sent={k: self.bytes_sent[k] for k in kinds},
                    comm_bytes_received={k: self.bytes_received[k] for k in kinds})

    # -- construction-time agreement ----------------------------------------------------------------------
    def check_same_on_every_rank(self, description: dict) -> None:
        """Raise the same ValueError on every rank if any rank's `description` (config, parameter shapes
        and dtypes, ...) differs from rank 0's, instead of hanging in the first mismatched collective."""
        gathered = self.all_gather_object(description)
        for rank, other in enumerate(gathered):
            difference = _first_difference(gathered[0], other)
            if difference is not None:
                raise ValueError(
                    f"ZenFlowAdamW differs across the data-parallel ranks: rank {rank} has {difference[1]} where "
                    f"rank 0 has {difference[0]} ({difference[2]}). Every rank must build the same model and "
                    "the same optimizer (same parameters in the same order, same config)")

    def broadcast_parameters(self, params: list[torch.Tensor]) -> None:
        """Rank 0's values into every rank's parameters (as DDP does at construction)."""
        with torch.no_grad():
            for param in params:
                self.broadcast(param.data, 0)


def collective_failed(error: BaseException) -> CollectiveError:
    return CollectiveError(
        "ZenFlow: a collective across the data-parallel group failed (a rank died, or the process group's "
        f"timeout passed); this rank cannot go on. Restart the job from the last checkpoint. Cause: "
        f"{type(error).__name__}: {error}")


def _first_difference(expected: dict, got: dict) -> Optional[tuple[Any, Any, str]]:
    for key in expected:
        a, b = expected[key], got.get(key)
        if isinstance(a, list) and isinstance(b, list):
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    return x, y, f"{key} {i}"
            if len(a) != len(b):
                return f"{len(a)} {key}", f"{len(b)} {key}", f"number of {key}"
        elif a != b:
            return a, b, key
    return None
