"""Online layout switches on real gloo processes, checked against PyTorch DCP and unswitched runs.

- Oracle: after `Trainer.switch(B)` from layout A, every rank's state (parameter shards, AdamW
  moments and steps, progress, RNG) is bit-identical to what DCP gives when the same state is saved
  under A and loaded into a trainer built under B with the same rank order.
- A run that switches several times agrees, loss for loss, with the run that never switched
  (float64, relative 1e-9: the layouts sum gradients in different orders, nothing else differs).
- A -> B -> A gives back bit-identical state; an invalid layout is refused and training goes on.
"""

from __future__ import annotations

import gc
import os
import random

import pytest
import torch
from torch.distributed.tensor import DTensor

from shardshift.layout import Layout, all_layouts
from shardshift.models import model_spec
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig
from shardshift.train.trainer import Trainer
from support import EXAMPLE_MODEL
from support.dist import run_distributed
from support.training import differences, local_state

SEED = 3


def _config(text: str, dtype: str = "float64", steps: int = 8, model: str = "test") -> TrainConfig:
    return TrainConfig(
        layout=Layout.parse(text), model=model_spec(model), steps=steps,
        seed=SEED, dtype=dtype, global_batch=8,
    )


# A fixed random draw of ordered pairs among the 10 layouts of 4 ranks, plus the pairs that cross
# every kind of boundary (pp stages, strided fsdp-over-tp shards, replication to sharding).
_LAYOUTS = [str(layout) for layout in all_layouts(4)]
PAIRS = [("fsdp=2,tp=2", "pp=2,dp=2"), ("pp=4", "tp=4"), ("dp=4", "fsdp=4"), ("dp=2,tp=2", "fsdp=2,pp=2")]
PAIRS += random.Random(7).sample([(a, b) for a in _LAYOUTS for b in _LAYOUTS if a != b], 2)


# float64 state; bfloat16 training keeps float32 state (autocast), switched the same way. The Llama
# (whose rotary buffer the new layout's model must rebuild) across stages and strided shards into
# key-value heads split over tp.
CASES = [("test", "float64", before, after) for before, after in PAIRS] + [("test", "bfloat16", *PAIRS[0])]
CASES += [("llama-test", "float64", "fsdp=2,tp=2", "pp=2,dp=2"), ("llama-test", "float64", "pp=4", "tp=4")]
# The README's model of one's own (a plain nn.Module and its ModuleSpec, named as --model names it).
CASES += [(EXAMPLE_MODEL, "float64", "fsdp=2,tp=2", "pp=2,dp=2")]


def _oracle(rank: int, world_size: int, root: str, cases) -> dict:
    out = {}
    for model, dtype, before, after in cases:
        trainer = Trainer(_config(before, dtype, model=model), rank, "cpu")
        for _ in range(2):
            trainer.train_step()
        path = checkpoint.save(trainer, f"{root}/{len(out)}-{dtype}-{before}-to-{after}")
        report = trainer.switch(Layout.parse(after), budget=16 << 10)
        switched = local_state(trainer)
        reference = Trainer(_config(after, dtype, model=model), rank, "cpu", ranks=trainer.par.ranks)
        checkpoint.load(reference, path)
        loaded = local_state(reference)
        # One more step in each: the switched trainer trains on, exactly as the reloaded one.
        losses = (trainer.train_step().loss, reference.train_step().loss)
        out[(model, dtype, before, after)] = {
            "diff": differences(switched, loaded), "keys": len(switched), "report": report,
            "moments": sum(k.startswith("exp_avg:") for k in switched), "losses": losses,
        }
    return out


