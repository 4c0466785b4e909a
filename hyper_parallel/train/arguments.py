"""The one definition of the run options: ``hyper-parallel``, ``train.run`` and the demo.

Each option maps to a :class:`~hyper_parallel.train.TrainConfig` field (its ``dest``)
and is defined once here; its default is the field's default, read from the dataclass
(shown in the help). :data:`COMMAND_OPTIONS` says which of them each command takes and
the few defaults a command sets otherwise; every command adds its options with
:func:`add_command_arguments` (``python -m hyper_parallel.train.run`` and
``hyper-parallel demo`` all of them, values left unset falling back to ``--config`` and
then to ``TrainConfig``; ``plan``, ``validate`` and ``suggest`` the model options and
the switches that change the run they check). So ``--model``, ``--model-overrides``,
``--hf-config`` and ``--dtype`` mean one thing in every command.

Example::

    parser = argparse.ArgumentParser()
    add_command_arguments(parser, "train")
    cfg = config_from_args(parser.parse_args(["--mesh", "dp=2,tp=2"]))
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hyper_parallel.config.data_files import DuplicateKeyError, load_json
from hyper_parallel.distributed.activation_checkpoint import AC_MODES
from hyper_parallel.distributed.mesh_arguments import mesh_argument as mesh_argument
from hyper_parallel.distributed.mesh_arguments import parse_mesh as parse_mesh
from hyper_parallel.distributed.pipeline import SCHEDULES
from hyper_parallel.distributed.precision import DTYPES
from hyper_parallel.train.schedule import LR_SCHEDULES

__all__ = [
    "COMMAND_OPTIONS",
    "MODEL_FIELDS",
    "RUN_OPTIONS",
    "SWITCHES",
    "CommandOptions",
    "add_command_arguments",
    "add_train_arguments",
    "command_defaults",
    "config_from_args",
    "json_object",
    "mesh_argument",
    "option_fields",
    "option_flag",
    "option_kwargs",
    "parse_mesh",
    "positive_int",
    "split_object",
]


def _object(text: str, example: str) -> dict[str, Any]:
    try:
        value = load_json(text)
    except DuplicateKeyError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({e.msg}); quote the keys, e.g. '{example}'"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, e.g. '{example}'")
    return value


def json_object(text: str) -> dict[str, Any]:
    """``argparse`` type of a JSON-object option (``--model-overrides``)."""
    return _object(text, '{"num_layers": 4}')


def split_object(text: str) -> dict[str, Any]:
    """``argparse`` type of ``--pipeline-split`` (its own example in the messages)."""
    return _object(text, '{"units_per_stage": 2}')


def positive_int(text: str) -> int:
    """``argparse`` type of a count option (``--gpus``, ``--seq``): an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def _defaults() -> dict[str, Any]:
    from hyper_parallel.train.trainer import TrainConfig

    return {
        f.name: f.default
        for f in dataclasses.fields(TrainConfig)
        if f.default is not dataclasses.MISSING
    }


