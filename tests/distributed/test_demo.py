"""The demo's parity line judges every first-step gradient, and NaN fails it.

One real demo run (dp=2 under torchrun, 2 steps) must PASS with the gradient fields
on its parity line; the same run's results handed back with every gradient 2x too
large, with one gradient zero, or with a NaN loss must each FAIL it. Under
``--dtype bf16`` the line shows the wider bounds and a 2x gradient still FAILs.
"""

from __future__ import annotations

import math

import pytest
import torch

from hyper_parallel.train import demo
from hyper_parallel.train.demo import GRAD_RTOL, compare_gradients

pytestmark = pytest.mark.distributed


def _grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(3, generator=g)}


@pytest.mark.parametrize("how", ["nan", "inf", "2x", "zero", "missing", "neg"])
def test_compare_gradients_fails_each_planted_wrong_gradient(how):
    ref = _grads()
    bad = {n: t.clone() for n, t in ref.items()}
    if how == "nan":
        bad["b.bias"][1] = math.nan
    elif how == "inf":
        bad["b.bias"][0] = math.inf
    elif how == "2x":
        bad["b.bias"] *= 2
    elif how == "zero":
        bad["b.bias"].zero_()
    elif how == "missing":
        del bad["b.bias"]
    elif how == "neg":
        bad["b.bias"].neg_()
    result = compare_gradients(bad, ref)
    assert not result.ok(GRAD_RTOL), result
    assert compare_gradients(ref, {n: t.clone() for n, t in ref.items()}).ok(GRAD_RTOL)


def _last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_demo_passes_then_fails_on_2x_zero_and_nan(tmp_path, capsys, monkeypatch):
    launched = {}
    real_launch = demo._launch_ranks

    def launch_and_keep(cfg, out_dir):
        status, metrics = real_launch(cfg, out_dir)
        launched["metrics"] = metrics
        return status, metrics

    monkeypatch.setattr(demo, "_launch_ranks", launch_and_keep)
    argv = ["--mesh", "dp=2", "--steps", "2", "--output-dir", str(tmp_path)]
    assert demo.main(argv) == 0
    line = _last_line(capsys)
    assert line.startswith("parity: steps=2 max_abs_loss_diff=") and line.endswith(" PASS"), line
    assert "max_rel_grad_err=" in line and "grad_rtol=1e-3" in line, line
    metrics = launched["metrics"]
    assert len(metrics["grads"]) > 10  # every parameter of the debug Llama

    def replay(**change):
        def fake_launch(cfg, out_dir):
            return 0, {**metrics, **change}

        monkeypatch.setattr(demo, "_launch_ranks", fake_launch)
        assert demo.main(argv) == 1
        return _last_line(capsys)

    # Every gradient 2x too large: the losses are unchanged, the gradients are not.
    doubled = {n: 2 * g for n, g in metrics["grads"].items()}
    line = replay(grads=doubled)
    assert line.endswith(" FAIL") and "max_rel_grad_err=1.00e+00" in line, line
    # One parameter's gradient zero.
    zeroed = dict(metrics["grads"])
    name = sorted(zeroed)[-1]
    zeroed[name] = torch.zeros_like(zeroed[name])
    assert replay(grads=zeroed).endswith(" FAIL")
    # A NaN loss on the last step (Python's max() would skip it: NaN is not first).
    line = replay(losses=[metrics["losses"][0], math.nan])
    assert line.endswith(" FAIL") and "max_abs_loss_diff=nan" in line, line


def test_demo_under_bf16_prints_its_wider_bounds_and_fails_a_2x_gradient(
    tmp_path, capsys, monkeypatch
):
    # The sharded run's results are replaced by the one-process bf16 run's own (no ranks
    # start): the parity line shows the bf16 bounds (loss 2e-2, gradients 0.1) and PASSes;
    # with every gradient 2x it FAILs, while the losses are unchanged.
    argv = ["--mesh", "dp=2", "--steps", "2", "--dtype", "bf16", "--output-dir", str(tmp_path)]
    kept = {}
    real_here = demo._train_here

    def here(cfg, hf=None):
        kept["dtype"] = cfg.dtype
        return real_here(cfg, hf)

    monkeypatch.setattr(demo, "_train_here", here)

    def launch(scale):
        def fake_launch(cfg, out_dir):
            losses, grads = real_here(cfg.replace(mesh={}, log_every=0))
            grads = {n: scale * g for n, g in grads.items()}
            return 0, {"steps": [1, 2], "losses": losses, "grads": grads}

        return fake_launch

    for scale, verdict in ((1.0, " PASS"), (2.0, " FAIL")):
        monkeypatch.setattr(demo, "_launch_ranks", launch(scale))
        assert demo.main(argv) == (0 if verdict == " PASS" else 1)
        line = _last_line(capsys)
        assert "tol=2e-2" in line and "grad_rtol=1e-1" in line and line.endswith(verdict), line
    assert kept["dtype"] == "bf16"  # the reference ran under the same policy
