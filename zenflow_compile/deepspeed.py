"""DeepSpeed integration: the DeepSpeed ZenFlow user's JSON, a real DeepSpeed engine, compiled ZenFlow inside.

    engine, optimizer, loader, scheduler = zenflow_compile.deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json", training_data=dataset)
    engine.compile()              # "compile": {"deepcompile": true} -> torch.compile(backend="zenflow")
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint("ckpt")

`initialize` takes the arguments of `deepspeed.initialize` and returns what it returns: a
`deepspeed.DeepSpeedEngine` (a subclass, `ZenFlowDeepSpeedEngine`), its optimizer (a
`zenflow_compile.ZenFlowAdamW`), DeepSpeed's dataloader and the LR scheduler of the JSON's `scheduler` block.

How the user's config is read. The whole JSON is first validated by DeepSpeed's own `DeepSpeedConfig`
(`zero_optimization.zenflow` by DeepSpeed's `ZenFlowConfig`), so a bad key gets DeepSpeed's error. Then:
- `optimizer` (type AdamW, or Adam in adam_w_mode) -> ZenFlowAdamW's lr/betas/eps/weight_decay, with the
  defaults of DeepSpeed's Adam optimizers (weight_decay 0, not torch's 0.01; with `"torch_adam": true` torch's,
  since DeepSpeed then builds torch.optim.AdamW);
- "auto" (Hugging Face's placeholder, filled by its Trainer) in the batch sizes, `gradient_clipping` or the
  optimizer / scheduler params is an error naming the key; DeepSpeed's config classes read it elsewhere as
  their default (for `zero_optimization.reduce_bucket_size`: ZenFlow's default bucket);
- `gradient_clipping` -> `max_grad_norm` (ZenFlow clips from its norm proxy, compiled or eager);
- `zero_optimization.zenflow` -> `ZenFlowConfig`; `steps_per_epoch` is the number of optimizer steps in one
  pass over `training_data` (DeepSpeed's dataloader length // gradient_accumulation_steps). This project's
  own keys (`max_update_interval`, `interval_aware_update`, `interval_second_moment`, `overlap_reselect`,
  `landing_lag`, `accumulate_on`, `stagger_boundaries`: not DeepSpeed's, whose config class forbids unknown
  keys) are taken out of the block before DeepSpeed validates it and validated by `ZenFlowConfig`, so one
  JSON holds every setting. The keys the block leaves out take DeepSpeed's defaults (parity), or this
  project's with `"preset": "project"` in the block;
- `zero_optimization.stage` 0/1/2 and `offload_optimizer.device` "cpu" (or none) are accepted: they are what
  DeepSpeed ZenFlow requires, and ZenFlow itself keeps the unselected columns' state on the host; stage 3,
  NVMe, parameter offload and partial offload cannot apply and are errors naming the key;
- `compile.deepcompile: true` -> `engine.compile()` uses backend "zenflow"; DeepCompile's pass options
  (offload_activation, ...) cannot apply and are errors naming the key;
- `bf16` -> DeepSpeed casts the module (its own cast, with keep_in_fp32_modules); ZenFlow keeps the fp32
  masters. `torch_autocast` (bf16 or fp16) is DeepSpeed's as is: at stage 0 it scales fp16 losses with its
  own torch.amp.GradScaler, which ZenFlowAdamW supports. The `fp16` block: DeepSpeed casts the module to
  fp16, ZenFlow keeps fp32 masters, and its dynamic loss scaling becomes that same GradScaler
  (`_fp16_grad_scaler`: initial_scale_power, loss_scale_window; hysteresis and min_loss_scale have no
  GradScaler equivalent; a static loss_scale is an error).

What the engine is given instead (why): DeepSpeed must not touch ZenFlow's state.
- no `optimizer` block but a client optimizer callable, so DeepSpeed never builds cpu_adam / FusedAdam; it
  calls the callable after it has cast and moved the module, so ZenFlow sees the final dtype and device;
- `zero_optimization: {"stage": 0}`: no ZeRO optimizer, no flattening, no ZenFlowZeroOptimizer;
- `gradient_clipping: 0`: ZenFlow clips (above); DeepSpeed's `clip_fp32_gradients` would clip an eager `.grad`
  a second time, or read one the compiled backward never fills;
- no `compile` block: DeepSpeed's DeepCompile accepts only inductor/eager; `compile()` here picks the backend;
- per engine instance (`ZenFlowDeepSpeedEngine`): `enable_backward_allreduce = False` (DeepSpeed's
  all-reduce zero-fills every missing `.grad` and reduces it; ZenFlow reduces across ranks itself);
  `_do_optimizer_sanity_check` returns "no wrapper", because with a `bf16`/`fp16` block and a client
  optimizer at stage 0 DeepSpeed would wrap it in FP16_UnfusedOptimizer / BF16_Optimizer (its own masters);
  `load_checkpoint` restores the optimizer through `ZenFlowAdamW.load_state_dict` (DeepSpeed would pass its
  wrappers' `load_optimizer_states=` argument); ZenFlowAdamW reports a skipped (non-finite) step through the
  `overflow` attribute DeepSpeed's step reads (skipped_steps, no LR-scheduler step), set by a step hook.

Data parallelism (`deepspeed --num_gpus N` or torchrun): ZenFlowAdamW gets the engine's data-parallel group
(`process_group=engine.data_parallel_group`): gradients are averaged inside the rewritten backward (or by
ZenFlow's hooks, eagerly), every rank selects the same columns, and each rank holds the host state of a
share of the matrices (what stage 1/2 with `offload_optimizer.device: "cpu"` asks for). DeepSpeed's own
all-reduce stays off. `zero_optimization.reduce_bucket_size`, when the JSON sets it, sizes ZenFlow's gradient
buckets. Checkpoints: on several ranks the optimizer state goes through torch.distributed.checkpoint into
`zenflow_optim/` in the tag directory (each rank writes the state of the parameters it owns), and
`load_checkpoint` reads it back at any world size; a one-rank run keeps it in DeepSpeed's model file.

DeepSpeed is imported only inside the functions of this module (the package imports without it).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
from typing import Any, Callable, Mapping, Optional

import torch

from zenflow_compile.config import PRESETS, ZENFLOW_KEYS, ZenFlowConfig
from zenflow_compile.optimizer import ZenFlowAdamW

__all__ = ["initialize", "ZenFlowDeepSpeedPlan", "plan_from_config", "engine_class"]

# DeepSpeed's Adam-family defaults (deepspeed.ops.adam: DeepSpeedCPUAdam / FusedAdam), which a DeepSpeed
# user's `optimizer.params` falls back to. With `"torch_adam": true` DeepSpeed builds torch.optim.AdamW instead,
# whose own defaults apply (weight_decay 0.01): see `_adamw_from`.
_DS_ADAM_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
# optimizer.params keys of DeepSpeed's Adam that only pick DeepSpeed's implementation (ZenFlow uses its own
# kernels): accepted and ignored.
_IMPLEMENTATION_KEYS = ("torch_adam", "foreach", "fused")
_BACKEND = "zenflow"
# The optimizer state of a checkpoint saved by several ranks: a torch.distributed.checkpoint folder in the tag's.
DCP_OPTIMIZER_DIR = "zenflow_optim"


def _require_deepspeed():
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError("zenflow_compile.deepspeed needs DeepSpeed: pip install \"zenflow-compile[deepspeed]\" "
                          f"(importing it failed: {error})") from error
    return deepspeed


def _config_error(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"DeepSpeed config {key}={value!r} cannot be used with zenflow_compile.deepspeed: {why}")


# ---------------------------------------------------------------------------------------------- the plan
@dataclasses.dataclass
class ZenFlowDeepSpeedPlan:
    """What the user's DeepSpeed config means here: ZenFlowAdamW's arguments and the engine's own config."""

    adamw: dict  # lr, betas, eps, weight_decay
    max_grad_norm: Optional[float]
    zenflow_keys: dict  # ZenFlowConfig keys from zero_optimization.zenflow (steps_per_epoch may be None)
    preset: str  # which defaults the keys the block does not set take: "deepspeed", or "project" on request
    deepcompile: bool
    engine_config: dict  # the user's config minus what ZenFlow takes over (see the module docstring)
    user_config: dict

    def zenflow_config(self, steps_per_epoch: Optional[int]) -> ZenFlowConfig:
        keys = dict(self.zenflow_keys)
        if keys.get("steps_per_epoch") is None:
            keys["steps_per_epoch"] = steps_per_epoch
        strategy = keys.get("select_strategy", ZenFlowConfig(preset=self.preset).select_strategy)
        if strategy == "epoch" and keys["steps_per_epoch"] is None:
            raise ValueError(
                "zero_optimization.zenflow.select_strategy='epoch' needs the epoch length: pass "
                "training_data=... to zenflow_compile.deepspeed.initialize (an epoch is one pass of DeepSpeed's "
                "dataloader over it), or set zero_optimization.zenflow.steps_per_epoch (optimizer steps per epoch)")
        return ZenFlowConfig.from_dict(keys, preset=self.preset)


