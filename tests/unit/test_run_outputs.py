"""Writers that never clobber, and the errors a newcomer meets, each said once and clearly.

Every writer (``save_hf`` / ``--save-hf``, ``export-hf``, the trainer's checkpoints)
writes a temporary sibling and renames it when complete; a non-empty target is
refused unless ``--overwrite``, which leaves nothing of the old one; an input's
folder is always refused. A truncated or corrupt safetensors file is one message
naming the file; ``verify-hf`` refused prints no parity line; an empty data file
names ``--batch-size`` and the counts; ``hyper-parallel --help`` names every command.
One process each (the distributed writers are exercised in tests/distributed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from hyper_parallel.checkpoint_hf import HFCheckpointError, load_hf, read_hf_config, save_hf
from hyper_parallel.checkpoint_hf.io import safetensors_problem
from hyper_parallel.checkpoint_hf.outputs import (
    PARTIAL_MARK,
    OutputError,
    check_output,
    staged_output,
)
from hyper_parallel.cli import main as cli
from hyper_parallel.train import TrainConfig, Trainer, save_checkpoint
from hyper_parallel.train.checkpoint import checkpoint_steps, latest_checkpoint
from hyper_parallel.train.run import main as run

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

_EXAMPLE = os.path.join(
    os.path.dirname(__file__), "..", "..", "examples", "hf", "make_tiny_checkpoint.py"
)
TINY = ["--batch-size", "2", "--seq-len", "16", "--no-progress", "--log-every", "0"]


def _write_tiny(out: str, num_layers: int = 1) -> str:
    """A transformers-written Llama with its tokenizer (several safetensors files)."""
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(out, hidden_size=32, num_layers=num_layers, vocab_size=300, max_shard_size="60KB")
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 256}, f)
    return out


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return _write_tiny(str(tmp_path_factory.mktemp("tiny") / "hf"))


def _tiny_model():
    cfg = TrainConfig(model_overrides={"num_layers": 1}, log_every=0, progress=False)
    return Trainer(cfg, device="cpu")


# ---------------------------------------------------------------------- outputs


def test_check_output_refuses_an_input_folder_always_and_a_full_one_without_overwrite(tmp_path):
    data = tmp_path / "in" / "corpus.bin"
    data.parent.mkdir()
    data.write_bytes(b"12")
    for target in (tmp_path / "in", tmp_path):  # the input's folder, or one holding it
        with pytest.raises(OutputError, match=r"input .*corpus\.bin.*even with --overwrite"):
            check_output(target, overwrite=True, inputs=[str(data)], what="--save-hf")
    check_output(tmp_path / "in" / "new", inputs=[str(data)])  # a new folder beside it: fine
    full = tmp_path / "full"
    full.mkdir()
    (full / "a").write_text("x")
    with pytest.raises(
        OutputError, match=r"--save-hf .*full: .*not empty \(1 entries: a\).*--overwrite"
    ):
        check_output(full, what="--save-hf")
    check_output(full, overwrite=True)
    check_output(tmp_path / "missing")


def test_staged_output_leaves_the_target_untouched_on_error_and_replaces_it_whole(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), staged_output(out, overwrite=True) as tmp:
        with open(os.path.join(tmp, "new.txt"), "w") as f:
            f.write("half")
        raise RuntimeError("crash while writing")
    assert sorted(os.listdir(out)) == ["old.txt"] and sorted(os.listdir(tmp_path)) == ["out"]
    with staged_output(out, overwrite=True) as tmp:
        assert not os.path.exists(os.path.join(out, "new.txt"))  # nothing visible yet
        with open(os.path.join(tmp, "new.txt"), "w") as f:
            f.write("whole")
    assert sorted(os.listdir(out)) == ["new.txt"] and sorted(os.listdir(tmp_path)) == ["out"]


def test_folders_beside_the_target_are_never_deleted_unless_this_module_made_them(tmp_path):
    """OUT.old and OUT.partial that are the user's (a backup, or the input itself) stay:
    the old target goes aside under a name of its own, and a OUT.partial without the
    module's mark is refused before anything is written."""
    out, backup, partial = tmp_path / "model", tmp_path / "model.old", tmp_path / "model.partial"
    for folder in (out, backup, partial):
        folder.mkdir()
        (folder / "notes.txt").write_text(folder.name)
    refused = pytest.raises(OutputError, match=r"model\.partial is there and was not left by")
    with refused, staged_output(out, overwrite=True):
        raise AssertionError("not reached")
    with pytest.raises(
        OutputError, match=r"written into .*model\.partial first, which is the input"
    ):
        check_output(out, overwrite=True, inputs=[str(partial)])
    assert (partial / "notes.txt").read_text() == "model.partial"
    partial.rename(tmp_path / "elsewhere")
    with staged_output(out, overwrite=True, inputs=[str(backup)]) as tmp:
        (Path(tmp) / "new.txt").write_text("new")
    assert sorted(os.listdir(out)) == ["new.txt"]  # the module's mark is not left in it
    assert (backup / "notes.txt").read_text() == "model.old"
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "model", "model.old"]
    # A OUT.partial an earlier write left (it carries the mark) is replaced.
    # (Several ranks leave it when one fails: a rank cannot tell the others.)
    partial.mkdir()
    (partial / PARTIAL_MARK).write_text("")
    (partial / "half.txt").write_text("half")
    with staged_output(out, overwrite=True) as tmp:
        (Path(tmp) / "newer.txt").write_text("newer")
    assert sorted(os.listdir(out)) == ["newer.txt"]
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "model", "model.old"]


