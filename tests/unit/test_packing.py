"""Bounds (max-flow / min-cut) and tree packings: worked values, brute force, theory, soundness."""

from __future__ import annotations

import itertools
import json

import networkx as nx
import numpy as np
import pytest

from shardshift.cli.main import main
from shardshift.collectives.planning import arborescence
from shardshift.collectives.planning.arborescence import (
    min_in_tree,
    min_out_tree,
    shallow_in_tree,
    shallow_out_tree,
    tree_cost,
)
from shardshift.collectives.planning.bounds import (
    allgather_bound,
    allreduce_bound,
    broadcast_bound,
    cut_bound,
    reduce_bound,
    reducescatter_bound,
)
from shardshift.collectives.planning.ops import Collective, Direction
from shardshift.collectives.planning.packing import Depth, Method, PackOptions, pack
from shardshift.collectives.planning.rings import ring_packing, ring_rate
from shardshift.collectives.planning.routing import RoutePricer
from shardshift.collectives.topology.io import load_topology
from shardshift.collectives.topology.model import Link, Topology
from shardshift.collectives.topology.presets import cluster, dgx1v, fat_tree, full, ring
from support import DOCS

UNIT = 25e9  # one NVLink, bytes/s
EXACT = PackOptions(keep=1.0)  # no pruning: the LP optimum itself
OPS = [op.value for op in Collective]


