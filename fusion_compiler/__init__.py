"""fusion-compiler: a torch.compile backend that fuses memory-bound ops into Triton kernels.

    model = torch.compile(model, backend="fusion")
"""
from .backend import fusion_backend
from .config import Config, ConfigError
from .explain import explain
from .report import GraphReport, capture_compiles

__all__ = ["fusion_backend", "Config", "ConfigError", "GraphReport", "capture_compiles",
           "explain"]
__version__ = "0.1.0"
