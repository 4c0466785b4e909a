"""The trainer's single-process parts: data stream, config, mesh parsing, clipping, checkpoints."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re

import pytest
import torch

from hyper_parallel.train import (
    DEFAULT_TEXT,
    VOCAB_SIZE,
    TextBatches,
    TrainConfig,
    Trainer,
    available_texts,
    build_mesh,
    build_parallel_model,
    checkpoint_path,
    clip_grad_norm_,
    demo,
    latest_checkpoint,
    load_checkpoint,
    load_tokens,
    save_checkpoint,
)
from hyper_parallel.train.run import add_train_arguments, config_from_args, main, parse_mesh

TINY = {"batch_size": 4, "seq_len": 16, "log_every": 0, "progress": False}


# ---------------------------------------------------------------------- data


def test_shipped_text_is_small_public_domain_prose():
    assert DEFAULT_TEXT in available_texts()
    tokens = load_tokens()
    assert tokens.dtype == torch.int64 and tokens.ndim == 1
    assert 20_000 < tokens.numel() < 100_000
    assert int(tokens.max()) < VOCAB_SIZE
    text = bytes(tokens.to(torch.uint8).tolist()).decode("ascii")
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")


def test_unknown_text_lists_the_shipped_ones():
    with pytest.raises(ValueError, match=r"no shipped text named 'nope.txt'.*coriolanus"):
        load_tokens("nope.txt")


def test_rows_are_consecutive_and_targets_are_shifted_inputs():
    tokens = torch.arange(1000)
    batches = TextBatches(tokens, global_batch_size=4, seq_len=8)
    inputs, targets = batches.global_batch()
    assert inputs.shape == targets.shape == (4, 8)
    assert torch.equal(inputs[1], torch.arange(8, 16))
    assert torch.equal(targets, inputs + 1)
    assert batches.state_dict() == {"position": 32, "epoch": 0}


def test_dp_ranks_take_disjoint_slices_of_the_same_global_batch():
    tokens = load_tokens()
    whole = TextBatches(tokens, global_batch_size=8, seq_len=16)
    expected_inputs, expected_targets = whole.global_batch()
    slices = []
    for rank in range(4):
        stream = TextBatches(tokens, global_batch_size=8, seq_len=16)
        slices.append(stream.next_batch(dp_rank=rank, dp_size=4))
    assert torch.equal(torch.cat([s[0] for s in slices]), expected_inputs)
    assert torch.equal(torch.cat([s[1] for s in slices]), expected_targets)


def test_stream_wraps_and_resumes_from_its_state():
    tokens = torch.arange(100)
    stream = TextBatches(tokens, global_batch_size=2, seq_len=20)  # 40 tokens a step
    seen = [stream.global_batch()[0][0, 0].item() for _ in range(3)]
    assert seen == [0, 40, 0]  # 80 + 41 > 100: starts over
    assert stream.state_dict() == {"position": 40, "epoch": 1}
    resumed = TextBatches(tokens, global_batch_size=2, seq_len=20)
    resumed.load_state_dict(stream.state_dict())
    assert torch.equal(resumed.global_batch()[0], stream.global_batch()[0])


def test_batch_errors_name_the_fix():
    with pytest.raises(ValueError, match="lower the batch size"):
        TextBatches(torch.arange(10), global_batch_size=2, seq_len=8)
    stream = TextBatches(torch.arange(100), global_batch_size=3, seq_len=4)
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 2"):
        stream.next_batch(dp_rank=0, dp_size=2)
    with pytest.raises(ValueError, match="cannot resume at position 500"):
        stream.load_state_dict({"position": 500, "epoch": 0})


# ---------------------------------------------------------------------- config


def test_config_round_trips_through_a_dict():
    cfg = TrainConfig(mesh={"dp": 2, "tp": 2}, sp=True, steps=5)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert (cfg.dp, cfg.tp, cfg.world_size) == (2, 2, 4)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mesh": {"tpp": 2}}, "'tpp' is not a mesh axis. Did you mean 'tp'"),
        ({"mesh": {"dp": 0}}, "integers >= 1"),
        ({"mesh": {"dp": 2, "dp_shard": 2}}, "'dp' and 'dp_shard' both name"),
        ({"resume": True}, "needs a checkpoint_dir"),
        ({"steps": 0}, "steps must be >= 1"),
    ],
)
def test_config_rejects_inconsistent_values(changes, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"mesh": {"dp": 3}},
            "(the global batch) is not divisible by dp_replicate x dp_shard = 3",
        ),
        ({"sp": True}, "(sequence parallelism) needs tp > 1"),
        ({"mesh": {"tp": 3}, "sp": True}, "seq_len divisible by tp"),
    ],
)
def test_the_switches_are_run_plan_findings_not_config_errors(changes, message):
    # TrainConfig is data: the run plan refuses these, for the trainer, validate and plan.
    from hyper_parallel.train.trainer import check_config

    cfg = TrainConfig(**changes)
    assert [f.field for f in check_config(cfg) if message in f.message] in (
        ["batch_size"],
        ["sp"],
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        Trainer(cfg, device="cpu")


def test_config_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['stepz'\]"):
        TrainConfig.from_dict({"stepz": 3})


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    cfg = TrainConfig(steps=10, warmup_steps=2, lr=1.0)
    lrs = [cfg.lr_at(s) for s in range(10)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(lrs[2:]))
    assert cfg.lr_at(10) == pytest.approx(0.1)


def test_parse_mesh():
    assert parse_mesh("dp=2,tp=2") == {"dp_shard": 2, "tp": 2}
    assert parse_mesh(" tp=4 ") == {"tp": 4}
    assert parse_mesh("dp_replicate=2,dp_shard=2,cp=1") == {"dp_replicate": 2, "dp_shard": 2}
    assert parse_mesh("") == {}
    for bad in ("dp", "dp=x", "cpp=2", "dp=0", "dp=2,dp=2", "dp=2,dp_shard=2", "tp=2,ep=3"):
        with pytest.raises(ValueError, match="mesh"):
            parse_mesh(bad)


def test_command_line_options_override_the_config_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text('{"steps": 7, "seed": 3}')
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    cfg = config_from_args(parser.parse_args(["--config", str(path), "--steps", "9"]), 4)
    assert (cfg.steps, cfg.seed, cfg.mesh) == (9, 3, {"dp_shard": 4})


def test_mesh_without_a_process_group_says_how_to_launch():
    assert build_mesh({}) is None
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 4"):
        build_mesh({"dp": 2, "tp": 2})


def test_demo_checks_the_run_before_starting_ranks(capsys):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.run(parser.parse_args(["--mesh", "dp=3"])) == 2  # global batch 8
    assert "not divisible by dp_replicate x dp_shard = 3" in capsys.readouterr().err
    assert demo.run(parser.parse_args(["--mesh", "tp=1"])) == 2
    assert "at least two" in capsys.readouterr().err


def test_demo_takes_a_job_file_under_its_options(tmp_path, monkeypatch):
    """DESIGN §9: --config FILE.toml on train.run and demo. The demo had no --config."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    seen = []

    def launch(cfg, out_dir):
        seen.append(cfg)
        return 1, None  # stop there: the options are what is checked

    monkeypatch.setattr(demo, "_launch_ranks", launch)
    job = tmp_path / "job.toml"
    job.write_text('mesh = "dp_shard=2"\nsteps = 2\nlog-every = 1\nseq-len = 32\n')
    out = ["--output-dir", str(tmp_path / "out")]
    demo.run(parser.parse_args(["--config", str(job), *out]))
    demo.run(parser.parse_args(["--config", str(job), "--mesh", "tp=2", "--steps", "3", *out]))
    (tmp_path / "empty.toml").write_text("")
    demo.run(parser.parse_args(["--config", str(tmp_path / "empty.toml"), *out]))
    demo.run(parser.parse_args(out))
    got = [(str(c.layout), c.steps, c.log_every, c.seq_len) for c in seen]
    # The job file's values; the command line's over them; the demo's mesh without either.
    assert got[:2] == [("dp_shard=2", 2, 1, 32), ("tp=2", 3, 1, 32)]
    assert got[2] == got[3] and got[2][0] == "dp_shard=2,tp=2"