def random_topology(seed: int, switches: int = 0, fractional: bool = False) -> Topology:
    """A strongly connected random network: ranks in a ring plus random extra links; switches
    get symmetric links (equal capacity both ways) to a few ranks and to each other."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 6))
    caps: dict[tuple[int, int], float] = {}

    def cap() -> float:
        return float(rng.integers(1, 5)) * (0.75 if fractional and rng.random() < 0.5 else 1.0)

    for i in range(n):
        caps[(i, (i + 1) % n)] = cap()
    for a, b in itertools.permutations(range(n), 2):
        if rng.random() < 0.35:
            caps[(a, b)] = cap()
    for s in range(n, n + switches):
        for r in rng.choice(n, size=min(n, 2 + int(rng.integers(0, 2))), replace=False):
            caps[(int(r), s)] = caps[(s, int(r))] = cap()
        if s > n:
            caps[(s - 1, s)] = caps[(s, s - 1)] = cap()
    links = tuple(Link(a, b, c) for (a, b), c in sorted(caps.items()) if a != b)
    return Topology(n, links, num_switches=switches, name=f"random{seed}")


def brute_force_bounds(t: Topology) -> dict:
    """Every bound by enumerating all node sets S (tiny graphs only)."""
    n, nodes = t.num_ranks, t.num_nodes
    cap = t.capacity_matrix()
    out = {"cut": np.inf, "ag": np.inf, "bc": [np.inf] * n, "rd": [np.inf] * n}
    for mask in range(1, 2**nodes - 1):
        inside = np.array([(mask >> v) & 1 for v in range(nodes)], dtype=bool)
        b_out = cap[np.ix_(inside, ~inside)].sum()
        ranks_in = int(inside[:n].sum())
        if 0 < ranks_in < n:
            out["cut"] = min(out["cut"], b_out)
            out["ag"] = min(out["ag"], b_out / ranks_in)
            for r in range(n):
                if inside[r]:
                    out["bc"][r] = min(out["bc"][r], b_out)
                else:  # S holds some rank that must reach r: reduce to r crosses S's boundary
                    out["rd"][r] = min(out["rd"][r], b_out)
    return out


def link_loads(t: Topology, packing) -> np.ndarray:
    """Bytes/s each link carries when every tree runs at its weight (switch paths included)."""
    load = np.zeros(len(t.links))
    for tree in packing.trees:
        for path in tree.paths:
            for a, b in zip(path, path[1:]):
                load[t.link_id(a, b)] += tree.weight
    return load


# ---------------------------------------------------------------- minimum arborescences
@pytest.mark.parametrize("small", [True, False])
def test_min_arborescence_matches_networkx(small, monkeypatch):
    monkeypatch.setattr(arborescence, "_SMALL", 10**6 if small else 0)
    rng = np.random.default_rng(7)
    for _ in range(150):
        n = int(rng.integers(2, 10))
        cost = rng.integers(0, 4, size=(n, n)).astype(float)  # many ties and zero cycles
        cost[rng.random((n, n)) < 0.3] = np.inf
        for i in range(n):
            cost[i, (i + 1) % n] = float(rng.integers(0, 4))
        root = int(rng.integers(n))
        parent = min_out_tree(cost, root)
        for v in range(n):  # a spanning arborescence over existing edges
            seen, u = set(), v
            while u != root:
                assert u not in seen and np.isfinite(cost[parent[u], u])
                seen.add(u)
                u = int(parent[u])
        graph = nx.DiGraph()
        graph.add_weighted_edges_from(
            (u, v, cost[u, v]) for u in range(n) for v in range(n)
            if u != v and v != root and np.isfinite(cost[u, v])
        )  # fmt: skip
        best = nx.minimum_spanning_arborescence(graph)
        assert tree_cost(cost, parent) == pytest.approx(best.size(weight="weight"))
        inward = min_in_tree(cost, root)
        assert tree_cost(cost, inward, inward=True) == pytest.approx(tree_cost(cost.T, inward))


def test_dense_arborescence_on_graphs_past_the_list_version():
    """Above `_SMALL` nodes one cycle is merged at a time (Tarjan's dense version); it must find
    trees as cheap as networkx's, with many ties (integer costs) and with none."""
    rng = np.random.default_rng(3)
    for trial in range(6):
        n = int(rng.integers(arborescence._SMALL + 1, 50))
        cost = rng.integers(0, 3, size=(n, n)).astype(float) if trial % 2 else rng.random((n, n))
        cost[rng.random((n, n)) < 0.5] = np.inf
        cost[np.arange(n), (np.arange(n) + 1) % n] = 1.0  # a ring: every node reachable
        graph = nx.DiGraph()
        graph.add_weighted_edges_from((u, v, cost[u, v]) for u, v in zip(*np.nonzero(np.isfinite(cost)))
                                      if u != v and v != 0)  # fmt: skip
        best = nx.minimum_spanning_arborescence(graph).size(weight="weight")
        parent = min_out_tree(cost, 0)
        assert sorted(np.flatnonzero(parent < 0)) == [0] and np.all(np.isfinite(cost[parent[1:], np.arange(1, n)]))
        assert tree_cost(cost, parent) == pytest.approx(best)
        inward = min_in_tree(cost.T, 0)  # an in-tree of cost.T is an out-tree of cost
        assert tree_cost(cost.T, inward, inward=True) == pytest.approx(best)


@pytest.mark.parametrize("topology", [random_topology(s, switches=1 + s % 3) for s in range(4)]
                         + [cluster(3, hosts_per_leaf=2), cluster(2, gpus_per_host=4, nics_per_host=2)],
                         ids=lambda t: t.name)  # fmt: skip
def test_routes_are_the_cheapest_and_join_their_ends(topology):
    prices = np.random.default_rng(topology.num_nodes).integers(1, 4, len(topology.links)).astype(float)
    edge_prices = RoutePricer(topology).price(prices)
    pairs = [(u, v) for u, v in itertools.permutations(range(topology.num_ranks), 2)
             if np.isfinite(edge_prices.cost[u, v])]  # fmt: skip
    for (u, v), route in zip(pairs, edge_prices.routes(pairs)):
        ends = [(topology.links[i].src, topology.links[i].dst) for i in route]
        assert ends[0][0] == u and ends[-1][1] == v and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
        assert all(topology.is_switch(a) for a, _ in ends[1:])  # only switches relay
        assert sum(prices[i] for i in route) == edge_prices.cost[u, v]


def test_unreachable_node_is_reported():
    cost = np.array([[np.inf, 1.0, np.inf], [np.inf, np.inf, np.inf], [np.inf, np.inf, np.inf]])
    with pytest.raises(ValueError, match="2.? cannot be reached from root 0"):
        min_out_tree(cost, 0)


# ---------------------------------------------------------------- bounds
@pytest.mark.parametrize(
    "gpus, broadcast, allreduce",
    [(range(8), 6.0, 48 / 14), (range(7), 4.0, 3.0), ((0, 1, 2, 3), 4.0, 3.0)],
)
def test_reference_worked_values_nvlink_only(gpus, broadcast, allreduce):
    """docs/background.md §2: 0-7: 6 and 3.43; 0-6: 4 and 3.0; 0,1,2,3: 4 and 3.0 (link units)."""
    t = dgx1v(list(gpus), pcie=False)
    assert broadcast_bound(t, 0) / UNIT == pytest.approx(broadcast)
    assert allreduce_bound(t) / UNIT == pytest.approx(allreduce)


@pytest.mark.parametrize("seed", range(12))
def test_bounds_match_brute_force(seed):
    t = random_topology(seed, switches=seed % 3, fractional=seed % 2 == 1)
    brute = brute_force_bounds(t)
    n = t.num_ranks
    for r in range(n):
        assert broadcast_bound(t, r) == pytest.approx(brute["bc"][r])
        assert reduce_bound(t, r) == pytest.approx(brute["rd"][r])
    assert cut_bound(t) == pytest.approx(brute["cut"])
    assert allgather_bound(t) == pytest.approx(n * brute["ag"])
    assert reducescatter_bound(t) == pytest.approx(n * brute_force_bounds(t.reversed())["ag"])
    rank_out = sum(l.capacity for l in t.links if l.src < n)
    rank_in = sum(l.capacity for l in t.links if l.dst < n)
    assert allreduce_bound(t) == pytest.approx(min(brute["cut"], min(rank_out, rank_in) / (2 * (n - 1))))


# ---------------------------------------------------------------- packings reach the bounds
@pytest.mark.parametrize("seed", range(10))
def test_packings_reach_the_bound_where_theory_says(seed):
    """Edmonds (broadcast/reduce) and ForestColl (all-gather/reduce-scatter): the LP optimum is
    the bound on rank-only networks and with switches whose links are symmetric."""
    t = random_topology(seed, switches=seed % 3)
    for op in ("broadcast", "reduce", "allgather", "reducescatter"):
        p = pack(t, op, root=seed % t.num_ranks, options=EXACT)
        assert p.rate == pytest.approx(p.bound, rel=1e-6), (op, p.rate, p.bound)
        assert np.all(link_loads(t, p) <= t.capacities() * (1 + 1e-6))


@pytest.mark.parametrize(
    "topology",
    [dgx1v(pcie=False), dgx1v([0, 1, 2, 3, 4]), ring(6), full(5), fat_tree(8, hosts_per_leaf=2)],
    ids=lambda t: t.name,
)
def test_presets_reach_the_bound_and_respect_capacities(topology):
    for op in ("broadcast", "reduce", "allgather", "reducescatter"):
        p = pack(topology, op, options=EXACT)
        assert p.rate == pytest.approx(p.bound, rel=1e-6), op
        assert np.all(link_loads(topology, p) <= topology.capacities() * (1 + 1e-6))
    p = pack(topology, "allreduce", options=EXACT)
    assert p.rate <= p.bound * (1 + 1e-6)
    assert np.all(link_loads(topology, p) <= topology.capacities() * (1 + 1e-6))


@pytest.mark.parametrize("gpus, units", [(range(8), 48 / 14), (range(7), 3.0), ((0, 1, 2, 3), 3.0)])
def test_allreduce_reaches_the_reference_bound_on_nvlink(gpus, units):
    p = pack(dgx1v(list(gpus), pcie=False), "allreduce", options=EXACT)
    assert p.rate / UNIT == pytest.approx(units, rel=1e-6)
    rates = dict(p.candidates)
    assert {"multiroot", "rs+ag"} <= set(rates) and p.rate == max(rates.values())
    assert rates["multiroot"] >= rates["rs+ag"] * (1 - 1e-6)  # the joint LP contains rs+ag


def test_multiroot_beats_rs_ag_on_an_irregular_graph():
    """GPUs 0-5 (NVLink only): reduce-scatter + all-gather reach 45 GB/s, multi-root trees more."""
    p = pack(dgx1v(list(range(6)), pcie=False), "allreduce", options=EXACT)
    rates = dict(p.candidates)
    assert p.construction.startswith("multiroot") and rates["multiroot"] > 1.3 * rates["rs+ag"]


# ---------------------------------------------------------------- shallow trees
def _brute_shallow(cost: np.ndarray, root: int) -> float:
    """Cheapest depth <= 2 out-tree by trying every parent assignment (tiny n only)."""
    n, best = len(cost), np.inf
    others = [v for v in range(n) if v != root]
    for parents in itertools.product(range(n), repeat=n - 1):
        parent = dict(zip(others, parents))
        if any(u == v for v, u in parent.items()):
            continue
        if all(v == root or parent[v] == root or parent[parent[v]] == root for v in others):
            best = min(best, sum(cost[u, v] for v, u in parent.items()))
    return best


@pytest.mark.parametrize("seed", range(60))
def test_shallow_tree_is_the_cheapest_of_depth_two(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 6))
    cost = rng.random((n, n))
    cost[rng.random((n, n)) < 0.35] = np.inf
    root = int(rng.integers(n))
    want = _brute_shallow(cost, root)
    parent = shallow_out_tree(cost, root)
    if not np.isfinite(want):
        assert parent is None
        return
    assert tree_cost(cost, parent) == pytest.approx(want, rel=1e-12)
    assert all(parent[v] == root or parent[parent[v]] == root for v in range(n) if v != root)
    inward = shallow_in_tree(cost.T, root)  # an in-tree of cost.T is an out-tree of cost
    assert tree_cost(cost.T, inward, inward=True) == pytest.approx(want, rel=1e-12)


