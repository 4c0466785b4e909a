"""A trainer that says what it does: start summary, events, log file, LR schedules, eval loss.

One process each; the numbers checked are computed here from the same definitions
(the schedule's formulas, the model's loss on the held-out batches).
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
import torch

from hyper_parallel.train import TrainConfig, Trainer
from hyper_parallel.train.run import main as run
from hyper_parallel.train.schedule import WSD_DECAY_FRACTION, lr_at
from hyper_parallel.train.tokens import write_token_file

TINY = {"batch_size": 2, "seq_len": 16, "progress": False, "log_every": 1}


# ---------------------------------------------------------------------- schedules


def test_each_schedule_warms_up_then_decays_to_min_lr_and_stays_there():
    kw = {"lr": 1.0, "warmup_steps": 2, "total_steps": 12, "min_lr": 0.1}
    for name in ("cosine", "linear", "constant", "wsd"):
        lrs = [lr_at(s, schedule=name, **kw) for s in range(16)]
        assert lrs[:2] == [0.5, 1.0]  # linear warm-up
        assert all(a >= b for a, b in itertools.pairwise(lrs[1:])), name  # never rises
        final = 1.0 if name == "constant" else 0.1
        assert lrs[12:] == pytest.approx([final] * 4), name  # past the end: the final rate
    # cosine: half-way between the peak and min_lr at the middle of the decay
    assert lr_at(7, schedule="cosine", **kw) == pytest.approx(0.55)
    assert lr_at(7, schedule="linear", **kw) == pytest.approx(1.0 - 0.9 * 5 / 10)
    # wsd: flat until the last 20 % of the steps, then linear
    start = 12 - round(WSD_DECAY_FRACTION * 12)
    assert [lr_at(s, schedule="wsd", **kw) for s in range(2, start + 1)] == [1.0] * (start - 1)
    assert lr_at(start + 1, schedule="wsd", **kw) < 1.0


def test_a_schedule_the_warm_up_fills_runs_at_min_lr_past_its_end():
    """warmup_steps >= total_steps leaves no decay: the steps past the end (a resumed
    run's) run at the final rate, not at the peak and then the final rate. A warm-up
    longer than the schedule stops at its end (it went on to the peak past it: a 2-step
    run resumed with --steps 3 ran step 3 at the peak, where the docs say --min-lr)."""
    for warmup, total in ((3, 3), (4, 3), (3, 2)):
        kw = {"lr": 1.0, "warmup_steps": warmup, "total_steps": total, "min_lr": 0.1}
        for name in ("cosine", "linear", "wsd"):
            lrs = [lr_at(s, schedule=name, **kw) for s in range(8)]
            assert lrs[:total] == pytest.approx([(s + 1) / warmup for s in range(total)])
            assert lrs[total:] == pytest.approx([0.1] * (8 - total)), (name, warmup, total)
        assert [lr_at(s, schedule="constant", **kw) for s in range(total, 8)] == [1.0] * (8 - total)
    # The trainer's default warm-up (3 steps) on a 2-step run: step 3 is past the end.
    cfg = TrainConfig(steps=2)
    assert cfg.lr_at(2) == pytest.approx(0.1 * cfg.lr)
    # The start summary names no peak the warm-up does not reach within the schedule.
    from hyper_parallel.train.report import lr_line

    cfg = TrainConfig(steps=6, warmup_steps=4, lr_schedule_steps=2)
    line = lr_line(cfg, 0)
    assert "peak" not in line, line
    assert _rates_said(line) == pytest.approx({1: cfg.lr_at(0), 6: cfg.lr_at(5)}), line


def test_default_schedule_is_cosine_to_a_tenth_as_before():
    cfg = TrainConfig(steps=10, warmup_steps=2, lr=1e-3)
    for step in range(12):
        progress = min(1.0, max(0, step - 2) / 8)
        old = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        expected = 1e-3 * (step + 1) / 2 if step < 2 else old
        assert cfg.lr_at(step) == pytest.approx(expected, rel=1e-12)


def test_bad_schedule_options_name_the_flag():
    with pytest.raises(ValueError, match=r"--min-lr 0.5 must be between 0 and --lr 0.1"):
        TrainConfig(lr=0.1, min_lr=0.5)
    with pytest.raises(ValueError, match=r"--lr-schedule 'cosin' is not a schedule"):
        TrainConfig(lr_schedule="cosin")
    with pytest.raises(ValueError, match=r"--eval-data: evaluation under pp > 1"):
        TrainConfig(eval_data="x.bin", mesh={"pp": 2})
    with pytest.raises(ValueError, match=r"--keep-checkpoints -1 must be >= 0"):
        TrainConfig(keep_checkpoints=-1)


def test_a_resumed_run_keeps_its_schedule_and_says_so_once(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    cfg = TrainConfig(steps=6, warmup_steps=1, checkpoint_dir=ckpt, **TINY)
    first = Trainer(cfg, device="cpu")
    first.fit()
    last = first.cfg.lr_at(5)  # the rate of step 6
    final = 0.1 * cfg.lr  # where the schedule ends (min_lr)
    capsys.readouterr()
    # --resume --steps 9 after 6 steps: the LR does not jump back up (it stays at the
    # schedule's final value), and the run says so once.
    resumed = Trainer(cfg.replace(steps=9, resume=True), device="cpu")
    assert [resumed.cfg.lr_at(s) for s in range(6, 9)] == pytest.approx([final] * 3)
    assert final < last  # it goes on down, not back up (the bug: a recomputed cosine)
    resumed.fit()
    out = capsys.readouterr().out
    assert out.count("keeps the cosine schedule of 6 steps") == 1
    assert "--lr-schedule-steps 9" in out
    lrs = [float(line.split("| lr ")[1].split()[0]) for line in out.splitlines() if "| lr " in line]
    assert lrs == pytest.approx([final] * 3, rel=1e-2)
    # Told otherwise: the schedule is stretched to the new length, without the note.
    stretched = Trainer(cfg.replace(steps=12, resume=True, lr_schedule_steps=12), device="cpu")
    assert stretched.cfg.lr_at(9) > final and stretched.cfg.lr_at(6) > last
    stretched.fit()
    assert "keeps the" not in capsys.readouterr().out


def _rates_said(line):
    """``{step: rate}`` of every "R at step K" in a summary or note line."""
    found = re.findall(r"(\d\.\d\de[-+]\d\d) at step (\d+)", line)
    return {int(k): float(r) for r, k in found}


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_the_lr_line_names_the_rates_the_optimizer_steps_at(tmp_path, capsys, schedule):
    ckpt = str(tmp_path / "ckpt")
    cfg = TrainConfig(steps=6, warmup_steps=2, lr_schedule=schedule, checkpoint_dir=ckpt, **TINY)
    got = {}
    trainer = Trainer(cfg, device="cpu")
    # The rate each step ran at, read back from the optimizer after the step.
    trainer.step_callback = lambda step, loss: got.setdefault(
        step, trainer.optimizer.param_groups[0]["lr"]
    )
    trainer.fit()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("lr: "))
    said = _rates_said(line)
    assert set(said) >= {1, 6}, line
    for step, rate in said.items():
        assert rate == pytest.approx(got[step], rel=5e-3), (line, got)  # printed to 3 digits
    # Resumed with more steps: the note names the rate the steps past the end get.
    resumed = Trainer(cfg.replace(steps=8, resume=True), device="cpu")
    resumed.step_callback = lambda step, loss: got.setdefault(
        step, resumed.optimizer.param_groups[0]["lr"]
    )
    resumed.fit()
    out = capsys.readouterr().out
    note = next(x for x in out.splitlines() if "keeps the" in x)
    rate = float(re.search(r"past its end, steps 7-8 run at (\S+?)[; (]", note).group(1))
    assert rate == pytest.approx(got[7], rel=5e-3) and got[7] == got[8], (note, got)
    for step, said_rate in _rates_said(
        next(x for x in out.splitlines() if x.startswith("lr: "))
    ).items():
        assert said_rate == pytest.approx(got[step], rel=5e-3)


def _note_rates(note):
    """``{step: rate}`` of every "step K runs at R" / "steps K-L at R" in a resume note."""
    out = {}
    for a, b, rate in re.findall(
        r"steps? (\d+)(?:-(\d+))? (?:runs? )?at (\d\.\d\de[-+]\d\d)", note
    ):
        for k in range(int(a), int(b or a) + 1):
            out[k] = float(rate)
    return out


@pytest.mark.parametrize(("steps", "warmup", "more"), [(2, 3, 4), (3, 3, 5), (6, 1, 8)])
def test_a_resume_note_names_each_steps_rate_past_the_schedule(
    tmp_path, capsys, steps, warmup, more
):
    """The note says the rate every resumed step gets, a warm-up longer than the schedule
    included (it said 'steps 3-4, past its end, run at 3.00e-03' where step 4 ran at
    3.00e-04)."""
    cfg = TrainConfig(steps=steps, warmup_steps=warmup, checkpoint_dir=str(tmp_path), **TINY)
    Trainer(cfg, device="cpu").fit()
    capsys.readouterr()
    resumed = Trainer(cfg.replace(steps=more, resume=True), device="cpu")
    got = {}
    resumed.step_callback = lambda step, loss: got.setdefault(
        step, resumed.optimizer.param_groups[0]["lr"]
    )
    resumed.fit()
    note = next(x for x in capsys.readouterr().out.splitlines() if "keeps the" in x)
    said = _note_rates(note.split("past its end, ")[1])
    assert set(said) == set(range(steps + 1, more + 1)) == set(got), note
    for step, rate in said.items():
        assert rate == pytest.approx(got[step], rel=5e-3), (note, got)


# ---------------------------------------------------------------------- summary and events


@pytest.fixture
def small_data(tmp_path):
    """100 tokens: 3 steps of 2 x 16 per pass, so a 7-step run wraps twice."""
    tokens = np.random.default_rng(0).integers(0, 256, 100).astype(np.uint16)
    return write_token_file(tokens, str(tmp_path / "small.bin"))


def test_the_start_summary_events_and_log_file(tmp_path, small_data, capsys):
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    argv = ["--steps", "7", "--batch-size", "2", "--seq-len", "16", "--no-progress"]
    argv += ["--data", small_data, "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"]
    assert (
        run([*argv, "--save-hf", str(hf), "--lr-schedule", "wsd", "--keep-checkpoints", "1"]) == 0
    )
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("model: llama3-debug (preset, initialized with seed 0), ")
    assert "parameters" in lines[0]
    assert lines[1].startswith("mesh: one device (1 rank(s) on cpu), dtype fp32")
    assert f"data: {small_data}: 100 tokens, 6 sequences of 16 (3 step(s) per pass)" in out
    assert "run: steps 1-7 (7) x 2 sequences x 16 tokens = 224 tokens, 2.33 pass(es)" in out
    assert "the data starts over every 3 step(s)" in out
    # wsd over 7 steps decays over its last step: step 7 still runs at the peak (the
    # line used to say "down to 3.00e-04 at step 7", a rate no step got).
    assert (
        "lr: wsd over 7 step(s), 3 of warm-up: 1.00e-03 at step 1, peak 3.00e-03 at step 3, "
        "3.00e-03 at step 7" in out
    )
    assert f"checkpoints: every 3 steps and at the end, to {ckpt}, keeping the newest 1" in out
    assert f"export: Hugging Face checkpoint to {hf} at the end" in out
    assert f"log: {ckpt / 'train.log'}" in out
    # events
    # 3 batches of 2 x 16 tokens (+1 target) read 97 of the 100; it said "every one of
    # its 100 tokens was seen".
    assert (
        "step 4: the data starts over (pass 2; 97 of its 100 tokens were seen; the last 3 "
        "do not fill a batch)" in out
    )
    assert "step 7: the data starts over (pass 3;" in out
    assert f"step 3: checkpoint saved to {ckpt / 'step_000003'} (" in out
    assert (
        f"step 6: checkpoint saved to {ckpt / 'step_000006'} (" in out
        and "removed step_000003" in out
    )
    assert f"step 7: Hugging Face checkpoint written to {hf} (1 safetensors file(s)" in out
    # the log file holds every line printed
    log = (ckpt / "train.log").read_text()
    assert log.startswith("=== run started ")
    for line in lines:
        assert line in log, line


def test_a_hf_start_names_its_checkpoint(tmp_path, capsys):
    from tests.distributed.hf_checks import write_checkpoint

    pytest.importorskip("transformers")
    path = write_checkpoint("llama", str(tmp_path / "hf"), vocab_size=256)  # bytes: no tokenizer
    assert run(["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--no-progress",
                "--hf-checkpoint", path]) == 0  # fmt: skip
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"model: llama3-hf (weights from the Hugging Face checkpoint {path})")


def test_quiet_runs_stay_quiet_but_still_log_to_the_run_dir(tmp_path, capsys):
    cfg = TrainConfig(steps=2, run_dir=str(tmp_path / "run"), **{**TINY, "log_every": 0})
    Trainer(cfg, device="cpu").fit()
    assert capsys.readouterr().out == ""
    assert "model: llama3-debug" in (tmp_path / "run" / "train.log").read_text()


# ---------------------------------------------------------------------- evaluation


def test_eval_loss_is_the_mean_loss_over_the_held_out_batches(tmp_path, capsys):
    rng = np.random.default_rng(1)
    held_out = write_token_file(rng.integers(0, 256, 70).astype(np.uint16), str(tmp_path / "e.bin"))
    cfg = TrainConfig(steps=4, eval_data=held_out, eval_every=2, **TINY)
    trainer = Trainer(cfg, device="cpu")
    trainer.fit()
    evals = [line for line in capsys.readouterr().out.splitlines() if "eval loss" in line]
    assert [line.split("/")[0].split()[-1] for line in evals] == ["2", "4"]
    reported = float(evals[-1].split("eval loss ")[1])
    # The same batches by hand: 70 tokens hold 2 global batches of 2 x 16 (+1).
    tokens = torch.from_numpy(np.fromfile(held_out, dtype=np.uint16).astype(np.int64))
    losses = []
    with torch.no_grad():
        for k in range(2):
            window = tokens[k * 32 : k * 32 + 33]
            rows = torch.stack([window[0:17], window[16:33]])
            logits = trainer.model(rows[:, :-1])
            losses.append(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
            )
    assert reported == pytest.approx(float(torch.stack(losses).mean()), abs=5e-5)


def test_eval_loss_goes_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rng = np.random.default_rng(1)
    held_out = write_token_file(rng.integers(0, 256, 70).astype(np.uint16), str(tmp_path / "e.bin"))
    tb = tmp_path / "tb"
    cfg = TrainConfig(steps=3, eval_data=held_out, eval_every=2, tensorboard=str(tb), **TINY)
    Trainer(cfg.replace(log_every=0), device="cpu").fit()
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 3]


def test_eval_split_holds_out_the_last_share_of_the_data(tmp_path, capsys):
    tokens = np.random.default_rng(2).integers(0, 256, 200).astype(np.uint16)
    path = write_token_file(tokens, str(tmp_path / "d.bin"))
    cfg = TrainConfig(steps=2, data=path, eval_split=0.25, **TINY)
    trainer = Trainer(cfg, device="cpu")
    assert len(trainer.data.tokens) == 150  # trained on the first 75 %
    held = trainer.report.eval_data
    assert np.array_equal(np.asarray(held.array), tokens[150:])
    trainer.fit()
    out = capsys.readouterr().out
    assert "data: " in out and "150 tokens (and 50 held out for eval)" in out
    assert "eval: the last 25% of the data, 1 batch(es), at the end" in out
    assert out.count("eval loss") == 1
    with pytest.raises(ValueError, match=r"--eval-split 0.99: the training part \(2 tokens\)"):
        Trainer(cfg.replace(eval_split=0.99), device="cpu")
    with pytest.raises(ValueError, match=r"--eval-split 1.5 must be between 0 and 1"):
        cfg.replace(eval_split=1.5)


# ---------------------------------------------------------------------- how a step runs


def test_the_summary_says_how_a_step_runs_its_batch_and_what_it_does_not_use(capsys):
    cfg = TrainConfig(steps=1, microbatches=2, schedule="GPipe", **{**TINY, "batch_size": 4})
    Trainer(cfg, device="cpu").fit()
    out = capsys.readouterr().out
    assert (
        "step: gradient accumulation, 2 micro-batches of 2 sequence(s) per data-parallel rank, "
        "run in turn; gradients summed over them" in out
    )
    assert (
        "note: switches: schedule: schedule='GPipe' shapes a pipeline, but the mesh has no pp "
        "axis (pp=1): the run has no pipeline and does not use it." in out
    )
    # One forward of the batch: no step line, no note.
    Trainer(TrainConfig(steps=1, **TINY), device="cpu").fit()
    out = capsys.readouterr().out
    assert "step:" not in out.replace("step    ", "") and "note:" not in out


def test_text_options_data_makes_unused_are_noted(small_data, capsys):
    """--text beside --data was neither read nor said (a missing text went unnoticed);
    --text-field without .jsonl data likewise."""
    from hyper_parallel.train.report import unused_options

    argv = ["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--no-progress"]
    argv += ["--data", small_data, "--text", "nonexist.txt", "--text-field", "body"]
    assert run(argv) == 0
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: ")]
    assert len(notes) == 2
    assert notes[0].startswith(
        "note: --text nonexist.txt: --data gives the training data, so the run does not read "
        "the shipped text (and there is no shipped text of that name: ["
    )
    assert notes[0].endswith("). Fix: drop --text.")
    assert notes[1] == (
        "note: --text-field body: no .jsonl data (--data, --eval-data), so the run does not "
        "use it. Fix: drop it."
    )
    # Used, or at their defaults: nothing to say.
    assert unused_options(TrainConfig(text="nonexist.txt", text_field="body")) == [
        "note: --text-field body: no .jsonl data (--data, --eval-data), so the run does not "
        "use it. Fix: drop it."
    ]
    assert unused_options(TrainConfig(data="a.jsonl", text_field="body")) == []
    assert unused_options(TrainConfig(data=small_data, eval_data="b.jsonl", text_field="b")) == []
    assert unused_options(TrainConfig(data=small_data)) == []


def test_checkpoint_and_eval_options_without_their_target_are_noted(tmp_path, capsys):
    cfg = TrainConfig(steps=1, checkpoint_every=1, keep_checkpoints=2, eval_every=1, **TINY)
    Trainer(cfg, device="cpu").fit()
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: ")]
    assert notes == [
        "note: --checkpoint-every 1, --keep-checkpoints 2: no --checkpoint-dir, so the run "
        "saves no checkpoint and does not use them. Fix: give --checkpoint-dir DIR, or drop "
        "them.",
        "note: --eval-every 1: no evaluation data, so the run does not evaluate. Fix: give "
        "--eval-data PATH or --eval-split X, or drop them.",
    ]
    Trainer(TrainConfig(steps=1, lr_schedule="constant", min_lr=1e-4, **TINY), device="cpu").fit()
    assert "note: --min-lr 0.0001: the constant schedule does not decay" in capsys.readouterr().out
    # With their targets: used, nothing to say.
    cfg = cfg.replace(
        checkpoint_dir=str(tmp_path / "ckpt"), eval_split=0.1, min_lr=1e-4, warmup_steps=0
    )
    Trainer(cfg, device="cpu").fit()
    assert "note: " not in capsys.readouterr().out


def test_a_decaying_schedule_the_warm_up_outlasts_is_noted():
    """--lr-schedule linear --min-lr 1e-5 over 3 steps of the default 3-step warm-up: the
    rate only rose; the schedule and --min-lr did nothing, unsaid."""
    from hyper_parallel.train.report import unused_options
    from hyper_parallel.train.schedule import lr_at

    cfg = TrainConfig(steps=3, lr_schedule="linear", min_lr=1e-5)
    assert unused_options(cfg) == [
        "note: --lr-schedule linear: the run's 3 step(s) are all warm-up (--warmup-steps 3), "
        "so the rate only rises and never decays nor reaches --min-lr 1e-05. Fix: "
        "--warmup-steps below --steps, or --lr-schedule constant."
    ]
    rates = [
        lr_at(k, lr=cfg.lr, warmup_steps=3, total_steps=3, min_lr=1e-5, schedule="linear")
        for k in range(cfg.steps)
    ]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(cfg.lr)  # what the note says
    assert unused_options(cfg.replace(warmup_steps=1)) == []  # it decays: nothing to say
    assert unused_options(TrainConfig(steps=1)) == []  # the defaults, not asked for


def test_a_weight_decay_bf16_true_rounds_away_is_noted_and_is_a_no_op(capsys):
    def trained(**changes):
        cfg = TrainConfig(**{**TINY, "steps": 2, "dtype": "bf16-true", **changes})
        trainer = Trainer(cfg, device="cpu")
        trainer.fit()
        notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: ")]
        return [p.detach().clone() for p in trainer.model.parameters()], notes

    # The defaults: lr x weight_decay = 3e-4, below 2**-9.
    decayed, notes = trained(weight_decay=0.1)
    assert notes == [
        "note: --weight-decay 0.1: under --dtype bf16-true AdamW multiplies each bf16 "
        "parameter by 1 - lr x weight_decay = 0.9997, which rounds back to the same value "
        "(lr x weight_decay below 2**-9), so the run does not decay. Fix: --dtype bf16 "
        "(fp32 master weights), or --weight-decay 0."
    ]
    plain, notes = trained(weight_decay=0.0)
    assert notes == []
    assert all(torch.equal(a, b) for a, b in zip(decayed, plain))  # what the note says
    # lr x weight_decay = 2**-6 moves the weights: no note, and the parameters differ.
    decayed, notes = trained(weight_decay=0.5, lr=2**-5)
    plain, _ = trained(weight_decay=0.0, lr=2**-5)
    assert notes == [] and not all(torch.equal(a, b) for a, b in zip(decayed, plain))
    # Under bf16 (fp32 master weights) the same decay is kept: nothing to say.
    _, notes = trained(weight_decay=0.1, dtype="bf16")
    assert notes == []


def test_the_step_line_of_a_pipeline_and_of_accumulation_over_data_ranks():
    from hyper_parallel.train.config import run_plan
    from hyper_parallel.train.report import step_line

    cfg = TrainConfig(mesh={"pp": 2, "dp_shard": 2}, schedule="Interleaved1F1B", batch_size=8)
    # Two stages per rank (the schedule's default): 4 stages, 4 micro-batches of 4 / 4.
    assert step_line(cfg, run_plan(cfg)) == (
        "step: Interleaved1F1B pipeline over pp=2, 4 stages (2 per rank), 4 micro-batches of "
        "1 sequence(s) per data-parallel rank; gradients reduced once per step"
    )
    cfg = TrainConfig(mesh={"dp_shard": 2}, microbatches=2, batch_size=8)
    assert step_line(cfg, run_plan(cfg)) == (
        "step: gradient accumulation, 2 micro-batches of 2 sequence(s) per data-parallel rank, "
        "run in turn; gradients reduced once, after the last"
    )
    cfg = cfg.replace(reduce_each_microbatch=True)
    assert step_line(cfg, run_plan(cfg)).endswith(
        "gradients reduced after each (--reduce-each-microbatch), accumulated sharded"
    )
    assert step_line(cfg.replace(microbatches=1), run_plan(cfg.replace(microbatches=1))) is None
    cfg = TrainConfig(mesh={"pp": 2}, batch_size=8)  # no data axis: nothing is reduced
    assert step_line(cfg, run_plan(cfg)) == (
        "step: 1F1B pipeline over pp=2, 2 stages (1 per rank), 2 micro-batches of 4 "
        "sequence(s) per data-parallel rank; gradients summed over them"
    )


@pytest.mark.parametrize(
    ("tokens", "said"),
    [
        (97, "every one of its 97 tokens was seen"),
        (100, "97 of its 100 tokens were seen; the last 3 do not fill a batch"),
    ],
)
def test_the_epoch_event_says_how_much_of_the_data_a_pass_reads(tokens, said, capsys):
    from types import SimpleNamespace

    from hyper_parallel.train.data import TextBatches
    from hyper_parallel.train.report import RunReport

    data = TextBatches(torch.arange(tokens), global_batch_size=2, seq_len=16)
    for _ in range(4):  # 3 batches a pass; the 4th starts over
        data.global_batch()
    report = object.__new__(RunReport)
    report.trainer = SimpleNamespace(data=data, step=4, cfg=SimpleNamespace(steps=10, eval_every=0))
    report.epoch, report.eval_data, report.prints, report.log_file = 0, None, True, None
    report.after_step(0.0)
    assert capsys.readouterr().out == f"step 4: the data starts over (pass 2; {said})\n"
