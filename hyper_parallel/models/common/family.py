"""A decoder family's typed contract and registration, with the shared parts filled in."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from hyper_parallel.contract import ModelFamily
from hyper_parallel.dmodule.model_spec import ModelSpec, register_spec
from hyper_parallel.models.common.decoder import TransformerStage, decoder_pipeline
from hyper_parallel.models.common.loss import cross_entropy_loss
from hyper_parallel.models.common.sharding import attention_heads

__all__ = ["decoder_family", "dense_family", "register_hf_spec", "register_presets"]


def _vocab_size(config: Any) -> int:
    return config.tok_embeddings.num_embeddings


def _positions(config: Any) -> int:
    """The positions the rotary tables cover (a config or a model built from one)."""
    return config.rope.max_seq_len


def decoder_family(name: str, **fields: Any) -> ModelFamily:
    """The :class:`~hyper_parallel.dmodule.ModelFamily` of a
    :class:`~hyper_parallel.models.common.Decoder` family.

    The shared decoder's answers are filled in — the loss
    (:func:`~hyper_parallel.models.common.cross_entropy_loss`), the vocabulary, the
    blocks (``layers``), the attention heads, the positions (the rope's), the stages' positions hook — and
    ``fields`` (the family's sharding functions, counts, pipeline, experts) are added.
    """
    shared: dict[str, Any] = {
        "loss_fn": cross_entropy_loss,
        "vocab_size": _vocab_size,
        "blocks": "layers",
        "attention_heads": attention_heads,
        "positions": _positions,
        "set_positions": TransformerStage.set_positions,
    }
    return ModelFamily(name=name, **{**shared, **fields})


def dense_family(
    name: str,
    shardings: tuple[Any, Any, Any],
    num_params: Any,
    *,
    why_no_ep: str,
    hf: Any = None,
) -> ModelFamily:
    """:func:`decoder_family` of a dense decoder: ``shardings`` are its ``(tp, tp_sp, cp)``
    functions, its stages the shared ones (:func:`decoder_pipeline`), and ``ep`` refused
    with ``why_no_ep``; ``hf`` its Hugging Face adapter."""
    tp, tp_sp, cp = shardings
    return decoder_family(
        name,
        tp=tp,
        tp_sp=tp_sp,
        cp=cp,
        axis_refusals={"ep": why_no_ep},
        num_params=num_params,
        pipeline=decoder_pipeline(),
        hf=hf,
    )


def register_presets(
    family: ModelFamily,
    presets: Mapping[str, Any],
    preset_config: Callable[..., Any],
    descriptions: Mapping[str, str],
) -> None:
    """Register one :class:`~hyper_parallel.dmodule.ModelSpec` per preset of ``family``."""
    for name in presets:
        register_spec(
            ModelSpec(
                name=name,
                build_model_fn=functools.partial(preset_config, name),
                description=descriptions[name],
                family=family,
            )
        )


def register_hf_spec(family: ModelFamily, factory: Callable[..., Any]) -> None:
    """Register the spec of ``family``'s Hugging Face adapter (``family.hf.spec``):
    ``factory`` takes the keyword arguments the adapter reads from a ``config.json``."""
    if family.hf is None:
        raise ValueError(
            f"register_hf_spec: family {family.name!r} has no Hugging Face adapter "
            "(ModelFamily.hf); declare one first."
        )
    register_spec(
        ModelSpec(
            name=family.hf.spec,
            build_model_fn=factory,
            description=f"{family.name} family from a Hugging Face config.json (its sizes)",
            family=family,
        )
    )
