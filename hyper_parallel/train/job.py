"""Job files: ``--config job.toml`` holding a run's options, and the record a run leaves.

A job file holds the run options (the table of :mod:`hyper_parallel.train.arguments`
is its schema), keyed by their long names without the dashes, written as in TOML::

    # job.toml
    mesh = "dp_shard=2,tp=2"
    steps = 200
    batch-size = 16          # batch_size works too
    hf-checkpoint = "outputs/tiny-llama"
    model-overrides = { num_layers = 4 }
    lr-schedule = "wsd"

Values are checked as the flags are (``mesh`` parsed, choices enforced, counts
integers); a key that is no option is refused with the closest name (``difflib``).
``TrainConfig`` field names (``lr_schedule_steps``) are accepted too, and a ``.json`` file of
them is read as before. Options given on the command line override the file.

:func:`write_run_record` leaves in the run directory the resolved options as a job
file (``config.toml``, which ``--config`` reads back) and ``run.json`` with the
package version and the git commit of its source, when it is a checkout. The one-off
actions of a run (:data:`ONE_OFF_ACTIONS`: ``--overwrite``, ``--resume``) are not kept
as options there: reading the record back repeats the run's settings, never its
deletions; a comment says they were given. Its header is the command that reads it
back (``torchrun`` with the run's ranks when there were several), from the folder the
run was started in, to which its paths are relative.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import difflib
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import tomllib

__all__ = [
    "COMMAND_LINE_OUTPUTS",
    "ONE_OFF_ACTIONS",
    "TRAIN_MODULE",
    "load_job_file",
    "node_command",
    "quoted_args",
    "rerun_command",
    "to_toml",
    "write_run_record",
]


RENAMED = {
    "num_steps": "steps",
    "global_batch_size": "batch_size",
    "num_microbatches": "microbatches",
    "sequence_parallel": "sp",
}
"""Former ``TrainConfig`` field names -> today's (the flags' names): refused with the hint."""

ONE_OFF_ACTIONS = ("overwrite", "resume")
"""``TrainConfig`` fields that act once rather than set the run (``--overwrite`` deletes
an earlier run's checkpoints and record, ``--resume`` continues one): a run's record
does not keep them, so reading it back with ``--config`` deletes nothing (no flag turns
a boolean off)."""

COMMAND_LINE_OUTPUTS = ("--metrics-out", "--grads-out")
"""Files ``train.run`` writes that are flags of its command line, not run options
(``TrainConfig`` fields): a job file does not set them; said so when one tries."""

Options = Sequence[tuple[str, str, dict[str, Any]]]
"""The run-option table: (flag, TrainConfig field, argparse keywords) per option."""


def _options(options: Options) -> dict[str, tuple[str, dict[str, Any]]]:
    """Job-file key -> (TrainConfig field, the option's argparse keywords)."""
    table: dict[str, tuple[str, dict[str, Any]]] = {}
    for flag, dest, kwargs in options:
        key = flag.removeprefix("--")
        table[key] = (dest, kwargs)
        table[key.replace("-", "_")] = (dest, kwargs)
    return table


def _fields() -> dict[str, Any]:
    from hyper_parallel.train.trainer import TrainConfig

    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def _convert(where: str, key: str, value: Any, kwargs: dict[str, Any]) -> Any:
    if value is None:  # JSON's null (TrainConfig.to_dict of an unset field): the default
        return None
    action = kwargs.get("action")
    if action in ("store_true", "store_false"):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {key} = {value!r}: expected true or false.")
        return value if action == "store_true" else not value
    kind = kwargs.get("type")
    if kind in (int, float):
        ok = isinstance(value, int) and not isinstance(value, bool)
        ok = ok or (kind is float and isinstance(value, float))
        if not ok:
            raise ValueError(f"{where}: {key} = {value!r}: expected a number ({kind.__name__}).")
        value = kind(value)
    elif kind is None and not isinstance(value, str):
        # A name or a path: a table here is most often a torchtitan-style [section].
        flat = (
            " A job file is flat: options at the top level, not in [sections]."
            if isinstance(value, dict)
            else ""
        )
        raise ValueError(
            f'{where}: {key} = {value!r}: expected a string (e.g. {key} = "...").{flat}'
        )
    elif kind is not None and isinstance(value, str):
        try:
            value = kind(value)
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ValueError(f"{where}: {key} = {value!r}: {e}") from None
    choices = kwargs.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{where}: {key} = {value!r}: choose one of {', '.join(choices)}.")
    return value


def load_job_file(path: str, options: Options) -> dict[str, Any]:
    """The ``TrainConfig`` values of a job file (``.toml``; ``.json`` of fields also read).

    ``options`` is the run-option table (:mod:`hyper_parallel.train.arguments`), the
    file's schema.

    Raises:
        ValueError: An unreadable file, a key that is no option (with the closest
            name), or a value the option does not take.
    """
    where = f"--config {path}"
    try:
        with open(path, "rb") as f:
            raw = json.load(f) if path.endswith(".json") else tomllib.load(f)
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror}).") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e}).") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: not valid TOML ({e}).") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object of run options, got {type(raw).__name__}.")
    table, fields = _options(options), _fields()
    values: dict[str, Any] = {}
    unknown = []
    for key, value in raw.items():
        if key in table:
            dest, kwargs = table[key]
            values[dest] = _convert(where, key, value, kwargs)
        elif key in fields:
            values[key] = value  # a TrainConfig field (the JSON files of TrainConfig.to_dict)
        else:
            unknown.append(key)
    command_line = {
        key: flag
        for key in unknown
        for flag in COMMAND_LINE_OUTPUTS
        if key in (flag.removeprefix("--"), flag.removeprefix("--").replace("-", "_"))
    }
    unknown = [key for key in unknown if key not in command_line]
    outputs = ""
    if command_line:
        one = len(command_line) == 1
        flags = " ".join(f"{f} {shlex.quote(str(raw[k]))}" for k, f in command_line.items())
        outputs = (
            f"{' and '.join(command_line.values())} "
            f"{'is an output' if one else 'are outputs'} of the train command line, not "
            f"{'a run option' if one else 'run options'} a job file can set: remove the "
            f"{'key' if one else 'keys'} {', '.join(repr(k) for k in command_line)} and pass "
            f"{'it as a flag' if one else 'them as flags'} next to --config "
            f"(--config {shlex.quote(path)} {flags})."
        )
    if outputs and not unknown:
        raise ValueError(f"{where}: {outputs}")
    if unknown:
        names = sorted({k for k in table if "_" not in k} | set(fields))
        hints = []
        for key in unknown:
            close = [RENAMED[key]] if key in RENAMED else []
            close = close or difflib.get_close_matches(key, names, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        sections = [k for k in unknown if isinstance(raw[k], dict)]
        flat = (
            f" [{sections[0]}] is a section: a job file is flat, its options at the top level "
            f"(e.g. {next(iter(raw[sections[0]]), 'steps')} = ... before any [section])."
            if sections
            else ""
        )
        raise ValueError(
            f"{where}: unknown option(s) {', '.join(hints)}; keys are the long option names "
            f"without dashes (python -m hyper_parallel.train.run --help lists them).{flat}"
            + (f" Also {outputs}" if outputs else "")
        )
    return values


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string is a JSON string
    return json.dumps(json.dumps(value))  # objects: as the JSON their option takes


def to_toml(cfg: Any, options: Options, *, leave_out: Sequence[str] = ()) -> str:
    """The options of ``cfg`` as a job file ``--config`` reads back to an equal config
    (but for the fields named in ``leave_out``, which it does not write). A field of a
    dataclass ``cfg`` that no option sets (``compile_backend``, which job files take) is
    written under its field name where it is not its default."""
    lines = []
    for flag, dest, kwargs in options:
        value = getattr(cfg, dest)
        if value is None or dest in leave_out:
            continue
        key = flag.removeprefix("--")
        if kwargs.get("action") == "store_false":
            value = not value
        if dest == "mesh":
            value = ",".join(f"{a}={s}" for a, s in value.items())
        lines.append(f"{key} = {_toml_value(value)}")
    covered = {dest for _, dest, _ in options} | set(leave_out)
    if dataclasses.is_dataclass(cfg):
        for field in dataclasses.fields(cfg):
            value = getattr(cfg, field.name)
            if field.name in covered or value is None or value == field.default:
                continue
            lines.append(f"{field.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = subprocess.run(
        ["git", "-C", here, "status", "--porcelain", "--untracked-files=no", "--", "."],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    ).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


TRAIN_MODULE = "hyper_parallel.train.run"


def quoted_args(args: Sequence[str]) -> str:
    """``args`` as one shell-quoted string."""
    return " ".join(shlex.quote(a) for a in args)


def node_command(train_args: Sequence[str], *, nodes: int, gpus_per_node: int) -> str:
    """The ``torchrun`` line that runs ``python -m hyper_parallel.train.run train_args``.

    One node: ``torchrun --standalone --nproc-per-node G``. Several: the line every
    node runs, with ``$NODE_RANK`` (0 .. nodes-1) and node 0's ``$MASTER_ADDR`` and
    ``$MASTER_PORT`` left for the shell to fill in.

    Example::

        node_command(["--mesh", "dp=2,tp=8"], nodes=2, gpus_per_node=8)
    """
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(
            f"launch: nodes ({nodes}) and GPUs per node ({gpus_per_node}) must be >= 1."
        )
    if nodes == 1:
        launch = f"torchrun --standalone --nproc-per-node {gpus_per_node}"
    else:
        launch = (
            f"torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node} "
            '--node-rank "$NODE_RANK" --rdzv-backend c10d '
            '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"'
        )
    return f"{launch} -m {TRAIN_MODULE} {quoted_args(train_args)}".rstrip()


def rerun_command(config: str, world_size: int = 1, ranks_per_node: int | None = None) -> str:
    """The command that runs the job file ``config`` on ``world_size`` ranks as a run
    did: ``python -m`` for one, else the ``torchrun`` line of
    :func:`node_command` (``ranks_per_node`` each; default:
    all on one node)."""
    if world_size <= 1:
        return f"python -m {TRAIN_MODULE} --config {shlex.quote(config)}"
    per_node = ranks_per_node or world_size
    nodes = max(1, world_size // per_node)
    return node_command(["--config", config], nodes=nodes, gpus_per_node=per_node)


def write_run_record(
    folder: str,
    cfg: Any,
    options: Options,
    *,
    world_size: int = 1,
    ranks_per_node: int | None = None,
    resumed_from: int = 0,
    argv: Sequence[str] | None = None,
) -> list[str]:
    """Write ``config.toml`` (the resolved options) and ``run.json`` (version, commit) to
    ``folder``; returns their paths. Call it on one process (the trainer: rank 0).

    A run resumed at step ``resumed_from`` > 0 keeps the record of the steps before it:
    ``run.json``'s ``earlier`` lists every earlier start (its time, command and
    options), and an earlier ``config.toml`` whose options differ from this start's is
    kept as ``config.before_step_N.toml`` (the command in its header runs those steps;
    a longer ``steps`` alone is no difference: the resumed run keeps its schedule). A
    later start from the same step keeps that file: those steps ran as it says.

    ``config.toml`` leaves out :data:`ONE_OFF_ACTIONS`; its header is the command that
    reads it back (:func:`rerun_command` with ``world_size`` ranks, ``ranks_per_node``
    on each node) from the working directory of this process, which its relative paths
    (``folder`` among them) are relative to. ``run.json`` keeps ``argv``, the command
    the run was given (default ``sys.argv``).
    """
    from hyper_parallel import __version__
    from hyper_parallel.train.report import run_starts

    os.makedirs(folder, exist_ok=True)
    config = os.path.join(folder, "config.toml")
    cwd = os.getcwd()
    command = f"cd {shlex.quote(cwd)} && {rerun_command(config, world_size, ranks_per_node)}"
    if getattr(cfg, "checkpoint_dir", None):
        how = [
            "# to continue it from its latest checkpoint, from there:",
            f"#   {command} --resume",
            "# (--overwrite instead of --resume starts it over, deleting its checkpoints).",
        ]
        if getattr(cfg, "save_hf", None):
            how += [
                "# Once its --save-hf export is written, continuing it replaces that export",
                f"# (the checkpoints are kept): {command} --resume --overwrite",
            ]
    else:
        how = [
            "# to run it again, from there (replacing this record and its log):",
            f"#   {command} --overwrite",
        ]
    head = [
        "# The resolved options of this run. Its relative paths are relative to the folder",
        f"# it was started in, {cwd};",
        *how,
    ]
    given = [f"--{dest}" for dest in ONE_OFF_ACTIONS if getattr(cfg, dest, False)]
    if given:
        head.append(f"# Given to this run, one-off actions not kept here: {' '.join(given)}")
    body = to_toml(cfg, options, leave_out=ONE_OFF_ACTIONS)
    record = os.path.join(folder, "run.json")
    earlier: list[Any] = []
    if resumed_from > 0:
        earlier = run_starts(record)
        before = os.path.join(folder, f"config.before_step_{resumed_from:06d}.toml")
        # A second start from the same step (the first stopped before its next
        # checkpoint) keeps the record of the steps that checkpoint holds: config.toml is
        # then the stopped start's, whose options run.json's ``earlier`` lists.
        if (
            os.path.isfile(config)
            and not os.path.exists(before)
            and _options_but_steps(_toml_body(config)) != _options_but_steps(body)
        ):
            os.replace(config, before)
    with open(config, "w", encoding="utf-8") as f:
        f.write("\n".join(head) + "\n")
        f.write(body)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    entry: dict[str, Any] = {
        "hyper_parallel": __version__,
        "git_commit": _git_commit(),
        "started": now,
        "argv": list(sys.argv if argv is None else argv),
        "config": cfg.to_dict(),
    }
    if resumed_from > 0:
        entry.update(resumed_from=resumed_from, earlier=earlier)
    with open(record, "w", encoding="utf-8") as f:
        json.dump(entry, f, indent=1)
    return [config, record]


def _toml_body(path: str) -> str:
    """A ``config.toml``'s options: the file without its header comment lines."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    first = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    return "".join(lines[first:])


def _options_but_steps(body: str) -> list[str]:
    """A ``config.toml`` body's option lines but ``steps``: a resumed run told to go on
    longer keeps its schedule (``lr-schedule-steps``), so its record re-runs the earlier
    steps as they ran."""
    lines = body.splitlines()
    steps = [line.split("=", 1)[1].strip() for line in lines if line.startswith("steps = ")]
    out = [line for line in lines if not line.startswith("steps = ")]
    if steps and not any(line.startswith("lr-schedule-steps = ") for line in out):
        out.append(f"lr-schedule-steps = {steps[0]}")  # unset: the schedule is --steps long
    return sorted(out)