# flag, TrainConfig field, argparse keywords (help says what; the default is added).
RUN_OPTIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("--model", "model", {"help": "registered model name"}),
    (
        "--model-overrides",
        "model_overrides",
        {
            "type": json_object,
            "metavar": "JSON",
            "help": "model config overrides, e.g. '{\"num_layers\": 4}' or "
            "'{\"max_seq_len\": 32768}'",
        },
    ),
    (
        "--hf-config",
        "hf_config",
        {
            "metavar": "PATH",
            "help": "take the model from a Hugging Face config.json or its directory "
            "(Llama / Mistral, Qwen3, Qwen3-MoE; no weights); sets the model, "
            "--model-overrides apply on top",
        },
    ),
    (
        "--mesh",
        "mesh",
        {
            "type": mesh_argument,
            "help": "mesh axis sizes over pp, dp_replicate, dp_shard (alias dp), cp, tp, ep, "
            "e.g. dp=2,tp=2 or dp_replicate=2,dp_shard=2",
        },
    ),
    (
        "--sp",
        "sp",
        {"action": "store_true", "help": "sequence parallel on top of tensor parallel"},
    ),
    ("--steps", "steps", {"type": int, "help": "optimizer steps"}),
    ("--batch-size", "batch_size", {"type": int, "help": "global batch (sequences)"}),
    ("--seq-len", "seq_len", {"type": int, "help": "tokens per sequence"}),
    ("--lr", "lr", {"type": float, "help": "peak learning rate"}),
    ("--weight-decay", "weight_decay", {"type": float, "help": "AdamW weight decay"}),
    ("--warmup-steps", "warmup_steps", {"type": int, "help": "linear warm-up steps"}),
    ("--lr-schedule", "lr_schedule", {"choices": LR_SCHEDULES, "help": "decay after warm-up"}),
    ("--min-lr", "min_lr", {"type": float, "help": "rate decayed to (default: 0.1 x --lr)"}),
    (
        "--lr-schedule-steps",
        "lr_schedule_steps",
        {"type": int, "help": "schedule length (default: --steps; a resumed run keeps its own)"},
    ),
    ("--max-grad-norm", "max_grad_norm", {"type": float, "help": "clipping norm (0: off)"}),
    ("--seed", "seed", {"type": int, "help": "initialization seed"}),
    ("--text", "text", {"help": "shipped text to train on"}),
    (
        "--checkpoint-dir",
        "checkpoint_dir",
        {"metavar": "DIR", "help": "directory for DCP checkpoints"},
    ),
    ("--checkpoint-every", "checkpoint_every", {"type": int, "help": "save every N steps"}),
    ("--keep-checkpoints", "keep_checkpoints", {"type": int, "help": "keep the N newest (0: all)"}),
    (
        "--async-checkpoint",
        "async_checkpoint",
        {
            "action": "store_true",
            "help": "write checkpoints in the background (DCP async_save): training goes on "
            "while they are written; each is finished before the next and at the end",
        },
    ),
    (
        "--overwrite",
        "overwrite",
        {
            "action": "store_true",
            "help": "replace outputs that are there: a non-empty --save-hf and old "
            "checkpoints (plan: the --chart file; suggest: the --write-config and --chart "
            "files)",
        },
    ),
    ("--run-dir", "run_dir", {"metavar": "DIR", "help": "train.log here (default: ckpt dir)"}),
    (
        "--resume",
        "resume",
        {"action": "store_true", "help": "continue from the latest checkpoint"},
    ),
    (
        "--schedule",
        "schedule",
        {"help": f"pipeline schedule under pp > 1 (torch's names: {', '.join(SCHEDULES)})"},
    ),
    (
        "--microbatches",
        "microbatches",
        {
            "type": int,
            "help": "micro-batches per step, with and without pp: each data-parallel rank's "
            "batch splits into them, run in turn, gradients reduced once per step unless "
            "--reduce-each-microbatch (gradient accumulation at pp=1; default 1, or one per "
            "stage under pp: pp x stages per rank)",
        },
    ),
    (
        "--pipeline-split",
        "pipeline_split",
        {
            "type": split_object,
            "metavar": "JSON",
            "help": "pipeline stage split, e.g. '{\"units_per_stage\": 2}' (default: balanced)",
        },
    ),
    (
        "--stages-per-rank",
        "stages_per_rank",
        {
            "type": int,
            "metavar": "N",
            "help": "pipeline stages each pp rank runs: 2 or more for Interleaved1F1B and "
            "InterleavedZeroBubble (default 2), exactly 2 for ZBVZeroBubble, 1 for GPipe "
            "and 1F1B",
        },
    ),
    (
        "--reduce-each-microbatch",
        "reduce_each_microbatch",
        {
            "action": "store_true",
            "help": "with gradient accumulation under FSDP2: reduce-scatter each "
            "micro-batch's gradients (sharded accumulation, as torchtitan; more "
            "communication) instead of holding them unsharded in fp32 until the last",
        },
    ),
    ("--log-every", "log_every", {"type": int, "help": "log every N steps (0: never)"}),
    (
        "--compile",
        "compile",
        {
            "action": "store_true",
            "help": "torch.compile each transformer block (fullgraph, after TP, before FSDP)",
        },
    ),
    (
        "--dtype",
        "dtype",
        {
            "choices": tuple(DTYPES),
            "help": "fp32; bf16: bf16 compute with fp32 master weights, gradients and "
            "AdamW state (FSDP2's MixedPrecisionPolicy; autocast without FSDP); or "
            "bf16-true: parameters, gradients and AdamW state in bf16, no fp32 copy "
            "(half the states' memory; updates below bf16's resolution are lost)",
        },
    ),
    (
        "--ac",
        "ac",
        {
            "choices": AC_MODES,
            "help": "activation checkpointing: none, full (every block), selective (every "
            "second block), op (every block keeps its attention and every second matmul's "
            "outputs and recomputes the rest: torchtitan's per-op selective AC)",
        },
    ),
    ("--no-progress", "progress", {"action": "store_false", "help": "no progress bar"}),
    (
        "--hf-checkpoint",
        "hf_checkpoint",
        {
            "metavar": "DIR",
            "help": "start from this Hugging Face checkpoint (config.json + safetensors); "
            "sets the model",
        },
    ),
    (
        "--save-hf",
        "save_hf",
        {"metavar": "DIR", "help": "write the trained model here in Hugging Face format"},
    ),
    (
        "--data",
        "data",
        {
            "metavar": "PATH",
            "help": "training data: a token file (.bin uint16/uint32, .npy) or text files "
            "(.txt, .jsonl; comma-separated) tokenized with --tokenizer (default: the "
            "shipped text)",
        },
    ),
    (
        "--tokenizer",
        "tokenizer",
        {
            "metavar": "FILE",
            "help": "tokenizers tokenizer.json for text data (default: the checkpoint's)",
        },
    ),
    (
        "--text-field",
        "text_field",
        {"metavar": "NAME", "help": "the .jsonl field holding a document"},
    ),
    ("--eval-data", "eval_data", {"metavar": "PATH", "help": "held-out data, as --data"}),
    ("--eval-split", "eval_split", {"type": float, "help": "or hold out this last share of it"}),
    ("--eval-every", "eval_every", {"type": int, "help": "evaluate every N steps (0: at the end)"}),
    ("--eval-batches", "eval_batches", {"type": int, "help": "batches per eval (default: all)"}),
    (
        "--tensorboard",
        "tensorboard",
        {"metavar": "DIR", "help": "write TensorBoard event files to this directory"},
    ),
)

