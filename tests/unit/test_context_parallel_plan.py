"""The dry run under context parallelism: what cp=2 saves per rank against cp=1.

Its own module: the dry run builds its own fake process group, so no other test's
mesh may be alive while it runs.
"""

from __future__ import annotations

import json


def test_plan_at_cp2_halves_the_states_and_the_activations_of_cp1(capsys):
    """llama3-8b, tp=8, one global sequence of 8192: cp=2 against cp=1, per rank.

    FSDP2 shards the states over cp (fsdp = dp_shard x cp); each rank saves its own
    tokens' activations, and the one causal mask every layer shares.
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
