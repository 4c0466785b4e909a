"""The Llama family's Hugging Face adapter: ``LlamaForCausalLM`` (Llama 2/3, Llama-3.x
``rope_type: "llama3"``) and ``MistralForCausalLM`` without a sliding window (the same
model), and the ``llama3-hf`` spec's factory."""

from __future__ import annotations

from typing import Any

from hyper_parallel.checkpoint_hf.config import ConfigReader
from hyper_parallel.models.common.hf import DecoderHF, hf_sized
from hyper_parallel.models.llama.config import PRESETS, llama3_config
from hyper_parallel.models.llama.model import Transformer
from hyper_parallel.models.llama.rope import Llama3RotaryEmbedding

__all__ = ["HF", "LlamaHF", "llama_hf_config"]


class LlamaHF(DecoderHF):
    """Llama / Mistral ``config.json`` and tensor names; rope scaling ``llama3``."""

    architectures = ("LlamaForCausalLM", "MistralForCausalLM")
    model_types = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
    spec = "llama3-hf"
    config_type = Transformer.Config

    def read_own(self, reader: ConfigReader, overrides: dict[str, Any], rope: tuple) -> None:
        if (
            reader.raw.get("model_type") == "mistral"
            and reader.raw.get("sliding_window") is not None
        ):
            reader.problem(
                "sliding_window", reader.raw["sliding_window"], "null: every layer attends causally"
            )
        dim, heads, head_dim = overrides["dim"], overrides["num_heads"], reader.get("head_dim")
        if head_dim is not None and dim and heads and head_dim != dim // heads:
            reader.problem(
                "head_dim", head_dim, f"hidden_size / num_attention_heads = {dim // heads}"
            )
        overrides["ffn_dim"] = reader.get("intermediate_size")
        # Splits the matmuls into slices for bitwise reproduction of Meta's runs; the
        # same maths.
        reader.get("pretraining_tp")
        if rope[1] is not None:
            overrides["rope_scaling"] = rope[1]

    def write_own(self, config: Any) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "mlp_bias": False,
            "intermediate_size": config.layers[0].feed_forward.w1.out_features,
        }

    def write_rope(self, config: Any) -> dict[str, Any]:
        rope = config.rope
        if not isinstance(rope, Llama3RotaryEmbedding.Config):
            return super().write_rope(config)
        return {
            "rope_theta": float(rope.theta),
            "rope_type": "llama3",
            "factor": rope.factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }


HF = LlamaHF()
"""The Llama family's adapter (``ModelFamily.hf``)."""

llama_hf_config = hf_sized("llama3-hf", llama3_config, PRESETS["llama3-debug"])
"""``llama3_config(**kwargs)`` (the rest: ``llama3-debug``'s), ``rope_scaling`` included;
refused without any sizes."""
