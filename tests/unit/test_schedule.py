"""Schedules from packings: the symbolic checker on every op and preset, broken schedules caught,
numeric reference runs, element ranges, and the deadlock-freedom of the ordering rule."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import numpy as np
import pytest

from shardshift.collectives.planning.checker import ScheduleError, check_schedule, run_reference
from shardshift.collectives.planning.ops import Collective, TransferKind
from shardshift.collectives.planning.packing import pack
from shardshift.collectives.planning.schedule import (
    Chunk,
    ChunkTransfer,
    CollectiveSchedule,
    element_ranges,
    make_schedule,
)
from shardshift.collectives.topology.model import Link, Topology
from shardshift.collectives.topology.presets import dgx1v, fat_tree, full, ring

OPS = [op.value for op in Collective]
PRESETS = {
    "dgx1v-nvlink": lambda: dgx1v([0, 1, 2, 3, 6], pcie=False),
    "dgx1v-pcie": lambda: dgx1v([0, 2, 5, 7]),
    "ring": lambda: ring(5),
    "full": lambda: full(4),
    "fat-tree": lambda: fat_tree(6, hosts_per_leaf=2),
}


@lru_cache(maxsize=None)
def packed(preset: str, op: str):
    topology = PRESETS[preset]()
    return pack(topology, op, root=1 if Collective.parse(op).rooted else 0)


def expected_outputs(op: str, inputs: list[np.ndarray], root: int) -> dict[int, tuple[slice, np.ndarray]]:
    """rank -> (region of its buffer that the op defines, the values it must hold there)."""
    n, size = len(inputs), len(inputs[0])
    total = np.sum(inputs, axis=0)
    shard = size // n
    if op == "broadcast":
        return {r: (slice(None), inputs[root]) for r in range(n)}
    if op == "reduce":
        return {root: (slice(None), total)}
    if op == "allreduce":
        return {r: (slice(None), total) for r in range(n)}
    if op == "allgather":
        gathered = np.concatenate([inputs[r][r * shard : (r + 1) * shard] for r in range(n)])
        return {r: (slice(None), gathered) for r in range(n)}
    return {r: (slice(r * shard, (r + 1) * shard), total[r * shard : (r + 1) * shard]) for r in range(n)}


def run_and_compare(schedule: CollectiveSchedule, size: int, seed: int = 0) -> None:
    """Run the numeric reference on integers (exact) and compare with the op's definition."""
    rng = np.random.default_rng(seed)
    n = schedule.num_ranks
    inputs = [rng.integers(-1000, 1000, size=size) for _ in range(n)]
    if schedule.op is Collective.ALLGATHER:  # only a rank's own shard is defined at the start
        shard = size // n
        inputs = [np.where(np.arange(size) // shard == r, x, 10**9) for r, x in enumerate(inputs)]
    outputs = run_reference(schedule, inputs)
    for rank, (region, want) in expected_outputs(schedule.op.value, inputs, schedule.root or 0).items():
        np.testing.assert_array_equal(outputs[rank][region], want, err_msg=f"rank {rank}")


# ---------------------------------------------------------------- every op on every preset
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("op", OPS)
def test_checker_passes_for_every_op_and_preset(preset, op):
    schedule = make_schedule(packed(preset, op), num_chunks_per_tree=3)
    report = check_schedule(schedule)
    assert report.num_transfers == len(schedule.transfers) > 0
    n = schedule.num_ranks
    run_and_compare(schedule, size=n * 7 + (0 if Collective.parse(op).sharded else 3))


@pytest.mark.parametrize("op", OPS)
def test_pipelining_depth_and_volume(op):
    """k chunks per tree take k - 1 extra steps, and every tree edge carries every chunk once."""
    p = packed("dgx1v-nvlink", op)
    one, many = make_schedule(p, 1), make_schedule(p, 6)
    assert many.num_steps == one.num_steps + 5
    assert len(many.transfers) == 6 * len(one.transfers)
    assert len(one.transfers) == sum(len(t.edges) for t in p.trees)


def test_chunk_sizes_follow_tree_weights():
    p = pack(dgx1v([0, 1, 2, 3], pcie=False), "broadcast")
    s = make_schedule(p, 2)
    total = sum(t.weight for t in p.trees)
    for piece, tree in enumerate(p.trees):
        size = sum(c.stop - c.start for c in s.chunks if c.piece == piece)
        assert float(size) == pytest.approx(tree.weight / total, abs=2**-19)


# ---------------------------------------------------------------- broken schedules are caught
def _broken(schedule: CollectiveSchedule, transfers: list[ChunkTransfer]) -> CollectiveSchedule:
    return replace(schedule, transfers=tuple(sorted(transfers, key=lambda t: t.order_key)))


def test_checker_catches_a_missing_transfer():
    s = make_schedule(packed("ring", "broadcast"), 2)
    last = max(s.transfers, key=lambda t: t.step)
    with pytest.raises(ScheduleError, match=rf"rank {last.dst} chunk {last.chunk} .* holds nothing"):
        check_schedule(_broken(s, [t for t in s.transfers if t != last]))


def test_checker_catches_a_relay_that_sends_too_early():
    s = make_schedule(packed("ring", "broadcast"), 2)
    relay = next(t for t in s.transfers if t.src != s.root)
    early = replace(relay, step=0)
    with pytest.raises(ScheduleError, match=rf"rank {relay.src} does not hold chunk {relay.chunk} yet"):
        check_schedule(_broken(s, [early if t == relay else t for t in s.transfers]))


def test_checker_catches_a_partial_sum_sent_before_its_children_arrive():
    s = make_schedule(packed("ring", "reduce"), 1)
    # The last hop into the root, moved to step 0, carries a sum without the far ranks.
    hop = max(s.transfers, key=lambda t: t.step)
    early = [replace(t, step=0) if t == hop else t for t in s.transfers]
    with pytest.raises(ScheduleError, match=rf"rank {s.root} chunk {hop.chunk} .* missing ranks"):
        check_schedule(_broken(s, early))


def test_checker_catches_double_counting():
    s = make_schedule(packed("full", "allreduce"), 1)
    dup = next(t for t in s.transfers if t.kind is TransferKind.REDUCE)
    with pytest.raises(ScheduleError, match=r"ranks counted too often or not expected \[" + str(dup.src)):
        check_schedule(_broken(s, list(s.transfers) + [dup]))


def test_checker_catches_a_wrong_kind():
    s = make_schedule(packed("full", "allgather"), 1)
    first = s.transfers[0]
    wrong = [replace(first, kind=TransferKind.REDUCE)] + list(s.transfers[1:])
    with pytest.raises(ScheduleError, match=f"rank {first.dst} has no value of chunk {first.chunk}"):
        check_schedule(_broken(s, wrong))


def test_checker_catches_hazards_within_a_step():
    s = make_schedule(packed("ring", "broadcast"), 2)
    copy = s.transfers[0]
    with pytest.raises(ScheduleError, match=f"rank {copy.dst} chunk {copy.chunk} is written twice"):
        check_schedule(_broken(s, list(s.transfers) + [copy]))
    # A reducing rank whose child's contribution arrives in the step it sends its own sum on.
    r = make_schedule(packed("ring", "reduce"), 1)
    child, up = next((c, t) for c in r.transfers for t in r.transfers if c.dst == t.src and c.chunk == t.chunk)
    moved = [replace(c, step=up.step) if c == child else c for c in r.transfers]
    with pytest.raises(ScheduleError, match=f"rank {up.src} both sends and receives chunk {up.chunk}"):
        check_schedule(_broken(r, moved))


def test_schedule_validation():
    s = make_schedule(packed("ring", "broadcast"), 2)
    with pytest.raises(ValueError, match="global"):
        replace(s, transfers=tuple(reversed(s.transfers)))
    with pytest.raises(ValueError, match="partition"):
        replace(s, chunks=s.chunks[1:])
    with pytest.raises(ValueError, match="names a rank"):
        replace(s, transfers=s.transfers + (ChunkTransfer(99, 0, 0, 0, TransferKind.COPY),))
    with pytest.raises(ValueError, match="root"):
        replace(s, root=None)
    with pytest.raises(ValueError, match="num_chunks_per_tree"):
        make_schedule(packed("ring", "broadcast"), 0)
    g = make_schedule(packed("full", "allgather"), 1)
    c = g.chunks[0]
    with pytest.raises(ValueError, match="outside shard"):  # a chunk must stay in its owner's shard
        replace(g, chunks=(Chunk(0, c.start, c.stop, (c.root + 1) % g.num_ranks, c.piece),) + g.chunks[1:])


# ---------------------------------------------------------------- element ranges
@pytest.mark.parametrize("count", [0, 1, 2, 3, 5, 17, 1000, 12345])
def test_element_ranges_partition_any_count(count):
    s = make_schedule(packed("dgx1v-pcie", "broadcast"), 4)
    ranges = element_ranges(s, count)
    assert ranges[0][0] == 0 and ranges[-1][1] == count
    assert all(a <= b for a, b in ranges)
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))
    if count < len(ranges):
        assert any(a == b for a, b in ranges)  # empty chunks happen, and the run still works
    run_and_compare(s, size=count)


