"""What the trainer tells its user: a start summary, events, evaluation and a log file.

:class:`RunReport` is created by the :class:`~hyper_parallel.train.Trainer` and
called at a few fixed points of a run. On rank 0 it prints (when ``log_every`` > 0)
and appends to ``train.log`` in the run directory (``run_dir``, else
``checkpoint_dir``):

- at the start, a summary: the model and where its weights come from, its
  parameters, the mesh, the data (tokens, sequences) and how many passes over it the
  run makes, the learning-rate schedule, the step it resumes from, where
  checkpoints, the Hugging Face export and the log go;
- events: a checkpoint saved (and old ones removed with ``keep_checkpoints``), the
  Hugging Face export written, the data starting over (an epoch boundary), the
  schedule a resumed run keeps;
- the held-out loss (``eval_data``) every ``eval_every`` steps and at the end, also
  to TensorBoard as ``eval/loss``.

``train.run`` also leaves the resolved options as a job file (``config.toml``) and
``run.json`` (package version, git commit) there: :mod:`hyper_parallel.train.job`.

:func:`check_outputs` refuses, before any rank builds, a run whose outputs would
clobber something (:mod:`hyper_parallel.checkpoint_hf.outputs`); :func:`check_resume`
a ``resume`` whose checkpoint is past ``steps`` (nothing would run).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from hyper_parallel.train.data import DEFAULT_TEXT, available_texts

__all__ = [
    "RECORD_FILES",
    "RunReport",
    "check_fields",
    "check_files",
    "check_outputs",
    "check_overlaps",
    "check_resume",
    "check_run_files",
    "log_path",
    "run_starts",
]


def check_fields(cfg: Any) -> None:
    """Raise a ``ValueError`` naming the option for a bad reporting or schedule field."""
    from hyper_parallel.train.schedule import check_schedule

    min_lr = 0.1 * cfg.lr if cfg.min_lr is None else cfg.min_lr
    check_schedule(cfg.lr_schedule, cfg.lr, min_lr, cfg.warmup_steps)
    for flag, value in (
        ("--keep-checkpoints", cfg.keep_checkpoints),
        ("--eval-every", cfg.eval_every),
    ):
        if value < 0:
            raise ValueError(f"{flag} {value} must be >= 0.")
    for flag, value in (
        ("--eval-batches", cfg.eval_batches),
        ("--lr-schedule-steps", cfg.lr_schedule_steps),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} must be >= 1.")
    if cfg.eval_split is not None and not 0 < cfg.eval_split < 1:
        raise ValueError(f"--eval-split {cfg.eval_split} must be between 0 and 1 (e.g. 0.1).")
    if cfg.eval_split is not None and cfg.eval_data:
        raise ValueError("--eval-split and --eval-data: give one (held-out part, or a file).")
    if (cfg.eval_data or cfg.eval_split) and cfg.layout.pp > 1:
        flag = "--eval-data" if cfg.eval_data else "--eval-split"
        raise ValueError(
            f"{flag}: evaluation under pp > 1 is not supported yet; drop {flag} or train "
            "without a pp axis."
        )


def log_path(cfg: Any) -> str | None:
    """The run's log file: ``train.log`` in ``run_dir``, else in ``checkpoint_dir``."""
    folder = cfg.run_dir or cfg.checkpoint_dir
    return None if folder is None else os.path.join(folder, "train.log")


def check_outputs(cfg: Any, files: Mapping[str, str | None] | None = None) -> None:
    """Refuse outputs that would clobber something, before anything runs.

    No folder output (``run_dir``, ``checkpoint_dir``, ``tensorboard``, ``save_hf``) may
    be a file or lie under one; ``save_hf`` must be new or empty (or ``overwrite``) and
    never one of the run's inputs; a new run (no ``resume``) may not start in a
    ``checkpoint_dir`` that holds checkpoints of another run, nor write into a
    ``tensorboard`` folder that holds another run's events, unless ``overwrite``; no
    output may replace another (:func:`check_overlaps`; ``files``: the file outputs by
    flag).

    Raises:
        OutputError: What is refused and how to proceed.
    """
    from hyper_parallel.checkpoint_hf.outputs import OutputError, check_output, check_output_folder
    from hyper_parallel.train.checkpoint import checkpoint_steps

    # A folder output where a file is (or above it): refused now, not a traceback when
    # the run first writes there.
    for flag, folder in (
        ("--run-dir", cfg.run_dir),
        ("--checkpoint-dir", cfg.checkpoint_dir),
        ("--tensorboard", cfg.tensorboard),
    ):
        if folder:
            check_output_folder(folder, what=flag)
    if cfg.checkpoint_dir:
        # A step folder given for the folder of checkpoints: no checkpoint is found in it,
        # so the run started at step 0 and wrote its own into the checkpoint.
        parent = os.path.dirname(os.path.normpath(cfg.checkpoint_dir)) or "."
        if any(_real(p) == _real(cfg.checkpoint_dir) for _, p in checkpoint_steps(parent)):
            then = " (--resume continues from its latest checkpoint)" if cfg.resume else ""
            raise OutputError(
                f"--checkpoint-dir {cfg.checkpoint_dir} is a checkpoint (a step folder of "
                f"{parent}), not the folder that holds them: the run would find no "
                "checkpoint in it, start at step 0 and write into it. Fix: give the folder "
                f"that holds it, --checkpoint-dir {parent}{then}."
            )
    inputs = [cfg.hf_checkpoint, cfg.tokenizer, cfg.eval_data]
    inputs += (cfg.data or "").split(",")
    if cfg.checkpoint_dir:
        # The checkpoints are the run's too: --save-hf may not replace a step folder (or
        # the directory holding them), even with --overwrite.
        inputs += [cfg.checkpoint_dir] + [p for _, p in checkpoint_steps(cfg.checkpoint_dir)]
    if cfg.save_hf:
        try:
            check_output(cfg.save_hf, overwrite=cfg.overwrite, inputs=inputs, what="--save-hf")
        except OutputError as e:
            if not _own_export(cfg):
                raise
            raise OutputError(
                f"{e} It holds the export of an earlier start of this run (its run.json): "
                "to continue the run and replace its export at the end, pass --resume "
                "--overwrite (with --resume the checkpoints are continued, not deleted)."
            ) from None
        if cfg.checkpoint_dir and os.path.realpath(cfg.save_hf) == os.path.realpath(
            cfg.checkpoint_dir
        ):
            raise OutputError(
                f"--save-hf {cfg.save_hf} is also --checkpoint-dir; give them different "
                "directories."
            )
    if cfg.checkpoint_dir and not cfg.resume and not cfg.overwrite:
        steps = checkpoint_steps(cfg.checkpoint_dir)
        if steps:
            raise OutputError(
                f"--checkpoint-dir {cfg.checkpoint_dir} holds checkpoints of an earlier run "
                f"({len(steps)}, the latest {os.path.basename(steps[-1][1])}); pass --resume to "
                "continue it, --overwrite to replace them, or choose another directory."
            )
    if cfg.tensorboard and not cfg.resume and not cfg.overwrite:
        events = _tensorboard_events(cfg.tensorboard)
        if events:
            raise OutputError(
                f"--tensorboard {cfg.tensorboard} holds TensorBoard events of an earlier run "
                f"({len(events)} file(s), e.g. {events[0]}); TensorBoard reads one folder as one "
                "run, so this run's curves would be drawn over that run's. Fix: give each run "
                f"a folder of its own (e.g. --tensorboard {os.path.join(cfg.tensorboard, 'NAME')}"
                "; TensorBoard pointed at the parent lists each as a run), pass --resume to "
                "continue that run, or --overwrite to start it over (its events are purged)."
            )
    check_overlaps(cfg, files)


