"""zenflow_compile.passes: FX passes that rewrite compiled backward graphs for ZenFlow."""

from zenflow_compile.passes.context import ZenFlowPassContext
from zenflow_compile.passes.pipeline import is_backward_graph, rewrite_backward

__all__ = ["ZenFlowPassContext", "is_backward_graph", "rewrite_backward"]
