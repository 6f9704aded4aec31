"""fthsdp: fault-tolerant HSDP training for PyTorch. The data-parallel replica is the unit of failure.

This package stays light on import; the runtime API lives in submodules.
"""

__version__ = "0.1.0"
