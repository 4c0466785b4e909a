"""How the Qwen3-MoE decoder is cut into pipeline stages.

The units are the Llama's: the token embedding (first stage), each transformer
block, and the final norm + output projection (last stage), each a unit a stage may
hold alone; every stage holds the rotary tables and the causal-mask builder. A stage
is the shared decoder's :class:`~hyper_parallel.models.common.TransformerStage`
holding this model's blocks (blocks with the shared ``forward(x, cos, sin, mask)``), so its parameter names are the full
model's (``layers.3.moe.experts.w1``) and a checkpoint loads at any pipeline size.

The router's balance loss needs nothing from the pipeline: each MoE layer sends its
gradient in backward (``MoE`` attaches it to the layer's output), so a stage's
routers are trained by their own layers' balance loss whichever stage holds them.
It is a per-sequence statistic averaged over sequences
(:func:`~hyper_parallel.models.qwen3_moe.load_balancing_loss`), so one micro-batch's
balance loss is the mean over its sequences, and the mean over equal micro-batches —
what the schedule's gradient scaling (``1 / num_microbatches``) computes, as
torchtitan and Megatron-LM average it over micro-batches — is exactly the whole
batch's: a pipelined step and a one-device step over the whole batch train the
routers the same way.
"""

from __future__ import annotations

from typing import Any

from hyper_parallel.models.common.decoder import decoder_pipeline

__all__ = ["PIPELINE"]


def _block_elements(config: Any, block: Any) -> tuple[int, int]:
    """Per token, the activation elements a block keeps for its backward: (replicated, tp-split).

    An estimate in the spirit of Korthikanti et al. (2022, §4.1), as the Llama's: a
    block keeps its two norm inputs and outputs and the residual (``5 x dim``,
    replicated under plain TP); attention keeps the projections of q, k, v, their
    per-head norms' and rotary outputs and the attention output (``4 x q_dim + 4 x
    kv_dim``, split over tp); the mixture of experts, which routes each tensor-parallel
    rank's slice of the tokens, keeps per token the router's logits and
    probabilities (``2 x num_experts``), per chosen expert the gathered input, three
    hidden-width SwiGLU tensors and its product, and the expert's output (``top_k x
    (2 x dim + 4 x hidden)``), and the combined output (``dim``).
    """
    dim = config.norm.dim
    q_dim = block.attention.wq.out_features
    kv_dim = block.attention.wk.out_features
    moe = block.moe
    hidden, top_k = moe.experts.hidden_dim, moe.router.top_k
    routed = 2 * moe.router.num_experts + top_k * (2 * dim + 4 * hidden) + dim
    return 5 * dim, 4 * q_dim + 4 * kv_dim + routed


PIPELINE = decoder_pipeline(_block_elements)
"""The Qwen3-MoE decoder's pipeline description (its family's ``pipeline``)."""
