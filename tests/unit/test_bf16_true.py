"""``--dtype bf16-true`` in one process: its refusals, the cast, the summary, a tied model.

The distributed checks (every rank's states bf16, losses and gradients against one
device) are in ``tests/distributed/test_bf16_true.py``; the builder's cast from the fp32
model's values in ``test_train_switches.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hyper_parallel.distributed.builder import build_model
from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.distributed.precision import DTYPES, PARAM_DTYPES, cast_parameters
from hyper_parallel.distributed.run_plan import RunPlan
from hyper_parallel.train import TrainConfig, Trainer
from hyper_parallel.train.run import build_parser

TINY = dict(steps=2, batch_size=2, seq_len=16, log_every=0, progress=False)


def test_an_unknown_dtype_is_refused_naming_every_choice():
    with pytest.raises(ValueError) as e:
        TrainConfig(dtype="bf16-x")
    message = str(e.value)
    assert "'bf16-x'" in message
    for choice in ("'fp32'", "'bf16'", "'bf16-true'"):
        assert choice in message, message
    with pytest.raises(ValueError, match="'bf16-true'"):
        cast_parameters(nn.Linear(2, 2), "bf16-x")
    with pytest.raises(SystemExit):  # the command line offers the same three
        build_parser().parse_args(["--dtype", "bf16-x"])
    assert build_parser().parse_args(["--dtype", "bf16-true"]).dtype == "bf16-true"


def test_only_bf16_true_stores_bf16_parameters():
    assert set(DTYPES) == set(PARAM_DTYPES) == {"fp32", "bf16", "bf16-true"}
    assert DTYPES["bf16-true"] == PARAM_DTYPES["bf16-true"] == torch.bfloat16
    assert PARAM_DTYPES["bf16"] == PARAM_DTYPES["fp32"] == torch.float32  # the master copy


def test_cast_parameters_on_the_meta_model_keeps_a_tie_and_the_buffers():
    """As the builder calls it: on the meta device, before the model is parallelized."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    model.register_buffer("freqs", torch.ones(3, device="meta"))
    for dtype, want in (("fp32", torch.float32), ("bf16", torch.float32)):
        cast_parameters(model, dtype)
        assert model[0].weight.dtype == want, dtype
    cast_parameters(model, "bf16-true")
    assert model[1].weight is model[0].weight
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16]  # one parameter
    assert model.freqs.dtype == torch.float32


def test_a_tied_model_trains_in_bf16_true_and_says_so():
    """Qwen3 with tied embeddings: the output keeps the embedding's (bf16) weight through
    the build and two steps, AdamW keeps two bf16 moments per parameter (the tied one
    once), the rotary tables stay fp32, and the summary names the precision."""
    cfg = TrainConfig(
        model="qwen3-debug", model_overrides={"tie_embeddings": True}, dtype="bf16-true", **TINY
    )
    trainer = Trainer(cfg, device="cpu")
    assert trainer.report.summary()[1] == "mesh: one device (1 rank(s) on cpu), dtype bf16-true"
    model = trainer.model
    losses = trainer.fit().losses
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert model.output.weight is model.tok_embeddings.weight
    params = list(model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    states = trainer.optimizers[0].state
    assert len(states) == len(params)
    for state in states.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert {b.dtype for b in model.buffers()} == {torch.float32}
    # Untied, the same model has one more parameter: the tie above is one parameter.
    untied = build_model(RunPlan.for_model("qwen3-debug", MeshLayout(), dtype="bf16-true"),
                         None, "cpu", 0)  # fmt: skip
    assert len(list(untied.parameters())) == len(params) + 1


def test_plan_holds_accumulated_gradients_at_fsdp2s_fp32_reduce_dtype(capsys):
    """Between micro-batches FSDP2 keeps a unit's unsharded gradients in its policy's
    reduce dtype (``to_accumulated_grad_if_needed``): fp32 under bf16-true as under bf16,
    4 bytes a parameter at dp_shard=2, which the dry run's table and the --gpu
    prediction both say (the table said bf16's 2)."""
    import json

    from hyper_parallel.cli import main
    from hyper_parallel.dmodule import get_spec

    argv = ["plan", "--model", "llama3-debug", "--mesh", "dp_shard=2", "--seq", "256"]
    argv += ["--microbatches", "2", "--gpu", "h100-80gb", "--format", "json"]
    reports = {}
    for dtype in ("bf16", "bf16-true"):
        assert main([*argv, "--dtype", dtype]) == 0
        reports[dtype] = json.loads(capsys.readouterr().out)
    spec = get_spec("llama3-debug")
    unsharded = 4 * spec.family.num_params(spec.config())
    for report in reports.values():
        assert report["per_rank_bytes"]["grads"] == unsharded
        assert report["predicted"]["memory"]["grads"] == unsharded
