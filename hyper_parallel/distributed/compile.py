"""``torch.compile`` per transformer block, as torchtitan applies it.

Each block's ``forward`` (the blocks the model's family declares,
:attr:`~hyper_parallel.dmodule.ModelFamily.blocks`, e.g. ``model.layers``) is compiled with ``fullgraph=True``,
after the tensor-parallel plan and before FSDP2 wraps the block: the blocks share one
compiled graph per shape class (same code, parameters as graph inputs), a graph break
is an error rather than a silent slowdown, and module hooks (FSDP's all-gathers) stay
outside the compiled region. Both boundary paths (the fast path and DTensor dispatch)
trace without a break (see ``hyper_parallel.dmodule._fast``).

A block with routed experts (a mixture of experts) is compiled region by region
instead, as torchtitan does: the experts module runs eagerly — under expert
parallelism it is an FSDP2 unit of its own (over ``efsdp``), whose hooks dynamo does
not trace, and its dispatch's all-to-alls take split sizes that change with the
routing on every call — and everything else is compiled with ``fullgraph=True``:
each child of the block without experts inside (norms, attention), each child of
the module holding the experts (the router, the balance statistics), and the
experts' own maths (the family's ``compile_experts`` hook, token count unbacked), so only the
residual adds, the routing glue and the dispatch run between compiled regions.

Sequence lengths: a block on the fast path compiles once per shape class — static for
the first shape, then one graph with a dynamic sequence length (torch's automatic
dynamic shapes) for every later length. A block whose linear layers run through
DTensor dispatch (the DTensor path, ``fast_path(False)``) cannot take that dynamic
graph in torch 2.13: AOTAutograd's trace of ``F.linear`` on a 3-D DTensor with a
symbolic length recurses without end in ``proxy_tensor.get_proxy_slot`` (the
backward of the linear's fold of its leading dims; folding them ourselves only moves
the failure to the view back; pytorch/pytorch#159709, #152954). Such a block is
compiled with ``dynamic=False`` instead: each new sequence length compiles one more
static graph (and a length seen before none), up to dynamo's
``recompile_limit`` (8) per block code, after which dynamo runs the block eagerly.
This is a torch limitation, not a choice; the fast path is the one to compile.

Activation checkpointing is applied after compile, around the compiled forward: its
recomputation reruns the compiled graph. (A checkpoint region traced inside the
graph — torchtitan's order — fails in this torch's AOTAutograd when the block's
activations are DTensors: it saves the DeviceMesh as a tensor.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hyper_parallel.dmodule._boundary import Boundary, installed_forward

__all__ = ["BACKENDS", "apply_compile", "blocks_of"]

BACKENDS = ("inductor", "aot_eager", "eager")
"""Backends the trainer accepts: torch's default code generator, and two for debugging."""


def blocks_of(model: nn.Module, *, what: str, blocks: str | None = "layers") -> list[nn.Module]:
    """The transformer blocks of ``model.<blocks>`` (a ``ModuleList`` or ``ModuleDict``).

    Args:
        model: The model (or a pipeline stage).
        what: The caller, for the error.
        blocks: The attribute holding the blocks (the family's
            :attr:`~hyper_parallel.dmodule.ModelFamily.blocks`).

    Raises:
        ValueError: The model has no such container; ``what`` names the caller.
    """
    layers = getattr(model, blocks, None) if blocks else None
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(
            f"{what}: {type(model).__name__} has no {blocks!r} ModuleList of transformer "
            "blocks; it applies to each block the model's family declares "
            "(ModelFamily.blocks)."
        )
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def apply_compile(
    model: nn.Module,
    *,
    backend: str = "inductor",
    blocks: str | None = "layers",
    experts: Sequence[nn.Module] = (),
    compile_experts: Callable[[nn.Module, str], None] | None = None,
) -> None:
    """Compile every block of ``model.<blocks>`` in place with ``fullgraph=True``.

    The blocks stay the same modules (only ``forward`` is replaced by its compiled
    form), so the blocks, parameter names and checkpoints are unchanged. A block
    holding routed experts is compiled region by region around them (module docstring).

    Args:
        model: A model with a container of blocks, already parallelized.
        backend: A ``torch.compile`` backend from :data:`BACKENDS`.
        blocks: The attribute holding the blocks (``ModelFamily.blocks``).
        experts: The routed-experts modules (``ModelFamily.expert_modules``); experts
            with a dispatch in their plan entry or an FSDP2 unit of their own are
            recognised without it.
        compile_experts: ``(experts, backend) -> None``, compiles the experts' own
            maths (``ModelFamily.compile_experts``); ``None``: they run eagerly.

    Raises:
        ValueError: For an unknown backend, or a model without those blocks.

    Example::

        model.parallelize(mesh)
        apply_compile(model)  # then activation checkpointing, fully_shard
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"apply_compile: backend {backend!r} is not one of {list(BACKENDS)}; use "
            "'inductor' (default) or 'aot_eager' to debug."
        )
    known = {id(m) for m in experts}
    for block in blocks_of(model, what="apply_compile", blocks=blocks):
        if _holds_experts(block, known):
            _compile_around_experts(block, backend, known, compile_experts)
        else:
            block.forward = _compile(block, backend)


def _is_experts(module: nn.Module, known: set[int]) -> bool:
    """Routed experts: declared by the family, a dispatch in their plan entry, or an
    FSDP2 unit of their own."""
    config = getattr(module, "sharding_config", None)
    return (
        id(module) in known
        or getattr(config, "dispatch", None) is not None
        or isinstance(module, FSDPModule)
    )


def _holds_experts(module: nn.Module, known: set[int]) -> bool:
    return any(_is_experts(m, known) for m in module.modules() if m is not module)


def _compile_around_experts(
    module: nn.Module,
    backend: str,
    known: set[int],
    compile_experts: Callable[[nn.Module, str], None] | None,
) -> None:
    """Compile each child of ``module`` that holds no experts; recurse into the one that
    does; compile the experts' own maths where the family offers it. ``module``'s own
    forward (residual adds, routing glue) stays eager."""
    for child in module.children():
        if _is_experts(child, known):
            if compile_experts is not None:
                compile_experts(child, backend)
        elif _holds_experts(child, known):
            _compile_around_experts(child, backend, known, compile_experts)
        else:
            child.forward = _compile(child, backend)


def _compile(unit: nn.Module, backend: str) -> Callable[..., Any]:
    """``unit.forward`` compiled with ``fullgraph=True``; statically where it must be."""
    dynamic = False if _runs_dtensor_linear(unit) else None
    return torch.compile(unit.forward, fullgraph=True, backend=backend, dynamic=dynamic)


def _runs_dtensor_linear(unit: nn.Module) -> bool:
    """Whether a linear layer of ``unit`` runs through DTensor dispatch (its boundary,
    not the fast path), whose dynamic-shape graph torch 2.13 cannot trace (module
    docstring). Decided from what ``parallelize`` installed, so a model built with the
    fast path off, or with layers the fast path does not take, is caught either way."""
    return any(
        isinstance(m, nn.Linear) and isinstance(installed_forward(m), Boundary)
        for m in unit.modules()
    )
