"""One run plan: the trainer's gate, ``validate`` and ``plan`` report the same findings.

A table of runs over every axis, good and bad. For each bad run, the errors of the
trainer's gate (``check_config``), of ``hyper-parallel validate`` and of
``hyper-parallel plan`` (on the command line, as a user runs them) are the same set.
Each good run passes the trainer's gate, ``validate`` (static checks: the traced
forward is covered by the validate tests) and the gate ``plan`` and the dry run ask
(``RunPlan.for_subject`` on the sharded config, what ``dry_run`` builds); two good runs
go through the whole ``plan`` command. ``plan`` takes the micro-batch size as
``--batch`` (with and without pp), so a batch that does not split into micro-batches
cannot be said to it; those rows compare the trainer and ``validate`` only.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from hyper_parallel.analysis import validate
from hyper_parallel.cli import main
from hyper_parallel.distributed.layout import MeshLayout
from hyper_parallel.distributed.run_plan import PlanCache, RunPlan, default_num_microbatches
from hyper_parallel.train.trainer import TrainConfig, check_config

LLAMA, MOE = "llama3-debug", "qwen3-moe-debug"


@dataclasses.dataclass(frozen=True)
class Run:
    """One row: the model, the mesh and the switches; ``bad``: the fields of its errors."""

    model: str
    mesh: str
    sp: bool = False
    schedule: str = "1F1B"
    microbatches: int | None = None
    seq: int = 16
    batch: int = 8  # the global batch (sequences)
    bad: tuple[str, ...] = ()
    plan_can_say_it: bool = True

    @property
    def layout(self) -> MeshLayout:
        return MeshLayout.parse(self.mesh)

    @property
    def num_microbatches(self) -> int:
        pp = self.layout.pp
        return self.microbatches or default_num_microbatches(pp, self.schedule)

    def switches(self) -> list[str]:
        out = ["--model", self.model, "--mesh", self.mesh, "--seq", str(self.seq)]
        out += ["--schedule", self.schedule, "--format", "json"]
        if self.sp:
            out.append("--sp")
        if self.microbatches is not None:
            out += ["--microbatches", str(self.microbatches)]
        return out

    def __str__(self) -> str:
        extra = " sp" if self.sp else ""
        if self.layout.pp > 1:
            extra += f" {self.schedule} M={self.microbatches}"
        elif self.microbatches is not None:
            extra += f" M={self.microbatches}"
        return f"{self.model}:{self.mesh}{extra}:seq{self.seq}:b{self.batch}"


RUNS = [
    # good: every axis, alone and together
    Run(LLAMA, "dp_shard=2"),
    Run(LLAMA, "dp_shard=2,tp=2"),
    Run(LLAMA, "tp=2", sp=True),
    Run(LLAMA, "dp_replicate=2,dp_shard=2"),
    Run(LLAMA, "cp=2"),
    Run(LLAMA, "dp_shard=2,cp=2,tp=2"),
    Run(LLAMA, "pp=2"),
    Run(LLAMA, "pp=2,dp_shard=2", schedule="GPipe", microbatches=2),
    Run(LLAMA, "pp=2,tp=2", schedule="Interleaved1F1B"),
    Run(LLAMA, "pp=2,cp=2"),
    Run(MOE, "dp_shard=2,ep=2"),
    Run(MOE, "pp=2,dp_shard=2,ep=2"),
    Run(MOE, "dp_shard=2,tp=2,ep=2"),
    Run(MOE, "cp=2,ep=2"),
    Run(LLAMA, "dp_shard=2,tp=2", microbatches=4),  # gradient accumulation at pp=1
    # bad: each refused by the run plan, with the same findings everywhere
    Run(LLAMA, "tp=3", bad=("llama3-debug",)),
    Run(LLAMA, "cp=2", seq=14, bad=("seq_len",)),
    Run(LLAMA, "pp=2", microbatches=1, bad=("num_microbatches",)),
    Run(LLAMA, "pp=2", schedule="1f1b", bad=("schedule",)),
    Run(LLAMA, "pp=4", schedule="Interleaved1F1B", bad=("split",)),
    Run(LLAMA, "dp_shard=2,ep=2", bad=("llama3-debug",)),
    Run(MOE, "pp=2,dp_shard=2,ep=2", schedule="ZBVZeroBubble", bad=("ep",)),
    Run(MOE, "tp=4,ep=2", bad=("ep",)),
    Run(MOE, "dp_shard=6,ep=3", batch=6, bad=("ep",)),
    Run(MOE, "dp_shard=2,cp=2,tp=2", seq=12, batch=4),  # each cp part (6) splits over tp
    Run(LLAMA, "pp=2", microbatches=4, batch=6, bad=("num_microbatches",), plan_can_say_it=False),
    Run(LLAMA, "dp_shard=2", microbatches=3, bad=("num_microbatches",), plan_can_say_it=False),
]


def _trainer(run: Run) -> set[str]:
    cfg = TrainConfig(
        model=run.model,
        mesh=run.layout.active(),
        sp=run.sp,
        schedule=run.schedule,
        microbatches=run.microbatches,
        seq_len=run.seq,
        batch_size=run.batch,
    )
    return {str(f) for f in check_config(cfg)}


def _validate(run: Run, capsys: pytest.CaptureFixture[str]) -> set[str]:
    per_rank = run.batch // run.layout.size("batch")
    code = main(["validate", *run.switches(), "--batch", str(per_rank)])
    out = json.loads(capsys.readouterr().out)
    errors = {_text(f) for f in out["findings"] if f["severity"] == "error"}
    assert code == (1 if errors else 0)
    return errors


def _plan(run: Run, capsys: pytest.CaptureFixture[str]) -> set[str]:
    per_rank = run.batch // run.layout.size("batch")
    microbatch = per_rank // run.num_microbatches  # with and without pp
    code = main(["plan", *run.switches(), "--batch", str(microbatch)])
    captured = capsys.readouterr()
    if code == 0:
        json.loads(captured.out)  # a report
        return set()
    assert code == 1, captured.err
    # "hyper-parallel plan: error: N problem(s):" then one finding per line.
    return {line.strip() for line in captured.err.splitlines()[1:] if line.startswith("  ")}


def _text(f: dict[str, str]) -> str:
    where = f["path"] or "<root>"
    field = f" {f['field']}:" if f["field"] else ""
    return f"{where}:{field} {f['message']} Fix: {f['fix']}"


def test_the_table_covers_every_axis_good_and_bad() -> None:
    assert len(RUNS) >= 20
    for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"):
        assert any(r.layout.size(axis) > 1 and not r.bad for r in RUNS), axis
        assert any(r.layout.size(axis) > 1 and r.bad for r in RUNS) or axis in ("dp_replicate",), (
            axis
        )


@pytest.mark.parametrize("run", [r for r in RUNS if r.bad], ids=str)
def test_bad_runs_get_the_same_findings_from_trainer_validate_and_plan(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = _trainer(run)
    assert trainer
    for field in run.bad:
        assert any(f" {field}:" in t or f"{field}=" in t for t in trainer), (field, trainer)
    assert _validate(run, capsys) == trainer
    if run.plan_can_say_it:
        assert _plan(run, capsys) == trainer


@pytest.mark.parametrize(
    "run", [Run(MOE, "tp=2,ep=2", seq=15), Run(MOE, "cp=2,tp=4", seq=20)], ids=str
)
def test_a_sequence_the_moe_cannot_split_over_tp_is_refused_by_every_gate(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    # The MoE routes each tp rank's slice of the sequence (of its cp part): seq 15 at tp=2
    # was accepted and failed on every rank at the first residual add (torch: "Attempting
    # to broadcast a dimension of length 16"). validate says the same one thing: its trace
    # of that sequence failed too and added an error blaming layers.0's placements.
    trainer = _trainer(run)
    unit = run.layout.cp * run.layout.tp
    assert len(trainer) == 1 and "switches: seq_len:" in next(iter(trainer)), trainer
    assert f"seq_len must be a multiple of {'tp=2' if unit == 2 else 'cp x tp = 8'}" in str(trainer)
    # The fix names a tp for each cp rank's part (at cp=2, tp=4 "divides 20" was tp=4 itself).
    other_tp = "divides 15" if unit == 2 else "divides the 10 tokens of each cp rank"
    assert f"or use a tp that {other_tp}." in str(trainer), trainer
    assert _plan(run, capsys) == trainer
    assert _validate(run, capsys) == trainer


@pytest.mark.parametrize("run", [r for r in RUNS if not r.bad], ids=str)
def test_good_runs_pass_every_gate(run: Run) -> None:
    assert _trainer(run) == set()
    # The sharded config the commands analyse, and the gate validate and the dry run ask.
    ran = RunPlan.for_model(
        run.model, run.layout, sequence_parallel=run.sp, schedule=run.schedule, seq_len=run.seq
    )
    assert ran.ok and ran.subject is not None
    per_rank = run.batch // run.layout.size("batch")
    report = validate(
        ran.subject,
        run.layout,
        trace=False,
        schedule=run.schedule,
        num_microbatches=run.microbatches,
        batch_size=per_rank,
        seq_len=run.seq,
    )
    assert report.errors == []
    subject = RunPlan.for_subject(
        ran.subject, run.layout, name=run.model, seq_len=run.seq, schedule=run.schedule
    )
    assert subject.ok and subject.plan_axes == ran.plan_axes
    assert subject.num_microbatches == ran.num_microbatches


@pytest.mark.parametrize("mesh", ["dp_shard=2,ep=2"])
def test_plan_runs_what_the_gates_accept(mesh: str, capsys: pytest.CaptureFixture[str]) -> None:
    model = MOE if "ep" in mesh else LLAMA
    assert _plan(Run(model, mesh), capsys) == set()


def test_a_shared_plan_cache_changes_no_finding() -> None:
    """One PlanCache across every row (as a search shares it), each row asked twice:
    the findings and the pipeline plan are those of an uncached call, and the cache
    built each model structure once."""
    cache = PlanCache()
    for run in RUNS + RUNS:
        kwargs = dict(
            sequence_parallel=run.sp,
            schedule=run.schedule,
            num_microbatches=run.microbatches,
            batch_size=run.batch // run.layout.size("batch"),
            seq_len=run.seq,
        )
        cached = RunPlan.for_model(run.model, run.layout, cache=cache, **kwargs)
        plain = RunPlan.for_model(run.model, run.layout, **kwargs)
        assert cached.findings == plain.findings, run
        assert cached.pipeline == plain.pipeline and cached.plan_axes == plain.plan_axes, run
        assert {f.field for f in cached.errors} >= set(run.bad), run
    structures = {(r.model, r.layout.tp, r.layout.cp, r.layout.ep, r.sp) for r in RUNS}
    assert len(cache.structures) == len(structures)


def test_the_micro_batch_default_is_one_rule() -> None:
    # The trainer, validate, plan and the cost model take the run plan's count.
    for mesh, schedule, expected in (
        ("pp=2", "1F1B", 2),
        ("pp=4", "GPipe", 4),
        ("pp=2", "Interleaved1F1B", 4),
        ("pp=2", "ZBVZeroBubble", 4),
        ("dp_shard=2", "1F1B", 1),
    ):
        layout = MeshLayout.parse(mesh)
        cfg = TrainConfig(mesh=layout.active(), schedule=schedule)
        assert cfg.resolved_microbatches == expected
        if layout.pp > 1:
            run = RunPlan.for_model(LLAMA, layout, schedule=schedule, batch_size=4)
            assert run.num_microbatches == expected
            assert run.pipeline is not None and run.pipeline.num_microbatches == expected


def test_the_cp_and_ep_gradient_convention_is_decided_once() -> None:
    cp = RunPlan.for_model(LLAMA, MeshLayout.parse("dp_replicate=2,dp_shard=2,cp=2"))
    assert cp.loss_divisor == 2 and cp.gradient_divide_factor == 4.0
    plain = RunPlan.for_model(LLAMA, MeshLayout.parse("dp_shard=2,tp=2"))
    assert plain.loss_divisor == 1 and plain.gradient_divide_factor is None


UNUSED = (
    # (mesh, switches, the fields warned of): switches this run would not use.
    ("dp_shard=2", {"schedule": "GPipe"}, ["schedule"]),
    ("dp_shard=2", {"stages_per_rank": 2, "pipeline_split": {"units_per_stage": 2}},
     ["stages_per_rank", "pipeline_split"]),
    ("pp=2,dp_shard=2", {"reduce_each_microbatch": True}, ["reduce_each_microbatch"]),
    ("dp_shard=2", {"reduce_each_microbatch": True}, ["reduce_each_microbatch"]),
    ("tp=2", {"reduce_each_microbatch": True, "num_microbatches": 2}, ["reduce_each_microbatch"]),
    # Where they mean something: nothing to say.
    ("pp=2,dp_shard=2", {"schedule": "GPipe", "stages_per_rank": 1}, []),
    ("dp_shard=2", {"reduce_each_microbatch": True, "num_microbatches": 2}, []),
    ("dp_replicate=2,cp=2", {"reduce_each_microbatch": True, "num_microbatches": 2}, []),
    ("dp_shard=2", {"schedule": "1F1B"}, []),
)  # fmt: skip


@pytest.mark.parametrize(("mesh", "switches", "fields"), UNUSED)
def test_a_switch_the_run_does_not_use_is_a_warning_every_gate_gives(
    mesh: str, switches: dict, fields: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A flag means one thing: where the run would not use it, the run plan says so (a
    warning: the run starts) — the trainer's start summary and ``validate`` alike."""
    layout = MeshLayout.parse(mesh)
    run = RunPlan.for_model(LLAMA, layout, batch_size=4, **switches)
    assert run.ok
    assert [f.field for f in run.findings if f.severity == "warning"] == fields
    argv = ["validate", "--model", LLAMA, "--mesh", mesh, "--batch", "4", "--format", "json"]
    flags = {"schedule": "--schedule", "stages_per_rank": "--stages-per-rank",
             "num_microbatches": "--microbatches"}  # fmt: skip
    for key, value in switches.items():
        if key == "reduce_each_microbatch":
            argv.append("--reduce-each-microbatch")
        elif key == "pipeline_split":
            argv += ["--pipeline-split", json.dumps(value)]
        else:
            argv += [flags[key], str(value)]
    assert main(argv) == 0
    reported = json.loads(capsys.readouterr().out)["findings"]
    warned = [
        f["field"] for f in reported if f["severity"] == "warning" and f["path"] == "switches"
    ]
    assert warned == fields


