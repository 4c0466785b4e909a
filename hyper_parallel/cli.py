"""The ``hyper-parallel`` command line: ``plan``, ``validate``, ``demo``, ``models``, ``launch``.

Examples::

    hyper-parallel models
    hyper-parallel plan --model llama3-70b --mesh dp=128,tp=8 --sp --format json
    hyper-parallel plan --model llama3-70b --mesh dp_replicate=4,dp_shard=32,tp=8
    hyper-parallel validate --model llama3-8b --mesh dp=16,tp=8
    hyper-parallel validate --config job.toml     # a job file (suggest --write-config)
    hyper-parallel validate --hf-model llama --plan examples/plans/hf_llama_tp.yaml --mesh tp=2
    hyper-parallel demo --mesh dp=2,tp=2
    hyper-parallel demo --mesh dp_replicate=2,dp_shard=2
    hyper-parallel launch --nodes 2 --gpus-per-node 8 --slurm job.sbatch --mesh dp=2,tp=8

``--mesh`` takes ``name=size`` pairs over ``pp, dp_replicate, dp_shard`` (alias ``dp``),
``cp, tp, ep`` in any order (:class:`hyper_parallel.distributed.MeshLayout`); every
problem of a mesh is one usage error (exit 2) naming each bad entry.

Exit status: 0 on success; 1 when ``validate`` finds errors (or ``plan`` is given a
plan that ``parallelize`` refuses, or the demo fails); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["main"]

# Tiny Hugging Face configs hold 128 positions; their dry run defaults to a short sequence.
_HF_SEQ_LEN = 64
_SEQ_LEN = 2048


class _UsageError(Exception):
    """A problem with the command line's arguments (exit status 2)."""


