"""Model specs for configs read from Hugging Face: ``llama3-hf``, ``qwen3-hf``, ``qwen3-moe-hf``.

Each is its family's factory (``llama3_config``, ``qwen3_config``, ``qwen3_moe_config``) taking the
keyword arguments :func:`~hyper_parallel.checkpoint_hf.config.read_hf_config` writes,
with its presets' :class:`~hyper_parallel.dmodule.model_spec.ModelFamily` (sharding,
loss, pipeline), whose ``hf`` slot holds the family's Hugging Face description
(:data:`~hyper_parallel.checkpoint_hf.mapping.HF_FAMILIES`). So a
checkpoint's model runs wherever a preset does: ``TrainConfig(model="llama3-hf",
model_overrides=cfg.model_overrides)``, ``plan``, ``validate``, the dry run.
``llama3-hf`` also takes ``rope_scaling`` (Llama 3.x frequency scaling, see
:mod:`hyper_parallel.models.llama.rope`). Sizes a config does not give are its family's
debug preset's; given no sizes at all, each refuses (name the config.json).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hyper_parallel.checkpoint_hf.mapping import HF_FAMILIES
from hyper_parallel.dmodule.model_spec import ModelSpec, get_spec, list_specs, register_spec

__all__ = ["llama_hf_config", "qwen3_hf_config", "qwen3_moe_hf_config", "register_specs"]


def _sized(name: str, kwargs: dict[str, Any]) -> None:
    """Refuse a ``*-hf`` spec given no sizes: it has no shape of its own."""
    if not kwargs:
        raise ValueError(
            f"{name} takes its sizes from a Hugging Face config.json, and none was given: "
            "pass --hf-config PATH (or --hf-checkpoint DIR to load its weights too), or name "
            "a preset (see 'hyper-parallel models')."
        )


def llama_hf_config(**kwargs: Any) -> Any:
    """``llama3_config(**kwargs)`` (the rest: ``llama3-debug``'s), ``rope_scaling`` included.

    Raises:
        ValueError: No ``kwargs`` (no config.json's sizes).
    """
    from hyper_parallel.models.llama.config import PRESETS, llama3_config

    _sized("llama3-hf", kwargs)
    return llama3_config(**{**PRESETS["llama3-debug"], **kwargs})


def qwen3_hf_config(**kwargs: Any) -> Any:
    """``qwen3_config(**kwargs)`` (the rest: ``qwen3-debug``'s); refused without any."""
    from hyper_parallel.models.qwen3.config import PRESETS, qwen3_config

    _sized("qwen3-hf", kwargs)
    return qwen3_config(**{**PRESETS["qwen3-debug"], **kwargs})


def qwen3_moe_hf_config(**kwargs: Any) -> Any:
    """``qwen3_moe_config(**kwargs)`` (the rest: ``qwen3-moe-debug``'s); refused without any."""
    from hyper_parallel.models.qwen3_moe.config import PRESETS, qwen3_moe_config

    _sized("qwen3-moe-hf", kwargs)
    return qwen3_moe_config(**{**PRESETS["qwen3-moe-debug"], **kwargs})


def register_specs() -> None:
    """Register ``llama3-hf``, ``qwen3-hf`` and ``qwen3-moe-hf`` (once; later calls do nothing)."""
    known = set(list_specs())
    for name, base, factory, family in (
        ("llama3-hf", "llama3-debug", llama_hf_config, "llama"),
        ("qwen3-hf", "qwen3-debug", qwen3_hf_config, "qwen3"),
        ("qwen3-moe-hf", "qwen3-moe-debug", qwen3_moe_hf_config, "qwen3_moe"),
    ):
        if name in known:
            continue
        base_family = get_spec(base).family
        register_spec(
            ModelSpec(
                name=name,
                build_model_fn=factory,
                description=f"{family} family from a Hugging Face config.json (its sizes)",
                family=dataclasses.replace(base_family, hf=HF_FAMILIES[family]),
            )
        )
