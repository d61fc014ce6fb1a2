"""Planning a switch, with no process: boxes, plans, schedules, checked element by element.

A symbolic executor runs plans on index arrays: every rank starts with its old pieces of
``arange(numel)``, copies segments round by round as the real executor would, and must end with
exactly its new pieces. Hypothesis draws models with uneven shapes, layouts of 4, 6 and 8 ranks,
and budgets from tiny to ample.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardshift.elastic.redundancy import copy_duties, plan_copies
from shardshift.layout import Layout, all_layouts
from shardshift.models.space import state_space
from shardshift.reshard.plan import (
    Assignment,
    axis_orders,
    choose_ranks,
    holdings_of,
    increasing_on_every_axis,
    plan_transition,
)
from shardshift.reshard.schedule import build_schedule
from shardshift.reshard.space import Box, Split, chunk_range
from support.models import gpt


@given(size=st.integers(0, 50), parts=st.integers(1, 9))
def test_chunk_range_is_torch_chunk(size, parts):
    pieces = torch.arange(size).chunk(parts) if size else ()
    for index in range(parts):
        start, length = chunk_range(0, size, parts, index)
        expected = pieces[index].tolist() if index < len(pieces) else []
        assert list(range(start, start + length)) == expected


@given(sizes=st.lists(st.integers(1, 9), min_size=0, max_size=3), itemsize=st.sampled_from([1, 2, 4, 8]),
       max_bytes=st.integers(1, 300))
def test_box_split_covers_the_box_once(sizes, itemsize, max_bytes):
    box = Box(tuple(1 for _ in sizes), tuple(sizes))
    pieces = box.split(itemsize, max_bytes)
    assert sum(p.numel for p in pieces) == box.numel
    assert all(box.contains(p) for p in pieces)
    assert all(p.numel * itemsize <= max_bytes or p.numel == 1 for p in pieces)
    for i, a in enumerate(pieces):
        for b in pieces[i + 1 :]:
            assert a.intersect(b).empty


def test_split_follows_tp_then_fsdp():
    # 10 rows, tp=4 then fsdp=2: torch.chunk pieces 3,3,3,1; then 2,1 of each.
    box = Split(0, 2, 1).apply(Split(0, 4, 2).apply(Box.full((10, 3))))
    assert box == Box((8, 0), (1, 3))


def _symbolic_switch(plan, schedule, pieces):
    """Run `schedule` on index arrays: `pieces[rank][t]` hold the old pieces; returns the new ones."""
    new = [
        {t: np.full(box.sizes, -1, dtype=np.int64) for t, box in enumerate(boxes) if box is not None}
        for boxes in plan.new_boxes
    ]
    for rnd in schedule.rounds:
        for seg in rnd.segments:
            # A copy a survivor keeps of a lost process's piece is that piece, exactly.
            owner = seg.src if seg.copy_of is None else seg.copy_of
            dst_box = plan.new_boxes[seg.dst][seg.tensor]
            new[seg.dst][seg.tensor][seg.box.relative_to(dst_box)] = \
                pieces[owner][seg.tensor][seg.box.relative_to(plan.source_box(seg))]
    return new


def _pieces(tensors, boxes):
    full = [np.arange(math.prod(t.shape), dtype=np.int64).reshape(t.shape) for t in tensors]
    return [{t: full[t][box.relative_to(Box.full(tensors[t].shape))] for t, box in enumerate(row) if box is not None}
            for row in boxes]


models = st.builds(
    lambda layers, heads, width, seq, ff: gpt(n_layer=layers, n_head=heads, d_model=heads * width, seq_len=seq, d_ff=ff, vocab_size=37),
    st.integers(1, 5), st.sampled_from([1, 2, 4]), st.integers(1, 5), st.integers(1, 11), st.sampled_from([4, 8, 12, 24]),
)


def _valid(cfg, world):
    space = state_space(cfg, torch.float32)
    out = []
    for layout in all_layouts(world):
        try:
            space.check(layout)
        except ValueError:
            continue
        out.append(layout)
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=models, world=st.sampled_from([4, 6, 8]), data=st.data(),
       budget=st.sampled_from([4 << 10, 16 << 10, 1 << 20]))
def test_plan_moves_every_element_exactly_where_it_belongs(cfg, world, data, budget):
    space = state_space(cfg, torch.float32)
    layouts = _valid(cfg, world)
    old_layout, new_layout = data.draw(st.sampled_from(layouts)), data.draw(st.sampled_from(layouts))
    old = Assignment(old_layout, data.draw(st.sampled_from(axis_orders(old_layout))))
    plan = plan_transition(space, old, new_layout)  # validates coverage when built
    schedule = build_schedule(plan, budget)  # validates the budget rule when built
    assert increasing_on_every_axis(new_layout, plan.new.ranks)
    assert plan.bytes_moved == plan.bytes_lower_bound
    assert plan.bytes_moved + plan.bytes_kept == plan.bytes_total

    new = _symbolic_switch(plan, schedule, _pieces(plan.tensors, plan.old_boxes))
    expected = _pieces(plan.tensors, plan.new_boxes)
    for rank in range(world):
        for t in expected[rank]:
            assert np.array_equal(new[rank][t], expected[rank][t]), (rank, plan.tensors[t].key)

    # And back: the inverse switch returns every piece to where it started.
    back = plan_transition(space, plan.new, old_layout, ranks=old.ranks)
    returned = _symbolic_switch(back, build_schedule(back, budget), new)
    original = _pieces(plan.tensors, plan.old_boxes)
    for rank in range(world):
        for t in original[rank]:
            assert np.array_equal(returned[rank][t], original[rank][t])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=models, old_world=st.integers(1, 6), new_world=st.integers(1, 6), data=st.data(),
       budget=st.sampled_from([4 << 10, 1 << 20]))
def test_a_world_that_grows_or_shrinks_ends_with_every_piece(cfg, old_world, new_world, data, budget):
    """The old world's processes and the new one's, planned together: processes that join hold
    nothing before, those that leave nothing after, and every new piece is exactly its slice."""
    space = state_space(cfg, torch.float32)
    old_layouts, new_layouts = _valid(cfg, old_world), _valid(cfg, new_world)
    if not old_layouts or not new_layouts:
        return
    old_layout, new_layout = data.draw(st.sampled_from(old_layouts)), data.draw(st.sampled_from(new_layouts))
    joiners = data.draw(st.integers(max(0, new_world - old_world), new_world))  # the rest stay
    processes = old_world + joiners
    stay = sorted(data.draw(st.permutations(range(old_world)))[: new_world - joiners])
    members = stay + list(range(old_world, processes))
    old = Assignment(old_layout, tuple(data.draw(st.sampled_from(axis_orders(old_layout)))), processes)
    plan = plan_transition(space, old, new_layout, members=members)
    schedule = build_schedule(plan, budget)
    assert sorted(plan.new.ranks) == members
    assert plan.bytes_moved == plan.bytes_lower_bound
    new = _symbolic_switch(plan, schedule, _pieces(plan.tensors, plan.old_boxes))
    expected = _pieces(plan.tensors, plan.new_boxes)
    for rank in range(processes):
        assert set(new[rank]) == set(expected[rank])
        for t in expected[rank]:
            assert np.array_equal(new[rank][t], expected[rank][t]), (rank, plan.tensors[t].key)
        if rank not in members:
            assert not any(box is not None for box in plan.new_boxes[rank])


def test_a_crash_takes_each_piece_from_a_surviving_copy_or_names_what_is_gone():
    cfg = gpt(n_layer=2, n_head=2, d_model=8, seq_len=5, d_ff=12, vocab_size=11)
    space = state_space(cfg, torch.float32)
    old = Assignment(Layout.parse("dp=2,fsdp=2"), (0, 1, 2, 3))  # 0 and 2, 1 and 3 are replicas
    plan = plan_transition(space, old, Layout.parse("fsdp=3"), members=[0, 2, 3], lost=[1])
    assert all(seg.src != 1 for seg in plan.segments)
    new = _symbolic_switch(plan, build_schedule(plan), _pieces(plan.tensors, plan.old_boxes))
    expected = _pieces(plan.tensors, plan.new_boxes)
    for rank in (0, 2, 3):
        for t in expected[rank]:
            assert np.array_equal(new[rank][t], expected[rank][t])
    with pytest.raises(ValueError, match=r"held by no surviving process \(lost: \[1, 3\]\)"):
        plan_transition(space, old, Layout.parse("fsdp=2"), members=[0, 2], lost=[1, 3])
    with pytest.raises(ValueError, match="needs 2 distinct processes of 0..2"):
        Assignment(Layout.parse("fsdp=2"), (0, 3), 3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=models, world=st.sampled_from([4, 6, 8]), k=st.integers(1, 2), data=st.data())
def test_with_redundancy_k_any_k_crashes_lose_nothing(cfg, world, k, data):
    """`copy_duties` gives every parameter piece K + 1 holders, so any K lost processes leave a
    copy of every piece: the survivors' plan takes them from replicas and copies, moves the
    fewest bytes, and every survivor ends with exactly its new pieces."""
    space = state_space(cfg, torch.float32)
    layouts = _valid(cfg, world)
    old = Assignment.identity(data.draw(st.sampled_from(layouts), label="old"))
    duties = copy_duties(space, old, k)
    holders: dict = {}
    for d in duties:
        holders.setdefault((d.of, d.fqn), []).append(d.holder)
    assert all(len(h) == len(set(h)) and d_of not in h for (d_of, _), h in holders.items())
    lost = sorted(data.draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=k), label="lost"))
    survivors = [r for r in range(world) if r not in lost]
    candidates = [layout for layout in _valid(cfg, len(survivors))]
    assume(candidates)
    new_layout = data.draw(st.sampled_from(candidates), label="new")
    plan = plan_transition(space, old, new_layout, members=survivors, lost=lost,
                           copies=plan_copies(space, duties, lambda rank: rank))
    assert all(seg.src not in lost for seg in plan.segments)
    assert plan.bytes_moved == plan.bytes_lower_bound
    new = _symbolic_switch(plan, build_schedule(plan), _pieces(plan.tensors, holdings_of(space, old)))
    expected = _pieces(plan.tensors, plan.new_boxes)
    for rank in survivors:
        for t in expected[rank]:
            assert np.array_equal(new[rank][t], expected[rank][t]), (rank, plan.tensors[t].key)


def test_copies_are_kept_only_where_replicas_do_not_already_count():
    cfg = gpt(n_layer=2, n_head=2, d_model=8, seq_len=5, d_ff=12, vocab_size=11)
    space = state_space(cfg, torch.float32)
    fsdp = copy_duties(space, Assignment.identity(Layout(fsdp=4)), 1)
    boxes = holdings_of(space, Assignment.identity(Layout(fsdp=4)))
    pieces = {(r, t.key.removeprefix("param:")) for i, t in enumerate(space.tensors) if t.key.startswith("param:")
              for r in range(4) if not boxes[r][i].empty}  # a dim of 3 split 4 ways leaves one rank nothing
    assert {(d.of, d.holder) for d in fsdp} == {(0, 1), (1, 2), (2, 3), (3, 0)}  # the next rank, cyclically
    assert {(d.of, d.fqn) for d in fsdp} == pieces and len(fsdp) == len(pieces)
    assert copy_duties(space, Assignment.identity(Layout(dp=2, fsdp=2)), 1) == ()  # replicas are the copies
    hsdp2 = copy_duties(space, Assignment.identity(Layout(dp=2, fsdp=2)), 2)
    assert {(d.of, d.holder) for d in hsdp2} == {(0, 1), (1, 2)}  # 0 and 2, 1 and 3 hold the same pieces
    assert copy_duties(space, Assignment.identity(Layout(fsdp=4)), 0) == ()
    # Two neighbours lost at once are beyond --redundancy 1: rank 1's pieces were only on 1 and 2.
    with pytest.raises(ValueError, match=r"held by no surviving process \(lost: \[1, 2\]\)"):
        plan_transition(space, Assignment.identity(Layout(fsdp=4)), Layout(fsdp=2), members=[0, 3], lost=[1, 2],
                        copies=plan_copies(space, fsdp, lambda rank: rank))


def test_copies_go_to_another_host_when_the_hosts_are_known():
    """Ranks 0, 1 on host a and 2, 3 on host b (fsdp=4, --redundancy 1): every piece's copy is on the
    other host, so losing either host leaves a holder of every piece; ranks on one host alone keep
    the rule of the next rank."""
    cfg = gpt(n_layer=2, n_head=2, d_model=8, seq_len=5, d_ff=12, vocab_size=11)
    space = state_space(cfg, torch.float32)
    world = Assignment.identity(Layout(fsdp=4))
    hosts = ["a", "a", "b", "b"]
    duties = copy_duties(space, world, 1, hosts)
    assert {(d.of, d.holder) for d in duties} == {(0, 2), (1, 2), (2, 0), (3, 0)}  # first on the other host
    assert all(hosts[d.of] != hosts[d.holder] for d in duties)
    for lost in ([0, 1], [2, 3]):
        survivors = [r for r in range(4) if r not in lost]
        plan_transition(space, world, Layout(fsdp=2), members=survivors, lost=lost,
                        copies=plan_copies(space, duties, lambda rank: rank))  # every piece has a holder
    assert copy_duties(space, world, 1, ["a"] * 4) == copy_duties(space, world, 1)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=models, data=st.data(), scale=st.sampled_from([4, 16]))
def test_memory_stays_within_the_budget(cfg, data, scale):
    """With a budget of a few pieces, no rank exceeds max(old, new) + budget + one piece."""
    space = state_space(cfg, torch.float32)
    layouts = _valid(cfg, 4)
    old_layout, new_layout = data.draw(st.sampled_from(layouts)), data.draw(st.sampled_from(layouts))
    plan = plan_transition(space, Assignment.identity(old_layout), new_layout)
    largest = max(box.numel * plan.tensors[t].itemsize for row in plan.new_boxes for t, box in enumerate(row) if box)
    budget = max(4 << 10, scale * largest)
    schedule = build_schedule(plan, budget)
    for rank in range(4):
        old, new = plan.held_bytes(plan.old_boxes, rank), plan.held_bytes(plan.new_boxes, rank)
        extra = old + max(schedule.memory_peaks(rank)) - max(old, new)
        assert extra <= budget + largest, (rank, extra, budget, largest)


def test_same_layout_moves_nothing_and_replication_sends_nothing():
    cfg = gpt(n_layer=3, n_head=2, d_model=8, seq_len=5, d_ff=12, vocab_size=11)
    space = state_space(cfg, torch.float64)
    for layout in _valid(cfg, 4):
        assert plan_transition(space, Assignment.identity(layout), layout).bytes_moved == 0
        # Every rank of dp=4 holds everything: any layout is reached without a message.
        assert plan_transition(space, Assignment.identity(Layout(dp=4)), layout).bytes_moved == 0


def test_assignment_keeps_more_than_the_fixed_order():
    cfg = gpt(n_layer=4, n_head=4, d_model=16, seq_len=8, d_ff=32, vocab_size=64)
    space = state_space(cfg, torch.float32)
    gains = 0
    for a in _valid(cfg, 4):
        for b in _valid(cfg, 4):
            chosen = plan_transition(space, Assignment.identity(a), b)
            fixed = plan_transition(space, Assignment.identity(a), b, ranks=range(4))
            assert chosen.bytes_moved <= fixed.bytes_moved
            gains += chosen.bytes_moved < fixed.bytes_moved
            assert chosen.new == choose_ranks(space, Assignment.identity(a), b)
    assert gains > 0  # e.g. fsdp=2,tp=2 -> tp=4 keeps more with tp outermost


def test_replicas_share_the_sending():
    cfg = gpt(n_layer=2, n_head=4, d_model=8, seq_len=4, d_ff=16, vocab_size=32)
    plan = plan_transition(state_space(cfg, torch.float32), Assignment.identity(Layout(dp=2, fsdp=2)), Layout(tp=4))
    # Ranks 0 and 2 hold the same fsdp half (as do 1 and 3): all four send, and evenly.
    sent = [plan.sent_bytes(rank) for rank in range(4)]
    assert min(sent) > 0 and max(sent) <= 1.5 * min(sent), sent


def test_bad_requests_are_refused_with_what_to_do():
    cfg = gpt(n_layer=2, n_head=2, d_model=8, seq_len=4, d_ff=16, vocab_size=32)
    space = state_space(cfg, torch.float32)
    old = Assignment.identity(Layout(dp=4))
    with pytest.raises(ValueError, match="choose tp in"):
        plan_transition(space, old, Layout(tp=4))
    with pytest.raises(ValueError, match="whose product is 4"):
        plan_transition(space, old, Layout(dp=2))
    with pytest.raises(ValueError, match="runs backwards"):
        plan_transition(space, old, Layout(fsdp=4), ranks=(1, 0, 2, 3))
    with pytest.raises(ValueError, match="too small"):
        build_schedule(plan_transition(space, old, Layout(fsdp=4)), 100)
