"""The ``suggest`` and ``calibrate`` subcommands of ``hyper-parallel`` (parsers and runners).

Kept apart from :mod:`hyper_parallel.cli` so that file only registers them.

Examples::

    hyper-parallel suggest --model llama3-70b --gpus 1024 --gpu h100-80gb --seq 8192 \\
        --global-batch-tokens 4194304 --top 5
    hyper-parallel suggest --hf-config config.json --gpus 64 --hardware mine.yaml \\
        --seq 4096 --global-batch-tokens 1048576 --format json --chart suggest.png
    hyper-parallel calibrate --out this-machine.yaml

Exit status: 0 with plans; 1 when nothing fits ("does not fit: needs >= X GB per GPU at
best (layout ...)"); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from hyper_parallel.analysis.charts import chart_path
from hyper_parallel.train.arguments import add_command_arguments, positive_int

__all__ = ["add_calibrate_parser", "add_suggest_parser", "run_calibrate", "run_suggest"]


def add_suggest_parser(sub: Any) -> None:
    """Register ``suggest`` on the CLI's subparsers."""
    p = sub.add_parser(
        "suggest",
        help="search the layouts of a model on N GPUs; print the fastest that fit",
        description="Search pp, dp_replicate, dp_shard, cp, tp, ep, micro-batches, schedule, "
        "activation checkpointing and sequence parallel; drop what the plan checks refuse and "
        "what does not fit in memory (dry run); rank the rest by the cost model's step time. "
        "--mesh scores that mesh only (axes not named are 1), searching just micro-batches, "
        "schedule, AC and SP unless --schedule, --ac or --microbatches fix them too.",
    )
    # --model, --model-overrides, --hf-config, --dtype and the switches that fix part of
    # the search (--mesh, --schedule, --ac, --microbatches): the run options' table.
    add_command_arguments(p, "suggest")
    p.add_argument("--gpus", type=positive_int, required=True, help="number of GPUs")
    p.add_argument(
        "--gpus-per-node",
        type=positive_int,
        default=None,
        help="GPUs per node (default: the hardware file's, 8 for the shipped kinds)",
    )
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--gpu", metavar="KIND", help="shipped hardware kind, e.g. h100-80gb")
    kind.add_argument("--hardware", metavar="FILE", help="your own hardware YAML file")
    p.add_argument("--seq", type=positive_int, required=True, help="tokens per sequence")
    p.add_argument(
        "--global-batch-tokens", type=positive_int, required=True, help="tokens per optimizer step"
    )
    p.add_argument("--top", type=positive_int, default=5, help="plans to print (default 5)")
    p.add_argument(
        "--write-config",
        metavar="FILE",
        help="write the job file (TOML; train --config FILE, validate --config FILE) of the "
        "top plan (or --pick N's)",
    )
    p.add_argument(
        "--pick",
        type=positive_int,
        default=None,
        help="with --write-config: the plan to write, by its number (default 1)",
    )
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument(
        "--chart",
        metavar="PNG",
        type=chart_path,
        help="draw step time vs memory of the candidates",
    )
    p.add_argument(
        "--allow-cross-node-tp", action="store_true", help="also search tp spanning nodes"
    )
    p.add_argument(
        "--allow-cross-node-ep", action="store_true", help="also search ep spanning nodes"
    )
    p.set_defaults(func=run_suggest)


