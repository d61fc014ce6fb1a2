"""Online layout switches on real gloo processes, checked against PyTorch DCP and unswitched runs.

- Oracle: after `Trainer.switch(B)` from layout A, every rank's state (parameter shards, AdamW
  moments and steps, progress, RNG) is bit-identical to what DCP gives when the same state is saved
  under A and loaded into a trainer built under B with the same rank order.
- A run that switches several times agrees, loss for loss, with the run that never switched
  (float64, relative 1e-9: the layouts sum gradients in different orders, nothing else differs).
- A -> B -> A gives back bit-identical state; an invalid layout is refused and training goes on.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import DTensor

from dist_harness import run_distributed
from shardshift.layout import Layout, all_layouts
from shardshift.train import checkpoint
from shardshift.train.config import TrainConfig, model_config
from shardshift.train.trainer import Trainer

pytestmark = pytest.mark.multiproc

SEED = 3


def _config(text: str, dtype: str = "float64", steps: int = 8) -> TrainConfig:
    return TrainConfig(
        layout=Layout.parse(text), model=model_config("test"), model_name="test", steps=steps,
        seed=SEED, dtype=dtype, global_batch=8,
    )


def local_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every piece of state this rank holds, by logical name, as plain local tensors (copies)."""
    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {}
    for fqn, param in trainer.model.named_parameters():
        out[f"param:{fqn}"] = local(param)
        for kind, value in trainer.optimizer.state[param].items():
            out[f"{kind}:{fqn}"] = local(value)
    out["progress"] = torch.tensor([trainer.progress.step, trainer.progress.position])
    out["rng"] = torch.get_rng_state()
    return out


def differences(a: dict, b: dict) -> list[str]:
    """Names whose tensors are not bit-identical (dtype, shape and every bit), or not in both."""
    bad = sorted(set(a) ^ set(b))
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim() else y):
            bad.append(key)
    return bad


# A fixed random draw of ordered pairs among the 10 layouts of 4 ranks, plus the pairs that cross
# every kind of boundary (pp stages, strided fsdp-over-tp shards, replication to sharding).
_LAYOUTS = [str(layout) for layout in all_layouts(4)]
PAIRS = [("fsdp=2,tp=2", "pp=2,dp=2"), ("pp=4", "tp=4"), ("dp=4", "fsdp=4"), ("dp=2,tp=2", "fsdp=2,pp=2")]
PAIRS += random.Random(7).sample([(a, b) for a in _LAYOUTS for b in _LAYOUTS if a != b], 4)


def _oracle(rank: int, world_size: int, root: str, dtype: str) -> dict:
    out = {}
    for before, after in PAIRS:
        trainer = Trainer(_config(before, dtype), rank, "cpu")
        for _ in range(2):
            trainer.train_step()
        path = checkpoint.save(trainer, f"{root}/{dtype}-{before}-to-{after}")
        report = trainer.switch(Layout.parse(after), budget=16 << 10)
        switched = local_state(trainer)
        reference = Trainer(_config(after, dtype), rank, "cpu", ranks=trainer.par.ranks)
        checkpoint.load(reference, path)
        loaded = local_state(reference)
        # One more step in each: the switched trainer trains on, exactly as the reloaded one.
        losses = (trainer.train_step().loss, reference.train_step().loss)
        out[(before, after)] = {
            "diff": differences(switched, loaded), "keys": len(switched), "report": report,
            "moments": sum(k.startswith("exp_avg:") for k in switched), "losses": losses,
        }
    return out


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_switch_is_bit_identical_to_dcp_save_and_load(tmp_path, dtype):
    per_rank = run_distributed(4, _oracle, str(tmp_path), dtype, timeout_s=600)
    for pair in PAIRS:
        for rank, results in enumerate(per_rank):
            result = results[pair]
            assert result["diff"] == [], f"{pair} rank {rank}: differs from DCP in {result['diff'][:5]}"
            assert result["moments"] > 0, "the comparison must include AdamW state"
            assert result["losses"][0] == result["losses"][1], (pair, rank, result["losses"])
        report = per_rank[0][pair]["report"]
        assert report.bytes_moved == report.bytes_lower_bound
        assert report.bytes_moved + report.bytes_kept == report.bytes_total
        assert report.rounds > 1  # the 16 KiB budget cuts every switch into rounds
