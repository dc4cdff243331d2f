"""zenflow-compile: ZenFlow stall-free offloaded AdamW as a torch.compile backend.

    opt = zenflow_compile.ZenFlowAdamW(model.parameters(), lr=2e-5, topk_ratio=0.05, update_interval=4)
    model = torch.compile(model, backend="zenflow")
"""

from zenflow_compile import backend  # noqa: F401  registers the "zenflow" backend (idempotent with the entry point)
from zenflow_compile.config import ZenFlowConfig
from zenflow_compile.optimizer import GradHandOffWarning, ZenFlowAdamW
from zenflow_compile.runtime.landings import LandingStallWarning

__all__ = ["ZenFlowConfig", "ZenFlowAdamW", "GradHandOffWarning", "LandingStallWarning"]
