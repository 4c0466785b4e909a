"""validate(): every problem of a model + plan + mesh shape, in one call, with its path.

Fake tier: the boundary analysis runs one forward pass on fake tensors over a fake
process group; no real process group is created.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.analysis import ValidationReport, validate
from hyper_parallel.analysis.collectives import redistribution_collectives
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.distributed import MeshLayout
from hyper_parallel.dmodule import ShardingConfig, colwise, get_spec, rowwise
from hyper_parallel.dmodule.presets import vocab_parallel_embedding

MESH = {"dp": 2, "tp": 4}
VOCAB, DIM, HIDDEN = 64, 32, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.act = nn.GELU()
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class Toy(nn.Module):
    """Embedding, three residual MLP blocks, a head of ``vocab`` outputs."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def good_plan() -> dict[str, ShardingConfig]:
    """Megatron TP with a plain residual stream (norms stay plain)."""
    return {
        "embed": vocab_parallel_embedding(use_local_output=True),
        "blocks.*.up": colwise(bias=False),
        "blocks.*.down": rowwise(use_local_output=True),
        "head": colwise(bias=False, output=Replicate(), use_local_output=True),
    }


def toy() -> nn.Module:
    with torch.device("meta"):
        return Toy(vocab=66)


def broken_plan() -> dict[str, ShardingConfig]:
    tp = "tp"
    return {
        # 1. a pattern that matches no module
        "blocks.*.mlp": colwise(bias=False),
        # 2. a state name that is not a parameter, and 7. 66 rows over tp=4 (uneven)
        "head": ShardingConfig(
            state_shardings={"weight": {tp: Shard(0)}, "wieght": {tp: Shard(0)}},
            in_dst_shardings={"input": {tp: Replicate()}},
            out_dst_shardings={tp: Replicate()},
            use_local_output=True,
        ),
        # 5. a Partial state
        "embed": ShardingConfig(state_shardings={"weight": {tp: Partial()}}),
        # 9. column shards reach a module that needs them replicated: implicit all-gather
        "blocks.0.up": colwise(bias=False),
        "blocks.0.down": ShardingConfig(
            state_shardings={"weight": {tp: Replicate()}},
            in_dst_shardings={"input": {tp: Replicate()}},
            use_local_output=True,
        ),
        # 4. Shard(2) of a 2-D weight
        "blocks.1.up": ShardingConfig(state_shardings={"weight": {tp: Shard(2)}}),
        # 6. an input name that is not an argument of GELU.forward(input)
        "blocks.1.act": ShardingConfig(in_dst_shardings={"x": {tp: Replicate()}}),
        # 3. an axis the mesh does not have (names are case-sensitive)
        "blocks.1.down": ShardingConfig(state_shardings={"weight": {"TP": Shard(1)}}),
        # 10. local column shards read back as replicated, then 11. a forward that fails
        "blocks.2.up": colwise(bias=False, use_local_output=True),
        "blocks.2.act": ShardingConfig(in_src_shardings={"input": {tp: Replicate()}}),
        "blocks.2.down": rowwise(use_local_output=True),
        # 8. blocks.*.norm: no config covers their parameters
    }


PLANTED = [
    # (severity, path, field contains, message contains)
    ("error", "blocks.*.mlp", "plan", "matches no module"),
    ("error", "head", "state_shardings['wieght']", "not a parameter or buffer"),
    ("error", "blocks.1.down", "state_shardings['weight']", "not in mesh"),
    ("error", "blocks.1.up", "state_shardings['weight']", "out of range"),
    ("error", "embed", "state_shardings['weight']", "cannot be Partial"),
    ("error", "blocks.1.act", "in_dst_shardings['x']", "not an argument"),
    ("warning", "head", "state_shardings['weight']", "not divisible by 4"),
    ("warning", "blocks.0.norm", "", "covered by no sharding config"),
    ("warning", "blocks.1.norm", "", "covered by no sharding config"),
    ("warning", "blocks.2.norm", "", "covered by no sharding config"),
    ("warning", "blocks.0.down", "in_dst_shardings['input']", "all_gather on tp"),
    ("warning", "blocks.2.act", "in_src_shardings['input']", "misread"),
    ("error", "blocks.2.down", "forward", "fails once the plan is applied"),
]


@pytest.fixture(scope="module")
def broken_report() -> ValidationReport:
    return validate(toy(), MESH, broken_plan())


@pytest.mark.parametrize("planted", PLANTED, ids=[f"{p[1]}:{p[3]}" for p in PLANTED])
def test_broken_plan_reports_each_planted_fault(broken_report, planted):
    severity, path, field, text = planted
    hits = [
        f
        for f in broken_report.findings
        if f.severity == severity and f.path == path and field in f.field and text in f.message
    ]
    assert hits, f"missing {planted}; got:\n{broken_report.to_table(verbose=True)}"
    assert all(f.fix for f in hits)


