"""Every 4-rank layout computes what one process computes (float64, relative 1e-9).

The reference and the parallel runs start from the same seed; parameters are initialised from
(seed, name) only and the global batch at step k is the same samples in every layout (docs/architecture.md,
numerics contract), so the only differences are the order of floating-point sums in collectives:
about 1e-16 relative per operation, far below the 1e-9 we require. The `test` GPT cuts shards
unevenly: 13 positions over fsdp=4 (4, 4, 4, 1), 5 layers over pp=4 (2, 1, 1, 1) and pp=2 (3, 2).
`llama-test` does too (259 vocabulary rows over fsdp=4: 65, 65, 65, 64; the same 5 layers), and
under tp=4 each rank holds 2 query heads and the one key-value head they share. `llama-test` with
tied embeddings (one matrix for the embedding and the head; no pp) runs under DDP and FSDP2 with TP.
The README's model of one's own (examples/tiny_decoder.py: a plain nn.Module and its ModuleSpec,
named as --model names it) runs under six: FSDP2 with TP, one head per rank under tp=4, uneven
stages under pp=4, its 30 positions over fsdp=4 (8, 8, 8, 6), DDP with pp, and HSDP.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardshift.layout import Layout, all_layouts
from shardshift.models import model_spec
from shardshift.models.llama.spec import LlamaSpec
from shardshift.models.space import state_space
from shardshift.reshard.space import holding
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig
from shardshift.train.trainer import Trainer
from support import EXAMPLE_MODEL
from support.dist import run_distributed
from support.training import ATOL, differences, full_parameters, local_state

STEPS = 3
RTOL = 1e-9
MODELS = ("test", "llama-test", "llama-test-tied", EXAMPLE_MODEL)
TIED = LlamaSpec("llama-test-tied", dataclasses.replace(model_spec("llama-test").config, tie_word_embeddings=True))


def _config(layout: Layout, steps: int = STEPS, model: str = "test") -> TrainConfig:
    return TrainConfig(
        layout=layout, model=TIED if model == TIED.name else model_spec(model), steps=steps,
        dtype="float64", global_batch=8, micro_batches=4 if layout.pp == 4 else 0, seed=3,
    )


def _train_layouts(rank: int, world_size: int, layouts: list[str], model: str = "test") -> dict:
    results = {}
    for text in layouts:
        trainer = Trainer(_config(Layout.parse(text), model=model), rank, "cpu")
        losses = [trainer.train_step().loss for _ in range(STEPS)]
        results[text] = {"losses": losses, "params": full_parameters(trainer), "keys": _keys_match(trainer)}
    return results


def _keys_match(trainer: Trainer) -> bool:
    """The state lists exactly the logical tensors that the pure space places on this rank."""
    space = state_space(trainer.cfg.model, trainer.cfg.param_dtype)
    placed = {t.key for t in space.tensors if holding(space, trainer.cfg.layout, trainer.par.coord, t) is not None}
    return list(trainer.state.tensors()) == [t.key for t in space.tensors if t.key in placed]


def _one_process(rank: int, world_size: int) -> dict:
    return {"float64": {model: _train_layouts(rank, world_size, ["dp=1"], model)["dp=1"] for model in MODELS},
            "dtypes": _train_dtypes(rank, world_size, [("dp=1", dtype) for dtype in DTYPE_RTOL]),
            "uneven": _train_uneven(rank, world_size, ["dp=1"])["dp=1"]}


UNEVEN_4 = ["dp=4", "fsdp=4", "dp=2,fsdp=2", "dp=2,tp=2"]


# (layout, --activation-checkpointing, --compile)
CHECKPOINTED = [*((layout, mode, "none") for layout in ("fsdp=4", "tp=4", "pp=4") for mode in ("full", "selective")),
                ("tp=4", "full", "aot_eager"), ("tp=4", "selective", "aot_eager")]


def _train_checkpointed(rank: int, cases: list[tuple[str, str, str]]) -> dict:
    """`llama-test` with activation checkpointing: its losses per (layout, mode, compile)."""
    out = {}
    for text, mode, compile in cases:
        cfg = dataclasses.replace(_config(Layout.parse(text), model="llama-test"), activation_checkpointing=mode,
                                  compile=compile)
        trainer = Trainer(cfg, rank, "cpu")
        out[text, mode, compile] = [trainer.train_step().loss for _ in range(STEPS)]
    return out


def _four_processes(rank: int, world_size: int) -> dict:
    return {"layouts": {model: _train_layouts(rank, world_size, LAYOUTS[model], model) for model in MODELS},
            "uneven": _train_uneven(rank, world_size, UNEVEN_4),
            "checkpointed": _train_checkpointed(rank, CHECKPOINTED)}


@pytest.fixture(scope="module")
def single() -> dict:
    """Every run of this module on one process, in one process start."""
    return run_distributed(1, _one_process)[0]


LAYOUTS_4 = [str(layout) for layout in all_layouts(4)]
LAYOUTS = {"test": LAYOUTS_4, "llama-test": LAYOUTS_4, "llama-test-tied": ["dp=4", "fsdp=2,tp=2"],
           EXAMPLE_MODEL: ["fsdp=2,tp=2", "tp=4", "pp=4", "fsdp=4", "dp=2,pp=2", "dp=2,fsdp=2"]}


@pytest.fixture(scope="module")
def four() -> list[dict]:
    """Every 4-process run of this module, in one process start."""
    return run_distributed(4, _four_processes)


@pytest.mark.parametrize("model", MODELS, ids=[*MODELS[:-1], "example"])
def test_all_four_rank_layouts_match_one_process(single, four, model):
    reference = single["float64"][model]
    mixed = ("pp=2,fsdp=2", "dp=2,tp=2", "fsdp=2,tp=2", "dp=2,fsdp=2", "pp=2,tp=2")
    assert all(Layout.parse(text) in all_layouts(4) for text in mixed)
    assert len(LAYOUTS_4) == 10
    per_rank = [r["layouts"][model] for r in four]
    ref_losses = torch.tensor(reference["losses"], dtype=torch.float64)
    # Not vacuous: training moves the loss and the parameters.
    assert (ref_losses[0] - ref_losses[-1]).abs() > 1e-3
    for text in LAYOUTS[model]:
        for rank, results in enumerate(per_rank):
            losses = torch.tensor(results[text]["losses"], dtype=torch.float64)
            torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=0, msg=f"{text} rank {rank} losses")
        seen = set()
        for rank, results in enumerate(per_rank):
            for name, value in results[text]["params"].items():
                seen.add(name)
                torch.testing.assert_close(
                    value, reference["params"][name], rtol=RTOL, atol=ATOL,
                    msg=lambda m, n=name, r=rank: f"{text} rank {r} parameter {n}: {m}",
                )
        assert seen == set(reference["params"]), f"{text}: parameters missing from every rank"
        assert all(results[text]["keys"] for results in per_rank), f"{text}: state keys differ from the space"


def _train_uneven(rank: int, world_size: int, layouts: list[str]) -> dict:
    results = {}
    for text in layouts:
        trainer = Trainer(dataclasses.replace(_config(Layout.parse(text)), global_batch=6), rank, "cpu")
        results[text] = {"losses": [trainer.train_step().loss for _ in range(STEPS)], "params": full_parameters(trainer)}
    return results


def test_a_batch_that_does_not_split_evenly_among_data_ranks_gives_the_same_losses(single, four):
    """A global batch of 6 over 4 data ranks is read as 2, 2, 1, 1 sequences, each rank's loss
    weighted by its share: the run equals one process on the same 6 sequences a step."""
    reference = single["uneven"]
    per_rank = [r["uneven"] for r in four]
    for text in UNEVEN_4:
        for rank, results in enumerate(per_rank):
            torch.testing.assert_close(torch.tensor(results[text]["losses"]), torch.tensor(reference["losses"]),
                                       rtol=RTOL, atol=0, msg=f"{text} rank {rank} losses")
            for name, value in results[text]["params"].items():
                torch.testing.assert_close(value, reference["params"][name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, n=name: f"{text} rank {rank} parameter {n}: {m}")
    assert reference["losses"] != single["float64"]["test"]["losses"]  # a batch of 6, not the usual 8


def _train_dtypes(rank: int, world_size: int, cases: list[tuple[str, str]], compiled: bool = False) -> dict:
    results = {}
    for text, dtype in cases:
        cfg = dataclasses.replace(_config(Layout.parse(text), steps=3), dtype=dtype)
        trainer = Trainer(cfg, rank, "cpu")
        results[(text, dtype)] = [trainer.train_step().loss for _ in range(3)]
    if compiled:
        results["compiled"] = {backend: _train_switched(rank, backend) for backend in ("none", "aot_eager")}
    return results


COMPILED_LAYOUTS = ("fsdp=2", "tp=2", "pp=2", "fsdp=2")


def _train_switched(rank: int, compile: str) -> list[tuple[float, int]]:
    """float32 under --compile `compile`, a step under each of `COMPILED_LAYOUTS` in turn (switched
    online): each step's loss and the graphs it compiled."""
    cfg = TrainConfig(layout=Layout.parse(COMPILED_LAYOUTS[0]), model=model_spec("test"), steps=len(COMPILED_LAYOUTS),
                      global_batch=8, seed=3, compile=compile)
    trainer = Trainer(cfg, rank, "cpu")
    out = []
    for index, text in enumerate(COMPILED_LAYOUTS):
        if index:
            trainer.switch(Layout.parse(text))
        result = trainer.train_step()
        out.append((result.loss, result.compiled))
    return out


