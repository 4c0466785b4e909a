"""The cost model's formulas against numbers derived independently (by hand, or from a
textbook formula), and planted errors each of which one of these tests catches.

Tiny models on the meta device; no process group.
"""

from __future__ import annotations

import dataclasses

import pytest

from hyper_parallel.analysis.cost_model import (
    Link,
    axis_per_node,
    collective_seconds,
    load_hardware,
)
from hyper_parallel.analysis.published import load_runs, split_by_rule
from hyper_parallel.analysis.suggest import (
    Candidate,
    LayoutScorer,
    ModelSource,
    RunFactors,
    count_flops,
    predict,
    suggest,
)
from hyper_parallel.distributed.layout import MeshLayout

DEBUG = ModelSource("llama3-debug", (("num_layers", 4),), label="llama-debug-4")
SEQ = 64


def _free_comm(**changes: object) -> object:
    """An H100 file whose links cost nothing: compute and the pipeline alone."""
    free = Link(bandwidth=1e30, latency_s=0.0, efficiency=1.0)
    hw = load_hardware("h100-80gb")
    return dataclasses.replace(hw, intra_node=free, inter_node=free, **changes)


def _known_links() -> object:
    """An H100 file with links of stated numbers (450 GB/s, 3 us, 80 %), whatever the
    shipped file's fitted efficiency is."""
    hw = load_hardware("h100-80gb")
    return dataclasses.replace(hw, intra_node=Link(bandwidth=450e9, latency_s=3e-6, efficiency=0.8))


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
    return Candidate(**{**base, **kw})


# ----------------------------------------------------------------------------- FLOPs


def test_block_flops_are_counted_by_hand_with_causal_attention():
    """One block's forward: 2 x tokens x its matmul weights, plus attention's Q K^T and
    P V over half the S x S scores (causal); backward twice the forward."""
    block = DEBUG.config().layers[0]
    att, ffn = block.attention, block.feed_forward
    weights = sum(
        lin.in_features * lin.out_features
        for lin in (att.wq, att.wk, att.wv, att.wo, ffn.w1, ffn.w2, ffn.w3)
    )
    heads = att.wq.out_features // att.head_dim
    scores = 2 * (2 * heads * SEQ * SEQ * att.head_dim)  # Q K^T and P V, full matrix
    expected = 2 * SEQ * weights + scores / 2
    f = count_flops(DEBUG, SEQ)
    assert f.block_fwd == pytest.approx(expected, rel=1e-9)
    assert f.block_bwd == pytest.approx(2 * expected, rel=1e-9)


def test_op_checkpointing_recomputes_every_second_matmul_of_a_block_by_hand():
    """Per-operator checkpointing keeps the attention and the 1st, 3rd, ... matmul of a
    block (wq, wv, w1, w2 in call order wq, wk, wv, wo, w1, w3, w2); backward recomputes
    wk, wo and w3: 2 x tokens x their weights, no attention score FLOPs."""
    block = DEBUG.config().layers[0]
    att, ffn = block.attention, block.feed_forward
    recomputed = sum(lin.in_features * lin.out_features for lin in (att.wk, att.wo, ffn.w3))
    f = count_flops(DEBUG, SEQ)
    assert f.block_op_recompute == pytest.approx(2 * SEQ * recomputed, rel=1e-9)


def test_op_checkpointing_adds_its_recomputed_matmuls_and_elementwise_traffic():
    """With free links, ``ac=op`` costs one rank what ``ac=none`` does plus the recomputed
    matmuls at the achieved rate and every block's forward element traffic again (the
    kept operators answer from their cache); ``full`` adds whole forwards. A planted
    'op recomputes whole blocks' fails the first comparison."""
    hw = _free_comm(attention_efficiency=None)
    kw = dict(gpus=1, gpu=hw, seq_len=SEQ, global_batch_tokens=SEQ)
    none, op = (predict(DEBUG, _c(ac=ac), **kw) for ac in ("none", "op"))
    f = count_flops(DEBUG, SEQ)
    rate = hw.peak_flops["bf16"] * hw.compute_efficiency["bf16"]
    traffic = 2 * f.num_layers * f.block_fwd_elements / hw.hbm_bandwidth
    extra = f.num_layers * f.block_op_recompute / rate + traffic
    got = op.time["pipeline_or_compute"] - none.time["pipeline_or_compute"]
    assert got == pytest.approx(extra, rel=1e-6)
    full = predict(DEBUG, _c(ac="full"), **kw)
    assert full.time["pipeline_or_compute"] > op.time["pipeline_or_compute"]
    # Memory between the two: inputs and kept outputs, not everything.
    assert full.memory["activations"] < op.memory["activations"] < none.memory["activations"]


