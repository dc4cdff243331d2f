"""zenflow_compile.runtime."""
