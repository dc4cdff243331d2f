"""ZenFlowPassContext: everything the backward-graph passes know about the world, passed explicitly.

A backward graph made by AOTAutograd returns one gradient per forward input ("primal"), in input order.
The backend knows which forward inputs are ZenFlow parameters; it records their shapes here by primal index
(the parameter's *slot*). The passes never see a live tensor or a parameter id: the hand-off ops carry
slots, and the runtime resolves slot -> parameter for each call of the compiled graph (the same compiled
graph serves every model it is called with), so the context can be hashed into the compile caches' keys.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["ZenFlowPassContext", "DEFAULT_BUCKET_NUMEL"]

#: ZenFlowAdamW's default `reduce_bucket_size` (elements), as DeepSpeed's `reduce_bucket_size`.
DEFAULT_BUCKET_NUMEL = 25_000_000


@dataclasses.dataclass(frozen=True)
class ZenFlowPassContext:
    """What the passes need to rewrite one backward graph.

    param_shapes: for each forward input (= each backward output), the shape of the ZenFlow parameter in that
        slot, or None for inputs that are not ZenFlow parameters (activations, buffers, frozen parameters,
        SymInts). The passes check each gradient against it, so a mismatched input-to-output mapping fails
        loudly instead of corrupting training.
    param_names: human-readable names (for error messages and inspection only, not part of any cache key).
    configs: the ZenFlowConfig of each owning optimizer, as sorted `(key, value)` tuples (cache key only).
    bucket_numel: the gradients are handed over in buckets of at least this many elements (the owners'
        `reduce_bucket_size`), one op call per bucket (`insert_grad_accumulate`, `insert_grad_reduce`).
    data_parallel: None, or the world size when the owners reduce gradients across ranks
        (`insert_grad_reduce` instead of the norm proxy and `insert_grad_accumulate`).
    runtime_scored_numel: gradients of at most this many elements get no norm proxy in the graph (None in
        the op's score list): the runtime scores them together with their like parameters, one stacked
        reduction per group instead of one kernel (and one live buffer) per parameter. 0: every gradient is
        scored in the graph. The backend sets it from the parameters' device (`layout.SHARED_SLAB_MAX_NUMEL`).
    """

    param_shapes: tuple[Optional[tuple[int, ...]], ...]
    param_names: tuple[Optional[str], ...] = ()
    configs: tuple[tuple[tuple[str, object], ...], ...] = ()
    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    data_parallel: Optional[int] = None
    runtime_scored_numel: int = 0

    def __post_init__(self) -> None:
        if self.param_names and len(self.param_names) != len(self.param_shapes):
            raise ValueError("param_names must be empty or have one entry per forward input")
        if not (isinstance(self.bucket_numel, int) and self.bucket_numel >= 1):
            raise ValueError(f"bucket_numel must be a positive int, got {self.bucket_numel!r}")
        if not (isinstance(self.runtime_scored_numel, int) and self.runtime_scored_numel >= 0):
            raise ValueError(f"runtime_scored_numel must be an int >= 0, got {self.runtime_scored_numel!r}")

    @property
    def num_inputs(self) -> int:
        return len(self.param_shapes)

    def is_param(self, index: int) -> bool:
        return self.param_shapes[index] is not None

    def name(self, index: int) -> str:
        if self.param_names and self.param_names[index]:
            return self.param_names[index]
        return f"forward input {index}"

    def cache_key(self) -> tuple:
        """What the rewritten graph depends on (which slots are parameters, their shapes; owners' configs,
        bucket size, data-parallel world size, which gradients the runtime scores)."""
        return (self.param_shapes, self.configs, self.bucket_numel, self.data_parallel, self.runtime_scored_numel)
