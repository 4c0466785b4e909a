"""Pictures of a plan and of a search (matplotlib, written to PNG files).

- :func:`plan_chart`: per-rank memory of a dry run (parameters, gradients, optimizer
  state, activations; one bar per pipeline stage with ``pp``) and, with ``pp``, the
  schedule's timeline per rank (forward, backward, input- and weight-gradient steps of
  each micro-batch, from the schedule's own action list: the bubble is the white).
- :func:`suggest_chart`: every evaluated candidate of ``suggest`` as predicted step time
  against memory per GPU, the memory limit drawn, the top K marked.

Example::

    hyper-parallel plan --model llama3-8b --mesh pp=4,dp=2 --chart plan.png
    hyper-parallel suggest --model llama3-8b --gpus 64 --gpu h100-80gb --seq 8192 \\
        --global-batch-tokens 4194304 --chart suggest.png
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["chart_path", "plan_chart", "suggest_chart"]

_MEMORY_PARTS = (
    ("params", "parameters", "#4c72b0"),
    ("grads", "gradients", "#55a868"),
    ("optimizer", "optimizer state", "#c44e52"),
    ("activations", "activations", "#8172b2"),
    ("transient", "FSDP transient", "#ccb974"),
)
_OP_COLORS = {"F": "#4c72b0", "B": "#c44e52", "I": "#dd8452", "W": "#55a868"}
_OP_NAMES = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
_GIB = 1024**3


def chart_path(text: str) -> str:
    """``argparse`` type of ``--chart``: a path matplotlib can write, checked before any
    work (a missing matplotlib or an unknown extension was a traceback after the dry
    run). The suffix names the format: the file written is the path given (without
    one matplotlib wrote ``NAME.png`` while ``NAME`` was reported). The commands check
    it as an output before the work (``check_output_file``: kept unless ``--overwrite``,
    never an input; its folder made).

    Raises:
        argparse.ArgumentTypeError: matplotlib is not installed, the path is a folder
            or has no suffix, or the suffix is not a format matplotlib writes.
    """
    import argparse
    import os

    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise argparse.ArgumentTypeError(
            "charts need matplotlib: pip install matplotlib (or the 'demo' extra)"
        ) from None
    formats = ", ".join(sorted(FigureCanvasBase.get_supported_filetypes()))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a folder; give a file path in it, e.g. "
            f"{os.path.join(text, 'chart.png')!r}"
        )
    suffix = Path(text).suffix.lower().removeprefix(".")
    if not suffix:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no suffix; the suffix names the format: use {text}.png (or "
            f"one of {formats})"
        )
    if suffix not in FigureCanvasBase.get_supported_filetypes():
        raise argparse.ArgumentTypeError(
            f"{text!r}: matplotlib does not write .{suffix} files; use .png (or one of {formats})"
        )
    return text


def _save(fig: Any, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plan_chart(plan: Mapping[str, Any], path: str | Path) -> None:
    """Draw ``hyper-parallel plan``'s JSON result (``plan --format json``) to ``path``.

    Args:
        plan: The plan's dict: ``per_rank_bytes``; with a pipeline also ``stages``
            (per stage ``params``, ``grads``, ``optimizer``, ``activations``) and
            ``pipeline`` (``schedule``, ``pp``, ``num_microbatches``, ``ranks``).
        path: The PNG file to write.
    """
    plt = _pyplot()
    stages = plan.get("stages")
    pipeline = plan.get("pipeline")
    rows = 2 if pipeline else 1
    fig, axes = plt.subplots(rows, 1, figsize=(11, 4.2 * rows), squeeze=False)
    ax = axes[0][0]
    if stages:
        labels = [f"stage {s['stage']}\n(pp rank {s['rank']})" for s in stages]
        parts = [{k: s.get(k, 0) for k, _, _ in _MEMORY_PARTS} for s in stages]
        title = "Memory per rank, per pipeline stage"
    else:
        labels = ["every rank"]
        parts = [dict(plan["per_rank_bytes"])]
        title = "Memory per rank"
    largest = max(sum(p.get(k, 0) for k, _, _ in _MEMORY_PARTS) for p in parts)
    scale, unit = (_GIB, "GiB") if largest >= _GIB else (2**20, "MiB")
    bottoms = [0.0] * len(parts)
    for key, name, color in _MEMORY_PARTS:
        values = [p.get(key, 0) / scale for p in parts]
        if not any(values):
            continue
        ax.bar(labels, values, bottom=bottoms, color=color, label=name, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for i, total in enumerate(bottoms):
        ax.annotate(f"{total:.2f} {unit}", (i, total), ha="center", va="bottom", fontsize=9)
    mesh = plan.get("mesh", {})
    mesh_text = ", ".join(
        f"{k}={v}"
        for k, v in mesh.items()
        if k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep") and v > 1
    )
    ax.set_title(f"{plan.get('model', '')} on {mesh_text or 'one device'}: {title}")
    ax.set_ylabel(unit)
    ax.legend(loc="upper left", fontsize=8, ncol=len(_MEMORY_PARTS))
    ax.set_ylim(0, max(bottoms) * 1.25 if max(bottoms) else 1)
    if pipeline:
        _timeline(axes[1][0], pipeline, plan.get("bubble_fraction"))
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _timeline(ax: Any, pipeline: Mapping[str, Any], bubble: float | None) -> None:
    """Each pp rank's ops against time (F = 1, B = 2, I = W = 1), micro-batch numbers."""
    from hyper_parallel.analysis.pipeline_cost import rank_ops, simulate

    pp, m = pipeline["pp"], pipeline["num_microbatches"]
    per_rank = len(pipeline["stages"]) // pp if "stages" in pipeline else None
    ops = rank_ops(pipeline["schedule"], pp, m, per_rank)
    timeline = simulate(ops)
    seen: set[str] = set()
    for r, rank in enumerate(ops):
        for op in rank:
            start = timeline.start[op]
            width = timeline.finish[op] - start
            label = _OP_NAMES[op.kind] if op.kind not in seen else None
            seen.add(op.kind)
            ax.barh(
                r,
                width,
                left=start,
                color=_OP_COLORS[op.kind],
                edgecolor="white",
                height=0.8,
                label=label,
            )
            if width >= 0.6:
                text = (
                    str(op.microbatch) if per_rank in (None, 1) else f"{op.microbatch}s{op.stage}"
                )
                ax.text(
                    start + width / 2, r, text, ha="center", va="center", fontsize=7, color="white"
                )
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"pp rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1)")
    frac = f", bubble {bubble:.1%}" if bubble is not None else ""
    labels = "micro-batch" if per_rank in (None, 1) else "micro-batch s stage"
    ax.set_title(
        f"{pipeline['schedule']}: {m} micro-batches on pp={pp}{frac} (white = idle; "
        f"labels: {labels})"
    )
    ax.legend(loc="lower right", fontsize=8, ncol=4)


