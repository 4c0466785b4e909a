"""Your own training data: token files (memory-mapped) and text tokenized with ``tokenizers``.

``--data PATH`` (``TrainConfig.data``) accepts

- pre-tokenized token files, memory-mapped whatever their size: a flat ``.bin`` of
  ``uint16`` (as nanoGPT and Megatron write them; ``uint32`` when the file is named
  ``*.uint32.bin`` or a ``PATH.json`` sidecar says ``{"dtype": "uint32"}``) or a 1-D
  ``.npy`` of integers;
- ``.txt`` (each file one document) and ``.jsonl`` (one document per line, its
  ``text`` field or ``text_field``), tokenized with a Hugging Face ``tokenizers``
  ``tokenizer.json`` (``--tokenizer``, default: the Hugging Face checkpoint's);
  ``hyper-parallel tokenize`` writes them once as a token file, on several processes.

Documents are separated by the EOS id and packed into one stream;
:class:`TokenBatches` cuts it into the same rows as
:class:`~hyper_parallel.train.data.TextBatches` (same positions, so ``--resume``
continues the exact stream), but each data-parallel rank reads only its own rows.

Errors are raised before training starts, each naming the file and the fix: an empty
corpus, a token id outside the model's vocabulary, a tokenizer whose vocabulary does
not fit the model, a corpus shorter than one batch, a missing tokenizer; a ``.jsonl`` line
that is not a JSON object, or text that is not UTF-8, is named by ``path:line``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from hyper_parallel.train.data import TextBatches

__all__ = [
    "EOS_NAMES",
    "TokenBatches",
    "checkpoint_eos_id",
    "eos_id",
    "iter_documents",
    "load_token_file",
    "load_tokenizer",
    "open_corpus",
    "token_file_paths",
    "tokenize_documents",
    "tokenize_files",
    "write_token_file",
]

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]")
"""Token names taken as the document separator when no EOS id is given nor found in a
``config.json`` (:func:`eos_id`)."""

_TEXT_SUFFIXES = (".txt", ".jsonl")
_TOKEN_SUFFIXES = (".bin", ".npy")


def load_tokenizer(path: str | None) -> Any:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json``.

    Raises:
        ValueError: No path given (text data needs a tokenizer), no such file, or a file
            ``tokenizers`` cannot read.
    """
    if path is None:
        raise ValueError(
            "text data (.txt/.jsonl) needs a tokenizer: pass --tokenizer PATH/tokenizer.json "
            "(or --hf-checkpoint DIR holding one), or pre-tokenize with hyper-parallel tokenize."
        )
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer {path}: no such file; give a tokenizers tokenizer.json.")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception that names no file
        raise ValueError(
            f"tokenizer {path}: not a tokenizers tokenizer.json ({e}); give the "
            "tokenizer.json of a Hugging Face checkpoint or one saved by tokenizers' "
            "Tokenizer.save()."
        ) from None


def checkpoint_eos_id(
    folder: str | os.PathLike[str] | None, *, required: bool = False
) -> int | None:
    """The first ``eos_token_id`` of ``folder/config.json`` (a Hugging Face checkpoint's),
    ``None`` when it has none (or, unless ``required``, no readable ``config.json``).

    Raises:
        ValueError: ``required`` and no ``config.json`` in ``folder``.
    """
    from hyper_parallel.checkpoint_hf.config import load_config_json, token_ids

    if folder is None:
        return None
    path = os.path.join(os.fspath(folder), "config.json")
    try:
        config, _ = load_config_json(path)
    except (OSError, ValueError) as err:
        if required:
            why = "no such file" if isinstance(err, FileNotFoundError) else str(err)
            raise ValueError(
                f"{path}: {why}; --hf-checkpoint names a Hugging Face checkpoint folder."
            ) from None
        return None
    ids = token_ids(config.get("eos_token_id")) if isinstance(config, dict) else []
    return ids[0] if ids else None


