"""One builder: the whole model (pp=1) and each pipeline stage (pp>1) are built alike.

Built for real (materialized on CPU) over PyTorch's fake process group: the routed
experts of ``qwen3-moe-debug`` are an FSDP2 unit of their own over ``efsdp`` and compute
in bf16 under ``dtype="bf16"`` — at pp=2 exactly as at pp=1 (the pipeline used to build
their unit without the mixed-precision policy, and the first matmul failed on bf16
against float).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hyper_parallel.analysis._world import fake_world
from hyper_parallel.train.trainer import (
    TrainConfig,
    build_parallel_model,
    build_pipeline_stages,
)


def _experts(module: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in module.modules()
        if getattr(getattr(m, "sharding_config", None), "dispatch", None) is not None
    ]


def _compute_dtypes(module: nn.Module) -> set[torch.dtype]:
    """The dtypes of an FSDP2 unit's parameters as its forward sees them (unsharded)."""
    assert isinstance(module, FSDPModule)
    module.unshard()  # FSDP2's own all-gather into the policy's param_dtype
    try:
        return {p.dtype for p in module.parameters()}
    finally:
        module.reshard()


def _expert_dtypes(cfg: TrainConfig, pp: int) -> list[set[torch.dtype]]:
    with fake_world(cfg.layout) as mesh:
        if pp > 1:
            parts, _ = build_pipeline_stages(cfg, mesh, "cpu")
        else:
            parts = [build_parallel_model(cfg, mesh, "cpu")]
        experts = [e for part in parts for e in _experts(part)]
        assert experts, "the model has no routed experts"
        return [_compute_dtypes(e) for e in experts]


def test_experts_compute_in_bf16_at_pp2_exactly_as_at_pp1() -> None:
    base = TrainConfig(model="qwen3-moe-debug", dtype="bf16", batch_size=4)
    flat = _expert_dtypes(base.replace(mesh={"dp_shard": 2, "ep": 2}), pp=1)
    piped = _expert_dtypes(base.replace(mesh={"pp": 2, "dp_shard": 2, "ep": 2}), pp=2)
    assert flat and all(d == {torch.bfloat16} for d in flat), flat
    assert piped and all(d == {torch.bfloat16} for d in piped), piped
    # In fp32 the same units keep fp32: the dtype is the run plan's, not a default.
    fp32 = _expert_dtypes(base.replace(mesh={"pp": 2, "dp_shard": 2, "ep": 2}, dtype="fp32"), 2)
    assert all(d == {torch.float32} for d in fp32), fp32
