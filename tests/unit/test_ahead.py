"""Work for a change of world done ahead (`elastic.ahead.Ahead`), and a change planned ahead
equal to one planned at the boundary."""

from __future__ import annotations

import threading

import pytest

from shardshift.elastic.ahead import Ahead
from shardshift.elastic.change import Request, plan_change
from shardshift.elastic.config import ElasticConfig
from shardshift.elastic.protocol import Epoch
from shardshift.layout import Layout
from shardshift.train.config import TrainConfig
from support.models import gpt

SMALL = gpt(n_layer=2, n_head=2, d_model=8, seq_len=5, d_ff=12, vocab_size=11)


def test_work_started_ahead_runs_in_the_background_and_is_what_get_returns():
    ahead, release, caller = Ahead(), threading.Event(), threading.get_ident()
    ran_on = []

    def work():
        ran_on.append(threading.get_ident())
        release.wait(10)
        return "planned"

    try:
        ahead.start("k", work)  # returns while the work waits
        assert "k" in ahead and "other" not in ahead
        release.set()
        assert ahead.get("k", lambda: "on the spot") == "planned"
        assert ran_on and ran_on[0] != caller
        ahead.start("k", lambda: "again")  # done once per key
        assert ahead.get("k", lambda: "on the spot") == "planned"
    finally:
        ahead.close()


def test_work_nobody_started_is_done_on_the_spot_and_kept_until_forgotten():
    ahead, calls = Ahead(), []
    try:
        assert ahead.get("k", lambda: calls.append(1) or len(calls)) == 1
        assert ahead.get("k", lambda: calls.append(1) or len(calls)) == 1
        ahead.forget()
        assert "k" not in ahead
        assert ahead.get("k", lambda: calls.append(1) or len(calls)) == 2
    finally:
        ahead.close()


def test_work_that_failed_ahead_raises_its_error_where_the_result_is_needed():
    ahead = Ahead()

    def impossible():
        raise ValueError("no copy of piece 3")

    try:
        ahead.start("k", impossible)
        with pytest.raises(ValueError, match="no copy of piece 3"):
            ahead.get("k", lambda: "on the spot")
    finally:
        ahead.close()


@pytest.mark.parametrize("leaving, joiners", [({2}, []), (set(), [4, 5]), ({0}, [4])])
def test_a_change_planned_ahead_is_the_change_planned_at_the_boundary(leaving, joiners):
    cfg = TrainConfig(layout=Layout(fsdp=4), model=SMALL, steps=4, global_batch=12)
    ecfg = ElasticConfig(min_nproc=2, max_nproc=6,
                         layouts=((3, Layout(fsdp=3)), (5, Layout(dp=5)), (6, Layout(dp=3, fsdp=2))))
    old = Epoch(0, (0, 1, 2, 3), Layout(fsdp=4), 3)
    args = (cfg, ecfg, old, Request("join", 7, 2, leaving=frozenset(leaving), joiners=tuple(joiners)))
    now = plan_change(*args)
    ahead = Ahead()
    try:
        ahead.start(now.placement, now.placement.plan)  # as a worker's foresight does
        planned = plan_change(*args, ahead=ahead)
    finally:
        ahead.close()
    assert planned.placement == now.placement and planned.epoch == now.epoch
    assert planned.plan is not now.plan  # worked out twice, alike:
    assert planned.plan.segments == now.plan.segments and planned.plan.new == now.plan.new
