"""Per-rank memory of training states: parameters, gradients, AdamW moments.

Formulas (per rank, per parameter element held locally):

- parameters: ``numel_local * sizeof(param dtype)``;
- gradients: the same (a gradient has its parameter's dtype and sharding; FSDP2
  reduce-scatters each gradient into its parameter's shard);
- AdamW: two moments, ``exp_avg`` and ``exp_avg_sq`` (Loshchilov & Hutter,
  "Decoupled Weight Decay Regularization", 2019; ``torch.optim.AdamW``'s state),
  in the parameter's dtype, as torch keeps them: ``2 * numel_local * sizeof(param
  dtype)`` bytes (``moment_bytes``). The per-parameter ``step`` scalar is ignored.

``--dtype bf16`` in every command is the trainer's mixed precision (FSDP2's
``MixedPrecisionPolicy``, torchtitan's default): parameters, gradients and AdamW
state stay fp32 (4 + 4 + 8 bytes per local element), only the compute — and so the
activations — is bf16. ``--dtype bf16-true`` keeps all three in bf16 (2 + 2 + 4).

These are the steady state between steps (ZeRO's "model states", Rajbhandari et
al., 2020). Activations — what autograd saves for backward during one micro-batch's
forward — are measured, not modelled: :class:`SavedActivations` records every saved
tensor of a traced step (fake tensors in the dry run) through
``torch.autograd.graph.saved_tensors_hooks`` and accounts for activation
checkpointing. Transient buffers (a matmul's output before it is saved, collective
buffers) are not included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyper_parallel._torch_private import TorchDispatchMode, pytree
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed.activation_checkpoint import OpPolicy, checkpointed_blocks

__all__ = [
    "ADAMW_MOMENT_BYTES",
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "NUM_ADAMW_MOMENTS",
    "SavedActivations",
    "StateBytes",
    "ddp_num_buckets",
    "state_bytes",
]

NUM_ADAMW_MOMENTS = 2
ADAMW_MOMENT_BYTES = 4  # fp32
# DistributedDataParallel's defaults (torch/nn/parallel/distributed.py): bucket_cap_mb=25,
# and a first bucket of 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) so the first all-reduce
# starts early.
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class StateBytes:
    """Bytes per rank of each kind of training state."""

    params: int
    grads: int
    optimizer: int
    activations: int = 0  # peak bytes saved for backward of one micro-batch

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def to_dict(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
        }


def state_bytes(
    param_bytes: int,
    grad_bytes: int,
    trainable_numel: int,
    activation_bytes: int = 0,
    moment_bytes: int = ADAMW_MOMENT_BYTES,
) -> StateBytes:
    """Per-rank state bytes from the local parameter and gradient bytes.

    Args:
        param_bytes: Sum over local parameter shards of ``numel * element_size``.
        grad_bytes: The same over gradients.
        trainable_numel: Local elements of parameters that require grad.
        activation_bytes: Peak bytes saved for backward (:class:`SavedActivations`).
        moment_bytes: Bytes of one moment element: the parameters' element size (4 for
            fp32 parameters, 2 under ``--dtype bf16-true``).

    Example::

        state_bytes(400, 400, 100).optimizer  # 800: two fp32 moments per element
    """
    return StateBytes(
        params=param_bytes,
        grads=grad_bytes,
        optimizer=NUM_ADAMW_MOMENTS * moment_bytes * trainable_numel,
        activations=activation_bytes,
    )


def ddp_num_buckets(grad_bytes: int) -> int:
    """All-reduces DDP issues per step for ``grad_bytes`` of gradients (default buckets).

    Assumes gradients fill buckets back to back (DDP closes a bucket at a parameter
    boundary, so the real count can be one or two higher).

    Example::

        ddp_num_buckets(30 * 1024 * 1024)  # 1 MiB, then 25 MiB, then 4 MiB: 3
    """
    if grad_bytes <= 0:
        return 0
    rest = max(grad_bytes - DDP_FIRST_BUCKET_BYTES, 0)
    return 1 + -(-rest // DDP_BUCKET_BYTES)


# --------------------------------------------------------------------------- activations


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """``(identity, bytes)`` of the storage behind ``t`` (a DTensor's local shard's)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    storage = local.untyped_storage()
    return storage._cdata, storage.nbytes()


def _held(t: torch.Tensor) -> Any:
    """The storage behind ``t``, to hold while its address is used as a key."""
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


