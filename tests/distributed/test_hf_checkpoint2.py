"""Hugging Face checkpoints on 2 gloo ranks, one axis at a time: tp, tp+sp, pp, cp, ep.

The same checks as ``test_hf_checkpoint.py`` (logits equal ``transformers``' to
1e-5) on the single-axis meshes, plus a bf16 checkpoint loaded into fp32 states.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.hf_checks import rank_logits, write_checkpoint

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2
TOL = 1e-5
CASES = [
    ("llama", {"tp": 2}),
    ("llama", {"pp": 2}),
    ("llama", {"cp": 2}),
    ("qwen3", {"tp": 2}),
    ("qwen3", {"cp": 2}),
    ("qwen3_moe", {"tp": 2}),
    ("qwen3_moe", {"dp_shard": 2, "ep": 2}),
    ("qwen3_moe", {"pp": 2}),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from hyper_parallel.hf_commands.verify import batch_tokens, hf_logits

    tokens = batch_tokens(128, 4, 16)
    out = {}
    for family, dtype in (
        ("llama", torch.float32),
        ("qwen3", torch.float32),
        ("qwen3_moe", torch.float32),
        ("llama", torch.bfloat16),
    ):
        path = write_checkpoint(family, str(tmp_path_factory.mktemp(family)), dtype=dtype)
        out[family, dtype] = (path, hf_logits(path, tokens))
    return tokens, out


@pytest.mark.parametrize(("family", "mesh"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_logits_equal_transformers(dist, checkpoints, family, mesh):
    tokens, paths = checkpoints
    path, reference = paths[family, torch.float32]
    logits = dist.run(rank_logits, path, mesh, tokens)[0]
    assert not torch.isnan(logits).any()
    assert (logits - reference).abs().max().item() <= TOL


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_tensor_and_sequence_parallel_logits_equal_transformers(dist, checkpoints, family):
    tokens, paths = checkpoints
    path, reference = paths[family, torch.float32]
    logits = dist.run(rank_logits, path, {"tp": 2}, tokens, True)[0]
    assert (logits - reference).abs().max().item() <= TOL


def test_bf16_checkpoint_loads_into_fp32_states(dist, checkpoints):
    # transformers upcasts the bf16 file to fp32 as well: the same numbers.
    tokens, paths = checkpoints
    path, reference = paths["llama", torch.bfloat16]
    logits = dist.run(rank_logits, path, {"tp": 2}, tokens)[0]
    assert (logits - reference).abs().max().item() <= TOL
