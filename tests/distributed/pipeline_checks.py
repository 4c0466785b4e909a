"""Rank-side checks of pipeline parallelism against one device.

Module-level functions run on every rank through ``dist.run`` by ``test_pipeline.py``
(2 ranks) and ``test_pipeline_4.py`` (4 ranks).
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as c10d

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.distributed import context_parallel, precision
from hyper_parallel.distributed.builder import build_stages
from hyper_parallel.distributed.expert_parallel import rescale_expert_grads
from hyper_parallel.distributed.fsdp import fsdp_mesh_for
from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.distributed.pipeline import (
    build_schedule,
    init_states_by_unit,
    pipeline_step,
)
from hyper_parallel.distributed.run_plan import RunPlan
from hyper_parallel.dmodule import get_spec
from hyper_parallel.models.llama import (
    apply_tp,
    cross_entropy_loss,
    preset_config,
)
from tests._compare import diff, diffs, worst_abs

BATCH = 8
SEQ_LEN = 16
LR = 1e-2


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, 256, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(step)
    )
    return tokens[:, :-1], tokens[:, 1:]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _setup(
    mesh_text: str,
    schedule: str,
    num_microbatches: int,
    split: dict | None,
    overrides: dict,
    sequence_parallel: bool = False,
    switches: dict | None = None,
    model: str = "llama3-debug",
):
    """This rank's stages built as the trainer builds them: the run plan of ``model`` at
    ``mesh_text`` (its meshes, experts' FSDP2 unit, compile, AC, dtype) through the builder.

    ``switches``: ``compile_backend`` (compile on, with that backend), ``ac``, ``dtype``.
    """
    layout = MeshLayout.parse(mesh_text)
    mesh = layout.build("cpu")
    switches = dict(switches or {})
    if "compile_backend" in switches:
        switches["compile"] = True
    run = RunPlan.for_model(
        model,
        layout,
        model_overrides=overrides,
        world_size=layout.world_size,
        sequence_parallel=sequence_parallel,
        schedule=schedule,
        num_microbatches=num_microbatches,
        pipeline_split=split,
        batch_size=BATCH // layout.size("batch"),
        seq_len=SEQ_LEN,
        **switches,
    )
    modules = build_stages(run, mesh, "cpu", seed=0)
    plan = run.pipeline
    config = get_spec(model).config(**overrides)
    # The trainer's loss convention: each rank's loss scaled by the run plan (1 / cp; the
    # cp ranks' gradients are summed), unscaled again in train_vs_one_device.
    sched = build_schedule(
        modules, plan, mesh["pp"], "cpu", lambda *a: run.scale_loss(cross_entropy_loss(*a))
    )
    return layout, mesh, config, plan, modules, sched


def _router_aux_grads(model: Any, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Per router, how much the balance loss adds to its gradient (one device, this batch).

    The largest difference between the router gradients with and without the balance
    loss: what a pipeline that dropped a stage's balance-loss gradient would miss.
    """
    grads = []
    coefs = {m: m.aux_loss_coef for m in model.modules() if hasattr(m, "aux_loss_coef")}
    for scale in (1.0, 0.0):
        for m, coef in coefs.items():
            m.aux_loss_coef = coef * scale
        model.zero_grad()
        cross_entropy_loss(model(inputs), targets).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "router" in n})
    for m, coef in coefs.items():
        m.aux_loss_coef = coef
    model.zero_grad()
    return {n: (g - grads[1][n]).abs().max().item() for n, g in grads[0].items()}


