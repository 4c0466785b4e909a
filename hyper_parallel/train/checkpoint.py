"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): save, load, find the latest.

A checkpoint is one DCP directory per step (``step_000120/``) holding the model and
optimizer states (DTensor shards under TP/FSDP, plain tensors in one process; the
optimizer's keyed by parameter name, so the parts of a pipeline — a list of stage
modules with one optimizer each — merge into one checkpoint that loads at any
split), a small ``train`` record (step, data position) and each rank's random
number generator states. DCP stores every DTensor with its
global shape, so a checkpoint saved at one mesh loads at any other (dp=2 x tp=2 →
tp=4, or into one process with no process group) and the parameters are bitwise the
same. A step directory counts as complete once DCP has written its ``.metadata``
file, which happens after every rank has written its shards, and once the
checksums manifest (``checksums.json``: every file's size and CRC-32, each rank's
shards hashed by that rank) is in place. :func:`latest_checkpoint` verifies the
manifest and passes over a checkpoint whose files were truncated or corrupted after
the save, with a warning naming the bad file, so a restart never picks it again
(the previous complete checkpoint is used), and refuses a directory where every
complete checkpoint is damaged (:class:`NoIntactCheckpointError`: a resume there is
not a fresh start); :func:`load_checkpoint` refuses a damaged one.
A checkpoint saved before manifests existed (``.metadata`` only) still loads.

Example::

    from hyper_parallel.train.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint("checkpoints/run1")
    if path is not None:
        train_state = load_checkpoint(path, model=model, optimizer=optimizer)
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import warnings
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hyper_parallel.checkpoint_hf.outputs import PARTIAL_MARK, staged_output

__all__ = [
    "NoIntactCheckpointError",
    "PendingSave",
    "async_save_checkpoint",
    "checkpoint_path",
    "checkpoint_problem",
    "checkpoint_steps",
    "is_step_folder",
    "latest_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "remove_checkpoints",
    "save_checkpoint",
    "unreadable_as_damaged",
    "verify_checkpoint",
]

_STEP_DIR = re.compile(r"^step_(\d+)$")
_METADATA = ".metadata"  # written by DCP's coordinator after all ranks finished
_MANIFEST = "checksums.json"  # written after .metadata: every file's size and CRC-32
_CHUNK = 1 << 22


def is_step_folder(name: str) -> bool:
    """``name`` is a step folder's (``step_N``) or its temporary sibling's (``.partial``):
    the checkpoint writer replaces and prunes those."""
    return _STEP_DIR.match(name.removesuffix(".partial")) is not None


