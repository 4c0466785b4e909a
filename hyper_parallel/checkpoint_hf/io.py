"""Load a Hugging Face checkpoint into a model on any mesh, and save one back.

:func:`load_hf` fills an already parallelized model (or this rank's pipeline stages)
in place. For every parameter it computes the global indices of this rank's shard
from the DTensor's mesh coordinates and placements (tp, sp, FSDP2/HSDP including
FSDP over a tensor-parallel shard, cp, ep, pp stages alike) and reads just that
box of the file with safetensors' ``get_slice`` — per expert for stacked experts,
only this rank's experts — so a rank reads its shards (plus what it holds
replicated). Each file is opened once; a shard made of a few contiguous blocks
(every shard of tp, FSDP2 and FSDP over tp) is copied block by block from the
file's slice straight into the local tensor (with safetensors >= 0.8 the slice is a
view of the memory-mapped file: nothing is held besides the states), any other
through one slice and ``index_select``. Rotary rows are read in our order
(:mod:`~hyper_parallel.checkpoint_hf.mapping`): whole heads are copied through a
reordering view; otherwise the box spans whole heads, at most one head more than
the shard.

Before anything is written every problem is collected — a tensor the model needs
that the checkpoint lacks, a tensor of the checkpoint no parameter takes, a wrong
shape, a dtype other than fp32/bf16/fp16, a parameter no mapping covers — and
raised as one :class:`HFCheckpointError` listing each; the model is then unchanged.

:func:`save_hf` gathers each parameter (``full_tensor``), one at a time, on the
lowest rank holding it, which writes safetensors shards of at most
``max_shard_size`` bytes; rank 0 writes ``model.safetensors.index.json`` and
``config.json``. ``transformers``' ``from_pretrained`` loads the result.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hyper_parallel._warnings import quiet_strided_gather
from hyper_parallel.checkpoint_hf.config import (
    HFConfig,
    hf_config_from_model,
    read_hf_config,
)
from hyper_parallel.checkpoint_hf.mapping import TensorMap, family_maps, to_hf_tensors
from hyper_parallel.checkpoint_hf.outputs import staged_output
from hyper_parallel.checkpoint_hf.shards import shard_indices

__all__ = [
    "HFCheckpointError",
    "LoadReport",
    "checkpoint_files",
    "load_hf",
    "parse_size",
    "safetensors_problem",
    "save_hf",
]

quiet_strided_gather()  # save_hf's full_tensor of FSDP-over-TP parameters (see _warnings)

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


class HFCheckpointError(ValueError):
    """A checkpoint that does not fit the model; ``problems`` lists each, nothing was loaded."""

    same_on_every_rank = True  # every rank reads every file's header: one message suffices

    def __init__(self, where: str, problems: list[str]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{where}: {len(problems)} problem(s), nothing loaded:\n{lines}")


@dataclasses.dataclass
class LoadReport:
    """What :func:`load_hf` did on this rank.

    Args:
        tensors: Parameters filled.
        bytes_read: Bytes of the slices read from the files (in the files' dtype).
        seconds: Wall time.
        config: The checkpoint's config.
    """

    tensors: int
    bytes_read: int
    seconds: float
    config: HFConfig


_HEADER_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                    "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # fmt: skip


def safetensors_problem(file: str | os.PathLike[str]) -> str | None:
    """What is wrong with a safetensors file, or ``None``: read from its header, not its data.

    A safetensors file is an 8-byte little-endian header length, a JSON header giving
    each tensor's dtype, shape and byte range, then the data. A file cut short (an
    interrupted download or copy) or with a damaged header is named with what is
    wrong, instead of the reader's own error deep in a load.
    """
    file = os.fspath(file)
    if not os.path.isfile(file):
        return f"{file} is missing"
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{file} has {size} bytes, too few for a safetensors header (truncated)"
        length = int.from_bytes(head, "little")
        if 8 + length > size:
            return (
                f"{file} is truncated: its header alone needs {8 + length} bytes, the file "
                f"has {size}"
            )
        try:
            header = json.loads(f.read(length))
            entries = {k: v for k, v in header.items() if k != "__metadata__"}
            ends = [int(v["data_offsets"][1]) for v in entries.values()]
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            return f"{file} has a damaged header (not a safetensors file, or corrupted)"
    for name, entry in entries.items():
        begin, end = (int(x) for x in entry["data_offsets"])
        itemsize = _HEADER_ITEMSIZE.get(entry.get("dtype"))
        if itemsize and end - begin != math.prod(entry.get("shape", [])) * itemsize:
            return f"{file}: the header's entry for {name} is inconsistent (corrupted)"
    needed = 8 + length + max(ends, default=0)
    if needed > size:
        return (
            f"{file} is truncated: it has {size:,} bytes, its header describes {needed:,}; "
            "download or save it again"
        )
    return None


def checkpoint_files(path: str | os.PathLike[str]) -> dict[str, str]:
    """Hugging Face tensor name -> safetensors file path of a checkpoint directory.

    One ``model.safetensors`` or a sharded checkpoint with
    ``model.safetensors.index.json``.

    Raises:
        FileNotFoundError: Neither is there.
    """
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        problem = safetensors_problem(single)
        if problem is not None:
            raise HFCheckpointError(f"checkpoint {path}", [problem])
        with open(single, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            names = [k for k in json.loads(f.read(length)) if k != "__metadata__"]
        return dict.fromkeys(names, single)
    raise FileNotFoundError(
        f"{path}: no model.safetensors or model.safetensors.index.json; save the checkpoint "
        "with safetensors (transformers' save_pretrained does by default)."
    )


def _clean(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def _parts(model: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def _named_params(parts: list[nn.Module]) -> dict[str, nn.Parameter]:
    return {_clean(n): p for part in parts for n, p in part.named_parameters()}


_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}
_MAX_BLOCKS = 64  # a shard of more contiguous pieces is gathered with index_select instead


def _headers(files: dict[str, str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shape and safetensors dtype of every tensor, reading each file's header once."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    headers = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                sl = f.get_slice(name)
                headers[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return headers


def _global_shapes(config: HFConfig) -> dict[str, tuple[int, ...]]:
    """Our parameters' global shapes, from a model built on the meta device."""
    with torch.device("meta"):
        model = config.model_config().build()
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _check(
    config: HFConfig,
    maps: list[TensorMap],
    files: dict[str, str],
    headers: dict[str, tuple[tuple[int, ...], str]],
    params: dict[str, nn.Parameter],
) -> list[str]:
    problems = []
    by_ours = {m.ours: m for m in maps}
    for name in sorted(set(params) - set(by_ours)):
        problems.append(
            f"parameter {name}: no Hugging Face tensor maps to it (model is not a "
            f"{config.family} of this config)"
        )
    used = {n for m in maps for n in m.hf}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    for name in sorted(set(files) - used - optional):
        problems.append(f"unexpected tensor {name} in {os.path.basename(files[name])}")
    # A parameter this rank holds is checked against the tensor it is read into; the
    # config's shapes (a model built on the meta device) are needed only for the
    # parameters of other pipeline stages, which every rank checks alike.
    config_shapes = _global_shapes(config) if any(m.ours not in params for m in maps) else None
    for m in maps:
        if config_shapes is None:
            shape = tuple(params[m.ours].shape)
        else:
            shape = config_shapes.get(m.ours)  # type: ignore[assignment]
            if shape is None:
                problems.append(f"mapping names {m.ours}, which the model of this config lacks")
                continue
            if m.ours in params and tuple(params[m.ours].shape) != shape:
                problems.append(
                    f"parameter {m.ours}: shape {tuple(params[m.ours].shape)} but the "
                    f"checkpoint's config makes it {shape}"
                )
        want = shape[1:] if m.stacked else shape
        if m.stacked and shape[0] != len(m.hf):
            problems.append(
                f"parameter {m.ours}: {shape[0]} experts stacked but the checkpoint's config "
                f"has {len(m.hf)}"
            )
        for hf in m.hf:
            if hf not in headers:
                problems.append(f"missing tensor {hf} (for {m.ours})")
                continue
            got, dtype = headers[hf]
            if got != want:
                problems.append(f"tensor {hf}: shape {got}, expected {want} (for {m.ours})")
            if dtype not in _DTYPES:
                problems.append(f"tensor {hf}: dtype {dtype}; supported: F32, BF16, F16")
    return problems


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive values in ``index``: (position, first value, length)."""
    n = index.numel()
    if n == 0:
        return []
    breaks = ((index[1:] - index[:-1]) != 1).nonzero().flatten().add_(1).tolist()
    starts, ends = [0, *breaks], [*breaks, n]
    firsts = index[starts].tolist()
    return [(s, v, e - s) for s, v, e in zip(starts, firsts, ends, strict=True)]


@dataclasses.dataclass
class _Job:
    """Copy the global indices ``index`` (ours, per dim) of tensor ``name`` into ``target``."""

    name: str
    target: torch.Tensor
    index: list[torch.Tensor]
    runs: list[list[tuple[int, int, int]]]
    tensor_map: TensorMap


def _copy_blocks(sl: Any, job: _Job, itemsize: int) -> int | None:
    """Copy ``job`` as a few contiguous blocks straight from the file's slice; the bytes
    read, or None when the shard is in too many pieces (or rotary rows not whole heads)."""
    head_dim = job.tensor_map.rotary_head_dim
    runs = job.runs
    if math.prod(len(r) for r in runs) > _MAX_BLOCKS:
        return None
    # Our rotary rows are a permutation of Hugging Face's within each head, so a run of
    # whole heads reads the same rows of the file, reordered in the copy.
    if head_dim and any(v % head_dim or n % head_dim for _, v, n in runs[0]):
        return None
    box = tuple(slice(min(v for _, v, _ in r), max(v + n for _, v, n in r)) for r in runs)
    data = sl[box]
    for block in itertools.product(*runs):
        dst = tuple(slice(s, s + n) for s, _, n in block)
        src = tuple(slice(v - b.start, v - b.start + n) for (_, v, n), b in zip(block, box))
        to, frm = job.target[dst], data[src]
        if head_dim:
            heads = to.shape[0] // head_dim
            # Ours: row h D + 2 i + j; Hugging Face's: row h D + j D/2 + i.
            to = to.unflatten(0, (heads, head_dim // 2, 2))
            frm = frm.unflatten(0, (heads, 2, head_dim // 2)).transpose(1, 2)
        to.copy_(frm)
    return math.prod(b.stop - b.start for b in box) * itemsize


def _copy_picked(sl: Any, job: _Job, itemsize: int) -> int:
    """Copy ``job`` through the smallest box holding its rows, picking them with
    ``index_select`` (one slice held besides the states)."""
    index = [job.tensor_map.hf_rows(job.index[0]), *job.index[1:]]
    box, picks = [], []
    for idx in index:
        lo, hi = int(idx.min()), int(idx.max()) + 1
        box.append(slice(lo, hi))
        picks.append(
            None
            if idx.numel() == hi - lo and bool((idx == torch.arange(lo, hi)).all())
            else idx - lo
        )
    data = sl[tuple(box)]
    nbytes = data.numel() * itemsize
    for dim, pick in enumerate(picks):
        if pick is not None:
            data = data.index_select(dim, pick)
    job.target.copy_(data)
    return nbytes


def _read_file(file: str, jobs: list[_Job]) -> int:
    """Run ``jobs`` of one file (opened and memory-mapped once), in file order; bytes read."""
    from safetensors import safe_open

    nbytes = 0
    with safe_open(file, framework="pt") as f:
        # In the order of the data in the file (offset_keys, where safetensors has it).
        keys = f.offset_keys() if hasattr(f, "offset_keys") else f.keys()
        order = {name: k for k, name in enumerate(keys)}
        for job in sorted(jobs, key=lambda j: order[j.name]):
            sl = f.get_slice(job.name)
            itemsize = _ITEMSIZE[sl.get_dtype()]
            n = _copy_blocks(sl, job, itemsize)
            nbytes += _copy_picked(sl, job, itemsize) if n is None else n
    return nbytes


def _local_index(
    param: torch.Tensor, cache: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[Any]]]
) -> tuple[list[torch.Tensor], list[list[tuple[int, int, int]]]]:
    """This rank's global indices of ``param`` per dim, and their runs (:func:`_runs`)."""
    if not isinstance(param, DTensor):
        n = tuple(param.shape)
        return [torch.arange(k) for k in n], [[(0, 0, k)] for k in n]
    # Parameters of one shape and placements share their indices (every layer's wq, ...).
    key = (param.device_mesh, tuple(param.placements), tuple(param.shape))
    if key not in cache:
        index = shard_indices(param)
        cache[key] = index, [_runs(idx) for idx in index]
    return cache[key]


