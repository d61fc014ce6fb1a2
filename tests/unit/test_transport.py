"""The point-to-point transport (`shardshift.comm`) on the in-process group: rounds that cannot
deadlock, deadlines that hold, and errors that name the rank, the peer and what was being done."""

from __future__ import annotations

import time

import pytest
import torch

from shardshift.comm import Deadline, PeerOp, TransferError, Transport
from support.local_group import LocalGroup, run_ranks


def test_a_round_exchanges_with_every_peer_at_once():
    """Every rank sends a different tensor to every other rank, all posted before any wait: the
    in-process group's sends complete only when received, so a round that waited on a send before
    posting its receives would deadlock here."""
    n = 4

    def body(group, rank):
        transport = Transport(group)
        peers = [p for p in range(n) if p != rank]
        inbox = {p: torch.empty(3, dtype=torch.int64) for p in peers}
        sends = [PeerOp(p, torch.tensor([rank, p, 7]), tag=5) for p in peers]
        transport.post_round(sends, [PeerOp(p, inbox[p], tag=5) for p in peers], "round 1").wait(Deadline.after(10))
        return {p: inbox[p].tolist() for p in peers}

    for rank, inbox in enumerate(run_ranks(n, body)):
        assert inbox == {p: [p, rank, 7] for p in range(n) if p != rank}


def test_messages_of_a_tag_match_in_order():
    def body(group, rank):
        transport = Transport(group)
        if rank == 0:
            ops = [PeerOp(1, torch.full((2,), float(i)), tag=3) for i in range(4)]
            transport.post_round(ops, [], "sending").wait(Deadline.after(10))
            return None
        got = [torch.empty(2) for _ in range(4)]
        transport.post_round([], [PeerOp(0, t, tag=3) for t in got], "receiving").wait(Deadline.after(10))
        return [float(t[0]) for t in got]

    assert run_ranks(2, body)[1] == [0.0, 1.0, 2.0, 3.0]


def test_sends_given_lazily_are_posted_after_every_receive_and_receives_are_taken_as_they_arrive():
    """A round's sends may come from a generator (the executor packs each while the ones before it
    travel): every receive is posted before the first send is produced, each send is posted as it
    is produced, and `received` hands out each receive, in order, with its bytes already there."""
    n = 3

    def body(group, rank):
        transport = Transport(group)
        peers = [p for p in range(n) if p != rank]
        inbox = [torch.full((4,), -1.0) for _ in peers]
        events = []
        real_send, real_recv = transport.send, transport.recv
        transport.send = lambda t, peer, tag=0: events.append(("send", peer)) or real_send(t, peer, tag)
        transport.recv = lambda t, peer, tag=0: events.append(("recv", peer)) or real_recv(t, peer, tag)

        def sends():
            for p in peers:
                events.append(("packed", p))
                yield PeerOp(p, torch.full((4,), float(10 * rank + p)), tag=2)

        posted = transport.post_round(sends(), [PeerOp(p, buf, tag=2) for p, buf in zip(peers, inbox)], "round 1")
        got = []
        for i in posted.received(Deadline.after(10)):
            got.append((i, inbox[i].tolist()))
        posted.wait(Deadline.after(10))
        return events, got

    for rank, (events, got) in enumerate(run_ranks(n, body)):
        peers = [p for p in range(n) if p != rank]
        assert events == [("recv", p) for p in peers] + [e for p in peers for e in (("packed", p), ("send", p))]
        assert got == [(i, [float(10 * p + rank)] * 4) for i, p in enumerate(peers)]


def test_a_missing_peer_fails_at_the_deadline_naming_it():
    transport = Transport(LocalGroup.world(3)[0])  # ranks 1 and 2 never show up
    posted = transport.post_round([PeerOp(2, torch.zeros(1024))], [PeerOp(1, torch.empty(256))], "switch round 3 of 7")
    start = time.monotonic()
    with pytest.raises(TransferError, match=r"rank 0: switch round 3 of 7: receiving 1\.0 KiB from rank 1 .*failed") as err:
        posted.wait(Deadline.after(0.3))
    assert err.value.peer == 1
    assert time.monotonic() - start < 5


def test_a_deadline_that_passed_fails_without_waiting():
    transport = Transport(LocalGroup.world(2)[0])
    work = transport.recv(torch.empty(1), 1)
    deadline = Deadline.after(0.01)
    time.sleep(0.02)
    with pytest.raises(TransferError, match="rank 0: probing timed out") as err:
        transport.wait(work, deadline, 1, lambda: "probing")
    assert err.value.peer == 1
    with pytest.raises(ValueError, match="give seconds > 0"):
        Deadline.after(0)


def test_a_peer_whose_connection_closed_fails_the_round_as_it_is_posted_naming_it():
    """gloo refuses at once to post a send to a peer that died (its connection closed): the round
    fails with a TransferError naming the peer and the round, not with gloo's RuntimeError."""

    class Closed(LocalGroup):
        def send(self, tensors, peer, tag):
            raise RuntimeError(f"Connection closed by peer {peer}")

    transport = Transport(Closed.world(2)[0])
    with pytest.raises(TransferError, match=r"rank 0: switch round 1 of 2: sending 16 B to rank 1 .*Connection closed") \
            as err:
        transport.post_round([PeerOp(1, torch.zeros(4))], [], "switch round 1 of 2")
    assert err.value.peer == 1
