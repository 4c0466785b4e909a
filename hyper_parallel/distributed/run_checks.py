"""The run plan's checks: what refuses a run, each a finding with its fix.

:class:`~hyper_parallel.distributed.run_plan.RunPlan` asks these once per run (the
trainer's gate, ``validate``, ``plan``, ``suggest``): the switches against the mesh
(:func:`switch_findings`, :func:`compile_findings`, :func:`accumulation_findings`;
warnings for switches the run would not use: :func:`unused_switch_findings`),
the model's sharding against the mesh (:func:`model_findings`), the sequence against
the model's positions (:func:`position_findings`) and the pipeline plan
(:func:`pipeline_plan_findings`, :func:`schedule_findings`). :func:`raise_findings` turns
errors into one ``ValueError``. Decisions (meshes, the gradient convention, the
micro-batch count) are the run plan's; this module only refuses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hyper_parallel.contract import ModelFamily, PipelineLayoutProtocol
from hyper_parallel.distributed.axes import apply_model_axes, plan_axis_findings
from hyper_parallel.distributed.context_parallel import cp_findings
from hyper_parallel.distributed.expert_parallel import ep_findings, ep_plan_findings, moe_layers
from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.distributed.pipeline import (
    SPLIT_BACKWARD_SCHEDULES,
    PipelinePlan,
    PipelineSplit,
    check_pipeline,
    count_unit_flops,
)
from hyper_parallel.dmodule.findings import Finding, PlanEntry

__all__ = [
    "accumulation_findings",
    "checkpoint_findings",
    "compile_findings",
    "model_findings",
    "pipeline_plan_findings",
    "position_findings",
    "raise_findings",
    "schedule_findings",
    "sharded_subject",
    "switch_findings",
    "unused_switch_findings",
]


def accumulation_findings(
    num_microbatches: int, batch_size: int | None, layout: MeshLayout
) -> list[Finding]:
    """What refuses gradient accumulation at ``pp=1``: a count below 1, or a batch per
    data-parallel rank that does not split into that many equal micro-batches.

    Equal micro-batches make the step's loss the mean of theirs, so the accumulated
    gradient is exactly the one of one forward over the whole batch.

    Args:
        num_microbatches: Micro-batches per step (``--microbatches``).
        batch_size: Sequences per data-parallel rank per step, when known.
        layout: The mesh (its data-parallel size names the global batch in the fix).

    Example:
        >>> from hyper_parallel.distributed import MeshLayout
        >>> [f.field for f in accumulation_findings(3, 4, MeshLayout(dp_shard=2))]
        ['num_microbatches']
    """
    if num_microbatches < 1:
        return [
            Finding(
                "error",
                "",
                "num_microbatches",
                f"--microbatches {num_microbatches}: a step needs at least one micro-batch.",
                "give --microbatches >= 1 (1: one forward of the whole batch).",
            )
        ]
    if batch_size is None or batch_size % num_microbatches == 0:
        return []
    dp = layout.size("batch")
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    shown = ", ".join(str(d) for d in divisors[:8]) + (", ..." if len(divisors) > 8 else "")
    return [
        Finding(
            "error",
            "",
            "num_microbatches",
            f"--microbatches {num_microbatches} does not divide the batch of {batch_size} "
            f"sequences per data-parallel rank (global batch {batch_size * dp} over "
            f"dp_replicate x dp_shard = {dp}): the micro-batches would be unequal.",
            f"use --microbatches among {shown} (divisors of {batch_size}), or a global batch "
            f"that is a multiple of {dp * num_microbatches} (dp x micro-batches).",
        )
    ]


def unused_switch_findings(
    layout: MeshLayout,
    *,
    schedule: str = "1F1B",
    stages_per_rank: int | None = None,
    pipeline_split: Any = None,
    num_microbatches: int = 1,
    reduce_each_microbatch: bool = False,
) -> list[Finding]:
    """Switches this run would not use: warnings (the run starts; nothing is changed).

    A flag should mean one thing; one that means nothing here is said, not silently
    dropped: pipeline switches without a ``pp`` axis (``schedule`` other than torch's
    default 1F1B, ``stages_per_rank``, ``pipeline_split``), and
    ``reduce_each_microbatch`` where no micro-batch's gradients are reduced apart — under
    ``pp`` (torch's schedule reduces every stage's gradients once per step), with one
    micro-batch, or with no data axis to reduce over (dp_replicate x dp_shard x cp = 1).

    Example:
        >>> from hyper_parallel.distributed import MeshLayout
        >>> [f.field for f in unused_switch_findings(MeshLayout(tp=2), schedule="GPipe")]
        ['schedule']
    """
    out: list[Finding] = []
    if layout.pp == 1:
        given = [
            ("schedule", f"schedule={schedule!r}", "--schedule", schedule != "1F1B"),
            (
                "stages_per_rank",
                f"stages_per_rank={stages_per_rank}",
                "--stages-per-rank",
                stages_per_rank is not None,
            ),
            ("pipeline_split", "a pipeline_split", "--pipeline-split", pipeline_split is not None),
        ]
        for field, what, flag, on in given:
            if on:
                out.append(
                    Finding(
                        "warning",
                        "switches",
                        field,
                        f"{what} shapes a pipeline, but the mesh has no pp axis (pp=1): the "
                        "run has no pipeline and does not use it.",
                        f"drop {flag}, or add a pp axis to the mesh (e.g. pp=2).",
                    )
                )
    if not reduce_each_microbatch:
        return out
    if layout.pp > 1:
        why = (
            "applies to gradient accumulation at pp=1; under pp the schedule runs the "
            "micro-batches and reduces each stage's gradients once per step"
        )
        fix = "drop --reduce-each-microbatch (the pipeline reduces once per step)."
    elif num_microbatches == 1:
        why = "reduces each accumulated micro-batch's gradients, but the step has one micro-batch"
        fix = (
            "accumulate with --microbatches N (N > 1, dividing each data-parallel rank's "
            "batch), or drop --reduce-each-microbatch."
        )
    elif layout.size("loss") == 1:
        why = (
            "reduces each micro-batch's gradients over the data axes, but the mesh has none "
            "(dp_replicate x dp_shard x cp = 1)"
        )
        fix = "drop --reduce-each-microbatch, or add a data axis (dp_shard, dp_replicate or cp)."
    else:
        return out
    out.append(
        Finding(
            "warning",
            "switches",
            "reduce_each_microbatch",
            f"reduce_each_microbatch {why}, so the run does not use it.",
            fix,
        )
    )
    return out


def _sp_unit(tp: int, cp: int) -> int:
    """What sequence parallelism needs the sequence length to be a multiple of: tp, and
    under cp each rank's head-tail share (seq_len / cp, of 2 chunks) split over tp."""
    return tp if cp == 1 else cp * math.lcm(2, tp)