def run_suggest(args: argparse.Namespace) -> int:
    """Run ``suggest``; returns the exit status."""
    from hyper_parallel.analysis.suggest import DoesNotFit, suggest

    if args.pick is not None and args.write_config is None:
        print(
            f"hyper-parallel suggest: error: argument --pick: --pick {args.pick} needs "
            "--write-config FILE (it picks the plan whose job file is written); add "
            "--write-config FILE, or drop --pick.",
            file=sys.stderr,
        )
        return 2
    # Before the search: a file that is there (a job file written by hand, a chart) is not
    # replaced unasked, and a file the command reads never is.
    from hyper_parallel.checkpoint_hf.outputs import OutputError, check_output_file

    inputs = command_inputs(args)
    try:
        if args.write_config is not None:
            check_output_file(
                args.write_config, overwrite=args.overwrite, inputs=inputs, what="--write-config"
            )
        if args.chart:
            check_output_file(
                args.chart,
                overwrite=args.overwrite,
                inputs=[*inputs, args.write_config],
                what="--chart",
            )
    except OutputError as e:
        print(f"hyper-parallel suggest: error: {e}", file=sys.stderr)
        return 2
    warnings = _unused_switches(args)
    print_warnings("suggest", warnings)
    found = {"warnings": [f.to_dict() for f in warnings]}
    try:
        source = _source(args)
        report = suggest(
            source,
            gpus=args.gpus,
            gpu=args.gpu or args.hardware,
            seq_len=args.seq,
            global_batch_tokens=args.global_batch_tokens,
            gpus_per_node=args.gpus_per_node,
            dtype=args.dtype,
            top=args.top,
            allow_cross_node_tp=args.allow_cross_node_tp,
            allow_cross_node_ep=args.allow_cross_node_ep,
            mesh=_mesh_sizes(args.mesh),
            schedule=args.schedule,
            ac=args.ac,
            microbatches=args.microbatches,
            sp=args.sp,
            compile=bool(args.compile),
            pipeline_split=args.pipeline_split,
            stages_per_rank=args.stages_per_rank,
            reduce_each_microbatch=args.reduce_each_microbatch,
        )
    except DoesNotFit as e:
        if args.format == "json":
            print(json.dumps(e.report.to_dict() | {"error": str(e), **found}, indent=1))
        _chart(args, e.report)
        print(f"hyper-parallel suggest: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"hyper-parallel suggest: error: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(report.to_dict() | found, indent=1))
    else:
        print(report.to_table())
    _chart(args, report)
    if args.write_config is not None:
        return _write_config(args, report)
    return 0


def _write_config(args: argparse.Namespace, report: Any) -> int:
    """``--write-config FILE``: plan ``--pick``'s train options as a job file."""
    from hyper_parallel.train.launch import job_file, train_options

    pick = args.pick or 1
    if pick > len(report.plans):
        print(
            f"hyper-parallel suggest: error: --pick {pick}: there are "
            f"{len(report.plans)} plan(s); give --pick 1..{len(report.plans)} (or a larger "
            "--top).",
            file=sys.stderr,
        )
        return 2
    c, p, command = report.plans[pick - 1]
    comment = (
        f"suggest plan {pick}: {report.model} on {report.gpus} x {report.hardware.name}: "
        f"{c.describe()}; predicted {p.step_s:.3g} s/step, "
        f"{p.memory_bytes_per_gpu / 2**30:.1f} GiB per GPU.\n"
        f"Run: {command.split(' -m ')[0]} -m hyper_parallel.train.run --config "
        f"{shlex.quote(args.write_config)}"
    )
    text = job_file(train_options(command), comment)
    with open(args.write_config, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"job file of plan {pick} written to {args.write_config}", file=sys.stderr)
    return 0


def _source(args: argparse.Namespace) -> Any:
    """The model ``--model`` / ``--hf-config`` and ``--model-overrides`` name, resolved as
    the trainer resolves them.

    Raises:
        ValueError: No model, two, or one that cannot be read or is not registered.
    """
    from hyper_parallel.analysis.suggest import ModelSource
    from hyper_parallel.analysis.suggest._source import hf_weights_dir
    from hyper_parallel.dmodule.model_spec import get_spec
    from hyper_parallel.train.run_hooks import hf_model

    overrides = dict(args.model_overrides or {})
    label, weights = "", None
    if args.hf_config is not None:
        spec, overrides = hf_model(args.hf_config, overrides)
        if args.model not in (None, spec):
            raise ValueError(
                f"--model {args.model} and --hf-config {args.hf_config!r} (a {spec} model) "
                "both name the model; give one of them."
            )
        label = str(args.hf_config)
        weights = hf_weights_dir(args.hf_config)  # the commands start from them
    elif args.model is None:
        raise ValueError(
            "no model: give --model NAME (see 'hyper-parallel models') or --hf-config PATH "
            "(a Hugging Face config.json)."
        )
    else:
        spec = args.model
        get_spec(spec)  # an unknown name: its error lists the known ones
    return ModelSource(spec, tuple(sorted(overrides.items())), label=label, weights=weights)


def command_inputs(args: argparse.Namespace) -> list[str]:
    """The files ``plan`` / ``suggest`` read (``--hardware``, ``--hf-config`` or the
    ``config.json`` of its folder, ``--config``, ``--plan``): an output may not be one."""
    import os

    out = [getattr(args, name, None) for name in ("hardware", "hf_config", "config", "plan")]
    hf = getattr(args, "hf_config", None)
    if hf and os.path.isdir(hf):
        out.append(os.path.join(hf, "config.json"))
    return [str(f) for f in out if f]


def print_warnings(command: str, findings: list[Any]) -> None:
    """Each warning finding on stderr, as ``hyper-parallel COMMAND: warning: ... Fix: ...``."""
    for f in findings:
        print(f"hyper-parallel {command}: warning: {f.message} Fix: {f.fix}", file=sys.stderr)


