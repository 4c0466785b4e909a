"""Hugging Face ``config.json`` to our model config, and back.

:func:`read_hf_config` turns the ``config.json`` of a ``LlamaForCausalLM`` (Llama 2/3,
Llama-3.x ``rope_type: "llama3"``; ``MistralForCausalLM`` without a sliding window is
the same model), a ``Qwen3ForCausalLM`` or a ``Qwen3MoeForCausalLM`` into an
:class:`HFConfig`: the family, the registered spec (``llama3-hf``, ``qwen3-hf``,
``qwen3-moe-hf``) and the keyword arguments of its
factory, which any tool takes as ``--model NAME --model-overrides JSON`` (the trainer's
``TrainConfig(model=..., model_overrides=...)``).

Nothing is silently ignored: every field either maps to our config, is checked to
hold a value our model computes identically (``attention_bias: false``,
``hidden_act: "silu"``, no sliding window, ...), or is metadata that changes no
number (token ids, ``dtype``, ``transformers_version``, ...). Anything else, or a
value we do not implement, is one :class:`HFConfigError` listing each field, its
value and what is supported.

:func:`hf_config_from_model` writes the ``config.json`` of one of our configs (for
``export-hf`` of a model that did not come from Hugging Face).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

__all__ = [
    "ARCHITECTURES",
    "HFConfig",
    "HFConfigError",
    "family_of_model_config",
    "hf_config_from_model",
    "read_hf_config",
]

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
"""``architectures[0]`` of a ``config.json`` -> our family."""

_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

SPEC_NAMES = {"llama": "llama3-hf", "qwen3": "qwen3-hf", "qwen3_moe": "qwen3-moe-hf"}

# Fields that change no number our model computes (metadata, generation defaults,
# outputs transformers may return).
_METADATA = frozenset(
    {
        "_name_or_path",
        "architectures",
        "model_type",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "tokenizer_class",
        "output_router_logits",
        # Splits Llama's matmuls into slices for bitwise reproduction of Meta's runs;
        # the same maths.
        "pretraining_tp",
        # Read only for sliding-window layers, which are refused.
        "max_window_layers",
    }
)

_SUPPORTED_ROPE = "rope_type 'default' or 'llama3' (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)"


class HFConfigError(ValueError):
    """A ``config.json`` our model cannot reproduce; ``problems`` lists each field."""

    def __init__(self, source: str, problems: list[tuple[str, Any, str]]) -> None:
        self.problems = problems
        lines = "\n".join(
            f"  {field}={json.dumps(value)}: {supported}" for field, value, supported in problems
        )
        super().__init__(
            f"{source}: {len(problems)} field(s) our model does not implement:\n{lines}"
        )


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """A Hugging Face config as one of our models.

    Args:
        family: ``"llama"``, ``"qwen3"`` or ``"qwen3_moe"``.
        spec: Registered spec name whose factory takes ``model_overrides``.
        model_overrides: Keyword arguments of the family's factory (JSON values).
        raw: The ``config.json`` as read.
    """

    family: str
    spec: str
    model_overrides: dict[str, Any]
    raw: dict[str, Any]

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether the checkpoint's output projection is its token embedding."""
        return bool(self.raw.get("tie_word_embeddings", False))

    @property
    def eos_token_ids(self) -> list[int]:
        """The config's end-of-sequence ids (one or several; empty when unset)."""
        eos = self.raw.get("eos_token_id")
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    def model_config(self) -> Any:
        """Our ``Transformer.Config`` (unsharded) for this checkpoint."""
        from hyper_parallel.checkpoint_hf.specs import register_specs
        from hyper_parallel.dmodule.model_spec import get_spec

        register_specs()
        return get_spec(self.spec).config(**self.model_overrides)