def test_demo_refuses_resume_before_starting_ranks(tmp_path, monkeypatch, capsys):
    """It compares from step 0: resumed, the ranks' first-step gradients were never
    written and the run was reported failed with parity nan FAIL."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    monkeypatch.setattr(demo, "_launch_ranks", lambda *a: pytest.fail("ranks started"))
    argv = ["--mesh", "dp=2", "--checkpoint-dir", str(tmp_path / "ck"), "--resume"]
    out = tmp_path / "out"
    assert demo.run(parser.parse_args([*argv, "--output-dir", str(out)])) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    assert "--resume is not supported" in captured.err and "from step 0" in captured.err
    assert "hyper-parallel train --resume" in captured.err


def test_demo_refuses_a_checkpoint_dir_of_another_run_before_starting_ranks(
    tmp_path, monkeypatch, capsys
):
    """The ranks refuse a --checkpoint-dir holding an earlier run's checkpoints; the demo
    reported that as "the distributed run failed" and parity nan FAIL. Said up front now."""
    ck = tmp_path / "ck"
    argv = ["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--no-progress"]
    assert main([*argv, "--checkpoint-dir", str(ck), "--checkpoint-every", "1"]) == 0
    capsys.readouterr()
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    monkeypatch.setattr(demo, "_launch_ranks", lambda *a: pytest.fail("ranks started"))
    out = tmp_path / "out"
    args = ["--mesh", "dp=2", "--checkpoint-dir", str(ck), "--output-dir", str(out)]
    assert demo.run(parser.parse_args(args)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    assert captured.err.startswith("demo: ") and "pass --overwrite" in captured.err
    assert "--resume" not in captured.err  # what the demo refuses is not offered


def test_demo_refuses_a_model_smaller_than_the_bytes_before_starting_ranks(
    tmp_path, monkeypatch, capsys
):
    """A vocabulary under 256 on the shipped text (bytes): every rank refused it after
    building its model, and the demo said "the distributed run failed" (exit 1) with
    torchrun's traceback and parity nan FAIL. Now the trainer's words, status 2, no rank."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    monkeypatch.setattr(demo, "_launch_ranks", lambda *a: pytest.fail("ranks started"))
    out = tmp_path / "out"
    argv = ["--mesh", "dp=2", "--model-overrides", '{"vocab_size": 100}']
    assert demo.run(parser.parse_args([*argv, "--output-dir", str(out)])) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    assert captured.err.startswith("demo: model 'llama3-debug' has a vocabulary of 100")
    assert "override vocab_size >= 256" in captured.err
    # A Hugging Face checkpoint's vocabulary is its weights' shape (the override above is
    # refused there): the fix offered is its tokenizer.
    from tests.distributed.hf_checks import write_checkpoint

    ckpt = write_checkpoint("llama", str(tmp_path / "hf"))  # vocabulary 128, no tokenizer
    args = ["--mesh", "dp=2", "--hf-checkpoint", ckpt, "--seq-len", "32", "--output-dir", str(out)]
    assert demo.run(parser.parse_args(args)) == 2
    err = capsys.readouterr().err
    assert "has a vocabulary of 128 but the data is bytes" in err
    assert f"give its tokenizer (--tokenizer FILE, or a tokenizer.json in {ckpt})" in err
    assert "override vocab_size" not in err


