"""The trainer's precisions: fp32, bf16 mixed precision with fp32 master weights, and
bf16 throughout.

``fp32`` trains in float32 throughout. ``bf16`` keeps parameters, gradients and
optimizer states in float32 (the master copy) and computes in bfloat16:

- with FSDP2, through its ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``: the all-gathered parameters are cast to bf16 for forward and
  backward, gradients are reduce-scattered in fp32 into the fp32 shards;
- without FSDP (one process, or tensor parallel only), under
  ``torch.autocast(dtype=bf16)``: matmuls run in bf16 from the fp32 weights and the
  gradients reach the fp32 parameters in fp32.

``bf16-true`` stores the parameters in bfloat16 (Lightning's ``precision="bf16-true"``;
NeMo AutoModel's MoE benchmark runs): there is no fp32 master copy, the gradients are
bf16 and ``torch.optim.AdamW`` keeps its moments in the parameters' dtype, so the
states take 8 bytes per parameter instead of 16. FSDP2 reduces the gradients in fp32
(``MixedPrecisionPolicy(reduce_dtype=fp32)``) and casts the result to bf16; without
FSDP nothing is cast (no autocast). Updates smaller than half a bf16 unit of a weight
(relative 2**-9) are lost, which is why mixed precision is the default. Buffers (the
rotary tables) stay float32, as under ``bf16``.

The loss is computed from float32 logits under every precision (torchtitan does the same).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "DTYPES",
    "PARAM_DTYPES",
    "cast_parameters",
    "check_dtype",
    "fsdp_policy",
    "loss_logits",
    "uses_autocast",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16-true": torch.bfloat16}
"""Each precision's compute dtype: the activations'."""

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.float32, "bf16-true": torch.bfloat16}
"""Each precision's parameter dtype, which is also its gradients' and AdamW moments'."""


def check_dtype(dtype: str) -> None:
    """Raise ``ValueError`` unless ``dtype`` is one of :data:`DTYPES`."""
    if dtype not in DTYPES:
        raise ValueError(
            f"dtype {dtype!r} is not one of {list(DTYPES)}; use 'bf16' for mixed precision "
            "with fp32 master weights, 'bf16-true' for bf16 parameters, gradients and "
            "optimizer states, or 'fp32'."
        )


def fsdp_policy(dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``dtype``: bf16 compute with fp32 reduction, or all fp32.

    Under ``bf16-true`` the parameters are bf16 already; only the reduction is fp32.

    Example::

        fully_shard(block, mesh=mesh["dp"], mp_policy=fsdp_policy("bf16"))
    """
    check_dtype(dtype)
    if dtype == "fp32":
        return MixedPrecisionPolicy()
    if dtype == "bf16-true":
        return MixedPrecisionPolicy(reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def uses_autocast(dtype: str) -> bool:
    """Whether a module without FSDP2 computes under bf16 autocast (mixed precision)."""
    check_dtype(dtype)
    return dtype == "bf16"


def cast_parameters(module: nn.Module, dtype: str) -> None:
    """Store ``module``'s parameters in ``dtype``'s parameter dtype, in place.

    Meant for a model on the meta device, before it is parallelized (FSDP2 records each
    parameter's dtype when it wraps it). Buffers are left as they are; a parameter shared
    by two modules (tied embeddings) stays one parameter.
    """
    check_dtype(dtype)
    target = PARAM_DTYPES[dtype]
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != target:
            p.data = p.data.to(target)


def loss_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits as the loss takes them: float32 (a no-op for fp32 logits)."""
    return logits if logits.dtype == torch.float32 else logits.float()
