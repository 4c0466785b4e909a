"""Nothing lost on a damaged checkpoint or a mismatched resume (one process, no ranks).

A truncated or corrupted shard next to a valid ``.metadata`` is detected by the
checksums manifest written at save: ``latest_checkpoint`` warns naming the bad file
and returns the previous complete checkpoint, ``--resume`` continues from it exactly
as an uninterrupted run; ``load_checkpoint`` refuses the damaged one. Resuming with
another model configuration is a clear error naming what differs.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from hyper_parallel.train import TrainConfig, Trainer
from hyper_parallel.train.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    verify_checkpoint,
)

TINY = {"batch_size": 4, "seq_len": 16, "log_every": 0, "progress": False}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """4 steps, checkpoints at 2 and 4; and the same 4 steps uninterrupted, no checkpoints."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    cfg = TrainConfig(steps=4, checkpoint_dir=str(ckpt), checkpoint_every=2, **TINY)
    whole = Trainer(cfg.replace(checkpoint_dir=None), device="cpu")
    result = whole.fit()
    Trainer(cfg, device="cpu").fit()
    params = {n: p.detach().clone() for n, p in whole.model.named_parameters()}
    return cfg, ckpt, result.losses, params


def _shard(step_dir: Path) -> Path:
    return sorted(step_dir.glob("*.distcp"))[0]


def test_the_manifest_lists_every_file_with_size_and_checksum(runs):
    _, ckpt, _, _ = runs
    step = ckpt / "step_000004"
    manifest = json.loads((step / "checksums.json").read_text())["files"]
    on_disk = {p.name for p in step.iterdir() if p.name != "checksums.json"}
    assert set(manifest) == on_disk and ".metadata" in manifest
    assert verify_checkpoint(step) is None


@pytest.mark.parametrize("damage", ["truncate", "corrupt", "delete"])
def test_damaged_shard_falls_back_to_the_previous_checkpoint(runs, tmp_path, damage):
    cfg, ckpt, losses, params = runs
    copy = tmp_path / "ckpt"
    _copy_steps(ckpt, copy)
    bad = _shard(copy / "step_000004")
    data = bad.read_bytes()
    if damage == "truncate":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "corrupt":  # same size, one byte flipped
        bad.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    else:
        bad.unlink()
    with pytest.warns(RuntimeWarning, match=f"skipping .*step_000004.*{bad.name}"):
        assert latest_checkpoint(copy) == str(copy / "step_000002")
    if damage != "corrupt":  # a size check on every load; checksums when choosing one
        model = Trainer(cfg.replace(checkpoint_dir=None), device="cpu").model
        with pytest.raises(ValueError, match=f"damaged.*{bad.name}"):
            load_checkpoint(copy / "step_000004", model=model)
    # --resume continues from step 2 and ends where the uninterrupted run ends.
    with pytest.warns(RuntimeWarning, match="skipping"):
        resumed = Trainer(cfg.replace(checkpoint_dir=str(copy), resume=True), device="cpu")
    assert resumed.step == 2
    result = resumed.fit()
    assert result.losses == losses[2:]
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, params[name]), name


def test_resume_with_another_model_config_is_a_clear_error(runs):
    cfg, ckpt, _, _ = runs
    other = cfg.replace(resume=True, model_overrides={"num_layers": 3})
    with pytest.raises(ValueError, match=r"another model configuration.*layers\.2\.") as e:
        Trainer(other, device="cpu")
    assert "model_overrides" in str(e.value)
    wider = cfg.replace(resume=True, model_overrides={"dim": 128})
    with pytest.raises(ValueError, match=r"other shape: .*saved"):
        Trainer(wider, device="cpu")
    assert os.path.isdir(ckpt / "step_000004")  # nothing was touched


def _copy_steps(ckpt: Path, copy: Path) -> None:
    """The checkpoints of steps 2 and 4 of ``ckpt`` copied into ``copy``."""
    for step in ("step_000002", "step_000004"):
        (copy / step).mkdir(parents=True)
        for f in (ckpt / step).iterdir():
            (copy / step / f.name).write_bytes(f.read_bytes())


def _copy_with_a_corrupt_newest(ckpt: Path, copy: Path) -> Path:
    """Steps 2 and 4 copied; one byte of a step-4 shard flipped (same size)."""
    _copy_steps(ckpt, copy)
    bad = _shard(copy / "step_000004")
    data = bad.read_bytes()
    bad.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    return bad