def load_hf(model: nn.Module | Iterable[nn.Module], path: str | os.PathLike[str]) -> LoadReport:
    """Fill ``model`` (a module, or this rank's pipeline stages) from a Hugging Face checkpoint.

    The model must have been built from the checkpoint's config (e.g.
    ``TrainConfig(model=cfg.spec, model_overrides=cfg.model_overrides)`` with
    ``cfg = read_hf_config(path)``) and may be parallelized on any mesh. Call it on
    every rank; it does no communication.

    Args:
        model: The model, or a list of its stages (parameter names are the model's).
        path: The checkpoint directory (``config.json`` and safetensors).

    Returns:
        A :class:`LoadReport` of this rank.

    Raises:
        HFConfigError: The config names fields our model does not implement.
        HFCheckpointError: Missing, unexpected or wrongly shaped tensors (all listed),
            before any parameter is written.
    """
    t0 = time.perf_counter()
    path = os.fspath(path)
    config = read_hf_config(path)
    files = checkpoint_files(path)
    maps = family_maps(
        config.family, config.model_config(), tie_word_embeddings=config.tie_word_embeddings
    )
    if config.tie_word_embeddings and "lm_head.weight" in files:
        # Tied in the config but written out too: transformers ties them anyway.
        maps = [m for m in maps if m.ours != "output.weight"] + [
            TensorMap("output.weight", ("model.embed_tokens.weight",))
        ]
    params = _named_params(_parts(model))
    damaged = [p for p in map(safetensors_problem, sorted(set(files.values()))) if p]
    if damaged:
        raise HFCheckpointError(f"load_hf({path})", damaged)
    problems = _check(config, maps, files, _headers(files), params)
    if problems:
        raise HFCheckpointError(f"load_hf({path})", problems)
    # One job per (parameter, Hugging Face tensor), grouped by file: each file is opened
    # (mapped) once, and each shard copied from it straight into the local tensor.
    jobs: dict[str, list[_Job]] = {}
    cache: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[Any]]] = {}
    count = 0
    with torch.no_grad():
        for m in maps:
            param = params.get(m.ours)
            if param is None:
                continue  # another pipeline stage's
            count += 1
            local = param.to_local() if isinstance(param, DTensor) else param.data
            if local.numel() == 0:
                continue
            index, runs = _local_index(param, cache)
            if m.stacked:
                for k, expert in enumerate(index[0].tolist()):
                    name = m.hf[expert]
                    job = _Job(name, local[k], index[1:], runs[1:], m)
                    jobs.setdefault(files[name], []).append(job)
            else:
                job = _Job(m.hf[0], local, index, runs, m)
                jobs.setdefault(files[m.hf[0]], []).append(job)
        nbytes = sum(_read_file(file, jobs[file]) for file in sorted(jobs))
    return LoadReport(
        tensors=count, bytes_read=nbytes, seconds=time.perf_counter() - t0, config=config
    )


