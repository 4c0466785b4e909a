"""Pipeline parallelism on the ``pp`` axis with ``torch.distributed.pipelining``.

A model family describes how it is cut (a :class:`PipelineLayout`: the config fields
of its first unit, its repeated blocks, its last unit, the modules every stage
shares, and the module class that runs a stage). The model is then a list of
*units* — the embedding, each block, the norm + output head — and a stage is a
contiguous run of units. As in torchtitan, the embedding and the head each count as
a unit a stage may hold alone, so a 2-layer model runs 4 stages.

The split is data (:class:`PipelineSplit`): units per stage, explicit lists, or —
when neither is given — a split that balances stages by parameter count or by
forward FLOPs (:func:`count_unit_flops`).
:func:`plan_pipeline` checks everything before a process group exists and returns a
:class:`PipelinePlan` (stages, the rank of each stage, the schedule);
:func:`build_stage_modules` builds this rank's stages on the meta device from the
model's own (already sharded) config, applies tensor parallelism, compile,
activation checkpointing and FSDP2 (with bf16 mixed precision) inside each stage,
materializes and initializes them unit by unit; :func:`build_schedule`
wraps them in torch's ``PipelineStage`` and schedule.

Initialization is per unit: each unit is initialized under its own seed derived
from the run's seed and the unit's name (:func:`init_states_by_unit`). A one-device
model initialized the same way equals the union of the stages at any split.

Example::

    from hyper_parallel.dmodule import get_spec
    spec = get_spec("llama3-debug")
    layout, config = spec.pipeline(), spec.config()
    plan = plan_pipeline(layout.units(config), pp=2, schedule="1F1B", num_microbatches=4)
    # on each rank of a mesh with a pp axis:
    # modules = build_stage_modules(config, layout, plan, pp_rank, device="cpu", seed=0)
    # schedule = build_schedule(modules, plan, mesh["pp"], "cpu", loss_fn)
    # loss = pipeline_step(schedule, plan, pp_rank, tokens, targets, mesh["pp"])
"""

from __future__ import annotations

import dataclasses
import inspect
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.distributed import precision
from hyper_parallel.distributed.activation_checkpoint import _Checkpointed, checkpointed_blocks
from hyper_parallel.distributed.compile import apply_compile
from hyper_parallel.dmodule._checks import Finding

__all__ = [
    "BALANCE",
    "MULTI_STAGE_SCHEDULES",
    "SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "PipelineError",
    "PipelineLayout",
    "PipelinePlan",
    "PipelineSplit",
    "PipelineUnit",
    "balanced_split",
    "build_schedule",
    "build_stage_modules",
    "count_unit_flops",
    "init_states_by_unit",
    "pipeline_findings",
    "pipeline_step",
    "plan_pipeline",
    "schedule_actions",
    "stage_ranks",
    "tied_parameter_findings",
    "unit_seed",
]

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
"""Schedules by torch's names (``torch.distributed.pipelining.schedules.get_schedule_class``)."""

MULTI_STAGE_SCHEDULES = frozenset({"Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"})
"""Schedules that run several stages per rank (the others run exactly one)."""

_V_SHAPE = frozenset({"ZBVZeroBubble"})
SPLIT_BACKWARD_SCHEDULES = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble"})
"""Schedules that split the backward into input- and weight-gradient steps."""
_DEFAULT_STAGES_PER_RANK = 2
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


