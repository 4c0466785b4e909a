"""Warnings of PyTorch we know to be harmless for this package, silenced once, narrowly.

:func:`quiet_strided_gather` installs (once per process) a filter on DTensor's
redistribution logger that drops exactly one message: gathering a parameter that
FSDP2 sharded on top of tensor parallelism (placements ``(_StridedShard, Shard)``)
to ``Replicate`` everywhere "takes 2 sequential all_gather operations". That is
the gather ``full_tensor`` does when a Hugging Face checkpoint is written or the
demo compares whole gradients: an all-gather adds nothing up, so the "inconsistent
results due to different reduction orders" it warns of cannot happen, and the
extra latency is paid once per save, not per step. It printed on every rank.
Every other message of that logger still prints.
"""

from __future__ import annotations

import logging

from hyper_parallel._torch_private import StridedShard

__all__ = ["quiet_strided_gather"]

_LOGGER = "torch.distributed.tensor._redistribute"


class _StridedGatherFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) < 4 or args[3] != "all_gather":
            return True
        src, dst = args[0], args[1]
        strided = any(isinstance(p, StridedShard) for p in src)
        whole = all(p.is_replicate() for p in dst)
        return not (strided and whole)


def quiet_strided_gather() -> None:
    """Install the filter (idempotent)."""
    logger = logging.getLogger(_LOGGER)
    if not any(isinstance(f, _StridedGatherFilter) for f in logger.filters):
        logger.addFilter(_StridedGatherFilter())
