"""ZenFlow configuration: the keys, defaults and validation of DeepSpeed's ``zero_optimization.zenflow`` block.

Plain dataclass: importing this module never imports DeepSpeed (an optional extra).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import numbers
import os
import warnings
from fractions import Fraction
from typing import Any, Mapping, Optional, Union

__all__ = ["ZenFlowConfig", "ZENFLOW_KEYS", "PRESETS"]

_STRATEGIES = ("auto", "step", "epoch")
# Named sets of defaults: `preset="deepspeed"` gives DeepSpeed's (the dataclass defaults below), "project" (what
# `preset=None` means) this project's: the most accurate setting that overlaps every boundary across the
# fine-tunes of benchmarks/accuracy.py (README "Which settings"). Keys set explicitly always win over the preset.
PRESETS = {
    "project": dict(update_interval=4, overlap_step=True, interval_aware_update=True, select_strategy="step",
                    select_interval=8, overlap_reselect="incoming", landing_lag=1),
    "deepspeed": {},
}
# Keys that say how an overlapped update behaves: a preset's values apply only where the overlap is on (a user's
# overlap_step=False turns them off with it, rather than making them an error).
_OVERLAP_KEYS = ("overlap_reselect", "landing_lag")
_OVERLAP_RESELECT = ("wait", "incoming")
_ACCUMULATE_ON = ("auto", "device", "host")


def _bad(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"ZenFlowConfig.{key}={value!r} is invalid: expected {allowed}")


# Arguments of ZenFlowAdamW itself and of torch.optim.AdamW, which users put among the ZenFlow keys by mistake:
# an unknown key close to one of them gets that hint instead of only the list of ZenFlow keys.
_OPTIMIZER_ARGS = ("lr", "betas", "eps", "weight_decay", "max_grad_norm", "config", "process_group",
                   "reduce_bucket_size")
_UNSUPPORTED_ADAMW_ARGS = {
    "amsgrad": "ZenFlowAdamW implements AdamW without amsgrad",
    "maximize": "ZenFlowAdamW minimizes; negate the loss instead",
    "foreach": "ZenFlowAdamW picks its own kernels (there is no foreach/fused switch)",
    "fused": "ZenFlowAdamW picks its own kernels (there is no foreach/fused switch)",
    "capturable": "ZenFlowAdamW does not run under CUDA graphs",
    "differentiable": "ZenFlowAdamW's step is not differentiable",
}


def unknown_key_hints(keys: Any) -> str:
    """For unknown config keys: what each probably meant (a ZenFlow key, a ZenFlowAdamW argument, or a
    torch.optim.AdamW argument ZenFlowAdamW does not take), as one sentence; "" when nothing is close."""
    hints = []
    for key in keys:
        key = str(key)
        if key in _UNSUPPORTED_ADAMW_ARGS:
            hints.append(f"{key!r} is a torch.optim.AdamW argument: {_UNSUPPORTED_ADAMW_ARGS[key]}")
            continue
        if key in _OPTIMIZER_ARGS:
            hints.append(f"{key!r} is an argument of ZenFlowAdamW(...), not a ZenFlow config key")
            continue
        close = difflib.get_close_matches(key, (*ZENFLOW_KEYS, *_OPTIMIZER_ARGS), n=1, cutoff=0.75)
        close = close or [k for k in ZENFLOW_KEYS if len(key) >= 4 and k.startswith(key)][:1]  # "topk"
        if close and close[0] in ZENFLOW_KEYS:
            hints.append(f"{key!r}: did you mean {close[0]!r}?")
        elif close:
            hints.append(f"{key!r}: did you mean {close[0]!r} (an argument of ZenFlowAdamW(...), not a ZenFlow "
                         "config key)?")
    return "; ".join(hints)


def _unknown_keys_message(unknown: list) -> str:
    hints = unknown_key_hints(unknown)
    return (f"unknown ZenFlowConfig key(s) {unknown}" + (f" ({hints})" if hints else "")
            + f": valid keys are {list(ZENFLOW_KEYS)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class ZenFlowConfig:
    """ZenFlow settings (same names, types and defaults as DeepSpeed's ``ZenFlowConfig``).

    preset (keyword, not stored): which defaults the keys not given take: None or "project" (this project's:
    update_interval=4, overlap_step=True, interval_aware_update=True, select_strategy="step",
    select_interval=8, overlap_reselect="incoming", landing_lag=1; the last two only where overlap_step is
    True), "deepspeed" (DeepSpeed's, the defaults listed below); see PRESETS.

    topk_ratio: fraction r in (0, 1] of each matrix's columns updated on the device every step (1: all).
    select_strategy: when the selected columns are re-chosen: "auto" (on churn), "step" or "epoch".
    select_interval: "auto", or the int >= 1 number of steps ("step") / epochs ("epoch") between reselections.
    update_interval: "auto" (Zen-auto) or the int >= 1 number of steps between CPU updates of the other columns.
    overlap_step: run the CPU update of a boundary while the device goes on (applied at the next boundary, or
        sooner with landing_lag).
    offload: keep the selected columns' and the vectors' moments in host memory too (DeepSpeed's flag): they
        visit the device for each step's update, one slab at a time (no effect where the model is on the CPU).
    auto_ratio: fraction in [0, 1] of matrices that must be ripe for Zen-auto to make a boundary.
    full_warm_up_rounds: number W >= 0 of initial steps with plain full AdamW updates, before any selection.
    pt_reserved_cores_perc: fraction in [0, 1] of CPU cores left to PyTorch threads (the rest run CPU AdamW).
    steps_per_epoch: int >= 1 steps in an epoch; required by select_strategy "epoch".
    max_update_interval: int >= 1 cap on Zen-auto's interval (this project's key, not DeepSpeed's).
    interval_aware_update: this project's key, not DeepSpeed's: on in the project's defaults, off with
        preset="deepspeed" (DeepSpeed parity). At an
        update boundary the unselected columns take one AdamW step with the mean of the m accumulated
        gradients, so they move about 1/m as far as under AdamW. True sizes that step for the m steps it
        stands for: lr * m (weight decay included, so the decay is (1 - lr*wd)^m to first order, as the
        selected columns get). "sqrt": lr * sqrt(m), the distance m AdamW steps cover where the gradient is
        noise, half of it (m = 4) where it is signal; with stagger_boundaries it measured closer to AdamW
        early in a fine-tune than True on two of three tasks (docs/sizing.md). m is the column's steps
        accumulated since its last update: update_interval, or under Zen-auto up to max_update_interval
        (lower that cap to bound the largest step).
    interval_second_moment: opt-in, needs interval_aware_update True or "sqrt" (this project's key). The
        interval step's second moment takes the mean of the m per-step squared gradients, what AdamW's m steps
        would have fed exp_avg_sq, instead of the square of their mean (smaller by the gradient's variance / m,
        so the lr * m step runs too long where the gradient is mostly noise). Costs one more fp32 host
        accumulator per unselected column and one more multiply-add per offloaded element per step.
    overlap_reselect: what a reselecting update boundary does with its own CPU update under overlap_step=True
        (this project's key; "wait" keeps DeepSpeed's semantics). "wait": the boundary waits for it and applies
        it, so the parameters are fully current when the selection changes (that boundary does not overlap).
        "incoming": only the columns joining the selection get the boundary's update at once (they move to the
        device with their state and must be current there); the columns that stay unselected keep it in flight
        until it lands (the next boundary, or landing_lag), as at any overlapped boundary, so the boundary
        overlaps. Needs overlap_step=True.
    landing_lag: this project's key (1 in the project's preset, None in DeepSpeed's), needs overlap_step=True.
        None: an overlapped CPU update lands (is applied to the parameters) at the next boundary, DeepSpeed's
        overlap. An int L >= 1: the update launched at boundary b lands at the end of step b + L, or at the
        next boundary if that comes first (which with an int update_interval S it never does: L must be <= S,
        and L = S is None's schedule). With update_interval="auto" the next boundary is not known in advance,
        so L is a cap on the staleness (L <= max_update_interval). A CPU update not finished by its landing
        step is waited for there (counted stall).
    accumulate_on: where the unselected columns' gradients are summed between CPU updates (this project's key;
        the result is the same): "device" (an fp32 accumulator on the device, copied to the host once per update
        interval), "host" (every step's gradient copied to the host and added there by a worker thread: for a
        device without room for the accumulator), "auto" (device where the accumulators fit half of the free
        device memory; host where the device is the host, or with ZenFlow's own data parallelism).
    stagger_boundaries: this project's key, needs an int update_interval S. False: every matrix's update boundary
        falls at the same steps. True: the matrices are dealt into S phases of about equal size (in the order
        the optimizer takes them, each to the phase holding the fewest elements so far) and phase q's
        boundaries, landings and reselections are those of the unstaggered schedule at step t + q: at every
        step about 1/S of the parameters reach a boundary, so the CPU works evenly and a landing_lag of L
        steps asks it for L / S of an update, not a whole one.
    """

    topk_ratio: float = 0.1
    select_strategy: str = "auto"
    select_interval: Union[str, int] = "auto"
    update_interval: Union[str, int] = "auto"
    overlap_step: bool = False
    offload: bool = False
    auto_ratio: float = 0.99
    full_warm_up_rounds: int = 0
    pt_reserved_cores_perc: float = 0.5
    steps_per_epoch: Optional[int] = None
    max_update_interval: int = 16
    interval_aware_update: Union[bool, str] = False  # False, True or "sqrt"
    interval_second_moment: bool = False
    overlap_reselect: str = "wait"
    landing_lag: Optional[int] = None
    accumulate_on: str = "auto"
    stagger_boundaries: bool = False

    # preset: which defaults the keys not given take, "project" (None) or "deepspeed" (see PRESETS); not stored.
    preset: dataclasses.InitVar[Optional[str]] = None

    def __new__(cls, *args: Any, **kwargs: Any):
        # The dataclass __init__ would say only "unexpected keyword argument"; name the fix too.
        unknown = sorted(k for k in kwargs if k not in ZENFLOW_KEYS and k != "preset")
        if unknown:
            raise TypeError(_unknown_keys_message(unknown))
        self = super().__new__(cls)
        # The keys given by name: a preset fills only the others.
        object.__setattr__(self, "_given", frozenset(ZENFLOW_KEYS[:len(args)]) | frozenset(kwargs))
        return self

    def __post_init__(self, preset: Optional[str]) -> None:
        def put(key: str, value: Any) -> None:
            object.__setattr__(self, key, value)

        if not (preset is None or (isinstance(preset, str) and preset in PRESETS)):
            raise _bad("preset", preset, f"None or one of {sorted(PRESETS)}")
        given = getattr(self, "_given", ())
        for key, value in PRESETS[preset or "project"].items():
            if key not in given and (key not in _OVERLAP_KEYS or self.overlap_step is True):
                put(key, value)

        def real_in(key: str, lo: float, hi: float, lo_open: bool, allowed: str) -> None:
            v = getattr(self, key)
            ok = _is_real(v) and (lo < v if lo_open else lo <= v) and v <= hi  # NaN fails both
            if not ok:
                raise _bad(key, v, allowed)
            put(key, float(v))

        def int_at_least(key: str, lo: int, allowed: str, auto: bool = False, none: bool = False) -> None:
            v = getattr(self, key)
            if (auto and isinstance(v, str) and v == "auto") or (none and v is None):
                return
            if not (_is_int(v) and v >= lo):
                raise _bad(key, v, allowed)
            put(key, int(v))

        real_in("topk_ratio", 0.0, 1.0, True, "a float in (0, 1]")
        if not (isinstance(self.select_strategy, str) and self.select_strategy in _STRATEGIES):
            raise _bad("select_strategy", self.select_strategy, 'one of "auto", "step", "epoch"')
        int_at_least("select_interval", 1, '"auto" or an int >= 1', auto=True)
        int_at_least("update_interval", 1, '"auto" or an int >= 1', auto=True)
        for key in ("overlap_step", "offload", "interval_second_moment", "stagger_boundaries"):
            if not isinstance(getattr(self, key), bool):
                raise _bad(key, getattr(self, key), "a bool (True or False)")
        if not (isinstance(self.interval_aware_update, bool) or self.interval_aware_update == "sqrt"):
            raise _bad("interval_aware_update", self.interval_aware_update,
                       'True (the interval step at lr * m), "sqrt" (at lr * sqrt(m)) or False (at lr)')
        real_in("auto_ratio", 0.0, 1.0, False, "a float in [0, 1]")
        int_at_least("full_warm_up_rounds", 0, "an int >= 0")
        real_in("pt_reserved_cores_perc", 0.0, 1.0, False, "a float in [0, 1]")
        int_at_least("steps_per_epoch", 1, "None or an int >= 1", none=True)
        int_at_least("max_update_interval", 1, "an int >= 1")

        if not (isinstance(self.overlap_reselect, str) and self.overlap_reselect in _OVERLAP_RESELECT):
            raise _bad("overlap_reselect", self.overlap_reselect, 'one of "wait", "incoming"')
        if self.overlap_reselect != "wait" and not self.overlap_step:
            raise ValueError(
                f"ZenFlowConfig.overlap_reselect={self.overlap_reselect!r} needs overlap_step=True: it says which "
                "part of a reselecting boundary's CPU update stays in flight, and without overlap none does")
        int_at_least("landing_lag", 1, "None (land at the next boundary) or an int >= 1 (steps after the boundary)",
                     none=True)
        if self.landing_lag is not None:
            if not self.overlap_step:
                raise ValueError(
                    f"ZenFlowConfig.landing_lag={self.landing_lag!r} needs overlap_step=True: it says when an "
                    "overlapped CPU update lands, and without overlap every update lands at its own boundary")
            longest, why = ((self.update_interval, f"update_interval={self.update_interval}")
                            if not self.auto_update else
                            (self.max_update_interval, f"update_interval='auto' (max_update_interval="
                                                       f"{self.max_update_interval}, its longest interval)"))
            if self.landing_lag > longest:
                raise _bad("landing_lag", self.landing_lag,
                           f"None or an int in [1, {longest}] with {why}: an update lands at the latest at the "
                           "next boundary, before that boundary launches its own")
        if not (isinstance(self.accumulate_on, str) and self.accumulate_on in _ACCUMULATE_ON):
            raise _bad("accumulate_on", self.accumulate_on, 'one of "auto", "device", "host"')
        if self.stagger_boundaries and self.auto_update:
            raise ValueError(
                "ZenFlowConfig.stagger_boundaries=True needs an int update_interval: it deals the matrices into "
                "update_interval phases, and Zen-auto's boundaries ('auto') are not known in advance. Set "
                "update_interval to an int, or stagger_boundaries=False")
        if self.interval_second_moment and self.interval_aware_update is False:
            raise ValueError(
                "ZenFlowConfig.interval_second_moment=True needs interval_aware_update=True: it sizes the second "
                "moment of the interval step that interval_aware_update scales (True or \"sqrt\"). Set both, or "
                "neither")
        # Cross-key rules, as DeepSpeed's engine (deepspeed/runtime/zenflow/engine.py) applies them.
        if self.select_strategy in ("step", "epoch") and self.select_interval == "auto":
            raise ValueError(
                f"ZenFlowConfig.select_interval='auto' is invalid with select_strategy={self.select_strategy!r}: "
                f"set select_interval to an int >= 1 (the number of {self.select_strategy}s between reselections)")
        if self.select_strategy == "auto" and self.select_interval != "auto":
            warnings.warn(
                f"ZenFlowConfig.select_interval={self.select_interval!r} is ignored with select_strategy='auto' "
                "(reselection is decided by selection churn); set select_strategy='step' or 'epoch' to use it",
                UserWarning, stacklevel=3)
        if self.select_strategy == "epoch" and self.steps_per_epoch is None:
            raise ValueError(
                "ZenFlowConfig.steps_per_epoch=None is invalid with select_strategy='epoch': "
                "expected an int >= 1 (the number of steps in an epoch)")

    # ----------------------------------------------------------------------------------------- builders
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], preset: Optional[str] = None) -> "ZenFlowConfig":
        """Build from a mapping of ZenFlow keys (the others from ``preset``'s defaults); unknown keys are a
        ValueError."""
        if not isinstance(d, Mapping):
            raise TypeError(f"ZenFlowConfig.from_dict expects a mapping, got {type(d).__name__}")
        unknown = sorted(str(k) for k in d if k not in ZENFLOW_KEYS)
        if unknown:
            raise ValueError(_unknown_keys_message(unknown))
        return cls(**dict(d), preset=preset)

    @classmethod
    def from_deepspeed(cls, config: Union[str, "os.PathLike[str]", Mapping[str, Any]], *,
                       steps_per_epoch: Optional[int] = None) -> "ZenFlowConfig":
        """Build from a DeepSpeed config (JSON file path or dict), reading ``zero_optimization.zenflow``.

        ``steps_per_epoch`` fills that key when the block does not set it. Keys the block does not set take
        DeepSpeed's defaults, or this project's where the block says ``"preset": "project"``.
        """
        where = "the DeepSpeed config"
        if isinstance(config, (str, os.PathLike)):
            where = f"DeepSpeed config file {os.fspath(config)!r}"
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        if not isinstance(config, Mapping):
            raise ValueError(f"{where} must be a JSON object / dict, got {type(config).__name__}")
        zero = config.get("zero_optimization")
        block = zero.get("zenflow") if isinstance(zero, Mapping) else None
        if block is None:
            raise ValueError(f"no ZenFlow settings: looked for 'zero_optimization.zenflow' in {where}")
        if not isinstance(block, Mapping):
            raise ValueError(f"'zero_optimization.zenflow' in {where} must be a JSON object, "
                             f"got {type(block).__name__}")
        block = dict(block)
        if block.get("steps_per_epoch") is None and steps_per_epoch is not None:
            block["steps_per_epoch"] = steps_per_epoch
        # A DeepSpeed config keeps DeepSpeed's defaults unless its block asks for the project's.
        return cls.from_dict(block, preset=block.pop("preset", "deepspeed"))

    def to_dict(self) -> dict:
        """All keys as a plain dict (``from_dict(c.to_dict()) == c``)."""
        return {k: getattr(self, k) for k in ZENFLOW_KEYS}

    # ------------------------------------------------------------------------------------------ helpers
    def num_selected(self, num_columns: int) -> int:
        """Columns selected in a matrix of ``num_columns`` columns: max(1, floor(topk_ratio * C))."""
        if not (_is_int(num_columns) and num_columns >= 1):
            raise ValueError(f"num_columns={num_columns!r} is invalid: expected an int >= 1")
        return _num_selected(self.topk_ratio, int(num_columns))

    @property
    def auto_update(self) -> bool:
        """True when the update interval is chosen by Zen-auto."""
        return self.update_interval == "auto"

    def interval_lr_scale(self, steps: int) -> float:
        """The lr multiplier of a CPU update standing for `steps` accumulated steps (interval_aware_update)."""
        if self.interval_aware_update == "sqrt":
            return math.sqrt(steps)
        return steps if self.interval_aware_update else 1

    @property
    def num_phases(self) -> int:
        """The phases the matrices' boundaries are staggered over (1: unstaggered)."""
        return self.update_interval if self.stagger_boundaries else 1

    @property
    def reselect_every(self) -> Optional[int]:
        """Steps between reselections for "step" / "epoch"; None for "auto" (churn-driven)."""
        if self.select_strategy == "step":
            return self.select_interval
        if self.select_strategy == "epoch":
            return self.select_interval * self.steps_per_epoch
        return None


ZENFLOW_KEYS = tuple(f.name for f in dataclasses.fields(ZenFlowConfig))


@functools.lru_cache(maxsize=4096)
def _num_selected(topk_ratio: float, num_columns: int) -> int:
    # The exact decimal product: 0.29 * 100 is 28.999999999999996 in floating point, but k is 29. (Cached:
    # asked per matrix at every selection.)
    return max(1, math.floor(Fraction(repr(topk_ratio)) * num_columns))
