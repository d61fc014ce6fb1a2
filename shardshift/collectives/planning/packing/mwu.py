"""Multiplicative weights (Garg–Könemann) for the tree-packing LP on large topologies.

Every link e carries a length ℓ_e, initially 1/c_e. Each round takes the shortest column under ℓ
(the same Edmonds oracle as column generation), pushes as much rate along it as its bottleneck
link allows, f = min_e c_e / use(e), and lengthens every link it used:

    ℓ_e ← ℓ_e · (1 + ε · f · use(e) / c_e)

so congested links become expensive and later columns avoid them. A column here is one bundle for
the packing problem, and one bundle *per family* for the concurrent problem (all-gather, where
every root must get the same rate: a column that serves all roots at once keeps them equal).

Two numbers are known at every round, so the loop stops when they meet rather than after the
worst-case round count of the analysis:

  feasible value   total pushed / max_e (load_e / c_e)      (the pushes scaled down to fit)
  upper bound      Σ_e c_e ℓ_e / length of the shortest column   (weak duality, any ℓ >= 0)

The columns found are re-weighted by a restricted LP solve (`restricted_value`), which can only
raise the value (the scaled pushes are one of its feasible points) and in practice raises it a lot:
on a 256-host fat tree the pushes of 200 rounds reach 0.94 of the optimum and their re-weighting
0.99. So `multiplicative_weights` re-solves every `check_every` rounds and stops as soon as the
re-weighted value is within `gap` of the best upper bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from shardshift.collectives.planning.packing.problem import (
    Bundle,
    LPResult,
    PackingProblem,
    bundle_key,
    restricted_value,
)


@dataclass(frozen=True)
class MWURun:
    """Columns found by a multiplicative-weights run, and its two certified numbers."""

    bundles: tuple[Bundle, ...]
    families: tuple[int, ...]
    feasible: float  # value of the scaled pushes, normalised units
    upper: float  # best price bound seen, normalised units
    rounds: int
    reweighted: LPResult | None  # the columns re-weighted by the restricted LP (when checking)


def mwu_columns(
    problem: PackingProblem,
    epsilon: float = 0.1,
    gap: float = 0.03,
    max_rounds: int = 5000,
    max_seconds: float = 25.0,
    target: float = np.inf,
    check_every: int | None = None,
    min_progress: float | None = None,
    patience: int = 1,
    push_all: bool = False,
    price_bound: bool = False,
) -> MWURun:
    """Run Garg–Könemann until a value >= (1 - gap) × upper bound is certified, or the limits.

    epsilon: step size (smaller: more accurate per round, slower to move).
    target: a value known to be an upper bound (e.g. from max-flow), normalised units.
    check_every: re-weight the columns by a restricted LP every this many rounds and stop when
    that value is close enough (None: judge by the scaled pushes only).
    min_progress: also stop when `patience` re-weightings in a row each gain less than this
    (relative) over the one before.
    push_all: push every family's cheapest bundle each round, not only the cheapest overall (for
    the packing problem this finds columns faster, which is all a warm start needs; it is no
    longer Garg–Könemann's rule, but the bound and the feasible value stay valid).
    price_bound: at every check also price the columns under the re-weighting LP's duals, whose
    weak-duality bound is tight once the columns are nearly optimal, where the one from the
    lengths stays loose. Without it a run whose max-flow `target` cannot be reached (all-reduce
    on a rail cluster, where the hosts' NICs bind first) only ends at its time limit, the value
    long flat. When `target` is the optimum, the bound cannot go below it and changes nothing.
    """
    if not 0 < epsilon < 1 or not 0 <= gap < 1:
        raise ValueError(f"need 0 < epsilon < 1 and 0 <= gap < 1, got epsilon={epsilon}, gap={gap}")
    start = time.perf_counter()
    cap = problem.capacity  # (links,), normalised
    length = 1.0 / cap
    load = np.zeros_like(cap)  # rate pushed across each link, summed over rounds
    pushed = feasible = 0.0
    upper = np.inf
    columns: dict[tuple, tuple[Bundle, int]] = {}  # first occurrence order
    reweighted: LPResult | None = None
    reweighted_at = rounds = stalled = 0  # the round whose columns `reweighted` covers; checks without gain
    for rounds in range(1, max_rounds + 1):
        cheapest = problem.cheapest(length)
        costs = [c for _, c in cheapest]
        # Weak duality holds for any lengths, whatever is pushed below.
        upper = min(upper, float(cap @ length) / (sum(costs) if problem.concurrent else min(costs)))
        if problem.concurrent or push_all:
            chosen = list(range(len(cheapest)))  # one bundle for every family
        else:
            chosen = [int(np.argmin(costs))]
        use = np.zeros_like(cap)
        for f in chosen:
            bundle = cheapest[f][0]
            columns.setdefault(bundle_key(bundle), (bundle, f))
            for tree in bundle:
                np.add.at(use, tree.link_ids, tree.link_uses)
        used = use > 0
        step = float(np.min(cap[used] / use[used]))
        load += step * use
        pushed += step if problem.concurrent else step * len(chosen)  # objective gained
        length = length * (1 + epsilon * step * use / cap)
        length /= length.max()  # the oracle and the bound are scale-free; avoid overflow
        feasible = pushed / float(np.max(load / cap))
        goal = (1 - gap) * min(upper, target)
        if feasible >= goal or time.perf_counter() - start > max_seconds:
            break
        if check_every and rounds % check_every == 0:
            last = reweighted.value if reweighted is not None else 0.0
            reweighted, dual_bound = _reweigh(problem, columns, price_bound)
            reweighted_at = rounds
            upper = min(upper, dual_bound)
            goal = (1 - gap) * min(upper, target)
            gained = min_progress is None or reweighted.value >= last * (1 + min_progress)
            stalled = 0 if gained else stalled + 1
            if reweighted.value / problem.scale >= goal or stalled >= patience:
                break
    if check_every and reweighted_at != rounds:
        reweighted, _ = _reweigh(problem, columns, False)
    return MWURun(
        tuple(b for b, _ in columns.values()),
        tuple(f for _, f in columns.values()),
        feasible,
        upper,
        rounds,
        reweighted,
    )


def _reweigh(problem: PackingProblem, columns: dict, price_bound: bool) -> tuple[LPResult, float]:
    """The columns re-weighted by the restricted LP, and the bound its duals certify (normalised
    units; inf unless `price_bound`)."""
    bundles, families = [b for b, _ in columns.values()], [f for _, f in columns.values()]
    if not price_bound:
        return restricted_value(problem, bundles, families), np.inf
    result, prices = restricted_value(problem, bundles, families, with_prices=True)
    if prices is None:
        return result, np.inf
    return result, problem.bound_from_prices(prices, [cost for _, cost in problem.cheapest(prices)])


def multiplicative_weights(
    problem: PackingProblem,
    epsilon: float = 0.1,
    gap: float = 0.03,
    max_seconds: float = 25.0,
    target: float = np.inf,
    patience: int | None = None,
) -> LPResult:
    """Approximate the master LP: Garg–Könemann columns, re-weighted by restricted LPs every 25
    rounds, until within `gap` of the best upper bound (see `mwu_columns`, `price_bound`), or,
    with `patience`, once that many re-weightings in a row gained less than 0.1% each."""
    run = mwu_columns(problem, epsilon, gap, max_seconds=max_seconds, target=target, check_every=25,
                      min_progress=None if patience is None else 1e-3, patience=patience or 1,
                      price_bound=True)  # fmt: skip
    reweighted = run.reweighted
    return LPResult(
        reweighted.bundles,
        reweighted.weights,
        reweighted.families,
        reweighted.value,  # >= the scaled pushes, which are feasible for the restricted LP
        max(run.upper * problem.scale, reweighted.value),
        run.rounds,
    )