def test_element_ranges_of_sharded_ops_stay_in_their_shard():
    s = make_schedule(packed("full", "reducescatter"), 3)
    n = s.num_ranks
    for count in (n, 3 * n, 101 * n):
        for c, (a, b) in zip(s.chunks, element_ranges(s, count)):
            assert c.root * count // n <= a <= b <= (c.root + 1) * count // n
    with pytest.raises(ValueError, match="not 4 equal shards"):
        element_ranges(s, 4 * 3 + 1)


# ---------------------------------------------------------------- the ordering rule
def blocking_execution_completes(schedule: CollectiveSchedule) -> bool:
    """Model (a): every rank performs its transfers in list order with rendezvous send/recv."""
    queues = {r: list(schedule.transfers_of(r)) for r in range(schedule.num_ranks)}
    position = dict.fromkeys(queues, 0)
    done = 0
    progress = True
    while progress:
        progress = False
        for r in queues:
            if position[r] < len(queues[r]):
                t = queues[r][position[r]]
                peer = t.dst if t.src == r else t.src
                if position[peer] < len(queues[peer]) and queues[peer][position[peer]] is t:
                    position[r] += 1
                    position[peer] += 1
                    done += 1
                    progress = True
    return done == len(schedule.transfers)


@pytest.mark.parametrize("op", OPS)
def test_blocking_execution_in_list_order_never_deadlocks(op):
    for preset in ("dgx1v-pcie", "fat-tree"):
        assert blocking_execution_completes(make_schedule(packed(preset, op), 4))