def _unused_switches(args: argparse.Namespace) -> list[Any]:
    """With a fixed ``--mesh``: the run plan's warnings for pipeline switches the run
    would not use (``--schedule``, ``--stages-per-rank``, ``--pipeline-split`` at pp=1),
    as ``validate`` and ``plan`` report them. Searched meshes choose their own."""
    if args.mesh is None:
        return []
    from hyper_parallel.distributed.layout import as_layout
    from hyper_parallel.distributed.run_checks import unused_switch_findings

    return unused_switch_findings(
        as_layout(args.mesh),
        schedule=args.schedule or "1F1B",  # unset: searched (nothing to warn of)
        stages_per_rank=args.stages_per_rank,
        pipeline_split=args.pipeline_split,
    )


def _mesh_sizes(mesh: dict[str, int] | None) -> dict[str, int] | None:
    """``--mesh pp=8,tp=8`` (parsed by the run options' table) as every axis' size."""
    if mesh is None:
        return None
    from hyper_parallel.distributed.layout import as_layout

    layout = as_layout(mesh)
    return {a: layout.size(a) for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp")} | {
        "ep": layout.ep
    }


def add_prediction_arguments(p: Any) -> None:
    """``plan --gpu KIND`` / ``--hardware FILE``: the cost model's step time next to the
    dry run."""
    kind = p.add_mutually_exclusive_group()
    kind.add_argument(
        "--gpu",
        metavar="KIND",
        help="also predict step time, tokens/s/GPU and MFU on this GPU kind (e.g. h100-80gb)",
    )
    kind.add_argument("--hardware", metavar="FILE", help="as --gpu, from your own hardware file")
    p.add_argument(
        "--gpus-per-node",
        type=positive_int,
        default=None,
        help="with --gpu: GPUs per node (default: the hardware file's)",
    )


def check_prediction_args(args: argparse.Namespace) -> None:
    """Refuse ``plan --gpu``/``--hardware`` where the prediction would not be of the run
    ``plan`` traces: the cost model scores a registered model under the trainer's own
    sharding with FSDP2 (as ``suggest`` does), so ``--plan FILE`` and ``--no-fsdp``
    describe runs it does not model (their predictions were the default run's,
    silently). Checked before the dry run; ``--hf-model`` is refused after it.

    Raises:
        ValueError: Naming the option and the fix.
    """
    if not (getattr(args, "gpu", None) or getattr(args, "hardware", None)):
        return
    other = [
        flag
        for flag, on in (
            (f"--plan {getattr(args, 'plan', None)}", getattr(args, "plan", None) is not None),
            ("--no-fsdp", bool(getattr(args, "no_fsdp", False))),
        )
        if on
    ]
    if other:
        raise ValueError(
            f"--gpu/--hardware predict the trainer's run of --model (its own sharding, FSDP2 "
            f"over fsdp), not one with {' and '.join(other)}: drop {' and '.join(other)} for a "
            "prediction, or --gpu/--hardware for the dry run of this plan."
        )