def test_broken_plan_every_problem_in_one_call(broken_report):
    assert not broken_report.ok
    assert broken_report.traced
    expected_errors = {(s, p) for s, p, *_ in PLANTED if s == "error"}
    assert {(f.severity, f.path) for f in broken_report.errors} == expected_errors
    # The implicit all-gather is listed with its cost: (batch, seq, hidden) fp32 gathered.
    (gather,) = [r for r in broken_report.redistributions if r.path == "blocks.0.down"]
    assert gather.source == "blocks.0.up" and not gather.declared
    # The plan declares only tp, so it is applied (and traced) on the tp submesh.
    assert gather.arrives == {"tp": "Shard(2)"}
    assert gather.needs == {"tp": "Replicate()"}
    seq_len = 2 * MESH["tp"] * 2  # the default: twice the non-data axes, at least 16
    assert gather.collectives == [
        {"kind": "all_gather", "axis": "tp", "bytes": seq_len * 4 * HIDDEN}
    ]


def test_broken_plan_report_forms(broken_report):
    d = broken_report.to_dict()
    assert (
        d["ok"] is False
        and d["mesh"]["dp_shard"] == 2
        and d["mesh"]["tp"] == 4
        and d["world_size"] == 8
    )
    assert d["num_errors"] == len(broken_report.errors)
    assert {"severity", "path", "field", "message", "fix"} <= set(d["findings"][0])
    text = broken_report.to_table()
    assert text.splitlines()[-1].startswith("FAILED: 7 error(s)")
    assert "blocks.*.norm (x3)" in text  # identical findings on every layer are folded


def test_good_plan_has_no_errors_and_no_implicit_redistribution():
    report = validate(toy(), MESH, good_plan())
    assert report.ok, report.to_table()
    assert report.traced
    assert not [r for r in report.redistributions if not r.declared]
    # The norms are the only parameters no config covers (the head's 66 rows are uneven).
    assert {f.path for f in report.warnings} == {
        "blocks.0.norm",
        "blocks.1.norm",
        "blocks.2.norm",
        "head",
    }


def test_a_weight_sharded_without_its_input_declared_gets_the_specific_fix():
    """The commonest first plan: a weight sharded, its input left a plain tensor (torch's
    ColwiseParallel converts it; a ShardingConfig declares it). The traced forward fails
    in DTensor; the fix names in_dst_shardings with the module's own argument name."""
    plan = dict(good_plan())
    plan["blocks.*.up"] = ShardingConfig(state_shardings={"weight": {"tp": Shard(0)}})
    report = validate(toy(), MESH, plan)
    (finding,) = [f for f in report.errors if f.field == "forward"]
    assert finding.path == "blocks.0.up" and "mixed torch.Tensor and DTensor" in finding.message
    assert finding.fix.startswith("say where this module's inputs are")
    assert "in_dst_shardings={'input': {'tp': Replicate()}}" in finding.fix
    # With it declared, the plan is good.
    plan["blocks.*.up"] = ShardingConfig(
        state_shardings={"weight": {"tp": Shard(0)}},
        in_dst_shardings={"input": {"tp": Replicate()}},
        out_dst_shardings={"tp": Shard(-1)},
    )
    assert validate(toy(), MESH, plan).ok


def test_plan_file_and_device_mesh_free(tmp_path):
    from hyper_parallel.dmodule import dump_plan

    path = tmp_path / "plan.yaml"
    dump_plan(good_plan(), path)
    report = validate(toy(), MeshLayout.parse("dp=2,tp=4"), str(path))
    assert report.ok
    assert not torch.distributed.is_initialized()  # the fake world is torn down


def test_without_trace_only_static_checks():
    report = validate(toy(), MESH, broken_plan(), trace=False)
    assert not report.traced and not report.redistributions
    assert "forward" not in {f.field for f in report.findings}
    assert len(report.errors) == 6


def test_implicitly_replicated_parameters_are_info():
    plan = {"blocks.*.norm": ShardingConfig(in_dst_shardings={"input": {"tp": Replicate()}})}
    report = validate(toy(), MESH, plan, trace=False)
    infos = [f for f in report.infos if f.path == "blocks.0.norm"]
    assert {f.field for f in infos} == {"state_shardings['weight']", "state_shardings['bias']"}


def test_inputs_that_do_not_fit_skip_the_trace_with_a_note():
    report = validate(toy(), MESH, good_plan(), inputs=[torch.zeros(2, 3, 5)])
    assert report.ok and not report.traced
    assert any("do not fit the model" in n for n in report.notes)


def test_bad_mesh_and_model_are_rejected():
    with pytest.raises(ValueError, match="sizes are integers"):
        validate(toy(), {"tp": 0}, good_plan())
    with pytest.raises(ValueError, match="not 'axis=size'"):
        MeshLayout.parse("dp:2")
    with pytest.raises(TypeError, match="expected a model Config"):
        validate(object(), MESH)


