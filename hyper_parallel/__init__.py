"""hyper_parallel: declarative, named-axis sharding for PyTorch modules."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