# ----------------------------------------------------------------------------- collectives


@pytest.mark.parametrize("p", [2, 4, 8])
def test_ring_all_reduce_from_its_formula(p):
    """Ring all-reduce (Patarasuk & Yuan 2009): each rank sends 2 (p - 1) / p of the
    buffer; NCCL's tree takes 2 log2 p latency steps when fewer than the ring's."""
    hw = _known_links()
    link = hw.intra_node
    nbytes = 1 << 30
    steps = min(2 * (p - 1), 2 * (p.bit_length() - 1))
    expected = steps * link.latency_s + 2 * (p - 1) / p * nbytes / (link.bandwidth * 0.8)
    assert link.efficiency == 0.8
    got = collective_seconds(hw, "all_reduce", nbytes, count=1, group_size=p, crosses_nodes=False)
    assert got == pytest.approx(expected, rel=1e-12)


def test_all_gather_time_halves_when_the_bandwidth_doubles():
    """Planted error 'bandwidth / 2' fails here: a large all-gather is bandwidth-bound."""
    hw = _known_links()
    nbytes = 8 << 30
    t = collective_seconds(hw, "all_gather", nbytes, count=1, group_size=8, crosses_nodes=False)
    # (p - 1) / p of the buffer over bandwidth x efficiency, + 7 ring steps of latency
    expected = 7 / 8 * nbytes / (450e9 * 0.8) + 7 * 3e-6
    assert t == pytest.approx(expected, rel=1e-12)


def _two_level_links() -> object:
    """An H100 file with links of stated numbers: NVLink 450 GB/s, 3 us; one 50 GB/s
    NIC per GPU, 10 us; 80 % of each."""
    hw = load_hardware("h100-80gb")
    return dataclasses.replace(
        hw,
        gpus_per_node=8,
        intra_node=Link(bandwidth=450e9, latency_s=3e-6, efficiency=0.8),
        inter_node=Link(bandwidth=50e9, latency_s=10e-6, efficiency=0.8),
        collectives={},
        collectives_by_group={},
    )


def test_a_ring_across_nodes_leaves_through_every_nic_the_group_has_in_a_node():
    """NCCL runs one ring per NIC, each leaving the node through another GPU's NIC: a
    group with 8 ranks in each node moves its bytes at 8 x 50 GB/s (NVIDIA measures
    192 GB/s all-reduce bus bandwidth across DGX A100s with 8 x 25 GB/s NICs, NCCL issue
    812), a group with one rank per node at one NIC's 50 GB/s. Planted error 'every
    cross-node ring at one NIC' (what the model did) fails the first assertion."""
    hw = _two_level_links()
    nbytes, p = 8 << 30, 64
    ring = (p - 1) / p * nbytes
    # dp_shard=64 on 8 nodes: 8 of the group's ranks in each node
    assert axis_per_node(MeshLayout(dp_shard=64), "dp_shard", 8) == 8
    got = collective_seconds(
        hw, "all_gather", nbytes, count=1, group_size=p, crosses_nodes=True, per_node=8
    )
    assert got == pytest.approx(63 * 10e-6 + ring / (8 * 50e9 * 0.8), rel=1e-12)
    # dp_shard=64 x tp=8 on 64 nodes: one rank of each dp group per node
    assert axis_per_node(MeshLayout(dp_shard=64, tp=8), "dp_shard", 8) == 1
    one = collective_seconds(
        hw, "reduce_scatter", nbytes, count=1, group_size=p, crosses_nodes=True, per_node=1
    )
    assert one == pytest.approx(63 * 10e-6 + ring / (50e9 * 0.8), rel=1e-12)
    # dp_shard=32 x tp=2: four per node; fsdp = dp_shard x cp at stride tp
    assert axis_per_node(MeshLayout(dp_shard=32, tp=2), "dp_shard", 8) == 4
    assert axis_per_node(MeshLayout(dp_shard=16, cp=2, tp=2), "fsdp", 8) == 4
    # 16 GPUs per node: 16 NICs would give 800 GB/s, but the bytes also cross NVLink
    wide = dataclasses.replace(hw, gpus_per_node=16)
    capped = collective_seconds(
        wide, "all_gather", nbytes, count=1, group_size=p, crosses_nodes=True, per_node=16
    )
    assert capped == pytest.approx(63 * 10e-6 + ring / (450e9 * 0.8), rel=1e-12)
    # an all-to-all sends each rank's own bytes through its own NIC
    a2a = collective_seconds(
        hw, "all_to_all", nbytes, count=1, group_size=p, crosses_nodes=True, per_node=8
    )
    assert a2a == pytest.approx(63 * 10e-6 + ring / (50e9 * 0.8), rel=1e-12)


