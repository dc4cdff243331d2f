"""Exploration, not library code: other sizings of the unselected columns' interval update, on the reference.

    python benchmarks/accuracy_variants.py --variant sqrt --runs reference:iau=1 --seed 0 --eval-size 2000 \\
        --eval-steps 200 250 300 --out variants_seed0.json      # then any other benchmarks/accuracy.py flag

`interval_aware_update=True` (the opt-in key) gives the interval's one AdamW step lr x m. Its second moment
is fed the mean gradient squared, whose expectation is mu^2 + sigma^2 / m instead of the mu^2 + sigma^2 AdamW
sees per step: where the gradient is mostly noise (small batches, late in a fine-tune) the step is up to
sqrt(m) times larger than m AdamW steps would be, i.e. AdamW at a higher lr. The variants here, each run by
`ZenFlowReference` (eager, synchronous, SPEC section 3 plus the variant) under the run name
`reference[<variant>]:...`:

  sqrt             lr x sqrt(m) instead of lr x m: equals AdamW where the gradient is noise, half its speed
                   (m = 4) where it is signal. The decoupled decay follows the lr (lr x sqrt(m) x wd per interval).
  second-moment    lr x m, and exp_avg_sq takes the mean of the per-step squared gradients (sum g_t^2 / m,
                   accumulated beside sum g_t) instead of the mean gradient squared: the second moment AdamW
                   would have seen. Needs a second host accumulator; not built in the runtime.

Each is made by patching the reference's source at import (asserting the patched lines are found), so a
change to zenflow_compile/reference.py fails here loudly instead of silently measuring something else.
"""

from __future__ import annotations

import argparse
import math
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accuracy  # noqa: E402  (benchmarks/accuracy.py)
import torch  # noqa: E402

import zenflow_compile.reference  # noqa: E402

VARIANTS = ("sqrt", "second-moment")

_LR_TIMES_M = 'group = dict(group, lr=group["lr"] * st["acc_steps"])'
_ACC_INIT = 'st["acc"] = torch.zeros(R, C, dtype=torch.float32, device=p.device)\n'
_ACCUMULATE = 'st["acc"][:, U] += g2d[:, U]\n'
_BOUNDARY_UPDATE = 'self._update_columns(st, st["acc"] / st["acc_steps"], self._unselected(p), group)'
_RESET = 'st["acc"].zero_()\n'


def _patch(source: str, old: str, new: str) -> str:
    if source.count(old) != 1:
        raise RuntimeError(f"zenflow_compile/reference.py changed: {old!r} is not there exactly once; "
                           "update benchmarks/accuracy_variants.py")
    return source.replace(old, new)


def update_columns_second_moment(st, grad_mean, grad_sq_mean, cols, group):
    """reference.adamw_ on the columns ``cols``, except that exp_avg_sq takes ``grad_sq_mean`` (the mean of the
    per-step squared gradients) where AdamW would take grad * grad."""
    beta1, beta2 = group["betas"]
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    master, exp_avg, exp_avg_sq = (st[k][:, cols] for k in ("master", "exp_avg", "exp_avg_sq"))
    count = st["count"][cols] + 1
    steps = count.tolist()
    step_size_neg = torch.tensor([-(lr / (1 - beta1 ** n)) for n in steps], dtype=torch.float64).float()
    bc2_sqrt = torch.tensor([(1 - beta2 ** n) ** 0.5 for n in steps], dtype=torch.float64).float()
    master.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad_mean[:, cols], 1 - beta1)
    exp_avg_sq.mul_(beta2).add_(grad_sq_mean[:, cols], alpha=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    master.add_(step_size_neg * exp_avg / denom)
    for k, v in zip(("master", "exp_avg", "exp_avg_sq"), (master, exp_avg, exp_avg_sq)):
        st[k][:, cols] = v
    st["count"][cols] = count


def variant_reference(variant: str) -> type:
    """ZenFlowReference with the interval update of ``variant`` (with interval_aware_update=True)."""
    source = Path(zenflow_compile.reference.__file__).read_text()
    if variant == "sqrt":
        source = _patch(source, _LR_TIMES_M, 'group = dict(group, lr=group["lr"] * math.sqrt(st["acc_steps"]))')
    elif variant == "second-moment":
        indent = " " * 12
        source = _patch(source, _ACC_INIT, _ACC_INIT + indent + _ACC_INIT.replace('"acc"', '"acc_sq"'))
        source = _patch(source, _ACCUMULATE, _ACCUMULATE + indent + 'st["acc_sq"][:, U] += g2d[:, U] ** 2\n')
        source = _patch(source, _BOUNDARY_UPDATE,
                        'update_columns_second_moment(st, st["acc"] / st["acc_steps"], '
                        'st["acc_sq"] / st["acc_steps"], self._unselected(p), group)')
        indent = " " * 16
        source = _patch(source, _RESET, _RESET + indent + 'st["acc_sq"].zero_()\n')
    else:
        raise ValueError(f"variant {variant!r}: expected one of {VARIANTS}")
    module = types.ModuleType(f"reference_{variant.replace('-', '_')}")
    module.__dict__.update(math=math, update_columns_second_moment=update_columns_second_moment)
    exec(compile(source, zenflow_compile.reference.__file__ + f" [{variant}]", "exec"), module.__dict__)
    return module.ZenFlowReference


def main(argv=None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--variant", required=True, choices=VARIANTS)
    known, rest = p.parse_known_args(argv)
    tag = f"reference[{known.variant}]"
    zenflow_compile.reference.ZenFlowReference = variant_reference(known.variant)  # what train_one builds

    parse_run, run_name = accuracy.parse_run, accuracy.run_name

    def parse_variant_run(name):
        if not name.startswith(("reference:", tag + ":")):
            raise ValueError(f"run {name!r}: this script runs reference:<settings> runs only (with iau=1)")
        spec = parse_run(name.replace(tag, "reference", 1))
        if not spec["iau"]:
            raise ValueError(f"run {name!r}: the variants size the interval_aware_update step; add iau=1")
        return spec

    accuracy.parse_run = parse_variant_run
    accuracy.run_name = lambda spec: run_name(spec).replace("reference", tag, 1)
    return accuracy.main(rest)


if __name__ == "__main__":
    sys.exit(main())
