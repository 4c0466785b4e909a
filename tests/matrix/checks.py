"""One matrix configuration: refused before any rank builds, or trained and held to one device.

:func:`gate` runs in the driver process (no process group): the trainer's gate
(:func:`~hyper_parallel.train.trainer.check_config`), ``hyper-parallel validate``,
``plan`` and ``suggest --mesh`` with the same switches; a refused run must be refused
by all four with the same findings, word for word. :func:`train_vs_one_device` runs on every rank of a gloo pool
(``tests/distributed/harness.py``): the trainer for 2 steps at the configuration's mesh,
then on rank 0 the same run in one process; :func:`judge` holds the result to one
device through ``tests/_compare.py``:

- fp32: every first-step gradient within ``atol=1e-5`` and ``FP32_RTOL`` of the
  one-process run's, and both losses within 1e-5;
- bf16: both losses within the demo's ``BF16_TOL`` of the one-process bf16 run (same
  autocast policy), and every first-step gradient within ``BF16_GRAD_RTOL`` of the
  one-process fp32 run's (a 2x, zero or NaN gradient fails).

Activation checkpointing and compile change no number of the one-process run, so its
reference runs without them (and without sequence parallelism, a tp layout).
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any

from tests._compare import BF16_GRAD_RTOL, FP32_RTOL, Diff, check, diffs, worst_abs

__all__ = [
    "FP32_LOSS_TOL",
    "gate",
    "judge",
    "suggest_argv",
    "train_vs_one_device",
    "validate_argv",
]

FP32_LOSS_TOL = 1e-5


def validate_argv(cfg: dict[str, Any]) -> list[str]:
    """``hyper-parallel validate`` arguments for the trainer config ``cfg``."""
    import json

    mesh = ",".join(f"{k}={v}" for k, v in cfg["mesh"].items()) or "dp_shard=1"
    dp = cfg["mesh"].get("dp_replicate", 1) * cfg["mesh"].get("dp_shard", 1)
    argv = ["validate", "--model", cfg["model"], "--mesh", mesh]
    if cfg.get("model_overrides"):
        argv += ["--model-overrides", json.dumps(cfg["model_overrides"])]
    argv += ["--batch", str(cfg["batch_size"] // dp), "--seq", str(cfg["seq_len"])]
    if cfg.get("sp"):
        argv.append("--sp")
    if "schedule" in cfg:
        argv += ["--schedule", cfg["schedule"]]
    if cfg.get("microbatches") is not None:
        argv += ["--microbatches", str(cfg["microbatches"])]
    if cfg.get("reduce_each_microbatch"):
        argv.append("--reduce-each-microbatch")
    if cfg.get("compile"):
        argv.append("--compile")
    if cfg.get("ac", "none") != "none":
        argv += ["--ac", cfg["ac"]]
    if cfg.get("pipeline_split") is not None:
        argv += ["--pipeline-split", json.dumps(cfg["pipeline_split"])]
    if cfg.get("stages_per_rank") is not None:
        argv += ["--stages-per-rank", str(cfg["stages_per_rank"])]
    return argv


def plan_argv(cfg: dict[str, Any]) -> list[str] | None:
    """``hyper-parallel plan`` arguments for ``cfg`` (its ``--batch`` is one micro-batch's
    sequences, with and without pp); ``None`` when the trainer's batch is not a whole
    number of them."""
    from hyper_parallel.distributed.run_plan import default_num_microbatches

    argv = validate_argv(cfg)
    argv[0] = "plan"
    pp = cfg["mesh"].get("pp", 1)
    microbatches = cfg.get("microbatches") or default_num_microbatches(
        pp, cfg.get("schedule", "1F1B"), cfg.get("stages_per_rank")
    )
    at = argv.index("--batch") + 1
    per_rank = int(argv[at])
    if per_rank % microbatches:
        return None
    per_rank //= microbatches
    argv[at] = str(per_rank)
    return [*argv, "--dtype", cfg.get("dtype", "fp32"), "--ac", cfg.get("ac", "none")]


def suggest_argv(cfg: dict[str, Any], world_size: int) -> list[str]:
    """``hyper-parallel suggest --mesh`` arguments for ``cfg``: every switch fixed (the
    micro-batches at the trainer's resolved count), on ``world_size`` GPUs."""
    import json

    from hyper_parallel.distributed.run_plan import default_num_microbatches

    mesh = ",".join(f"{k}={v}" for k, v in cfg["mesh"].items()) or "dp_shard=1"
    schedule = cfg.get("schedule", "1F1B")
    microbatches = cfg.get("microbatches") or default_num_microbatches(
        cfg["mesh"].get("pp", 1), schedule, cfg.get("stages_per_rank")
    )
    argv = ["suggest", "--model", cfg["model"], "--mesh", mesh, "--gpus", str(world_size)]
    if cfg.get("model_overrides"):
        argv += ["--model-overrides", json.dumps(cfg["model_overrides"])]
    argv += ["--gpu", "h100-80gb", "--seq", str(cfg["seq_len"])]
    argv += ["--global-batch-tokens", str(cfg["batch_size"] * cfg["seq_len"])]
    argv += ["--dtype", cfg.get("dtype", "fp32"), "--ac", cfg.get("ac", "none")]
    argv += ["--schedule", schedule, "--microbatches", str(microbatches)]
    if cfg.get("sp"):
        argv.append("--sp")
    if cfg.get("reduce_each_microbatch"):
        argv.append("--reduce-each-microbatch")
    if cfg.get("compile"):
        argv.append("--compile")
    if cfg.get("pipeline_split") is not None:
        argv += ["--pipeline-split", json.dumps(cfg["pipeline_split"])]
    if cfg.get("stages_per_rank") is not None:
        argv += ["--stages-per-rank", str(cfg["stages_per_rank"])]
    return argv


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from hyper_parallel.cli import main as cli_main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli_main(argv)
    except SystemExit as e:  # argparse refused the arguments
        rc = e.code if isinstance(e.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


_FIELDS = ("severity", "path", "field", "message", "fix")


def _words(text: str) -> str:
    return " ".join(text.split())


def gate(cfg: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The trainer's gate, ``validate --format json`` and ``plan`` on ``cfg``, in this process.

    A finding is the same in both when its path, field, message and fix are (word for
    word); a refusal ``TrainConfig`` raises itself (not a finding) must appear in
    validate's output.

    Returns:
        ``refused`` (whether the trainer refuses), ``findings`` (its error texts),
        ``validate_rc`` and ``validate_missing`` (the trainer's findings validate does
        not report; empty when they agree), ``validate_extra`` (validate's errors on a
        run the trainer accepts), ``plan_missing`` (those ``plan`` does not print, for a
        refused run whose batch ``plan --batch`` can state), ``suggest_missing`` (those
        ``suggest --mesh`` does not print, for a refused run).
    """
    import json

    from hyper_parallel.dmodule.findings import Finding
    from hyper_parallel.train.trainer import TrainConfig, check_config

    raised: str | None = None
    found: list[Any] = []
    try:
        config = TrainConfig.from_dict(cfg)
    except ValueError as e:
        raised = str(e)
    else:
        found = check_config(config, world_size)
    rc, out_text, err_text = _cli([*validate_argv(cfg), "--format", "json"])
    try:
        reported = json.loads(out_text)["findings"]
    except (ValueError, KeyError, TypeError):
        reported = []
    # validate's errors in the trainer's form (str of a Finding), word for word.
    errors = {
        _words(str(Finding(*(str(f.get(k, "")) for k in _FIELDS))))
        for f in reported
        if f.get("severity") == "error"
    }
    # A mesh argparse refuses (before any JSON) is printed as the layout's findings.
    text = _words(out_text + err_text)

    def reported_alike(finding: str) -> bool:
        return _words(finding) in errors or (rc == 2 and _words(finding) in text)

    if raised is not None:
        findings = [raised]
        # TrainConfig raises the run plan's findings: its lines after the first.
        lines = [ln.strip() for ln in raised.splitlines()[1:] if ln.strip()] or [raised]
        missing = [ln for ln in lines if not reported_alike(ln)]
    else:
        findings = [str(f) for f in found]
        missing = [str(f) for f in found if not reported_alike(str(f))]
    extra = "" if findings or rc == 0 else (" | ".join(sorted(errors)) or text)
    # plan prints a refused run's findings (str of each) and exits non-zero.
    plan_missing: list[str] = []
    argv = plan_argv(cfg) if findings else None
    if argv is not None:
        plan_rc, plan_out, plan_err = _cli(argv)
        plan_text = _words(plan_out + plan_err)
        wanted = lines if raised is not None else [str(f) for f in found]
        plan_missing = [f for f in wanted if plan_rc == 0 or _words(f) not in plan_text]
    # suggest --mesh: no candidate of the fixed run passes; it prints the run plan's errors.
    suggest_missing: list[str] = []
    if findings:
        wanted = lines if raised is not None else [str(f) for f in found]
        suggest_rc, suggest_out, suggest_err = _cli(suggest_argv(cfg, world_size))
        suggest_text = _words(suggest_out + suggest_err)
        suggest_missing = [f for f in wanted if suggest_rc == 0 or _words(f) not in suggest_text]
    return {
        "plan_missing": plan_missing,
        "suggest_missing": suggest_missing,
        "refused": bool(findings),
        "findings": findings,
        "validate_rc": rc,
        "validate_missing": missing,
        "validate_extra": extra,
    }


def _keep_first(into: dict[str, Any], pp: int) -> Any:
    from hyper_parallel.train.run import full_gradients

    def keep(step: int, parts: list[Any]) -> None:
        if step == 0:
            into.update(full_gradients(parts, pp))

    return keep


def train_vs_one_device(cfg_dict: dict[str, Any]) -> dict[str, Any] | None:
    """On every rank: the trainer at ``cfg_dict``'s mesh for its steps; then on rank 0
    the one-process run (and, under bf16, the fp32 one-process first step).

    Returns:
        On rank 0: losses of both, and the first-step gradient diffs; ``None`` elsewhere.
    """
    import torch
    import torch.distributed as c10d

    from hyper_parallel.train import TrainConfig, Trainer

    cfg = TrainConfig.from_dict(cfg_dict)
    pp = cfg.mesh.get("pp", 1)
    grads: dict[str, Any] = {}
    # Each configuration is a job of its own (one torchrun each), though the ranks'
    # processes are reused: nothing dynamo compiled for an earlier one is kept.
    torch._dynamo.reset()
    trainer = Trainer(cfg, device="cpu", grad_callback=_keep_first(grads, pp))
    # Blocks held by each of this rank's model parts (pipeline stages).
    blocks = [len(getattr(part, "layers", ())) for part in trainer.model_parts]
    result = trainer.fit()
    if c10d.get_rank() != 0:
        return None
    one = cfg.replace(
        mesh={},
        sp=False,
        compile=False,
        ac="none",
        microbatches=None,
        pipeline_split=None,
        schedule="1F1B",
    )
    ref_grads: dict[str, Any] = {}
    ref_trainer = Trainer(one, device="cpu", grad_callback=_keep_first(ref_grads, 1))
    reference = ref_trainer.fit()
    num_params = sum(1 for m in ref_trainer.model_parts for _ in m.named_parameters())
    fp32_grad_diffs: dict[str, Diff] | None = None
    if cfg.dtype != "fp32":
        fp32_grads: dict[str, Any] = {}
        fp32 = one.replace(dtype="fp32")
        Trainer(fp32, device="cpu", grad_callback=_keep_first(fp32_grads, 1)).train_step()
        fp32_grad_diffs = diffs(grads, fp32_grads)
    return {
        "dtype": cfg.dtype,
        "losses": result.losses,
        "ref_losses": reference.losses,
        "grad_diffs": diffs(grads, ref_grads),
        "fp32_grad_diffs": fp32_grad_diffs,
        "num_params": num_params,
        "blocks_per_part": blocks,
    }


def judge(r: dict[str, Any]) -> tuple[float, float]:
    """Hold a :func:`train_vs_one_device` result to one device (module doc).

    Returns:
        The largest loss difference and the largest gradient relative error.

    Raises:
        AssertionError: A loss or a gradient is off (or NaN), or one is missing.
    """
    loss_tol = FP32_LOSS_TOL
    if r["dtype"] != "fp32":
        from hyper_parallel.train.demo import BF16_TOL

        loss_tol = BF16_TOL
    assert len(r["losses"]) == len(r["ref_losses"]) > 0, (r["losses"], r["ref_losses"])
    loss_err = worst_abs([abs(a - b) for a, b in zip(r["losses"], r["ref_losses"], strict=True)])
    if not loss_err <= loss_tol:
        raise AssertionError(
            f"losses {r['losses']} vs one device {r['ref_losses']}: {loss_err:.3g} > {loss_tol:g}"
        )
    if r["dtype"] == "fp32":
        grads = r["grad_diffs"]
        check(grads, atol=1e-5, rtol=FP32_RTOL, expect_count=r["num_params"])
    else:
        grads = r["fp32_grad_diffs"]
        check(grads, rtol=BF16_GRAD_RTOL, expect_count=r["num_params"])
    rel = max((d.rel for d in grads.values()), default=0.0)
    return loss_err, rel if not math.isnan(rel) else math.inf