def test_switch_is_bit_identical_to_dcp_save_and_load(tmp_path, budget):
    per_rank = run_distributed(4, _oracle, str(tmp_path), CASES, timeout_s=budget.left())
    for pair in CASES:
        for rank, results in enumerate(per_rank):
            result = results[pair]
            assert result["diff"] == [], f"{pair} rank {rank}: differs from DCP in {result['diff'][:5]}"
            assert result["moments"] > 0, "the comparison must include AdamW state"
            assert result["losses"][0] == result["losses"][1], (pair, rank, result["losses"])
        report = per_rank[0][pair]["report"]
        # Processor time summed over the ranks: one figure, the same on every rank.
        assert report.move_cpu_seconds > 0
        assert {r[pair]["report"].move_cpu_seconds for r in per_rank} == {report.move_cpu_seconds}
        assert report.bytes_moved == report.bytes_lower_bound
        assert report.bytes_moved + report.bytes_kept == report.bytes_total
        assert report.rounds > 1  # the 16 KiB budget cuts every switch into rounds
    # `simulate switch` plans the same switch from the same spec: the same bytes moved and kept.
    from shardshift.simulate.cluster import Cluster
    from shardshift.simulate.switch import model_space, simulate_switch

    model, dtype, before, after = CASES[-1]
    planned = simulate_switch(model_space(model, dtype), Layout.parse(before), Layout.parse(after),
                              Cluster(hosts=1, name="one host")).plan
    report = per_rank[0][CASES[-1]]["report"]
    assert (planned.bytes_moved, planned.bytes_kept) == (report.bytes_moved, report.bytes_kept) != (0, 0)
    # Whole pieces kept were handed over (no copy) in the real model's DTensor and FSDP2 tensors,
    # and the state above is still DCP's to the bit.
    handed = {pair: per_rank[0][pair]["report"].bytes_handed_over for pair in CASES}
    assert handed[("test", "float64", "pp=4", "tp=4")] > 0 and handed[("test", "float64", "dp=2,tp=2", "fsdp=2,pp=2")] > 0, handed