def _local_batch(layout: MeshLayout, mesh: Any, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = _batch(step)
    num = layout.dp_replicate * layout.dp_shard
    if num > 1:
        size = BATCH // num
        rank = mesh["batch"].get_local_rank()
        inputs, targets = (t[rank * size : (rank + 1) * size] for t in (inputs, targets))
    return inputs, targets


def train_vs_one_device(
    mesh_text: str,
    schedule: str,
    num_microbatches: int,
    num_steps: int,
    split: dict | None = None,
    overrides: dict | None = None,
    sequence_parallel: bool = False,
    switches: dict | None = None,
    model: str = "llama3-debug",
) -> dict[str, Any]:
    """Train ``num_steps`` AdamW steps pipelined and on one device; compare losses and grads.

    The stages are the trainer's (the run plan through the builder, :func:`_setup`).
    ``switches`` (``compile_backend``, ``ac``, ``dtype``) go to the run plan; the one
    device reference runs eagerly without checkpointing, in the same precision
    (bf16 autocast from fp32 weights, as the trainer's one-process run), on the
    whole batch at once; under bf16 the first step's gradients are also compared
    with the fp32 one-device ones (``fp32_grad_diffs``). With ``ep`` the expert
    gradients are brought to the dense convention after the schedule's step
    (``rescale_expert_grads``, as the trainer does); for a mixture of experts the result also carries, per router, what the
    balance loss adds to its gradient on one device (``router_aux``).

    Returns:
        Per-step losses of both, the largest init difference, and the largest
        gradient difference of every parameter this rank holds after step 1.
    """
    overrides = overrides or {}
    layout, mesh, config, plan, modules, sched = _setup(
        mesh_text, schedule, num_microbatches, split, overrides, sequence_parallel, switches, model
    )
    dtype = (switches or {}).get("dtype", "fp32")
    reference = config.build()
    init_states_by_unit(reference, get_spec(model).pipeline(), 0)
    router_aux = _router_aux_grads(reference, *_batch(0)) if layout.ep > 1 else {}
    ref_params = dict(reference.named_parameters())
    params = {n: p for m in modules for n, p in m.named_parameters()}
    fp32_grads: dict[str, torch.Tensor] = {}
    if dtype != "fp32":  # the first step's gradients in fp32 on one device, on a copy
        fp32_reference = copy.deepcopy(reference)
        full_inputs, full_targets = _batch(0)
        cross_entropy_loss(fp32_reference(full_inputs), full_targets).backward()
        fp32_grads = {n: p.grad for n, p in fp32_reference.named_parameters()}
    init_diff = worst_abs(
        [(_full(p).detach() - ref_params[n]).abs().max().item() for n, p in params.items()]
    )

    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    losses, ref_losses, grad_diffs, grad_scales, fp32_grad_diffs = [], [], {}, {}, {}
    # The dtype every linear layer of the stages computes in.
    linear_dtypes: set[str] = set()
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, torch.nn.Linear):
                sub.register_forward_hook(lambda _m, _a, out: linear_dtypes.add(str(out.dtype)))
    for step in range(num_steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        inputs, targets = _local_batch(layout, mesh, step)
        if layout.cp > 1:  # this rank's head-tail part of each sequence, held by each stage
            cp_rank = mesh["cp"].get_local_rank()
            inputs, targets = (
                context_parallel.shard_sequence(t, cp_rank, layout.cp) for t in (inputs, targets)
            )
            for m in modules:
                m.set_positions(context_parallel.positions(SEQ_LEN, cp_rank, layout.cp))
        # This rank's mean loss (the schedule's was scaled by 1 / cp, as the trainer's).
        loss = pipeline_step(sched, plan, mesh["pp"], inputs, targets) * layout.cp
        if layout.ep > 1:
            for m in modules:
                rescale_expert_grads(m, layout)
        if layout.dp_replicate * layout.dp_shard > 1:
            c10d.all_reduce(loss, op=c10d.ReduceOp.AVG, group=mesh["batch"].get_group())
        if layout.cp > 1:  # each cp rank's mean over its tokens (equal counts)
            c10d.all_reduce(loss, op=c10d.ReduceOp.AVG, group=mesh["cp"].get_group())
        losses.append(loss.item())
        full_inputs, full_targets = _batch(step)
        # The one-process run's precision: bf16 autocast from fp32 weights.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = reference(full_inputs)
        ref_loss = cross_entropy_loss(precision.loss_logits(logits), full_targets)
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        if step == 0:
            grad_diffs = {n: diff(p.grad, ref_params[n].grad) for n, p in params.items()}
            fp32_grad_diffs = (
                {n: diff(p.grad, fp32_grads[n]) for n, p in params.items()} if fp32_grads else {}
            )
            grad_scales = {n: ref_params[n].grad.abs().max().item() for n in params}
        opt.step()
        ref_opt.step()
    return {
        "stages": plan.stages_of_rank(mesh["pp"].get_local_rank()),
        "placements": {
            n: [str(x) for x in p.placements] if isinstance(p, DTensor) else []
            for n, p in params.items()
        },
        "losses": losses,
        "ref_losses": ref_losses,
        "init_diff": init_diff,
        "grad_diffs": grad_diffs,
        "fp32_grad_diffs": fp32_grad_diffs,
        "grad_scales": grad_scales,
        "linear_dtypes": sorted(linear_dtypes),
        "router_aux": router_aux,
    }


def run_back_to_back(
    mesh_text: str, schedule: str, num_microbatches: int, num_steps: int, overrides: dict
) -> dict[str, Any]:
    """Run ``num_steps`` schedule steps back to back (no optimizer); report time and losses."""
    layout, mesh, _, plan, _, sched = _setup(mesh_text, schedule, num_microbatches, None, overrides)
    t0 = time.perf_counter()
    losses = []
    for step in range(num_steps):
        inputs, targets = _local_batch(layout, mesh, step % 3)
        losses.append(pipeline_step(sched, plan, mesh["pp"], inputs, targets).item())
    return {"seconds": time.perf_counter() - t0, "losses": losses}


def _stage_modules(mesh_text: str, schedule: str) -> tuple[Any, list[Any]]:
    """This rank's stages at ``mesh_text`` through the builder, placed by the plan only
    (no FSDP2), initialized under seed 1."""
    layout = MeshLayout.parse(mesh_text)
    run = RunPlan.for_model(
        "llama3-debug", layout, schedule=schedule, num_microbatches=4, fsdp=False
    )
    mesh = layout.build("cpu")
    return (mesh, run.pipeline), build_stages(run, mesh, "cpu", seed=1)


def _full_states(modules: list[Any], optimizers: list[Any]) -> dict[str, torch.Tensor]:
    out = {}
    for module, opt in zip(modules, optimizers, strict=True):
        for name, p in module.named_parameters():
            out[name] = _full(p).detach().clone()
            if p in opt.state:
                out[name + ":exp_avg"] = _full(opt.state[p]["exp_avg"]).clone()
    return out


def checkpoint_across_meshes(path: str) -> dict[str, Any]:
    """Save at pp=2 x tp=2 (1F1B) after 2 steps; load at pp=2 x tp=2 with 4 stages,
    at pp=1 x tp=4 and into one process. Returns the largest differences."""
    from hyper_parallel.train.checkpoint import load_checkpoint, save_checkpoint

    (mesh, plan), modules = _stage_modules("pp=2,tp=2", "1F1B")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in modules]
    sched = build_schedule(modules, plan, mesh["pp"], "cpu", cross_entropy_loss)
    for step in range(2):
        for opt in optimizers:
            opt.zero_grad()
        pipeline_step(sched, plan, mesh["pp"], *_batch(step))
        for opt in optimizers:
            opt.step()
    save_checkpoint(path, model=modules, optimizer=optimizers, train_state={"step": 2})
    saved = _full_states(modules, optimizers)
    # Every rank learns every saved value, to compare with any layout.
    gathered: list[dict[str, torch.Tensor]] = [{} for _ in range(c10d.get_world_size())]
    c10d.all_gather_object(gathered, saved)
    reference = {k: v for part in gathered for k, v in part.items()}

    def state_diff(states: dict[str, torch.Tensor]) -> float:
        return worst_abs([(states[k] - reference[k]).abs().max().item() for k in states])

    result: dict[str, Any] = {"num_saved": len(reference)}
    # pp=2 x tp=2, interleaved: 4 stages, another split of the same names.
    (_, _), other = _stage_modules("pp=2,tp=2", "Interleaved1F1B")
    other_opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in other]
    result["train_state"] = load_checkpoint(path, model=other, optimizer=other_opts)
    states = _full_states(other, other_opts)
    result["interleaved"] = (state_diff(states), len(states))
    # pp=1 x tp=4: the whole model, tensor parallel on 4 ranks.
    tp_mesh = MeshLayout.parse("tp=4").build("cpu")["tp"]
    with torch.device("meta"):
        whole = apply_tp(preset_config("llama3-debug"), tp_size=4).build()
    whole.parallelize(tp_mesh)
    whole.to_empty(device="cpu")
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=LR)
    load_checkpoint(path, model=whole, optimizer=whole_opt)
    states = _full_states([whole], [whole_opt])
    result["tp4"] = (state_diff(states), len(states))
    # One process, no process group.
    if c10d.get_rank() == 0:
        single = preset_config("llama3-debug").build()
        load_checkpoint(path, model=single, distributed=False)
        states = {n: p.detach() for n, p in single.named_parameters()}
        result["one_process"] = (state_diff(states), len(states))
    c10d.barrier()
    return result