def test_save_hf_refuses_a_full_folder_and_overwrite_leaves_nothing_stale(tmp_path):
    trainer = _tiny_model()
    out = tmp_path / "hf"
    out.mkdir()
    stale = out / "model-00007-of-00009.safetensors"  # a shard of a larger, older export
    stale.write_bytes(b"old")
    with pytest.raises(OutputError, match="not empty"):
        save_hf(trainer.model, out, model_config=_config())
    assert sorted(os.listdir(out)) == [stale.name]  # untouched
    save_hf(trainer.model, out, model_config=_config(), overwrite=True)
    names = sorted(os.listdir(out))
    assert stale.name not in names and "config.json" in names
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no .partial, no .old left


def _config():
    from hyper_parallel.dmodule.model_spec import get_spec

    return get_spec("llama3-debug").config(num_layers=1)


def test_a_checkpoint_step_appears_complete_or_not_at_all(tmp_path, monkeypatch):
    trainer = _tiny_model()
    path = tmp_path / "step_000001"
    save_checkpoint(path, model=trainer.model, optimizer=trainer.optimizer)
    (path / "stale.distcp").write_bytes(b"x")  # a file the next save of this step lacks
    import torch.distributed.checkpoint as dcp

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", crash)
    with pytest.raises(OSError):
        save_checkpoint(path, model=trainer.model, optimizer=trainer.optimizer)
    assert latest_checkpoint(tmp_path) == str(path)  # the earlier save still stands
    assert sorted(os.listdir(tmp_path)) == ["step_000001"]
    monkeypatch.undo()
    save_checkpoint(path, model=trainer.model, optimizer=trainer.optimizer)
    assert "stale.distcp" not in os.listdir(path)  # replaced whole
    assert sorted(os.listdir(tmp_path)) == ["step_000001"]


