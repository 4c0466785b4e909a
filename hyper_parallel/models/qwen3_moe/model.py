"""A Qwen3-MoE decoder: the maths only.

The shared decoder (:mod:`hyper_parallel.models.common`) with its odd layer:
placements live in ``sharding.py``, presets in ``config.py``. The attention is the
shared grouped-query attention with an RMSNorm on each query and key head (Qwen3);
the feed-forward of every block is a mixture of experts: a softmax
router picks ``top_k`` experts per token (their weights renormalized over the chosen
``k``), and :class:`GroupedExperts` runs SwiGLU experts whose weights are stacked
``[num_experts, ...]``, with no capacity limit (no token is dropped).

:class:`GroupedExperts` takes ``(x, top_k_index, top_k_weights)`` and returns the
router-weighted sum of the chosen experts' outputs — the same contract as Hugging
Face's experts modules — so expert parallelism
(:mod:`hyper_parallel.distributed.expert_parallel`) applies to both unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyper_parallel._torch_private import dynamo_config, is_fake, mark_unbacked
from hyper_parallel.dmodule.module import Module
from hyper_parallel.models.common.decoder import Decoder, DecoderBlock
from hyper_parallel.models.common.layers import (
    Attention,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    ScaledDotProductAttention,
    swiglu,
)

__all__ = [
    "Attention",
    "BalanceStatistics",
    "Embedding",
    "GroupedExperts",
    "Linear",
    "MoE",
    "RMSNorm",
    "RotaryEmbedding",
    "Router",
    "ScaledDotProductAttention",
    "Transformer",
    "TransformerBlock",
    "balance_loss",
    "balance_statistics",
    "even_split",
    "expert_counts",
    "expert_ffn",
    "load_balancing_loss",
]


class Router(Module):
    """Softmax top-k router: ``x (T, dim) -> (probs (T, E), top_k_index, top_k_weights)``.

    Probabilities are computed in fp32; the chosen ``top_k`` weights are renormalized
    to sum to one (Qwen3-MoE's ``norm_topk_prob``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        num_experts: int
        top_k: int

    def __init__(self, config: Router.Config) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).float().softmax(dim=-1)
        top_weights, top_index = probs.topk(self.top_k, dim=-1)
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return probs, top_index, top_weights.to(x.dtype)