def trainer_parity(
    mesh: dict,
    schedule: str,
    num_microbatches: int,
    switches: dict | None = None,
    model: str = "llama3-debug",
) -> dict[str, Any]:
    """The trainer at ``mesh`` (with pp) and in one process: losses and first-step gradients.

    ``switches`` (``dtype``, ``ac``) apply to both runs, as the demo runs them. Every
    parameter's first-step gradient (whole, gathered over every rank, before clipping)
    is compared with the one-process run's (``grad_diffs``) and, under bf16, also with
    the fp32 one-process run's (``fp32_grad_diffs``, one step of it).
    """
    from hyper_parallel.train import TrainConfig, Trainer
    from hyper_parallel.train.run import full_gradients

    def keep_first(into: dict[str, torch.Tensor], pp: int) -> Any:
        def keep(step: int, parts: list[torch.nn.Module]) -> None:
            if step == 0:
                into.update(full_gradients(parts, pp))

        return keep

    cfg = TrainConfig(
        model=model,
        mesh=mesh,
        schedule=schedule,
        microbatches=num_microbatches,
        steps=3,
        seq_len=16,
        log_every=0,
        progress=False,
        **(switches or {}),
    )
    grads: dict[str, torch.Tensor] = {}
    trainer = Trainer(cfg, device="cpu", grad_callback=keep_first(grads, mesh.get("pp", 1)))
    linear_dtypes: set[str] = set()
    for part in trainer.model_parts:
        for sub in part.modules():
            if isinstance(sub, torch.nn.Linear):
                sub.register_forward_hook(lambda _m, _a, out: linear_dtypes.add(str(out.dtype)))
    result = trainer.fit()
    ref_grads: dict[str, torch.Tensor] = {}
    one = cfg.replace(mesh={})
    ref_trainer = Trainer(one, device="cpu", grad_callback=keep_first(ref_grads, 1))
    reference = ref_trainer.fit()
    fp32_grad_diffs = None
    if cfg.dtype != "fp32":
        fp32_grads: dict[str, torch.Tensor] = {}
        fp32 = one.replace(dtype="fp32", ac="none")
        Trainer(fp32, device="cpu", grad_callback=keep_first(fp32_grads, 1)).train_step()
        fp32_grad_diffs = diffs(grads, fp32_grads)
    return {
        "losses": result.losses,
        "ref_losses": reference.losses,
        "grad_norms": result.grad_norms,
        "ref_grad_norms": reference.grad_norms,
        "grad_diffs": diffs(grads, ref_grads),
        "fp32_grad_diffs": fp32_grad_diffs,
        "num_params": sum(1 for m in ref_trainer.model_parts for _ in m.named_parameters()),
        "parts": [sorted(n for n, _ in m.named_parameters())[:1] for m in trainer.model_parts],
        "linear_dtypes": sorted(linear_dtypes),
    }


