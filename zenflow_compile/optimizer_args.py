"""What ZenFlowAdamW takes and what it refuses: its hyperparameters, its settings (`config=`, the ZenFlow keys,
`reduce_bucket_size`), its parameters (dtype, devices, layout, duplicates), and parameters someone rewrote after
it took them. Every check runs before anything is registered, so a refused argument changes nothing."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, Optional

import torch

from zenflow_compile.config import ZenFlowConfig
from zenflow_compile.runtime.engine import ZenFlowRuntime


#: Parameter dtypes ZenFlow trains (fp32 masters); integer and bool tensors are skipped, as by torch.optim.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_hyperparameters(lr, betas, eps, weight_decay, max_grad_norm) -> None:
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


def check_reduce_bucket_size(reduce_bucket_size) -> None:
    if not (isinstance(reduce_bucket_size, int) and not isinstance(reduce_bucket_size, bool)
            and reduce_bucket_size >= 1):
        raise ValueError(f"ZenFlowAdamW reduce_bucket_size={reduce_bucket_size!r} is invalid: expected an int "
                         ">= 1 (elements per bucket of gradients handed to the runtime, and reduced "
                         "across ranks under data parallelism)")


def config_from_args(config: Any, preset: Optional[str], zenflow_keys: dict[str, Any]) -> ZenFlowConfig:
    """The optimizer's `ZenFlowConfig` from `config=` (one, or a dict of its keys) or from the ZenFlow keys given
    as arguments over `preset`'s defaults; never both."""
    if config is not None and zenflow_keys:
        raise ValueError("pass either config=ZenFlowConfig(...) or ZenFlow keys, not both "
                         f"(got config and {sorted(zenflow_keys)})")
    if isinstance(config, Mapping):  # (the ZenFlow keys as a dict)
        config = ZenFlowConfig.from_dict(config)
    elif config is not None and not isinstance(config, ZenFlowConfig):
        raise TypeError(
            f"ZenFlowAdamW config= expects a ZenFlowConfig or a dict of ZenFlow keys, got "
            f"{type(config).__name__}; for a DeepSpeed JSON pass config=ZenFlowConfig.from_deepspeed(path)")
    if config is not None and preset is not None:
        raise ValueError(f"pass either config= or preset={preset!r}, not both (a config's keys are all set)")
    config = config if config is not None else ZenFlowConfig.from_dict(zenflow_keys, preset=preset)
    return config


def param_list(params):
    """`params` as torch.optim takes them, with every iterable made a list (they are read twice: once to find
    sharded parameters, once by torch.optim)."""
    if isinstance(params, torch.Tensor):
        return params  # (torch.optim's own error)
    items = []
    for item in params:
        if isinstance(item, Mapping) and "params" in item and not isinstance(item["params"], torch.Tensor):
            item = {**item, "params": list(item["params"])}
        items.append(item)
    return items


def tensors_in(params) -> list:
    """The tensors of a `param_list` (plain, named (name, tensor) pairs, or param groups)."""
    if isinstance(params, torch.Tensor):
        return [params]
    tensors = []
    for item in params:
        if isinstance(item, Mapping):
            inner = item.get("params", [])
            tensors += tensors_in([inner] if isinstance(inner, torch.Tensor) else inner)
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            tensors.append(item[1])
        else:
            tensors.append(item)
    return tensors


def check_params(params: list, group_index: int, known: dict, runtime: ZenFlowRuntime) -> None:
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
        if not (param.is_floating_point() or param.is_complex()):
            continue  # integer and bool tensors never get a gradient
        check_dtype(param.dtype, where)
        if param.dim() >= 2 and param.numel() == 0:
            raise ValueError(f"ZenFlowAdamW: {where} is an empty matrix; ZenFlow views a matrix as [rows, "
                             "columns] and needs at least one of each. Fix: leave empty parameters out")
        if param.dim() >= 2 and not param.is_contiguous():
            raise ValueError(f"ZenFlowAdamW: {where} is not contiguous (strides {param.stride()}). Fix: make it "
                             "contiguous first (param.data = param.data.contiguous())")
        runtime.check_device(param)


def check_dtype(dtype: torch.dtype, where: str, cast: bool = False) -> None:
    if dtype in SUPPORTED_DTYPES:
        return
    how = "was cast to" if cast else "is"
    if dtype.is_complex:
        why = ("ZenFlow selects and updates real columns and would not train it; torch.optim.AdamW treats a "
               "complex parameter as its real and imaginary parts")
        fix = ("register it as a real parameter (torch.view_as_real(...) of it, viewed back with "
               "torch.view_as_complex in forward), or give it to a torch.optim.AdamW of its own")
    elif dtype == torch.float64:
        why = "ZenFlow keeps fp32 masters and would update it at fp32 precision, not fp64's"
        fix = ("train in fp32 (model.float()) or bf16/fp16, or give the fp64 parameters to a torch.optim.AdamW "
               "of their own")
    else:
        why = f"ZenFlow trains {', '.join(map(str, SUPPORTED_DTYPES))} parameters (fp32 masters)"
        fix = "cast it to one of those, or give it to an optimizer of its own"
    raise ValueError(f"ZenFlowAdamW: {where} {how} {dtype}: {why}. Fix: {fix}")


def check_written_param(param: torch.Tensor, where: str, shape_taken: torch.Size) -> None:
    """A parameter someone else wrote (a new storage or dtype included), before the runtime adopts its values: a
    dtype ZenFlow does not train, another shape than the one the optimizer took (`shape_taken`, its state's),
    or a matrix whose memory is no longer [rows, columns] in order
    (`model.to(memory_format=torch.channels_last)`) is refused naming the parameter (`where`)."""
    check_dtype(param.dtype, where, cast=True)
    if param.shape != shape_taken:
        raise ValueError(
            f"ZenFlowAdamW: {where} was {tuple(shape_taken)} when the optimizer took it (param.data was "
            "replaced by a tensor of another shape); its optimizer state has the old shape. Fix: "
            "build a new optimizer over the resized parameters (or resize them before building it)")
    if param.dim() >= 2 and not param.is_contiguous():
        raise ValueError(
            f"ZenFlowAdamW: {where} is no longer contiguous (strides {param.stride()}; e.g. after "
            "model.to(memory_format=torch.channels_last)): ZenFlow updates a matrix in place as [rows, "
            "columns] of contiguous memory. Fix: keep the parameters contiguous "
            "(model.to(memory_format=torch.contiguous_format)); a channels_last input works with "
            "contiguous weights")