def eos_id(
    tokenizer: Any,
    given: int | Sequence[int] | None = None,
    *,
    tokenizer_path: str | None = None,
) -> int:
    """The document separator, one rule for ``tokenize`` and the trainer's text ``--data``.

    ``given`` (an id, or the first of several: ``--eos-id``, or the first
    ``eos_token_id`` of the ``--hf-checkpoint``'s ``config.json``), else the first
    ``eos_token_id`` of the ``config.json`` beside ``tokenizer_path`` (a tokenizer in
    a checkpoint folder), else the first of :data:`EOS_NAMES` the tokenizer has.

    Raises:
        ValueError: None of these, or a negative id.
    """
    if given is not None:
        token = int(given[0] if isinstance(given, (list, tuple)) else given)
        if token < 0:  # a token file holds unsigned ids: numpy's OverflowError otherwise
            raise ValueError(
                f"the document separator id {token} is negative; token ids are 0 or more: "
                "give the tokenizer's EOS id (--eos-id), or leave it out to take the "
                "checkpoint's or the tokenizer's."
            )
        return token
    if tokenizer_path is not None:
        beside = checkpoint_eos_id(os.path.dirname(os.path.abspath(tokenizer_path)))
        if beside is not None:
            return beside
    for name in EOS_NAMES:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return int(token)
    raise ValueError(
        f"the tokenizer has none of {list(EOS_NAMES)} to separate documents; add one "
        "(tokenizers' special_tokens) or give the EOS id (--eos-id)."
    )


def iter_documents(paths: Iterable[str], text_field: str = "text") -> Iterator[str]:
    """The documents of ``.txt`` files (one each) and ``.jsonl`` files (one per line).

    Raises:
        ValueError: A file of another kind, text that is not UTF-8, or a ``.jsonl`` line
            that is not a JSON object holding ``text_field``; each names ``path:line``.
    """
    for path in paths:
        if path.endswith(".txt"):
            with open(path, "rb") as f:
                yield _txt_text(f.read(), path)
        elif path.endswith(".jsonl"):
            # surrogateescape: a byte that is not UTF-8 is found below, on its line.
            with open(path, encoding="utf-8", errors="surrogateescape") as f:
                for n, line in enumerate(f, 1):
                    _check_utf8(line, path, n)
                    if not line.strip():
                        continue
                    yield _jsonl_text(line, path, n, text_field)
        else:
            raise ValueError(f"{path}: text data is .txt or .jsonl, token files .bin or .npy.")


_NOT_UTF8_FIX = "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 IN > OUT)."


def _txt_text(data: bytes, path: str) -> str:
    """``data`` as UTF-8 with newlines as text mode reads them; else a ValueError naming
    ``path:line`` and the byte offset."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte offset {e.start}: "
            f"{data[e.start : e.end]!r}, {e.reason}); {_NOT_UTF8_FIX}"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines


def _check_utf8(line: str, path: str, n: int) -> None:
    """Raise a ValueError naming ``path:n`` when ``line`` holds a byte that is not UTF-8."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as e:
        offset = len(line[: e.start].encode("utf-8"))
        bad = line[e.start : e.end].encode("utf-8", "surrogateescape")
        raise ValueError(
            f"{path}:{n}: not UTF-8 text (byte {offset} of the line: {bad!r}); {_NOT_UTF8_FIX}"
        ) from None


_JSON_KINDS = {str: "string", int: "number", float: "number", list: "array", bool: "boolean"}