def test_shallow_packings_on_hetero4():
    """The fast 4-ring with slow diagonals: the unrestricted LP reaches the all-reduce bound with
    6-hop pieces (Hamiltonian chains up and down); depth <= 2 trees reach it with 4 hops, and
    `auto` keeps those. Broadcast needs depth 3 for its bound, so `auto` keeps the deep trees."""
    t = load_topology(DOCS / "topologies" / "hetero4.yaml")
    deep = pack(t, "allreduce", options=PackOptions(keep=1.0, depth="any"))
    auto = pack(t, "allreduce", options=PackOptions(keep=1.0))
    assert deep.rate == pytest.approx(deep.bound, rel=1e-6) and deep.depth == 6
    assert auto.rate == pytest.approx(auto.bound, rel=1e-6) and auto.depth == 4
    assert auto.construction.endswith("/shallow")
    assert all(tree.depth <= 2 for tree in auto.trees)
    assert np.all(link_loads(t, auto) <= t.capacities() * (1 + 1e-6))
    bcast = pack(t, "broadcast", options=PackOptions(keep=1.0))
    rates = dict(bcast.candidates)
    assert bcast.construction == "broadcast" and bcast.rate == pytest.approx(bcast.bound, rel=1e-6)
    assert rates["broadcast/shallow"] == pytest.approx(1.4 / 2.2 * bcast.bound, rel=1e-6)