def _adamw_from(ds_config, user_config: Mapping[str, Any]) -> dict:
    name = ds_config.optimizer_name
    if name is None:
        raise ValueError("the DeepSpeed config has no 'optimizer' block: zenflow_compile.deepspeed builds "
                         "ZenFlowAdamW from it; add {\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": ...}}}")
    if str(name).lower() not in ("adamw", "adam"):
        raise _config_error("optimizer.type", user_config["optimizer"].get("type", name),
                            "ZenFlow is AdamW; use type \"AdamW\" (or \"Adam\")")
    params = dict(ds_config.optimizer_params or {})
    if str(name).lower() == "adam" and params.get("adam_w_mode", True) is not True:
        raise _config_error("optimizer.params.adam_w_mode", params["adam_w_mode"],
                            "ZenFlow is AdamW (decoupled weight decay); remove the key or set it to true")
    params.pop("adam_w_mode", None)
    if "max_grad_norm" in params:  # DeepSpeed's own rule, same advice
        raise _config_error("optimizer.params.max_grad_norm", params["max_grad_norm"],
                            "use the top-level 'gradient_clipping' key instead")
    for key, required in (("bias_correction", True), ("amsgrad", False), ("fp32_optimizer_states", True)):
        if key in params and params.pop(key) is not required:
            raise _config_error(f"optimizer.params.{key}", not required,
                                f"ZenFlowAdamW is AdamW with fp32 state and bias correction; set it to "
                                f"{str(required).lower()} or remove it")
    defaults = dict(_DS_ADAM_DEFAULTS)
    if params.get("torch_adam"):  # DeepSpeed then builds torch.optim.AdamW with torch's defaults
        signature = inspect.signature(torch.optim.AdamW).parameters
        defaults.update({k: signature[k].default for k in defaults})
    for key in _IMPLEMENTATION_KEYS:
        params.pop(key, None)
    unknown = sorted(set(params) - set(_DS_ADAM_DEFAULTS))
    if unknown:
        raise _config_error(f"optimizer.params.{unknown[0]}", params[unknown[0]],
                            f"ZenFlowAdamW takes {sorted(_DS_ADAM_DEFAULTS)} (plus DeepSpeed's implementation "
                            f"switches {list(_IMPLEMENTATION_KEYS)}, ignored)")
    adamw = {**defaults, **params}
    adamw["betas"] = tuple(adamw["betas"])
    return adamw


