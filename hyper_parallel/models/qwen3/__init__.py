"""Qwen3 dense decoders, built from the shared decoder parts (:mod:`hyper_parallel.models.common`).

Registers ``qwen3-debug``, ``qwen3-0.6b``, ``qwen3-8b`` and ``qwen3-32b`` (published
shapes: per-head QK-norm, GQA, ``head_dim`` apart from ``dim / num_heads``, tied
embeddings for 0.6B); :data:`FAMILY` declares tp, tp+sp, cp and the pipeline stages.

Example::

    spec = hyper_parallel.dmodule.get_spec("qwen3-debug")
    model = spec.sharding("tp")(spec.config(), tp_size=2).build()
"""

from __future__ import annotations

from hyper_parallel.models.common.family import dense_family, register_hf_spec, register_presets
from hyper_parallel.models.common.loss import cross_entropy_loss as cross_entropy_loss
from hyper_parallel.models.qwen3.config import PRESETS as PRESETS
from hyper_parallel.models.qwen3.config import num_params as num_params
from hyper_parallel.models.qwen3.config import preset_config as preset_config
from hyper_parallel.models.qwen3.config import qwen3_config as qwen3_config
from hyper_parallel.models.qwen3.hf import HF as HF
from hyper_parallel.models.qwen3.hf import qwen3_hf_config as qwen3_hf_config
from hyper_parallel.models.qwen3.model import Transformer as Transformer
from hyper_parallel.models.qwen3.sharding import apply_cp as apply_cp
from hyper_parallel.models.qwen3.sharding import apply_tp as apply_tp
from hyper_parallel.models.qwen3.sharding import apply_tp_sp as apply_tp_sp

__all__ = [
    "FAMILY",
    "HF",
    "PIPELINE",
    "PRESETS",
    "Transformer",
    "apply_cp",
    "apply_tp",
    "apply_tp_sp",
    "cross_entropy_loss",
    "num_params",
    "preset_config",
    "qwen3_config",
    "qwen3_hf_config",
]

FAMILY = dense_family(
    "qwen3",
    (apply_tp, apply_tp_sp, apply_cp),
    num_params,
    why_no_ep="Qwen3 dense has no routed experts to place on ep; Qwen3-MoE has",
    hf=HF,
)
"""What the infrastructure needs to know about the Qwen3 dense (shared by its presets)."""

PIPELINE = FAMILY.pipeline
"""How the model is cut into pipeline stages (the shared decoder's units)."""

register_presets(
    FAMILY,
    PRESETS,
    preset_config,
    {
        "qwen3-debug": "Qwen3 dense, debug size (trains in seconds on CPU)",
        "qwen3-0.6b": "Qwen3-0.6B shapes (tied embeddings)",
        "qwen3-8b": "Qwen3-8B shapes",
        "qwen3-32b": "Qwen3-32B shapes",
    },
)
register_hf_spec(FAMILY, qwen3_hf_config)
