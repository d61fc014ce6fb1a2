"""Column generation for the tree-packing LP (HiGHS through scipy.optimize.linprog).

Solve the master (packing_problem.py) over the bundles found so far; its capacity duals are link
prices; the cheapest bundle of each family under those prices (Edmonds over routed rank-to-rank
edges) enters when its reduced cost is negative. The loop stops when no bundle enters (the master
is optimal over all bundles), when the master's value meets the certified price bound or a bound
known from max-flow (no packing can exceed it), or at the time limit.

Plain column generation adds one tree per family per LP solve and creeps (87 solves for a
broadcast on the DGX-1 with its PCIe switch; 55 for an all-gather on 16 fully connected ranks).
So it starts from the columns of a short multiplicative-weights run that pushes every family's
cheapest bundle each round (cheap: oracle calls only) and re-weights them by a restricted LP every
5 rounds, until they meet the max-flow bound or stop gaining. When they meet the bound no column
generation is needed at all; otherwise a few iterations finish and certify the optimum.

`prune` then keeps the fewest heaviest bundles whose re-solved LP stays within a stated fraction.
"""

from __future__ import annotations

import time

import numpy as np

from shardshift.collectives.planning.packing.mwu import mwu_columns
from shardshift.collectives.planning.packing.problem import (
    Bundle,
    LPResult,
    PackingProblem,
    bundle_key,
    restricted_value,
)


def column_generation(
    problem: PackingProblem,
    tol: float = 1e-6,
    max_iterations: int = 500,
    max_seconds: float = 60.0,
    target: float = np.inf,
    warm_rounds: int | None = None,
    seeds: list[tuple[Bundle, int]] = (),
) -> LPResult:
    """Solve the master LP to within `tol` (relative) of optimal.

    target: an upper bound known independently (max-flow), bytes/s; reaching it ends the search.
    warm_rounds: at most this many multiplicative-weights rounds for the starting columns
    (default 3 per family, at least 30); they stop early when re-weighting them stops gaining.
    seeds: (bundle, family) columns known to be good; when they meet `target` nothing else runs.
    """
    start = time.perf_counter()
    goal = target / problem.scale
    if seeds:
        seeded = restricted_value(problem, [b for b, _ in seeds], [f for _, f in seeds])
        if seeded.value >= target * (1 - tol):
            return LPResult(seeded.bundles, seeded.weights, seeded.families, seeded.value, target, 0)
    rounds = warm_rounds if warm_rounds is not None else max(30, 3 * len(problem.families))
    warm = mwu_columns(problem, epsilon=0.5, gap=tol, max_rounds=rounds, target=goal,
                       check_every=5, min_progress=1e-3, push_all=True)  # fmt: skip
    best = warm.reweighted
    if best.value >= target * (1 - tol):  # met the max-flow bound: optimal, nothing to add
        return LPResult(best.bundles, best.weights, best.families, best.value, target, 0)
    unique = {bundle_key(b): (b, f) for b, f in list(seeds) + list(zip(warm.bundles, warm.families))}
    bundles, fam = [b for b, _ in unique.values()], [f for _, f in unique.values()]
    seen = set(unique)
    upper = min(warm.upper, goal)
    for iteration in range(1, max_iterations + 1):
        weights, value, prices, duals = problem.solve_master(bundles, fam)
        if value >= upper * (1 - tol) or time.perf_counter() - start > max_seconds:
            break
        cheapest = problem.cheapest(prices)
        upper = min(upper, problem.bound_from_prices(prices, [c for _, c in cheapest]))
        if value >= upper * (1 - tol):
            break
        added = 0
        for f, (bundle, cost) in enumerate(cheapest):
            # Reduced cost < 0: price below the family's dual (1 for the packing problem).
            if cost < duals[f] * (1 - tol) and bundle_key(bundle) not in seen:
                seen.add(bundle_key(bundle))
                bundles.append(bundle)
                fam.append(f)
                added += 1
        if not added:  # nothing improves: the master is optimal up to solver tolerance
            upper = min(upper, value)
            break
    return problem.result(bundles, fam, weights, value, max(upper, value), iteration)


def prune(problem: PackingProblem, lp: LPResult, keep: float, max_trees: int | None) -> LPResult:
    """Fewest bundles (heaviest first) whose re-solved LP keeps >= `keep` × the LP value.

    Bundles are ranked by weight (relative to their family's total for the concurrent problem);
    the smallest prefix meeting the target is found by bisection, each probe a restricted LP
    re-solve (its value only grows with the prefix). `max_trees` caps the number of trees
    (bundles × trees per bundle) even below the target; the result states its own value.
    """
    if not lp.bundles:
        return lp
    per_bundle = len(lp.bundles[0])
    totals: dict[int, float] = {}
    for f, w in zip(lp.families, lp.weights):
        totals[f] = totals.get(f, 0.0) + w
    order = sorted(
        range(len(lp.bundles)),
        key=lambda j: -(lp.weights[j] / totals[lp.families[j]] if problem.concurrent else lp.weights[j]),
    )
    cap = len(order) if max_trees is None else max(1, max_trees // per_bundle)

    def solve(count: int) -> LPResult:
        chosen = order[:count]
        return restricted_value(problem, [lp.bundles[j] for j in chosen], [lp.families[j] for j in chosen])

    target = keep * lp.value
    lo = len(problem.families) if problem.concurrent else 1  # every family needs a bundle
    hi = max(lo, min(cap, len(order)))
    best = solve(hi)
    if best.value < target:  # the cap binds: report what fits
        return _with_bound(best, lp)
    while lo < hi:
        mid = (lo + hi) // 2
        trial = solve(mid)
        if trial.value >= target:
            hi, best = mid, trial
        else:
            lo = mid + 1
    return _with_bound(best, lp)


def _with_bound(result: LPResult, full: LPResult) -> LPResult:
    return LPResult(result.bundles, result.weights, result.families, result.value,
                    full.upper_bound, full.iterations)  # fmt: skip


