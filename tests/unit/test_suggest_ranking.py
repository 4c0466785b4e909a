"""The top K of ``suggest`` on hand-made candidates and step times (no trace, no model):
one plan per structure with its dp splits as equivalents, and within the model's error
the simpler plan first, saying why."""

from __future__ import annotations

import pytest

from hyper_parallel.analysis.suggest import Candidate, Prediction
from hyper_parallel.analysis.suggest._search import MODEL_ERROR, TOLD_APART, _rank


def _c(**kw: object) -> Candidate:
    base = dict(
        pp=1,
        dp_replicate=1,
        dp_shard=1,
        cp=1,
        tp=1,
        ep=1,
        microbatches=1,
        schedule=None,
        ac="none",
        sp=False,
    )
    base.update(kw)
    if base["pp"] > 1 and base["schedule"] is None:
        base["schedule"] = "1F1B"
    base["sp"] = base["tp"] > 1
    return Candidate(**base)


def _p(step_s: float, memory: int = 1 << 30) -> Prediction:
    return Prediction(
        step_s=step_s,
        tokens_per_s_per_gpu=1.0 / step_s,
        mfu=0.0,
        memory_bytes_per_gpu=memory,
        memory={},
        time={},
        bubble_fraction=0.0,
    )


def _meshes(ranked: list[tuple[Candidate, Prediction]]) -> list[str]:
    return [c.mesh_text() for c, _ in ranked]


def test_told_apart_is_the_ratio_two_predictions_within_the_error_can_swap():
    assert pytest.approx((1 + MODEL_ERROR) / (1 - MODEL_ERROR)) == TOLD_APART
    assert 1.4 < TOLD_APART < 1.6


def test_dp_splits_of_one_layout_are_one_plan_with_the_others_listed_as_equivalent():
    fsdp = _c(dp_shard=8, tp=8)
    hsdp = _c(dp_replicate=2, dp_shard=4, tp=8)
    hsdp_other_settings = _c(dp_replicate=2, dp_shard=4, tp=8, microbatches=2, ac="full")
    other = _c(dp_shard=4, cp=2, tp=8)
    ranked, why, equivalents = _rank(
        [(hsdp, _p(10.0)), (hsdp_other_settings, _p(9.9)), (fsdp, _p(10.1)), (other, _p(30))],
        top=5,
    )
    assert _meshes(ranked) == ["dp_shard=8,tp=8", "dp_shard=4,cp=2,tp=8"]
    # Plain FSDP stands for the layout (within the error, one axis fewer than HSDP);
    # the HSDP split is listed once, at the settings the same rule picks (as simple
    # either way: the faster, ac=full).
    assert equivalents[0] == ["dp_replicate=2,dp_shard=4,tp=8 (-2%)"]
    assert equivalents[1] == []
    assert len(why) == 2


def test_within_the_error_fewer_axes_first_beyond_it_by_time():
    fsdp = _c(dp_shard=8, microbatches=16, ac="full")  # +27 %: the model cannot tell
    tp2 = _c(dp_shard=4, tp=2)
    tp8 = _c(tp=8)
    cp4 = _c(dp_shard=2, cp=4)  # the fastest, but cp at a sequence that fits without
    far = _c(dp_shard=2, tp=4)
    scored = [
        (cp4, _p(1.00)),
        (tp2, _p(1.01)),
        (fsdp, _p(1.27)),
        (tp8, _p(1.45)),
        (far, _p(TOLD_APART + 0.01)),
    ]
    ranked, why, _ = _rank(scored, top=5)
    assert _meshes(ranked) == [
        "dp_shard=8",
        "dp_shard=4,tp=2",
        "tp=8",
        "dp_shard=2,cp=4",
        "dp_shard=2,tp=4",
    ]
    assert why[0].startswith("+27% vs the fastest, within the model's error")
    assert "no axis beyond FSDP" in why[0] and "ac=" not in why[0].split("ahead")[0]
    assert "ahead of the fastest, dp_shard=2,cp=4" in why[0]
    assert why[1] == (
        "+1% vs the fastest, not told apart (within 1.5x), so simplest first: axes beyond FSDP: tp"
    )
    assert "cp where a layout without it fits" in why[3]
    assert why[4] == "+51% vs the fastest: beyond the model's error, by time"


def test_pp_and_cp_count_against_a_plan_only_where_a_layout_without_them_fits():
    # Every layout that fits pipelines (the states need pp): pp is no mark against one.
    pp_cp = _c(pp=16, dp_shard=8, cp=2, tp=8, microbatches=16)
    pp_only = _c(pp=16, dp_shard=16, tp=8, microbatches=16)
    ranked, why, _ = _rank([(pp_cp, _p(1.0)), (pp_only, _p(1.3))], top=2)
    assert _meshes(ranked) == ["pp=16,dp_shard=16,tp=8", "pp=16,dp_shard=8,cp=2,tp=8"]
    assert "pp where" not in why[0]
    assert "cp where a layout without it fits" in why[1]
    # Once a layout without pp fits, pp counts against the pipelined one, ahead of the
    # number of axes: the plain layout goes first though it has as many.
    no_pp = _c(dp_shard=256, tp=8, ac="full")
    ranked, why, _ = _rank([(pp_only, _p(1.0)), (no_pp, _p(1.2))], top=2)
    assert _meshes(ranked) == ["dp_shard=256,tp=8", "pp=16,dp_shard=16,tp=8"]
    assert "pp where a layout without it fits" in why[1]


