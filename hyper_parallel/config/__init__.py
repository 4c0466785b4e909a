"""Typed, nested configs that build the objects they describe."""

from __future__ import annotations

from hyper_parallel.config._configurable import Configurable as Configurable

__all__ = ["Configurable"]
