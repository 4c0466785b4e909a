"""A fixed slice of the configuration matrix on 4 gloo ranks (the whole: ``make matrix``).

Each configuration of :data:`tests.matrix.configs.SLICE` is refused by the trainer's
gate and by ``validate`` with the same findings, or trains 2 steps and matches one
device (loss and every first-step gradient, :func:`tests.matrix.checks.judge`).
"""

from __future__ import annotations

import pytest

from tests.matrix.checks import gate, judge, train_vs_one_device
from tests.matrix.configs import SLICE, Config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD_SIZE = 4


def _config(i: int) -> dict:
    c = Config(i, dict(SLICE[i]))
    assert c.world_size == WORLD_SIZE
    return c.train_config()


def test_stages_without_a_block_train_and_match_one_device(dist):
    # pp=2 x dp_shard=2, Interleaved1F1B: 4 stages over 4 units (embedding, 2 blocks,
    # head), so rank 0 holds the embedding's stage and rank 1 the head's, neither with
    # a block: each is one FSDP2 unit (its root). It crashed every rank before.
    cfg = _config(0)
    g = gate(cfg, WORLD_SIZE)
    assert not g["refused"] and not g["validate_extra"], g
    r = dist.run(train_vs_one_device, cfg)[0]
    assert sorted(r["blocks_per_part"]) == [0, 1]  # rank 0: the embedding, layers.1
    loss_err, grad_rel = judge(r)
    assert loss_err <= 1e-5 and grad_rel <= 1e-3


def test_ep_with_a_split_backward_is_refused_by_every_gate_alike():
    # ZBVZeroBubble splits each backward; the routed experts' own FSDP2 unit would
    # reduce before the weight step: refused before any rank builds, validate agreeing.
    g = gate(_config(1), WORLD_SIZE)
    assert g["refused"] and g["validate_missing"] == g["suggest_missing"] == [], g
    assert any("ZBVZeroBubble" in f and "ep=2" in f for f in g["findings"])
    assert g["validate_rc"] == 1


def test_pipelined_moe_with_ep_sp_bf16_and_ac_matches_one_device(dist):
    cfg = _config(2)
    g = gate(cfg, WORLD_SIZE)
    assert not g["refused"] and not g["validate_extra"], g
    judge(dist.run(train_vs_one_device, cfg)[0])
