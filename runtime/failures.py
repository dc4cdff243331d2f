"""Whether an optimizer's state can still be trusted.

A CPU worker's error, or any exception part-way through a step after it began changing state (KeyboardInterrupt,
out of memory), leaves the device columns, the host work and the counters out of step. The optimizer is then
failed: `step()`, `synchronize()` and `state_dict()` raise until `load_state_dict()` replaces every state.

The failure is kept as text, never as the exception: a stored exception's traceback keeps its frames alive, and
with them the training loop's locals and the optimizer itself, as long as the parameters' hooks hold the runtime.
"""

from __future__ import annotations

from typing import Optional


class Failure:
    """The first failure of one optimizer, as (what failed, its cause); None while the state is consistent."""

    def __init__(self):
        self._record: Optional[tuple[str, str]] = None

    @property
    def failed(self) -> bool:
        return self._record is not None

    def record(self, what: str, error: BaseException) -> bool:
        """Keep the first failure; True if this was it."""
        if self._record is not None:
            return False
        self._record = (what, f"{type(error).__name__}: {error}")
        return True

    def clear(self) -> None:
        """A checkpoint load replaced every state: the optimizer is consistent again."""
        self._record = None

    def error(self) -> RuntimeError:
        what, cause = self._record
        return RuntimeError(
            f"{what}; the optimizer state is no longer consistent. Restore from the last checkpoint "
            "(model.load_state_dict(...) and opt.load_state_dict(...), after opt.zero_grad()), or build a new "
            f"optimizer. Cause: {cause}")

    def raise_if_failed(self) -> None:
        if self._record is not None:
            raise self.error()


__all__ = ["Failure"]