SWITCHES = (
    "sp",
    "schedule",
    "microbatches",
    "pipeline_split",
    "stages_per_rank",
    "reduce_each_microbatch",
    "compile",
)
"""The options ``plan`` and ``validate`` take too: they change the run those check."""

MODEL_FIELDS = ("model", "model_overrides", "hf_config")
"""The options that name the model: every command takes them."""


@dataclass(frozen=True)
class CommandOptions:
    """Which run options a command takes, and the defaults it sets otherwise.

    Attributes:
        fields: The ``TrainConfig`` fields whose options it takes (``None``: all).
        defaults: Parsed defaults by field that differ from "unset" (``None``, which
            falls back to ``--config`` and then to ``TrainConfig``). A command without
            ``--config`` parses to the ``TrainConfig`` default, unless set here.
        config_file: It takes ``--config FILE``.
        required: Fields whose option it requires.
    """

    fields: tuple[str, ...] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    config_file: bool = False
    required: tuple[str, ...] = ()


COMMAND_OPTIONS: dict[str, CommandOptions] = {
    "train": CommandOptions(config_file=True),
    "demo": CommandOptions(config_file=True, defaults={"mesh": {"dp_shard": 2, "tp": 2}}),
    # The planners need a model named (--model, --hf-config, or plan's --hf-model) and a
    # mesh given (required there).
    "plan": CommandOptions(
        fields=(*MODEL_FIELDS, "mesh", *SWITCHES, "dtype", "ac", "overwrite"),
        defaults={"model": None, "mesh": None},
        required=("mesh",),
    ),
    "validate": CommandOptions(
        fields=(*MODEL_FIELDS, "mesh", *SWITCHES, "dtype", "ac"),
        defaults={"model": None, "mesh": None},
        required=("mesh",),
    ),
    # The search is for GPUs, where training runs in bf16 mixed precision.
    # --mesh, --schedule, --ac, --microbatches, --sp and --reduce-each-microbatch fix that
    # part of the search (unset: searched); --compile and --pipeline-split are the run's, as
    # the trainer's.
    "suggest": CommandOptions(
        fields=(*MODEL_FIELDS, "dtype", "mesh", *SWITCHES, "ac", "overwrite"),
        defaults={
            "model": None,
            "dtype": "bf16",
            "mesh": None,
            "schedule": None,
            "ac": None,
            "microbatches": None,
            "sp": None,
            "reduce_each_microbatch": None,
        },
    ),
}
"""The one table of which options each command takes (``train`` is
``python -m hyper_parallel.train.run``)."""


def command_defaults(command: str) -> dict[str, Any]:
    """The parsed default of each option ``command`` takes, by field."""
    spec = COMMAND_OPTIONS[command]
    fields = [dest for _, dest, _ in RUN_OPTIONS] if spec.fields is None else spec.fields
    if spec.config_file or spec.fields is None:
        out: dict[str, Any] = {}
    else:  # no --config to fall back on: the TrainConfig default itself
        fallback = _defaults()
        out = {f: fallback[f] for f in fields if f in fallback}
    out.update(spec.defaults)
    return out