def _grouped_mm_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` accepts these operands (else the loop is used).

    Its CPU kernel needs every stride a multiple of 16 bytes and a float dtype it
    implements; the loop gives the same numbers everywhere else.
    """
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.dtype not in (torch.float32, torch.bfloat16):
        return False
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and weight.shape[-1] % align == 0


def _grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: list[int] | None, offsets: torch.Tensor
) -> torch.Tensor:
    """``x`` in expert-major blocks times ``weight[e].T`` per block: ``(N, in) -> (N, out)``."""
    if counts is None:
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    blocks = torch.split(x, counts)
    return torch.cat([b @ weight[e].T for e, b in enumerate(blocks)], dim=0)


def even_split(total: int, parts: int) -> list[int]:
    """``total`` items in ``parts`` near-equal counts (the first ``total % parts`` get one more).

    Example:
        >>> even_split(10, 4)
        [3, 3, 2, 2]
    """
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def expert_counts(flat_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of ``flat_index`` name each of ``num_experts`` experts (int64).

    A scatter-add rather than ``bincount``, so the shape is static (fake tensors too).
    """
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat_index.device)
    return counts.index_add_(0, flat_index, torch.ones_like(flat_index))


def expert_ffn(
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    use_grouped_mm: bool = True,
) -> torch.Tensor:
    """SwiGLU experts on expert-major token blocks: ``w2_e(silu(w1_e x) * w3_e x)``.

    Args:
        x: ``(N, dim)`` tokens, the first ``num_tokens_per_expert[0]`` for expert 0, ...
        num_tokens_per_expert: ``(E,)`` integer counts summing to ``N`` (zeros allowed).
        w1, w3: ``(E, hidden, dim)``; w2: ``(E, dim, hidden)``.
        use_grouped_mm: Use ``torch._grouped_mm`` where it runs; ``False`` forces the
            loop over experts (the same numbers).

    Returns:
        ``(N, dim)`` expert outputs in the same order.
    """
    grouped = use_grouped_mm and _grouped_mm_runs(x, w1) and _grouped_mm_runs(x, w2)
    return _swiglu_blocks(x, num_tokens_per_expert, w1, w2, w3, "grouped_mm" if grouped else "loop")


def _swiglu_blocks(
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    mode: str,
) -> torch.Tensor:
    """:func:`expert_ffn` with the split decided by the caller (``GroupedExperts`` once).

    ``mode``: ``"grouped_mm"`` (one grouped GEMM per weight, offsets from the counts),
    ``"loop"`` (a loop over the experts, the counts read as Python ints) or ``"even"``
    (the loop with an even split assumed: fake tensors carry no counts, and the dry
    run states uniform routing).
    """
    num_experts = num_tokens_per_expert.shape[0]
    if mode == "even" and num_experts and x.shape[0] % num_experts == 0:
        # Equal blocks: one batched matmul per weight over ``(experts, block, dim)`` views
        # (the loop's FLOPs, its outputs and the same saved storages, in 3 ops, not 3 per
        # expert: the dry run of 128 local experts is ~4x faster).
        xe = x.view(num_experts, -1, x.shape[-1])
        h = swiglu(torch.bmm(xe, w1.transpose(-2, -1)), torch.bmm(xe, w3.transpose(-2, -1)))
        return torch.bmm(h, w2.transpose(-2, -1)).reshape(x.shape[0], -1)
    offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
    counts: list[int] | None = None
    if mode == "even":
        counts = even_split(x.shape[0], num_tokens_per_expert.shape[0])
    elif mode == "loop":
        counts = num_tokens_per_expert.tolist()
    h = swiglu(_grouped_linear(x, w1, counts, offsets), _grouped_linear(x, w3, counts, offsets))
    return _grouped_linear(h, w2, counts, offsets)


@functools.cache
def _grouped_mm_traces(dtype: torch.dtype) -> bool:
    """Whether ``torch.compile`` can trace ``torch._grouped_mm`` in ``dtype``.

    Tracing runs the operator's meta kernel, which accepts fewer dtypes than the CPU
    kernel (bf16 only in this torch); asked once per dtype, on the meta device.
    """
    try:
        torch._grouped_mm(
            torch.empty(8, 8, dtype=dtype, device="meta"),
            torch.empty(2, 8, 8, dtype=dtype, device="meta"),
            offs=torch.empty(2, dtype=torch.int32, device="meta"),
        )
    except RuntimeError:
        return False
    return True


class GroupedExperts(Module):
    """``num_experts`` SwiGLU experts with stacked weights; routed tokens in, weighted sum out.

    ``forward(x (T, dim), top_k_index (T, k), top_k_weights (T, k)) -> (T, dim)``:
    ``out[t] = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(x[t])``. The
    number of experts is read from the weights, so the same code runs on a rank's
    local experts (indices then count from that rank's first expert).

    How the tokens are split into expert blocks is decided on the first call and
    kept: ``torch._grouped_mm`` where it runs for these tensors (``use_grouped_mm``),
    else a loop over the experts; on fake tensors (the dry run, which carries no
    counts) the loop with an even split (uniform routing). :meth:`compile_compute`
    compiles the experts' maths alone.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        num_experts: int
        dim: int
        hidden_dim: int
        use_grouped_mm: bool = True

    def __init__(self, config: GroupedExperts.Config) -> None:
        super().__init__()
        self.use_grouped_mm = config.use_grouped_mm
        e, d, h = config.num_experts, config.dim, config.hidden_dim
        self.w1 = nn.Parameter(torch.empty(e, h, d))
        self.w2 = nn.Parameter(torch.empty(e, d, h))
        self.w3 = nn.Parameter(torch.empty(e, h, d))
        self._ffn: Callable[..., torch.Tensor] | None = None  # decided on the first call
        self._compile_backend: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy (the dry run copies a model onto fake tensors) or a pickle decides again.
        return {**super().__getstate__(), "_ffn": None}

    def compile_compute(self, backend: str = "inductor") -> None:
        """``torch.compile`` (``fullgraph=True``) the experts' maths: SwiGLU on expert blocks.

        The routing around it (sort, gather, weighted sum) stays eager, and so do, under
        expert parallelism, the dispatch's all-to-alls and the experts' FSDP2 hooks. The
        token count is marked unbacked: it changes with the routing on every call, and one
        graph serves every count, zero included. Compiled, the grouped GEMM is used only in
        dtypes its meta kernel traces (bf16 in this torch), else the loop, whose block
        sizes are then read as unbacked ints (``capture_scalar_outputs``, patched around
        each compiled call and restored after: no process-wide setting changes).
        """
        self._compile_backend = backend
        self._ffn = None

    def _decide_ffn(self, x: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The experts' maths for tensors like ``x``: decided once, on the first call."""
        if is_fake(x):
            mode = "even"
        else:
            grouped = self.use_grouped_mm and _grouped_mm_runs(x, self.w1)
            grouped = grouped and _grouped_mm_runs(x, self.w2)
            if grouped and self._compile_backend is not None:
                grouped = _grouped_mm_traces(x.dtype)
            mode = "grouped_mm" if grouped else "loop"
        ffn: Callable[..., torch.Tensor] = functools.partial(_swiglu_blocks, mode=mode)
        if self._compile_backend is not None and mode != "even":
            compiled = torch.compile(ffn, fullgraph=True, backend=self._compile_backend)

            def run_compiled(x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
                mark_unbacked(x, 0)
                with dynamo_config().patch(capture_scalar_outputs=True):
                    return compiled(x, *args)

            ffn = run_compiled
        self._ffn = ffn
        return ffn

    def forward(
        self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        top_k = top_k_index.shape[1]
        flat_index = top_k_index.reshape(-1)
        # Expert-major order of the (token, choice) pairs; stable, so ties keep token order.
        order = torch.argsort(flat_index, stable=True)
        counts = expert_counts(flat_index, self.w1.shape[0])
        token_of = order // top_k
        y = self.grouped_forward(x[token_of], counts)
        y = y * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token_of, y.to(x.dtype))

    def grouped_forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The experts on tokens already in expert-major blocks: ``(N, dim) -> (N, dim)``.

        The maths of :meth:`forward` without its routing (:func:`expert_ffn` on this
        module's weights); expert parallelism calls it with the received tokens, which
        arrive grouped by expert, so they are not sorted, weighted and summed again.
        """
        ffn = self._ffn or self._decide_ffn(x)
        return ffn(x, num_tokens_per_expert, self.w1, self.w2, self.w3)


def balance_statistics(
    probs: torch.Tensor, top_k_index: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Per-sequence routing sums: ``(B, 2, E)`` = router probabilities summed over the
    sequence, and the number of ``(token, choice)`` assignments of each expert.

    Sums, not means, so that the statistics of pieces of a sequence (tensor-parallel
    ranks holding sequence slices) add up to those of the whole sequence.

    Args:
        probs: ``(B, S, E)`` router probabilities.
        top_k_index: ``(B, S, k)`` chosen experts.
        num_experts: ``E``.
    """
    bsz = probs.shape[0]
    counts = torch.zeros(bsz, num_experts, device=probs.device, dtype=probs.dtype)
    counts.scatter_add_(
        1,
        top_k_index.reshape(bsz, -1),
        torch.ones_like(top_k_index.reshape(bsz, -1), dtype=probs.dtype),
    )
    return torch.stack((probs.sum(dim=1), counts), dim=1)


def balance_loss(statistics: torch.Tensor, top_k: int) -> torch.Tensor:
    """The balance loss of :func:`load_balancing_loss` from :func:`balance_statistics`."""
    prob_sums, counts = statistics.unbind(dim=1)
    assignments = counts.sum(dim=-1, keepdim=True)  # seq_len * top_k per sequence
    fraction = counts / assignments
    mean_probs = prob_sums / (assignments / top_k)
    return (counts.shape[-1] * (fraction * mean_probs).sum(dim=-1)).mean()


def load_balancing_loss(
    probs: torch.Tensor, top_k_index: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Switch-Transformer balance loss per sequence, averaged over sequences.

    For each sequence: ``num_experts * sum_e f_e * P_e`` with ``f_e`` the fraction of
    its ``(token, choice)`` assignments that went to expert ``e`` and ``P_e`` its mean
    router probability (Fedus et al., 2021, eq. 4-6; per sequence as DeepSeek-V3's
    sequence-wise balance loss). Per sequence, so that any mesh that keeps whole
    sequences on a rank (data and expert parallel) computes exactly the single-device
    value as the mean of its ranks' values; ranks that hold slices of the same
    sequences (tensor parallel) add their :func:`balance_statistics` first. A value
    over 1 means imbalance, 1 is perfect balance.

    Args:
        probs: ``(B, S, E)`` router probabilities.
        top_k_index: ``(B, S, k)`` chosen experts.
        num_experts: ``E``.

    Returns:
        A scalar: the mean over the ``B`` sequences.
    """
    stats = balance_statistics(probs, top_k_index, num_experts)
    return balance_loss(stats, top_k_index.shape[-1])


class BalanceStatistics(Module):
    """:func:`balance_statistics` as a module: ``(probs, top_k_index) -> (B, 2, E)``.

    A module of its own so that a sharding can say how the sums of ranks holding
    slices of the same sequences combine (``Partial`` -> ``Replicate``: one
    all-reduce), without the model knowing any mesh.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        num_experts: int

    def __init__(self, config: BalanceStatistics.Config) -> None:
        super().__init__()
        self.num_experts = config.num_experts

    def forward(self, probs: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        return balance_statistics(probs, top_k_index, self.num_experts)


class _AttachAuxLoss(torch.autograd.Function):
    """Return ``x`` unchanged; in backward, also send ``coef`` as the aux loss's gradient.

    The balance loss then trains the router without the training loop having to add
    it to the loss (Megatron-LM's ``MoEAuxLossAutoScaler``).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux_loss: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.coef = coef
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.coef), None


class MoE(Module):
    """Mixture-of-experts feed-forward: route, run the chosen experts, weighted sum.

    ``forward(x (B, S, dim)) -> (B, S, dim)``. With ``aux_loss_coef > 0`` the router's
    balance loss (:func:`load_balancing_loss`) adds ``aux_loss_coef`` times its
    gradient in backward; its last value is kept in ``aux_loss`` (detached) for logging.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        router: Router.Config
        experts: GroupedExperts.Config
        aux_loss_coef: float = 0.001
        balance: BalanceStatistics.Config | None = None

    def __init__(self, config: MoE.Config) -> None:
        super().__init__()
        self.aux_loss_coef = config.aux_loss_coef
        self.num_experts = config.router.num_experts
        self.router = config.router.build()
        self.experts = config.experts.build()
        balance = config.balance or BalanceStatistics.Config(num_experts=self.num_experts)
        self.balance = balance.build()
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, dim = x.shape
        tokens = x.reshape(-1, dim)
        probs, top_index, top_weights = self.router(tokens)
        out = self.experts(tokens, top_index, top_weights).view(bsz, seq_len, dim)
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            top_index = top_index.view(bsz, seq_len, -1)
            stats = self.balance(probs.view(bsz, seq_len, -1), top_index)
            aux = balance_loss(stats, top_index.shape[-1])
            self.aux_loss = aux.detach()
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_coef)
        return out


class TransformerBlock(DecoderBlock):
    """Pre-norm residual block: attention, then the mixture of experts (``moe``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(DecoderBlock.Config):
        moe: MoE.Config

    ffn_name = "moe"


class Transformer(Decoder):
    """Decoder-only MoE language model: ``forward(tokens (B, S)) -> logits (B, S, vocab)``.

    ``forward(tokens, positions=positions)`` takes each token's position in the global
    sequence (``[S]`` or ``[B, S]``) for a sequence split across ranks (context
    parallel): the rotary tables and the causal mask read them, as in the Llama.

    Build one from a preset with :func:`~hyper_parallel.models.qwen3_moe.qwen3_moe_config`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Decoder.Config):
        layers: list[TransformerBlock.Config]