# ---------------------------------------------------------------------------- description


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineUnit:
    """The smallest piece a stage holds: the embedding, one block, or the head.

    Attributes:
        name: ``"tok_embeddings"``, ``"layers.3"``, ``"norm+output"``.
        modules: Module paths in the model that make up the unit.
        num_params: Parameters of the unit.
        num_flops: Forward FLOPs of the unit for one sequence, when counted
            (:func:`count_unit_flops`); ``None`` otherwise.
    """

    name: str
    modules: tuple[str, ...]
    num_params: int
    num_flops: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineLayout:
    """How a model family is cut into stages (declared next to the model).

    Attributes:
        first: Config fields of the first unit (on the first stage), e.g. the embedding.
        layers: The config field holding the list of repeated blocks.
        last: Config fields of the last unit (on the last stage), e.g. norm and output.
        shared: Config fields every stage holds (state-free or buffer-only modules).
        stage: The module class that runs a stage. Its ``Config`` has the fields of
            ``first``, ``last`` (``None`` when absent), ``shared`` and ``layers`` (a
            dict from the block's index, as a string, to its config).
        activation_layout: ``config -> NamedPlacement`` of the activation passed
            between stages as the model's sharding declares it (``{}``: a plain tensor).
        activation_elements: ``(config, unit name) -> (replicated, tp_split)``: per
            token, the activation elements the unit keeps for its backward (an
            estimate for the dry run); ``None`` when the model gives none.
    """

    first: tuple[str, ...]
    layers: str
    last: tuple[str, ...]
    shared: tuple[str, ...]
    stage: type
    activation_layout: Callable[[Any], dict]
    activation_elements: Callable[[Any, str], tuple[int, int]] | None = None

    @property
    def first_name(self) -> str:
        """The first unit's name."""
        return "+".join(self.first)

    @property
    def last_name(self) -> str:
        """The last unit's name."""
        return "+".join(self.last)

    def units(self, config: Any, seq_len: int | None = None) -> list[PipelineUnit]:
        """The model's units in order, with their parameter counts (built on meta).

        With ``seq_len``, each unit also carries its forward FLOPs for one sequence of
        that length (:func:`count_unit_flops`, on the meta device).
        """
        if seq_len is not None:
            with torch.device("meta"):
                return count_unit_flops(self, config.build(), seq_len)

        def built(configs: list[Any]) -> list[nn.Module]:
            with torch.device("meta"):
                return [c.build() for c in configs]

        return self._units(
            built([getattr(config, f) for f in self.first]),
            [built([b])[0] for b in getattr(config, self.layers)],
            built([getattr(config, f) for f in self.last]),
        )

    def units_of_model(self, model: nn.Module) -> list[PipelineUnit]:
        """The units of an already built model (any device, meta included), in order.

        Example:
            >>> from hyper_parallel.models.llama import PIPELINE, preset_config
            >>> [u.name for u in PIPELINE.units_of_model(preset_config("llama3-debug").build())]
            ['tok_embeddings', 'layers.0', 'layers.1', 'norm+output']
        """
        blocks = getattr(model, self.layers)
        return self._units(
            [getattr(model, f) for f in self.first],
            list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks),
            [getattr(model, f) for f in self.last],
        )

    def _units(
        self, first: list[nn.Module], blocks: list[nn.Module], last: list[nn.Module]
    ) -> list[PipelineUnit]:
        def count(modules: list[nn.Module]) -> int:
            return sum(p.numel() for m in modules for p in m.parameters())

        units = [PipelineUnit(self.first_name, self.first, count(first))]
        for i, block in enumerate(blocks):
            name = f"{self.layers}.{i}"
            units.append(PipelineUnit(name, (name,), count([block])))
        units.append(PipelineUnit(self.last_name, self.last, count(last)))
        return units

    def stage_config(self, config: Any, unit_names: Sequence[str]) -> Any:
        """The config of the stage holding ``unit_names``, sub-configs taken from ``config``.

        The sub-configs keep their sharding configs, so a stage of a tensor-parallel
        config is tensor parallel. The stage's own sharding hands its output on as a
        local tensor (what torch's pipeline stages send) and re-enters its input in
        the model's activation layout.
        """
        from hyper_parallel.dmodule.sharding import ShardingConfig

        names = set(unit_names)
        is_first, is_last = self.first_name in names, self.last_name in names
        fields: dict[str, Any] = {f: getattr(config, f) for f in self.shared}
        blocks = getattr(config, self.layers)
        prefix = f"{self.layers}."
        fields[self.layers] = {
            n[len(prefix) :]: blocks[int(n[len(prefix) :])]
            for n in unit_names
            if n.startswith(prefix)
        }
        for f in self.first:
            fields[f] = getattr(config, f) if is_first else None
        for f in self.last:
            fields[f] = getattr(config, f) if is_last else None
        layout = self.activation_layout(config)
        # Inputs other than the first the model's root adapts (context parallelism's
        # ``positions``) are adapted the same way by every stage's root.
        root = getattr(config, "sharding_config", None)
        taken = list(inspect.signature(self.stage.forward).parameters)[2:]
        extra_src = {
            k: v for k, v in ((root and root.in_src_shardings) or {}).items() if k in taken
        }
        extra_dst = {
            k: v for k, v in ((root and root.in_dst_shardings) or {}).items() if k in taken
        }
        if (layout and not (is_first and is_last)) or extra_src or extra_dst:
            boundary = not (is_first and is_last)
            fields["sharding_config"] = ShardingConfig(
                in_src_shardings={**({"x": layout} if layout and not is_first else {}), **extra_src}
                or None,
                in_dst_shardings=extra_dst or None,
                out_dst_shardings=layout if layout and boundary and not is_last else None,
                use_local_output=boundary and not is_last,
            )
        return self.stage.Config(**fields)


