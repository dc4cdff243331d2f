"""Hugging Face ``Trainer`` with ZenFlowAdamW: clipping, evaluation and checkpoints that see the right weights.

    from zenflow_compile.integrations.transformers import ZenFlowCallback

    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=1e-4, topk_ratio=0.1, update_interval=4,
                                       overlap_step=True)
    trainer = Trainer(model=model, args=TrainingArguments(..., torch_compile=True,
                                                          torch_compile_backend="zenflow", max_grad_norm=1.0),
                      optimizers=(opt, scheduler), callbacks=[ZenFlowCallback()], ...)
    trainer.train()

Why Trainer needs it. Under ``torch_compile`` the compiled backward hands each gradient to ZenFlow where it is
produced, so parameters carry no ``.grad``:
- Trainer's own ``clip_grad_norm_`` would see no gradient and clip nothing. The callback hands
  ``args.max_grad_norm`` to ZenFlow's clipping (the global norm from the column scores, the same in eager and
  compiled training) and sets ``args.max_grad_norm = 0`` for the duration of ``train()`` so Trainer skips its
  clip (restored at the end). Training logs get ``grad_norm`` from ZenFlow: the global norm, before
  clipping, of the last step (``opt.stats()["grad_norm"]``), what Trainer logs for torch optimizers.
- With ``overlap_step`` a CPU update may still be in flight at a step's end. The callback calls
  ``opt.synchronize()`` before every evaluation and checkpoint Trainer is about to make, and at the end of
  training (so ``trainer.evaluate()`` / ``save_model()`` afterwards see every update), never otherwise.
- ``opt.stats()`` (CPU updates, reselections, bytes each way, stall and CPU-update seconds) go into every
  log entry as ``zenflow/<name>``.

- Trainer compiles through accelerate, whose list of backends is closed: importing this module adds
  "zenflow" to it (``register_accelerate_backend``), so ``TrainingArguments(torch_compile=True,
  torch_compile_backend="zenflow")`` works.

transformers is imported only here, on demand: ``import zenflow_compile`` never needs it.
"""

from __future__ import annotations

from numbers import Number
from typing import Optional

from transformers import TrainerCallback

from zenflow_compile.optimizer import ZenFlowAdamW

__all__ = ["ZenFlowCallback", "find_zenflow_optimizer", "register_accelerate_backend"]


def register_accelerate_backend() -> None:
    """Let accelerate (which Trainer compiles through) accept ``torch_compile_backend="zenflow"``.

    accelerate checks the backend name against a closed enum of torch's built-in backends
    (``accelerate.utils.DynamoBackend``) and passes ``member.value.lower()`` to ``torch.compile``; a backend
    registered through torch's ``torch_dynamo_backends`` entry point, like this one, is refused with "'ZENFLOW'
    is not a valid DynamoBackend". This adds a ZENFLOW value to that enum's lookup table (not to its listed
    members). Called when this module is imported; idempotent.
    """
    try:
        from accelerate.utils import DynamoBackend
    except ImportError:  # Trainer itself needs accelerate and will say so
        return
    if "ZENFLOW" in DynamoBackend._value2member_map_:
        return
    member = str.__new__(DynamoBackend, "ZENFLOW")
    member._name_, member._value_ = "ZENFLOW", "ZENFLOW"
    DynamoBackend._value2member_map_["ZENFLOW"] = member


register_accelerate_backend()


