"""Placement: which parameters one optimizer holds and where their state is. A parameter's owner (the rank
holding its host state, data parallel), the slabs and each parameter's member in one of them, the matrices
waiting for their first selection (`state/pending.py`), and where the unselected columns' gradients are
summed (`accumulate_on`). The engine asks it to lay state out (a parameter's first gradient, a first
selection, a cast, a param-group edit, a checkpoint load); `version` counts the layouts (the engine drops
what it planned for the old one)."""

from __future__ import annotations

from typing import Optional

import torch

from zenflow_compile.runtime.state.layout import accumulator_bytes
from zenflow_compile.runtime.state.members import Member, MemberState, slab_key
from zenflow_compile.runtime.state.pending import PendingPlacements
from zenflow_compile.runtime.state.slab import Slab
from zenflow_compile.runtime.transfers import Transfers

# Auto placement of the accumulators (`accumulate_on="auto"`): on the device when they take at most this share
# of its free memory when the state is first laid out; the rest is left for activations that grow later
# (longer sequences, a larger batch at evaluation) and the allocator's fragmentation.
DEVICE_ACCUMULATOR_SHARE = 0.5


class Placement:
    def __init__(self, config, data_parallel):
        self.config = config
        self.data_parallel = data_parallel
        self.rank = data_parallel.rank if data_parallel is not None else 0
        self.transfers: Optional[Transfers] = None  # set by the first parameter: one device per optimizer
        self.owners: dict[int, int] = {}  # data parallel: pid -> rank holding its host state (set at creation)
        self.params: dict[int, tuple[torch.Tensor, int]] = {}  # every owned parameter: id -> (param, group)
        # Optimizer state exists only for parameters that got a gradient: a frozen (or never used) parameter
        # costs no host memory and no transfers, and is never written.
        self.members: dict[int, Member] = {}  # pid -> its place in a slab, in registration (pid) order
        self.slabs: list[Slab] = []
        self.pending = PendingPlacements()  # matrices laid out at this step's first selection
        # Where the unselected columns' gradients are summed, "device" or "host"; None until the first state is
        # laid out ("auto" looks at the device's free memory then).
        self.accumulate_on: Optional[str] = None
        self.version = 0  # layouts of the slabs so far

    def owner(self, pid: int, param: torch.Tensor) -> int:
        """The rank that holds the parameter's host state: decided when the optimizer takes a trainable
        parameter (else when its state is created), in the same order on every rank."""
        if self.data_parallel is None:
            return 0
        if pid not in self.owners:
            self.owners[pid] = self.data_parallel.assign_owner(param.numel())
        return self.owners[pid]

    def new_member(self, pid: int) -> Member:
        param, group_index = self.params[pid]
        owner = self.owner(pid, param)
        return Member(param, pid, group_index, owner, owns_host=owner == self.rank)

    def create_members(self, pids: list[int], selects_now: bool) -> list[Member]:
        """State for the parameters of `pids` that have none yet, from their current values (a parameter's state
        is created at its first gradient), in new slabs; with `selects_now` (warm-up is over) a matrix waits for
        its first selection at this step holding only its gradient (`state/pending.py`), except with ZenFlow's
        own data parallelism, whose reducer splits each gradient by its slab's columns as it arrives. Returns
        every pid's member."""
        new = []
        for pid in dict.fromkeys(pids):
            if pid not in self.members and pid not in self.pending:
                member = self.new_member(pid)
                if member.is_matrix and not member.param.is_contiguous():
                    param = member.param
                    raise ValueError(
                        f"ZenFlowAdamW needs contiguous parameters; got one of shape {tuple(param.shape)} with "
                        f"strides {param.stride()}. Make it contiguous (param.data = param.data.contiguous()) first.")
                new.append(member)
        pending = [m for m in new if m.is_matrix and selects_now and self.data_parallel is None]
        if pending:
            self.accumulates_on_device()  # (decided when the first state is made, as for any other)
            self.pending.add(pending, lambda member: slab_key(member, 0))
        laid_out = [m for m in new if m.pid not in self.pending]
        if laid_out:
            self.add_slabs(laid_out, [MemberState.fresh(m.param) for m in laid_out])
        return [self.members[pid] if pid in self.members else self.pending.members[pid] for pid in pids]

    def add_slabs(self, members: list[Member], states: list[MemberState], together: Optional[list] = None) -> None:
        """New slabs for `members` (their states laid out), one per key; `together`: per member, a group id
        (members of different groups never share a slab: those of one old slab stay together)."""
        groups: dict[tuple, list[int]] = {}
        for position, member in enumerate(members):
            k = member.cols if not member.is_matrix else states[position].selected.numel()
            key = slab_key(member, k)
            groups.setdefault((key, None if together is None else together[position]), []).append(position)
        for (key, _), positions in groups.items():
            slab = Slab(key, [members[p] for p in positions], [states[p] for p in positions], self.transfers,
                        accumulate_squares=self.config.interval_second_moment,
                        accumulate_on_device=self.accumulates_on_device(),
                        upload_early=self.data_parallel is None)
            self.slabs.append(slab)
        for member in members:
            self.members[member.pid] = member
        # Registration order (ids grow with it): the global norm sums the members in this order.
        self.members = dict(sorted(self.members.items()))
        self.version += 1

    def replace_slabs(self, old: list[Slab], members: list[Member], states: list[MemberState]) -> None:
        """`old` slabs give way to new ones for `members` (laid out from `states`)."""
        gone = {id(slab) for slab in old}
        together = [id(m.slab) for m in members]
        self.slabs = [slab for slab in self.slabs if id(slab) not in gone]
        self.add_slabs(members, states, together)

    def clear(self) -> None:
        """No state at all (a checkpoint's states follow)."""
        self.members, self.slabs = {}, []
        self.pending.clear()
        self.version += 1

    def accumulates_on_device(self) -> bool:
        """Where the unselected columns' gradients are summed, decided once, when the first state is laid out:
        `accumulate_on`, or for "auto" the device where it is not the host, without ZenFlow's own data
        parallelism, and where the accumulators of every parameter that trains (fp32, with the gradient's
        staging buffer and, with interval_second_moment, the squares) take at most `DEVICE_ACCUMULATOR_SHARE`
        of the device's free memory."""
        if self.accumulate_on is None:
            choice = self.config.accumulate_on
            if choice == "auto":
                fits = (not self.transfers.device_is_host and self.data_parallel is None
                        and accumulator_bytes([p for p, _ in self.params.values()], self.config)
                        <= DEVICE_ACCUMULATOR_SHARE * self.transfers.free_device_bytes())
                choice = "device" if fits else "host"
            self.accumulate_on = choice
        return self.accumulate_on == "device"


__all__ = ["DEVICE_ACCUMULATOR_SHARE", "Placement"]