def count_unit_flops(layout: PipelineLayout, model: nn.Module, seq_len: int) -> list[PipelineUnit]:
    """The units of ``model`` with their forward FLOPs for one sequence of ``seq_len`` tokens.

    Counted by ``torch.utils.flop_counter.FlopCounterMode`` over one forward pass of
    token ids ``(1, seq_len)`` — on the meta device when ``model`` lives there, so
    nothing is computed — and summed over each unit's modules. Matmuls count
    ``2 m n k``, attention its two batched matmuls over the full (not causal) score
    matrix; lookups and elementwise ops count nothing, so the embedding weighs 0.
    Backward costs about twice the forward for each matmul, so the forward's
    proportions are the step's.

    Args:
        layout: The model's pipeline description.
        model: A model whose first unit takes token ids.
        seq_len: Tokens per sequence.

    Returns:
        :meth:`PipelineLayout.units_of_model` with ``num_flops`` set.
    """
    from torch.utils.flop_counter import FlopCounterMode

    device = next((p.device for p in model.parameters()), torch.device("meta"))
    tokens = torch.zeros((1, seq_len), dtype=torch.long, device=device)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(tokens)
    # Keys are the module paths under the root's class name ("Transformer.layers.0").
    root = type(model).__name__
    totals = {
        key[len(root) + 1 :]: sum(v.values())
        for key, v in counter.get_flop_counts().items()
        if key.startswith(root + ".")
    }
    return [
        dataclasses.replace(u, num_flops=sum(totals.get(m, 0) for m in u.modules))
        for u in layout.units_of_model(model)
    ]


