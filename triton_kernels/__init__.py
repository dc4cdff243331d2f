"""zenflow_compile.triton_kernels: the GPU kernels of the compiled path, each with a torch fallback.

- `column_sq_norms(grad)`: per-column squared L2 norms (eager path; Inductor fuses it on the compiled path).
- `adamw_selected_columns_(...)`: fused AdamW over the selected columns of many parameters, one launch per
  (param dtype, grad dtype) group, optional in-kernel gather of the gradient columns.
- `merge_host_columns_(param, columns, values)`: write CPU-updated columns into a device parameter.

Each runs its Triton kernel when `triton_available(device)` (CUDA with triton; CPU with `TRITON_INTERPRET=1`)
and its plain-torch `*_reference` otherwise.
"""

from ._triton import HAVE_TRITON, triton_available
from .adamw_columns import adamw_selected_columns_, adamw_selected_columns_reference_
from .column_norms import column_sq_norms, column_sq_norms_reference
from .merge_columns import merge_host_columns_, merge_host_columns_reference_

__all__ = [
    "HAVE_TRITON",
    "triton_available",
    "column_sq_norms",
    "column_sq_norms_reference",
    "adamw_selected_columns_",
    "adamw_selected_columns_reference_",
    "merge_host_columns_",
    "merge_host_columns_reference_",
]
