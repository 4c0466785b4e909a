"""A training run's configuration and its gate: :class:`TrainConfig` (data only, the
run-option table's fields), the model config it trains (:func:`model_config`), its run plan
(:func:`run_plan`: every decision, made once) and that plan's errors (:func:`check_config`),
which ``validate``, ``plan``, the demo and the trainer share.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

from hyper_parallel.distributed.activation_checkpoint import check_mode as check_ac_mode
from hyper_parallel.distributed.axes import apply_model_axes, declared_axes
from hyper_parallel.distributed.compile import BACKENDS
from hyper_parallel.distributed.layout import LayoutError, MeshLayout
from hyper_parallel.distributed.precision import check_dtype
from hyper_parallel.distributed.process_group import default_device as default_device
from hyper_parallel.distributed.run_plan import RunPlan, default_num_microbatches
from hyper_parallel.dmodule.findings import Finding
from hyper_parallel.dmodule.model_spec import get_spec
from hyper_parallel.dmodule.module import Module
from hyper_parallel.train import report, run_hooks
from hyper_parallel.train import schedule as lr_schedules
from hyper_parallel.train.data import DEFAULT_TEXT

__all__ = ["TRAINER_AXES", "TrainConfig", "check_config", "config_axes", "model_config", "run_plan"]

TRAINER_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
"""User axes the trainer runs; any other axis of size > 1 is refused by :func:`check_config`."""


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything one training run needs; JSON-serialisable (:meth:`to_dict`).

    Args:
        model: Name of a registered model spec (``hyper_parallel.dmodule.get_spec``).
        model_overrides: Keyword overrides for the spec's config (e.g. ``num_layers``).
        mesh: Mesh axis sizes over ``pp, dp_replicate, dp_shard`` (alias ``dp``),
            ``cp, tp, ep``, e.g. ``{"dp_replicate": 2, "dp_shard": 2}`` (HSDP) or
            ``{"dp": 2, "tp": 2}``; missing axes are 1. ``pp x dp_replicate x dp_shard
            x cp x tp`` is the number of ranks; ``{}`` trains in one process.
        sp: Sequence parallel: use the model's TP+SP layout instead of plain TP (needs
            ``tp > 1`` and ``seq_len`` divisible by ``tp``).
        steps: Optimizer steps to train for.
        batch_size: Sequences per step over all data ranks (divisible by
            dp_replicate x dp_shard).
        seq_len: Tokens per sequence.
        lr: Peak learning rate of AdamW.
        weight_decay: AdamW's decoupled weight decay.
        warmup_steps: Linear warm-up steps; then the ``lr_schedule``.
        lr_schedule: ``"cosine"``, ``"linear"``, ``"constant"`` or ``"wsd"``
            (:mod:`hyper_parallel.train.schedule`), decaying to ``min_lr``.
        min_lr: The rate the schedule decays to; ``None``: 10 % of ``lr``.
        lr_schedule_steps: The schedule's length in steps; ``None``: ``steps`` for
            a new run, and for a resumed run the length it was started with.
        max_grad_norm: Clip the global gradient norm to this; ``0`` disables clipping.
        seed: Seeds initialization (same values at every mesh).
        text: A text shipped in ``hyper_parallel/train/data/``.
        checkpoint_dir: Where checkpoints go; ``None`` saves none.
        checkpoint_every: Save every this many steps (``0``: only after the last step).
        resume: Continue from the latest complete checkpoint in ``checkpoint_dir``
            (starts from scratch when there is none).
        log_every: Print a log line on rank 0 every this many steps (``0``: never).
        progress: Show a progress bar on rank 0 when stderr is a terminal.
        schedule: Pipeline schedule (torch's name) when ``pp > 1``: ``GPipe``,
            ``1F1B``, ``Interleaved1F1B``, ``InterleavedZeroBubble``, ``ZBVZeroBubble``.
        microbatches: Micro-batches per step, with and without ``pp``: each
            data-parallel rank's batch splits into that many equal micro-batches, run
            one after the other, gradients reduced once per step (gradient accumulation
            at ``pp=1``; each micro-batch with ``reduce_each_microbatch``). ``None``: 1 at ``pp=1``, one per stage under ``pp`` (``pp`` x
            stages per rank; the run plan's one rule,
            :func:`~hyper_parallel.distributed.run_plan.default_num_microbatches`).
        pipeline_split: The stage split (``{"units_per_stage": n}`` or
            ``{"stages": [[unit, ...], ...]}``); ``None`` balances stages by parameters.
        stages_per_rank: Pipeline stages each pp rank runs: 1 for GPipe / 1F1B, 2 or
            more for Interleaved1F1B and InterleavedZeroBubble, exactly 2 for
            ZBVZeroBubble; ``None``: the schedule's default (1, or 2).
        reduce_each_microbatch: With gradient accumulation (``pp=1``, several
            micro-batches) under FSDP2: reduce-scatter each micro-batch's gradients and
            accumulate the shards (torchtitan's way: gradients stay sharded; one
            reduction per micro-batch). ``False``: FSDP2 holds each unit's gradients
            unsharded (fp32) until the last micro-batch's backward reduces their sum
            once (less communication, the unsharded gradients' memory).
        compile: ``torch.compile`` each transformer block (``fullgraph=True``), after
            the tensor-parallel plan and before FSDP2
            (:mod:`hyper_parallel.distributed.compile`).
        compile_backend: ``torch.compile``'s backend under ``compile``: ``"inductor"``
            (torch's code generator), or ``"aot_eager"`` / ``"eager"`` (tracing without
            code generation: what the configuration matrix runs on a small CPU machine).
        dtype: ``"fp32"``, ``"bf16"`` mixed precision with fp32 master weights, or
            ``"bf16-true"``: parameters, gradients and AdamW state in bf16
            (:mod:`hyper_parallel.distributed.precision`).
        ac: Activation checkpointing: ``"none"``, ``"full"`` (every block),
            ``"selective"`` (every second block) or ``"op"`` (per operator in every
            block: attention and every second matmul kept;
            :mod:`hyper_parallel.distributed.activation_checkpoint`).
        hf_checkpoint: Start from this Hugging Face checkpoint; sets ``model`` (and
            ``model_overrides``) to its config (:mod:`hyper_parallel.train.run_hooks`).
        hf_config: Take the model from this Hugging Face ``config.json`` (or its
            directory) without its weights; sets ``model`` and ``model_overrides``.
        save_hf: Write the trained model here in Hugging Face format at the end.
        data: Training data instead of ``text``: a token file (``.bin``, ``.npy``) or
            text files (``.txt``, ``.jsonl``) (:mod:`hyper_parallel.train.tokens`).
        tokenizer: ``tokenizer.json`` for text ``data`` (default: the checkpoint's).
        text_field: The ``.jsonl`` field holding a document.
        tensorboard: Write per-step TensorBoard scalars to this directory.
        overwrite: Let ``save_hf`` replace a non-empty directory and a new run (not
            ``resume``) replace the checkpoints in ``checkpoint_dir``; without it they
            are refused before training (:mod:`hyper_parallel.checkpoint_hf.outputs`).
        keep_checkpoints: Keep only this many newest checkpoints (``0``: all).
        async_checkpoint: Write checkpoints in the background (DCP's ``async_save``):
            the states are copied to CPU memory and training goes on while a thread
            writes them; the previous save is finished before the next one and at the
            end of :meth:`Trainer.fit`, and is reported saved then.
        eval_data: Held-out data (as ``data``); its mean loss is logged every
            ``eval_every`` steps and at the end.
        eval_split: Hold out this last share of the training data for evaluation
            instead (``0.1``: the last 10 % of its tokens).
        eval_every: Evaluate every this many steps (``0``: at the end only).
        eval_batches: Global batches per evaluation (``None``: the whole of ``eval_data``).
        run_dir: Where the run's log (``train.log``) goes; ``None``: ``checkpoint_dir``.
    """

    model: str = "llama3-debug"
    model_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    sp: bool = False
    steps: int = 30
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 3
    max_grad_norm: float = 1.0
    seed: int = 0
    text: str = DEFAULT_TEXT
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    log_every: int = 1
    progress: bool = True
    schedule: str = "1F1B"
    microbatches: int | None = None
    pipeline_split: dict[str, Any] | None = None
    stages_per_rank: int | None = None
    reduce_each_microbatch: bool = False
    compile: bool = False
    compile_backend: str = "inductor"
    dtype: str = "fp32"
    ac: str = "none"
    hf_checkpoint: str | None = None
    hf_config: str | None = None
    save_hf: str | None = None
    data: str | None = None
    tokenizer: str | None = None
    text_field: str = "text"
    tensorboard: str | None = None
    lr_schedule: str = "cosine"
    min_lr: float | None = None
    lr_schedule_steps: int | None = None
    overwrite: bool = False
    keep_checkpoints: int = 0
    async_checkpoint: bool = False
    eval_data: str | None = None
    eval_split: float | None = None
    eval_every: int = 0
    eval_batches: int | None = None
    run_dir: str | None = None

    def __post_init__(self) -> None:
        # Data only: no file is read here (the Hugging Face config is read once, where
        # the run is built: run_hooks.resolve_model), and the run plan's findings are
        # the trainer's gate (check_config), not this constructor's.
        _check_types(self)
        if self.hf_checkpoint and self.hf_config:
            raise ValueError(
                "TrainConfig: hf_checkpoint and hf_config both name the model; give one "
                "(--hf-checkpoint DIR loads the weights too)."
            )
        if not isinstance(self.compile, bool):
            raise ValueError(f"TrainConfig.compile must be True or False, got {self.compile!r}.")
        if self.compile_backend not in BACKENDS:
            raise ValueError(
                f"TrainConfig.compile_backend {self.compile_backend!r} is not one of "
                f"{list(BACKENDS)}; leave it 'inductor' unless debugging a compile."
            )
        try:
            check_dtype(self.dtype)
            check_ac_mode(self.ac)
        except ValueError as e:
            raise ValueError(f"TrainConfig: {e}") from None
        if not isinstance(self.mesh, Mapping):
            raise ValueError(
                f"TrainConfig.mesh must be a dict of axis sizes such as "
                f'{{"dp_shard": 2, "tp": 2}}, got {type(self.mesh).__name__}.'
            )
        try:
            MeshLayout.from_sizes(self.mesh)
        except LayoutError as e:
            raise ValueError(f"TrainConfig.mesh {dict(self.mesh)}: {e}") from None
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("warmup_steps", "checkpoint_every", "log_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}.")
        if self.max_grad_norm < 0 or self.lr <= 0 or self.weight_decay < 0:
            raise ValueError(
                "TrainConfig: lr must be > 0 and max_grad_norm, weight_decay >= 0; got "
                f"lr={self.lr}, max_grad_norm={self.max_grad_norm}, "
                f"weight_decay={self.weight_decay}."
            )
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("TrainConfig: resume=True needs a checkpoint_dir to resume from.")
        report.check_fields(self)

    @property
    def layout(self) -> MeshLayout:
        """The mesh as a :class:`~hyper_parallel.distributed.MeshLayout`."""
        return MeshLayout.from_sizes(self.mesh)

    @property
    def dp(self) -> int:
        """Data-parallel size: dp_replicate x dp_shard, the ranks that read different rows."""
        return self.layout.size("batch")

    @property
    def tp(self) -> int:
        """Tensor-parallel size."""
        return self.layout.tp

    @property
    def resolved_microbatches(self) -> int:
        """Micro-batches per step (``microbatches``; else 1, or one per pipeline stage)."""
        if self.microbatches is not None:
            return self.microbatches
        return default_num_microbatches(self.layout.pp, self.schedule, self.stages_per_rank)

    @property
    def world_size(self) -> int:
        """Number of ranks the mesh needs."""
        return self.layout.world_size

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-serialisable dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """Rebuild a config from :meth:`to_dict` output.

        Raises:
            ValueError: For a key that is not a field (the message lists the fields).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"TrainConfig: unknown field(s) {unknown}; fields are {sorted(names)}."
            )
        return cls(**values)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based): warm-up, then ``lr_schedule``."""
        return lr_schedules.lr_at(
            step,
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            total_steps=self.lr_schedule_steps or self.steps,
            min_lr=0.1 * self.lr if self.min_lr is None else self.min_lr,
            schedule=self.lr_schedule,
        )


