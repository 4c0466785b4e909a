"""Your own data: token files, text with a tokenizer, the tokenize command, errors, resume.

The tokenizer is a byte-level BPE trained here on the shipped text
(``examples/hf/make_tiny_checkpoint.py``); models are tiny.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch

from hyper_parallel.train import TextBatches, TrainConfig, Trainer
from hyper_parallel.train.tokens import (
    TokenBatches,
    load_token_file,
    open_corpus,
    tokenize_files,
    write_token_file,
)

pytest.importorskip("tokenizers")
_EXAMPLE = os.path.join(
    os.path.dirname(__file__), "..", "..", "examples", "hf", "make_tiny_checkpoint.py"
)


def _example():
    spec = importlib.util.spec_from_file_location("make_tiny_checkpoint", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return _example().train_tokenizer(str(tmp_path_factory.mktemp("tok") / "tokenizer.json"), 300)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    docs = [
        f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * 20 for i in range(12)
    ]
    with open(folder / "a.jsonl", "w") as f:
        for d in docs[:8]:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    (folder / "b.txt").write_text(docs[8])
    with open(folder / "c.jsonl", "w") as f:
        for d in docs[9:]:
            f.write(json.dumps({"body": d}) + "\n")
    return folder


TINY = dict(
    model="llama3-debug",
    model_overrides={"vocab_size": 320, "num_layers": 1},
    batch_size=4,
    seq_len=16,
    log_every=0,
    progress=False,
    warmup_steps=1,
)


@pytest.mark.parametrize("kind", ["uint16.bin", "uint32.bin", "npy"])
def test_token_files_are_memory_mapped_and_batch_like_text_batches(tmp_path, kind):
    tokens = np.arange(1000, dtype=np.int64) % 250
    if kind == "npy":
        path = str(tmp_path / "t.npy")
        np.save(path, tokens.astype(np.int32))
    else:
        dtype = np.uint16 if kind.startswith("uint16") else np.uint32
        path = str(tmp_path / ("t.uint32.bin" if dtype is np.uint32 else "t.bin"))
        tokens.astype(dtype).tofile(path)
    array = load_token_file(path)
    assert isinstance(array, np.memmap) or isinstance(array.base, np.memmap) or kind == "npy"
    ours = TokenBatches(array, global_batch_size=4, seq_len=16)
    ref = TextBatches(torch.from_numpy(tokens), global_batch_size=4, seq_len=16)
    for _ in range(20):  # past the end: the same epoch wrap
        inputs, targets = ref.next_batch(1, 2)
        a, b = ours.next_batch(1, 2)  # rank 1 of 2 reads only its two rows
        assert torch.equal(a, inputs) and torch.equal(b, targets)
    assert ours.state_dict() == ref.state_dict()


def test_a_token_file_named_uint32_is_written_as_uint32(tmp_path):
    """``*.uint32.bin`` is read as uint32 without its sidecar; written with small ids it
    held uint16, which read back (the sidecar left behind) as a size error or other ids.
    A size that is no whole number of ids is refused naming the file."""
    tokens = np.arange(999, dtype=np.uint32) % 250  # every id fits uint16; odd count
    path = write_token_file(tokens, str(tmp_path / "t.uint32.bin"))
    os.remove(path + ".json")
    assert np.array_equal(load_token_file(path), tokens)
    # A .bin that is not a whole number of ids: numpy's "Size of available data is not a
    # multiple of the data-type size", which named neither the file nor the fix.
    (tmp_path / "cut.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"cut\.bin: 3 bytes, not a whole number of uint16 ids"):
        load_token_file(str(tmp_path / "cut.bin"))


def test_text_is_tokenized_with_eos_between_documents(corpus, tokenizer):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    eos = tok.token_to_id("<|endoftext|>")
    tokens = open_corpus(
        [str(corpus / "a.jsonl"), str(corpus / "b.txt")], vocab_size=320, tokenizer=tokenizer
    )
    assert int((tokens == eos).sum()) == 9 and tokens[-1] == eos
    first = tok.encode(json.loads((corpus / "a.jsonl").read_text().splitlines()[0])["text"]).ids
    assert tokens[: len(first)].tolist() == first


def test_tokenize_command_on_two_processes_equals_one(corpus, tokenizer, tmp_path, capsys):
    from hyper_parallel.cli import main

    inputs = [str(corpus / "a.jsonl"), str(corpus / "b.txt")]
    assert (
        main(
            [
                "tokenize",
                *inputs,
                "--tokenizer",
                tokenizer,
                "--out",
                str(tmp_path / "two.bin"),
                "--workers",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    one = tokenize_files(
        inputs, str(tmp_path / "one.npy"), tokenizer=tokenizer, workers=1, progress=False
    )
    assert "tokens from 2 file(s)" in capsys.readouterr().out
    two = load_token_file(str(tmp_path / "two.bin"))
    assert two.dtype == np.uint16 and one == two.size
    assert np.array_equal(np.load(tmp_path / "one.npy"), two)
    assert np.array_equal(open_corpus(inputs, vocab_size=320, tokenizer=tokenizer), two)


def test_tokenize_separates_documents_as_the_trainer_does(corpus, tmp_path, capsys):
    """One rule for ``tokenize`` and the trainer's text ``--data``: ``--eos-id``, else the
    first eos_token_id of ``--hf-checkpoint``'s config.json, else that of the
    config.json beside the tokenizer, else the tokenizer's EOS token. A checkpoint
    whose config.json names another id than the tokenizer's <|endoftext|>: the token
    file equals the stream the trainer builds from the same text."""
    from tokenizers import Tokenizer

    from hyper_parallel.cli import main
    from hyper_parallel.train.run_hooks import build_data, resolve_model

    ckpt = str(tmp_path / "hf")
    _example().build(ckpt, hidden_size=32, num_layers=1, vocab_size=300, max_shard_size="60KB")
    tokenizer = os.path.join(ckpt, "tokenizer.json")
    endoftext = Tokenizer.from_file(tokenizer).token_to_id("<|endoftext|>")
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    config["eos_token_id"] = [7, endoftext]  # as Llama-3-Instruct's generation list
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(config, f)
    data = str(corpus / "a.jsonl")
    cfg, hf = resolve_model(TrainConfig(hf_checkpoint=ckpt, data=data, batch_size=2, seq_len=16))
    trainer_stream = np.asarray(build_data(cfg, 300, hf).array)
    assert int((trainer_stream == 7).sum()) == 8 and trainer_stream[-1] == 7

    def tokenize(name, *flags):
        argv = ["tokenize", data, "--out", str(tmp_path / name), "--no-progress", *flags]
        assert main(argv) == 0, capsys.readouterr().err
        return load_token_file(str(tmp_path / name))

    for name, flags in (
        ("beside.npy", ["--tokenizer", tokenizer]),  # a tokenizer in a checkpoint folder
        ("given.npy", ["--tokenizer", tokenizer, "--eos-id", "7"]),
        ("ckpt.npy", ["--hf-checkpoint", ckpt]),  # its tokenizer and its eos
    ):
        assert np.array_equal(tokenize(name, *flags), trainer_stream), name
    # A tokenizer alone (no config.json beside it) and the trainer's --tokenizer alike:
    # its <|endoftext|>.
    alone = str(tmp_path / "tok" / "tokenizer.json")
    os.makedirs(os.path.dirname(alone))
    with open(tokenizer) as src, open(alone, "w") as dst:
        dst.write(src.read())
    by_name = tokenize("alone.npy", "--tokenizer", alone)
    cfg, hf = resolve_model(TrainConfig(tokenizer=alone, data=data, batch_size=2, seq_len=16))
    assert np.array_equal(np.asarray(build_data(cfg, 300, hf).array), by_name)
    assert np.array_equal(by_name[trainer_stream != 7], trainer_stream[trainer_stream != 7])
    assert int((by_name == endoftext).sum()) == 8
    # No tokenizer at all is one clear error.
    assert main(["tokenize", data, "--out", str(tmp_path / "x.npy")]) == 2
    assert "--tokenizer FILE" in capsys.readouterr().err
    # A negative id, on one process or several: it was numpy's OverflowError (a traceback)
    # after the whole corpus was tokenized.
    for workers in ("1", "2"):
        argv = ["tokenize", data, "--tokenizer", tokenizer, "--eos-id", "-1", "--workers", workers]
        assert main([*argv, "--out", str(tmp_path / "neg.npy"), "--no-progress"]) == 2
        assert "separator id -1 is negative" in capsys.readouterr().err
        assert not (tmp_path / "neg.npy").exists()


def test_tokenize_and_calibrate_keep_a_file_that_is_there(corpus, tokenizer, tmp_path, capsys):
    """Single-file outputs are never clobbered unasked, never an input even when asked
    (``tokenize --out`` on its own input destroyed it), and their folder is made; each
    refusal comes before any work."""
    from hyper_parallel.cli import main

    src = corpus / "b.txt"
    before = src.read_bytes()
    base = ["tokenize", str(src), "--tokenizer", tokenizer, "--no-progress", "--out"]
    out = tmp_path / "t.bin"
    out.write_bytes(b"mine")
    assert main([*base, str(out)]) == 2
    assert "a file is there already" in capsys.readouterr().err and out.read_bytes() == b"mine"
    assert main([*base, str(src), "--overwrite"]) == 2
    assert "it is the input" in capsys.readouterr().err and src.read_bytes() == before
    assert main([*base, str(out), "--overwrite"]) == 0 and load_token_file(str(out)).size > 0
    # A .bin's sidecar (PATH.json) is an output too: a file of that name was replaced unasked.
    fresh, sidecar = tmp_path / "s.bin", tmp_path / "s.bin.json"
    sidecar.write_text("mine\n")
    assert main([*base, str(fresh)]) == 2
    err = capsys.readouterr().err
    assert f"tokenize --out's sidecar {sidecar}: a file is there already" in err
    assert sidecar.read_text() == "mine\n" and not fresh.exists()
    assert main([*base, str(fresh), "--overwrite"]) == 0 and load_token_file(str(fresh)).size > 0
    # A kind of file it cannot write: refused before the corpus is read (it was refused
    # after tokenizing all of it; this corpus would fail on its first byte).
    capsys.readouterr()
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff")
    argv = ["tokenize", str(bad), "--tokenizer", tokenizer, "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "t.txt")]) == 2
    assert capsys.readouterr().err.endswith("t.txt: write .bin or .npy.\n")
    assert main([*base, str(tmp_path / "new" / "t.bin")]) == 0
    assert load_token_file(str(tmp_path / "new" / "t.bin")).size == load_token_file(str(out)).size
    hardware = tmp_path / "hw.yaml"
    hardware.write_text("mine\n")
    assert main(["calibrate", "--out", str(hardware), "--quick"]) == 2  # before measuring
    assert "a file is there already" in capsys.readouterr().err
    assert hardware.read_text() == "mine\n"


def test_clear_errors(corpus, tokenizer, tmp_path):
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="corpus is empty"):
        open_corpus(str(empty), vocab_size=320)
    big = tmp_path / "big.npy"
    np.save(big, np.array([1, 2, 400]))
    with pytest.raises(ValueError, match="token id 400 >= the model's vocabulary 320"):
        open_corpus(str(big), vocab_size=320)
    with pytest.raises(ValueError, match="has 300 tokens but the model's vocabulary is 256"):
        open_corpus(str(corpus / "b.txt"), vocab_size=256, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        open_corpus(str(corpus / "b.txt"), vocab_size=320)
    with pytest.raises(ValueError, match=r"no field 'text'.*--text-field"):
        open_corpus(str(corpus / "c.jsonl"), vocab_size=320, tokenizer=tokenizer)
    assert open_corpus(
        str(corpus / "c.jsonl"), vocab_size=320, tokenizer=tokenizer, text_field="body"
    ).size
    # Documents with no text: tokenize refuses what --data refuses (it wrote separators).
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n{"text": ""}\n')
    for read in (
        lambda: open_corpus(str(blank), vocab_size=320, tokenizer=tokenizer),
        lambda: tokenize_files([str(blank)], str(tmp_path / "b.bin"), tokenizer=tokenizer),
    ):
        with pytest.raises(ValueError, match=r"2 document\(s\), none holding any text"):
            read()
    assert not (tmp_path / "b.bin").exists()
    short = tmp_path / "short.npy"
    np.save(short, np.arange(20))
    with pytest.raises(ValueError, match=r"fewer than one step needs.*--batch-size"):
        Trainer(TrainConfig(data=str(short), **TINY), device="cpu")


@pytest.mark.parametrize(
    "name, content, expected",
    [
        (
            "s.jsonl",
            b'{"text": "a"}\n"some text here"\n',
            r"s\.jsonl:2: a JSON string, not an object",
        ),
        ("a.jsonl", b'{"text": "a"}\n[1, 2]\n', r"a\.jsonl:2: a JSON array, not an object"),
        (
            "j.jsonl",
            b'{"text": "a"}\n\nnot json\n',
            r"j\.jsonl:3: not valid JSON \(Expecting value",
        ),
        (
            "u.jsonl",
            b'{"text": "a"}\n{"text": "b\xff"}\n',
            r"u\.jsonl:2: not UTF-8 text \(byte 11 ",
        ),
        ("u.txt", b"ab\ncd\xffef", r"u\.txt:2: not UTF-8 text \(byte offset 5: b'\\xff'"),
        # A text field that is not a string was tokenized as its repr ("None", "12").
        ("n.jsonl", b'{"text": "a"}\n{"text": null}\n', r"n\.jsonl:2: field 'text' is a JSON null"),
        ("i.jsonl", b'{"text": 12}\n', r"i\.jsonl:1: field 'text' is a JSON number, not a"),
        ("l.jsonl", b'{"text": ["a", "b"]}\n', r"l\.jsonl:1: field 'text' is a JSON array"),
    ],
    ids=[
        "string",
        "array",
        "not-json",
        "jsonl-not-utf8",
        "txt-not-utf8",
        "null-text",
        "number-text",
        "array-text",
    ],
)
def test_bad_text_names_the_file_and_line(tokenizer, tmp_path, capsys, name, content, expected):
    """A line that is not a JSON object, not JSON, or not UTF-8: a ValueError naming
    ``path:line`` and the fix, and a clean error (status 2) from tokenize, on one process
    or several (train --data reads through open_corpus)."""
    from hyper_parallel.cli import main

    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=expected) as info:
        open_corpus(str(path), vocab_size=320, tokenizer=tokenizer)
    assert any(fix in str(info.value) for fix in ("UTF-8", '{"text": "..."}', "fix or remove"))
    base = ["tokenize", str(path), "--tokenizer", tokenizer, "--no-progress"]
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}.bin"
        assert main([*base, "--out", str(out), "--workers", workers]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hyper-parallel tokenize: error: ") and "Traceback" not in err
        assert str(path) in err and not out.exists()


def test_a_tokenizer_file_tokenizers_cannot_read_is_named(corpus, tmp_path, capsys):
    """tokenizers raises a bare Exception naming no file: the trainer, tokenize (one
    process or several) and generate showed it as a traceback; each now says which file
    and what to give, with status 2."""
    from hyper_parallel.cli import main

    bad = str(tmp_path / "tokenizer.json")
    with open(bad, "w") as f:
        f.write('{"model": 1}\n')
    data = str(corpus / "b.txt")
    expected = f"tokenizer {bad}: not a tokenizers tokenizer.json ("
    with pytest.raises(ValueError, match=re.escape(expected)):
        open_corpus(data, vocab_size=320, tokenizer=bad)
    for workers in ("1", "2"):
        out = tmp_path / f"t{workers}.bin"
        argv = ["tokenize", data, "--tokenizer", bad, "--out", str(out), "--workers", workers]
        assert main([*argv, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err and not out.exists()
    ckpt = str(tmp_path / "hf")
    _example().build(ckpt, hidden_size=32, num_layers=1, vocab_size=300, max_shard_size="60KB")
    argv = ["generate", "--hf-checkpoint", ckpt, "--tokenizer", bad, "--prompt", "First"]
    assert main([*argv, "--max-new-tokens", "1"]) == 2
    assert expected in capsys.readouterr().err


def test_tokenize_says_a_text_field_it_does_not_use(corpus, tokenizer, tmp_path, capsys):
    """--text-field names a .jsonl field; on .txt inputs alone it did nothing, silently
    (the trainer notes the same flag); with a .jsonl input nothing is said."""
    from hyper_parallel.cli import main

    base = ["tokenize", "--tokenizer", tokenizer, "--no-progress", "--text-field", "body"]
    assert main([*base, str(corpus / "b.txt"), "--out", str(tmp_path / "t.bin")]) == 0
    assert "note: --text-field body: no .jsonl input" in capsys.readouterr().err
    argv = [*base, str(corpus / "c.jsonl"), str(corpus / "b.txt")]
    assert main([*argv, "--out", str(tmp_path / "j.bin")]) == 0
    assert "note:" not in capsys.readouterr().err


def test_text_with_crlf_reads_as_text_mode_does(tokenizer, tmp_path):
    (tmp_path / "lf.txt").write_bytes(b"one\ntwo\nthree")
    (tmp_path / "crlf.txt").write_bytes(b"one\r\ntwo\rthree")
    lf = open_corpus(str(tmp_path / "lf.txt"), vocab_size=320, tokenizer=tokenizer)
    crlf = open_corpus(str(tmp_path / "crlf.txt"), vocab_size=320, tokenizer=tokenizer)
    assert np.array_equal(lf, crlf)


def test_trainer_on_a_token_file_resumes_the_exact_stream(tmp_path):
    path = write_token_file(
        np.random.default_rng(0).integers(0, 320, 5000).astype(np.uint32), str(tmp_path / "c.bin")
    )
    straight = Trainer(TrainConfig(data=path, steps=4, **TINY), device="cpu").fit().losses
    ckpt = str(tmp_path / "ckpt")
    cfg = TrainConfig(data=path, steps=4, checkpoint_dir=ckpt, **TINY)
    Trainer(cfg, device="cpu").fit(until_step=2)
    resumed = Trainer(cfg.replace(resume=True), device="cpu").fit()
    assert resumed.resumed_from == 2
    assert resumed.losses == straight[2:]


def test_resume_on_other_data_is_said_and_past_its_end_refused(tmp_path, capsys):
    """A checkpoint records what its run read; resuming on another file, batch or sequence
    length continued at the old token position silently (or failed with "TextBatches:
    cannot resume at position ...", naming no flag)."""
    rng = np.random.default_rng(0)
    a = write_token_file(rng.integers(0, 320, 5000).astype(np.uint32), str(tmp_path / "a.bin"))
    b = write_token_file(rng.integers(0, 320, 6000).astype(np.uint32), str(tmp_path / "b.bin"))
    short = write_token_file(rng.integers(0, 320, 40).astype(np.uint32), str(tmp_path / "s.bin"))
    ckpt = tmp_path / "ckpt"
    cfg = TrainConfig(data=a, steps=2, checkpoint_dir=str(ckpt), **TINY)
    Trainer(cfg, device="cpu").fit()
    capsys.readouterr()
    cases = (({}, None), ({"data": b}, "--data"), ({"seq_len": TINY["seq_len"] * 2}, "--seq-len"))
    for i, (change, flag) in enumerate(cases):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(ckpt, copy)
        again = cfg.replace(resume=True, steps=3, log_every=1, checkpoint_dir=str(copy), **change)
        trainer = Trainer(again, device="cpu")
        assert trainer.resumed_from == 2
        trainer.fit()
        out = capsys.readouterr().out
        if flag is None:  # the same data: nothing said
            assert "does not continue the same stream" not in out, out
            continue
        assert f"the run that wrote {copy}" in out and "read " + a in out, out
        assert f"does not continue the same stream. Fix: resume with the {flag}" in out, out
    with pytest.raises(ValueError) as info:
        Trainer(cfg.replace(resume=True, steps=4, data=short, batch_size=1), device="cpu")
    text = str(info.value)
    assert "past the end of this run's " + short in text and "read " + a in text, text
    assert "Fix: resume with the --batch-size, --data that run used" in text, text


def test_resume_with_another_eval_split_is_said(tmp_path, capsys):
    """--eval-split cuts the training stream; a resume with another share trained on
    other tokens (its data starts over elsewhere, the old held-out tail trained on or
    the old training tail held out) and was not told: the checkpoint's record counted
    the whole stream alike."""
    path = write_token_file(
        np.random.default_rng(0).integers(0, 320, 2000).astype(np.uint32), str(tmp_path / "c.bin")
    )
    ckpt = tmp_path / "ckpt"
    cfg = TrainConfig(data=path, steps=2, checkpoint_dir=str(ckpt), eval_split=0.1, **TINY)
    Trainer(cfg, device="cpu").fit()
    for i, split in enumerate((0.1, 0.3, None)):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(ckpt, copy)
        capsys.readouterr()
        again = cfg.replace(
            resume=True, steps=3, log_every=1, checkpoint_dir=str(copy), eval_split=split
        )
        Trainer(again, device="cpu").fit()
        out = capsys.readouterr().out
        if split == 0.1:  # the same cut: nothing said
            assert "does not continue the same stream" not in out, out
            continue
        held = f", the last {split:.0%} held out" if split else ""
        assert (
            f"read {path} (2,000 tokens, the last 10% held out), batches of 4 x 16; this run "
            f"reads {path} (2,000 tokens{held}), batches of 4 x 16"
        ) in out, out
        assert "does not continue the same stream. Fix: resume with the --eval-split" in out


def test_resume_with_another_tokenizer_names_it(corpus, tokenizer, tmp_path, capsys):
    """Text --data resumed with another --tokenizer was told 'resume with the --data that
    run used' (the data was the same file): the checkpoint did not record the tokenizer
    of text data, so the note saw other token counts only (and nothing, had they been
    equal)."""
    (tmp_path / "other").mkdir()
    other = _example().train_tokenizer(str(tmp_path / "other" / "tokenizer.json"), 280)
    data = str(corpus / "a.jsonl")
    cfg = TrainConfig(
        data=data, tokenizer=tokenizer, steps=2, checkpoint_dir=str(tmp_path / "ck"), **TINY
    )
    Trainer(cfg, device="cpu").fit()
    capsys.readouterr()
    Trainer(cfg.replace(resume=True, steps=3, log_every=1, tokenizer=other), device="cpu").fit()
    out = capsys.readouterr().out
    assert (
        f"the run that wrote {tmp_path / 'ck' / 'step_000002'} read {data} tokenized with "
        f"{tokenizer} ("
    ) in out, out
    assert f"this run reads {data} tokenized with {other} (" in out, out
    assert "does not continue the same stream. Fix: resume with the --tokenizer that" in out
    # The same tokenizer: nothing said.
    Trainer(cfg.replace(resume=True, steps=4, log_every=1, tokenizer=other), device="cpu").fit()
    assert "does not continue the same stream" not in capsys.readouterr().out


def test_tensorboard_gets_loss_lr_grad_norm_tokens_per_s_mfu_and_memory(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("HYPER_PARALLEL_PEAK_TFLOPS", "1")
    cfg = TrainConfig(
        steps=2,
        tensorboard=str(tmp_path / "tb"),
        **{**TINY, "model_overrides": {"num_layers": 1}},
    )
    Trainer(cfg, device="cpu").fit()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/mfu",
        "memory/peak_bytes",
    }
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    assert 0 < events.Scalars("perf/mfu")[0].value < 1


def test_a_resumed_runs_tensorboard_has_one_value_per_step(tmp_path):
    """A run stopped after logging step 3 but before saving it, resumed from step 2: its
    events held steps 1, 2, 3, 3 (the stopped start's step 3 beside the resumed one's),
    so TensorBoard drew the curve back over itself."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    cfg = TrainConfig(
        steps=3,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=2,
        tensorboard=tb,
        **{**TINY, "model_overrides": {"num_layers": 1}},
    )
    Trainer(cfg, device="cpu").fit()
    shutil.rmtree(tmp_path / "ckpt" / "step_000003")  # stopped before that save
    resumed = Trainer(cfg.replace(resume=True, lr=1e-2), device="cpu")
    assert resumed.step == 2
    loss = resumed.fit().losses[-1]
    events = EventAccumulator(tb)
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in scalars] == [1, 2, 3]
    assert scalars[-1][1] == pytest.approx(loss)  # the resumed start's step 3
    assert [e.step for e in events.Scalars("train/lr")] == [1, 2, 3]
    # Started over with --overwrite (2 steps): those, not the earlier run's 1, 2, 3 too.
    again = Trainer(cfg.replace(steps=2, lr=1e-2, overwrite=True), device="cpu").fit().losses
    events = EventAccumulator(tb)
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert scalars == [(1, pytest.approx(again[0])), (2, pytest.approx(again[1]))]


def test_demo_passes_hf_checkpoint_and_data_to_both_runs(tmp_path, monkeypatch, capsys):
    # The launcher is replaced by the same run in this process (the real one is torchrun,
    # checked by hand: demo --hf-checkpoint ... --data ... --mesh dp_shard=2,tp=2 PASS).
    pytest.importorskip("transformers")
    from hyper_parallel.train import demo
    from hyper_parallel.train.run import full_gradients

    ckpt = _example().build(str(tmp_path / "tiny"), vocab_size=300)
    seen = {}

    def launch(cfg, out_dir):
        seen["cfg"] = cfg
        grads = {}

        def keep_first(step, model_parts):
            if step == 0:
                grads.update(full_gradients(model_parts))

        trainer = Trainer(
            cfg.replace(mesh={}, save_hf=None), device="cpu", grad_callback=keep_first
        )
        losses = trainer.fit().losses
        return 0, {"steps": list(range(1, len(losses) + 1)), "losses": losses, "grads": grads}

    monkeypatch.setattr(demo, "_launch_ranks", launch)
    text = tmp_path / "corpus.txt"
    text.write_text("the city is the people. " * 200)
    argv = ["--hf-checkpoint", ckpt, "--data", str(text), "--steps", "2", "--output-dir",
            str(tmp_path / "out"), "--save-hf", str(tmp_path / "saved")]  # fmt: skip
    assert demo.main(argv) == 0
    cfg = seen["cfg"]
    assert cfg.model == "llama3-hf" and cfg.model_overrides["vocab_size"] == 300
    assert cfg.data == str(text) and cfg.save_hf == str(tmp_path / "saved")
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("PASS")
    assert not (tmp_path / "saved").exists()  # the reference run does not write it


def test_hf_checkpoint_without_data_tokenizes_the_shipped_text(tmp_path, capsys):
    """Without --data, a run with a tokenizer (the checkpoint's, or --tokenizer) reads the
    shipped text as text data: tokenized with it. It read the bytes, and a checkpoint's
    model trained on byte values as if they were its own ids (31,994 "tokens" where the
    tokenizer gives fewer); the start line now says which."""
    from tokenizers import Tokenizer

    from hyper_parallel.train import Trainer
    from hyper_parallel.train.data import DEFAULT_TEXT, shipped_text_path

    ckpt = str(tmp_path / "hf")
    _example().build(ckpt, hidden_size=32, num_layers=1, vocab_size=300, max_shard_size="60KB")
    tok = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json"))
    text = shipped_text_path(DEFAULT_TEXT).read_text()
    expected = tok.encode(text).ids
    cfg = TrainConfig(hf_checkpoint=ckpt, steps=1, batch_size=2, seq_len=16, log_every=1)
    trainer = Trainer(cfg, device="cpu")
    stream = np.asarray(trainer.data.array)
    assert len(expected) < len(text.encode())  # tokens, not bytes
    assert stream[: len(expected)].tolist() == expected
    trainer.fit()
    out = capsys.readouterr().out
    assert f"the shipped text {DEFAULT_TEXT} tokenized with {ckpt}/tokenizer.json" in out, out
    # No tokenizer: the bytes, and the line says so.
    Trainer(TrainConfig(steps=1, batch_size=2, seq_len=16, log_every=1), device="cpu").fit()
    assert f"the shipped text {DEFAULT_TEXT} as bytes" in capsys.readouterr().out
