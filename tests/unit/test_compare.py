"""The tests' comparison helper fails on every planted wrong gradient, passes on equal ones."""

from __future__ import annotations

import math

import pytest
import torch

from tests._compare import BF16_GRAD_RTOL, FP32_RTOL, assert_close, check, diffs, worst_abs

TOL = 1e-5


def _grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 8, generator=g) * 1e-2,
        "layers.0.attn.wq.weight": torch.randn(8, 8, generator=g) * 1e-2,
        "norm.weight": torch.randn(8, generator=g) * 1e-3,
    }


def _planted(name: str, how: str) -> dict[str, torch.Tensor]:
    grads = {n: t.clone() for n, t in _grads().items()}
    t = grads[name]
    if how == "nan":
        t.view(-1)[3] = float("nan")
    elif how == "inf":
        t.view(-1)[0] = float("inf")
    elif how == "2x":
        t.mul_(2)
    elif how == "zero":
        t.zero_()
    elif how == "half":
        t.mul_(0.5)
    elif how == "neg":
        t.neg_()
    return grads


@pytest.mark.parametrize("how", ["nan", "inf", "2x", "zero", "half", "neg"])
@pytest.mark.parametrize("name", ["embed.weight", "norm.weight"])
@pytest.mark.parametrize(
    "bounds",
    [{"atol": TOL, "rtol": FP32_RTOL}, {"rtol": BF16_GRAD_RTOL}],
    ids=["fp32", "bf16"],
)
def test_fails_on_each_planted_wrong_gradient_and_names_it(how, name, bounds):
    with pytest.raises(AssertionError, match=name.replace(".", r"\.")):
        assert_close(_planted(name, how), _grads(), **bounds)


def test_passes_equal_and_rounding_close_gradients():
    ref = _grads()
    assert_close(ref, ref, atol=TOL, rtol=FP32_RTOL)
    noisy = {n: t * (1 + 1e-6) for n, t in ref.items()}
    assert_close(noisy, ref, atol=TOL, rtol=FP32_RTOL)
    bf16 = {n: t.bfloat16().float() for n, t in ref.items()}
    assert_close(bf16, ref, rtol=BF16_GRAD_RTOL)


def test_nan_in_the_reference_or_a_missing_gradient_fails():
    ref = _grads()
    with pytest.raises(AssertionError, match="reference has NaN"):
        assert_close(ref, _planted("norm.weight", "nan"), atol=TOL)
    partial = dict(ref)
    del partial["norm.weight"]
    with pytest.raises(AssertionError, match=r"norm\.weight: no actual tensor"):
        assert_close(partial, ref, atol=TOL)
    partial["norm.weight"] = None
    with pytest.raises(AssertionError, match=r"norm\.weight: no actual tensor"):
        assert_close(partial, ref, atol=TOL)
    with pytest.raises(AssertionError, match="3 gradients compared, expected 19"):
        check(diffs(ref, ref), atol=TOL, expect_count=19)


def test_refuses_a_reference_too_small_for_the_absolute_tolerance():
    tiny = {n: t * 1e-4 for n, t in _grads().items()}  # largest entry ~3e-6 < 10 * 1e-5
    with pytest.raises(AssertionError, match="reference too small"):
        assert_close({n: 2 * t for n, t in tiny.items()}, tiny, atol=TOL)
    # A relative bound still sees the 2x.
    with pytest.raises(AssertionError, match="relative error"):
        assert_close({n: 2 * t for n, t in tiny.items()}, tiny, rtol=FP32_RTOL)


def test_zero_reference_needs_a_zero_result():
    ref = {"w": torch.zeros(4)}
    assert_close({"w": torch.zeros(4)}, ref, rtol=FP32_RTOL)
    with pytest.raises(AssertionError, match="reference is zero"):
        assert_close({"w": torch.full((4,), 1e-3)}, ref, rtol=FP32_RTOL)


def test_reports_the_worst_parameter_by_name():
    grads = _planted("norm.weight", "2x")
    grads["embed.weight"] = grads["embed.weight"] * 1.01
    with pytest.raises(AssertionError, match=r"worst norm\.weight: rel=1 "):
        assert_close(grads, _grads(), rtol=FP32_RTOL)


def test_worst_abs_propagates_nan_where_python_max_does_not():
    values = [0.0, float("nan"), 1.0]
    assert max(values) == 1.0 or math.isnan(max(values))  # Python's max depends on order
    assert max([1.0, float("nan")]) == 1.0  # the hole
    assert math.isnan(worst_abs([1.0, float("nan")]))
    assert worst_abs([1.0, 3.0]) == 3.0
