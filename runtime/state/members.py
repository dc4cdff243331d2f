"""A parameter in the optimizer state: its place in a slab and bookkeeping (`Member`), and its whole state in
transit (`MemberState`): what moves between slabs, and the layout of its checkpoint entry."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from zenflow_compile.runtime.sharding import is_sharded, local_shard
from zenflow_compile.runtime.state.layout import SHARED_SLAB_MAX_NUMEL, SlabKey, matrix_shape
from zenflow_compile.runtime.state.watch import ParamWatch


class Member:
    """One parameter's place in its slab (`slab`, `index`) and its per-parameter bookkeeping."""

    def __init__(self, param: torch.Tensor, pid: int, group_index: int, owner: int, owns_host: bool,
                 phase: int = 0):
        # Sharded by FSDP2: the state is this rank's rows', its slab chosen by the global shape (every rank's).
        self.key_rows, self.key_numel = matrix_shape(param)[0], param.numel()
        self.sharded = param if is_sharded(param) else None  # (its DTensor: the local tensor may be replaced)
        param = local_shard(param)
        self.param, self.pid, self.group_index = param, pid, group_index
        self.owner, self.owns_host = owner, owns_host
        self.phase = phase  # stagger_boundaries: whose boundaries it follows (`Placement.assign_phase`)
        self.is_matrix = param.dim() >= 2
        self.rows, self.cols = matrix_shape(param)
        self.watch = ParamWatch(self.registered, self.sharded is not None)
        self.slab = None  # its Slab (state/slab.py), set by the slab
        self.index = 0
        self.num_grads = 0  # backwards handed over this step
        self.steps_accumulated = 0  # steps whose gradient went into the accumulator since the last update
        # Zen-auto: mean selected / unselected scores summed since the last CPU update.
        self.sum_selected_score = 0.0
        self.sum_unselected_score = 0.0

    @property
    def registered(self) -> torch.Tensor:
        """The parameter as the optimizer was given it (a sharded one's DTensor)."""
        return self.param if self.sharded is None else self.sharded

    def follow_local_shard(self) -> None:
        """The state follows a sharded parameter's new local tensor (FSDP2 re-pads the shard after
        `model.load_state_dict(..., assign=True)`, a `module._apply`, ...): the same rows of the parameter."""
        local = local_shard(self.sharded)
        if local is self.param:
            return
        if matrix_shape(local) != (self.rows, self.cols):
            raise ValueError(
                f"ZenFlowAdamW: a parameter of shape {tuple(self.sharded.shape)} now holds {tuple(local.shape)} "
                f"of its rows on this rank, where its optimizer state holds {self.rows} (resharded over "
                "another mesh). Fix: build the optimizer over the resharded model, or save its state_dict with "
                "torch.distributed.checkpoint and load it into a new one")
        self.param = local

    def as_columns(self) -> torch.Tensor:
        """The parameter viewed as [R, C] (a view: writes land in the parameter)."""
        return self.param.data.view(self.rows, self.cols)

    # -- the data-parallel reducer's view of a parameter -------------------------------------------------------
    def reduce_split_numel(self) -> tuple[int, int]:
        """(elements averaged on every rank, elements reduced into the owner) of the parameter's gradient."""
        slab = self.slab
        return slab.R * slab.k, slab.R * slab.u

    def split_grad_for_reduce(self, grad: torch.Tensor, replicated: Optional[torch.Tensor],
                              host: Optional[torch.Tensor]) -> None:
        """The gradient's selected columns ([R, k]) and unselected ones ([u, R]) into the reduction buffers."""
        slab, i = self.slab, self.index
        g = grad.reshape(slab.R, slab.C)
        if replicated is not None:
            if slab.whole:
                replicated.copy_(g.reshape(-1))
            else:
                torch.index_select(g, 1, slab.selected[i], out=replicated.view(slab.R, slab.k))
        if host is not None:
            torch.index_select(g.t(), 0, slab.host_columns[i], out=host.view(slab.u, slab.R))


def written_externally(members: Iterable[Member], check_written_params: Callable[[list[torch.Tensor]], None]
                       ) -> list[Member]:
    """The members whose parameter someone else wrote, checked (`check_written_params` refuses what their state
    cannot follow); a sharded one's state follows its new local tensor."""
    written = [m for m in members if m.watch.written_externally()]
    if written:
        check_written_params([m.registered for m in written])
        for member in written:
            if member.sharded is not None:
                member.follow_local_shard()
    return written


def slab_key(member: Member, num_selected: int) -> SlabKey:
    param = member.param
    large = member.key_numel > SHARED_SLAB_MAX_NUMEL.get(param.device.type, 0)
    return SlabKey(member.group_index, param.dtype, member.key_rows, member.cols, num_selected, member.owner,
                   member.pid if large else None, member.phase)


@dataclass
class MemberState:
    """One parameter's whole state in its natural [R, C] layout, on the host: what moves between slabs and into
    checkpoints; NaN where this rank does not know (a host part another rank owns). An exported state holds views
    of [C, R] tensors (`Slab.natural`), a fresh one None for master and moments: either is laid out without an
    intermediate copy."""

    master: Optional[torch.Tensor]  # fp32 [R, C] (None: the parameter's values)
    exp_avg: Optional[torch.Tensor]
    exp_avg_sq: Optional[torch.Tensor]
    step: torch.Tensor  # fp32 [C] per-column update counts
    selected: torch.Tensor  # int64 [k] ascending (empty: not selected yet)
    host_columns: Optional[torch.Tensor] = None  # the host columns' order, where the counts deciding it are unknown
    accumulator: Optional[torch.Tensor] = None  # fp32 [R, C] (host columns)
    square_accumulator: Optional[torch.Tensor] = None
    applied: Optional[torch.Tensor] = None  # [R, C] param dtype: the host columns as the device holds them
    selected_written: Optional[torch.Tensor] = None  # [R, k]: the parameter's selected columns, if not the master cast
    unapplied: bool = False  # a CPU update of the host columns has not reached the device yet
    step_grad: Optional[torch.Tensor] = None  # [R, C] param dtype: the gradient handed over this step
    step_scores: Optional[torch.Tensor] = None  # [C] fp32: its column scores

    @classmethod
    def fresh(cls, param: torch.Tensor, selected: Optional[torch.Tensor] = None) -> "MemberState":
        """A parameter's first state: its master the parameter's values (read by the slab that lays them out),
        zero moments and counts; `selected`: its first selection (None: none yet)."""
        _, C = matrix_shape(param)
        if selected is None:
            selected = torch.zeros(0, dtype=torch.long, device="cpu")
        return cls(None, None, None, torch.zeros(C, device="cpu"), selected)

    @classmethod
    def unknown(cls, rows: int, cols: int, selected: torch.Tensor) -> "MemberState":
        return cls(*(torch.full((rows, cols), math.nan, device="cpu") for _ in range(3)),
                   torch.full((cols,), math.nan, device="cpu"), selected)


__all__ = ["Member", "MemberState", "slab_key", "written_externally"]