def test_pruning_never_counts_a_corrupt_newest_checkpoint(runs, tmp_path):
    """Its sizes are right, its checksums are not: it used to count as the one kept."""
    _, ckpt, _, _ = runs
    copy = tmp_path / "ckpt"
    _copy_with_a_corrupt_newest(ckpt, copy)
    assert prune_checkpoints(copy, 1) == []  # step 2 is the newest good one
    assert sorted(os.listdir(copy)) == ["step_000002", "step_000004"]


def test_keep_checkpoints_after_resuming_past_a_corrupt_newest_keeps_the_new_ones(runs, tmp_path):
    """--keep-checkpoints 1, resumed from step 2 past a corrupt step 4: each save used
    to remove itself (the corrupt 4 counted as the newest kept, the log said '0 B'),
    leaving only the corrupt one, so the next --resume started at step 0."""
    cfg, ckpt, losses, _ = runs
    copy = tmp_path / "ckpt"
    _copy_with_a_corrupt_newest(ckpt, copy)
    resumed_cfg = cfg.replace(
        steps=3, checkpoint_dir=str(copy), checkpoint_every=1, keep_checkpoints=1, resume=True
    )
    with pytest.warns(RuntimeWarning, match="skipping"):
        resumed = Trainer(resumed_cfg, device="cpu")
    assert resumed.step == 2
    resumed.fit()
    # The step just saved stays; the corrupt step 4 (newer, an earlier run's) is left
    # alone and never counts in its place.
    assert sorted(os.listdir(copy)) == ["step_000003", "step_000004", "train.log"]
    log = (copy / "train.log").read_text()
    saved = [line for line in log.splitlines() if "checkpoint saved to" in line]
    assert len(saved) == 1 and "step_000003 (" in saved[0] and "(0 B" not in saved[0]
    assert saved[0].endswith("; removed step_000002")
    with pytest.warns(RuntimeWarning, match="skipping"):
        assert latest_checkpoint(copy) == str(copy / "step_000003")
    with pytest.warns(RuntimeWarning, match="skipping"):
        again = Trainer(resumed_cfg.replace(steps=4), device="cpu")
    assert again.step == 3
    assert again.fit().losses == losses[3:]  # the run goes on as uninterrupted
    assert sorted(os.listdir(copy)) == ["step_000004", "train.log"]  # saved over the bad 4
    assert verify_checkpoint(copy / "step_000004") is None


def test_a_skipped_checkpoint_warning_names_the_one_used_instead(runs, tmp_path):
    _, ckpt, _, _ = runs
    copy = tmp_path / "ckpt"
    _copy_with_a_corrupt_newest(ckpt, copy)
    with pytest.warns(RuntimeWarning, match=r"using the earlier complete checkpoint .*step_000002"):
        assert latest_checkpoint(copy) == str(copy / "step_000002")


def test_resume_where_every_checkpoint_is_damaged_is_refused_not_a_fresh_start(
    runs, tmp_path, capsys
):
    """The only checkpoint corrupt: --resume used to warn of 'an earlier complete
    checkpoint' (there was none), start at step 0 and save over the damaged one."""
    from hyper_parallel.train.checkpoint import NoIntactCheckpointError
    from hyper_parallel.train.run import main as run

    cfg, ckpt, _, _ = runs
    copy = tmp_path / "ckpt"
    bad = _copy_with_a_corrupt_newest(ckpt, copy)
    shutil.rmtree(copy / "step_000002")  # step 4 (corrupt) is the only one left
    damaged = bad.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning claiming an earlier checkpoint
        with pytest.raises(NoIntactCheckpointError) as e:
            latest_checkpoint(copy)
    message = str(e.value)
    assert f"{copy / 'step_000004'} is damaged: {bad}" in message
    assert "CRC-32" in message and "restore the damaged step folder" in message
    assert "drop --resume and pass --overwrite" in message
    assert e.value.damaged == [(str(copy / "step_000004"), e.value.damaged[0][1])]
    with pytest.raises(NoIntactCheckpointError):
        Trainer(cfg.replace(steps=8, checkpoint_dir=str(copy), resume=True), device="cpu")
    argv = ["--steps", "8", "--batch-size", "4", "--seq-len", "16", "--no-progress"]
    argv += ["--checkpoint-dir", str(copy), "--checkpoint-every", "4", "--resume"]
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert "no intact checkpoint to resume from in --checkpoint-dir" in err
    assert "step_000004 is damaged" in err and "Traceback" not in err
    assert sorted(p.name for p in copy.iterdir() if p.name.startswith("step_")) == ["step_000004"]
    assert bad.read_bytes() == damaged  # nothing saved over it


def test_a_directory_without_complete_checkpoints_still_starts_at_step_0(tmp_path):
    (tmp_path / "step_000004").mkdir()  # a save that died before .metadata: never complete
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "absent") is None
