"""Matrices waiting for their first selection: a matrix whose first gradient arrives after warm-up holds only the
step's gradient and column scores, on the device, until `step()` selects it; then its slab is laid out once, with
its k selected columns, straight from the parameter (`Placement.select_first`), and takes the gradient as any
first gradient (`intake.take_first_gradient`). To the intake a `PendingSlab` is a whole slab with no host part,
so gradients reach it through the same calls (`BucketPlan`, `take_grad`, `exact_scores`).
"""

from __future__ import annotations

from typing import Callable

import torch

from zenflow_compile.runtime.state import intake
from zenflow_compile.runtime.state.layout import SlabKey
from zenflow_compile.runtime.state.members import Member


class PendingSlab:
    """n like matrices' gradient of this step ([n, R, C], their dtype) and its scores ([n, C] fp32)."""

    whole, has_host_part, accumulates_on_device, is_matrix, u = True, False, False, True, 0

    def __init__(self, key: SlabKey, members: list[Member], device: torch.device):
        self.key, self.device = key, device
        self.R, self.C, self.k, self.dtype = members[0].rows, key.cols, key.cols, key.dtype
        self.members_taken, self.several_backwards = 0, False
        self.extra_grads: list[dict] = [{}, {}]  # (none: a whole slab keeps no host part)
        self._hold(members)

    def _hold(self, members: list[Member]) -> None:
        self.members, self.n = members, len(members)
        for i, member in enumerate(members):
            member.slab, member.index = self, i
        self.grad = torch.empty(self.n, self.R, self.C, dtype=self.dtype, device=self.device)
        self.scores = torch.zeros(self.n, self.C, device=self.device)
        self.selected = torch.arange(self.C, device=self.device).expand(self.n, self.C)

    def hand_over(self, grad_slot: int) -> int:
        """Once its members are laid out in slabs: each slab takes its members' gradient and scores; returns the
        bytes sent device -> host. The buffers are let go (the copies keep alive what they still read)."""
        row = {id(member): i for i, member in enumerate(self.members)}
        sent = 0
        for slab in {id(m.slab): m.slab for m in self.members}.values():
            rows = [row[id(m)] for m in slab.members]
            grad, scores = self.grad, self.scores
            if rows != list(range(self.n)):  # (param groups edited before the step: split by group)
                grad, scores = grad[rows], scores[rows]
            sent += intake.take_first_gradient(slab, grad.to(slab.dtype), scores, grad_slot)
        for member in self.members:
            member.watch.remember()  # (the slab read its values just now)
        self.grad = self.scores = None
        return sent

    def keep_only(self, members: list[Member]) -> None:
        """Drop the other members (removed from the param groups before the step) with their gradients."""
        rows = [m.index for m in members]
        grad, scores = self.grad[rows], self.scores[rows]
        self._hold(members)
        self.grad.copy_(grad)
        self.scores.copy_(scores)
        self.members_taken = sum(1 for m in members if m.num_grads)
        self.several_backwards = any(m.num_grads > 1 for m in members)


class PendingPlacements:
    """The runtime's pending matrices: `members` by pid, in `slabs` grouped as their slabs would be."""

    def __init__(self):
        self.members: dict[int, Member] = {}
        self.slabs: list[PendingSlab] = []

    def __contains__(self, pid: int) -> bool:
        return pid in self.members

    def add(self, members: list[Member], key_of: Callable[[Member], SlabKey]) -> None:
        groups: dict[SlabKey, list[Member]] = {}
        for member in members:
            groups.setdefault(key_of(member), []).append(member)
        self.slabs += [PendingSlab(key, grouped, grouped[0].param.device) for key, grouped in groups.items()]
        self.members.update((m.pid, m) for m in members)

    def follow_param_groups(self, group_of: dict[int, int]) -> None:
        """`group_of`: every pid still in the param groups -> its group (see `ZenFlowRuntime.follow_param_groups`)."""
        for slab in list(self.slabs):
            kept = [m for m in slab.members if m.pid in group_of]
            for member in kept:
                member.group_index = group_of[member.pid]
            if not kept:
                self.slabs.remove(slab)
            elif len(kept) < slab.n:
                slab.keep_only(kept)
        self.members = {pid: m for pid, m in self.members.items() if pid in group_of}

    def clear(self) -> None:
        self.members, self.slabs = {}, []


__all__ = ["PendingPlacements", "PendingSlab"]
