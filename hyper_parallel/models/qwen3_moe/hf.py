"""The Qwen3-MoE family's Hugging Face adapter: ``Qwen3MoeForCausalLM`` (per-head q/k
norms; each expert's three projections stacked on dim 0 of ours), and the
``qwen3-moe-hf`` spec's factory."""

from __future__ import annotations

from typing import Any

from hyper_parallel.checkpoint_hf.config import ConfigReader
from hyper_parallel.checkpoint_hf.mapping import TensorMap
from hyper_parallel.models.common.hf import DecoderHF, head_dim_of, hf_sized
from hyper_parallel.models.qwen3_moe.config import PRESETS, qwen3_moe_config
from hyper_parallel.models.qwen3_moe.model import Transformer

__all__ = ["HF", "Qwen3MoeHF", "qwen3_moe_hf_config"]


class Qwen3MoeHF(DecoderHF):
    """Qwen3-MoE ``config.json`` and tensor names (router, stacked experts)."""

    architectures = ("Qwen3MoeForCausalLM",)
    model_types = {"qwen3_moe": "Qwen3MoeForCausalLM"}
    spec = "qwen3-moe-hf"
    config_type = Transformer.Config
    qk_norm = True

    def read_own(self, reader: ConfigReader, overrides: dict[str, Any], rope: tuple) -> None:
        if rope[1] is not None:
            reader.problem("rope_parameters.rope_type", "llama3", "'default' for Qwen3-MoE")
        moe_dim, top_k = reader.required("moe_intermediate_size", "num_experts_per_tok")
        experts = reader.get("num_local_experts", reader.get("num_experts"))
        if experts is None:
            reader.problem("num_local_experts", None, "required")
        reader.expect("norm_topk_prob", (True,), "true: top-k weights renormalized")
        reader.expect("decoder_sparse_step", (1,), "1: every layer sparse")
        reader.expect("mlp_only_layers", ([],), "[]: every layer sparse")
        overrides.update(
            head_dim=head_dim_of(reader, overrides),
            num_experts=experts,
            top_k=top_k,
            moe_hidden_dim=moe_dim,
            aux_loss_coef=float(reader.get("router_aux_loss_coef", 0.001)),
        )
        reader.get("max_window_layers")  # read only for sliding-window layers (refused)

    def write_own(self, config: Any) -> dict[str, Any]:
        block = config.layers[0]
        experts = block.moe.experts
        return {
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
        }

    def ffn_maps(self, block: Any, ours: str, hf: str) -> list[TensorMap]:
        experts = range(block.moe.experts.num_experts)
        maps = [TensorMap(ours + "moe.router.weight", (hf + "mlp.gate.weight",))]
        for w, name in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            maps.append(
                TensorMap(
                    ours + f"moe.experts.{w}",
                    tuple(f"{hf}mlp.experts.{e}.{name}.weight" for e in experts),
                )
            )
        return maps


HF = Qwen3MoeHF()
"""The Qwen3-MoE family's adapter (``ModelFamily.hf``)."""

qwen3_moe_hf_config = hf_sized("qwen3-moe-hf", qwen3_moe_config, PRESETS["qwen3-moe-debug"])
"""``qwen3_moe_config(**kwargs)`` (the rest: ``qwen3-moe-debug``'s); refused without any sizes."""
