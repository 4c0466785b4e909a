"""The covering array: every possible pair of switch values in some allowed row, seeded."""

from __future__ import annotations

import itertools

import pytest

from tests.matrix.configs import EIGHT_RANKS, PROBES, SWITCHES, allowed, covering, matrix
from tests.matrix.covering import all_pairs, pairwise


def _brute_possible(switches, allowed_fn):
    """Every pair held by some allowed full row (by enumerating all rows)."""
    names = list(switches)
    held = set()
    for values in itertools.product(*(switches[n] for n in names)):
        row = dict(zip(names, values, strict=True))
        if allowed_fn(row):
            held |= {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}
    return held


SMALL = {"a": (0, 1, 2), "b": ("x", "y"), "c": (0, 1), "d": (True, False), "e": (1, 2, 3)}


def _small_allowed(row):
    # A constraint in the shape of the matrix's: a budget, and one value excluding another.
    if row.get("a", 0) + row.get("e", 1) > 4:
        return False
    return not (row.get("b") == "y" and row.get("d") is True)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_every_possible_pair_is_covered_and_every_row_allowed(seed):
    c = pairwise(SMALL, _small_allowed, seed=seed)
    possible = _brute_possible(SMALL, _small_allowed)
    held = {((a, r[a]), (b, r[b])) for r in c.rows for a, b in itertools.combinations(SMALL, 2)}
    assert possible <= held
    assert all(_small_allowed(r) and set(r) == set(SMALL) for r in c.rows)
    # What is reported impossible is exactly what no allowed row holds.
    assert set(c.impossible) == set(all_pairs(SMALL)) - possible
    assert c.uncovered(c.rows) == []
    # Far fewer rows than the 72 of the full product; at least the largest pair product.
    assert 9 <= len(c.rows) <= 20


def test_a_missing_row_leaves_pairs_uncovered():
    c = pairwise(SMALL, _small_allowed, seed=0)
    # Each row is kept because it covers some pair first: dropping one loses a pair.
    assert any(c.uncovered(c.rows[:i] + c.rows[i + 1 :]) for i in range(len(c.rows)))


def test_the_array_is_deterministic_for_a_seed():
    assert (
        pairwise(SMALL, _small_allowed, seed=3).rows == pairwise(SMALL, _small_allowed, seed=3).rows
    )


def test_the_matrix_covers_every_pair_of_switch_values_it_can():
    c = covering()
    assert c.uncovered(c.rows) == []
    assert all(allowed(r) for r in c.rows)
    # Only pairs the constraints exclude are left out, and each is truly excluded.
    for (a, va), (b, vb) in c.impossible:
        assert not any(allowed({**r, a: va, b: vb}) for r in c.rows)
    # Every schedule with every data axis (and tp and cp) of size 2.
    for schedule in SWITCHES["pipeline"][1:]:
        for axis in ("dp_replicate", "dp_shard", "cp", "tp"):
            assert any(r["pipeline"] == schedule and r[axis] == 2 for r in c.rows), (
                schedule,
                axis,
            )
    # Every family with every pipeline, dtype, ac and compile value.
    for family in SWITCHES["family"]:
        for switch in ("pipeline", "dtype", "ac", "compile", "microbatches"):
            for value in SWITCHES[switch]:
                assert (
                    any(r["family"] == family and r[switch] == value for r in c.rows)
                    or (
                        ("family", family),
                        (switch, value),
                    )
                    in c.impossible
                )


def test_matrix_runs_are_on_four_ranks_and_a_few_on_eight():
    configs = matrix()
    sizes = [c.world_size for c in configs]
    assert sizes.count(8) == len(EIGHT_RANKS) >= 3
    assert all(s == 4 for s in sizes[: -len(EIGHT_RANKS)])
    # The refusal probes are outside the constraints (the covering array never holds them).
    assert not any(allowed(p) for p in PROBES)
    # Every configuration names all the switches, and its trainer config is complete.
    for c in configs:
        assert set(SWITCHES) <= set(c.switches)
        cfg = c.train_config()
        assert cfg["steps"] == 2 and cfg["model"] == c.switches["family"]
