"""The README's Hugging Face walkthrough, command by command, on 4 gloo ranks.

1. ``examples/hf/make_tiny_checkpoint.py`` builds a checkpoint and a tokenizer;
2. the training command's options (``--hf-checkpoint --data --mesh dp_shard=2,tp=2
   --save-hf --checkpoint-dir``) fine-tune it on a local ``.jsonl`` corpus (the
   options parsed by ``train.run``'s parser, the run on this module's rank pool);
3. ``transformers`` loads the saved model with no missing or unexpected keys, and
   its logits equal ours;
4. ``hyper-parallel export-hf`` of the DCP checkpoint (saved at dp_shard=2 x tp=2)
   gives the same tensors bitwise;
5. ``hyper-parallel generate`` prints transformers' greedy continuation;
6. ``hyper-parallel verify-hf`` (its own torchrun ranks) ends with ``PASS``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.distributed.hf_checks import assert_same_checkpoint

pytestmark = pytest.mark.distributed
WORLD_SIZE = 4
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
TRAIN_ARGS = "--steps 3 --batch-size 4 --seq-len 32 --lr 1e-3 --log-every 1 --no-progress"


def _train(argv: list[str]) -> list[float]:
    from hyper_parallel.train import Trainer
    from hyper_parallel.train.run import add_train_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    cfg = config_from_args(parser.parse_args(argv), world_size=4)
    return Trainer(cfg, device="cpu").fit().losses


@pytest.fixture(scope="module")
def walkthrough(dist, tmp_path_factory):
    root = tmp_path_factory.mktemp("walk")
    spec = importlib.util.spec_from_file_location(
        "make_tiny_checkpoint", os.path.join(ROOT, "examples", "hf", "make_tiny_checkpoint.py")
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tiny = str(root / "tiny-llama")
    assert example.main(["--out", tiny]) == 0
    corpus = root / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"Note {i}: what is the city but the people? " * 3}) + "\n")
    out, ckpt = str(root / "finetuned"), str(root / "ckpt")
    argv = [
        "--hf-checkpoint", tiny, "--data", str(corpus), "--mesh", "dp_shard=2,tp=2",
        *TRAIN_ARGS.split(), "--save-hf", out, "--checkpoint-dir", ckpt,
    ]  # fmt: skip
    losses = dist.run(_train, argv)
    return {"tiny": tiny, "out": out, "ckpt": ckpt, "losses": losses, "root": root}


def test_fine_tune_saves_a_checkpoint_transformers_loads(walkthrough):
    from transformers import AutoModelForCausalLM

    from hyper_parallel.checkpoint_hf import load_hf, read_hf_config

    losses = walkthrough["losses"]
    assert all(r == losses[0] for r in losses) and len(losses[0]) == 3
    out = walkthrough["out"]
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    # Trained: not the starting weights; and our model of the saved files agrees.
    start = AutoModelForCausalLM.from_pretrained(walkthrough["tiny"])
    assert not torch.equal(start.lm_head.weight, model.lm_head.weight)
    cfg = read_hf_config(out)
    ours = cfg.model_config().build()
    ours.init_states()
    load_hf(ours, out)
    tokens = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(tokens) - model(tokens).logits).abs().max().item() <= 1e-5


def test_export_hf_of_the_mesh_checkpoint_equals_save_hf(walkthrough, capsys):
    from hyper_parallel.cli import main

    exported = str(walkthrough["root"] / "exported")
    assert main(["export-hf", walkthrough["ckpt"], exported, "--max-shard-size", "200KB"]) == 0
    assert "safetensors file(s)" in capsys.readouterr().out
    assert_same_checkpoint(walkthrough["out"], exported)


def test_generate_prints_transformers_greedy_continuation(walkthrough, capsys):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from hyper_parallel.cli import main
    from hyper_parallel.hf_commands.commands import printable

    out = walkthrough["out"]
    prompt = "First Citizen:"
    argv = ["generate", "--hf-checkpoint", out, "--prompt", prompt, "--max-new-tokens", "12"]
    assert main([*argv, "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    tokenizer = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    ids = tokenizer.encode(prompt).ids
    assert result["prompt_ids"] == ids
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    theirs = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    expected = theirs[0, len(ids) :].tolist()
    assert result["ids"] == expected
    assert main(argv) == 0  # the prompt, then its continuation, as one text
    assert capsys.readouterr().out.strip() == printable(tokenizer.decode(ids + expected)).strip()
    # The trainer checkpoint generates the same (it records its model and tokenizer).
    assert main(["generate", "--checkpoint", walkthrough["ckpt"], "--prompt", prompt,
                 "--max-new-tokens", "12", "--format", "json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["ids"] == expected


def test_verify_hf_command_passes_on_local_ranks(walkthrough):
    env = {**os.environ, "PYTHONPATH": os.path.abspath(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "hyper_parallel.cli", "verify-hf", walkthrough["out"],
         "--mesh", "tp=2"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert last.startswith("parity: max_abs_logit_diff=") and last.endswith("tol=1e-5 PASS")


def test_verify_hf_refuses_an_unsupported_config_with_exit_2(tmp_path):
    from hyper_parallel.cli import main

    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "attention_bias": True})
    )
    assert main(["verify-hf", str(tmp_path), "--mesh", "tp=2"]) == 2