def test_the_fastest_leads_when_nothing_simpler_is_within_the_error():
    fast = _c(pp=4, dp_shard=2, microbatches=8)
    slow = _c(dp_shard=8, ac="full")
    ranked, why, _ = _rank([(slow, _p(2.0)), (fast, _p(1.0))], top=5)
    assert _meshes(ranked) == ["pp=4,dp_shard=2", "dp_shard=8"]
    assert why[0].startswith("+0% vs the fastest, within the model's error")
    assert "ahead of the fastest" not in why[0]
    assert why[1] == "+100% vs the fastest: beyond the model's error, by time"


def test_top_cuts_after_ordering_and_nothing_scored_gives_nothing():
    scored = [(_c(dp_shard=8, tp=1), _p(1.2)), (_c(dp_shard=4, tp=2), _p(1.0))]
    ranked, why, equivalents = _rank(scored, top=1)
    assert _meshes(ranked) == ["dp_shard=8"] and len(why) == len(equivalents) == 1
    assert _rank([], top=3) == ([], [], [])


# ----------------------------------------------------------------------------- pipelines


def test_pipeline_counts_reach_one_sequence_per_micro_batch():
    from hyper_parallel.analysis.suggest._search import _pipelines

    by_schedule: dict[str | None, list[int]] = {}
    for schedule, m, _ in _pipelines(16, 16):
        by_schedule.setdefault(schedule, []).append(m)
    # pp=16 with 16 sequences per rank: below the interleaved default (2 pp = 32), the
    # local batch itself is searched for every schedule.
    assert set(by_schedule) == {
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
    }
    assert all(set(counts) == {16} for counts in by_schedule.values())
    one_f_one_b = [m for s, m, _ in _pipelines(4, 64) if s == "1F1B"]
    assert one_f_one_b == [4, 8, 16, 32, 64]  # pp, 2 pp, 4 pp, half the batch, the batch
    # Only counts the local batch splits into, and at least one per pipeline rank.
    assert [m for s, m, _ in _pipelines(4, 6) if s == "1F1B"] == [6]
    assert _pipelines(8, 4) == []
    assert {(s, m) for s, m, _ in _pipelines(4, 64, fixed=12)} == {(s, 12) for s in by_schedule}
    # The looped schedules also at 4 and 8 stages per rank where the layers allow.
    per_rank = {r for s, _, r in _pipelines(4, 64, num_layers=32) if s == "Interleaved1F1B"}
    assert per_rank == {None, 4, 8}
    assert {r for s, _, r in _pipelines(4, 64, num_layers=16)} == {None, 4}


def test_a_pipeline_plan_takes_the_micro_batches_that_shrink_its_bubble():
    import dataclasses

    from hyper_parallel.analysis.cost_model import Link, load_hardware
    from hyper_parallel.analysis.suggest import LayoutScorer, ModelSource, suggest

    model = ModelSource("llama3-debug", (("num_layers", 4),), label="llama-debug-4")
    # Links without latency: the tiny model's step is then its compute and bubble, as a
    # large model's is (with latency, its microsecond micro-batches favour fewer).
    link = Link(bandwidth=450e9, latency_s=0.0, efficiency=1.0)
    hw = dataclasses.replace(load_hardware("h100-80gb"), intra_node=link, inter_node=link)
    kw = dict(gpus=4, gpu=hw, seq_len=64, global_batch_tokens=32 * 64)
    report = suggest(model, mesh={"pp": 2, "dp_shard": 2}, schedule="1F1B", ac="none", **kw)
    best, predicted, _ = report.plans[0]
    assert best.microbatches == 16  # the local batch: one sequence per micro-batch
    default = LayoutScorer(model, **kw).predict(
        _c(pp=2, dp_shard=2, schedule="1F1B", microbatches=2)
    )
    assert predicted.bubble_fraction < default.bubble_fraction / 2


def test_equal_step_times_go_fewest_flags_first_then_least_memory():
    """A model so small that its step is latency predicts every setting of a layout at the
    same time: the plain run (no checkpointing, one micro-batch) goes first, not the one
    that needs least memory (llama3-debug on 4 GPUs was offered ac=full, 2 micro-batches);
    among equal flags, least memory; a faster setting still wins whatever its flags."""
    mesh = {"dp_replicate": 4}
    plain = _c(**mesh)
    full = _c(**mesh, ac="full")
    full_mb = _c(**mesh, ac="full", microbatches=2)
    ranked, _, _ = _rank(
        [(full_mb, _p(1.0, memory=1)), (full, _p(1.0, memory=2)), (plain, _p(1.0, memory=3))],
        top=3,
        settings=True,
    )
    assert [(c.ac, c.microbatches) for c, _ in ranked] == [("none", 1), ("full", 1), ("full", 2)]
    op_small, op_large = _c(**mesh, ac="op"), _c(**mesh, ac="full")
    ranked, _, _ = _rank([(op_large, _p(1.0, 9)), (op_small, _p(1.0, 5))], top=2, settings=True)
    assert [c.ac for c, _ in ranked] == ["op", "full"]  # equal flags: least memory first
    ranked, _, _ = _rank([(plain, _p(1.0)), (full_mb, _p(0.999))], top=2, settings=True)
    assert ranked[0][0] is full_mb  # faster, if only just
    # The same time summed in another order, a last bit apart, is equal: the flags decide
    # (llama3-debug at dp_replicate=4 x dp_shard=4 was offered ac=op this way).
    op = _c(**mesh, ac="op")
    times = [(op, _p(0.0002574000406438396, 1)), (plain, _p(0.00025740004064383966, 2))]
    assert times[0][1].step_s < times[1][1].step_s
    ranked, _, _ = _rank(times, top=2, settings=True)
    assert [c.ac for c, _ in ranked] == ["none", "op"]
