"""Hugging Face models parallelized from the shipped plan files at tp=2, against one device.

Each case asserts numerics (logits, loss and every gradient vs a single-device
deepcopy), collective counts (CommDebugMode over one forward) and placements.
"""

from __future__ import annotations

import copy
import functools
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.dmodule import (
    ParallelizeError,
    colwise,
    parallelize_module,
    rowwise,
    sequence_parallel_norm,
)
from hyper_parallel.hf import build_hf_model
from tests._compare import FP32_RTOL, Diff, check, diff

pytest.importorskip("transformers", reason="transformers is in the test extra")

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2
PLANS = Path(__file__).resolve().parents[2] / "examples" / "plans"
ATOL = 2e-5


def _quiet_comm_debug(fn):
    """CommDebugMode's module tracker warns about HF's dataclass outputs; not our concern."""

    @functools.wraps(fn)
    def wrapper(*args):
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="(For backward hooks|Full backward hook)", category=UserWarning
            )
            return fn(*args)

    return wrapper


def _mesh():
    return init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None
    return p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad


def _compare_grads(model: nn.Module, reference: nn.Module) -> dict[str, Diff]:
    ref = dict(reference.named_parameters())
    diffs = {}
    for name, p in model.named_parameters():
        diffs[name] = diff(_grad(p), ref[name].grad)
    assert set(diffs) == set(ref), "both models have the same (tied) parameters"
    return diffs


def _placements(model: nn.Module) -> dict[str, str]:
    return {
        n: repr(list(p.placements)) if isinstance(p, DTensor) else "plain"
        for n, p in model.named_parameters()
    }


# Functional and c10d spellings of one collective (torch picks either, depending on path).
_COLLECTIVE = {
    "all_reduce": "all_reduce",
    "allreduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
}


def _comm_counts(comm: CommDebugMode) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op, n in comm.get_comm_counts().items():
        name = str(op).split(".")[-1]
        key = _COLLECTIVE.get(name, name)
        counts[key] = counts.get(key, 0) + n
    return counts