def test_the_planner_charges_fsdp_across_nodes_by_the_nics_its_group_drives():
    """End to end through :class:`LayoutScorer`: FSDP2's exposed gather and reduce of a
    step with dp_shard over 2 nodes (8 ranks per node) cost at most 1/8 of those of the
    same bytes with one rank per node: the planner passes each axis' ranks per node to
    the collectives."""
    hw = _two_level_links()
    # no latency: the exposed time is bytes over bandwidth, less what compute hides
    hw = dataclasses.replace(
        hw,
        intra_node=dataclasses.replace(hw.intra_node, latency_s=0.0),
        inter_node=dataclasses.replace(hw.inter_node, latency_s=0.0),
    )
    scorer = LayoutScorer(DEBUG, gpus=16, gpu=hw, seq_len=SEQ, global_batch_tokens=16 * SEQ)
    c = _c(dp_shard=16)
    eight = scorer.predict(c, hardware=hw)
    one = scorer.predict(
        c, hardware=dataclasses.replace(hw, intra_node=hw.inter_node, gpus_per_node=1)
    )
    # gpus_per_node=1: every rank its own node, one NIC per ring
    t8, t1 = eight.time["data_comm_exposed"], one.time["data_comm_exposed"]
    # exposed = comm - min(comm, compute): an eighth of the bytes' time exposes at most
    # an eighth (exactly that where nothing hides it: the first gather, the last reduce)
    assert t1 > 0 and 0 < t8 <= t1 / 8 * (1 + 1e-9)


# ----------------------------------------------------------------------------- compute


def test_tp_halves_each_ranks_compute():
    """Planted error 'compute x 2 under tp' fails here: with free links, tp=2 does half
    of each sequence's FLOPs per rank (the step's compute term halves)."""
    hw = _free_comm()
    kw = dict(gpus=2, gpu=hw, seq_len=SEQ, global_batch_tokens=2 * SEQ)
    one = predict(DEBUG, _c(dp_shard=2), **kw)
    two = predict(DEBUG, _c(tp=2, sp=True), **kw)
    # dp_shard=2: one sequence per rank at full width; tp=2: two sequences at half.
    assert two.time["pipeline_or_compute"] == pytest.approx(
        one.time["pipeline_or_compute"], rel=0.02
    )
    f = count_flops(DEBUG, SEQ)
    achieved = hw.peak_flops["bf16"] * hw.compute_efficiency["bf16"]
    matmul_s = f.total / achieved  # one sequence, the whole model, one rank
    assert one.time["pipeline_or_compute"] >= matmul_s
    assert two.time["pipeline_or_compute"] >= 2 * matmul_s / 2


def test_compute_term_is_the_flops_at_the_achieved_rate():
    """One rank, one sequence, no checkpointing: the step's compute is the counted FLOPs
    at peak x efficiency plus the non-matmul traffic (no operator cost on a GPU kind);
    the attention kernel at the matmuls' efficiency here (its own rate is tested apart)."""
    hw = _free_comm(attention_efficiency=None)
    p = predict(DEBUG, _c(), gpus=1, gpu=hw, seq_len=SEQ, global_batch_tokens=SEQ)
    f = count_flops(DEBUG, SEQ)
    flops_s = f.total / (hw.peak_flops["bf16"] * hw.compute_efficiency["bf16"])
    traffic = 2 * (
        f.num_layers * (f.block_fwd_elements + f.block_bwd_elements)
        + f.rest_fwd_elements
        + f.rest_bwd_elements
    )
    expected = flops_s + traffic / hw.hbm_bandwidth
    assert p.time["pipeline_or_compute"] == pytest.approx(expected, rel=1e-6)


