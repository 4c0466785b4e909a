"""Process-wide torch settings are scoped to where they are needed and restored.

``torch._functorch.config.donated_buffer`` is off inside a split-backward pipeline step
(and only there); ``torch._dynamo.config.capture_scalar_outputs`` is on inside the
compiled experts' maths (and only there). After a run both hold their values again.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyper_parallel._torch_private import dynamo_config, functorch_config
from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
from hyper_parallel.distributed.pipeline import (
    build_schedule,
    init_states_by_unit,
    pipeline_step,
    plan_pipeline,
)
from hyper_parallel.models.llama import PIPELINE, cross_entropy_loss, preset_config


def test_a_split_backward_step_turns_donated_buffers_off_only_inside() -> None:
    before = functorch_config.donated_buffer
    seen: list[bool] = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
        config = preset_config("llama3-debug")
        plan = plan_pipeline(
            PIPELINE.units(config), pp=1, schedule="ZBVZeroBubble", num_microbatches=2
        )
        # Both stages in one process, unsharded (no mesh axis to apply: built and
        # initialized as the builder does, per unit).
        modules = []
        for s in plan.stages_of_rank(0):
            stage = PIPELINE.stage_config(config, plan.stages[s]).build()
            init_states_by_unit(stage, PIPELINE, 0)
            modules.append(stage)
        for m in modules:
            m.register_forward_hook(lambda *_: seen.append(functorch_config.donated_buffer))
        schedule = build_schedule(modules, plan, mesh["pp"], "cpu", cross_entropy_loss)
        tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
        loss = pipeline_step(schedule, plan, mesh["pp"], tokens[:, :-1], tokens[:, 1:])
    finally:
        dist.destroy_process_group()
    assert torch.isfinite(loss)
    assert seen and not any(seen)  # off during the step's forwards
    assert functorch_config.donated_buffer == before  # restored after


def test_compiled_experts_capture_scalar_outputs_only_inside() -> None:
    from hyper_parallel.models.qwen3_moe import preset_config as moe_config

    before = dynamo_config().capture_scalar_outputs
    experts_config = moe_config("qwen3-moe-debug").layers[0].moe.experts
    experts = experts_config.build()
    experts.init_states()
    experts.compile_compute("eager")
    tokens, top_k = 6, 2
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(0))
    index = torch.randint(0, 8, (tokens, top_k), generator=torch.Generator().manual_seed(1))
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(2))
    out = experts(x, index, weights)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert dynamo_config().capture_scalar_outputs == before
