"""A small trainer: tensor parallel (+ sequence parallel) x FSDP2, DCP checkpoints.

The model is built on the meta device from its registered
:class:`~hyper_parallel.dmodule.model_spec.ModelSpec`, tensor-parallelized with
``Module.parallelize(mesh["tp"])``, each transformer block and then the root are
wrapped with FSDP2's ``fully_shard`` over ``mesh["dp"]``, and only then are states
materialized (``to_empty``) and initialized (``init_states``), so each rank only
ever holds its own shards. ``init_states`` is shard-consistent: with the same seed,
a model built this way at any mesh starts from exactly the values of the same model
built in one process. With the same global batch (each dp rank takes its slice,
tp ranks the same rows) and FSDP averaging gradients over dp, the losses of a
dp x tp run match the single-process run to float32 rounding.

Run it under ``torchrun`` (see :mod:`hyper_parallel.train.run`) or in one process::

    from hyper_parallel.train import TrainConfig, train

    result = train(TrainConfig(num_steps=10))  # one process: no process group needed
    print(result.losses[-1])
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed import precision
from hyper_parallel.distributed.activation_checkpoint import apply_activation_checkpointing
from hyper_parallel.distributed.activation_checkpoint import check_mode as check_ac_mode
from hyper_parallel.distributed.compile import apply_compile
from hyper_parallel.distributed.precision import check_dtype
from hyper_parallel.dmodule.model_spec import get_spec
from hyper_parallel.train.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from hyper_parallel.train.data import DEFAULT_TEXT, VOCAB_SIZE, TextBatches, load_tokens

__all__ = [
    "MESH_AXES",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "build_mesh",
    "build_parallel_model",
    "clip_grad_norm_",
    "default_device",
    "model_config",
    "train",
]

MESH_AXES = ("dp", "tp")
"""Mesh axes the trainer knows, outermost first: data parallel (FSDP2), tensor parallel."""


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything one training run needs; JSON-serialisable (:meth:`to_dict`).

    Args:
        model: Name of a registered model spec (``hyper_parallel.dmodule.get_spec``).
        model_overrides: Keyword overrides for the spec's config (e.g. ``num_layers``).
        mesh: Mesh axis sizes, e.g. ``{"dp": 2, "tp": 2}``; missing axes are 1. The
            product is the number of ranks; ``{}`` trains in one process.
        sequence_parallel: Use the model's TP+SP layout instead of plain TP (needs
            ``tp > 1`` and ``seq_len`` divisible by ``tp``).
        num_steps: Optimizer steps to train for.
        global_batch_size: Sequences per step over all dp ranks (divisible by dp).
        seq_len: Tokens per sequence.
        lr: Peak learning rate of AdamW.
        weight_decay: AdamW's decoupled weight decay.
        warmup_steps: Linear warm-up steps; then cosine decay to 10% at ``num_steps``.
        max_grad_norm: Clip the global gradient norm to this; ``0`` disables clipping.
        seed: Seeds initialization (same values at every mesh).
        text: A text shipped in ``hyper_parallel/train/data/``.
        checkpoint_dir: Where checkpoints go; ``None`` saves none.
        checkpoint_every: Save every this many steps (``0``: only after the last step).
        resume: Continue from the latest complete checkpoint in ``checkpoint_dir``
            (starts from scratch when there is none).
        log_every: Print a log line on rank 0 every this many steps (``0``: never).
        progress: Show a progress bar on rank 0 when stderr is a terminal.
        compile: ``torch.compile`` each transformer block (``fullgraph=True``), after
            the tensor-parallel plan and before FSDP2
            (:mod:`hyper_parallel.distributed.compile`).
        dtype: ``"fp32"``, or ``"bf16"`` mixed precision with fp32 master weights
            (:mod:`hyper_parallel.distributed.precision`).
        ac: Activation checkpointing: ``"none"``, ``"full"`` (every block) or
            ``"selective"`` (every second block;
            :mod:`hyper_parallel.distributed.activation_checkpoint`).
    """

    model: str = "llama3-debug"
    model_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    sequence_parallel: bool = False
    num_steps: int = 30
    global_batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 3
    max_grad_norm: float = 1.0
    seed: int = 0
    text: str = DEFAULT_TEXT
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    log_every: int = 1
    progress: bool = True
    compile: bool = False
    dtype: str = "fp32"
    ac: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise ValueError(f"TrainConfig.compile must be True or False, got {self.compile!r}.")
        try:
            check_dtype(self.dtype)
            check_ac_mode(self.ac)
        except ValueError as e:
            raise ValueError(f"TrainConfig: {e}") from None
        unknown = sorted(set(self.mesh) - set(MESH_AXES))
        if unknown:
            raise ValueError(
                f"TrainConfig.mesh: axes {unknown} are not trainer axes {list(MESH_AXES)}; "
                'write the mesh as e.g. {"dp": 2, "tp": 2}.'
            )
        bad = {k: v for k, v in self.mesh.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"TrainConfig.mesh: axis sizes must be integers >= 1, got {bad}.")
        for name in ("num_steps", "global_batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("warmup_steps", "checkpoint_every", "log_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}.")
        if self.max_grad_norm < 0 or self.lr <= 0 or self.weight_decay < 0:
            raise ValueError(
                "TrainConfig: lr must be > 0 and max_grad_norm, weight_decay >= 0; got "
                f"lr={self.lr}, max_grad_norm={self.max_grad_norm}, "
                f"weight_decay={self.weight_decay}."
            )
        if self.global_batch_size % self.dp:
            raise ValueError(
                f"TrainConfig: global_batch_size={self.global_batch_size} is not divisible by "
                f"dp={self.dp}; each dp rank takes an equal slice of the global batch."
            )
        if self.sequence_parallel and (self.tp == 1 or self.seq_len % self.tp):
            raise ValueError(
                f"TrainConfig: sequence_parallel needs tp > 1 and seq_len divisible by tp "
                f"(got tp={self.tp}, seq_len={self.seq_len}); set a tp axis or drop it."
            )
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("TrainConfig: resume=True needs a checkpoint_dir to resume from.")

    @property
    def dp(self) -> int:
        """Data-parallel size."""
        return self.mesh.get("dp", 1)

    @property
    def tp(self) -> int:
        """Tensor-parallel size."""
        return self.mesh.get("tp", 1)

    @property
    def world_size(self) -> int:
        """Number of ranks the mesh needs."""
        return self.dp * self.tp

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-serialisable dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """Rebuild a config from :meth:`to_dict` output.

        Raises:
            ValueError: For a key that is not a field (the message lists the fields).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(
                f"TrainConfig: unknown field(s) {unknown}; fields are {sorted(names)}."
            )
        return cls(**values)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based): linear warm-up, cosine decay."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        decay_steps = max(1, self.num_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainResult:
    """What a run did, as seen on this rank.

    Args:
        steps: The step number (1-based) of each entry of ``losses``.
        losses: Global-batch mean loss after each step, averaged over dp ranks.
        grad_norms: Global gradient norm before clipping, per step.
        final_step: Step count at the end (the resumed-from step + steps run).
        seconds: Wall time of the training loop.
        resumed_from: The step the run resumed from (``0``: from scratch).
    """

    steps: list[int]
    losses: list[float]
    grad_norms: list[float]
    final_step: int
    seconds: float
    resumed_from: int = 0


def default_device() -> torch.device:
    """This rank's device: its CUDA device under ``LOCAL_RANK`` when there is one, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def build_mesh(
    sizes: Mapping[str, int], device: torch.device | str | None = None
) -> DeviceMesh | None:
    """A ``("dp", "tp")`` DeviceMesh of the given sizes on the running process group.

    Args:
        sizes: Axis sizes (``{"dp": 2, "tp": 2}``); missing axes are 1.
        device: Device whose type the mesh uses; defaults to :func:`default_device`.

    Returns:
        The mesh, or ``None`` when the sizes multiply to 1 (one device, no mesh).

    Raises:
        ValueError: The sizes need more than one rank but there is no process group,
            or the process group has another number of ranks.
    """
    world = math.prod(sizes.get(axis, 1) for axis in MESH_AXES)
    if world == 1:
        return None
    if not dist.is_initialized():
        raise ValueError(
            f"build_mesh: mesh {dict(sizes)} needs {world} ranks but no process group is "
            f"running; launch with `torchrun --nproc-per-node {world} -m "
            "hyper_parallel.train.run ...`."
        )
    if dist.get_world_size() != world:
        raise ValueError(
            f"build_mesh: mesh {dict(sizes)} needs {world} ranks, the process group has "
            f"{dist.get_world_size()}; make the axis sizes multiply to the world size."
        )
    device_type = torch.device(device if device is not None else default_device()).type
    shape = tuple(sizes.get(axis, 1) for axis in MESH_AXES)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)