def suggest_chart(report: Any, path: str | Path) -> None:
    """Draw a :class:`~hyper_parallel.analysis.suggest.SuggestReport` to ``path``.

    Every evaluated candidate is a dot (predicted step time vs memory per GPU; grey
    when it does not fit), the memory limit a vertical line, the top K numbered.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 6))
    fits = [(m / _GIB, t) for t, m, ok in report.points if ok]
    over = [(m / _GIB, t) for t, m, ok in report.points if not ok]
    if over:
        ax.scatter(*zip(*over), s=6, color="#bbbbbb", label="does not fit", alpha=0.6)
    if fits:
        ax.scatter(*zip(*fits), s=8, color="#4c72b0", label="fits", alpha=0.6)
    limit = report.memory_limit / _GIB
    ax.axvline(limit, color="#c44e52", linestyle="--", label=f"memory limit {limit:.1f} GiB")
    lines = []
    for i, (c, p, _) in enumerate(report.plans, 1):
        x, y = p.memory_bytes_per_gpu / _GIB, p.step_s
        ax.scatter(
            [x],
            [y],
            s=70,
            facecolors="none",
            edgecolors="#dd8452",
            linewidths=1.5,
            label="top plans" if i == 1 else None,
            zorder=3,
        )
        ax.annotate(
            str(i),
            (x, y),
            textcoords="offset points",
            xytext=(4, 4 + 6 * (i % 2)),
            fontsize=8,
            color="#dd8452",
            zorder=4,
        )
        lines.append(f"{i}. {c.describe()}: {p.step_s:.3g} s, {x:.1f} GiB")
    if lines:
        ax.text(
            0.01,
            0.99,
            "\n".join(lines),
            transform=ax.transAxes,
            va="top",
            ha="left",
            fontsize=7,
            family="monospace",
            bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "#cccccc"},
        )
    if report.points:
        times = [t for t, _, _ in report.points]
        if max(times) / max(min(times), 1e-12) > 20:
            ax.set_yscale("log")
        # Memory: the region that fits is what matters. Clip the axis at 4x the limit
        # (what lies beyond is counted in the label) and go logarithmic when the
        # candidates that fit span more than a decade.
        memory = [m / _GIB for _, m, _ in report.points]
        right = min(max(memory), 4 * limit) * 1.05
        beyond = sum(m > right for m in memory)
        low = min(memory)
        if limit / max(low, 1e-9) > 10:
            ax.set_xscale("log")
            ax.set_xlim(max(low * 0.8, 1e-3), right)
        else:
            ax.set_xlim(0, right)
        if beyond:
            ax.text(
                0.99,
                0.01,
                f"{beyond:,} candidates beyond {right:,.0f} GiB not drawn",
                transform=ax.transAxes,
                ha="right",
                va="bottom",
                fontsize=7,
                color="#777777",
            )
    ax.set_xlabel("memory per GPU (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(
        f"{report.model} on {report.gpus:,} x {report.hardware.name}: "
        f"{len(report.points):,} candidates evaluated of {report.searched:,} searched"
    )
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
