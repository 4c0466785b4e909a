"""The pipeline plan: schedules, the stage split, and every check before anything runs.

:func:`plan_pipeline` (or :func:`check_pipeline`, which returns the findings instead of
raising) resolves a :class:`PipelineSplit` over a model's units into a
:class:`PipelinePlan`: which units each stage holds and which pp rank runs it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from torch import nn

from hyper_parallel._torch_private import get_schedule_ops
from hyper_parallel.distributed.pipeline.units import PipelineUnit
from hyper_parallel.dmodule.findings import Finding

__all__ = [
    "BALANCE",
    "DEFAULT_STAGES_PER_RANK",
    "MULTI_STAGE_SCHEDULES",
    "SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "PipelineError",
    "PipelinePlan",
    "PipelineSplit",
    "balanced_split",
    "check_pipeline",
    "pipeline_findings",
    "plan_pipeline",
    "schedule_actions",
    "stage_ranks",
    "stages_per_rank_of",
    "tied_parameter_findings",
]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
"""Schedules by torch's names (``torch.distributed.pipelining.schedules.get_schedule_class``)."""

MULTI_STAGE_SCHEDULES = frozenset({"Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"})
"""Schedules that run several stages per rank (the others run exactly one)."""

_V_SHAPE = frozenset({"ZBVZeroBubble"})
SPLIT_BACKWARD_SCHEDULES = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble"})
"""Schedules that split the backward into input- and weight-gradient steps."""
DEFAULT_STAGES_PER_RANK = 2
"""Stages per rank of the interleaved schedules when not given."""


def stages_per_rank_of(schedule: str, stages_per_rank: int | None = None) -> int:
    """Stages each rank runs: ``stages_per_rank`` when given, else 1 for the single-stage
    schedules and :data:`DEFAULT_STAGES_PER_RANK` for the interleaved ones."""
    if stages_per_rank:
        return stages_per_rank
    return DEFAULT_STAGES_PER_RANK if schedule in MULTI_STAGE_SCHEDULES else 1


BALANCE = ("params", "flops")
"""What an automatic split balances: parameter count, or forward FLOPs per unit."""


class PipelineError(ValueError):
    """A pipeline plan was refused before anything ran; ``findings`` lists every problem."""

    def __init__(self, findings: Sequence[Finding]) -> None:
        self.findings = list(findings)
        lines = "\n".join(f"  {f}" for f in self.findings)
        super().__init__(f"{len(self.findings)} problem(s) in the pipeline plan:\n{lines}")


def _error(field: str, message: str, fix: str, path: str = "") -> Finding:
    return Finding("error", path, field, message, fix)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PipelineSplit:
    """Which units go to which stage; give at most one of the two fields.

    Attributes:
        units_per_stage: Consecutive units per stage (the embedding and the head
            count as one unit each, as torchtitan's ``layers_per_stage``); the last
            stage may hold fewer.
        stages: Explicit unit names per stage, in order, e.g.
            ``(("tok_embeddings", "layers.0"), ("layers.1", "norm+output"))``; a
            module name of a unit (``"norm"``, ``"output"``) stands for its unit.

    With neither, stages are balanced (:func:`balanced_split`) by ``balance``:
    ``"params"`` (parameter count, the default) or ``"flops"`` (each unit's forward
    FLOPs, :func:`count_unit_flops`: attention's cost grows with the sequence, the
    embedding costs none). A ``balance`` other than ``"params"`` beside either field is
    refused: the explicit split places the units itself.
    """

    units_per_stage: int | None = None
    stages: tuple[tuple[str, ...], ...] | None = None
    balance: str = "params"

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PipelineSplit:
        """Read ``{"units_per_stage": 2}`` or ``{"stages": [["tok_embeddings", ...], ...]}``."""
        unknown = sorted(set(values) - {"units_per_stage", "stages", "balance"})
        if unknown:
            raise ValueError(
                f"PipelineSplit: unknown key(s) {unknown}; use 'units_per_stage', 'stages' "
                "or 'balance'."
            )
        stages = values.get("stages")
        if isinstance(stages, (list, tuple)):
            # A stage given as one string stays one (refused by name), never its letters.
            stages = tuple(s if isinstance(s, str) else tuple(s) for s in stages)
        return cls(
            units_per_stage=values.get("units_per_stage"),
            stages=stages,
            balance=values.get("balance", "params"),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "units_per_stage": self.units_per_stage,
            "stages": None if self.stages is None else [list(s) for s in self.stages],
            "balance": self.balance,
        }