def _check_zero(zero) -> None:
    if int(zero.stage) == 3:
        raise _config_error("zero_optimization.stage", 3,
                            "ZenFlow keeps every parameter whole on the device here (stage 3 partitions "
                            "parameters); use stage 1 or 2 (what DeepSpeed ZenFlow requires) or 0. To shard the "
                            "parameters too, use PyTorch's FSDP2 without DeepSpeed: fully_shard the model (per "
                            "block and the root), then zenflow_compile.ZenFlowAdamW(model.parameters(), ...) "
                            "(docs/distributed.md, 'Sharded parameters (FSDP2)')")
    offload = zero.offload_optimizer
    if offload is not None:
        device = getattr(offload.device, "value", offload.device)
        if device not in ("cpu", "none"):
            raise _config_error("zero_optimization.offload_optimizer.device", device,
                                "ZenFlow offloads the unselected columns' optimizer state to CPU memory; "
                                "use \"cpu\"")
        if offload.ratio != 1.0:
            raise _config_error("zero_optimization.offload_optimizer.ratio", offload.ratio,
                                "partial offload does not apply: ZenFlow decides per column (topk_ratio)")
    param_offload = zero.offload_param
    if param_offload is not None and getattr(param_offload.device, "value", param_offload.device) != "none":
        raise _config_error("zero_optimization.offload_param.device",
                            getattr(param_offload.device, "value", param_offload.device),
                            "parameters stay on the device with ZenFlow (offload_param is a ZeRO-3 feature)")
    if zero.zenflow is None:
        raise ValueError("the DeepSpeed config has no 'zero_optimization.zenflow' block: add the ZenFlow settings "
                         "(e.g. {\"topk_ratio\": 0.05, \"update_interval\": 4}) to use zenflow_compile.deepspeed")


