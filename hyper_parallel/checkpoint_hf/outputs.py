"""Output directories that are never clobbered: written aside, renamed into place when complete.

Every writer of the package (``--save-hf`` / :func:`~hyper_parallel.checkpoint_hf.save_hf`,
``export-hf``, the trainer's DCP checkpoints) goes through :func:`staged_output`:

- :func:`check_output` refuses, before anything is written, a target that is one of
  the run's inputs' folders (or holds one) — always — and a target that exists and
  is not empty, unless ``overwrite``;
- the files are written into a temporary sibling (``OUT.partial``); only when every
  rank has finished does rank 0 rename it onto ``OUT`` (after a barrier), so a crash
  leaves ``OUT`` as it was and a reader never sees half a checkpoint. A ``OUT.partial``
  is only ever deleted when it holds the mark this module leaves in the ones it makes
  (an earlier attempt that did not finish); one that is the user's is refused, as is
  one that is (or holds) an input;
- with ``overwrite`` the old target is moved aside under a new, unique name and deleted
  after the rename, so nothing of it is left next to the new files (no stale shard of
  a larger model) and no other folder is touched.

Single-file outputs (``tokenize --out``, ``calibrate --out``, ``suggest --write-config``)
go through :func:`check_output_file`: never an input, kept unless ``overwrite``.

The directories must be on a file system every rank sees (as DCP already requires).

Example::

    with staged_output("out/model", overwrite=False, inputs=["ckpt/base"]) as tmp:
        ...  # write files into tmp
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator

import torch.distributed as dist

__all__ = [
    "PARTIAL_MARK",
    "OutputError",
    "check_output",
    "check_output_file",
    "check_output_folder",
    "partial_path",
    "staged_output",
]


class OutputError(ValueError):
    """A target directory that may not be written (an input, or not empty without overwrite)."""

    same_on_every_rank = True  # decided from the file system every rank sees


PARTIAL_MARK = ".hyper_parallel-partial"
"""The file in a temporary sibling that says this module made it (removed before the rename)."""


def partial_path(path: str | os.PathLike[str]) -> str:
    """The temporary sibling ``path`` is written into before it is renamed onto ``path``."""
    return os.path.normpath(os.fspath(path)) + ".partial"


def _ours(tmp: str) -> bool:
    return os.path.isfile(os.path.join(tmp, PARTIAL_MARK))


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def check_output_folder(path: str | os.PathLike[str], *, what: str = "output") -> None:
    """Refuse ``path`` as an output directory that cannot be made: a file is there, or
    at a folder above it (where ``os.makedirs`` fails after the work is done).

    Raises:
        OutputError: Naming the file and the fix.
    """
    given = os.fspath(path)
    if os.path.exists(given) and not os.path.isdir(given):
        raise OutputError(f"{what} {given}: a file is there; give a directory.")
    above = os.path.dirname(os.path.normpath(given))
    while above and not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if above and os.path.exists(above) and not os.path.isdir(above):
        raise OutputError(
            f"{what} {given}: {above} is a file, so no directory can be made there; give a "
            "directory path."
        )


def check_output(
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    inputs: Iterable[str | os.PathLike[str] | None] = (),
    what: str = "output",
) -> None:
    """Refuse ``path`` as an output directory, before anything is written, when it must not be.

    Args:
        path: The directory to write.
        overwrite: Replace a non-empty ``path`` (its old files all go).
        inputs: Files or directories the run reads; ``path`` may not be (or hold) one
            of them or a file's folder, even with ``overwrite``.
        what: How the user named ``path`` (``--save-hf``, ``export-hf OUT``), for the message.

    Raises:
        OutputError: ``path`` is an input, a file (or lies under one), or a non-empty
            directory without ``overwrite``; or its temporary sibling ``path.partial`` is
            an input or a folder this module did not make.
    """
    target = os.path.realpath(os.fspath(path))
    partial = partial_path(target)
    for given in inputs:
        if not given:
            continue
        source = os.path.realpath(os.fspath(given))
        if os.path.isfile(source):
            source = os.path.dirname(source)
        # A new folder inside an input's folder is harmless; the input's folder itself
        # or one holding it would be replaced (with --overwrite: deleted).
        if _inside(source, target):
            how = "is" if source == target else "holds"
            raise OutputError(
                f"{what} {os.fspath(path)}: it {how} the input {os.fspath(given)}; writing "
                "there would replace what is being read (even with --overwrite). Choose "
                "another directory."
            )
        if _inside(source, partial):
            raise OutputError(
                f"{what} {os.fspath(path)}: it is written into {partial_path(path)} first, "
                f"which is the input {os.fspath(given)}. Move the input, or choose another "
                "directory."
            )
    if os.path.lexists(partial) and not _ours(partial):
        raise OutputError(
            f"{what} {os.fspath(path)}: {partial_path(path)} is there and was not left by an "
            f"earlier write of {os.path.basename(target)}; it is where the files go before "
            "they are renamed into place. Move or delete it, or choose another directory."
        )
    check_output_folder(path, what=what)
    if os.path.isdir(target) and os.listdir(target) and not overwrite:
        names = sorted(os.listdir(target))
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise OutputError(
            f"{what} {os.fspath(path)}: the directory is not empty ({len(names)} entries: "
            f"{shown}); choose a new directory, or pass --overwrite to replace its contents."
        )


def check_output_file(
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    inputs: Iterable[str | os.PathLike[str] | None] = (),
    what: str = "output",
) -> None:
    """Refuse ``path`` as an output file before any work, when it must not be written;
    make its folder otherwise.

    Args:
        path: The file to write.
        overwrite: Replace a file that is there.
        inputs: Files the command reads; ``path`` may not be one of them, even with
            ``overwrite``.
        what: How the user named ``path`` (``tokenize --out``), for the message.

    Raises:
        OutputError: ``path`` is an input or a folder, or a file is there without
            ``overwrite``.
    """
    target = os.path.realpath(os.fspath(path))
    for given in inputs:
        if given and os.path.realpath(os.fspath(given)) == target:
            raise OutputError(
                f"{what} {os.fspath(path)}: it is the input {os.fspath(given)}; writing there "
                "would replace what is being read (even with --overwrite). Choose another path."
            )
    if os.path.isdir(target):
        raise OutputError(f"{what} {os.fspath(path)}: a folder is there; give a file path.")
    if os.fspath(path).endswith(("/", os.sep)):
        raise OutputError(
            f"{what} {os.fspath(path)}: names a folder (ends in /); give a file path."
        )
    if os.path.lexists(target) and not overwrite:
        raise OutputError(
            f"{what} {os.fspath(path)}: a file is there already; give another path, or pass "
            "--overwrite to replace it."
        )
    folder = os.path.dirname(target) or "."
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:  # a file where a folder of the path should be, no permission
        raise OutputError(
            f"{what} {os.fspath(path)}: cannot make its folder {folder} "
            f"({e.strerror or e}); give a path in a folder you can write."
        ) from None


def _rank(distributed: bool) -> int:
    return dist.get_rank() if distributed else 0


def _barrier(distributed: bool) -> None:
    if distributed and dist.get_world_size() > 1:
        dist.barrier()


def _replace(tmp: str, path: str) -> None:
    """Rename ``tmp`` onto ``path``; an old ``path`` is moved aside (under a new name no
    other folder has) first and then deleted."""
    os.remove(os.path.join(tmp, PARTIAL_MARK))
    old = None
    if os.path.lexists(path):
        parent, name = os.path.split(os.path.normpath(path))
        old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent or ".")
        os.replace(path, old)  # onto the empty folder just made
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_output(
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    inputs: Iterable[str | os.PathLike[str] | None] = (),
    what: str = "output",
    distributed: bool | None = None,
    check: bool = True,
) -> Iterator[str]:
    """Write a directory as a whole: yields the temporary sibling to write into.

    Call it on every rank of the default process group (``distributed``, default:
    whether one is initialized): every rank writes into the same temporary directory,
    and on leaving the block all ranks meet at a barrier, rank 0 renames it onto
    ``path`` and all meet again. On an error in one process the partial directory is
    removed (one process) or left for the next attempt to replace (several ranks; a
    rank that fails cannot tell the others), and ``path`` is untouched.

    Args:
        path: The directory to write.
        overwrite, inputs, what: See :func:`check_output` (``check=False`` skips it,
            for a writer whose target is its own, such as a checkpoint step).

    Raises:
        OutputError: See :func:`check_output`.
    """
    if distributed is None:
        distributed = dist.is_available() and dist.is_initialized()
    path = os.path.normpath(os.fspath(path))
    if check:
        check_output(path, overwrite=overwrite, inputs=inputs, what=what)
        # Every rank has looked before rank 0 makes OUT.partial: a rank that looked
        # after it was made, before its mark was written, would refuse alone and leave
        # the others waiting at the next barrier.
        _barrier(distributed)
    tmp = partial_path(path)
    if _rank(distributed) == 0:
        # An earlier attempt that did not finish (check_output refused any other; a
        # writer with check=False owns the folder the target is in).
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        with open(os.path.join(tmp, PARTIAL_MARK), "w"):
            pass
    _barrier(distributed)
    try:
        yield tmp
    except BaseException:
        if not distributed:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier(distributed)
    if _rank(distributed) == 0:
        _replace(tmp, path)
    _barrier(distributed)