@functools.lru_cache(maxsize=1024)
def _balanced_split(weights: tuple[int, ...], num_parts: int) -> tuple[int, ...]:
    """:func:`balanced_split`, memoized (a pure function; a search asks it again per
    batch size and micro-batch count of one model and stage count)."""
    return tuple(balanced_split(weights, num_parts))


def balanced_split(weights: Sequence[int], num_parts: int) -> list[int]:
    """Cut ``weights`` into ``num_parts`` contiguous non-empty parts, minimizing the largest sum.

    The classic linear-partition dynamic programme, O(n^2 k); ties keep earlier
    parts no heavier than later ones.

    Args:
        weights: One weight per unit (parameter counts).
        num_parts: Number of parts, 1 <= num_parts <= len(weights).

    Returns:
        The number of units in each part.

    Example:
        >>> balanced_split([1, 1, 1, 1], 2)
        [2, 2]
    """
    n = len(weights)
    if not 1 <= num_parts <= n:
        raise ValueError(f"balanced_split: cannot cut {n} units into {num_parts} non-empty parts.")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest possible largest part when the first i units form k parts.
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i] or (cost == best[k][i] and j > cut[k][i]):
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(num_parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def stage_ranks(schedule: str, pp: int, num_stages: int) -> list[int]:
    """The pp rank of each stage: looped (stage s on rank s mod pp) or V-shape for ZBV.

    Example:
        >>> stage_ranks("ZBVZeroBubble", 2, 4)
        [0, 1, 1, 0]
    """
    if schedule in _V_SHAPE:
        return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]


@dataclasses.dataclass(frozen=True, slots=True)
class PipelinePlan:
    """A checked pipeline: which units each stage holds and where each stage runs.

    Attributes:
        schedule: The schedule's torch name.
        pp: Size of the pp axis.
        num_microbatches: Micro-batches per step.
        stages: Unit names of each stage, in pipeline order.
        ranks: The pp rank of each stage.
    """

    schedule: str
    pp: int
    num_microbatches: int
    stages: tuple[tuple[str, ...], ...]
    ranks: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        """Total number of stages."""
        return len(self.stages)

    @property
    def stages_per_rank(self) -> int:
        """Stages each rank holds."""
        return self.num_stages // self.pp

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        """Indices of the stages ``pp_rank`` runs, in pipeline order."""
        return [s for s, r in enumerate(self.ranks) if r == pp_rank]

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "schedule": self.schedule,
            "pp": self.pp,
            "num_microbatches": self.num_microbatches,
            "stages": [list(s) for s in self.stages],
            "ranks": list(self.ranks),
        }


def _schedule_findings(schedule: str) -> list[Finding]:
    if schedule in SCHEDULES:
        return []
    near = [s for s in SCHEDULES if s.lower() == schedule.lower()]
    fix = f"write {near[0]!r}." if near else f"choose one of {list(SCHEDULES)}."
    return [
        _error(
            "schedule",
            f"{schedule!r} is not a pipeline schedule hyper_parallel runs (torch's "
            f"names: {list(SCHEDULES)}).",
            fix,
        )
    ]


