"""Asynchronous checkpoints (``--async-checkpoint``, DCP's ``async_save``) on 2 gloo ranks.

A run writing its checkpoints in the background leaves the same checkpoints as one
writing them in place — each step's states, bitwise (the states are copied before
training changes them) — keeps the newest ``keep_checkpoints`` of them, reports each
saved once complete, and a run resumed from one ends bitwise where the synchronous
run ends.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as c10d

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.train import TrainConfig, Trainer
from hyper_parallel.train.checkpoint import checkpoint_steps, verify_checkpoint

pytestmark = pytest.mark.distributed
WORLD_SIZE = 2

STEPS = 6
CFG = {
    "mesh": {"dp_shard": 2},
    "steps": STEPS,
    "batch_size": 4,
    "seq_len": 32,
    "checkpoint_every": 2,
    "log_every": 0,
    "progress": False,
}


def _states(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    """Every parameter and its AdamW moments as full tensors, on rank 0 (collective)."""
    out = {}
    for name, p in trainer.model.named_parameters():
        state = trainer.optimizer.state.get(p, {})
        for key, t in (("param", p), ("exp_avg", state.get("exp_avg")),
                       ("exp_avg_sq", state.get("exp_avg_sq"))):  # fmt: skip
            if t is not None:
                full = t.full_tensor() if isinstance(t, DTensor) else t
                out[f"{key}/{name}"] = full.detach().clone()
    return out if c10d.get_rank() == 0 else None


def _train(cfg_dict: dict, stop_at: int | None) -> dict | None:
    """Train to ``stop_at`` (default: the end), then resume a new trainer to the end."""
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, device="cpu")
    said: list[str] = []
    trainer.report.say = said.append  # type: ignore[method-assign]
    first = trainer.fit(until_step=stop_at)
    result = {"losses": first.losses, "said": said}
    if stop_at is not None:
        trainer = Trainer(cfg.replace(resume=True), device="cpu")
        trainer.report.say = said.append  # type: ignore[method-assign]
        resumed = trainer.fit()
        result.update(resumed_from=resumed.resumed_from, losses=first.losses + resumed.losses)
    states = _states(trainer)
    return None if states is None else {**result, "states": states}


def _load(cfg_dict: dict, path: str) -> dict | None:
    cfg = TrainConfig.from_dict(cfg_dict).replace(checkpoint_dir=None)
    trainer = Trainer(cfg, device="cpu")
    trainer.load(path)
    return _states(trainer)


def _assert_bitwise_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys() and len(expected) > 10
    different = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not different, f"not bitwise equal: {different}"


@pytest.fixture(scope="module")
def sync_run(dist, tmp_path_factory):
    """The reference: checkpoints written in place every 2 steps."""
    folder = tmp_path_factory.mktemp("sync")
    cfg = {**CFG, "checkpoint_dir": str(folder)}
    return cfg, dist.run(_train, cfg, None)[0]


def test_async_checkpoints_equal_sync_ones_and_resume_to_the_same_result(dist, sync_run, tmp_path):
    sync_cfg, expected = sync_run
    cfg = {**CFG, "checkpoint_dir": str(tmp_path), "async_checkpoint": True}
    run = dist.run(_train, cfg, None)[0]
    assert run["losses"] == expected["losses"]
    _assert_bitwise_equal(run["states"], expected["states"])
    # Each step's checkpoint holds that step's states (copied before training went on),
    # complete (manifest checked), as the in-place save's.
    steps = checkpoint_steps(tmp_path)
    assert [s for s, _ in steps] == [2, 4, 6]
    for _, path in steps:
        assert verify_checkpoint(path) is None
        assert not os.path.exists(f"{path}.partial")
        saved = dist.run(_load, cfg, path)[0]
        reference = dist.run(_load, sync_cfg, os.path.join(sync_cfg["checkpoint_dir"], os.path.basename(path)))[0]  # fmt: skip
        _assert_bitwise_equal(saved, reference)
    # Each is reported once complete, with its own step.
    saves = [line for line in run["said"] if "checkpoint saved" in line]
    assert [line.split(":")[0] for line in saves] == ["step 2", "step 4", "step 6"]
    assert all("in the background" in line for line in saves)


def test_a_run_resumed_from_async_checkpoints_ends_as_the_sync_run(dist, sync_run, tmp_path):
    _, expected = sync_run
    cfg = {**CFG, "checkpoint_dir": str(tmp_path), "async_checkpoint": True, "keep_checkpoints": 2}
    run = dist.run(_train, cfg, 3)[0]  # stops after step 3 (saved at 2 and 3), resumes at 3
    assert run["resumed_from"] == 3
    assert run["losses"] == expected["losses"]
    _assert_bitwise_equal(run["states"], expected["states"])
    # --keep-checkpoints holds: the two newest complete ones remain.
    assert [s for s, _ in checkpoint_steps(tmp_path)] == [4, 6]
    removed = [line for line in run["said"] if "removed" in line]
    assert [line.split(":")[0] for line in removed] == ["step 4", "step 6"]
    assert "removed step_000002" in removed[0] and "removed step_000003" in removed[1]
