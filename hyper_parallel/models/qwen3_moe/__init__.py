"""A Qwen3-MoE decoder with expert parallelism.

Importing this package registers one :class:`~hyper_parallel.dmodule.ModelSpec` per
preset (``qwen3-moe-debug``, ``qwen3-30b-a3b``, ``qwen3-235b-a22b``). Each spec's
``config(**overrides)`` returns a ``Transformer.Config``; its ``family`` (:data:`FAMILY`,
a :class:`~hyper_parallel.dmodule.ModelFamily`) declares the sharding functions (``ep``,
``tp``, ``tp_sp``, ``cp``), the loss, ``num_params``, ``num_expert_params``, the expert
paths and the pipeline stages (:data:`PIPELINE`).

Example::

    import torch
    from hyper_parallel.dmodule import get_spec

    spec = get_spec("qwen3-moe-debug")
    config = spec.sharding("ep")(spec.config())
    with torch.device("meta"):
        model = config.build()
    # model.parallelize(mesh["ep"]); model.to_empty(device="cpu"); model.init_states()
"""

from __future__ import annotations

from hyper_parallel.models.common.family import decoder_family, register_hf_spec, register_presets
from hyper_parallel.models.common.loss import cross_entropy_loss as cross_entropy_loss
from hyper_parallel.models.qwen3_moe.config import PRESETS as PRESETS
from hyper_parallel.models.qwen3_moe.config import num_expert_params as num_expert_params
from hyper_parallel.models.qwen3_moe.config import num_experts as num_experts
from hyper_parallel.models.qwen3_moe.config import num_params as num_params
from hyper_parallel.models.qwen3_moe.config import preset_config as preset_config
from hyper_parallel.models.qwen3_moe.config import qwen3_moe_config as qwen3_moe_config
from hyper_parallel.models.qwen3_moe.hf import HF as HF
from hyper_parallel.models.qwen3_moe.hf import qwen3_moe_hf_config as qwen3_moe_hf_config
from hyper_parallel.models.qwen3_moe.model import Attention as Attention
from hyper_parallel.models.qwen3_moe.model import GroupedExperts as GroupedExperts
from hyper_parallel.models.qwen3_moe.model import MoE as MoE
from hyper_parallel.models.qwen3_moe.model import Router as Router
from hyper_parallel.models.qwen3_moe.model import Transformer as Transformer
from hyper_parallel.models.qwen3_moe.model import TransformerBlock as TransformerBlock
from hyper_parallel.models.qwen3_moe.model import expert_ffn as expert_ffn
from hyper_parallel.models.qwen3_moe.model import load_balancing_loss as load_balancing_loss
from hyper_parallel.models.qwen3_moe.sharding import EXPERT_PARAMS as EXPERT_PARAMS
from hyper_parallel.models.qwen3_moe.sharding import apply_cp as apply_cp
from hyper_parallel.models.qwen3_moe.sharding import apply_ep as apply_ep
from hyper_parallel.models.qwen3_moe.sharding import apply_tp as apply_tp
from hyper_parallel.models.qwen3_moe.sharding import apply_tp_sp as apply_tp_sp
from hyper_parallel.models.qwen3_moe.sharding import check_ep as check_ep
from hyper_parallel.models.qwen3_moe.stages import PIPELINE as PIPELINE

__all__ = [
    "EXPERT_PARAMS",
    "FAMILY",
    "PIPELINE",
    "PRESETS",
    "Attention",
    "GroupedExperts",
    "MoE",
    "Router",
    "Transformer",
    "TransformerBlock",
    "apply_cp",
    "apply_ep",
    "apply_tp",
    "apply_tp_sp",
    "check_ep",
    "cross_entropy_loss",
    "expert_ffn",
    "load_balancing_loss",
    "num_expert_params",
    "num_experts",
    "num_params",
    "preset_config",
    "qwen3_moe_config",
    "qwen3_moe_hf_config",
]

FAMILY = decoder_family(
    "qwen3_moe",
    tp=apply_tp,
    tp_sp=apply_tp_sp,
    cp=apply_cp,
    ep=apply_ep,
    num_params=num_params,
    num_expert_params=num_expert_params,
    experts=num_experts,
    pipeline=PIPELINE,
    expert_paths=("layers.*.moe.experts",),
    compile_experts=GroupedExperts.compile_compute,
    hf=HF,
)
"""What the infrastructure needs to know about the Qwen3-MoE family (shared by its presets)."""

register_presets(
    FAMILY,
    PRESETS,
    preset_config,
    {
        "qwen3-moe-debug": "Qwen3-MoE-style decoder, debug size: 8 experts, top-2 (trains in "
        "seconds on CPU)",
        "qwen3-30b-a3b": "Qwen3-30B-A3B shapes: 128 experts, top-8",
        "qwen3-235b-a22b": "Qwen3-235B-A22B shapes: 128 experts, top-8",
    },
)
register_hf_spec(FAMILY, qwen3_moe_hf_config)
