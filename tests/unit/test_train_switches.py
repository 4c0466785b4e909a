"""The trainer's compile, precision and activation-checkpointing switches, in one process."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from hyper_parallel.distributed.activation_checkpoint import checkpointed_blocks
from hyper_parallel.distributed.builder import build_model
from hyper_parallel.distributed.compile import apply_compile
from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.distributed.precision import cast_parameters, fsdp_policy, loss_logits
from hyper_parallel.distributed.run_plan import RunPlan
from hyper_parallel.train import TrainConfig, Trainer
from hyper_parallel.train.run import add_train_arguments, config_from_args, full_gradients
from tests._compare import BF16_GRAD_RTOL, FP32_RTOL, check, diffs, worst_abs

TINY = dict(
    steps=2,
    batch_size=2,
    seq_len=16,
    log_every=0,
    progress=False,
    model_overrides={"num_layers": 2},
)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("dtype", "fp16", ["dtype 'fp16'", "bf16"]),
        ("ac", "some", ["'some'", "selective"]),
        ("compile", "yes", ["compile", "True or False"]),
    ],
)
def test_bad_switch_values_are_refused_with_the_fix(field, value, words):
    with pytest.raises(ValueError) as e:
        TrainConfig(**{field: value})
    for w in words:
        assert w in str(e.value)


def test_selective_checkpoints_every_second_block():
    assert checkpointed_blocks(5, "selective") == [1, 3]
    assert checkpointed_blocks(3, "full") == [0, 1, 2]
    assert checkpointed_blocks(3, "op") == [0, 1, 2]
    assert checkpointed_blocks(3, "none") == []


def test_compile_needs_a_model_with_layers_and_a_known_backend():
    with pytest.raises(ValueError, match=r"no 'layers' ModuleList.*ModelFamily\.blocks"):
        apply_compile(nn.Linear(2, 2), backend="inductor")
    with pytest.raises(ValueError, match="'inductor'"):
        apply_compile(nn.Linear(2, 2), backend="xla")


def test_precision_policies():
    policy = fsdp_policy("bf16")
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_policy("fp32").param_dtype is None
    # Without FSDP2 the builder runs the forward under bf16 autocast from fp32 weights.
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    for dtype, computed in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        run = RunPlan.for_model("llama3-debug", MeshLayout(), dtype=dtype)
        model = build_model(run, None, "cpu", seed=0)
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        y = model(tokens)
        assert y.dtype == computed
        assert loss_logits(y).dtype == torch.float32


def test_bf16_true_stores_bf16_parameters_from_the_fp32_models_values():
    """bf16-true: every parameter bf16, drawn in fp32 and rounded (so it starts from the
    values every other precision starts from), buffers fp32, no autocast: the forward's
    logits are bf16 from bf16 weights. The policy only reduces in fp32."""
    policy = fsdp_policy("bf16-true")
    assert (policy.param_dtype, policy.reduce_dtype) == (None, torch.float32)
    for name in ("llama3-debug", "qwen3-moe-debug"):
        fp32 = build_model(RunPlan.for_model(name, MeshLayout(), dtype="fp32"), None, "cpu", 0)
        true = build_model(RunPlan.for_model(name, MeshLayout(), dtype="bf16-true"), None, "cpu", 0)
        ref = dict(fp32.named_parameters())
        for n, p in true.named_parameters():
            assert p.dtype == torch.bfloat16, n
            assert torch.equal(p, ref[n].detach().to(torch.bfloat16)), n
        assert {b.dtype for b in true.buffers()} <= {torch.float32}, name
        tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        assert true(tokens).dtype == torch.bfloat16


def test_cast_parameters_keeps_a_tied_parameter_one_parameter():
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    model.register_buffer("table", torch.ones(3))
    cast_parameters(model, "bf16-true")
    assert model[1].weight is model[0].weight and model[0].weight.dtype == torch.bfloat16
    assert len(list(model.parameters())) == 1 and model.table.dtype == torch.float32


def test_command_line_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(["--compile", "--dtype", "bf16", "--ac", "selective"])
    cfg = config_from_args(args)
    assert (cfg.compile, cfg.dtype, cfg.ac) == (True, "bf16", "selective")
    assert (TrainConfig().compile, TrainConfig().dtype, TrainConfig().ac) == (False, "fp32", "none")


def _run(**switches):
    torch.manual_seed(0)
    trainer = Trainer(TrainConfig(**TINY, **switches), device="cpu")
    losses = trainer.fit().losses
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _first_grads(**switches) -> dict[str, torch.Tensor]:
    """The trainer's first-step gradients (its own step: autocast, scaling), before clipping."""
    grads: dict[str, torch.Tensor] = {}

    def keep(step: int, parts: list[nn.Module]) -> None:
        grads.update(full_gradients(parts))

    torch.manual_seed(0)
    Trainer(TrainConfig(**TINY, **switches), device="cpu", grad_callback=keep).train_step()
    return grads