def _axis_size(mesh: DeviceMesh | None, axis: str) -> int:
    return 1 if mesh is None else mesh[axis].size()


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError(
            f"build_parallel_model: {type(model).__name__} has no `layers` ModuleList of "
            "transformer blocks to wrap with fully_shard; the trainer shards each block "
            "of model.layers and then the root."
        )
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def model_config(cfg: TrainConfig, tp: int | None = None) -> Any:
    """The model config ``cfg`` trains, with its sharding configs attached when ``tp > 1``.

    Needs no process group, so a launcher can check a run before starting ranks.

    Args:
        cfg: The run's config.
        tp: Tensor-parallel size; defaults to ``cfg.tp``.

    Raises:
        ValueError: The model is not registered, has no sharding function for the
            layout asked for, or ``tp`` does not fit its shapes.
    """
    tp = cfg.tp if tp is None else tp
    spec = get_spec(cfg.model)
    config = spec.config(**cfg.model_overrides)
    if tp == 1:
        return config
    layout = "tp_sp" if cfg.sequence_parallel else "tp"
    shard_config = spec.extras.get(layout)
    if shard_config is None:
        raise ValueError(
            f"model {cfg.model!r} has no {layout!r} sharding function in its "
            f"ModelSpec.extras (has: {sorted(spec.extras)}); register one, or train with tp=1."
        )
    return shard_config(config, tp_size=tp)


