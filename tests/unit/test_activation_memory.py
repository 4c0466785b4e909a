"""Activation memory: the dry run's saved-for-backward bytes, against the allocator.

The prediction (``SavedActivations`` on fake tensors, through ``dry_run``) is checked
against a measurement on real tensors: the CPU allocator's live bytes at the end of
one forward (what autograd holds for backward), read from PyTorch's profiler.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from hyper_parallel.analysis import dry_run
from hyper_parallel.analysis.memory import SavedActivations
from hyper_parallel.distributed.builder import build_model
from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.distributed.run_plan import RunPlan
from hyper_parallel.dmodule import get_spec
from hyper_parallel.models.llama import cross_entropy_loss, preset_config

SEQ, BATCH = 64, 2


def _measured_bytes(ac: str) -> int:
    """Bytes the allocator still holds after forward + loss, beyond the loss itself."""
    # The trainer's one-device build: the run plan's checkpointing through the builder.
    model = build_model(RunPlan.for_model("llama3-debug", MeshLayout(), ac=ac), None, "cpu", 0)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = cross_entropy_loss(model(inputs), targets)
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    return held - loss.untyped_storage().nbytes()


def _report(ac: str, dtype: str = "fp32") -> Any:
    """The dry run of the one-device build ``_measured_bytes`` measures."""
    return dry_run(
        get_spec("llama3-debug").config(),
        {"dp": 1},
        batch_size=BATCH,
        seq_len=SEQ,
        fsdp=False,
        ac=ac,
        dtype=dtype,
        loss_fn=lambda logits, tokens: cross_entropy_loss(logits, tokens),
    )


def _predicted(ac: str, dtype: str = "fp32") -> int:
    """Peak activation bytes under ``ac`` (with the recompute's working set)."""
    return _report(ac, dtype).per_rank.activations


def test_prediction_on_fake_tensors_matches_the_allocator_within_15_percent():
    measured, predicted = _measured_bytes("none"), _predicted("none")
    assert measured > 0
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)


def test_recorder_on_real_tensors_sees_what_the_allocator_holds():
    torch.manual_seed(0)
    model = preset_config("llama3-debug").build()
    model.init_states()
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    with SavedActivations(model, list(model.layers)) as saved:
        cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    measured = _measured_bytes("none")
    assert abs(saved.peak_bytes("none") - measured) <= 0.15 * measured


def test_checkpointing_keeps_block_inputs_only():
    none, full = _predicted("none"), _predicted("full")
    selective = _predicted("selective")
    assert full < selective < none
    # Full AC at the end of the forward holds what the allocator holds with AC on.
    measured_full = _measured_bytes("full")
    assert measured_full <= full  # the prediction adds the recomputation peak


def _predicted_held(ac: str) -> int:
    """Bytes held at the end of the forward under ``ac``."""
    return _report(ac).activations_held_by_ac[ac]


def test_op_checkpointing_holds_what_the_allocator_holds_after_the_forward():
    # Per-operator checkpointing (torch's selective checkpointing under OpPolicy) keeps
    # each block's input and the outputs of its attention and every second matmul. The
    # dry run counts them on fake tensors without checkpointing anything; the allocator
    # sees what the trainer's build really keeps at the end of the forward.
    measured = _measured_bytes("op")
    held = _predicted_held("op")
    assert abs(held - measured) <= 0.15 * measured, (held, measured)
    # Between full (inputs only) and none (everything saved), for both.
    assert _measured_bytes("full") < measured < _measured_bytes("none")
    assert _predicted("full") < _predicted("op") < _predicted("none")


def test_bf16_halves_what_fsdp_mixed_precision_saves():
    spec = get_spec("llama3-debug")
    args = dict(batch_size=BATCH, seq_len=SEQ)
    fp32 = dry_run(spec.config(), {"dp": 2}, dtype="fp32", **args).per_rank.activations
    bf16 = dry_run(spec.config(), {"dp": 2}, dtype="bf16", **args).per_rank.activations
    # Every matmul input and output halves, and the norms' saved input; their rstd and
    # the loss's fp32 logits do not, so the whole is a bit over half.
    assert 0.5 * fp32 <= bf16 < 0.7 * fp32


def test_plan_reports_activations_in_json_and_full_ac_cuts_8b_at_seq_8192(capsys):
    from hyper_parallel.cli import main

    sizes = {}
    for ac in ("none", "full"):
        args = ["plan", "--model", "llama3-8b", "--mesh", "tp=8", "--seq", "8192"]
        assert main([*args, "--ac", ac, "--format", "json"]) == 0
        report = json.loads(capsys.readouterr().out)
        per_rank = report["per_rank_bytes"]
        assert per_rank["total"] == sum(
            per_rank[k] for k in ("params", "grads", "optimizer", "activations")
        )
        sizes[ac] = per_rank["activations"]
    assert 0 < sizes["full"] < 0.5 * sizes["none"]
