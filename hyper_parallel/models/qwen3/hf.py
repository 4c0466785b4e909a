"""The Qwen3 (dense) family's Hugging Face adapter: ``Qwen3ForCausalLM`` (per-head
q/k norms, tied embeddings as one parameter), and the ``qwen3-hf`` spec's factory."""

from __future__ import annotations

from typing import Any

from hyper_parallel.checkpoint_hf.config import ConfigReader
from hyper_parallel.models.common.hf import DecoderHF, head_dim_of, hf_sized
from hyper_parallel.models.qwen3.config import PRESETS, qwen3_config
from hyper_parallel.models.qwen3.model import Transformer

__all__ = ["HF", "Qwen3HF", "qwen3_hf_config"]


class Qwen3HF(DecoderHF):
    """Qwen3 ``config.json`` and tensor names (q/k norms)."""

    architectures = ("Qwen3ForCausalLM",)
    model_types = {"qwen3": "Qwen3ForCausalLM"}
    spec = "qwen3-hf"
    config_type = Transformer.Config
    qk_norm = True

    def read_own(self, reader: ConfigReader, overrides: dict[str, Any], rope: tuple) -> None:
        if rope[1] is not None:
            reader.problem("rope_parameters.rope_type", "llama3", "'default' for Qwen3")
        overrides.update(
            head_dim=head_dim_of(reader, overrides),
            ffn_dim=reader.get("intermediate_size"),
            # Our Qwen3 ties natively (one parameter), as transformers does.
            tie_embeddings=bool(reader.get("tie_word_embeddings", False)),
        )
        reader.get("max_window_layers")  # read only for sliding-window layers (refused)

    def write_own(self, config: Any) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "intermediate_size": config.layers[0].feed_forward.w1.out_features,
            "use_sliding_window": False,
            "tie_word_embeddings": bool(config.tie_embeddings),
        }


HF = Qwen3HF()
"""The Qwen3 family's adapter (``ModelFamily.hf``)."""

qwen3_hf_config = hf_sized("qwen3-hf", qwen3_config, PRESETS["qwen3-debug"])
"""``qwen3_config(**kwargs)`` (the rest: ``qwen3-debug``'s); refused without any sizes."""
