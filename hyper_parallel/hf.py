"""Hugging Face models from small configs, and their tensor-parallel plans.

Nothing is downloaded: each family's config is constructed in code with tiny sizes
(randomly initialized weights), for tests, validation and dry runs. ``transformers``
is imported only when a model is built (``pip install hyper-parallel[test]``)::

    from hyper_parallel.hf import build_hf_model, hf_tp_plan
    from hyper_parallel.dmodule import parallelize_module

    model = build_hf_model("llama", num_hidden_layers=4)
    # parallelize_module(model, mesh, hf_tp_plan("llama"))
    # or the same plan from a file:
    # parallelize_module(model, mesh, "examples/plans/hf_llama_tp.yaml")

The plans follow Megatron's layout: q/k/v and gate/up column-wise, o/down row-wise,
the embedding vocab-parallel. Attention code reshapes with ``-1`` head counts and
mixes activations with plain rotary tables, so q/k/v hand their *local* head shards
on (``use_local_output``) and o/down hand a plain replicated residual stream back.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hyper_parallel.core.dtensor.placement_types import Replicate
from hyper_parallel.dmodule.findings import Finding
from hyper_parallel.dmodule.presets import colwise, rowwise, vocab_parallel_embedding
from hyper_parallel.dmodule.sharding import ShardingConfig
from hyper_parallel.dmodule.types import MeshAxisName

__all__ = [
    "HF_FAMILIES",
    "HF_MOE_FAMILIES",
    "build_hf_model",
    "check_hf_heads",
    "hf_config",
    "hf_ep_plan",
    "hf_family",
    "hf_tp_plan",
]

# family → (config class, model class, small config). Every tensor-parallel dim (heads,
# kv heads, hidden, intermediate, vocab) divides by 4, so tp=2 and tp=4 keep whole heads.
_DECODER = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
_FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**_DECODER, "tie_word_embeddings": False}),
    # Qwen2: biased q/k/v, tied embedding and lm_head (as its small checkpoints are).
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**_DECODER, "tie_word_embeddings": True}),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        {**_DECODER, "sliding_window": None, "tie_word_embeddings": False},
    ),
    # Mixtures of experts: 8 experts, top-2, every layer sparse.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **_DECODER,
            "head_dim": 8,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "tie_word_embeddings": False,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            **_DECODER,
            "intermediate_size": 32,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
        },
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {
            "vocab_size": 128,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 128,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}

HF_FAMILIES: tuple[str, ...] = tuple(_FAMILIES)
"""Families :func:`build_hf_model` knows: ``llama``, ``qwen2``, ``mistral``, ``qwen3_moe``,
``mixtral``, ``gpt2``."""
HF_MOE_FAMILIES: tuple[str, ...] = ("qwen3_moe", "mixtral")
"""Families whose feed-forward is routed experts (plans: :func:`hf_ep_plan`)."""


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError(
            "hyper_parallel.hf needs Hugging Face transformers, which is not installed "
            f"({e}); install the test extra: pip install 'hyper-parallel[test]'."
        ) from None


def _config_file(source: str) -> str | None:
    """The ``config.json`` that ``source`` names (the file, or a directory holding one,
    as ``save_pretrained`` writes it), or ``None`` when ``source`` is a family name."""
    if source in _FAMILIES:
        return None
    if os.path.isdir(source):
        path = os.path.join(source, "config.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"{source!r} is a directory without a config.json; give a family "
                f"({', '.join(HF_FAMILIES)}), a Hugging Face config.json, or the checkpoint "
                "directory save_pretrained wrote."
            )
        return path
    if os.path.isfile(source):
        return source
    return None


def _config_fields(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path!r} is no readable Hugging Face config.json: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path!r} is no Hugging Face config.json (not a JSON object).")
    return fields


def hf_family(source: str) -> str:
    """The family of ``source``: a family name itself, or a ``config.json``'s ``model_type``.

    Args:
        source: One of :data:`HF_FAMILIES`, the path of a Hugging Face ``config.json``, or
            a checkpoint directory holding one.

    Raises:
        ValueError: For an unknown family, or a config whose ``model_type`` is none of them.

    Example::

        hf_family("ckpt/")  # "llama" for a LlamaForCausalLM checkpoint
    """
    path = _config_file(source)
    if path is None:
        _family(source)
        return source
    model_type = _config_fields(path).get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(
            f"{path!r}: model_type {model_type!r} is none of the Hugging Face families "
            f"hyper_parallel builds ({', '.join(HF_FAMILIES)})."
        )
    return str(model_type)


def _family(family: str) -> tuple[str, str, dict[str, Any]]:
    if family not in _FAMILIES:
        raise ValueError(
            f"unknown Hugging Face model family {family!r}; known families: "
            f"{', '.join(HF_FAMILIES)} (or give the path of a config.json or of the "
            "checkpoint directory holding one)."
        )
    return _FAMILIES[family]


def hf_config(family: str, *, attn_implementation: str = "eager", **overrides: Any) -> Any:
    """The small ``transformers`` config of a family, with ``overrides`` applied.

    Args:
        family: One of :data:`HF_FAMILIES`; or the path of a ``config.json`` (or of the
            checkpoint directory holding one) of such a family: its own fields then, on
            the config class's defaults (not the small sizes).
        attn_implementation: ``"eager"`` or ``"sdpa"``.
        **overrides: Config fields, e.g. ``num_hidden_layers=4``.

    Returns:
        A ``transformers.PretrainedConfig`` (``LlamaConfig`` for ``"llama"``).

    Raises:
        ValueError: For an unknown family.
        ImportError: When ``transformers`` is not installed.

    Example::

        cfg = hf_config("llama", num_hidden_layers=1)
    """
    config_cls, _, defaults = _family(hf_family(family))
    cls = getattr(_transformers(), config_cls)
    path = _config_file(family)
    if path is not None:
        fields = {**_config_fields(path), **overrides}
        return cls.from_dict(fields, attn_implementation=attn_implementation)
    return cls(**{**defaults, **overrides}, attn_implementation=attn_implementation)


def build_hf_model(
    family: str,
    *,
    device: str | torch.device | None = None,
    seed: int | None = 0,
    attn_implementation: str = "eager",
    **overrides: Any,
) -> nn.Module:
    """A tiny, randomly initialized Hugging Face causal LM built from a small config.

    Args:
        family: One of :data:`HF_FAMILIES` (``"llama"``, ``"qwen2"``, ``"mistral"``,
            ``"gpt2"``, ``"qwen3_moe"``, ``"mixtral"``); or the path of such a model's
            ``config.json`` (or of the checkpoint directory holding one): that config,
            its weights still random (nothing is loaded).
        device: Where to build it; ``"meta"`` allocates nothing (for validation and
            dry runs at any size). Default: the current default device.
        seed: Seeds the initialization, so every rank builds the same weights;
            ``None`` draws from (and advances) the global generator. The global RNG
            state is left untouched otherwise.
        attn_implementation: ``"eager"`` or ``"sdpa"``.
        **overrides: Config fields (``hidden_size=4096``, ``num_hidden_layers=32``).

    Returns:
        The model (``LlamaForCausalLM`` for ``"llama"``), in training mode.

    Raises:
        ValueError: For an unknown family.
        ImportError: When ``transformers`` is not installed.

    Example::

        model = build_hf_model("llama", device="meta", hidden_size=4096)
    """
    _, model_cls, _ = _family(hf_family(family))
    config = hf_config(family, attn_implementation=attn_implementation, **overrides)
    cls = getattr(_transformers(), model_cls)
    if seed is None:
        return _build(cls, config, device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _build(cls, config, device)


def _build(cls: Callable[[Any], nn.Module], config: Any, device: Any) -> nn.Module:
    if device is None:
        return cls(config)
    with torch.device(device):
        return cls(config)


def hf_tp_plan(family: str, *, axis: str = MeshAxisName.TP.value) -> dict[str, ShardingConfig]:
    """The tensor-parallel plan of a Llama-style family (the shipped plan files' content).

    Args:
        family: ``"llama"``, ``"qwen2"`` or ``"mistral"`` (or such a model's config.json, as
            for :func:`hf_config`).
        axis: Mesh axis to shard over.

    Returns:
        Module path pattern → config, for :func:`~hyper_parallel.dmodule.parallelize_module`.

    Raises:
        ValueError: For ``"gpt2"``: its fused q|k|v ``c_attn`` cannot be sharded
            column-wise (see the plan check's message), or an unknown family.

    Example::

        plan = hf_tp_plan("qwen2")
    """
    family = hf_family(family)
    if family in HF_MOE_FAMILIES:
        raise ValueError(
            f"hf_tp_plan({family!r}): a mixture of experts has no gate/up/down MLP to shard "
            f"column- and row-wise; split its experts with hf_ep_plan({family!r}) on a mesh "
            "axis named 'ep'."
        )
    if family == "gpt2":
        raise ValueError(
            "hf_tp_plan('gpt2'): GPT-2 fuses q|k|v into one Conv1D (c_attn), whose contiguous "
            "column shards do not hold whole heads; un-fuse it, or shard only the MLP "
            "(c_fc: colwise(transposed_weight=True, input_name='x'), c_proj: "
            "rowwise(transposed_weight=True, input_name='x'))."
        )
    qkv_bias = family == "qwen2"
    layer = "model.layers.*"
    return {
        "model.embed_tokens": vocab_parallel_embedding(axis=axis, use_local_output=True),
        # Local head shards: attention views them as (..., -1, head_dim).
        f"{layer}.self_attn.q_proj": colwise(axis=axis, bias=qkv_bias, use_local_output=True),
        f"{layer}.self_attn.k_proj": colwise(axis=axis, bias=qkv_bias, use_local_output=True),
        f"{layer}.self_attn.v_proj": colwise(axis=axis, bias=qkv_bias, use_local_output=True),
        # Reads the local attention output as Shard(-1); all-reduces into the residual.
        f"{layer}.self_attn.o_proj": rowwise(axis=axis, use_local_output=True),
        # The MLP stays in DTensor: act(gate) * up works on column shards as they are.
        f"{layer}.mlp.gate_proj": colwise(axis=axis, bias=False),
        f"{layer}.mlp.up_proj": colwise(axis=axis, bias=False),
        f"{layer}.mlp.down_proj": rowwise(axis=axis, use_local_output=True),
        # Gathered logits: callers (and HF's loss) get a plain (batch, seq, vocab) tensor.
        "lm_head": colwise(axis=axis, bias=False, output=Replicate(), use_local_output=True),
    }


def hf_ep_plan(family: str, *, axis: str = MeshAxisName.EP.value) -> dict[str, ShardingConfig]:
    """The expert-parallel plan of a Hugging Face mixture of experts (the plan files' content).

    Each layer's experts module (``gate_up_proj`` and ``down_proj`` stacked
    ``[num_experts, ...]``, ``forward(hidden_states, top_k_index, top_k_weights)``) is
    split by whole experts over ``axis``, its tokens dispatched to the rank holding
    their expert (:mod:`hyper_parallel.distributed.expert_parallel`); everything else
    stays plain (data-parallel over ``axis``).

    Args:
        family: ``"qwen3_moe"`` or ``"mixtral"`` (or such a model's config.json, as for
            :func:`hf_config`).
        axis: Mesh axis the experts are split over.

    Returns:
        Module path pattern → config, for :func:`~hyper_parallel.dmodule.parallelize_module`.

    Raises:
        ValueError: For a family without routed experts.

    Example::

        plan = hf_ep_plan("qwen3_moe")
    """
    family = hf_family(family)
    if family not in HF_MOE_FAMILIES:
        raise ValueError(
            f"hf_ep_plan({family!r}): {family} has no routed experts; expert-parallel plans "
            f"exist for {', '.join(HF_MOE_FAMILIES)} (use hf_tp_plan for dense models)."
        )
    # Imported here: distributed/ builds on dmodule, and hf is imported without it.
    from hyper_parallel.distributed.expert_parallel import expert_parallel

    return {"model.layers.*.mlp.experts": expert_parallel(("gate_up_proj", "down_proj"), axis=axis)}


def check_hf_heads(
    model: nn.Module, tp: int, *, axis: str = MeshAxisName.TP.value
) -> list[Finding]:
    """Problems splitting a Hugging Face model's attention heads ``tp`` ways.

    The shipped plans hand q/k/v on as local tensors that attention views as
    ``(..., -1, head_dim)``, so each rank must hold whole query *and* key/value heads.
    Plan checks see single layers and cannot know the head size; this reads the
    model's config.

    Args:
        model: A Hugging Face model (anything with a ``config``).
        tp: Size of the mesh axis the heads are split over.
        axis: That axis's name, for the message.

    Returns:
        One error :class:`~hyper_parallel.dmodule.Finding` per head count not divisible
        by ``tp``; empty when the heads split evenly (or the model has no such config).

    Example::

        check_hf_heads(build_hf_model("llama", device="meta"), tp=8)  # 4 kv heads: error
    """
    config = getattr(model, "config", None)
    num_heads = getattr(config, "num_attention_heads", None)
    if not isinstance(num_heads, int):
        return []
    counts = {"num_attention_heads": num_heads}
    num_kv_heads = getattr(config, "num_key_value_heads", None)
    if isinstance(num_kv_heads, int):
        counts["num_key_value_heads"] = num_kv_heads
    findings = []
    for field, count in counts.items():
        if count % tp:
            findings.append(
                Finding(
                    "error",
                    "",
                    f"config.{field}",
                    f"{type(model).__name__} has {field}={count}, not divisible by the "
                    f"{axis!r} axis size {tp}: column shards of q/k/v would split a head "
                    "across ranks.",
                    f"make the {axis!r} axis size divide {' and '.join(counts)}.",
                )
            )
    return findings