def _own_export(cfg: Any) -> bool:
    """Whether a resumed run's ``save_hf`` is the one an earlier start of it was given
    (the starts its ``run.json`` lists)."""
    log = log_path(cfg)
    if not (cfg.resume and cfg.save_hf) or log is None:
        return False
    for start in run_starts(os.path.join(os.path.dirname(log) or ".", "run.json")):
        config = start.get("config") if isinstance(start, dict) else None
        given = config.get("save_hf") if isinstance(config, dict) else None
        if isinstance(given, str) and _real(given) == _real(cfg.save_hf):
            return True
    return False


def _tensorboard_events(folder: str) -> list[str]:
    """The TensorBoard event files directly in ``folder`` (where ``SummaryWriter`` writes)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [n for n in names if n.startswith("events.out.tfevents.")]


def check_resume(cfg: Any) -> None:
    """Refuse a ``resume`` whose checkpoint is past ``steps``: nothing would run.

    The checkpoint is the one :func:`~hyper_parallel.train.checkpoint.latest_checkpoint`
    picks: a newer one whose checksums fail is passed over there, so here too (only
    checkpoints past ``steps`` are read). At ``steps`` itself the run is complete and
    starts nothing new but its ``save_hf`` export (a restarting launcher re-running a
    run that failed after its last save gets it written).

    Raises:
        ValueError: Naming ``--steps``, the checkpoint's step and the fix.
    """
    if not (cfg.resume and cfg.checkpoint_dir):
        return
    from hyper_parallel.train.checkpoint import checkpoint_steps, verify_checkpoint

    for step, path in reversed(checkpoint_steps(cfg.checkpoint_dir)):
        if step <= cfg.steps:
            return
        if verify_checkpoint(path) is None:
            export = f" and --save-hf {cfg.save_hf} would not be written" if cfg.save_hf else ""
            raise ValueError(
                f"--steps {cfg.steps} is below step {step} of the checkpoint --resume "
                f"continues from ({path}): nothing would run{export}. Pass --steps > {step} "
                f"to train on, export it with 'hyper-parallel export-hf {path} OUT', or "
                "choose another --checkpoint-dir."
            )


RECORD_FILES = ("config.toml", "run.json")
"""The record ``train.run`` leaves in the run directory (:mod:`hyper_parallel.train.job`)."""


def _real(path: str) -> str:
    return os.path.realpath(os.fspath(path))


def _inside(child: str, parent: str) -> bool:
    """``child`` is ``parent`` or lies under it (both real paths)."""
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def _step_folder(path: str, checkpoint_dir: str) -> str | None:
    """The checkpoint step folder (``step_N``, ``step_N.partial``) of ``checkpoint_dir``
    that ``path`` is or lies in, else ``None`` (real paths)."""
    from hyper_parallel.train.checkpoint import is_step_folder

    if path == checkpoint_dir or not _inside(path, checkpoint_dir):
        return None
    first = os.path.relpath(path, checkpoint_dir).split(os.sep)[0]
    return first if is_step_folder(first) else None


def check_overlaps(cfg: Any, files: Mapping[str, str | None] | None = None) -> None:
    """Refuse outputs of one run that would replace one another, before anything runs.

    ``--run-dir``, ``--checkpoint-dir`` and ``--tensorboard`` add files under their own
    names and may share a folder; but ``--save-hf`` is replaced whole at the end and a
    checkpoint step folder at each save, so no other output may be (or lie in) either;
    and a file output (``files``: flag -> path, such as ``--metrics-out``) may not be
    another output, hold one, or be the run's record (``train.log``, ``config.toml``,
    ``run.json``).

    Raises:
        OutputError: The two outputs, named by their flags, and the fix.
    """
    from hyper_parallel.checkpoint_hf.outputs import OutputError

    folders = [
        ("--run-dir", cfg.run_dir),
        ("--checkpoint-dir", cfg.checkpoint_dir),
        ("--tensorboard", cfg.tensorboard),
    ]
    folders = [(flag, path) for flag, path in folders if path]
    singles = [(flag, path) for flag, path in (files or {}).items() if path]
    if cfg.save_hf:
        target = _real(cfg.save_hf)
        for flag, path in folders + singles:
            if _inside(_real(path), target):
                how = "is" if _real(path) == target else "lies in"
                raise OutputError(
                    f"{flag} {path} {how} --save-hf {cfg.save_hf}, which the run replaces as "
                    "a whole with its Hugging Face export at the end (refused there as not "
                    "empty, or with --overwrite deleting what the run wrote). Fix: give "
                    "--save-hf a directory of its own (a new folder inside the run "
                    "directory is fine)."
                )
    if cfg.checkpoint_dir:
        ckpt = _real(cfg.checkpoint_dir)
        others = [("--save-hf", cfg.save_hf)] if cfg.save_hf else []
        for flag, path in folders + singles + others:
            step = _step_folder(_real(path), ckpt)
            if step is not None:
                raise OutputError(
                    f"{flag} {path} lies in the checkpoint folder {step} of --checkpoint-dir "
                    f"{cfg.checkpoint_dir}, which each save replaces and --keep-checkpoints "
                    "deletes. Fix: choose a path outside the step_* folders."
                )
    log = log_path(cfg)
    record = []
    if log is not None:
        record = [os.path.join(os.path.dirname(log), n) for n in ("train.log", *RECORD_FILES)]
    for i, (flag, path) in enumerate(singles):
        target = _real(path)
        for other, held in folders + singles[:i] + [("the run's record", r) for r in record]:
            if _inside(_real(held), target):
                how = "is" if _real(held) == target else "holds"
                raise OutputError(
                    f"{flag} {path}: it {how} {other} {held}, which the run writes too. "
                    f"Fix: give {flag} a file of its own."
                )


def check_run_files(
    cfg: Any,
    files: Mapping[str, str | None] | None = None,
    config_file: str | None = None,
) -> None:
    """The checks of :func:`check_files` that a run of ``train.run`` adds: its file
    outputs (``files``: flag -> path, ``--metrics-out``, ``--grads-out``) and its record.

    A file output is never one of the run's inputs (data, tokenizer, the Hugging Face
    checkpoint's files, ``config_file``), even with ``overwrite``, nor a folder, nor a
    file that is there unless ``overwrite`` (or, for ``--metrics-out``, ``resume`` and the
    file is the metrics of a run into the same ``checkpoint_dir``: the run's own earlier
    metrics; for ``--grads-out``, ``resume`` and an earlier start of the run, as its
    ``run.json`` lists them, was given the same file); its folder is made. The run
    directory may not hold another run's record unless ``resume`` (continue it) or
    ``overwrite``.

    Raises:
        OutputError: What is refused and the fix.
    """
    from hyper_parallel.checkpoint_hf.outputs import OutputError, check_output_file
    from hyper_parallel.train.run_hooks import tokenizer_path

    inputs = [tokenizer_path(cfg), config_file, getattr(cfg, "hf_config", None)]
    for given in (cfg.data, cfg.eval_data):
        inputs += (given or "").split(",")
    if cfg.hf_checkpoint and os.path.isdir(cfg.hf_checkpoint):
        inputs += [os.path.join(cfg.hf_checkpoint, n) for n in os.listdir(cfg.hf_checkpoint)]
    log = log_path(cfg)
    folder = os.path.dirname(log) or "." if log is not None else None
    held = [n for n in RECORD_FILES if folder and os.path.isfile(os.path.join(folder, n))]
    if held and not (cfg.resume or cfg.overwrite):
        flag = "--run-dir" if cfg.run_dir else "--checkpoint-dir"
        raise OutputError(
            f"{flag} {folder} holds the record of an earlier run ({', '.join(held)}); pass "
            "--resume to continue it, --overwrite to replace it, or choose another directory."
        )
    # Last: a file output's folder is made once nothing is refused.
    for flag, path in (files or {}).items():
        if path:
            # A resumed run's metrics replace those its earlier part wrote (a run continued
            # to more --steps with the same flags), not another run's; inputs are refused
            # all the same.
            replace = cfg.overwrite
            if flag == "--metrics-out" and cfg.resume and not cfg.overwrite:
                replace = _own_metrics(path, cfg.checkpoint_dir, inputs)
            if flag == "--grads-out" and cfg.resume and folder and not replace:
                # A start of this run given the same file wrote it; this one (a restart
                # before the first checkpoint: step 0 again) writes the same gradients.
                replace = _given_before(os.path.join(folder, "run.json"), flag, path)
            check_output_file(path, overwrite=replace, inputs=inputs, what=flag)


def run_starts(record: str) -> list[Any]:
    """The starts an existing ``run.json`` (``record``) lists, oldest first, the latest
    without its ``earlier`` list (``[]`` when there is none, or it is unreadable: a record
    is kept, never a reason to stop a run)."""
    try:
        with open(record, encoding="utf-8") as f:
            latest = json.load(f)
    except (OSError, ValueError):
        return []
    if not isinstance(latest, dict):
        return []
    before = latest.pop("earlier", [])
    return [*(before if isinstance(before, list) else []), latest]


def _given_before(record: str, flag: str, path: str) -> bool:
    """Whether a start that ``record`` (a run directory's ``run.json``) lists was given
    ``flag`` with ``path`` on its command line."""
    for start in run_starts(record):
        argv = start.get("argv") if isinstance(start, dict) else None
        if not isinstance(argv, list):
            continue
        for i, arg in enumerate(argv):
            value = argv[i + 1] if arg == flag and i + 1 < len(argv) else None
            if isinstance(arg, str) and arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            if isinstance(value, str) and _real(value) == _real(path):
                return True
    return False


def _own_metrics(path: str, checkpoint_dir: str, inputs: list[Any]) -> bool:
    """Whether ``path`` may be replaced by a resumed run: no file there, or the metrics a
    run into the same ``checkpoint_dir`` wrote (its ``config``). An input is left to
    :func:`check_output_file` to refuse.

    Raises:
        OutputError: Another file is there (another run's metrics, or no metrics).
    """
    from hyper_parallel.checkpoint_hf.outputs import OutputError

    if not os.path.isfile(path) or any(p and _real(p) == _real(path) for p in inputs):
        return True
    try:
        with open(path, encoding="utf-8") as f:
            written = json.load(f)["config"]["checkpoint_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        written = None
    if isinstance(written, str) and _real(written) == _real(checkpoint_dir):
        return True
    whose = (
        f"the metrics of a run into --checkpoint-dir {written}"
        if isinstance(written, str)
        else "not metrics a run wrote"
    )
    raise OutputError(
        f"--metrics-out {path}: a file is there, {whose}; --resume replaces only the "
        f"metrics of the run it continues (--checkpoint-dir {checkpoint_dir}). Give another "
        "path, or pass --overwrite to replace it."
    )


def check_files(
    cfg: Any,
    *,
    files: Mapping[str, str | None] | None = None,
    config_file: str | None = None,
) -> None:
    """Before any rank builds: outputs that would clobber something, a ``resume`` past
    ``steps``, a damaged checkpoint, bytes for a model whose vocabulary cannot hold them.

    Args:
        cfg: The run's ``TrainConfig``.
        files: The file outputs of ``train.run`` by flag (``--metrics-out``, ``--grads-out``).
        config_file: The ``--config`` file the options came from (an input).

    Raises:
        OutputError: See :func:`check_outputs` and :func:`check_run_files`.
        ValueError: See :func:`check_resume` and
            :func:`~hyper_parallel.train.run_hooks.check_byte_data`.
        HFCheckpointError: A safetensors file of ``hf_checkpoint`` is missing,
            truncated or corrupt (each named, with what is wrong).
    """
    check_outputs(cfg, files)
    check_resume(cfg)
    from hyper_parallel.train import run_hooks

    run_hooks.check_byte_data(cfg)
    if cfg.hf_checkpoint:
        from hyper_parallel.checkpoint_hf.io import (
            HFCheckpointError,
            checkpoint_files,
            safetensors_problem,
        )

        try:
            shards = sorted(set(checkpoint_files(cfg.hf_checkpoint).values()))
        except FileNotFoundError as e:
            raise ValueError(f"--hf-checkpoint: {e}") from None
        damaged = [p for p in map(safetensors_problem, shards) if p]
        if damaged:
            raise HFCheckpointError(f"--hf-checkpoint {cfg.hf_checkpoint}", damaged)
    check_run_files(cfg, files, config_file)  # last: it makes the file outputs' folders


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:,.0f}"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


def num_parameters(cfg: Any) -> int:
    """The whole model's parameter count (built on the meta device: no memory)."""
    from hyper_parallel.dmodule.model_spec import get_spec

    with torch.device("meta"):
        model = get_spec(cfg.model).config(**cfg.model_overrides).build()
    return sum(p.numel() for p in model.parameters())


def batches_per_epoch(data: Any) -> int:
    """Global batches a stream serves before it starts over (see ``TextBatches``)."""
    return max(1, (len(data.tokens) - 1) // data.span)


def unused_options(cfg: Any) -> list[str]:
    """Notes for options this run would not use: checkpoint options without
    ``--checkpoint-dir``, evaluation options without evaluation data, ``--text`` beside
    ``--data``, ``--text-field`` without ``.jsonl`` data, ``--min-lr`` under the constant
    schedule, a decaying schedule the warm-up outlasts, a weight decay bf16-true rounds
    away. Said, not refused (a job file may
    carry them for the runs that do)."""
    out = []
    ckpt = [
        flag
        for flag, on in (
            (f"--checkpoint-every {cfg.checkpoint_every}", cfg.checkpoint_every > 0),
            (f"--keep-checkpoints {cfg.keep_checkpoints}", cfg.keep_checkpoints > 0),
            ("--async-checkpoint", cfg.async_checkpoint),
        )
        if on
    ]
    if ckpt and not cfg.checkpoint_dir:
        out.append(
            f"note: {', '.join(ckpt)}: no --checkpoint-dir, so the run saves no checkpoint "
            "and does not use them. Fix: give --checkpoint-dir DIR, or drop them."
        )
    evals = [
        flag
        for flag, on in (
            (f"--eval-every {cfg.eval_every}", cfg.eval_every > 0),
            (f"--eval-batches {cfg.eval_batches}", cfg.eval_batches is not None),
        )
        if on
    ]
    if evals and not (cfg.eval_data or cfg.eval_split):
        out.append(
            f"note: {', '.join(evals)}: no evaluation data, so the run does not evaluate. "
            "Fix: give --eval-data PATH or --eval-split X, or drop them."
        )
    if cfg.lr_schedule == "constant" and cfg.min_lr is not None:
        out.append(
            f"note: --min-lr {cfg.min_lr:g}: the constant schedule does not decay, so the run "
            "does not use it. Fix: pick a decaying --lr-schedule (cosine, linear, wsd), or "
            "drop it."
        )
    # A decaying schedule the warm-up outlasts, when asked for (a schedule other than the
    # default, or a --min-lr): the quick runs of the defaults say nothing.
    default_schedule = type(cfg).__dataclass_fields__["lr_schedule"].default
    asked = cfg.lr_schedule != default_schedule or cfg.min_lr is not None
    if cfg.lr_schedule != "constant" and cfg.warmup_steps >= cfg.steps and asked:
        floor = f" nor reaches --min-lr {cfg.min_lr:g}" if cfg.min_lr is not None else ""
        out.append(
            f"note: --lr-schedule {cfg.lr_schedule}: the run's {cfg.steps} step(s) are all "
            f"warm-up (--warmup-steps {cfg.warmup_steps}), so the rate only rises and never "
            f"decays{floor}. Fix: --warmup-steps below --steps, or --lr-schedule constant."
        )
    if cfg.data and cfg.text != DEFAULT_TEXT:
        unknown = cfg.text not in available_texts()
        out.append(
            f"note: --text {cfg.text}: --data gives the training data, so the run does not "
            "read the shipped text"
            + (
                f" (and there is no shipped text of that name: {available_texts()})"
                if unknown
                else ""
            )
            + ". Fix: drop --text."
        )
    jsonl = [
        p for p in f"{cfg.data or ''},{cfg.eval_data or ''}".split(",") if p.endswith(".jsonl")
    ]
    if cfg.text_field != "text" and not jsonl:
        out.append(
            f"note: --text-field {cfg.text_field}: no .jsonl data (--data, --eval-data), so the "
            "run does not use it. Fix: drop it."
        )
    decay = cfg.lr * cfg.weight_decay
    if cfg.dtype == "bf16-true" and 0 < decay < 2**-9:
        # p * (1 - decay) moves p by less than half a bf16 unit (2**-8 of p, at the least).
        out.append(
            f"note: --weight-decay {cfg.weight_decay:g}: under --dtype bf16-true AdamW "
            f"multiplies each bf16 parameter by 1 - lr x weight_decay = {1 - decay:.6g}, "
            "which rounds back to the same value (lr x weight_decay below 2**-9), so the "
            "run does not decay. Fix: --dtype bf16 (fp32 master weights), or "
            "--weight-decay 0."
        )
    return out


def _rate_runs(rates: list[tuple[int, float]]) -> str:
    """``"step 3 runs at 3.00e-03, steps 4-5 at 3.00e-04"``: consecutive steps of the
    same rate (as printed) said once."""
    runs: list[list[Any]] = []
    for step, rate in rates:
        text = f"{rate:.2e}"
        if runs and runs[-1][2] == text:
            runs[-1][1] = step
        else:
            runs.append([step, step, text])
    parts = [f"step {a}" if a == b else f"steps {a}-{b}" for a, b, _ in runs]
    verbs = ["runs at" if a == b else "run at" for a, b, _ in runs]
    said = [f"{parts[0]} {verbs[0]} {runs[0][2]}"]
    said += [f"{p} at {r[2]}" for p, r in zip(parts[1:], runs[1:], strict=True)]
    return ", ".join(said)


def step_line(cfg: Any, run: Any) -> str | None:
    """How a step runs its batch, when it is more than one forward and backward: the
    pipeline schedule and its stages, or gradient accumulation and when gradients are
    reduced. ``None`` for one forward of each data-parallel rank's batch."""
    layout = run.layout
    microbatches = run.num_microbatches
    per_rank = cfg.batch_size // layout.size("batch")
    size = per_rank // max(1, microbatches)
    each = f"{microbatches} micro-batches of {size} sequence(s) per data-parallel rank"
    if layout.pp > 1 and run.pipeline is not None:
        stages = len(run.pipeline.stages)
        reduced = "reduced once per step" if layout.size("loss") > 1 else "summed over them"
        return (
            f"step: {run.schedule} pipeline over pp={layout.pp}, {stages} stages "
            f"({stages // layout.pp} per rank), {each}; gradients {reduced}"
        )
    if microbatches == 1:
        return None
    if layout.size("loss") == 1:
        when = "gradients summed over them"
    elif cfg.reduce_each_microbatch:
        when = "gradients reduced after each (--reduce-each-microbatch), accumulated sharded"
    else:
        when = "gradients reduced once, after the last"
    return f"step: gradient accumulation, {each}, run in turn; {when}"


def lr_line(cfg: Any, done: int) -> str:
    """The start summary's ``lr:`` line: the rates the run's steps get.

    Step ``k`` (1-based) runs at ``cfg.lr_at(k - 1)``, as the trainer sets it; the line
    names the first step's rate, the peak's step (when the run reaches it) and the last
    step's rate, read from that function rather than from the flags.
    """
    first, last = done + 1, cfg.steps
    total = cfg.lr_schedule_steps or cfg.steps
    head = f"lr: {cfg.lr_schedule} over {total} step(s)"
    if cfg.warmup_steps:
        head += f", {cfg.warmup_steps} of warm-up"
    points = [f"{cfg.lr_at(first - 1):.2e} at step {first}"]
    peak = max(cfg.warmup_steps, 1)
    if first < peak < last and peak <= total:  # a warm-up past the schedule stops at its end
        points.append(f"peak {cfg.lr_at(peak - 1):.2e} at step {peak}")
    if last > first:
        points.append(f"{cfg.lr_at(last - 1):.2e} at step {last}")
    return f"{head}: " + ", ".join(points)


class RunReport:
    """The reporting side of one :class:`~hyper_parallel.train.Trainer` (see the module).

    Args:
        trainer: The trainer (its config, rank, data and model are read).
    """

    def __init__(self, trainer: Any) -> None:
        cfg = trainer.cfg
        self.trainer = trainer
        self.is_logger = trainer.rank == 0
        self.prints = self.is_logger and cfg.log_every > 0
        self.log_file = log_path(cfg) if self.is_logger else None
        self.step_logger: Any = None
        self.started = False
        self.notes: list[str] = []
        self.epoch = trainer.data.epoch
        self.eval_data: Any = None
        self.held_out = 0
        self.resumed_path: str | None = None
        # What the run plan warns of (switches the run does not use): said at the start.
        self.notes += [f"note: {f}" for f in trainer.run.findings if f.severity == "warning"]
        self.notes += unused_options(cfg)
        if cfg.eval_data:
            self.eval_data = _eval_stream(cfg, trainer)
        elif cfg.eval_split:
            # The last eval_split of the data is held out: the trainer's stream is cut
            # to the rest (the same cut every run, so a resumed stream stays valid).
            trainer.data, self.eval_data = _split(trainer.data, cfg)
            self.held_out = len(self.eval_data.tokens)
        if cfg.checkpoint_dir and cfg.overwrite and not cfg.resume:
            self._clear_checkpoints(cfg.checkpoint_dir)
        if self.log_file is not None:
            os.makedirs(os.path.dirname(self.log_file) or ".", exist_ok=True)
            mode = "w" if cfg.overwrite and not cfg.resume else "a"
            with open(self.log_file, mode, encoding="utf-8") as f:
                now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
                f.write(f"=== run started {now} ===\n")

    def _clear_checkpoints(self, checkpoint_dir: str) -> None:
        from hyper_parallel.train.checkpoint import remove_checkpoints

        removed = remove_checkpoints(checkpoint_dir) if self.is_logger else []
        if self.trainer.mesh is not None and dist.get_world_size() > 1:
            dist.barrier()  # no rank looks for a checkpoint before they are gone
        if removed:
            self.notes.append(
                f"--overwrite: removed {len(removed)} checkpoint(s) of an earlier run from "
                f"{checkpoint_dir}"
            )

    def say(self, line: str) -> None:
        """Print ``line`` (rank 0, ``log_every`` > 0) and append it to the log file."""
        if self.prints:
            print(line, flush=True)
        if self.log_file is not None:
            with open(self.log_file, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    # ------------------------------------------------------------------ start

    def resumed(self, path: str, state: dict[str, Any]) -> None:
        """Keep the schedule a resumed run was started with (unless told otherwise); say
        where the data differs from what the checkpoint's run read."""
        t = self.trainer
        cfg = t.cfg
        saved = state.get("lr_schedule_steps")
        self.notes.append(f"resumed from step {t.step} ({path})")
        self.resumed_path = path
        differs = data_mismatch(path, state, t.data_record())
        if differs:
            self.notes.append(f"note: {differs}")
        if saved is None or cfg.lr_schedule_steps is not None:
            return
        saved = int(saved)
        if saved != cfg.steps and cfg.steps > t.step:
            t.cfg = dataclasses.replace(cfg, lr_schedule_steps=saved)
            # Step k (1-based) runs at lr_at(k - 1): past the schedule's end, at min_lr
            # (a warm-up longer than the schedule stops at its end too).
            if cfg.steps > saved:
                rates = [(k, t.cfg.lr_at(k - 1)) for k in range(saved + 1, cfg.steps + 1)]
                tail = f"; past its end, {_rate_runs(rates)}"
            else:
                tail = f"; step {cfg.steps} runs at {t.cfg.lr_at(cfg.steps - 1):.2e}"
            self.notes.append(
                f"lr: the resumed run keeps the {cfg.lr_schedule} schedule of {saved} steps it "
                f"was started with{tail} (pass --lr-schedule-steps {cfg.steps} to fit it "
                f"to --steps {cfg.steps} instead)"
            )
        else:
            t.cfg = dataclasses.replace(cfg, lr_schedule_steps=saved)

    def summary(self) -> list[str]:
        """The start summary's lines."""
        t = self.trainer
        cfg = t.cfg
        if self.resumed_path:  # the checkpoint's weights, whatever --seed or --hf-checkpoint say
            source = f"weights from the checkpoint {self.resumed_path}"
        elif cfg.hf_checkpoint:
            source = f"weights from the Hugging Face checkpoint {cfg.hf_checkpoint}"
        else:
            source = f"preset, initialized with seed {cfg.seed}"
        lines = [f"model: {cfg.model} ({source}), {_count(num_parameters(cfg))} parameters"]
        ranks = dist.get_world_size() if t.mesh is not None else 1
        extras = [f"dtype {cfg.dtype}"]
        if cfg.ac != "none":
            extras.append(f"ac {cfg.ac}")
        if cfg.sp:
            extras.append("sp")
        if cfg.compile:
            extras.append(f"compiled ({cfg.compile_backend})")
        lines.append(
            f"mesh: {cfg.layout.describe()} ({ranks} rank(s) on {t.device.type}), "
            + ", ".join(extras)
        )
        data = t.data
        tokens = len(data.tokens)
        source = cfg.data or f"the shipped text {cfg.text}"
        if not cfg.data:
            from hyper_parallel.train.run_hooks import tokenizer_path

            tokenizer = tokenizer_path(cfg)
            source += f" tokenized with {tokenizer}" if tokenizer else " as bytes"
        per_epoch = batches_per_epoch(data)
        held = f" (and {self.held_out:,} held out for eval)" if self.held_out else ""
        lines.append(
            f"data: {source}: {tokens:,} tokens{held}, {per_epoch * cfg.batch_size:,} "
            f"sequences of {cfg.seq_len} ({per_epoch} step(s) per pass)"
        )
        remaining = max(0, cfg.steps - t.step)
        passes = remaining / per_epoch
        wrap = f"; the data starts over every {per_epoch} step(s)" if passes > 1 else ""
        if remaining:
            lines.append(
                f"run: steps {t.step + 1}-{cfg.steps} ({remaining}) x {cfg.batch_size} "
                f"sequences x {cfg.seq_len} tokens = {remaining * data.span:,} tokens, "
                f"{passes:.2f} pass(es) over the data{wrap}"
            )
        else:  # resumed at --steps (it said "steps 7-6 (0)")
            lines.append(
                f"run: nothing to train: resumed at step {t.step}, --steps {cfg.steps} "
                f"(pass --steps > {t.step} to train on)"
            )
        step = step_line(cfg, t.run) if remaining else None
        if step:
            lines.append(step)
        if remaining:  # no rate to tell when no step runs
            lines.append(lr_line(cfg, t.step))
        if cfg.checkpoint_dir:
            every = f"every {cfg.checkpoint_every} steps and " if cfg.checkpoint_every else ""
            keep = f", keeping the newest {cfg.keep_checkpoints}" if cfg.keep_checkpoints else ""
            how = ", written in the background" if getattr(cfg, "async_checkpoint", False) else ""
            lines.append(f"checkpoints: {every}at the end, to {cfg.checkpoint_dir}{keep}{how}")
        if cfg.save_hf:
            lines.append(f"export: Hugging Face checkpoint to {cfg.save_hf} at the end")
        if self.eval_data is not None:
            when = f"every {cfg.eval_every} steps and " if cfg.eval_every else ""
            what = cfg.eval_data or f"the last {cfg.eval_split:.0%} of the data"
            lines.append(f"eval: {what}, {self.eval_batches} batch(es), {when}at the end")
        if self.log_file is not None:
            lines.append(f"log: {self.log_file}")
        return lines + self.notes

    def start(self) -> None:
        """Print the summary once (the first :meth:`~hyper_parallel.train.Trainer.fit`)."""
        if self.started:
            return
        self.started = True
        if self.is_logger:
            for line in self.summary():
                self.say(line)

    # ------------------------------------------------------------------ events

    def after_step(self, loss: float) -> None:
        """Note an epoch boundary; evaluate when due (every rank calls it)."""
        t = self.trainer
        if t.data.epoch != self.epoch:
            self.epoch = t.data.epoch
            tokens = len(t.data.tokens)
            # A pass reads whole global batches: rows overlap by one token, so it reads
            # batches x span + 1 tokens; a tail too short for one more batch is left.
            seen = batches_per_epoch(t.data) * t.data.span + 1
            said = (
                f"every one of its {tokens:,} tokens was seen"
                if seen >= tokens
                else f"{seen:,} of its {tokens:,} tokens were seen; the last "
                f"{tokens - seen:,} do not fill a batch"
            )
            self.say(f"step {t.step}: the data starts over (pass {self.epoch + 1}; {said})")
        cfg = t.cfg
        end = t.step == cfg.steps
        if self.eval_data is not None and (
            end or (cfg.eval_every and t.step % cfg.eval_every == 0)
        ):
            loss = self.evaluate()
            self.say(f"step {t.step:>5}/{cfg.steps} | eval loss {loss:.4f}")
            if self.step_logger is not None and self.step_logger.writer is not None:
                self.step_logger.writer.add_scalar("eval/loss", loss, t.step)
                self.step_logger.writer.flush()

    @property
    def eval_batches(self) -> int:
        cfg = self.trainer.cfg
        whole = batches_per_epoch(self.eval_data)
        return whole if cfg.eval_batches is None else min(cfg.eval_batches, whole)

    def evaluate(self) -> float:
        """The mean loss over ``eval_batches`` global batches of the held-out data."""
        t = self.trainer
        stream, saved = self.eval_data, t.data
        stream.load_state_dict({"position": 0, "epoch": 0})
        total = 0.0
        t.data = stream  # the trainer's own batching (dp rows, cp chunks)
        try:
            with torch.no_grad():
                for _ in range(self.eval_batches):
                    batch = t.local_batch()
                    from hyper_parallel.distributed.precision import loss_logits

                    logits = t.model(batch.inputs, **batch.model_kwargs)
                    total += t.global_mean(t.loss_fn(loss_logits(logits), batch.targets))
        finally:
            t.data = saved
        return total / self.eval_batches

    def saved(
        self, path: str, seconds: float, *, step: int | None = None, background: bool = False
    ) -> None:
        """A checkpoint of ``step`` (default: the trainer's) was written; remove old ones
        beyond ``keep_checkpoints``. ``background``: written while training went on
        (``seconds`` from its start to its completion)."""
        cfg = self.trainer.cfg
        if not self.is_logger:
            return
        step = self.trainer.step if step is None else step
        size = _dir_bytes(path)  # measured first: a pruning that removed it said '0 B'
        removed: list[str] = []
        if cfg.keep_checkpoints and cfg.checkpoint_dir:
            from hyper_parallel.train.checkpoint import prune_checkpoints

            # The step just saved stays and counts; newer ones (an earlier run's, passed
            # over on --resume as damaged) never count in its place.
            removed = prune_checkpoints(cfg.checkpoint_dir, cfg.keep_checkpoints, step=step)
        gone = f"; removed {', '.join(os.path.basename(p) for p in removed)}" if removed else ""
        how = " in the background" if background else ""
        self.say(
            f"step {step}: checkpoint saved to {path} ({_bytes(size)}, {seconds:.2f} s{how}){gone}"
        )

    def exported(self, path: str, seconds: float) -> None:
        """The Hugging Face checkpoint was written."""
        if not self.is_logger:
            return
        names = sorted(os.listdir(path))
        shards = sum(n.endswith(".safetensors") for n in names)
        others = [n for n in names if not n.endswith(".safetensors")]
        self.say(
            f"step {self.trainer.step}: Hugging Face checkpoint written to {path} "
            f"({shards} safetensors file(s), {', '.join(others)}; "
            f"{_bytes(_dir_bytes(path))}, {seconds:.2f} s)"
        )


_DATA_FLAGS = {
    "source": "--data",
    "tokens": "--data",
    "batch_size": "--batch-size",
    "seq_len": "--seq-len",
    "eval_split": "--eval-split",
    "tokenizer": "--tokenizer",
}
_RECORDED_LATER = ("eval_split", "tokenizer")  # compared where a checkpoint recorded them


def data_mismatch(
    path: str, state: dict[str, Any], now: dict[str, Any], *, refused: bool = False
) -> str:
    """What a resumed run reads otherwise than the run that wrote checkpoint ``path``
    (its ``data_json``; ``now``: :meth:`Trainer.data_record`), or ``""``.

    ``refused``: the checkpoint's data position is past this run's data (the run cannot
    start): the message says so whether or not the checkpoint recorded its data.
    """
    position = int(state.get("data_position", 0))
    raw = state.get("data_json")
    then = json.loads(raw if isinstance(raw, str) else bytes(raw).decode()) if raw else None
    if isinstance(then, dict):
        changed = [
            k
            for k in _DATA_FLAGS
            if (k in then or k not in _RECORDED_LATER) and then.get(k) != now.get(k)
        ]
        if "tokenizer" in changed and "source" not in changed and "tokens" in changed:
            changed.remove("tokens")  # the other tokenizer made other tokens: it is the fix
    else:
        changed = []
    if not changed and not refused:
        return ""

    def describe(d: dict[str, Any]) -> str:
        held = f", the last {d['eval_split']:.0%} held out" if d.get("eval_split") else ""
        how = f" tokenized with {d['tokenizer']}" if d.get("tokenizer") else ""
        return (
            f"{d['source']}{how} ({int(d['tokens']):,} tokens{held}), batches of "
            f"{d['batch_size']} x {d['seq_len']}"
        )

    before = f"the run that wrote {path} read {describe(then)}" if isinstance(then, dict) else ""
    flags = sorted({_DATA_FLAGS[k] for k in changed}) or ["--data"]
    if refused:
        head = (
            f"--resume: {path} stopped at token {position:,} of its data, past the end of "
            f"this run's {describe(now)}"
        )
        fix = f"resume with the {', '.join(flags)} that run used"
        return (
            f"{head}{'; ' + before if before else ''}. Fix: {fix}, or start a new run on "
            "this data (another --checkpoint-dir, or --overwrite)."
        )
    return (
        f"--resume: {before}; this run reads {describe(now)}, from that run's position "
        f"(token {position:,}), so it does not continue the same stream. Fix: resume with "
        f"the {', '.join(flags)} that run used, or start a new run on this data (another "
        "--checkpoint-dir, or --overwrite)."
    )


def _split(data: Any, cfg: Any) -> tuple[Any, Any]:
    """The training stream over the first ``1 - eval_split`` of ``data``'s tokens, and an
    evaluation stream over the rest."""
    from hyper_parallel.train.data import TextBatches
    from hyper_parallel.train.tokens import TokenBatches

    array = data.array if isinstance(data, TokenBatches) else data.tokens
    cut = len(array) - round(cfg.eval_split * len(array))
    sizes = {"global_batch_size": cfg.batch_size, "seq_len": cfg.seq_len}
    parts = []
    for name, piece in (("training", array[:cut]), ("held-out", array[cut:])):
        try:
            if isinstance(data, TokenBatches):
                source = f"{data.source} ({name} part)"
                parts.append(TokenBatches(piece, source=source, **sizes))
            else:
                parts.append(TextBatches(piece, **sizes))
        except ValueError as e:
            raise ValueError(
                f"--eval-split {cfg.eval_split}: the {name} part ({len(piece):,} tokens) is "
                f"too small: {e}"
            ) from None
    return parts[0], parts[1]


def _eval_stream(cfg: Any, trainer: Any) -> Any:
    from hyper_parallel.dmodule.model_spec import get_spec
    from hyper_parallel.train.run_hooks import build_data

    spec = get_spec(cfg.model)
    vocab = None
    if spec.family.vocab_size is not None:
        vocab = spec.family.vocab_size(spec.config(**cfg.model_overrides))
    try:
        return build_data(
            dataclasses.replace(cfg, data=cfg.eval_data), vocab, getattr(trainer, "hf", None)
        )
    except ValueError as e:
        raise ValueError(str(e).replace("--data ", "--eval-data ")) from None


def timed() -> float:
    """``time.perf_counter()``: the clock events are timed with."""
    return time.perf_counter()
