"""What the trainer does with Hugging Face checkpoints, your own data and TensorBoard.

Kept apart from :mod:`hyper_parallel.train.trainer`, which calls these at a few fixed
points:

- :func:`resolve_model` (where a run is built from options: ``train.run``, the demo,
  the :class:`~hyper_parallel.train.Trainer`): ``hf_checkpoint`` (or ``hf_config``)
  sets the model to the checkpoint's (``llama3-hf`` / ``qwen3-moe-hf`` with its sizes;
  user ``model_overrides`` on top), reading its ``config.json`` once for the run; the
  other hooks take what it read (``TrainConfig`` itself is data and reads no file);
- :func:`load_weights` (after the model is built on the mesh): :func:`load_hf`, each
  rank reading only its shards;
- :func:`build_data` (the data stream): ``data`` (token files or text with a
  tokenizer, :mod:`hyper_parallel.train.tokens`), else the shipped text;
- :func:`model_record` (checkpoint ``train`` state): which model this is, so
  ``export-hf`` and ``generate --checkpoint`` need nothing else;
- :func:`save_weights` (end of training): ``save_hf`` to ``save_hf``;
- :class:`StepLogger`: loss, learning rate, gradient norm, tokens/s, MFU and peak
  memory per step to TensorBoard (``tensorboard``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = [
    "HF_ARGUMENT_FIELDS",
    "StepLogger",
    "build_data",
    "hf_model",
    "load_weights",
    "model_record",
    "peak_flops",
    "register_hf_specs",
    "replaced_model_note",
    "resolve_model",
    "save_weights",
    "tokenizer_path",
]

HF_ARGUMENT_FIELDS = ("hf_checkpoint", "save_hf", "data", "tokenizer", "text_field", "tensorboard")
"""``TrainConfig`` fields these hooks read; each has a command-line option
(:mod:`hyper_parallel.train.arguments`)."""


def hf_model(
    source: str, overrides: Any = None, *, where: str = "--hf-config"
) -> tuple[str, dict[str, Any]]:
    """The registered spec and config overrides of a Hugging Face ``config.json``.

    The converter (:func:`~hyper_parallel.checkpoint_hf.config.read_hf_config`) gives
    the spec (``llama3-hf``, ``qwen3-hf``, ``qwen3-moe-hf``, registered here) and its
    sizes; ``overrides`` apply on top. Every command that takes ``--hf-config`` asks this.

    Raises:
        ValueError: The file cannot be read, is not JSON, or the converter refuses it
            (each field we do not implement, named); the message starts with ``where``.
    """
    return _model_of(_read(source, where=where), overrides)


def replaced_model_note(cfg: Any) -> str | None:
    """The note for a ``--model`` that ``--hf-checkpoint``/``--hf-config`` replaces.

    :func:`resolve_model` takes the model from the source's ``config.json`` and drops the
    overrides of another named model; said, not refused (a job file written for the
    registered model may be run on a checkpoint). ``None`` when nothing is replaced.
    """
    from hyper_parallel.checkpoint_hf.config import hf_spec_names

    source = cfg.hf_checkpoint or getattr(cfg, "hf_config", None)
    default_model = type(cfg).__dataclass_fields__["model"].default
    if not source or cfg.model in {default_model, *hf_spec_names()}:
        return None
    flag = "--hf-checkpoint" if cfg.hf_checkpoint else "--hf-config"
    dropped = " and its --model-overrides" if cfg.model_overrides else ""
    return (
        f"note: --model {cfg.model}{dropped} not used: the model is {flag} {source}'s "
        f"(its config.json). Fix: drop --model{dropped}."
    )


def resolve_model(cfg: Any, hf: Any = None) -> tuple[Any, Any]:
    """``cfg`` with ``model`` and ``model_overrides`` set from ``cfg.hf_checkpoint`` or
    ``cfg.hf_config`` (the user's ``model_overrides`` apply on top), and the
    :class:`~hyper_parallel.checkpoint_hf.config.HFConfig` read for it.

    The one place a run reads the Hugging Face ``config.json``: the code that builds the
    run calls it once and hands the config it read to the :class:`Trainer` and to the
    hooks (:func:`build_data`, :func:`model_record`, :func:`save_weights`). Resolving a
    resolved config again gives the same model. Without a source nothing is read.

    Args:
        cfg: A :class:`~hyper_parallel.train.TrainConfig`.
        hf: The ``HFConfig`` of the source, already read (``None``: read it here).

    Returns:
        ``(resolved copy of cfg, HFConfig or None)``.

    Raises:
        ValueError: The checkpoint's config has fields our model does not implement, or
            there is no ``config.json``.
    """
    import dataclasses

    from hyper_parallel.checkpoint_hf.config import hf_spec_names

    register_hf_specs(cfg)
    source = cfg.hf_checkpoint or getattr(cfg, "hf_config", None)
    if not source:
        return cfg, None
    field = "hf_checkpoint" if cfg.hf_checkpoint else "hf_config"
    # Overrides of another named model are not this config's.
    default_model = type(cfg).__dataclass_fields__["model"].default
    own = cfg.model_overrides if cfg.model in {default_model, *hf_spec_names()} else {}
    if hf is None:
        hf = _read(source, where=f"TrainConfig.{field}")
    model, overrides = _model_of(hf, own)
    if cfg.hf_checkpoint:
        _check_weights_fit(hf, model, overrides, cfg.hf_checkpoint)
    return dataclasses.replace(cfg, model=model, model_overrides=overrides), hf


def _check_weights_fit(hf: Any, model: str, overrides: dict[str, Any], source: str) -> None:
    """Refuse ``model_overrides`` that change the parameters of the checkpoint's model
    (``num_layers``, sizes): its weights would load in part, or not at all."""
    from hyper_parallel.dmodule.model_spec import get_spec

    if overrides == hf.model_overrides:
        return

    def shapes(kwargs: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):
            built = get_spec(model).config(**kwargs).build()
        return {n: tuple(p.shape) for n, p in built.named_parameters()}

    want, got = shapes(hf.model_overrides), shapes(overrides)
    differ = sorted(set(want) ^ set(got)) + sorted(
        n for n in set(want) & set(got) if want[n] != got[n]
    )
    if not differ:
        return
    changed = {k: v for k, v in overrides.items() if hf.model_overrides.get(k, object()) != v}
    shown = ", ".join(differ[:3]) + (", ..." if len(differ) > 3 else "")
    raise ValueError(
        f"TrainConfig.model_overrides {changed}: they change the parameters of the model "
        f"the checkpoint {str(source)!r} holds ({len(differ)} differ: {shown}), so its "
        "weights would not load whole. Fix: drop those overrides (ones that keep every "
        "parameter's shape, such as max_seq_len or rope_theta, may stay), or start from "
        "its config alone with --hf-config."
    )


def register_hf_specs(cfg: Any) -> None:
    """Register the ``*-hf`` model specs when ``cfg`` names one or a Hugging Face source."""
    from hyper_parallel.checkpoint_hf.config import hf_spec_names

    hf_config = getattr(cfg, "hf_config", None)
    if cfg.hf_checkpoint or hf_config or cfg.model in hf_spec_names():
        from hyper_parallel.checkpoint_hf.specs import register_specs

        register_specs()


def _read(source: str, *, where: str) -> Any:
    """The ``HFConfig`` of ``source``; every failure a ``ValueError`` starting with ``where``."""
    import json

    from hyper_parallel.checkpoint_hf.config import read_hf_config

    where = f"{where} {str(source)!r}"
    try:
        return read_hf_config(source)
    except OSError as e:  # FileNotFoundError included
        raise ValueError(f"{where}: cannot read it ({e.strerror or e}).") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e}).") from None
    except ValueError as e:  # HFConfigError: fields we do not implement
        raise ValueError(f"{where}: {e}") from None


def _model_of(hf: Any, overrides: Any) -> tuple[str, dict[str, Any]]:
    from hyper_parallel.checkpoint_hf.specs import register_specs

    register_specs()
    return hf.spec, {**hf.model_overrides, **dict(overrides or {})}


def load_weights(cfg: Any, parts: list[Any]) -> None:
    """Fill the built model parts from ``cfg.hf_checkpoint`` (nothing when unset)."""
    if cfg.hf_checkpoint:
        from hyper_parallel.checkpoint_hf.io import load_hf

        load_hf(parts, cfg.hf_checkpoint)


def tokenizer_path(cfg: Any) -> str | None:
    """``cfg.tokenizer``, else the Hugging Face checkpoint's ``tokenizer.json`` when it has one."""
    if cfg.tokenizer:
        return cfg.tokenizer
    if cfg.hf_checkpoint:
        candidate = os.path.join(cfg.hf_checkpoint, "tokenizer.json")
        if os.path.isfile(candidate):
            return candidate
    return None


def _eos(cfg: Any, hf: Any) -> Any:
    if not cfg.hf_checkpoint or hf is None:
        return None
    ids = hf.eos_token_ids
    return ids[0] if ids else None


def check_byte_data(cfg: Any) -> None:
    """Without ``--data`` or a tokenizer the run trains on the shipped text as bytes: the
    model's vocabulary must hold every byte. Asked before any rank builds (``demo``,
    ``train.run``: :func:`~hyper_parallel.train.report.check_files`) and by the trainer,
    the same check.

    Raises:
        ValueError: The model's vocabulary is smaller than the bytes' (a Hugging Face
            checkpoint's, or ``vocab_size`` overridden), naming the fixes.
    """
    if cfg.data or tokenizer_path(cfg) is not None:
        return
    from hyper_parallel.dmodule.model_spec import get_spec
    from hyper_parallel.train.data import VOCAB_SIZE

    spec = get_spec(cfg.model)
    if spec.family.vocab_size is None:
        return
    vocab_size = spec.family.vocab_size(spec.config(**cfg.model_overrides))
    if vocab_size < VOCAB_SIZE:
        # A checkpoint's vocabulary is its weights' shape: an override of it is refused.
        fix = (
            f"give its tokenizer (--tokenizer FILE, or a tokenizer.json in {cfg.hf_checkpoint}), "
            "or train on --data with one"
            if cfg.hf_checkpoint
            else f"override vocab_size >= {VOCAB_SIZE} (--model-overrides), or train on --data "
            "with a tokenizer"
        )
        raise ValueError(
            f"model {cfg.model!r} has a vocabulary of {vocab_size} but the data is bytes "
            f"(vocabulary {VOCAB_SIZE}); {fix}."
        )


def build_data(cfg: Any, vocab_size: int | None, hf: Any = None) -> Any:
    """The run's data stream: ``cfg.data`` (checked against ``vocab_size``), else ``None``.

    ``None`` means the trainer's own default (the shipped text, bytes). Without ``--data``
    but with a tokenizer (``--tokenizer``, or the Hugging Face checkpoint's), the shipped
    text is text data like any other: it is tokenized with it (as bytes, a checkpoint's
    model would train on ids that mean other tokens). ``hf``: the checkpoint's config
    (:func:`resolve_model`), whose end-of-sequence id separates documents.
    """
    tokenizer = tokenizer_path(cfg)
    if not cfg.data and tokenizer is None:
        return None
    from hyper_parallel.train.data import shipped_text_path
    from hyper_parallel.train.tokens import TokenBatches, open_corpus

    flag = "--data" if cfg.data else "--tokenizer" if cfg.tokenizer else "--hf-checkpoint"
    if vocab_size is None:
        raise ValueError(f"{flag}: model {cfg.model!r} declares no vocabulary size.")
    data = cfg.data or str(shipped_text_path(cfg.text))
    try:
        tokens = open_corpus(
            data,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
            text_field=cfg.text_field,
            eos=_eos(cfg, hf),
        )
        return TokenBatches(
            tokens, global_batch_size=cfg.batch_size, seq_len=cfg.seq_len, source=data
        )
    except ValueError as e:
        e.same_on_every_rank = True  # type: ignore[attr-defined]  # the files every rank reads
        raise


def model_record(cfg: Any, hf: Any = None) -> str:
    """The JSON the trainer stores in checkpoints (``train.model_json``); ``hf``: the
    checkpoint's config (:func:`resolve_model`)."""
    from hyper_parallel.checkpoint_hf.records import model_record as record

    hf_config = hf.raw if cfg.hf_checkpoint and hf is not None else None
    tokenizer, generation = tokenizer_path(cfg), _generation_config(cfg)
    return record(cfg.model, dict(cfg.model_overrides), hf_config, tokenizer, generation)


def _generation_config(cfg: Any) -> dict[str, Any] | None:
    """The ``generation_config.json`` the run's Hugging Face export carries (``--save-hf``
    copies it with the tokenizer's files: the tokenizer's folder's, else the checkpoint's),
    ``None`` when neither has one."""
    from hyper_parallel.checkpoint_hf.config import load_generation_config
    from hyper_parallel.checkpoint_hf.records import tokenizer_files

    source = tokenizer_files(tokenizer_path(cfg), [cfg.hf_checkpoint]).get("generation_config.json")
    return None if source is None else load_generation_config(os.path.dirname(source))


def save_weights(cfg: Any, parts: list[Any], hf: Any = None) -> None:
    """Write the model parts to ``cfg.save_hf`` in Hugging Face format (every rank calls it).

    The tokenizer files the run used (and those of its Hugging Face checkpoint) are
    copied next to them, so ``generate`` finds them; the directory is written aside and
    renamed into place when complete, and refused when it is not empty (unless
    ``cfg.overwrite``) or is one of the run's inputs.
    """
    if not cfg.save_hf:
        return
    from hyper_parallel.checkpoint_hf.io import save_hf
    from hyper_parallel.checkpoint_hf.records import tokenizer_files
    from hyper_parallel.dmodule.model_spec import get_spec

    hf_config = hf if cfg.hf_checkpoint else None
    config = get_spec(cfg.model).config(**cfg.model_overrides)
    save_hf(
        parts,
        cfg.save_hf,
        hf_config=hf_config,
        model_config=config,
        overwrite=cfg.overwrite,
        inputs=[cfg.hf_checkpoint, cfg.tokenizer, cfg.eval_data, *(cfg.data or "").split(",")],
        extra_files=tokenizer_files(tokenizer_path(cfg), [cfg.hf_checkpoint]),
        what="--save-hf",
    )


# Dense bf16 peak FLOP/s of accelerators we know by name (vendor datasheets).
_PEAKS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12, "MI300X": 1307e12}


def peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of one device: ``HYPER_PARALLEL_PEAK_TFLOPS``, else a known GPU, else None."""
    env = os.environ.get("HYPER_PARALLEL_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).upper()
        for key, value in _PEAKS.items():
            if key in name:
                return value
    return None


def train_flops_per_sequence(cfg: Any) -> float | None:
    """Training FLOPs of one sequence (3 x the units' forward FLOPs), when countable."""
    from hyper_parallel.dmodule.model_spec import get_spec

    spec = get_spec(cfg.model)
    layout = spec.family.pipeline
    if layout is None:
        return None
    try:
        units = layout.units(spec.config(**cfg.model_overrides), seq_len=cfg.seq_len)
    except Exception:  # a model whose FLOPs cannot be counted on meta: no MFU
        return None
    if any(u.num_flops is None for u in units):
        return None
    return 3.0 * sum(u.num_flops for u in units)


class StepLogger:
    """Per-step scalars to TensorBoard (``torch.utils.tensorboard``), on rank 0 only.

    Tags: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``perf/tokens_per_s``,
    ``perf/mfu`` (when the device's peak is known, see :func:`peak_flops`) and
    ``memory/peak_bytes`` (CUDA's max allocated, or the process's peak RSS on CPU).

    ``purge_step``: the first step this run logs when it resumes (or starts over with
    ``overwrite``); the events an earlier start logged from that step on (past its last
    checkpoint) are purged, so each step has one value (TensorBoard's
    ``SummaryWriter(purge_step=...)``).
    """

    def __init__(
        self,
        cfg: Any,
        device: torch.device,
        rank: int,
        world_size: int,
        *,
        purge_step: int | None = None,
    ) -> None:
        self.writer = None
        if not cfg.tensorboard or rank != 0:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ValueError(
                f"--tensorboard needs the tensorboard package ({e}); pip install tensorboard."
            ) from None
        self.writer = SummaryWriter(cfg.tensorboard, purge_step=purge_step)
        self.device = device
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        flops = train_flops_per_sequence(cfg)
        peak = peak_flops(device)
        self.flops_per_step = None if flops is None else flops * cfg.batch_size
        self.peak_total = None if peak is None else peak * world_size

    @staticmethod
    def _peak_memory(device: torch.device) -> float:
        if device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(device))
        import resource

        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def log(self, step: int, loss: float, lr: float, grad_norm: float, seconds: float) -> None:
        """Write one step's scalars (``seconds``: that step's wall time)."""
        if self.writer is None:
            return
        w = self.writer
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("train/lr", lr, step)
        w.add_scalar("train/grad_norm", grad_norm, step)
        w.add_scalar("perf/tokens_per_s", self.tokens_per_step / max(seconds, 1e-9), step)
        if self.flops_per_step is not None and self.peak_total is not None:
            w.add_scalar(
                "perf/mfu", self.flops_per_step / max(seconds, 1e-9) / self.peak_total, step
            )
        w.add_scalar("memory/peak_bytes", self._peak_memory(self.device), step)
        w.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
