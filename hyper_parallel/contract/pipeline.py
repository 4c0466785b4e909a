"""The pipeline-layout protocol: how a model family is cut into stages, as the
infrastructure reads it (:class:`PipelineLayoutProtocol`), and the unit it counts
(:class:`PipelineUnit`).

A family declares its layout next to the model; the shared decoder's is
:class:`hyper_parallel.distributed.pipeline.PipelineLayout`, which satisfies this
protocol. The protocol sits on the lowest floor so that ``dmodule`` (the family
contract) and ``distributed`` (the stages) can both name it without importing each
other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import nn

__all__ = ["PipelineLayoutProtocol", "PipelineUnit"]


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineUnit:
    """The smallest piece a stage holds: the embedding, one block, or the head.

    Attributes:
        name: ``"tok_embeddings"``, ``"layers.3"``, ``"norm+output"``.
        modules: Module paths in the model that make up the unit.
        num_params: Parameters of the unit.
        num_flops: Forward FLOPs of the unit for one sequence, when counted; ``None``
            otherwise.
    """

    name: str
    modules: tuple[str, ...]
    num_params: int
    num_flops: int | None = None


@runtime_checkable
class PipelineLayoutProtocol(Protocol):
    """What the stages, the run plan and the dry run read of a family's pipeline cut.

    Attributes:
        first: Config fields of the first unit (on the first stage), e.g. the embedding.
        layers: The config field holding the list of repeated blocks.
        last: Config fields of the last unit (on the last stage).
        shared: Config fields every stage holds.
        stage: The module class that runs a stage.
        activation_layout: ``config -> NamedPlacement`` of the activation passed between
            stages (``{}``: a plain tensor).
        activation_elements: ``(config, unit name) -> (replicated, tp_split)`` per token,
            or ``None``.
        activation_dim: ``config -> int``, the width passed between stages, or ``None``.

    Example::

        from hyper_parallel.contract import PipelineLayoutProtocol
        from hyper_parallel.models.llama import PIPELINE

        assert isinstance(PIPELINE, PipelineLayoutProtocol)
    """

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]
    shared: tuple[str, ...]
    stage: type
    activation_layout: Callable[[Any], dict]
    activation_elements: Callable[[Any, str], tuple[int, int]] | None
    activation_dim: Callable[[Any], int] | None

    @property
    def first_name(self) -> str:
        """The first unit's name."""
        ...

    @property
    def last_name(self) -> str:
        """The last unit's name."""
        ...

    def stage_width(self, config: Any) -> int:
        """The width of the activation passed between stages."""
        ...

    def units(self, config: Any, seq_len: int | None = None) -> list[PipelineUnit]:
        """The model's units in order, with their parameter counts."""
        ...

    def units_of_model(self, model: nn.Module) -> list[PipelineUnit]:
        """The units of an already built model, in order."""
        ...

    def stage_config(self, config: Any, unit_names: Sequence[str]) -> Any:
        """The config of the stage holding ``unit_names``."""
        ...
