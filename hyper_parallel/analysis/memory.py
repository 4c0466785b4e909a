"""Per-rank memory of training states: parameters, gradients, AdamW moments.

Formulas (per rank, per parameter element held locally):

- parameters: ``numel_local * sizeof(param dtype)``;
- gradients: the same (a gradient has its parameter's dtype and sharding; FSDP2
  reduce-scatters each gradient into its parameter's shard);
- AdamW: two moments, ``exp_avg`` and ``exp_avg_sq`` (Loshchilov & Hutter,
  "Decoupled Weight Decay Regularization", 2019; ``torch.optim.AdamW``'s state),
  taken as fp32: ``8 * numel_local`` bytes. torch keeps them in the parameter's
  dtype, so this is exact for fp32 parameters and assumes fp32 optimizer states
  (as mixed-precision training keeps them) for bf16 parameters. The per-parameter
  ``step`` scalar is ignored.

This is the steady state between steps (ZeRO's "model states", Rajbhandari et
al., 2020): activations and transient buffers are not included.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ADAMW_MOMENT_BYTES",
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "NUM_ADAMW_MOMENTS",
    "StateBytes",
    "ddp_num_buckets",
    "state_bytes",
]

NUM_ADAMW_MOMENTS = 2
ADAMW_MOMENT_BYTES = 4  # fp32
# DistributedDataParallel's defaults (torch/nn/parallel/distributed.py): bucket_cap_mb=25,
# and a first bucket of 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) so the first all-reduce
# starts early.
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class StateBytes:
    """Bytes per rank of each kind of training state."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "total": self.total,
        }


def state_bytes(param_bytes: int, grad_bytes: int, trainable_numel: int) -> StateBytes:
    """Per-rank state bytes from the local parameter and gradient bytes.

    Args:
        param_bytes: Sum over local parameter shards of ``numel * element_size``.
        grad_bytes: The same over gradients.
        trainable_numel: Local elements of parameters that require grad.

    Example::

        state_bytes(400, 400, 100).optimizer  # 800: two fp32 moments per element
    """
    return StateBytes(
        params=param_bytes,
        grads=grad_bytes,
        optimizer=NUM_ADAMW_MOMENTS * ADAMW_MOMENT_BYTES * trainable_numel,
    )


def ddp_num_buckets(grad_bytes: int) -> int:
    """All-reduces DDP issues per step for ``grad_bytes`` of gradients (default buckets).

    Assumes gradients fill buckets back to back (DDP closes a bucket at a parameter
    boundary, so the real count can be one or two higher).

    Example::

        ddp_num_buckets(30 * 1024 * 1024)  # 1 MiB, then 25 MiB, then 4 MiB: 3
    """
    if grad_bytes <= 0:
        return 0
    rest = max(grad_bytes - DDP_FIRST_BUCKET_BYTES, 0)
    return 1 + -(-rest // DDP_BUCKET_BYTES)
