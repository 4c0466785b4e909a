"""A family added in one folder (``tests/unit/toy_helium``) plus one registration line
round-trips a ``transformers``-written checkpoint: ``checkpoint_hf`` reads it through
the family's adapter (``ModelFamily.hf``) without naming it.

load (their safetensors) -> our model (logits equal theirs) -> save -> ``transformers``
loads ours (logits equal again, every tensor bitwise the original).
"""

from __future__ import annotations

import os

import pytest
import torch

from hyper_parallel.checkpoint_hf import load_hf, read_hf_config, save_hf
from hyper_parallel.checkpoint_hf.config import HFConfigError, hf_architectures
from hyper_parallel.dmodule.model_spec import list_specs
from hyper_parallel.models.common.family import register_hf_spec
from tests.distributed.hf_checks import assert_same_checkpoint
from tests.unit import toy_helium

transformers = pytest.importorskip("transformers")

# The one registration line.
if "toy-helium-hf" not in list_specs():
    register_hf_spec(toy_helium.FAMILY, toy_helium.helium_hf_config)

# fp32 logits of a 2-layer, 64-wide model: each of the ~10 matmuls on the path to a
# logit rounds at 2**-24 relative to its operands (|x| ~ 1-10 here), summed over
# 64-128 terms; 1e-5 is ~10x that bound and far below a wrong mapping's ~1e-1
# (test_the_rotary_permutation_is_needed's scale).
TOL = 1e-5


def _helium(path: str) -> str:
    torch.manual_seed(0)
    config = transformers.HeliumConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    model = transformers.HeliumForCausalLM(config).eval()
    model.save_pretrained(path, max_shard_size="60KB")
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) >= 2
    return path


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def test_the_toy_family_is_read_by_its_own_adapter(tmp_path) -> None:
    path = _helium(str(tmp_path / "in"))
    assert hf_architectures()["HeliumForCausalLM"] is toy_helium.FAMILY
    cfg = read_hf_config(path)
    assert (cfg.family, cfg.spec) == ("toy_helium", "toy-helium-hf")
    assert cfg.model_overrides["head_dim"] == 16


def test_a_transformers_checkpoint_of_the_toy_family_round_trips(tmp_path) -> None:
    path = _helium(str(tmp_path / "in"))
    cfg = read_hf_config(path)
    model = cfg.model_config().build()
    model.init_states()
    load_hf(model, path)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    reference = _logits(theirs, tokens)
    assert reference.abs().max().item() > 100 * TOL  # a reference, not zeros
    assert (_logits(model, tokens) - reference).abs().max().item() <= TOL
    out = str(tmp_path / "out")
    save_hf(model, out, hf_config=cfg, max_shard_size="60KB")
    assert_same_checkpoint(path, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "HeliumForCausalLM"
    assert torch.equal(_logits(back, tokens), reference)


def test_a_field_the_toy_family_does_not_implement_is_refused_by_name(tmp_path) -> None:
    path = _helium(str(tmp_path / "in"))
    raw = dict(read_hf_config(path).raw, attention_bias=True)
    with pytest.raises(HFConfigError, match="attention_bias=true: false: our q/k/v/o have no bias"):
        read_hf_config(raw)
