"""Optimizer state born flat: the parameters of one slab share every state tensor, one row each.

A slab holds n like parameters: one param group, one dtype, one [R, C] shape (a matrix of any dim viewed as
[shape[0], rest]; a vector of N elements as [N, 1]), k selected columns each. Its tensors, row i being
member i's (u = C - k host columns):

    device  grad [n, R, k] (param dtype)      master, exp_avg, exp_avg_sq [n, R, k] fp32
            counts [n, k] fp32 (per-column update counts)    selected [n, k], host_columns [n, u] int64
            scores [n, C] fp32 (this step's squared column norms)
    host    master, exp_avg, exp_avg_sq [n, u, R] fp32       host_counts [n, u] fp32
            accumulators[2], square_accumulators[2] [n, u, R] fp32 (by interval parity)
            host_grads[2] [n, u, R] (by step parity), host_weights[2] [n, u, R] (by update parity): pinned,
            the param dtype; host_scores [n, u] pinned

Where the unselected columns' gradients are summed (`accumulate_on`): on the host, each step's host columns
are copied into host_grads and a worker adds them into the accumulators; on the device, they are gathered
into `rest_grad` [n, u, R] (param dtype) and added on the device into `device_acc` (and `device_sq_acc`)
[n, u, R] fp32, which a boundary copies into the pinned accumulators[slot] once per interval (host_grads then
do not exist). A slab before its first selection (k = 0: warm-up, a boundary every step) sums on the host.

Host tensors are transposed, [u, R] per member, so one column is one contiguous row: the offload of the
unselected columns is one contiguous copy, and the CPU AdamW runs over whole rows. A member's host columns
are ordered by update count, so equal counts form runs (one fused-AdamW tensor each; out of order after a
reselection made in flight, see `Slab.host_adamw_`). A vector is a slab of k = C = 1: all of its state on
the device.

Per step a slab costs a fixed number of calls whatever n is: the hand-off stacks its gradients once and
gathers the selected and the host columns in one call each; the device AdamW, the accumulation, the CPU
AdamW and the merge each take the slab's tensors whole. Where only some members take part (a later
backward of the step, a parameter without gradient, data parallelism) the same work runs on the members'
rows. A parameter of more than `SHARED_SLAB_MAX_NUMEL` elements gets a slab of its own, so stacking never
copies a large gradient.

The layout changes only in two ways. A reselection writes the new columns into the same tensors (k and u are
fixed by topk_ratio). Anything else (a member's first selection, a cast, a param-group edit, a checkpoint
load) exports the members' state (`MemberState`) and builds new slabs from it.

Data parallel: every rank holds the device part of every member; only a member's `owner` holds its host part,
so a slab's key says whether this rank owns its members' host parts (`owns_host`).

Sharded parameters (FSDP2, runtime/sharding.py): a member is this rank's rows of its parameter (R = the local
rows, possibly 0); its slab is keyed by the global shape, so every rank has the same slabs in the same order.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from zenflow_compile.runtime import kernels
from zenflow_compile.runtime.sharding import is_sharded, local_shard
from zenflow_compile.runtime.transfers import Transfers, wait_events

# Largest parameter (elements) that shares a slab with others: stacking its gradient in the hand-off copies it
# once more, which pays while a tensor costs more in per-call host time than in bandwidth (CPU: ~5 us of host
# time per call vs ~10 GB/s; CUDA: the same host time vs TB/s).
SHARED_SLAB_MAX_NUMEL = {"cpu": 1 << 14, "cuda": 1 << 20}


def top_k_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, ties to the lower index, in ascending order (on the host). `scores`
    may be [n, C]: the top k of each row."""
    order = torch.sort(scores.detach().cpu(), dim=-1, descending=True, stable=True).indices
    return order[..., :k].sort(dim=-1).values