def test_shallow_refused_where_it_cannot_be_built():
    with pytest.raises(ValueError, match="no spanning trees of depth <= 2"):
        pack(ring(6), "broadcast", options=PackOptions(depth=Depth.SHALLOW))
    with pytest.raises(ValueError, match="up to 8 ranks"):
        pack(full(9), "broadcast", options=PackOptions(depth="shallow"))
    assert pack(ring(6), "broadcast").construction == "broadcast"  # auto: the deep trees only


# ---------------------------------------------------------------- pruning, MWU, errors
def test_pruning_keeps_the_stated_fraction_with_fewer_trees():
    t = dgx1v()
    exact = pack(t, "broadcast", options=EXACT)
    pruned = pack(t, "broadcast", options=PackOptions(keep=0.9))
    assert pruned.rate >= 0.9 * exact.rate and len(pruned.trees) < len(exact.trees)
    one = pack(t, "broadcast", options=PackOptions(max_trees=1))
    assert len(one.trees) == 1 and one.rate <= exact.rate
    two = pack(t, "allreduce", options=PackOptions(max_trees=4))
    assert len(two.trees) <= 4


@pytest.mark.parametrize("op", OPS)
def test_multiplicative_weights_is_close_to_the_lp(op):
    t = dgx1v([0, 1, 2, 4, 5, 6])
    lp = pack(t, op)
    mwu = pack(t, op, options=PackOptions(method=Method.MWU))
    assert mwu.method == "mwu" and mwu.rate >= 0.95 * lp.rate


def _valid_under_capacity(t: Topology, packing) -> None:
    for tree in packing.trees:
        tree.check_spans(t.num_ranks)
    assert np.all(link_loads(t, packing) <= t.capacities() * (1 + 1e-6))


