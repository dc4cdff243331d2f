"""Placement: which parameters one optimizer holds and where their state is: owners (data parallel), slabs and
members, matrices waiting for their first selection (`state/pending.py`), and `accumulate_on`. The engine asks
it to lay state out (first gradient, first selection, cast, param-group edit, checkpoint load); `version`
counts the layouts. Values others write into the parameters are adopted here: the parameter is the source of
truth."""

from __future__ import annotations

import operator
from typing import Callable, Optional

import torch

from zenflow_compile.runtime.state import columns as column_moves, watch
from zenflow_compile.runtime.state.layout import accumulator_bytes, top_k_columns
from zenflow_compile.runtime.state.members import Member, MemberState, slab_key, written_externally
from zenflow_compile.runtime.state.pending import PendingPlacements
from zenflow_compile.runtime.state.slab import Slab
from zenflow_compile.runtime.transfers import Transfers

# accumulate_on="auto": the device when the accumulators take at most this share of its free memory at the first
# layout; the rest is for activations that grow later (longer sequences, evaluation batches) and fragmentation.
DEVICE_ACCUMULATOR_SHARE = 0.5

_DTYPE = operator.attrgetter("dtype")


class Placement:
    def __init__(self, config, data_parallel, sharded: bool = False):
        self.config = config
        self.data_parallel = data_parallel
        self.sharded = sharded  # FSDP2: members watch their parameters' DTensors
        self.rank = data_parallel.rank if data_parallel is not None else 0
        self.transfers: Optional[Transfers] = None  # set by the first parameter: one device per optimizer
        self.owners: dict[int, int] = {}  # data parallel: pid -> rank holding its host state (set at creation)
        self.params: dict[int, tuple[torch.Tensor, int]] = {}  # every owned parameter: id -> (param, group)
        # stagger_boundaries: each matrix's phase, and the elements each phase holds (`assign_phase`)
        self.phases: dict[int, int] = {}
        self._phase_numel = [0] * config.num_phases
        self.phases_in_use = [0]  # phase 0 and the phases holding a matrix (one without has no boundaries)
        # State only for parameters that got a gradient: a frozen one costs nothing and is never written.
        self.members: dict[int, Member] = {}  # pid -> its place in a slab, in registration (pid) order
        self.slabs: list[Slab] = []
        self.pending = PendingPlacements()  # matrices laid out at this step's first selection
        # "device" or "host": where the unselected columns' gradients are summed; decided at the first layout.
        self.accumulate_on: Optional[str] = None
        self.version = 0  # layouts of the slabs so far
        self._watched = None  # (version, params, what their watches saw) for the current members

    def owner(self, pid: int, param: torch.Tensor) -> int:
        """The rank holding the parameter's host state, assigned in the same order on every rank."""
        if self.data_parallel is None:
            return 0
        if pid not in self.owners:
            self.owners[pid] = self.data_parallel.assign_owner(param.numel())
        return self.owners[pid]

    def assign_phase(self, pid: int, param: torch.Tensor) -> None:
        """A matrix joins the phase holding the fewest elements so far (lowest on a tie), so that the phases'
        CPU updates stay about equal, the same on every rank."""
        if param.dim() >= 2 and pid not in self.phases:
            phase = self.phases[pid] = self._phase_numel.index(min(self._phase_numel))
            self._phase_numel[phase] += param.numel()  # (a DTensor's: the whole parameter's)
            if phase not in self.phases_in_use:
                self.phases_in_use = sorted([*self.phases_in_use, phase])

    def new_member(self, pid: int) -> Member:
        param, group_index = self.params[pid]
        owner = self.owner(pid, param)
        return Member(param, pid, group_index, owner, owns_host=owner == self.rank, phase=self.phases.get(pid, 0))

    def create_members(self, pids: list[int], selects_now: bool) -> list[Member]:
        """State for those of `pids` without any, from their current values, in new slabs. With `selects_now`
        (warm-up over) a matrix waits for its first selection holding only its gradient (`state/pending.py`),
        except with ZenFlow's data parallelism, whose reducer splits gradients by columns as they arrive.
        Returns every pid's member."""
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
        """New slabs for `members`, one per key; `together`: per member, a group id that slabs do not mix."""
        groups: dict[tuple, list[int]] = {}
        for position, member in enumerate(members):
            k = member.cols if not member.is_matrix else states[position].selected.numel()
            key = slab_key(member, k)
            groups.setdefault((key, None if together is None else together[position]), []).append(position)
        for (key, _), positions in groups.items():
            slab = Slab(key, [members[p] for p in positions], [states[p] for p in positions], self.transfers,
                        accumulate_squares=self.config.interval_second_moment,
                        accumulate_on_device=self.accumulates_on_device(),
                        upload_early=self.data_parallel is None, offload_moments=self.config.offload)
            self.slabs.append(slab)
        for member in members:
            self.members[member.pid] = member
        # Registration (pid) order: the global norm sums the members in this order.
        self.members = dict(sorted(self.members.items()))
        self.version += 1

    def replace_slabs(self, old: list[Slab], members: list[Member], states: list[MemberState]) -> None:
        gone = {id(slab) for slab in old}
        together = [id(m.slab) for m in members]
        self.slabs = [slab for slab in self.slabs if id(slab) not in gone]
        self.add_slabs(members, states, together)

    def clear(self) -> None:
        self.members, self.slabs = {}, []
        self.pending.clear()
        self.version += 1

    # -- first selection ------------------------------------------------------------------------------------
    def select_first(self, selecting: list[Member], readout, grad_slot: int) -> int:
        """The members' first selection (top-k of the step's scores in `readout`): their state and this step's
        gradient move into slabs of k selected columns. Returns the bytes their gradients sent to the host."""
        sent = 0
        old_slabs = list({id(m.slab): m.slab for m in selecting if m.pid not in self.pending}.values())
        while old_slabs:  # one slab at a time: the host holds one slab's state twice, never the model's
            old = old_slabs.pop(0)
            members = list(old.members)
            states = [old.export_member(m.index, with_step_grad=grad_slot) for m in members]
            for member, state in zip(members, states):
                if member.pid not in readout.selecting_scores:
                    continue  # (a member of the same slab without a gradient this step stays unselected)
                state.selected = self._first_selection(member, readout)
                if self.data_parallel is not None:
                    column_moves.share_first_selection(member, state, self.data_parallel)
            self.replace_slabs([old], members, states)
            del old, states
        for pending in self.pending.slabs:  # laid out once, selected, straight from the parameters (pending.py)
            states = [MemberState.fresh(m.param, self._first_selection(m, readout)) for m in pending.members]
            self.add_slabs(pending.members, states, together=[0] * pending.n)
            sent += pending.hand_over(grad_slot)
        self.pending.clear()
        return sent

    def _first_selection(self, member: Member, readout) -> torch.Tensor:
        """Top-k of the step's scores (Zen-auto: their means too)."""
        host_scores = readout.selecting_scores[member.pid]
        selected = top_k_columns(host_scores, self.config.num_selected(member.cols))
        if self.config.auto_update and selected.numel() < member.cols:
            unselected = torch.ones(member.cols, dtype=torch.bool, device="cpu")
            unselected[selected] = False
            readout.mean_scores[member.pid] = (float(host_scores[selected].mean()),
                                               float(host_scores[unselected].mean()))
        return selected

    # -- values written by others ---------------------------------------------------------------------------
    def _watched_params(self) -> tuple[list, list]:
        if self._watched is None or self._watched[0] != self.version:
            members = list(self.members.values())
            self._watched = (self.version, [m.watch.watched for m in members], [m.watch.seen for m in members])
        return self._watched[1], self._watched[2]

    def adopt_external_writes(self, grad_slot: int, check_written_params: Callable[[list[torch.Tensor]], None],
                              drain: Callable[[], None]) -> None:
        """Values written into a parameter by anyone else since the optimizer's last write (version counter
        or storage changed) become the master (docs/semantics.md). `check_written_params` refuses what the
        state cannot follow; `drain` waits for the CPU work in flight (it uses the host masters)."""
        params, seen = self._watched_params()
        if watch.watch_keys(params, self.sharded) == seen:
            return
        written = written_externally(self.members.values(), check_written_params)
        if not written:
            return
        drain()
        cast = [m for m in written if m.param.dtype != m.slab.dtype]
        for member in written:
            if member.param.dtype == member.slab.dtype:
                watch.adopt_param_values(member.slab, member.index)
        if cast:
            self._adopt_cast(cast, grad_slot)
        self._watched = None

    def adopt_casts(self, grad_slot: int, check_written_params, drain) -> None:
        """A cast parameter (model.to(dtype)) gets buffers in its new dtype before the step's first gradient
        lands (else an upcast's gradient is rounded to the old dtype); other writes wait for the step."""
        params, seen = self._watched_params()
        if list(map(_DTYPE, params)) != [s[-1] for s in seen]:
            self.adopt_external_writes(grad_slot, check_written_params, drain)

    def _adopt_cast(self, cast: list[Member], grad_slot: int) -> None:
        """Slabs of cast parameters laid out again in the new dtypes. As with any write, values that differ from
        what the optimizer left (in the old dtype) become the master: an upcast keeps every master bit, a
        downcast adopts what it rounded. Accumulators, a pending CPU update and this step's gradients move
        over."""
        old = {id(m.slab): m.slab for m in cast}
        members = [m for slab in old.values() for m in slab.members]
        states = []
        for member in members:
            slab, i = member.slab, member.index
            left = watch.left_in_param(slab, i)
            state = slab.export_member(i, with_step_grad=grad_slot)
            current = member.as_columns().detach().cpu()
            watch.adopt_changed(current, left, state.master)
            state.applied = current  # what the device holds
            state.selected_written = current[:, state.selected]
            states.append(state)
        self.replace_slabs(list(old.values()), members, states)
        for member in members:
            member.watch.remember()

    # -- where the sums are ---------------------------------------------------------------------------------
    def accumulates_on_device(self) -> bool:
        """Decided once, at the first layout: `accumulate_on`; "auto" is the device where it is not the host,
        without ZenFlow's data parallelism, and where every trainable parameter's accumulators (`accumulator_bytes`)
        take at most `DEVICE_ACCUMULATOR_SHARE` of its free memory."""
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