def parse_size(size: int | str) -> int:
    """Bytes of a file size: a count, or ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` (the units
    ``transformers``' ``max_shard_size`` takes: decimal GB/MB/KB, binary GiB/MiB/KiB).

    Raises:
        ValueError: Not a size, or less than one byte.
    """
    value: float | None = None
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        text = size.strip().upper()
        units = (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9),
                 ("MB", 10**6), ("KB", 10**3), ("B", 1), ("", 1))  # fmt: skip
        unit, factor = next((u, f) for u, f in units if text.endswith(u))
        try:
            value = float(text[: len(text) - len(unit)]) * factor
        except ValueError:
            value = None
    if value is None or value != value:  # not a number (or NaN)
        raise ValueError(
            f"max_shard_size {size!r}: give a size such as 5GB, 500MB, 2GiB or a byte count."
        )
    if value < 1:
        raise ValueError(f"max_shard_size {size!r}: a file holds at least one byte.")
    return int(value)


def save_hf(
    model: nn.Module | Iterable[nn.Module],
    path: str | os.PathLike[str],
    *,
    hf_config: HFConfig | dict[str, Any] | None = None,
    model_config: Any = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    inputs: Iterable[str | os.PathLike[str] | None] = (),
    extra_files: dict[str, str] | None = None,
    what: str = "save_hf",
) -> list[str]:
    """Write ``model`` (or this rank's stages) as a Hugging Face checkpoint in ``path``.

    Call it on every rank (it gathers each parameter over its mesh). The config is
    the checkpoint's own (``hf_config``: an :class:`HFConfig` or a ``config.json``
    dict; its ``tie_word_embeddings`` kept only when the output projection still
    equals the embedding; with ``model_config`` too, the fields in which that model
    differs from the checkpoint's, such as a ``rope_theta`` the run overrode, are
    written over it) or, for a model that did not come from Hugging Face, made from
    ``model_config`` (our ``Transformer.Config``).

    Args:
        model: The model, or this rank's pipeline stages.
        path: Output directory (created).
        hf_config: The checkpoint's config, when the model was loaded from one.
        model_config: Our config, used when ``hf_config`` is not given.
        max_shard_size: Largest safetensors file, bytes or ``"500MB"``-style
            (:func:`parse_size`).
        dtype: Cast every tensor to this dtype (default: the checkpoint's ``dtype``
            when ``hf_config`` says bf16 or fp16, else the parameters' own; fp32 when
            they differ). ``config.json``'s ``dtype`` states the dtype written.
        overwrite: Replace a non-empty ``path`` (nothing of the old files is left).
        inputs: The run's inputs (the checkpoint it started from): ``path`` may never
            be one of them.
        extra_files: ``{name: source file}`` copied into the checkpoint by rank 0
            (the tokenizer's files).
        what: How the user named ``path``, for error messages (``--save-hf``).

    The files are written into ``path.partial`` and renamed onto ``path`` once every
    rank is done (:mod:`~hyper_parallel.checkpoint_hf.outputs`).

    Returns:
        The files written (on rank 0; other ranks: those they wrote).

    Raises:
        OutputError: ``path`` is an input, or not empty and ``overwrite`` is false;
            nothing is written.
        ValueError: ``max_shard_size`` is not a size; nothing is written.
    """
    path = os.fspath(path)
    shard_bytes = parse_size(max_shard_size)  # before any gather or file
    if isinstance(hf_config, HFConfig):
        raw = dict(hf_config.raw)
    elif hf_config is not None:
        raw = dict(hf_config)
    elif model_config is not None:
        raw = hf_config_from_model(model_config)
    else:
        raise ValueError(
            "save_hf: give hf_config (the checkpoint's config) or model_config (our "
            "Transformer.Config) so config.json can be written."
        )
    if hf_config is not None and model_config is not None:
        _carry_overrides(raw, read_hf_config(raw), model_config)
    config = read_hf_config(raw)
    if dtype is None and hf_config is not None:
        # A checkpoint's own dtype (bf16 and fp16 values are exact in fp32 states).
        saved = raw.get("dtype", raw.get("torch_dtype"))
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(saved)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    maps = family_maps(config.family, config.model_config())
    params = _named_params(_parts(model))
    held = sorted(m.ours for m in maps if m.ours in params)
    dtypes = sorted({str(params[name].dtype) for name in held})
    if distributed:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (held, dtypes))
    else:
        everyone = [(held, dtypes)]
    writer = {}
    for r, (names, _) in enumerate(everyone):
        for name in names:
            writer.setdefault(name, r)
    missing = sorted({m.ours for m in maps} - set(writer))
    if missing:
        raise ValueError(f"save_hf: no rank holds {missing}; pass every pipeline stage.")
    if dtype is None:
        # The parameters' own dtype (bf16 under bf16-true); fp32, exact, when they differ.
        own = {d for _, ds in everyone for d in ds}
        dtype = getattr(torch, own.pop().removeprefix("torch.")) if len(own) == 1 else torch.float32
    # config.json states the dtype the files hold (from_pretrained's dtype="auto" reads it).
    raw["dtype"] = str(dtype).removeprefix("torch.")
    if "torch_dtype" in raw:  # older transformers' name for it
        raw["torch_dtype"] = raw["dtype"]
    with staged_output(
        path, overwrite=overwrite, inputs=inputs, what=what, distributed=distributed
    ) as tmp:
        result = _write_hf(
            tmp, path, rank, distributed, maps, params, writer, config, raw, dtype,
            shard_bytes,
        )  # fmt: skip
        if rank == 0:
            for name, source in (extra_files or {}).items():
                shutil.copyfile(source, os.path.join(tmp, name))
    return result


