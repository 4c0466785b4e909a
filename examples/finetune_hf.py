"""Fine-tune a Hugging Face Llama on a mesh, save it in Hugging Face format, generate.

The whole path a Python user takes, in one file:

1. a checkpoint written by ``transformers`` (``--checkpoint DIR``; without one, a tiny
   Llama is written with ``save_pretrained`` into a temporary directory);
2. :class:`~hyper_parallel.train.TrainConfig` with ``hf_checkpoint``: the trainer builds
   the model for the mesh and each rank reads only its slices of the safetensors files;
   a few optimizer steps on the shipped text (or ``--data``); ``save_hf`` writes the
   trained model back in Hugging Face format;
3. the saved model, loaded on one process, generates a few tokens greedily
   (:func:`hyper_parallel.hf_commands.generate.generate`), and ``transformers`` loads
   the same files and generates the same tokens.

Run it in one process (a mesh of one device)::

    python examples/finetune_hf.py

or on two gloo ranks (FSDP2 over ``dp_shard=2``; any mesh whose size is the number of
ranks works, e.g. ``--mesh tp=2``)::

    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py --mesh dp_shard=2

Your own checkpoint and text: ``--checkpoint DIR --data corpus.jsonl`` (text data needs
the checkpoint's ``tokenizer.json``, or ``--tokenizer FILE``). Needs the ``hf`` extra.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.checkpoint_hf import load_hf, read_hf_config
from hyper_parallel.hf_commands.generate import generate
from hyper_parallel.train import TrainConfig, Trainer
from hyper_parallel.train.arguments import parse_mesh

__all__ = ["main", "write_tiny_llama"]

PROMPT = "First Citizen:"


def write_tiny_llama(out: str, seed: int = 0) -> str:
    """Write a small random ``LlamaForCausalLM`` to ``out`` with ``save_pretrained``.

    Its vocabulary is the 256 byte values, so the trainer's shipped text (read as bytes)
    and a byte prompt need no tokenizer.
    """
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(out, max_shard_size="100KB")
    return out


def _shared_dir(rank: int, given: str | None) -> str:
    """``given``, else a temporary directory made by rank 0; its path sent to every rank."""
    if given is not None:
        return given
    path = [tempfile.mkdtemp(prefix="finetune_hf_") if rank == 0 else ""]
    if dist.is_initialized():
        dist.broadcast_object_list(path, src=0)
    return path[0]


def _encode(text: str, checkpoint: str) -> tuple[list[int], Any]:
    """Token ids of ``text`` and a decoder: the checkpoint's tokenizer, else bytes."""
    path = os.path.join(checkpoint, "tokenizer.json")
    if os.path.isfile(path):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(path)
        return tokenizer.encode(text).ids, tokenizer.decode
    return list(text.encode("utf-8")), lambda ids: bytes(ids).decode("utf-8", "replace")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Fine-tune, save and generate; returns what rank 0 saw (empty on other ranks)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="a transformers checkpoint (default: a tiny Llama)")
    parser.add_argument("--workdir", help="where the tiny checkpoint and the output go (temp)")
    parser.add_argument("--out", help="where the fine-tuned model goes (default: in --workdir)")
    parser.add_argument("--mesh", help="mesh axes, e.g. dp_shard=2 (default: all ranks as dp)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--data", help="training data (default: the shipped text)")
    parser.add_argument("--tokenizer", help="tokenizer.json for text --data")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")  # torchrun's variables say where the others are
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        work = _shared_dir(rank, args.workdir)
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = os.path.join(work, "tiny-llama")
            if rank == 0:
                write_tiny_llama(checkpoint)
            if dist.is_initialized():
                dist.barrier()  # the files exist before any rank reads them
        out = args.out or os.path.join(work, "finetuned")
        mesh = parse_mesh(args.mesh) if args.mesh else ({"dp_shard": world} if world > 1 else {})

        # 2. Train: the model comes from the checkpoint (its config and weights).
        cfg = TrainConfig(
            hf_checkpoint=checkpoint,
            mesh=mesh,
            steps=args.steps,
            batch_size=4,
            seq_len=32,
            lr=1e-3,
            warmup_steps=1,
            data=args.data,
            tokenizer=args.tokenizer,
            save_hf=out,
            log_every=1,
            progress=False,
        )
        result = Trainer(cfg, device="cpu").fit()
        if rank != 0:
            return {}

        # 3. Generate from the saved Hugging Face files, on this process.
        hf = read_hf_config(out)
        model = hf.model_config().build()
        model.init_states()
        load_hf(model, out)
        prompt, decode = _encode(PROMPT, checkpoint)
        ours = generate(model, prompt, args.max_new_tokens)
        print(f"generate: {PROMPT!r} -> {decode(ours)!r}")

        import transformers

        reference = transformers.AutoModelForCausalLM.from_pretrained(out)
        with torch.no_grad():
            theirs = reference.generate(
                torch.tensor([prompt]),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                min_new_tokens=args.max_new_tokens,
            )[0, len(prompt) :].tolist()
        print(f"transformers loads {out} and generates the same tokens: {theirs == ours}")
        return {
            "checkpoint": checkpoint,
            "saved": out,
            "losses": result.losses,
            "prompt": prompt,
            "tokens": ours,
            "transformers_tokens": theirs,
        }
    finally:
        if dist.is_initialized():
            dist.barrier()  # rank 0 done with the files before any rank leaves
            dist.destroy_process_group()


if __name__ == "__main__":
    seen = main()
    sys.exit(0 if not seen or seen["tokens"] == seen["transformers_tokens"] else 1)
