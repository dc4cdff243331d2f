"""Values written into a parameter by anyone but the optimizer: telling that it happened (`ParamWatch`) and
adopting them into a slab's state (`adopt_param_values`), elementwise where they differ from what the optimizer
left there (`left_in_param`, `adopt_changed`). `slab` arguments are `Slab`s (this module sits below slab.py)."""

from __future__ import annotations

import operator

import torch

from zenflow_compile.runtime.transfers import wait_events

_VERSION = operator.attrgetter("_version")
_DTYPE = operator.attrgetter("dtype")
_LOCAL = operator.attrgetter("_local_tensor")


def watch_keys(watched: list[torch.Tensor], sharded: bool) -> list[tuple]:
    """What `ParamWatch` compares, for many parameters in one pass of builtins: (version, storage, dtype); for a
    sharded one's DTensor, its version (an in-place write through it, as `load_state_dict` makes, bumps only
    the DTensor's counter), which local tensor it holds (FSDP2 may swap it), then that tensor's three."""
    if not sharded:
        return list(zip(map(_VERSION, watched), map(torch.Tensor.data_ptr, watched), map(_DTYPE, watched)))
    local = list(map(_LOCAL, watched))
    return list(zip(map(_VERSION, watched), map(id, local), map(_VERSION, local),
                    map(torch.Tensor.data_ptr, local), map(_DTYPE, local)))


class ParamWatch:
    """Whether anyone but the optimizer wrote a parameter (or, sharded, its DTensor) since it last looked: the
    optimizer writes through `param.data`, which leaves the version counter alone; an in-place write by anyone
    else bumps it, and `p.data = other` changes the storage."""

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


def adopt_param_values(slab, i: int) -> None:
    """Member i's parameter was written by someone else (same dtype): where it differs from what the
    optimizer left in it, its values become the master (call with no CPU work in flight)."""
    member = slab.members[i]
    slab.forget_param_views()  # (its storage may be new)
    current = member.as_columns().detach()
    if slab.k:
        now = current.index_select(1, slab.selected[i])
        written = slab.master[i].to(current.dtype) if slab.selected_written is None else slab.selected_written[i]
        adopt_changed(now, written, slab.master[i])
        if slab.selected_written is not None:
            slab.selected_written[i] = now
    if slab.has_host_part:
        wait_events(slab.upload_done)  # an upload may still be reading the host weights
        slab.transfers.host_access(writes=slab.host_weights)
        host_now = current.t().index_select(0, slab.host_columns[i]).cpu()
        applied = slab.applied_weights()[i]
        adopt_changed(host_now, applied, slab.host_master[i])
        applied.copy_(host_now)
        if slab.unapplied:  # the pending update now carries the written values where they changed
            slab.host_weights[slab.weights_slot][i].copy_(slab.host_master[i])
            slab.uploaded = None  # (uploaded before: the apply uploads them again)
    member.watch.remember()


def left_in_param(slab, i: int) -> torch.Tensor:
    """[R, C] on the host, in the slab's dtype: what the optimizer last wrote into member i's parameter."""
    left = torch.zeros(slab.R, slab.C, dtype=slab.dtype, device="cpu")
    written = slab.master[i].to(slab.dtype) if slab.selected_written is None else slab.selected_written[i]
    left[:, slab.selected_cpu[i]] = written.cpu()
    if slab.has_host_part:
        slab.transfers.host_access(reads=slab.host_weights)
        left[:, slab.host_columns_cpu[i]] = slab.applied_weights()[i].t()
    return left


__all__ = ["ParamWatch", "adopt_changed", "adopt_param_values", "left_in_param", "watch_keys"]
