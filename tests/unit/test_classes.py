"""Coordinates grouped by the box they hold (`reshard.classes`): the same boxes and kept bytes as
asking every rank, from one `holding` per distinct box."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from shardshift.layout import Layout, all_layouts
from shardshift.models.space import state_space
from shardshift.reshard.classes import NOTHING, KeptBytes, all_classes, classes_of
from shardshift.reshard.plan import Assignment, choose_ranks, coord_holdings
from shardshift.reshard.space import holding
from support.models import gpt

# Uneven on purpose: 5 layers over pp=2 and pp=4, 13 positions over fsdp=4, 6 heads over tp=2 and tp=3.
SPACE = state_space(gpt(n_layer=5, n_head=6, d_model=24, seq_len=13, d_ff=36, vocab_size=50), torch.float32)


def _fits(layout: Layout) -> bool:
    try:
        SPACE.check(layout)
        return True
    except ValueError:
        return False


LAYOUTS = [layout for n in (4, 6, 8, 12) for layout in all_layouts(n) if _fits(layout)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_classes_give_every_rank_the_box_holding_gives_it(layout):
    by_coord = coord_holdings(SPACE, layout)
    for rank, coord in enumerate(layout.coords()):
        assert by_coord[rank] == tuple(holding(SPACE, layout, coord, t) for t in SPACE.tensors), (layout, rank)


def test_a_tensor_has_one_class_per_distinct_box():
    layout = Layout(pp=2, dp=2, fsdp=2, tp=3)
    by_key = {t.key: t for t in SPACE.tensors}
    weight = classes_of(SPACE, layout, by_key["param:blocks.0.attn.q.weight"])  # tp rows, then fsdp
    assert len(weight.boxes) == 6 and weight.signature == ((2, 4), 0)
    assert (weight.of_coord[layout.world_size // 2:] == NOTHING).all()  # stage 1 holds none of block 0
    bias = classes_of(SPACE, layout, by_key["param:blocks.4.attn.out.bias"])  # row-parallel bias: fsdp only
    assert len(bias.boxes) == 2 and bias.signature == ((2,), 1)
    step = classes_of(SPACE, layout, by_key["step:blocks.4.attn.out.bias"])
    assert len(step.boxes) == 1 and step.signature == ((), 1)
    rng = classes_of(SPACE, layout, by_key["rng:cpu"])
    assert len(rng.boxes) == 1 and (rng.of_coord == 0).all()


@pytest.mark.parametrize("seed", range(6))
def test_kept_bytes_from_classes_equal_the_sum_over_tensors(seed):
    rng = random.Random(seed)
    n = rng.choice([4, 6, 8, 12])
    a, b = rng.choice([x for x in LAYOUTS if x.world_size == n]), rng.choice([x for x in LAYOUTS if x.world_size == n])
    old, new = all_classes(SPACE, a), all_classes(SPACE, b)
    kept = KeptBytes(SPACE.tensors, old, new)
    held = [rng.randrange(-1, n) for _ in range(5)]  # -1: a process that held nothing
    coords = rng.sample(range(n), min(n, 5))
    want = np.zeros((len(held), len(coords)))
    for p, h in enumerate(held):
        for i, c in enumerate(coords):
            for t, x, y in zip(SPACE.tensors, old, new):
                bx, by = (None if h == NOTHING else x.box(h)), y.box(c)
                if bx is not None and by is not None:
                    want[p, i] += t.itemsize * bx.intersect(by).numel
    np.testing.assert_array_equal(kept.matrix(held, coords), want)
    order = rng.sample(range(n), n)
    assert kept.total(order) == int(sum(want_one(SPACE, old, new, h, c) for c, h in enumerate(order)))


def want_one(space, old, new, held: int, coord: int) -> int:
    return sum(t.itemsize * x.box(held).intersect(y.box(coord)).numel for t, x, y in zip(space.tensors, old, new)
               if x.box(held) is not None and y.box(coord) is not None)


def test_a_switch_to_the_same_layout_keeps_every_rank_where_it_is():
    for layout in LAYOUTS:
        assert choose_ranks(SPACE, Assignment.identity(layout), layout).ranks == tuple(range(layout.world_size))