# float32 sums reordered across 2 ranks differ by ~1e-7 relative per operation; bfloat16 autocast
# rounds every matmul input to 8 bits of mantissa (~4e-3), so its losses agree only to ~1e-2.
DTYPE_RTOL = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.fixture(scope="module")
def two_dtypes() -> list[dict]:
    cases = [(text, dtype) for dtype in DTYPE_RTOL for text in ("fsdp=2", "tp=2", "pp=2")]
    return run_distributed(2, _train_dtypes, cases, True)


def test_float32_and_bfloat16_layouts_track_one_process(single, two_dtypes):
    cases = [(text, dtype) for dtype in DTYPE_RTOL for text in ("fsdp=2", "tp=2", "pp=2")]
    single, per_rank = single["dtypes"], two_dtypes
    for text, dtype in cases:
        expected = torch.tensor(single[("dp=1", dtype)])
        got = torch.tensor(per_rank[0][(text, dtype)])
        torch.testing.assert_close(got, expected, rtol=DTYPE_RTOL[dtype], atol=0, msg=f"{text} {dtype}")
    # bfloat16 really computes in bfloat16: its losses are not the float32 ones.
    assert single[("dp=1", "bfloat16")] != single[("dp=1", "float32")]


def test_compiled_layers_track_eager_ones_across_switches(two_dtypes):
    """--compile aot_eager (torch.compile's capture of each layer's forward and backward, through
    FSDP2, tensor and pipeline parallelism) over fsdp=2 -> tp=2 -> pp=2 -> fsdp=2, switched online:
    float32 losses within 1e-5 of the same run eager. The layers compile at the start and after the
    switch to tp=2 (DTensor parameters); the return to fsdp=2 reuses the code compiled for it."""
    for rank, results in enumerate(two_dtypes):
        (eager, none), (compiled, graphs) = (zip(*results["compiled"][b]) for b in ("none", "aot_eager"))
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0, msg=f"rank {rank}")
        assert none == (0, 0, 0, 0)
        assert graphs[0] > 0 and graphs[1] > 0 and graphs[3] == 0, graphs


