"""The ``--mesh AXES`` argument every command takes (``"dp_shard=2,tp=2"``), parsed by the
mesh layout's own rules (:meth:`~hyper_parallel.distributed.MeshLayout.parse`).

Example::

    from hyper_parallel.distributed.mesh_arguments import parse_mesh

    assert parse_mesh("dp=2,tp=2") == {"dp_shard": 2, "tp": 2}
"""

from __future__ import annotations

import argparse

from hyper_parallel.distributed.layout import LayoutError, MeshLayout

__all__ = ["mesh_argument", "parse_mesh"]


def parse_mesh(text: str) -> dict[str, int]:
    """Parse ``"dp=2,tp=2"`` into ``{"dp_shard": 2, "tp": 2}``: the axes of size > 1.

    Any user axis of :class:`~hyper_parallel.distributed.MeshLayout` is accepted
    (``dp`` is ``dp_shard``); ``""`` is ``{}`` (one device).

    Raises:
        LayoutError: (a ``ValueError``) every malformed entry, unknown axis (with the
            nearest name), repeated axis, size < 1 and ``ep`` not dividing
            dp_shard x cp x tp, in one error.
    """
    return MeshLayout.parse(text).active()


def mesh_argument(text: str) -> dict[str, int]:
    """``argparse`` type of ``--mesh``: :func:`parse_mesh`, errors as usage errors."""
    try:
        return parse_mesh(text)
    except LayoutError as e:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(e)) from None