def model_config(cfg: TrainConfig, tp: int | None = None) -> Any:
    """The model config ``cfg`` trains, with the sharding of every active model axis.

    For each axis of :data:`~hyper_parallel.distributed.axes.MODEL_AXES` of size > 1
    the spec's sharding for that axis is applied
    (:func:`~hyper_parallel.distributed.axes.apply_model_axes`), so the config declares
    exactly the active model axes. Needs no process group, so a launcher can check a
    run before starting ranks.

    Args:
        cfg: The run's config.
        tp: Tensor-parallel size; defaults to ``cfg.tp``.

    Raises:
        ValueError: The model is not registered, has no sharding function for an
            active axis, or the axis size does not fit its shapes.
    """
    layout = cfg.layout if tp is None else dataclasses.replace(cfg.layout, tp=tp)
    spec = get_spec(cfg.model)
    config = spec.config(**cfg.model_overrides)
    return apply_model_axes(spec, config, layout, sequence_parallel=cfg.sp)


def config_axes(config: Any) -> tuple[str, ...]:
    """The mesh axes a model config's sharding configs declare."""
    return declared_axes(c.sharding_config for _, c, _, _ in config.traverse(Module.Config))


def run_plan(
    cfg: TrainConfig, world_size: int | None = None, layout: MeshLayout | None = None
) -> RunPlan:
    """The :class:`~hyper_parallel.distributed.run_plan.RunPlan` of ``cfg``: every decision
    and every check of the run, made once.

    Args:
        cfg: The run's config.
        world_size: The ranks the job has, when known (checked against the mesh).
        layout: Plan for this mesh instead of ``cfg.mesh`` (``MeshLayout()``: one device).
    """
    cfg = _resolved(cfg)
    layout = cfg.layout if layout is None else layout
    plan = RunPlan.for_model(
        cfg.model,
        layout,
        model_overrides=cfg.model_overrides,
        world_size=world_size,
        sequence_parallel=cfg.sp,
        compile=cfg.compile,
        compile_backend=cfg.compile_backend,
        ac=cfg.ac,
        dtype=cfg.dtype,
        schedule=cfg.schedule,
        num_microbatches=cfg.microbatches,
        batch_size=cfg.batch_size // layout.size("batch"),
        global_batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        pipeline_split=cfg.pipeline_split,
        stages_per_rank=cfg.stages_per_rank,
        reduce_each_microbatch=cfg.reduce_each_microbatch,
    )
    return _offer_weights(plan, cfg)