class SavedActivations:
    """Bytes autograd saves for backward during one forward, by segment of the model.

    A segment is what runs before the first block of ``blocks``, each block, and what
    runs after the last (the final layers and the loss). Saved tensors are counted
    once per storage (views share it) at the local shard's size, and parameters and
    buffers are left out (they are states, counted elsewhere). Use it as a context
    manager around the forward and the loss; it works on fake and on real tensors.

    Example::

        with SavedActivations(model, list(model.layers)) as saved:
            loss = loss_fn(model(tokens), targets)
        saved.peak_bytes("full")
    """

    def __init__(self, model: nn.Module, blocks: Sequence[nn.Module]) -> None:
        self.model = model
        self.blocks = list(blocks)
        num = len(self.blocks)
        # Segment k + 1 is block k; 0 is before the blocks, num + 1 after them.
        self.saved: list[dict[int, int]] = [{} for _ in range(num + 2)]
        self.inputs: list[dict[int, int]] = [{} for _ in range(num + 2)]
        # Per block segment: the outputs ``op`` checkpointing keeps (OpPolicy's choice).
        self.op_kept: list[dict[int, int]] = [{} for _ in range(num + 2)]
        self._policy = OpPolicy()
        self._segment = 0
        self._seen: set[int] = set()
        self._handles: list[Any] = []
        self._hooks: Any = None
        self._ops: _KeptOutputs | None = None
        # The storages whose addresses are keys, held until the forward ends: a storage
        # freed meanwhile (a block input nothing saves) could hand its address to a new
        # one, and two tensors would count as one (counts varied from run to run).
        self._alive: list[Any] = []

    # -- recording

    def _states(self) -> set[int]:
        # Read at each save: FSDP swaps the unsharded parameters in for a block's forward.
        keys = set()
        for t in (*self.model.parameters(), *self.model.buffers()):
            keys.add(_storage(t)[0])
        return keys

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter):
            return t
        key, nbytes = _storage(t)
        if key not in self._seen and key not in self._states():
            self._alive.append(_held(t))
            self._seen.add(key)
            self.saved[self._segment][key] = nbytes
        return t

    def _keep_output(self, func: Any, out: Any) -> None:
        """Record ``out`` when ``op`` checkpointing would keep it (inside a block)."""
        if not 1 <= self._segment <= len(self.blocks) or not self._policy.keeps(func):
            return
        states = None
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key, nbytes = _storage(t)
                states = self._states() if states is None else states
                if key not in states:
                    self._alive.append(_held(t))
                    self.op_kept[self._segment][key] = nbytes

    def _enter(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._segment = index + 1
            self._policy = OpPolicy()  # one per call of a block, as checkpointing makes
            states = self._states()
            for x in (*args, *kwargs.values()):
                if isinstance(x, torch.Tensor):
                    key, nbytes = _storage(x)
                    if key not in states:
                        self._alive.append(_held(x))
                        self.inputs[index + 1][key] = nbytes

        return hook

    def _leave(self, index: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            self._segment = index + 2 if index + 1 == len(self.blocks) else self._segment

        return hook

    def __enter__(self) -> SavedActivations:
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._enter(i), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._leave(i)))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        self._ops = _KeptOutputs(self._keep_output)
        self._ops.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._ops is not None:
            self._ops.__exit__(*exc)
            self._ops = None
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._alive.clear()

    # -- results

    def outside_blocks(self) -> tuple[int, int]:
        """Bytes saved before the first block and after the last one (no checkpointing)."""
        return sum(self.saved[0].values()), sum(self.saved[-1].values())

    def block_bytes(self, index: int, ac: str = "full") -> tuple[int, int, int]:
        """``(saved, kept, recomputed)`` of block ``index``: what it saves, what it keeps
        when ``ac`` checkpoints it (its inputs not already held before it; under ``op``
        also the outputs :class:`OpPolicy` keeps), and what it holds while backward
        recomputes it (that and what it saves again)."""
        segment = index + 1
        earlier: set[int] = set()
        for held in (*self.saved[:segment], *self.inputs[:segment]):
            earlier.update(held)
        keeps = self._checkpoint_keeps(segment, ac)
        kept = sum(n for k, n in keeps.items() if k not in earlier)
        recomputed = sum({**keeps, **self.saved[segment]}.values())
        return sum(self.saved[segment].values()), kept, recomputed

    def _checkpoint_keeps(self, segment: int, ac: str) -> dict[int, int]:
        """What a checkpointed segment keeps for its backward under ``ac``."""
        if ac == "op":
            return {**self.inputs[segment], **self.op_kept[segment]}
        return self.inputs[segment]

    def held_bytes(self, ac: str = "none") -> int:
        """Bytes held at the end of the forward when the blocks ``ac`` selects are
        checkpointed: what a micro-batch keeps while it waits for its backward (under a
        pipeline schedule, several do), without the working set of a recompute."""
        return sum(self._kept(ac))

    def _kept(self, ac: str) -> list[int]:
        chosen = {i + 1 for i in checkpointed_blocks(len(self.blocks), ac)}
        kept: list[int] = []
        counted: set[int] = set()
        for segment, saved in enumerate(self.saved):
            held = self._checkpoint_keeps(segment, ac) if segment in chosen else saved
            kept.append(sum(n for k, n in held.items() if k not in counted))
            counted.update(held)
        return kept

    def peak_bytes(self, ac: str = "none") -> int:
        """Peak bytes held for backward when the blocks ``ac`` selects are checkpointed.

        Without checkpointing the peak is at the end of the forward: everything saved.
        A checkpointed block keeps only its inputs (non-reentrant
        ``torch.utils.checkpoint``; under ``op`` also the outputs it keeps) and saves
        its activations again when backward recomputes it, while the segments before it
        still hold theirs; the peak is the larger of the end of the forward and the
        worst such recomputation.
        """
        chosen = {i + 1 for i in checkpointed_blocks(len(self.blocks), ac)}
        kept = self._kept(ac)
        peak = sum(kept)
        for segment in chosen:
            recomputed = {**self._checkpoint_keeps(segment, ac), **self.saved[segment]}
            peak = max(peak, sum(kept[:segment]) + sum(recomputed.values()))
        return peak


class _KeptOutputs(TorchDispatchMode):
    """Hands every operator's outputs to ``record(func, out)``: what
    :class:`SavedActivations` reads to count the outputs ``op`` checkpointing keeps."""

    def __init__(self, record: Callable[[Any, Any], None]) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.record(func, out)
        return out