def test_attention_scores_run_at_the_attention_kernels_own_rate():
    """With ``attention_efficiency`` set, the score matmuls (Q K^T and P V over the causal
    half, forward and twice that backward, counted by hand) run at it and the rest at the
    matmuls' rate: a planted 'attention at the matmul rate' fails here."""
    slow = 0.25
    hw = _free_comm(attention_efficiency=slow)
    base = _free_comm(attention_efficiency=None)
    kw = dict(gpus=1, seq_len=SEQ, global_batch_tokens=SEQ)
    p = predict(DEBUG, _c(), gpu=hw, **kw)
    q = predict(DEBUG, _c(), gpu=base, **kw)
    att = DEBUG.config().layers[0].attention
    heads = att.wq.out_features // att.head_dim
    scores_fwd = 2 * heads * SEQ * SEQ * att.head_dim  # causal half of Q K^T + P V
    scores = 3 * scores_fwd * len(DEBUG.config().layers)  # forward + backward (2x)
    peak = hw.peak_flops["bf16"]
    extra = scores / (peak * slow) - scores / (peak * hw.compute_efficiency["bf16"])
    got = p.time["pipeline_or_compute"] - q.time["pipeline_or_compute"]
    assert got == pytest.approx(extra, rel=1e-6)


def test_float8_speeds_the_matmuls_alone():
    """float8 linears (``RunFactors.matmul``) shorten the matmuls only: the step loses
    ``(1 - m)`` of the non-attention matmul FLOPs' time (every matmul weight, forward and
    backward, by hand), not attention's score matmuls nor the elementwise traffic. Planted
    'float8 scales all of compute' fails here."""
    m = 0.5
    hw = _free_comm(attention_efficiency=0.25)
    kw = dict(gpus=1, seq_len=SEQ, global_batch_tokens=SEQ)
    fast = predict(DEBUG, _c(), gpu=hw, factors=RunFactors(matmul=m), **kw)
    bf16 = predict(DEBUG, _c(), gpu=hw, **kw)
    cfg = DEBUG.config()
    block = cfg.layers[0]
    att, ffn = block.attention, block.feed_forward
    weights = len(cfg.layers) * sum(
        lin.in_features * lin.out_features
        for lin in (att.wq, att.wk, att.wv, att.wo, ffn.w1, ffn.w2, ffn.w3)
    )
    weights += cfg.output.in_features * cfg.output.out_features  # the output projection
    matmul_s = 3 * 2 * SEQ * weights / (hw.peak_flops["bf16"] * hw.compute_efficiency["bf16"])
    saved = bf16.time["pipeline_or_compute"] - fast.time["pipeline_or_compute"]
    assert saved == pytest.approx((1 - m) * matmul_s, rel=1e-6)
    assert RunFactors.stated(float8="tensorwise").compute == 1.0


def test_context_parallel_attention_runs_at_the_chunked_kernels_rate():
    """Under cp the trainer's attention runs its chunked kernel per chunk pair
    (``chunked_attention_efficiency``): each rank's share of the score FLOPs (1 / cp, by
    hand) at that rate instead of the one-sequence kernel's; without cp the chunked rate
    is never read. A published run's stated attention rate replaces both. Planted
    'cp attention at the one-sequence rate' fails the first comparison."""
    whole, chunked = 0.5, 0.125
    hw = _free_comm(attention_efficiency=whole, chunked_attention_efficiency=chunked)
    same = _free_comm(attention_efficiency=whole, chunked_attention_efficiency=whole)
    cp = 2
    kw = dict(gpus=cp, seq_len=SEQ, global_batch_tokens=SEQ)
    c = _c(cp=cp)
    att = DEBUG.config().layers[0].attention
    heads = att.wq.out_features // att.head_dim
    scores = 3 * 2 * heads * SEQ * SEQ * att.head_dim * len(DEBUG.config().layers) / cp
    peak = hw.peak_flops["bf16"]
    extra = scores / (peak * chunked) - scores / (peak * whole)
    got = predict(DEBUG, c, gpu=hw, **kw).time["pipeline_or_compute"]
    base = predict(DEBUG, c, gpu=same, **kw).time["pipeline_or_compute"]
    assert got - base == pytest.approx(extra, rel=1e-6)
    one = dict(gpus=1, seq_len=SEQ, global_batch_tokens=SEQ)
    assert (
        predict(DEBUG, _c(), gpu=hw, **one).step_s == predict(DEBUG, _c(), gpu=same, **one).step_s
    )
    # A published run's kernels: one stated rate for both paths.
    stated = RunFactors(attention_efficiency=whole)
    assert predict(DEBUG, c, gpu=hw, factors=stated, **kw).time["pipeline_or_compute"] == (
        pytest.approx(base, rel=1e-12)
    )


