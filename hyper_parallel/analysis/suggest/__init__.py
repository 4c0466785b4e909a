"""The best layouts for a model on a cluster, found on a CPU: ``hyper-parallel suggest``.

:func:`suggest` searches the N-D mesh (pp, dp_replicate, dp_shard, cp, tp, ep), the
pipeline schedule and its micro-batches, activation checkpointing and sequence
parallelism; drops what the plan checks refuse (counted per reason, :func:`_findings`),
then what does not fit in memory; ranks the rest by the estimated step time of
:mod:`~hyper_parallel.analysis.cost_model`; and returns the best with the command that
runs each.

**Memory** is the dry run's (:func:`~hyper_parallel.analysis.dry_run`), per rank:
parameters, gradients and AdamW moments (fp32 master weights) sharded as FSDP2
shards them; the activations of one micro-batch at its backward's peak (a
recompute's working set included), plus what its forward keeps (the end-of-forward
bytes) for each other micro-batch a pipeline stage holds at once (from the schedule's
own action list);
and FSDP2's transient buffers (two units gathered in the compute dtype: the one
running and the one prefetched; one unit's unsharded fp32 gradients before its
reduce-scatter; under a pipeline, every unit of the stage gathered with its
unsharded fp32 gradients, which are reduced once at the step's end). A layout fits
when that is at most
:func:`~hyper_parallel.analysis.cost_model.usable_memory` (device memory less the
stated allocator and communication-library headroom).

**Speed: trace once per local structure.** What a rank holds and sends depends on
the model axes (tp, cp, ep), sequence parallelism and whether FSDP2 runs; not on how
many data-parallel ranks there are. So one dry run per ``(tp, cp, sp, ep, fsdp)``
(at the smallest mesh with those local shapes, one sequence per micro-batch) serves
every candidate with those: activations of every checkpointing mode and every
pipeline stage (blocks are identical: a stage's saved bytes are its blocks' plus the
embedding's or the output's; :class:`_Trace`), the model axes' collectives (scaled by
the micro-batch), and the states (divided by the FSDP size). FSDP2's own collectives
follow from the states (all-gather of each unit in the compute dtype, reduce-scatter
in fp32, HSDP all-reduce of the shard), as the dry run traces them. Candidates whose
states alone cannot fit are dropped before any trace. FLOPs are counted once per
model on the meta device.


The package, by role (its modules are private; this one is the API): ``_source`` (the
model: a spec and overrides, or a Hugging Face config), ``_search`` (candidates, the
ranking, the command), ``_checks`` (the run plan's findings as the filter), ``_trace``
(one dry run per local structure), ``_operators`` (FLOPs and operator counts on the
meta device), ``_cost`` (one candidate's memory and step time) and ``_report`` (what a
search returns, and its chart).

Example::

    from hyper_parallel.analysis.suggest import suggest
    report = suggest("llama3-8b", gpus=64, gpu="h100-80gb", seq_len=8192,
                     global_batch_tokens=4 * 1024**2)
    print(report.to_table())
"""

from hyper_parallel.analysis.suggest._cost import STATED_FACTORS as STATED_FACTORS
from hyper_parallel.analysis.suggest._cost import RunFactors as RunFactors
from hyper_parallel.analysis.suggest._operators import count_flops as count_flops
from hyper_parallel.analysis.suggest._operators import count_operators as count_operators
from hyper_parallel.analysis.suggest._report import Candidate as Candidate
from hyper_parallel.analysis.suggest._report import DoesNotFit as DoesNotFit
from hyper_parallel.analysis.suggest._report import Prediction as Prediction
from hyper_parallel.analysis.suggest._report import SuggestReport as SuggestReport
from hyper_parallel.analysis.suggest._report import suggest_chart as suggest_chart
from hyper_parallel.analysis.suggest._search import AC_MODES as AC_MODES
from hyper_parallel.analysis.suggest._search import LayoutScorer as LayoutScorer
from hyper_parallel.analysis.suggest._search import predict as predict
from hyper_parallel.analysis.suggest._search import suggest as suggest
from hyper_parallel.analysis.suggest._source import ModelSource as ModelSource
from hyper_parallel.analysis.suggest._source import model_from_hf_config as model_from_hf_config

__all__ = [
    "AC_MODES",
    "STATED_FACTORS",
    "Candidate",
    "DoesNotFit",
    "LayoutScorer",
    "ModelSource",
    "Prediction",
    "RunFactors",
    "SuggestReport",
    "count_flops",
    "count_operators",
    "model_from_hf_config",
    "predict",
    "suggest",
    "suggest_chart",
]