def _offer_weights(plan: RunPlan, cfg: TrainConfig) -> RunPlan:
    """``plan`` whose finding for a ``*-hf`` model given no sizes (no Hugging Face source,
    no overrides) offers ``--hf-checkpoint`` too: a run has it, ``plan`` and ``validate``
    (whose finding names only ``--hf-config``) do not."""
    from hyper_parallel.checkpoint_hf.config import hf_spec_names

    if cfg.model_overrides or cfg.model not in hf_spec_names():
        return plan
    fix = (
        "pass --hf-checkpoint DIR (its config.json and weights) or --hf-config PATH (its "
        "config.json alone), or name a preset (see 'hyper-parallel models')."
    )
    findings = tuple(
        dataclasses.replace(f, fix=fix)
        if f.severity == "error" and f.path == "model" and f.field == cfg.model
        else f
        for f in plan.findings
    )
    return dataclasses.replace(plan, findings=findings)


def _resolved(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its Hugging Face source's model: as given when it is resolved already
    (its model a ``*-hf`` spec), else read here
    (:func:`~hyper_parallel.train.run_hooks.resolve_model`)."""
    from hyper_parallel.checkpoint_hf.config import hf_spec_names

    run_hooks.register_hf_specs(cfg)
    if (cfg.hf_checkpoint or cfg.hf_config) and cfg.model not in hf_spec_names():
        cfg, _ = run_hooks.resolve_model(cfg)
    return cfg


_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an integer", lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)),
    "bool": ("True or False", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, (str, os.PathLike))),
    "None": ("None", lambda v: v is None),
}


def _check_types(cfg: TrainConfig) -> None:
    """Each scalar field of its annotated type (``steps="3"`` was a ``TypeError`` from a
    comparison: "'<' not supported between instances of 'str' and 'int'"); ``float``
    takes integers, ``str`` paths. ``mesh`` and ``pipeline_split`` are checked where
    they are read (with their own messages)."""
    for f in dataclasses.fields(cfg):
        if f.name in ("mesh", "pipeline_split"):
            continue
        value = getattr(cfg, f.name)
        kinds = [k.strip() for k in str(f.type).split("|")]
        if any(k.startswith("dict") for k in kinds):
            if not isinstance(value, Mapping) and not (value is None and "None" in kinds):
                raise ValueError(
                    f'TrainConfig.{f.name} must be a dict (e.g. {{"num_layers": 2}}), got '
                    f"{type(value).__name__}: {value!r}."
                )
            continue
        known = [k for k in kinds if k in _KINDS]
        if len(known) != len(kinds) or any(_KINDS[k][1](value) for k in known):
            continue
        want = " or ".join(_KINDS[k][0] for k in known)
        raise ValueError(
            f"TrainConfig.{f.name} must be {want}, got {type(value).__name__}: {value!r}."
        )


def check_config(cfg: TrainConfig, world_size: int | None = None) -> list[Finding]:
    """Every problem of a run's mesh, axes, model and switches, before any process group.

    The gate the trainer, ``python -m hyper_parallel.train.run`` and the demo use: the
    errors of the run plan (:func:`run_plan`), which ``validate`` and ``plan`` report
    too — the mesh (and, when given, its product against ``world_size``), the model's
    sharding over its axes, context and expert parallelism, and the pipeline plan.

    Returns:
        The errors (an empty list when the run can start).
    """
    return run_plan(cfg, world_size).errors
