"""``hyper-parallel export-hf CKPT OUT``: a trainer checkpoint (DCP, any mesh) as Hugging Face.

The trainer records which model a checkpoint holds (``train.model_json``: the spec
name, its overrides, for a model that came from Hugging Face the original
``config.json``, and the ``generation_config.json`` its export carries). The checkpoint
is read with ``torch.distributed.checkpoint`` into the unsharded model in this process
(DCP reassembles the shards of whatever mesh saved it) and written with
:func:`~hyper_parallel.checkpoint_hf.save_hf`. A checkpoint without that record takes ``--model`` / ``--model-overrides`` (or
``--hf-config DIR``) instead.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from typing import Any

import torch
from torch import nn

from hyper_parallel.checkpoint_hf.records import MODEL_KEY, tokenizer_files

__all__ = [
    "checkpoint_record",
    "export_hf",
    "load_trainer_checkpoint",
    "recorded_generation_config",
]


def _step_dir(path: str) -> str:
    """The step directory ``path`` names (itself, or a checkpoint directory's newest
    intact step), its files checked against the sizes and CRC-32s saved with them.

    Raises:
        ValueError: No complete checkpoint there, or the one named (every one, for a
            checkpoint directory) is damaged: the bad file and the fix.
    """
    from hyper_parallel.train.checkpoint import (
        NoIntactCheckpointError,
        checkpoint_problem,
        checkpoint_steps,
        latest_checkpoint,
    )

    if os.path.isfile(os.path.join(path, ".metadata")):
        problem = checkpoint_problem(path)  # hashed once per process: export reads it twice
        if problem is not None:
            parent = os.path.dirname(os.path.abspath(path))
            earlier = [p for _, p in checkpoint_steps(parent) if p != os.path.abspath(path)]
            alternative = (
                f", or give the checkpoint directory {parent} (its newest intact step is used)"
                if earlier
                else ""
            )
            raise ValueError(
                f"checkpoint {path} is damaged: {problem}. Fix: restore it from a copy"
                f"{alternative}."
            )
        return path
    try:
        latest = latest_checkpoint(path, distributed=False)
    except NoIntactCheckpointError as e:
        damaged = "; ".join(f"{p} is damaged: {problem}" for p, problem in e.damaged)
        raise ValueError(
            f"no intact checkpoint in {path}: {damaged}. Fix: restore the damaged step "
            "folder(s) from a copy."
        ) from None
    if latest is None:
        raise ValueError(
            f"{path} is neither a complete checkpoint (step directory with .metadata) nor a "
            "directory holding one."
        )
    return latest


def checkpoint_record(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The model record of a trainer checkpoint (step or checkpoint directory), if it has one."""
    return _saved_record(_step_dir(os.fspath(path)))


def _saved_record(path: str) -> dict[str, Any] | None:
    import torch.distributed.checkpoint as dcp

    from hyper_parallel.train.checkpoint import unreadable_as_damaged

    with unreadable_as_damaged(path):
        keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if f"train.{MODEL_KEY}" not in keys:
        return None
    state: dict[str, Any] = {"train": {MODEL_KEY: None}}
    with warnings.catch_warnings(), unreadable_as_damaged(path):
        # DCP's notice that it assumes one process: reading one record is meant to be.
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return json.loads(state["train"][MODEL_KEY])


