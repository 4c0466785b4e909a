"""Whole models: ``BaseModel`` and ``ModelConfigConverter``.

A ``BaseModel`` is the root ``Module`` of a model: every submodule that holds
states is a :class:`~hyper_parallel.dmodule.module.Module` (so it can carry a
sharding config and be initialized in place), which
:meth:`BaseModel.verify_module_protocol` checks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

import torch

from hyper_parallel.dmodule.module import Module

__all__ = ["BaseModel", "ModelConfigConverter"]

_Source = TypeVar("_Source")
_Target = TypeVar("_Target", bound=Module.Config)


class BaseModel(Module):
    """Root module of a model built from configs.

    Example::

        model = MyModel.Config(...).build()   # MyModel(BaseModel)
        model.verify_module_protocol()
        model.init_weights()
    """

    def init_weights(self, *, buffer_device: torch.device | str | None = None) -> None:
        """Initialize every parameter and buffer in place (see ``Module.init_states``)."""
        self.init_states(buffer_device=buffer_device)

    def verify_module_protocol(self) -> None:
        """Check that every submodule holding parameters or buffers is a ``Module``.

        Raises:
            TypeError: Naming each offending module path and its class.
        """
        offenders = [
            f"{path or '<root>'} ({type(m).__name__})"
            for path, m in self.named_modules()
            if not isinstance(m, Module)
            and (
                any(p is not None for p in m._parameters.values())
                or any(b is not None for b in m._buffers.values())
            )
        ]
        if offenders:
            raise TypeError(
                f"{type(self).__name__}: these submodules hold states but are not "
                f"hyper_parallel Modules: {', '.join(offenders)}. Build them from a "
                "Module Config, or wrap the class with Module.from_nn_module(cls)."
            )


class ModelConfigConverter(ABC, Generic[_Source, _Target]):
    """Converts a foreign model description (e.g. a Hugging Face config) to a ``Config``.

    Subclasses implement :meth:`convert`; :meth:`__call__` is an alias.
    """

    @abstractmethod
    def convert(self, source: _Source) -> _Target:
        """Return the equivalent model ``Config``."""

    def __call__(self, source: _Source) -> _Target:
        return self.convert(source)