def test_activation_checkpointing_changes_no_loss(four):
    """Full and selective activation checkpointing under fsdp, tp and pp, and under tp with its
    layers compiled (aot_eager: the same kernels): the same losses as without it, to 1e-12 (the same
    operations on the same values, some done again in the backward)."""
    for rank, results in enumerate(four):
        for (text, mode, compile), losses in results["checkpointed"].items():
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(results["layouts"]["llama-test"][text]["losses"]),
                                       rtol=1e-12, atol=0, msg=f"{text} {mode} {compile} rank {rank}")


def _mixed_precision(rank: int, world_size: int, root: str) -> dict:
    """`llama-test` under --mixed-precision bf16: the dtype a layer computes with, losses beside
    float32's, and a switch against DCP's save and load."""
    def config(text: str, mp: str) -> TrainConfig:
        return TrainConfig(layout=Layout.parse(text), model=model_spec("llama-test"), steps=STEPS, global_batch=8,
                           seed=3, mixed_precision=mp)

    seen = []
    out = {}
    for mp in ("none", "bf16"):
        trainer = Trainer(config("fsdp=2,tp=2", mp), rank, "cpu")
        layer = next(trainer.model.get_submodule("model.layers").children())
        hook = layer.mlp.register_forward_pre_hook(lambda module, _: seen.append(str(module.up_proj.weight.dtype)))
        out[mp] = [trainer.train_step().loss for _ in range(3)]
        hook.remove()
    trainer = Trainer(config("fsdp=4", "bf16"), rank, "cpu")
    trainer.train_step()
    saved = checkpoint.save(trainer, f"{root}/bf16")
    trainer.switch(Layout.parse("pp=2,fsdp=2"))
    reference = Trainer(config("pp=2,fsdp=2", "bf16"), rank, "cpu", ranks=trainer.par.ranks)
    checkpoint.load(reference, saved)
    out["diff"] = differences(local_state(trainer), local_state(reference))
    out["next"] = (trainer.train_step().loss, reference.train_step().loss)
    out["computed_in"] = sorted(set(seen))
    out["held_in"] = sorted({str(p.dtype) for p in trainer.model.parameters()})
    return out


def test_mixed_precision_bf16_computes_in_bfloat16_keeps_float32_and_switches_as_dcp(tmp_path, budget):
    per_rank = run_distributed(4, _mixed_precision, str(tmp_path), timeout_s=budget.left())
    for rank, out in enumerate(per_rank):
        assert out["computed_in"] == ["torch.bfloat16", "torch.float32"]  # FSDP2 gathers bf16 copies under bf16
        assert out["held_in"] == ["torch.float32"]  # the state stays float32 (master weights)
        # bf16 rounding moves the loss a little, not the training: within 1e-3 of float32's here
        torch.testing.assert_close(torch.tensor(out["bf16"]), torch.tensor(out["none"]), rtol=1e-3, atol=0)
        assert out["bf16"] != out["none"]
        assert out["diff"] == [], f"rank {rank}: the switched state differs from DCP's in {out['diff'][:5]}"
        assert out["next"][0] == out["next"][1]
