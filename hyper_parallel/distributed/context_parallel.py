"""Context parallelism: the sequence split across the ``cp`` axis, load-balanced.

A model laid out with ``apply_cp`` (e.g. :func:`hyper_parallel.models.llama.apply_cp`)
keeps its activations ``Shard(seq)`` on ``cp``; each attention block gathers keys and
values over ``cp`` and masks causally by *global* positions. This module is the data
side of that layout, and its checks:

- :func:`shard_sequence` cuts a batch's tokens (targets, positions, anything indexed
  by sequence) for one rank, and :func:`unshard_sequence` puts a rank-local result
  back together in sequence order (for anything a user reads back).
- The split is **head-tail** balanced: the sequence is cut into ``2 * cp`` chunks and
  rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i``. Under a causal mask a query at
  position ``p`` attends to ``p + 1`` keys, so a plain split in ``cp`` contiguous
  pieces gives the last rank ``2 * cp - 1`` times the work of the first; pairing an
  early chunk with a late one gives every rank the same work (:func:`causal_work`).
  This is the balancing of Megatron-LM's context parallelism and torchtitan's
  ``_HeadTailLoadBalancer``.
- :func:`positions` is each rank's global token positions, passed to the model as
  ``model(tokens, positions=positions)``.
- The loss on a rank (``cross_entropy_loss``) is the sum over its own tokens times ``cp``
  over the non-ignored targets of the whole sequence (one count all-reduced over
  ``cp``), so the mean of the ranks' losses is the global mean even where the ranks
  hold different numbers of ignored (-100) targets, and averaging the gradients over
  ``cp`` (what FSDP2 does over ``fsdp = dp_shard x cp``) gives the one-device gradient.
- :func:`cp_findings` reports every problem of a model + layout + sequence length as
  :class:`~hyper_parallel.dmodule.Finding` s, before anything runs.

Example::

    from hyper_parallel.distributed import MeshLayout, context_parallel as cp
    from hyper_parallel.models.llama import apply_cp, preset_config

    layout = MeshLayout.parse("cp=2")
    mesh = layout.build("cpu")                       # 2 ranks under torchrun
    config = apply_cp(preset_config("llama3-debug"), cp_size=2)
    model = config.build().parallelize(mesh.submesh(("cp",)))
    rank = mesh.local_rank("cp")
    tokens = cp.shard_sequence(batch[:, :-1], rank, 2)
    targets = cp.shard_sequence(batch[:, 1:], rank, 2)
    logits = model(tokens, positions=cp.positions(tokens.shape[1] * 2, rank, 2))
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.dmodule.findings import Finding

__all__ = [
    "CP_AXIS",
    "causal_work",
    "chunk_order",
    "cp_findings",
    "positions",
    "shard_sequence",
    "unshard_sequence",
]

CP_AXIS = "cp"
"""The mesh axis context parallelism splits the sequence over."""


# --------------------------------------------------------------------------- the split


def _check_split(length: int, cp_size: int, what: str) -> None:
    if not isinstance(cp_size, int) or isinstance(cp_size, bool) or cp_size < 1:
        raise ValueError(f"{what}: cp_size={cp_size!r}; it must be an integer >= 1.")
    if length % (2 * cp_size):
        raise ValueError(
            f"{what}: a sequence of {length} tokens cannot be split head-tail over cp={cp_size} "
            f"ranks (2 x cp = {2 * cp_size} equal chunks); use a sequence length divisible by "
            f"{2 * cp_size} (e.g. {length - length % (2 * cp_size)} or "
            f"{length + 2 * cp_size - length % (2 * cp_size)}), or pad the batch."
        )


def _sequence_dim(t: torch.Tensor, dim: int, what: str) -> int:
    """``dim`` as a dim of ``t`` (negative counts from the end), refused out of range.

    Wrapping it modulo ``t.ndim`` instead would cut another dim without a word (dim=2 of
    ``[batch, seq]`` tokens is the batch).
    """
    if t.ndim == 0 or not -t.ndim <= dim < t.ndim:
        raise ValueError(
            f"{what}: dim={dim} is not a dim of a tensor of shape {tuple(t.shape)} "
            f"({t.ndim}-D); pass the sequence dim (dim=1 for [batch, seq, ...], dim=0 for "
            "one sequence)."
        )
    return dim % t.ndim


def _check_rank(cp_rank: int, cp_size: int, what: str) -> None:
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(
            f"{what}: cp_rank={cp_rank!r} is not a rank of a cp axis of size {cp_size}; "
            f"use mesh['cp'].get_local_rank() (an int, 0..{cp_size - 1})."
        )


def chunk_order(cp_size: int) -> list[int]:
    """The chunks of the sequence in rank order (what an all-gather over ``cp`` of each
    rank's part holds): ``[0, 2 cp - 1, 1, 2 cp - 2, ...]``.

    Example:
        >>> chunk_order(2)
        [0, 3, 1, 2]
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"chunk_order: cp_size={cp_size!r}; it must be an integer >= 1.")
    return [c for r in range(cp_size) for c in (r, 2 * cp_size - 1 - r)]