def _sp_fix(tp: int, cp: int, seq_len: int | None, heads: int | None = None) -> str:
    """A fix for sequence parallelism that is true of this mesh and seq_len: a tp > 1
    the sequence splits over (and, given the model's query ``heads``, that divides
    them), or a sequence length this tp splits."""
    if seq_len is None:
        return "add a tp axis (e.g. tp=2), or drop --sp."
    sizes = [
        d
        for d in range(2, 17)
        if d <= seq_len and seq_len % _sp_unit(d, cp) == 0 and (heads is None or heads % d == 0)
    ]
    flag = "the sequence length (--seq; --seq-len on train.run and demo)"
    if tp == 1:
        if sizes:
            return f"add a tp axis of size {' or '.join(map(str, sizes[:3]))}, or drop --sp."
        unit = _sp_unit(2, cp)
        return (
            f"add a tp axis (e.g. tp=2) and set {flag} to a multiple of {unit} "
            f"(e.g. {seq_len + -seq_len % unit}), or drop --sp."
        )
    unit = _sp_unit(tp, cp)
    below = seq_len - seq_len % unit
    lengths = [n for n in (below, below + unit) if n]
    what = f"tp={tp}" if cp == 1 else f"cp x lcm(2, tp) = {unit}"
    fix = f"set {flag} to a multiple of {what} (e.g. {' or '.join(map(str, lengths))})"
    if sizes:
        fix += f", or use tp={sizes[0]}" if len(sizes) == 1 else f", or use tp among {sizes}"
    return fix + ", or drop --sp."


