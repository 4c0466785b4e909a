"""The ``hyper-parallel`` command line: ``plan``, ``validate``, ``demo``, ``models``.

Examples::

    hyper-parallel models
    hyper-parallel plan --model llama3-70b --mesh dp=128,tp=8 --sp --format json
    hyper-parallel validate --model llama3-8b --mesh dp=16,tp=8
    hyper-parallel validate --hf-model llama --plan examples/plans/hf_llama_tp.yaml --mesh tp=2
    hyper-parallel demo --mesh dp=2,tp=2

Exit status: 0 on success; 1 when ``validate`` finds errors (or ``plan`` is given a
plan that ``parallelize`` refuses, or the demo fails); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["main"]

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
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


def _mesh(text: str) -> dict[str, int]:
    from hyper_parallel.analysis._world import parse_mesh

    try:
        return parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="registered model name (see 'hyper-parallel models')")
    which.add_argument(
        "--hf-model",
        metavar="FAMILY",
        help="a tiny Hugging Face model built on the meta device: llama, qwen2, mistral, gpt2",
    )
    p.add_argument(
        "--mesh", required=True, type=_mesh, help="axis sizes in mesh order, e.g. dp=128,tp=8"
    )
    p.add_argument(
        "--plan",
        metavar="FILE",
        help="plan file (.yaml/.json: module path pattern -> sharding config); default: the "
        "model's own tensor-parallel sharding when the mesh has a 'tp' axis",
    )
    p.add_argument(
        "--sp", action="store_true", help="tensor + sequence parallel (registered models)"
    )
    p.add_argument("--batch", type=_positive_int, default=1, help="per-rank batch size (default 1)")
    p.add_argument(
        "--seq",
        type=_positive_int,
        default=None,
        help=f"sequence length (default {_SEQ_LEN}; {_HF_SEQ_LEN} for --hf-model)",
    )
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyper-parallel",
        description="Declarative named-axis sharding: plan, validate and demo.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = sub.add_parser(
        "plan",
        help="dry run one training step: sharding, memory and collectives per rank",
        description="Trace one training step at full scale in this process (fake process "
        "group, fake tensors) and report the per-module sharding, per-rank memory and the "
        "collectives per step.",
    )
    _add_model_arguments(plan)
    plan.add_argument(
        "--no-fsdp", action="store_true", help="do not shard states over dp with FSDP2"
    )
    plan.add_argument("--dp-axis", default="dp", help="data-parallel axis for FSDP (default dp)")
    plan.add_argument(
        "--dtype",
        choices=tuple(_DTYPES),
        default="fp32",
        help="parameter and compute dtype; sets the activations' dtype too (default fp32)",
    )
    plan.add_argument(
        "--ac",
        choices=("none", "full", "selective"),
        default="none",
        help="activation checkpointing for the activation bytes: none (default), full "
        "(every block), selective (every second block)",
    )
    plan.set_defaults(func=_cmd_plan)

    validate = sub.add_parser(
        "validate",
        help="check a model + plan + mesh; exit 1 when there are errors",
        description="Report every problem of a model, its plan and a mesh shape at once, "
        "each with its module path. No process group is needed.",
    )
    _add_model_arguments(validate)
    validate.add_argument(
        "--verbose", action="store_true", help="also list info findings and every redistribution"
    )
    validate.set_defaults(func=_cmd_validate)

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

    models = sub.add_parser("models", help="list the registered models")
    models.add_argument("--format", choices=("table", "json"), default="table")
    models.set_defaults(func=_cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Example::

        main(["validate", "--model", "llama3-debug", "--mesh", "tp=2"])
    """
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except _UsageError as e:
        print(f"hyper-parallel {args.command}: error: {e}", file=sys.stderr)
        return 2
    except _PlanError as e:
        print(f"hyper-parallel {args.command}: error: {e}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------- model + plan


@dataclass
class _Subject:
    """The model (or config), plan and loss a command analyses."""

    name: str
    model: Any
    plan: Any
    loss_fn: Callable[..., Any] | None
    seq_len: int


def _subject(args: argparse.Namespace) -> _Subject:
    from hyper_parallel.dmodule.plan_file import load_plan

    shape: dict[str, int] = args.mesh
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
    elif args.model is not None or args.hf_model is not None:
        _check_axes(shape, args)
    if args.hf_model is not None:
        return _hf_subject(args, shape, plan)
    from hyper_parallel.dmodule.model_spec import get_spec

    try:
        spec = get_spec(args.model)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    config = spec.config()
    if plan is None and "tp" in shape:
        key = "tp_sp" if args.sp else "tp"
        sharding = spec.extras.get(key)
        if sharding is None:
            raise _UsageError(
                f"model {args.model!r} has no {key!r} sharding; pass a plan file with --plan."
            )
        try:
            if "tp_size" in inspect.signature(sharding).parameters:
                config = sharding(config, tp_size=shape["tp"])
            else:
                config = sharding(config)
        except ValueError as e:  # e.g. heads not divisible by the tp size
            raise _PlanError(
                f"{args.model} cannot be sharded over tp={shape['tp']}: {e}",
                [_finding("", "mesh['tp']", str(e), "use a tp size that divides the head counts.")],
            ) from None
    elif args.sp:
        raise _UsageError(
            "--sp shards the sequence over the 'tp' axis: give the mesh a tp axis "
            "(e.g. --mesh dp=2,tp=2), and no --plan."
        )
    return _Subject(args.model, config, plan, spec.extras.get("loss_fn"), args.seq or _SEQ_LEN)


def _finding(path: str, field: str, message: str, fix: str) -> Any:
    from hyper_parallel.dmodule._checks import Finding

    return Finding("error", path, field, message, fix)


def _check_axes(shape: dict[str, int], args: argparse.Namespace) -> None:
    """Without --plan only 'tp' (the model's sharding) and the FSDP axis are used."""
    used = {"tp", getattr(args, "dp_axis", "dp")}
    unused = [a for a in shape if a not in used]
    if unused:
        raise _UsageError(
            f"mesh axis {unused[0]!r} is used by nothing: without --plan the model's own "
            f"sharding uses 'tp' (tensor parallel) and FSDP uses {sorted(used - {'tp'})[0]!r} "
            "(data parallel); rename the axis (e.g. --mesh dp=2,tp=2), or pass a --plan "
            "that places states on it."
        )


def _hf_subject(args: argparse.Namespace, shape: dict[str, int], plan: Any) -> _Subject:
    if args.sp:
        raise _UsageError("--sp applies to registered models; give an SP plan with --plan.")
    try:
        from hyper_parallel.hf import build_hf_model, check_hf_heads, hf_tp_plan

        model = build_hf_model(args.hf_model, device="meta")
    except (ImportError, ValueError) as e:
        raise _UsageError(str(e)) from None
    if plan is None:
        try:
            plan = hf_tp_plan(args.hf_model) if "tp" in shape else {}
        except ValueError as e:  # gpt2: its fused c_attn has no default plan
            raise _PlanError(f"{e} Pass such a plan with --plan FILE.") from None
    if "tp" in shape and any(p.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj") for p in plan):
        heads = check_hf_heads(model, shape["tp"])
        if heads:
            raise _PlanError(" ".join(f"{f.message} Fix: {f.fix}" for f in heads), heads)
    return _Subject(f"hf:{args.hf_model}", model, plan, None, args.seq or _HF_SEQ_LEN)


# ---------------------------------------------------------------------- commands


def _cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from hyper_parallel.analysis import dry_run
    from hyper_parallel.dmodule._checks import ParallelizeError

    subject = _subject(args)
    try:
        report = dry_run(
            subject.model,
            args.mesh,
            subject.plan,
            batch_size=args.batch,
            seq_len=subject.seq_len,
            fsdp=not args.no_fsdp,
            dp_axis=args.dp_axis,
            param_dtype=getattr(torch, _DTYPES[args.dtype]),
            loss_fn=subject.loss_fn,
            ac=args.ac,
            # fp16 parameters already compute in fp16; no mixed-precision policy on top.
            dtype="bf16" if args.dtype == "bf16" else "fp32",
        )
    except ParallelizeError as e:
        print(
            f"hyper-parallel plan: the plan cannot be applied; run 'hyper-parallel validate' "
            f"with the same arguments for the full report.\n{e}",
            file=sys.stderr,
        )
        return 1
    except (ValueError, TypeError, RuntimeError) as e:
        raise _PlanError(
            f"the plan fails when traced ({type(e).__name__}: {e}); run 'hyper-parallel "
            "validate' with the same arguments for the module at fault."
        ) from None
    report.model = subject.name
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.to_table())
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from hyper_parallel.analysis import validate

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
        )
    except (ValueError, TypeError) as e:
        raise _UsageError(str(e)) from None
    report.model = subject.name
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.to_table(verbose=args.verbose))
    return 0 if report.ok else 1


def _print_validate_failure(args: argparse.Namespace, findings: list[Any]) -> int:
    """Report a model/plan/mesh refused before tracing the way ``validate`` reports."""
    from hyper_parallel.analysis.validate import ValidationReport

    name = args.model if args.model is not None else f"hf:{args.hf_model}"
    report = ValidationReport(model=name, mesh=dict(args.mesh), findings=findings)
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
                        "shardings": sorted(k for k in ("tp", "tp_sp") if k in s.extras),
                    }
                    for s in specs
                ],
                indent=1,
            )
        )
        return 0
    from hyper_parallel.analysis._format import table

    rows = [
        (s.name, ", ".join(k for k in ("tp", "tp_sp") if k in s.extras) or "-", s.description)
        for s in specs
    ]
    print(table(["model", "shardings", "description"], rows))
    print(f"\n{len(specs)} model(s).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