def plan_prediction(args: argparse.Namespace, layout: Any) -> dict[str, Any] | None:
    """The cost model's prediction for ``plan``'s model, mesh and switches (``None``
    without ``--gpu`` / ``--hardware``): one model behind ``plan`` and ``suggest``.

    The global batch is ``--batch`` (per rank, per micro-batch) x micro-batches x the
    data-parallel ranks.

    Raises:
        ValueError: Not a registered model, or the cost model refuses the layout.
    """
    gpu = getattr(args, "gpu", None) or getattr(args, "hardware", None)
    if gpu is None:
        return None
    check_prediction_args(args)
    if getattr(args, "model", None) is None:  # --hf-config resolves to a registered model
        raise ValueError("--gpu/--hardware predict registered models only; give --model.")
    from hyper_parallel.analysis.suggest import Candidate, LayoutScorer, ModelSource
    from hyper_parallel.distributed.run_plan import default_num_microbatches

    schedule = args.schedule if layout.pp > 1 else None
    # At pp=1 the run plan's micro-batches are gradient accumulation (default 1).
    per_rank = args.stages_per_rank if layout.pp > 1 else None
    microbatches = args.microbatches or default_num_microbatches(layout.pp, args.schedule, per_rank)
    dp = layout.size("dp_replicate") * layout.size("dp_shard")
    seq = args.seq or 2048
    global_batch = args.batch * microbatches * dp
    dtype = args.dtype
    # The model as traced: --model-overrides and --hf-config (resolved into both).
    overrides = tuple(sorted((getattr(args, "model_overrides", None) or {}).items()))
    scorer = LayoutScorer(
        ModelSource(args.model, overrides),
        gpus=layout.world_size,
        gpu=gpu,
        seq_len=seq,
        global_batch_tokens=global_batch * seq,
        gpus_per_node=args.gpus_per_node,
        dtype=dtype,
        compile=bool(getattr(args, "compile", False)),
        pipeline_split=getattr(args, "pipeline_split", None),
    )
    c = Candidate(
        pp=layout.pp,
        dp_replicate=layout.size("dp_replicate"),
        dp_shard=layout.size("dp_shard"),
        cp=layout.size("cp"),
        tp=layout.size("tp"),
        ep=layout.ep,
        microbatches=microbatches,
        schedule=schedule,
        ac=args.ac,
        sp=bool(args.sp),
        stages_per_rank=per_rank,
        reduce_each=bool(getattr(args, "reduce_each_microbatch", False)),
    )
    p = scorer.predict(c)
    return {
        "hardware": scorer.hardware.name,
        "global_batch": global_batch,
        "seq_len": seq,
        **p.to_dict(),
        # suggest's rule: the larger of backward's and the optimizer step's peak, against
        # the device's memory less the stated headroom (usable_memory).
        "memory_limit_bytes": int(scorer.memory_limit),
        "fits": p.memory_bytes_per_gpu <= scorer.memory_limit,
    }


def prediction_text(pred: dict[str, Any]) -> str:
    """``plan``'s table lines for :func:`plan_prediction`."""
    return (
        f"Predicted on {pred['hardware']} (cost model; global batch {pred['global_batch']} x "
        f"{pred['seq_len']:,} tokens): step {pred['step_s']:.3f} s, "
        f"{pred['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {100 * pred['mfu']:.1f}%, "
        f"memory {pred['memory_bytes_per_gpu'] / 2**30:.1f} GiB per GPU"
        + (
            f" (fits the {pred['memory_limit_bytes'] / 2**30:.1f} GiB it may use)"
            if pred["fits"]
            else f" — DOES NOT FIT: {pred['hardware']} leaves {pred['memory_limit_bytes'] / 2**30:.1f}"
            " GiB after the allocator's and the communication library's headroom (suggest "
            "refuses this layout)"
        )
    )


def _chart(args: argparse.Namespace, report: Any) -> None:
    if args.chart:
        from hyper_parallel.analysis.charts import suggest_chart

        suggest_chart(report, args.chart)
        print(f"chart: {args.chart}", file=sys.stderr)


def add_calibrate_parser(sub: Any) -> None:
    """Register ``calibrate`` on the CLI's subparsers."""
    p = sub.add_parser(
        "calibrate",
        help="measure this machine (matmul FLOP/s, gloo collectives) into a hardware file",
        description="Measure matmul FLOP/s per dtype and each collective's latency and "
        "bandwidth on local gloo ranks; write a hardware YAML file that 'suggest --hardware' "
        "and the benchmark read.",
    )
    p.add_argument("--out", required=True, metavar="FILE.yaml", help="where to write it")
    p.add_argument(
        "--ranks", type=_ranks, default=4, help="local gloo ranks, 2 or more (default 4)"
    )
    p.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads per rank (default 1)"
    )
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--overwrite", action="store_true", help="replace a file --out names")
    p.set_defaults(func=run_calibrate)


def _ranks(text: str) -> int:
    """``argparse`` type of ``calibrate --ranks``: an integer >= 2 (a collective needs two)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer >= 2: collectives need two ranks or more; "
            "give --ranks 2 or more (default 4)"
        )
    return value


def run_calibrate(args: argparse.Namespace) -> int:
    """Run ``calibrate``; returns the exit status."""
    from hyper_parallel.analysis.calibrate import calibrate
    from hyper_parallel.checkpoint_hf.outputs import OutputError, check_output_file

    if not args.out.endswith((".yaml", ".yml")):
        print("hyper-parallel calibrate: error: --out must end in .yaml", file=sys.stderr)
        return 2
    try:  # before the measurement (minutes): a hardware file is not replaced unasked
        check_output_file(args.out, overwrite=args.overwrite, what="calibrate --out")
    except OutputError as e:
        print(f"hyper-parallel calibrate: error: {e}", file=sys.stderr)
        return 2
    result = calibrate(args.out, ranks=args.ranks, threads=args.threads, quick=args.quick)
    print(result)
    return 0