def test_keep_checkpoints_keeps_the_newest(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = [*TINY, "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    assert run([*argv, "--keep-checkpoints", "2"]) == 0
    assert [s for s, _ in checkpoint_steps(ckpt)] == [3, 4]


def test_a_new_run_refuses_another_runs_checkpoints_and_save_hf_into_a_full_folder(
    tmp_path, capsys
):
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    argv = [*TINY, "--steps", "2", "--checkpoint-dir", str(ckpt)]
    assert run([*argv, "--save-hf", str(hf)]) == 0
    capsys.readouterr()
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert "holds checkpoints of an earlier run" in err and "--resume" in err
    assert "--overwrite" in err
    assert run([*argv, "--resume", "--steps", "3", "--save-hf", str(hf)]) == 2
    err = capsys.readouterr().err
    assert "--save-hf" in err and "not empty" in err
    assert "export of an earlier start of this run" in err and "--resume --overwrite" in err
    assert "--resume --overwrite" in (ckpt / "config.toml").read_text()
    assert [s for s, _ in checkpoint_steps(ckpt)] == [2]  # nothing ran
    # The fix it names: the run continued, its export replaced.
    assert run([*argv, "--resume", "--overwrite", "--steps", "3", "--save-hf", str(hf)]) == 0
    assert [s for s, _ in checkpoint_steps(ckpt)] == [2, 3]
    # --overwrite: a fresh run, nothing of the old one left.
    assert run([*TINY, "--steps", "1", "--checkpoint-dir", str(ckpt), "--overwrite"]) == 0
    assert [s for s, _ in checkpoint_steps(ckpt)] == [1]


def test_resume_past_steps_is_refused_before_any_output(tmp_path, capsys):
    """--resume --steps 1 onto a step-2 checkpoint printed 'run: steps 3-1 (0)', promised
    the export, rewrote the run's config.toml and exited 0 having written nothing."""
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    argv = [*TINY, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    assert run([*argv, "--steps", "2"]) == 0
    record = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in ckpt.iterdir() if p.is_file()}
    assert "config.toml" in record
    capsys.readouterr()
    assert run([*argv, "--resume", "--steps", "1", "--save-hf", str(hf)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "--steps 1 is below step 2" in err and "step_000002" in err
    assert "--steps > 2" in err and "export-hf" in err and "--save-hf" in err
    assert not hf.exists()
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in ckpt.iterdir() if p.is_file()}
    assert after == record  # config.toml, run.json and train.log untouched
    # A damaged step 2 is passed over as --resume does: step 1 is where it continues,
    # and at --steps 1 the run is complete (its export still written, as on a restart).
    shard = sorted((ckpt / "step_000002").glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    with pytest.warns(RuntimeWarning, match="skipping"):
        assert run([*argv, "--resume", "--steps", "1", "--save-hf", str(hf)]) == 0
    assert (hf / "config.json").is_file()
    log = (ckpt / "train.log").read_text()
    assert "run: nothing to train: resumed at step 1, --steps 1" in log
    # The start lines are true of a resumed run: its weights are the checkpoint's (it said
    # "initialized with seed 0"), and no learning rate is told when no step runs.
    started = log.split("run: nothing to train")[0].rsplit("model: ", 1)[1]
    assert "(weights from the checkpoint " in started and "step_000001)" in started, started
    after = log.split("run: nothing to train")[1].split("log: ")[0]
    assert "lr:" not in after and "step:" not in after, after


def test_export_hf_carries_the_tokenizer_and_never_writes_into_its_checkpoint(tiny_hf, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = [*TINY, "--steps", "1", "--hf-checkpoint", tiny_hf, "--checkpoint-dir", str(ckpt)]
    assert run(argv) == 0
    assert cli(["export-hf", str(ckpt), str(ckpt)]) == 2  # its own folder: refused
    assert cli(["export-hf", str(ckpt / "step_000001"), str(ckpt)]) == 2  # holds it: refused
    # The step folder it reads, even with --overwrite (this deleted the checkpoint once).
    step = ckpt / "step_000001"
    assert cli(["export-hf", str(ckpt), str(step), "--overwrite"]) == 2
    assert cli(["export-hf", str(step), str(step), "--overwrite"]) == 2
    assert [s for s, _ in checkpoint_steps(ckpt)] == [1] and (step / ".metadata").is_file()
    out = tmp_path / "exported"
    assert cli(["export-hf", str(ckpt), str(out)]) == 0
    names = set(os.listdir(out))
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
    assert cli(["export-hf", str(ckpt), str(out)]) == 2  # full: refused
    assert (
        cli(["generate", "--hf-checkpoint", str(out), "--prompt", "First", "--max-new-tokens", "3"])
        == 0
    )
    (out / "junk.safetensors").write_bytes(b"x")
    assert cli(["export-hf", str(ckpt), str(out), "--overwrite"]) == 0
    assert "junk.safetensors" not in os.listdir(out)


def test_overrides_on_a_checkpoint_are_refused_when_they_change_its_weights_and_saved_else(
    tiny_hf, tmp_path, capsys
):
    out, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    two = _write_tiny(str(tmp_path / "two"), num_layers=2)
    # One layer of a two-layer checkpoint: refused before the run (it loaded layer 0,
    # dropped layer 1's tensors unsaid, trained, and failed in --save-hf at the end).
    cut = [*TINY, "--steps", "1", "--hf-checkpoint", two, "--save-hf", str(out)]
    assert run([*cut, "--model-overrides", '{"num_layers": 1}']) == 2
    err = capsys.readouterr().err
    assert "model_overrides {'num_layers': 1}: they change the parameters" in err
    assert "layers.1." in err and "--hf-config" in err and not out.exists()
    argv = [*TINY, "--steps", "1", "--hf-checkpoint", tiny_hf, "--save-hf", str(out)]
    # A rotary base the run trains with is the one config.json says (it kept the source's).
    theta = ["--model-overrides", '{"rope_theta": 100.0}', "--checkpoint-dir", str(ckpt)]
    assert run([*argv, *theta]) == 0
    exported = tmp_path / "exported"
    assert cli(["export-hf", str(ckpt), str(exported)]) == 0
    for folder in (out, exported):
        config = json.loads((folder / "config.json").read_text())
        assert read_hf_config(folder).model_overrides["rope_theta"] == 100.0
        assert config["rope_parameters"]["rope_theta"] == 100.0 and "rope_theta" not in config
        loaded = transformers.AutoConfig.from_pretrained(folder)
        assert loaded.rope_parameters["rope_theta"] == 100.0
        source = json.loads((Path(tiny_hf) / "config.json").read_text())
        assert config["eos_token_id"] == source["eos_token_id"]  # the rest as it was


def test_save_hf_into_the_checkpoint_it_started_from_is_refused(tiny_hf, tmp_path, capsys):
    before = sorted(os.listdir(tiny_hf))
    argv = [*TINY, "--steps", "1", "--hf-checkpoint", tiny_hf, "--save-hf", tiny_hf]
    assert run([*argv, "--overwrite"]) == 2
    assert "is the input" in capsys.readouterr().err
    assert sorted(os.listdir(tiny_hf)) == before


def test_save_hf_never_replaces_a_checkpoint_of_the_run(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    argv = [*TINY, "--steps", "1", "--checkpoint-dir", str(ckpt)]
    assert run(argv) == 0
    step = ckpt / "step_000001"
    before = sorted(os.listdir(step))
    for target in (step, tmp_path):  # a step folder, a folder holding the checkpoints
        capsys.readouterr()
        resumed = [*TINY, "--steps", "2", "--checkpoint-dir", str(ckpt), "--resume"]
        assert run([*resumed, "--save-hf", str(target), "--overwrite"]) == 2
        assert "even with --overwrite" in capsys.readouterr().err
    assert sorted(os.listdir(step)) == before
    assert [s for s, _ in checkpoint_steps(ckpt)] == [1]
    # A new folder inside the checkpoint directory is fine.
    assert (
        run(
            [
                *argv[:-2],
                "--checkpoint-dir",
                str(ckpt),
                "--resume",
                "--steps",
                "2",
                "--save-hf",
                str(ckpt / "hf"),
            ]
        )
        == 0
    )
    assert [s for s, _ in checkpoint_steps(ckpt)] == [1, 2]


class _Built(Exception):
    """The run got past its checks and built a trainer."""


@pytest.fixture
def no_training(monkeypatch):
    """``train.run`` raises :class:`_Built` where it would build the trainer: a refusal
    (exit 2 with no ``_Built``) came before any work."""
    import hyper_parallel.train.run as run_module

    def built(*args, **kwargs):
        raise _Built

    monkeypatch.setattr(run_module, "Trainer", built)


def _refused(argv, capsys) -> str:
    capsys.readouterr()
    assert run(argv) == 2
    return capsys.readouterr().err


def test_metrics_and_grads_out_are_checked_with_the_other_outputs_before_any_work(
    tiny_hf, tmp_path, capsys, no_training
):
    # They were written after the run: over the run's data or its checkpoint's config,
    # or a traceback after all steps (a missing folder, a directory).
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("First Citizen: Before we proceed any further, hear me speak.\n" * 40)
    job = tmp_path / "job.toml"
    job.write_text("steps = 1\n")
    config = Path(tiny_hf) / "config.json"
    before = (corpus.read_text(), config.read_text(), job.read_text())
    base = [*TINY, "--hf-checkpoint", tiny_hf, "--data", str(corpus)]
    for flag in ("--metrics-out", "--grads-out"):
        for target in (corpus, config, job, Path(tiny_hf) / "tokenizer.json"):
            err = _refused([*base, "--config", str(job), flag, str(target), "--overwrite"], capsys)
            assert f"{flag} {target}: it is the input" in err and "even with --overwrite" in err
        err = _refused([*base, flag, str(tmp_path)], capsys)
        assert f"{flag} {tmp_path}: a folder is there; give a file path" in err
        there = tmp_path / "there.json"
        there.write_text("{}")
        err = _refused([*base, flag, str(there)], capsys)
        assert "a file is there already" in err and "--overwrite" in err
        blocked = tmp_path / "a-file" / "m.json"
        (tmp_path / "a-file").write_text("")
        assert "cannot make its folder" in _refused([*base, flag, str(blocked)], capsys)
    assert (corpus.read_text(), config.read_text(), job.read_text()) == before
    same = str(tmp_path / "out.pt")
    err = _refused([*base, "--metrics-out", same, "--grads-out", same], capsys)
    assert f"--grads-out {same}: it is --metrics-out {same}" in err
    # A folder that is not there is made, as every other writer does; the run goes on.
    with pytest.raises(_Built):
        run([*base, "--metrics-out", str(tmp_path / "new" / "m.json")])
    assert (tmp_path / "new").is_dir()
    # A resumed run replaces its own earlier metrics (continued with the same flags); its
    # inputs stay refused.
    resume = ["--resume", "--checkpoint-dir", str(tmp_path / "ck")]
    there.write_text(json.dumps({"config": {"checkpoint_dir": str(tmp_path / "ck")}}))
    with pytest.raises(_Built):
        run([*base, "--metrics-out", str(there), *resume])
    err = _refused([*base, "--metrics-out", str(corpus), *resume], capsys)
    assert f"--metrics-out {corpus}: it is the input" in err


def test_a_resumed_run_replaces_only_its_own_metrics(tmp_path, capsys, no_training):
    """--resume let --metrics-out replace any file: a new run into another
    --checkpoint-dir (--resume with no checkpoint there starts at step 0, as a
    restarting launcher's command line does) wrote over an earlier run's metrics."""
    metrics = tmp_path / "metrics.json"
    earlier = json.dumps({"config": {"checkpoint_dir": str(tmp_path / "a")}, "losses": [1.0]})
    metrics.write_text(earlier)
    argv = [*TINY, "--metrics-out", str(metrics), "--resume", "--checkpoint-dir"]
    err = _refused([*argv, str(tmp_path / "b")], capsys)
    assert (
        f"--metrics-out {metrics}: a file is there, the metrics of a run into "
        f"--checkpoint-dir {tmp_path / 'a'}; --resume replaces only the metrics of the run "
        f"it continues (--checkpoint-dir {tmp_path / 'b'}). Give another path, or pass "
        "--overwrite to replace it."
    ) in err
    other = tmp_path / "notes.json"
    other.write_text("[1, 2]")
    err = _refused(
        [*TINY, "--metrics-out", str(other), "--resume", "--checkpoint-dir", "b"], capsys
    )
    assert f"--metrics-out {other}: a file is there, not metrics a run wrote;" in err
    assert (metrics.read_text(), other.read_text()) == (earlier, "[1, 2]")
    # The run's own (its checkpoint folder, as written or as another path to it), or with
    # --overwrite: the run goes on.
    for folder in (str(tmp_path / "a"), str(tmp_path / "." / "a")):
        with pytest.raises(_Built):
            run([*argv, folder])
    with pytest.raises(_Built):
        run([*argv, str(tmp_path / "b"), "--overwrite"])


def test_a_folder_output_where_a_file_is_is_refused_before_any_work(tmp_path, capsys, no_training):
    """--checkpoint-dir, --run-dir or --tensorboard naming a file (or a path under one) was
    a FileExistsError / NotADirectoryError traceback once the model was built; --save-hf
    under a file was one after the last step, the training lost."""
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    for flag in ("--checkpoint-dir", "--run-dir", "--tensorboard", "--save-hf"):
        err = _refused([*TINY, flag, str(afile)], capsys)
        assert f"{flag} {afile}: a file is there; give a directory." in err
        under = afile / "run" / "x"
        err = _refused([*TINY, flag, str(under)], capsys)
        assert (
            f"{flag} {under}: {afile} is a file, so no directory can be made there; give a "
            "directory path."
        ) in err
    err = _refused([*TINY, "--checkpoint-dir", str(afile), "--resume"], capsys)
    assert f"--checkpoint-dir {afile}: a file is there; give a directory." in err
    assert afile.read_text() == "mine"


def test_a_resume_with_no_step_to_train_keeps_the_metrics(tmp_path):
    """A complete run's command run again with --resume (a requeued job) trains nothing:
    its --metrics-out replaced the run's steps 1-2 with an empty list."""
    metrics = tmp_path / "m.json"
    argv = [*TINY, "--steps", "2", "--checkpoint-dir", str(tmp_path / "ck")]
    assert run([*argv, "--metrics-out", str(metrics)]) == 0
    written = metrics.read_text()
    assert json.loads(written)["steps"] == [1, 2]
    assert run([*argv, "--metrics-out", str(metrics), "--resume"]) == 0
    assert metrics.read_text() == written
    # A resumed run that trains replaces them with its steps (as --help says).
    assert run([*argv, "--steps", "3", "--metrics-out", str(metrics), "--resume"]) == 0
    assert json.loads(metrics.read_text())["steps"] == [3]


def test_a_restart_before_the_first_checkpoint_writes_its_grads_out_again(
    tmp_path, capsys, monkeypatch
):
    """A run given --resume and --grads-out (a restarting launcher's command line) that
    stopped before its first checkpoint: the restart, at step 0 again, was refused 'a file
    is there already' (its first start wrote it), so every restart failed."""
    grads = tmp_path / "g.pt"
    ckpt = tmp_path / "ck"
    argv = [*TINY, "--steps", "1", "--checkpoint-dir", str(ckpt), "--resume"]
    # run.json records the command line (sys.argv) each start was given.
    monkeypatch.setattr("sys.argv", ["train", *argv, "--grads-out", str(grads)])
    assert run([*argv, "--grads-out", str(grads)]) == 0
    shutil.rmtree(ckpt / "step_000001")  # stopped before that save
    grads.write_bytes(b"")
    assert run([*argv, "--grads-out", str(grads)]) == 0
    assert grads.stat().st_size > 0  # the first step's gradients, written again
    # A file no start of this run was given stays refused.
    other = tmp_path / "other.pt"
    other.write_bytes(b"mine")
    shutil.rmtree(ckpt / "step_000001")
    err = _refused([*argv, "--grads-out", str(other)], capsys)
    assert f"--grads-out {other}: a file is there already" in err
    assert other.read_bytes() == b"mine"


def test_a_step_folder_given_as_the_checkpoint_dir_is_refused(tmp_path, capsys, no_training):
    """--checkpoint-dir ck/step_000001 --resume (the checkpoint, not its folder): 'no
    checkpoint in ck/step_000001; starting at step 0', and the run wrote its checkpoints,
    train.log and record into that checkpoint's folder."""
    step = tmp_path / "ck" / "step_000001"
    trainer = _tiny_model()
    save_checkpoint(step, model=trainer.model, optimizer=trainer.optimizer)
    before = sorted(os.listdir(step))
    for resume in (["--resume"], []):
        err = _refused([*TINY, "--checkpoint-dir", str(step), *resume], capsys)
        assert (
            f"--checkpoint-dir {step} is a checkpoint (a step folder of {tmp_path / 'ck'}), "
            "not the folder that holds them: the run would find no checkpoint in it, start "
            f"at step 0 and write into it. Fix: give the folder that holds it, "
            f"--checkpoint-dir {tmp_path / 'ck'}"
        ) in err
        assert ("(--resume continues from its latest checkpoint)" in err) == bool(resume)
    assert sorted(os.listdir(step)) == before
    with pytest.raises(_Built):  # its folder is fine
        run([*TINY, "--checkpoint-dir", str(tmp_path / "ck"), "--resume"])


def test_outputs_that_would_replace_one_another_are_refused_before_any_work(
    tmp_path, capsys, no_training
):
    # --run-dir X --save-hf X trained, then failed at the export (not empty); with
    # --overwrite the export deleted the run's own config.toml and run.json.
    out = tmp_path / "out"
    for flag in ("--run-dir", "--tensorboard"):
        for target in (out, out / "sub"):
            for extra in ([], ["--overwrite"]):
                argv = [*TINY, flag, str(target), "--save-hf", str(out), *extra]
                err = _refused(argv, capsys)
                assert f"{flag} {target}" in err and f"--save-hf {out}" in err
                assert "a directory of its own" in err
    err = _refused([*TINY, "--metrics-out", str(out / "m.json"), "--save-hf", str(out)], capsys)
    assert "lies in --save-hf" in err
    ckpt = tmp_path / "ckpt"
    step = ckpt / "step_000002"
    err = _refused([*TINY, "--checkpoint-dir", str(ckpt), "--run-dir", str(step)], capsys)
    assert "lies in the checkpoint folder step_000002" in err
    err = _refused([*TINY, "--run-dir", str(out), "--metrics-out", str(out / "run.json")], capsys)
    assert "it is the run's record" in err
    assert not out.exists() and not ckpt.exists()
    # What may share a folder still does: the log, checkpoints, events, an export inside.
    with pytest.raises(_Built):
        argv = ["--run-dir", str(out), "--checkpoint-dir", str(out), "--tensorboard", str(out)]
        run([*TINY, *argv, "--save-hf", str(out / "hf"), "--metrics-out", str(out / "m.json")])


def test_a_new_run_refuses_a_run_dir_holding_another_runs_record(tmp_path, capsys):
    # A second run into the same --run-dir replaced the first one's config.toml and run.json.
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = [*TINY, "--steps", "1", "--run-dir", str(run_dir), "--checkpoint-dir", str(ckpt)]
    assert run(argv) == 0
    record = {n: (run_dir / n).read_text() for n in ("config.toml", "run.json")}
    other = [*TINY, "--steps", "1", "--run-dir", str(run_dir)]  # not its checkpoints
    err = _refused(other, capsys)
    assert f"--run-dir {run_dir} holds the record of an earlier run (config.toml, run.json)" in err
    assert "--resume" in err and "--overwrite" in err
    assert {n: (run_dir / n).read_text() for n in record} == record
    # --resume continues it (train.log goes on); --overwrite replaces it.
    assert run([*argv[:-1], str(ckpt), "--resume", "--steps", "2"]) == 0
    assert (run_dir / "train.log").read_text().count("=== run started") == 2
    assert run([*other, "--overwrite"]) == 0
    assert (run_dir / "train.log").read_text().count("=== run started") == 1


def test_the_hugging_face_config_is_read_once_per_run(tiny_hf, tmp_path, monkeypatch):
    # Every reader on the train path (the model, the data's end-of-sequence id, each
    # checkpoint's model record, --save-hf) takes the config read once where the run is
    # built; TrainConfig is data and reads nothing. (load_hf reads the checkpoint's own
    # files, config.json included, through checkpoint_hf.io.)
    import hyper_parallel.checkpoint_hf.config as hf_config

    reads = []
    real = hf_config.read_hf_config

    def counting(source):
        reads.append(source)
        return real(source)

    monkeypatch.setattr(hf_config, "read_hf_config", counting)
    cfg = TrainConfig(hf_checkpoint=tiny_hf, steps=2)
    assert reads == [] and cfg.model == "llama3-debug"  # not resolved: data only
    text = tmp_path / "a.txt"
    text.write_text("First Citizen: before we proceed any further, hear me speak.\n" * 20)
    argv = [*TINY, "--steps", "2", "--hf-checkpoint", tiny_hf, "--data", str(text)]
    argv += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    argv += ["--save-hf", str(tmp_path / "out")]
    assert run(argv) == 0
    assert reads == [tiny_hf]
    assert [s for s, _ in checkpoint_steps(tmp_path / "ckpt")] == [1, 2]
    record = json.loads((tmp_path / "out" / "config.json").read_text())
    assert record["hidden_size"] == 32


# ---------------------------------------------------------------------- bad inputs


def _damaged_copy(tiny_hf, tmp_path, how):
    copy = str(tmp_path / "damaged")
    shutil.copytree(tiny_hf, copy)
    with open(os.path.join(copy, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shard = os.path.join(copy, sorted(set(index["weight_map"].values()))[-1])
    size = os.path.getsize(shard)
    if how == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(size - 1000)
    else:
        with open(shard, "r+b") as f:
            f.seek(8)
            f.write(b"\x00garbage")
    return copy, shard


@pytest.mark.parametrize("how", ["truncated", "corrupt"])
def test_a_damaged_safetensors_file_is_one_message_naming_it(tiny_hf, tmp_path, capsys, how):
    copy, shard = _damaged_copy(tiny_hf, tmp_path, how)
    problem = safetensors_problem(shard)
    assert shard in problem and (
        "truncated" in problem if how == "truncated" else "damaged header" in problem
    )
    cfg = read_hf_config(copy)
    model = cfg.model_config().build()
    with pytest.raises(HFCheckpointError, match=os.path.basename(shard)):
        load_hf(model, copy)
    assert run([*TINY, "--steps", "1", "--hf-checkpoint", copy]) == 2
    captured = capsys.readouterr()
    assert captured.err.count(os.path.basename(shard)) == 1, captured.err
    assert "Traceback" not in captured.err and "SafetensorError" not in captured.err
    assert cli(["verify-hf", copy, "--mesh", "tp=2"]) == 2
    captured = capsys.readouterr()
    assert os.path.basename(shard) in captured.err
    assert "parity:" not in captured.out + captured.err


def test_verify_hf_refused_prints_the_refusal_and_no_parity_line(tiny_hf, capsys):
    assert cli(["verify-hf", tiny_hf, "--mesh", "tp=3"]) == 2
    captured = capsys.readouterr()
    assert "problem" in captured.err and "parity:" not in captured.out + captured.err


def test_verify_hf_names_a_config_of_model_type_only(tiny_hf, tmp_path, capsys, monkeypatch):
    """A config.json written by code names only its model_type: the banner names that
    (the ranks are not started here: their launch is replaced by a failing one)."""
    import subprocess

    from hyper_parallel.hf_commands import verify

    copy = str(tmp_path / "typed")
    shutil.copytree(tiny_hf, copy)
    with open(os.path.join(copy, "config.json")) as f:
        config = json.load(f)
    del config["architectures"]
    with open(os.path.join(copy, "config.json"), "w") as f:
        json.dump(config, f)
    launched = subprocess.CompletedProcess([], 3)
    monkeypatch.setattr(verify.subprocess, "run", lambda *a, **k: launched)
    assert cli(["verify-hf", copy, "--mesh", "tp=2"]) == 3
    captured = capsys.readouterr()
    assert f"verify-hf: {copy} (llama) on tp=2" in captured.out
    assert "the ranks failed" in captured.err and "Traceback" not in captured.err


def test_verify_hf_too_long_a_sequence_says_a_shorter_seq_len(tiny_hf, capsys):
    """verify-hf has no --model-overrides: the fix it prints is its own --seq-len."""
    assert cli(["verify-hf", tiny_hf, "--mesh", "tp=2", "--seq-len", "100000"]) == 2
    err = capsys.readouterr().err
    assert "seq_len 100,000 exceeds" in err and "Fix: give --seq-len 256 or less" in err
    assert "1 problem(s) with the run on --mesh tp=2:" in err  # not "with --mesh": seq-len's
    assert "--model-overrides" not in err and "parity:" not in err


def test_pre_launch_errors_are_said_by_rank_0_only(tmp_path, capsys, monkeypatch):
    argv = [*TINY, "--steps", "1", "--min-lr", "1.0"]
    monkeypatch.setenv("RANK", "1")
    assert run(argv) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert run(argv) == 2
    assert "--min-lr 1.0 must be between 0 and --lr" in capsys.readouterr().err


def test_an_empty_or_short_data_file_names_the_real_flags_and_counts(tiny_hf, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    argv = [*TINY, "--steps", "1", "--hf-checkpoint", tiny_hf]
    assert run([*argv, "--data", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "corpus is empty" in err and "1 document(s), none holding any text" in err
    short = tmp_path / "short.npy"
    np.save(short, np.arange(20))
    assert run([*argv, "--data", str(short)]) == 2
    err = capsys.readouterr().err
    assert "20 token(s)" in err and "--batch-size 2 x --seq-len 16 + 1 = 33" in err
    assert "lower --batch-size to 1" in err and "--global-batch-size" not in err


def test_generate_prints_the_prompt_and_escapes_control_characters(tiny_hf, capsys):
    from hyper_parallel.hf_commands.commands import printable

    assert printable("a\x1b[2Jb\x00c\nd\te") == "a\\x1b[2Jb\\x00c\nd\te"
    assert printable("café — ok") == "café — ok"  # only control characters change
    argv = ["generate", "--hf-checkpoint", tiny_hf, "--prompt", "First", "--max-new-tokens", "8"]
    assert cli(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("First")
    assert all(ch in "\n\t" or (ord(ch) >= 32 and ord(ch) != 127) for ch in out)


def test_help_names_every_command(capsys):
    from hyper_parallel.cli import _parser

    parser = _parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert {"plan", "validate", "demo", "suggest", "train", "export-hf", "generate"} <= set(
        commands
    )
    with pytest.raises(SystemExit):
        cli(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in commands:
        assert f" {name}" in text
    assert "plan, validate and demo." not in text
    assert cli(["train", *TINY, "--steps", "1"]) == 0


def test_strided_shard_gather_warning_is_filtered_and_nothing_else(caplog):
    import logging

    from torch.distributed.tensor import Replicate, Shard

    from hyper_parallel._torch_private import StridedShard
    from hyper_parallel._warnings import _LOGGER, quiet_strided_gather

    quiet_strided_gather()
    quiet_strided_gather()  # once
    logger = logging.getLogger(_LOGGER)
    assert sum(type(f).__name__ == "_StridedGatherFilter" for f in logger.filters) == 1
    fmt = "While redistributing from %s to %s, %d sequential %s operations. %s"
    with caplog.at_level(logging.WARNING, logger=_LOGGER):
        strided = (StridedShard(0, split_factor=2), Shard(0))
        logger.warning(fmt, strided, (Replicate(), Replicate()), 2, "all_gather", "")
        logger.warning(fmt, (Shard(0), Shard(1)), (Replicate(), Replicate()), 2, "all_gather", "")
    assert len(caplog.records) == 1 and "Shard(dim=1)" in caplog.records[0].getMessage()


def test_a_model_the_checkpoint_replaces_is_said(tiny_hf, capsys, no_training):
    """--model M with --hf-checkpoint: the checkpoint's config.json decides the model and
    M's --model-overrides were dropped, silently."""
    argv = [*TINY, "--hf-checkpoint", tiny_hf, "--steps", "1"]
    with pytest.raises(_Built):
        run([*argv, "--model", "qwen3-debug", "--model-overrides", '{"rope_theta": 1000.0}'])
    out = capsys.readouterr().out
    assert "note: --model qwen3-debug and its --model-overrides not used" in out, out
    assert f"the model is --hf-checkpoint {tiny_hf}'s" in out
    with pytest.raises(_Built):  # the checkpoint alone: nothing to say
        run(argv)
    assert "note: --model" not in capsys.readouterr().out


def test_resume_keeps_the_record_of_the_steps_before_it(tmp_path, capsys):
    """A resumed run rewrote config.toml and run.json: the options and command of the
    steps before the resume were lost (a run resumed with another --lr could not be
    re-run from its record)."""
    ckpt = tmp_path / "ckpt"
    argv = [*TINY, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    assert run([*argv, "--steps", "2", "--lr", "1e-3"]) == 0
    first = (ckpt / "config.toml").read_text()
    assert run([*argv, "--steps", "3", "--lr", "5e-4", "--resume"]) == 0
    kept = ckpt / "config.before_step_000002.toml"
    assert kept.read_text() == first  # the options of steps 1-2, header and all
    assert "lr = 0.0005" in (ckpt / "config.toml").read_text()
    record = json.loads((ckpt / "run.json").read_text())
    assert record["resumed_from"] == 2 and record["config"]["lr"] == 5e-4
    assert [e["config"]["lr"] for e in record["earlier"]] == [1e-3]
    # Resumed again with the same options (longer: the schedule kept, steps 1-3 re-run
    # from either record alike): nothing else kept aside, one more start listed.
    assert run([*argv, "--steps", "4", "--lr", "5e-4", "--resume"]) == 0
    assert sorted(p.name for p in ckpt.glob("config*.toml")) == [kept.name, "config.toml"]
    record = json.loads((ckpt / "run.json").read_text())
    assert [e["config"]["lr"] for e in record["earlier"]] == [1e-3, 5e-4]
    assert record["resumed_from"] == 3
    # Only --steps longer, from a first run's record (no lr-schedule-steps line): the same.
    other = tmp_path / "other"
    argv = [*TINY, "--checkpoint-dir", str(other), "--checkpoint-every", "1"]
    assert run([*argv, "--steps", "2"]) == 0
    assert run([*argv, "--steps", "3", "--resume"]) == 0
    assert [p.name for p in other.glob("config*.toml")] == ["config.toml"]


def test_a_second_resume_from_the_same_step_keeps_the_record_of_the_steps_before_it(tmp_path):
    """A resumed start that stopped before its next checkpoint, resumed again from the
    same step with other options: its config.toml replaced config.before_step_N.toml, so
    the record of steps 1-N named the stopped start's options (weight decay 0.05 where
    those steps ran at 0.1)."""
    ckpt = tmp_path / "ckpt"
    argv = [*TINY, "--checkpoint-dir", str(ckpt), "--steps", "4", "--lr-schedule-steps", "4"]
    assert run([*argv, "--steps", "2"]) == 0
    first = (ckpt / "config.toml").read_text()
    # Resumed with --weight-decay 0.05; it stops before any checkpoint (a crash).
    assert run([*argv, "--weight-decay", "0.05", "--resume"]) == 0
    kept = ckpt / "config.before_step_000002.toml"
    assert kept.read_text() == first
    shutil.rmtree(ckpt / "step_000004")
    # Resumed again from step 2, with --weight-decay 0.02.
    assert run([*argv, "--weight-decay", "0.02", "--resume"]) == 0
    assert kept.read_text() == first  # steps 1-2 ran at 0.1
    assert "weight-decay = 0.02" in (ckpt / "config.toml").read_text()
    record = json.loads((ckpt / "run.json").read_text())
    assert [e["config"]["weight_decay"] for e in record["earlier"]] == [0.1, 0.05]
    assert record["resumed_from"] == 2 and record["config"]["weight_decay"] == 0.02


def test_a_new_run_refuses_a_tensorboard_folder_holding_another_runs_events(tmp_path, capsys):
    """Two runs given the same --tensorboard folder: TensorBoard read both event files as
    one run, the second run's steps 1, 2 drawn over the first's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    argv = [*TINY, "--steps", "2", "--tensorboard", str(tb)]
    assert run(argv) == 0
    before = sorted(os.listdir(tb))
    assert len(before) == 1
    err = _refused([*argv, "--lr", "1e-2"], capsys)
    assert f"--tensorboard {tb} holds TensorBoard events of an earlier run (1 file(s)" in err
    assert os.path.join(str(tb), "NAME") in err and "--resume" in err and "--overwrite" in err
    assert sorted(os.listdir(tb)) == before  # nothing written
    # A folder of its own for the second run: its own curve.
    assert run([*argv[:-1], str(tb / "second"), "--lr", "1e-2"]) == 0
    # --overwrite starts the run over: one value per step.
    assert run([*argv, "--overwrite"]) == 0
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]


def test_run_json_records_the_command_the_run_was_given(tmp_path):
    # train.run.main(argv) from Python recorded its caller's sys.argv (pytest's options).
    argv = [*TINY, "--steps", "1", "--run-dir", str(tmp_path / "run")]
    assert run(argv) == 0
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["argv"] == ["python -m hyper_parallel.train.run", *argv]