def _resolve_split(
    units: Sequence[PipelineUnit], split: PipelineSplit, num_stages: int | None
) -> tuple[list[list[str]] | None, list[Finding]]:
    """Unit names per stage from ``split`` (``num_stages`` when balancing)."""
    names = [u.name for u in units]
    if split.units_per_stage is not None and split.stages is not None:
        return None, [
            _error(
                "split",
                "both units_per_stage and stages are given.",
                "give one: units per stage, or explicit stage lists.",
            )
        ]
    if split.balance != "params" and (
        split.units_per_stage is not None or split.stages is not None
    ):
        return None, [
            _error(
                "split.balance",
                f"is {split.balance!r} beside an explicit split (units_per_stage or stages), "
                "which places the units itself: the balance would do nothing.",
                "drop 'balance' to keep the explicit split, or drop units_per_stage / stages "
                f"to balance by {split.balance!r}.",
            )
        ]
    if split.units_per_stage is not None:
        size = split.units_per_stage
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            return None, [
                _error(
                    "split.units_per_stage",
                    f"is {size!r}; it must be an integer >= 1.",
                    "give the number of units (embedding, blocks, head) per stage.",
                )
            ]
        return [names[i : i + size] for i in range(0, len(names), size)], []
    if split.stages is not None:
        where, value = _malformed_stages(split.stages)
        if where:
            return None, [
                _error(
                    where,
                    f"is {value!r}; each stage is a list of unit names, stages a list of them.",
                    f'write e.g. {{"stages": [["{units[0].name}", "{units[1].name}"], '
                    f'[..., "{units[-1].name}"]]}} (a one-unit stage too: ["layers.1"]).',
                )
            ]
        return _explicit_stages(units, split.stages)
    assert num_stages is not None
    if num_stages > len(units):
        return None, [
            _error(
                "split",
                f"{num_stages} stages need at least {num_stages} units, but the model has "
                f"{len(units)} ({len(units) - 2} layers + the embedding and the head): the "
                "split cannot place a unit on every stage.",
                f"use at most {len(units)} stages (a smaller pp or fewer stages per rank), or "
                "a model with more layers (--model-overrides '{\"num_layers\": N}').",
            )
        ]
    if split.balance not in BALANCE:
        return None, [
            _error(
                "split.balance",
                f"is {split.balance!r}; stages are balanced by one of {list(BALANCE)}.",
                "use 'params' (parameter count) or 'flops' (forward FLOPs per unit).",
            )
        ]
    if split.balance == "flops" and any(u.num_flops is None for u in units):
        return None, [
            _error(
                "split.balance",
                "is 'flops', but the units carry no FLOP counts.",
                "build the units with PipelineLayout.units(config, seq_len=...) (the "
                "trainer does), or balance by 'params'.",
            )
        ]
    weights = [u.num_params if split.balance == "params" else u.num_flops for u in units]
    sizes = list(_balanced_split(tuple(weights), num_stages))
    out, start = [], 0
    for size in sizes:
        out.append(names[start : start + size])
        start += size
    return out, []


def _malformed_stages(stages: Any) -> tuple[str, Any]:
    """The field and value of ``stages`` that is not a list of lists of unit names
    (``("", None)`` when it is one)."""
    if not isinstance(stages, (list, tuple)):
        return "split.stages", stages
    for i, items in enumerate(stages):
        if not isinstance(items, (list, tuple)) or not all(isinstance(n, str) for n in items):
            return f"split.stages[{i}]", items
    return "", None


def _explicit_stages(
    units: Sequence[PipelineUnit], stages: Sequence[Sequence[str]]
) -> tuple[list[list[str]] | None, list[Finding]]:
    owner: dict[str, str] = {}
    for u in units:
        owner[u.name] = u.name
        for m in u.modules:
            owner[m] = u.name
    findings: list[Finding] = []
    where: dict[str, int] = {}
    out: list[list[str]] = []
    for s, items in enumerate(stages):
        field = f"split.stages[{s}]"
        if not items:
            findings.append(
                _error(
                    field,
                    "is empty: a stage must hold at least one unit.",
                    "remove the empty stage or move a unit onto it.",
                )
            )
        stage: list[str] = []
        for item in items:
            unit = owner.get(item)
            if unit is None:
                findings.append(
                    _error(
                        field,
                        f"names {item!r}, which is not a unit of the model.",
                        f"use the unit names {[u.name for u in units][:4]}... or their module "
                        "names.",
                    )
                )
                continue
            if unit in where and where[unit] != s:
                findings.append(
                    _error(
                        field,
                        f"places {unit!r}, already placed on stage {where[unit]}.",
                        "put each unit on exactly one stage (norm and output are one unit).",
                    )
                )
                continue
            if unit not in stage:
                stage.append(unit)
            where[unit] = s
        out.append(stage)
    missing = [u.name for u in units if u.name not in where]
    if missing:
        findings.append(
            _error(
                "split.stages",
                f"leaves unit(s) {missing} on no stage.",
                "place every unit of the model on a stage.",
            )
        )
    order = [u.name for u in units]
    flat = [n for stage in out for n in stage]
    if not findings and flat != order:
        findings.append(
            _error(
                "split.stages",
                f"does not list the units in model order (got {flat}).",
                "give each stage a contiguous run of units, stages in model order.",
            )
        )
    return (None if findings else out), findings


