"""The elastic layout policy: memory per rank, step features, calibration and the choice (pure)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shardshift.elastic.policy import (
    ACTIVATION_VALUES,
    DEFAULT,
    LOGIT_COPIES,
    NEAR,
    CostModel,
    activation_bytes,
    calibrate,
    choose_layout,
    explain,
    state_bytes_per_rank,
    step_features,
)
from shardshift.layout import Layout, all_layouts
from shardshift.models import model_spec
from shardshift.models.space import state_space
from shardshift.train.config import TrainConfig
from support.models import gpt

SMALL = gpt(n_layer=2, n_head=2, d_model=8, seq_len=5, d_ff=12, vocab_size=11)


def config(model = SMALL, **kw) -> TrainConfig:
    kw.setdefault("global_batch", 8)
    return TrainConfig(layout=Layout(), model=model, steps=1, **kw)


def param_bytes(cfg: TrainConfig) -> int:
    space = state_space(cfg.model, cfg.param_dtype)
    return sum(t.nbytes for t in space.tensors if t.kind == "param")


def test_replication_holds_the_whole_model_four_times():
    for dtype in ("float32", "float64"):
        cfg = config(dtype=dtype)
        whole = param_bytes(cfg)
        assert whole == SMALL.num_params() * cfg.param_dtype.itemsize
        for n in (1, 2, 3, 4):
            layout = Layout(dp=n)
            (activations,) = activation_bytes(cfg, layout)
            assert state_bytes_per_rank(cfg, layout) == 4 * whole + activations


def test_fsdp_holds_about_one_nth():
    cfg = config()
    whole = 4 * param_bytes(cfg)
    space = state_space(SMALL, cfg.param_dtype)
    rows = sum(4 * t.nbytes // t.shape[0] for t in space.tensors if t.kind == "param")  # a row of each
    for n in (2, 3, 4):
        layout = Layout(fsdp=n)
        state = state_bytes_per_rank(cfg, layout) - activation_bytes(cfg, layout)[0]
        assert whole / n <= state <= whole / n + rows  # torch.chunk: at most one row more per tensor
    base = config(model_spec("base"), global_batch=12)
    whole = 4 * param_bytes(base)
    state = state_bytes_per_rank(base, Layout(fsdp=4)) - activation_bytes(base, Layout(fsdp=4))[0]
    assert state == pytest.approx(whole / 4, rel=1e-3)
    assert state_bytes_per_rank(base, Layout(dp=4)) - activation_bytes(base, Layout(dp=4))[0] == whole


def test_activation_estimate_by_hand():
    cfg = config(global_batch=7)  # dp=3: slices of 3, 2 and 2: the largest counts
    tokens = 3 * SMALL.seq_len
    expected = 4 * (2 * ACTIVATION_VALUES * tokens * 8 + LOGIT_COPIES * tokens * 11)
    assert activation_bytes(cfg, Layout(dp=3)) == (expected,)
    # pp=2 with 4 micro-batches of 2: stage 0 keeps 2 in flight, stage 1 one, and the logits of one.
    cfg = config(global_batch=8, micro_batches=4)
    micro = 2 * SMALL.seq_len
    assert activation_bytes(cfg, Layout(pp=2)) == (
        4 * ACTIVATION_VALUES * 2 * micro * 8,
        4 * (ACTIVATION_VALUES * micro * 8 + LOGIT_COPIES * micro * 11),
    )
    with pytest.raises(ValueError, match="does not divide n_head=2"):
        state_bytes_per_rank(cfg, Layout(tp=4))


def test_step_features_by_hand():
    base = config(model_spec("base"), global_batch=12)
    p = model_spec("base").num_params()
    f = step_features(base, Layout(dp=2, fsdp=2))
    assert f.compute == 6 * p * 3 * 256
    assert f.comm_bytes == pytest.approx(4 * p * (2 * 0.5 / 2 + 3 * 0.5), rel=1e-6)
    assert f.messages == 2 + 17 * (3 + 1)
    assert step_features(base, Layout(dp=4)).comm_bytes == 2 * 3 / 4 * 4 * p
    # pp=2 (4 micro-batches): the bubble, and one activation per rank sent across the boundary.
    f = step_features(base, Layout(pp=2, tp=2))
    assert f.comm_bytes >= 12 * 256 * 768 * 4 * (1 + 4 * 8)
    assert f.compute > 6 * p / 4 * 12 * 256 * (1 + 4) / 4


def test_default_is_in_the_measured_ballpark():
    base = config(model_spec("base"), global_batch=12)
    seconds = DEFAULT.predict(step_features(base, Layout(dp=2, fsdp=2)))
    assert 8 < seconds < 32  # measured: about 16 s on 2 cores


def test_memory_limit_excludes_replicated_layouts():
    cfg = config()
    free_bytes = CostModel(1e-9, 0.0, 1e-6)
    assert choose_layout(4, cfg, free_bytes, None) == Layout(dp=4)
    limit = state_bytes_per_rank(cfg, Layout(fsdp=4))
    assert limit < state_bytes_per_rank(cfg, Layout(dp=4))
    chosen = choose_layout(4, cfg, free_bytes, limit)
    assert chosen.dp < 4 and state_bytes_per_rank(cfg, chosen) <= limit
    rows = {layout: (seconds, need, why) for layout, seconds, need, why in explain(4, cfg, free_bytes, limit)}
    assert set(rows) == set(all_layouts(4))
    assert "above the limit" in rows[Layout(dp=4)][2] and rows[Layout(dp=4)][0] is not None
    for seconds, need, why in rows.values():
        assert (why == "") == (seconds is not None and need <= limit)


def test_one_observation_is_reproduced():
    cfg = config(model_spec("base"), global_batch=12)
    fitted = calibrate([(cfg, Layout(dp=2, fsdp=2), 16.0)])
    assert fitted.predict(step_features(cfg, Layout(dp=2, fsdp=2))) == pytest.approx(16.0, rel=1e-12)
    ratios = np.array(fitted.coefficients) / np.array(DEFAULT.coefficients)
    assert np.allclose(ratios, ratios[0], rtol=1e-12)
    # Repeated measurements of one layout: their mean.
    fitted = calibrate([(cfg, Layout(fsdp=4), t) for t in (10.0, 12.0, 14.0)])
    assert fitted.predict(step_features(cfg, Layout(fsdp=4))) == pytest.approx(12.0, rel=1e-12)
    assert calibrate([]) == DEFAULT
    with pytest.raises(ValueError, match="must be finite and > 0"):
        calibrate([(cfg, Layout(fsdp=4), 0.0)])


def test_several_observations_recover_the_model():
    cfg = config(global_batch=24)
    truth = CostModel(seconds_per_compute=2e-7, seconds_per_byte=3e-5, seconds_per_message=4e-3)
    seen = [Layout(fsdp=4), Layout(dp=4), Layout(tp=2, dp=2), Layout(pp=2, fsdp=2), Layout(dp=3), Layout(fsdp=2)]
    features = np.array([step_features(cfg, layout).values for layout in seen])
    assert np.linalg.matrix_rank(features / features.max(axis=0)) == 3  # the data determine all three prices
    observations = [(cfg, layout, truth.predict(step_features(cfg, layout))) for layout in seen]
    fitted = calibrate(observations)
    for n in (2, 3, 4, 6):
        for layout in all_layouts(n):
            try:
                f = step_features(cfg, layout)
            except ValueError:
                continue
            assert fitted.predict(f) == pytest.approx(truth.predict(f), rel=1e-6), layout
    shuffled = observations[:]
    random.Random(0).shuffle(shuffled)
    assert calibrate(shuffled) == fitted  # every worker gets the same model, whatever the order
    # Two layouts leave a direction free: the fit still reproduces both.
    fitted = calibrate(observations[:2])
    for _, layout, seconds in observations[:2]:
        assert fitted.predict(step_features(cfg, layout)) == pytest.approx(seconds, rel=1e-6)


def test_cheap_bandwidth_replicates_and_dear_bandwidth_communicates_less():
    base = config(model_spec("base"), global_batch=12)
    assert choose_layout(4, base, CostModel(1e-12, 0.0, 1e-2), None) == Layout(dp=4)  # the fewest calls
    dear = choose_layout(4, base, CostModel(1e-15, 1e-6, 0.0), None)
    valid = [layout for layout, seconds, _, _ in explain(4, base, DEFAULT, None) if seconds is not None]
    least = min(step_features(base, layout).comm_bytes for layout in valid)
    assert step_features(base, dear).comm_bytes == least
    assert least < step_features(base, Layout(dp=4)).comm_bytes


def test_ties_are_broken_deterministically():
    cfg = config()
    free = CostModel(0.0, 0.0, 0.0)  # every layout takes no time
    rows = explain(4, cfg, free, None)
    fitting = [layout for layout, _, _, why in rows if not why]
    assert fitting == sorted(fitting, key=lambda layout: (layout.pp, layout.tp, str(layout)))
    assert choose_layout(4, cfg, free, None) == Layout(dp=2, fsdp=2)  # pp=1, tp=1, first by name
    assert all(choose_layout(4, cfg, free, None) == fitting[0] for _ in range(3))


def test_layouts_predicted_within_a_few_percent_of_the_best_go_to_the_simplest():
    base = config(model_spec("base"), global_batch=12)
    rows = [(layout, seconds) for layout, seconds, _, why in explain(4, base, DEFAULT, None) if not why]
    best = rows[0][1]
    chosen = choose_layout(4, base, DEFAULT, None)
    near = [layout for layout, seconds in rows if seconds <= best * (1 + NEAR)]
    assert chosen in near and len(near) > 1
    assert chosen == min(near, key=lambda layout: (layout.pp, layout.tp, str(layout)))
    # With redundancy, a replicated layout needs no copies and a sharded one does.
    assert state_bytes_per_rank(base, Layout(dp=2, fsdp=2), redundancy=1) == state_bytes_per_rank(base, Layout(dp=2, fsdp=2))
    assert state_bytes_per_rank(base, Layout(fsdp=4), redundancy=1) > state_bytes_per_rank(base, Layout(fsdp=4))


def test_nothing_fits():
    cfg = config()
    with pytest.raises(ValueError, match=r"no layout of 4 workers fits \(.*above the limit.*--layout-for 4:LAYOUT, "
                                         r"or allow more memory per rank"):
        choose_layout(4, cfg, DEFAULT, 1)
    # Refused by the model and the batch alone: more memory would not help.
    refused = r"dp=3: --global-batch 2 .*tp=3: tp=3 does not divide.*--layout-for 3:LAYOUT$"
    with pytest.raises(ValueError, match=refused):
        choose_layout(3, config(global_batch=2), DEFAULT, None)
    with pytest.raises(ValueError, match="at least one worker"):
        choose_layout(0, cfg, DEFAULT, None)


def test_a_mixture_of_experts_is_offered_expert_parallel_layouts_and_a_dense_model_is_not():
    moe = TrainConfig(layout=Layout(fsdp=4), model=model_spec("moe-test"), steps=4, global_batch=8)
    dense = TrainConfig(layout=Layout(fsdp=4), model=model_spec("test"), steps=4, global_batch=8)
    offered = {str(row[0]) for row in explain(4, moe, DEFAULT, None) if row[1] is not None}
    assert {"ep=4", "fsdp=2,ep=2", "ep=2,pp=2"} <= offered and len(all_layouts(4, with_ep=True)) == 15
    assert all(row[0].ep == 1 for row in explain(4, dense, DEFAULT, None))
    # Splitting the experts over ep divides what a rank holds of them: less memory than replicating.
    assert state_bytes_per_rank(moe, Layout(ep=4)) < state_bytes_per_rank(moe, Layout(dp=4))
    # The exchange is priced: ep=4 sends what dp=4 does not in its forward and backward.
    assert step_features(moe, Layout(ep=4)).messages > step_features(moe, Layout(dp=4)).messages
