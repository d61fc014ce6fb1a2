"""The lookout (`elastic.lookout`): notices published and read, ready joiners counted as the
boundary counts them, each change foreseen once; over a real c10d store."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from shardshift.elastic.config import ElasticConfig, Inject
from shardshift.elastic.lookout import Lookout, World
from shardshift.elastic.protocol import Epoch, JobStore
from shardshift.layout import Layout

EPOCH = Epoch(3, (0, 5, 2), Layout(fsdp=3), 5, admitted=1)  # worker ids in rank order; one joiner admitted
WORLD = World(EPOCH, (), 6)


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    JobStore(server).publish_job([], 3, 0)
    return server


def _lookouts(store, ecfg, noticed=(), members=EPOCH.members):
    seen = {m: [] for m in members}
    lookouts = [Lookout(JobStore(store), m, ecfg, lambda m=m: m in noticed, lambda w, leaving, joiners, m=m:
                        seen[m].append((w, leaving, joiners))) for m in members]
    for lookout in lookouts:
        lookout.world = WORLD
    return lookouts, seen


def test_a_notice_is_published_and_every_worker_foresees_that_leave_once(store):
    lookouts, seen = _lookouts(store, ElasticConfig(min_nproc=1, max_nproc=3), noticed={5})
    for _ in range(2):
        for lookout in lookouts:  # worker 0 looks before worker 5 published: it sees it the next time
            lookout.look()
    assert JobStore(store).notices(3, 3) == {1}  # rank 1 is worker 5
    assert all(seen[m] == [(WORLD, frozenset({5}), ())] for m in EPOCH.members)


def test_the_ready_joiners_are_foreseen_as_the_boundary_will_count_them(store):
    lookouts, seen = _lookouts(store, ElasticConfig(min_nproc=1, max_nproc=4))
    lookouts[0].look()
    assert seen[0] == []  # nobody ready
    for _ in range(3):
        JobStore(store).register_joiner()  # queue places 0 (admitted before), 1 and 2: worker ids 4 and 5
    lookouts[0].look()
    assert seen[0] == [(WORLD, frozenset(), (4,))]  # room for one more worker
    JobStore(store).mark_joiner_dead(1)
    lookouts[0].look()
    assert seen[0][1:] == [(WORLD, frozenset(), (5,))]  # a dead joiner is passed over


def test_a_scripted_join_is_foreseen_only_for_its_step_and_its_number(store):
    ecfg = ElasticConfig(min_nproc=1, max_nproc=6, injects=(Inject(7, "join", (2,)),))
    lookouts, seen = _lookouts(store, ecfg)
    for _ in range(4):
        JobStore(store).register_joiner()
    lookouts[0].look()
    assert seen[0] == []  # the join follows step 7; step 6 runs
    lookouts[0].world = World(EPOCH, (), 7)
    lookouts[0].look()
    assert [joiners for _, _, joiners in seen[0]] == [(4, 5)]


def test_the_thread_looks_while_a_world_is_set_and_stops_when_closed(store):
    lookouts, seen = _lookouts(store, ElasticConfig(min_nproc=1, max_nproc=3), noticed={2})
    lookout = lookouts[2]
    lookout.world = None
    lookout.start()
    try:
        time.sleep(0.3)
        assert seen[2] == [] and JobStore(store).notices(3, 3) == set()  # no world: it does nothing
        lookout.world = WORLD
        deadline = time.monotonic() + 20
        while not seen[2] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen[2] == [(WORLD, frozenset({2}), ())]
    finally:
        lookout.close()
    assert lookout.world is None