@pytest.mark.parametrize(
    "topology, allreduce_best",
    [(fat_tree(64), allreduce_bound(fat_tree(64))),
     # 3 hosts whose 8 GPUs share 2 NICs (100 GB/s a host): all-reducing across hosts takes
     # 2·(3-1)/3 of the bytes through each host's NICs, so no algorithm beats 100 / (4/3) GB/s,
     # below the cut bound (100 GB/s).
     (cluster(3, nics_per_host=2, hosts_per_leaf=2), 75e9)],
    ids=["fat-tree64", "cluster3x8-shared-nics"],
)  # fmt: skip
def test_multiplicative_weights_on_larger_networks(topology, allreduce_best):
    """Broadcast within the 3% gap of its bound; all-reduce with its pieces rooted at one rank
    within it of the best any algorithm can do (the LP's dual prices end the run where the cut
    bound cannot be reached)."""
    bcast = pack(topology, "broadcast", options=PackOptions(method=Method.MWU))
    assert bcast.rate >= 0.97 * bcast.bound
    _valid_under_capacity(topology, bcast)
    allreduce = pack(topology, "allreduce", options=PackOptions(method=Method.MWU, roots=1))
    assert allreduce.construction == "multiroot" and {t.root for t in allreduce.trees} == {0}
    assert 0.97 * allreduce_best <= allreduce.rate <= allreduce_best * (1 + 1e-9)
    _valid_under_capacity(topology, allreduce)


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda: PackOptions(roots=0), "roots=0: give a number of ranks >= 1"),
        (lambda: PackOptions(patience=True), "patience=True: give a number of re-weightings >= 1"),
        (lambda: pack(ring(3), "allreduce", options=PackOptions(roots=4)), "has 3 ranks; give at most 3"),
        (lambda: pack(dgx1v([0]), "broadcast"), "at least 2"),
        (lambda: pack(ring(3), "broadcast", root=3), "root=3 is not a rank"),
        (lambda: pack(dgx1v([0, 5], pcie=False), "allgather"), r"ranks \[1\] cannot be reached"),
        (lambda: pack(ring(3), "alltoall"), "unknown collective"),
        (lambda: PackOptions(keep=1.5), "keep=1.5"),
    ],
)
def test_packing_errors(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_packing_validates_its_trees():
    p = pack(ring(4), "broadcast")
    from dataclasses import replace

    with pytest.raises(ValueError, match="does not match"):
        replace(p, rate=p.rate * 2)
    with pytest.raises(ValueError, match="root must be"):
        replace(p, root=None)
    bad = replace(p.trees[0], edges=p.trees[0].edges[:-1], paths=p.trees[0].paths[:-1])
    with pytest.raises(ValueError, match="spanning tree has 3"):
        replace(p, trees=(bad,) + p.trees[1:])
    assert all(t.direction is Direction.OUT for t in p.trees)


# ---------------------------------------------------------------- command line
def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("op", OPS)
def test_topo_pack_json(op, capsys):
    code, out, _ = _cli(["topo", "pack", "--preset", "dgx1v", "--gpus", "0,1,2,3", "--no-pcie",
                         "--op", op, "--json"], capsys)  # fmt: skip
    obj = json.loads(out)
    assert code == 0
    for key in ("op", "rate_gbps", "bound_gbps", "num_trees", "solve_seconds", "rate_units"):
        assert key in obj
    assert obj["op"] == op and obj["rate_gbps"] <= obj["bound_gbps"] * (1 + 1e-9)
    assert ("root" in obj) == (op in ("broadcast", "reduce"))
    assert obj["num_trees"] == len(obj["trees"]) and obj["link_unit_gbps"] == 25.0


def test_topo_pack_text_yaml_and_errors(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text("ranks: 3\nlinks:\n  - {between: [0, 1], bandwidth: 1 Gbit/s}\n"
                    "  - {between: [1, 2], bandwidth: 1 Gbit/s}\n")  # fmt: skip
    code, out, _ = _cli(["topo", "pack", "--topology", str(path), "--op", "broadcast", "--root", "1"], capsys)
    assert code == 0 and "rate/bound 1.0000" in out
    code, _, err = _cli(["topo", "pack", "--preset", "ring", "--op", "broadcast"], capsys)
    assert code == 2 and err.startswith("shardshift: error: --preset ring needs --ranks")
    code, _, err = _cli(["topo", "pack", "--preset", "dgx1v", "--gpus", "0,x", "--op", "reduce"], capsys)
    assert code == 2 and "--gpus" in err
    code, out, _ = _cli(["topo", "show", "--preset", "fat-tree", "--hosts", "4", "--json"], capsys)
    assert code == 0 and len(json.loads(out)["pair_rates"]) == 12
    code, out, _ = _cli(["topo", "show", "--preset", "ring", "--ranks", "3", "--bandwidth", "200mbit", "--json"], capsys)
    assert code == 0 and {r for _, _, r in json.loads(out)["pair_rates"]} == {25e6}
    code, _, err = _cli(["topo", "show", "--preset", "ring", "--ranks", "3", "--bandwidth", "25mbps"], capsys)
    assert code == 2 and "ambiguous" in err
    code, out, _ = _cli(["topo", "pack", "--topology", str(DOCS / "topologies" / "hetero4.yaml"), "--op", "allreduce",
                         "--depth", "any", "--json"], capsys)  # fmt: skip
    assert code == 0 and json.loads(out)["depth"] == 6 and "/shallow" not in json.loads(out)["construction"]
    code, _, err = _cli(["topo", "pack", "--preset", "ring", "--ranks", "6", "--op", "broadcast",
                         "--depth", "shallow"], capsys)  # fmt: skip
    assert code == 2 and "no spanning trees of depth <= 2" in err


def test_ring_rate_is_the_ring_packings():
    for topology in (dgx1v(), fat_tree(12, hosts_per_leaf=4), cluster(2)):
        for op in OPS:
            assert ring_rate(topology, op) == pytest.approx(ring_packing(topology, op).rate, rel=1e-12)


def test_predicted_times_add_route_latencies():
    """One leaf of 4 hosts: every route is host → leaf → host, 2 links of 1 us."""
    from shardshift.bench.packing import predicted_seconds, ring_cost

    t = fat_tree(4)
    packing = pack(t, "broadcast", options=EXACT)
    assert predicted_seconds(t, packing, 10**9) == pytest.approx(1e9 / packing.rate + 2e-6 * packing.depth)
    rate, latency = ring_cost(t, Collective.ALLREDUCE)
    assert rate == pytest.approx(4 * 12.5e9 / 6) and latency == pytest.approx(2 * 3 * 2e-6)
    assert ring_cost(t, Collective.BROADCAST) == pytest.approx((12.5e9, 3 * 2e-6))


def test_bench_packing_scale_small(capsys):
    code, out, err = _cli(["bench", "packing", "--scale", "--hosts", "4", "--families", "fat-tree,rails-gpu",
                           "--json"], capsys)  # fmt: skip
    rows = json.loads(out)["scale"]["rows"]
    # With --json the rows still show as they come, on stderr: a header and one line a row.
    assert err.startswith("Packing at scale") and len(err.strip().splitlines()) == 2 + len(rows)
    assert code == 0 and [(r["family"], r["ranks"], r["op"]) for r in rows] == [
        ("fat-tree", 4, "broadcast"), ("fat-tree", 4, "allreduce"),
        ("rails-gpu", 32, "broadcast"), ("rails-gpu", 32, "allreduce")]  # fmt: skip
    for r in rows:
        assert 0.9 <= r["ratio"] <= 1 + 1e-9 and r["num_trees"] >= 1 and r["solve_seconds"] >= 0
        assert r["predicted_ms"] >= 2**30 / (r["rate_gbps"] * 1e6)  # 1 GiB at the packing's rate, in ms
        assert r["rings_ms"] <= r["ring_ms"]
    code, _, err = _cli(["bench", "packing", "--hosts", "4"], capsys)
    assert code == 2 and "--hosts apply to --scale" in err
    code, _, err = _cli(["bench", "packing", "--scale", "--ops", "allgather"], capsys)
    assert code == 2 and "--scale packs broadcast, reduce, allreduce" in err


def test_bench_packing_runs_small(capsys):
    code, out, _ = _cli(["bench", "packing", "--sizes", "3:3", "--limit", "2", "--ops", "broadcast",
                         "--skip-large", "--json"], capsys)  # fmt: skip
    result = json.loads(out)
    assert code == 0 and result["dgx1v"]["subsets"] == 2
    assert result["dgx1v"]["summary"]["broadcast"]["min_ratio"] >= 0.99