def checkpoint_steps(checkpoint_dir: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(step, path)`` of every step directory under ``checkpoint_dir`` holding DCP's
    ``.metadata``, by step (damaged ones included: see :func:`verify_checkpoint`)."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        return []
    steps = []
    for name in os.listdir(checkpoint_dir):
        match = _STEP_DIR.match(name)
        if match and os.path.isfile(os.path.join(checkpoint_dir, name, _METADATA)):
            steps.append((int(match.group(1)), os.path.join(checkpoint_dir, name)))
    return sorted(steps)


def prune_checkpoints(
    checkpoint_dir: str | os.PathLike[str], keep: int, *, step: int | None = None
) -> list[str]:
    """Delete all but the ``keep`` newest intact checkpoints under ``checkpoint_dir``.

    Only intact checkpoints count towards ``keep``, their checksums verified as
    :func:`latest_checkpoint` does (a size check alone passes a shard corrupted in
    place), so a damaged newest one never costs the last good one: it stays (for the
    user to inspect) until ``keep`` intact ones are newer. ``step``: the step just
    saved. Its checkpoint is kept and counts (its checksums were just computed from
    its files); newer ones (an earlier run's, passed over on ``--resume`` as damaged)
    are neither counted nor deleted, so they never stand in for it. Call it on one
    process (the trainer: rank 0).

    Returns:
        The step directories deleted.
    """
    if keep < 1:
        return []
    kept, deleted = 0, []
    for saved_step, path in reversed(checkpoint_steps(checkpoint_dir)):
        if step is not None and saved_step > step:
            continue
        if kept < keep:
            kept += saved_step == step or _verified(path)
            continue
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


# Checkpoints whose checksums this process verified, by path, with their manifest's
# identity: pruning after every save reads each kept checkpoint once, not at every save.
# A step saved again is a new directory (renamed into place): a new manifest inode.
_VERIFIED: dict[str, tuple[int, int, int]] = {}


def _manifest_identity(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(os.path.join(path, _MANIFEST))
    except OSError:
        return None  # no manifest (an old checkpoint): verified on .metadata alone
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


def _remember_verified(path: str) -> None:
    """Record that ``path`` passed a full :func:`verify_checkpoint` in this process."""
    identity = _manifest_identity(path)
    if identity is not None:
        _VERIFIED[os.path.realpath(path)] = identity


def checkpoint_problem(path: str) -> str | None:
    """:func:`verify_checkpoint` of ``path``, its checksums read once per process (a
    checkpoint verified already gets the size check only)."""
    identity = _manifest_identity(path)
    if identity is not None and _VERIFIED.get(os.path.realpath(path)) == identity:
        return verify_checkpoint(path, contents=False)  # sizes: cheap, every time
    problem = verify_checkpoint(path)
    if problem is None:
        _remember_verified(path)
    return problem


def _verified(path: str) -> bool:
    """Whether the checkpoint at ``path`` is intact, checksums included (cached)."""
    return checkpoint_problem(path) is None


def remove_checkpoints(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Delete every step directory (complete, partial or damaged) under ``checkpoint_dir``."""
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        return []
    removed = []
    for name in sorted(os.listdir(checkpoint_dir)):
        if is_step_folder(name):
            shutil.rmtree(os.path.join(checkpoint_dir, name), ignore_errors=True)
            removed.append(os.path.join(checkpoint_dir, name))
    return removed


def checkpoint_path(checkpoint_dir: str | os.PathLike[str], step: int) -> str:
    """The directory of the checkpoint of ``step`` under ``checkpoint_dir``."""
    return os.path.join(os.fspath(checkpoint_dir), f"step_{step:06d}")


class NoIntactCheckpointError(ValueError):
    """A checkpoint directory holds complete step folders but every one is damaged.

    Starting over there would silently throw the run away (and its first save would
    replace a damaged checkpoint the user may still recover), so
    :func:`latest_checkpoint` refuses instead of answering ``None``.

    Attributes:
        checkpoint_dir: The directory looked in.
        damaged: ``(step folder, what is wrong)`` of each, newest first.
    """

    same_on_every_rank = True  # rank 0 decides and tells the others: one message suffices

    def __init__(self, checkpoint_dir: str, damaged: Sequence[tuple[str, str]]) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.damaged = list(damaged)
        super().__init__(
            f"no intact checkpoint to resume from in --checkpoint-dir {checkpoint_dir}: "
            f"{_damaged_list(self.damaged)}. Fix: restore the damaged step folder(s) from "
            "a copy and resume again; or delete them to start over at step 0 (with "
            "hyper-parallel train: drop --resume and pass --overwrite, which removes "
            "them), or choose another --checkpoint-dir."
        )


def _damaged_list(damaged: Sequence[tuple[str, str]]) -> str:
    return "; ".join(f"{path} is damaged: {problem}" for path, problem in damaged)


def latest_checkpoint(
    checkpoint_dir: str | os.PathLike[str], *, distributed: bool | None = None
) -> str | None:
    """The complete checkpoint with the highest step under ``checkpoint_dir``, if any.

    A step directory without DCP's ``.metadata`` (a save interrupted by a crash) is
    skipped; so, with a ``RuntimeWarning`` naming the bad file and the checkpoint used
    instead, is one whose files do not match their saved sizes and checksums
    (:func:`verify_checkpoint`). With a process group, rank 0 looks and tells the
    others, so every rank resumes from the same step even if they see the file system
    at different times.

    Args:
        checkpoint_dir: The directory holding ``step_*`` checkpoints.
        distributed: Whether all ranks of the default process group call this
            together; defaults to whether one is initialized. Pass ``False`` for a
            one-process model inside a larger job.

    Returns:
        The step directory, or ``None`` when ``checkpoint_dir`` holds no complete one.

    Raises:
        NoIntactCheckpointError: It holds complete step directories, but every one is
            damaged (on every rank): resuming there is not starting over.
    """
    distributed = _distributed(distributed)
    found: list[Any] = [(None, [])]
    if not distributed or dist.get_rank() == 0:
        found[0] = _latest_on_disk(os.fspath(checkpoint_dir))
    if distributed and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    path, damaged = found[0]
    if path is None and damaged:
        raise NoIntactCheckpointError(os.fspath(checkpoint_dir), damaged)
    return path


def _latest_on_disk(checkpoint_dir: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest intact checkpoint (or ``None``) and the damaged ones newer than it."""
    damaged: list[tuple[str, str]] = []
    for _, path in reversed(checkpoint_steps(checkpoint_dir)):
        problem = verify_checkpoint(path)  # always read in full: the one to resume from
        if problem is None:
            _remember_verified(path)  # its reader (export-hf) need not hash it again
            for bad, bad_problem in damaged:
                warnings.warn(
                    f"latest_checkpoint: skipping {bad}: {bad_problem}; using the earlier "
                    f"complete checkpoint {path} instead (restore, delete or move the "
                    "damaged one).",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return path, damaged
        damaged.append((path, problem))
    return None, damaged


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _file_record(path: str) -> dict[str, int]:
    return {"size": os.path.getsize(path), "crc32": _crc32(path)}


def verify_checkpoint(path: str | os.PathLike[str], *, contents: bool = True) -> str | None:
    """What is wrong with the checkpoint at ``path``, or ``None`` if it is intact.

    Checks DCP's ``.metadata`` is there and, where the checksums manifest exists,
    that every file it lists has its recorded size and (``contents=True``) CRC-32.
    A checkpoint without a manifest (saved before manifests existed) passes on its
    ``.metadata`` alone.

    Returns:
        ``None``, or one sentence naming the first bad file.
    """
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, _METADATA)):
        return f"no {_METADATA} (the save did not finish)"
    manifest_path = os.path.join(path, _MANIFEST)
    if not os.path.isfile(manifest_path):
        return None
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{manifest_path} is unreadable ({e})"
    for name, record in sorted(manifest.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        size = os.path.getsize(file)
        if size != record["size"]:
            return f"{file} has {size} bytes, {record['size']} were saved (truncated?)"
        if contents and _crc32(file) != record["crc32"]:
            return f"{file} does not match its saved CRC-32 (corrupted)"
    return None


@contextlib.contextmanager
def unreadable_as_damaged(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn a failure to read the files of the checkpoint at ``path`` (a torch
    deserialization error, raw or inside DCP's ``CheckpointException``) into a
    ``ValueError`` naming the damaged file (from the checksums manifest, else the
    step folder's files) and the fix. Any other error passes through."""
    try:
        yield
    except (Exception, CheckpointException) as e:
        cause = _read_failure(e)
        if cause is None:
            raise
        path = os.fspath(path)
        problem = verify_checkpoint(path)
        if problem is None:
            files = sorted(n for n in os.listdir(path) if n.endswith(".distcp") or n == _METADATA)
            which = (
                "its files match the checksums saved with them: it was written unreadable"
                if _manifest_identity(path)
                else "it has no checksums manifest (saved before there were) to tell which"
            )
            problem = (
                f"could not be read ({cause}): one of its files is damaged "
                f"({', '.join(os.path.join(path, n) for n in files)}); {which}"
            )
        else:
            problem = f"is damaged: {problem}"
        raise ValueError(
            f"checkpoint {path} {problem}. Fix: restore it from a copy, or use an earlier "
            "step folder."
        ) from None


def _read_failure(error: BaseException) -> str | None:
    """``error`` (or, in a ``CheckpointException``, a rank's failure) as one line when
    it comes from reading checkpoint bytes (torch's unpickler, its zip reader), else ``None``."""
    failures = (
        [exc for exc, _ in error.failures.values()]
        if isinstance(error, CheckpointException)
        else [error]
    )
    for exc in failures:
        text = str(exc).strip()
        # torch's weights-only unpickler puts what it met after a long notice
        text = re.split(r"WeightsUnpickler error:\s*", text)[-1].strip()
        text = text.splitlines()[0].split(". ")[0] if text else ""
        if isinstance(exc, (pickle.UnpicklingError, EOFError)) or (
            isinstance(exc, RuntimeError)
            and any(s in str(exc) for s in ("PytorchStreamReader", "zip archive"))
        ):
            return f"{type(exc).__name__}: {text}"[:300]
    return None


def _write_manifest(path: str, distributed: bool) -> None:
    """Each rank hashes the shard files it wrote; rank 0 writes the manifest last."""
    rank = _rank(distributed)
    names = sorted(os.listdir(path))
    mine = {n: _file_record(os.path.join(path, n)) for n in names if n.startswith(f"__{rank}_")}
    gathered: list[Any] = [mine]
    if distributed and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    if rank != 0:
        return
    files: dict[str, dict[str, int]] = {}
    for part in gathered:
        files.update(part)
    for name in names:  # .metadata and anything not named by rank
        if name in files or name in (_MANIFEST, PARTIAL_MARK):  # the mark goes before the rename
            continue
        if os.path.isfile(os.path.join(path, name)):
            files[name] = _file_record(os.path.join(path, name))
    tmp = os.path.join(path, f".{_MANIFEST}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, _MANIFEST))


def _distributed(distributed: bool | None) -> bool:
    if distributed is None:
        return dist.is_available() and dist.is_initialized()
    if distributed and not dist.is_initialized():
        raise ValueError("distributed=True needs an initialized default process group.")
    return distributed


@contextlib.contextmanager
def _single_process_notice_muted(distributed: bool) -> Iterator[None]:
    """Mute DCP's notice that it assumes one process: here that was asked for explicitly."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


def _rank(distributed: bool) -> int:
    return dist.get_rank() if distributed else 0


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


# Optimizer states keyed by parameter name (``state.layers.0.w1.weight.exp_avg``), so
# the states of several model parts (pipeline stages) merge into one flat dict and a
# checkpoint saved with one split loads with any other.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _model_parts(
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
) -> list[tuple[nn.Module, torch.optim.Optimizer | None]]:
    models = [model] if isinstance(model, nn.Module) else list(model)
    if optimizer is None:
        return [(m, None) for m in models]
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    if len(optimizers) != len(models):
        raise ValueError(
            f"checkpoint: {len(models)} model part(s) but {len(optimizers)} optimizer(s); "
            "give one optimizer per model part (pipeline stage), in the same order."
        )
    return list(zip(models, optimizers, strict=True))


def _part_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    model_state = get_model_state_dict(model)
    if optimizer is None:
        return model_state, {}
    return model_state, get_optimizer_state_dict(model, optimizer, options=_OPTIONS)


def _merged_state(
    parts: list[tuple[nn.Module, torch.optim.Optimizer | None]], *, with_optimizer: bool
) -> dict[str, Any]:
    """Model (and optimizer) states of every part in one dict; parts own disjoint names."""
    model_state: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    for part, part_optimizer in parts:
        m, o = _part_state(part, part_optimizer)
        model_state.update(m)
        optim_state.update(o)
    state: dict[str, Any] = {"model": model_state}
    if with_optimizer:
        state["optimizer"] = optim_state
    return state


def _saved_state(
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
    train_state: dict[str, Any] | None,
    distributed: bool,
) -> dict[str, Any]:
    """What a checkpoint holds: model (and optimizer) states, ``train``, this rank's RNG."""
    parts = _model_parts(model, optimizer)
    state: dict[str, Any] = _merged_state(parts, with_optimizer=optimizer is not None)
    state["train"] = dict(train_state or {})
    # Keyed by rank: each rank's generator state is its own, not a replicated value.
    state["rng"] = {f"rank{_rank(distributed)}": _rng_state()}
    return state


def save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    train_state: dict[str, Any] | None = None,
    distributed: bool | None = None,
) -> None:
    """Save model, optimizer, ``train_state`` and this rank's RNG states to ``path``.

    Call on every rank (it is a collective when a process group exists).

    Args:
        path: The checkpoint directory (see :func:`checkpoint_path`).
        model: The model (plain, tensor-parallel and/or ``fully_shard``-ed), or this
            rank's model parts (pipeline stages) in a sequence.
        optimizer: Its optimizer (one per model part); omitted, only the model is saved.
        train_state: A flat dict of small picklable values (step, data position).
        distributed: Whether every rank of the default process group saves together;
            defaults to whether one is initialized.
    """
    distributed = _distributed(distributed)
    state = _saved_state(model, optimizer, train_state, distributed)
    # Written into ``path.partial`` and renamed onto ``path`` by rank 0 once every rank
    # is done: a step directory is there complete or not at all, and a save over an
    # earlier one of this step replaces it whole.
    with staged_output(path, distributed=distributed, check=False) as tmp:
        with _single_process_notice_muted(distributed):
            dcp.save(state, checkpoint_id=tmp, no_dist=not distributed)
        _write_manifest(tmp, distributed)


class PendingSave:
    """A checkpoint being written in the background (:func:`async_save_checkpoint`).

    :meth:`wait` finishes it on every rank that started it: DCP's write completes, the
    checksums manifest is written and rank 0 renames the staged directory onto its
    step's name, as :func:`save_checkpoint` does before it returns. Until then the
    step directory does not exist (only its ``.partial`` sibling), so a crash in
    between leaves the previous complete checkpoint the latest.
    """

    def __init__(
        self, path: str, tmp: str, future: Any, stack: contextlib.ExitStack, distributed: bool
    ) -> None:
        self.path = path
        self._tmp = tmp
        self._future = future
        self._stack = stack
        self._distributed = distributed
        self._done = False

    def done(self) -> bool:
        """Whether this rank's write is finished (:meth:`wait` still renames it)."""
        return self._done or self._future.done()

    def wait(self) -> str:
        """Finish the save (a collective when distributed); returns its path."""
        if self._done:
            return self.path
        self._done = True
        try:
            self._future.result()
            _write_manifest(self._tmp, self._distributed)
        except BaseException as e:
            self._stack.__exit__(type(e), e, e.__traceback__)
            raise
        self._stack.close()  # every rank done: rank 0 renames the staged directory
        return self.path


_SAVE_GROUP: list[Any] = []  # [default group, its writers' group], made once per default group


def _save_group() -> Any:
    """A gloo group of every rank for the background writes' own collectives.

    DCP's thread talks to the other ranks while the training thread runs its own
    collectives; on one communicator their order could interleave differently on
    different ranks. One group per default process group, made once (a collective)."""
    world = dist.group.WORLD
    if not _SAVE_GROUP or _SAVE_GROUP[0] is not world:
        _SAVE_GROUP[:] = [world, dist.new_group(backend="gloo")]
    return _SAVE_GROUP[1]


def async_save_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    train_state: dict[str, Any] | None = None,
    distributed: bool | None = None,
) -> PendingSave:
    """Start saving what :func:`save_checkpoint` saves; return before it is written.

    The states are copied to CPU memory first (DCP's ``async_save`` stager), so training
    may change them at once; the files are written by a background thread. Call
    :meth:`PendingSave.wait` on every rank before the next save and before the end.

    Example::

        pending = async_save_checkpoint(checkpoint_path(d, step), model=m, optimizer=o)
        ...  # train on
        pending.wait()
    """
    from torch.distributed.checkpoint.state_dict_saver import async_save

    distributed = _distributed(distributed)
    state = _saved_state(model, optimizer, train_state, distributed)
    group = _save_group() if distributed else None
    if not distributed:
        # DCP's writer thread says it assumes one process; here that was asked for
        # (no_dist). Its warning comes from that thread, after any catch_warnings
        # block of ours has ended, so the filter is installed for the process, once.
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
    stack = contextlib.ExitStack()
    tmp = stack.enter_context(staged_output(path, distributed=distributed, check=False))
    try:
        with _single_process_notice_muted(distributed):
            future = async_save(
                state, checkpoint_id=tmp, process_group=group, no_dist=not distributed
            )
    except BaseException as e:
        stack.__exit__(type(e), e, e.__traceback__)
        raise
    return PendingSave(os.path.normpath(os.fspath(path)), tmp, future, stack, distributed)


def _check_same_model(
    path: str, model_state: dict[str, Any], metadata: dict[str, Any], *, pipeline: bool
) -> None:
    """Raise a ``ValueError`` naming every parameter whose name or global shape differs."""
    saved = {
        k.split(".", 1)[1]: tuple(getattr(v, "size", ()))
        for k, v in metadata.items()
        if k.startswith("model.")
    }
    mine = {k: tuple(v.shape) for k, v in model_state.items() if hasattr(v, "shape")}
    missing = sorted(set(mine) - set(saved))
    shapes = sorted(
        f"{k}: saved {saved[k]}, model {mine[k]}"
        for k in mine
        if k in saved and saved[k] != mine[k]
    )
    # A pipeline rank holds some stages; a whole model must hold every saved name.
    unexpected = [] if pipeline else sorted(set(saved) - set(mine))
    if not (missing or shapes or unexpected):
        return
    lines = (
        [
            f"missing in the checkpoint: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        ]
        if missing
        else []
    )
    lines += (
        [f"not in the model: {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else "")]
        if unexpected
        else []
    )
    lines += (
        [f"other shape: {'; '.join(shapes[:8])}" + (" ..." if len(shapes) > 8 else "")]
        if shapes
        else []
    )
    raise ValueError(
        f"load_checkpoint: {path!r} was saved from another model configuration: "
        + "; ".join(lines)
        + ". Resume with the model and model_overrides it was saved with, or start a new "
        "checkpoint_dir."
    )


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    distributed: bool | None = None,
) -> dict[str, Any]:
    """Load a checkpoint saved by :func:`save_checkpoint` into ``model`` (and ``optimizer``).

    The model may be placed differently than when it was saved (another mesh, or one
    process without a process group): DCP reads each rank's part of every tensor.
    This rank's RNG states are restored when the checkpoint has them (same rank
    count); otherwise the generators are left as they are.

    Args:
        path: A checkpoint directory.
        model: A model with the same parameter names and global shapes, or this
            rank's model parts (pipeline stages, any split) in a sequence.
        optimizer: Its optimizer (one per model part), to restore too; omitted, only
            the model is loaded.
        distributed: Whether every rank of the default process group loads together;
            defaults to whether one is initialized.

    Returns:
        The ``train_state`` that was saved.

    Raises:
        ValueError: ``path`` is not a complete checkpoint, a file has another size
            than was saved, the model's parameters differ from the saved ones (names
            or shapes: another model config), or it has no optimizer state but one
            was asked for.
    """
    distributed = _distributed(distributed)
    rank = _rank(distributed)
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, _METADATA)):
        raise ValueError(
            f"load_checkpoint: {path!r} is not a complete checkpoint (no {_METADATA}); "
            "pass a step directory such as latest_checkpoint(checkpoint_dir) returns."
        )
    problem = verify_checkpoint(path, contents=False)  # sizes: cheap on every rank
    if problem is not None:
        raise ValueError(
            f"load_checkpoint: {path!r} is damaged: {problem}. Load an earlier checkpoint "
            "(latest_checkpoint(checkpoint_dir) skips damaged ones)."
        )
    with unreadable_as_damaged(path):
        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved_keys = set(metadata)
    if optimizer is not None and not any(k.startswith("optimizer.") for k in saved_keys):
        raise ValueError(
            f"load_checkpoint: {path!r} holds no optimizer state (saved with the model "
            "only); load it with optimizer=None."
        )
    parts = _model_parts(model, optimizer)
    per_part = [tuple(map(list, _part_state(m, o))) for m, o in parts]
    state: dict[str, Any] = _merged_state(parts, with_optimizer=optimizer is not None)
    _check_same_model(path, state["model"], metadata, pipeline=not isinstance(model, nn.Module))
    train_keys = sorted(k.split(".", 1)[1] for k in saved_keys if k.startswith("train."))
    state["train"] = dict.fromkeys(train_keys)
    rng = {
        kind: value
        for kind, value in _rng_state().items()
        if f"rng.rank{rank}.{kind}" in saved_keys
    }
    if rng:
        state["rng"] = {f"rank{rank}": rng}
    with _single_process_notice_muted(distributed), unreadable_as_damaged(path):
        dcp.load(state, checkpoint_id=path, no_dist=not distributed)
    for (part, part_optimizer), (model_keys, optim_keys) in zip(parts, per_part, strict=True):
        set_model_state_dict(part, {k: state["model"][k] for k in model_keys})
        if optimizer is not None:
            set_optimizer_state_dict(
                part,
                part_optimizer,
                {k: state["optimizer"][k] for k in optim_keys},
                options=_OPTIONS,
            )
    restored = state.get("rng", {}).get(f"rank{rank}", {})
    if "cpu" in restored:
        torch.set_rng_state(restored["cpu"])
    if "cuda" in restored:
        torch.cuda.set_rng_state(restored["cuda"])
    return state["train"]
