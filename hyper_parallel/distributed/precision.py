"""bf16 mixed precision with fp32 master weights, with and without FSDP2.

``fp32`` trains in float32 throughout. ``bf16`` keeps parameters, gradients and
optimizer states in float32 (the master copy) and computes in bfloat16:

- with FSDP2, through its ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``: the all-gathered parameters are cast to bf16 for forward and
  backward, gradients are reduce-scattered in fp32 into the fp32 shards;
- without FSDP (one process, or tensor parallel only), under
  ``torch.autocast(dtype=bf16)``: matmuls run in bf16 from the fp32 weights and the
  gradients reach the fp32 parameters in fp32.

The loss is computed from float32 logits either way (torchtitan does the same).
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["DTYPES", "check_dtype", "fsdp_policy", "loss_logits"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_dtype(dtype: str) -> None:
    """Raise ``ValueError`` unless ``dtype`` is ``"fp32"`` or ``"bf16"``."""
    if dtype not in DTYPES:
        raise ValueError(
            f"dtype {dtype!r} is not one of {list(DTYPES)}; use 'bf16' for mixed precision "
            "with fp32 master weights, or 'fp32'."
        )


def fsdp_policy(dtype: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``dtype``: bf16 compute with fp32 reduction, or all fp32.

    Example::

        fully_shard(block, mesh=mesh["dp"], mp_policy=fsdp_policy("bf16"))
    """
    check_dtype(dtype)
    if dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def loss_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits as the loss takes them: float32 (a no-op for fp32 logits)."""
    return logits if logits.dtype == torch.float32 else logits.float()
