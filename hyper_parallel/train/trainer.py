"""A small trainer on the N-D mesh: PP x FSDP2 / HSDP x CP x TP (+SP) x EP, DCP checkpoints.

The mesh is one :class:`~hyper_parallel.distributed.MeshLayout` (``TrainConfig.mesh``:
``pp``, ``dp_replicate``, ``dp_shard`` — alias ``dp`` —, ``cp``, ``tp``, ``ep``).
Every decision about the run is made once, by its run plan (:func:`run_plan`, a
:class:`~hyper_parallel.distributed.run_plan.RunPlan`): the submeshes, the gradient
convention under ``cp`` and ``ep``, the micro-batches; its errors are the one gate
(:func:`check_config`, which ``validate``, ``plan`` and the demo share): every problem
of the mesh, the axes, the model and the switches, each with the reason and the fix,
before any process group exists; one builder applies it to the whole model and to
each pipeline stage. The model is built on the meta device from its registered
:class:`~hyper_parallel.dmodule.model_spec.ModelSpec`, parallelized on the submesh
of the axes its sharding declares (:func:`~hyper_parallel.distributed.plan_mesh`),
each transformer block and then the root are wrapped with FSDP2's ``fully_shard``
over :meth:`~hyper_parallel.distributed.ParallelMesh.fsdp_mesh` (1-D ``fsdp``, or
``(dp_replicate, fsdp)`` for HSDP), and only then are states materialized
(``to_empty``) and initialized (``init_states``, one module at a time), so a rank's
states are its own shards. ``init_states`` is shard-consistent: with the same seed, a model built
this way at any mesh starts from exactly the values of the same model built in one
process. With the same global batch (split over the ``batch`` axis, dp_replicate x
dp_shard; tp ranks read the same rows; cp ranks split each sequence head-tail and
pass its global positions), FSDP averaging gradients over every data rank (and the
``cp``-partial gradients averaged over cp) and the logged loss averaged over the
``loss`` axis, the losses of any mesh match the single-process run to float32
rounding.

The run's configuration and gate are in :mod:`hyper_parallel.train.config`, what it builds
in :mod:`hyper_parallel.train.build`, the gradients across the mesh in
:mod:`hyper_parallel.train.gradients`; this module is the loop (:class:`Trainer`,
:func:`train`) and re-exports them.

Run it under ``torchrun`` (see :mod:`hyper_parallel.train.run`) or in one process::

    from hyper_parallel.train import TrainConfig, train

    result = train(TrainConfig(steps=10))  # one process: no process group needed
    print(result.losses[-1])
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.core.dtensor.device_mesh import init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed.axes import MODEL_AXES
from hyper_parallel.distributed.builder import build_model, build_stages
from hyper_parallel.distributed.pipeline import build_schedule, pipeline_step
from hyper_parallel.distributed.precision import loss_logits
from hyper_parallel.distributed.process_group import default_device as default_device
from hyper_parallel.distributed.process_group import init_process_group
from hyper_parallel.dmodule.model_spec import get_spec
from hyper_parallel.train import report, run_hooks
from hyper_parallel.train.build import build_mesh, build_parallel_model, build_pipeline_stages
from hyper_parallel.train.checkpoint import (
    PendingSave,
    async_save_checkpoint,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from hyper_parallel.train.config import (
    TRAINER_AXES,
    TrainConfig,
    check_config,
    config_axes,
    model_config,
    run_plan,
)
from hyper_parallel.train.data import TextBatches, load_tokens
from hyper_parallel.train.gradients import ScaledLoss, clip_grad_norm_, set_gradient_sync

__all__ = [
    "MODEL_AXES",
    "TRAINER_AXES",
    "Batch",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "build_mesh",
    "build_parallel_model",
    "build_pipeline_stages",
    "check_config",
    "clip_grad_norm_",
    "config_axes",
    "default_device",
    "model_config",
    "run_plan",
    "train",
]


@dataclasses.dataclass(kw_only=True, slots=True)
class Batch:
    """One rank's share of a global batch.

    Args:
        inputs: Token ids ``[rows, seq]`` this rank feeds the model.
        targets: The next-token ids the loss compares with, same shape.
        model_kwargs: Extra keyword arguments of the model's forward for this shard.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    model_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def split(self, num_microbatches: int) -> list[Batch]:
        """This batch as ``num_microbatches`` equal micro-batches of consecutive rows.

        The model's keyword arguments (the cp positions, the same for every row) go
        to each. The run plan refuses a count that does not divide the rows.
        """
        if num_microbatches == 1:
            return [self]
        rows = self.inputs.shape[0]
        assert rows % num_microbatches == 0, (rows, num_microbatches)  # the run plan's check
        return [
            Batch(inputs=i, targets=t, model_kwargs=self.model_kwargs)
            for i, t in zip(
                self.inputs.chunk(num_microbatches), self.targets.chunk(num_microbatches)
            )
        ]


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
        grad_callback: Called as ``fn(step, model_parts)`` on every rank once the
            step's gradients are final (reduced, scaled, experts rescaled) and before
            clipping; the demo reads the first step's gradients there.
        hf: The Hugging Face config of ``cfg.hf_checkpoint`` / ``cfg.hf_config``
            when the caller already read it
            (:func:`~hyper_parallel.train.run_hooks.resolve_model`); ``None``: read
            here, once.
        one_rank_fsdp: A one-device run (``cfg.mesh`` of one rank, in a process group of
            one rank: :func:`~hyper_parallel.distributed.process_group.one_rank_group`)
            whose model FSDP2 wraps over that rank, so that it computes as FSDP2 makes a
            data-parallel run compute (under ``bf16``: bf16 parameters and a bf16 stream
            between units, where one device alone computes under autocast). The demo's
            one-process reference of a run whose dense states FSDP2 shards.

    Raises:
        ValueError: Every problem :func:`check_config` finds (a bad mesh, an axis the
            trainer cannot run, a model that cannot be sharded), or a mesh that does
            not match the process group.

    Example:
        >>> trainer = Trainer(TrainConfig(steps=4, log_every=0))
        >>> result = trainer.fit()
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        device: torch.device | str | None = None,
        step_callback: Callable[[int, float], None] | None = None,
        grad_callback: Callable[[int, list[nn.Module]], None] | None = None,
        hf: Any = None,
        one_rank_fsdp: bool = False,
    ) -> None:
        # The model of a Hugging Face source, its config.json read once for the run
        # (``hf``: already read by the code that built the run; run_hooks.resolve_model).
        cfg, self.hf = run_hooks.resolve_model(cfg, hf)
        self.cfg = cfg
        self.device = torch.device(device if device is not None else default_device())
        layout = cfg.layout
        if layout.world_size > 1:
            init_process_group()  # under torchrun: join its group, as the mesh would
        # A one-device run may sit inside a larger process group (it then ignores it).
        world = dist.get_world_size() if dist.is_initialized() and layout.world_size > 1 else None
        # The run plan decides everything once: its errors stop the run here.
        self.run = run_plan(cfg, world)
        self.run.raise_for_errors(f"Trainer (mesh {layout.describe()})")
        report.check_outputs(cfg)
        self.mesh = build_mesh(layout, self.device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # Rows of the global batch are split over `batch` (dp_replicate x dp_shard);
        # the mean loss is averaged over `loss` (the ranks holding different tokens).
        self.dp_size = layout.size("batch")
        self.dp_rank = 0 if self.mesh is None else self.mesh.local_rank("batch")
        self.loss_size = layout.size("loss")
        # Context parallelism: each rank holds chunks of every sequence (head-tail).
        self.cp_size = layout.cp
        self.cp_rank = 0 if self.mesh is None else self.mesh.local_rank("cp")
        spec = get_spec(cfg.model)
        self.family = spec.family
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            spec.family.loss_fn or _cross_entropy
        )
        # Under pp > 1 this rank holds some stages (model parts) and runs torch's schedule.
        self.schedule: Any = None
        self.pipeline_plan: Any = None
        if layout.pp > 1:
            assert self.mesh is not None
            self.model_parts = build_stages(self.run, self.mesh, self.device, cfg.seed)
            self.pipeline_plan = self.run.pipeline
            # Each rank's loss scaled as the run plan says (1 / cp), as in `backward`.
            self.schedule = build_schedule(
                self.model_parts,
                self.pipeline_plan,
                self.mesh["pp"],
                self.device,
                ScaledLoss(self.loss_fn, self.run),
            )
        else:
            one_rank = None
            if one_rank_fsdp:
                if layout.world_size != 1 or not dist.is_initialized():
                    raise ValueError(
                        "Trainer: one_rank_fsdp is for a one-device run in a process group "
                        f"of one rank (mesh {layout.describe()}; process group "
                        f"{'of ' + str(dist.get_world_size()) if dist.is_initialized() else 'none'})"
                        "; use hyper_parallel.distributed.process_group.one_rank_group()."
                    )
                one_rank = init_device_mesh(self.device.type, (1,), mesh_dim_names=("fsdp",))
            self.model_parts = [
                build_model(self.run, self.mesh, self.device, cfg.seed, one_rank_fsdp=one_rank)
            ]
        self.model = self.model_parts[0]
        run_hooks.load_weights(cfg, self.model_parts)
        self.optimizers = [
            torch.optim.AdamW(m.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
            for m in self.model_parts
        ]
        self.optimizer = self.optimizers[0]
        vocab_size = (
            spec.family.vocab_size(spec.config(**cfg.model_overrides))
            if spec.family.vocab_size is not None
            else None
        )
        self.data = run_hooks.build_data(cfg, vocab_size, self.hf)
        if self.data is None:
            tokens = load_tokens(cfg.text)
            run_hooks.check_bytes_fit(cfg, vocab_size)
            self.data = TextBatches(tokens, global_batch_size=cfg.batch_size, seq_len=cfg.seq_len)
        self.step = 0
        self.resumed_from = 0
        self.step_callback = step_callback
        self.grad_callback = grad_callback
        self._pending: tuple[PendingSave, int, float] | None = None  # a background save
        self.report = report.RunReport(self)
        if cfg.resume:
            assert cfg.checkpoint_dir is not None  # checked by TrainConfig
            path = latest_checkpoint(cfg.checkpoint_dir, distributed=self.mesh is not None)
            if path is not None:
                self.report.resumed(path, self.load(path))
                self.resumed_from = self.step

    # ------------------------------------------------------------------ checkpoints

    def train_state(self) -> dict[str, Any]:
        """Step and data position, as stored in checkpoints."""
        data = self.data.state_dict()
        return {
            "step": self.step,
            "data_position": data["position"],
            "data_epoch": data["epoch"],
            "model_json": run_hooks.model_record(self.cfg, self.hf),
            "lr_schedule_steps": self.cfg.lr_schedule_steps or self.cfg.steps,
            "data_json": json.dumps(self.data_record()),
        }

    def data_record(self) -> dict[str, Any]:
        """What the run reads, as checkpoints record it: a resumed run that reads other
        data (or cuts it otherwise) is told so (:meth:`RunReport.resumed`)."""
        cfg = self.cfg
        tokenizer = None  # text --data: the tokenizer makes its tokens
        if cfg.data:
            source = cfg.data
            if all(p.endswith((".txt", ".jsonl")) for p in cfg.data.split(",") if p):
                tokenizer = run_hooks.tokenizer_path(cfg)
        else:  # its tokenizer is named in the source
            shipped = run_hooks.tokenizer_path(cfg)
            source = f"the shipped text {cfg.text}" + (
                f" tokenized with {shipped}" if shipped else " as bytes"
            )
        return {
            "source": source,
            # The whole stream: --eval-split's held-out tail is cut off it at the start.
            "tokens": self.data.tokens.numel() + self.report.held_out,
            "batch_size": cfg.batch_size,
            "seq_len": cfg.seq_len,
            # Another held-out share trains on another part of the stream.
            "eval_split": cfg.eval_split,
            "tokenizer": tokenizer,
        }

    def save(self, path: str | None = None) -> str:
        """Save a checkpoint of the current step (default: under ``cfg.checkpoint_dir``)."""
        self.wait_for_checkpoint()  # one save at a time, in step order
        path = self._checkpoint_path(path)
        save_checkpoint(
            path,
            model=self._parts(self.model_parts),
            optimizer=self._parts(self.optimizers),
            train_state=self.train_state(),
            distributed=self.mesh is not None,
        )
        return path

    def save_async(self, path: str | None = None) -> PendingSave:
        """Start saving a checkpoint of the current step in the background (after
        finishing the one in flight); :meth:`wait_for_checkpoint` finishes it."""
        self.wait_for_checkpoint()
        path = self._checkpoint_path(path)
        self._pending = (
            async_save_checkpoint(
                path,
                model=self._parts(self.model_parts),
                optimizer=self._parts(self.optimizers),
                train_state=self.train_state(),
                distributed=self.mesh is not None,
            ),
            self.step,
            time.perf_counter(),
        )
        return self._pending[0]

    def wait_for_checkpoint(self) -> str | None:
        """Finish the background save in flight, if any, and report it saved; returns
        its path (``None`` when there was none). Every rank calls it."""
        pending = self._pending
        if pending is None:
            return None
        self._pending = None
        save, step, started = pending
        path = save.wait()
        self.report.saved(path, time.perf_counter() - started, step=step, background=True)
        return path

    def _checkpoint_path(self, path: str | None) -> str:
        if path is not None:
            return path
        if self.cfg.checkpoint_dir is None:
            raise ValueError("Trainer.save: no path given and cfg.checkpoint_dir is None.")
        return checkpoint_path(self.cfg.checkpoint_dir, self.step)

    def load(self, path: str) -> dict[str, Any]:
        """Restore model, optimizer, step, data position and RNG from a checkpoint.

        The optimizer's hyperparameters stay this run's (``lr`` by the schedule at each
        step, ``weight_decay``), not those the checkpoint's run was given.

        Returns:
            The checkpoint's ``train`` record (step, data position, schedule length).
        """
        state = load_checkpoint(
            path,
            model=self._parts(self.model_parts),
            optimizer=self._parts(self.optimizers),
            distributed=self.mesh is not None,
        )
        self.step = int(state["step"])
        # AdamW's state restores the checkpoint's weight decay over this run's (the
        # learning rate is set at every step): the resumed steps use --weight-decay.
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["weight_decay"] = self.cfg.weight_decay
        try:
            self.data.load_state_dict(
                {"position": state["data_position"], "epoch": state["data_epoch"]}
            )
        except ValueError:
            raise ValueError(
                report.data_mismatch(path, state, self.data_record(), refused=True)
            ) from None
        self.report.epoch = self.data.epoch
        return state

    # ------------------------------------------------------------------ training

    def train_step(self) -> tuple[float, float]:
        """One optimizer step on the next batch; returns ``(loss, grad_norm)``.

        ``loss`` is the mean over this rank's slice of the global batch, averaged over
        the ``loss`` ranks (equal slices: the global-batch mean). FSDP2 averages
        gradients over every data rank (HSDP: within and across replicas), so the
        update is the one a single process computes from the whole batch.
        """
        lr = self.cfg.lr_at(self.step)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        batch = self.local_batch()
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else math.inf
        if self.schedule is not None:
            assert self.mesh is not None
            # Stages receive only the previous stage's output: each holds its cp
            # positions (the same for every micro-batch) itself.
            positions = batch.model_kwargs.get("positions")
            if self.family.set_positions is not None:
                for part in self.model_parts:
                    self.family.set_positions(part, positions)
            # The batch mean over micro-batches, on every pp rank.
            loss = pipeline_step(
                self.schedule, self.pipeline_plan, self.mesh["pp"], batch.inputs, batch.targets
            )
            loss = loss * self.run.loss_divisor  # this rank's mean (the schedule's was scaled)
            # After the schedule's reduction and 1 / M scaling: the run plan's convention.
            self.run.finish_gradients(self.model_parts)
            if self.grad_callback is not None:
                self.grad_callback(self.step, self.model_parts)
            params = [p for m in self.model_parts for p in m.parameters()]
            grad_norm = clip_grad_norm_(params, max_norm, group=self.mesh["pp"].get_group())
        else:
            loss = self.accumulate(batch)
            if self.grad_callback is not None:
                self.grad_callback(self.step, self.model_parts)
            grad_norm = clip_grad_norm_(self.model.parameters(), max_norm)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return self.global_mean(loss), float(grad_norm)

    def _parts(self, items: list[Any]) -> Any:
        """One model (optimizer) at pp=1; the list of this rank's parts under pp > 1."""
        return items if self.schedule is not None else items[0]

    def local_batch(self) -> Batch:
        """This rank's part of the next global batch (advances the data stream).

        Rows are split over the ``batch`` axis (dp_replicate x dp_shard); ranks that
        differ only in model-parallel coordinates read the same rows.
        Under context parallelism each rank keeps chunks ``i`` and ``2 cp - 1 - i`` of
        every sequence (:func:`~hyper_parallel.distributed.context_parallel.shard_sequence`)
        for inputs and targets alike, and passes their global positions to the model.
        """
        inputs, targets = self.data.next_batch(self.dp_rank, self.dp_size)
        kwargs: dict[str, Any] = {}
        if self.cp_size > 1:
            from hyper_parallel.distributed import context_parallel

            seq_len = inputs.shape[1]
            inputs = context_parallel.shard_sequence(inputs, self.cp_rank, self.cp_size)
            targets = context_parallel.shard_sequence(targets, self.cp_rank, self.cp_size)
            positions = context_parallel.positions(seq_len, self.cp_rank, self.cp_size)
            kwargs["positions"] = positions.to(self.device)
        return Batch(
            inputs=inputs.to(self.device), targets=targets.to(self.device), model_kwargs=kwargs
        )

    def accumulate(self, batch: Batch) -> torch.Tensor:
        """Forward and backward of ``batch`` as the run plan's micro-batches (``pp=1``).

        Each micro-batch's mean loss is backpropagated as the run plan scales it
        (``1 / cp``); FSDP2 reduces no gradient but the last micro-batch's (HSDP's
        all-reduce included), which carries the sum of all of them — or, with
        ``reduce_each_microbatch``, each micro-batch's, accumulating the shards; the sum is then
        divided by the count, once, with the rest of the run plan's finishing
        (:meth:`~hyper_parallel.distributed.run_plan.RunPlan.finish_gradients`: cp
        partial sums, expert gradients). Equal micro-batches: the mean of their mean
        losses is the whole batch's, and so is the gradient.

        Returns:
            This rank's mean loss over the whole batch (detached).
        """
        steps = self.run.accumulation_steps
        total: torch.Tensor | None = None
        for i, micro in enumerate(batch.split(steps)):
            if steps > 1 and not self.cfg.reduce_each_microbatch:
                set_gradient_sync(self.model, i == steps - 1)
            # bf16: FSDP2's policy casts, or the builder's autocast where there is no FSDP2.
            logits = self.model(micro.inputs, **micro.model_kwargs)
            loss = self.loss_fn(loss_logits(logits), micro.targets)
            self.run.scale_loss(loss).backward()
            loss = loss.detach()
            total = loss if total is None else total + loss
        assert total is not None
        self.run.finish_gradients(self.model_parts, accumulated=steps)
        return total if steps == 1 else total / steps

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate this rank's mean ``loss`` so every gradient is the global-batch one.

        FSDP2 averages over the data ranks. The run plan's convention under ``cp`` and
        ``ep`` (:class:`~hyper_parallel.distributed.run_plan.RunPlan`): the loss is
        divided by ``cp`` and the cp ranks' gradients summed (FSDP2 divides by the
        data-parallel ranks only; gradients of states replicated over cp come back
        ``Partial`` and are reduced here, once), and expert gradients are rescaled.
        """
        self.run.scale_loss(loss).backward()
        self.run.finish_gradients(self.model_parts)

    def global_mean(self, loss: torch.Tensor) -> float:
        """The global-batch mean of this rank's mean ``loss``: averaged over the ``loss`` axis.

        A collective on the ``loss`` group: every rank calls it.
        """
        return self._global_mean(loss)

    def _global_mean(self, loss: torch.Tensor) -> float:
        value = loss.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if self.loss_size > 1:
            assert self.mesh is not None
            value = value.clone()
            dist.all_reduce(value, group=self.mesh["loss"].get_group())
            value = value / self.loss_size
        return float(value)

    def fit(self, until_step: int | None = None) -> TrainResult:
        """Train from the current step to ``until_step`` (default ``cfg.steps``).

        Saves a checkpoint every ``cfg.checkpoint_every`` steps and after the last step
        of the run (when ``cfg.checkpoint_dir`` is set); logs on rank 0.
        """
        cfg = self.cfg
        end = cfg.steps if until_step is None else min(until_step, cfg.steps)
        is_logger = self.rank == 0
        progress = _Progress(cfg.steps, self.step, cfg.progress and is_logger)
        if cfg.resume and not self.resumed_from and not self.report.started:
            self.report.notes.append(f"no checkpoint in {cfg.checkpoint_dir}; starting at step 0")
        self.report.start()
        steps, losses, grad_norms = [], [], []
        logger = run_hooks.StepLogger(
            cfg,
            self.device,
            self.rank,
            dist.get_world_size() if self.mesh is not None else 1,
            # A resumed run's steps replace those an earlier start logged past its
            # checkpoint; a run started over (--overwrite) replaces every earlier step.
            purge_step=self.step + 1 if cfg.resume or cfg.overwrite else None,
        )
        self.report.step_logger = logger
        t0 = time.perf_counter()
        while self.step < end:
            step_start = time.perf_counter()
            loss, grad_norm = self.train_step()
            logger.log(
                self.step, loss, cfg.lr_at(self.step - 1), grad_norm,
                time.perf_counter() - step_start,
            )  # fmt: skip
            steps.append(self.step)
            losses.append(loss)
            grad_norms.append(grad_norm)
            progress.update(self.step, loss)
            if is_logger and cfg.log_every and self.step % cfg.log_every == 0:
                tokens_per_second = (
                    cfg.batch_size * cfg.seq_len * len(steps) / (time.perf_counter() - t0)
                )
                self._log(loss, grad_norm, tokens_per_second, progress)
            every = cfg.checkpoint_every
            if cfg.checkpoint_dir is not None and (
                (every and self.step % every == 0) or self.step == end
            ):
                if cfg.async_checkpoint:
                    self.save_async()  # reported saved once written (wait_for_checkpoint)
                else:
                    saving = time.perf_counter()
                    path = self.save()
                    self.report.saved(path, time.perf_counter() - saving)
            self.report.after_step(loss)
            if self.step_callback is not None:
                self.step_callback(self.step, loss)
        self.wait_for_checkpoint()  # the last save is complete when fit returns
        progress.close()
        logger.close()
        if self.step == cfg.steps and cfg.save_hf:
            saving = time.perf_counter()
            run_hooks.save_weights(cfg, self.model_parts, self.hf)
            self.report.exported(cfg.save_hf, time.perf_counter() - saving)
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
        self.report.say(
            f"step {self.step:>5}/{self.cfg.steps} | loss {loss:.4f} | grad_norm "
            f"{grad_norm:.3f} | lr {self.cfg.lr_at(self.step - 1):.2e} | "
            f"{tokens_per_second:,.0f} tok/s"
        )


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


def train(
    cfg: TrainConfig,
    *,
    device: torch.device | str | None = None,
    step_callback: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Build a :class:`Trainer` for ``cfg`` and train to ``cfg.steps``.

    Under ``torchrun`` (or any initialized process group) call it on every rank with
    a mesh whose sizes multiply to the world size; in one process use ``mesh={}``.

    Example:
        >>> result = train(TrainConfig(steps=2, log_every=0))
        >>> len(result.losses)
        2
    """
    return Trainer(cfg, device=device, step_callback=step_callback).fit()