def _check_compile(compile_config) -> bool:
    if not compile_config.deepcompile:
        return False
    defaults = type(compile_config)()
    for name in type(compile_config).model_fields:
        if name != "deepcompile" and getattr(compile_config, name) != getattr(defaults, name):
            raise _config_error(f"compile.{name}", getattr(compile_config, name),
                                "it is a DeepCompile pass option; with zenflow_compile, \"deepcompile\": true "
                                "means torch.compile with the zenflow backend, which does not run DeepCompile's "
                                "passes; remove the key")
    return True


def _check_precision(ds_config) -> None:
    # torch_autocast with fp16 passes: at stage 0 DeepSpeed drives its own torch.amp.GradScaler, which
    # ZenFlowAdamW supports (the scale is divided out in step(), found-inf reported back). The fp16 block is
    # mapped onto that same GradScaler (`_fp16_grad_scaler`); what cannot be mapped is an error.
    fp16 = ds_config.float16_config
    if not fp16.enabled:
        return
    if fp16.loss_scale > 0:
        raise _config_error("fp16.loss_scale", fp16.loss_scale,
                            "a static loss scale has no torch.amp.GradScaler equivalent (GradScaler always backs "
                            "off on overflow); use 0 (dynamic loss scaling, DeepSpeed's default)")
    if fp16.fp16_master_weights_and_grads:
        raise _config_error("fp16.fp16_master_weights_and_grads", True,
                            "ZenFlow keeps fp32 masters; leave it false")


def _fp16_grad_scaler(fp16_config, device_name: str):
    """DeepSpeed's dynamic loss scaling as torch.amp.GradScaler: initial scale 2**initial_scale_power, halved
    on overflow, doubled after loss_scale_window clean steps. Not mapped (GradScaler has no such knobs):
    hysteresis (DeepSpeed waits for that many overflows before lowering the scale; here every overflow
    lowers it) and min_loss_scale."""
    import torch

    return torch.amp.GradScaler(device=device_name, init_scale=2.0 ** fp16_config.initial_scale_power,
                                growth_factor=2.0, backoff_factor=0.5,
                                growth_interval=fp16_config.loss_scale_window)


# Keys Hugging Face's Trainer fills in when they hold "auto" (transformers.integrations.deepspeed) that DeepSpeed
# reads as plain values: "auto" there would reach DeepSpeed's batch arithmetic or the optimizer as a string.
# (DeepSpeed's pydantic config blocks, zero_optimization included, read "auto" as their default.)
_HF_AUTO_TOP_LEVEL = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                      "gradient_clipping")


