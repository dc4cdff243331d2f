"""ZenFlowAdamW: the user-facing torch.optim.Optimizer; all state and scheduling live in the runtime.

Eagerly, `step()` hands the `.grad` of the parameters in the param groups to the runtime in one batched call
(`grad_hooks.py`; with data parallelism, hooks hand them over during the backward); under
`torch.compile(backend="zenflow")` the rewritten backward calls the runtime directly and returns no gradient.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Iterable, Optional

import torch
from torch.amp.grad_scaler import OptState
from torch.utils.weak import WeakIdKeyDictionary

from zenflow_compile.config import ZENFLOW_KEYS, ZenFlowConfig
from zenflow_compile.grad_hooks import DataParallelHooks, hand_over_grads
from zenflow_compile.optimizer_args import (check_hyperparameters, check_params, check_reduce_bucket_size,
                                            check_written_param, config_from_args, param_list, tensors_in)
from zenflow_compile.optimizer_args import SUPPORTED_DTYPES  # noqa: F401  (users read it from this module)
from zenflow_compile.optimizer_checkpoint import CheckpointMixin
from zenflow_compile.runtime import collectives, sharding as sharded
from zenflow_compile.runtime.engine import ZenFlowRuntime
from zenflow_compile.runtime.landings import LandingStallWarning


class GradHandOffWarning(UserWarning):
    """A step's gradients were handed to ZenFlowAdamW inside the backward, so `.grad` stays None: then
    `torch.nn.utils.clip_grad_norm_` clips nothing (shown once per optimizer that has no `max_grad_norm`), and
    after `zero_grad(set_to_none=False)` a parameter without a gradient in a step is not stepped with a zeroed
    `.grad` as torch.optim.AdamW steps it (shown once per optimizer, when it happens)."""


class ZenFlowAdamW(CheckpointMixin, torch.optim.Optimizer):
    """AdamW with ZenFlow's importance-aware, bounded-asynchronous CPU offload (docs/semantics.md).

    Args: as torch.optim.AdamW (lr, betas, eps, weight_decay), plus `max_grad_norm` (global-norm clipping
    computed from the gradient-norm proxy; None = off) and either `config=ZenFlowConfig(...)` or the
    ZenFlow keys themselves (topk_ratio, update_interval, overlap_step, ...); the keys not given take the
    defaults of `preset` (None: this project's; "deepspeed": DeepSpeed's). `reduce_bucket_size`
    (elements, default 25M): a compiled backward hands gradients to the runtime in buckets of this size (a
    bucket's gradients live until it is handed over) and, under data parallelism, they are reduced in
    buckets of this size.

    Gradients. Eagerly, `.grad` works as with torch.optim.AdamW up to `step()`: hooks, `clip_grad_norm_`,
    edits and `zero_grad(set_to_none=False)` change what the update uses, and `step()` takes `.grad` as it
    stands. Under `torch.compile(backend="zenflow")` the backward hands gradients over itself and `.grad`
    stays None (a parameter with a gradient hook keeps its `.grad`, so the hook applies); clip with
    `max_grad_norm` and read the step's global norm (before clipping) from `stats()["grad_norm"]` (a
    `clip_grad_norm_` would clip nothing: without `max_grad_norm`, the first such step warns, once,
    `GradHandOffWarning`). Under compiled autograd (`torch._dynamo.config.compiled_autograd`) the compiled
    backward fills `.grad` and `step()` takes it as eagerly.

    Data parallel (docs/semantics.md): under torch.distributed with more than one rank in `process_group` (None = the
    default group, if initialised), gradients are averaged across ranks inside the backward, every rank
    makes the same selection, and each rank holds the host state of a share of the matrices; as when
    compiled, `.grad` is None after the backward (tensor hooks still apply). Do not wrap the model in
    DistributedDataParallel: refused, compiled, when the graph is compiled (in one process too); eagerly (or
    where Dynamo compiles nothing inside DDP's forward, e.g. an `nn.Sequential`), at the first step, where DDP
    refilled `.grad`. In one process, eager DDP's `.grad` (its average over one rank) cannot be told from a plain
    backward's and trains as without DDP. Parameters are broadcast from rank 0 at construction. `state_dict()`
    is this rank's part of the state, in the form torch.distributed.checkpoint saves and loads at any world size;
    `consolidated_state_dict()` gathers a full one.

    Follows torch.optim conventions: parameters that never get a gradient (frozen, unused, integer tensors)
    are never touched and cost nothing; one that starts requiring grad later trains from then on; values
    written into a parameter between steps are what its next update starts from; edits of `param_groups`
    (a parameter removed, added or moved to another group) take effect at the next `step()`. Works with
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
        preset: Optional[str] = None,
        process_group: Any = None,
        reduce_bucket_size: int = 25_000_000,
        **zenflow_keys: Any,
    ):
        check_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm)
        check_reduce_bucket_size(reduce_bucket_size)
        config = config_from_args(config, preset, zenflow_keys)
        params = param_list(params)
        # FSDP2-sharded (DTensor) parameters: the mesh comes from them, and FSDP2 reduces the gradients.
        sharding = sharded.sharding_of(tensors_in(params), process_group)
        data_parallel = None if sharding is not None else collectives.data_parallel_group(process_group)
        self._runtime = ZenFlowRuntime(config, max_grad_norm, data_parallel, reduce_bucket_size, sharding=sharding)
        self._constructed = False
        self._param_ids: dict[int, int] = {}  # id(param) -> runtime id, for the parameters in param_groups
        self._group_of: dict[int, int] = {}  # runtime id -> its param group
        self._shapes: dict[int, torch.Size] = {}  # id(param) -> its shape when registered (its state's)
        self._removed = WeakIdKeyDictionary()  # parameters removed from param_groups (their state is gone)
        self._groups_seen: Optional[list] = None  # the param groups' ids when last followed (see step())
        self._followed: tuple[list, list] = ([], [])  # (parameters in group order, their runtime ids)
        self._hook_handles: dict[int, Any] = {}  # data parallel: id(param) -> its post-accumulate-grad hook
        # Whether the user was told that `.grad` stays None (`_note_grad_hand_off`); integrations that clip
        # through `max_grad_norm` themselves set it.
        self._grad_hand_off_noted = False
        # zero_grad(set_to_none=False) with gradients handed over (`_note_no_zeroed_grads`): the parameters
        # whose `.grad` torch would now hold as zeros, and whether the difference was said.
        self._grads_kept_as_zeros = False
        self._handed_over: set[int] = set()
        self._no_zeroed_grads_noted = False
        self._dp_hooks = None if self._runtime.reducer is None else DataParallelHooks(self._runtime, self._param_ids)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        try:
            super().__init__(params, defaults)
            self._agree_across_ranks(self._params_in_order())
        except BaseException:
            # A refused construction (a bad later param group) keeps none of the parameters it took: a traceback
            # kept alive (a notebook's) must not make them "owned" when the corrected call runs.
            _close(self._runtime, self._hook_handles)
            raise
        weakref.finalize(self, _close, self._runtime, self._hook_handles)
        self._runtime.check_written_params = _written_params_check(weakref.ref(self))
        self._constructed = True
        self._mark_state()

    @property
    def config(self) -> ZenFlowConfig:
        return self._runtime.config

    @property
    def max_grad_norm(self) -> Optional[float]:
        """Global-norm clipping threshold (None = off); settable between steps (e.g. by a Trainer callback)."""
        return self._runtime.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: Optional[float]) -> None:
        check_hyperparameters(self.defaults["lr"], self.defaults["betas"], self.defaults["eps"],
                              self.defaults["weight_decay"], value)
        self._runtime.max_grad_norm = None if value is None else float(value)

    def add_param_group(self, param_group: dict) -> None:
        group_index = len(self.param_groups)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        as_given = params  # (`model.named_parameters()` pairs: torch.optim keeps the names as "param_names")
        params = tensors_in(params)
        check_params(params, group_index, self._param_ids, self._runtime)
        sharded.check_added(params, self._runtime.sharding, self._constructed)
        per_group = sorted(key for key in param_group if key in ZENFLOW_KEYS)
        if per_group:  # (torch.optim would keep them in the group, where nothing reads them)
            raise ValueError(
                f"param group {group_index} sets ZenFlow key(s) {per_group}: ZenFlow keys apply to the whole "
                "optimizer, not per param group. Pass them to ZenFlowAdamW(...) (or config=), or use one "
                "ZenFlowAdamW per setting")
        merged = {**self.defaults, **param_group}
        check_hyperparameters(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"], None)
        super().add_param_group({**param_group, "params": as_given})
        self._register(params, group_index)
        self._groups_seen = None

    def _register(self, params: list, group_index: int) -> None:
        for param in params:
            if not param.is_floating_point():
                continue  # never gets a gradient (e.g. a quantized frozen weight); torch.optim skips it too
            pid = self._param_ids[id(param)] = self._runtime.add_param(param, group_index)
            self._group_of[pid] = group_index
            self._shapes[id(param)] = param.shape
            if param.requires_grad and self._dp_hooks is not None:
                self._hook(param)
        if self._constructed:  # added later: every rank adds them (a collective)
            self._agree_across_ranks(params)

    def _follow_param_groups(self) -> tuple[list, list]:
        """(the parameters in param_groups, their runtime ids), after taking in any edit of the groups made
        since the last step (as torch.optim reads its groups at every step). Per step: one id per parameter."""
        seen = [list(map(id, group["params"])) for group in self.param_groups]
        if seen != self._groups_seen:
            self._take_in_group_edits()
            self._groups_seen = seen
        return self._followed

    def _take_in_group_edits(self) -> None:
        """Parameters added to a group are registered (checked as by add_param_group), removed ones are no
        longer optimized (their state is dropped), moved ones take their new group's hyperparameters."""
        group_of: dict[int, int] = {}
        params_in_order, pids_in_order = [], []
        for group_index, group in enumerate(self.param_groups):
            params = list(group["params"])
            added = [p for p in params if not (isinstance(p, torch.Tensor) and id(p) in self._param_ids)]
            if added:
                for param in added:
                    if isinstance(param, torch.Tensor) and param in self._removed:
                        raise ValueError(
                            f"ZenFlowAdamW: a parameter of shape {tuple(param.shape)} was put back into param "
                            f"group {group_index} after it had been removed from the param groups, which dropped "
                            "its optimizer state (torch.optim.AdamW would resume its moments). Fix: to pause a "
                            "parameter, keep it in its group and freeze it (requires_grad_(False)); or give it "
                            "to a new optimizer")
                check_params(added, group_index, self._param_ids, self._runtime)
                sharded.check_added(added, self._runtime.sharding, self._constructed)
                self._register(added, group_index)
            for param in params:
                pid = self._param_ids.get(id(param))
                if pid is None:
                    continue  # an integer tensor
                if pid in group_of:
                    raise ValueError(
                        f"ZenFlowAdamW: a parameter of shape {tuple(param.shape)} is in param groups "
                        f"{group_of[pid]} and {group_index}. Fix: each parameter in one group only")
                group_of[pid] = group_index
                params_in_order.append(param)
                pids_in_order.append(pid)
        if group_of != self._group_of:
            removed = [self._runtime.params[pid][0] for pid in self._group_of if pid not in group_of]
            self._runtime.follow_param_groups(group_of)
            for param in removed:
                del self._param_ids[id(param)]
                del self._shapes[id(param)]
                handle = self._hook_handles.pop(id(param), None)
                if handle is not None:
                    handle.remove()
                self._removed[param] = True
            self._group_of = group_of
        self._followed = (params_in_order, pids_in_order)

    def _agree_across_ranks(self, params: list) -> None:
        """Data parallel: every rank must hold the same optimizer (else a clear error on every rank, not a
        hang in the first mismatched collective); then rank 0's parameter values are everyone's."""
        data_parallel = self._runtime.data_parallel
        if self._runtime.sharding is not None:  # sharded: the same config and (global) shapes, nothing to broadcast
            self._runtime.sharding.collectives.check_same_on_every_rank(dict(
                **{f"config key {key}": value for key, value in self.config.to_dict().items()},
                max_grad_norm=self.max_grad_norm,
                parameters=[f"shape {tuple(p.shape)} dtype {p.dtype}" for p in params]))
            return
        if data_parallel is None:
            return
        data_parallel.check_same_on_every_rank(dict(
            **{f"config key {key}": value for key, value in self.config.to_dict().items()},
            max_grad_norm=self.max_grad_norm,
            reduce_bucket_size=self._runtime.reducer.bucket_numel,
            parameters=[f"shape {tuple(p.shape)} dtype {p.dtype}" for p in params]))
        data_parallel.broadcast_parameters([p for p in params if p.is_floating_point()])

    def _hook(self, param: torch.Tensor) -> None:
        self._hook_handles[id(param)] = param.register_post_accumulate_grad_hook(self._dp_hooks.hook)

    def param_id(self, param: torch.Tensor) -> int:
        return self._param_ids[id(param)]

    def _params_in_order(self) -> list[torch.Tensor]:
        """The parameters in param-group order: a parameter's index in `state_dict()`."""
        return [p for group in self.param_groups for p in group["params"]]

    # (A train step compiled whole graph-breaks here: this runs eagerly, beside the graphs it drives.)
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, *, grad_scaler=None):
        """One optimizer step on the gradients since the last one (`.grad` eagerly, the hand-offs of a compiled
        backward); with none at all it does nothing, as torch.optim.AdamW. `grad_scaler` is passed by
        `torch.amp.GradScaler.step(opt)`, not by users."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params, pids = self._follow_param_groups()
        if self._runtime.sharding is not None:
            self._runtime.sharding.check_still_held(params, self._describe)
        scale = self._loss_scale(grad_scaler)
        if self._runtime.holds_step_grads and not self._grad_hand_off_noted and self.max_grad_norm is None:
            self._note_grad_hand_off()
        try:
            if self._dp_hooks is None:
                handed = hand_over_grads(self._runtime, params, pids)
            else:
                handed = self._hand_over_late_grads(params, pids)
        except RuntimeError as error:  # a parameter replaced by one its state cannot take: say which
            self._runtime.check_written_params(params)
            raise error
        stepped = True
        if handed or self._runtime.holds_step_grads:
            handed_over = not handed  # (the backward handed the gradients over: no `.grad` kept them)
            stepped = self._runtime.step(self.param_groups, grad_scale=scale)
            if handed_over:
                self._note_no_zeroed_grads(self._runtime.last_step_pids, params, pids)
            advice = self._runtime.landings.take_advice()
            if advice is not None:  # (the caller of opt.step(), past torch.optim's wrappers)
                warnings.warn(advice, LandingStallWarning, stacklevel=5)
        else:
            self._runtime.check_failure()  # (nothing to do, but a failed optimizer still says so)
        if self._dp_hooks is not None:
            self._dp_hooks.step_done()
        self._mark_state()
        if grad_scaler is not None:
            device = grad_scaler._get_scale_async().device
            found_inf = torch.full((), 0.0 if stepped else 1.0, device=device)
            grad_scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {device: found_inf}
        return loss

    def _loss_scale(self, grad_scaler) -> Optional[torch.Tensor]:
        """The scale the step's gradients carry: GradScaler's, unless `scaler.unscale_(opt)` already divided it
        out of `.grad` (the usual clipping recipe); gradients a compiled backward handed over were never in
        `.grad` for it to unscale."""
        if grad_scaler is None:
            return None
        if grad_scaler._per_optimizer_states[id(self)]["stage"] is not OptState.UNSCALED:
            return grad_scaler._get_scale_async()
        if self._runtime.holds_step_grads:
            raise ValueError(
                "scaler.unscale_(opt) found no .grad to unscale: this step's gradients were handed to "
                "ZenFlowAdamW during the backward (a model compiled with backend='zenflow', or data parallel), "
                "so a clip_grad_norm_ after it clipped nothing. Fix: drop scaler.unscale_(opt) and the "
                "clip_grad_norm_ call, and clip with ZenFlowAdamW(max_grad_norm=...), which sees the unscaled "
                "global norm (opt.stats()['grad_norm'])")
        return None

    def _note_grad_hand_off(self) -> None:
        """Once per optimizer without `max_grad_norm`, at the first step whose gradients were handed over inside
        the backward: `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` then saw no `.grad`, returned 0
        and clipped nothing, and nothing it does leaves a trace the optimizer could check."""
        self._grad_hand_off_noted = True
        warnings.warn(
            "ZenFlowAdamW takes the gradients inside the backward (backend='zenflow', or data parallel), so .grad "
            "stays None and torch.nn.utils.clip_grad_norm_ clips nothing (it returns 0). To clip, pass "
            "ZenFlowAdamW(max_grad_norm=...); opt.stats()['grad_norm'] is the step's norm. (Said once, to an "
            "optimizer without max_grad_norm; to silence: warnings.filterwarnings('ignore', "
            "category=zenflow_compile.GradHandOffWarning).)",
            GradHandOffWarning, stacklevel=6)  # (the caller of opt.step(), past torch.optim's wrappers)

    def _note_no_zeroed_grads(self, taking: set[int], params: list, pids: list) -> None:
        """Gradients handed over in the backward leave no `.grad` for `zero_grad(set_to_none=False)` to keep as
        zeros, so a parameter that took one before and none this step (frozen since, or unused) is left alone,
        where torch.optim.AdamW steps it with its zeroed `.grad` (weight decay, and the moments' decay). Said
        once, at the first step where that happens."""
        if self._grads_kept_as_zeros and not self._no_zeroed_grads_noted:
            left_alone = [params[i] for i, pid in enumerate(pids) if pid in self._handed_over and pid not in taking]
            if left_alone:
                self._no_zeroed_grads_noted = True
                warnings.warn(
                    f"ZenFlowAdamW: {len(left_alone)} parameter(s) ({self._describe(left_alone[0])}, ...) took no "
                    "gradient this step after zero_grad(set_to_none=False). torch.optim.AdamW would still step "
                    "them with their zeroed .grad (weight decay and momentum move them). Here the gradients are "
                    "handed over during the backward (backend='zenflow', or data parallel) and leave no .grad, so "
                    "ZenFlowAdamW leaves them alone. opt.zero_grad() (set_to_none=True, torch's default) makes "
                    "torch.optim.AdamW leave them alone too; an eager model without data parallelism keeps "
                    "torch's .grad and steps them as it does. (Said once.)",
                    GradHandOffWarning, stacklevel=6)
        self._handed_over |= taking

    def _hand_over_late_grads(self, params: list, pids: list) -> bool:
        """Data parallel: gradients that are in `.grad` at step() although the hooks take each one during the
        backward: a parameter that started requiring grad after construction (hooked from now on) or a
        `.grad` set without a backward. They are reduced now. One written after a backward that already
        reduced that parameter's gradient is refused."""
        self._dp_hooks.check_no_late_grads(params, lambda i: self._describe(params[i]))
        for param in params:
            if param.grad is not None and id(param) not in self._hook_handles and param.requires_grad:
                self._hook(param)
        return hand_over_grads(self._runtime, params, pids)

    @torch.compiler.disable
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear `.grad` (as torch.optim does) and drop what a compiled backward handed over since the last step."""
        super().zero_grad(set_to_none)
        self._runtime.discard_step_grads()
        self._grads_kept_as_zeros = not set_to_none
        if set_to_none:
            self._handed_over.clear()
        if self._dp_hooks is not None:
            self._dp_hooks.step_done()

    def synchronize(self) -> None:
        """Apply any in-flight CPU update to the device parameters (before eval or save)."""
        self._runtime.synchronize()

    def stats(self) -> dict:
        """steps, skipped_steps, cpu_updates, reselections, bytes each way, stall and CPU-update seconds,
        current_interval (steps since the last update boundary), selection_churn, overlapped_boundaries (update
        boundaries whose CPU update ran on while training went on; a reselecting one waits), and grad_norm: the last
        step's global gradient norm before clipping (unscaled; inf or nan for a skipped step; None before the
        first step)."""
        stats = self._runtime.stats()
        stats["grad_norm"] = self._runtime.grad_norm
        if self._runtime.sharding is not None:  # (host_state_bytes: this rank's rows)
            stats.update(self._runtime.sharding.stats())
        return stats

    def selected_columns(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The device-resident (selected) columns of a matrix parameter, a sorted LongTensor on the host; None
        before the first selection."""
        return self._runtime.selected_columns(self.param_id(param))

    def master(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 master of a parameter, in its shape, on the host (waits for CPU work in flight); before its
        first gradient, the parameter's own values."""
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
        return entry["master"].reshape(sharded.local_shard(param).shape)  # (sharded: this rank's rows)

    def _describe(self, param: torch.Tensor) -> str:
        """How error messages name a parameter: its place in the param groups and its shape."""
        place, shape = self._place(param), tuple(param.shape)
        return f"a parameter of shape {shape}" if place is None else f"{place} (shape {shape})"

    def _place(self, param: torch.Tensor) -> Optional[str]:
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p is param:
                    return f"parameter {i} of param group {g}"
        return None

    # -- copies -------------------------------------------------------------------------------------------
    def __reduce_ex__(self, protocol):
        """copy.deepcopy(opt) and pickling (torch.save({"model": m, "opt": opt})) rebuild the optimizer over the
        copied parameters from `state_dict()`: the copy resumes exactly where this one is (a state_dict
        resume). Refused where that cannot hold: data parallel, or between a backward and step()."""
        if self._runtime.sharding is not None:
            raise TypeError(
                "a ZenFlowAdamW over FSDP2-sharded parameters cannot be copied or pickled: its state is this "
                "rank's rows. Fix: save opt.state_dict() on every rank and load it into a ZenFlowAdamW built on "
                "every rank")
        if self._runtime.data_parallel is not None:
            raise TypeError(
                "a data-parallel ZenFlowAdamW cannot be copied or pickled: its state is spread over the ranks "
                "and rebuilding it is a collective over every rank. Fix: save opt.state_dict() on every rank "
                "(torch.distributed.checkpoint) or opt.consolidated_state_dict(), and load it into a "
                "ZenFlowAdamW built on every rank")
        if self._runtime.holds_step_grads:
            raise RuntimeError(
                "ZenFlowAdamW cannot be copied or pickled between a backward and step(): that backward's "
                "gradients were already handed to the optimizer and the copy would not have them. Fix: copy "
                "after step() (or after zero_grad()), or save opt.state_dict()")
        groups = [{**group, "params": list(group["params"])} for group in self.param_groups]
        # The constructor's own defaults only: torch.optim's load_state_dict adds keys of its own to `defaults`.
        options = dict({key: self.defaults[key] for key in ("lr", "betas", "eps", "weight_decay")},
                       max_grad_norm=self.max_grad_norm, config=self.config,
                       reduce_bucket_size=self._runtime.bucket_numel)
        return _rebuild, (type(self), groups, options, self.state_dict())

    def __copy__(self):
        raise TypeError(
            "copy.copy(ZenFlowAdamW) is refused: a shallow copy would share the parameters, and each parameter "
            "belongs to one ZenFlow optimizer. Fix: copy.deepcopy({'model': model, 'opt': opt}) (copies both), "
            "or opt.state_dict() loaded into a ZenFlowAdamW over other parameters")

    def __repr__(self) -> str:
        return super().__repr__().replace("(\n", f"(\n{self.config}\n", 1)


def _rebuild(cls, groups: list[dict], options: dict, state_dict: dict) -> "ZenFlowAdamW":
    """A copy's (or an unpickled optimizer's) reconstruction: see `ZenFlowAdamW.__reduce_ex__`."""
    optimizer = cls(groups, **options)
    optimizer.load_state_dict(state_dict)
    return optimizer


def _close(runtime: ZenFlowRuntime, hook_handles: dict) -> None:
    for handle in hook_handles.values():
        handle.remove()
    runtime.close()


def _written_params_check(optimizer_ref: "weakref.ReferenceType[ZenFlowAdamW]"):
    """The runtime's check of parameters someone else wrote, before it adopts their values
    (`optimizer_args.check_written_param`, naming the parameter). (Holds the optimizer weakly: the runtime must
    not keep it alive.)"""

    def check(params: list[torch.Tensor]) -> None:
        optimizer = optimizer_ref()
        if optimizer is None:
            return
        for param in params:
            check_written_param(param, optimizer._describe(param), optimizer._shapes.get(id(param), param.shape))

    return check