@pytest.mark.parametrize("sharding", ["tp", "tp_sp"])
def test_llama_debug_plans_are_valid(sharding):
    spec = get_spec("llama3-debug")
    report = validate(
        spec.sharding("tp", sequence_parallel=sharding == "tp_sp")(spec.config()),
        {"dp": 2, "tp": 2},
    )
    assert report.ok, report.to_table()
    assert report.traced
    if sharding == "tp_sp":
        # The residual stream is sequence-sharded: each block and the output projection
        # gather it on tp (2 per layer + 1).
        gathers = [r for r in report.redistributions if r.collectives]
        assert len(gathers) == 2 * 2 + 1
        assert {(c["kind"], c["axis"]) for r in gathers for c in r.collectives} == {
            ("all_gather", "tp")
        }


def test_llama_heads_not_divisible_by_tp_fail_with_the_module_path():
    spec = get_spec("llama3-debug")  # 4 key/value heads
    report = validate(spec.sharding("tp")(spec.config()), {"tp": 8})
    assert not report.ok
    assert any(f.path.startswith("layers.0.attention") for f in report.errors), report.to_table()


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        ([Shard(2)], [Replicate()], [("all_gather", "tp")]),
        ([Partial()], [Replicate()], [("all_reduce", "tp")]),
        ([Partial()], [Shard(1)], [("reduce_scatter", "tp")]),
        ([Shard(1)], [Shard(2)], [("all_to_all", "tp")]),
        ([Replicate()], [Shard(0)], []),
        ([Shard(0)], [Shard(0)], []),
    ],
)
def test_redistribution_collectives(src, dst, expected):
    assert redistribution_collectives(src, dst, ["tp"]) == expected


def test_redistribution_collectives_per_axis():
    assert redistribution_collectives(
        [Shard(0), Partial()], [Replicate(), Replicate()], ["dp", "tp"]
    ) == [("all_gather", "dp"), ("all_reduce", "tp")]


def test_an_existing_process_group_skips_the_trace_with_a_note():
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        report = validate(toy(), MESH, good_plan())
        assert report.ok and not report.traced
        assert any("already exists" in n for n in report.notes)
        from hyper_parallel.analysis import dry_run

        with pytest.raises(RuntimeError, match="already exists"):
            dry_run(toy(), MESH, good_plan())
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- misconfigurations users hit


def _findings(report: ValidationReport, severity: str, path: str) -> list[str]:
    return [
        f"{f.field} | {f.message} | {f.fix}"
        for f in report.findings
        if f.severity == severity and f.path == path
    ]


@pytest.mark.parametrize(
    ("tp", "relation", "sizes"),
    [(8, "is larger than", "(4, 2, 1)"), (3, "does not divide", "(4, 2, 1)")],
)
def test_key_value_heads_split_over_tp_is_an_error_with_path_axis_and_fix(tp, relation, sizes):
    spec = get_spec("llama3-debug")  # 4 key/value heads of head_dim 8
    report = validate(spec.sharding("tp")(spec.config()), {"tp": tp}, trace=False)
    for proj in ("wk", "wv"):
        (text,) = _findings(report, "error", f"layers.1.attention.{proj}")
        assert text.startswith("state_shardings['weight'] | 4 heads (32 features / head_dim 8")
        assert f"axis 'tp' of size {tp}, which {relation} the head count" in text
        assert f"use a 'tp' size that divides 4 {sizes}" in text


def test_vocabulary_not_divisible_is_a_warning_with_the_padding():
    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(66, DIM)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.embed(tokens)

    with torch.device("meta"):
        model = Tokens()
    report = validate(model, {"tp": 4}, {"embed": vocab_parallel_embedding()}, trace=False)
    assert report.ok
    (text,) = _findings(report, "warning", "embed")
    assert "vocabulary of 66 rows does not divide by 4 (axis 'tp')" in text
    assert "ranks hold 17 rows, the last 15" in text
    assert "pad the vocabulary to 68 rows (+2)" in text


def test_sequence_parallel_length_not_divisible_is_a_warning_naming_the_axis():
    spec = get_spec("llama3-debug")
    report = validate(
        spec.sharding("tp", sequence_parallel=True)(spec.config()), {"tp": 2}, seq_len=15
    )
    assert report.ok and report.traced
    (text,) = _findings(report, "warning", "layers.0.attention_norm")
    assert "dim 1 has size 15" in text and "(axis 'tp'): shards of 8 and 7" in text
    assert "divisible by 2 (the 'tp' size)" in text