# ----------------------------------------------------------------------------- pipeline


def test_1f1b_bubble_is_the_textbook_fraction():
    """Planted error 'bubble dropped' fails here: 1F1B with p stages and m micro-batches
    idles (p - 1) / (m + p - 1) of each rank's time (Narayanan et al. 2021)."""
    hw = _free_comm()
    pp, m = 2, 4
    scorer = LayoutScorer(DEBUG, gpus=pp, gpu=hw, seq_len=SEQ, global_batch_tokens=m * SEQ)
    p = scorer.predict(_c(pp=pp, microbatches=m, schedule="1F1B"))
    assert p.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-6)
    assert p.time["pipeline_or_compute"] > p.time["busy"] * 1.1


def test_fsdp_gathers_once_per_step_under_a_pipeline():
    """The stage's units stay gathered across micro-batches: the FSDP2 time of a step
    does not grow with the micro-batches (overlap off, so all of it shows)."""
    hw = dataclasses.replace(load_hardware("h100-80gb"), comm_overlap=0.0)
    times = []
    for m in (2, 4):
        scorer = LayoutScorer(DEBUG, gpus=4, gpu=hw, seq_len=SEQ, global_batch_tokens=8 * SEQ)
        c = _c(pp=2, dp_shard=2, microbatches=m, schedule="1F1B")
        times.append(scorer.predict(c).time["data_comm_exposed"])
    assert times[0] > 0
    assert times[1] == pytest.approx(times[0], rel=1e-9)


def test_model_axes_comm_is_one_ranks_not_the_sum_over_stages():
    """tp's seconds per step on the busiest pp rank: its own stage's. Four stages of one
    block hold about half of what two stages of two blocks hold (summed over the stages
    both would be the whole model's)."""
    hw = load_hardware("h100-80gb")
    kw = dict(gpu=hw, seq_len=SEQ, global_batch_tokens=4 * SEQ)
    comm = {}
    for pp in (2, 4):
        c = _c(pp=pp, tp=2, sp=True, microbatches=4, schedule="1F1B")
        comm[pp] = predict(DEBUG, c, gpus=2 * pp, **kw).time["model_axes_comm"]
    assert 0 < comm[4] < 0.8 * comm[2]


# ----------------------------------------------------------------------------- memory, batch


