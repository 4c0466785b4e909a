"""The trainer's bf16 and activation-checkpointing switches on 2 gloo ranks.

bf16 under tensor + sequence parallel runs the fast path (autocast, fp32 master
weights) and stays within the demo's bf16 tolerance of one process under the same
policy; checkpointing every block changes nothing (1e-6); bf16 under FSDP2 (its
MixedPrecisionPolicy) keeps fp32 master weights and the same tolerance. In both bf16
runs every first-step gradient is within a relative error of the fp32 one-process one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as c10d

from hyper_parallel.dmodule._boundary import installed_forward
from hyper_parallel.dmodule._fast import FastPath
from hyper_parallel.train import TrainConfig, Trainer
from hyper_parallel.train.demo import BF16_TOL
from hyper_parallel.train.run import full_gradients
from tests._compare import BF16_GRAD_RTOL, FP32_RTOL, check, diffs, worst_abs

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2
SMALL = dict(steps=3, batch_size=4, seq_len=32, log_every=0, progress=False)


def _keep_first(grads: dict):
    """A ``grad_callback`` keeping the first step's full gradients (before clipping)."""

    def keep(step: int, parts: list) -> None:
        if step == 0:
            grads.update(full_gradients(parts))

    return keep


def _train(cfg_dict: dict) -> dict:
    grads: dict = {}
    trainer = Trainer(
        TrainConfig.from_dict(cfg_dict), device="cpu", grad_callback=_keep_first(grads)
    )
    wq = trainer.model.layers[0].attention.wq
    logits_dtypes = []
    hook = trainer.model.output.register_forward_hook(
        lambda m, a, out: logits_dtypes.append(out.dtype)
    )
    losses = trainer.fit().losses
    hook.remove()
    return {
        "losses": losses,
        "fast_path": isinstance(installed_forward(wq), FastPath),
        "logits_dtype": str(logits_dtypes[0]),
        "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
        "first_grads": grads,
    }


def _one_process_on_rank0(cfg_dict: dict) -> list[float] | None:
    if c10d.get_rank() != 0:
        return None
    cfg = TrainConfig.from_dict(cfg_dict).replace(mesh={}, sp=False)
    return Trainer(cfg, device="cpu").fit().losses


def _first_grads(cfg_dict: dict) -> dict:
    """The trainer's first-step gradients (its own step), before clipping."""
    grads: dict = {}
    cfg = TrainConfig.from_dict(cfg_dict)
    Trainer(cfg, device="cpu", grad_callback=_keep_first(grads)).train_step()
    return grads


def _fp32_one_process_grads_on_rank0(cfg_dict: dict) -> dict | None:
    if c10d.get_rank() != 0:
        return None
    cfg = TrainConfig.from_dict(cfg_dict).replace(mesh={}, sp=False, dtype="fp32")
    return _first_grads(cfg.to_dict())


@pytest.fixture(scope="module")
def runs(dist):
    tp_sp = dict(SMALL, mesh={"tp": 2}, sp=True, dtype="bf16")
    fsdp = dict(SMALL, mesh={"dp": 2}, dtype="bf16")
    return {
        "tp_sp": dist.run(_train, tp_sp)[0],
        "tp_sp_ac": dist.run(_train, dict(tp_sp, ac="full"))[0],
        "fsdp": dist.run(_train, fsdp)[0],
        "one": dist.run(_one_process_on_rank0, tp_sp)[0],
        "fp32_grads": dist.run(_fp32_one_process_grads_on_rank0, tp_sp)[0],
    }


def test_bf16_runs_the_fast_path_in_bf16_with_fp32_master_weights(runs):
    r = runs["tp_sp"]
    assert r["fast_path"]
    assert r["logits_dtype"] == str(torch.bfloat16)
    assert r["param_dtypes"] == [str(torch.float32)]
    assert worst_abs([abs(a - b) for a, b in zip(r["losses"], runs["one"])]) <= BF16_TOL
    # Every first-step gradient against the fp32 one-process one (a 2x or zero one fails).
    check(diffs(r["first_grads"], runs["fp32_grads"]), rtol=BF16_GRAD_RTOL)


def test_full_checkpointing_equals_none_under_tp_sp(runs):
    a, b = runs["tp_sp"]["losses"], runs["tp_sp_ac"]["losses"]
    assert worst_abs([abs(x - y) for x, y in zip(a, b)]) <= 1e-6


def test_bf16_under_fsdp_mixed_precision(runs):
    r = runs["fsdp"]
    assert r["param_dtypes"] == [str(torch.float32)]  # the fp32 shards are the masters
    assert r["logits_dtype"] == str(torch.bfloat16)  # FSDP cast the gathered parameters
    assert worst_abs([abs(a - b) for a, b in zip(r["losses"], runs["one"])]) <= BF16_TOL
    check(diffs(r["first_grads"], runs["fp32_grads"]), rtol=BF16_GRAD_RTOL)


def _first_grads_on_rank0_of(cfg_dict: dict) -> dict | None:
    grads = _first_grads(cfg_dict)
    return grads if c10d.get_rank() == 0 else None


def _one_process_first_grads_on_rank0(cfg_dict: dict) -> dict | None:
    if c10d.get_rank() != 0:
        return None
    cfg = TrainConfig.from_dict(cfg_dict).replace(mesh={}, sp=False, ac="none")
    return _first_grads(cfg.to_dict())


@pytest.mark.parametrize(
    ("model", "mesh", "ac"),
    [
        ("qwen3-moe-debug", {"dp_shard": 2, "ep": 2}, "full"),
        ("llama3-debug", {"cp": 2}, "full"),
        ("llama3-debug", {"cp": 2}, "op"),
        ("llama3-debug", {"tp": 2}, "op"),
        ("llama3-debug", {"dp_shard": 2}, "op"),
    ],
    ids=["ep-full", "cp-full", "cp-op", "tp_sp-op", "fsdp-op"],
)
def test_checkpointing_recomputes_the_all_to_alls_gathers_and_reductions_exactly(
    dist, model, mesh, ac
):
    # The recomputed forward re-runs the experts' all-to-alls (ep), the k/v gathers
    # (cp) and the sequence-parallel gathers (tp; under ``op`` the reduce-scatters'
    # outputs are kept, the rest recomputed): every first-step gradient equals the
    # one-process run without checkpointing.
    cfg = dict(SMALL, model=model, mesh=mesh, ac=ac, sp="tp" in mesh)
    grads = dist.run(_first_grads_on_rank0_of, cfg)[0]
    reference = dist.run(_one_process_first_grads_on_rank0, cfg)[0]
    check(diffs(grads, reference), atol=1e-5, rtol=FP32_RTOL)
