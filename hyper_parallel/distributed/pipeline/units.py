"""How a model family is cut into units: :class:`PipelineLayout`, :class:`PipelineUnit`.

A model is a list of *units* — the embedding, each block, the norm + output head —
and a stage is a contiguous run of units; a family declares its cut next to the model.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hyper_parallel.contract.pipeline import PipelineUnit as PipelineUnit

__all__ = ["PipelineLayout", "PipelineUnit", "count_unit_flops"]


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineLayout:
    """How a model family is cut into stages (declared next to the model); the shared
    decoder's :class:`~hyper_parallel.contract.PipelineLayoutProtocol`.

    Attributes:
        first: Config fields of the first unit (on the first stage), e.g. the embedding.
        layers: The config field holding the list of repeated blocks.
        last: Config fields of the last unit (on the last stage), e.g. norm and output.
        shared: Config fields every stage holds (state-free or buffer-only modules).
        stage: The module class that runs a stage. Its ``Config`` has the fields of
            ``first``, ``last`` (``None`` when absent), ``shared`` and ``layers`` (a
            dict from the block's index, as a string, to its config).
        activation_layout: ``config -> NamedPlacement`` of the activation passed
            between stages as the model's sharding declares it (``{}``: a plain tensor).
        activation_elements: ``(config, unit name) -> (replicated, tp_split)``: per
            token, the activation elements the unit keeps for its backward (an
            estimate for the dry run); ``None`` when the model gives none.
        activation_dim: ``config -> int``: the width of the activation passed between
            stages (per token; the residual stream), for its send/receive bytes;
            ``None`` when the model gives none (then its pipeline is not costed).
    """

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]
    shared: tuple[str, ...]
    stage: type
    activation_layout: Callable[[Any], dict]
    activation_elements: Callable[[Any, str], tuple[int, int]] | None = None
    activation_dim: Callable[[Any], int] | None = None

    def stage_width(self, config: Any) -> int:
        """The width of the activation passed between stages (:attr:`activation_dim`).

        Raises:
            ValueError: The model's pipeline declares no ``activation_dim``.
        """
        if self.activation_dim is None:
            raise ValueError(
                f"{self.stage.__name__}'s PipelineLayout declares no activation_dim (the "
                "width of the activation passed between stages); declare it to cost the "
                "model's pipeline."
            )
        return int(self.activation_dim(config))

    @property
    def first_name(self) -> str:
        """The first unit's name."""
        return "+".join(self.first)

    @property
    def last_name(self) -> str:
        """The last unit's name."""
        return "+".join(self.last)

    def units(self, config: Any, seq_len: int | None = None) -> list[PipelineUnit]:
        """The model's units in order, with their parameter counts (built on meta).

        With ``seq_len``, each unit also carries its forward FLOPs for one sequence of
        that length (:func:`count_unit_flops`, on the meta device).
        """
        if seq_len is not None:
            with torch.device("meta"):
                return count_unit_flops(self, config.build(), seq_len)

        def built(configs: list[Any]) -> list[nn.Module]:
            with torch.device("meta"):
                return [c.build() for c in configs]

        return self._units(
            built([getattr(config, f) for f in self.first]),
            [built([b])[0] for b in getattr(config, self.layers)],
            built([getattr(config, f) for f in self.last]),
        )

    def units_of_model(self, model: nn.Module) -> list[PipelineUnit]:
        """The units of an already built model (any device, meta included), in order.

        Example:
            >>> from hyper_parallel.models.llama import PIPELINE, preset_config
            >>> [u.name for u in PIPELINE.units_of_model(preset_config("llama3-debug").build())]
            ['tok_embeddings', 'layers.0', 'layers.1', 'norm+output']
        """
        blocks = getattr(model, self.layers)
        return self._units(
            [getattr(model, f) for f in self.first],
            list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks),
            [getattr(model, f) for f in self.last],
        )

    def _units(
        self, first: list[nn.Module], blocks: list[nn.Module], last: list[nn.Module]
    ) -> list[PipelineUnit]:
        def count(modules: list[nn.Module]) -> int:
            return sum(p.numel() for m in modules for p in m.parameters())

        units = [PipelineUnit(self.first_name, self.first, count(first))]
        for i, block in enumerate(blocks):
            name = f"{self.layers}.{i}"
            units.append(PipelineUnit(name, (name,), count([block])))
        units.append(PipelineUnit(self.last_name, self.last, count(last)))
        return units

    def stage_config(self, config: Any, unit_names: Sequence[str]) -> Any:
        """The config of the stage holding ``unit_names``, sub-configs taken from ``config``.

        The sub-configs keep their sharding configs, so a stage of a tensor-parallel
        config is tensor parallel. The stage's own sharding hands its output on as a
        local tensor (what torch's pipeline stages send) and re-enters its input in
        the model's activation layout.
        """
        from hyper_parallel.dmodule.sharding import ShardingConfig

        names = set(unit_names)
        is_first, is_last = self.first_name in names, self.last_name in names
        fields: dict[str, Any] = {f: getattr(config, f) for f in self.shared}
        blocks = getattr(config, self.layers)
        prefix = f"{self.layers}."
        fields[self.layers] = {
            n[len(prefix) :]: blocks[int(n[len(prefix) :])]
            for n in unit_names
            if n.startswith(prefix)
        }
        for f in self.first:
            fields[f] = getattr(config, f) if is_first else None
        for f in self.last:
            fields[f] = getattr(config, f) if is_last else None
        layout = self.activation_layout(config)
        # Inputs other than the first the model's root adapts (context parallelism's
        # ``positions``) are adapted the same way by every stage's root.
        root = getattr(config, "sharding_config", None)
        taken = list(inspect.signature(self.stage.forward).parameters)[2:]
        extra_src = {
            k: v for k, v in ((root and root.in_src_shardings) or {}).items() if k in taken
        }
        extra_dst = {
            k: v for k, v in ((root and root.in_dst_shardings) or {}).items() if k in taken
        }
        if (layout and not (is_first and is_last)) or extra_src or extra_dst:
            boundary = not (is_first and is_last)
            fields["sharding_config"] = ShardingConfig(
                in_src_shardings={**({"x": layout} if layout and not is_first else {}), **extra_src}
                or None,
                in_dst_shardings=extra_dst or None,
                out_dst_shardings=layout if layout and boundary and not is_last else None,
                use_local_output=boundary and not is_last,
            )
        return self.stage.Config(**fields)


