"""Context parallelism without a process group: the head-tail split, positions, causal
work balance, the model's positions path, the cp layout's configs, and the findings."""

from __future__ import annotations

import pytest
import torch

from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.distributed import MeshLayout
from hyper_parallel.distributed import context_parallel as cp
from hyper_parallel.dmodule import Module
from hyper_parallel.models.common.layers import CausalMask, Linear
from hyper_parallel.models.llama import (
    ScaledDotProductAttention,
    apply_cp,
    apply_tp,
    apply_tp_sp,
    causal_mask,
    preset_config,
)

# --------------------------------------------------------------------------- the split


def test_rank_holds_chunk_i_and_its_mirror():
    seq = torch.arange(16)
    # 2 x cp = 8 chunks of 2: rank i holds chunks i and 7 - i.
    assert cp.shard_sequence(seq, 0, 4, dim=0).tolist() == [0, 1, 14, 15]
    assert cp.shard_sequence(seq, 1, 4, dim=0).tolist() == [2, 3, 12, 13]
    assert cp.shard_sequence(seq, 3, 4, dim=0).tolist() == [6, 7, 8, 9]
    batch = torch.arange(2 * 8).view(2, 8)
    assert cp.shard_sequence(batch, 1, 2).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert cp.shard_sequence(batch.unsqueeze(-1), 0, 2, dim=-2).shape == (2, 4, 1)


@pytest.mark.parametrize(("seq_len", "cp_size"), [(8, 1), (8, 2), (16, 4), (24, 3)])
def test_positions_of_all_ranks_are_the_sequence_once(seq_len, cp_size):
    parts = [cp.positions(seq_len, r, cp_size) for r in range(cp_size)]
    assert all(p.dtype == torch.long and p.numel() == seq_len // cp_size for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(seq_len))
    tokens = torch.arange(100, 100 + seq_len).view(1, -1)
    for r, p in enumerate(parts):  # tokens and positions are cut alike
        assert (cp.shard_sequence(tokens, r, cp_size)[0] - 100).tolist() == p.tolist()


def test_uneven_sequence_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"15 tokens cannot be split head-tail over cp=2") as e:
        cp.shard_sequence(torch.zeros(1, 15), 0, 2)
    assert "divisible by 4 (e.g. 12 or 16)" in str(e.value)
    with pytest.raises(ValueError, match="cp_rank=2 is not a rank of a cp axis of size 2"):
        cp.shard_sequence(torch.zeros(1, 8), 2, 2)
    with pytest.raises(ValueError, match="cp_size=0"):
        cp.positions(8, 0, 0)


def test_odd_arguments_are_refused_not_wrapped_or_aliased():
    batch = torch.arange(16).view(2, 8)
    # dim=2 of [batch, seq] wrapped modulo 2 was the batch dim, cut without a word.
    with pytest.raises(ValueError, match=r"dim=2 is not a dim of a tensor of shape \(2, 8\)"):
        cp.shard_sequence(batch, 0, 2, dim=2)
    with pytest.raises(ValueError, match=r"dim=1 is not a dim of a tensor of shape \(8,\)"):
        cp.shard_sequence(torch.arange(8), 0, 2)
    with pytest.raises(ValueError, match=r"dim=1 is not a dim of a tensor of shape \(\)"):
        cp.shard_sequence(torch.tensor(3), 0, 2)
    with pytest.raises(ValueError, match=r"cp_rank=0.0 is not a rank .* \(an int, 0..1\)"):
        cp.shard_sequence(batch, 0.0, 2)
    with pytest.raises(ValueError, match=r"positions: seq_len=-4; .* an int >= 0"):
        cp.positions(-4, 0, 2)
    with pytest.raises(ValueError, match=r"positions: seq_len=8.0"):
        cp.positions(8.0, 0, 2)
    with pytest.raises(ValueError, match=r"causal_work: cp_size=0"):
        cp.causal_work(8, 0, balanced=False)
    for size in (0, -1):
        with pytest.raises(ValueError, match=rf"chunk_order: cp_size={size}"):
            cp.chunk_order(size)
    # A copy at cp=1 too, as documented: writing into the result leaves the batch alone.
    part = cp.shard_sequence(batch, 0, 1)
    part[:, :2] = -100
    assert batch[:, :2].tolist() == [[0, 1], [8, 9]]
    assert cp.shard_sequence(batch, 1, 2, dim=-1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]