def _jsonl_text(line: str, path: str, n: int, text_field: str) -> str:
    """The ``text_field`` of the JSON object on line ``n``; else a ValueError naming it."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}); each line of a .jsonl "
            f'is one JSON object such as {{"{text_field}": "..."}}: fix or remove the line.'
        ) from None
    if not isinstance(record, dict):
        kind = _JSON_KINDS.get(type(record), "null")
        raise ValueError(
            f"{path}:{n}: a JSON {kind}, not an object; each line of a .jsonl is one JSON "
            f'object such as {{"{text_field}": "..."}} (plain text: use a .txt file).'
        )
    if text_field not in record:
        raise ValueError(
            f"{path}:{n}: no field {text_field!r} (fields: {sorted(record)}); "
            "pass --text-field NAME."
        )
    text = record[text_field]
    if not isinstance(text, str):
        # str() would train on "None", "12" or "['a', 'b']" in place of the document.
        kind = _JSON_KINDS.get(type(text), "null" if text is None else "object")
        raise ValueError(
            f"{path}:{n}: field {text_field!r} is a JSON {kind}, not a string; each document "
            f"is a string: fix or remove the line (or pass --text-field NAME)."
        )
    return text


def tokenize_documents(tokenizer: Any, documents: Iterable[str], eos: int) -> np.ndarray:
    """Token ids of ``documents``, each followed by ``eos`` (``uint32``)."""
    ids: list[int] = []
    batch: list[str] = []

    def flush() -> None:
        for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
            ids.extend(encoding.ids)
            ids.append(eos)
        batch.clear()

    for document in documents:
        batch.append(document)
        if len(batch) >= 256:
            flush()
    if batch:
        flush()
    return np.asarray(ids, dtype=np.uint32)


def _bin_dtype(path: str) -> np.dtype:
    sidecar = path + ".json"
    if os.path.isfile(sidecar):
        with open(sidecar, encoding="utf-8") as f:
            return np.dtype(json.load(f).get("dtype", "uint16"))
    return np.dtype(np.uint32 if path.endswith(".uint32.bin") else np.uint16)


def load_token_file(path: str) -> np.ndarray:
    """A token file as a read-only memory map (``.bin`` flat, ``.npy`` 1-D).

    Raises:
        ValueError: Not a token file, not 1-D integers, a ``.bin`` that is not a whole
            number of ids, or empty.
    """
    if not os.path.isfile(path):
        raise ValueError(f"--data {path}: no such file.")
    if path.endswith(".npy"):
        tokens = np.load(path, mmap_mode="r")
    elif path.endswith(".bin"):
        dtype = _bin_dtype(path)
        size = os.path.getsize(path)
        if size % dtype.itemsize:
            raise ValueError(
                f"--data {path}: {size:,} bytes, not a whole number of {dtype.name} ids "
                f"({dtype.itemsize} bytes each): the file is cut short, or holds another "
                "dtype (name a uint32 file *.uint32.bin, or give its PATH.json sidecar "
                '{"dtype": "uint32"}).'
            )
        empty = size == 0  # np.memmap refuses an empty file
        tokens = np.zeros(0, dtype) if empty else np.memmap(path, dtype=dtype, mode="r")
    else:
        raise ValueError(f"--data {path}: token files are .bin or .npy, text .txt or .jsonl.")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(
            f"--data {path}: a token file holds a 1-D array of integer ids, got shape "
            f"{tokens.shape} of {tokens.dtype}."
        )
    return tokens


def token_file_paths(path: str) -> list[str]:
    """The files :func:`write_token_file` writes for ``path``: it, and for a ``.bin`` its
    sidecar ``PATH.json`` (the dtype), so a command can refuse either before any work.

    Raises:
        ValueError: ``path`` is neither ``.bin`` nor ``.npy``.
    """
    if not path.endswith(_TOKEN_SUFFIXES):
        raise ValueError(f"--out {path}: write .bin or .npy.")
    return [path, path + ".json"] if path.endswith(".bin") else [path]


def write_token_file(tokens: np.ndarray, path: str) -> str:
    """Write ``tokens`` as ``.npy``, or ``.bin`` (uint16 when every id fits and the name is
    not ``*.uint32.bin``, else uint32), with a sidecar ``PATH.json`` naming the dtype."""
    paths = token_file_paths(path)
    if path.endswith(".npy"):
        np.save(path, tokens)
        return path
    # A name that says uint32 is read as uint32 without the sidecar (_bin_dtype): keep it.
    small = tokens.size == 0 or int(tokens.max()) < 2**16
    dtype = np.uint16 if small and not path.endswith(".uint32.bin") else np.uint32
    tokens.astype(dtype).tofile(path)
    with open(paths[1], "w", encoding="utf-8") as f:
        json.dump({"dtype": np.dtype(dtype).name, "tokens": int(tokens.size)}, f)
    return path


def _max_id(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    return max((int(tokens[i : i + chunk].max()) for i in range(0, tokens.size, chunk)), default=-1)


def open_corpus(
    paths: str | Sequence[str],
    *,
    vocab_size: int,
    tokenizer: str | None = None,
    text_field: str = "text",
    eos: int | Sequence[int] | None = None,
) -> np.ndarray:
    """The training stream of ``paths`` for a model of ``vocab_size`` ids, checked.

    Args:
        paths: A token file, or text files (comma-separated in one string, or a list).
        vocab_size: The model's vocabulary.
        tokenizer: ``tokenizer.json`` for text files.
        text_field: The ``.jsonl`` field holding a document.
        eos: The document separator id (default: :func:`eos_id`'s rule).

    Raises:
        ValueError: An empty corpus, an id >= ``vocab_size``, a tokenizer whose
            vocabulary exceeds the model's, a missing tokenizer, an unknown file kind.
    """
    if isinstance(paths, str):
        paths = [p for p in paths.split(",") if p]
    paths = list(paths)
    where = ",".join(paths)
    if not paths:
        raise ValueError("--data: no file given.")
    if all(p.endswith(_TOKEN_SUFFIXES) for p in paths):
        if len(paths) > 1:
            raise ValueError(f"--data {where}: give one token file (concatenate with tokenize).")
        tokens = load_token_file(paths[0])
    elif all(p.endswith(_TEXT_SUFFIXES) for p in paths):
        for p in paths:
            if not os.path.isfile(p):
                raise ValueError(f"--data {p}: no such file.")
        tok = load_tokenizer(tokenizer)
        if tok.get_vocab_size() > vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer} has {tok.get_vocab_size()} tokens but the model's "
                f"vocabulary is {vocab_size}; use the model's tokenizer or a model with "
                f"vocab_size >= {tok.get_vocab_size()}."
            )
        separator = eos_id(tok, eos, tokenizer_path=tokenizer)
        tokens = tokenize_documents(tok, iter_documents(paths, text_field), separator)
        if tokens.size and bool((tokens == separator).all()):
            # Only the separators of empty documents: there is nothing to learn from.
            raise ValueError(
                f"--data {where}: the corpus is empty: {tokens.size} document(s), none "
                "holding any text; give files that hold text."
            )
    else:
        raise ValueError(
            f"--data {where}: use one token file (.bin/.npy) or text files (.txt/.jsonl)."
        )
    if tokens.size == 0:
        raise ValueError(f"--data {where}: the corpus is empty (no tokens).")
    top = _max_id(tokens)
    if top >= vocab_size:
        raise ValueError(
            f"--data {where}: token id {top} >= the model's vocabulary {vocab_size}; the file "
            "was tokenized for another model (or a .bin is uint32: name it *.uint32.bin)."
        )
    return tokens


def tokenize_files(
    paths: Sequence[str],
    out: str,
    *,
    tokenizer: str,
    text_field: str = "text",
    eos: int | None = None,
    hf_checkpoint: str | None = None,
    workers: int = 1,
    progress: bool = True,
) -> int:
    """Tokenize text files into one token file ``out`` on ``workers`` processes; returns the count.

    Documents go to the workers in chunks, in order (the file is the same for any
    number of workers); a progress bar (``tqdm``, on stderr) counts documents. They are
    separated as the trainer separates them (:func:`eos_id`): ``eos``, else the first
    ``eos_token_id`` of ``hf_checkpoint``'s ``config.json`` (the trainer's
    ``--hf-checkpoint``), else that of the ``config.json`` beside the tokenizer, else
    the tokenizer's EOS token.

    Raises:
        ValueError: See :func:`open_corpus` (missing tokenizer, unknown files, empty
            corpus); no ``config.json`` in ``hf_checkpoint``.
    """
    import multiprocessing as mp

    from hyper_parallel import _tokenize_worker as worker

    tok = load_tokenizer(tokenizer)
    if eos is None and hf_checkpoint is not None:
        eos = checkpoint_eos_id(hf_checkpoint, required=True)
    separator = eos_id(tok, eos, tokenizer_path=tokenizer)
    for p in paths:
        if not os.path.isfile(p):
            raise ValueError(f"tokenize: {p}: no such file.")

    def chunks() -> Iterator[list[str]]:
        chunk: list[str] = []
        for document in iter_documents(paths, text_field):
            chunk.append(document)
            if len(chunk) >= 64:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(desc="tokenize", unit=" docs")
        except ImportError:
            bar = None
    pieces: list[np.ndarray] = []
    if workers > 1:
        context = mp.get_context("spawn")
        pool = context.Pool(workers, initializer=worker.init, initargs=(tokenizer,))
        results = pool.imap(worker.encode, chunks())
    else:
        worker.init(tokenizer)
        pool, results = None, map(worker.encode, chunks())
    try:
        for encoded in results:
            for ids in encoded:
                pieces.append(np.asarray([*ids, separator], dtype=np.uint32))
            if bar is not None:
                bar.update(len(encoded))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if bar is not None:
            bar.close()
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.uint32)
    if tokens.size == 0:
        raise ValueError(f"tokenize: {', '.join(paths)}: the corpus is empty (no documents).")
    if tokens.size == len(pieces):  # only separators: --data refuses the same text
        raise ValueError(
            f"tokenize: {', '.join(paths)}: the corpus is empty: {len(pieces)} document(s), "
            "none holding any text; give files that hold text."
        )
    write_token_file(tokens, out)
    return int(tokens.size)


class TokenBatches(TextBatches):
    """:class:`TextBatches` over a (memory-mapped) token array; a rank reads only its rows.

    The rows, positions and epochs are exactly those of :class:`TextBatches` on the
    same tokens (so checkpoints resume the same stream); :meth:`next_batch` reads
    rows ``[r b, (r + 1) b)`` of the step from the array and nothing else.

    Raises:
        ValueError: The corpus is shorter than one global batch (names ``source``).
    """

    def __init__(
        self, tokens: np.ndarray, *, global_batch_size: int, seq_len: int, source: str = "corpus"
    ) -> None:
        span = global_batch_size * seq_len
        if span + 1 > tokens.size:
            most = (tokens.size - 1) // seq_len
            fix = (
                f"lower --batch-size to {most} or less, or --seq-len"
                if most >= 1
                else "lower --seq-len"
            )
            raise ValueError(
                f"--data {source}: {tokens.size:,} token(s), fewer than one step needs "
                f"(--batch-size {global_batch_size} x --seq-len {seq_len} + 1 = {span + 1:,}); "
                f"add data, or {fix}."
            )
        self.array = tokens
        self.source = source
        # TextBatches' bookkeeping (sizes, position, epoch) on a stand-in of the same length.
        super().__init__(
            torch.zeros(1, dtype=torch.long).expand(tokens.size),
            global_batch_size=global_batch_size,
            seq_len=seq_len,
        )

    def _rows(self, first: int, count: int) -> torch.Tensor:
        if self.position + self.span + 1 > self.array.size:
            self.position = 0
            self.epoch += 1
        start = self.position + first * self.seq_len
        window = np.asarray(self.array[start : start + count * self.seq_len + 1], dtype=np.int64)
        self.position += self.span
        idx = np.arange(count)[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return torch.from_numpy(window[idx])

    def global_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._rows(0, self.global_batch_size)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def next_batch(self, dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        if dp_size < 1 or self.global_batch_size % dp_size:
            raise ValueError(
                f"TokenBatches: global_batch_size {self.global_batch_size} is not divisible "
                f"by the data-parallel size {dp_size}; pick a multiple of it."
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"TokenBatches: dp_rank {dp_rank} is not in [0, {dp_size}).")
        count = self.global_batch_size // dp_size
        rows = self._rows(dp_rank * count, count)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