def pipeline_findings(units: Sequence[PipelineUnit], **options: Any) -> list[Finding]:
    """Every problem of a pipeline plan, each with its fix (no process group needed).

    Takes :func:`plan_pipeline`'s arguments. Checks: the schedule name; stages per
    rank for the schedule (one for single-stage schedules, two or more for
    interleaved ones, exactly two for ZBV); the split (a layer count it cannot place,
    an empty stage, a unit placed twice or not at all, a stage count that is not a
    multiple of pp); micro-batches fewer than the schedule needs (torch's own rule,
    by building the schedule on stand-in stages); a batch not divisible into
    micro-batches; with ``model`` (meta is enough), a weight tied across stages
    (:func:`tied_parameter_findings`).

    Returns:
        The findings (empty when the plan is good).

    Example:
        >>> from hyper_parallel.dmodule import get_spec
        >>> spec = get_spec("llama3-debug")
        >>> units = spec.pipeline().units(spec.config())
        >>> [f.field for f in pipeline_findings(units, pp=2, schedule="1F1B",
        ...                                      num_microbatches=1)]
        ['num_microbatches']
    """
    return check_pipeline(units, **options)[1]


def plan_pipeline(
    units: Sequence[PipelineUnit],
    *,
    pp: int,
    schedule: str,
    num_microbatches: int,
    split: PipelineSplit | None = None,
    stages_per_rank: int | None = None,
    batch_size: int | None = None,
    model: nn.Module | None = None,
) -> PipelinePlan:
    """Check and resolve a pipeline plan (see :func:`pipeline_findings` for the checks).

    Args:
        units: The model's units (:meth:`PipelineLayout.units`).
        pp: Size of the pp axis.
        schedule: Torch's schedule name (:data:`SCHEDULES`).
        num_microbatches: Micro-batches per step.
        split: The stage split; ``None`` balances by parameter count.
        stages_per_rank: Stages per rank (interleaved schedules; default 2).
        batch_size: Sequences per data-parallel rank per step, when known.
        model: The model (meta is enough), to find weights tied across stages.

    Raises:
        PipelineError: Every error at once.

    Example:
        >>> from hyper_parallel.dmodule import get_spec
        >>> spec = get_spec("llama3-debug")
        >>> units = spec.pipeline().units(spec.config())
        >>> plan_pipeline(units, pp=2, schedule="Interleaved1F1B", num_microbatches=4).ranks
        (0, 1, 0, 1)
    """
    plan, findings = check_pipeline(
        units,
        pp=pp,
        schedule=schedule,
        num_microbatches=num_microbatches,
        split=split,
        stages_per_rank=stages_per_rank,
        batch_size=batch_size,
        model=model,
    )
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise PipelineError(errors)
    assert plan is not None
    return plan


