"""One dry run per local structure, reduced to what every candidate with it needs."""

from __future__ import annotations

import dataclasses
import math

from hyper_parallel.analysis.suggest._source import ModelSource
from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.distributed.precision import PARAM_DTYPES
from hyper_parallel.dmodule import keep_gathered


@dataclasses.dataclass(frozen=True)
class _Comm:
    """Collectives of one kind on one axis in one phase: count and buffer bytes."""

    kind: str
    axis: str
    phase: str
    count: float
    bytes: float


@dataclasses.dataclass
class _Trace:
    """One dry run, reduced to what every candidate with its local structure needs.

    Per sequence (one micro-batch of one sequence): ``pre`` / ``post`` are the bytes
    saved before the first block and after the last; ``block`` what one block saves
    without checkpointing, ``block_input`` what a checkpointed block keeps (its input),
    ``block_recompute`` what it holds while backward recomputes it: the dry run's
    ``activations_per_block``; ``shared`` per checkpointing mode, what a run of blocks
    holds beyond that (tensors every block reads, such as the rotary tables' slices and
    the mask, held once per stage by its first block): the dry run's peak of the whole
    model less the same composition of its blocks; ``held_shared`` the same for the
    bytes held at the end of the forward. ``block_op_kept`` / ``block_op_recompute``:
    ``block_input`` / ``block_recompute`` under ``op`` checkpointing (the input and the
    operator outputs a block keeps: the dry run's ``activations_per_block_op``).
    ``per_layer_op_recompute``: the forward collectives of one block that ``op``
    checkpointing repeats in backward (all but the reduce-scatters, whose outputs it
    keeps).
    """

    pre: int
    post: int
    block: int
    block_input: int
    block_recompute: int
    shared: dict[str, int]
    held_shared: dict[str, int]
    per_layer: list[_Comm]
    rest: list[_Comm]
    dense_local: float
    expert_local: float
    dense_total: int
    expert_total: int
    block_op_kept: int = 0
    block_op_recompute: int = 0
    per_layer_op_recompute: list[_Comm] = dataclasses.field(default_factory=list)

    def _kept(self, ac: str) -> tuple[int, int]:
        """What a checkpointed block keeps and holds recomputed under ``ac``."""
        if ac == "op":
            return self.block_op_kept, self.block_op_recompute
        return self.block_input, self.block_recompute

    def activations(self, blocks: int, first: bool, last: bool, ac: str) -> int:
        """Peak saved bytes of one sequence on a rank holding ``blocks`` blocks (+ the
        embedding when ``first``, the head and loss when ``last``), as the dry run
        composes them (:func:`~hyper_parallel.analysis.dry_run.checkpointed_peak`)."""
        from hyper_parallel.analysis.dry_run import checkpointed_peak

        ends = first * self.pre + last * self.post
        none = ends + blocks * self.block
        tail = last * self.post
        kept, recompute = self._kept(ac)
        peak = checkpointed_peak(none, blocks, self.block, kept, recompute, tail, ac)
        return peak + (self.shared[ac] if blocks else 0)

    def held(self, blocks: int, first: bool, last: bool, ac: str) -> int:
        """Saved bytes of one sequence at the end of its forward on such a rank: what
        a micro-batch keeps while it waits for its backward (the peak less a
        recompute's working set; equal to it without checkpointing)."""
        from hyper_parallel.analysis.dry_run import checkpointed_held

        none = first * self.pre + last * self.post + blocks * self.block
        held = checkpointed_held(none, blocks, self.block, self._kept(ac)[0], ac)
        return held + (self.held_shared[ac] if blocks else 0)


def _trace_layout(tp: int, cp: int, ep: int, fsdp: bool) -> MeshLayout:
    """The smallest mesh with these local shapes (FSDP on when the candidate has it)."""
    dp_shard = 2 if fsdp and cp == 1 else 1
    need = ep // math.gcd(ep, dp_shard * cp * tp)
    if need > 1:
        dp_shard *= need
    return MeshLayout(dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)


