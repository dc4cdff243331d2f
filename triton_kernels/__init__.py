"""zenflow_compile.triton_kernels: the GPU kernels, each with its torch twin, taken where
`triton_available(device)` is False (Triton runs on CUDA, and on the CPU under `TRITON_INTERPRET=1`).

- `adamw_slab_`: AdamW of a slab's selected columns, one launch for the slab (`adamw_slab_torch_`: in torch);
- `column_sq_norms`: per-column squared L2 norms, for the eager hand-off.
"""

from ._triton import HAVE_TRITON, triton_available
from .adamw_slab import adamw_columns_torch_, adamw_slab_, adamw_slab_torch_
from .column_norms import column_sq_norms, column_sq_norms_reference

__all__ = ["HAVE_TRITON", "triton_available", "adamw_slab_", "adamw_slab_torch_", "adamw_columns_torch_",
           "column_sq_norms", "column_sq_norms_reference"]
