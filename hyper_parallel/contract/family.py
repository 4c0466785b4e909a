"""The model contract: what the infrastructure needs to know about a model family.

:class:`ModelFamily` is the one place a family declares how each mesh axis shards it,
its loss, its pipeline cut (:class:`~hyper_parallel.contract.PipelineLayoutProtocol`),
its repeated blocks, its routed experts, its sequence limit and its Hugging Face
adapter (:class:`~hyper_parallel.contract.HFAdapter`). Tools read a model only through
it (never a family's attribute names, never a family's name)::

    from hyper_parallel.contract import ModelFamily

    family = ModelFamily(name="tiny", blocks="layers", axis_refusals={"tp": "too small"})

It sits on the lowest floor of the package: ``dmodule``, ``distributed``,
``checkpoint_hf`` and ``analysis`` all import it, and it imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hyper_parallel.contract.hf import HFAdapter
from hyper_parallel.contract.pipeline import PipelineLayoutProtocol

__all__ = ["SHARDING_AXES", "ModelFamily", "ShardingFn"]

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
            (:class:`~hyper_parallel.contract.PipelineLayoutProtocol`).
        expert_paths: Module path patterns of the routed experts (``*`` matches one
            path segment), e.g. ``("layers.*.moe.experts",)``.
        attention_heads: ``config -> [(path, num_heads, num_kv_heads)]``: each
            attention of the model (the context-parallel checks of head counts).
        set_positions: ``(stage, positions) -> None``: hands a pipeline stage this
            rank's token positions under context parallelism (a stage receives only
            the previous stage's output).
        compile_experts: ``(experts, backend) -> None``: compiles the routed experts'
            own maths (the rest of a block holding them is compiled around them).
        experts: ``config -> int``: the routed experts of each mixture-of-experts
            block (read through :meth:`num_experts`; a dense family leaves it out).
        positions: ``config -> int | None``: the longest sequence the model's position
            encoding covers (read through :meth:`max_seq_len`; ``None``: no limit).
        hf: The family's Hugging Face adapter (:class:`~hyper_parallel.contract.HFAdapter`:
            config conversion, tensor names, reversible transforms), when it has one.

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
    pipeline: PipelineLayoutProtocol | None = None
    expert_paths: tuple[str, ...] = ()
    attention_heads: Callable[[Any], list[tuple[str, int, int]]] | None = None
    set_positions: Callable[[nn.Module, torch.Tensor | None], None] | None = None
    compile_experts: Callable[[nn.Module, str], None] | None = None
    experts: Callable[[Any], int] | None = None
    positions: Callable[[Any], int | None] | None = None
    hf: HFAdapter | None = None

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

    def num_layers(self, config: Any) -> int:
        """The repeated blocks of ``config`` (or of a model built from it).

        Raises:
            ValueError: The family declares neither ``blocks`` nor a ``pipeline``.
        """
        attribute = self.blocks or (self.pipeline.layers if self.pipeline else None)
        if attribute is None:
            raise ValueError(
                f"model family {self.name!r} declares no blocks (ModelFamily.blocks); "
                "declare the attribute that holds the repeated blocks."
            )
        return len(getattr(config, attribute))

    def num_experts(self, config: Any) -> int:
        """The routed experts of each mixture-of-experts block; ``0`` for a dense family."""
        return int(self.experts(config)) if self.experts is not None else 0

    def max_seq_len(self, config: Any) -> int | None:
        """The longest sequence the model's positions cover; ``None`` when unbounded or
        the family does not say."""
        if self.positions is None:
            return None
        limit = self.positions(config)
        return int(limit) if limit is not None else None

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
