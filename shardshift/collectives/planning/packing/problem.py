"""The tree-packing LP's data: families, bundles, the master problem, and its solution.

A *bundle* is what one LP variable buys: one routed tree (broadcast, reduce, all-gather,
reduce-scatter), or an in-tree and an out-tree at the same root (all-reduce: the piece reduced up
the first is broadcast down the second, so both carry the same rate). Bundles belong to *families*:
the root (and directions) they serve. Two master problems, over capacities c (one per link):

  packing     max Σ_b y_b            s.t.  Σ_b use_b(e) y_b <= c_e,  y >= 0
              (broadcast/reduce: one family; all-reduce: one family per root, shares free)
  concurrent  max x                  s.t.  the same capacity rows, and Σ_{b in f} y_b = x per family
              (all-gather/reduce-scatter: every root gets the same rate x)

Any link prices p >= 0 certify an upper bound: Σ_b y_b·price(b) <= p·c for every feasible y, so

  packing:    value <= p·c / min_f price_f          concurrent:  x <= p·c / Σ_f price_f

where price_f is the cheapest bundle of family f under p. Column generation (packing_lp.py) and
multiplicative weights (packing_mwu.py) both use these.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from shardshift.collectives.planning.ops import Direction
from shardshift.collectives.planning.routing import RoutePricer, TreeColumn
from shardshift.collectives.topology.model import Topology

Bundle = tuple[TreeColumn, ...]


@dataclass(frozen=True)
class Family:
    """Bundles of one root: one tree per direction listed (all-reduce: (IN, OUT))."""

    root: int
    directions: tuple[Direction, ...]


@dataclass(frozen=True)
class LPResult:
    """Bundles with positive weight and the master's value, in bytes/s."""

    bundles: tuple[Bundle, ...]
    weights: tuple[float, ...]  # bytes/s per bundle
    families: tuple[int, ...]  # family index of each bundle
    value: float  # packing: Σ weights; concurrent: the common per-family rate x
    upper_bound: float  # certified bound on the LP optimum from the last prices, bytes/s
    iterations: int


class PackingProblem:
    """The master LP data for one topology and set of families (see module docstring)."""

    def __init__(self, topology: Topology, families: list[Family], concurrent: bool,
                 shallow: bool = False):
        self.topology = topology
        self.families = families
        self.concurrent = concurrent
        self.shallow = shallow  # only trees of depth <= 2 (arborescence.shallow_out_tree)
        self.pricer = RoutePricer(topology)
        caps = topology.capacities()
        self.scale = float(caps.max())  # capacities are normalised to <= 1 for the solver
        self.capacity = caps / self.scale

    def cheapest(self, link_prices: np.ndarray) -> list[tuple[Bundle, float]]:
        """The cheapest bundle of every family under `link_prices`, with its price."""
        prices = self.pricer.price(link_prices)
        out = []
        for family in self.families:
            parts = [prices.cheapest_tree(family.root, d, self.shallow) for d in family.directions]
            out.append((tuple(t for t, _ in parts), sum(c for _, c in parts)))
        return out

    def solve_master(self, bundles: list[Bundle], fam: list[int]):
        """Solve the master over `bundles`. Returns (weights, value, link prices, family duals)."""
        k, m, nf = len(bundles), len(self.capacity), len(self.families)
        rows, cols, vals = [], [], []
        for j, bundle in enumerate(bundles):
            for tree in bundle:
                rows.append(tree.link_ids)
                cols.append(np.full(len(tree.link_ids), j))
                vals.append(tree.link_uses)
        shift = 1 if self.concurrent else 0  # variable 0 is x in the concurrent problem
        a_ub = sp.csr_array(
            (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols) + shift)),
            shape=(m, k + shift),
        )
        if self.concurrent:
            cost = np.r_[-1.0, np.zeros(k)]
            eq_rows = np.r_[np.arange(nf), np.asarray(fam)]
            eq_cols = np.r_[np.zeros(nf, dtype=int), np.arange(k) + 1]
            eq_vals = np.r_[-np.ones(nf), np.ones(k)]
            a_eq = sp.csr_array((eq_vals, (eq_rows, eq_cols)), shape=(nf, k + 1))
            res = linprog(cost, A_ub=a_ub, b_ub=self.capacity, A_eq=a_eq, b_eq=np.zeros(nf),
                          bounds=(0, None), method=_method(a_ub))  # fmt: skip
        else:
            res = linprog(-np.ones(k), A_ub=a_ub, b_ub=self.capacity, bounds=(0, None), method=_method(a_ub))
        assert res.status == 0, f"master LP failed: {res.message}"
        prices = np.maximum(-res.ineqlin.marginals, 0.0)
        duals = res.eqlin.marginals if self.concurrent else np.ones(nf)
        weights = res.x[shift:]
        return weights, -res.fun, prices, duals

    def bound_from_prices(self, prices: np.ndarray, cheapest_costs: list[float]) -> float:
        """Upper bound on the LP optimum (normalised units) certified by link prices."""
        total = float(prices @ self.capacity)
        denom = sum(cheapest_costs) if self.concurrent else min(cheapest_costs)
        return np.inf if denom <= 0 else total / denom

    def result(self, bundles, fam, weights, value, upper, iterations) -> LPResult:
        """Keep the bundles with weight > 0 and convert to bytes/s."""
        keep = [j for j, w in enumerate(weights) if w > 1e-12]
        return LPResult(
            tuple(bundles[j] for j in keep),
            tuple(float(weights[j]) * self.scale for j in keep),
            tuple(fam[j] for j in keep),
            value * self.scale,
            upper * self.scale,
            iterations,
        )


_INTERIOR_POINT_NONZEROS = 200_000


def _method(a_ub) -> str:
    """HiGHS's choice (dual simplex here) for the LPs of up to some thousands of links and trees;
    its interior point method beyond, where it is faster: 1.7 s against 2.5 s for 330 tree pairs
    over a 1,024-host fat tree's 4,096 links (760,000 nonzeros, 1,471 simplex iterations)."""
    return "highs-ipm" if a_ub.nnz > _INTERIOR_POINT_NONZEROS else "highs"


def restricted_value(problem: PackingProblem, bundles: list[Bundle], fam: list[int], with_prices: bool = False):
    """Re-solve the master over a fixed set of bundles (no new columns). `with_prices`: also
    return the link prices (the LP's capacity duals; None when some family has no bundle)."""
    if problem.concurrent and len(set(fam)) < len(problem.families):
        result, prices = problem.result([], [], [], 0.0, 0.0, 0), None
    else:
        weights, value, prices, _ = problem.solve_master(bundles, fam)
        result = problem.result(bundles, fam, weights, value, value, 0)
    return (result, prices) if with_prices else result


def bundle_key(bundle: Bundle) -> tuple:
    return tuple(t.key for t in bundle)
