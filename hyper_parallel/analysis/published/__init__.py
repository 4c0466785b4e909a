"""Published large-scale training runs (``runs.yaml``): the planner's GPU test set.

Each run gives a model this package builds, its layout, the GPUs it ran on (a shipped
hardware kind) and a published measurement with its source. ``split`` (``fit`` or
``heldout``) was assigned by the file's stated rule before any fitting;
:func:`split_by_rule` recomputes it so a test can hold the file to it.

Example::

    from hyper_parallel.analysis.published import load_runs
    runs = load_runs()
    [r["id"] for r in runs if r["split"] == "heldout"]
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

from hyper_parallel.distributed.precision import PARAM_DTYPES

__all__ = [
    "ATTENTION_RATES",
    "MEMORY_METRICS",
    "REQUIRED",
    "RUNTIMES",
    "load_runs",
    "split_by_rule",
]

RUNTIMES = ("pytorch", "megatron-te")
"""The training stacks a run may state (``runtime``, default ``pytorch``: eager PyTorch
with torch's own kernels, as this package's trainer and torchtitan run;
``megatron-te``: Megatron-Core with Transformer Engine's fused kernels)."""

ATTENTION_RATES = ("fitted", "measured")
"""Where a run's attention rate comes from (its ``attention``, default its source's, else
``fitted``): ``fitted``, the published runs' fitted factor (``STATED_FACTORS["attention"]``:
torch's SDPA as torchtitan and AutoModel ran it, context-parallel ring included);
``measured``, the hardware file's measured fused-attention kernel (cuDNN) at every
context-parallel degree: a run whose kernel is that one (Transformer Engine's fused
attention) or whose attention is one kernel call per query chunk (all-gather context
parallelism)."""

MEMORY_METRICS = ("reserved", "allocated")
"""What a source's memory figure measures (its ``memory``): the caching allocator's peak
``reserved`` bytes (what torchtitan logs), or the peak ``allocated`` to live tensors
(what the planner counts)."""

REQUIRED = (
    "id",
    "source_key",
    "where",
    "model",
    "gpus",
    "hardware",
    "mesh",
    "seq",
    "global_batch",
    "ac",
    "precision",
    "compile",
    "float8",
    "async_tp",
    "measured",
    "split",
)
"""Fields every run states (``ac`` may be null: not stated by the source)."""


def _raw() -> dict[str, Any]:
    text = resources.files(__name__).joinpath("runs.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def load_runs() -> list[dict[str, Any]]:
    """The runs, each with its source's ``url`` added (``source_url``).

    Raises:
        ValueError: A run lacks a field, names an unknown source, or its ``split`` is not
            the one the file's rule gives (the offending ids listed).
    """
    raw = _raw()
    sources = raw["sources"]
    runs = []
    for run in raw["runs"]:
        missing = [k for k in REQUIRED if k not in run]
        if missing:
            raise ValueError(f"published run {run.get('id')!r}: missing field(s) {missing}.")
        if run["source_key"] not in sources:
            raise ValueError(
                f"published run {run['id']!r}: unknown source_key {run['source_key']!r}."
            )
        runtime = run.get("runtime", "pytorch")
        if runtime not in RUNTIMES:
            raise ValueError(
                f"published run {run['id']!r}: runtime {runtime!r}; use one of "
                f"{', '.join(RUNTIMES)}."
            )
        if not isinstance(run.get("compile_loss", False), bool):
            raise ValueError(
                f"published run {run['id']!r}: compile_loss {run['compile_loss']!r}; use "
                "true or false."
            )
        attention = run.get("attention", sources[run["source_key"]].get("attention", "fitted"))
        if attention not in ATTENTION_RATES:
            raise ValueError(
                f"published run {run['id']!r}: attention {attention!r}; use one of "
                f"{', '.join(ATTENTION_RATES)}."
            )
        if run["precision"] not in PARAM_DTYPES:
            raise ValueError(
                f"published run {run['id']!r}: precision {run['precision']!r}; use one of "
                f"{', '.join(PARAM_DTYPES)} (the trainer's --dtype)."
            )
        metric = sources[run["source_key"]].get("memory")
        if "memory_gib" in run["measured"] and metric not in MEMORY_METRICS:
            raise ValueError(
                f"published run {run['id']!r}: memory_gib given, but its source "
                f"{run['source_key']!r} says memory: {metric!r}; say which of "
                f"{', '.join(MEMORY_METRICS)} the figure measures."
            )
        runs.append(
            {
                **run,
                "runtime": runtime,
                "attention": attention,
                "memory_metric": metric,
                "source_url": sources[run["source_key"]]["url"],
            }
        )
    expected = split_by_rule(runs)
    wrong = [r["id"] for r in runs if r["split"] != expected[r["id"]]]
    if wrong:
        raise ValueError(f"published runs {wrong}: split differs from the file's split_rule.")
    return runs


def split_by_rule(runs: list[dict[str, Any]]) -> dict[str, str]:
    """``{id: "fit" | "heldout"}`` by the file's rule: per ``source_key``, rows sorted by
    ``id``; odd positions (1st, 3rd, ...) held out, even positions (2nd, 4th, ...) fit:
    at most half of the rows fit."""
    out: dict[str, str] = {}
    by_source: dict[str, list[str]] = {}
    for r in runs:
        by_source.setdefault(r["source_key"], []).append(r["id"])
    for ids in by_source.values():
        for i, run_id in enumerate(sorted(ids)):
            out[run_id] = "heldout" if i % 2 == 0 else "fit"
    return out