def test_loss_peak_is_in_the_memory():
    """The last stage holds 8 bytes per local logit at the loss (two fp32 gradients)."""
    hw = load_hardware("h100-80gb")
    vocab = DEBUG.config().output.out_features
    for tp in (1, 2):
        c = _c(tp=tp, sp=tp > 1, dp_shard=2 // tp)
        p = predict(DEBUG, c, gpus=2, gpu=hw, seq_len=SEQ, global_batch_tokens=4 * SEQ)
        mbs = 4 // c.dp
        assert p.memory["loss"] == 8 * mbs * SEQ * vocab // tp
        # A compiled loss (torchtitan's from 2025) keeps no fp32 copy: 8 bytes per logit
        # fewer in all, the activations the dry run counts unchanged.
        q = predict(
            DEBUG,
            c,
            gpus=2,
            gpu=hw,
            seq_len=SEQ,
            global_batch_tokens=4 * SEQ,
            factors=RunFactors(compiled_loss=True),
        )
        assert q.memory["loss"] == 0
        assert q.memory["activations"] == p.memory["activations"]
        assert p.memory_bytes_per_gpu - q.memory_bytes_per_gpu == 8 * mbs * SEQ * vocab // tp


def _stage_dry_run(names: tuple[str, ...], ac: str) -> object:
    """Stage 0 of the debug Llama (the embedding and its blocks) traced whole, on its own:
    one sequence, the trainer's mixed precision."""
    import torch

    from hyper_parallel.analysis import dry_run
    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.models.llama import PIPELINE

    return dry_run(
        PIPELINE.stage_config(DEBUG.config(), names),
        MeshLayout.from_sizes({}),
        batch_size=1,
        seq_len=SEQ,
        inputs=[torch.zeros(1, SEQ, dtype=torch.long)],
        ac=ac,
        dtype="bf16",
        param_dtype=torch.float32,
    )


def test_a_pipeline_rank_holds_one_peak_and_the_forward_state_of_the_other_micro_batches():
    """1F1B at pp=2 with 4 micro-batches of one sequence: rank 0 has 2 in flight. One is
    in its backward (with full checkpointing: recomputing a block, the peak); the other
    holds only what its forward kept: the token ids (int64) and each checkpointed
    block's input (the fp32 residual stream), counted by hand. Charging the peak per
    micro-batch in flight (this model's earlier error) overstates it 1.8x here (405B at
    pp=8, 1F1B x 8: 101.6 GiB predicted against 82.5 published)."""
    from hyper_parallel.analysis.pipeline_cost import pipeline_report
    from hyper_parallel.distributed import MeshLayout
    from hyper_parallel.models.llama import PIPELINE

    config = DEBUG.config()
    report = pipeline_report(
        MeshLayout.from_sizes({"pp": 2}),
        PIPELINE,
        config,
        schedule="1F1B",
        num_microbatches=4,
        microbatch_size=1,
        element_bytes=4,
        seq_len=SEQ,
        sharded_config=config,
        ac="full",
        dtype="bf16",
        param_dtype=None,
    )
    names = tuple(report["pipeline"]["stages"][0])
    assert names == ("tok_embeddings", "layers.0", "layers.1")
    dim = config.norm.dim
    held = SEQ * 8 + 2 * SEQ * dim * 4  # token ids + two blocks' fp32 inputs
    stage = _stage_dry_run(names, "full")
    assert stage.activations_held_by_ac["full"] == held
    assert stage.per_rank.activations > 5 * held  # a block recomputed: the peak
    row = report["stages"][0]
    assert row["in_flight_microbatches"] == 2
    assert row["activations"] == stage.per_rank.activations + held
    # suggest's prediction without checkpointing (rank 0 the heaviest): two micro-batches'
    # full forward state, each what the stage traced whole saves.
    c = _c(pp=2, microbatches=4, schedule="1F1B", ac="none")
    p = predict(DEBUG, c, gpus=2, gpu="h100-80gb", seq_len=SEQ, global_batch_tokens=4 * SEQ)
    assert p.memory["activations"] == 2 * _stage_dry_run(names, "none").per_rank.activations


def test_accumulation_reducing_each_microbatch_keeps_gradients_sharded_and_reduces_each_time():
    """4 micro-batches on dp_shard=4. Reduced at the last (the trainer's default) FSDP2
    holds every unit's gradients unsharded in fp32: 4x the sharded bytes. With
    ``--reduce-each-microbatch`` they stay sharded and the reduce-scatter of the fp32
    gradients repeats 3 more times: 3 x (5 units x 3 ring steps of latency + 3/4 of
    the 4-byte gradients over the link), counted by hand (all of it exposed)."""
    hw = dataclasses.replace(_known_links(), comm_overlap=0.0)
    scorer = LayoutScorer(DEBUG, gpus=4, gpu=hw, seq_len=SEQ, global_batch_tokens=16 * SEQ)
    one = scorer.predict(_c(dp_shard=4))
    last = scorer.predict(_c(dp_shard=4, microbatches=4))
    each = scorer.predict(_c(dp_shard=4, microbatches=4, reduce_each=True))
    assert last.memory["grads"] == pytest.approx(4 * one.memory["grads"], rel=1e-6)
    assert each.memory["grads"] == one.memory["grads"]
    params = sum(x.numel() for x in DEBUG.config().build().parameters())
    units, p = 4 + 1, 4  # 4 blocks and the root; dp_shard=4
    link = hw.intra_node
    reduce = units * (p - 1) * link.latency_s + (p - 1) / p * 4 * params / (
        link.bandwidth * link.efficiency
    )
    extra = each.time["data_comm_exposed"] - last.time["data_comm_exposed"]
    assert extra == pytest.approx(3 * reduce, rel=1e-6)
    assert scorer.predict(_c(dp_shard=4, microbatches=1, reduce_each=True)).step_s == one.step_s


def test_predict_refuses_a_batch_that_does_not_split_over_dp():
    with pytest.raises(ValueError, match="does not split over dp_replicate x dp_shard = 4"):
        predict(
            DEBUG, _c(dp_shard=4), gpus=4, gpu="h100-80gb", seq_len=SEQ, global_batch_tokens=6 * SEQ
        )


# ----------------------------------------------------------------------------- --mesh


def test_suggest_with_a_fixed_mesh_scores_only_that_mesh():
    report = suggest(
        DEBUG,
        gpus=4,
        gpu="h100-80gb",
        seq_len=SEQ,
        global_batch_tokens=8 * SEQ,
        top=10,
        mesh={"pp": 2, "dp_shard": 2},
        ac="none",
    )
    assert report.plans
    for c, _, _ in report.plans:
        assert c.mesh() == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1}
        assert c.ac == "none"
    # One mesh: its settings (schedule, micro-batches) are the plans, each listed once.
    settings = [(c.schedule, c.microbatches, c.stages_per_rank) for c, _, _ in report.plans]
    assert len(settings) > 1 and len(set(settings)) == len(settings)
    with pytest.raises(ValueError, match="has 8 ranks, not --gpus 4"):
        suggest(
            DEBUG,
            gpus=4,
            gpu="h100-80gb",
            seq_len=SEQ,
            global_batch_tokens=8 * SEQ,
            mesh={"dp_shard": 8},
        )
    # The mesh as the command line gives it (every axis): named by its axes of size > 1.
    with pytest.raises(ValueError, match=r"--mesh tp=8 has 8 ranks, not --gpus 4;"):
        suggest(
            DEBUG,
            gpus=4,
            gpu="h100-80gb",
            seq_len=SEQ,
            global_batch_tokens=8 * SEQ,
            mesh={"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 8, "ep": 1},
        )


# ----------------------------------------------------------------------------- published


def test_published_runs_follow_their_split_rule_and_name_what_we_ship():
    from hyper_parallel.analysis.cost_model import list_hardware
    from hyper_parallel.dmodule.model_spec import get_spec

    runs = load_runs()
    expected = split_by_rule(runs)
    assert all(r["split"] == expected[r["id"]] for r in runs)
    fit = [r for r in runs if r["split"] == "fit"]
    assert 0 < len(fit) <= len(runs) // 2
    kinds = set(list_hardware())
    for r in runs:
        assert r["hardware"] in kinds, r["id"]
        get_spec(r["model"])
        assert r["source_url"].startswith("https://")
        measured = r["measured"]
        assert "tokens_per_s_per_gpu" in measured or "tflops_per_gpu" in measured


# ----------------------------------------------------------------------------- top K


def test_top_k_lists_distinct_structures_simplest_first_within_the_models_error():
    from hyper_parallel.analysis.suggest._search import (
        TOLD_APART,
        _Needs,
        _simplicity,
        _structure,
    )

    report = suggest(
        DEBUG, gpus=4, gpu="h100-80gb", seq_len=SEQ, global_batch_tokens=8 * SEQ, top=8
    )
    plans = [(c, p) for c, p, _ in report.plans]
    structures = [_structure(c) for c, _ in plans]
    assert len(set(structures)) == len(structures)  # dp splits are one plan
    fastest = min(p.step_s for _, p in plans)
    band = [c for c, p in plans if p.step_s <= fastest * TOLD_APART]
    assert band == [c for c, _ in plans[: len(band)]]  # the band leads
    needs = _Needs.of([c for c, _ in plans])
    keys = [_simplicity(c, needs) for c in band]
    assert keys == sorted(keys)
    assert len(report.why) == len(plans) and all(report.why)


# ----------------------------------------------------------------------------- precision


def test_bf16_true_halves_the_states_and_the_optimizers_traffic():
    """Under bf16 (mixed precision) a rank holds 4 + 4 + 8 bytes per local element of the
    fp32 masters; under bf16-true 2 + 2 + 4. AdamW reads parameter, gradient and two
    moments and writes parameter and two moments: 7 accesses per element, 4 or 2 bytes
    each, at the memory bandwidth; the difference is 7 x 2 bytes per local element
    (dp_shard=4: a quarter of the model's elements), counted by hand."""
    hw = _known_links()
    common = dict(gpus=4, gpu=hw, seq_len=SEQ, global_batch_tokens=16 * SEQ)
    mixed = LayoutScorer(DEBUG, dtype="bf16", **common).predict(_c(dp_shard=4))
    true = LayoutScorer(DEBUG, dtype="bf16-true", **common).predict(_c(dp_shard=4))
    params = sum(x.numel() for x in DEBUG.config().build().parameters())
    for key, fp32_bytes in (("params", 4), ("grads", 4), ("optimizer", 8)):
        assert mixed.memory[key] == pytest.approx(fp32_bytes * params / 4, rel=1e-3), key
        assert true.memory[key] == pytest.approx(fp32_bytes / 2 * params / 4, rel=1e-3), key
    # The same compute (bf16 either way); the saved activations are the two traces' (bf16
    # either way: the mixed trace saves 1 KiB more per block here, a few fp32 per-token
    # values).
    assert true.memory["activations"] <= mixed.memory["activations"]
    assert true.time["pipeline_or_compute"] == mixed.time["pipeline_or_compute"]
    saved = mixed.time["optimizer"] - true.time["optimizer"]
    assert saved == pytest.approx(7 * 2 * params / 4 / hw.hbm_bandwidth, rel=1e-3)


def test_the_optimizer_steps_peak_is_five_states_a_parameter_counted_by_hand():
    """At AdamW's step activations and the loss are freed, and its multi-tensor path (CUDA's
    default) holds sqrt(exp_avg_sq) of every parameter besides parameter, gradient and two
    moments: 5 x 4 bytes per local element under bf16 (fp32 states), 5 x 2 under
    bf16-true. With the model whole on one GPU and every block checkpointed, that is the
    step's peak (above the backward's states + activations + loss); with nothing
    checkpointed the backward's is. A planted 'the optimizer needs nothing beyond the
    states' fails the first assertion. A CPU's file (``optimizer_temporary`` 0) counts the
    four states alone."""
    hw = _known_links()
    params = sum(x.numel() for x in DEBUG.config().build().parameters())
    for dtype, state in (("bf16", 4), ("bf16-true", 2)):
        scorer = LayoutScorer(
            DEBUG, dtype=dtype, gpus=1, gpu=hw, seq_len=SEQ, global_batch_tokens=SEQ
        )
        full, none = scorer.predict(_c(ac="full")), scorer.predict(_c(ac="none"))
        assert full.optimizer_step_bytes == 5 * state * params, dtype
        assert sum(full.memory.values()) < full.memory_bytes_per_gpu == 5 * state * params, dtype
        assert none.optimizer_step_bytes == 5 * state * params, dtype
        assert none.memory_bytes_per_gpu == sum(none.memory.values()) > 5 * state * params, dtype
        # On a CPU AdamW loops over the parameters: no temporary of them all (calibrate's 0).
        cpu = dataclasses.replace(hw, optimizer_temporary=0.0)
        on_cpu = LayoutScorer(
            DEBUG, dtype=dtype, gpus=1, gpu=cpu, seq_len=SEQ, global_batch_tokens=SEQ
        ).predict(_c(ac="full"))
        assert on_cpu.optimizer_step_bytes == 4 * state * params, dtype
        assert on_cpu.memory_bytes_per_gpu == sum(on_cpu.memory.values()), dtype


def test_suggest_refuses_an_unknown_precision_naming_the_choices():
    with pytest.raises(ValueError, match="fp32, bf16, bf16-true"):
        LayoutScorer(
            DEBUG, gpus=4, gpu="h100-80gb", seq_len=SEQ, global_batch_tokens=16 * SEQ, dtype="fp16"
        )
