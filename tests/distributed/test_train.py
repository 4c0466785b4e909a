"""The trainer on 4 gloo ranks: parity with one process, resharding, resume, restart.

Each test trains the debug Llama a few steps at dp=2 x tp=2 (TP, TP+SP) or
dp_replicate=2 x dp_shard=2 (HSDP) and checks: outputs, loss and every gradient of a
step, and the losses of a short run, equal a single-process run with the same seed and
data; a checkpoint saved at dp=2 x tp=2 loads bitwise at tp=4 and in one process, one
saved at HSDP(2, 2) at dp_shard=4 and in one process; stopping and resuming, and a
rank killed under ``torchrun --max-restarts 1``, both end bitwise where an
uninterrupted run ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist_c10d

from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.train import TrainConfig, Trainer, clip_grad_norm_, latest_checkpoint
from tests._compare import FP32_RTOL, check, worst_abs
from tests._compare import diffs as grad_diffs

pytestmark = pytest.mark.distributed
WORLD_SIZE = 4

SMALL = {"batch_size": 4, "seq_len": 32, "log_every": 0, "progress": False}
DP2_TP2 = {"dp": 2, "tp": 2}
HSDP = {"dp_replicate": 2, "dp_shard": 2}
CP2_TP2 = {"cp": 2, "tp": 2}
# tp=4 needs every head count divisible by 4 (the debug preset has 2 key/value heads).
FOUR_HEADS = {"num_heads": 4, "num_kv_heads": 4}
ENTRY = os.path.join(os.path.dirname(__file__), "train_crash_entry.py")


# ---------------------------------------------------------------------- rank functions


def _full_states(trainer: Trainer) -> dict[str, torch.Tensor] | None:
    """Every parameter and its AdamW ``exp_avg`` as full tensors, on rank 0 (collective)."""
    out = {}
    for name, p in trainer.model.named_parameters():
        state = trainer.optimizer.state.get(p, {})
        for key, t in (("param", p), ("exp_avg", state.get("exp_avg"))):
            if t is not None:
                full = t.full_tensor() if isinstance(t, DTensor) else t
                out[f"{key}/{name}"] = full.detach().clone()
    on_rank0 = not dist_c10d.is_initialized() or dist_c10d.get_rank() == 0
    return out if on_rank0 else None


def _train(cfg_dict: dict) -> dict | None:
    trainer = Trainer(TrainConfig.from_dict(cfg_dict), device="cpu")
    result = trainer.fit()
    states = _full_states(trainer)
    return None if states is None else {"losses": result.losses, "states": states}


def _gather_rows(t: torch.Tensor, trainer: Trainer) -> torch.Tensor:
    """This rank's rows of a batch-sharded tensor, gathered over the ``batch`` axis."""
    local = (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous()
    if trainer.mesh is None or trainer.dp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(trainer.dp_size)]
    dist_c10d.all_gather(parts, local, group=trainer.mesh["batch"].get_group())
    return torch.cat(parts)


def _step_then_train(cfg_dict: dict) -> dict | None:
    """Outputs, loss and every gradient of the first batch; then train from scratch."""
    trainer = Trainer(TrainConfig.from_dict(cfg_dict), device="cpu")
    batch = trainer.local_batch()
    logits = trainer.model(batch.inputs, **batch.model_kwargs)
    loss = trainer.loss_fn(logits, batch.targets)
    trainer.backward(loss)
    outputs = logits
    if trainer.cp_size > 1:  # the sequence back in order (head-tail undone)
        from hyper_parallel.distributed import context_parallel

        outputs = context_parallel.unshard_sequence(logits, trainer.mesh["cp"])
    outputs = _gather_rows(outputs, trainer)
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for name, p in trainer.model.named_parameters()
    }
    first = {"loss": trainer.global_mean(loss), "outputs": outputs, "grads": grads}
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.data.load_state_dict({"position": 0, "epoch": 0})  # the run starts afresh
    result = trainer.fit()
    states = _full_states(trainer)
    if states is None:
        return None
    return {"first": first, "losses": result.losses, "states": states}


def _step_then_train_one_process_on_rank0(cfg_dict: dict) -> dict | None:
    if dist_c10d.get_rank() != 0:
        return None
    cfg = TrainConfig.from_dict(cfg_dict).replace(mesh={}, sp=False)
    return _step_then_train(cfg.to_dict())