def recorded_generation_config(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``generation_config.json`` a trainer checkpoint's export carries.

    The one the run recorded (its ``--save-hf`` would carry it), else (a checkpoint
    recorded before the trainer kept it) the one beside the recorded tokenizer, which
    ``export-hf`` copies with it; ``None`` when neither is there.
    """
    from hyper_parallel.checkpoint_hf.config import load_generation_config

    record = record or {}
    if record.get("generation_config") is not None:
        return record["generation_config"]
    tokenizer = record.get("tokenizer")
    if tokenizer and os.path.isfile(tokenizer):
        return load_generation_config(os.path.dirname(tokenizer))
    return None


def load_trainer_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: str | None = None,
    model_overrides: dict[str, Any] | None = None,
    hf_config: dict[str, Any] | None = None,
) -> tuple[nn.Module, Any, dict[str, Any] | None]:
    """The model of a trainer checkpoint, unsharded, in this process.

    Args:
        path: A step directory (``step_000030``) or a checkpoint directory (its latest
            complete step is used).
        model, model_overrides, hf_config: The model, for a checkpoint that does not
            record it (one that does refuses any that differ from its record).

    Returns:
        ``(model, our config, Hugging Face config or None)``.

    Raises:
        ValueError: No complete checkpoint there, the one there is damaged (a file
            that does not match its saved size or CRC-32, or that torch cannot read:
            named, with the fix), no model recorded nor given, or one given that
            differs from the recorded one.
    """
    from hyper_parallel.checkpoint_hf.config import read_hf_config
    from hyper_parallel.checkpoint_hf.specs import register_specs
    from hyper_parallel.dmodule.model_spec import get_spec
    from hyper_parallel.train.checkpoint import load_checkpoint

    register_specs()
    path = _step_dir(os.fspath(path))
    record = _saved_record(path)
    if record is not None:
        _check_given_model(path, record, model, model_overrides, hf_config)
    if record is None:
        if hf_config is not None:
            cfg = read_hf_config(hf_config)
            record = {
                "model": cfg.spec,
                "model_overrides": cfg.model_overrides,
                "hf_config": cfg.raw,
            }
        elif model is not None:
            record = {
                "model": model,
                "model_overrides": model_overrides or {},
                "hf_config": None,
            }
        else:
            raise ValueError(
                f"export-hf: {path} does not record its model (saved before the trainer "
                "did); pass --model NAME [--model-overrides JSON] or --hf-config DIR."
            )
    config = get_spec(record["model"]).config(**record["model_overrides"])
    built = config.build()
    built.init_states()
    load_checkpoint(path, model=built, distributed=False)
    return built, config, record["hf_config"]


def _check_given_model(
    path: str,
    record: dict[str, Any],
    model: str | None,
    model_overrides: dict[str, Any] | None,
    hf_config: dict[str, Any] | None,
) -> None:
    """Refuse a model given for a checkpoint that records another: its weights are the
    recorded model's (the given one used to be ignored without a word)."""
    given = [
        ("--model", model, record["model"], model),
        (
            "--model-overrides",
            model_overrides,
            record["model_overrides"],
            json.dumps(model_overrides, sort_keys=True),
        ),
        ("--hf-config", hf_config, record.get("hf_config"), None),
    ]
    for flag, value, recorded, shown in given:
        if value is None or value == recorded:
            continue
        if flag == "--model-overrides":
            saved = json.dumps(recorded, sort_keys=True)
        elif flag == "--hf-config":
            saved = "another config.json" if recorded is not None else "no Hugging Face config"
        else:
            saved = recorded
        raise ValueError(
            f"{flag}{f' {shown}' if shown else ''} differs from what checkpoint {path} records "
            f"({saved}), whose weights it holds; these options are for a checkpoint that "
            f"records no model. Fix: drop {flag} (the recorded model is used)."
        )


def export_hf(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    tokenizer: str | None = None,
    **model: Any,
) -> list[str]:
    """Write the model of a trainer checkpoint as a Hugging Face checkpoint in ``out``.

    The tokenizer files of the run (:func:`~hyper_parallel.checkpoint_hf.records.tokenizer_files` of the recorded tokenizer)
    are copied along, and the ``generation_config.json`` the run recorded, so
    ``generate --hf-checkpoint OUT`` works on the export. ``out`` is written aside and renamed into place when complete
    (:mod:`~hyper_parallel.checkpoint_hf.outputs`).

    Args:
        checkpoint: Step or checkpoint directory (see :func:`load_trainer_checkpoint`).
        out: Output directory: new or empty, or any with ``overwrite``; never the
            checkpoint's own.
        max_shard_size: Largest safetensors file.
        dtype: Cast the tensors (default: the dtype of the Hugging Face checkpoint the
            run started from when its config.json says bf16 or fp16, else fp32, as the
            parameters are loaded; see :func:`~hyper_parallel.checkpoint_hf.save_hf`).
        overwrite: Replace a non-empty ``out`` (nothing of it is left).
        tokenizer: The ``tokenizer.json`` to ship (default: the one the run recorded).
        **model: ``model``, ``model_overrides`` or ``hf_config`` for a checkpoint
            that does not record its model.

    Returns:
        The safetensors files written.

    Raises:
        OutputError: ``out`` is the checkpoint's folder, or not empty without ``overwrite``.
    """
    from hyper_parallel.checkpoint_hf.io import save_hf
    from hyper_parallel.checkpoint_hf.outputs import check_output

    # The step folder read is an input too: OUT may sit inside the checkpoint directory
    # (a new folder there is harmless), but never on the step it reads.
    step = _step_dir(os.fspath(checkpoint))  # checked once (a checkpoint directory: warned once)
    inputs = [checkpoint, step]
    check_output(out, overwrite=overwrite, inputs=inputs, what="export-hf OUT")
    built, config, hf_config = load_trainer_checkpoint(step, **model)
    record = checkpoint_record(step) or {}
    if tokenizer is None:
        tokenizer = record.get("tokenizer")
        if tokenizer is not None and not os.path.isfile(tokenizer):
            tokenizer = None  # moved since the run; generate then takes --tokenizer
    extra_files = tokenizer_files(tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        generation = record.get("generation_config")
        if generation is not None:
            # The run's (its --save-hf carries the same), wherever its files are now.
            extra_files["generation_config.json"] = os.path.join(tmp, "generation_config.json")
            with open(extra_files["generation_config.json"], "w", encoding="utf-8") as f:
                json.dump(generation, f, indent=2, sort_keys=True)
                f.write("\n")
        return save_hf(
            built,
            out,
            hf_config=hf_config,
            model_config=config,
            max_shard_size=max_shard_size,
            dtype=dtype,
            overwrite=overwrite,
            inputs=inputs,
            extra_files=extra_files,
            what="export-hf OUT",
        )