class _PlanError(Exception):
    """A model, plan or mesh that cannot work together (exit status 1).

    ``findings`` (``Finding``s) let ``validate`` report it in its own format.
    """

    def __init__(self, message: str, findings: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.findings = list(findings)


def _add_model_arguments(p: argparse.ArgumentParser, command: str) -> None:
    """The options of ``plan`` and ``validate``: the run options of the table
    (:data:`~hyper_parallel.train.arguments.COMMAND_OPTIONS`: ``--model``,
    ``--model-overrides``, ``--hf-config`` and the switches), and the analysis' own."""
    from hyper_parallel.train.arguments import add_command_arguments, positive_int

    add_command_arguments(p, command)
    p.add_argument(
        "--hf-model",
        metavar="FAMILY|CONFIG",
        help="instead of --model: a Hugging Face (transformers) model built on the meta device: "
        "a tiny one of a family (llama, qwen2, mistral, gpt2, qwen3_moe, mixtral), or the one "
        "a config.json (or a checkpoint directory) describes; --model-overrides sets its "
        "config's fields "
        '(e.g. \'{"tie_word_embeddings": true, "num_attention_heads": 8}\')',
    )
    p.add_argument(
        "--plan",
        metavar="FILE",
        help="plan file (.yaml/.json: module path pattern -> sharding config); default: the "
        "model's own sharding for the mesh's model axes (tp)",
    )
    p.add_argument(
        "--batch",
        type=positive_int,
        default=1,
        help="per-rank batch size (default 1); with --microbatches or pp: plan's micro-batch "
        "size, validate's sequences per data-parallel rank split into micro-batches (default "
        "one each)",
    )
    p.add_argument(
        "--seq",
        type=positive_int,
        default=None,
        help=f"sequence length (default {_SEQ_LEN}; {_HF_SEQ_LEN} for --hf-model)",
    )
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    p.add_argument(
        "--config",
        metavar="FILE",
        help="job file (.toml, as train --config and suggest --write-config write it): its "
        "model, mesh, switches, seq-len and batch-size (per data-parallel rank, and for plan per "
        "micro-batch, as the trainer splits it); options given here override it",
    )


def _job_file_defaults(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """``plan`` / ``validate --config FILE``: the job file's values of the options the
    command takes become its parser's defaults, so options given still override them.

    Raises:
        _UsageError: The job file cannot be read or holds a bad value (named).
    """
    command = argv[0] if argv else None
    flags = [a for a in argv if a == "--config" or a.startswith("--config=")]
    if command not in ("plan", "validate") or not flags:
        return
    if flags[-1] == "--config":
        at = len(argv) - 1 - argv[::-1].index("--config")
        if at + 1 >= len(argv):
            return  # argparse reports the missing value
        path = argv[at + 1]
    else:
        path = flags[-1].split("=", 1)[1]
    from hyper_parallel.train.arguments import COMMAND_OPTIONS, RUN_OPTIONS
    from hyper_parallel.train.job import load_job_file

    try:
        values = load_job_file(path, RUN_OPTIONS)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.choices[command]
    fields = COMMAND_OPTIONS[command].fields or ()
    # The job's other options (steps, lr, ...) are the trainer's; a dry run has no use for
    # them. Its overwrite is the run's outputs', not plan --chart's.
    given = {f: values[f] for f in fields if values.get(f) is not None and f != "overwrite"}
    # What the job leaves out is the trainer's default, as the run would take it.
    from hyper_parallel.train.config import TrainConfig

    default = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    named = ("--model", "--hf-config", "--hf-model")
    if not any(a.split("=", 1)[0] in named for a in argv):
        # The model the trainer would run: the job's hf-checkpoint (its config.json; it
        # replaces model), else its hf-config or model, else the trainer's default.
        if values.get("hf_checkpoint"):
            given.pop("model", None)
            given["hf_config"] = values["hf_checkpoint"]
        elif "model" not in given and "hf_config" not in given:
            given["model"] = default["model"]
    given["seq"] = values.get("seq_len") or default["seq_len"]
    # The run's global batch: per rank once parsed (_batch_from_job).
    batch = values.get("batch_size")
    given.update(
        job_batch_size=batch or default["batch_size"],
        job_batch_name="batch-size" if batch else "the trainer's default batch-size",
        batch=None,
    )
    p.set_defaults(**given)
    for action in p._actions:
        if action.dest in given:
            action.required = False


def _batch_from_job(args: argparse.Namespace) -> None:
    """``--config``'s ``batch-size`` (the run's global batch) as the command's ``--batch``
    when ``--batch`` is not given: each data-parallel rank's share (``dp_replicate x
    dp_shard``), for ``plan`` split into its micro-batches as the trainer splits it.

    Raises:
        _UsageError: The batch does not divide as the trainer would need it to.
    """
    total = getattr(args, "job_batch_size", None)
    if total is None or args.batch is not None:
        if args.command == "plan" and args.batch is None:
            args.batch = 1
        return
    from hyper_parallel.distributed import MeshLayout

    if not isinstance(args.mesh, MeshLayout):  # the table's --mesh: the active axes
        args.mesh = MeshLayout.from_sizes(args.mesh)
    layout = args.mesh
    ranks = layout.size("batch")
    name = getattr(args, "job_batch_name", "batch-size")
    if total % ranks:
        raise _UsageError(
            f"--config: {name} {total} does not divide over the {ranks} data-parallel ranks "
            f"(dp_replicate x dp_shard of --mesh {layout}); give --batch (sequences per rank) "
            "or a batch-size that divides."
        )
    local = total // ranks
    if args.command != "plan":  # validate: sequences per data-parallel rank
        args.batch = local
        return
    from hyper_parallel.distributed.run_plan import default_num_microbatches

    microbatches = args.microbatches or default_num_microbatches(
        layout.pp, args.schedule, args.stages_per_rank
    )
    if local % microbatches:
        raise _UsageError(
            f"--config: {name} {total} gives {local} sequences per data-parallel rank, "
            f"which {microbatches} micro-batches do not divide; give --batch (sequences per "
            "micro-batch) or a batch-size that divides."
        )
    args.batch = local // microbatches


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyper-parallel",
        description="Declarative named-axis sharding for PyTorch: check a layout before a "
        "cluster sees it, train on it, and move weights to and from Hugging Face.",
    )
    from hyper_parallel.analysis.charts import chart_path

    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = sub.add_parser(
        "plan",
        help="dry run one training step: sharding, memory and collectives per rank",
        description="Trace one training step at full scale in this process (fake process "
        "group, fake tensors) and report the per-module sharding, per-rank memory and the "
        "collectives per step.",
    )
    _add_model_arguments(plan, "plan")
    plan.add_argument(
        "--no-fsdp",
        action="store_true",
        help="do not shard states with FSDP2 over fsdp = dp_shard x cp (HSDP with dp_replicate)",
    )
    plan.add_argument(
        "--chart",
        metavar="PNG",
        type=chart_path,
        help="also draw per-rank memory (per stage with pp) and, with pp, the schedule's "
        "timeline per rank to this PNG file",
    )
    from hyper_parallel.analysis.suggest_cli import add_prediction_arguments

    add_prediction_arguments(plan)
    plan.set_defaults(func=_cmd_plan)

    validate = sub.add_parser(
        "validate",
        help="check a model + plan + mesh; exit 1 when there are errors",
        description="Report every problem of a model, its plan and a mesh shape at once, "
        "each with its module path. No process group is needed.",
    )
    _add_model_arguments(validate, "validate")
    validate.add_argument(
        "--verbose", action="store_true", help="also list info findings and every redistribution"
    )
    # None: one sequence (per micro-batch under pp); see _cmd_validate.
    validate.set_defaults(func=_cmd_validate, batch=None)

    demo = sub.add_parser(
        "demo", help="train on local ranks and in one process; show the losses agree"
    )
    try:
        from hyper_parallel.train.demo import add_arguments
    except ImportError as e:  # the training extra is not installed
        demo.set_defaults(func=_demo_unavailable(str(e)))
    else:
        add_arguments(demo)
        demo.set_defaults(func=_cmd_demo)

    from hyper_parallel.analysis.suggest_cli import add_calibrate_parser, add_suggest_parser

    add_suggest_parser(sub)
    add_calibrate_parser(sub)

    models = sub.add_parser("models", help="list the registered models")
    models.add_argument("--format", choices=("table", "json"), default="table")
    models.set_defaults(func=_cmd_models)

    # Hugging Face checkpoints in and out: verify-hf, export-hf, generate, tokenize.
    from hyper_parallel.hf_commands.commands import add_commands as add_hf_commands

    add_hf_commands(sub)
    launch = sub.add_parser(
        "launch",
        add_help=False,  # --help goes to the launcher's own parser
        help="print the torchrun command of each node for a run on --nodes N x "
        "--gpus-per-node G, and with --slurm FILE a SLURM batch script (starts nothing; "
        "launch --help lists its options)",
    )
    launch.add_argument("options", nargs=argparse.REMAINDER)  # main passes them on itself
    launch.set_defaults(func=lambda args: _launch(args.options))
    # The description names every command there is (it said "plan, validate and demo").
    parser.description += f" Commands: {', '.join(sub.choices)}."
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Example::

        main(["validate", "--model", "llama3-debug", "--mesh", "tp=2"])
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # every option after it is the trainer's (argparse would eat them)
        from hyper_parallel.train.run import main as train_main

        return train_main(argv[1:], prog="hyper-parallel train")
    if argv[:1] == ["launch"]:  # the train options after it are passed on (as for train)
        return _launch(argv[1:])
    parser = _parser()
    try:
        _job_file_defaults(parser, argv)
    except _UsageError as e:
        print(f"hyper-parallel {argv[0]}: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except _UsageError as e:
        print(f"hyper-parallel {args.command}: error: {e}", file=sys.stderr)
        return 2
    except _PlanError as e:
        print(f"hyper-parallel {args.command}: error: {e}", file=sys.stderr)
        return 1


def _launch(argv: Sequence[str]) -> int:
    from hyper_parallel.train.launch import main as launch_main

    return launch_main(argv)


# ---------------------------------------------------------------------- model + plan


@dataclass
class _Subject:
    """The model (or config), plan and loss a command analyses."""

    name: str
    model: Any
    plan: Any
    loss_fn: Callable[..., Any] | None
    seq_len: int
    run: Any = None  # the run plan of a registered model with its own sharding


def _check_hf_overrides(family: str, overrides: dict[str, Any]) -> None:
    """Refuse a ``--model-overrides`` key that is no field of ``--hf-model``'s config
    (``transformers`` configs keep any keyword as an attribute, so a typo would be ignored)."""
    if not overrides:
        return
    import difflib

    try:
        from hyper_parallel.hf import hf_config

        config = hf_config(family)
        # The aliases transformers maps to a field (Qwen3-MoE's num_experts is
        # num_local_experts, as the Hub's config.json files spell it) set that field.
        fields = set(config.to_dict()) | set(getattr(config, "attribute_map", None) or {})
    except (ImportError, ValueError) as e:
        raise _UsageError(str(e)) from None
    unknown = sorted(set(overrides) - fields)
    if unknown:
        hints = [
            f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k)
            for k in unknown
            for close in [difflib.get_close_matches(k, sorted(fields), n=1)]
        ]
        raise _UsageError(
            f"--model-overrides: {', '.join(hints)} is no field of the {family} config "
            "--hf-model builds (a transformers config, e.g. hidden_size, num_attention_heads, "
            "num_key_value_heads, num_hidden_layers, tie_word_embeddings)."
        )


def _resolve_model(args: argparse.Namespace) -> None:
    """Set ``args.model`` and ``args.model_overrides`` from ``--model``,
    ``--hf-config`` and ``--model-overrides`` (as the trainer resolves them), or
    refuse a command line that names no model or two."""
    from hyper_parallel.train.run_hooks import hf_model

    overrides = dict(args.model_overrides or {})
    if args.hf_model is not None:
        if args.model or args.hf_config:
            raise _UsageError(
                "--hf-model builds a Hugging Face model of its own (its config's fields set "
                "with --model-overrides); give it without --model NAME / --hf-config PATH."
            )
        _check_hf_overrides(args.hf_model, overrides)
        return
    if args.hf_config is not None:
        try:
            spec, overrides = hf_model(args.hf_config, overrides)
        except ValueError as e:
            raise _UsageError(str(e)) from None
        if args.model not in (None, spec):
            raise _UsageError(
                f"--model {args.model} and --hf-config {args.hf_config!r} (a {spec} model) "
                "both name the model; give one of them."
            )
        args.model = spec
    elif args.model is None:
        raise _UsageError(
            "no model: give --model NAME (see 'hyper-parallel models'), --hf-config PATH "
            "(a Hugging Face config.json) or --hf-model FAMILY."
        )
    args.model_overrides = overrides


def _subject(args: argparse.Namespace) -> _Subject:
    from hyper_parallel.distributed.layout import MeshLayout
    from hyper_parallel.dmodule.plan_file import load_plan

    if not isinstance(args.mesh, MeshLayout):  # the table's --mesh: the active axes
        args.mesh = MeshLayout.from_sizes(args.mesh)
    _resolve_model(args)
    layout = args.mesh
    plan = None
    if args.plan is not None:
        suffix = os.path.splitext(args.plan)[1].lower()
        if os.path.isdir(args.plan) or suffix in (".yaml", ".yml", ".json"):
            if not os.path.isfile(args.plan):
                what = "is a directory" if os.path.isdir(args.plan) else "does not exist"
                raise _UsageError(
                    f"plan file {args.plan!r} {what}; give the path of a .yaml or .json "
                    "plan file, e.g. --plan examples/plans/hf_llama_tp.yaml."
                )
        else:
            raise _UsageError(
                f"plan file {args.plan!r}: unknown suffix {suffix!r}; use .yaml, .yml or .json."
            )
        try:
            plan = load_plan(args.plan)
        except OSError as e:
            raise _UsageError(f"plan file {args.plan!r}: {e}") from None
        except (ValueError, TypeError) as e:  # the file's content is not a valid plan
            raise _PlanError(
                str(e), [_finding("", "plan", str(e), "correct the plan file and run again.")]
            ) from None
    if args.hf_model is not None:
        return _hf_subject(args, layout, plan)
    from hyper_parallel.dmodule.model_spec import get_spec

    try:
        spec = get_spec(args.model)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    if args.sp and plan is not None:
        raise _UsageError(
            "--sp takes the model's own sequence-parallel layout: give no --plan (a plan "
            "file states its own placements)."
        )
    run = None
    if plan is None:
        # The run plan: the trainer's decisions and checks for this model and mesh.
        run = _run_plan(args, layout)
        if run.subject is None:  # e.g. heads not divisible by the tp size
            raise _PlanError(_problems(run.errors), run.errors)
        config = run.subject
    else:
        try:
            config = spec.config(**args.model_overrides)
        except (ValueError, TypeError) as e:
            raise _UsageError(f"--model-overrides: {e}") from None
    return _Subject(args.model, config, plan, spec.family.loss_fn, args.seq or _SEQ_LEN, run)


def _run_plan(args: argparse.Namespace, layout: Any) -> Any:
    """The run plan of ``--model`` on ``--mesh`` with the command's switches.

    ``validate --batch`` is the sequences per data-parallel rank; ``plan --batch`` the
    per-rank batch of one micro-batch (so the rank's batch is ``--batch`` x micro-batches,
    with and without pp: at pp=1 the micro-batches are gradient accumulation).
    """
    from hyper_parallel.distributed.run_plan import RunPlan, default_num_microbatches

    microbatches = args.microbatches or default_num_microbatches(
        layout.pp, args.schedule, args.stages_per_rank
    )
    if args.command == "plan":
        batch = args.batch * microbatches
        seq_len = args.seq or _SEQ_LEN
        switches = {"ac": args.ac, "dtype": args.dtype, "fsdp": not args.no_fsdp}
    else:
        batch = args.batch if args.batch is not None or microbatches == 1 else microbatches
        seq_len = args.seq
        # What the gate refuses of them (ac='op' with ep, ...).
        switches = {"ac": args.ac, "dtype": args.dtype}
    return RunPlan.for_model(
        args.model,
        layout,
        model_overrides=args.model_overrides,
        sequence_parallel=args.sp,
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        batch_size=batch,
        seq_len=seq_len,
        pipeline_split=args.pipeline_split,
        stages_per_rank=args.stages_per_rank,
        compile=args.compile,
        reduce_each_microbatch=bool(getattr(args, "reduce_each_microbatch", False)),
        **switches,
    )


def _problems(findings: Sequence[Any]) -> str:
    lines = "\n".join(f"  {f}" for f in findings)
    return f"{len(findings)} problem(s):\n{lines}"


def _finding(path: str, field: str, message: str, fix: str) -> Any:
    from hyper_parallel.dmodule.findings import Finding

    return Finding("error", path, field, message, fix)


def _hf_subject(args: argparse.Namespace, layout: Any, plan: Any) -> _Subject:
    if args.sp:
        raise _UsageError("--sp applies to registered models; give an SP plan with --plan.")
    try:
        from hyper_parallel.hf import build_hf_model, check_hf_heads, hf_tp_plan

        overrides = dict(args.model_overrides or {})
        model = build_hf_model(args.hf_model, device="meta", **overrides)
    except (ImportError, ValueError) as e:
        raise _UsageError(str(e)) from None
    except Exception as e:  # transformers' config validation (huggingface_hub's errors)
        if not overrides:
            raise
        cause = e.__cause__ or e
        raise _UsageError(
            f"--model-overrides {json.dumps(overrides)}: transformers refuses the {args.hf_model} "
            f"config they make: {type(cause).__name__}: {cause}"
        ) from None
    if plan is None:
        try:
            plan = hf_tp_plan(args.hf_model) if layout.tp > 1 else {}
        except ValueError as e:  # gpt2: its fused c_attn has no default plan
            raise _PlanError(f"{e} Pass such a plan with --plan FILE.") from None
    if layout.tp > 1 and any(p.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj") for p in plan):
        heads = check_hf_heads(model, layout.tp)
        if heads:
            raise _PlanError(" ".join(f"{f.message} Fix: {f.fix}" for f in heads), heads)
    return _Subject(f"hf:{args.hf_model}", model, plan, None, args.seq or _HF_SEQ_LEN)


# ---------------------------------------------------------------------- commands


def _cmd_plan(args: argparse.Namespace) -> int:
    from hyper_parallel.dmodule import keep_gathered

    if args.chart:  # before the dry run: a chart that is there is kept unless --overwrite
        from hyper_parallel.analysis.suggest_cli import command_inputs
        from hyper_parallel.checkpoint_hf.outputs import OutputError, check_output_file

        inputs = command_inputs(args)
        try:
            check_output_file(args.chart, overwrite=args.overwrite, inputs=inputs, what="--chart")
        except OutputError as e:
            raise _UsageError(str(e)) from None
    _batch_from_job(args)
    from hyper_parallel.analysis.suggest_cli import check_prediction_args

    try:  # before the dry run: --gpu with options it does not model
        check_prediction_args(args)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    # A compiled block keeps its gathered inputs (sequence parallelism's shard-keeping
    # hook runs in eager code only): the dry run traces what that run keeps.
    with keep_gathered(bool(getattr(args, "compile", False))):
        return _plan(args)


def _plan(args: argparse.Namespace) -> int:
    from hyper_parallel.analysis import dry_run
    from hyper_parallel.analysis.suggest_cli import print_warnings
    from hyper_parallel.distributed.layout import LayoutError
    from hyper_parallel.dmodule.findings import ParallelizeError

    subject = _subject(args)
    layout = args.mesh
    if subject.run is not None and subject.run.errors:  # the run plan's gate
        raise _PlanError(_problems(subject.run.errors), subject.run.errors)
    # The run plan's warnings (a switch the run would not use, ...), as validate lists them.
    warnings = [f for f in subject.run.findings if f.severity == "warning"] if subject.run else []
    print_warnings("plan", warnings)
    pipeline = None
    if layout.pp > 1:
        pipeline = _pipeline_part(args, layout, subject)
    try:
        report = dry_run(
            subject.model,
            dataclasses.replace(layout, pp=1) if pipeline is not None else layout,
            subject.plan,
            batch_size=args.batch,
            seq_len=subject.seq_len,
            fsdp=not args.no_fsdp,
            # --dtype is the trainer's precision: the parameters' dtype follows it (fp32
            # master weights under bf16, bf16 weights under bf16-true).
            loss_fn=subject.loss_fn,
            ac=args.ac,
            dtype=args.dtype,
            # At pp=1 the run plan's micro-batches are gradient accumulation.
            num_microbatches=subject.run.num_microbatches
            if subject.run is not None and pipeline is None
            else 1,
            reduce_each_microbatch=bool(getattr(args, "reduce_each_microbatch", False)),
        )
    except ParallelizeError as e:
        print(
            f"hyper-parallel plan: the plan cannot be applied; run 'hyper-parallel validate' "
            f"with the same arguments for the full report.\n{e}",
            file=sys.stderr,
        )
        return 1
    except LayoutError as e:  # an axis the plan or the model cannot run on
        raise _PlanError(str(e), e.findings) from None
    except (ValueError, TypeError, RuntimeError) as e:
        raise _PlanError(
            f"the plan fails when traced ({type(e).__name__}: {e}); run 'hyper-parallel "
            "validate' with the same arguments for the module at fault."
        ) from None
    report.model = subject.name
    from hyper_parallel.analysis.suggest_cli import plan_prediction, prediction_text

    try:
        predicted = plan_prediction(args, layout)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    if pipeline is not None:
        out = report.to_dict()
        # The traced step is one pipeline's model-parallel group; pp copies of it.
        out["world_size"] = layout.world_size
        out["mesh"]["pp"] = layout.pp
        out["mesh"]["world_size"] = layout.world_size
        # The step's micro-batches are the pipeline's (the trace ran one of them).
        out["num_microbatches"] = pipeline["pipeline"]["num_microbatches"]
        out.update(pipeline)
        if predicted is not None:
            out["predicted"] = predicted
        out["warnings"] = [f.to_dict() for f in warnings]
        if args.format == "json":
            print(json.dumps(out, indent=1))
        else:
            print(report.to_pipeline_table(layout, pipeline))
            print(_pipeline_table(pipeline))
            if predicted is not None:
                print(prediction_text(predicted))
        _plan_chart(args, out)
        return 0
    out = report.to_dict()
    if predicted is not None:
        out["predicted"] = predicted
    out["warnings"] = [f.to_dict() for f in warnings]
    if args.format == "json":
        print(json.dumps(out, indent=1))
    else:
        print(report.to_table())
        if predicted is not None:
            print(prediction_text(predicted))
    _plan_chart(args, report.to_dict())
    return 0


def _plan_chart(args: argparse.Namespace, out: dict[str, Any]) -> None:
    if getattr(args, "chart", None):
        from hyper_parallel.analysis.charts import plan_chart

        plan_chart(out, args.chart)
        print(f"chart: {args.chart}", file=sys.stderr)


def _pipeline_part(args: argparse.Namespace, layout: Any, subject: _Subject) -> dict[str, Any]:
    """Stages (with their collectives), per-rank bytes, bubble and P2P bytes (``pp > 1``)."""

    from hyper_parallel.analysis.pipeline_cost import pipeline_report
    from hyper_parallel.distributed.pipeline import PipelineError
    from hyper_parallel.distributed.precision import DTYPES, PARAM_DTYPES
    from hyper_parallel.dmodule.model_spec import get_spec

    stages = get_spec(args.model).family.pipeline if args.model else None
    if stages is None or args.plan is not None:
        fix = (
            _hf_pipeline_fix(args) if args.hf_model is not None else "leave pp out, or use --model."
        )
        raise _PlanError(
            f"pp={layout.pp}: the dry run cuts registered models into pipeline stages; "
            f"{args.model or args.hf_model!r} with this plan declares none. Fix: {fix}",
            [_finding("", "mesh", "no pipeline stages", fix)],
        )
    assert subject.run is not None
    microbatches = subject.run.num_microbatches  # the run plan's count
    element_bytes = DTYPES[args.dtype].itemsize  # the activations: the compute dtype
    try:
        return pipeline_report(
            layout,
            stages,
            get_spec(args.model).config(**args.model_overrides),
            schedule=args.schedule,
            num_microbatches=microbatches,
            microbatch_size=args.batch,
            seq_len=args.seq or _SEQ_LEN,
            element_bytes=element_bytes,
            sequence_parallel=args.sp,
            sharded_config=subject.model,
            fsdp=not args.no_fsdp,
            param_dtype=PARAM_DTYPES[args.dtype],  # fp32 master weights under bf16
            ac=args.ac,
            dtype=args.dtype,
            loss_fn=get_spec(args.model).family.loss_fn,
            split=subject.run.pipeline_split,
            stages_per_rank=subject.run.stages_per_rank,
        )
    except PipelineError as e:
        raise _PlanError(str(e), e.findings) from None


def _pipeline_table(pipeline: dict[str, Any]) -> str:
    lines = [
        f"pipeline: {pipeline['pipeline']['schedule']}, "
        f"{pipeline['pipeline']['num_microbatches']} micro-batches, bubble "
        f"{pipeline['bubble_fraction']:.3f}",
        "stage  rank  units                          param bytes/rank  in-flight  total bytes/rank"
        "  collective bytes/step",
    ]
    for s in pipeline["stages"]:
        units = s["units"]
        label = units[0] if len(units) == 1 else f"{units[0]} .. {units[-1]} ({len(units)})"
        moved = sum(c["bytes"] for c in s.get("collectives", ()))
        lines.append(
            f"{s['stage']:>5}  {s['rank']:>4}  {label:<30} {s['params']:>16,}  "
            f"{s['in_flight_microbatches']:>9}  {s['total']:>16,}  {moved:>21,}"
        )
    return "\n".join(lines)


def _cmd_validate(args: argparse.Namespace) -> int:
    from hyper_parallel.analysis import validate

    _batch_from_job(args)
    try:
        subject = _subject(args)
    except _PlanError as e:
        if not e.findings:
            raise
        return _print_validate_failure(args, e.findings)
    try:
        report = validate(
            subject.model,
            args.mesh,
            subject.plan,
            batch_size=args.batch,
            seq_len=args.seq,
            schedule=args.schedule,
            num_microbatches=args.microbatches,
            pipeline_split=args.pipeline_split,
            stages_per_rank=args.stages_per_rank,
        )
    except (ValueError, TypeError) as e:
        raise _UsageError(str(e)) from None
    report.model = subject.name
    report.findings = _hf_paths_hint(args, report.findings)
    if subject.run is not None:  # the run plan's findings (its errors are the gate): every one
        report.findings += [f for f in subject.run.findings if f not in report.findings]
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.to_table(verbose=args.verbose))
    return 0 if report.ok else 1


def _hf_pipeline_fix(args: argparse.Namespace) -> str:
    """The fix of ``pp`` on a ``transformers`` model (``--hf-model``), which is not cut into
    stages: this library's own model of that config is (``--hf-config``)."""
    source = args.hf_model if os.path.exists(args.hf_model) else "DIR (its config.json)"
    return (
        "leave pp out of the mesh, or check this library's own model of that config, which "
        f"is cut into pipeline stages and trains under pp: --hf-config {source} instead of "
        "--hf-model (Llama / Mistral, Qwen3, Qwen3-MoE)."
    )


def _hf_paths_hint(args: argparse.Namespace, findings: list[Any]) -> list[Any]:
    """Point a plan written for the ``transformers`` model, checked with ``--hf-config``
    (which builds this library's own model of that config), at ``--hf-model CONFIG``; and
    ``pp`` on the ``transformers`` model (``--hf-model``) at ``--hf-config``."""
    if args.hf_model is not None:
        return [
            dataclasses.replace(f, fix=_hf_pipeline_fix(args))
            if (f.path, f.field) == ("mesh", "pp") and "declares no pipeline stages" in f.message
            else f
            for f in findings
        ]
    if args.hf_config is None or args.plan is None:
        return findings
    hint = (
        f"this plan names Hugging Face module paths (model.layers.*, lm_head), but --hf-config "
        f"builds hyper_parallel's own {args.model} model of that config; check a plan for the "
        f"transformers model with --hf-model {args.hf_config} (instead of --hf-config), or "
        "write the plan with this model's module paths."
    )
    return [
        dataclasses.replace(f, fix=hint)
        if "matches no module of" in f.message
        and (f.path.startswith("model.") or f.path in ("lm_head", "model"))
        else f
        for f in findings
    ]


def _print_validate_failure(args: argparse.Namespace, findings: list[Any]) -> int:
    """Report a model/plan/mesh refused before tracing the way ``validate`` reports."""
    from hyper_parallel.analysis.validate import ValidationReport

    name = f"hf:{args.hf_model}" if args.hf_model is not None else args.model
    report = ValidationReport(
        model=name, mesh=args.mesh.active(), layout=args.mesh, findings=findings
    )
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.to_table(verbose=args.verbose))
    return 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from hyper_parallel.train.demo import run

    return int(run(args))


def _demo_unavailable(reason: str) -> Callable[[argparse.Namespace], int]:
    def fail(args: argparse.Namespace) -> int:
        raise _UsageError(
            f"the demo needs the training package, which failed to import ({reason}); "
            "install the demo extra: pip install 'hyper-parallel[demo]'."
        )

    return fail


def _cmd_models(args: argparse.Namespace) -> int:
    from hyper_parallel.dmodule.model_spec import get_spec, list_specs

    specs = [get_spec(n) for n in list_specs()]
    if args.format == "json":
        print(
            json.dumps(
                [
                    {
                        "name": s.name,
                        "description": s.description,
                        "shardings": list(s.family.shardings()),
                    }
                    for s in specs
                ],
                indent=1,
            )
        )
        return 0
    from hyper_parallel.analysis import table

    rows = [
        (
            s.name,
            ", ".join(s.family.shardings()) or "-",
            s.description,
        )
        for s in specs
    ]
    print(table(["model", "shardings", "description"], rows))
    print(f"\n{len(specs)} model(s).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
