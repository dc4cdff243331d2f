"""The two AdamW kernels of the runtime, each behind one function.

- `adamw_columns_`: the device-side update of selected columns and vector parameters. Every column owns
  its own update count (bias correction), so it is written with broadcast tensors instead of
  torch.optim's per-tensor step. (The Triton multi-parameter kernel replaces it on CUDA.)
- `cpu_adamw_`: the host-side update of unselected columns, torch's fused CPU AdamW kernel (as fast as
  DeepSpeedCPUAdam on 2 cores, no JIT build). Swap the kernel here and nowhere else.

Both follow torch.optim.AdamW exactly: decoupled weight decay, then moments, then the bias-corrected step.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw as _torch_adamw


def adamw_columns_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    steps: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """AdamW in place on fp32 `master` [R, k] with per-column counts `steps` [k] (already incremented)."""
    # Bias corrections in float64, like torch.optim.AdamW's Python-float arithmetic.
    steps64 = steps.to(torch.float64)
    step_size = (lr / (1 - beta1**steps64)).to(master.dtype)
    bias_correction2_sqrt = (1 - beta2**steps64).sqrt().to(master.dtype)

    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.sub_(exp_avg / denom * step_size)


def cpu_adamw_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """Fused CPU AdamW over host tensors; each `steps[i]` is a float32 scalar tensor it increments."""
    if not params:
        return
    _torch_adamw(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        fused=True, amsgrad=False, maximize=False,
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
    )
