"""The switch's executor (`reshard.execute`) on real tensors, each rank a thread of the test process
talking through the in-process group: every new piece is exactly its slice of the logical tensor,
old pieces are released, memory stays within the budget, and a lost peer is named with its round."""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from shardshift.comm import Deadline, TransferError, Transport
from shardshift.elastic.redundancy import copy_duties, plan_copies
from shardshift.layout import Layout
from shardshift.models.space import state_space
from shardshift.reshard.execute import (
    PHASES,
    Copy,
    RoundWork,
    SwitchProgram,
    arena,
    calls_per_rank,
    compile_program,
    run_program,
)
from shardshift.reshard.plan import Assignment, holdings_of, plan_transition
from shardshift.reshard.schedule import ALIGN, build_schedule
from shardshift.reshard.space import Box
from support.local_group import LocalGroup, run_ranks
from support.models import gpt

# Uneven on purpose: 13 positions over 4 shards, 5 layers over pp=2.
CFG = gpt(n_layer=5, n_head=4, d_model=24, seq_len=13, d_ff=40, vocab_size=37)


def _full(tensor, index: int) -> torch.Tensor:
    """A logical tensor whose every element tells where it is (and which tensor it belongs to)."""
    numel = math.prod(tensor.shape)
    values = torch.arange(numel, dtype=torch.float64) + 1000.0 * index
    return values.to(tensor.dtype if tensor.dtype.is_floating_point else torch.int64).to(tensor.dtype).reshape(tensor.shape)


class _Source:
    def __init__(self, pieces: dict[int, torch.Tensor], copies: dict[tuple[int, int], torch.Tensor] | None = None):
        self.pieces, self.copies, self.released = pieces, copies or {}, set()

    def local(self, index: int, copy_of: int | None = None) -> torch.Tensor:
        if copy_of is not None:
            return self.copies[(copy_of, index)]
        assert index not in self.released, f"tensor {index} read after it was released"
        return self.pieces[index]

    def release(self, index: int) -> None:
        self.released.add(index)


class _Sink:
    def __init__(self, shapes: dict[int, tuple[int, ...]], dtypes):
        self.shapes, self.dtypes, self.pieces = shapes, dtypes, {}

    def open(self, index: int) -> torch.Tensor:
        assert index not in self.pieces, f"tensor {index} opened twice"
        self.pieces[index] = torch.full(self.shapes[index], -1).to(self.dtypes[index])
        return self.pieces[index]


def _slice(full: torch.Tensor, box: Box) -> torch.Tensor:
    return full[box.relative_to(Box.full(tuple(full.shape)))]


def _run(schedule, rank: int, group, source: _Source) -> tuple[_Sink, object]:
    """Run `rank`'s part of `schedule` from `source` into a fresh sink; the sink and the stats."""
    plan = schedule.plan
    sink = _Sink({t: box.sizes for t, box in enumerate(plan.new_boxes[rank]) if box},
                 [t.dtype for t in plan.tensors])
    stats = run_program(compile_program(schedule, rank), source, sink, Transport(group), Deadline.after(30),
                        torch.device("cpu"))
    return sink, stats


@pytest.mark.parametrize("old, new", [("dp=4", "fsdp=2,tp=2"), ("fsdp=4", "tp=2,pp=2"), ("pp=2,tp=2", "dp=2,fsdp=2"),
                                      ("tp=4", "pp=4")])
def test_every_new_piece_is_its_slice_of_the_logical_tensor(old, new):
    space = state_space(CFG, torch.float32)
    fulls = [_full(t, i) for i, t in enumerate(space.tensors)]
    plan = plan_transition(space, Assignment.identity(Layout.parse(old)), Layout.parse(new))
    schedule = build_schedule(plan, 8 << 10)  # small: many rounds
    assert len(schedule.rounds) > 1

    def body(group, rank):
        source = _Source({t: _slice(fulls[t], box).clone() for t, box in enumerate(plan.old_boxes[rank]) if box})
        sink, stats = _run(schedule, rank, group, source)
        return source, sink, stats

    for rank, (source, sink, stats) in enumerate(run_ranks(4, body)):
        expected = {t: box for t, box in enumerate(plan.new_boxes[rank]) if box}
        assert sorted(sink.pieces) == sorted(expected)
        for t, box in expected.items():
            assert torch.equal(sink.pieces[t], _slice(fulls[t], box)), (rank, space.tensors[t].key)
        assert source.released == set(source.pieces)  # every old piece let go
        received = [plan.segment_bytes(s) for s in plan.segments if s.dst == rank and not s.local]
        # Messages pack segments at 16-byte aligned offsets: the payload plus at most that padding.
        assert sum(received) <= stats.bytes_received <= sum(received) + ALIGN * len(received)
        assert stats.peak_bytes - max(stats.old_bytes, stats.new_bytes) <= schedule.budget + max(
            t.nbytes for t in space.tensors)
        # The profile: every phase of the rounds booked, together no more than the whole.
        assert tuple(stats.phases) == PHASES and min(stats.phases.values()) >= 0
        assert sum(stats.phases.values()) <= stats.seconds
        assert stats.cpu_seconds > 0  # the process's processor time while it ran (its threads')