def test_mesh_size_other_than_the_world_size_is_an_error():
    report = validate(toy(), MESH, good_plan(), trace=False, world_size=6)
    (text,) = _findings(report, "error", "")
    assert text.startswith("mesh | the mesh has 8 ranks but the job has 6 (world size)")
    assert "product is 6" in text
    assert validate(toy(), MESH, good_plan(), trace=False, world_size=8).ok


def test_a_mesh_that_names_an_axis_twice_is_an_error():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hyper_parallel.core.dtensor.device_mesh import DeviceMesh

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("tp", "tp"))
        report = validate(toy(), mesh, good_plan(), trace=False)
    finally:
        dist.destroy_process_group()
    (text,) = _findings(report, "error", "")
    assert "axis 'tp' appears more than once" in text and "name each mesh axis once" in text


def test_placement_on_an_axis_of_size_1_is_a_warning():
    report = validate(toy(), {"dp": 4, "tp": 1}, good_plan(), trace=False)
    assert report.ok
    (text,) = _findings(report, "warning", "blocks.0.up")
    fields, message, fix = text.split(" | ")
    assert fields == "state_shardings['weight'], out_dst_shardings"  # colwise's Shard()s
    assert message.startswith("axis 'tp' has size 1, so these placements on it do nothing")
    assert fix.startswith("drop 'tp' from these placements")
    wider = validate(toy(), {"dp": 2, "tp": 2}, good_plan(), trace=False)
    assert not any("has size 1" in f.message for f in wider.findings)


def test_state_sharded_on_a_dim_of_size_1_is_an_error():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(DIM, 1))
    report = validate(model, {"tp": 2}, {"0": colwise()}, trace=False)
    texts = _findings(report, "error", "0")
    assert len(texts) == 2  # weight (1, DIM) and bias (1,)
    assert "axis 'tp' shards dim 0 of 'weight', which has size 1" in texts[0]


@pytest.mark.parametrize(
    ("model", "mesh"),
    [("llama3-debug", {"dp_shard": 4}), ("qwen3-moe-debug", {"dp_shard": 2, "ep": 2})],
)
def test_a_mesh_without_tp_reports_no_parameter_as_uncovered(model, mesh):
    """Without tp no dense plan shards a parameter: data parallelism holds the dense ones
    (FSDP2 shards them over its axes in training), so nothing is "covered by no sharding
    config" (a dp x ep Qwen3-30B-A3B layout drew 435 such warnings, one per dense weight).
    With tp the uncovered ones are named, as the axes they are copied over."""
    from hyper_parallel.distributed.axes import apply_model_axes

    spec = get_spec(model)
    config = apply_model_axes(spec, spec.config(), MeshLayout.from_sizes(mesh))  # as the CLI
    report = validate(config, mesh, trace=False)
    assert not [f for f in report.findings if "covered by no sharding config" in f.message]
    assert report.ok
    uncovered = validate(toy(), {"dp": 2, "tp": 4}, {"head": colwise(bias=False)}, trace=False)
    norms = [f for f in uncovered.findings if "covered by no sharding config" in f.message]
    assert norms and all("a full copy on every rank of tp" in f.message for f in norms)


def test_a_run_level_error_under_cp_keeps_the_root_config_in_the_trace():
    """A run-level error at the model's root (here micro-batches that do not divide the
    batch) is the run's, not the root module's config: that config carries cp's positions,
    and tracing without it failed in the attention with a second, wrong error ("fix the
    placements of this module")."""
    from hyper_parallel.distributed.axes import apply_model_axes

    spec = get_spec("llama3-debug")
    mesh = {"cp": 2}
    config = apply_model_axes(spec, spec.config(), MeshLayout.from_sizes(mesh))  # as the CLI
    report = validate(config, mesh, batch_size=1, num_microbatches=2)
    assert report.traced
    errors = [(f.path, f.field) for f in report.findings if f.severity == "error"]
    assert errors == [("", "num_microbatches")], report.to_table()
    assert not any("ran without" in n for n in report.notes), report.notes


def test_a_sequence_past_the_rope_under_cp_is_one_error_not_a_failed_trace_too():
    """Under cp the trace feeds a rank's half of the sequence: the model without its plan
    ran on that half (32 tokens fit max_seq_len=32), so the parallelized forward's failure
    on the global 64 was reported as the plan's, with the fix "fix the placements of this
    module". The plain forward now runs on the whole sequence, as one device would."""
    from hyper_parallel.distributed.axes import apply_model_axes

    spec = get_spec("llama3-debug")
    mesh = {"cp": 2}
    config = apply_model_axes(spec, spec.config(max_seq_len=32), MeshLayout.from_sizes(mesh))
    report = validate(config, mesh, seq_len=64)
    fields = {f.field for f in report.findings if f.severity == "error"}
    assert fields == {"max_seq_len"}, report.to_table()
    assert any("do not fit the model even without the plan" in n for n in report.notes)
