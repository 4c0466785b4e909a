"""A registry of named models: ``ModelSpec``, ``register_spec``, ``get_spec``.

Tools (the dry run, the validator, the CLI) reach models through this registry, by
name, never by importing a model package directly::

    from hyper_parallel.dmodule.model_spec import ModelSpec, get_spec, register_spec

    register_spec(ModelSpec(name="tiny", build_model_fn=lambda: MyModel.Config().build()))
    model = get_spec("tiny").build()
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["ModelSpec", "get_spec", "list_specs", "register_spec"]


@dataclass(kw_only=True)
class ModelSpec:
    """How to build one named model.

    Exactly one of ``build_model_fn`` (called with keyword overrides, returns a
    model or a model ``Config``) and ``model`` (a ``Config`` to build, or a model
    instance) is given.

    Args:
        name: Registry key, e.g. ``"llama3-8b"``.
        build_model_fn: Factory returning a model config or model.
        model: A model config (anything with ``build()``) or a built model.
        description: One line for listings.
        extras: Free-form facts tools may use (family, default sharding functions).
    """

    name: str
    build_model_fn: Callable[..., Any] | None = None
    model: Any = None
    description: str = ""
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelSpec.name must be a non-empty string, got {self.name!r}.")
        if (self.build_model_fn is None) == (self.model is None):
            raise ValueError(
                f"ModelSpec {self.name!r}: give exactly one of build_model_fn and model "
                f"(got {'both' if self.model is not None else 'neither'})."
            )

    def config(self, **overrides: Any) -> Any:
        """The model's config (``build_model_fn(**overrides)`` or ``model``)."""
        if self.build_model_fn is not None:
            return self.build_model_fn(**overrides)
        if overrides:
            if isinstance(self.model, nn.Module):
                raise ValueError(
                    f"ModelSpec {self.name!r} holds a built model, so fields "
                    f"{sorted(overrides)} cannot be overridden; register its Config instead."
                )
            return self.model.replace(**overrides)
        return self.model

    def build(self, **overrides: Any) -> nn.Module:
        """Build the model (an already built model is returned as is)."""
        value = self.config(**overrides)
        return value if isinstance(value, nn.Module) else value.build()


_REGISTRY: dict[str, ModelSpec] = {}
# Packages that register specs when imported; loaded on first lookup.
_BUILTIN_PACKAGES = ("hyper_parallel.models.llama", "hyper_parallel.models.qwen3_moe")


def register_spec(spec: ModelSpec) -> ModelSpec:
    """Add a spec to the registry.

    Args:
        spec: The spec; its ``name`` becomes the registry key.

    Returns:
        ``spec``, so the call can be used as an expression.

    Raises:
        ValueError: If a spec of the same name is already registered.
        TypeError: If ``spec`` is not a ModelSpec.

    Example::

        from torch import nn
        from hyper_parallel.dmodule.model_spec import ModelSpec, get_spec, register_spec

        register_spec(ModelSpec(name="doc-mlp", model=nn.Linear(4, 4)))
        assert isinstance(get_spec("doc-mlp").build(), nn.Linear)
    """
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"register_spec: expected a ModelSpec, got {type(spec).__name__}.")
    if spec.name in _REGISTRY:
        raise ValueError(
            f"register_spec: a model named {spec.name!r} is already registered; "
            "choose another name."
        )
    _REGISTRY[spec.name] = spec
    return spec


def _load_builtins() -> None:
    for package in _BUILTIN_PACKAGES:
        try:
            importlib.import_module(package)
        except ModuleNotFoundError as e:  # a package not present in this install
            if e.name != package:
                raise


def list_specs() -> list[str]:
    """Names of all registered models, sorted.

    Returns:
        Registry keys, built-in models included.

    Example::

        from hyper_parallel.dmodule.model_spec import list_specs

        names = list_specs()  # e.g. ['llama3-8b', ...]
    """
    _load_builtins()
    return sorted(_REGISTRY)


def get_spec(name: str) -> ModelSpec:
    """The spec registered under ``name``.

    Args:
        name: Registry key, e.g. ``"llama3-8b"``.

    Returns:
        The registered :class:`ModelSpec`.

    Raises:
        ValueError: For an unknown name; the message lists the known ones.

    Example::

        from hyper_parallel.dmodule.model_spec import get_spec, list_specs

        spec = get_spec(list_specs()[0])
    """
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"get_spec: no model named {name!r}; known models: {sorted(_REGISTRY)}."
        ) from None
