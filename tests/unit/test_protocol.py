"""The job's store protocol (`elastic.protocol`), over a real c10d store: records round-trip, a
step's decision is made once whatever is counted after it, and reads of what is not written yet
say so instead of blocking."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from shardshift.elastic.protocol import CrashRecord, Epoch, JobStore
from shardshift.layout import Layout


@pytest.fixture
def store() -> JobStore:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    job = JobStore(server)
    job.publish_job(["train", "--elastic"], 3, 2)
    return job


def test_records_round_trip_and_unwritten_keys_read_as_absent(store):
    assert store.current_epoch() is None and store.crash(0) is None and store.member_of(123) is None
    epoch = Epoch(4, (0, 5, 2), Layout(fsdp=3), 7, "join", admitted=3, observed=((Layout(dp=2), 0.25),))
    store.publish_epoch(epoch)
    store.set_current(4)
    assert store.current_epoch() == epoch == Epoch.from_json(epoch.to_json())
    store.publish_crash(4, CrashRecord((5,), 12.5))
    assert store.crash(4) == CrashRecord((5,), 12.5) and store.has_crash(4) and not store.has_crash(3)
    store.register_process(5, pid=123)
    assert store.member_of(123) == 5
    assert store.argv() == ["train", "--elastic"] and store.joiner_id(1) == 4 and store.joiners_started() == 2


def test_a_steps_decision_is_made_once_whatever_is_counted_after_it(store):
    assert store.decision(1, 6) is None
    for _ in range(2):
        store.vote(1, 6)
    assert store.decide(1, 6, apply=store.votes(1, 6) == 3) is False  # a loss was seen with 2 of 3 votes
    assert store.vote(1, 6) == 3  # a worker taken for lost votes late
    assert store.decide(1, 6, apply=True) is False and store.decision(1, 6) is False  # nothing changes
    assert store.decide(1, 7, apply=True) is True and store.decision(1, 7) is True


def test_notices_joiners_and_admissions(store):
    assert store.notices(2, 3) == frozenset()
    store.publish_notice(2, 1)
    assert store.notices(2, 3) == {1}
    places = [store.register_joiner() for _ in range(3)]
    assert places == [0, 1, 2] and store.ready_joiners() == 3
    store.mark_joiner_dead(1)
    assert store.live_joiners(0) == [0, 2] and store.live_joiners(1) == [2]
    store.set_admissions(2, 9, [0, 2])
    assert store.admissions(2, 9) == [0, 2]
    epoch = Epoch(3, (0, 1, 2, 3, 5), Layout(dp=5), 9, "join", admitted=3)
    store.admit(epoch, [0, 2])
    assert store.is_admitted(0) and store.is_admitted(2) and not store.is_admitted(1)
    assert store.wait_for_admission(2) == epoch


def test_a_scripted_event_fires_in_the_first_epoch_that_reaches_it_and_once_per_actor(store):
    assert store.claim_event("3:kill=1", 2) and store.claim_event("3:kill=1", 2)  # every rank of epoch 2
    assert not store.claim_event("3:kill=1", 3)  # the step run again in the next world
    assert store.fire_once("5:term=0", "rank0") and not store.fire_once("5:term=0", "rank0")


def test_the_coordinator_takes_a_silent_stranger_for_lost_even_one_that_never_beat(store):
    """A worker started elsewhere is watched by its heartbeat alone, by the coordinator's clock: one
    that never beat is first seen, then taken for lost once --heartbeat-timeout has passed."""
    import time

    from shardshift.elastic.coordinator import _Crashes

    store.publish_epoch(Epoch(1, (0, 1, 3), Layout(fsdp=3), 4, "join", admitted=1))
    store.set_current(1)
    crashes = _Crashes(store)
    assert crashes.silent_strangers({}, heartbeat_s=0.2) == []  # 0, 1 and 3 seen for the first time
    store.beat(0)
    store.beat(1)
    time.sleep(0.6)  # the coordinator looks twice a second at most
    store.beat(0)
    store.beat(1)
    assert crashes.silent_strangers({}, heartbeat_s=0.2) == [(3, True)]  # 3 never beat; 0 and 1 did since


def test_a_change_is_decided_once_done_or_failed(store):
    assert store.moved_decision(3) is None
    assert store.vote_moved(3) == 1 and store.vote_moved(3) == 2 and store.moved_votes(3) == 2
    assert store.decide_moved(3, False) is False
    assert store.decide_moved(3, True) is False and store.moved_decision(3) is False  # set once
    assert store.decide_moved(4, True) is True and store.moved_decision(4) is True


def _crashes(store):
    from shardshift.elastic.coordinator import _Crashes

    crashes = _Crashes(store)
    crashes.SETTLE_S = 0.0
    return crashes


def _died(crashes, member: int) -> bool:
    survived = crashes._lose(member)
    crashes.first_at -= 1.0  # settled
    crashes.publish_if_settled()
    return survived


def test_a_death_is_recorded_under_the_epoch_it_breaks(store):
    """The current world's record; then, that one written, the change its survivors make next
    (written or not); a change under way, its own; and when the change under way and the next both
    have one, the record waits until a newer change is written. A worker recorded once is not
    recorded again; one in no world nor change under way is not survived."""
    store.publish_epoch(Epoch(0, (0, 1, 2, 3), Layout(fsdp=4), 0))
    store.set_current(0)
    crashes = _crashes(store)
    assert _died(crashes, 1) and store.crash(0).lost == (1,)
    assert _died(crashes, 2) and store.crash(1).lost == (2,)  # the survivors' change into epoch 1
    store.publish_epoch(Epoch(1, (0, 3), Layout(fsdp=2), 3, "crash"))  # it failed (2 died); ...
    store.publish_epoch(Epoch(2, (0, 3), Layout(fsdp=2), 3, "crash"))  # ... tried again
    assert _died(crashes, 3) and store.crash(2).lost == (3,)  # the change under way
    assert _died(crashes, 0) and store.crash(3).lost == (0,)  # the one after it, not written yet
    assert not store.has_crash(4)
    assert _died(crashes, 2)  # recorded already: nothing new
    assert not store.has_crash(4)
    assert not _died(crashes, 9)  # in no world


def test_a_death_waits_while_the_change_under_way_and_the_next_are_both_recorded(store):
    store.publish_epoch(Epoch(0, (0, 1, 2), Layout(fsdp=3), 0))
    store.set_current(0)
    store.publish_epoch(Epoch(1, (0, 1, 2, 5), Layout(fsdp=4), 2, "join"))
    store.publish_crash(1, CrashRecord((5,), 1.0))
    store.publish_crash(2, CrashRecord((1,), 2.0))
    crashes = _crashes(store)
    assert _died(crashes, 2)
    assert not store.has_crash(3)  # held: the change it breaks is not written yet
    store.publish_epoch(Epoch(2, (0, 2), Layout(fsdp=2), 2, "crash"))
    store.publish_epoch(Epoch(3, (0,), Layout(), 2, "crash"))
    crashes.publish_if_settled()
    assert store.crash(3).lost == (2,)