def count_unit_flops(layout: PipelineLayout, model: nn.Module, seq_len: int) -> list[PipelineUnit]:
    """The units of ``model`` with their forward FLOPs for one sequence of ``seq_len`` tokens.

    Counted by ``torch.utils.flop_counter.FlopCounterMode`` over one forward pass of
    token ids ``(1, seq_len)`` — on the meta device when ``model`` lives there, so
    nothing is computed — and summed over each unit's modules. Matmuls count
    ``2 m n k``, attention its two batched matmuls over the full (not causal) score
    matrix; lookups and elementwise ops count nothing, so the embedding weighs 0.
    Backward costs about twice the forward for each matmul, so the forward's
    proportions are the step's.

    Args:
        layout: The model's pipeline description.
        model: A model whose first unit takes token ids.
        seq_len: Tokens per sequence.

    Returns:
        :meth:`PipelineLayout.units_of_model` with ``num_flops`` set.
    """
    from torch.utils.flop_counter import FlopCounterMode

    device = next((p.device for p in model.parameters()), torch.device("meta"))
    tokens = torch.zeros((1, seq_len), dtype=torch.long, device=device)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(tokens)
    # Keys are the module paths under the root's class name ("Transformer.layers.0").
    root = type(model).__name__
    totals = {
        key[len(root) + 1 :]: sum(v.values())
        for key, v in counter.get_flop_counts().items()
        if key.startswith(root + ".")
    }
    return [
        dataclasses.replace(u, num_flops=sum(totals.get(m, 0) for m in u.modules))
        for u in layout.units_of_model(model)
    ]