@pytest.mark.parametrize("owned", [True, False], ids=["own-storage", "views-of-one-buffer"])
def test_a_whole_piece_kept_is_handed_over_not_copied_and_still_sent_from(owned):
    """pp=2 -> dp=2: each rank keeps its stage's tensors whole (new box = old box) and sends them to
    the other, over many rounds. Where the old pieces own their storage, the new pieces take their
    memory (same addresses, nothing copied) and later sends read the same bytes from there; where
    they are views of one buffer (as a padded shard is), they are copied."""
    space = state_space(CFG, torch.float32)
    fulls = [_full(t, i) for i, t in enumerate(space.tensors)]
    plan = plan_transition(space, Assignment.identity(Layout(pp=2)), Layout(dp=2))
    schedule = build_schedule(plan, 8 << 10)
    assert len(schedule.rounds) > 1

    def body(group, rank):
        boxes = {t: box for t, box in enumerate(plan.old_boxes[rank]) if box}
        if owned:
            pieces = {t: _slice(fulls[t], box).clone() for t, box in boxes.items()}
        else:  # every piece a view into one buffer: none is the whole of its storage
            flat = torch.cat([_slice(fulls[t], box).reshape(-1).to(torch.float64) for t, box in boxes.items()])
            pieces, at = {}, 0
            for t, box in boxes.items():
                pieces[t] = flat[at:at + box.numel].view(box.sizes)
                at += box.numel
        addresses = {t: piece.data_ptr() for t, piece in pieces.items()}
        sink, stats = _run(schedule, rank, group, _Source(pieces))
        return addresses, sink, stats

    for rank, (addresses, sink, stats) in enumerate(run_ranks(2, body)):
        # Tensors whose local copy the schedule kept in one piece (a larger one it cuts to fit rounds)
        whole = {seg.tensor for index in range(len(schedule.rounds)) for seg in schedule.messages(index, rank)[2]
                 if seg.box == plan.new_boxes[rank][seg.tensor] == plan.old_boxes[rank][seg.tensor]}
        assert whole and stats.bytes_sent > 0
        for t, box in enumerate(plan.new_boxes[rank]):
            if box is not None:
                assert torch.equal(sink.pieces[t], _slice(fulls[t], box).to(sink.pieces[t].dtype)), t
        whole_bytes = sum(plan.piece_bytes(plan.new_boxes, rank, t) for t in whole)
        if owned:
            assert all(sink.pieces[t].data_ptr() == addresses[t] for t in whole)
            assert stats.bytes_handed_over == whole_bytes
        else:
            assert not any(sink.pieces[t].data_ptr() == addresses[t] for t in whole)
            assert stats.bytes_handed_over == 0 and stats.bytes_copied >= whole_bytes


def test_a_lost_process_s_pieces_come_from_the_copies_survivors_keep():
    """fsdp=4 with --redundancy 1 (each rank's pieces copied on the next); rank 1 is lost and the
    three others go to fsdp=3: rank 2 sends (and keeps) rank 1's pieces from its copies."""
    space = state_space(CFG, torch.float32)
    fulls = [_full(t, i) for i, t in enumerate(space.tensors)]
    old = Assignment.identity(Layout(fsdp=4))
    boxes = holdings_of(space, old)
    duties = copy_duties(space, old, 1)
    plan = plan_transition(space, old, Layout(fsdp=3), members=[0, 2, 3], lost=[1],
                           copies=plan_copies(space, duties, lambda rank: rank))
    assert any(seg.copy_of == 1 and not seg.local for seg in plan.segments)
    schedule = build_schedule(plan, 8 << 10)

    def body(group, rank):
        if rank == 1:
            return None  # lost: it takes no part
        pieces = {t: _slice(fulls[t], box).clone() for t, box in enumerate(plan.old_boxes[rank]) if box}
        copies = {(of, t): _slice(fulls[t], boxes[of][t]).clone() for holder, of, t in plan.copies if holder == rank}
        return _run(schedule, rank, group, _Source(pieces, copies))[0]

    for rank, sink in enumerate(run_ranks(4, body)):
        if rank == 1:
            continue
        for t, box in enumerate(plan.new_boxes[rank]):
            if box is not None:
                assert torch.equal(sink.pieces[t], _slice(fulls[t], box)), (rank, space.tensors[t].key)