# ---------------------------------------------------------------------- clipping


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twins):
        p.grad = torch.randn(p.shape)
        q.grad = p.grad.clone()
    ours = clip_grad_norm_(params, 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(twins, 1.0)
    assert torch.equal(ours, theirs)
    for p, q in zip(params, twins):
        assert torch.equal(p.grad, q.grad)
    assert math.isclose(
        float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))),
        1.0,
        rel_tol=1e-5,
    )


def test_clip_grad_norm_of_bf16_gradients_is_fp32():
    """bf16-true: the norm (and so the clip factor) is the fp32 norm of the bf16
    gradients, not one rounded to bf16's 3 digits as torch's is."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (300, 7, 50)]
    for p in params:
        p.grad = torch.randn(p.shape, dtype=torch.bfloat16)
    exact = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in params]))
    bf16 = torch.nn.utils.get_total_norm([p.grad for p in params])
    assert bf16.dtype == torch.bfloat16 and abs(float(bf16) / float(exact) - 1) > 1e-4
    norm = clip_grad_norm_(params, 1.0)
    assert norm.dtype == torch.float32
    # fp32 sums of ~360 squares: relative error well under 1e-6.
    assert abs(float(norm) / float(exact) - 1) < 1e-6
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in params]))
    assert abs(float(clipped) - 1.0) < 2**-8  # each element rounded to bf16 after scaling
    assert all(p.grad.dtype == torch.bfloat16 for p in params)


# ---------------------------------------------------------------------- one process


def test_one_process_build_is_seeded():
    a = build_parallel_model(TrainConfig(seed=1), mesh=None, device="cpu")
    b = build_parallel_model(TrainConfig(seed=1), mesh=None, device="cpu")
    c = build_parallel_model(TrainConfig(seed=2), mesh=None, device="cpu")
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        assert not torch.equal(p, r) or name.endswith("norm.weight"), name


def test_checkpoint_round_trip_in_one_process(tmp_path):
    cfg = TrainConfig(steps=2, **TINY)
    trainer = Trainer(cfg, device="cpu")
    trainer.fit()
    path = checkpoint_path(tmp_path, trainer.step)
    save_checkpoint(
        path, model=trainer.model, optimizer=trainer.optimizer, train_state=trainer.train_state()
    )
    assert latest_checkpoint(tmp_path) == path
    fresh = Trainer(cfg, device="cpu")
    state = load_checkpoint(path, model=fresh.model, optimizer=fresh.optimizer)
    record = json.loads(state.pop("model_json"))  # which model: for export-hf and generate
    assert record == {
        "model": cfg.model,
        "model_overrides": cfg.model_overrides,
        "hf_config": None,
        "generation_config": None,  # the generation_config.json its export carries: none
    }
    # What the run read: a resumed run that reads otherwise is told so.
    assert json.loads(state.pop("data_json")) == {
        "source": "the shipped text shakespeare_coriolanus.txt as bytes",
        "tokens": 31994,
        "batch_size": 4,
        "seq_len": 16,
        "eval_split": None,
        "tokenizer": None,  # the tokenizer of text --data (the shipped text's is in source)
    }
    expected = {"step": 2, "data_position": 2 * 4 * 16, "data_epoch": 0, "lr_schedule_steps": 2}
    assert state == expected  # the schedule's length: a resumed run keeps it
    for p, q in zip(trainer.model.parameters(), fresh.model.parameters()):
        assert torch.equal(p, q)
    saved = trainer.optimizer.state_dict()["state"]
    loaded = fresh.optimizer.state_dict()["state"]
    assert all(torch.equal(saved[k]["exp_avg"], loaded[k]["exp_avg"]) for k in saved)


def test_incomplete_checkpoint_is_skipped_and_refused(tmp_path):
    (tmp_path / "step_000009").mkdir()  # a save that died before DCP wrote .metadata
    assert latest_checkpoint(tmp_path) is None
    model = build_parallel_model(TrainConfig(), mesh=None, device="cpu")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(tmp_path / "step_000009", model=model)


def test_resume_in_one_process_equals_an_uninterrupted_run(tmp_path):
    cfg = TrainConfig(steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2, **TINY)
    whole = Trainer(cfg.replace(checkpoint_dir=None), device="cpu")
    whole_result = whole.fit()
    Trainer(cfg, device="cpu").fit(until_step=2)
    resumed = Trainer(cfg.replace(resume=True), device="cpu")
    assert resumed.step == 2
    result = resumed.fit()
    assert result.losses == whole_result.losses[2:]
    for p, q in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)


def test_a_resumed_run_trains_with_the_weight_decay_it_is_given(tmp_path):
    """AdamW's state restored the checkpoint's weight decay over the run's own: resumed
    with --weight-decay 0, steps 3-4 decayed at 0.1 (losses bitwise those of 0.1)."""
    cfg = TrainConfig(steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2, **TINY)
    Trainer(cfg, device="cpu").fit(until_step=2)
    # The uninterrupted run: 0.1 for steps 1-2, then 0 (as the resumed run is told).
    whole = Trainer(cfg.replace(checkpoint_dir=None), device="cpu")
    whole.fit(until_step=2)
    for group in whole.optimizer.param_groups:
        group["weight_decay"] = 0.0
    expected = whole.fit().losses
    resumed = Trainer(cfg.replace(resume=True, weight_decay=0.0), device="cpu")
    assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [0.0]
    assert resumed.fit().losses == expected
    for p, q in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    # Steps 3-4 at 0.1 (what the resumed run trained) differ from those at 0.
    assert Trainer(cfg.replace(checkpoint_dir=None), device="cpu").fit().losses[2:] != expected


def test_run_entry_explains_a_run_that_cannot_start(capsys):
    assert main(["--mesh", "dp=2", "--steps", "1"]) == 2
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err