def add_command_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Add the run options ``command`` takes (:data:`COMMAND_OPTIONS`) to ``parser``.

    Example::

        add_command_arguments(argparse.ArgumentParser(), "plan")
    """
    spec = COMMAND_OPTIONS[command]
    add_train_arguments(
        parser,
        fields=spec.fields,
        defaults=command_defaults(command),
        config_file=spec.config_file,
        required=spec.required,
    )
    if spec.config_file and spec.defaults:
        # Shown in the help, but parsed unset: a --config file's value comes first
        # (config_from_args(..., defaults=spec.defaults) applies them beneath it).
        parser.set_defaults(**dict.fromkeys(spec.defaults))


def add_train_arguments(
    parser: argparse.ArgumentParser,
    *,
    fields: Iterable[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    config_file: bool = True,
    required: Iterable[str] = (),
) -> None:
    """Add the run options (each maps to a :class:`~hyper_parallel.train.TrainConfig` field).

    Args:
        parser: The parser (or subparser) to add them to.
        fields: Only the options of these fields (default: all).
        defaults: Values the parsed options take when not given, by field (e.g. the
            demo's mesh). Options without one parse to ``None`` and
            :func:`config_from_args` falls back to ``--config``, then to ``TrainConfig``.
        config_file: Add ``--config FILE`` (a JSON object of TrainConfig fields).
        required: Fields whose option must be given.
    """
    wanted = None if fields is None else set(fields)
    given = dict(defaults or {})
    if config_file and wanted is None:
        parser.add_argument(
            "--config",
            metavar="FILE",
            help="job file (.toml: these options without dashes, e.g. steps = 3; or .json of "
            "TrainConfig fields); options given here override it",
        )
    for flag, dest, _ in RUN_OPTIONS:
        if wanted is not None and dest not in wanted:
            continue
        kwargs = option_kwargs(dest, given)
        if dest in required:
            kwargs["required"] = True
        parser.add_argument(flag, dest=dest, **kwargs)
        if kwargs.get("action") in ("store_true", "store_false") and dest not in given:
            parser.set_defaults(**{dest: None})  # unset: --config, then TrainConfig


def option_kwargs(dest: str, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``add_argument`` keywords of the option of field ``dest``, with ``defaults``
    (by field; unset: ``None``) as :func:`add_train_arguments` adds it: its help ends with
    the default it takes (the ``TrainConfig`` field's unless ``defaults`` gives one).

    Raises:
        KeyError: ``dest`` is not a field of the table.
    """
    given = dict(defaults or {})
    (kwargs,) = [dict(k) for _, d, k in RUN_OPTIONS if d == dest]
    if kwargs.get("type") in (int, float) and "metavar" not in kwargs:
        kwargs["metavar"] = "N" if kwargs["type"] is int else "X"
    shown = given.get(dest, _defaults().get(dest))
    if kwargs.get("action") not in ("store_true", "store_false") and shown is not None:
        kwargs["help"] = f"{kwargs['help']} (default: {_shown(shown)})"
    kwargs["default"] = given.get(dest)
    return kwargs


def option_fields() -> tuple[str, ...]:
    """Every field of the table, in its order (``option_flag`` gives each one's flag)."""
    return tuple(dest for _, dest, _ in RUN_OPTIONS)


def option_flag(dest: str) -> str:
    """The command-line flag of field ``dest`` (``"text_field"`` -> ``--text-field``)."""
    (flag,) = [f for f, d, _ in RUN_OPTIONS if d == dest]
    return flag


def _shown(value: Any) -> str:
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "one device"
    return str(value)


def config_from_args(
    args: argparse.Namespace,
    world_size: int = 1,
    *,
    defaults: Mapping[str, Any] | None = None,
    **fixed: Any,
) -> Any:
    """The :class:`~hyper_parallel.train.TrainConfig` of parsed options.

    ``defaults`` (the command's own, by field) first, then the ``--config`` file, then
    every option given, then ``fixed``. Without a mesh, all ``world_size`` ranks are
    data parallel.

    Raises:
        ValueError: An unreadable ``--config`` file, or a bad value (TrainConfig's error).
    """
    from hyper_parallel.train.trainer import TrainConfig

    values: dict[str, Any] = dict(defaults or {})
    if getattr(args, "config", None):
        from hyper_parallel.train.job import load_job_file

        values.update(
            load_job_file(args.config, RUN_OPTIONS)
        )  # a job file (TOML), or JSON of fields
    for _, name, _ in RUN_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    values.update(fixed)
    if "mesh" not in values and world_size > 1:
        values["mesh"] = {"dp_shard": world_size}
    return TrainConfig.from_dict(values)