def switch_findings(
    layout: MeshLayout,
    *,
    sequence_parallel: bool = False,
    seq_len: int | None = None,
    global_batch_size: int | None = None,
    heads: int | None = None,
) -> list[Finding]:
    """What the switches ask of the mesh: sequence parallelism needs ``tp > 1`` and a
    sequence divisible by ``tp``; the global batch splits evenly over the data ranks.
    ``heads`` (the model's query heads, when known) keeps the fix to tp sizes the model
    takes.

    ``TrainConfig`` raises these at construction with the same text
    (:func:`raise_findings`); ``validate``, ``plan`` and the demo report them as
    findings of the run plan.
    """
    out: list[Finding] = []
    tp = layout.tp
    if sequence_parallel and (tp == 1 or (seq_len is not None and seq_len % tp)):
        out.append(
            Finding(
                "error",
                "switches",
                "sp",
                f"sp (sequence parallelism) needs tp > 1 and seq_len divisible by tp (got "
                f"tp={tp}, seq_len={seq_len}): it shards each sequence over the tp axis.",
                _sp_fix(tp, layout.cp, seq_len, heads),
            )
        )
    dp = layout.size("batch")
    if global_batch_size is not None and global_batch_size % dp:
        out.append(
            Finding(
                "error",
                "switches",
                "batch_size",
                f"batch_size={global_batch_size} (the global batch) is not divisible by "
                f"dp_replicate x dp_shard = {dp}; each data-parallel rank takes an equal slice "
                "of it.",
                f"make --batch-size a multiple of {dp}, or change the data axes.",
            )
        )
    return out


def compile_findings(
    layout: MeshLayout, *, compile: bool, fsdp: bool, microbatch_size: int | None
) -> list[Finding]:
    """What ``torch.compile`` does not trace: cp on a states mesh of several axes with
    more than one sequence per micro-batch.

    Under context parallelism a block's input is a sequence shard; each linear layer
    flattens (batch, sequence) into rows, so a batch of several sequences becomes a
    strided shard of the rows. On a states mesh of more than one axis (tp, or FSDP2's
    data axes next to cp) torch 2.13 propagates that sharding through the matmul with a
    data-dependent size, which dynamo's fake tensors cannot give: every rank stops
    with ``PendingUnbackedSymbolNotFound`` (found by the configuration matrix at
    dp_shard=2 x cp=2, dp_replicate=2 x cp=2 and cp=2 x tp=2 with 4 sequences per
    rank). Eager runs it, and one sequence per micro-batch compiles (dp_shard=2 x cp=2,
    and cp alone with 2 sequences, match eager).
    """
    if not compile or layout.cp == 1 or microbatch_size is None or microbatch_size <= 1:
        return []
    others = [a for a in ("dp_replicate", "dp_shard") if fsdp and layout.size(a) > 1]
    others += ["tp"] if layout.tp > 1 else []
    if not others:
        return []
    return [
        Finding(
            "error",
            "switches",
            "compile",
            f"compile with cp={layout.cp} next to {' x '.join(others)} and "
            f"{microbatch_size} sequences per micro-batch: dynamo cannot trace the linear "
            "layers on a sequence shard flattened with the batch over a states mesh of "
            "several axes (torch's strided-shard propagation needs a data-dependent size; "
            "every rank would stop).",
            "give each rank one sequence per micro-batch (a global batch of data-parallel "
            "ranks x micro-batches), or leave compile off with cp.",
        )
    ]


def checkpoint_findings(
    layout: MeshLayout, *, ac: str, fsdp: bool, schedule: str | None = None
) -> list[Finding]:
    """What per-operator checkpointing (``ac="op"``) does not run.

    torch's selective checkpointing keeps each kept operator output for one backward of
    the block and matches each recomputed operator with its forward call by its index
    among the calls of that operator. Two things break that, and every rank stops:

    - routed experts that are an FSDP2 unit of their own inside the block (``ep`` with
      FSDP2 over data ranks): FSDP2's hooks on that unit run other operators while
      backward recomputes the block than in its forward (``... invocation index 2
      encountered during backward but not found in storage``; found by
      ``tests/distributed/test_train_switches.py`` at dp_shard=2 x ep=2);
    - a schedule that splits the backward (``InterleavedZeroBubble``, ``ZBVZeroBubble``):
      the weight-gradient step reads the block's saved activations after the
      input-gradient step consumed them (found by the configuration matrix at pp=2 x
      cp=2, InterleavedZeroBubble).
    """
    if ac != "op":
        return []
    out: list[Finding] = []
    experts_unit = layout.ep > 1 and fsdp
    if (
        experts_unit
        and layout.efsdp == 1
        and layout.dp_replicate * layout.dp_shard * layout.cp == 1
    ):
        experts_unit = False
    if experts_unit:
        out.append(
            Finding(
                "error",
                "switches",
                "ac",
                f"ac='op' with ep={layout.ep} under FSDP2: the routed experts are an FSDP2 "
                "unit inside each block, and torch's selective checkpointing cannot replay "
                "the block's operators past FSDP2's hooks on that unit (every rank would "
                "stop in backward).",
                "use ac='full' or 'selective' with ep, or a mesh without data axes "
                "(dp_replicate, dp_shard, cp: no FSDP2).",
            )
        )
    if layout.pp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES:
        out.append(
            Finding(
                "error",
                "switches",
                "ac",
                f"ac='op' with the {schedule} schedule: it splits each backward into an "
                "input-gradient and a weight-gradient step, and the second reads what torch's "
                "selective checkpointing handed to the first once (every rank would stop).",
                "use ac='full' or 'selective' with a zero-bubble schedule, or a schedule "
                "without a split backward (1F1B, Interleaved1F1B, GPipe).",
            )
        )
    return out


