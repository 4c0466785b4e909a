"""A registry of named models (``ModelSpec``) and the typed contract of a family (``ModelFamily``).

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from hyper_parallel.distributed.pipeline import PipelineLayout

__all__ = [
    "SHARDING_AXES",
    "ModelFamily",
    "ModelSpec",
    "family_of",
    "get_spec",
    "list_specs",
    "register_spec",
]

ShardingFn = Callable[..., Any]
"""``(config, *, <axis>_size=...) -> config``: the model config with one axis' sharding."""

SHARDING_AXES = ("tp", "tp_sp", "cp", "ep")
"""The sharding functions a family declares: tensor parallel, tensor + sequence
parallel, context parallel, expert parallel (field names of :class:`ModelFamily`)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelFamily:
    """What the infrastructure needs to know about a model family (shared by its presets).

    Every field is optional: a family that leaves one out does not support what it
    serves, and the tool that needs it refuses with a message naming the model and
    the field (for an axis, with the family's reason from ``axis_refusals``).

    Attributes:
        name: The family, e.g. ``"llama3"``.
        tp: Tensor-parallel sharding function (:data:`ShardingFn`, takes ``tp_size=``).
        tp_sp: Tensor + sequence-parallel sharding function (takes ``tp_size=``).
        cp: Context-parallel sharding function (takes ``cp_size=``).
        ep: Expert-parallel sharding function (takes ``ep_size=``).
        axis_refusals: Why the family has no sharding function for an axis of
            :data:`SHARDING_AXES` (``{"ep": "a dense model has no routed experts"}``).
        loss_fn: ``(logits, targets) -> loss``, the training loss.
        num_params: ``config -> int``: parameters of a config (no model built).
        num_expert_params: ``config -> int``: parameters of the routed experts.
        vocab_size: ``config -> int``: the token vocabulary the model embeds.
        blocks: The attribute holding the repeated blocks, on the model, its config
            and its pipeline stages (a ``ModuleList``, a ``ModuleDict`` on a stage): the
            units of FSDP2, ``torch.compile`` and activation checkpointing.
        pipeline: How the model is cut into pipeline stages
            (:class:`~hyper_parallel.distributed.pipeline.PipelineLayout`).
        expert_paths: Module path patterns of the routed experts (``*`` matches one
            path segment), e.g. ``("layers.*.moe.experts",)``.
        attention_heads: ``config -> [(path, num_heads, num_kv_heads)]``: each
            attention of the model (the context-parallel checks of head counts).
        set_positions: ``(stage, positions) -> None``: hands a pipeline stage this
            rank's token positions under context parallelism (a stage receives only
            the previous stage's output).
        compile_experts: ``(experts, backend) -> None``: compiles the routed experts'
            own maths (the rest of a block holding them is compiled around them).
        hf: The family's Hugging Face mapping (names and config conversion), when it
            has one.

    Example::

        from hyper_parallel.dmodule import ModelFamily

        family = ModelFamily(name="mlp", axis_refusals={"cp": "it has no sequence"})
        family.sharding("cp")  # None: no cp sharding
    """

    name: str = ""
    tp: ShardingFn | None = None
    tp_sp: ShardingFn | None = None
    cp: ShardingFn | None = None
    ep: ShardingFn | None = None
    axis_refusals: Mapping[str, str] = field(default_factory=dict)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    num_params: Callable[[Any], int] | None = None
    num_expert_params: Callable[[Any], int] | None = None
    vocab_size: Callable[[Any], int] | None = None
    blocks: str | None = None
    pipeline: PipelineLayout | None = None
    expert_paths: tuple[str, ...] = ()
    attention_heads: Callable[[Any], list[tuple[str, int, int]]] | None = None
    set_positions: Callable[[nn.Module, torch.Tensor | None], None] | None = None
    compile_experts: Callable[[nn.Module, str], None] | None = None
    hf: Any | None = None

    def __post_init__(self) -> None:
        for axis in SHARDING_AXES:
            fn = getattr(self, axis)
            if fn is not None and not callable(fn):
                raise TypeError(
                    f"ModelFamily {self.name!r}: {axis} must be a sharding function "
                    f"(config -> config), got {type(fn).__name__}."
                )
        unknown = sorted(set(self.axis_refusals) - set(SHARDING_AXES))
        if unknown:
            raise ValueError(
                f"ModelFamily {self.name!r}: axis_refusals names {unknown}, which are not "
                f"sharding axes; use {list(SHARDING_AXES)}."
            )
        both = sorted(a for a in self.axis_refusals if getattr(self, a) is not None)
        if both:
            raise ValueError(
                f"ModelFamily {self.name!r}: {both} have a sharding function and a refusal; "
                "keep one."
            )
        if isinstance(self.expert_paths, str):
            raise TypeError(
                f"ModelFamily {self.name!r}: expert_paths must be a tuple of patterns, got "
                f"the string {self.expert_paths!r}; write ({self.expert_paths!r},)."
            )

    def sharding(self, axis: str, *, sequence_parallel: bool = False) -> ShardingFn | None:
        """The sharding function of mesh axis ``axis`` (``tp_sp`` for tp with sequence
        parallel), or ``None`` when the family has none."""
        key = "tp_sp" if axis == "tp" and sequence_parallel else axis
        if key not in SHARDING_AXES:
            raise ValueError(
                f"ModelFamily.sharding: {axis!r} is not a model axis; use one of "
                f"{[a for a in SHARDING_AXES if a != 'tp_sp']}."
            )
        return getattr(self, key)

    def shardings(self) -> tuple[str, ...]:
        """The sharding functions the family declares, by name (``("tp", "tp_sp")``)."""
        return tuple(a for a in SHARDING_AXES if getattr(self, a) is not None)

    def blocks_of(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(path, block)`` of each repeated block of ``model`` (a model or a stage).

        Raises:
            ValueError: The family declares no ``blocks``, or ``model`` has no such
                ``ModuleList`` / ``ModuleDict``.
        """
        container = getattr(model, self.blocks, None) if self.blocks else None
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"model family {self.name!r}: {type(model).__name__} has no blocks "
                f"(ModelFamily.blocks={self.blocks!r} is not a ModuleList or ModuleDict of "
                "it); declare the attribute that holds the repeated blocks."
            )
        items = container.items() if isinstance(container, nn.ModuleDict) else enumerate(container)
        return [(f"{self.blocks}.{key}", block) for key, block in items]

    def expert_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(path, module)`` of each routed-experts module of ``model`` (``expert_paths``)."""
        if not self.expert_paths:
            return []
        patterns = [p.split(".") for p in self.expert_paths]
        return [
            (path, m)
            for path, m in model.named_modules()
            if any(_matches(path.split("."), p) for p in patterns)
        ]


def _matches(parts: list[str], pattern: list[str]) -> bool:
    return len(parts) == len(pattern) and all(p in ("*", s) for s, p in zip(parts, pattern))


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

    def pipeline(self) -> PipelineLayout:
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