def small_topology(seed: int) -> Topology:
    """A random strongly connected network of 2-5 ranks, sometimes with a switch."""
    rng = np.random.default_rng(1000 + seed)
    n = int(rng.integers(2, 6))
    caps = {(i, (i + 1) % n): int(rng.integers(1, 5)) for i in range(n)}
    for a in range(n):
        for b in range(n):
            if a != b and rng.random() < 0.4:
                caps[(a, b)] = int(rng.integers(1, 5))
    links = [Link(a, b, float(c)) for (a, b), c in sorted(caps.items()) if a != b]
    switch = bool(rng.random() < 0.5)
    if switch:
        links += [Link(r, n, 2.0) for r in range(n)] + [Link(n, r, 2.0) for r in range(n)]
    return Topology(n, tuple(links), num_switches=int(switch), name=f"small{seed}")


@pytest.mark.parametrize("seed", range(15))
def test_random_topologies_give_correct_schedules(seed):
    rng = np.random.default_rng(seed)
    topology = small_topology(seed)
    op = OPS[seed % len(OPS)]
    n = topology.num_ranks
    p = pack(topology, op, root=n - 1 if Collective.parse(op).rooted else 0)
    s = make_schedule(p, int(rng.integers(1, 5)))
    check_schedule(s)
    assert blocking_execution_completes(s)
    extra = int(rng.integers(0, 40))
    run_and_compare(s, size=n * (extra + 1) if p.op.sharded else extra)