# --------------------------------------------------------------------------- load balance


def _brute_force_work(positions: torch.Tensor, seq_len: int) -> int:
    return int(causal_mask(positions, torch.arange(seq_len)).sum())


@pytest.mark.parametrize(("seq_len", "cp_size"), [(16, 2), (64, 4), (128, 8), (96, 3)])
def test_head_tail_gives_every_rank_the_same_causal_work(seq_len, cp_size):
    work = cp.causal_work(seq_len, cp_size)
    # Counted from the mask itself: the pairs each rank's queries score.
    assert work == [
        _brute_force_work(cp.positions(seq_len, r, cp_size), seq_len) for r in range(cp_size)
    ]
    assert sum(work) == seq_len * (seq_len + 1) // 2
    ratio = max(work) / min(work)
    naive = cp.causal_work(seq_len, cp_size, balanced=False)
    print(
        f"causal work seq={seq_len} cp={cp_size}: head-tail max/min = {ratio:.2f}, "
        f"contiguous max/min = {max(naive) / min(naive):.2f}"
    )
    assert f"{ratio:.2f}" == "1.00"
    # A contiguous split into pieces of m tokens: the first rank scores m (m + 1) / 2
    # pairs, the last (cp - 1) m^2 more: a ratio of 1 + 2 m (cp - 1) / (m + 1), which
    # approaches 2 cp - 1 for long sequences.
    m = seq_len // cp_size
    assert max(naive) / min(naive) == pytest.approx(1 + 2 * m * (cp_size - 1) / (m + 1))


# --------------------------------------------------------------------------- the model


def _model(**overrides):
    model = preset_config("llama3-debug", **overrides).build()
    torch.manual_seed(0)
    model.init_states()
    return model


def _tokens(bsz=2, seq_len=12):
    return torch.randint(0, 256, (bsz, seq_len), generator=torch.Generator().manual_seed(3))


def test_positions_in_order_match_the_causal_path():
    model, tokens = _model(), _tokens()
    with torch.no_grad():
        plain = model(tokens)
        explicit = model(tokens, positions=torch.arange(12))
        batched = model(tokens, positions=torch.arange(12).expand(2, -1))
    torch.testing.assert_close(explicit, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(batched, explicit, atol=1e-6, rtol=0)


def test_tokens_in_any_order_with_their_positions_give_the_same_logits():
    model, tokens = _model(), _tokens(seq_len=16)
    order = torch.cat([cp.positions(16, r, 4) for r in range(4)])  # head-tail, all ranks
    with torch.no_grad():
        expected = model(tokens)
        permuted = model(tokens[:, order], positions=order)
    torch.testing.assert_close(permuted, expected[:, order], atol=1e-5, rtol=0)


def test_queries_against_a_longer_key_sequence_use_global_positions():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8), torch.randn(1, 8, 2, 8)
    core = ScaledDotProductAttention.Config().build()
    full = core(q, k, v)
    mine = cp.positions(8, 1, 2)  # [2, 3, 4, 5]: this rank's queries, every key
    mask = CausalMask.Config().build()(mine, torch.arange(8))
    assert mask.shape == (4, 8) and mask.dtype == torch.float32
    # Additive: 0 where key position <= query position, -inf elsewhere.
    assert torch.equal(mask == 0, mine.unsqueeze(-1) >= torch.arange(8))
    local = core(q[:, mine], k, v, mask)
    torch.testing.assert_close(local, full[:, mine], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="4 queries and 8 keys cannot be masked causally"):
        core(q[:, mine], k, v)


def test_one_mask_is_saved_for_every_layer():
    """The causal mask is built once per forward: backward holds one copy, not one per layer."""
    model, tokens = _model(), _tokens(seq_len=16)
    masks = []

    def pack(t):
        if t.ndim == 2 and t.shape == (16, 16) and t.dtype == torch.float32:
            masks.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, positions=torch.arange(16)).sum()
    assert len(masks) == len(model.layers) and len(set(masks)) == 1


