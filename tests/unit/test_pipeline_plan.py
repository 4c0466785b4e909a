"""Pipeline stage splits, placement and the plan's findings (no process group)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from hyper_parallel.distributed.pipeline import (
    PipelineError,
    PipelineSplit,
    PipelineUnit,
    balanced_split,
    init_states_by_unit,
    pipeline_findings,
    plan_pipeline,
    stage_ranks,
)
from hyper_parallel.dmodule import Finding, get_spec
from hyper_parallel.models.llama import PIPELINE, preset_config


@pytest.fixture(scope="module")
def units():
    return PIPELINE.units(preset_config("llama3-debug"))


def _fields(findings: list[Finding]) -> list[str]:
    return [f.field for f in findings]


def test_units_of_the_debug_model(units):
    assert [u.name for u in units] == ["tok_embeddings", "layers.0", "layers.1", "norm+output"]
    assert units[-1].modules == ("norm", "output")
    with torch.device("meta"):
        model = preset_config("llama3-debug").build()
    assert sum(u.num_params for u in units) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("pp", "schedule", "stages", "ranks"),
    [
        (4, "1F1B", 4, [0, 1, 2, 3]),
        (2, "Interleaved1F1B", 4, [0, 1, 0, 1]),
        (2, "InterleavedZeroBubble", 4, [0, 1, 0, 1]),
        (2, "ZBVZeroBubble", 4, [0, 1, 1, 0]),
        (2, "GPipe", 2, [0, 1]),
    ],
)
def test_two_layer_model_runs_four_stages(units, pp, schedule, stages, ranks):
    plan = plan_pipeline(units, pp=pp, schedule=schedule, num_microbatches=4)
    assert plan.num_stages == stages and list(plan.ranks) == ranks
    assert [n for s in plan.stages for n in s] == [u.name for u in units]
    if stages == 4:
        assert plan.stages[0] == ("tok_embeddings",) and plan.stages[-1] == ("norm+output",)


def test_stage_ranks_looped_and_v_shape():
    assert stage_ranks("Interleaved1F1B", 3, 9) == [0, 1, 2] * 3
    assert stage_ranks("ZBVZeroBubble", 3, 6) == [0, 1, 2, 2, 1, 0]


def test_balanced_split_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        weights = [rng.randint(1, 20) for _ in range(rng.randint(2, 8))]
        parts = rng.randint(1, len(weights))
        sizes = balanced_split(weights, parts)
        assert sum(sizes) == len(weights) and len(sizes) == parts and min(sizes) >= 1

        def worst(cuts, weights=weights):
            bounds = [0, *cuts, len(weights)]
            return max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))

        best = min(worst(c) for c in itertools.combinations(range(1, len(weights)), parts - 1))
        assert worst(list(itertools.accumulate(sizes))[:-1]) == best


def test_units_per_stage_and_explicit_lists(units):
    plan = plan_pipeline(
        units, pp=2, schedule="GPipe", num_microbatches=2, split=PipelineSplit(units_per_stage=2)
    )
    assert plan.stages == (("tok_embeddings", "layers.0"), ("layers.1", "norm+output"))
    split = PipelineSplit.from_dict(
        {"stages": [["tok_embeddings"], ["layers.0", "layers.1", "norm", "output"]]}
    )
    plan = plan_pipeline(units, pp=2, schedule="1F1B", num_microbatches=2, split=split)
    assert plan.stages == (("tok_embeddings",), ("layers.0", "layers.1", "norm+output"))
    assert PipelineSplit.from_dict(split.to_dict()) == split


def test_405b_at_pp16_is_balanced_by_parameters():
    spec = get_spec("llama3-405b")
    units = PIPELINE.units(spec.config())
    plan = plan_pipeline(units, pp=16, schedule="1F1B", num_microbatches=16)
    sizes = {u.name: u.num_params for u in units}
    totals = [sum(sizes[n] for n in s) for s in plan.stages]
    assert len(totals) == 16 and sum(totals) == spec.family.num_params(spec.config())
    # No stage is more than one block heavier than the lightest.
    assert max(totals) - min(totals) <= sizes["layers.0"]


# ------------------------------------------------------------------ findings


def test_good_plan_has_no_findings(units):
    assert pipeline_findings(units, pp=2, schedule="1F1B", num_microbatches=4, batch_size=8) == []


def test_too_few_microbatches_for_1f1b(units):
    findings = pipeline_findings(units, pp=4, schedule="1F1B", num_microbatches=2)
    assert _fields(findings) == ["num_microbatches"]
    assert "refuses 2 micro-batches" in findings[0].message
    assert "at least 4 micro-batches" in findings[0].fix


def test_layer_count_the_split_cannot_place(units):
    findings = pipeline_findings(units, pp=8, schedule="1F1B", num_microbatches=8)
    assert _fields(findings) == ["split"]
    assert "cannot place" in findings[0].message and "num_layers" in findings[0].fix
    # 2 units per stage gives 2 stages; Interleaved1F1B at pp=2 needs 4.
    findings = pipeline_findings(
        units,
        pp=2,
        schedule="Interleaved1F1B",
        num_microbatches=4,
        split=PipelineSplit(units_per_stage=2),
    )
    assert _fields(findings) == ["split"] and "at least 2 per rank" in findings[0].message
    # ZBVZeroBubble takes a V of exactly 2 stages per rank: 6 stages (1 unit each) at pp=2
    # were refused as not "a multiple of pp=2, at least 2 per rank", which 6 is: the
    # message named the interleaved schedules' rule, not the V's (exactly 4).
    deeper = PIPELINE.units(preset_config("llama3-debug", num_layers=4))
    for pp, size in ((2, 1), (1, 2)):  # 6 stages at pp=2; 3 at pp=1
        findings = pipeline_findings(
            deeper,
            pp=pp,
            schedule="ZBVZeroBubble",
            num_microbatches=4,
            split=PipelineSplit(units_per_stage=size),
        )
        assert _fields(findings) == ["split"]
        assert f"needs exactly {2 * pp} (pp={pp} x 2 per rank, a V)" in findings[0].message
        assert "a multiple of" not in findings[0].message


def test_empty_stage_unknown_unit_and_order(units):
    split = PipelineSplit(stages=(("tok_embeddings", "layers.0", "layers.1"), (), ("norm",)))
    findings = pipeline_findings(units, pp=3, schedule="GPipe", num_microbatches=3, split=split)
    assert _fields(findings) == ["split.stages[1]"] and "is empty" in findings[0].message
    split = PipelineSplit(stages=(("tok_embeddings", "layers.0", "layer.1"), ("output",)))
    findings = pipeline_findings(units, pp=2, schedule="GPipe", num_microbatches=2, split=split)
    assert findings[0].message.startswith("names 'layer.1'")
    assert "leaves unit(s) ['layers.1']" in findings[1].message
    split = PipelineSplit(stages=(("tok_embeddings", "layers.1"), ("layers.0", "output")))
    findings = pipeline_findings(units, pp=2, schedule="GPipe", num_microbatches=2, split=split)
    assert "model order" in findings[0].message


def test_a_stage_that_is_not_a_list_of_unit_names_is_refused_as_such(units):
    # {"stages": [[...], "layers.1"]} was read letter by letter: eight findings "names
    # 'l'", "names 'a'", ... and none saying the stage must be a list.
    def found(stages):
        split = PipelineSplit.from_dict({"stages": stages})
        return pipeline_findings(units, pp=2, schedule="GPipe", num_microbatches=2, split=split)

    (error,) = found([["tok_embeddings", "layers.0"], "layers.1"])
    assert error.field == "split.stages[1]" and error.message.startswith("is 'layers.1';")
    assert '["layers.1"]' in error.fix and '"tok_embeddings"' in error.fix
    (error,) = found("tok_embeddings")
    assert error.field == "split.stages" and error.message.startswith("is 'tok_embeddings';")
    (error,) = found([["tok_embeddings", 1], ["layers.1"]])
    assert error.field == "split.stages[0]"
    (error,) = found(3)
    assert error.field == "split.stages"
    good = [["tok_embeddings", "layers.0"], ["layers.1", "norm+output"]]
    assert found(good) == [] and found([tuple(s) for s in good]) == []
    # JSON's true is no unit count (it was read as 1).
    split = PipelineSplit.from_dict({"units_per_stage": True})
    findings = pipeline_findings(units, pp=2, schedule="GPipe", num_microbatches=2, split=split)
    assert _fields(findings) == ["split.units_per_stage"] and "is True" in findings[0].message


def test_batch_not_divisible_into_microbatches(units):
    findings = pipeline_findings(units, pp=2, schedule="GPipe", num_microbatches=4, batch_size=6)
    assert _fields(findings) == ["num_microbatches"]
    assert "does not split into 4 equal micro-batches" in findings[0].message
    assert "(e.g. 1, 2, 3)" in findings[0].fix  # GPipe runs any count


def test_the_batch_fix_names_only_counts_the_schedule_runs():
    # pp=4 at 1F1B, 2 sequences per rank: the fix said "use a micro-batch count that
    # divides 2", and 1 or 2 micro-batches are then refused by 1F1B (fewer than 4 stages).
    deeper = PIPELINE.units(preset_config("llama3-debug", num_layers=4))

    def fix(**options):
        findings = pipeline_findings(deeper, pp=4, schedule="1F1B", **options)
        (finding,) = findings
        assert finding.field == "num_microbatches" and "equal micro-batches" in finding.message
        return finding.fix

    assert "runs no micro-batch count that divides 2" in fix(num_microbatches=4, batch_size=2)
    assert "a multiple of 4" in fix(num_microbatches=4, batch_size=2)
    # 12 sequences, 8 micro-batches: 1F1B at pp=4 runs 4, 6 and 12 of its divisors.
    assert "(e.g. 4, 6, 12)" in fix(num_microbatches=8, batch_size=12)
    for m in (4, 6, 12):
        assert (
            pipeline_findings(deeper, pp=4, schedule="1F1B", num_microbatches=m, batch_size=12)
            == []
        )


def test_schedule_names_and_stages_per_rank(units):
    findings = pipeline_findings(units, pp=2, schedule="1f1b", num_microbatches=4)
    assert "not a pipeline schedule" in findings[0].message and "'1F1B'" in findings[0].fix
    findings = pipeline_findings(units, pp=2, schedule="DualPipeV", num_microbatches=4)
    assert "GPipe" in findings[0].fix
    findings = pipeline_findings(
        units, pp=1, schedule="ZBVZeroBubble", num_microbatches=4, stages_per_rank=4
    )
    assert "exactly 2 stages per rank" in findings[0].message
    findings = pipeline_findings(
        units, pp=2, schedule="1F1B", num_microbatches=4, stages_per_rank=2
    )
    assert "one stage per rank" in findings[0].message


def test_tied_weights_across_stages_are_refused(units):
    with torch.device("meta"):
        model = preset_config("llama3-debug").build()
    model.output.weight = model.tok_embeddings.weight  # same (vocab, dim) shape: tie them
    findings = pipeline_findings(units, pp=2, schedule="GPipe", num_microbatches=2, model=model)
    assert _fields(findings) == ["split"]
    assert "tok_embeddings.weight (stage 0)" in findings[0].message
    assert "output.weight (stage 1)" in findings[0].message
    assert "untie" in findings[0].fix
    with pytest.raises(PipelineError, match="one tied tensor"):
        plan_pipeline(units, pp=2, schedule="GPipe", num_microbatches=2, model=model)
    # On one stage the tie is harmless.
    assert pipeline_findings(units, pp=1, schedule="GPipe", num_microbatches=2, model=model) == []


def test_plan_raises_every_error_at_once():
    units = [PipelineUnit(n, (n,), 1) for n in ("tok_embeddings", "layers.0", "norm+output")]
    with pytest.raises(PipelineError) as info:
        plan_pipeline(units, pp=4, schedule="GPipe", num_microbatches=0)
    assert _fields(info.value.findings) == ["num_microbatches"]


# ------------------------------------------------------------------ stages


def test_stages_equal_the_one_device_model(units):
    config = preset_config("llama3-debug")
    full = config.build()
    init_states_by_unit(full, PIPELINE, seed=3)
    plan = plan_pipeline(units, pp=2, schedule="Interleaved1F1B", num_microbatches=4)
    reference = dict(full.named_parameters())
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    h, names = tokens, []
    for stage in plan.stages:
        with torch.device("meta"):
            module = PIPELINE.stage_config(config, stage).build()
        module.to_empty(device="cpu")
        init_states_by_unit(module, PIPELINE, seed=3)
        for n, p in module.named_parameters():
            assert torch.equal(p, reference[n]), n
            names.append(n)
        h = module(h)
    assert sorted(names) == sorted(reference)  # the model's own names, each once
    assert torch.equal(h, full(tokens))


def test_stage_refuses_norm_without_output():
    config = preset_config("llama3-debug")
    stage = PIPELINE.stage_config(config, ["layers.1", "norm+output"])
    stage.output = None
    with pytest.raises(ValueError, match="norm and output are one unit"):
        stage.build()


def test_unit_flops_are_the_matmul_and_attention_flops():
    seq = 64
    config = preset_config("llama3-debug")
    units = PIPELINE.units(config, seq_len=seq)
    block = config.layers[0]
    linears = [
        block.attention.wq,
        block.attention.wk,
        block.attention.wv,
        block.attention.wo,
        block.feed_forward.w1,
        block.feed_forward.w2,
        block.feed_forward.w3,
    ]
    dim = config.norm.dim
    # 2 m n k per matmul; attention: q k^T and scores x v, each 2 S S dim (full, not causal).
    expected_block = 2 * seq * sum(c.in_features * c.out_features for c in linears)
    expected_block += 2 * 2 * seq * seq * dim
    assert [u.num_flops for u in units] == [
        0,
        expected_block,
        expected_block,
        2 * seq * dim * config.output.out_features,
    ]
    assert [u.num_params for u in units] == [u.num_params for u in PIPELINE.units(config)]


def test_balance_by_flops_beats_params_where_they_disagree():
    # A large vocabulary: by parameters the embedding weighs as much as the head, so
    # the split is [emb, L0] | [L1, head]; by FLOPs the embedding costs nothing and
    # the head's matmul is larger than a block's.
    config = preset_config("llama3-debug", num_layers=2, vocab_size=1024)
    units = PIPELINE.units(config, seq_len=16)
    flops = {u.name: u.num_flops for u in units}

    def heaviest(balance):
        plan = plan_pipeline(
            units,
            pp=2,
            schedule="GPipe",
            num_microbatches=2,
            split=PipelineSplit(balance=balance),
        )
        return plan.stages, max(sum(flops[n] for n in s) for s in plan.stages)

    by_params, worst_params = heaviest("params")
    by_flops, worst_flops = heaviest("flops")
    assert by_params == (("tok_embeddings", "layers.0"), ("layers.1", "norm+output"))
    assert by_flops == (("tok_embeddings", "layers.0", "layers.1"), ("norm+output",))
    assert worst_flops < worst_params
    assert PipelineSplit.from_dict({"balance": "flops"}) == PipelineSplit(balance="flops")


def test_balance_errors(units):
    bad = pipeline_findings(
        units, pp=2, schedule="GPipe", num_microbatches=2, split=PipelineSplit(balance="time")
    )
    assert _fields(bad) == ["split.balance"] and "'flops'" in bad[0].fix
    uncounted = pipeline_findings(
        units, pp=2, schedule="GPipe", num_microbatches=2, split=PipelineSplit(balance="flops")
    )
    assert _fields(uncounted) == ["split.balance"] and "seq_len" in uncounted[0].fix


def test_a_balance_beside_an_explicit_split_is_refused(units):
    # {"units_per_stage": 2, "balance": "flops"} planned by units_per_stage and said
    # nothing of the balance (any value, "bogus" too, was accepted and unused).
    for explicit in ({"units_per_stage": 2}, {"stages": [["tok_embeddings"], ["layers.0"]]}):
        for balance in ("flops", "bogus"):
            split = PipelineSplit.from_dict({**explicit, "balance": balance})
            findings = pipeline_findings(
                units, pp=2, schedule="GPipe", num_microbatches=2, split=split
            )
            assert _fields(findings) == ["split.balance"], findings
            assert f"is {balance!r} beside an explicit split" in findings[0].message
            assert "drop 'balance'" in findings[0].fix
    plain = PipelineSplit.from_dict({"units_per_stage": 2, "balance": "params"})  # the default
    assert pipeline_findings(units, pp=2, schedule="GPipe", num_microbatches=2, split=plain) == []
    # The trainer's gate says so before counting FLOPs (which refused the debug model's
    # 512 positions at validate's 2048-token count, a problem of a balance not used).
    from hyper_parallel.train.trainer import TrainConfig, check_config

    cfg = TrainConfig(
        mesh={"pp": 2}, batch_size=2, pipeline_split={"units_per_stage": 2, "balance": "flops"}
    )
    assert [(f.field, f.severity) for f in check_config(cfg, 2)] == [("split.balance", "error")]


def test_the_trainer_balances_by_flops_when_asked():
    from hyper_parallel.train.trainer import TrainConfig, run_plan

    cfg = TrainConfig(
        mesh={"pp": 3},
        batch_size=6,
        model_overrides={"num_layers": 4},
        seq_len=64,
        pipeline_split={"balance": "flops"},
    )
    units = PIPELINE.units(preset_config("llama3-debug", num_layers=4), seq_len=64)
    by_flops = plan_pipeline(
        units, pp=3, schedule="1F1B", num_microbatches=3, split=PipelineSplit(balance="flops")
    )
    assert run_plan(cfg).pipeline.stages == by_flops.stages
    # Balanced by parameters the split differs (the embedding weighs no FLOPs).
    assert run_plan(cfg.replace(pipeline_split=None)).pipeline.stages != by_flops.stages


def test_stage_width_comes_from_the_layout_or_a_clear_refusal():
    import dataclasses

    config = preset_config("llama3-debug")
    assert PIPELINE.stage_width(config) == config.tok_embeddings.embedding_dim
    silent = dataclasses.replace(PIPELINE, activation_dim=None)
    with pytest.raises(ValueError, match="declares no activation_dim"):
        silent.stage_width(config)


def test_the_package_example_calls_each_function_as_it_is_defined():
    # The package's example called pipeline_step(schedule, plan, pp_rank, tokens,
    # targets, mesh["pp"]): six arguments to a function of five, pp_rank where the pp
    # mesh goes (TypeError when copied). Each call of the example binds to its signature.
    import ast
    import inspect

    import hyper_parallel.distributed.builder as builder
    import hyper_parallel.distributed.pipeline as pipeline

    doc = pipeline.__doc__
    code = doc[doc.index("Example::") :].split("\n", 1)[1]
    lines = [ln.strip().removeprefix("# ").split("  #")[0] for ln in code.splitlines()]
    trees = []
    for line in lines:  # each line of code, commented or not; prose is skipped
        try:
            trees.append(ast.parse(line))
        except SyntaxError:
            continue
    calls = [
        node
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    functions = {"build_stages": builder.build_stages}
    functions |= {n: getattr(pipeline, n) for n in pipeline.__all__}
    bound = []
    for call in calls:
        if call.func.id in functions:
            args = [ast.unparse(a) for a in call.args]
            kwargs = {k.arg: ast.unparse(k.value) for k in call.keywords}
            sig = inspect.signature(functions[call.func.id]).bind(*args, **kwargs)
            bound.append((call.func.id, sig.arguments))
    names = [name for name, _ in bound]
    assert names == ["plan_pipeline", "build_stages", "build_schedule", "pipeline_step"]
    assert dict(bound)["pipeline_step"]["pp_mesh"] == "mesh['pp']"
