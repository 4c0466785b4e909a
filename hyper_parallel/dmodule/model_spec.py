"""A registry of named models (``ModelSpec``); each carries its family's contract
(:class:`~hyper_parallel.contract.ModelFamily`, re-exported here).

Tools (the trainer, the dry run, the validator, the CLI) reach models through this
registry, by name, never by importing a model package directly. What they need to
know about a model — how each mesh axis shards it, its loss, its pipeline units, its
repeated blocks, its routed experts, the hooks the trainer calls — the model's
family declares in a :class:`ModelFamily`; the infrastructure reads those fields and
never assumes a model's attribute names::

    from hyper_parallel.dmodule.model_spec import ModelFamily, ModelSpec, get_spec, register_spec

    family = ModelFamily(name="tiny", blocks="layers", axis_refusals={"tp": "too small"})
    register_spec(ModelSpec(name="tiny", build_model_fn=MyModel.Config, family=family))
    model = get_spec("tiny").build()
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hyper_parallel.contract.family import SHARDING_AXES as SHARDING_AXES
from hyper_parallel.contract.family import ModelFamily as ModelFamily
from hyper_parallel.contract.family import ShardingFn as ShardingFn
from hyper_parallel.contract.pipeline import PipelineLayoutProtocol

__all__ = [
    "SHARDING_AXES",
    "ModelFamily",
    "ModelSpec",
    "family_of",
    "get_spec",
    "list_specs",
    "register_spec",
]


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
        family: What the infrastructure needs to know about the model
            (:class:`ModelFamily`); default: a family declaring nothing.
        extras: Free-form facts for the user; nothing in the package reads them.
    """

    name: str
    build_model_fn: Callable[..., Any] | None = None
    model: Any = None
    description: str = ""
    family: ModelFamily = field(default_factory=ModelFamily)
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelSpec.name must be a non-empty string, got {self.name!r}.")
        if (self.build_model_fn is None) == (self.model is None):
            raise ValueError(
                f"ModelSpec {self.name!r}: give exactly one of build_model_fn and model "
                f"(got {'both' if self.model is not None else 'neither'})."
            )
        if not isinstance(self.family, ModelFamily):
            raise TypeError(
                f"ModelSpec {self.name!r}: family must be a ModelFamily, got "
                f"{type(self.family).__name__}."
            )

    def sharding(self, axis: str, *, sequence_parallel: bool = False) -> ShardingFn:
        """The family's sharding function of ``axis`` (``tp_sp`` for tp with ``sequence_parallel``).

        Raises:
            ValueError: The family has none; the message names the model, the axis and
                the family's reason.
        """
        fn = self.family.sharding(axis, sequence_parallel=sequence_parallel)
        if fn is None:
            key = "tp_sp" if axis == "tp" and sequence_parallel else axis
            reason = self.family.axis_refusals.get(key, "its family declares no sharding for it")
            has = ", ".join(self.family.shardings()) or "none"
            raise ValueError(
                f"model {self.name!r} does not support {key} ({reason}; its shardings: "
                f"{has}); leave {axis} out of the mesh"
                + (", or drop sequence parallel" if key == "tp_sp" else "")
                + "."
            )
        return fn

    def pipeline(self) -> PipelineLayoutProtocol:
        """The family's pipeline description.

        Raises:
            ValueError: The family declares none (the message names the model).
        """
        if self.family.pipeline is None:
            raise ValueError(
                f"model {self.name!r} declares no pipeline stages (ModelFamily.pipeline); "
                "leave pp out of the mesh, or declare the family's PipelineLayout."
            )
        return self.family.pipeline

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
_BUILTIN_PACKAGES = (
    "hyper_parallel.models.llama",
    "hyper_parallel.models.qwen3",
    "hyper_parallel.models.qwen3_moe",
)


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
    _CONFIG_TYPES.pop(spec.name, None)
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


def family_of(model_or_config: Any) -> ModelFamily | None:
    """The family of the registered model whose config class ``model_or_config`` has.

    Args:
        model_or_config: A model config, or a model built from one (a pipeline stage
            is not a registered model: pass the whole model's config).

    Returns:
        The :class:`ModelFamily` of the first registered spec whose config is of the
        same class, or ``None`` when no registered model has that class.

    Example::

        from hyper_parallel.dmodule.model_spec import family_of, get_spec

        assert family_of(get_spec("llama3-debug").config()).name == "llama3"
    """
    if isinstance(model_or_config, nn.Module):
        config_type = getattr(type(model_or_config), "Config", None)
    else:
        config_type = type(model_or_config)
    if config_type is None:
        return None
    for name in list_specs():
        spec = _REGISTRY[name]
        if name not in _CONFIG_TYPES:
            try:
                value = spec.config() if spec.build_model_fn is not None else spec.model
            except ValueError:  # a spec sized by a file it was not given (llama3-hf)
                _CONFIG_TYPES[name] = None
                continue
            _CONFIG_TYPES[name] = (
                getattr(type(value), "Config", None)
                if isinstance(value, nn.Module)
                else type(value)
            )
        if _CONFIG_TYPES[name] is config_type:
            return spec.family
    return None


_CONFIG_TYPES: dict[str, type | None] = {}
