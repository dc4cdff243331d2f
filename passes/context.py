"""ZenFlowPassContext: everything the backward-graph passes know about the world, passed explicitly.

A backward graph made by AOTAutograd returns one gradient per forward input ("primal"), in input order.
The backend knows which forward inputs are ZenFlow parameters; it records their shapes here by primal index
(the parameter's *slot*). The passes never see a live tensor or a parameter id: the hand-off op carries the
slot, and the runtime resolves slot -> parameter for each call of the compiled graph (the same compiled graph
serves every model it is called with), so the context can be hashed into the compile caches' keys.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["ZenFlowPassContext"]


@dataclasses.dataclass(frozen=True)
class ZenFlowPassContext:
    """What the passes need to rewrite one backward graph.

    param_shapes: for each forward input (= each backward output), the shape of the ZenFlow parameter in that
        slot, or None for inputs that are not ZenFlow parameters (activations, buffers, frozen parameters,
        SymInts). The passes check each gradient against it, so a mismatched input-to-output mapping fails
        loudly instead of corrupting training.
    param_names: human-readable names (for error messages and inspection only, not part of any cache key).
    configs: the ZenFlowConfig of each owning optimizer, as sorted `(key, value)` tuples (cache key only).
    data_parallel: None, or `(world_size, bucket_numel)` when the owners reduce gradients across ranks: the
        gradients are then handed over in buckets of about `bucket_numel` elements (`insert_grad_reduce`).
    """

    param_shapes: tuple[Optional[tuple[int, ...]], ...]
    param_names: tuple[Optional[str], ...] = ()
    configs: tuple[tuple[tuple[str, object], ...], ...] = ()
    data_parallel: Optional[tuple[int, int]] = None

    def __post_init__(self) -> None:
        if self.param_names and len(self.param_names) != len(self.param_shapes):
            raise ValueError("param_names must be empty or have one entry per forward input")

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
        """What the rewritten graph depends on (which slots are parameters, their shapes; owners' configs and
        data-parallel settings)."""
        return (self.param_shapes, self.configs, self.data_parallel)