def find_zenflow_optimizer(optimizer) -> Optional[ZenFlowAdamW]:
    """The ZenFlowAdamW inside Trainer's optimizer (accelerate wraps it in ``AcceleratedOptimizer``), or None."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        if isinstance(optimizer, ZenFlowAdamW):
            return optimizer
        seen.add(id(optimizer))
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _is_deepspeed_wrapper(optimizer) -> bool:
    return type(optimizer).__name__ == "DeepSpeedOptimizerWrapper" or "deepspeed" in type(optimizer).__module__


def _deepspeed_error() -> ValueError:
    return ValueError(
        "ZenFlowCallback cannot run with DeepSpeed enabled in Trainer (TrainingArguments(deepspeed=...) or "
        "accelerate's DeepSpeed plugin): Trainer hands the optimizer to deepspeed.initialize, whose ZeRO / fp16 "
        "optimizer wrappers keep their own fp32 masters and read `.grad`, which ZenFlow never fills (and a "
        "zero_optimization.zenflow block there selects DeepSpeed's own ZenFlow, not this one). ZenFlowAdamW "
        "offloads by itself: drop deepspeed= and pass Trainer(..., optimizers=(ZenFlowAdamW(...), scheduler)); "
        "for DeepSpeed's own training loop use zenflow_compile.deepspeed.initialize")


class ZenFlowCallback(TrainerCallback):
    """Makes ``Trainer`` correct with a ``ZenFlowAdamW`` optimizer (see the module docstring).

    Pass the optimizer to Trainer through ``optimizers=(opt, scheduler)``; the callback finds it when training
    begins. ``log_stats=False`` keeps ``opt.stats()`` out of the logs.
    """

    def __init__(self, log_stats: bool = True):
        self.log_stats = log_stats
        self.optimizer: Optional[ZenFlowAdamW] = None
        self._trainer_max_grad_norm: Optional[float] = None

    # -- training begins / ends ---------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        if getattr(args, "deepspeed", None):
            raise _deepspeed_error()
        mode = getattr(args, "parallel_mode", None)
        if mode is not None and mode.value != "not_parallel":
            # Trainer would wrap the model in DistributedDataParallel / DataParallel, whose gradient hooks
            # refill `.grad` behind ZenFlow (measured: 3.6e-3 off the reference after 6 steps, one rank).
            raise ValueError(
                f"ZenFlowCallback cannot run with Trainer's parallel mode {mode.value!r} (torch.distributed "
                "initialized, a launcher such as torchrun, or several GPUs): Trainer would wrap the model in "
                "DistributedDataParallel / DataParallel, which refills the `.grad` that ZenFlow consumes. Run "
                "Trainer in one process on one device, or train data-parallel without Trainer: "
                "ZenFlowAdamW(..., process_group=...) reduces the gradients itself (docs/distributed.md, \"Data parallel\")")

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        opt = find_zenflow_optimizer(optimizer)
        if opt is None and _is_deepspeed_wrapper(optimizer):  # DeepSpeed enabled by accelerate's own config
            raise _deepspeed_error()
        if opt is None:
            raise TypeError(
                f"ZenFlowCallback needs a zenflow_compile.ZenFlowAdamW as Trainer's optimizer, got "
                f"{type(optimizer).__name__}: pass Trainer(..., optimizers=(ZenFlowAdamW(model.parameters(), "
                f"...), scheduler)), or drop the callback")
        self.optimizer = opt
        self._forward_clipping(args, opt)

    def on_train_end(self, args, state, control, **kwargs):
        if self.optimizer is not None:
            self.optimizer.synchronize()  # evaluate() / save_model() after train() see every update
        if self._trainer_max_grad_norm is not None:
            args.max_grad_norm = self._trainer_max_grad_norm
            self._trainer_max_grad_norm = None

    def _forward_clipping(self, args, opt: ZenFlowAdamW) -> None:
        wanted = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        if wanted is not None:
            if opt.max_grad_norm is None:
                opt.max_grad_norm = float(wanted)
            elif opt.max_grad_norm != wanted:
                raise ValueError(
                    f"TrainingArguments.max_grad_norm={args.max_grad_norm!r} and ZenFlowAdamW(max_grad_norm="
                    f"{opt.max_grad_norm!r}) disagree: set one of them (ZenFlow clips with the global norm of "
                    f"each step's gradient), or make them equal")
        # Trainer's clip_grad_norm_ would see no .grad (ZenFlow consumes the gradients): turn it off. Trainer's
        # clipping now goes through max_grad_norm, so the optimizer's note about clip_grad_norm_ is not needed.
        self._trainer_max_grad_norm = args.max_grad_norm
        args.max_grad_norm = 0.0
        opt._grad_hand_off_noted = True

    # -- evaluation and checkpoints see current weights ---------------------------------------------------
    def _synchronize_if_due(self, control) -> None:
        if self.optimizer is not None and (control.should_evaluate or control.should_save
                                           or control.should_training_stop):
            self.optimizer.synchronize()

    def on_step_end(self, args, state, control, **kwargs):
        self._synchronize_if_due(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._synchronize_if_due(control)

    # -- logs ---------------------------------------------------------------------------------------------
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self.optimizer is None:
            return
        entry = state.log_history[-1] if state.log_history and state.log_history[-1].get("step") == \
            state.global_step else None
        extra = {}
        if self.log_stats:
            extra = {f"zenflow/{k}": v for k, v in self.optimizer.stats().items()
                     if isinstance(v, Number) and not isinstance(v, bool)}
        grad_norm = self.optimizer.stats()["grad_norm"]
        for target in filter(lambda d: d is not None, (logs, entry)):
            if "loss" in target:  # a training log: the step's norm, as Trainer logs it from its own clipping
                target.pop("grad_norm", None)
                if grad_norm is not None:
                    target["grad_norm"] = grad_norm
            target.update(extra)