def _holdings_vs_dtensor(rank: int, world_size: int, model: str) -> tuple[list, int, int]:
    """Compare the pure `holding` with DTensor's own placement math on the real sharded model."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from shardshift.models.space import state_space
    from shardshift.reshard.plan import axis_orders
    from shardshift.reshard.space import holding
    from shardshift.train.parallelize import build_parallel, build_stage_skeleton

    cfg = model_spec(model)
    space = state_space(cfg, torch.float32)
    by_key = {t.key: t for t in space.tensors}
    wrong, strided, checked = [], 0, 0
    for layout in all_layouts(world_size):
        par = build_parallel(layout, rank, "cpu", ranks=axis_orders(layout)[-1])  # tp outermost
        model = build_stage_skeleton(cfg, par, torch.float32)
        model.to_empty(device="cpu")  # FSDP2 pads meta shards; allocated ones are exact
        held = {t.name for t in space.tensors if t.kind == "param" and holding(space, layout, par.coord, t)}
        if held != {fqn for fqn, _ in model.named_parameters()}:
            wrong.append((str(layout), "stage ownership", sorted(held ^ {f for f, _ in model.named_parameters()})))
        for fqn, param in model.named_parameters():
            box = holding(space, layout, par.coord, by_key[f"param:{fqn}"])
            if isinstance(param, DTensor):
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                strided += any(type(p).__name__ == "_StridedShard" for p in param.placements)
                expected = (tuple(shape), tuple(offset), tuple(param.to_local().shape))
            else:
                expected = (tuple(param.shape), (0,) * param.dim(), tuple(param.shape))
            if (box.sizes, box.offsets, box.sizes) != expected:
                wrong.append((str(layout), fqn, box, expected))
            checked += 1
    return wrong, strided, checked


@pytest.mark.parametrize("model", ["test", "llama-test", EXAMPLE_MODEL], ids=["test", "llama-test", "example"])
def test_holdings_follow_dtensor_placements(budget, model):
    """Every layout of 4 ranks in a non-default rank order, uneven shards (the GPT's pos_emb has 13
    rows, the Llama's vocabulary 259)."""
    for wrong, strided, checked in run_distributed(4, _holdings_vs_dtensor, model, timeout_s=budget.left()):
        assert wrong == [], wrong[:5]
        assert strided > 0 and checked > 300  # fsdp-over-tp strided shards were among them


SWITCHES = {3: "fsdp=2,tp=2", 5: "tp=2,pp=2", 7: "fsdp=4"}  # before steps 3, 5 and 7 (1-based)
BUDGET = 32 << 10


def _switching_run(rank: int, world_size: int) -> dict:
    steps = 8
    straight = Trainer(_config("dp=4", steps=steps), rank, "cpu")
    expected = [straight.train_step().loss for _ in range(steps)]
    del straight

    trainer = Trainer(_config("dp=4", steps=steps), rank, "cpu")
    losses, reports, refused = [], [], []
    prepared = stale = None
    for step in range(1, steps + 1):
        if step in SWITCHES:
            if step == 7:  # prepared before the switch at step 5: the state has moved since
                try:
                    trainer.switch(stale)
                except ValueError as err:
                    refused.append(str(err))
            target = prepared if step == 5 else Layout.parse(SWITCHES[step])
            reports.append(trainer.switch(target, budget=BUDGET))
        if step == 4:  # layouts the job cannot take are refused before anything changes
            before = local_state(trainer)
            for bad in (Layout(tp=3), Layout(dp=2), Layout(pp=8)):
                try:
                    trainer.switch(bad, budget=BUDGET)
                except ValueError as err:
                    refused.append(str(err))
            unchanged = differences(before, local_state(trainer)) == [] and str(trainer.cfg.layout) == "fsdp=2,tp=2"
            # The next switch is prepared a step ahead, as the run loop does.
            prepared = trainer.prepare_switch(Layout.parse(SWITCHES[5]), budget=BUDGET)
            stale = trainer.prepare_switch(Layout.parse(SWITCHES[7]), budget=BUDGET)
        losses.append(trainer.train_step().loss)

    # A -> B -> A: the same bits come back.
    start = local_state(trainer)
    trainer.switch(Layout.parse("tp=2,pp=2"), budget=BUDGET)
    trainer.switch(Layout.parse("fsdp=4"), budget=BUDGET)
    round_trip = differences(start, local_state(trainer))
    # More round trips leave no more threads behind (each gloo group has three): the old layout's
    # groups are destroyed by each switch.
    threads = []
    for _ in range(2):
        for _ in range(3):
            trainer.switch(Layout.parse("tp=2,pp=2"), budget=BUDGET)
            trainer.switch(Layout.parse("fsdp=4"), budget=BUDGET)
        gc.collect()
        threads.append(len(os.listdir("/proc/self/task")))
    return {
        "expected": expected, "losses": losses, "reports": reports, "refused": refused,
        "unchanged": unchanged, "round_trip": round_trip, "layout": str(trainer.cfg.layout), "threads": threads,
    }


def test_switching_run_matches_the_unswitched_run(budget):
    from shardshift.models.space import state_space

    largest = max(t.nbytes for t in state_space(model_spec("test"), torch.float64).tensors)
    for rank, result in enumerate(run_distributed(4, _switching_run, timeout_s=budget.left())):
        got, expected = torch.tensor(result["losses"]), torch.tensor(result["expected"])
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=0, msg=f"rank {rank}")
        assert [r.new.split(" ")[0] for r in result["reports"]] == list(SWITCHES.values())
        assert [r.step for r in result["reports"]] == list(SWITCHES)
        assert result["reports"][0].bytes_moved == 0  # dp=4 holds everything everywhere
        assert all(r.bytes_moved > 0 for r in result["reports"][1:])
        for report in result["reports"]:
            assert report.bytes_moved == report.bytes_lower_bound
            # Peak memory: max(old state, new state) + the budget + one tensor a round boundary cuts.
            assert 0 <= report.extra_mem_bytes <= report.budget + largest, report
        assert len(result["refused"]) == 4 and result["unchanged"], result["refused"]
        assert "was prepared from fsdp=2,tp=2" in result["refused"][3]
        assert [r.prepared_ahead for r in result["reports"]] == [False, True, False]
        assert "tp=3 does not divide" in result["refused"][0]
        assert "has 2 ranks but the job has 4" in result["refused"][1]
        assert "pp=8" in result["refused"][2]
        assert result["round_trip"] == [] and result["layout"] == "fsdp=4"
        assert result["threads"][1] <= result["threads"][0], result["threads"]
