"""One comparison for every test that holds a result against a reference.

A rank (or a unit test) turns tensors into :class:`Diff` records with
:func:`diff` / :func:`diffs` — small, picklable, so a distributed check can return
them to the test process — and the test judges them with :func:`check`, which

- fails on a NaN or an Inf in the result or in the reference (a ``d > tol`` filter
  or Python's ``max()`` lets a NaN through: every comparison with NaN is false);
- fails when a parameter is missing on either side, or its shape differs;
- with an absolute tolerance, refuses a reference whose largest entry is below
  ``MIN_REF_OVER_ATOL`` times it (a 2x or a zero result would pass such a bound);
- with a relative bound, fails when ``||actual - expected|| / ||expected||`` exceeds
  it: a gradient 2x too large or zero has relative error 1, a sign flip 2;
- names the worst entry (by relative error, then absolute) and every failing one.

Bounds: fp32 against fp32 keeps the suite's 1e-5 absolute tolerance and adds a
relative bound of ``FP32_RTOL``; bf16 against the fp32 reference uses the relative
bound ``BF16_GRAD_RTOL`` alone (bf16 first-step gradients of the debug Llama measured
at most 0.7% from fp32 on one process).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "BF16_GRAD_RTOL",
    "FP32_RTOL",
    "MIN_REF_OVER_ATOL",
    "Diff",
    "assert_close",
    "check",
    "diff",
    "diffs",
    "merge_ranks",
    "worst_abs",
]

# Relative bounds: far below 1 (a 2x or zero gradient), far above rounding.
FP32_RTOL = 1e-3
BF16_GRAD_RTOL = 0.1
# With an absolute tolerance, the reference must reach this multiple of it somewhere.
MIN_REF_OVER_ATOL = 10.0
# Below this norm a reference counts as zero: the relative error is then not defined,
# and the result must be zero too (within the absolute tolerance, or exactly).
_ZERO_NORM = 1e-30


@dataclass(frozen=True)
class Diff:
    """How one result tensor differs from its reference (all in float64)."""

    max_abs: float  # max |actual - expected|; NaN if either has a NaN
    ref_max: float  # max |expected|
    act_norm: float
    ref_norm: float
    rel: float  # ||actual - expected|| / ||expected|| (inf when the reference is 0 and actual is not)
    cos: float  # cosine similarity (1 when both are zero)
    finite: bool  # actual is all finite
    ref_finite: bool
    shape_ok: bool = True
    missing: str = ""  # "actual" or "expected" when one side has no tensor

    def __float__(self) -> float:
        return self.max_abs


def _to_local(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    if full is not None:
        t = full()
    return t.detach().to(torch.float64)


def diff(actual: torch.Tensor | None, expected: torch.Tensor | None) -> Diff:
    """Compare one tensor (DTensors are gathered with ``full_tensor()``) with its reference."""
    nan = float("nan")
    if actual is None or expected is None:
        side = "actual" if actual is None else "expected"
        return Diff(nan, nan, nan, nan, nan, nan, False, False, True, side)
    a, e = _to_local(actual), _to_local(expected)
    if a.shape != e.shape:
        return Diff(nan, nan, nan, nan, nan, nan, True, True, False)
    finite = bool(torch.isfinite(a).all())
    ref_finite = bool(torch.isfinite(e).all())
    d = a - e
    max_abs = float(d.abs().max()) if d.numel() else 0.0
    if not (finite and ref_finite):
        max_abs = nan
    ref_max = float(e.abs().max()) if e.numel() else 0.0
    act_norm, ref_norm = float(a.norm()), float(e.norm())
    err = float(d.norm())
    rel = err / ref_norm if ref_norm > _ZERO_NORM else 0.0 if err <= _ZERO_NORM else math.inf
    if act_norm > _ZERO_NORM and ref_norm > _ZERO_NORM:
        cos = float((a * e).sum()) / (act_norm * ref_norm)
    else:
        cos = 1.0 if act_norm <= _ZERO_NORM and ref_norm <= _ZERO_NORM else 0.0
    if not (finite and ref_finite):
        rel = cos = nan
    return Diff(max_abs, ref_max, act_norm, ref_norm, rel, cos, finite, ref_finite)


def diffs(
    actual: Mapping[str, torch.Tensor | None], expected: Mapping[str, torch.Tensor | None]
) -> dict[str, Diff]:
    """:func:`diff` for every name on either side (a name on one side only is ``missing``)."""
    names = list(expected) + [n for n in actual if n not in expected]
    return {n: diff(actual.get(n), expected.get(n)) for n in names}


def worst_abs(values: Mapping[str, Diff] | list[float]) -> float:
    """The largest absolute difference, NaN if any is NaN (unlike Python's ``max``)."""
    items = [float(v) for v in (values.values() if isinstance(values, Mapping) else values)]
    if any(math.isnan(v) for v in items):
        return float("nan")
    return max(items, default=0.0)


def _problem(d: Diff, atol: float | None, rtol: float | None) -> str:
    if d.missing:
        return f"no {d.missing} tensor"
    if not d.shape_ok:
        return "shape differs"
    if not d.finite:
        return "result has NaN/Inf"
    if not d.ref_finite:
        return "reference has NaN/Inf"
    if atol is not None and not d.max_abs <= atol:
        return f"max_abs {d.max_abs:.3g} > atol {atol:g}"
    if rtol is not None:
        if d.ref_norm <= _ZERO_NORM:
            if not d.act_norm <= (atol or 0.0) * 1e-3 + _ZERO_NORM:
                return f"reference is zero, result norm {d.act_norm:.3g}"
        elif not d.rel <= rtol:
            return f"relative error {d.rel:.3g} > rtol {rtol:g} (norm ratio {d.act_norm / d.ref_norm:.3g})"
    return ""


def check(
    results: Mapping[str, Diff],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    what: str = "gradient",
    expect_count: int | None = None,
) -> None:
    """Raise ``AssertionError`` unless every entry is within the bounds (see module doc).

    Args:
        results: name -> :class:`Diff` (from :func:`diffs`).
        atol: absolute bound on ``max_abs``; the reference must then reach
            ``MIN_REF_OVER_ATOL * atol`` in some entry.
        rtol: bound on the relative error (norm of the difference over the reference's).
        what: what the entries are, for the message.
        expect_count: the number of entries there must be (every parameter compared).
    """
    if atol is None and rtol is None:
        raise ValueError("check: give atol, rtol or both")
    if not results:
        raise AssertionError(f"no {what} compared")
    if expect_count is not None and len(results) != expect_count:
        raise AssertionError(f"{len(results)} {what}s compared, expected {expect_count}")
    bad = {n: p for n, d in results.items() if (p := _problem(d, atol, rtol))}

    def badness(item: tuple[str, Diff]) -> tuple[float, float]:
        d = item[1]
        rel = d.rel if not math.isnan(d.rel) else math.inf
        mx = d.max_abs if not math.isnan(d.max_abs) else math.inf
        return (rel, mx)

    worst_name, worst = max(results.items(), key=badness)
    if bad:
        lines = [f"  {n}: {p}" for n, p in list(bad.items())[:12]]
        more = f"\n  ... and {len(bad) - 12} more" if len(bad) > 12 else ""
        raise AssertionError(
            f"{len(bad)} of {len(results)} {what}s differ from the reference "
            f"(atol={atol}, rtol={rtol}); worst {worst_name}: rel={worst.rel:.3g} "
            f"max_abs={worst.max_abs:.3g} cos={worst.cos:.6g}\n" + "\n".join(lines) + more
        )
    if atol is not None:
        ref_scale = worst_abs([d.ref_max for d in results.values()])
        if not ref_scale >= MIN_REF_OVER_ATOL * atol:
            raise AssertionError(
                f"{what} reference too small for atol={atol:g}: its largest entry is "
                f"{ref_scale:.3g} (< {MIN_REF_OVER_ATOL:g}x atol); a 2x or zero {what} "
                "would pass. Use a relative bound or a larger reference."
            )


def merge_ranks(per_rank: list[Mapping[str, Diff]]) -> dict[str, Diff]:
    """One mapping ``"rank{i}/{name}"`` of every rank's diffs, to judge them together.

    Where a rank legitimately holds zero gradients (an expert rank that received no
    tokens), the reference scale is the whole run's, not that rank's.
    """
    return {f"rank{i}/{n}": d for i, diffs_ in enumerate(per_rank) for n, d in diffs_.items()}


def assert_close(
    actual: Mapping[str, torch.Tensor | None],
    expected: Mapping[str, torch.Tensor | None],
    **kwargs: object,
) -> dict[str, Diff]:
    """:func:`diffs` then :func:`check` (keyword arguments go to ``check``); returns the diffs."""
    out = diffs(actual, expected)
    check(out, **kwargs)  # type: ignore[arg-type]
    return out
