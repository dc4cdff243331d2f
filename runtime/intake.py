"""How one bucket of gradients goes into its slabs (`BucketPlan`), and which members of a slab took one.

Every gradient source (the compiled graph's op, the eager `.grad`s handed over at `step()`, the data-parallel
reducer) reaches the runtime through `ZenFlowRuntime.take_grads`; a bucket's plan is made once per bucket
composition and layout, so a step costs a fixed number of calls per slab.
"""

from __future__ import annotations

from typing import Optional

import torch

from zenflow_compile.runtime.slab import Member, Slab


class BucketPlan:
    """Whole slabs in one batched call each (`Slab.take_grads`), the rest member by member (`Slab.take_grad`)."""

    def __init__(self, members: list[Member]):
        by_slab: dict[int, list[int]] = {}
        slabs = {}
        for position, member in enumerate(members):
            by_slab.setdefault(id(member.slab), []).append(position)
            slabs[id(member.slab)] = member.slab
        self.whole, self.singles = [], []
        for key, positions in by_slab.items():
            slab = slabs[key]
            if len(positions) == slab.n:
                positions.sort(key=lambda p: members[p].index)
                self.whole.append((slab, positions))
            else:
                self.singles += [(slab, members[p].index, p) for p in positions]

    def take(self, grads: list[torch.Tensor], scores: Optional[list], grad_slot: int) -> int:
        """Hand the bucket's gradients (and scores, or None) to their slabs; returns the bytes sent down."""
        sent = 0
        for slab, positions in self.whole:
            if slab.members_taken or any(grads[p].dtype != slab.dtype for p in positions):
                for p, member in zip(positions, slab.members):  # a later backward of the step
                    sent += slab.take_grad(member.index, grads[p], None if scores is None else scores[p], grad_slot)
                continue
            sent += slab.take_grads([grads[p] for p in positions],
                                    None if scores is None else [scores[p] for p in positions], grad_slot)
        for slab, i, p in self.singles:
            sent += slab.take_grad(i, grads[p], None if scores is None else scores[p], grad_slot)
        return sent


def rows_taken(slab: Slab) -> Optional[list[int]]:
    """The members of `slab` that took a gradient this step: None for all of them."""
    if slab.members_taken == slab.n:
        return None
    return [i for i, m in enumerate(slab.members) if m.num_grads]


__all__ = ["BucketPlan", "rows_taken"]