def raise_findings(findings: Iterable[Finding], where: str) -> None:
    """Raise one ``ValueError`` listing every error of ``findings`` (none: return).

    Args:
        findings: Findings of any severity; only errors are raised.
        where: Who refuses, e.g. ``"Trainer (mesh pp=2)"``.
    """
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        lines = "\n".join(f"  {f}" for f in errors)
        raise ValueError(f"{where}: {len(errors)} problem(s):\n{lines}")


def sharded_subject(
    model: str, overrides: Mapping[str, Any] | None, layout: MeshLayout, sp: bool
) -> tuple[Any, Any, list[Finding]]:
    """The registered model's config sharded for the layout's model axes, its family, and
    what refused it (an unknown name, overrides, or axis sizes the model does not take)."""
    from hyper_parallel.dmodule.model_spec import get_spec

    findings: list[Finding] = []
    subject, family = None, None
    try:
        spec = get_spec(model)
        family = spec.family
        config = spec.config(**dict(overrides or {}))
    except (ValueError, TypeError) as e:  # unknown name, or overrides it refuses
        # A message that says its own fix keeps it (it had a second, generic one).
        message, _, fix = str(e).partition(" Fix: ")
        findings.append(
            Finding(
                "error", "model", model, message, fix or "name a registered model and its fields."
            )
        )
    else:
        try:
            subject = apply_model_axes(spec, config, layout, sequence_parallel=sp)
        except ValueError as e:
            findings.append(
                Finding("error", "model", model, str(e), "pick axis sizes the model supports.")
            )
    return subject, family, findings


def model_findings(
    layout: MeshLayout,
    subject: Any,
    model: nn.Module,
    entries: Sequence[PlanEntry],
    axes: Sequence[str],
    states_on_data: Any,
    fsdp: bool,
    seq_len: int | None,
    memo: dict[Any, Any] | None = None,
) -> list[Finding]:
    """The model's sharding against the mesh: experts over ``ep``, the plan's axes against
    the data axes and ``cp``, context parallelism against the sequence and the heads.
    ``memo`` (per model structure, from a :class:`PlanCache`) keeps the model's MoE
    layers, found once by walking its modules."""
    out: list[Finding] = []
    layers = None
    if layout.ep > 1 or layout.tp > 1:
        if memo is not None:
            if "moe_layers" not in memo:
                memo["moe_layers"] = moe_layers(model)
            layers = memo["moe_layers"]
        else:
            layers = moe_layers(model)
    if layout.ep > 1:
        out += ep_plan_findings(layout, entries)
        out += ep_findings(model, layout, layers=layers)
    if layout.tp > 1 and layers:
        out += _moe_sequence_findings(layout, layers[0][0].rpartition(".")[0], seq_len)
    out += plan_axis_findings(layout, axes, fsdp=fsdp, states_on_data=states_on_data)
    if layout.cp > 1:
        found = cp_findings(model if isinstance(subject, nn.Module) else subject, layout, seq_len)
        # The sequence against the positions is position_findings' (at every cp size).
        out += [f for f in found if (f.path, f.field) != ("rope", "max_seq_len")]
    return out