def test_rope_reads_the_tables_at_global_positions_exactly():
    model = _model()
    cos, sin = model.rope(12)
    pos = torch.tensor([3, 11, 0])
    cos_at, sin_at = model.rope(12, pos)
    assert torch.equal(cos_at, cos[pos]) and torch.equal(sin_at, sin[pos])
    with pytest.raises(ValueError, match="600 tokens exceeds max_seq_len=512"):
        model.rope(600, pos)


# --------------------------------------------------------------------------- configs


def _configs(config):
    return {
        path: c.sharding_config
        for path, c, *_ in config.traverse(Module.Config)
        if getattr(c, "sharding_config", None) is not None
    }


def test_cp_layout_gathers_keys_and_values_and_declares_their_gradients_partial():
    config = apply_cp(preset_config("llama3-debug"), cp_size=2)
    core = config.layers[0].attention.inner_attention.sharding_config
    seq, gathered = {"cp": Shard(1)}, {"cp": Replicate()}
    # No mask among the core's inputs: it computes by chunks (nothing S/cp x S).
    assert core.in_dst_shardings == {"q": seq, "k": gathered, "v": gathered}
    assert core.in_src_shardings == {"k": seq, "v": seq}
    grads = core.local_map.in_grad_placements
    assert grads == (seq, {"cp": Partial()}, {"cp": Partial()})
    # The mask module has no placement; positions enter as this rank's slice, never gathered.
    assert config.mask.sharding_config is None
    assert config.sharding_config.in_src_shardings == {"positions": {"cp": Shard(-1)}}
    assert config.sharding_config.in_dst_shardings is None
    assert config.output.sharding_config.out_dst_shardings == seq
    assert config.layers[1].feed_forward.w2.sharding_config.state_shardings == {"weight": gathered}


@pytest.mark.parametrize("tp_layout", [apply_tp, apply_tp_sp])
def test_cp_and_tp_layouts_compose_in_either_order(tp_layout):
    base = preset_config("llama3-debug")
    cp_last = apply_cp(tp_layout(base, tp_size=2), cp_size=2)
    cp_first = tp_layout(apply_cp(base, cp_size=2), tp_size=2)
    a, b = _configs(cp_last), _configs(cp_first)
    # root, embedding, rope, final norm, output; per layer 2 norms, 2 blocks, 7
    # linears, core
    assert a.keys() == b.keys() and len(a) == 5 + 2 * 12
    for path in a:
        assert a[path].to_dict() == b[path].to_dict(), path
    core = cp_last.layers[0].attention.inner_attention.sharding_config
    assert core.in_dst_shardings["k"] == {"tp": Shard(2), "cp": Replicate()}
    assert core.local_map.in_grad_placements[1] == {"tp": Shard(2), "cp": Partial()}
    assert len(core.local_map.in_grad_placements) == 3  # q, k, v: no mask
    assert base.sharding_config is None  # the input config is not changed


def test_apply_cp_refuses_bad_sizes_and_a_second_application():
    config = preset_config("llama3-debug")
    with pytest.raises(ValueError, match=r"cp_size=0; it must be an integer >= 1"):
        apply_cp(config, cp_size=0)
    with pytest.raises(TypeError, match=r"expected the Llama Transformer\.Config, got Config"):
        apply_cp(config.layers[0], cp_size=2)
    once = apply_cp(config, cp_size=2)
    with pytest.raises(ValueError, match="already places axis 'cp'"):
        apply_cp(once, cp_size=2)
    tp = apply_tp(config, tp_size=2)
    with pytest.raises(ValueError, match="already places axis 'tp'"):
        apply_tp_sp(tp, tp_size=2)


# --------------------------------------------------------------------------- findings


def _fields(findings):
    return [(f.path, f.field) for f in findings]


def test_a_runnable_combination_has_no_findings():
    config = apply_cp(apply_tp_sp(preset_config("llama3-debug"), tp_size=2), cp_size=2)
    assert cp.cp_findings(config, MeshLayout.parse("cp=2,tp=2"), seq_len=16) == []
    assert cp.cp_findings(preset_config("llama3-debug"), MeshLayout.parse("tp=4"), 15) == []