def check_pipeline(
    units: Sequence[PipelineUnit],
    *,
    pp: int,
    schedule: str,
    num_microbatches: int,
    split: PipelineSplit | None = None,
    stages_per_rank: int | None = None,
    batch_size: int | None = None,
    model: nn.Module | None = None,
    tied_memo: dict[Any, list[Finding]] | None = None,
) -> tuple[PipelinePlan | None, list[Finding]]:
    """:func:`plan_pipeline`'s checks and plan without raising: ``(plan, findings)``.

    The plan is ``None`` when the findings stop it from being resolved; with errors of
    a resolved plan (micro-batches, tied weights, the batch) both come back.
    ``tied_memo`` keeps the tied-weight findings of ``model`` per stage assignment
    (for many checks of one model: they depend on nothing else).
    """
    findings = _schedule_findings(schedule)
    if findings:
        return None, findings
    multi = schedule in MULTI_STAGE_SCHEDULES
    if stages_per_rank is not None:
        if not multi and stages_per_rank != 1:
            findings.append(
                _error(
                    "stages_per_rank",
                    f"{schedule} runs one stage per rank, got --stages-per-rank {stages_per_rank}.",
                    "leave --stages-per-rank out (or 1), or use a looped schedule "
                    "(Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble) for "
                    "several stages per rank.",
                )
            )
        elif multi and stages_per_rank < 2:
            findings.append(
                _error(
                    "stages_per_rank",
                    f"{schedule} runs several stages per rank, got --stages-per-rank "
                    f"{stages_per_rank}.",
                    "use --stages-per-rank 2 or more, or GPipe / 1F1B for one stage per rank.",
                )
            )
    if schedule in _V_SHAPE and stages_per_rank not in (None, 2):
        findings.append(
            _error(
                "stages_per_rank",
                f"{schedule} places exactly 2 stages per rank (a V), got --stages-per-rank "
                f"{stages_per_rank}.",
                "use --stages-per-rank 2 (or leave it out), or Interleaved1F1B for more.",
            )
        )
    if num_microbatches < 1:
        findings.append(
            _error(
                "num_microbatches",
                f"is {num_microbatches}; it must be >= 1.",
                "give the number of micro-batches per step.",
            )
        )
    if findings:
        return None, findings
    per_rank = stages_per_rank_of(schedule, stages_per_rank)
    stages, split_findings = _resolve_split(units, split or PipelineSplit(), pp * per_rank)
    findings += split_findings
    if stages is None:
        return None, findings
    num_stages = len(stages)
    expected = (
        f"{pp * per_rank} (pp={pp} x {per_rank} per rank)"
        if stages_per_rank or not multi
        else f"a multiple of pp={pp}, at least 2 per rank"
    )
    good_count = num_stages % pp == 0 and (
        num_stages // pp == per_rank if (stages_per_rank or not multi) else num_stages // pp >= 2
    )
    if schedule in _V_SHAPE:
        good_count = num_stages == 2 * pp
        expected = f"exactly {2 * pp} (pp={pp} x 2 per rank, a V)"
    if not good_count:
        findings.append(
            _error(
                "split",
                f"gives {num_stages} stages for {len(units)} units, but {schedule} at pp={pp} "
                f"needs {expected}: the split cannot place this layer count.",
                "change units_per_stage (or the stage lists) so the stage count fits, change "
                "pp, or leave the split out to balance by parameter count.",
            )
        )
        return None, findings
    plan = PipelinePlan(
        schedule=schedule,
        pp=pp,
        num_microbatches=num_microbatches,
        stages=tuple(tuple(s) for s in stages),
        ranks=tuple(stage_ranks(schedule, pp, num_stages)),
    )
    findings += _microbatch_findings(plan)
    if model is not None:
        if tied_memo is None:
            findings += tied_parameter_findings(model, plan, units)
        else:
            if plan.stages not in tied_memo:
                tied_memo[plan.stages] = tied_parameter_findings(model, plan, units)
            findings += tied_memo[plan.stages]
    if batch_size is not None and batch_size % num_microbatches:
        findings.append(
            _error(
                "num_microbatches",
                f"the batch of {batch_size} sequences per data-parallel rank does not split "
                f"into {num_microbatches} equal micro-batches.",
                _batch_fix(plan, batch_size),
            )
        )
    return plan, findings


def _batch_fix(plan: PipelinePlan, batch_size: int) -> str:
    """The fix of a batch the micro-batch count does not divide: the (up to 3 smallest)
    counts that divide it and that the schedule runs (a divisor it refuses is no fix),
    else a larger batch. The smallest only: torch builds a schedule in up to quadratic
    time in its micro-batches (memoized)."""
    counts: list[int] = []
    for m in range(1, batch_size + 1):
        if len(counts) == 3:
            break
        if batch_size % m == 0 and (
            _schedule_refusal(plan.schedule, plan.pp, m, plan.stages_per_rank) is None
        ):
            counts.append(m)
    larger = f"a batch size that is a multiple of {plan.num_microbatches}"
    if not counts:
        return (
            f"use {larger}: {plan.schedule} with {plan.num_stages} stages on pp={plan.pp} runs "
            f"no micro-batch count that divides {batch_size}."
        )
    return (
        f"use a micro-batch count that divides {batch_size} and {plan.schedule} runs (e.g. "
        f"{', '.join(map(str, counts))}), or {larger}."
    )


