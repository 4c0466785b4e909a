"""``export-hf`` and ``generate --checkpoint`` on a damaged trainer checkpoint (one process).

A step folder given directly is checked against its checksums manifest as a
checkpoint directory is (a corrupt shard used to be exported silently), and a
shard torch cannot read is one message naming the file and the fix, not a
traceback. A ``--model`` / ``--model-overrides`` other than the model the checkpoint
records is refused, not ignored. Nothing is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from hyper_parallel.cli import main as cli
from hyper_parallel.train import TrainConfig, Trainer

TINY = {"batch_size": 4, "seq_len": 16, "log_every": 0, "progress": False}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Checkpoints of steps 1 and 2 of a tiny run."""
    path = tmp_path_factory.mktemp("ckpt")
    cfg = TrainConfig(steps=2, checkpoint_dir=str(path), checkpoint_every=1, **TINY)
    Trainer(cfg, device="cpu").fit()
    return path


def _flip(step: Path, fqn: str, where: int) -> Path:
    """One byte of ``fqn``'s stored item flipped, ``where`` bytes into it (< 0: from its end)."""
    storage = dcp.FileSystemReader(str(step)).read_metadata().storage_data
    (info,) = [v for k, v in storage.items() if k.fqn == fqn]
    shard = step / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + (where if where >= 0 else info.length + where)] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def _copy(ckpt: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    return copy


def _commands(step: Path, out: Path) -> list[list[str]]:
    generate = ["generate", "--checkpoint", str(step), "--prompt", "hi", "--max-new-tokens", "2"]
    return [["export-hf", str(step), str(out)], generate]


def test_a_corrupt_step_folder_is_refused_naming_the_file(ckpt, tmp_path, capsys):
    copy = _copy(ckpt, tmp_path)
    step = copy / "step_000002"
    shard = _flip(step, "model.output.weight", 4000)  # inside lm_head's data
    out = tmp_path / "out"
    for argv in _commands(step, out):
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{argv[0]}: error: checkpoint {step} is damaged: {shard}" in err
        assert "does not match its saved CRC-32 (corrupted)" in err
        assert f"restore it from a copy, or give the checkpoint directory {copy}" in err
        assert not out.exists()
    # The checkpoint directory uses step 1 instead, as before.
    with pytest.warns(RuntimeWarning, match=r"skipping .*step_000002.*using .*step_000001"):
        assert cli(["export-hf", str(copy), str(out)]) == 0


def test_an_unreadable_shard_is_one_message_not_a_traceback(ckpt, tmp_path, capsys):
    """No checksums manifest (an older checkpoint) and a zip header flipped: torch's
    reader fails; that used to escape as a raw traceback."""
    copy = _copy(ckpt, tmp_path)
    step = copy / "step_000002"
    (step / "checksums.json").unlink()
    shard = _flip(step, "model.output.weight", -20)  # the item's zip directory
    out = tmp_path / "out"
    for argv in _commands(step, out):
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{argv[0]}: error: checkpoint {step} could not be read (" in err
        assert "one of its files is damaged (" in err and str(shard) in err
        assert "Fix: restore it from a copy" in err and "Traceback" not in err
        assert not out.exists()


def test_a_checkpoint_directory_with_no_intact_step_names_each(ckpt, tmp_path, capsys):
    copy = _copy(ckpt, tmp_path)
    shards = [_flip(copy / s, "model.output.weight", 4000) for s in ("step_000001", "step_000002")]
    assert cli(["export-hf", str(copy), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"export-hf: error: no intact checkpoint in {copy}:" in err
    assert all(str(s) in err for s in shards) and "neither a complete checkpoint" not in err
    assert "restore the damaged step folder(s) from a copy" in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--model", "qwen3-debug"], "--model qwen3-debug differs from what checkpoint"),
        (["--model-overrides", '{"num_layers": 3}'], '--model-overrides {"num_layers": 3} differs'),
    ],
)
def test_export_hf_refuses_a_model_other_than_the_recorded_one(
    ckpt, tmp_path, capsys, flags, named
):
    """--model qwen3-debug on a llama3-debug checkpoint used to be ignored without a word
    (the export said model_type llama)."""
    out = tmp_path / "out"
    assert cli(["export-hf", str(ckpt), str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and "records (" in err and f"Fix: drop {flags[0]}" in err
    assert not out.exists()
    # The recorded model, given again, is no conflict.
    assert cli(["export-hf", str(ckpt), str(out), "--model", "llama3-debug"]) == 0
