"""zenflow_compile.triton_kernels."""