# ---------------------------------------------------------------------------- split


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
    embedding costs none).
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
        return cls(
            units_per_stage=values.get("units_per_stage"),
            stages=None if stages is None else tuple(tuple(s) for s in stages),
            balance=values.get("balance", "params"),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "units_per_stage": self.units_per_stage,
            "stages": None if self.stages is None else [list(s) for s in self.stages],
            "balance": self.balance,
        }


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
    if split.units_per_stage is not None:
        size = split.units_per_stage
        if not isinstance(size, int) or size < 1:
            return None, [
                _error(
                    "split.units_per_stage",
                    f"is {size!r}; it must be an integer >= 1.",
                    "give the number of units (embedding, blocks, head) per stage.",
                )
            ]
        return [names[i : i + size] for i in range(0, len(names), size)], []
    if split.stages is not None:
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
    sizes = balanced_split(weights, num_stages)
    out, start = [], 0
    for size in sizes:
        out.append(names[start : start + size])
        start += size
    return out, []


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
    return _plan(units, **options)[1]


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
    plan, findings = _plan(
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


def _plan(
    units: Sequence[PipelineUnit],
    *,
    pp: int,
    schedule: str,
    num_microbatches: int,
    split: PipelineSplit | None = None,
    stages_per_rank: int | None = None,
    batch_size: int | None = None,
    model: nn.Module | None = None,
) -> tuple[PipelinePlan | None, list[Finding]]:
    findings = _schedule_findings(schedule)
    if findings:
        return None, findings
    multi = schedule in MULTI_STAGE_SCHEDULES
    if stages_per_rank is not None:
        if not multi and stages_per_rank != 1:
            findings.append(
                _error(
                    "stages_per_rank",
                    f"{schedule} runs one stage per rank, got stages_per_rank={stages_per_rank}.",
                    "use 1, or an interleaved schedule (Interleaved1F1B, InterleavedZeroBubble, "
                    "ZBVZeroBubble) for several stages per rank.",
                )
            )
        elif multi and stages_per_rank < 2:
            findings.append(
                _error(
                    "stages_per_rank",
                    f"{schedule} runs several stages per rank, got {stages_per_rank}.",
                    "use 2 or more, or GPipe / 1F1B for one stage per rank.",
                )
            )
    if schedule in _V_SHAPE and stages_per_rank not in (None, 2):
        findings.append(
            _error(
                "stages_per_rank",
                f"{schedule} places exactly 2 stages per rank (a V), got {stages_per_rank}.",
                "use stages_per_rank=2, or Interleaved1F1B for more.",
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
    per_rank = stages_per_rank or (_DEFAULT_STAGES_PER_RANK if multi else 1)
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
        findings += tied_parameter_findings(model, plan, units)
    if batch_size is not None and batch_size % num_microbatches:
        findings.append(
            _error(
                "num_microbatches",
                f"the batch of {batch_size} sequences per data-parallel rank does not split "
                f"into {num_microbatches} equal micro-batches.",
                f"use a micro-batch count that divides {batch_size}, or a batch size that is a "
                f"multiple of {num_microbatches}.",
            )
        )
    return plan, findings


def _microbatch_findings(plan: PipelinePlan) -> list[Finding]:
    """Ask torch's own schedule whether it runs this many micro-batches."""
    try:
        schedule_actions(plan.schedule, plan.pp, plan.num_microbatches, plan.stages_per_rank)
    except (ValueError, RuntimeError) as e:
        return [
            _error(
                "num_microbatches",
                f"{plan.schedule} with {plan.num_stages} stages on pp={plan.pp} refuses "
                f"{plan.num_microbatches} micro-batches: {e}",
                f"use at least {plan.num_stages} micro-batches (a multiple of pp={plan.pp}), "
                "or another schedule.",
            )
        ]
    return []


def schedule_actions(
    schedule: str, pp: int, num_microbatches: int, stages_per_rank: int = 1
) -> list[list[Any]]:
    """Torch's own action list of a schedule, per rank (``None`` marks an idle slot).

    Built by torch's ``get_schedule_ops`` on stand-in stages: no process group.

    Raises:
        ValueError: torch refuses the combination (e.g. 1F1B with fewer micro-batches
            than stages).
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    return get_schedule_ops(schedule, pp, num_microbatches, stages_per_rank)


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
                    "untie the weights (e.g. tie_word_embeddings=False), or place the units "
                    "that share them on the same stage.",
                    path=names[0].rsplit(".", 1)[0],
                )
            )
    return findings


# ---------------------------------------------------------------------------- build


def unit_seed(seed: int, unit: str) -> int:
    """The seed unit ``unit`` is initialized with: a stable mix of the run seed and its name."""
    return (seed * 1_000_003 + zlib.crc32(unit.encode())) % (2**63)


def init_states_by_unit(model: nn.Module, layout: PipelineLayout, seed: int) -> None:
    """Initialize a full model or a stage unit by unit, each under :func:`unit_seed`.

    The same unit gets the same values whichever stage holds it and whatever the
    tensor or data parallel sharding (``init_states`` is shard-consistent), so the
    stages of a pipeline equal a one-device model initialized this way.

    Args:
        model: A model or a stage built from ``layout`` (after ``to_empty``).
        layout: The model's pipeline description.
        seed: The run's seed.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    devices = [device] if device.type == "cuda" else []

    def seeded(name: str, modules: list[nn.Module]) -> None:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(unit_seed(seed, name))
            for m in modules:
                m.init_states()

    first = [getattr(model, f) for f in layout.first if hasattr(model, f)]
    if first:
        seeded(layout.first_name, first)
    blocks = getattr(model, layout.layers)
    items = blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks)
    for key, block in items:
        seeded(f"{layout.layers}.{key}", [block])
    last = [getattr(model, f) for f in layout.last if hasattr(model, f)]
    if last:
        seeded(layout.last_name, last)
    for f in layout.shared:
        seeded(f, [getattr(model, f)])


def build_stage_modules(
    config: Any,
    layout: PipelineLayout,
    plan: PipelinePlan,
    pp_rank: int,
    *,
    device: torch.device | str,
    seed: int,
    tp_mesh: Any = None,
    fsdp_mesh: Any = None,
    expert_mesh: Any = None,
    gradient_divide_factor: float | None = None,
    compile_backend: str | None = None,
    ac: str = "none",
    dtype: str = "fp32",
    family: Any = None,
) -> list[nn.Module]:
    """Build, shard, materialize and initialize the stages ``pp_rank`` runs.

    Each stage is built on the meta device from ``config`` (already carrying the
    model's sharding configs when ``tp_mesh`` is given), parallelized on
    ``tp_mesh``, its blocks compiled (``compile_backend``) and checkpointed (``ac``),
    wrapped block by block and then whole with FSDP2 over ``fsdp_mesh`` (with
    ``dtype``'s mixed-precision policy), moved to ``device`` and initialized per
    unit — the order the trainer applies at pp=1.

    Under the zero-bubble schedules (backward split into input- and weight-gradient
    steps) a stage is one FSDP2 unit: per-block units reduce-scatter their
    gradients when the input-gradient step passes them, before the weight-gradient
    step has accumulated, and the gradients come out wrong (measured: 2.7e-3 off
    one device on the 2-layer model with torch 2.13); the whole-stage unit is
    reduced once, after both (torch's ``REDUCE_GRAD`` action).

    Args:
        config: The model config, with its sharding.
        layout: The model's pipeline description.
        plan: The checked plan.
        pp_rank: This rank's coordinate on the pp axis.
        device: Where the stages live.
        seed: The run's seed (:func:`init_states_by_unit`).
        tp_mesh: The submesh the model's sharding is applied on, or ``None``.
        fsdp_mesh: The FSDP2 mesh, or ``None``.
        expert_mesh: With expert parallelism, the run's
            :class:`~hyper_parallel.distributed.ParallelMesh` (its ``ep`` and ``efsdp``
            views are this pp rank's): the routed experts are parallelized on
            ``mesh["ep"]`` and the rest on ``tp_mesh``
            (:func:`~hyper_parallel.distributed.expert_parallel.parallelize_with_experts`),
            and each experts module is its own FSDP2 unit over ``efsdp`` before the
            blocks are wrapped, as at pp=1.
        gradient_divide_factor: What FSDP2 divides the dense units' reduced
            gradients by instead of its mesh size (summed, then divided): the
            trainer's convention under ``cp`` (each rank's loss scaled by ``1 / cp``,
            gradients summed over cp and divided by the data-parallel ranks only), so
            gradients a model sends at a fixed size, like the MoE balance loss's,
            come out right. ``None``: FSDP2's mean over its mesh.
        compile_backend: ``torch.compile`` each block with this backend
            (``fullgraph=True``); ``None``: eager.
        ac: Activation checkpointing of the blocks: ``"none"``, ``"full"`` or
            ``"selective"`` (the model's blocks 1, 3, 5, ... by their index in the
            model, as at pp=1).
        dtype: ``"fp32"`` or ``"bf16"``: FSDP2's mixed-precision policy, or without
            FSDP the stage's forward under bf16 autocast (fp32 master weights).
        family: The model's :class:`~hyper_parallel.dmodule.ModelFamily`: its routed
            experts and their ``compile_experts`` hook, for ``compile_backend``.

    Returns:
        One module per local stage, in pipeline order.
    """
    from torch.distributed.fsdp import fully_shard

    from hyper_parallel.distributed.fsdp import _states_on_one_mesh, fsdp_mesh_dims

    precision.check_dtype(dtype)
    checkpointed = set(checkpointed_blocks(len(getattr(config, layout.layers)), ac))
    modules = []
    for s in plan.stages_of_rank(pp_rank):
        with torch.device("meta"):
            module = layout.stage_config(config, plan.stages[s]).build()
        if expert_mesh is not None:
            _parallelize_experts(module, expert_mesh, tp_mesh, fsdp_mesh)
        elif tp_mesh is not None:
            module.parallelize(tp_mesh)
        blocks = getattr(module, layout.layers)
        if compile_backend is not None and len(blocks):
            apply_compile(
                module,
                backend=compile_backend,
                blocks=layout.layers,
                experts=[m for _, m in family.expert_modules(module)] if family else (),
                compile_experts=family.compile_experts if family else None,
            )
            if plan.schedule in SPLIT_BACKWARD_SCHEDULES:
                _compile_without_donated_buffers()
        for key, block in blocks.items():
            if int(key) in checkpointed:
                block.forward = _Checkpointed(block.forward)
        if fsdp_mesh is not None:
            kwargs: dict[str, Any] = {"mp_policy": precision.fsdp_policy(dtype)}
            mesh = fsdp_mesh
            dims = fsdp_mesh_dims(fsdp_mesh)
            if dims is not None:  # the stage's own mesh under cp: FSDP2's SPMD form
                mesh = _states_on_one_mesh(module, fsdp_mesh)
                kwargs["dp_mesh_dims"] = dims
            units = [] if plan.schedule in SPLIT_BACKWARD_SCHEDULES else list(blocks.values())
            for unit in [*units, module]:
                fully_shard(unit, mesh=mesh, **kwargs)
                if gradient_divide_factor is not None:
                    unit.set_gradient_divide_factor(gradient_divide_factor)
                    # A custom factor is a PREMUL_SUM reduction, which gloo lacks.
                    unit.set_force_sum_reduction_for_comms(True)
        elif dtype != "fp32":
            module.forward = _Autocast(module.forward, torch.device(device).type)
        module.to_empty(device=device)
        init_states_by_unit(module, layout, seed)
        modules.append(module)
    return modules


def _parallelize_experts(module: nn.Module, mesh: Any, dense_mesh: Any, fsdp_mesh: Any) -> None:
    """A stage's routed experts on ``mesh["ep"]`` (FSDP2 over ``efsdp``), the rest on ``dense_mesh``.

    The trainer's pp=1 steps on the stage's part of the model: the ``ep`` and
    ``efsdp`` meshes are those of this pp rank (the layout borrows ep from dp_shard x
    cp x tp inside each pipeline's ranks).
    """
    from hyper_parallel.distributed.expert_parallel import parallelize_with_experts, shard_experts

    parallelize_with_experts(module, mesh, dense_mesh)
    if fsdp_mesh is not None or mesh.layout.efsdp > 1:
        shard_experts(module, mesh)


def _compile_without_donated_buffers() -> None:
    """Turn off AOTAutograd's donated buffers (process-wide) for split-backward schedules.

    The zero-bubble schedules run a block's backward in two steps (input, then
    weight gradients) over one retained graph; a compiled backward with donated
    buffers allows one backward only and refuses the second (``donated_buffer``
    needs ``retain_graph=False``). Torch reads the flag when it compiles the
    backward, lazily, inside the schedule's step, so it is set for the process;
    donated buffers only save memory.
    """
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False


class _Autocast:
    """A stage's ``forward`` under bf16 autocast (the stage is not FSDP-sharded)."""

    def __init__(self, forward: Callable[..., Any], device_type: str) -> None:
        self.forward, self.device_type = forward, device_type

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.forward(*args, **kwargs)


def build_schedule(
    modules: Sequence[nn.Module],
    plan: PipelinePlan,
    pp_mesh: Any,
    device: torch.device | str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Any:
    """Wrap this rank's stage modules in ``PipelineStage``s and torch's schedule.

    ``loss_fn`` is the per-micro-batch mean; torch divides the summed gradients by
    the number of micro-batches (``scale_grads=True``), so with equal micro-batches
    the gradient is that of the global-batch mean.
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    group = pp_mesh.get_group()
    pp_rank = pp_mesh.get_local_rank()
    for module in modules:
        module.register_forward_hook(_own_storage)
    stages = [
        PipelineStage(m, s, plan.num_stages, torch.device(device), group=group)
        for m, s in zip(modules, plan.stages_of_rank(pp_rank), strict=True)
    ]
    cls = get_schedule_class(plan.schedule)
    target = stages if plan.schedule in MULTI_STAGE_SCHEDULES else stages[0]
    return cls(target, plan.num_microbatches, loss_fn=_FloatLoss(loss_fn), scale_grads=True)


class _FloatLoss:
    """The loss from float32 logits (bf16 stages hand on bf16 logits), as at pp=1."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_fn = loss_fn

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(precision.loss_logits(logits), target)


def _own_storage(module: nn.Module, args: Any, output: Any) -> Any:
    """A stage output that is a view (a local shard handed on by a tensor-parallel
    boundary) is copied: the zero-bubble schedules detach stage outputs in place,
    which autograd refuses for views."""
    if isinstance(output, torch.Tensor) and output._is_view():
        return output.clone()
    return output


def pipeline_step(
    schedule: Any,
    plan: PipelinePlan,
    pp_mesh: Any,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """One forward + backward of the whole batch; returns the batch's mean loss on every pp rank.

    The first stage's rank feeds ``inputs``, the last stage's rank ``targets``; the
    loss (mean over micro-batches of each micro-batch's mean, i.e. the batch mean)
    is broadcast from the last stage's rank over the pp group.
    """
    from hyper_parallel.core.dtensor.dtensor import DTensor

    pp_rank = pp_mesh.get_local_rank()
    local = plan.stages_of_rank(pp_rank)
    last = plan.num_stages - 1
    args = (inputs,) if 0 in local else ()
    losses: list[torch.Tensor] = []
    kwargs = {"target": targets, "losses": losses} if last in local else {}
    schedule.step(*args, return_outputs=False, **kwargs)
    loss = torch.zeros((), dtype=torch.float32, device=inputs.device)
    if losses:
        values = [
            (v.full_tensor() if isinstance(v, DTensor) else v).detach().float() for v in losses
        ]
        loss = torch.stack(values).mean()
    src = dist.get_global_rank(pp_mesh.get_group(), plan.ranks[last])
    dist.broadcast(loss, src=src, group=pp_mesh.get_group())
    return loss