def _microbatch_findings(plan: PipelinePlan) -> list[Finding]:
    """Ask torch's own schedule whether it runs this many micro-batches."""
    refusal = _schedule_refusal(plan.schedule, plan.pp, plan.num_microbatches, plan.stages_per_rank)
    if refusal is not None:
        return [
            _error(
                "num_microbatches",
                f"{plan.schedule} with {plan.num_stages} stages on pp={plan.pp} refuses "
                f"{plan.num_microbatches} micro-batches: {refusal}",
                f"use at least {plan.num_stages} micro-batches (a multiple of pp={plan.pp}), "
                "or another schedule.",
            )
        ]
    return []


def _schedule_refusal(schedule: str, pp: int, num_microbatches: int, per_rank: int) -> str | None:
    """Why torch's schedule refuses this combination (``None``: it runs it)."""
    answer = _torch_schedule(schedule, pp, num_microbatches, per_rank)
    return answer if isinstance(answer, str) else None


@functools.lru_cache(maxsize=512)
def _torch_schedule(
    schedule: str, pp: int, num_microbatches: int, per_rank: int
) -> tuple[tuple[Any, ...], ...] | str:
    """torch's action list, or the text of its refusal; memoized, as both depend on these
    four numbers only, and building one takes up to seconds (torch's interleaved
    schedules place their unshard/reshard actions in quadratic time: ~3 s at pp=32 with
    256 micro-batches). The plan's check and the cost model's replay share it."""
    try:
        actions = get_schedule_ops(schedule, pp, num_microbatches, per_rank)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return tuple(tuple(rank) for rank in actions)


def schedule_actions(
    schedule: str, pp: int, num_microbatches: int, stages_per_rank: int = 1
) -> list[list[Any]]:
    """Torch's own action list of a schedule, per rank (``None`` marks an idle slot).

    Built by torch's ``get_schedule_ops`` on stand-in stages: no process group.
    Memoized (the actions are immutable; each call returns new lists).

    Raises:
        ValueError: torch refuses the combination (e.g. 1F1B with fewer micro-batches
            than stages).
    """
    answer = _torch_schedule(schedule, pp, num_microbatches, stages_per_rank)
    if isinstance(answer, str):
        raise ValueError(answer)
    return [list(rank) for rank in answer]


def tied_parameter_findings(
    model: nn.Module, plan: PipelinePlan, units: Sequence[PipelineUnit]
) -> list[Finding]:
    """Parameters shared by units on different stages (tied embeddings), as errors.

    ``model`` may live on the meta device. Each ``PipelineStage`` owns its
    parameters; a weight shared across stages would be two unsynchronized copies.
    """
    stage_of: dict[str, int] = {}
    for s, names in enumerate(plan.stages):
        for name in names:
            stage_of[name] = s
    module_unit = {m: u.name for u in units for m in u.modules}
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    findings = []
    for names in owners.values():
        stages = {}
        for n in names:
            unit = next(
                (u for m, u in module_unit.items() if n == m or n.startswith(m + ".")), None
            )
            if unit is not None:
                stages[n] = stage_of[unit]
        if len(set(stages.values())) > 1:
            where = ", ".join(f"{n} (stage {s})" for n, s in stages.items())
            findings.append(
                _error(
                    "split",
                    f"parameters {where} are one tied tensor split across pipeline stages; "
                    "each stage would train its own copy.",
                    "untie the weights (a registered model: --model-overrides "
                    "'{\"tie_embeddings\": false}'; a Hugging Face config: "
                    '"tie_word_embeddings": false), place the units that share them on the '
                    "same stage, or train without pp.",
                    path=names[0].rsplit(".", 1)[0],
                )
            )
    return findings