def _carry_overrides(raw: dict[str, Any], source: HFConfig, model_config: Any) -> None:
    """Write into ``raw`` (a checkpoint's ``config.json``) the fields in which the model
    trained (``model_config``: its ``model_overrides`` on top) differs from the one
    ``raw`` makes; the rest of ``raw`` (token ids, metadata) is kept as it was."""
    was = hf_config_from_model(source.model_config())
    now = hf_config_from_model(model_config)
    changed = {k: v for k, v in now.items() if was.get(k) != v}
    if "rope_parameters" in changed:  # the older fields it replaces would contradict it
        raw.pop("rope_theta", None)
        raw.pop("rope_scaling", None)
    raw.update(changed)


def _write_hf(
    path: str,
    final_dir: str,
    rank: int,
    distributed: bool,
    maps: list[TensorMap],
    params: dict[str, nn.Parameter],
    writer: dict[str, int],
    config: HFConfig,
    raw: dict[str, Any],
    dtype: torch.dtype | None,
    limit: int,
) -> list[str]:
    """Write the shards, index and config into ``path`` (to be renamed onto ``final_dir``)."""
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    written: list[tuple[str, list[str]]] = []
    tied_output: torch.Tensor | None = None
    tied_embedding: torch.Tensor | None = None

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        from safetensors.torch import save_file

        name = f"part-r{rank:05d}-{len(written):05d}.safetensors"
        save_file(pending, os.path.join(path, name), metadata={"format": "pt"})
        written.append((name, sorted(pending)))
        pending, pending_bytes = {}, 0

    with torch.no_grad():
        for m in maps:
            param = params.get(m.ours)
            if param is None:
                continue
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            if rank != writer[m.ours]:
                continue
            full = full.detach().cpu()
            if dtype is not None:
                full = full.to(dtype)
            if config.tie_word_embeddings and m.ours == "output.weight":
                tied_output = full
                continue
            tensors = to_hf_tensors(m, full)
            if config.tie_word_embeddings and m.ours == "tok_embeddings.weight":
                tied_embedding = full
            for hf_name, tensor in tensors.items():
                size = tensor.numel() * tensor.element_size()
                if pending and pending_bytes + size > limit:
                    flush()
                pending[hf_name] = tensor
                pending_bytes += size
    # Tied only while the output projection still equals the embedding (same writer).
    untie = config.tie_word_embeddings and (
        tied_output is not None
        and (tied_embedding is None or not torch.equal(tied_output, tied_embedding))
    )
    if untie:
        assert tied_output is not None
        pending["lm_head.weight"] = tied_output.contiguous()
    flush()
    if distributed:
        all_written: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(all_written, (written, untie))
    else:
        all_written = [(written, untie)]
    files = [f for w, _ in all_written for f in w]
    if any(u for _, u in all_written):
        raw["tie_word_embeddings"] = False
    result = [f for f, _ in written]
    if rank == 0:
        total = len(files)
        weight_map, result = {}, []
        for k, (name, keys) in enumerate(files):
            final = f"model-{k + 1:05d}-of-{total:05d}.safetensors"
            os.replace(os.path.join(path, name), os.path.join(path, final))
            weight_map.update(dict.fromkeys(keys, final))
            result.append(os.path.join(path, final))
        size = sum(int(os.path.getsize(f)) for f in result)
        result = [os.path.join(final_dir, os.path.basename(f)) for f in result]
        index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(raw, f, indent=2)
    return result
