"""Sharded parameters (ZeRO-3 class) through FSDP2: the shard group of one ZenFlowAdamW (ARCHITECTURE.md,
"Sharded parameters (FSDP2)").

`fully_shard` makes each parameter a `DTensor` `Shard(0)` on a 1-D mesh: every rank holds a block of rows of
every column (possibly none). That fits column selection: a rank's state of a parameter is that of its own rows
(`local_shard`), and a column's score is the sum over ranks of each rank's partial squared norm, so one
all-reduce of the step's scores (`ZenFlowRuntime._all_reduce_scores`) gives every rank the same decisions.
Refused, each with the fix in its error: HSDP and placements other than `Shard(0)`, FSDP2's `CPUOffloadPolicy`,
DTensors beside plain parameters or beside a `process_group=`, and at `step()` a parameter FSDP2 no longer holds.

Checkpoints in DCP's form: per-row state as DTensors `Shard(0)` over the mesh (`dcp_entry`), so DCP reshards
them at another world size, their local tensors on the host; per-column state and the schedule replicated,
less the counters that are a rank's own.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable, Optional

import torch

from zenflow_compile.runtime.collectives import DataParallel

_SHARDED_PARAM, _SECOND = operator.attrgetter("sharded_param"), operator.itemgetter(1)

__all__ = ["Sharding", "sharding_of", "check_added", "local_shard", "local_entry", "replicated_globals", "is_sharded",
           "fsdp_sharded_param_of"]

try:  # (a torch built without distributed has no DTensor: nothing is ever sharded)
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover
    DTensor, Shard = (), None


def is_sharded(tensor: Any) -> bool:
    return isinstance(tensor, DTensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The rows of `tensor` this rank holds (a DTensor's local tensor, a view of FSDP2's sharded storage: writes
    into it are what the next all-gather reads); any other tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class Sharding:
    """The 1-D mesh a ZenFlowAdamW's parameters are sharded over, and its collectives."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.collectives = DataParallel(mesh.get_group())
        self._fsdp_params: list = []  # (parameter, the FSDPParam that held it when the optimizer took it)
        self._held_ids: list = []  # their parameters' ids, in that order

    def hold(self, params: list) -> None:
        """Remember which FSDP2 parameter slot holds each of `params` (see `check_still_held`)."""
        ours = {id(p): p for p in params}
        self._fsdp_params += [(ours[id(f.sharded_param)], f) for f in _fsdp_params() if id(f.sharded_param) in ours]
        self._held_ids = [id(param) for param, _ in self._fsdp_params]

    def check_still_held(self, params: list, describe) -> None:
        """Each of `params` FSDP2 held is still the parameter it shards and gives gradients to (not so after
        `model.load_state_dict(sd, assign=True)`, or a module attribute set anew: the old one gets no gradient)."""
        # (every step: one pass of builtins while FSDP2 still holds what it held, the common case)
        if list(map(id, map(_SHARDED_PARAM, map(_SECOND, self._fsdp_params)))) == self._held_ids:
            return
        current = set(map(id, params))  # (a parameter removed from the param groups is no concern)
        for param, fsdp_param in self._fsdp_params:
            if fsdp_param.sharded_param is not param and id(param) in current:
                raise ValueError(
                    f"ZenFlowAdamW: {describe(param)} is no longer the model's parameter: FSDP2 holds another "
                    "parameter object in its place (model.load_state_dict(..., assign=True) makes new ones), "
                    "which gets the gradients while the optimizer holds the old one. Fix: load without "
                    "assign=True (model.load_state_dict(sd) or torch.distributed.checkpoint's "
                    "set_model_state_dict copy the values into the parameters, and ZenFlow trains on from "
                    "them), or build the optimizer after loading")

    # -- checkpoints (torch.distributed.checkpoint) -----------------------------------------------------------
    def dcp_entry(self, entry: dict, param: torch.Tensor) -> dict:
        """A parameter's entry in DCP's form (`checkpoint.dcp_form`, this rank's rows) with its `ROW_KEYS` as
        DTensors `Shard(0)` of the parameter's global rows; the rest is the same on every rank (replicated)."""
        return {key: self._rows(value, param) if key in ROW_KEYS else value for key, value in entry.items()}

    def _rows(self, local: torch.Tensor, param: torch.Tensor) -> "DTensor":
        """`local` (this rank's rows, on the host) as a DTensor of the parameter's global rows; not through
        `DTensor.from_local`, which would copy it to the mesh's device (host state is many times device memory)."""
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        shape = torch.Size((param.shape[0], *local.shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
        spec = DTensorSpec(self.mesh, (Shard(0),), tensor_meta=TensorMeta(shape, stride, local.dtype))
        return DTensor(local.contiguous(), spec, requires_grad=False)

    def stats(self) -> dict:
        stats = self.collectives.stats()
        return dict(shard_world_size=stats["world_size"], shard_rank=stats["rank"],
                    comm_bytes_sent=stats["comm_bytes_sent"], comm_bytes_received=stats["comm_bytes_received"])


# Entries of a parameter's checkpoint entry with one row per parameter row (saved sharded like the parameter).
ROW_KEYS = ("master", "exp_avg", "exp_avg_sq", "accumulator", "square_accumulator", "device_columns")

# Counters of `opt.stats()` that are this rank's own (the bytes of its rows, its waits for its host). DCP stores
# one copy of an object every rank saves under one key, taken from any rank, so they stay out of a checkpoint;
# a rank that loads one keeps counting its own from where it is.
RANK_LOCAL_COUNTERS = ("bytes_device_to_host", "bytes_host_to_device", "host_waits")


def replicated_globals(saved: dict) -> dict:
    """The optimizer's schedule entry (`ZenFlowRuntime.export_globals`) as every rank holds it alike."""
    return dict(saved, counters={k: v for k, v in saved["counters"].items() if k not in RANK_LOCAL_COUNTERS})


def local_entry(entry: dict) -> dict:
    """A checkpoint entry as `checkpoint.state_from_entry` reads it: this rank's rows of its DTensors."""
    return {key: value.to_local() if isinstance(value, DTensor) else value for key, value in entry.items()}


def _fsdp_params() -> Iterable:
    """Every FSDP2 parameter (`FSDPParam`) of the live `fully_shard`-ed modules of this process."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover
        return
    for ref in list(_module_state_mapping.values()):
        state = ref()
        group = getattr(state, "_fsdp_param_group", None) if isinstance(state, FSDPState) else None
        if group is not None:
            yield from group.fsdp_params


def fsdp_sharded_param_of(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """If `tensor` is the unsharded parameter FSDP2 all-gathers for a forward (what a compiled graph sees as
    its input, not the registered DTensor), the sharded parameter it stands for; else None."""
    for fsdp_param in _fsdp_params():
        if getattr(fsdp_param, "_unsharded_param", None) is tensor:
            return fsdp_param.sharded_param
    return None


def _where(index: int, param: torch.Tensor) -> str:
    return f"parameter {index} (shape {tuple(param.shape)})"


def check_added(params: list, sharding: Optional[Sharding], constructed: bool) -> None:
    """Parameters added after construction (add_param_group, an edit of param_groups) must be sharded like the
    others: DTensors of the optimizer's mesh over sharded parameters, plain tensors otherwise."""
    if not constructed:
        return
    tensors = [p for p in params if isinstance(p, torch.Tensor) and (p.is_floating_point() or p.is_complex())]
    for i, param in enumerate(tensors):
        if sharding is None and isinstance(param, DTensor):
            raise ValueError(
                f"ZenFlowAdamW: {_where(i, param)} added to an optimizer over plain parameters is a DTensor "
                "(sharded by FSDP2). Fix: give sharded parameters to a ZenFlowAdamW built over sharded "
                "parameters (one optimizer per mesh)")
        if sharding is not None and not (isinstance(param, DTensor) and param.device_mesh == sharding.mesh):
            raise ValueError(
                f"ZenFlowAdamW: {_where(i, param)} added to an optimizer over FSDP2-sharded parameters is not a "
                "DTensor of its mesh; its gradient would not be reduced like the others. Fix: fully_shard its "
                "module first (on the same mesh), or give it to an optimizer of its own")
    if sharding is not None:
        sharding_of(tensors)  # (the placement and offload checks)
        sharding.hold(tensors)


def sharding_of(params: list, process_group: Any = None) -> Optional[Sharding]:
    """The Sharding of an optimizer's parameters, None when none is a DTensor (refusals: module docstring)."""
    floating = [p for p in params if isinstance(p, torch.Tensor) and (p.is_floating_point() or p.is_complex())]
    sharded = [i for i, p in enumerate(floating) if isinstance(p, DTensor)]
    if not sharded:
        return None
    if len(sharded) != len(floating):
        plain = next(i for i, p in enumerate(floating) if not isinstance(p, DTensor))
        raise ValueError(
            f"ZenFlowAdamW: {_where(plain, floating[plain])} is a plain tensor while others are DTensors "
            "(sharded by FSDP2's fully_shard); its gradient would not be reduced across ranks. Fix: call "
            "fully_shard on the root module too (it shards every parameter not sharded yet), or give the "
            "plain parameters to an optimizer of their own")
    if process_group is not None:
        raise ValueError(
            "ZenFlowAdamW: process_group= is ZenFlow's own data parallelism (it reduces the gradients itself), "
            "but the parameters are DTensors sharded by FSDP2, which reduce-scatters them. Fix: drop "
            "process_group=; over fully_shard-ed parameters ZenFlowAdamW takes the mesh from the parameters")
    mesh = floating[0].device_mesh
    for i, param in enumerate(floating):
        if param.device_mesh.ndim != 1:
            raise ValueError(
                f"ZenFlowAdamW: {_where(i, param)} is on a {param.device_mesh.ndim}-D device mesh "
                f"{tuple(param.device_mesh.mesh_dim_names or ())} (HSDP or tensor parallel): ZenFlow over "
                "sharded parameters supports a 1-D mesh (fully_shard with a 1-D mesh, the default). Fix: "
                "fully_shard(module, mesh=init_device_mesh(device, (world_size,)))")
        if tuple(param.placements) != (Shard(0),):
            raise ValueError(
                f"ZenFlowAdamW: {_where(i, param)} has placements {tuple(param.placements)}; ZenFlow over "
                "sharded parameters needs FSDP2's Shard(0) (each rank holds whole rows of every column): "
                "tensor parallel placements, or fully_shard(shard_placement_fn=...) sharding on another dim, "
                "split columns across ranks. Fix: fully_shard with the default placement, no tensor parallelism")
        if param.device_mesh != mesh:
            raise ValueError(
                f"ZenFlowAdamW: {_where(i, param)} is sharded over another device mesh than parameter 0; one "
                "ZenFlowAdamW takes parameters of one mesh. Fix: one optimizer per mesh")
    ours = {id(p) for p in floating}
    for fsdp_param in _fsdp_params():
        if id(fsdp_param.sharded_param) in ours and getattr(fsdp_param, "offload_to_cpu", False):
            raise ValueError(
                "ZenFlowAdamW: the parameters were sharded with fully_shard(offload_policy=CPUOffloadPolicy()), "
                "which keeps the whole sharded parameters, gradients and optimizer step on the CPU. ZenFlow "
                "already offloads what pays: the unselected columns' state stays on the host and only their "
                "gradients and updates move, while the top-k columns train on the device every step; the "
                "policy would move the selected columns and the parameters across every step too. Fix: drop "
                "offload_policy= (ZenFlow's host offload replaces it)")
    sharding = Sharding(mesh)
    sharding.hold(floating)
    return sharding
