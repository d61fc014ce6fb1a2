"""Tree collectives on real gloo processes: the executor against gloo's own collectives, and the
`shardshift` backend under the torch.distributed API, DDP and FSDP2.

Each world size is one spawn of processes that loops over many cases (process start-up dominates).

Tolerances. Broadcast and the gathers move bytes: compared exactly. Reductions associate the
terms in another order than gloo's ring, so floats round differently. Inputs are of size ~1 and
n <= 5 terms are summed, so the difference is a few ulps of the terms, not of the result (sums
that cancel towards 0 need an absolute tolerance): float64 rtol 1e-12, atol 1e-13 (ulp 2e-16);
float32 rtol 1e-5, atol 1e-6 (ulp 1.2e-7); bfloat16 rtol 2e-2, atol 5e-2 (8-bit mantissa, ulp of
a term near 2 is 1.6e-2). Integer sums, and MIN / MAX of anything, are exact.
Every case also checks against a locally computed reference, so agreeing with gloo is not vacuous.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardshift.collectives.execution.reduction import Reduction
from shardshift.collectives.planning.ops import Collective
from shardshift.collectives.topology.presets import dgx1v, full, ring
from support.dist import run_distributed

TOLERANCE = {torch.float64: (1e-12, 1e-13), torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 5e-2),
             torch.int64: (0.0, 0.0), torch.int32: (0.0, 0.0)}  # fmt: skip
TORCH_OPS = {Reduction.SUM: dist.ReduceOp.SUM, Reduction.MAX: dist.ReduceOp.MAX,
             Reduction.MIN: dist.ReduceOp.MIN, Reduction.PRODUCT: dist.ReduceOp.PRODUCT,
             Reduction.AVG: dist.ReduceOp.AVG}  # fmt: skip


def _topologies(n: int):
    gpus = [[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4, 5]][n - 2]
    return [full(n), ring(n) if n > 2 else full(n, bandwidth=2e8), dgx1v(gpus)]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, exact: bool) -> bool:
    if exact:
        return torch.equal(a, b)
    rtol, atol = TOLERANCE[dtype]
    return torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol)


def _executor_cases(rank: int, n: int) -> dict:
    from shardshift.collectives.execution.executor import ExecMode
    from shardshift.collectives.execution.runner import RunOptions, TreeCollectives
    from shardshift.collectives.planning.rings import ring_packing

    world = dist.group.WORLD
    report = {"cases": 0, "failures": []}
    cases = [(torch.float64, Reduction.SUM), (torch.float32, Reduction.SUM), (torch.bfloat16, Reduction.SUM),
             (torch.int64, Reduction.SUM), (torch.float32, Reduction.MAX), (torch.int32, Reduction.MIN),
             (torch.float64, Reduction.AVG), (torch.float64, Reduction.PRODUCT)]  # fmt: skip
    sizes = [1, n - 1, 13, 4099]  # per rank; 1 and n-1 are fewer elements than chunks
    for t_index, topology in enumerate(_topologies(n)):
        options = RunOptions(timeout_s=60, min_chunk_bytes=1024, max_chunks_per_tree=4,
                             mode=ExecMode.STEPPED if t_index == 2 else ExecMode.DATAFLOW)  # fmt: skip
        impls = [TreeCollectives(world, topology, options)]
        if t_index == 0:
            impls.append(TreeCollectives(world, topology, options, packer=ring_packing))
        for trees in impls:
            for c_index, (dtype, red) in enumerate(cases):
                for m in sizes[: 2 if c_index > 3 else 4]:
                    root = (m + c_index) % n
                    for op in Collective:
                        ok = _one_case(trees, op, m, dtype, red, root, rank, n)
                        report["cases"] += 1
                        if not ok:
                            report["failures"].append((topology.name, op.value, m, str(dtype), red.value, root))
            built = trees.plans_built
            for op in Collective:  # repeated calls reuse the cached plans: no planning
                _one_case(trees, op, 13, torch.float32, Reduction.SUM, (13 + 1) % n, rank, n)
            report.setdefault("replanned", []).append(trees.plans_built - built)
            trees.close()
    return report


def _one_case(trees, op, m, dtype, red, root, rank, n) -> bool:
    g = torch.Generator().manual_seed(1000 * rank + m)
    count = n * m if op is Collective.REDUCESCATTER else m
    if dtype.is_floating_point:
        x = ((torch.rand(count, generator=g, dtype=torch.float64) - 0.3) * 4).to(dtype)
        if red is Reduction.PRODUCT:
            x = x.abs() + 0.5
    else:
        x = torch.randint(-50, 50, (count,), generator=g).to(dtype)
    torch_op = TORCH_OPS[red]
    if op is Collective.BROADCAST:
        mine, ref = x.clone(), x.clone()
        trees.broadcast(mine, root)
        dist.broadcast(ref, root)
        return torch.equal(mine, ref)
    if op is Collective.REDUCE:
        mine, ref = x.clone(), x.clone()
        trees.reduce(mine, root, red)
        dist.reduce(ref, root, torch_op)
        return _close(mine, ref, dtype, False) if rank == root else torch.equal(mine, x)
    if op is Collective.ALLREDUCE:
        mine, ref = x.clone(), x.clone()
        trees.all_reduce(mine, red)
        dist.all_reduce(ref, torch_op)
        exact = not dtype.is_floating_point or red in (Reduction.MIN, Reduction.MAX)
        return _close(mine, ref, dtype, exact)
    if op is Collective.ALLGATHER:
        mine, ref = x.new_zeros(n * m), x.new_zeros(n * m)
        trees.all_gather(mine, x)
        dist.all_gather_single(ref, x)
        return torch.equal(mine, ref)
    mine, ref = x.new_zeros(m), x.new_zeros(m)
    trees.reduce_scatter(mine, x, red)
    dist.reduce_scatter_single(ref, x.clone(), op=torch_op)
    exact = not dtype.is_floating_point or red in (Reduction.MIN, Reduction.MAX)
    return _close(mine, ref, dtype, exact)


@pytest.mark.parametrize("n", [2, 3, 5])  # 4 ranks: the backend's and training's own tests
def test_executor_matches_gloo(n, budget):
    reports = run_distributed(n, _executor_cases, timeout_s=budget.left())
    for rank, report in enumerate(reports):
        assert report["failures"] == [], f"rank {rank}: {report['failures'][:5]}"
        assert report["cases"] > 300 and set(report["replanned"]) == {0}


# ---- the backend -------------------------------------------------------------------------------

def _backend_cases(rank: int, n: int) -> dict:
    import shardshift.collectives.execution.backend as backend

    out: dict = {}
    g = dist.new_group(backend="shardshift", pg_options=backend.ShardShiftOptions(topology="ring"))
    out["name"] = dist.get_backend(g)
    checks = []
    for dtype in (torch.float64, torch.float32, torch.int64):
        x = (torch.arange(7 * n, dtype=torch.float64) * (rank + 1) - 3).to(dtype)
        for fn in (
            lambda t, grp: dist.all_reduce(t, group=grp),
            lambda t, grp: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=grp),
            lambda t, grp: dist.broadcast(t, src=n - 1, group=grp),
        ):
            a, b = x.clone(), x.clone()
            fn(a, g)
            fn(b, None)
            checks.append(_close(a, b, dtype, not dtype.is_floating_point))
        a, b = x.clone(), x.clone()
        dist.reduce(a, dst=1, group=g)
        dist.reduce(b, dst=1)  # gloo leaves partial sums on other ranks; we leave them untouched
        checks.append(_close(a, b, dtype, not dtype.is_floating_point) if rank == 1 else torch.equal(a, x))
        a, b = x.new_zeros(n * x.numel()), x.new_zeros(n * x.numel())
        dist.all_gather_single(a, x, group=g)
        dist.all_gather_single(b, x)
        checks.append(torch.equal(a, b))
        la, lb = [x.new_zeros(x.numel()) for _ in range(n)], [x.new_zeros(x.numel()) for _ in range(n)]
        dist.all_gather(la, x, group=g)
        dist.all_gather(lb, x)
        checks.append(all(torch.equal(p, q) for p, q in zip(la, lb)))
        a, b = x.new_zeros(7), x.new_zeros(7)
        dist.reduce_scatter_single(a, x, group=g)
        dist.reduce_scatter_single(b, x.clone())
        checks.append(_close(a, b, dtype, not dtype.is_floating_point))
        a, b = x.new_zeros(7), x.new_zeros(7)
        dist.reduce_scatter(a, list(x.chunk(n)), group=g)
        dist.reduce_scatter(b, list(x.clone().chunk(n)))
        checks.append(_close(a, b, dtype, not dtype.is_floating_point))
    # async: Work.wait, get_future, several in flight, issue order kept
    ts = [torch.full((1000,), float(rank + i)) for i in range(4)]
    works = [dist.all_reduce(t, group=g, async_op=True) for t in ts]
    futures = [w.get_future() for w in works[:2]]
    for w in works[2:]:
        w.wait()
    checks.append(all(torch.equal(f.wait()[0], ts[i]) for i, f in enumerate(futures)))
    checks.append(torch.equal(works[3].result()[0], ts[3]))
    checks.append(all(float(t[0]) == sum(range(n)) + n * i for i, t in enumerate(ts)))
    dist.barrier(group=g)
    # delegated to gloo: unsupported reduction, point-to-point, gather
    a = torch.full((3,), rank + 1, dtype=torch.int64)
    dist.all_reduce(a, op=dist.ReduceOp.BOR, group=g)
    b = torch.full((3,), rank + 1, dtype=torch.int64)
    dist.all_reduce(b, op=dist.ReduceOp.BOR)
    checks.append(torch.equal(a, b))
    if rank == 0:
        dist.send(torch.arange(5.0), 1, group=g)
    elif rank == 1:
        got = torch.zeros(5)
        dist.recv(got, 0, group=g)
        checks.append(torch.equal(got, torch.arange(5.0)))
    out["checks"] = checks
    out["ddp"] = _train_ddp(g, rank)
    out["fsdp"] = _train_fsdp(g, rank, n)
    dist.destroy_process_group(g)
    out["auto"] = _auto_cases(rank, n)
    out["chooser"] = _chooser_cases(rank)
    return out


def _auto_cases(rank: int, n: int) -> dict:
    """algorithm="auto": results stay right through the trial calls and after, picks agree."""
    import shardshift.collectives.execution.backend as backend

    g = dist.new_group(backend="shardshift", pg_options=backend.ShardShiftOptions(algorithm="auto", trials=2))
    checks = []
    for _ in range(6):  # 4 trial calls (trees, gloo, trees, gloo), then the pick
        x = torch.arange(1000, dtype=torch.float64) * (rank + 1)
        dist.all_reduce(x, group=g)
        checks.append(torch.equal(x, torch.arange(1000, dtype=torch.float64) * sum(range(1, n + 1))))
        y = torch.full((300,), float(rank))
        dist.broadcast(y, src=1, group=g)
        checks.append(torch.equal(y, torch.ones(300)))
    out = {"checks": checks, "choices": sorted(g.choices.items())}  # new_group gives the backend itself
    dist.destroy_process_group(g)
    return out


class _ScriptedClock:
    """A clock whose successive readings are given: a call's time is end - start."""

    def __init__(self, durations: list[float]) -> None:
        self._readings = [v for d in durations for v in (0.0, d)]

    def __call__(self) -> float:
        return self._readings.pop(0)


