"""Subcommands of ``hyper-parallel``: ``train``, ``verify-hf``, ``export-hf``, ``generate``,
``tokenize``.

:func:`add_commands` adds them to the command line's subparsers (one call in
:mod:`hyper_parallel.cli`); each returns an exit status (0 success, 1 failure, 2 a
usage error such as a missing file or an unsupported config field).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["add_commands", "load_tokenizer", "printable"]


def _json_object(text: str) -> dict[str, Any]:
    from hyper_parallel.train.arguments import json_object

    return json_object(text)


def add_commands(sub: Any) -> None:
    """Add ``train``, ``verify-hf``, ``export-hf``, ``generate``, ``tokenize`` to ``sub``."""
    from hyper_parallel.hf_commands import verify

    r = sub.add_parser(
        "train",
        add_help=False,  # --help goes to the trainer's own parser
        help="train a model on an N-D mesh (one process per rank under torchrun); the "
        "options of python -m hyper_parallel.train.run (train --help lists them)",
    )
    r.add_argument("options", nargs=argparse.REMAINDER)  # cli.main passes them on itself
    r.set_defaults(func=_train)

    v = sub.add_parser(
        "verify-hf",
        help="load a Hugging Face checkpoint on local ranks; compare logits with transformers",
        description="Load a Hugging Face checkpoint on a mesh of local gloo ranks, run one "
        "batch and compare logits and loss with transformers on one process. Last line: "
        "parity: max_abs_logit_diff=X loss_diff=Y tol=T PASS|FAIL.",
    )
    verify.add_arguments(v)
    v.set_defaults(func=verify.run)

    e = sub.add_parser(
        "export-hf",
        help="write a trainer checkpoint (any mesh) as a Hugging Face checkpoint",
        description="Read a trainer checkpoint (torch.distributed.checkpoint, saved at any "
        "mesh) and write safetensors shards, their index and config.json.",
    )
    e.add_argument("checkpoint", help="step directory, or a checkpoint directory (latest step)")
    e.add_argument("out", help="output directory")
    e.add_argument(
        "--max-shard-size",
        default="5GB",
        type=_shard_size,
        help="largest file: 5GB, 500MB, 2GiB or bytes (default 5GB)",
    )
    e.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="dtype of the tensors written (default: that of the Hugging Face checkpoint the "
        "run started from when its config.json says bf16 or fp16, else fp32)",
    )
    e.add_argument("--model", help="model, for a checkpoint that does not record it")
    e.add_argument("--model-overrides", type=_json_object, default=None)
    e.add_argument("--hf-config", help="config.json (or its directory) of the model")
    e.add_argument(
        "--tokenizer", help="tokenizer.json to ship with it (default: the run's, as recorded)"
    )
    e.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty OUT (its old files all go; the checkpoint's own folder is "
        "always refused)",
    )
    e.set_defaults(func=_export)

    g = sub.add_parser(
        "generate",
        help="sample a continuation of a prompt on one process (KV cache)",
        description="Load a model on one process and print the continuation of --prompt "
        "(greedy by default).",
    )
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-checkpoint", help="Hugging Face checkpoint directory")
    source.add_argument("--checkpoint", help="trainer checkpoint (step or checkpoint directory)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32, help="most tokens to add")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample"
    )
    g.add_argument(
        "--top-k", type=int, default=None, help="sample among the K most likely tokens only"
    )
    g.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample within the smallest set of tokens holding this probability (nucleus)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--tokenizer",
        help="tokenizer.json (default: the checkpoint's; bytes for a 256-token model without one)",
    )
    g.add_argument("--format", choices=("text", "json"), default="text")
    g.set_defaults(func=_generate)

    t = sub.add_parser(
        "tokenize",
        help="tokenize text files (.txt, .jsonl) once into a token file for --data",
        description="Tokenize .txt (one document each) and .jsonl (one per line) files with a "
        "tokenizers tokenizer.json on several processes. Documents are separated as the "
        "trainer's text --data separates them: --eos-id, else the first eos_token_id of "
        "--hf-checkpoint's config.json, else that of the config.json beside the tokenizer, "
        "else the tokenizer's EOS token (<|endoftext|>, </s>, ...).",
    )
    t.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt or .jsonl files")
    t.add_argument(
        "--tokenizer",
        help="tokenizers tokenizer.json (default: --hf-checkpoint's)",
    )
    t.add_argument(
        "--hf-checkpoint",
        metavar="DIR",
        help="the Hugging Face checkpoint the token file trains: its config.json's "
        "eos_token_id separates documents, as the trainer's --hf-checkpoint DIR does",
    )
    t.add_argument("--out", required=True, help="token file to write: .bin or .npy")
    t.add_argument("--text-field", default="text", help="the .jsonl field (default text)")
    t.add_argument(
        "--eos-id",
        type=int,
        default=None,
        help="separator id (default: --hf-checkpoint's eos_token_id, else the one of the "
        "config.json beside the tokenizer, else the tokenizer's EOS token)",
    )
    t.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="processes")
    t.add_argument("--no-progress", dest="progress", action="store_false")
    t.add_argument("--overwrite", action="store_true", help="replace a file --out names")
    t.set_defaults(func=_tokenize)


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _shard_size(text: str) -> str:
    """``argparse`` type of ``--max-shard-size``: checked before anything is read."""
    from hyper_parallel.checkpoint_hf.io import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _train(args: argparse.Namespace) -> int:
    from hyper_parallel.train.run import main

    return main(args.options, prog="hyper-parallel train")


def _export(args: argparse.Namespace) -> int:
    import torch

    from hyper_parallel.hf_commands.export import export_hf

    model: dict[str, Any] = {}
    if args.model:
        model["model"] = args.model
    if args.model_overrides is not None:  # checked against a recorded model too
        model["model_overrides"] = args.model_overrides
    if args.hf_config:
        from hyper_parallel.checkpoint_hf.config import load_config_json

        model["hf_config"] = load_config_json(args.hf_config)[0]
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    try:
        files = export_hf(
            args.checkpoint,
            args.out,
            max_shard_size=args.max_shard_size,
            dtype=dtype,
            overwrite=args.overwrite,
            tokenizer=args.tokenizer,
            **model,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"hyper-parallel export-hf: error: {err}", file=sys.stderr)
        return 2
    extra = sorted(set(os.listdir(args.out)) - {os.path.basename(f) for f in files})
    print(f"export-hf: wrote {len(files)} safetensors file(s) and {', '.join(extra)} to {args.out}")
    with open(os.path.join(args.out, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f).get("vocab_size")
    if "tokenizer.json" not in extra and vocab != 256:  # 256: bytes, no tokenizer needed
        print(
            "export-hf: no tokenizer recorded for this checkpoint; generate on the export needs "
            "--tokenizer FILE (or rerun export-hf with --tokenizer FILE)",
            file=sys.stderr,
        )
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    from hyper_parallel.checkpoint_hf.outputs import check_output_file
    from hyper_parallel.train.tokens import token_file_paths, tokenize_files

    tokenizer = args.tokenizer
    if tokenizer is None and args.hf_checkpoint:
        tokenizer = os.path.join(args.hf_checkpoint, "tokenizer.json")  # as the trainer
    if tokenizer is None:
        print(
            "hyper-parallel tokenize: error: give --tokenizer FILE (a tokenizers "
            "tokenizer.json) or --hf-checkpoint DIR holding one",
            file=sys.stderr,
        )
        return 2
    try:
        inputs = [*args.inputs, tokenizer]
        check_output_file(args.out, overwrite=args.overwrite, inputs=inputs, what="tokenize --out")
        # Then its kind (.bin/.npy) and a .bin's sidecar (PATH.json), kept as --out is: all
        # before the corpus is read.
        for sidecar in token_file_paths(args.out)[1:]:
            check_output_file(
                sidecar, overwrite=args.overwrite, inputs=inputs, what="tokenize --out's sidecar"
            )
        if args.text_field != "text" and not any(p.endswith(".jsonl") for p in args.inputs):
            # As the trainer says it (a flag that does nothing is said, not dropped).
            print(
                f"note: --text-field {args.text_field}: no .jsonl input, so tokenize does not "
                "use it (a .txt file is one document). Fix: drop it.",
                file=sys.stderr,
            )
        count = tokenize_files(
            args.inputs,
            args.out,
            tokenizer=tokenizer,
            text_field=args.text_field,
            eos=args.eos_id,
            hf_checkpoint=args.hf_checkpoint,
            workers=max(1, args.workers),
            progress=args.progress,
        )
    except ValueError as err:  # OutputError is one
        print(f"hyper-parallel tokenize: error: {err}", file=sys.stderr)
        return 2
    print(f"tokenize: {count} tokens from {len(args.inputs)} file(s) -> {args.out}")
    return 0


class _Bytes:
    """Bytes as tokens (the shipped text's vocabulary), for a 256-token model."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class _Tokenizer:
    def __init__(self, path: str) -> None:
        from hyper_parallel.train.tokens import load_tokenizer

        self.tokenizer = load_tokenizer(path)  # a file tokenizers cannot read: ValueError

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def load_tokenizer(path: str | None, default_dirs: list[str], vocab_size: int) -> Any:
    """A tokenizer: ``path``, else ``tokenizer.json`` in one of ``default_dirs``, else bytes.

    Raises:
        FileNotFoundError: ``path`` is missing, or none is found and the model's
            vocabulary is not bytes (256).
        ValueError: A file ``tokenizers`` cannot read.
    """
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"--tokenizer {path}: no such file (a tokenizers tokenizer.json)."
            )
        return _Tokenizer(path)
    for folder in default_dirs:
        candidate = os.path.join(folder, "tokenizer.json")
        if os.path.isfile(candidate):
            return _Tokenizer(candidate)
    if vocab_size == 256:
        return _Bytes()
    raise FileNotFoundError(
        f"no tokenizer.json in {default_dirs}; pass --tokenizer FILE (a tokenizers tokenizer.json)."
    )