def _check_no_hf_auto(user_config: Mapping[str, Any]) -> None:
    places = [(key, user_config.get(key)) for key in _HF_AUTO_TOP_LEVEL]
    for block in ("optimizer", "scheduler"):
        section = user_config.get(block)
        params = section.get("params") if isinstance(section, Mapping) else None
        if isinstance(params, Mapping):
            places += [(f"{block}.params.{key}", value) for key, value in params.items()]
    for key, value in places:
        if isinstance(value, str) and value == "auto":
            raise _config_error(key, value, "\"auto\" is a placeholder that Hugging Face's Trainer replaces with its "
                                "TrainingArguments before DeepSpeed reads the config; zenflow_compile.deepspeed."
                                "initialize reads it as deepspeed.initialize does, so set a value")


def _pop_project_zenflow_keys(user_config: dict) -> tuple[dict, str]:
    """Take this project's ZenFlow keys (those DeepSpeed's ZenFlowConfig does not know) and `preset` out of
    `zero_optimization.zenflow`, so DeepSpeed's validation sees only its own keys."""
    from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig as DeepSpeedZenFlowConfig

    zero = user_config.get("zero_optimization")
    block = zero.get("zenflow") if isinstance(zero, dict) else None
    if not isinstance(block, dict):
        return {}, "deepspeed"
    preset = block.pop("preset", "deepspeed")
    if preset not in PRESETS:
        raise _config_error("zero_optimization.zenflow.preset", preset,
                            f"expected one of {sorted(PRESETS)}: \"deepspeed\" (the default: DeepSpeed's defaults "
                            "for the keys the block leaves out) or \"project\" (this project's)")
    ours = [k for k in ZENFLOW_KEYS if k not in DeepSpeedZenFlowConfig.model_fields]
    return {k: block.pop(k) for k in ours if k in block}, preset


def plan_from_config(config: Mapping[str, Any], mpu=None) -> ZenFlowDeepSpeedPlan:
    """Validate a DeepSpeed config dict with DeepSpeed's own classes and split it (see the module docstring).

    Needs `deepspeed.comm` initialised (DeepSpeed's batch-size checks read the world size).
    """
    _require_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig

    user_config = copy.deepcopy(dict(config))
    _check_no_hf_auto(user_config)
    project_keys, preset = _pop_project_zenflow_keys(user_config)
    ds_config = DeepSpeedConfig(copy.deepcopy(user_config), mpu)  # DeepSpeed's validation and errors
    if ds_config.hybrid_engine.enabled:
        raise _config_error("hybrid_engine.enabled", True, "the hybrid (RLHF inference) engine is not supported")
    _check_precision(ds_config)
    _check_zero(ds_config.zero_config)
    deepcompile = _check_compile(ds_config.compile_config)
    zenflow = ds_config.zero_config.zenflow
    # DeepSpeed's preset: every DeepSpeed key as DeepSpeed's config class has it; the project's: those set.
    given = zenflow.model_fields_set if preset == "project" else type(zenflow).model_fields
    zenflow_keys = {k: getattr(zenflow, k) for k in ZENFLOW_KEYS if k in given}
    zenflow_keys.update(project_keys)
    clip = float(ds_config.gradient_clipping or 0.0)

    engine_config = copy.deepcopy(user_config)
    engine_config.pop("optimizer", None)
    engine_config.pop("compile", None)
    engine_config["zero_optimization"] = {"stage": 0}
    engine_config["gradient_clipping"] = 0.0
    return ZenFlowDeepSpeedPlan(adamw=_adamw_from(ds_config, user_config),
                                max_grad_norm=clip if clip > 0 else None, zenflow_keys=zenflow_keys, preset=preset,
                                deepcompile=deepcompile, engine_config=engine_config, user_config=user_config)