def _chooser_cases(rank: int) -> list:
    """The pick goes by the slowest rank's time: trees are faster on rank 0 only, so gloo wins."""
    from shardshift.collectives.execution.backend import Chooser

    ran = []
    trees, gloo = (lambda: ran.append("trees")), (lambda: ran.append("gloo"))
    # Per call, in turn trees, gloo, trees, gloo: rank 0 sees trees at 1 s and gloo at 2 s; the
    # others see trees at 5 s and gloo at 3 s. Slowest ranks: trees 5 s, gloo 3 s: gloo.
    durations = [1.0, 2.0, 1.0, 2.0] if rank == 0 else [5.0, 3.0, 6.0, 3.0]
    chooser = Chooser(dist.group.WORLD, trials=2, clock=_ScriptedClock(durations))
    for _ in range(6):
        chooser.run(("allreduce", "float32", 10), trees, gloo)
    return [ran, dict(chooser.choices)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5)).double()


def _train(model, rank: int, steps: int = 4) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
        x, y = torch.randn(8, 12, generator=g, dtype=torch.float64), torch.randn(8, 5, generator=g, dtype=torch.float64)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train_ddp(group, rank: int) -> float:
    """Max relative difference of DDP's parameters, shardshift vs the gloo default group."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours = DDP(_model(), process_group=group, bucket_cap_mb=0.001)  # several buckets
    theirs = DDP(_model(), process_group=dist.group.WORLD, bucket_cap_mb=0.001)
    _train(ours, rank)
    _train(theirs, rank)
    initial = _model()
    moved = max((a - b).abs().max().item() for a, b in zip(theirs.parameters(), initial.parameters()))
    assert moved > 1e-3, "training did not change the parameters: the comparison would be vacuous"
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours.parameters(), theirs.parameters()))


def _train_fsdp(group, rank: int, n: int) -> float:
    """Max relative difference of FSDP2's full parameters, shardshift vs gloo."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    results = []
    for grp in (group, dist.group.WORLD):
        mesh = DeviceMesh.from_group(grp, "cpu")
        model = _model()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train(model, rank)
        results.append([p.full_tensor() for p in model.parameters()])
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*results))


def test_backend_ops_ddp_and_fsdp_match_gloo(budget):
    n = 3
    reports = run_distributed(n, _backend_cases, timeout_s=budget.left())
    for rank, report in enumerate(reports):
        assert report["name"] == "shardshift"
        assert all(report["checks"]) and len(report["checks"]) >= 27, (rank, report["checks"])
        # float64 training, 4 AdamW steps: the sums associate differently, nothing else differs.
        assert report["ddp"] < 1e-10, report["ddp"]
        assert report["fsdp"] < 1e-10, report["fsdp"]
        auto = report["auto"]
        assert all(auto["checks"]) and len(auto["checks"]) == 12, (rank, auto["checks"])
        assert [key for key, _ in auto["choices"]] == [("allreduce", "torch.float64", 12),
                                                       ("broadcast/1", "torch.float32", 10)]
        assert auto["choices"] == reports[0]["auto"]["choices"]  # every rank picked alike
        ran, choices = report["chooser"]
        assert ran == ["trees", "gloo", "trees", "gloo", "gloo", "gloo"], (rank, ran)
        assert choices == {("allreduce", "float32", 10): "gloo"}
