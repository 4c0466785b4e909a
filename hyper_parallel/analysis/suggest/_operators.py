"""FLOPs and operators of one sequence, counted on the meta device; the optimizer's operators."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from hyper_parallel._torch_private import TorchDispatchMode, pytree
from hyper_parallel.analysis.suggest._source import ModelSource


@dataclasses.dataclass(frozen=True)
class _Flops:
    """FLOPs of one sequence: one block's and the rest's, forward and backward; the
    operators each runs (``*_ops``: one per aten call, whatever the batch); the
    elements the operators without a FLOP formula read and write (``*_elements``:
    elementwise ops, norms, softmax, copies, concatenations; views excluded), per
    sequence; the parameter tensors of one block and of the rest (``*_tensors``); and
    the operators the trainer's optimizer step runs per parameter tensor
    (``optimizer_ops_per_tensor``: gradient-norm and AdamW on a CPU tensor), of which
    ``optimizer_grad_reads`` arguments are the gradient (a gradient DTensor left
    ``Partial`` is reduced for each: DTensor redistributes per operator argument and
    keeps no result)."""

    block_fwd: float
    block_bwd: float
    rest_fwd: float
    rest_bwd: float
    num_layers: int
    block_fwd_ops: int = 0
    block_bwd_ops: int = 0
    rest_fwd_ops: int = 0
    rest_bwd_ops: int = 0
    block_fwd_elements: float = 0.0
    block_bwd_elements: float = 0.0
    rest_fwd_elements: float = 0.0
    rest_bwd_elements: float = 0.0
    block_tensors: int = 0
    rest_tensors: int = 0
    optimizer_ops_per_tensor: int = 0
    optimizer_grad_reads: int = 1
    block_score_fwd: float = 0.0
    block_score_bwd: float = 0.0
    """Of ``block_fwd`` / ``block_bwd``: attention's score matmuls (causal share), which
    the attention kernel runs (``Hardware.attention_efficiency``)."""
    block_op_recompute: float = 0.0
    """Of ``block_fwd``: what ``op`` checkpointing recomputes in backward — the FLOPs of
    the matmuls whose outputs :class:`~hyper_parallel.distributed.activation_checkpoint.OpPolicy`
    does not keep (every second one); attention's are kept."""

    @property
    def total(self) -> float:
        n = self.num_layers
        return n * (self.block_fwd + self.block_bwd) + self.rest_fwd + self.rest_bwd


class _OperatorCount(TorchDispatchMode):
    """Counts the aten operators that run under it (views and metadata ops included:
    each is a dispatch with its fixed cost), and the tensor elements the operators
    without a FLOP formula read and write (``elements``): every tensor argument and
    result of an operator that is neither a view nor has a formula in
    ``torch.utils.flop_counter`` (matmuls, convolutions, attention)."""

    def __init__(self, scores: int | None = None) -> None:
        super().__init__()
        self.count = 0
        self.elements = 0
        self.scores = scores

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        out = func(*args, **(kwargs or {}))
        if not _moves_no_data(func):
            self.elements += sum(
                _tensor_elements(tree, self.scores) for tree in (args, kwargs, out)
            )
        return out