def build_parallel_model(
    cfg: TrainConfig, mesh: DeviceMesh | None, device: torch.device | str | None = None
) -> nn.Module:
    """Build ``cfg.model`` on meta, parallelize, ``fully_shard``, materialize and initialize.

    Steps: build on the meta device → ``model.parallelize(mesh["tp"])`` with the
    spec's ``"tp"`` (or ``"tp_sp"``) sharding function (when ``tp > 1``) →
    ``torch.compile`` per block (``cfg.compile``) → activation checkpointing
    (``cfg.ac``) → ``fully_shard`` (with ``cfg.dtype``'s mixed precision) each block of ``model.layers`` and the root over ``mesh["dp"]``
    (when ``dp > 1``) → ``to_empty(device)`` → ``torch.manual_seed(cfg.seed)`` and
    ``init_states()``. With ``mesh=None`` the same model is built for one device,
    through the same steps, so it gets the same initial values.

    Args:
        cfg: The run's config (model name, overrides, sequence parallel, seed).
        mesh: A mesh from :func:`build_mesh`, or ``None`` for one device.
        device: Where states live; defaults to :func:`default_device`.

    Returns:
        The initialized model.

    Raises:
        ValueError: The model spec has no sharding function for the layout asked
            for, or its model has no ``layers`` to shard.

    Example:
        >>> model = build_parallel_model(TrainConfig(), mesh=None)
    """
    device = torch.device(device if device is not None else default_device())
    tp, dp = _axis_size(mesh, "tp"), _axis_size(mesh, "dp")
    config = model_config(cfg, tp)
    with torch.device("meta"):
        model = config.build()
    if tp > 1:
        model.parallelize(mesh["tp"])
    # Plan, compile (per block), activation checkpointing around the compiled blocks,
    # then FSDP (see hyper_parallel.distributed.compile for why AC goes outside).
    if cfg.compile:
        apply_compile(model)
    if cfg.ac != "none":
        apply_activation_checkpointing(model, cfg.ac)
    if dp > 1:
        mp_policy = precision.fsdp_policy(cfg.dtype)
        for block in _blocks(model):
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp_policy)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp_policy)
    model.to_empty(device=device)
    torch.manual_seed(cfg.seed)
    model.init_states()
    return model


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients to a global norm, for plain, DTensor and mixed-mesh gradients.

    ``torch.nn.utils.clip_grad_norm_`` stacks the per-tensor norms, which fails when
    DTensor gradients live on different meshes (e.g. FSDP-only parameters on
    ``dp`` next to TP x FSDP ones on ``(dp, tp)``), and returns a DTensor norm. Here
    the gradients are grouped by mesh; each group's norm is computed by torch and
    made full with ``full_tensor()`` (the DTensor norm of a shard is partial: its
    reduction adds the other shards' contributions and counts replicas once); the
    groups' norms are then combined.

    Args:
        parameters: Parameters whose ``.grad`` to clip (those without are skipped).
        max_norm: Largest allowed total norm (``inf``: only measure it).
        norm_type: The p of the p-norm (``inf`` for the max norm).

    Returns:
        The total norm before clipping, a plain scalar tensor (same on every rank).
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    group_norms = []
    for group in groups.values():
        with _quiet_redistribute_hints():
            norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
        group_norms.append(norm)
    total = torch.linalg.vector_norm(torch.stack(group_norms), norm_type)
    if math.isfinite(max_norm):
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


@contextlib.contextmanager
def _quiet_redistribute_hints() -> Iterator[None]:
    """Mute DTensor's hint that a 2-D partial reduction takes two all-reduces.

    For one scalar per mesh the second all-reduce costs nothing worth a warning on
    every rank, and every rank runs the same reductions in the same order.
    """
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class _Progress:
    """A one-line progress bar on a terminal; silent elsewhere (logs still print)."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.total, self.start = total, start
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        width = 30
        done = int(width * step / self.total)
        elapsed = time.perf_counter() - self.t0
        rate = (step - self.start) / elapsed if elapsed > 0 else 0.0
        sys.stderr.write(
            f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total} "
            f"loss {loss:.4f} {rate:.1f} step/s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


class Trainer:
    """Owns the mesh, model, optimizer and data stream of one run.

    Args:
        cfg: The run's config.
        device: Where states live; defaults to :func:`default_device`.
        step_callback: Called as ``fn(step, loss)`` after every step on every rank
            (after any checkpoint of that step is written).

    Raises:
        ValueError: The mesh does not match the process group (see :func:`build_mesh`).

    Example:
        >>> trainer = Trainer(TrainConfig(num_steps=4, log_every=0))
        >>> result = trainer.fit()
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        device: torch.device | str | None = None,
        step_callback: Callable[[int, float], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device if device is not None else default_device())
        self.mesh = build_mesh(cfg.mesh, self.device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dp_size = _axis_size(self.mesh, "dp")
        self.dp_rank = 0 if self.mesh is None else self.mesh["dp"].get_local_rank()
        self.model = build_parallel_model(cfg, self.mesh, self.device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        spec = get_spec(cfg.model)
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = spec.extras.get(
            "loss_fn", _cross_entropy
        )
        tokens = load_tokens(cfg.text)
        vocab_size = _vocab_size(self.model)
        if vocab_size is not None and vocab_size < VOCAB_SIZE:
            raise ValueError(
                f"Trainer: model {cfg.model!r} has a vocabulary of {vocab_size} but the data "
                f"is bytes (vocabulary {VOCAB_SIZE}); override vocab_size >= {VOCAB_SIZE}."
            )
        self.data = TextBatches(
            tokens, global_batch_size=cfg.global_batch_size, seq_len=cfg.seq_len
        )
        self.step = 0
        self.resumed_from = 0
        self.step_callback = step_callback
        if cfg.resume:
            assert cfg.checkpoint_dir is not None  # checked by TrainConfig
            path = latest_checkpoint(cfg.checkpoint_dir, distributed=self.mesh is not None)
            if path is not None:
                self.load(path)
                self.resumed_from = self.step

    # ------------------------------------------------------------------ checkpoints

    def train_state(self) -> dict[str, int]:
        """Step and data position, as stored in checkpoints."""
        data = self.data.state_dict()
        return {"step": self.step, "data_position": data["position"], "data_epoch": data["epoch"]}

    def save(self, path: str | None = None) -> str:
        """Save a checkpoint of the current step (default: under ``cfg.checkpoint_dir``)."""
        if path is None:
            if self.cfg.checkpoint_dir is None:
                raise ValueError("Trainer.save: no path given and cfg.checkpoint_dir is None.")
            path = checkpoint_path(self.cfg.checkpoint_dir, self.step)
        save_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer,
            train_state=self.train_state(),
            distributed=self.mesh is not None,
        )
        return path

    def load(self, path: str) -> None:
        """Restore model, optimizer, step, data position and RNG from a checkpoint."""
        state = load_checkpoint(
            path, model=self.model, optimizer=self.optimizer, distributed=self.mesh is not None
        )
        self.step = int(state["step"])
        self.data.load_state_dict(
            {"position": state["data_position"], "epoch": state["data_epoch"]}
        )

    # ------------------------------------------------------------------ training

    def train_step(self) -> tuple[float, float]:
        """One optimizer step on the next batch; returns ``(loss, grad_norm)``.

        ``loss`` is the mean over this rank's slice of the global batch, averaged over
        dp ranks (equal slices: the global-batch mean). FSDP2 averages gradients over
        dp, so the update is the one a single process computes from the whole batch.
        """
        lr = self.cfg.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = self.data.next_batch(self.dp_rank, self.dp_size)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        with precision.autocast(self.cfg.dtype, self.device, sharded=self.dp_size > 1):
            logits = self.model(inputs)
        loss = self.loss_fn(precision.loss_logits(logits), targets)
        loss.backward()
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return self._global_mean(loss), float(grad_norm)

    def _global_mean(self, loss: torch.Tensor) -> float:
        value = loss.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if self.dp_size > 1:
            assert self.mesh is not None
            value = value.clone()
            dist.all_reduce(value, group=self.mesh.get_group("dp"))
            value = value / self.dp_size
        return float(value)

    def fit(self, until_step: int | None = None) -> TrainResult:
        """Train from the current step to ``until_step`` (default ``cfg.num_steps``).

        Saves a checkpoint every ``cfg.checkpoint_every`` steps and after the last step
        of the run (when ``cfg.checkpoint_dir`` is set); logs on rank 0.
        """
        cfg = self.cfg
        end = cfg.num_steps if until_step is None else min(until_step, cfg.num_steps)
        is_logger = self.rank == 0
        progress = _Progress(cfg.num_steps, self.step, cfg.progress and is_logger)
        if is_logger and cfg.log_every and self.resumed_from:
            print(f"resumed from step {self.resumed_from}", flush=True)
        elif is_logger and cfg.log_every and cfg.resume and self.step == 0:
            print(f"no checkpoint in {cfg.checkpoint_dir}; starting from step 0", flush=True)
        steps, losses, grad_norms = [], [], []
        t0 = time.perf_counter()
        while self.step < end:
            loss, grad_norm = self.train_step()
            steps.append(self.step)
            losses.append(loss)
            grad_norms.append(grad_norm)
            progress.update(self.step, loss)
            if is_logger and cfg.log_every and self.step % cfg.log_every == 0:
                tokens_per_second = (
                    cfg.global_batch_size * cfg.seq_len * len(steps) / (time.perf_counter() - t0)
                )
                self._log(loss, grad_norm, tokens_per_second, progress)
            every = cfg.checkpoint_every
            if cfg.checkpoint_dir is not None and (
                (every and self.step % every == 0) or self.step == end
            ):
                self.save()
            if self.step_callback is not None:
                self.step_callback(self.step, loss)
        progress.close()
        return TrainResult(
            steps=steps,
            losses=losses,
            grad_norms=grad_norms,
            final_step=self.step,
            seconds=time.perf_counter() - t0,
            resumed_from=self.resumed_from,
        )

    def _log(
        self, loss: float, grad_norm: float, tokens_per_second: float, progress: _Progress
    ) -> None:
        if progress.enabled:
            sys.stderr.write("\r")  # the log line replaces the bar; the bar redraws after
        print(
            f"step {self.step:>5}/{self.cfg.num_steps} | loss {loss:.4f} | grad_norm "
            f"{grad_norm:.3f} | lr {self.cfg.lr_at(self.step - 1):.2e} | "
            f"{tokens_per_second:,.0f} tok/s",
            flush=True,
        )


def _vocab_size(model: nn.Module) -> int | None:
    embedding = getattr(model, "tok_embeddings", None)
    return getattr(embedding, "num_embeddings", None)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


def train(
    cfg: TrainConfig,
    *,
    device: torch.device | str | None = None,
    step_callback: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Build a :class:`Trainer` for ``cfg`` and train to ``cfg.num_steps``.

    Under ``torchrun`` (or any initialized process group) call it on every rank with
    a mesh whose sizes multiply to the world size; in one process use ``mesh={}``.

    Example:
        >>> result = train(TrainConfig(num_steps=2, log_every=0))
        >>> len(result.losses)
        2
    """
    return Trainer(cfg, device=device, step_callback=step_callback).fit()