def test_a_peer_that_never_comes_fails_the_round_naming_it():
    space = state_space(CFG, torch.float32)
    plan = plan_transition(space, Assignment.identity(Layout(fsdp=2)), Layout(tp=2))
    program = compile_program(build_schedule(plan, 64 << 10), 0)
    source = _Source({t: _slice(_full(space.tensors[t], t), box).clone()
                      for t, box in enumerate(plan.old_boxes[0]) if box})
    sink = _Sink({t: box.sizes for t, box in enumerate(plan.new_boxes[0]) if box}, [t.dtype for t in space.tensors])
    group = LocalGroup.world(2)[0]  # rank 1 never runs its part
    with pytest.raises(TransferError, match=rf"rank 0: switch round 1 of {len(program.rounds)}: .* rank 1 ") as err:
        run_program(program, source, sink, Transport(group), Deadline.after(0.5), torch.device("cpu"))
    assert err.value.peer == 1


def _never_touched(shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 tensor on pages no one has written: an anonymous mapping of its own. (Whether
    ``torch.empty`` gets fresh pages is up to the allocator and what earlier tests left in it: after
    600 tests a 48 MiB ``torch.empty`` took no page fault at all.)"""
    mapping = mmap.mmap(-1, math.prod(shape) * 4)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping.madvise(mmap.MADV_NOHUGEPAGE)  # a fault per 4 KiB page, not per 2 MiB where THP is "always"
    return torch.frombuffer(mapping, dtype=torch.float32).view(shape)  # the tensor keeps the mapping alive


def test_the_pages_a_switch_first_touches_are_counted():
    """A new piece on pages never written costs page faults when the copy first writes it; the same
    copy into memory written before costs next to none. `ExecStats.page_faults` tells them apart."""
    shape = (48, 1 << 18)  # float32: 48 MiB
    where = (slice(0, 48), slice(0, 1 << 18))
    nbytes = 48 << 20
    program = SwitchProgram(
        rank=0,
        rounds=(RoundWork(opens=((0, nbytes, shape),), sends=(), recvs=(), copies=(Copy(0, where, where),),
                          closes=()),),
        idle_opens=(), idle_closes=(), old_bytes=nbytes, new_bytes=nbytes)
    source = _Source({0: torch.ones(shape)})
    group = LocalGroup.world(1)[0]

    def faults(target: Callable[[], torch.Tensor]) -> int:
        sink = SimpleNamespace(open=lambda index: target())
        stats = run_program(program, source, sink, Transport(group), Deadline.after(30), torch.device("cpu"))
        return stats.page_faults

    touched = torch.zeros(shape)
    fresh = faults(lambda: _never_touched(shape))
    again = faults(lambda: touched)
    assert fresh >= nbytes // mmap.PAGESIZE and again <= fresh // 4, (fresh, again)  # every fresh page faults once
    assert torch.equal(touched, source.local(0))


def test_a_round_s_work_is_a_few_calls_per_peer_and_its_buffers_come_from_one_arena():
    """Run the same switch twice on each rank's thread: each allocates one block for its staging
    buffers, at its start, and hands it back at its end; the calls made are those the program and
    the schedule's count predict: a post, a wait and at most one copy per message, one call for the
    local copies and one per hand-over; fewer than the pieces."""
    space = state_space(CFG, torch.float32)
    fulls = [_full(t, i) for i, t in enumerate(space.tensors)]
    plan = plan_transition(space, Assignment.identity(Layout(fsdp=4)), Layout(tp=2, pp=2))
    schedule = build_schedule(plan, 64 << 10)
    counts = calls_per_rank(schedule)

    def body(group, rank):
        runs = []
        for _ in range(2):
            source = _Source({t: _slice(fulls[t], box).clone() for t, box in enumerate(plan.old_boxes[rank]) if box})
            before = arena(torch.device("cpu")).allocations
            sink, stats = _run(schedule, rank, group, source)
            runs.append((sink, stats, arena(torch.device("cpu")).allocations - before,
                         arena(torch.device("cpu")).nbytes))
        return compile_program(schedule, rank), runs

    for rank, (program, runs) in enumerate(run_ranks(4, body)):
        (_, first, _, _), (sink, second, allocated, held) = runs
        assert allocated == 1 and held == 0 and second.arena_bytes == first.arena_bytes
        assert second.arena_bytes >= max(step.staging for step in program.rounds) > 0
        assert second.host_calls == program.host_calls == counts.after[rank] < counts.before[rank]
        assert second.pieces == program.pieces == counts.pieces[rank]
        assert second.host_calls < second.pieces
        for step in program.rounds:
            handed = sum(c.whole for c in step.copies)
            assert step.host_calls <= 3 * (len(step.sends) + len(step.recvs)) + 1 + handed
        for t, box in enumerate(plan.new_boxes[rank]):
            if box is not None:
                assert torch.equal(sink.pieces[t], _slice(fulls[t], box)), (rank, space.tensors[t].key)