def _load(source: str | os.PathLike[str] | dict[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(source, dict):
        return dict(source), "config"
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"read_hf_config: no {path}; a Hugging Face checkpoint directory holds config.json "
            "next to its safetensors files."
        )
    with open(path, encoding="utf-8") as f:
        return json.load(f), path


def _rope(raw: dict[str, Any], problems: list, used: set[str]) -> tuple[float, dict | None]:
    """``(rope_theta, llama3 scaling or None)`` from ``rope_parameters`` or the older fields."""
    used.update({"rope_parameters", "rope_scaling", "rope_theta"})
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        if "rope_theta" in raw:
            params.setdefault("rope_theta", raw["rope_theta"])
    params = dict(params)
    theta = float(params.pop("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        if params:
            problems.append(("rope_parameters", params, _SUPPORTED_ROPE))
        return theta, None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in params]
        extra = sorted(set(params) - set(keys))
        if missing or extra:
            problems.append(
                ("rope_parameters", {"rope_type": rope_type, **params}, _SUPPORTED_ROPE)
            )
            return theta, None
        scaling = {k: params[k] for k in keys}
        scaling["original_max_position_embeddings"] = int(
            scaling["original_max_position_embeddings"]
        )
        return theta, scaling
    problems.append(("rope_parameters.rope_type", rope_type, _SUPPORTED_ROPE))
    return theta, None


def _expect(
    raw: dict[str, Any],
    used: set[str],
    problems: list,
    field: str,
    allowed: tuple[Any, ...],
    supported: str,
) -> None:
    used.add(field)
    if field in raw and raw[field] not in allowed:
        problems.append((field, raw[field], supported))


def _required(raw: dict[str, Any], used: set[str], problems: list, *fields: str) -> list[Any]:
    values = []
    for field in fields:
        used.add(field)
        if field not in raw or raw[field] is None:
            problems.append((field, None, "required"))
        values.append(raw.get(field))
    return values


def _common(raw: dict[str, Any], used: set[str], problems: list) -> None:
    _expect(raw, used, problems, "hidden_act", ("silu",), "'silu' (SwiGLU)")
    _expect(raw, used, problems, "attention_bias", (False,), "false: our q/k/v/o have no bias")
    _expect(raw, used, problems, "mlp_bias", (False,), "false: our MLPs have no bias")
    _expect(raw, used, problems, "attention_dropout", (0, 0.0), "0.0: our attention has no dropout")
    _expect(raw, used, problems, "tie_word_embeddings", (True, False), "true or false")
    _expect(
        raw, used, problems, "use_sliding_window", (False,), "false: every layer attends causally"
    )
    if raw.get("use_sliding_window") is not True:
        used.add("sliding_window")  # read by transformers only with use_sliding_window
        if raw.get("model_type") == "mistral" and raw.get("sliding_window") is not None:
            problems.append(
                ("sliding_window", raw["sliding_window"], "null: every layer attends causally")
            )
    else:
        used.add("sliding_window")
    used.add("layer_types")
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        problems.append(("layer_types", sorted(set(layer_types)), "only 'full_attention' layers"))


def read_hf_config(source: str | os.PathLike[str] | dict[str, Any]) -> HFConfig:
    """Our model config of a Hugging Face ``config.json`` (a path, its directory, or a dict).

    Raises:
        FileNotFoundError: No ``config.json`` there.
        HFConfigError: An architecture we do not have, or fields we do not implement
            (each listed with its value and what is supported).

    Example::

        cfg = read_hf_config("path/to/checkpoint")
        model = cfg.model_config().build()
    """
    raw, where = _load(source)
    archs = raw.get("architectures") or []
    # Configs built in code (not yet saved) name only their model_type.
    arch = archs[0] if archs else _MODEL_TYPES.get(raw.get("model_type", ""))
    family = ARCHITECTURES.get(arch or "")
    if family is None:
        raise HFConfigError(
            where,
            [("architectures", archs, f"one of {sorted(ARCHITECTURES)}")],
        )
    problems: list[tuple[str, Any, str]] = []
    used: set[str] = set()
    _common(raw, used, problems)
    theta, scaling = _rope(raw, problems, used)
    vocab, dim, layers, heads, ffn, eps, max_pos = _required(
        raw,
        used,
        problems,
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "rms_norm_eps",
        "max_position_embeddings",
    )
    used.add("num_key_value_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    used.add("head_dim")
    head_dim = raw.get("head_dim")
    # The fields every family shares; each branch adds its own.
    overrides: dict[str, Any] = dict(
        vocab_size=vocab,
        dim=dim,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        norm_eps=eps,
        rope_theta=theta,
        max_seq_len=max_pos,
    )
    if family == "llama":
        if head_dim is not None and dim and heads and head_dim != dim // heads:
            problems.append(
                ("head_dim", head_dim, f"hidden_size / num_attention_heads = {dim // heads}")
            )
        overrides["ffn_dim"] = ffn
        if scaling is not None:
            overrides["rope_scaling"] = scaling
    elif family == "qwen3":
        if scaling is not None:
            problems.append(("rope_parameters.rope_type", "llama3", "'default' for Qwen3"))
        overrides.update(
            head_dim=head_dim
            if head_dim is not None
            else (dim // heads if dim and heads else None),
            ffn_dim=ffn,
            # Our Qwen3 ties natively (one parameter), as transformers does.
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )
    else:  # qwen3_moe
        if scaling is not None:
            problems.append(("rope_parameters.rope_type", "llama3", "'default' for Qwen3-MoE"))
        (moe_dim, top_k) = _required(
            raw, used, problems, "moe_intermediate_size", "num_experts_per_tok"
        )
        used.update({"num_local_experts", "num_experts"})
        experts = raw.get("num_local_experts", raw.get("num_experts"))
        if experts is None:
            problems.append(("num_local_experts", None, "required"))
        _expect(raw, used, problems, "norm_topk_prob", (True,), "true: top-k weights renormalized")
        _expect(raw, used, problems, "decoder_sparse_step", (1,), "1: every layer sparse")
        _expect(raw, used, problems, "mlp_only_layers", ([],), "[]: every layer sparse")
        used.add("router_aux_loss_coef")
        overrides.update(
            head_dim=head_dim
            if head_dim is not None
            else (dim // heads if dim and heads else None),
            num_experts=experts,
            top_k=top_k,
            moe_hidden_dim=moe_dim,
            aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
        )
    unknown = sorted(set(raw) - used - _METADATA)
    for field in unknown:
        problems.append((field, raw[field], f"not a field of {arch} that we implement"))
    if problems:
        raise HFConfigError(where, problems)
    return HFConfig(family=family, spec=SPEC_NAMES[family], model_overrides=overrides, raw=raw)


def family_of_model_config(config: Any) -> str:
    """``"llama"``, ``"qwen3"`` or ``"qwen3_moe"`` for one of our ``Transformer.Config`` trees.

    Raises:
        ValueError: A config of another model.
    """
    from hyper_parallel.models.llama.model import Transformer as Llama
    from hyper_parallel.models.qwen3.model import Transformer as Qwen3
    from hyper_parallel.models.qwen3_moe.model import Transformer as Qwen3Moe

    for family, cls in (("qwen3_moe", Qwen3Moe), ("qwen3", Qwen3), ("llama", Llama)):
        if isinstance(config, cls.Config):
            return family
    raise ValueError(
        f"no Hugging Face mapping for {type(config).__qualname__}; families with one: "
        "llama, qwen3, qwen3_moe."
    )


def hf_config_from_model(config: Any, **extra: Any) -> dict[str, Any]:
    """The ``config.json`` of our (unsharded) ``Transformer.Config``.

    Args:
        config: A Llama or Qwen3-MoE ``Transformer.Config``.
        **extra: Fields to add or replace (``eos_token_id``, ``tie_word_embeddings``).

    Returns:
        A dict ``transformers`` reads with ``AutoConfig``; :func:`read_hf_config` maps
        it back to the same model.
    """
    from hyper_parallel.checkpoint_hf.rope import Llama3RotaryEmbedding

    family = family_of_model_config(config)
    block = config.layers[0]
    attention = block.attention
    head_dim = attention.head_dim
    rope: dict[str, Any] = {"rope_theta": float(config.rope.theta), "rope_type": "default"}
    if isinstance(config.rope, Llama3RotaryEmbedding.Config):
        rope = {
            "rope_theta": float(config.rope.theta),
            "rope_type": "llama3",
            "factor": config.rope.factor,
            "low_freq_factor": config.rope.low_freq_factor,
            "high_freq_factor": config.rope.high_freq_factor,
            "original_max_position_embeddings": config.rope.original_max_position_embeddings,
        }
    common = {
        "vocab_size": config.tok_embeddings.num_embeddings,
        "hidden_size": config.tok_embeddings.embedding_dim,
        "num_hidden_layers": len(config.layers),
        "num_attention_heads": attention.wq.out_features // head_dim,
        "num_key_value_heads": attention.wk.out_features // head_dim,
        "head_dim": head_dim,
        "rms_norm_eps": config.norm.eps,
        "max_position_embeddings": config.rope.max_seq_len,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    if family == "llama":
        raw = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "mlp_bias": False,
            "intermediate_size": block.feed_forward.w1.out_features,
            **common,
        }
    elif family == "qwen3":
        raw = {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "intermediate_size": block.feed_forward.w1.out_features,
            "use_sliding_window": False,
            **common,
            "tie_word_embeddings": bool(config.tie_embeddings),
        }
    else:
        experts = block.moe.experts
        raw = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "intermediate_size": experts.hidden_dim,
            "moe_intermediate_size": experts.hidden_dim,
            "num_experts": experts.num_experts,
            "num_experts_per_tok": block.moe.router.top_k,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": block.moe.aux_loss_coef,
            "use_sliding_window": False,
            **common,
        }
    raw.update(extra)
    return raw