def _train_one_process_on_rank0(cfg_dict: dict) -> dict | None:
    if dist_c10d.get_rank() != 0:
        return None
    cfg = TrainConfig.from_dict(cfg_dict).replace(mesh={}, sp=False)
    return _train(cfg.to_dict())


def _train_and_save(cfg_dict: dict, path: str) -> dict | None:
    trainer = Trainer(TrainConfig.from_dict(cfg_dict), device="cpu")
    trainer.fit()
    trainer.save(path)
    return _full_states(trainer)


def _load(cfg_dict: dict, path: str) -> dict | None:
    trainer = Trainer(TrainConfig.from_dict(cfg_dict), device="cpu")
    trainer.load(path)
    return _full_states(trainer)


def _stop_then_resume(cfg_dict: dict, stop_at: int) -> dict | None:
    cfg = TrainConfig.from_dict(cfg_dict)
    Trainer(cfg, device="cpu").fit(until_step=stop_at)  # saves its last step
    resumed = Trainer(cfg.replace(resume=True), device="cpu")
    result = resumed.fit()
    states = _full_states(resumed)
    if states is None:
        return None
    return {"resumed_from": result.resumed_from, "losses": result.losses, "states": states}


def _clip_across_meshes() -> tuple[float, float, float]:
    """Gradients on (dp, tp), on dp alone, on tp alone and plain: one global norm."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same full gradients on every rank
    layouts = [
        (mesh, [Shard(0), Shard(1)]),
        (mesh["dp"], [Shard(0)]),
        (mesh["tp"], [Replicate()]),
        (None, None),
    ]
    params, full_grads = [], []
    for sub_mesh, placements in layouts:
        full = torch.randn(4, 6)
        full_grads.append(full)
        if sub_mesh is None:
            param = torch.nn.Parameter(torch.zeros(4, 6))
            param.grad = full.clone()
        else:
            param = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6), sub_mesh, placements))
            param.grad = distribute_tensor(full, sub_mesh, placements)
        params.append(param)
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in full_grads]))
    total = clip_grad_norm_(params, max_norm=1.0)
    clipped = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params]
    after = torch.linalg.vector_norm(torch.stack([g.norm() for g in clipped]))
    return float(total), float(expected), float(after)


def _save_fails_on_rank1_then_resume(cfg_dict: dict, fail_at: int) -> dict | None:
    """Rank 1 dies in the middle of the step-``fail_at`` save; every rank then restarts.

    Rank 1's DCP writer truncates the shard it just wrote and raises, as a rank killed
    mid-write leaves it: DCP then fails the save on every rank and writes no
    ``.metadata``. The restart (``resume``) must pick the last complete checkpoint.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    cfg = TrainConfig.from_dict(cfg_dict)
    original = FileSystemWriter.write_data

    def dying_write(self, plan, planner):
        future = original(self, plan, planner)
        future.wait()
        if dist_c10d.get_rank() == 1 and f"step_{fail_at:06d}" in str(self.path):
            for name in os.listdir(self.path):
                if name.startswith("__1_"):
                    with open(os.path.join(self.path, name), "r+b") as f:
                        f.truncate(os.path.getsize(f.name) // 2)
            raise RuntimeError("rank 1 killed in the middle of the save")
        return future

    from hyper_parallel.checkpoint_hf.outputs import partial_path

    FileSystemWriter.write_data = dying_write
    error = ""
    try:
        Trainer(cfg, device="cpu").fit()
    except CheckpointException as e:  # every rank learns that the save failed
        error = f"{type(e).__name__}: {e}"
    finally:
        FileSystemWriter.write_data = original
    # The save went to step_*.partial (renamed only when complete): the step is absent.
    step = checkpoint_path_of(cfg, fail_at)
    assert not os.path.exists(step), os.listdir(os.path.dirname(step))
    incomplete = sorted(os.listdir(partial_path(step)))
    resumed = Trainer(cfg.replace(resume=True), device="cpu")
    result = resumed.fit()
    states = _full_states(resumed)
    if states is None:
        return None
    return {
        "error": error,
        "incomplete": incomplete,
        "resumed_from": result.resumed_from,
        "losses": result.losses,
        "states": states,
    }


def checkpoint_path_of(cfg: TrainConfig, step: int) -> str:
    from hyper_parallel.train.checkpoint import checkpoint_path

    assert cfg.checkpoint_dir is not None
    return checkpoint_path(cfg.checkpoint_dir, step)


def _stop_then_resume_at(cfg_dict: dict, stop_at: int, resume_mesh: dict) -> dict | None:
    """Train to ``stop_at`` (saving), then resume on ``resume_mesh`` to the end."""
    cfg = TrainConfig.from_dict(cfg_dict)
    first = Trainer(cfg, device="cpu").fit(until_step=stop_at)
    resumed = Trainer(cfg.replace(mesh=resume_mesh, resume=True), device="cpu")
    result = resumed.fit()
    states = _full_states(resumed)
    if states is None:
        return None
    return {
        "first_losses": first.losses,
        "resumed_from": result.resumed_from,
        "losses": result.losses,
        "states": states,
    }


# ---------------------------------------------------------------------- helpers


def _assert_bitwise_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not different, f"not bitwise equal: {different}"


@pytest.fixture(scope="module")
def uninterrupted(dist, tmp_path_factory):
    """Six steps at dp=2 x tp=2, checkpointing every 2 steps: the reference run."""
    checkpoint_dir = tmp_path_factory.mktemp("uninterrupted")
    cfg = TrainConfig(
        mesh=DP2_TP2,
        steps=6,
        checkpoint_dir=str(checkpoint_dir),
        checkpoint_every=2,
        **SMALL,
    )
    return cfg, dist.run(_train, cfg.to_dict())[0]


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_dp_tp_training_matches_one_process(dist, sequence_parallel):
    cfg = TrainConfig(mesh=DP2_TP2, sp=sequence_parallel, steps=4, **SMALL)
    sharded = dist.run(_train, cfg.to_dict())[0]
    single = dist.run(_train_one_process_on_rank0, cfg.to_dict())[0]
    diffs = [abs(a - b) for a, b in zip(sharded["losses"], single["losses"], strict=True)]
    assert worst_abs(diffs) < 1e-4, diffs
    for name, value in single["states"].items():
        torch.testing.assert_close(sharded["states"][name], value, atol=1e-5, rtol=1e-4)


def _assert_step_and_training_match(sharded: dict, single: dict) -> None:
    first, one = sharded["first"], single["first"]
    assert abs(first["loss"] - one["loss"]) < 1e-5
    torch.testing.assert_close(first["outputs"], one["outputs"], atol=1e-5, rtol=1e-5)
    assert first["grads"].keys() == one["grads"].keys() and len(one["grads"]) > 10
    check(grad_diffs(first["grads"], one["grads"]), atol=1e-5, rtol=FP32_RTOL)
    diffs = [abs(a - b) for a, b in zip(sharded["losses"], single["losses"], strict=True)]
    assert worst_abs(diffs) < 1e-5, diffs
    for name, value in single["states"].items():
        torch.testing.assert_close(sharded["states"][name], value, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("mesh", "sequence_parallel", "model"),
    [
        (HSDP, False, "llama3-debug"),
        (CP2_TP2, False, "llama3-debug"),
        (CP2_TP2, True, "llama3-debug"),
        ({"dp_shard": 2, "tp": 2}, False, "qwen3-debug"),  # q/k norms on head shards
    ],
    ids=["hsdp", "cp2_tp2", "cp2_tp2_sp", "qwen3_dp2_tp2"],
)
def test_step_and_training_match_one_process(dist, mesh, sequence_parallel, model):
    cfg = TrainConfig(model=model, mesh=mesh, sp=sequence_parallel, steps=3, **SMALL)
    sharded = dist.run(_step_then_train, cfg.to_dict())[0]
    single = dist.run(_step_then_train_one_process_on_rank0, cfg.to_dict())[0]
    _assert_step_and_training_match(sharded, single)


def test_clip_grad_norm_across_meshes(dist):
    for total, expected, after in dist.run(_clip_across_meshes):
        assert total == pytest.approx(expected, rel=1e-6)
        assert after == pytest.approx(1.0, rel=1e-5)


def test_checkpoint_reshards_bitwise_to_tp4_and_one_process(dist, tmp_path):
    path = str(tmp_path / "ckpt")
    cfg = TrainConfig(mesh=DP2_TP2, steps=2, model_overrides=FOUR_HEADS, **SMALL)
    saved = dist.run(_train_and_save, cfg.to_dict(), path)[0]
    at_tp4 = dist.run(_load, cfg.replace(mesh={"tp": 4}).to_dict(), path)[0]
    _assert_bitwise_equal(at_tp4, saved)
    # This test process has no process group at all.
    assert not dist_c10d.is_initialized()
    one = Trainer(cfg.replace(mesh={}), device="cpu")
    one.load(path)
    assert one.step == 2
    _assert_bitwise_equal(_full_states(one), saved)


def test_hsdp_checkpoint_reshards_bitwise_to_dp_shard4_and_one_process(dist, tmp_path):
    path = str(tmp_path / "ckpt")
    cfg = TrainConfig(mesh=HSDP, steps=2, **SMALL)
    saved = dist.run(_train_and_save, cfg.to_dict(), path)[0]
    at_dp4 = dist.run(_load, cfg.replace(mesh={"dp_shard": 4}).to_dict(), path)[0]
    _assert_bitwise_equal(at_dp4, saved)
    assert not dist_c10d.is_initialized()
    one = Trainer(cfg.replace(mesh={}), device="cpu")
    one.load(path)
    assert one.step == 2
    _assert_bitwise_equal(_full_states(one), saved)


def test_cp_tp_checkpoint_reshards_bitwise_to_tp4(dist, tmp_path):
    path = str(tmp_path / "ckpt")
    cfg = TrainConfig(mesh=CP2_TP2, steps=2, model_overrides=FOUR_HEADS, **SMALL)
    saved = dist.run(_train_and_save, cfg.to_dict(), path)[0]
    at_tp4 = dist.run(_load, cfg.replace(mesh={"tp": 4}).to_dict(), path)[0]
    _assert_bitwise_equal(at_tp4, saved)


def test_stop_and_resume_equals_uninterrupted_run(dist, tmp_path, uninterrupted):
    cfg, expected = uninterrupted
    resumed = dist.run(_stop_then_resume, cfg.replace(checkpoint_dir=str(tmp_path)).to_dict(), 3)[0]
    assert resumed["resumed_from"] == 3
    assert resumed["losses"] == expected["losses"][3:]
    _assert_bitwise_equal(resumed["states"], expected["states"])


@pytest.mark.slow
def test_killed_rank_restarts_from_last_checkpoint(uninterrupted, tmp_path):
    cfg, expected = uninterrupted
    checkpoint_dir, marker = tmp_path / "ckpt", tmp_path / "crashed"
    metrics = tmp_path / "metrics.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(WORLD_SIZE),
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.5",
        ENTRY,
        "--mesh",
        "dp=2,tp=2",
        "--steps",
        str(cfg.steps),
        "--batch-size",
        str(cfg.batch_size),
        "--seq-len",
        str(cfg.seq_len),
        "--checkpoint-dir",
        str(checkpoint_dir),
        "--checkpoint-every",
        "2",
        "--resume",
        "--log-every",
        "0",
        "--no-progress",
        "--metrics-out",
        str(metrics),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",  # gloo CPU ranks, like the rest of the suite
        "HP_CRASH_STEP": "5",  # after the step-4 checkpoint, before step 6
        "HP_CRASH_RANK": "1",
        "HP_CRASH_MARKER": str(marker),
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert marker.exists(), "the planted failure never happened"
    result = json.loads(metrics.read_text())
    assert result["resumed_from"] == 4 and result["final_step"] == cfg.steps
    assert result["losses"] == expected["losses"][4:]
    final = latest_checkpoint(checkpoint_dir)
    assert final is not None and final.endswith("step_000006")
    restarted = Trainer(cfg.replace(mesh={}, checkpoint_dir=None), device="cpu")
    restarted.load(final)
    reference = Trainer(cfg.replace(mesh={}, checkpoint_dir=None), device="cpu")
    reference.load(latest_checkpoint(cfg.checkpoint_dir))
    _assert_bitwise_equal(_full_states(restarted), _full_states(reference))
    _assert_bitwise_equal(_full_states(restarted), expected["states"])


def test_a_rank_failing_mid_save_restarts_from_the_last_complete_checkpoint(
    dist, tmp_path, uninterrupted
):
    cfg, expected = uninterrupted
    run = cfg.replace(checkpoint_dir=str(tmp_path))
    r = dist.run(_save_fails_on_rank1_then_resume, run.to_dict(), 4)[0]
    assert "killed in the middle of the save" in r["error"], r["error"]
    assert ".metadata" not in r["incomplete"] and "checksums.json" not in r["incomplete"]
    assert any(n.startswith("__1_") for n in r["incomplete"])  # rank 1's cut-off shard
    assert r["resumed_from"] == 2
    assert r["losses"] == expected["losses"][2:]
    _assert_bitwise_equal(r["states"], expected["states"])


def test_resume_at_another_mesh_continues_the_same_loss_curve(dist, tmp_path):
    # Saved at dp=2 x tp=2 after 3 steps, resumed at tp=4 (optimizer state resharded).
    cfg = TrainConfig(
        mesh=DP2_TP2,
        steps=5,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=3,
        model_overrides=FOUR_HEADS,
        **SMALL,
    )
    r = dist.run(_stop_then_resume_at, cfg.to_dict(), 3, {"tp": 4})[0]
    single = dist.run(_train_one_process_on_rank0, cfg.replace(checkpoint_dir=None).to_dict())[0]
    assert r["resumed_from"] == 3
    curve = r["first_losses"] + r["losses"]
    assert worst_abs([abs(a - b) for a, b in zip(curve, single["losses"], strict=True)]) < 1e-5
    for name, value in single["states"].items():
        torch.testing.assert_close(r["states"][name], value, atol=1e-5, rtol=1e-4)


MOE = {"model": "qwen3-moe-debug"}


def test_moe_checkpoint_resumes_bitwise_and_at_another_ep(dist, tmp_path):
    # Experts over (efsdp, ep) and their AdamW state: stop and resume at the same mesh
    # ends bitwise where the uninterrupted run ends; resumed at ep=2 (from ep=4) it
    # continues the same loss curve.
    mesh = {"dp_shard": 4, "ep": 4}
    cfg = TrainConfig(mesh=mesh, steps=4, checkpoint_every=2, **MOE, **SMALL)
    whole = dist.run(_train, cfg.to_dict())[0]
    same = cfg.replace(checkpoint_dir=str(tmp_path / "same"))
    r = dist.run(_stop_then_resume_at, same.to_dict(), 2, mesh)[0]
    assert r["resumed_from"] == 2
    assert r["first_losses"] + r["losses"] == whole["losses"]
    _assert_bitwise_equal(r["states"], whole["states"])
    other = cfg.replace(checkpoint_dir=str(tmp_path / "other"))
    r = dist.run(_stop_then_resume_at, other.to_dict(), 2, {"dp_shard": 4, "ep": 2})[0]
    assert r["resumed_from"] == 2
    curve = r["first_losses"] + r["losses"]
    assert worst_abs([abs(a - b) for a, b in zip(curve, whole["losses"], strict=True)]) < 1e-5
    for name, value in whole["states"].items():
        torch.testing.assert_close(r["states"][name], value, atol=1e-5, rtol=1e-4)


_SCRIPT_WITHOUT_GROUP = """
import json, sys
from hyper_parallel.train import TrainConfig, Trainer
# No init_process_group: the Trainer joins torchrun's group, as torch's init_device_mesh does.
cfg = TrainConfig(mesh={"dp_shard": 2}, steps=2, batch_size=4, seq_len=32, log_every=0,
                  progress=False)
losses = Trainer(cfg, device="cpu").fit().losses
import torch.distributed as dist
if dist.get_rank() == 0:
    json.dump({"world": dist.get_world_size(), "losses": losses}, open(sys.argv[1], "w"))
"""


def test_trainer_under_torchrun_joins_its_process_group(tmp_path):
    # The getting-started snippet: `Trainer(cfg)` under torchrun with no
    # init_process_group call. It was refused ("no process group is running. Fix: launch
    # with torchrun", which it was). Its losses are the one-process run's (fp32, FSDP2's
    # mean over 2 ranks: within the suite's fp32 loss tolerance).
    script, out = tmp_path / "snippet.py", tmp_path / "out.json"
    script.write_text(_SCRIPT_WITHOUT_GROUP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += ["2", str(script), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(__file__))), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    one = Trainer(
        TrainConfig(steps=2, batch_size=4, seq_len=32, log_every=0, progress=False), device="cpu"
    ).fit()
    assert result["world"] == 2
    diffs = [abs(a - b) for a, b in zip(result["losses"], one.losses, strict=True)]
    assert worst_abs(diffs) < 1e-5, diffs  # NaN-safe: a NaN loss fails
