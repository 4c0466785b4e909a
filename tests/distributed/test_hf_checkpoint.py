"""Hugging Face checkpoints on 4 gloo ranks: load on a mesh, logits vs transformers, save back.

Checkpoints are written by ``transformers``' ``save_pretrained`` from tiny random
configs (Llama with Llama-3 rope scaling, Qwen3 dense, Qwen3-MoE), in several
safetensors files.
Each mesh loads them with :func:`~hyper_parallel.checkpoint_hf.load_hf` (every rank
reading only its slices) and runs one batch; rank 0's assembled logits must equal
``transformers``' to 1e-5. Saving from the mesh gives back the same tensors bitwise.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed.hf_checks import (
    assert_same_checkpoint,
    rank_logits,
    rank_roundtrip,
    rank_save_over,
    rank_shard_indices,
    write_checkpoint,
)

pytestmark = pytest.mark.distributed
WORLD_SIZE = 4
TOL = 1e-5
MESHES = {
    "llama": [
        {"dp_shard": 2, "tp": 2},
        {"dp_replicate": 2, "dp_shard": 2},
        {"pp": 2, "tp": 2},
        {"cp": 2, "dp_shard": 2},
    ],
    "qwen3": [
        {"dp_shard": 2, "tp": 2},
        {"pp": 2, "dp_shard": 2},
    ],
    "qwen3_moe": [
        {"dp_shard": 2, "tp": 2},
        {"pp": 2, "tp": 2},
        {"cp": 2, "tp": 2},
        {"dp_shard": 2, "tp": 2, "ep": 4},
        {"pp": 2, "dp_shard": 2, "ep": 2},
    ],
}
CASES = [(family, mesh) for family, meshes in MESHES.items() for mesh in meshes]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from hyper_parallel.hf_commands.verify import batch_tokens, hf_logits

    tokens = batch_tokens(128, 4, 16)
    out = {}
    for family in MESHES:
        path = write_checkpoint(family, str(tmp_path_factory.mktemp(family)))
        out[family] = (path, hf_logits(path, tokens))
    return tokens, out


@pytest.mark.parametrize(("family", "mesh"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_logits_equal_transformers(dist, checkpoints, family, mesh):
    tokens, paths = checkpoints
    path, reference = paths[family]
    logits = dist.run(rank_logits, path, mesh, tokens)[0]
    assert not torch.isnan(logits).any(), "some positions were computed by no rank"
    assert (logits - reference).abs().max().item() <= TOL


@pytest.mark.parametrize(
    ("family", "mesh"),
    [("llama", {"dp_shard": 2, "tp": 2}), ("qwen3_moe", {"pp": 2, "dp_shard": 2, "ep": 2})],
)
def test_save_back_is_bitwise_and_reads_only_shards(dist, checkpoints, tmp_path, family, mesh):
    _, paths = checkpoints
    path = paths[family][0]
    out = str(tmp_path / "saved")
    results = dist.run(rank_roundtrip, path, mesh, out)
    assert_same_checkpoint(path, out)
    assert sorted(os.listdir(tmp_path)) == ["saved"]  # written aside, renamed by rank 0
    # Each rank read its shards, not the checkpoint: at most one rotary head per tensor
    # more than it holds (all fp32 here), far below the whole.
    total = sum(p.stat().st_size for p in (tmp_path / "saved").glob("*.safetensors"))
    for read, held in results:
        assert read <= 1.2 * held + 8 * 8 * 4 * 16, (read, held)
        assert read < 0.75 * total


def test_a_full_folder_is_refused_on_every_rank_and_overwrite_replaces_it_whole(
    dist, checkpoints, tmp_path
):
    path = checkpoints[1]["llama"][0]
    out = tmp_path / "saved"
    out.mkdir()
    (out / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    results = dist.run(rank_save_over, path, {"dp_shard": 2, "tp": 2}, str(out))
    assert all(refused for refused, _, _ in results)
    assert_same_checkpoint(path, str(out))
    for _, names, beside in results:
        assert "model-00009-of-00009.safetensors" not in names and beside == ["saved"]


def test_shard_indices_of_uneven_and_strided_shards(dist):
    checked = dist.run(rank_shard_indices)[0]
    assert any("_StridedShard" in c for c in checked), checked  # FSDP2 over a TP shard