def _param_groups(model_parameters) -> list:
    """DeepSpeed drops empty param groups after building the optimizer; ZenFlowAdamW numbers its groups at
    construction, so drop them before."""
    groups = list(model_parameters)
    if groups and isinstance(groups[0], dict):
        groups = [dict(g, params=list(g["params"])) for g in groups]
        return [g for g in groups if g["params"]]
    return groups


# -------------------------------------------------------------------------------------------- the engine
_ENGINE_CLASS = None


def engine_class():
    """`ZenFlowDeepSpeedEngine`, a `deepspeed.DeepSpeedEngine` subclass (defined on first use: DeepSpeed is
    imported lazily)."""
    global _ENGINE_CLASS
    _require_deepspeed()
    if _ENGINE_CLASS is None:
        _ENGINE_CLASS = _define_engine_class()
    return _ENGINE_CLASS


def _define_engine_class():
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine

    class ZenFlowDeepSpeedEngine(DeepSpeedEngine):
        """DeepSpeed's engine (loop, dataloader, scheduler, monitor, checkpoints) around a ZenFlowAdamW.

        Differs from DeepSpeedEngine only where DeepSpeed would touch ZenFlow's state (module docstring).
        """

        def __init__(self, *, zenflow_plan: ZenFlowDeepSpeedPlan, **engine_kwargs):
            plan = zenflow_plan

            def build_optimizer(model_parameters):
                # DeepSpeed calls this from _configure_optimizer, after casting and moving the module and
                # after creating the training dataloader (the epoch length).
                return _build_optimizer(self, plan, model_parameters)

            super().__init__(optimizer=build_optimizer, **engine_kwargs)
            self._zenflow_plan = plan
            if self.fp16_enabled():
                # DeepSpeed's fp16 loss scaling lives in its FP16 optimizer wrappers, which would own the fp32
                # masters ZenFlow keeps; its stage-0 GradScaler path (engine.backward scales, the step unscales
                # through ZenFlowAdamW's grad_scaler protocol) does the same job without them.
                self.torch_autocast_z0_gradscaler = _fp16_grad_scaler(self._config.float16_config,
                                                                      get_accelerator().device_name())
            # ZenFlow reduces across ranks itself (compiled: in the rewritten backward; eagerly: its
            # data-parallel hooks): DeepSpeed's all-reduce would zero-fill and reduce `.grad`s a second time.
            self.enable_backward_allreduce = False
            _report_skipped_steps(self.optimizer)

        @property
        def zenflow_plan(self) -> ZenFlowDeepSpeedPlan:
            return self._zenflow_plan

        def _do_optimizer_sanity_check(self, basic_optimizer):
            """No DeepSpeed optimizer wrapper: with a bf16/fp16 block DeepSpeed would wrap the client optimizer
            in FP16_UnfusedOptimizer / BF16_Optimizer, with its own masters and `.grad` flattening. ZenFlow
            keeps the fp32 masters itself."""
            return None

        def compile(self, backend=None, compile_kwargs=None, schedule=None,
                    compiled_autograd_enabled=False) -> None:
            """With `"compile": {"deepcompile": true}`: torch.compile(backend="zenflow"). Without it: DeepSpeed's
            plain torch.compile (default backend the accelerator's; ZenFlow then runs through its hooks)."""
            if self._zenflow_plan.deepcompile:
                if backend not in (None, _BACKEND):
                    raise ValueError(f"engine.compile(backend={backend!r}): with \"compile\": {{\"deepcompile\": "
                                     f"true}} zenflow_compile compiles with backend {_BACKEND!r}; leave backend unset")
                if schedule is not None:
                    raise ValueError("engine.compile(schedule=...): DeepCompile schedules do not apply to the "
                                     "zenflow backend")
                if compiled_autograd_enabled:
                    raise ValueError("engine.compile(compiled_autograd_enabled=True): the zenflow backend "
                                     "rewrites AOTAutograd's backward graph; compiled autograd would bypass it")
                backend = _BACKEND
            elif backend is None:
                backend = get_accelerator().get_compile_backend()
            super().compile(backend=backend, compile_kwargs=dict(compile_kwargs or {}), schedule=schedule,
                            compiled_autograd_enabled=compiled_autograd_enabled)

        def _save_checkpoint(self, save_dir, tag, client_state={}, exclude_frozen_parameters=False):
            super()._save_checkpoint(save_dir, tag, client_state=client_state,
                                     exclude_frozen_parameters=exclude_frozen_parameters)
            data_parallel = self.optimizer._runtime.data_parallel
            if data_parallel is not None:  # (a collective: every rank writes the state of its own parameters)
                import torch.distributed.checkpoint as dcp

                optimizer_dir = os.path.join(save_dir, str(tag), DCP_OPTIMIZER_DIR)
                dcp.save(self.optimizer.state_dict(), checkpoint_id=optimizer_dir, process_group=data_parallel.group)

        def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                            load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
            """DeepSpeed's load (module, scheduler, counters, client state), then ZenFlowAdamW.load_state_dict
            with the optimizer state under `zenflow_optim/` (saved by several ranks), or else the optimizer entry
            of DeepSpeed's model file (DeepSpeed hands it back in the client state when it is told not to load
            it itself)."""
            load_path, client_state = super().load_checkpoint(
                load_dir, tag=tag, load_module_strict=load_module_strict, load_optimizer_states=False,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                custom_load_fn=custom_load_fn)
            if load_path is None:
                return load_path, client_state
            saved = client_state.pop("optimizer", None)
            if not load_optimizer_states or load_module_only:
                return load_path, client_state
            optimizer_dir = os.path.join(os.path.dirname(load_path), DCP_OPTIMIZER_DIR)
            if os.path.isdir(optimizer_dir):  # (the model file holds only rank 0's part then)
                import torch.distributed.checkpoint as dcp

                data_parallel = self.optimizer._runtime.data_parallel
                saved = self.optimizer.state_dict()  # the template: the state of this rank's parameters
                dcp.load(saved, checkpoint_id=optimizer_dir,
                         process_group=None if data_parallel is None else data_parallel.group)
            if saved is None:
                raise ValueError(f"checkpoint {load_path} has no optimizer state; load it with "
                                 "load_optimizer_states=False or load_module_only=True")
            self.optimizer.load_state_dict(saved)
            return load_path, client_state

    return ZenFlowDeepSpeedEngine


