"""Training data: a public-domain text shipped with the package, tokenized as bytes.

The text is the opening of Shakespeare's *Coriolanus* (public domain), as found in
the ``tinyshakespeare`` corpus of Karpathy's ``char-rnn``. Every byte is a token
(vocabulary 256), so no tokenizer is needed and any model with ``vocab_size >= 256``
can train on it.

Batches are a pure function of a position in the text: the global batch of step
``k`` is the same on every rank and in a single process, each data-parallel rank
takes its own contiguous slice of it, and the position (saved in checkpoints) is
all that is needed to resume the stream exactly.

Example::

    from hyper_parallel.train.data import TextBatches, load_tokens

    batches = TextBatches(load_tokens(), global_batch_size=8, seq_len=64)
    inputs, targets = batches.next_batch(dp_rank=0, dp_size=2)  # (4, 64) each
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import torch

__all__ = [
    "DEFAULT_TEXT",
    "VOCAB_SIZE",
    "TextBatches",
    "available_texts",
    "load_tokens",
    "shipped_text_path",
]

VOCAB_SIZE = 256
"""Byte-level tokens: one token per byte."""

DEFAULT_TEXT = "shakespeare_coriolanus.txt"
"""The text shipped in ``hyper_parallel/train/data/``."""


def available_texts() -> list[str]:
    """Names of the texts shipped with the package, sorted."""
    folder = resources.files("hyper_parallel.train") / "data"
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".txt"))


def shipped_text_path(name: str = DEFAULT_TEXT, who: str = "--text") -> Any:
    """The file of the shipped text ``name`` (a ``pathlib``-like resource path).

    Raises:
        ValueError: ``name`` is not a shipped text; the message lists the ones there are.
    """
    path = resources.files("hyper_parallel.train") / "data" / name
    if not name.endswith(".txt") or "/" in name or not path.is_file():
        raise ValueError(f"{who}: no shipped text named {name!r}; available: {available_texts()}.")
    return path


def load_tokens(name: str = DEFAULT_TEXT) -> torch.Tensor:
    """A shipped text as a 1-D ``int64`` tensor of byte values (0..255).

    Args:
        name: File name in ``hyper_parallel/train/data/`` (see :func:`available_texts`).

    Returns:
        The tokens, one per byte of the file.

    Raises:
        ValueError: ``name`` is not a shipped text; the message lists the ones there are.
    """
    raw = shipped_text_path(name, "load_tokens").read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


class TextBatches:
    """Deterministic next-token batches over a token stream, resumable from a position.

    Step ``k``'s global batch is ``global_batch_size`` rows of ``seq_len + 1``
    consecutive tokens; row ``i`` starts at ``position + i * seq_len`` (rows overlap
    by one token so every input position has a target). After each batch the
    position advances by ``global_batch_size * seq_len``; when the next batch would
    run past the end, the stream starts over at 0 and ``epoch`` counts up.

    Args:
        tokens: 1-D integer tensor (e.g. from :func:`load_tokens`).
        global_batch_size: Rows per step over all data-parallel ranks.
        seq_len: Tokens per row fed to the model.

    Raises:
        ValueError: A size is not positive, or one global batch needs more tokens
            than the stream has.
    """

    def __init__(self, tokens: torch.Tensor, *, global_batch_size: int, seq_len: int) -> None:
        if tokens.ndim != 1 or tokens.dtype.is_floating_point:
            raise ValueError(
                f"TextBatches: tokens must be a 1-D integer tensor, got shape "
                f"{tuple(tokens.shape)} of {tokens.dtype}."
            )
        if global_batch_size < 1 or seq_len < 1:
            raise ValueError(
                "TextBatches: global_batch_size and seq_len must be >= 1, got "
                f"{global_batch_size} and {seq_len}."
            )
        self.span = global_batch_size * seq_len
        if self.span + 1 > tokens.numel():
            raise ValueError(
                f"TextBatches: one global batch needs {self.span + 1} tokens "
                f"(global_batch_size={global_batch_size} x seq_len={seq_len} + 1) but the "
                f"text has {tokens.numel()}; lower the batch size or sequence length."
            )
        self.tokens = tokens
        self.global_batch_size = global_batch_size
        self.seq_len = seq_len
        self.position = 0
        self.epoch = 0

    def global_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next global batch ``(inputs, targets)``, each ``(global_batch_size, seq_len)``.

        Advances the position.
        """
        if self.position + self.span + 1 > self.tokens.numel():
            self.position = 0
            self.epoch += 1
        window = self.tokens[self.position : self.position + self.span + 1]
        self.position += self.span
        starts = torch.arange(self.global_batch_size) * self.seq_len
        rows = window[starts[:, None] + torch.arange(self.seq_len + 1)]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def next_batch(self, dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's slice of the next global batch; advances the position.

        Rank ``r`` of ``dp_size`` gets rows ``[r * b, (r + 1) * b)`` with
        ``b = global_batch_size // dp_size``; ranks that differ only in other mesh
        axes (tensor parallel) get the same rows.

        Raises:
            ValueError: ``global_batch_size`` is not divisible by ``dp_size``, or
                ``dp_rank`` is out of range.
        """
        if dp_size < 1 or self.global_batch_size % dp_size:
            raise ValueError(
                f"TextBatches: global_batch_size {self.global_batch_size} is not divisible "
                f"by the data-parallel size {dp_size}; pick a multiple of it."
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"TextBatches: dp_rank {dp_rank} is not in [0, {dp_size}).")
        inputs, targets = self.global_batch()
        rows = self.global_batch_size // dp_size
        local = slice(dp_rank * rows, (dp_rank + 1) * rows)
        return inputs[local], targets[local]

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands: ``{"position": ..., "epoch": ...}``."""
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the stream from a :meth:`state_dict`.

        Raises:
            ValueError: The position is outside the text.
        """
        position, epoch = int(state["position"]), int(state["epoch"])
        if not 0 <= position <= self.tokens.numel() or epoch < 0:
            raise ValueError(
                f"TextBatches: cannot resume at position {position}, epoch {epoch}: the "
                f"text has {self.tokens.numel()} tokens."
            )
        self.position, self.epoch = position, epoch
