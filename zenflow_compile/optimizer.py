"""ZenFlowAdamW: the user-facing torch.optim.Optimizer; all state and scheduling live in the runtime.

Eager use works through post-accumulate-grad hooks (each backward's gradient goes to the runtime and
`.grad` is cleared); under `torch.compile(backend="zenflow")` the rewritten backward calls the runtime
directly and returns no gradient, so the hooks never fire for the parameters of compiled graphs.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Iterable, Optional

import torch

from zenflow_compile.config import ZenFlowConfig
from zenflow_compile.runtime import registry
from zenflow_compile.runtime.engine import ZenFlowRuntime


def _check_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm) -> None:
    def bad(name, value, allowed):
        raise ValueError(f"ZenFlowAdamW {name}={value!r} is invalid: expected {allowed}")

    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0.0 <= lr < math.inf):
        bad("lr", lr, "a finite float >= 0")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        bad("betas", betas, "a pair of floats in [0, 1)")
    if not (isinstance(eps, (int, float)) and 0.0 <= eps < math.inf):
        bad("eps", eps, "a finite float >= 0")
    if not (isinstance(weight_decay, (int, float)) and 0.0 <= weight_decay < math.inf):
        bad("weight_decay", weight_decay, "a finite float >= 0")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and 0.0 < max_grad_norm < math.inf):
        bad("max_grad_norm", max_grad_norm, "None (no clipping) or a finite float > 0")


class ZenFlowAdamW(torch.optim.Optimizer):
    """AdamW with ZenFlow's importance-aware, bounded-asynchronous CPU offload (SPEC §3).

    Args: as torch.optim.AdamW (lr, betas, eps, weight_decay), plus `max_grad_norm` (global-norm clipping
    computed from the gradient-norm proxy; None = off) and either `config=ZenFlowConfig(...)` or the
    ZenFlow keys themselves (topk_ratio, update_interval, overlap_step, ...).
    """

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
        **zenflow_keys: Any,
    ):
        _check_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm)
        if config is not None and zenflow_keys:
            raise ValueError("pass either config=ZenFlowConfig(...) or ZenFlow keys, not both "
                             f"(got config and {sorted(zenflow_keys)})")
        config = config if config is not None else ZenFlowConfig.from_dict(zenflow_keys)
        if config.offload:
            raise NotImplementedError(
                "ZenFlowConfig.offload=True (selected columns' state on the CPU too) is not implemented; "
                "set offload=False: selected columns' state lives on the device")
        self._runtime = ZenFlowRuntime(config, max_grad_norm)
        self._param_ids: dict[int, int] = {}  # id(param) -> runtime id
        self._hook_handles = []
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        weakref.finalize(self, ZenFlowRuntime.close, self._runtime)

    @property
    def config(self) -> ZenFlowConfig:
        return self._runtime.config

    @property
    def max_grad_norm(self) -> Optional[float]:
        return self._runtime.max_grad_norm

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group_index = len(self.param_groups) - 1
        for param in self.param_groups[-1]["params"]:
            pid = self._runtime.add_param(param, group_index)
            self._param_ids[id(param)] = pid
            if param.requires_grad:
                self._hook_handles.append(param.register_post_accumulate_grad_hook(_handoff_hook(pid)))

    def param_id(self, param: torch.Tensor) -> int:
        return self._param_ids[id(param)]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._runtime.step(self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients received since the last step (as torch.optim does with `.grad`)."""
        super().zero_grad(set_to_none)
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
        """The fp32 master of a parameter, in its shape (waits for CPU work in flight)."""
        self._runtime.quiesce()
        entry = self._runtime.export_state(self.param_id(param))
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
        saved["state"] = {i: self._runtime.export_state(self.param_id(p))
                          for i, p in enumerate(self._params_in_order())}
        saved["zenflow"] = self._runtime.export_globals()
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        if "zenflow" not in state_dict:
            raise ValueError("not a ZenFlowAdamW state_dict (no 'zenflow' entry); a torch.optim.AdamW "
                             "checkpoint cannot be resumed exactly by ZenFlow")
        self._runtime.quiesce()
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._runtime.import_globals(state_dict["zenflow"])
        for i, param in enumerate(self._params_in_order()):
            self._runtime.import_state(self.param_id(param), state_dict["state"][i])

    def __repr__(self) -> str:
        return super().__repr__().replace("(\n", f"(\n{self.config}\n", 1)


def _handoff_hook(pid: int):
    def hook(param: torch.Tensor) -> None:
        if param.grad is not None:
            registry.accumulate_grad(pid, param.grad, None)
            param.grad = None

    return hook