def host_order(counts: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """[n, u]: each row's unselected columns ordered by update count (stable: ties by column; an unknown,
    NaN, count orders as 0), from counts [n, C] and the selected columns [n, k]."""
    keys = torch.nan_to_num(counts, nan=0.0).scatter(1, selected, math.inf)  # selected columns sort last
    return torch.sort(keys, dim=1, stable=True).indices[:, :counts.shape[1] - selected.shape[1]].contiguous()


def matrix_shape(param: torch.Tensor) -> tuple[int, int]:
    """[R, C] of a parameter as the state sees it: a matrix [shape[0], rest], a vector [N, 1]."""
    if param.dim() >= 2:
        return param.shape[0], math.prod(param.shape[1:])  # (a rank's shard may hold no rows)
    return param.numel(), 1


def _plain(grad: torch.Tensor, shape: tuple) -> torch.Tensor:
    """`grad` detached and viewed as `shape` (no call when it already is)."""
    if grad.requires_grad:
        grad = grad.detach()
    return grad if grad.shape == shape else grad.reshape(shape)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


_VERSION = operator.attrgetter("_version")
_DTYPE = operator.attrgetter("dtype")
_LOCAL = operator.attrgetter("_local_tensor")


def watch_keys(watched: list[torch.Tensor], sharded: bool) -> list[tuple]:
    """What `ParamWatch` compares, for many parameters in one pass of builtins (the common case, nothing
    written, costs ~0.1 us a parameter). A parameter: (version, storage, dtype). A sharded one (its DTensor):
    the DTensor's version (an in-place write through the DTensor, as `load_state_dict` makes, bumps the
    DTensor's counter and not its local tensor's), which local tensor it holds (FSDP2 may give it a new one)
    and that tensor's version, storage and dtype. The dtype comes last in both."""
    if not sharded:
        return list(zip(map(_VERSION, watched), map(torch.Tensor.data_ptr, watched), map(_DTYPE, watched)))
    local = list(map(_LOCAL, watched))
    return list(zip(map(_VERSION, watched), map(id, local), map(_VERSION, local),
                    map(torch.Tensor.data_ptr, local), map(_DTYPE, local)))


class ParamWatch:
    """Tells whether anyone but the optimizer wrote a parameter since the optimizer last looked.

    The optimizer writes through `param.data`, which leaves the parameter's version counter alone; an in-place
    write by anyone else (`load_state_dict`, an init routine, `p.copy_`) bumps it, and `p.data = other`
    changes its storage. `watched`: the parameter, or for a sharded one its DTensor (`watch_keys`).
    """

    def __init__(self, watched: torch.Tensor, sharded: bool):
        self.watched, self.sharded = watched, sharded
        self.remember()

    def remember(self) -> None:
        self.seen = watch_keys([self.watched], self.sharded)[0]

    def written_externally(self) -> bool:
        return watch_keys([self.watched], self.sharded)[0] != self.seen


def adopt_changed(current: torch.Tensor, last_written: torch.Tensor, master: torch.Tensor) -> None:
    """master := current where current differs from what the optimizer last wrote (elementwise), so untouched
    elements keep their fp32 master bits (a bf16 parameter cannot hold them)."""
    changed = current != last_written
    master.copy_(torch.where(changed, current.float(), master))


@dataclass
class MemberState:
    """One parameter's whole state in its natural [R, C] layout, on the host: what moves between slabs and
    into checkpoints. NaN where this rank does not know (a host part another rank owns). A state a slab
    exports holds [R, C] views of [C, R] tensors (`Slab._natural`), a fresh one's moments are None (zeros):
    both so that a new slab lays them out without a transpose (`_columns_as_rows`)."""

    master: torch.Tensor  # fp32 [R, C]
    exp_avg: Optional[torch.Tensor]
    exp_avg_sq: Optional[torch.Tensor]
    step: torch.Tensor  # fp32 [C] per-column update counts
    selected: torch.Tensor  # int64 [k] ascending (empty: not selected yet)
    host_columns: Optional[torch.Tensor] = None  # the host columns' order, when the counts that decide it are unknown here
    accumulator: Optional[torch.Tensor] = None  # fp32 [R, C] (host columns)
    square_accumulator: Optional[torch.Tensor] = None
    applied: Optional[torch.Tensor] = None  # [R, C] param dtype: the host columns as the device holds them
    selected_written: Optional[torch.Tensor] = None  # [R, k] param dtype: the selected columns as the device holds
    # them, where that is not the master cast (after a cast, until the device update rewrites them)
    unapplied: bool = False  # a CPU update of the host columns has not reached the device yet
    step_grad: Optional[torch.Tensor] = None  # [R, C] param dtype: the gradient handed over this step
    step_scores: Optional[torch.Tensor] = None  # [C] fp32: its column scores

    @classmethod
    def fresh(cls, param: torch.Tensor) -> "MemberState":
        R, C = matrix_shape(param)
        master = param.detach().reshape(R, C).float().cpu()  # (read once, by the slab that lays it out)
        return cls(master, None, None, torch.zeros(C, device="cpu"), torch.zeros(0, dtype=torch.long, device="cpu"))

    @classmethod
    def unknown(cls, rows: int, cols: int, selected: torch.Tensor) -> "MemberState":
        return cls(*(torch.full((rows, cols), math.nan, device="cpu") for _ in range(3)),
                   torch.full((cols,), math.nan, device="cpu"), selected)


def _cut(tensors: list[Optional[torch.Tensor]], lengths: list[int]) -> list[tuple]:
    """(master, grad, exp_avg, exp_avg_sq, grad_sq) 2-D row tensors cut into runs of `lengths` rows: one tuple
    per run."""
    return list(zip(*(t.split(lengths) if t is not None else [None] * len(lengths) for t in tensors)))


def _cpu_adamw_(runs: list, steps: torch.Tensor, hyperparameters: dict) -> None:
    """One fused CPU AdamW over `runs` ((master, grad, exp_avg, exp_avg_sq, grad_sq) each), run i at update
    count steps[i]."""
    masters, grads, exp_avgs, exp_avg_sqs, grad_sqs = (list(column) for column in zip(*runs))
    kernels.cpu_adamw_(masters, grads, exp_avgs, exp_avg_sqs, steps.clone().unbind(0),  # (incremented in place)
                       grad_sqs=None if grad_sqs[0] is None else grad_sqs, **hyperparameters)


# `Slab.acc_sent` where the device is the host: the copy was made at once, no event to wait for.
_SENT = object()


def columns_not_in(columns: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """[n, k] bool: whether columns[i, j] is not among others[i] (two members' selections compared row by row)."""
    return ~(columns.unsqueeze(2) == others.unsqueeze(1)).any(2)


class RowScratch:
    """A host buffer, kept between reselections, that host rows are reordered through. A fresh buffer the
    size of a slab's state would cost more in page faults than the copies themselves (measured on the CPU:
    0.3-1.9 s against 0.05 s for 380 MB of rows), so it is reused, and bounded: a slab is reordered a few
    members at a time."""

    CHUNK_ELEMENTS = 1 << 24  # 64 MB of fp32 rows, or one member's rows where those are more

    def __init__(self):
        self.buffer = torch.empty(0, device="cpu")

    def reorder_rows_(self, state: torch.Tensor, order: torch.Tensor) -> None:
        """state[i] = state[i][order[i]] for every member i of `state` ([n, u, R]; `order` [n, u])."""
        n, u, R = state.shape
        if not state.numel():  # (a rank holding none of the rows: FSDP2)
            return
        members = max(1, self.CHUNK_ELEMENTS // (u * R))
        for start in range(0, n, members):
            stop = min(n, start + members)
            rows = (order[start:stop] + torch.arange(stop - start, device="cpu").unsqueeze(1) * u).reshape(-1)
            block = state[start:stop].view(-1, R)
            if self.buffer.numel() < block.numel():
                self.buffer = torch.empty(block.numel(), dtype=state.dtype, device="cpu")
            reordered = self.buffer[:block.numel()].view(-1, R)
            torch.index_select(block, 0, rows, out=reordered)
            block.copy_(reordered)


class Member:
    """One parameter's place in its slab (`slab`, `index`) and its per-parameter bookkeeping."""

    def __init__(self, param: torch.Tensor, pid: int, group_index: int, owner: int, owns_host: bool):
        # A parameter sharded by FSDP2 (runtime/sharding.py): the state is that of this rank's rows, and the
        # slab it joins is chosen by its global shape (`key_rows`, `key_numel`), the same on every rank.
        self.key_rows, self.key_numel = matrix_shape(param)[0], param.numel()
        self.sharded = param if is_sharded(param) else None  # (its DTensor: the local tensor may be replaced)
        param = local_shard(param)
        self.param, self.pid, self.group_index = param, pid, group_index
        self.owner, self.owns_host = owner, owns_host
        self.is_matrix = param.dim() >= 2
        self.rows, self.cols = matrix_shape(param)
        self.watch = ParamWatch(self.registered, self.sharded is not None)
        self.slab: Optional[Slab] = None
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
        """A sharded parameter whose DTensor holds another local tensor than the one the state was made for
        (FSDP2 re-pads the shard after `model.load_state_dict(..., assign=True)` with swapped parameters, a
        `module._apply`, ...): the state follows the new one. Its rows are the same rows of the parameter."""
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

    # (the data-parallel reducer's view of a parameter)
    def reduce_split_numel(self) -> tuple[int, int]:
        return self.slab.reduce_split_numel()

    def split_grad_for_reduce(self, grad, replicated, host) -> None:
        self.slab.split_grad_for_reduce(self.index, grad, replicated, host)


class SlabKey(NamedTuple):
    group_index: int
    dtype: torch.dtype
    rows: int  # (sharded parameters: the global rows; the slab holds this rank's share of them)
    cols: int
    num_selected: int  # k (0 before a matrix's first selection; a vector's is its one column)
    owner: int  # the rank holding the members' host parts (data parallel; else 0)
    alone: Optional[int]  # the pid of a parameter too large to share its slab, else None


def slab_key(member: Member, num_selected: int) -> SlabKey:
    param = member.param
    large = member.key_numel > SHARED_SLAB_MAX_NUMEL.get(param.device.type, 0)
    return SlabKey(member.group_index, param.dtype, member.key_rows, member.cols, num_selected, member.owner,
                   member.pid if large else None)


def _columns_index(columns: torch.Tensor, rows: int) -> torch.Tensor:
    """[n, k] column indices as a gather index over [n, R, C] (an expanded view: no memory)."""
    return columns.unsqueeze(1).expand(-1, rows, -1)


def _columns_as_rows(naturals: list[Optional[torch.Tensor]], dtype: torch.dtype, columns: torch.Tensor,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[n, m, R] on the host (into `out` if given): the columns `columns` ([n, m]) of each of n [R, C] tensors
    (None: zeros) as rows. One pass per member where its tensor is by column already (a state a slab exported:
    `_natural`) or `columns` is every column in order; else torch's blocked transpose, then the gather."""
    n, m = columns.shape
    rows = next(t for t in naturals if t is not None).shape[0]
    out = torch.empty(n, m, rows, dtype=dtype, device="cpu") if out is None else out
    every = torch.arange(m, device="cpu")
    for row, natural, cols in zip(out, naturals, columns):
        if natural is None:
            row.zero_()
        elif natural.t().is_contiguous():
            torch.index_select(natural.t().to(dtype), 0, cols, out=row)
        elif m == natural.shape[1] and torch.equal(cols, every):
            row.copy_(natural.t())
        else:
            torch.index_select(natural.to(dtype).t().contiguous(), 0, cols, out=row)
    return out


def _device_columns(naturals: list[Optional[torch.Tensor]], dtype: torch.dtype, columns: torch.Tensor,
                    device: torch.device) -> torch.Tensor:
    """[n, R, k] on `device`: the columns `columns` ([n, k]) of each of n [R, C] tensors (None: zeros)."""
    return _columns_as_rows(naturals, dtype, columns).to(device).transpose(1, 2).contiguous()


class _Columns(NamedTuple):
    """Some columns' whole state, one row each (column j of member `member[j]`): `place` is its device slot
    (arriving columns) or host row (departing ones)."""

    member: torch.Tensor  # [m] int64
    place: torch.Tensor  # [m] int64
    master: torch.Tensor  # [m, R] fp32, on the host
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    counts: torch.Tensor  # [m] fp32
    weights: Optional[torch.Tensor] = None  # [m, R] param dtype: what the parameter holds (departing columns)


class Slab:
    """The state of n like parameters (see the module docstring)."""

    # Runs of equal update count shorter than this on average (host rows out of count order) are updated
    # apart from the most common count: one fused call per run would cost more than gathering them.
    SHORT_RUN_ROWS = 64

    def __init__(self, key: SlabKey, members: list[Member], states: list[MemberState], transfers: Transfers,
                 accumulate_squares: bool, accumulate_on_device: bool = False, upload_early: bool = False):
        self.key, self.members, self.transfers = key, members, transfers
        self.n, self.R, self.C, self.k = len(members), members[0].rows, key.cols, key.num_selected
        self.u = self.C - self.k
        self.dtype, self.device = key.dtype, members[0].param.device
        self.is_matrix = members[0].is_matrix
        self.owns_host = members[0].owns_host
        self.accumulate_squares = accumulate_squares
        for i, member in enumerate(members):
            member.slab, member.index = self, i
        n, R, C, k, u, dev = self.n, self.R, self.C, self.k, self.u, self.device
        if k == C:  # every column selected (vectors): the device layout is the parameter's own
            selected = torch.arange(C, device="cpu").expand(n, C).contiguous()
        elif k:
            selected = torch.stack([s.selected for s in states])
        else:
            selected = torch.zeros(n, 0, dtype=torch.long, device="cpu")
        counts = torch.stack([s.step for s in states])
        host_columns = self._host_order(selected, counts, states)
        self.selected_cpu, self.host_columns_cpu = selected, host_columns
        self.has_host_part = self.owns_host and u > 0
        self.accumulates_on_device = accumulate_on_device and self.has_host_part and k > 0
        # The update worker queues its columns' upload as soon as it has published them (one process, a device
        # that is not the host); `uploaded` is that (device tensor, event) until the apply merges it.
        self.upload_early = upload_early and self.has_host_part and not transfers.device_is_host
        self.uploaded = None
        host_state = {}
        for name in ("master", "exp_avg", "exp_avg_sq"):
            naturals = [getattr(s, name) for s in states]
            if all(t is None for t in naturals):  # fresh moments: zeros, laid out directly
                setattr(self, name, torch.zeros(n, R, k, device=dev))
                host_state[name] = torch.zeros(n, u, R, device="cpu") if self.has_host_part else None
                continue
            setattr(self, name, _device_columns(naturals, torch.float32, selected, dev))
            host_state[name] = _columns_as_rows(naturals, torch.float32, host_columns) if self.has_host_part else None
        self.counts = counts.gather(1, selected).to(dev)
        # What the members' selected columns hold where it is not their master in the slab's dtype (after a
        # cast: an upcast leaves bf16 values beside fp32 masters), until the device update rewrites them.
        self.selected_written: Optional[torch.Tensor] = None
        written = [s.selected_written for s in states]
        if k and any(w is not None for w in written):
            cast = self.master.to(self.dtype)
            written = torch.stack([c if w is None else w.to(dev, self.dtype) for c, w in zip(cast, written)])
            if not torch.equal(written, cast):
                self.selected_written = written
        self.grad = torch.zeros(n, R, k, dtype=self.dtype, device=dev)
        self.scores = torch.zeros(n, C, device=dev)
        self.selected, self.host_columns = selected.to(dev), host_columns.to(dev)
        self._pick, self._rest = _columns_index(self.selected, R), _columns_index(self.host_columns, R)
        # Whole-parameter slabs (vectors, matrices with every column selected): the device layout is the
        # parameter's own, no gather.
        self.whole = k == C
        self.offload_done: list[list] = [[], []]  # copy events into host_grads[slot] (and a step's extras)
        self.upload_done: list = [None, None]  # upload events of host_weights[slot]
        self.extra_grads: list[dict] = [{}, {}]  # later backwards of a step: member index -> [host buffers]
        self.extra_pool: list[dict] = [{}, {}]  # the pinned buffers extra_grads reuses, per member
        self.weights_slot = 0  # which host_weights holds the latest CPU-updated columns
        self.unapplied = any(s.unapplied for s in states)
        # A reselection during an in-flight CPU update (overlap_reselect="incoming"): the departing columns'
        # state, waiting for their host rows until that update has finished (`settle_departing`).
        self.departing: Optional[_Columns] = None
        self._params = None  # see `params`
        self.master_rows = list(self.master.unbind(0))  # (the tensors are rewritten in place, never replaced)
        # This step: how many members took a gradient, and whether any took several backwards.
        self.members_taken = sum(1 for s in states if s.step_grad is not None)
        self.several_backwards = any(m.num_grads > 1 for m in members)
        step_grads = [s.step_grad for s in states]
        has_step_grad = any(g is not None for g in step_grads)
        if has_step_grad:
            self.grad.copy_(_device_columns(step_grads, self.dtype, selected, dev))
            for i, s in enumerate(states):
                if s.step_scores is not None:
                    self.scores[i].copy_(s.step_scores)
        self.device_acc = self.device_sq_acc = self.rest_grad = None
        self.acc_landed: list = [None, None]  # device accumulation: the copy events into accumulators[slot]
        self.acc_sent = None  # device accumulation: the sums were sent at a boundary, not yet emptied (an event)
        if not self.has_host_part:
            self.host_master = self.host_exp_avg = self.host_exp_avg_sq = self.host_counts = None
            self.accumulators, self.square_accumulators, self.host_grads, self.host_weights = [], [], [], []
            self.host_grad_bytes = 0
            return
        host_zeros = transfers.host_zeros
        self.host_master, self.host_exp_avg, self.host_exp_avg_sq = (host_state[name] for name in
                                                                     ("master", "exp_avg", "exp_avg_sq"))
        self.host_counts = counts.gather(1, host_columns)
        on_device = self.accumulates_on_device
        # Host accumulators: where the worker adds, or (device accumulation) where a boundary's copy lands.
        landing = (lambda: host_zeros((n, u, R), torch.float32)) if on_device else (
            lambda: torch.zeros(n, u, R, device="cpu"))
        self.accumulators = [landing() for _ in range(2)]
        self.square_accumulators = [landing() for _ in range(2)] if accumulate_squares else []
        if on_device:
            self.device_acc = torch.zeros(n, u, R, device=dev)
            self.device_sq_acc = torch.zeros(n, u, R, device=dev) if accumulate_squares else None
            self.rest_grad = torch.zeros(n, u, R, dtype=self.dtype, device=dev)
        sums = [self.device_acc, self.device_sq_acc] if on_device else [self.accumulators[0],
                                                                         (self.square_accumulators or [None])[0]]
        for target, name in zip(sums, ("accumulator", "square_accumulator")):
            saved = [getattr(s, name) for s in states]
            if target is not None and any(a is not None for a in saved):
                target.copy_(_columns_as_rows(saved, torch.float32, host_columns))
        self.host_grads = [] if on_device else [host_zeros((n, u, R), self.dtype) for _ in range(2)]
        self.host_grad_bytes = 0 if on_device else self.host_grads[0].numel() * self.host_grads[0].element_size()
        if has_step_grad:
            if on_device:
                self.rest_grad.copy_(_columns_as_rows(step_grads, self.dtype, host_columns))
            else:
                _columns_as_rows(step_grads, self.dtype, host_columns, out=self.host_grads[0])
                self.host_grads[1].copy_(self.host_grads[0])
        # host_weights[0]: the latest CPU update (a member's pending one, else what the device holds);
        # host_weights[1]: what the device holds (the applied weights while an update is pending).
        self.host_weights = [host_zeros((n, u, R), self.dtype) for _ in range(2)]
        applied = [s.applied for s in states]
        if any(a is None for a in applied):  # what the device holds is the master, cast
            self.host_weights[1].copy_(self.host_master)
        if any(a is not None for a in applied):
            given = _columns_as_rows(applied, self.dtype, host_columns)
            given_rows = torch.tensor([a is not None for a in applied], device="cpu").view(n, 1, 1)
            torch.where(given_rows, given, self.host_weights[1], out=self.host_weights[1])
        pending = torch.tensor([s.unapplied for s in states], device="cpu").view(n, 1, 1)
        self.host_weights[0].copy_(torch.where(pending, self.host_master.to(self.dtype), self.host_weights[1]))
        self.host_scores = host_zeros((n, u), torch.float32)

    def _host_order(self, selected: torch.Tensor, counts: torch.Tensor, states: list[MemberState]) -> torch.Tensor:
        """[n, u]: each member's unselected columns, ordered by update count (stable: ties by column)."""
        given = [s.host_columns for s in states]
        if all(g is not None for g in given):
            if given and given[0].numel():
                return torch.stack(given)
            return torch.zeros(self.n, self.u, dtype=torch.long, device="cpu")
        return host_order(counts, selected)

    # -- what the slab holds --------------------------------------------------------------------------------
    @property
    def params(self) -> list[torch.Tensor]:
        """The members' parameters as [R, C] views (made once; again after a parameter's storage changed)."""
        if self._params is None:
            self._params = [m.as_columns() for m in self.members]
        return self._params

    def device_buffers(self) -> list[torch.Tensor]:
        written = [] if self.selected_written is None else [self.selected_written]
        staging = [] if self.rest_grad is None else [self.rest_grad]
        return [self.master, self.exp_avg, self.exp_avg_sq, self.counts, self.grad, self.scores, self.selected,
                self.host_columns, *written, *self._device_sums(), *staging]

    def host_buffers(self) -> list[torch.Tensor]:
        if not self.has_host_part:
            return []
        return [self.host_master, self.host_exp_avg, self.host_exp_avg_sq, *self.host_grads, *self.accumulators,
                *self.square_accumulators, *self.host_weights]

    def applied_weights(self) -> torch.Tensor:
        """[n, u, R]: the host columns as the device holds them (the last uploaded CPU update)."""
        return self.host_weights[self.weights_slot ^ 1 if self.unapplied else self.weights_slot]

    # -- gradients ------------------------------------------------------------------------------------------
    def take_grads(self, grads: list[torch.Tensor], scores: Optional[list], grad_slot: int) -> int:
        """The first backward's gradient of every member (member order), in a fixed number of calls; returns
        the bytes sent device -> host. Keeps no reference to the gradients (the compiled graph reuses them)."""
        n, R, C = self.n, self.R, self.C
        if n == 1:
            g = _plain(grads[0], (R, C)).unsqueeze(0)
        else:  # (the caller runs without autograd: no detach needed)
            g = torch.stack(grads).reshape(n, R, C)  # (a copy only for non-contiguous gradients: channels-last)
        if scores is not None and scores[0] is not None:
            if n == 1:
                self.scores.copy_(scores[0].reshape(1, C))
            else:
                torch.stack([s.reshape(C) for s in scores], out=self.scores)
        else:
            torch.sum(_fp32(g).square(), 1, out=self.scores)
        if self.whole:
            self.grad.copy_(g)
        elif self.k:
            if n == 1:
                torch.index_select(g[0], 1, self.selected[0], out=self.grad[0])
            else:
                torch.gather(g, 2, self._pick, out=self.grad)
        for member in self.members:
            member.num_grads = 1
        self.members_taken = n
        for slot_extras in self.extra_grads[grad_slot].values():  # (a discarded step's extras)
            slot_extras.clear()
        if not self.has_host_part:
            return 0
        if self.accumulates_on_device:  # gathered by column on the device, summed there at step()
            if n == 1:
                torch.index_select(g[0].t(), 0, self.host_columns[0], out=self.rest_grad[0])
            else:
                torch.gather(g.transpose(1, 2), 1, self._rest.transpose(1, 2), out=self.rest_grad)
            return 0
        if n == 1:  # gather + transpose straight into the host buffer
            done = self.transfers.to_host(g[0].t(), self.host_grads[grad_slot][0], rows=self.host_columns[0])
        else:
            done = self.transfers.to_host(torch.gather(g.transpose(1, 2), 1, self._rest.transpose(1, 2)),
                                          self.host_grads[grad_slot])
        self.offload_done[grad_slot] = [*self.offload_done[grad_slot], done]
        return self.host_grad_bytes

    def take_grad(self, i: int, grad: torch.Tensor, scores: Optional[torch.Tensor], grad_slot: int) -> int:
        """One backward's gradient of member i (a later backward of the step, or a member whose slab did not
        arrive whole)."""
        member = self.members[i]
        g = _plain(grad, (self.R, self.C))
        first = self._count_grad(member)
        if scores is None and first:
            kernels.column_scores(g, out=self.scores[i])  # straight into the buffer
        else:
            scores = (kernels.column_scores(g) if scores is None else scores).reshape(self.C)
            self.scores[i].copy_(scores) if first else self.scores[i].add_(scores)
        if self.k:
            chosen = g if self.whole else g.index_select(1, self.selected[i])
            self.grad[i].copy_(chosen) if first else self.grad[i].add_(chosen)
        if not self.has_host_part:
            return 0
        return self._offload(i, g.t(), first, grad_slot, rows=self.host_columns[i])

    def _count_grad(self, member: Member) -> bool:
        """One more backward of `member` this step; whether it is its first."""
        member.num_grads += 1
        if member.num_grads == 1:
            self.members_taken += 1
            return True
        self.several_backwards = True
        return False

    def end_step(self) -> None:
        for member in self.members:
            member.num_grads = 0
        self.members_taken, self.several_backwards = 0, False

    def _offload(self, i: int, rest: torch.Tensor, first: bool, grad_slot: int,
                 rows: Optional[torch.Tensor] = None) -> int:
        """Member i's unselected columns ([u, R], or the rows `rows` of `rest`) into host_grads[grad_slot][i];
        a later backward of the step into an extra pinned buffer (reused step after step), summed at step().
        Device accumulation: into (or, a later backward, added to) rest_grad[i], on the device."""
        if self.accumulates_on_device:
            part = rest if rows is None else rest.index_select(0, rows)
            self.rest_grad[i].copy_(part) if first else self.rest_grad[i].add_(part)
            return 0
        extras = self.extra_grads[grad_slot].setdefault(i, [])
        if first:
            extras.clear()  # (a discarded step's)
            done = self.transfers.to_host(rest, self.host_grads[grad_slot][i], rows=rows)
            self.offload_done[grad_slot] = [*self.offload_done[grad_slot], done]
            return self.u * self.R * self.host_grads[grad_slot].element_size()
        pool = self.extra_pool[grad_slot].setdefault(i, [])
        if len(extras) == len(pool):
            pool.append(self.transfers.host_zeros((self.u, self.R), rest.dtype))
        target = pool[len(extras)]
        extras.append(target)
        self.offload_done[grad_slot] = [*self.offload_done[grad_slot], self.transfers.to_host(rest, target, rows=rows)]
        return target.numel() * target.element_size()

    def start_step(self, grad_slot: int) -> None:
        """Forget the copy events of the step two steps ago (its accumulate task has been joined)."""
        self.offload_done[grad_slot] = []

    # data parallel
    def reduce_split_numel(self) -> tuple[int, int]:
        """(elements averaged on every rank, elements reduced into the owner) of one member's gradient."""
        return self.R * self.k, self.R * self.u

    def split_grad_for_reduce(self, i: int, grad: torch.Tensor, replicated: Optional[torch.Tensor],
                              host: Optional[torch.Tensor]) -> None:
        """Member i's selected columns ([R, k]) and unselected ones (transposed, [u, R]) into the reduction
        buffers."""
        g = grad.reshape(self.R, self.C)
        if replicated is not None:
            if self.whole:
                replicated.copy_(g.reshape(-1))
            else:
                torch.index_select(g, 1, self.selected[i], out=replicated.view(self.R, self.k))
        if host is not None:
            torch.index_select(g.t(), 0, self.host_columns[i], out=host.view(self.u, self.R))

    def take_reduced(self, i: int, replicated: Optional[torch.Tensor], host: Optional[torch.Tensor],
                     grad_slot: int) -> int:
        """Member i's averaged gradient: the selected columns (every rank) and, on the owner, the unselected
        ones. Scores are the averaged gradient's (the host columns' only on the owner: the runtime all-reduces
        the scores at the step)."""
        first = self._count_grad(self.members[i])
        scores = torch.zeros(self.C, device=self.device)
        if replicated is not None:
            chosen = replicated.view(self.R, self.k)
            self.grad[i].copy_(chosen) if first else self.grad[i].add_(chosen)
            scores[self.selected[i]] = chosen.float().pow(2).sum(0)
        rest = None if host is None else host.view(self.u, self.R)
        if rest is not None:
            scores[self.host_columns[i]] = rest.float().pow(2).sum(1)
        self.scores[i].copy_(scores) if first else self.scores[i].add_(scores)
        return 0 if rest is None or not self.has_host_part else self._offload(i, rest, first, grad_slot)

    # -- the step -------------------------------------------------------------------------------------------
    def fold_extra_grads(self, grad_slot: int) -> None:
        """Sum the later backwards' offloaded gradients into host_grads[grad_slot] (waits for their copies).
        Runs on the accumulate worker; a no-op once done."""
        extras = {i: buffers for i, buffers in self.extra_grads[grad_slot].items() if buffers}
        if not extras:
            return
        wait_events(self.offload_done[grad_slot])
        target = self.host_grads[grad_slot]
        self.transfers.host_access(reads=[b for buffers in extras.values() for b in buffers], writes=[target])
        for i, buffers in extras.items():
            for extra in buffers:
                target[i].add_(extra)
            buffers.clear()

    def host_step_scores(self, grad_slot: int, rows: list[int]) -> None:
        """Accumulate worker, several backwards in one step: fold the extras, then the exact scores of the summed
        gradient's host columns of members `rows`, into the pinned `host_scores`."""
        self.fold_extra_grads(grad_slot)
        self.transfers.host_access(reads=[self.host_grads[grad_slot]], writes=[self.host_scores])
        for i in rows:
            torch.sum(self.host_grads[grad_slot][i].float().pow(2), dim=1, out=self.host_scores[i])

    def exact_scores(self, grad_slot: int, rows: list[int]) -> None:
        """The scores of members `rows` that took several backwards this step, recomputed from their summed
        gradient (the host columns' from `host_step_scores`, which must have run)."""
        for i in rows:
            exact = torch.empty(self.C, device=self.device)
            exact[self.selected[i]] = self.grad[i].float().pow(2).sum(0)
            if self.u:
                if self.accumulates_on_device:
                    exact[self.host_columns[i]] = self.rest_grad[i].float().pow(2).sum(1)
                elif self.has_host_part:
                    exact[self.host_columns[i]] = self.transfers.to_device(self.host_scores[i])[0]
                else:  # the owner reports them
                    exact[self.host_columns[i]] = 0.0
            self.scores[i].copy_(exact)

    def update_on_device(self, rows: Optional[list[int]], *, grad_scale, **hyperparameters) -> None:
        """AdamW of the selected columns of members `rows` (None: all), written into their parameters."""
        if not self.k:
            return
        kernels.device_adamw_(self.grad, self.master, self.exp_avg, self.exp_avg_sq, self.counts,
                              self.params, self.selected, rows=rows, whole=self.whole, grad_scale=grad_scale,
                              master_rows=self.master_rows, **hyperparameters)
        if self.selected_written is not None:  # the update wrote the masters into these members' columns
            if rows is None:
                self.selected_written = None
            else:
                self.selected_written[rows] = self.master[rows].to(self.dtype)

    def copies_in_flight(self, grad_slot: int) -> list:
        """The events of this step's copies into the gradient buffers (none where the device is the host).
        Taken when the accumulate task is submitted: the next step replaces them."""
        return [] if self.transfers.device_is_host else list(self.offload_done[grad_slot])

    def accumulate_on_device(self, rows: Optional[list[int]], coef: float) -> None:
        """On the device, at step(): device_acc += coef * rest_grad (and device_sq_acc += (coef * rest_grad)**2)
        for members `rows` (None: all)."""
        if self.acc_sent is not None:  # the first step of an interval: the sums sent at the boundary start over
            sums = self._device_sums()
            self.transfers.after_copy_down(self.acc_sent, sums)
            torch._foreach_zero_(sums)
            self.acc_sent = None
        pick = (lambda t: [t]) if rows is None else (lambda t: [t[i] for i in rows])
        accs, grads = pick(self.device_acc), pick(self.rest_grad)
        torch._foreach_add_(accs, grads, alpha=coef)
        if self.device_sq_acc is not None:
            torch._foreach_addcmul_(pick(self.device_sq_acc), grads, grads, value=coef * coef)

    def send_accumulators(self, acc_slot: int) -> int:
        """Device accumulation, at a boundary: the interval's sums copied into the pinned accumulators[acc_slot]
        for the CPU update (`acc_landed[acc_slot]` is their copy's event). The device sums hold nothing from
        here on (`acc_sent`); the next step's accumulation empties them, its stream waiting for the copy then:
        a step later, so the device does not wait for it. Returns the bytes sent. (Host accumulation: nothing
        to send.)"""
        if not self.accumulates_on_device or self.acc_sent is not None:
            return 0
        targets = self._host_sums(acc_slot)
        self.acc_landed[acc_slot] = self.transfers.to_host_many(self._device_sums(), targets)
        self.acc_sent = self.acc_landed[acc_slot] or _SENT
        return sum(t.numel() * t.element_size() for t in targets)

    def wait_for_accumulators(self, acc_slot: int) -> None:
        """Before a host thread reads accumulators[acc_slot]: device accumulation's copy has landed."""
        if self.accumulates_on_device:
            wait_events([self.acc_landed[acc_slot]])
            self.transfers.host_access(writes=self._host_sums(acc_slot))

    def _device_sums(self) -> list[torch.Tensor]:
        """Device accumulation's sums: device_acc (and device_sq_acc)."""
        return [t for t in (self.device_acc, self.device_sq_acc) if t is not None]

    def _host_sums(self, acc_slot: int) -> list[torch.Tensor]:
        """The host accumulators of interval slot `acc_slot` (and their squares)."""
        return [self.accumulators[acc_slot], *self.square_accumulators[acc_slot:acc_slot + 1]]

    def accumulate(self, rows: Optional[list[int]], grad_slot: int, acc_slot: int, coef: float) -> None:
        """Accumulate worker, once the step's copies have landed: acc += coef * g (and square_acc +=
        (coef * g)**2) for members `rows` (None: all)."""
        grads, accs = self.host_grads[grad_slot], self.accumulators[acc_slot]
        squares = self.square_accumulators[acc_slot] if self.accumulate_squares else None
        self.transfers.host_access(reads=[grads])
        if rows is None:
            kernels.accumulate_scaled_many_([accs], [grads], coef, square_accs=None if squares is None else [squares])
        else:
            kernels.accumulate_scaled_many_([accs[i] for i in rows], [grads[i] for i in rows], coef,
                                            square_accs=None if squares is None else [squares[i] for i in rows])

    def update_host_columns(self, members_by_scale: dict[float, list[tuple[int, int]]], acc_slot: int,
                            hyperparameters: dict) -> None:
        """Update worker, at a boundary: the CPU AdamW of the host columns of the members in
        `members_by_scale` (lr multiplier -> [(member index, steps accumulated)], in member order), from the mean
        of each member's accumulated gradients; then empty the accumulators and publish the new columns."""
        self.wait_for_accumulators(acc_slot)
        acc = self.accumulators[acc_slot]
        squares = self.square_accumulators[acc_slot] if self.accumulate_squares else None
        sums = self._host_sums(acc_slot)
        for scale, taking in members_by_scale.items():
            rows = [i for i, _ in taking]
            steps = [s for _, s in taking]
            everyone = len(rows) == self.n
            if everyone and steps.count(steps[0]) == len(steps):
                torch._foreach_div_(sums, steps[0])
            else:
                for i, s in taking:
                    torch._foreach_div_([t[i] for t in sums], s)
            self.host_adamw_(rows, everyone, acc, squares,
                             dict(hyperparameters, lr=hyperparameters["lr"] * scale))
            if everyone:
                self.host_counts.add_(1)
            else:
                self.host_counts[rows] += 1
        if not self.accumulates_on_device:  # (device accumulation: the next boundary's copy overwrites them)
            torch._foreach_zero_(sums)
        self.publish_host_weights()

    def host_adamw_(self, rows: list[int], everyone: bool, acc: torch.Tensor, squares: Optional[torch.Tensor],
                    hyperparameters: dict) -> None:
        """The CPU AdamW of the host columns of members `rows` (gradient `acc`), each row stepping with its own
        update count. Rows in count order form a few runs of equal count: one fused-AdamW tensor each (the
        whole slab is one [n * u, R] tensor whose runs may span members). Out of order (after reselections
        made in flight) runs are many and short: the rows of the most common count then go through the kernel
        in one tensor per block, and the others are gathered by count, updated apart and written back over
        what that call left in their rows (the same arithmetic, row by row)."""
        if everyone:
            blocks = [(lambda t: t.reshape(self.n * self.u, self.R), self.host_counts.reshape(-1))]
        else:
            blocks = [(lambda t, i=i: t[i], self.host_counts[i]) for i in rows]
        state = (self.host_master, acc, self.host_exp_avg, self.host_exp_avg_sq, squares)
        views = lambda view: [None if t is None else view(t) for t in state]
        runs = [torch.unique_consecutive(counts, return_counts=True) for _, counts in blocks]
        if sum(len(values) for values, _ in runs) * self.SHORT_RUN_ROWS <= sum(len(c) for _, c in blocks):
            for (view, _), (values, lengths) in zip(blocks, runs):
                _cpu_adamw_(_cut(views(view), lengths.tolist()), values, hyperparameters)
            return
        distinct, frequency = torch.unique(torch.cat([counts for _, counts in blocks]), return_counts=True)
        common = distinct[frequency.argmax()]
        apart = []
        for view, counts in blocks:
            odd = (counts != common).nonzero().squeeze(1)
            order = odd[counts[odd].argsort(stable=True)]
            values, lengths = torch.unique_consecutive(counts[order], return_counts=True)
            apart.append((view, order, [None if t is None else t.index_select(0, order) for t in views(view)],
                          values, lengths.tolist()))
        _cpu_adamw_([views(view) for view, _ in blocks], common.expand(len(blocks)), hyperparameters)
        for view, order, gathered, values, lengths in apart:
            if order.numel():
                _cpu_adamw_(_cut(gathered, lengths), values, hyperparameters)
                for target, updated in zip((self.host_master, self.host_exp_avg, self.host_exp_avg_sq),
                                           (gathered[0], gathered[2], gathered[3])):
                    view(target).index_copy_(0, order, updated)

    def publish_host_weights(self) -> None:
        """After a CPU update: cast the new masters into the free weights buffer for the next upload. With
        `upload_early`, the upload is queued at once (on the update worker), so that by the apply it has
        landed and the merge does not wait for it."""
        free = self.weights_slot ^ 1
        wait_events([self.upload_done[free]])
        self.transfers.host_access(writes=[self.host_weights[free]])
        self.host_weights[free].copy_(self.host_master)
        self.weights_slot = free
        if self.upload_early:
            self.uploaded = self.transfers.upload_ahead(self.host_weights[free])
            self.upload_done[free] = self.uploaded[1]

    def apply_host_columns(self, data_parallel=None) -> int:
        """Write the latest CPU-updated columns into the members' parameters; returns the bytes uploaded.
        Data parallel: each member's owner uploads and broadcasts its columns, the other ranks receive them.
        Called once the update has finished."""
        self.settle_departing()
        uploaded, self.uploaded = self.uploaded, None
        self.unapplied = False
        if not self.u:
            return 0
        if data_parallel is None:
            if uploaded is None:
                values, self.upload_done[self.weights_slot] = self.transfers.to_device(
                    self.host_weights[self.weights_slot])
            else:
                values = uploaded[0]
                self.transfers.use_upload(*uploaded)
            kernels.write_columns_(self.params, self.host_columns, values.transpose(1, 2))
            return values.numel() * values.element_size()
        uploaded = 0
        for i, member in enumerate(self.members):
            if self.has_host_part:
                slot = self.weights_slot
                values, done = self.transfers.to_device(self.host_weights[slot][i])
                self.upload_done[slot] = done
                uploaded += values.numel() * values.element_size()
            else:
                values = torch.empty(self.u, self.R, dtype=self.dtype, device=self.device)
            data_parallel.broadcast(values, member.owner)
            kernels.write_columns_([member.as_columns()], self.host_columns[i:i + 1], values.t().unsqueeze(0))
        return uploaded

    # -- layout ---------------------------------------------------------------------------------------------
    def canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(master, exp_avg, exp_avg_sq [n, R, C], step [n, C]) on the host; NaN where this rank does not hold
        the host part."""
        members = [self.member_state(i) for i in range(self.n)]
        return tuple(torch.stack(parts) for parts in zip(*members))

    def member_state(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Member i's (master, exp_avg, exp_avg_sq [R, C], step [C]) on the host; NaN where this rank does not
        hold the host part."""
        full = [self._natural(i, device_part, host_part) for device_part, host_part in
                ((self.master, self.host_master), (self.exp_avg, self.host_exp_avg),
                 (self.exp_avg_sq, self.host_exp_avg_sq))]
        step = torch.full((self.C,), math.nan, device="cpu")
        step[self.selected_cpu[i]] = self.counts[i].cpu()
        if self.host_counts is not None:
            step[self.host_columns_cpu[i]] = self.host_counts[i]
        return (*full, step)

    def _natural(self, i: int, device_part: Optional[torch.Tensor], host_part: Optional[torch.Tensor],
                 dtype=torch.float32, missing: float = math.nan) -> torch.Tensor:
        """Member i's [R, C] tensor from its device columns ([n, R, k]; None: `missing` there) and its host rows
        ([n, u, R]; None: `missing` there): the transpose of a [C, R] tensor built by column (a host row is one
        column: a contiguous copy), which is the layout a new slab gathers from (`_columns_as_rows`)."""
        by_column = torch.empty(self.C, self.R, dtype=dtype, device="cpu")
        for columns, part, column_rows in ((self.selected_cpu[i], device_part, False),
                                           (self.host_columns_cpu[i], host_part, True)):
            if part is None:
                by_column.index_fill_(0, columns, missing)
            else:
                by_column.index_copy_(0, columns, (part[i] if column_rows else part[i].t()).to("cpu", dtype))
        return by_column.t()

    def export_member(self, i: int, acc_slot: int, with_step_grad: Optional[int] = None) -> MemberState:
        """Member i's whole state (after the CPU work that touches it is done). `with_step_grad`: the grad slot
        whose gradient (this step's) goes along."""
        if self.departing is not None:
            raise RuntimeError("internal: a slab's state was read before its departing columns were settled")
        master, exp_avg, exp_avg_sq, step = self.member_state(i)
        state = MemberState(master, exp_avg, exp_avg_sq, step, self.selected_cpu[i].clone(),
                            host_columns=None if self.has_host_part else self.host_columns_cpu[i].clone(),
                            unapplied=self.unapplied)
        if self.selected_written is not None:
            state.selected_written = self.selected_written[i].cpu()
        if self.has_host_part:
            self.transfers.host_access(reads=self.host_weights)
            if self.accumulates_on_device:  # (sent at a boundary: nothing accumulated since)
                sums = (None, None) if self.acc_sent is not None else (self.device_acc, self.device_sq_acc)
            else:
                sums = (self.accumulators[acc_slot], (self.square_accumulators or [None] * 2)[acc_slot])
            state.accumulator = self._natural(i, None, sums[0], missing=0.0)
            if self.accumulate_squares:
                state.square_accumulator = self._natural(i, None, sums[1], missing=0.0)
            state.applied = self._natural(i, None, self.applied_weights(), self.dtype, missing=0.0)
        if with_step_grad is not None and self.members[i].num_grads:
            state.step_grad = self.step_grad(i, with_step_grad)
            state.step_scores = self.scores[i].clone()
        return state

    def step_grad(self, i: int, grad_slot: int) -> torch.Tensor:
        """Member i's gradient of this step in [R, C] layout on the host (waits for its offload)."""
        if self.accumulates_on_device:
            return self._natural(i, self.grad, self.rest_grad, self.dtype, missing=0.0)
        self.fold_extra_grads(grad_slot)
        wait_events(self.offload_done[grad_slot])
        if self.has_host_part:
            self.transfers.host_access(reads=[self.host_grads[grad_slot]])
        host_part = self.host_grads[grad_slot] if self.has_host_part else None
        return self._natural(i, self.grad, host_part, self.dtype, missing=0.0)

    def reselect(self, selected: torch.Tensor, scratch: RowScratch, data_parallel=None) -> int:
        """Make `selected` ([n, k], ascending rows) the device-resident columns, moving state with its columns,
        in place (k and u stay). Called at a boundary whose CPU update was applied: accumulators are empty and
        no worker reads these buffers. `scratch`: the host buffer the host rows are reordered through.
        Returns how many columns changed sides."""
        arriving = columns_not_in(selected, self.selected_cpu)
        moved = 2 * int(arriving.sum())
        if moved == 0:
            return 0  # every member keeps its columns: the layout stands
        if self.has_host_part:
            wait_events(self.upload_done)  # an upload may still read the host weights rewritten below
            self.upload_done = [None, None]
            self.transfers.host_access(writes=[*self.host_grads, *self.host_weights])
        if data_parallel is not None:  # the state of arriving columns comes from their owner's host
            self._reselect_through_canonical(selected, arriving, data_parallel)
        else:
            self._swap_columns(selected, scratch)
        if self.selected_written is not None:  # a member whose columns changed took this step's device update
            changed = arriving.any(1).to(self.device).view(-1, 1, 1)
            self.selected_written = torch.where(changed, self.master.to(self.dtype), self.selected_written)
        self.grad.zero_()
        self.offload_done = [[], []]
        for slot_extras in self.extra_grads:
            slot_extras.clear()
        if self.has_host_part:  # (the accumulators are empty: the boundary's update took them)
            for buffer in self.host_grads:
                buffer.zero_()
            for weights in self.host_weights:
                weights.copy_(self.host_master)
            self.weights_slot = 0
        return moved

    def _swap_columns(self, selected: torch.Tensor, scratch: RowScratch) -> None:
        """Reselection on one rank: only the columns that change sides cross between device and host. The
        staying device columns are gathered on the device, the staying host rows copied whole into the new
        host order (a row is a column: a contiguous copy) through `scratch`, then the arriving and departing
        columns written in, every tensor in place, in a fixed number of calls per slab and per scratch's
        worth of host rows. No [n, R, C] copy of the state is made."""
        old_selected, old_host = self.selected_cpu, self.host_columns_cpu
        n, C, k, u = self.n, self.C, self.k, self.u
        position = self._host_position()  # column -> its host row / device slot
        position.scatter_(1, old_selected, torch.arange(k, device="cpu").expand(n, k))
        on_device = torch.zeros(n, C, dtype=torch.bool, device="cpu").scatter_(1, old_selected, True)
        step = torch.empty(n, C, device="cpu")
        step.scatter_(1, old_selected, self.counts.cpu())
        step.scatter_(1, old_host, self.host_counts)
        host_columns = host_order(step, selected)
        # (member, new slot) of each arriving column with its host row; (member, new host row) of each
        # departing column with its device slot.
        arriving_member, arriving_slot = (~on_device.gather(1, selected)).nonzero(as_tuple=True)
        arriving_row = position[arriving_member, selected[arriving_member, arriving_slot]]
        departing_member, departing_row = on_device.gather(1, host_columns).nonzero(as_tuple=True)
        departing_slot = position[departing_member, host_columns[departing_member, departing_row]]
        staying_slot = position.gather(1, selected).masked_fill(~on_device.gather(1, selected), 0)
        stay = _columns_index(staying_slot.to(self.device), self.R)
        keep = position.gather(1, host_columns).masked_fill(on_device.gather(1, host_columns), 0)  # [n, u]
        on_device_index = lambda *index: tuple(i.to(self.device) for i in index)
        for name in ("master", "exp_avg", "exp_avg_sq"):
            device_state, host_state = getattr(self, name), getattr(self, "host_" + name)
            by_column = device_state.transpose(1, 2)  # [n, k, R]: a column per row, like the host
            outgoing = by_column[on_device_index(departing_member, departing_slot)].cpu()
            incoming = host_state[arriving_member, arriving_row].to(self.device)
            device_state.copy_(device_state.gather(2, stay))
            by_column.index_put_(on_device_index(arriving_member, arriving_slot), incoming)
            scratch.reorder_rows_(host_state, keep)
            host_state.view(n * u, self.R).index_copy_(0, departing_member * u + departing_row, outgoing)
        self.counts.copy_(step.gather(1, selected))
        self.host_counts.copy_(step.gather(1, host_columns))
        self.selected_cpu, self.host_columns_cpu = selected, host_columns
        self.selected.copy_(selected)
        self.host_columns.copy_(host_columns)

    # -- reselection while the boundary's CPU update runs on (overlap_reselect="incoming") ------------------
    def take_arriving(self, selected: torch.Tensor, acc_slot: int,
                      members_by_scale: dict[float, list[tuple[int, int]]], hyperparameters: dict
                      ) -> Optional[_Columns]:
        """Before this boundary's CPU update is launched, with no CPU work in flight: the CPU AdamW of the
        columns `selected` ([n, k]) brings onto the device, on copies of their host rows (the launched update
        redoes them, unused), so they arrive current while the others' update runs on. `members_by_scale` as
        in `update_host_columns`. Returns their state, for `reselect_in_flight` (None: no column arrives)."""
        member, slot = columns_not_in(selected, self.selected_cpu).nonzero(as_tuple=True)
        if not member.numel():
            return None
        row = self._host_position()[member, selected[member, slot]]
        self.wait_for_accumulators(acc_slot)
        master, exp_avg, exp_avg_sq, grad = (t[member, row] for t in (  # (copies: advanced indexing)
            self.host_master, self.host_exp_avg, self.host_exp_avg_sq, self.accumulators[acc_slot]))
        grad_sq = self.square_accumulators[acc_slot][member, row] if self.accumulate_squares else None
        counts = self.host_counts[member, row]
        scale_of, steps_of = {}, {}
        for scale, taking in members_by_scale.items():
            for i, steps in taking:
                scale_of[i], steps_of[i] = scale, steps
        steps = torch.tensor([steps_of[i] for i in member.tolist()], dtype=torch.float32, device="cpu")
        for sums in (grad, grad_sq):
            if sums is not None:
                sums.div_(steps.unsqueeze(1))  # the interval's mean, as the update computes it
        rows_of_scale: dict[float, list[int]] = {}
        for j, i in enumerate(member.tolist()):
            rows_of_scale.setdefault(scale_of[i], []).append(j)
        count_rows = counts.unbind(0)  # (each row's step, incremented in place by the update)
        for scale, rows in rows_of_scale.items():
            pick = lambda t: None if t is None else [t[j] for j in rows]
            kernels.cpu_adamw_(pick(master), pick(grad), pick(exp_avg), pick(exp_avg_sq), pick(count_rows),
                               grad_sqs=pick(grad_sq), **dict(hyperparameters, lr=hyperparameters["lr"] * scale))
        return _Columns(member, slot, master, exp_avg, exp_avg_sq, counts)

    def reselect_in_flight(self, selected: torch.Tensor, arriving: Optional[_Columns]) -> int:
        """Make `selected` the device-resident columns while this boundary's CPU update (launched after
        `take_arriving`) still runs over the host rows. The arriving columns take the state `take_arriving`
        made (`arriving`) and their new masters are written into the parameters at once; each departing column
        takes the host row its member's arriving column leaves, its state kept aside (`departing`) until that
        update has finished (`settle_departing`). Device tensors change in place, in a fixed number of calls.
        The host rows are left out of count order (re-sorting them would copy the whole host state;
        `host_adamw_` takes rows in any order). Returns how many columns changed sides."""
        if arriving is None:
            return 0
        old_selected, n, C, k = self.selected_cpu, self.n, self.C, self.k
        leaving = columns_not_in(old_selected, selected)  # [n, k] of the old slots
        departing_member, departing_slot = leaving.nonzero(as_tuple=True)  # (member by member, as arriving's)
        row = self._host_position()[arriving.member, selected[arriving.member, arriving.place]]
        host_columns = self.host_columns_cpu.clone()
        host_columns[arriving.member, row] = old_selected[departing_member, departing_slot]
        old_slot = torch.zeros(n, C, dtype=torch.long, device="cpu")
        old_slot.scatter_(1, old_selected, torch.arange(k, device="cpu").expand(n, k))
        stay = old_slot.gather(1, selected).to(self.device)  # (an arriving column's entry is overwritten below)
        on_device = lambda *index: tuple(i.to(self.device) for i in index)
        departing_at, arriving_at = on_device(departing_member, departing_slot), on_device(arriving.member,
                                                                                          arriving.place)
        in_param = self.master.to(self.dtype) if self.selected_written is None else self.selected_written
        parked = dict(weights=in_param.transpose(1, 2)[departing_at].cpu(), counts=self.counts[departing_at].cpu())
        for name in ("master", "exp_avg", "exp_avg_sq"):
            device_state = getattr(self, name)
            by_column = device_state.transpose(1, 2)  # [n, k, R]
            parked[name] = by_column[departing_at].cpu()
            device_state.copy_(device_state.gather(2, _columns_index(stay, self.R)))
            by_column.index_put_(arriving_at, getattr(arriving, name).to(self.device))
        counts = self.counts.gather(1, stay)
        counts[arriving_at] = arriving.counts.to(self.device)
        self.counts.copy_(counts)
        self.departing = _Columns(departing_member, row, **parked)
        self.selected_cpu, self.host_columns_cpu = selected, host_columns
        self.selected.copy_(selected)
        self.host_columns.copy_(host_columns)
        # The members whose columns changed hold their masters in every selected column from now on.
        cast = self.master.to(self.dtype)
        if self.selected_written is not None:
            changed = leaving.any(1).to(self.device).view(-1, 1, 1)
            self.selected_written = torch.where(changed, cast, self.selected_written)
        kernels.write_columns_(self.params, self.selected, cast if self.selected_written is None
                               else self.selected_written)
        self.grad.zero_()
        self.offload_done = [[], []]
        for slot_extras in self.extra_grads:
            slot_extras.clear()
        self.transfers.host_access(writes=self.host_grads)
        for buffer in self.host_grads:
            buffer.zero_()
        return 2 * int(departing_member.numel())

    def settle_departing(self) -> None:
        """The departing columns' state into the host rows they took, once the CPU update that ran over those
        rows has finished (call with no CPU work in flight); the host weights get what their parameters hold."""
        if self.departing is None:
            return
        d, self.departing = self.departing, None
        for name in ("master", "exp_avg", "exp_avg_sq"):
            getattr(self, "host_" + name)[d.member, d.place] = getattr(d, name)
        self.host_counts[d.member, d.place] = d.counts
        wait_events(self.upload_done)  # an upload may still read the weights of these rows
        self.transfers.host_access(writes=self.host_weights)
        for weights in self.host_weights:
            weights[d.member, d.place] = d.weights
        self.uploaded = None  # (an upload made before these rows changed: the apply uploads them again)

    def _host_position(self) -> torch.Tensor:
        """[n, C]: the host row of each host column (-1 for the selected ones)."""
        position = torch.full((self.n, self.C), -1, dtype=torch.long, device="cpu")
        return position.scatter_(1, self.host_columns_cpu, torch.arange(self.u, device="cpu").expand(self.n, self.u))

    def _reselect_through_canonical(self, selected: torch.Tensor, arriving: torch.Tensor, data_parallel) -> None:
        """Data parallel: every rank rebuilds its device columns from the whole state, the arriving columns'
        state broadcast by their owner; the owner rebuilds its host rows."""
        master, exp_avg, exp_avg_sq, step = self.canonical()
        for i, member in enumerate(self.members):
            columns = selected[i][arriving[i]]
            if columns.numel():
                self._broadcast_columns(data_parallel, member, columns, master[i], exp_avg[i], exp_avg_sq[i],
                                        step[i])
        # Only the owner knows the host columns' update counts, which order them: everyone takes its order.
        order = host_order(step, selected).to(self.device)
        data_parallel.broadcast(order, self.key.owner)
        host_columns = order.cpu()
        self.selected_cpu, self.host_columns_cpu = selected, host_columns
        self.selected.copy_(selected)
        self.host_columns.copy_(host_columns)
        for name, full in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            getattr(self, name).copy_(_device_columns(list(full), torch.float32, selected, self.device))
            if self.has_host_part:
                _columns_as_rows(list(full), torch.float32, host_columns, out=getattr(self, "host_" + name))
        self.counts.copy_(step.gather(1, selected))
        if self.has_host_part:
            self.host_counts.copy_(step.gather(1, host_columns))

    def _broadcast_columns(self, data_parallel, member: Member, columns, master, exp_avg, exp_avg_sq, step) -> None:
        """The owner's state of `columns` into every rank's canonical rows."""
        parts = [master[:, columns], exp_avg[:, columns], exp_avg_sq[:, columns], step[columns].reshape(1, -1)]
        packed = torch.cat(parts).to(self.device)
        data_parallel.broadcast(packed, member.owner)
        if member.owns_host:
            return
        packed = packed.cpu()
        R = self.R
        master[:, columns] = packed[:R]
        exp_avg[:, columns] = packed[R:2 * R]
        exp_avg_sq[:, columns] = packed[2 * R:3 * R]
        step[columns] = packed[3 * R]

    # -- values written by others ---------------------------------------------------------------------------
    def adopt_param_values(self, i: int) -> None:
        """Member i's parameter was written by someone else (same dtype): where it differs from what the
        optimizer left in it, its values become the master (call with no CPU work in flight)."""
        member = self.members[i]
        self._params = None  # (its storage may be new)
        current = member.as_columns().detach()
        if self.k:
            now = current.index_select(1, self.selected[i])
            written = self.master[i].to(current.dtype) if self.selected_written is None else self.selected_written[i]
            adopt_changed(now, written, self.master[i])
            if self.selected_written is not None:
                self.selected_written[i] = now
        if self.has_host_part:
            wait_events(self.upload_done)  # an upload may still be reading the host weights
            self.transfers.host_access(writes=self.host_weights)
            host_now = current.t().index_select(0, self.host_columns[i]).cpu()
            applied = self.applied_weights()[i]
            adopt_changed(host_now, applied, self.host_master[i])
            applied.copy_(host_now)
            if self.unapplied:  # the pending update now carries the written values where they changed
                self.host_weights[self.weights_slot][i].copy_(self.host_master[i])
                self.uploaded = None  # (uploaded before: the apply uploads them again)
        member.watch.remember()

    def left_in_param(self, i: int) -> torch.Tensor:
        """[R, C] on the host, in the slab's dtype: what the optimizer last wrote into member i's parameter."""
        left = torch.zeros(self.R, self.C, dtype=self.dtype, device="cpu")
        written = self.master[i].to(self.dtype) if self.selected_written is None else self.selected_written[i]
        left[:, self.selected_cpu[i]] = written.cpu()
        if self.has_host_part:
            self.transfers.host_access(reads=self.host_weights)
            left[:, self.host_columns_cpu[i]] = self.applied_weights()[i].t()
        return left


__all__ = ["Slab", "SlabKey", "Member", "MemberState", "ParamWatch", "slab_key", "top_k_columns", "matrix_shape",
           "adopt_changed", "SHARED_SLAB_MAX_NUMEL"]
