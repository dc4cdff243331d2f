"""ZenFlowAdamW: the user-facing torch.optim.Optimizer; all state and scheduling live in the runtime.

Eager use works through post-accumulate-grad hooks (each backward's gradient leaves `.grad` for a bucket
that the runtime takes in one batched call: `grad_hooks.py`); under `torch.compile(backend="zenflow")` the rewritten backward calls the runtime
directly and returns no gradient, so the hooks never fire for the parameters of compiled graphs.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Optional

import torch

from zenflow_compile.config import ZENFLOW_KEYS, ZenFlowConfig
from zenflow_compile.grad_hooks import GradBucket
from zenflow_compile.runtime import collectives, registry
from zenflow_compile.runtime.engine import ZenFlowRuntime


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm) -> None:
    def bad(name, value, allowed):
        raise ValueError(f"ZenFlowAdamW {name}={value!r} is invalid: expected {allowed}")

    if isinstance(lr, torch.Tensor):  # as torch.optim.AdamW: a one-element tensor (e.g. for schedulers)
        if lr.numel() != 1 or not lr.dtype.is_floating_point:
            bad("lr", lr, "a float, or a one-element floating-point tensor")
        lr = lr.item()
    if not (_is_real(lr) and 0.0 <= lr < math.inf):
        bad("lr", lr, "a finite float >= 0")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(_is_real(b) and 0.0 <= b < 1.0 for b in betas)):
        bad("betas", betas, "a pair of floats in [0, 1)")
    if not (_is_real(eps) and 0.0 <= eps < math.inf):
        bad("eps", eps, "a finite float >= 0")
    if not (_is_real(weight_decay) and 0.0 <= weight_decay < math.inf):
        bad("weight_decay", weight_decay, "a finite float >= 0")
    if max_grad_norm is not None and not (_is_real(max_grad_norm) and 0.0 < max_grad_norm < math.inf):
        bad("max_grad_norm", max_grad_norm, "None (no clipping) or a finite float > 0")


class ZenFlowAdamW(torch.optim.Optimizer):
    """AdamW with ZenFlow's importance-aware, bounded-asynchronous CPU offload (docs/semantics.md).

    Args: as torch.optim.AdamW (lr, betas, eps, weight_decay), plus `max_grad_norm` (global-norm clipping
    computed from the gradient-norm proxy; None = off) and either `config=ZenFlowConfig(...)` or the
    ZenFlow keys themselves (topk_ratio, update_interval, overlap_step, ...). `reduce_bucket_size`
    (elements, default 25M): gradients reach the runtime in buckets of this size (one call per bucket from a
    compiled backward or from the eager hooks; a bucket's gradients live until it is handed over) and, under
    data parallelism, are reduced in buckets of this size.

    Data parallel (docs/semantics.md): under torch.distributed with more than one rank in `process_group` (None = the
    default group, if initialised), gradients are averaged across ranks inside the backward, every rank
    makes the same selection, and each rank holds the host state of a share of the matrices. Do not wrap the
    model in DDP. Parameters are broadcast from rank 0 at construction. `state_dict()` is this rank's share;
    `consolidated_state_dict()` gathers a full one.

    Follows torch.optim conventions: parameters that never get a gradient (frozen, unused, integer tensors)
    are never touched and cost nothing; one that starts requiring grad later trains from then on; values
    written into a parameter between steps are what its next update starts from. Works with
    `torch.amp.GradScaler` (`scaler.step(opt)`): the loss scale is divided out and an inf/NaN gradient skips
    the step and is reported to the scaler.
    """

    # GradScaler hands itself to step() (`grad_scaler=`) instead of unscaling `.grad`s, which ZenFlow
    # parameters never have; step() reports found-inf back to it.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: Optional[float] = None,
        config: Optional[ZenFlowConfig] = None,
        process_group: Any = None,
        reduce_bucket_size: int = 25_000_000,
        **zenflow_keys: Any,
    ):
        _check_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm)
        if not (isinstance(reduce_bucket_size, int) and not isinstance(reduce_bucket_size, bool)
                and reduce_bucket_size >= 1):
            raise ValueError(f"ZenFlowAdamW reduce_bucket_size={reduce_bucket_size!r} is invalid: expected an int "
                             ">= 1 (elements per bucket of gradients handed to the runtime, and reduced "
                             "across ranks under data parallelism)")
        if config is not None and zenflow_keys:
            raise ValueError("pass either config=ZenFlowConfig(...) or ZenFlow keys, not both "
                             f"(got config and {sorted(zenflow_keys)})")
        if isinstance(config, Mapping):  # (the ZenFlow keys as a dict)
            config = ZenFlowConfig.from_dict(config)
        elif config is not None and not isinstance(config, ZenFlowConfig):
            raise TypeError(
                f"ZenFlowAdamW config= expects a ZenFlowConfig or a dict of ZenFlow keys, got "
                f"{type(config).__name__}; for a DeepSpeed JSON pass config=ZenFlowConfig.from_deepspeed(path)")
        config = config if config is not None else ZenFlowConfig.from_dict(zenflow_keys)
        if config.offload:
            raise NotImplementedError(
                "ZenFlowConfig.offload=True (selected columns' state on the CPU too) is not implemented; "
                "set offload=False: selected columns' state lives on the device")
        data_parallel = collectives.data_parallel_group(process_group)
        self._runtime = ZenFlowRuntime(config, max_grad_norm, data_parallel, reduce_bucket_size)
        self._constructed = False
        self._param_ids: dict[int, int] = {}  # id(param) -> runtime id
        self._hook_handles: dict[int, Any] = {}  # id(param) -> its post-accumulate-grad hook
        self._grad_bucket = GradBucket(self._runtime, reduce_bucket_size, self._param_ids)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        weakref.finalize(self, _close, self._runtime, self._hook_handles)
        self._agree_across_ranks(self._params_in_order())
        self._constructed = True

    @property
    def config(self) -> ZenFlowConfig:
        return self._runtime.config

    @property
    def max_grad_norm(self) -> Optional[float]:
        """Global-norm clipping threshold (None = off); settable between steps (e.g. by a Trainer callback)."""
        return self._runtime.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: Optional[float]) -> None:
        _check_hyperparameters(self.defaults["lr"], self.defaults["betas"], self.defaults["eps"],
                               self.defaults["weight_decay"], value)
        self._runtime.max_grad_norm = None if value is None else float(value)

    def add_param_group(self, param_group: dict) -> None:
        group_index = len(self.param_groups)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        _check_params(params, group_index, self._param_ids, self._runtime)
        per_group = sorted(key for key in param_group if key in ZENFLOW_KEYS)
        if per_group:  # (torch.optim would keep them in the group, where nothing reads them)
            raise ValueError(
                f"param group {group_index} sets ZenFlow key(s) {per_group}: ZenFlow keys apply to the whole "
                "optimizer, not per param group. Pass them to ZenFlowAdamW(...) (or config=), or use one "
                "ZenFlowAdamW per setting")
        merged = {**self.defaults, **param_group}
        _check_hyperparameters(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"], None)
        super().add_param_group({**param_group, "params": params})
        for param in params:
            if not param.is_floating_point():
                continue  # never gets a gradient (e.g. a quantized frozen weight); torch.optim skips it too
            self._param_ids[id(param)] = self._runtime.add_param(param, group_index)
            if param.requires_grad:
                self._hook(param)
        if self._constructed:  # a group added later: every rank adds it (a collective)
            self._agree_across_ranks(params)

    def _agree_across_ranks(self, params: list) -> None:
        """Data parallel: every rank must hold the same optimizer (else a clear error on every rank, not a
        hang in the first mismatched collective); then rank 0's parameter values are everyone's."""
        data_parallel = self._runtime.data_parallel
        if data_parallel is None:
            return
        data_parallel.check_same_on_every_rank(dict(
            **{f"config key {key}": value for key, value in self.config.to_dict().items()},
            max_grad_norm=self.max_grad_norm,
            reduce_bucket_size=self._runtime.reducer.bucket_numel,
            parameters=[f"shape {tuple(p.shape)} dtype {p.dtype}" for p in params]))
        data_parallel.broadcast_parameters([p for p in params if p.is_floating_point()])

    def _hook(self, param: torch.Tensor) -> None:
        bucket = self._grad_bucket
        hook = bucket.hook if self._runtime.reducer is None else bucket.hook_data_parallel
        self._hook_handles[id(param)] = param.register_post_accumulate_grad_hook(hook)

    def param_id(self, param: torch.Tensor) -> int:
        return self._param_ids[id(param)]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scaler=None):
        """One optimizer step. `grad_scaler` is passed by `torch.amp.GradScaler.step(opt)`, not by users."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._collect_unhooked_grads()
        self._grad_bucket.finish()
        scale = None if grad_scaler is None else grad_scaler._get_scale_async()
        stepped = self._runtime.step(self.param_groups, grad_scale=scale)
        if grad_scaler is not None:
            found_inf = torch.full((), 0.0 if stepped else 1.0, device=scale.device)
            grad_scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {scale.device: found_inf}
        return loss

    def _collect_unhooked_grads(self) -> None:
        """Gradients that reached `.grad` without a hook (a parameter unfrozen after construction): hand them
        to the runtime, and hook the parameter for the next steps."""
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None and id(param) in self._param_ids:
                    if id(param) not in self._hook_handles:
                        self._hook(param)
                    self._grad_bucket.hook(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients received since the last step (as torch.optim does with `.grad`)."""
        super().zero_grad(set_to_none)
        self._grad_bucket.drop()
        self._runtime.discard_step_grads()

    def synchronize(self) -> None:
        """Apply any in-flight CPU update to the device parameters (before eval or save)."""
        self._runtime.synchronize()

    def stats(self) -> dict:
        """steps, skipped_steps, cpu_updates, reselections, bytes each way, stall and CPU-update seconds,
        current_interval (steps since the last update boundary) and selection_churn."""
        return self._runtime.stats()

    def selected_columns(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The device-resident (selected) columns of a matrix parameter, None before the first selection."""
        return self._runtime.selected_columns(self.param_id(param))

    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master of a parameter, in its shape (waits for CPU work in flight); before its first
        gradient, the parameter's own values."""
        self._runtime.quiesce()
        pid = self.param_id(param)
        if not self._runtime.has_state(pid):
            return param.detach().float().cpu().clone()
        entry = self._runtime.export_state(pid)
        if "host_owner" in entry:
            raise ValueError(
                f"ZenFlowAdamW.master: the unselected columns of this parameter (shape {tuple(param.shape)}) live "
                f"on rank {entry['host_owner']}'s host, not on this rank's; call master() there, or gather the "
                "whole state with consolidated_state_dict()")
        return entry["master"].reshape(param.shape)

    # -- checkpoints --------------------------------------------------------------------------------------
    def _params_in_order(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict:
        """torch.optim layout: per-parameter state in its natural shape (fp32 master, moments, per-column
        counts, selection, accumulator) keyed by index, param_groups, plus a "zenflow" entry.

        Saving never changes the run: it waits for CPU work in flight but applies nothing to the device.
        """
        self._runtime.quiesce()
        saved = super().state_dict()
        indexed = [(i, self._param_ids[id(p)]) for i, p in enumerate(self._params_in_order())
                   if id(p) in self._param_ids and self._runtime.has_state(self._param_ids[id(p)])]
        saved["state"] = {i: self._runtime.export_state(pid) for i, pid in indexed}
        saved["zenflow"] = self._runtime.export_globals()
        data_parallel = self._runtime.data_parallel
        if data_parallel is not None:  # this rank's share: loadable at this world size, by this rank
            saved["zenflow"]["data_parallel"] = dict(
                world_size=data_parallel.world_size, rank=data_parallel.rank,
                owners={i: self._runtime.owners[pid] for i, pid in indexed})
        return saved

    def consolidated_state_dict(self, to_rank: int = 0) -> Optional[dict]:
        """Data parallel: gather every rank's share into one world-size-free state_dict on `to_rank` (None
        on the other ranks; a collective: call it on every rank). Without data parallelism, `state_dict()`.
        Load it at any world size; see README "Data parallel" for what differs from resuming a share."""
        data_parallel = self._runtime.data_parallel
        if data_parallel is None:
            return self.state_dict()
        shares = data_parallel.gather_object(self.state_dict(), dst=to_rank)
        if shares is None:
            return None
        full = shares[to_rank]
        owners = full["zenflow"].pop("data_parallel")["owners"]
        full["state"] = {i: shares[owner]["state"][i] for i, owner in owners.items()}
        return full

    def load_state_dict(self, state_dict: dict) -> None:
        if "zenflow" not in state_dict:
            raise ValueError("not a ZenFlowAdamW state_dict (no 'zenflow' entry); a torch.optim.AdamW "
                             "checkpoint cannot be resumed exactly by ZenFlow")
        if self._runtime.holds_step_grads:
            # torch.optim would keep `.grad` for the next step; here the gradients already live in the states
            # that loading re-creates, so they would be lost without a word.
            raise RuntimeError(
                "ZenFlowAdamW.load_state_dict() was called between a backward and step(): that backward's "
                "gradients were already handed to the optimizer and loading would discard them. Load the "
                "checkpoint before the backward, or after step() (or call zero_grad() first to drop them)")
        owners = self._share_owners(state_dict["zenflow"].get("data_parallel"))
        if self._runtime.failed:  # a worker failure or an interrupted step: loading replaces every state
            self._runtime.settle_after_failure()
        else:
            self._runtime.quiesce()
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._runtime.import_globals(state_dict["zenflow"], owners)
        for i, param in enumerate(self._params_in_order()):
            if i in state_dict["state"]:
                self._runtime.import_state(self.param_id(param), state_dict["state"][i])
        self._runtime.clear_failure()

    def _share_owners(self, saved: Optional[dict]) -> Optional[dict[int, int]]:
        """pid -> owner of a data-parallel share saved by this rank at this world size (None for a full
        state_dict); a share of another rank or world size is an error."""
        if saved is None:
            return None
        data_parallel = self._runtime.data_parallel
        world_size, rank = (1, 0) if data_parallel is None else (data_parallel.world_size, data_parallel.rank)
        if (saved["world_size"], saved["rank"]) != (world_size, rank):
            raise ValueError(
                f"this ZenFlowAdamW state_dict is rank {saved['rank']}'s share of a data-parallel run with world "
                f"size {saved['world_size']}; it can only be loaded by rank {saved['rank']} at that world size "
                f"(here: rank {rank} of {world_size}). To resume at another world size, save "
                "opt.consolidated_state_dict() instead and load that on every rank")
        params = self._params_in_order()
        return {self.param_id(params[int(i)]): owner for i, owner in saved["owners"].items()}

    def __repr__(self) -> str:
        return super().__repr__().replace("(\n", f"(\n{self.config}\n", 1)


def _close(runtime: ZenFlowRuntime, hook_handles: dict) -> None:
    for handle in hook_handles.values():
        handle.remove()
    runtime.close()


def _check_params(params: list, group_index: int, known: dict, runtime: ZenFlowRuntime) -> None:
    """Reject what ZenFlow cannot optimize before anything is registered (nothing changes on error)."""
    seen = set()
    devices = {p.device for p in params if isinstance(p, torch.Tensor) and p.is_floating_point()}
    if len(devices) > 1:
        raise ValueError(f"ZenFlowAdamW: param group {group_index} has parameters on several devices "
                         f"{sorted(map(str, devices))}. Fix: use one optimizer per device")
    for i, param in enumerate(params):
        where = f"parameter {i} of param group {group_index} (shape {tuple(param.shape)})"
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"ZenFlowAdamW: {where} is a {type(param).__name__}, not a tensor")
        if id(param) in seen or id(param) in known:
            raise ValueError(f"ZenFlowAdamW: {where} appears more than once in the optimizer's parameters. "
                             "Fix: pass each parameter once (e.g. deduplicate tied weights)")
        seen.add(id(param))
        if not param.is_floating_point():
            continue
        if param.dim() >= 2 and param.numel() == 0:
            raise ValueError(f"ZenFlowAdamW: {where} is an empty matrix; ZenFlow views a matrix as [rows, "
                             "columns] and needs at least one of each. Fix: leave empty parameters out")
        if param.dim() >= 2 and not param.is_contiguous():
            raise ValueError(f"ZenFlowAdamW: {where} is not contiguous (strides {param.stride()}). Fix: make it "
                             "contiguous first (param.data = param.data.contiguous())")
        runtime.check_device(param)