def test_sequence_not_divisible_by_twice_cp():
    (f,) = cp.cp_findings(preset_config("llama3-debug"), MeshLayout.parse("cp=2"), seq_len=30)
    assert (f.severity, f.path, f.field) == ("error", "data", "seq_len")
    assert "30 tokens cannot be split head-tail over cp=2" in f.message
    assert "(--seq; --seq-len on train.run and demo) to a multiple of 4 (e.g. 28 or 32)" in f.fix
    assert "cp among [3, 5" in f.fix


def test_cp_on_a_model_without_positions():
    config = Linear.Config(in_features=4, out_features=4)
    (f,) = cp.cp_findings(config, MeshLayout.parse("cp=2"), seq_len=8)
    assert (f.path, f.field) == ("", "forward")
    assert "Linear.forward takes no 'positions'" in f.message
    assert "put those ranks on dp_shard" in f.fix


def test_tp_larger_than_the_key_value_heads_names_a_layout_that_fits():
    config = preset_config("llama3-debug")  # 8 query heads, 4 key/value heads
    (f,) = cp.cp_findings(config, MeshLayout.parse("tp=8"), seq_len=16)
    assert (f.path, f.field) == ("layers.0.attention", "tp")
    assert "tp=8 is larger than the 4 key/value heads" in f.message
    assert "use tp=4" in f.fix and "cp=2" in f.fix


def test_tp_not_dividing_the_heads():
    config = preset_config("llama3-debug", num_heads=8, num_kv_heads=8, dim=64)
    (f,) = cp.cp_findings(config, MeshLayout.parse("cp=2,tp=3"), seq_len=16)
    assert "tp=3 does not divide the 8 key/value heads" in f.message
    assert "[1, 2, 4, 8]" in f.fix


def test_cp_by_tp_sequence_conflict_under_sequence_parallelism():
    config = apply_cp(apply_tp_sp(preset_config("llama3-debug"), tp_size=4), cp_size=2)
    layout = MeshLayout.parse("cp=2,tp=4")
    (f,) = cp.cp_findings(config, layout, seq_len=20)
    assert (f.path, f.field) == ("data", "seq_len")
    assert "each cp rank's 10 tokens are split again over tp=4" in f.message
    assert "cp x lcm(2, tp) = 8" in f.fix
    plain_tp = apply_cp(apply_tp(preset_config("llama3-debug"), tp_size=4), cp_size=2)
    assert cp.cp_findings(plain_tp, layout, seq_len=20) == []  # no sequence split on tp


def test_uneven_cp_sequence_under_sequence_parallelism_offers_lengths_tp_splits_too():
    # It offered 28 or 32 for cp=2 x tp=3 with sp: 14 and 16 tokens per cp rank do not
    # split over tp=3 either.
    heads = preset_config("llama3-debug", num_heads=6, num_kv_heads=6, dim=48)
    config = apply_cp(apply_tp_sp(heads, tp_size=3), cp_size=2)
    layout = MeshLayout.parse("cp=2,tp=3")
    (f,) = [f for f in cp.cp_findings(config, layout, seq_len=30) if f.field == "seq_len"]
    assert "needs 2 x cp = 4 equal chunks" in f.message
    assert "to a multiple of cp x lcm(2, tp) = 12 (e.g. 24 or 36), or use cp among [5]." in f.fix
    for n in (24, 36):
        assert [f for f in cp.cp_findings(config, layout, seq_len=n) if f.field == "seq_len"] == []
    five = MeshLayout.parse("cp=5,tp=3")
    assert [f for f in cp.cp_findings(config, five, seq_len=30) if f.field == "seq_len"] == []


def test_sequence_longer_than_the_rotary_tables():
    (f,) = cp.cp_findings(preset_config("llama3-debug"), MeshLayout.parse("cp=2"), 1024)
    assert (f.path, f.field) == ("rope", "max_seq_len")
    assert "max_seq_len >= 1024" in f.fix


def test_parallelize_on_a_mesh_without_cp_is_refused_and_changes_nothing(mesh):
    model = apply_cp(preset_config("llama3-debug"), cp_size=4).build()
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"not in mesh: \['cp'\]") as e:
        model.parallelize(mesh)  # a 1-D "tp" mesh
    assert "layers.0.attention.inner_attention" in str(e.value)
    assert {n: p for n, p in model.named_parameters()} == before
    assert not any(isinstance(p, DTensor) for p in model.parameters())
