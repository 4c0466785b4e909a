"""``examples/finetune_hf.py`` runs as a user runs it (a mesh of one device, in this process):
a ``transformers``-written Llama is fine-tuned, saved in Hugging Face format, and the saved
model generates the tokens ``transformers`` generates from the same files."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS, NEW_TOKENS = 3, 6


def _example():
    spec = importlib.util.spec_from_file_location(
        "finetune_hf", ROOT / "examples" / "finetune_hf.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_hf_example_trains_saves_and_generates(tmp_path, capsys):
    pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")
    from safetensors.torch import load_file

    example = _example()
    seen = example.main(
        ["--workdir", str(tmp_path), "--steps", str(STEPS), "--max-new-tokens", str(NEW_TOKENS)]
    )
    printed = capsys.readouterr().out

    assert len(seen["losses"]) == STEPS and all(math.isfinite(x) for x in seen["losses"])
    assert seen["losses"][-1] < seen["losses"][0]  # AdamW at lr 1e-3 on the shipped text
    # The saved model is a Hugging Face checkpoint that transformers generates from alike.
    saved = Path(seen["saved"])
    assert (saved / "config.json").is_file() and list(saved.glob("*.safetensors"))
    assert len(seen["tokens"]) == NEW_TOKENS
    assert seen["tokens"] == seen["transformers_tokens"]
    assert "generates the same tokens: True" in printed
    # Fine-tuning changed the weights it loaded (the export is not the input copied).
    before, after = {}, {}
    for folder, into in ((Path(seen["checkpoint"]), before), (saved, after)):
        for f in folder.glob("*.safetensors"):
            into.update(load_file(f))
    assert before.keys() == after.keys()
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(before[name], after[name])