def _moe_sequence_findings(layout: MeshLayout, moe: str, seq_len: int | None) -> list[Finding]:
    """A mixture of experts under ``tp`` routes each tp rank's slice of the sequence (of
    its cp part): the slices must be equal, ``seq_len`` a multiple of cp x tp, else the
    block's output re-enters the residual stream one token too long (torch: "Attempting
    to broadcast a dimension of length 16" at the residual add)."""
    unit = layout.cp * layout.tp
    if seq_len is None or seq_len % unit == 0:
        return []
    what = f"tp={layout.tp}" if layout.cp == 1 else f"cp x tp = {unit}"
    # Lengths that also split head-tail over cp (2 x cp chunks), so the fix is one fix.
    step = unit if layout.cp == 1 else layout.cp * math.lcm(2, layout.tp)
    below = seq_len - seq_len % step
    lengths = " or ".join(str(n) for n in (below, below + step) if n)
    # The tp ranks split each cp rank's part, not the whole sequence.
    if layout.cp == 1:
        other_tp = f", or use a tp that divides {seq_len}"
    elif seq_len % (2 * layout.cp) == 0:
        other_tp = f", or use a tp that divides the {seq_len // layout.cp} tokens of each cp rank"
    else:
        other_tp = ""
    return [
        Finding(
            "error",
            "switches",
            "seq_len",
            f"the mixture of experts ({moe}, ...) runs on each tp rank's slice of the "
            f"sequence, so seq_len must be a multiple of {what}; got seq_len={seq_len}.",
            "set the sequence length (--seq; --seq-len on train.run and demo) to a multiple "
            f"of {step} (e.g. {lengths}){other_tp}.",
        )
    ]


def position_findings(
    name: str | None, subject: Any, family: ModelFamily | None, seq_len: int | None
) -> list[Finding]:
    """A sequence longer than the model's rotary positions (``rope.max_seq_len``), refused
    with the fix: a registered model of the same family and size that takes it (Llama
    3.1's scaled rope for Llama 3), a shorter sequence, or ``max_seq_len`` overridden.

    The positions are what the model's rope covers: a Llama 3 rope was trained on 8,192,
    Llama 3.1's is scaled to 131,072; a longer table than that is the user's explicit
    override, never a silent one.
    """
    limit = family.max_seq_len(subject) if family is not None else None
    if seq_len is None or limit is None or seq_len <= limit:
        return []
    who = name or "the model"
    longer = _longer_models(name, subject, family, seq_len)
    instead = f"use {longer} instead, " if longer else ""
    return [
        Finding(
            "error",
            "rope",
            "max_seq_len",
            f"seq_len {seq_len:,} exceeds {who}'s {limit:,} positions (rope.max_seq_len="
            f"{limit}); the rotary embedding has no angle for the positions past them.",
            f"{instead}shorten the sequence to at most {limit:,} tokens, or set "
            f"--model-overrides '{{\"max_seq_len\": {seq_len}}}' (positions the rope was "
            "not trained on).",
        )
    ]


def _longer_models(
    name: str | None, subject: Any, family: ModelFamily | None, seq_len: int
) -> str | None:
    """Registered models of ``subject``'s family and parameter count whose positions
    cover ``seq_len`` (``"llama3.1-8b (131,072 positions)"``), or ``None``."""
    from hyper_parallel.dmodule.model_spec import get_spec, list_specs

    count = getattr(family, "num_params", None)
    if family is None or count is None or isinstance(subject, nn.Module):
        return None
    try:
        size = count(subject)
    except (AttributeError, TypeError, ValueError):
        return None
    found = []
    for other in list_specs():
        spec = get_spec(other)
        if other == name or spec.family is None or spec.family.name != family.name:
            continue
        try:
            config = spec.config()
        except (ValueError, TypeError):  # a spec sized by a file (the *-hf ones)
            continue
        positions = spec.family.max_seq_len(config) or 0
        if positions >= seq_len and count(config) == size:
            found.append(f"{other} ({positions:,} positions)")
    return " or ".join(found) or None


