"""The mixture-of-experts model (`moe-test`) trains to the numerics contract: every 4-rank layout,
and each with expert parallelism (ep=4, ep=2 with dp, fsdp, tp or pp),
computes the losses of one process (float64, relative 1e-9), the loss being the cross entropy plus
the load-balancing term; so do micro-batches of one sequence; and a switch is DCP's save and load
to the bit.

`moe-test` cuts shards unevenly (13 positions, 5 layers over pp=4 as 2, 1, 1, 1, 259 vocabulary
rows over fsdp=4) and FSDP2 splits its stacked experts (4, 24, 32) along the experts. Under tp the
router and the experts are whole on every rank while attention and the shared expert are split, so
every tp rank must route alike. The balancing term is a mean of per-sequence terms (docs/models.md),
so data ranks and micro-batches split it as they split the cross entropy: a term over each rank's
or micro-batch's tokens together would not match here.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from shardshift.layout import Layout, all_layouts
from shardshift.models import model_spec
from shardshift.models.space import state_space
from shardshift.reshard.space import holding
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig
from shardshift.train.trainer import Trainer
from support.dist import run_distributed
from support.training import ATOL, differences, full_parameters, local_state

STEPS = 3
RTOL = 1e-9
LAYOUTS = [str(layout) for layout in all_layouts(4)]
# Expert parallelism with each other axis: the experts split over ep (1 or 2 of the 4 a rank),
# tokens sent to them and back by all-to-all, dense parameters averaged over ep too.
EP_LAYOUTS = ["ep=4", "ep=2,fsdp=2", "ep=2,tp=2", "ep=2,pp=2", "ep=2,dp=2"]
# micro-batches of one sequence: DDP's no_sync, the pipeline's micro-batches, and one exchange per micro-batch
MICRO = ["dp=4", "pp=2,fsdp=2", "ep=2,fsdp=2"]
SWITCHES = [("fsdp=2,tp=2", "pp=2,dp=2"), ("fsdp=4", "ep=2,fsdp=2"), ("ep=4", "ep=2,pp=2")]


def _config(text: str, **changes) -> TrainConfig:
    fields = dict(model=model_spec("moe-test"), steps=STEPS, dtype="float64", global_batch=8, seed=3)
    return TrainConfig(layout=Layout.parse(text), **{**fields, **changes})


def _placement_errors(trainer: Trainer) -> list:
    """The parameters whose local piece is not the box the derived space places on this rank."""
    space = state_space(trainer.cfg.model, trainer.cfg.param_dtype)
    by_key = {t.key: t for t in space.tensors}
    wrong = []
    for fqn, param in trainer.model.named_parameters():
        box = holding(space, trainer.cfg.layout, trainer.par.coord, by_key[f"param:{fqn}"])
        if isinstance(param, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            expected = (tuple(shape), tuple(offset), tuple(param.to_local().shape))
        else:
            expected = (tuple(param.shape), (0,) * param.dim(), tuple(param.shape))
        if box is None or (box.sizes, box.offsets, box.sizes) != expected:
            wrong.append((fqn, box, expected))
    return wrong


def _train(rank: int, text: str, **changes) -> dict:
    trainer = Trainer(_config(text, **changes), rank, "cpu")
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    return {"losses": losses, "params": full_parameters(trainer), "wrong": _placement_errors(trainer)}


def _one_process(rank: int, world_size: int) -> dict:
    spec = model_spec("moe-test")
    unbalanced = spec.with_config({**spec.config_dict(), "router_aux_loss_coef": 0.0})
    return {**_train(rank, "dp=1"), "without_balance": Trainer(_config("dp=1", model=unbalanced), rank, "cpu").train_step().loss}


def _switch_against_dcp(rank: int, root: str, before: str, after: str) -> dict:
    trainer = Trainer(_config(before, steps=8), rank, "cpu")
    for _ in range(2):
        trainer.train_step()
    path = checkpoint.save(trainer, f"{root}/moe-{before}")
    report = trainer.switch(Layout.parse(after), budget=16 << 10)
    switched = local_state(trainer)
    reference = Trainer(_config(after, steps=8), rank, "cpu", ranks=trainer.par.ranks)
    checkpoint.load(reference, path)
    loaded = local_state(reference)
    return {"diff": differences(switched, loaded), "keys": len(switched),
            "experts": sum("mlp.experts." in key for key in switched),
            "moved": (report.bytes_moved, report.bytes_lower_bound),
            "losses": (trainer.train_step().loss, reference.train_step().loss)}


def _four_processes(rank: int, world_size: int, root: str) -> dict:
    return {"checkpointed": {mode: _train(rank, "ep=2,fsdp=2", activation_checkpointing=mode)["losses"]
                             for mode in ("full", "selective")},
            "layouts": {text: _train(rank, text) for text in LAYOUTS + EP_LAYOUTS},
            "micro": {text: _train(rank, text, micro_batch_size=1) for text in MICRO},
            "switch": [_switch_against_dcp(rank, root, *pair) for pair in SWITCHES]}


def test_moe_trains_alike_under_every_layout_and_switches_as_dcp(tmp_path, budget):
    reference = run_distributed(1, _one_process, timeout_s=budget.left())[0]
    per_rank = run_distributed(4, _four_processes, str(tmp_path), timeout_s=budget.left())
    ref_losses = torch.tensor(reference["losses"], dtype=torch.float64)
    # Not vacuous: training moves the loss, and the balancing term is part of it.
    assert (ref_losses[0] - ref_losses[-1]).abs() > 1e-3
    assert abs(reference["without_balance"] - reference["losses"][0]) > 1e-4
    assert reference["wrong"] == []
    runs = [("layouts", text) for text in LAYOUTS + EP_LAYOUTS] + [("micro", text) for text in MICRO]
    assert len(LAYOUTS) == 10 and "tp=4" in LAYOUTS and "pp=4" in LAYOUTS
    for kind, text in runs:
        seen = set()
        for rank, results in enumerate(per_rank):
            run = results[kind][text]
            torch.testing.assert_close(torch.tensor(run["losses"], dtype=torch.float64), ref_losses, rtol=RTOL,
                                       atol=0, msg=f"{kind} {text} rank {rank} losses")
            for name, value in run["params"].items():
                seen.add(name)
                torch.testing.assert_close(value, reference["params"][name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, n=name, r=rank: f"{kind} {text} rank {r} {n}: {m}")
            assert run["wrong"] == [], (kind, text, rank, run["wrong"][:3])
        assert seen == set(reference["params"]), f"{kind} {text}: parameters missing from every rank"
    for rank, results in enumerate(per_rank):  # experts exchanged again in the backward: the same numbers
        for mode, losses in results["checkpointed"].items():
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(results["layouts"]["ep=2,fsdp=2"]["losses"]),
                                       rtol=1e-12, atol=0, msg=f"activation checkpointing {mode} rank {rank}")
    for rank, results in enumerate(per_rank):
        for pair, switch in zip(SWITCHES, results["switch"]):
            assert switch["diff"] == [], f"{pair} rank {rank}: differs from DCP in {switch['diff'][:5]}"
            assert switch["experts"] > 0, "the comparison must include the experts' state"
            assert switch["losses"][0] == switch["losses"][1], (pair, rank, switch["losses"])
            moved, bound = switch["moved"]
            assert moved == bound > 0, (pair, rank, moved, bound)  # the experts move as little as can be
