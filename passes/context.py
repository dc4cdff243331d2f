"""ZenFlowPassContext: everything the backward-graph passes know about the world, passed explicitly.

A backward graph made by AOTAutograd returns one gradient per forward input ("primal"), in input order.
The backend knows which forward inputs are ZenFlow parameters; it records their ids here by primal index,
so the passes never look at live tensors (they see only the graph) and the context can be hashed into the
compile caches' keys.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["ZenFlowPassContext"]


@dataclasses.dataclass(frozen=True)
class ZenFlowPassContext:
    """What the passes need to rewrite one backward graph.

    param_ids: for each forward input (= each backward output), the ZenFlow parameter id, or None for
        inputs that are not ZenFlow parameters (activations, buffers, frozen parameters, SymInts).
    param_shapes: the shape of each ZenFlow parameter (None elsewhere); the passes check each gradient
        against it, so a mismatched input-to-output mapping fails loudly instead of corrupting training.
    param_names: human-readable names (for error messages and inspection only, not part of any cache key).
    configs: the ZenFlowConfig of each owning optimizer, as sorted `(key, value)` tuples (cache key only).
    """

    param_ids: tuple[Optional[int], ...]
    param_shapes: tuple[Optional[tuple[int, ...]], ...]
    param_names: tuple[Optional[str], ...] = ()
    configs: tuple[tuple[tuple[str, object], ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.param_shapes) != len(self.param_ids):
            raise ValueError("param_shapes must have one entry per forward input")
        if self.param_names and len(self.param_names) != len(self.param_ids):
            raise ValueError("param_names must be empty or have one entry per forward input")

    @property
    def num_inputs(self) -> int:
        return len(self.param_ids)

    def name(self, index: int) -> str:
        if self.param_names and self.param_names[index]:
            return self.param_names[index]
        return f"forward input {index}"

    def cache_key(self) -> tuple:
        """What the rewritten graph depends on (ids and shapes baked in, owners' configs)."""
        return (self.param_ids, self.param_shapes, self.configs)
