"""The tree executor without processes: compiled plans, the two execution modes on an in-process
group (tests/support/local_group.py), ring packings, and the small pure helpers around them."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import numpy as np
import pytest
import torch

from shardshift.collectives.execution.executor import ExecMode, _Dataflow
from shardshift.collectives.execution.program import MIN_CHUNK_BYTES, SendOp, chunks_per_tree, compile_plan
from shardshift.collectives.execution.reduction import Reduction, UnsupportedReduction
from shardshift.collectives.execution.runner import RunOptions, TreeCollectives
from shardshift.collectives.planning.bounds import collective_bound
from shardshift.collectives.planning.checker import check_schedule
from shardshift.collectives.planning.ops import Collective
from shardshift.collectives.planning.packing import pack
from shardshift.collectives.planning.rings import best_ring, ring_packing
from shardshift.collectives.planning.schedule import make_schedule
from shardshift.collectives.topology.io import load_topology
from shardshift.collectives.topology.model import Link, Topology
from shardshift.collectives.topology.presets import dgx1v, fat_tree, full, ring
from shardshift.collectives.topology.probe import matching_rounds, snap_rates
from shardshift.collectives.topology.spec import topology_from_plain, topology_from_spec, topology_to_dict
from shardshift.comm.p2p import Deadline, TransferError, Transport
from shardshift.netemu.topology import auto_scale, emulation_rates, scaled
from support import DOCS
from support.local_group import LocalGroup, run_ranks

OPS = list(Collective)
MBIT = 1e6 / 8


def hetero4(swap: bool = False) -> Topology:
    """Fast ring 0-1-2-3 (1 Gbit/s), slow diagonals (200 Mbit/s); `swap`: ranks 1 and 2 swapped."""
    fast = [(0, 2), (2, 1), (1, 3), (3, 0)] if swap else [(0, 1), (1, 2), (2, 3), (3, 0)]
    slow = [(0, 1), (2, 3)] if swap else [(0, 2), (1, 3)]
    links = [Link(a, b, 1000 * MBIT) for u, v in fast for a, b in ((u, v), (v, u))]
    links += [Link(a, b, 200 * MBIT) for u, v in slow for a, b in ((u, v), (v, u))]
    return Topology(4, tuple(links), name="hetero4x" if swap else "hetero4")


TOPOLOGIES = [full(3), ring(4), dgx1v([0, 1, 2, 4, 5]), hetero4()]


# ---- compiled plans ---------------------------------------------------------------------------

@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: t.name)
@pytest.mark.parametrize("count_per_rank", [1, 7, 1000])
def test_compiled_queues_match_between_ranks(topology, count_per_rank):
    n = topology.num_ranks
    for op in OPS:
        schedule = make_schedule(pack(topology, op, root=n - 1), num_chunks_per_tree=3)
        count = count_per_rank * n
        plans = [compile_plan(schedule, count, r) for r in range(n)]
        sent, received = defaultdict(list), defaultdict(list)
        for plan in plans:
            ops = plan.program.ops
            assert [o.index for o in ops] == sorted(o.index for o in ops)
            assert all(o.begin < o.end for o in ops)  # empty chunks dropped
            writes = defaultdict(int)
            for o in ops:  # dependencies count only earlier ops of the same chunk
                if isinstance(o, SendOp):
                    assert o.after_writes == writes[o.chunk]
                    sent[(plan.program.rank, o.peer, o.lane)].append((o.chunk, o.begin, o.end))
                else:
                    assert o.ordinal == writes[o.chunk]
                    writes[o.chunk] += 1
                    received[(o.peer, plan.program.rank, o.lane)].append((o.chunk, o.begin, o.end))
        # The k-th send on (a → b, lane) is the k-th receive there: FIFO matching per tag.
        assert sent == received
        assert sum(e - b for b, e in plans[0].ranges) == count


def test_every_lane_carries_one_tree():
    """An all-reduce piece reduces up its IN tree and broadcasts down its OUT tree; where both cross
    the same ordered pair, they still travel in separate lanes (program.lane_of)."""
    topology = load_topology(DOCS / "topologies" / "hetero5.yaml")
    packing = pack(topology, Collective.ALLREDUCE)
    schedule = make_schedule(packing, num_chunks_per_tree=3)
    shared_pairs = 0
    for piece in packing.pieces():
        edges = [set(packing.trees[i].edges) for i in piece.trees]
        shared_pairs += len(set.intersection(*edges)) if len(edges) == 2 else 0
    assert shared_pairs > 0  # the case the lanes are split for occurs here
    for rank in range(topology.num_ranks):
        plan = compile_plan(schedule, 5 * 999, rank)
        for _, lane, ops in plan.program.sends + plan.program.recvs:
            trees = {(schedule.chunks[o.chunk].piece, schedule.transfers[o.index].kind) for o in ops}
            assert len(trees) == 1, f"rank {rank}, lane {lane} mixes {sorted(trees)}"


def test_one_pump_posts_the_sends_it_finds_in_global_order():
    """gloo writes a pair's messages in the order they are posted: at the start every lane has a
    window of sends ready, and they must go out earliest first, not lane by lane."""
    posted = []

    class Recording:
        def rank(self):
            return 1

        def size(self):
            return 4

        def send(self, tensors, dst, tag):
            posted.append((dst, tag))
            return None

        def recv(self, tensors, src, tag):
            return None

    packing = pack(hetero4(), Collective.ALLREDUCE)
    plan = compile_plan(make_schedule(packing, num_chunks_per_tree=6), 4 * 6000, rank=1)
    flow = _Dataflow(plan, torch.zeros(plan.count), Transport(Recording()), Reduction.SUM.combine,
                     Deadline.after(60), window=4)  # fmt: skip
    with flow.lock:
        flow.pump()
    sends = [q.posted for q in flow.sends]
    order = sorted((op.index, op.peer, op.lane) for queue in sends for op, _, _ in queue)
    assert posted == [(peer, lane) for _, peer, lane in order]
    assert len({lane for _, lane in posted}) > 1 and all(len(queue) <= 4 for queue in sends)


def test_small_counts_leave_empty_chunks_out():
    schedule = make_schedule(pack(full(4), "allreduce"), num_chunks_per_tree=8)
    plan = compile_plan(schedule, 3, 0)
    assert sum(1 for b, e in plan.ranges if b < e) == 3
    assert all(o.end - o.begin == 1 for o in plan.program.ops)


def test_chunks_per_tree_bounds():
    assert chunks_per_tree(10, 4) == 1
    assert chunks_per_tree(64 << 20, 4) == 64
    assert chunks_per_tree(4 << 20, 4, min_chunk_bytes=256 << 10) == 4
    assert chunks_per_tree(64 << 20, 4, seconds=0.1, chunk_seconds=0.004) == 25  # chunks of ~4 ms
    # Many trees (all-reduce packings take 28 on hetero4): the total cap keeps messages in check.
    assert chunks_per_tree(64 << 20, 28) == 256 // 28
    assert chunks_per_tree(16 << 20, 28) == (16 << 20) // (28 * (128 << 10))  # the byte floor binds
    # The floor is per tree: an all-reduce piece's chunk crosses its IN and its OUT tree.
    assert chunks_per_tree(16 << 20, 11, trees_per_piece=2) == (16 << 20) // (22 * (128 << 10))
    assert chunks_per_tree(64 << 20, 11, trees_per_piece=2) == 256 // 11  # the cap is per piece
    assert chunks_per_tree(64 << 20, 4, seconds=0.001) == 1
    with pytest.raises(ValueError, match="must be > 0"):
        chunks_per_tree(1, 0)
    with pytest.raises(ValueError, match="must be > 0"):
        chunks_per_tree(1, 1, trees_per_piece=0)


def test_plans_put_the_chunk_floor_on_every_tree_a_chunk_crosses():
    topology = load_topology(DOCS / "topologies" / "hetero4.yaml")
    trees = TreeCollectives(LocalGroup.world(4)[0], topology, RunOptions(verify_plans=False))
    count = 4 << 20  # 16 MiB of float32: the byte floor binds for both ops
    for op in (Collective.BROADCAST, Collective.ALLREDUCE):
        packing = trees.packing(op)
        plan = trees.plan(op, count, 4)
        assert plan.chunks_per_tree == (count * 4) // (len(packing.trees) * MIN_CHUNK_BYTES), op


# ---- execution on an in-process group -------------------------------------------------------

def _inputs(op: Collective, n: int, m: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n * 1000 + m)
    count = n * m if op is Collective.REDUCESCATTER else m
    return [(torch.randint(-9, 10, (count,), generator=g)).to(dtype) for _ in range(n)]


def _expected(op: Collective, xs: list[torch.Tensor], rank: int, root: int, red: Reduction):
    n, stack = len(xs), torch.stack([x.double() for x in xs])
    reduced = {Reduction.SUM: stack.sum(0), Reduction.MAX: stack.amax(0), Reduction.MIN: stack.amin(0),
               Reduction.PRODUCT: stack.prod(0), Reduction.AVG: stack.mean(0)}[red]  # fmt: skip
    if op is Collective.BROADCAST:
        return xs[root].double()
    if op is Collective.REDUCE:
        return reduced if rank == root else xs[rank].double()  # non-roots keep their input
    if op is Collective.ALLREDUCE:
        return reduced
    if op is Collective.ALLGATHER:
        return torch.cat([x.double() for x in xs])
    m = xs[0].numel() // n
    return reduced[rank * m:(rank + 1) * m]


def _run_op(trees: TreeCollectives, op: Collective, x: torch.Tensor, root: int, red: Reduction):
    n = trees.size
    if op is Collective.BROADCAST:
        y = x.clone(); trees.broadcast(y, root); return y  # noqa: E702
    if op is Collective.REDUCE:
        y = x.clone(); trees.reduce(y, root, red); return y  # noqa: E702
    if op is Collective.ALLREDUCE:
        y = x.clone(); trees.all_reduce(y, red); return y  # noqa: E702
    if op is Collective.ALLGATHER:
        y = x.new_zeros(n * x.numel()); trees.all_gather(y, x); return y  # noqa: E702
    y = x.new_zeros(x.numel() // n); trees.reduce_scatter(y, x, red); return y  # noqa: E702


@pytest.mark.parametrize("mode", list(ExecMode))
@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: t.name)
def test_every_op_matches_reference_in_process(topology, mode):
    n = topology.num_ranks
    options = RunOptions(mode=mode, timeout_s=30, min_chunk_bytes=64, max_chunks_per_tree=4)
    cases = [(op, m, dtype, red) for op in OPS for m in (1, 5, 301)
             for dtype, red in ((torch.float64, Reduction.SUM), (torch.int64, Reduction.MAX))]  # fmt: skip
    root = n // 2

    def body(group, rank):
        trees = TreeCollectives(group, topology, options)
        for op, m, dtype, red in cases:
            xs = _inputs(op, n, m, dtype)
            got = _run_op(trees, op, xs[rank], root, red)
            assert torch.equal(got.double(), _expected(op, xs, rank, root, red)), (op, m, dtype, rank)
        built = trees.plans_built
        for op, m, dtype, red in cases[:6]:  # again: no planning
            _run_op(trees, op, _inputs(op, n, m, dtype)[rank], root, red)
        assert trees.plans_built == built
        trees.close()

    run_ranks(n, body)


def test_reductions_and_avg_in_process():
    n, topology = 3, full(3)

    def body(group, rank):
        trees = TreeCollectives(group, topology, RunOptions(min_chunk_bytes=8))
        for red in Reduction:
            xs = [torch.arange(1.0, 12.0) * (r + 1) for r in range(n)]
            y = xs[rank].clone()
            trees.all_reduce(y, red)
            assert torch.allclose(y.double(), _expected(Collective.ALLREDUCE, xs, rank, 0, red), rtol=1e-12)
        with pytest.raises(UnsupportedReduction, match="AVG"):
            trees.all_reduce(torch.ones(3, dtype=torch.int32), "avg")
        strided = torch.arange(20.0).view(4, 5).t()  # not contiguous: written back
        trees.all_reduce(strided)
        assert torch.equal(strided, torch.arange(20.0).view(4, 5).t() * n)
        trees.close()

    run_ranks(n, body)


def test_a_missing_peer_times_out_with_a_clear_error():
    threads = threading.active_count()  # what earlier tests left running is not this test's
    group = LocalGroup.world(2)[0]  # rank 1 never shows up
    trees = TreeCollectives(group, full(2), RunOptions(timeout_s=0.5, verify_plans=False))
    start = time.monotonic()
    with pytest.raises(TransferError, match=r"rank 0: allreduce: .* rank 1 .*(timed out|failed)"):
        trees.all_reduce(torch.ones(1000))
    assert time.monotonic() - start < 5
    with pytest.raises(RuntimeError, match="destroy the group"):
        trees.all_reduce(torch.ones(10))
    assert threading.active_count() - threads < 50


def test_plans_that_differ_between_ranks_are_refused():
    topologies = [full(3), full(3), dgx1v([0, 1, 2])]  # 2 trees vs 3 trees: other chunks

    def body(group, rank):
        trees = TreeCollectives(group, topologies[rank], RunOptions(timeout_s=5))
        with pytest.raises(RuntimeError, match="differs on ranks"):
            trees.broadcast(torch.ones(1 << 16), 0)

    run_ranks(3, body)


# ---- rings -----------------------------------------------------------------------------------

@pytest.mark.parametrize("topology", [full(5), hetero4(), dgx1v([0, 1, 2, 3, 4, 5])], ids=lambda t: t.name)
def test_ring_packings_pass_the_checker(topology):
    for op in OPS:
        packing = ring_packing(topology, op, root=1)
        assert packing.rate <= packing.bound * (1 + 1e-9)
        check_schedule(make_schedule(packing, num_chunks_per_tree=3))


def test_best_ring_avoids_slow_links():
    assert best_ring(hetero4()) == (0, 1, 2, 3)
    assert best_ring(hetero4(swap=True)) in ((0, 2, 1, 3), (0, 3, 1, 2))
    assert ring_packing(hetero4(swap=True), "broadcast").rate == pytest.approx(1000 * MBIT)


# ---- helpers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_probe_rounds_are_matchings_covering_every_ordered_pair(n):
    rounds = matching_rounds(n)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(a, b) for a in range(n) for b in range(n) if a != b]
    for r in rounds:
        ranks = [x for p in r for x in p]
        assert len(ranks) == len(set(ranks))


def test_snap_rates_groups_near_equal_links():
    rates = np.array([[0, 100, 96, 20], [103, 0, 21, 19.5], [99, 20, 0, 100], [19, 21, 98, 0]], float)
    snapped = snap_rates(rates, 0.1)
    assert set(np.unique(snapped)) == {0.0, float(np.median([103, 100, 100, 99, 98, 96])),
                                       float(np.median([21, 21, 20, 20, 19.5, 19]))}  # fmt: skip


def test_emulation_rates_scale_and_fill():
    t = dgx1v([0, 1, 2, 3], pcie=False)  # 0-1 single, 0-3 double NVLink...
    scale = auto_scale(t)
    rates = emulation_rates(t, scale)
    assert max(rates.values()) == pytest.approx(1000 * MBIT)
    assert len(rates) == 12
    with pytest.warns(UserWarning, match="outside"):
        emulation_rates(t, 1.0)
    half = scaled(hetero4(), 0.5)
    for op in OPS:
        assert collective_bound(half, op) == pytest.approx(collective_bound(hetero4(), op) / 2)


def test_topology_specs_and_round_trip(tmp_path):
    assert topology_from_spec("full", 3).num_ranks == 3
    assert topology_from_spec("ring:2Gbit/s", 4).links[0].capacity == 250e6
    assert topology_from_spec("dgx1v:1,5,6", 3).names[:3] == ("gpu1", "gpu5", "gpu6")
    with pytest.raises(ValueError, match="has 4 ranks but the group has 3"):
        topology_from_spec("dgx1v:0,1,2,3", 3)
    with pytest.raises(ValueError, match="give full"):
        topology_from_spec("nonsense", 3)
    for t in (dgx1v([0, 2, 3]), fat_tree(6, hosts_per_leaf=4), hetero4()):
        assert topology_from_plain(topology_to_dict(t)) == t


def test_reduction_names():
    assert Reduction.parse("SUM") is Reduction.SUM
    assert Reduction.parse(torch.distributed.ReduceOp.AVG) is Reduction.AVG
    with pytest.raises(UnsupportedReduction, match="inner process group"):
        Reduction.parse(torch.distributed.ReduceOp.BAND)
