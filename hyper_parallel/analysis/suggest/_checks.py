"""The filter of a search: each candidate's run plan, as the trainer asks for it."""

from __future__ import annotations

from typing import Any

from hyper_parallel.analysis.suggest._report import Candidate
from hyper_parallel.analysis.suggest._source import ModelSource
from hyper_parallel.dmodule.findings import Finding


class _Checks:
    """The run plan of every candidate; its errors are the filter.

    Each candidate is asked as the trainer asks it
    (:func:`hyper_parallel.train.trainer.run_plan`): :meth:`RunPlan.for_model
    <hyper_parallel.distributed.run_plan.RunPlan.for_model>` with the candidate's mesh,
    sequence parallelism, checkpointing, dtype, schedule, micro-batches, the batch per
    data-parallel rank (and the global batch), the sequence, compile and the stage split. One :class:`~hyper_parallel.distributed.run_plan.PlanCache`
    serves the search, so the sharded model is built on the meta device once per local
    structure and the pipeline plan once per schedule, micro-batches and batch.
    """

    def __init__(
        self,
        source: ModelSource,
        seq_len: int,
        global_batch: int,
        dtype: str,
        *,
        compile: bool = False,
        pipeline_split: Any = None,
    ) -> None:
        from hyper_parallel.distributed.run_plan import PlanCache

        self.source = source
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dtype = dtype
        self.compile = compile
        self.pipeline_split = pipeline_split
        self.config = source.config()
        self.stages = source.spec.family.pipeline
        self.cache = PlanCache()
        self._units: Any = None

    @property
    def units(self) -> Any:
        if self._units is None and self.stages is not None:
            self._units = self.stages.units(self.config)
        return self._units

    def run(self, c: Candidate) -> Any:
        """The candidate's :class:`~hyper_parallel.distributed.run_plan.RunPlan`."""
        from hyper_parallel.distributed.run_plan import RunPlan

        return RunPlan.for_model(
            self.source.spec_name,
            c.layout,
            model_overrides=dict(self.source.overrides),
            world_size=c.layout.world_size,
            cache=self.cache,
            sequence_parallel=c.sp,
            ac=c.ac,
            dtype=self.dtype,
            schedule=c.schedule or "1F1B",
            num_microbatches=c.microbatches,
            stages_per_rank=c.stages_per_rank,
            batch_size=self.global_batch // c.dp,
            global_batch_size=self.global_batch,
            seq_len=self.seq_len,
            compile=self.compile,
            pipeline_split=self.pipeline_split,
        )

    def findings(self, c: Candidate) -> list[tuple[str, Finding]]:
        """``(check, finding)`` for every error of the candidate's run plan; the check
        is the finding's kind (mesh, model, pipeline, ...)."""
        return [(f.path or f.field or "plan", f) for f in self.run(c).errors]