@_quiet_comm_debug
def _hf_equivalence(family: str, plan_file: str, attn: str, overrides: dict | None = None) -> dict:
    """Parallelize ``family`` from a plan file; compare one training step with one device."""
    model = build_hf_model(family, attn_implementation=attn, **(overrides or {}))
    reference = copy.deepcopy(model)
    parallelize_module(model, _mesh(), plan_file)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)
    )

    with CommDebugMode() as comm:
        out = model(input_ids=ids, labels=ids, use_cache=False)
    ref = reference(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    ref.loss.backward()
    assert not isinstance(out.logits, DTensor), "lm_head hands back gathered plain logits"
    return {
        "logits": (out.logits - ref.logits).abs().max().item(),
        "loss": abs(out.loss.item() - ref.loss.item()),
        "grads": _compare_grads(model, reference),
        "placements": _placements(model),
        "comms": _comm_counts(comm),
        "tied": model.lm_head.weight is model.get_input_embeddings().weight,
        "model": type(model).__name__,
        "sliding_window": getattr(model.config, "sliding_window", None),
    }


def _check_hf_result(results: list[dict], num_layers: int = 2) -> dict:
    r0 = results[0]
    for r in results:
        assert r["logits"] < ATOL, r["logits"]
        assert r["loss"] < ATOL, r["loss"]
        check(r["grads"], atol=ATOL, rtol=FP32_RTOL)
    p = r0["placements"]
    layer = "model.layers.0"
    assert p[f"{layer}.self_attn.q_proj.weight"] == "[Shard(dim=0)]"
    assert p[f"{layer}.self_attn.o_proj.weight"] == "[Shard(dim=1)]"
    assert p[f"{layer}.mlp.up_proj.weight"] == "[Shard(dim=0)]"
    assert p[f"{layer}.mlp.down_proj.weight"] == "[Shard(dim=1)]"
    assert p["model.embed_tokens.weight"] == "[Shard(dim=0)]"
    assert p[f"{layer}.input_layernorm.weight"] == "plain"  # outside the plan
    # One forward: embedding all-reduce, o_proj + down_proj all-reduce per layer,
    # lm_head all-gather of the vocab shards. Nothing else.
    assert r0["comms"] == {"all_reduce": 1 + 2 * num_layers, "all_gather": 1}, r0["comms"]
    return r0


def test_llama_from_plan_file_matches_one_device(dist):
    results = dist.run(_hf_equivalence, "llama", str(PLANS / "hf_llama_tp.yaml"), "eager")
    r0 = _check_hf_result(results)
    assert r0["placements"]["lm_head.weight"] == "[Shard(dim=0)]"
    assert not r0["tied"]


def test_mistral_sliding_window_from_llama_plan_file_matches_one_device(dist):
    """Mistral's layout is Llama's: the same plan file. A window of 8 over 16 tokens
    makes its sliding-window mask (what sets it apart) part of the comparison."""
    results = dist.run(
        _hf_equivalence, "mistral", str(PLANS / "hf_llama_tp.yaml"), "eager", {"sliding_window": 8}
    )
    r0 = _check_hf_result(results)
    assert (r0["model"], r0["sliding_window"]) == ("MistralForCausalLM", 8)
    assert not r0["tied"]


def test_qwen2_tied_biased_sdpa_from_plan_file_matches_one_device(dist):
    results = dist.run(_hf_equivalence, "qwen2", str(PLANS / "hf_qwen2_tp.yaml"), "sdpa")
    r0 = _check_hf_result(results)
    assert r0["placements"]["model.layers.0.self_attn.q_proj.bias"] == "[Shard(dim=0)]"
    assert r0["tied"], "lm_head and embed_tokens share one sharded parameter"


# --------------------------------------------------------------------------- GPT-2 (Conv1D)

_GPT2_MLP_PLAN = {
    "transformer.h.*.mlp.c_fc": colwise(transposed_weight=True, input_name="x"),
    "transformer.h.*.mlp.c_proj": rowwise(
        transposed_weight=True, input_name="x", use_local_output=True
    ),
}


def _gpt2_fused_qkv_refused() -> dict:
    model = build_hf_model("gpt2")
    before = {n: p for n, p in model.named_parameters()}
    plan = {**_GPT2_MLP_PLAN, "transformer.h.*.attn.c_attn": colwise(transposed_weight=True)}
    with pytest.raises(ParallelizeError) as info:
        parallelize_module(model, _mesh(), plan)
    unchanged = all(p is before[n] for n, p in model.named_parameters())
    return {"message": str(info.value), "unchanged": unchanged}


def test_gpt2_fused_qkv_is_refused_and_model_untouched(dist):
    r0 = dist.run(_gpt2_fused_qkv_refused)[0]
    assert r0["unchanged"]
    msg = r0["message"]
    assert "transformer.h.0.attn.c_attn" in msg and "transformer.h.1.attn.c_attn" in msg
    assert "fused q|k|v" in msg and "un-fuse" in msg and "local_map" in msg
    assert "input_name='x'" in msg  # Conv1D.forward(x): the input key is checked too


def _gpt2_mlp_equivalence() -> dict:
    model = build_hf_model("gpt2")
    reference = copy.deepcopy(model)
    parallelize_module(model, _mesh(), _GPT2_MLP_PLAN)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    ref = reference(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    ref.loss.backward()
    return {
        "logits": (out.logits - ref.logits).abs().max().item(),
        "grads": _compare_grads(model, reference),
        "placements": _placements(model),
    }


def test_gpt2_mlp_only_plan_matches_one_device(dist):
    """The alternative the refusal names: c_attn replicated, the Conv1D MLP sharded."""
    for r in dist.run(_gpt2_mlp_equivalence):
        assert r["logits"] < ATOL, r
        check(r["grads"], atol=ATOL, rtol=FP32_RTOL)
    p = r["placements"]
    assert p["transformer.h.0.mlp.c_fc.weight"] == "[Shard(dim=1)]"
    assert p["transformer.h.0.mlp.c_fc.bias"] == "[Shard(dim=0)]"
    assert p["transformer.h.0.mlp.c_proj.weight"] == "[Shard(dim=0)]"
    assert p["transformer.h.0.mlp.c_proj.bias"] == "[Replicate()]"


# --------------------------------------------------------------------------- presets, SP


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


@_quiet_comm_debug
def _sequence_parallel_block() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    reference = copy.deepcopy(model)
    plan = {
        "*.norm": sequence_parallel_norm(),
        "*.up": colwise(input=Shard(1)),
        "*.down": rowwise(output=Shard(1)),
    }
    parallelize_module(model, _mesh(), plan)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
    # The residual stream enters sharded on the sequence and stays so.
    rank = torch.distributed.get_rank()
    local = x.chunk(WORLD_SIZE, dim=1)[rank]
    with CommDebugMode() as comm:
        y = model(DTensor.from_local(local, _mesh(), [Shard(1)]))
    y.full_tensor().sum().backward()
    reference(x).sum().backward()
    return {
        "out": (y.full_tensor() - reference(x)).abs().max().item(),
        "placement": repr(list(y.placements)),
        "grads": _compare_grads(model, reference),
        "comms": _comm_counts(comm),
        "norm_weight": repr(list(model[0].norm.weight.placements)),
    }


def test_sequence_parallel_presets_match_one_device(dist):
    for r in dist.run(_sequence_parallel_block):
        assert r["out"] < ATOL, r
        check(r["grads"], atol=ATOL, rtol=FP32_RTOL)
    assert r["placement"] == "[Shard(dim=1)]"
    assert r["norm_weight"] == "[Replicate()]"
    # Per block: all-gather of the sequence before `up`, reduce-scatter after `down`.
    assert r["comms"] == {"all_gather": 2, "reduce_scatter": 2}, r["comms"]