def fsdp_collectives_per_step(schedules: list[str]) -> dict[str, dict[str, int]]:
    """FSDP2 all-gathers and gradient reductions of one pipeline step, counted per schedule.

    Counts the calls of FSDP2's own ``foreach_all_gather`` / ``foreach_reduce`` (one
    per FSDP unit gathered or reduced) during the second step (the first infers the
    stages' shapes), at pp=2 x dp_shard=2 with 4 micro-batches.
    """
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    counts = {"all_gather": 0, "reduce_scatter": 0}

    def counted(fn: Any, key: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return fn(*args, **kwargs)

        return call

    gather, reduce = param_group.foreach_all_gather, param_group.foreach_reduce
    param_group.foreach_all_gather = counted(gather, "all_gather")
    param_group.foreach_reduce = counted(reduce, "reduce_scatter")
    out = {}
    try:
        for schedule in schedules:
            layout, mesh, _, plan, _, sched = _setup("pp=2,dp_shard=2", schedule, 4, None, {})
            inputs, targets = _local_batch(layout, mesh, 0)
            pipeline_step(sched, plan, mesh["pp"], inputs, targets)
            counts.update(all_gather=0, reduce_scatter=0)
            pipeline_step(sched, plan, mesh["pp"], inputs, targets)
            out[schedule] = dict(counts, pp_rank=mesh["pp"].get_local_rank())
    finally:
        param_group.foreach_all_gather, param_group.foreach_reduce = gather, reduce
    return out


def cp_stage_collectives_per_step(schedule: str, num_microbatches: int) -> dict[str, Any]:
    """Collectives of one pipeline step at pp=2 x cp=2, recorded per kind and axis on gloo.

    The second step is recorded (the first infers the stages' shapes) by the dry run's
    recorder, a dispatch mode over the real process groups, naming each group's mesh
    axis; the loss's broadcast over pp (not a stage's) is outside it.
    """
    from hyper_parallel.analysis.collectives import CollectiveRecorder, axis_groups
    from hyper_parallel.analysis.dry_run._trace import _fsdp_group_names

    layout, mesh, _, plan, modules, sched = _setup(
        "pp=2,cp=2", schedule, num_microbatches, None, {}
    )
    cp_rank, pp_rank = mesh["cp"].get_local_rank(), mesh["pp"].get_local_rank()
    inputs, targets = (
        context_parallel.shard_sequence(t, cp_rank, layout.cp)
        for t in _local_batch(layout, mesh, 0)
    )
    for m in modules:
        m.set_positions(context_parallel.positions(SEQ_LEN, cp_rank, layout.cp))
    pipeline_step(sched, plan, mesh["pp"], inputs, targets)
    # Every group over this rank's cp ranks (DTensor may reuse an equal mesh, and its
    # groups, built by an earlier test of the module): FSDP2's collectives on them are
    # told from the model's by who issued them.
    from torch.distributed.distributed_c10d import _world

    cp_ranks = sorted(c10d.get_process_group_ranks(mesh["cp"].get_group()))
    same = {
        pg.group_name
        for pg in list(_world.pg_map)
        if sorted(c10d.get_process_group_ranks(pg)) == cp_ranks
    }
    groups = {**axis_groups(mesh), **dict.fromkeys(same, "cp")}
    fsdp = {**_fsdp_group_names(fsdp_mesh_for(mesh, ("cp",))), **dict.fromkeys(same, "fsdp")}
    recorder = CollectiveRecorder(groups, fsdp)
    args = (inputs,) if pp_rank == 0 else ()
    kwargs = {"target": targets, "losses": []} if pp_rank == 1 else {}
    with recorder:
        sched.step(*args, **kwargs)
    counts: dict[str, int] = {}
    for c in recorder.records:
        key = f"{c.kind}/{c.axis}"
        counts[key] = counts.get(key, 0) + 1
    return {"counts": counts, "pp_rank": pp_rank}
