"""A pairwise covering array under constraints: greedy, one row at a time, seeded.

Given switches (each a name and its values) and a predicate saying which (partial)
assignments are allowed, :func:`pairwise` returns rows (full assignments, each allowed)
such that every pair of values of two switches that occurs in *some* allowed row occurs
in at least one returned row. Pairs no allowed row holds are returned apart
(:attr:`Covering.impossible`), so a constraint cannot silently drop coverage.

The construction is AETG's (Cohen et al., 1997): each new row starts from an uncovered
pair, fills the other switches one at a time in a seeded random order with the value
that covers the most uncovered pairs (ties: the seeded random order), keeping only
values from which the row can still be completed, and the best of a few candidate rows
is kept. Deterministic for a given seed.

Example:
    >>> c = pairwise({"a": (0, 1), "b": (0, 1), "c": (0, 1)}, seed=0)
    >>> len(c.rows) <= 6 and not c.uncovered(c.rows)
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Covering", "all_pairs", "pairwise"]

Row = dict[str, Any]
Pair = tuple[tuple[str, Any], tuple[str, Any]]
Allowed = Callable[[Mapping[str, Any]], bool]


@dataclasses.dataclass(frozen=True)
class Covering:
    """Rows covering every possible pair, and the pairs no allowed row holds."""

    switches: dict[str, tuple[Any, ...]]
    rows: list[Row]
    impossible: list[Pair]

    def uncovered(self, rows: Sequence[Mapping[str, Any]]) -> list[Pair]:
        """The possible pairs ``rows`` do not hold (empty for :attr:`rows`)."""
        held = {p for r in rows for p in _pairs_of(r, self.switches)}
        gone = set(self.impossible)
        return [p for p in all_pairs(self.switches) if p not in held and p not in gone]


def all_pairs(switches: Mapping[str, Sequence[Any]]) -> list[Pair]:
    """Every pair of values of two different switches, in a fixed order."""
    names = list(switches)
    return [
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in switches[a]
        for vb in switches[b]
    ]


def _pairs_of(row: Mapping[str, Any], switches: Mapping[str, Sequence[Any]]) -> list[Pair]:
    names = [n for n in switches if n in row]
    return [((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)]


def _complete(
    row: Row, order: Sequence[str], switches: Mapping[str, Sequence[Any]], allowed: Allowed
) -> Row | None:
    """An allowed full row extending ``row`` (depth-first, values in the given order)."""
    if not allowed(row):
        return None
    rest = [n for n in order if n not in row]
    if not rest:
        return dict(row)
    name = rest[0]
    for value in switches[name]:
        done = _complete({**row, name: value}, rest, switches, allowed)
        if done is not None:
            return done
    return None


def pairwise(
    switches: Mapping[str, Sequence[Any]],
    allowed: Allowed = lambda row: True,
    *,
    seed: int = 0,
    candidates: int = 8,
) -> Covering:
    """A covering array of strength 2 over ``switches`` under ``allowed`` (module doc).

    Args:
        switches: Each switch's values (hashable), in order.
        allowed: Whether a partial assignment can still be part of an allowed row:
            it must return ``False`` only when no completion is allowed (the search
            prunes on it) and decide full rows exactly.
        seed: Seeds the order in which switches are filled and ties are broken.
        candidates: Candidate rows built per new row; the one covering most is kept.

    Returns:
        The rows, and the pairs that no allowed row holds.
    """
    switches = {n: tuple(v) for n, v in switches.items()}
    rng = random.Random(seed)
    names = list(switches)
    uncovered: set[Pair] = set()
    impossible: list[Pair] = []
    for pair in all_pairs(switches):
        (a, va), (b, vb) = pair
        if _complete({a: va, b: vb}, names, switches, allowed) is None:
            impossible.append(pair)
        else:
            uncovered.add(pair)
    ordered = [p for p in all_pairs(switches) if p in uncovered]
    rows: list[Row] = []
    while uncovered:
        start = next(p for p in ordered if p in uncovered)
        best: Row | None = None
        best_gain = -1
        for _ in range(candidates):
            row = _candidate(start, switches, allowed, uncovered, rng)
            gain = sum(p in uncovered for p in _pairs_of(row, switches))
            if gain > best_gain:
                best, best_gain = row, gain
        assert best is not None
        rows.append({n: best[n] for n in names})
        uncovered -= set(_pairs_of(best, switches))
    return Covering(switches, rows, impossible)


def _candidate(
    start: Pair,
    switches: Mapping[str, tuple[Any, ...]],
    allowed: Allowed,
    uncovered: set[Pair],
    rng: random.Random,
) -> Row:
    (a, va), (b, vb) = start
    row: Row = {a: va, b: vb}
    rest = [n for n in switches if n not in row]
    rng.shuffle(rest)
    names = list(switches)
    for name in rest:
        values = list(switches[name])
        rng.shuffle(values)
        scored = []
        for value in values:
            trial = {**row, name: value}
            if _complete(trial, names, switches, allowed) is None:
                continue
            gain = sum(
                ((n, row[n]), (name, value)) in uncovered
                or ((name, value), (n, row[n])) in uncovered
                for n in row
            )
            scored.append((gain, value))
        # ``start`` is completable, so some value of each switch keeps the row completable.
        gain, value = max(scored, key=lambda gv: gv[0])
        row[name] = value
    return row
