"""zenflow_compile.triton_kernels: the GPU kernels, each with its torch twin.

- `adamw_slab_(...)`: AdamW of a slab's selected columns ([n, R, k] state, per-column counts), one launch for
  the slab's members; `adamw_slab_torch_` is the same math in torch.
- `column_sq_norms(grad)`: per-column squared L2 norms (the eager hand-off; Inductor fuses them into the
  compiled backward).

Each runs its Triton kernel when `triton_available(device)` (CUDA with triton; CPU with `TRITON_INTERPRET=1`)
and its torch twin otherwise.
"""

from ._triton import HAVE_TRITON, triton_available
from .adamw_slab import adamw_columns_torch_, adamw_slab_, adamw_slab_torch_
from .column_norms import column_sq_norms, column_sq_norms_reference

__all__ = [
    "HAVE_TRITON",
    "triton_available",
    "adamw_slab_",
    "adamw_slab_torch_",
    "adamw_columns_torch_",
    "column_sq_norms",
    "column_sq_norms_reference",
]