def pipeline_plan_findings(
    name: str,
    layout: MeshLayout,
    model: nn.Module | None,
    family: ModelFamily | None,
    pipeline_layout: PipelineLayoutProtocol | None,
    *,
    schedule: str,
    num_microbatches: int,
    split: PipelineSplit | None,
    stages_per_rank: int | None,
    batch_size: int | None,
    seq_len: int | None,
    memo: dict[Any, Any] | None = None,
) -> tuple[PipelinePlan | None, list[Finding]]:
    """The pipeline plan and its findings (``pp > 1``), each on path ``pipeline``.

    ``memo`` (one per model structure, from a :class:`PlanCache`) keeps the model's
    units and its tied-weight findings per stage assignment.
    """
    if pipeline_layout is None:
        return None, [
            Finding(
                "error",
                "mesh",
                "pp",
                f"pp={layout.pp}, but {name} declares no pipeline stages (no PipelineLayout "
                "registered with the model).",
                "leave pp out of the mesh, register the model's PipelineLayout, or pass "
                "validate(..., pipeline=PipelineLayout(...)) describing its units.",
            )
        ]
    if layout.cp > 1 and family is not None and family.set_positions is None:
        return None, [
            Finding(
                "error",
                "mesh",
                "cp",
                f"model {name!r} with pp and cp: its family declares no set_positions "
                "hook to hand each pipeline stage its tokens' positions.",
                "leave cp or pp out of the mesh, or declare ModelFamily.set_positions.",
            )
        ]
    if model is None:  # the model's sharding was refused: reported already
        return None, []
    # FLOPs are counted for a balanced split only (an explicit one with a balance is refused).
    flops = (
        split is not None
        and split.balance == "flops"
        and split.units_per_stage is None
        and split.stages is None
    )
    units_key = ("units", seq_len or 2048) if flops else ("units",)
    try:
        if memo is not None and units_key in memo:
            units = memo[units_key]
        elif flops:
            with torch.device("meta"):
                units = count_unit_flops(pipeline_layout, model, seq_len or 2048)
        else:
            units = pipeline_layout.units_of_model(model)
        if memo is not None:
            memo[units_key] = units
    except ValueError as e:  # the model refuses the sequence it is counted on
        return None, [
            Finding(
                "error",
                "pipeline",
                "split.balance",
                f"counting each unit's FLOPs on a sequence of {seq_len or 2048:,} tokens"
                f"{'' if seq_len else ' (no sequence length given: 2,048 assumed)'} failed: {e}",
                "give the run's sequence length, one the model takes (--seq N for validate "
                "and plan, --seq-len N for train and demo), or balance by 'params'.",
            )
        ]
    except AttributeError as e:
        return None, [
            Finding(
                "error",
                "pipeline",
                "layout",
                f"the pipeline description does not fit {type(model).__name__}: {e}",
                "pass the PipelineLayout of this model family.",
            )
        ]
    plan, found = check_pipeline(
        units,
        pp=layout.pp,
        schedule=schedule,
        num_microbatches=num_microbatches,
        split=split,
        stages_per_rank=stages_per_rank,
        batch_size=batch_size,
        model=model,
        tied_memo=memo.setdefault("tied", {}) if memo is not None else None,
    )
    found = [dataclasses.replace(f, path=f.path or "pipeline") for f in found]
    found += schedule_findings(layout, schedule)
    if any(f.severity == "error" for f in found):
        plan = None
    return plan, found


def schedule_findings(layout: MeshLayout, schedule: str) -> list[Finding]:
    """What a pipeline schedule does not run with the other axes: ``ep`` with a schedule
    that splits the backward.

    Inside a pipeline stage the routed experts are an FSDP2 unit of their own (over
    ``efsdp``, a mesh apart from the dense states'). The zero-bubble schedules
    (``InterleavedZeroBubble``, ``ZBVZeroBubble``) run each backward as an
    input-gradient and a later weight-gradient step, and FSDP2 units nested in a stage
    then reduce their gradients before the weight step has accumulated them (the
    reason a stage is one FSDP2 unit under those schedules): measured 9.5e-4 and
    2.3e-3 off one device after 5 steps of the debug MoE at pp=2 x dp_shard=2 x ep=2.
    1F1B, GPipe and Interleaved1F1B run the full backward and match one device.
    """
    if layout.ep == 1 or layout.pp == 1 or schedule not in SPLIT_BACKWARD_SCHEDULES:
        return []
    return [
        Finding(
            "error",
            "mesh",
            "ep",
            f"ep={layout.ep} with pp={layout.pp} and {schedule}: the schedule splits each "
            "backward into input- and weight-gradient steps, and the routed experts' own "
            "FSDP2 unit (over efsdp) inside each stage would reduce its gradients before "
            "the weight step (wrong gradients).",
            "use 1F1B, GPipe or Interleaved1F1B with ep, or leave ep out of the mesh for "
            f"{schedule}.",
        )
    ]