class _Tracer:
    """Dry runs per local structure, cached; counts how many ran."""

    def __init__(
        self, source: ModelSource, seq_len: int, dtype: str, compile: bool = False
    ) -> None:
        self.source = source
        self.seq_len = seq_len
        self.dtype = dtype
        self.compile = compile  # compiled blocks keep their gathered inputs (dmodule/_regather)
        self.cache: dict[tuple[int, int, bool, int, bool], _Trace] = {}
        self.num_layers = source.spec.family.num_layers(source.config())

    @property
    def count(self) -> int:
        return len(self.cache)

    def get(self, tp: int, cp: int, sp: bool, ep: int, fsdp: bool) -> _Trace:
        key = (tp, cp, sp, ep, fsdp)
        if key not in self.cache:
            self.cache[key] = self._run(*key)
        return self.cache[key]

    def _run(self, tp: int, cp: int, sp: bool, ep: int, fsdp: bool) -> _Trace:
        from hyper_parallel.analysis.dry_run import checkpointed_held, checkpointed_peak, dry_run
        from hyper_parallel.distributed.axes import apply_model_axes

        layout = _trace_layout(tp, cp, ep, fsdp)
        spec = self.source.spec
        config = apply_model_axes(spec, self.source.config(), layout, sequence_parallel=sp)
        with keep_gathered(self.compile):
            report = dry_run(
                config,
                layout,
                batch_size=1,
                seq_len=self.seq_len,
                param_dtype=PARAM_DTYPES[self.dtype],
                loss_fn=spec.family.loss_fn,
                dtype=self.dtype,
            )
        num_layers = report.num_layers or self.num_layers
        pre, post = report.activations_outside_blocks
        assert report.activations_per_block is not None  # traced at two depths
        block, block_input, block_recompute = report.activations_per_block
        assert report.activations_per_block_op is not None
        op_kept, op_recompute = report.activations_per_block_op

        def kept(ac: str) -> tuple[int, int]:
            return (op_kept, op_recompute) if ac == "op" else (block_input, block_recompute)

        model_axes = {"tp", "cp", "ep"}
        total = [
            _Comm(c.kind, c.axis, c.phase, c.count, c.bytes)
            for c in report.collectives
            if c.axis in model_axes
        ]
        per_layer = [
            _Comm(c.kind, c.axis, c.phase, c.count, c.bytes)
            for c in (report.collectives_per_layer or [])
            if c.axis in model_axes
        ]
        layer_sum: dict[tuple[str, str, str], tuple[float, float]] = {}
        for c in per_layer:
            layer_sum[(c.kind, c.axis, c.phase)] = (c.count, c.bytes)
        rest = []
        for c in total:
            n, b = layer_sum.get((c.kind, c.axis, c.phase), (0, 0))
            count, nbytes = c.count - num_layers * n, c.bytes - num_layers * b
            if count > 0:
                rest.append(_Comm(c.kind, c.axis, c.phase, count, max(nbytes, 0)))
        element = PARAM_DTYPES[self.dtype].itemsize  # the parameters' bytes in the trace
        experts = report.per_rank_experts
        expert_params = experts.params if experts is not None else 0
        efsdp = layout.efsdp if fsdp else 1
        fsdp_size = layout.fsdp if report.fsdp else 1
        expert_total = report.num_expert_params
        return _Trace(
            pre=pre,
            post=post,
            block=round(block),
            block_input=round(block_input),
            block_recompute=block_recompute,
            shared={
                ac: max(
                    0,
                    peak
                    - checkpointed_peak(
                        pre + post + num_layers * block, num_layers, block, *kept(ac), post, ac
                    ),
                )
                for ac, peak in report.activations_by_ac.items()
            },
            held_shared={
                ac: max(
                    0,
                    held
                    - checkpointed_held(
                        pre + post + num_layers * block, num_layers, block, kept(ac)[0], ac
                    ),
                )
                for ac, held in report.activations_held_by_ac.items()
            },
            per_layer=per_layer,
            rest=rest,
            block_op_kept=round(op_kept),
            block_op_recompute=op_recompute,
            per_layer_op_recompute=[
                c for c in per_layer if c.phase == "forward" and c.kind != "reduce_scatter"
            ],
            dense_local=(report.per_rank.params - expert_params) / element * fsdp_size,
            expert_local=expert_params / element * efsdp,
            dense_total=report.num_params - expert_total,
            expert_total=expert_total,
        )