def _moves_no_data(func: Any) -> bool:
    """A view, a metadata or allocation-only op, or a FLOP-counted op (matmul, attention:
    the compute term has it)."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(func, "overloadpacket", None)
    if packet is None or getattr(func, "is_view", False) or packet in flop_registry:
        return True
    name = packet.__name__
    return name in _NO_DATA_OPS or name.startswith("_grouped_mm")


_NO_DATA_OPS = frozenset(
    (
        "detach",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "_to_copy_meta",
        "lift_fresh",
        "alias",
        "set_",
        "resize_",
        "_local_scalar_dense",
        "_unsafe_view",
        "_reshape_alias",
    )
)


def _tensor_elements(tree: Any, scores: int | None = None) -> int:
    """Elements of the tensors in ``tree``; with ``scores``, less those shaped ``[...,
    scores, scores]`` (an attention score matrix or mask of a ``scores``-token sequence)."""
    return sum(
        t.numel()
        for t in pytree.tree_leaves(tree)
        if isinstance(t, torch.Tensor)
        and not (scores is not None and t.dim() >= 2 and t.shape[-2:] == (scores, scores))
    )


def count_operators(scores: int | None = None) -> _OperatorCount:
    """A context that counts the aten operators run inside it (``.count``) and the
    elements the non-matmul ones read and write (``.elements``): what the cost model
    multiplies by the hardware's ``op_overhead_s`` and charges at its memory
    bandwidth, and what ``calibrate`` takes out of a small step's time.

    ``scores``: a sequence length whose ``[..., S, S]`` tensors are left out of
    ``.elements``: on the meta device attention runs torch's unfused math path
    (scores, mask, softmax materialized), while the kernels a training step runs
    (flash attention on GPUs and CPUs) never write them; their reads of queries, keys
    and values and writes of the output are counted with the neighbouring operators."""
    return _OperatorCount(scores)


class _GradReads(TorchDispatchMode):
    """Counts the arguments of operators that are one of ``grads`` (by storage): a
    DTensor operator redistributes each argument apart."""

    def __init__(self, grads: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {g.untyped_storage().data_ptr() for g in grads}
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += sum(
            isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages
            for t in pytree.tree_leaves((args, kwargs or {}))
        )
        return func(*args, **(kwargs or {}))


def _optimizer_ops_per_tensor() -> tuple[int, int]:
    """Operators the trainer's optimizer step runs per parameter tensor on a CPU (the
    gradient norm, ``train.trainer.clip_grad_norm_``, AdamW's step and ``zero_grad``),
    and how many of their arguments are the gradient: the differences between two
    parameters and one (AdamW's lazily created states made first)."""
    from hyper_parallel.train.trainer import clip_grad_norm_

    counts = []
    for n in (1, 2):
        params = [torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(n)]
        opt = torch.optim.AdamW(params)
        for _ in range(2):
            for q in params:
                q.grad = torch.zeros(2, 2)
            with count_operators() as ops, _GradReads([q.grad for q in params]) as reads:
                clip_grad_norm_(params, math.inf)
                opt.step()
                opt.zero_grad(set_to_none=True)
        counts.append((ops.count, reads.count))
    return max(0, counts[1][0] - counts[0][0]), max(1, counts[1][1] - counts[0][1])


class _ScoreFlops(TorchDispatchMode):
    """FLOPs of the batched matmuls that read or write a ``[batch, ..., S, S]`` tensor of an ``S``-token
    sequence: attention's ``Q K^T`` and ``P V`` (and their gradients) as the meta device
    runs them (torch's math path materializes the score matrix), counted with
    ``torch.utils.flop_counter``'s formulas."""

    def __init__(self, scores: int) -> None:
        super().__init__()
        self.scores = scores
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils.flop_counter import flop_registry

        out = func(*args, **(kwargs or {}))
        formula = flop_registry.get(getattr(func, "overloadpacket", None))
        if formula is not None and any(
            isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[-2:] == (self.scores,) * 2
            for t in pytree.tree_leaves((args, out))
        ):
            self.flops += formula(*args, **(kwargs or {}), out_val=out)
        return out


class _OpRecomputeFlops(TorchDispatchMode):
    """FLOPs of the operators inside ``blocks`` whose outputs ``op`` checkpointing does
    not keep (:class:`~hyper_parallel.distributed.activation_checkpoint.OpPolicy`, one
    per call of a block), less attention's score matmuls (an ``[..., S, S]`` tensor: the
    meta device runs torch's math path; a fused attention kernel's outputs are kept)."""

    def __init__(self, blocks: Any, scores: int, mapping: dict[Any, Any] | None = None) -> None:
        from torch.utils.flop_counter import flop_registry, shape_wrapper

        from hyper_parallel.distributed.activation_checkpoint import OpPolicy

        super().__init__()
        self.scores = scores
        self.formulas = dict(flop_registry)
        self.formulas.update({k: shape_wrapper(v) for k, v in (mapping or {}).items()})
        if isinstance(blocks, torch.nn.ModuleDict):
            blocks = list(blocks.values())
        self.flops = 0
        self.policy: OpPolicy | None = None
        self.handles = []
        for block in blocks:
            self.handles.append(
                block.register_forward_pre_hook(lambda *_: setattr(self, "policy", OpPolicy()))
            )
            self.handles.append(
                block.register_forward_hook(lambda *_: setattr(self, "policy", None))
            )

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.policy is None or self.policy.keeps(func):
            return out
        formula = self.formulas.get(getattr(func, "overloadpacket", None))
        scores = any(
            isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[-2:] == (self.scores,) * 2
            for t in pytree.tree_leaves((args, out))
        )
        if formula is not None and not scores:
            self.flops += formula(*args, **(kwargs or {}), out_val=out)
        return out


CAUSAL_SHARE = 0.5
"""Share of the score matrix a causal attention kernel computes: query ``i`` attends to
keys ``0..i``, about half of ``S x S`` (flash attention skips the masked blocks; torch's
flop formula for attention counts the full matrix)."""


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, **kwargs: Any) -> int:
    """``torch._grouped_mm``: 2 x rows x inner x cols summed over the groups."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # (tokens, k) x (experts, k, n)
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (k, tokens) x (tokens, n), per group
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(a_shape) * b_shape[-1]


def count_flops(source: ModelSource, seq_len: int) -> _Flops:
    """Forward and backward FLOPs of one sequence, counted on the meta device.

    ``FlopCounterMode`` (torch's own formulas; ``torch._grouped_mm`` of the routed
    experts added: 2 x tokens x in x out) at depths 1 and 2: the difference is one
    block, the rest is the embedding, the output projection and the loss. Attention is
    causal: of the matmuls on the ``S x S`` score matrix only :data:`CAUSAL_SHARE` is
    counted (the model's attention runs ``is_causal``; a document mask only removes more).
    """
    from torch.utils.flop_counter import FlopCounterMode

    counts = []
    op_recompute = 0.0
    mapping = {}
    if hasattr(torch.ops.aten, "_grouped_mm"):
        mapping[torch.ops.aten._grouped_mm] = _grouped_mm_flops
    loss_fn = source.spec.family.loss_fn
    for depth in (1, 2):
        config = source.config()
        blocks = source.spec.family.blocks or "layers"
        config = config.replace(**{blocks: list(getattr(config, blocks)[:depth])})
        with torch.device("meta"):
            model = config.build().to(torch.bfloat16)
        tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
        with (
            FlopCounterMode(display=False, custom_mapping=mapping) as fwd,
            count_operators(seq_len) as fo,
            _ScoreFlops(seq_len) as fs,
            _OpRecomputeFlops(getattr(model, blocks), seq_len, mapping) as fr,
        ):
            out = model(tokens)
            loss = loss_fn(out, tokens) if loss_fn is not None else out.float().sum()
        op_recompute = fr.flops / depth  # identical blocks
        with (
            FlopCounterMode(display=False, custom_mapping=mapping) as bwd,
            count_operators(seq_len) as bo,
            _ScoreFlops(seq_len) as bs,
        ):
            loss.backward()
        masked = 1.0 - CAUSAL_SHARE
        counts.append(
            (
                fwd.get_total_flops() - masked * fs.flops,
                bwd.get_total_flops() - masked * bs.flops,
                CAUSAL_SHARE * fs.flops,
                CAUSAL_SHARE * bs.flops,
                fo.count,
                bo.count,
                fo.elements,
                bo.elements,
                sum(1 for _ in model.parameters()),
            )
        )
    (f1, b1, a1, ab1, fo1, bo1, fe1, be1, t1), (f2, b2, a2, ab2, fo2, bo2, fe2, be2, t2) = counts
    n = source.spec.family.num_layers(source.config())
    optimizer_ops, grad_reads = _optimizer_ops_per_tensor()
    return _Flops(
        f2 - f1,
        b2 - b1,
        f1 - (f2 - f1),
        b1 - (b2 - b1),
        n,
        block_fwd_ops=fo2 - fo1,
        block_bwd_ops=bo2 - bo1,
        rest_fwd_ops=max(0, fo1 - (fo2 - fo1)),
        rest_bwd_ops=max(0, bo1 - (bo2 - bo1)),
        block_fwd_elements=fe2 - fe1,
        block_bwd_elements=be2 - be1,
        rest_fwd_elements=max(0, fe1 - (fe2 - fe1)),
        rest_bwd_elements=max(0, be1 - (be2 - be1)),
        block_tensors=t2 - t1,
        rest_tensors=max(0, t1 - (t2 - t1)),
        optimizer_ops_per_tensor=optimizer_ops,
        optimizer_grad_reads=grad_reads,
        block_score_fwd=a2 - a1,
        block_score_bwd=ab2 - ab1,
        block_op_recompute=op_recompute,
    )
