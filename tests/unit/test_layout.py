"""Layout parsing, rank order and validation: pure, no processes."""

from __future__ import annotations

import pytest

from shardshift.layout import AXES, Layout, all_layouts
from shardshift.models import model_spec
from shardshift.reshard.training import stage_layers
from shardshift.train.config import TrainConfig


def test_parse_and_print_round_trip():
    layout = Layout.parse("tp=2, dp=2")
    assert (layout.dp, layout.fsdp, layout.tp, layout.pp) == (2, 1, 2, 1)
    assert str(layout) == "dp=2,tp=2"
    assert Layout.parse(str(layout)) == layout
    assert Layout.parse("") == Layout() and str(Layout()) == "dp=1"
    assert Layout.parse("pp=2,fsdp=2").world_size == 4


@pytest.mark.parametrize(
    "text, needle",
    [
        ("dp=2,xp=2", "unknown axis 'xp'"),
        ("dp=-1", "dp=-1"),
        ("dp=0", ">= 1"),
        ("dp=two", "not an integer"),
        ("dp", "axis=degree"),
        ("dp=2,dp=2", "given twice"),
    ],
)
def test_parse_refuses_bad_text(text, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        Layout.parse(text)


def test_rank_order_is_pp_dp_fsdp_tp_row_major():
    layout = Layout(dp=2, fsdp=3, tp=2, pp=2)
    for rank in range(layout.world_size):
        coord = layout.coord(rank)
        assert layout.rank(coord) == rank
        expected = ((coord.pp * 2 + coord.dp) * 3 + coord.fsdp) * 2 + coord.tp
        assert expected == rank
    # tp neighbours are adjacent ranks; pipeline stages are the outermost blocks.
    assert layout.coord(1).tp == 1 and layout.coord(layout.world_size // 2).pp == 1
    assert AXES == ("pp", "dp", "fsdp", "ep", "tp")


def test_ep_sits_between_fsdp_and_tp_and_splits_the_batch():
    layout = Layout.parse("dp=2,ep=3,tp=2")
    assert str(layout) == "dp=2,ep=3,tp=2" and layout.world_size == 12 and layout.data_parallel == 6
    for rank in range(layout.world_size):
        coord = layout.coord(rank)
        assert layout.rank(coord) == rank == (coord.dp * 3 + coord.ep) * 2 + coord.tp
    assert sorted({layout.data_rank(c) for c in layout.coords()}) == list(range(6))
    assert all(layout.ep == 1 for layout in all_layouts(12))


def test_training_refuses_ep_saying_it_is_for_planning():
    with pytest.raises(ValueError, match="ep=2.*simulate"):
        model_spec("tiny").check_layout(Layout(ep=2))


def test_data_rank_covers_each_batch_slice_once_per_stage_and_tp():
    layout = Layout(dp=2, fsdp=2, tp=2, pp=2)
    seen = {}
    for coord in layout.coords():
        seen.setdefault((coord.pp, coord.tp), []).append(layout.data_rank(coord))
    assert all(sorted(v) == [0, 1, 2, 3] for v in seen.values())


def test_all_layouts_enumerates_every_factorisation():
    assert len(all_layouts(4)) == 10
    assert len(set(all_layouts(8))) == len(all_layouts(8)) == 20
    assert all(layout.world_size == 8 for layout in all_layouts(8))


def test_world_size_mismatch_says_what_would_do():
    with pytest.raises(ValueError, match=r"dp=2,tp=2 has 4 ranks .* 3 processes .* dp=3"):
        Layout.parse("dp=2,tp=2").check_world(3)


def test_model_constraints():
    tiny = model_spec("tiny")
    with pytest.raises(ValueError, match=r"tp=3 does not divide n_head=8; choose tp in \{1, 2, 4, 8\}"):
        tiny.check_layout(Layout(tp=3))
    with pytest.raises(ValueError, match=r"pp=9 is larger than .* n_layer=8"):
        tiny.check_layout(Layout(pp=9))
    for layout in all_layouts(8):  # the default model takes every layout of up to 8 ranks
        tiny.check_layout(layout)


def test_batch_constraints():
    def cfg(layout, **kw):
        return TrainConfig(layout=Layout.parse(layout), model=model_spec("tiny"), steps=1, **kw)

    with pytest.raises(ValueError, match="--global-batch 2 leaves some of the dp\\*fsdp=3 data ranks without"):
        cfg("dp=3", global_batch=2)
    cfg("dp=3", global_batch=16)  # 6, 5 and 5 sequences
    with pytest.raises(ValueError, match="of 16 sequences .* do not split into --micro-batches 3"):
        cfg("pp=2", global_batch=16, micro_batches=3)
    with pytest.raises(ValueError, match="of 2 and 3 sequences .* do not split into --micro-batches 2"):
        cfg("dp=2,pp=2", global_batch=5, micro_batches=2)
    cfg("dp=3,pp=2", global_batch=12)
    with pytest.raises(ValueError, match="fewer than pp=4"):
        cfg("pp=4", global_batch=16, micro_batches=2)
    with pytest.raises(ValueError, match="--dtype 'float16'"):
        cfg("dp=1", dtype="float16")
    assert cfg("pp=2").micro_batches == 4


def test_stage_layers_are_contiguous_and_as_even_as_possible():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(5, 4) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert [b for r in stage_layers(13, 5) for b in r] == list(range(13))