def shard_sequence(t: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``t`` along ``dim``: chunks ``cp_rank`` and ``2*cp - 1 - cp_rank``.

    Args:
        t: A tensor indexed by sequence on ``dim`` (tokens ``[B, S]``, targets, positions).
        cp_rank: This rank's coordinate on the ``cp`` axis.
        cp_size: Size of the ``cp`` axis.
        dim: The sequence dim of ``t``.

    Returns:
        A tensor with ``S / cp`` entries on ``dim`` (a copy, at ``cp_size=1`` too; ``t``
        is unchanged).

    Raises:
        ValueError: ``S`` is not divisible by ``2 * cp_size``, ``cp_rank`` is not an int
            in range, or ``dim`` is not a dim of ``t``.

    Example:
        >>> shard_sequence(torch.arange(8), 0, 2, dim=0)
        tensor([0, 1, 6, 7])
    """
    dim = _sequence_dim(t, dim, "shard_sequence")
    _check_split(t.shape[dim], cp_size, "shard_sequence")
    _check_rank(cp_rank, cp_size, "shard_sequence")
    if cp_size == 1:
        return t.clone()
    chunks = t.chunk(2 * cp_size, dim)
    return torch.cat((chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]), dim)


def positions(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global positions of this rank's tokens, in the order :func:`shard_sequence` keeps them.

    Args:
        seq_len: The global sequence length.
        cp_rank: This rank's coordinate on the ``cp`` axis.
        cp_size: Size of the ``cp`` axis.

    Returns:
        A ``LongTensor`` of ``seq_len / cp_size`` positions (pass it as
        ``model(tokens, positions=...)``; it broadcasts over the batch).

    Example:
        >>> positions(8, 1, 2)
        tensor([2, 3, 4, 5])
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(
            f"positions: seq_len={seq_len!r}; it must be the global sequence length, an int "
            ">= 0 (tokens.shape[1] * cp_size for a rank's tokens)."
        )
    return shard_sequence(torch.arange(seq_len), cp_rank, cp_size, dim=0)


def unshard_sequence(local: torch.Tensor, cp_mesh: DeviceMesh, dim: int = 1) -> torch.Tensor:
    """Every rank's part of a head-tail split sequence, gathered back in sequence order.

    All-gathers over ``cp_mesh`` (through DTensor, so it is differentiable) and undoes
    the head-tail order. Every rank receives the whole tensor.

    Args:
        local: This rank's part (as :func:`shard_sequence` cut it, or an output computed
            from such parts, e.g. ``logits.to_local()``). A DTensor sharded on ``dim``
            over ``cp`` is taken whole with ``full_tensor()`` (other axes too).
        cp_mesh: The 1-D ``cp`` mesh (``mesh["cp"]``).
        dim: The sequence dim.

    Returns:
        The full tensor, ``cp`` times longer on ``dim``, in sequence order.

    Example::

        logits = model(tokens, positions=pos)           # a DTensor, Shard(1) on cp
        full = unshard_sequence(logits.to_local(), mesh["cp"])
    """
    if cp_mesh.ndim != 1:
        raise ValueError(
            f"unshard_sequence: cp_mesh is {cp_mesh.ndim}-D {cp_mesh.mesh_dim_names}; pass "
            "the 1-D cp mesh (mesh['cp'])."
        )
    cp_size = cp_mesh.size()
    dim = _sequence_dim(local, dim, "unshard_sequence")
    if isinstance(local, DTensor):
        _check_split_on_cp(local, cp_mesh, dim)
        full = local.full_tensor()
    else:
        full = DTensor.from_local(local, cp_mesh, [Shard(dim)], run_check=False).redistribute(
            cp_mesh, [Replicate()]
        )
        full = full.to_local()
    if cp_size == 1:
        return full
    _check_split(full.shape[dim], cp_size, "unshard_sequence")
    chunks = full.chunk(2 * cp_size, dim)
    where = {chunk: i for i, chunk in enumerate(chunk_order(cp_size))}
    return torch.cat([chunks[where[c]] for c in range(2 * cp_size)], dim)


def _check_split_on_cp(local: DTensor, cp_mesh: DeviceMesh, dim: int) -> None:
    """A DTensor is taken whole only where it is ``Shard(dim)`` on the ``cp`` axis: any
    other placement there is not a head-tail split, and reordering its chunks would
    scramble it (a replicated one is already whole)."""
    mesh, placements = local.device_mesh, local.placements
    names, cp_names = mesh.mesh_dim_names, cp_mesh.mesh_dim_names
    if names is not None and cp_names is not None:
        on_cp = [p for name, p in zip(names, placements) if name == cp_names[0]]
    else:
        on_cp = list(placements) if mesh.ndim == 1 and mesh == cp_mesh else []
    if len(on_cp) != 1 or not on_cp[0].is_shard(dim):
        raise ValueError(
            f"unshard_sequence: the DTensor is placed {list(placements)} on mesh axes "
            f"{names}, not Shard({dim}) on the cp axis {cp_names}: it is not this rank's "
            "head-tail part of the sequence. Take a tensor that is already whole with "
            f"full_tensor(), or pass the sequence dim (dim={dim} given)."
        )


def causal_work(seq_len: int, cp_size: int, *, balanced: bool = True) -> list[int]:
    """Causal attention work of each rank: the (query, key) pairs it scores.

    A query at global position ``p`` attends to the ``p + 1`` keys at positions
    ``0..p``; a rank's work is that sum over its queries (FLOPs are proportional).

    Args:
        seq_len: The global sequence length.
        cp_size: Size of the ``cp`` axis.
        balanced: The head-tail split (default); ``False`` for a plain split into
            ``cp_size`` contiguous pieces, for comparison.

    Returns:
        One count per rank, in rank order.

    Example:
        >>> causal_work(8, 2), causal_work(8, 2, balanced=False)
        ([18, 18], [10, 26])
    """
    if balanced:
        _check_split(seq_len, cp_size, "causal_work")
        per_rank = [positions(seq_len, r, cp_size) for r in range(cp_size)]
    else:
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"causal_work: cp_size={cp_size!r}; it must be an integer >= 1.")
        if seq_len % cp_size:
            raise ValueError(
                f"causal_work: {seq_len} tokens do not split into cp={cp_size} equal pieces."
            )
        per_rank = list(torch.arange(seq_len).chunk(cp_size))
    return [int((p + 1).sum()) for p in per_rank]


# --------------------------------------------------------------------------- checks


def _error(path: str, field: str, message: str, fix: str) -> Finding:
    return Finding("error", path, field, message, fix)


def _model_class(model_config: Any) -> type | None:
    if isinstance(model_config, torch.nn.Module):
        return type(model_config)
    return type(model_config).__dict__.get("_owner") or getattr(type(model_config), "_owner", None)


def _handles_positions(model_config: Any) -> bool:
    cls = _model_class(model_config)
    if cls is None:
        return False
    try:
        return "positions" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def _attention_heads(model_config: Any) -> list[tuple[str, int, int]]:
    """``(path, query heads, key/value heads)`` of each attention, as the model's family
    declares them (:attr:`~hyper_parallel.dmodule.ModelFamily.attention_heads`)."""
    from hyper_parallel.dmodule.model_spec import family_of

    family = family_of(model_config)
    if family is None or family.attention_heads is None:
        return []
    return family.attention_heads(model_config)


def _max_seq_len(model_config: Any) -> int | None:
    """The positions the model covers, as its family declares them
    (:meth:`~hyper_parallel.contract.ModelFamily.max_seq_len`)."""
    from hyper_parallel.dmodule.model_spec import family_of

    family = family_of(model_config)
    return family.max_seq_len(model_config) if family is not None else None


def _sequence_parallel(model_config: Any) -> bool:
    """Whether a config splits the residual stream's sequence over ``tp`` (TP+SP)."""
    norm = getattr(model_config, "norm", None)
    config = getattr(norm, "sharding_config", None)
    placement = ((config.in_dst_shardings or {}).get("x") or {}) if config is not None else {}
    tp = next((p for k, p in placement.items() if str(getattr(k, "value", k)) == "tp"), None)
    return tp is not None and tp.is_shard()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_findings(model_config: Any, layout: MeshLayout, seq_len: int | None = None) -> list[Finding]:
    """Every problem of context (and tensor) parallelism for a model, layout and sequence.

    Checked before anything is built: ``seq_len`` divisible by ``2 * cp`` (head-tail
    chunks), within the model's position tables, and, under sequence parallelism, each
    rank's ``seq_len / cp`` tokens divisible by ``tp``; a model that takes ``positions``
    when ``cp > 1``; ``tp`` dividing the query and key/value head counts (a ``tp`` larger
    than the key/value heads is named as such, with a layout that fits).

    Args:
        model_config: The model's config (e.g. a Llama ``Transformer.Config``, with or
            without layouts applied), or a model.
        layout: The mesh layout.
        seq_len: The global sequence length of a batch, when known.

    Returns:
        ``Finding`` s (all errors); empty when the combination runs.

    Example:
        >>> from hyper_parallel.models.llama import preset_config
        >>> [f.field for f in cp_findings(preset_config("llama3-debug"),
        ...                               MeshLayout.parse("cp=2"), seq_len=30)]
        ['seq_len']
    """
    out: list[Finding] = []
    cp, tp = layout.cp, layout.tp
    if cp > 1 and not _handles_positions(model_config):
        name = _model_class(model_config)
        out.append(
            _error(
                "",
                "forward",
                f"context parallelism (cp={cp}) splits the sequence across ranks, but "
                f"{getattr(name, '__name__', type(model_config).__name__)}.forward takes no "
                "'positions', so each rank would read its tokens as positions 0..S/cp-1 "
                "and mask them causally by local index.",
                "use a model whose forward takes positions (the reference Llama), or run "
                "without cp (put those ranks on dp_shard).",
            )
        )
    if seq_len is not None and cp > 1 and seq_len % (2 * cp):
        # Under sequence parallelism each cp rank's share is split again over tp: the
        # lengths and cp sizes offered must pass that check too.
        sp_tp = tp if tp > 1 and _sequence_parallel(model_config) else 1
        step = cp * math.lcm(2, sp_tp)
        lengths = [n for n in (seq_len - seq_len % step, seq_len - seq_len % step + step) if n]
        sizes = [
            c
            for c in range(2, min(seq_len // 2, 64) + 1)
            if seq_len % (c * math.lcm(2, sp_tp)) == 0
        ]
        what = f"{step}" if sp_tp == 1 else f"cp x lcm(2, tp) = {step}"
        out.append(
            _error(
                "data",
                "seq_len",
                f"a sequence of {seq_len} tokens cannot be split head-tail over cp={cp} ranks: "
                f"that needs 2 x cp = {2 * cp} equal chunks.",
                f"set the sequence length (--seq; --seq-len on train.run and demo) to a "
                f"multiple of {what} (e.g. {' or '.join(map(str, lengths))})"
                + (f", or use cp among {sizes}." if sizes else ", or pad the batch."),
            )
        )
    max_seq_len = _max_seq_len(model_config)
    if seq_len is not None and max_seq_len is not None and seq_len > max_seq_len:
        out.append(
            _error(
                "rope",
                "max_seq_len",
                f"a sequence of {seq_len} tokens is longer than the rotary tables "
                f"(max_seq_len={max_seq_len}); the global positions must fit them.",
                f"build the model with max_seq_len >= {seq_len}, or shorten the sequence.",
            )
        )
    if (
        seq_len is not None
        and tp > 1
        and _sequence_parallel(model_config)
        and seq_len % (2 * cp) == 0
        and (seq_len // cp) % tp
    ):
        local = seq_len // cp
        out.append(
            _error(
                "data",
                "seq_len",
                f"with cp={cp} x tp={tp} and sequence parallelism, each cp rank's {local} tokens "
                f"are split again over tp={tp}, which does not divide {local}.",
                f"use a sequence length divisible by cp x lcm(2, tp) = {cp * math.lcm(2, tp)}, "
                "or tensor parallelism without sequence parallelism (apply_tp).",
            )
        )
    if tp > 1:
        for path, num_heads, num_kv_heads in _attention_heads(model_config):
            if tp > num_kv_heads:
                fits = max(d for d in _divisors(num_kv_heads) if d <= tp)
                rest = tp // fits
                out.append(
                    _error(
                        path,
                        "tp",
                        f"tp={tp} is larger than the {num_kv_heads} key/value heads: each tp "
                        "rank must hold whole key/value heads.",
                        f"use tp={fits} (a divisor of {num_kv_heads}) and give the other "
                        f"x{rest} ranks to cp (cp={cp * rest}, which splits the sequence "
                        "instead of the heads) or to dp_shard.",
                    )
                )
            elif num_kv_heads % tp or num_heads % tp:
                kind, n = ("key/value", num_kv_heads) if num_kv_heads % tp else ("query", num_heads)
                out.append(
                    _error(
                        path,
                        "tp",
                        f"tp={tp} does not divide the {n} {kind} heads: each tp rank must hold "
                        "whole heads.",
                        f"use a tp among {_divisors(math.gcd(num_heads, num_kv_heads))}, and put "
                        "the remaining ranks on cp or dp_shard.",
                    )
                )
            if out and out[-1].path == path:
                break  # every layer has the same heads: report once
    return out