def _generate(args: argparse.Namespace) -> int:
    from hyper_parallel.hf_commands.generate import check_sampling, generate

    try:
        # Before the model is read: a sampling setting out of range.
        check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
        if args.hf_checkpoint:
            from hyper_parallel.checkpoint_hf import load_hf, read_hf_config

            cfg = read_hf_config(args.hf_checkpoint)
            model = cfg.model_config().build()
            model.init_states()
            load_hf(model, args.hf_checkpoint)
            # Stop where transformers' generate does: generation_config.json's
            # eos_token_id when the checkpoint has one, else config.json's.
            eos, dirs = cfg.stop_token_ids, [args.hf_checkpoint]
        else:
            from hyper_parallel.checkpoint_hf.config import stop_token_ids
            from hyper_parallel.hf_commands.export import (
                _step_dir,
                checkpoint_record,
                load_trainer_checkpoint,
                recorded_generation_config,
            )

            step = _step_dir(args.checkpoint)  # checked once (its checksums: a damaged file)
            model, _, hf_config = load_trainer_checkpoint(step)
            record = checkpoint_record(step) or {}
            # As transformers' generate on this checkpoint's export stops.
            eos = stop_token_ids(hf_config, recorded_generation_config(record))
            # The run's tokenizer (recorded), else one next to the checkpoint.
            recorded = record.get("tokenizer")
            dirs = [os.path.dirname(recorded)] if recorded else []
            dirs += [args.checkpoint, os.path.dirname(os.path.abspath(args.checkpoint))]
        vocab = model.tok_embeddings.num_embeddings
        tokenizer = load_tokenizer(args.tokenizer, dirs, vocab)
        prompt = tokenizer.encode(args.prompt)
        bad = [t for t in prompt if t >= vocab]
        if bad:
            raise ValueError(
                f"the tokenizer gives ids {sorted(set(bad))[:5]} >= the model's vocabulary "
                f"{vocab}; use the tokenizer the model was trained with."
            )
        ids = generate(
            model,
            prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            eos_token_ids=eos,
        )
    except (ValueError, FileNotFoundError) as err:
        print(f"hyper-parallel generate: error: {err}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps({"prompt_ids": prompt, "ids": ids, "text": tokenizer.decode(ids)}))
    else:
        # The prompt and its continuation, as one text (decoded together: a tokenizer may
        # join the two), with control characters shown escaped rather than sent to the
        # terminal (a small or untrained model emits them).
        print(printable(tokenizer.decode(prompt + ids)))
    return 0


def printable(text: str) -> str:
    """``text`` with every control character but newline and tab written as an escape
    (``\\x1b``), so generated bytes cannot drive the terminal."""
    import unicodedata

    return "".join(
        ch.encode("unicode_escape").decode("ascii")
        if unicodedata.category(ch) == "Cc" and ch not in "\n\t"
        else ch
        for ch in text
    )
