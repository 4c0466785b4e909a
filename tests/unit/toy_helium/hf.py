"""The toy Helium family's Hugging Face adapter: ``HeliumForCausalLM``."""

from __future__ import annotations

from typing import Any

from hyper_parallel.checkpoint_hf.config import ConfigReader
from hyper_parallel.models.common.hf import DecoderHF, head_dim_of, hf_sized
from tests.unit.toy_helium.model import Transformer, helium_config

__all__ = ["HF", "HeliumHF", "helium_hf_config"]


class HeliumHF(DecoderHF):
    """Helium's ``config.json`` and names; its rotary pairs are ours (no permutation)."""

    architectures = ("HeliumForCausalLM",)
    model_types = {"helium": "HeliumForCausalLM"}
    spec = "toy-helium-hf"
    config_type = Transformer.Config
    rotate_half = False

    def read_own(self, reader: ConfigReader, overrides: dict[str, Any], rope: tuple) -> None:
        if rope[1] is not None:
            reader.problem("rope_parameters.rope_type", "llama3", "'default' for Helium")
        overrides.update(head_dim=head_dim_of(reader, overrides))
        overrides["ffn_dim"] = reader.get("intermediate_size")

    def write_own(self, config: Any) -> dict[str, Any]:
        return {
            "architectures": ["HeliumForCausalLM"],
            "model_type": "helium",
            "mlp_bias": False,
            "intermediate_size": config.layers[0].feed_forward.w1.out_features,
        }


HF = HeliumHF()

helium_hf_config = hf_sized("toy-helium-hf", helium_config, {})
