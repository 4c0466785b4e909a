"""The dry run under context parallelism: what cp=2 saves per rank against cp=1.

Its own module: the dry run builds its own fake process group, so no other test's
mesh may be alive while it runs.
"""

from __future__ import annotations

import json


def test_plan_at_cp2_halves_the_states_and_the_activations_of_cp1(capsys):
    """llama3-8b, tp=8, one global sequence of 8192: cp=2 against cp=1, per rank.

    FSDP2 shards the states over cp (fsdp = dp_shard x cp); each rank saves its own
    tokens' activations (attention by chunks: no mask).
    """
    from hyper_parallel.cli import main

    per_rank = {}
    for mesh in ("tp=8", "tp=8,cp=2"):
        args = ["plan", "--model", "llama3-8b", "--mesh", mesh, "--seq", "8192"]
        assert main([*args, "--format", "json"]) == 0
        report = json.loads(capsys.readouterr().out)
        per_rank[mesh] = report["per_rank_bytes"]
        if "cp" in mesh:
            assert report["fsdp_axes"] == ["fsdp"]
    one, two = per_rank["tp=8"], per_rank["tp=8,cp=2"]
    for kind in ("params", "grads", "optimizer"):
        assert 2 * two[kind] == one[kind], kind  # every dim divides by 2: exact
    assert 0.45 < two["activations"] / one["activations"] < 0.55


def _activations(model: str, mesh: str, seq_len: int, **overrides) -> int:
    from hyper_parallel.analysis import dry_run
    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.distributed.axes import apply_model_axes
    from hyper_parallel.dmodule import get_spec

    spec = get_spec(model)
    layout = MeshLayout.parse(mesh)
    config = apply_model_axes(spec, spec.config(max_seq_len=seq_len, **overrides), layout)
    report = dry_run(config, layout, seq_len=seq_len, dtype="bf16", loss_fn=spec.family.loss_fn)
    return report.per_rank.activations


def test_cp8_holds_at_most_a_sixth_of_dp_shard8s_activations_at_32k():
    """llama3-8b, one 32,768-token sequence per data-parallel rank, bf16, no checkpointing.

    dp_shard=8: each rank saves the activations of its whole sequence; cp=8: of its
    4,096 tokens (1/8), plus each layer's gathered keys and values. No mask, and no
    seq x seq probabilities (attention keeps its output and log-sum-exp).
    """
    dp = _activations("llama3-8b", "dp_shard=8", 32768)
    cp = _activations("llama3-8b", "cp=8", 32768)
    assert cp <= dp / 6, cp / dp
    assert cp >= dp / 8  # a rank holds at least its own tokens' share


def test_activations_grow_linearly_with_the_sequence_under_cp():
    """Twice the sequence, twice the bytes: nothing of size S/cp x S is saved."""
    one, two = (_activations("llama3-debug", "cp=2", s) for s in (2048, 4096))
    assert 1.98 < two / one < 2.02, two / one


def test_plan_traces_cp_with_a_data_axis_and_several_sequences_a_rank(capsys):
    """dp_shard=2 x cp=2 with two sequences a rank: the trace (fake tensors) ran into torch's
    ``_StridedShard`` size computation, which reads an arange with ``.tolist()``; the
    attention input ``(batch, seq/cp, dim)`` flattened for its matmuls is one when batch > 1.

    Against batch 1: the same collectives, cp's gathers carrying twice the bytes (the keys
    and values of two sequences), the loss's one all-reduce on cp (the count of non-ignored
    targets) the same 4, and the activations twice less the part no batch scales.
    """
    from hyper_parallel.cli import main

    reports = {}
    for batch in (1, 2):
        args = ["plan", "--model", "llama3-debug", "--mesh", "dp=2,cp=2", "--seq", "64"]
        assert main([*args, "--batch", str(batch), "--format", "json"]) == 0, batch
        reports[batch] = json.loads(capsys.readouterr().out)
    one, two = reports[1], reports[2]

    def counts(report):
        return {(c["phase"], c["kind"], c["axis"]): c["count"] for c in report["collectives"]}

    assert counts(two) == counts(one)

    def cp_bytes(report, kinds):
        return [
            c["bytes"] for c in report["collectives"] if c["axis"] == "cp" and c["kind"] in kinds
        ]

    gathers = ("all_gather", "reduce_scatter")
    assert cp_bytes(two, gathers) == [2 * b for b in cp_bytes(one, gathers)] and cp_bytes(
        one, gathers
    )
    assert cp_bytes(two, ("all_reduce",)) == cp_bytes(one, ("all_reduce",)) == [4]
    act_one, act_two = one["per_rank_bytes"]["activations"], two["per_rank_bytes"]["activations"]
    assert 1.95 * act_one < act_two <= 2 * act_one