@pytest.mark.parametrize(
    ("mesh", "seq", "fix"),
    [
        ("tp=2", 31, "to a multiple of tp=2 (e.g. 30 or 32), or drop --sp."),
        ("tp=4", 30, "to a multiple of tp=4 (e.g. 28 or 32), or use tp among [2, 3, 5, 6, 10, 15]"),
        ("", 32, "add a tp axis of size 2 or 4 or 8, or drop --sp."),
        ("", 31, "add a tp axis (e.g. tp=2) and set the sequence length"),
        ("cp=2,tp=2", 31, "to a multiple of cp x lcm(2, tp) = 4 (e.g. 28 or 32)"),
    ],
)
def test_the_sequence_parallel_fix_is_true_of_the_run(mesh: str, seq: int, fix: str) -> None:
    """It said 'set a tp axis dividing seq_len (e.g. tp=2)' where tp=2 was set and did
    not divide the sequence."""
    from hyper_parallel.distributed.run_checks import switch_findings

    layout = MeshLayout.parse(mesh)
    (f,) = switch_findings(layout, sequence_parallel=True, seq_len=seq)
    assert fix in f.fix, f.fix
    lengths = f.fix.split("(e.g. ")[1].split(")")[0].split(" or ") if "(e.g. " in f.fix else []
    if layout.tp > 1:
        for n in map(int, lengths):
            assert switch_findings(layout, sequence_parallel=True, seq_len=n) == []
            assert n % (2 * layout.cp) == 0  # the cp split takes it too
    if "tp among" in f.fix:
        for tp in json.loads(f.fix.split("tp among ")[1].split("]")[0] + "]"):
            other = dataclasses.replace(layout, tp=tp)
            assert switch_findings(other, sequence_parallel=True, seq_len=seq) == []
    if "tp axis of size" in f.fix:
        for tp in map(int, f.fix.split("of size ")[1].split(",")[0].split(" or ")):
            other = dataclasses.replace(layout, tp=tp)
            assert switch_findings(other, sequence_parallel=True, seq_len=seq) == []


def test_the_sequence_parallel_fix_offers_only_tp_sizes_the_model_takes() -> None:
    """llama3-debug (8 query heads), tp=2 --sp at 63 tokens: the fix offered 'tp among
    [3, 7, 9]', which the model then refused (8 heads cannot be split over 3)."""
    from hyper_parallel.distributed.run_checks import switch_findings

    layout = MeshLayout.parse("tp=2")
    (f,) = switch_findings(layout, sequence_parallel=True, seq_len=63, heads=8)
    assert "tp among" not in f.fix and "use tp=" not in f.fix and "drop --sp" in f.fix
    (f,) = switch_findings(layout, sequence_parallel=True, seq_len=63, heads=21)
    offered = json.loads(f.fix.split("tp among ")[1].split("]")[0] + "]")
    assert offered == [3, 7], offered  # 9 divides 63, not 21
    # Through the run plan, which reads the model's heads.
    plan = RunPlan.for_model("llama3-debug", layout, sequence_parallel=True, seq_len=63)
    (sp,) = [f for f in plan.findings if f.severity == "error" and f.field == "sp"]
    assert "tp among" not in sp.fix and "use tp=" not in sp.fix