def _build_optimizer(engine, plan: ZenFlowDeepSpeedPlan, model_parameters) -> ZenFlowAdamW:
    steps_per_epoch = None
    if engine.training_dataloader is not None:
        steps_per_epoch = max(1, len(engine.training_dataloader) // engine.gradient_accumulation_steps())
    config = plan.zenflow_config(steps_per_epoch)
    bucket = plan.user_config.get("zero_optimization", {}).get("reduce_bucket_size")
    if bucket == "auto":  # DeepSpeed reads "auto" as "its default"; ZenFlow's default bucket size then applies
        bucket = None
    optimizer = ZenFlowAdamW(_param_groups(model_parameters), **plan.adamw, max_grad_norm=plan.max_grad_norm,
                             config=config, process_group=engine.data_parallel_group,
                             **({"reduce_bucket_size": int(bucket)} if bucket is not None else {}))
    # The engine's clipping is the config's gradient_clipping, forwarded as max_grad_norm: it never calls
    # clip_grad_norm_, so the optimizer's note about it would be noise.
    optimizer._grad_hand_off_noted = True
    return optimizer


def _report_skipped_steps(optimizer: ZenFlowAdamW) -> None:
    """DeepSpeed's step reads `optimizer.overflow` (its fp16 optimizers' flag) to count a skipped step and hold
    the LR scheduler; ZenFlow skips a step whose gradient norm is not finite. Set the flag after each step."""
    last = {"skipped": optimizer.stats()["skipped_steps"]}
    optimizer.overflow = False

    def after_step(opt, args, kwargs):
        skipped = opt.stats()["skipped_steps"]
        opt.overflow = skipped > last["skipped"]
        last["skipped"] = skipped

    optimizer.register_step_post_hook(after_step)


# ------------------------------------------------------------------------------------------- initialize
def _resolve_config(args, config, config_params):
    """The config the way deepspeed.initialize finds it (argument, config_params, args.deepspeed_config)."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("got a DeepSpeed config both as args.deepspeed_config and as config=...; pass one")
        config = from_args
    if config is None:
        raise ValueError("DeepSpeed requires a config: pass config=\"ds_config.json\" (or a dict), or "
                         "--deepspeed_config through args")
    return load_ds_config(config) if not isinstance(config, dict) else config


_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _no_launcher_error() -> RuntimeError:
    """Outside a launcher DeepSpeed falls back to MPI discovery, whose `No module named 'mpi4py'` names no fix."""
    missing = ", ".join(k for k in _LAUNCHER_ENV if k not in os.environ)
    return RuntimeError(
        f"zenflow_compile.deepspeed.initialize found no distributed environment ({missing} not set), so DeepSpeed "
        f"tried MPI discovery, which needs mpi4py. Run the script under a launcher (`deepspeed train.py`, "
        f"`torchrun --nproc-per-node N train.py`), or for one process set the variables yourself: "
        f"RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 (and DS_ACCELERATOR=cpu on a "
        f"machine without a GPU).")


def initialize(args: Any = None,
               model: Optional[torch.nn.Module] = None,
               optimizer: Any = None,
               model_parameters: Any = None,
               training_data: Any = None,
               lr_scheduler: Any = None,
               distributed_port: Optional[int] = None,
               mpu: Any = None,
               dist_init_required: Optional[bool] = None,
               collate_fn: Optional[Callable] = None,
               config: Any = None,
               mesh_param: Any = None,
               config_params: Any = None):
    """`deepspeed.initialize` with ZenFlow: returns (engine, optimizer, training_dataloader, lr_scheduler).

    The engine is a real `deepspeed.DeepSpeedEngine` (`ZenFlowDeepSpeedEngine`); the optimizer is the
    `ZenFlowAdamW` built from the config's `optimizer`, `gradient_clipping` and `zero_optimization.zenflow`
    (so `optimizer=` must stay None). See the module docstring for how each key is read.
    """
    deepspeed = _require_deepspeed()
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
    from deepspeed.runtime import zero
    from deepspeed.runtime.config import DeepSpeedConfig

    if model is None:
        raise ValueError("zenflow_compile.deepspeed.initialize requires a model")
    if optimizer is not None:
        raise ValueError("zenflow_compile.deepspeed.initialize builds ZenFlowAdamW from the config's 'optimizer' "
                         "and 'zero_optimization.zenflow' blocks; pass optimizer=None")
    if isinstance(model, deepspeed.PipelineModule):
        raise NotImplementedError("pipeline parallelism (PipelineModule) is not supported with ZenFlow")
    if mpu is not None or mesh_param is not None:
        raise NotImplementedError("model / sequence parallelism (mpu=, mesh_param=) is not supported with ZenFlow")

    zero.partition_parameters.shutdown_init_context()  # as deepspeed.initialize: no zero.Init while building
    try:
        try:
            dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                  distributed_port=distributed_port or TORCH_DISTRIBUTED_DEFAULT_PORT,
                                  dist_init_required=dist_init_required)
        except ModuleNotFoundError as error:
            if error.name != "mpi4py":
                raise
            raise _no_launcher_error() from error
        plan = plan_from_config(_resolve_config(args, config, config_params))
        engine = engine_class()(zenflow_plan=plan, args=args, model=model, model_parameters=model_parameters,
                                training_data=training_data, lr_scheduler=lr_scheduler, mpu=None,
                                dist_init_required=dist_init_required, collate_fn=collate_fn,
                                config=plan.engine_config,
                                config_class=DeepSpeedConfig(copy.deepcopy(plan.engine_config), None))
    finally:
        zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()  # as deepspeed.initialize does after building its engine
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
