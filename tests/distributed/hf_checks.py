"""Shared by the Hugging Face checkpoint tests: tiny checkpoints written by transformers.

Each is a random model from a small config, saved with ``save_pretrained`` into at
least two safetensors files (``max_shard_size``); the rank functions load it on a
mesh and hand rank 0's assembled logits back.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    eos_token_id=2,
    bos_token_id=1,
)


def hf_model(family: str, **overrides: Any) -> Any:
    """A random ``transformers`` model of ``family`` (``llama``, ``qwen3``, ``qwen3_moe``), fp32."""
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 10000.0,
        }
        config = transformers.LlamaConfig(**{**_COMMON, "rope_parameters": rope, **overrides})
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen3":
        # head_dim 16 apart from hidden_size / heads, as Qwen3 allows.
        config = transformers.Qwen3Config(**{**_COMMON, "head_dim": 16, **overrides})
        model = transformers.Qwen3ForCausalLM(config)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **{
                **_COMMON,
                "head_dim": 8,
                "moe_intermediate_size": 32,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "norm_topk_prob": True,
                **overrides,
            }
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        raise ValueError(family)
    return model.eval()


def write_checkpoint(
    family: str, path: str, dtype: torch.dtype = torch.float32, **overrides: Any
) -> str:
    """Save a random ``family`` model to ``path`` in several safetensors files; returns ``path``."""
    model = hf_model(family, **overrides).to(dtype)
    model.save_pretrained(path, max_shard_size="60KB")
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(files) >= 2, files
    return path


def rank_logits(path: str, mesh: dict[str, int], tokens: torch.Tensor, sp: bool = False) -> Any:
    """On every rank: load ``path`` on ``mesh`` (``sp``: sequence parallel); rank 0 returns
    the batch's logits."""
    from hyper_parallel.hf_commands.verify import mesh_logits

    torch.manual_seed(123)  # the random init is overwritten by the checkpoint
    logits, _ = mesh_logits(path, mesh, tokens, sp)
    return logits


def rank_roundtrip(path: str, mesh: dict[str, int], out: str) -> Any:
    """On every rank: load ``path`` on ``mesh`` and save it back to ``out``.

    Returns this rank's bytes read and the global bytes of the parameters it holds
    (its shards' share), for the bytes-per-rank check.
    """
    from torch.distributed.tensor import DTensor

    from hyper_parallel.checkpoint_hf import save_hf
    from hyper_parallel.hf_commands.verify import load_on_mesh

    loaded = load_on_mesh(path, mesh)
    save_hf(loaded.parts, out, hf_config=loaded.report.config, max_shard_size="60KB")
    local = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * 4
        for part in loaded.parts
        for p in part.parameters()
    )
    return loaded.report.bytes_read, local


def rank_save_over(path: str, mesh: dict[str, int], out: str) -> Any:
    """On every rank: load ``path`` on ``mesh``; saving into the full ``out`` is refused on
    every rank (before any collective: no rank hangs), then replaced with ``overwrite``.

    Returns whether this rank was refused, and what ``out`` and its parent hold after.
    """
    from hyper_parallel.checkpoint_hf import save_hf
    from hyper_parallel.checkpoint_hf.outputs import OutputError
    from hyper_parallel.hf_commands.verify import load_on_mesh

    loaded = load_on_mesh(path, mesh)
    try:
        save_hf(loaded.parts, out, hf_config=loaded.report.config, max_shard_size="60KB")
        refused = False
    except OutputError:
        refused = True
    save_hf(
        loaded.parts, out, hf_config=loaded.report.config, max_shard_size="60KB", overwrite=True
    )
    return refused, sorted(os.listdir(out)), sorted(os.listdir(os.path.dirname(out)))


def assert_same_checkpoint(original: str, saved: str) -> None:
    """Every tensor of ``original`` is in ``saved``, bitwise; transformers loads ``saved`` cleanly."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hyper_parallel.checkpoint_hf import checkpoint_files

    a, b = checkpoint_files(original), checkpoint_files(saved)
    assert set(a) == set(b), set(a) ^ set(b)
    for name in a:
        with safe_open(a[name], "pt") as fa, safe_open(b[name], "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert len([f for f in os.listdir(saved) if f.endswith(".safetensors")]) >= 2
    _, info = AutoModelForCausalLM.from_pretrained(saved, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info


def rank_shard_indices() -> list[str]:
    """On 4 ranks: ``shard_indices`` of uneven and FSDP-over-TP (strided) shards pick the
    local tensor out of the full one. Returns the placements checked."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from hyper_parallel.checkpoint_hf.shards import shard_indices

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(7 * 5, dtype=torch.float32).view(7, 5)
    tensors = [
        distribute_tensor(full, mesh, p)
        for p in ([Shard(0), Shard(0)], [Shard(1), Shard(0)], [Replicate(), Shard(1)])
    ]
    torch.manual_seed(0)
    linear = nn.Linear(5, 7, bias=False)  # 7 rows: uneven over tp=2 and then dp=2
    parallelize_module(linear, mesh["tp"], ColwiseParallel())
    fully_shard(linear, mesh=mesh["dp"])
    tensors.append(linear.weight)
    checked = []
    for t in tensors:
        index = shard_indices(t)
        whole = t.full_tensor()
        picked = whole[index[0][:, None], index[1][None, :]]
        assert torch.equal(picked, t.to_local()), (t.placements, index)
        checked.append(str(t.placements))
    return checked
