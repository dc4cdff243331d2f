"""The step's blocking reads of device values on the host, each counted (`stats()["host_reads"]`): the host
synchronisation budget (ARCHITECTURE.md, "The device path"). One batched read per step of every value the
step's decisions need before anything is updated (`step_values`), and at a boundary that may reselect one
transfer of every matrix's scores (`scores`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from zenflow_compile.runtime.host_work import Stepped
from zenflow_compile.runtime.state.members import Member


@dataclasses.dataclass
class StepReadout:
    """What the step's one host read brought back (`HostReads.step_values`)."""

    norm: float  # global L2 norm of the unscaled gradient
    scale: float  # the loss scale the gradients carry (1 without a GradScaler)
    mean_scores: dict = dataclasses.field(default_factory=dict)  # Zen-auto: pid -> (selected, unselected) mean
    selecting_scores: dict = dataclasses.field(default_factory=dict)  # pid -> host scores, first selections


class HostReads:
    def __init__(self, counters: dict):
        self.counters = counters  # the runtime's; reads are counted in "host_reads"
        self.transfers = None  # set with the device
        self._norm_orders: dict[tuple, Optional[torch.Tensor]] = {}  # see _norm_order, for the current layout

    def forget_layout(self) -> None:
        self._norm_orders.clear()

    def step_values(self, stepped: Stepped, grad_scale: Optional[torch.Tensor], zen_auto: list,
                    selecting: list[Member]) -> StepReadout:
        """The step's one host read: the squared norm (the stepped members' squared norms summed in registration
        order), the loss scale, Zen-auto's mean scores (selected, unselected) per matrix, and the scores of the
        matrices selecting for the first time."""
        if not stepped:
            return StepReadout(norm=0.0, scale=1.0)
        per_member = torch.cat([slab.scores.sum(1) if rows is None else slab.scores.sum(1)[rows]
                                for slab, rows in stepped])
        order = self._norm_order(stepped)
        parts = [(per_member if order is None else per_member[order]).sum().float().reshape(1)]
        if grad_scale is not None:
            parts.append(grad_scale.to(parts[0].device).float().reshape(1))
        means_of = []
        for slab, rows in zen_auto:  # [n, 2]: each member's (selected, unselected) mean
            both = torch.stack([slab.scores.gather(1, cols).mean(1) for cols in (slab.selected, slab.host_columns)], 1)
            parts.append((both if rows is None else both[rows]).reshape(-1))
            means_of += slab.members if rows is None else [slab.members[i] for i in rows]
        parts += [m.slab.scores[m.index] for m in selecting]
        values = self.read(torch.cat(parts))
        scale, head = (1.0, 1) if grad_scale is None else (float(values[1]), 2)
        means, *first_scores = values[head:].split([2 * len(means_of), *(m.cols for m in selecting)])
        return StepReadout(norm=math.sqrt(float(values[0])) / scale, scale=scale,
                           mean_scores={m.pid: tuple(pair) for m, pair in zip(means_of, means.view(-1, 2).tolist())},
                           selecting_scores={m.pid: scores for m, scores in zip(selecting, first_scores)})

    def _norm_order(self, stepped: Stepped) -> Optional[torch.Tensor]:
        """The permutation that puts the stepped members' squared norms (slab by slab) in registration order
        (None: they are), made once per layout and set of stepped members."""
        key = tuple((id(slab), rows if rows is None else tuple(rows)) for slab, rows in stepped)
        if key not in self._norm_orders:
            pids = [slab.members[i].pid for slab, rows in stepped for i in (range(slab.n) if rows is None else rows)]
            order = sorted(range(len(pids)), key=pids.__getitem__)
            self._norm_orders[key] = (None if order == list(range(len(order)))
                                      else self.transfers.indices_to_device([torch.tensor(order, device="cpu")])[0])
        return self._norm_orders[key]

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """A blocking device -> host read (on CUDA, a synchronisation): every one the step makes goes
        through here and is counted."""
        self.counters["host_reads"] += 1
        return self.transfers.read_to_host(tensor)

    def scores(self, slabs: Stepped) -> list[torch.Tensor]:
        """Every slab's step scores ([n, C]) on the host, in one transfer."""
        if not slabs:
            return []
        flat = self.read(torch.cat([slab.scores.reshape(-1) for slab, _ in slabs]))
        return [part.view(slab.n, slab.C) for part, (slab, _) in
                zip(flat.split([slab.scores.numel() for slab, _ in slabs]), slabs)]


__all__ = ["HostReads", "StepReadout"]