def test_activation_checkpointing_equals_no_checkpointing():
    losses, params = _run()
    for ac in ("full", "selective"):
        ac_losses, ac_params = _run(ac=ac)
        assert worst_abs([abs(a - b) for a, b in zip(losses, ac_losses)]) <= 1e-6
        assert worst_abs([(params[n] - p).abs().max().item() for n, p in ac_params.items()]) <= 1e-6
        check(diffs(_first_grads(ac=ac), _first_grads()), atol=1e-6, rtol=FP32_RTOL)


def test_bf16_keeps_fp32_master_weights_and_stays_close():
    losses, _ = _run()
    bf16_losses, params = _run(dtype="bf16")
    assert all(p.dtype == torch.float32 for p in params.values())
    assert bf16_losses != losses  # computed in bf16
    assert worst_abs([abs(a - b) for a, b in zip(losses, bf16_losses)]) <= 2e-2
    # Every gradient of the first step against fp32: a 2x or zero gradient fails.
    check(diffs(_first_grads(dtype="bf16"), _first_grads()), rtol=BF16_GRAD_RTOL)


def test_compile_with_expert_parallel_is_accepted():
    # MoE blocks compile region by region around the eager experts; compiled equals eager
    # on gloo (tests/distributed/test_compile.py).
    from hyper_parallel.train.trainer import check_config

    cfg = TrainConfig(model="qwen3-moe-debug", mesh={"dp_shard": 2, "ep": 2}, compile=True)
    assert check_config(cfg, world_size=2) == []


def test_compile_with_context_parallel_is_accepted_at_one_sequence_per_rank():
    # Compiled cp blocks equal eager on gloo (tests/distributed/test_compile.py). Next to
    # FSDP2's data axes, several sequences per micro-batch are a run-plan finding (dynamo
    # stops on torch's strided-shard propagation; found by the configuration matrix).
    from hyper_parallel.train.trainer import check_config

    cfg = TrainConfig(mesh={"dp_shard": 2, "cp": 2}, compile=True, batch_size=2)
    assert check_config(cfg, world_size=4) == []
    cfg = TrainConfig(mesh={"dp_shard": 2, "cp": 2}, compile=True, batch_size=8)
    [finding] = check_config(cfg, world_size=4)
    assert finding.field == "compile" and "one sequence per micro-batch" in finding.fix


def test_op_checkpointing_is_refused_where_torch_cannot_replay_the_block():
    # torch's selective checkpointing replays a block's operators by call index; FSDP2's
    # hooks on the experts' own unit run others in the recompute (every rank stopped,
    # tests/distributed/test_train_switches.py). Without FSDP2 over data ranks it runs.
    from hyper_parallel.train.trainer import check_config

    moe = dict(model="qwen3-moe-debug", batch_size=4)
    [finding] = check_config(TrainConfig(mesh={"dp_shard": 2, "ep": 2}, ac="op", **moe), 2)
    assert finding.field == "ac" and "ep=2" in finding.message and "'full'" in finding.fix
    assert check_config(TrainConfig(mesh={"dp_shard": 2, "ep": 2}, ac="full", **moe), 2) == []
    assert check_config(TrainConfig(mesh={"dp_shard": 2}, ac="op", **moe), 2) == []
    # A split backward reads the saved activations twice (found by the matrix).
    zb = dict(mesh={"pp": 2, "cp": 2}, batch_size=8, ac="op")
    [finding] = check_config(TrainConfig(schedule="InterleavedZeroBubble", **zb), 4)
    assert finding.field == "ac" and "InterleavedZeroBubble" in finding.message
    assert "1F1B" in finding.fix
    assert check_config(TrainConfig(schedule="Interleaved1F1B", **zb), 4) == []


@pytest.mark.parametrize("per_op", [False, True], ids=["full", "op"])
def test_checkpointing_wraps_the_compiled_blocks_and_changes_nothing(per_op):
    # The builder's order (compile, then checkpointing around the compiled forward):
    # backward recomputes through the compiled graph; the loss and every gradient
    # equal the eager model without checkpointing.
    import copy

    from hyper_parallel.distributed.activation_checkpoint import _Checkpointed
    from hyper_parallel.distributed.builder import apply_parallelism
    from hyper_parallel.distributed.pipeline import init_states_by_unit
    from hyper_parallel.models.llama import PIPELINE, cross_entropy_loss, preset_config

    model = preset_config("llama3-debug").build()
    init_states_by_unit(model, PIPELINE, 0)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    apply_parallelism(
        model,
        mesh=None,
        dense_mesh=None,
        fsdp_mesh=None,
        compile_backend="aot_eager",
        checkpointed=range(len(model.layers)),
        per_op=per_op,
    )
    for block in model.layers:
        assert isinstance(block.forward, _Checkpointed)
        assert (block.forward.context_fn is not None) == per_op
        assert "Compile" in type(block.forward.forward).__name__ or hasattr(
            block.forward.forward, "_torchdynamo_orig_callable"
        ), block.forward.forward
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (model, eager):
        loss = cross_entropy_loss(m(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5
    grads = {n: p.grad for n, p in model.named_parameters()}
    reference = {n: p.grad for n, p in eager.named_parameters()}
    check(diffs(grads, reference), atol=1e-5, rtol=FP32_RTOL, expect_count=len(reference))
