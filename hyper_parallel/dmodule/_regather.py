"""A gathered input is kept as its shard for backward and gathered again there.

A module whose input is declared ``Shard`` on an axis and wanted ``Replicate`` there —
sequence parallelism's attention and feed-forward blocks (``in_src`` ``Shard(seq)``,
``in_dst`` ``Replicate``) — all-gathers it on the way in. Its matmuls then save the
gathered tensor for their weight gradients: the axis size times the shard, held from the
forward to the backward. Megatron-LM keeps the shard instead and all-gathers again in
backward (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022, section 4.2.2); so does the boundary. While the module's forward runs, a
saved-tensor hook stores each tensor saved from the gathered storage as the shard (with
the view's size, stride and offset); in backward the first of them to be unpacked gathers
the shard again — the same collective as the forward (DTensor's ``redistribute`` at a
boundary, the fast path's own all-gather in a column-parallel projection), so the same
values bit for bit — and the others share that tensor until the last is unpacked. A
shard modified in place before backward is refused, as autograd refuses a saved tensor
so modified.

Cost: one more all-gather per such input per backward (the dry run runs backward, so the
planner counts it). Memory: the shard, where the gathered tensor was.

Not while compiling (a hook inside a compiled region would break the graph: compiled
modules keep the gathered tensor), not without grad, and not inside a ``local_map``
region (context parallelism's keys and values stay gathered). Saved-tensor hooks already
in force — activation checkpointing's, the dry run's ``SavedActivations`` — still see
every saved tensor: this hook hands them the others as they are and the shard in place of
the gathered tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from hyper_parallel._torch_private import saved_tensors_hooks_enabled, top_saved_tensors_hooks
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Placement

__all__ = [
    "Gather",
    "Gathered",
    "applies",
    "in_backward",
    "is_gather",
    "keep_gathered",
    "kept",
    "redistribute_to",
]

_keep_gathered = 0


@contextlib.contextmanager
def keep_gathered(enabled: bool = True) -> Iterator[None]:
    """Forwards run inside keep their gathered inputs, as compiled modules do: what the
    dry run traces for a run that compiles (``plan --compile``, ``suggest --compile``).
    ``enabled=False`` changes nothing (``with keep_gathered(compile):``)."""
    global _keep_gathered
    _keep_gathered += enabled
    try:
        yield
    finally:
        _keep_gathered -= enabled


def applies() -> bool:
    """Whether a forward run now may keep shards (grad on, eager, hooks allowed)."""
    return (
        not _keep_gathered
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and saved_tensors_hooks_enabled()
    )


def kept(src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """Whether ``src -> dst``, run now, is an all-gather whose shard is kept (:func:`applies`)."""
    return is_gather(src, dst) and applies()


def is_gather(src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """Whether ``src -> dst`` only all-gathers: every changed axis goes ``Shard -> Replicate``."""
    changed = False
    for s, d in zip(src, dst, strict=True):
        if s == d:
            continue
        if not (s.is_shard() and d.is_replicate()):
            return False
        changed = True
    return changed


Gather = Callable[[Any], torch.Tensor]
"""``shard -> gathered local tensor``: the forward's all-gather, done again."""


def redistribute_to(placements: Sequence[Placement]) -> Gather:
    """The gather of a DTensor shard: DTensor's ``redistribute`` to ``placements``."""
    dst = tuple(placements)
    return lambda shard: shard.redistribute(shard.device_mesh, dst).to_local()


def _local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard (``t`` itself unless a DTensor): what in-place ops bump."""
    return t._local_tensor if isinstance(t, DTensor) else t


class _Whole:
    """One gathered input: its shard, and the gathered tensor while backward needs it."""

    __slots__ = ("gather", "pending", "shard", "tensor", "version", "versioned")

    def __init__(self, shard: Any, gather: Gather, versioned: torch.Tensor | None) -> None:
        self.shard = shard  # what the outer hook returned for the shard (or the shard)
        self.gather = gather
        # The shard's local tensor as the forward had it (a detached DTensor has a
        # version counter of its own), when this hook holds the shard itself.
        self.versioned = versioned
        self.version = None if versioned is None else versioned._version
        self.pending = 0
        self.tensor: torch.Tensor | None = None

    def local(self, unpack: Callable[[Any], Any] | None) -> torch.Tensor:
        """The gathered local tensor, gathered again at the first call; dropped after the
        last saved tensor that needs it is unpacked.

        Raises:
            RuntimeError: The shard was modified in place after the forward saved it (as
                autograd raises for a saved tensor so modified).
        """
        whole = self.tensor
        if whole is None:
            shard = self.shard if unpack is None else unpack(self.shard)
            if self.versioned is not None and self.versioned._version != self.version:
                raise RuntimeError(
                    "a sequence-parallel input kept as its shard for backward was modified "
                    f"in place after the forward saved it (version {self.version}, now "
                    f"{self.versioned._version}): its gradient would be computed from other "
                    "values. "
                    "Do not modify a module's gathered input in place before backward, or "
                    "run that forward inside keep_gathered()."
                )
            with torch.no_grad():
                whole = self.gather(shard).contiguous()
        self.pending -= 1
        self.tensor = whole if self.pending > 0 else None
        return whole


class _Saved:
    """A saved tensor that was a view of a gathered input."""

    __slots__ = ("offset", "size", "spec", "stride", "whole")

    def __init__(self, whole: _Whole, local: torch.Tensor, spec: Any) -> None:
        self.whole = whole
        self.size, self.stride, self.offset = local.size(), local.stride(), local.storage_offset()
        self.spec = spec


def _fresh(local: torch.Tensor) -> bool:
    """Whether ``local`` owns its whole storage, laid out contiguously from its start."""
    return (
        local.storage_offset() == 0
        and local.is_contiguous()
        and local.untyped_storage().nbytes() == local.numel() * local.element_size()
    )


Gathered = tuple[torch.Tensor, torch.Tensor, Gather]
"""``(shard, gathered local tensor, gather)``: one all-gathered input of a forward."""


def in_backward(gathered: Sequence[Gathered] | None) -> contextlib.AbstractContextManager[Any]:
    """Saved-tensor hooks that keep each gathered input's shard for backward in place of
    any tensor saved from the gathered storage; a no-op when there is none."""
    if not gathered:
        return contextlib.nullcontext()
    top = top_saved_tensors_hooks()
    outer_pack, outer_unpack = top if top is not None else (None, None)
    shards: dict[int, tuple[torch.Tensor, Gather]] = {}
    for shard, local, gather in gathered:
        if _fresh(local):
            shards[local.untyped_storage()._cdata] = (shard, gather)
    if not shards:
        return contextlib.nullcontext()
    wholes: dict[int, _Whole] = {}

    def pack(t: torch.Tensor) -> Any:
        local = t._local_tensor if isinstance(t, DTensor) else t
        key = local.untyped_storage()._cdata
        found = shards.get(key)
        if found is None:
            return t if outer_pack is None else outer_pack(t)
        whole = wholes.get(key)
        if whole is None:
            shard, gather = found
            kept = shard.detach()
            if outer_pack is None:
                whole = _Whole(kept, gather, _local(shard))
            else:
                whole = _Whole(outer_pack(kept), gather, None)
            wholes[key] = whole
        whole.pending += 1
        return _Saved(whole, local, t._spec if isinstance(t, DTensor) else None)

    def unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed if outer_unpack is None else outer_unpack(packed)
        local = packed.whole.local(outer_unpack)
        view = local.as_strided(packed.size, packed.stride, packed.offset)
        return view if packed.spec is None else DTensor(view, packed.spec, requires_grad=False)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
