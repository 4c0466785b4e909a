"""Build a small Hugging Face checkpoint and tokenizer locally (no hub needed).

Trains a byte-level BPE tokenizer with ``tokenizers`` on the text shipped with
hyper_parallel, and saves a randomly initialized ``transformers`` model of the
family's architecture sized to that vocabulary (``save_pretrained``, several
safetensors files), with the tokenizer next to it::

    python examples/hf/make_tiny_checkpoint.py --family llama --out outputs/tiny-llama
    hyper-parallel verify-hf outputs/tiny-llama --mesh dp_shard=2,tp=2

Families: ``llama`` (Llama-3-style, with Llama-3.x rope scaling) and ``qwen3_moe``.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import resources

__all__ = ["build", "train_tokenizer"]

EOS = "<|endoftext|>"


def train_tokenizer(out_path: str, vocab_size: int = 384) -> str:
    """A byte-level BPE ``tokenizer.json`` trained on the shipped text; returns its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = (
        resources.files("hyper_parallel.train") / "data" / "shakespeare_coriolanus.txt"
    ).read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.split("\n\n"), trainer=trainer)
    tokenizer.save(out_path)
    return out_path


def build(
    out: str,
    family: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 384,
    seed: int = 0,
    max_shard_size: str = "200KB",
) -> str:
    """Write a random ``family`` checkpoint plus its tokenizer to ``out``; returns ``out``."""
    import torch
    import transformers

    os.makedirs(out, exist_ok=True)
    tokenizer_path = train_tokenizer(os.path.join(out, "tokenizer.json"), vocab_size)
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(tokenizer_path).token_to_id(EOS)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        eos_token_id=eos,
        bos_token_id=eos,
    )
    torch.manual_seed(seed)
    if family == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, rope_parameters=rope)
        )
    elif family == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **common,
                head_dim=hidden_size // 8,
                moe_intermediate_size=hidden_size // 2,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=True,
            )
        )
    else:
        raise ValueError(f"family {family!r}: llama or qwen3_moe")
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--family", choices=("llama", "qwen3_moe"), default="llama")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    build(
        args.out,
        args.family,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        vocab_size=args.vocab_size,
        seed=args.seed,
    )
    files = sorted(os.listdir(args.out))
    print(f"wrote {args.out}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
