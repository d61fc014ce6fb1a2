"""One rank of `shardshift bench collectives` (collectives.py starts the ranks; they run this).

With `probe`, the ranks measure the topology first (topology/probe.py). Then, for every size, each
implementation (gloo's own collective, the ring, the packed trees, `auto`) runs once to warm up
(plans are built there, not in the timed calls; `auto`, the shardshift backend picking by
measurement, runs its trial calls there and is timed on what it picked), then `iters` rounds in
which the implementations take turns in a rotating order, so drifts of a shared machine hit all
alike. A timed call starts after a barrier; its time is the slowest rank's. Results are checked
against values computed locally (inputs are small integers, so sums are exact in every dtype
here), and rank 0 prints the report.

Rank 0 also reads its host's CPU counters (/proc/stat) around every timed call: a row's
`cpu_busy` is the share of the host's CPUs that were busy during that implementation's timed
calls (None if they all fit in one clock tick, 10 ms). Emulated ranks all run on one host, so
near 1 it says that the times measure the CPUs (the ranks and the kernel's shaping) more than the
links. With `plot`, rank 0 draws the rows once the group is gone (`shardshift.plots.bench`).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from shardshift.bench.collectives import CollectivesBenchOptions, report, rows
from shardshift.collectives.execution.reduction import Reduction
from shardshift.collectives.execution.runner import TreeCollectives
from shardshift.collectives.planning.bounds import collective_bound
from shardshift.collectives.planning.ops import Collective
from shardshift.collectives.planning.rings import ring_packing
from shardshift.collectives.topology.presets import full
from shardshift.collectives.topology.probe import probe_topology
from shardshift.console import say
from shardshift.runtime import init_distributed

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "int32": torch.int32, "int64": torch.int64}  # fmt: skip
_TORCH_OPS = {Reduction.SUM: dist.ReduceOp.SUM, Reduction.PRODUCT: dist.ReduceOp.PRODUCT,
              Reduction.MIN: dist.ReduceOp.MIN, Reduction.MAX: dist.ReduceOp.MAX,
              Reduction.AVG: dist.ReduceOp.AVG}  # fmt: skip


def pattern(rank: int, count: int, offset: int = 0) -> torch.Tensor:
    """Rank's input: small integers 1..5 (exact sums in every dtype), float64."""
    i = torch.arange(offset, offset + count, dtype=torch.float64)
    return torch.remainder(i + 3 * rank, 5) + 1


def reduce_reference(red: Reduction, n: int, count: int, offset: int = 0) -> torch.Tensor:
    stack = torch.stack([pattern(r, count, offset) for r in range(n)])
    if red is Reduction.SUM:
        return stack.sum(0)
    if red is Reduction.AVG:
        return stack.mean(0)
    if red is Reduction.PRODUCT:
        return stack.prod(0)
    return stack.amin(0) if red is Reduction.MIN else stack.amax(0)


class Case:
    """Buffers, the call of each implementation, and the check, for one op and size."""

    def __init__(self, op: Collective, count: int, dtype: torch.dtype, red: Reduction, root: int,
                 rank: int, n: int) -> None:
        self.op, self.red, self.root, self.rank, self.n, self.dtype = op, red, root, rank, n, dtype
        m = count // n if op.sharded else count
        self.count = m * n if op.sharded else m
        if op is Collective.ALLGATHER:
            self.input = pattern(rank, m, rank * m).to(dtype)
            self.expected = torch.cat([pattern(r, m, r * m) for r in range(n)])
            self.output = torch.zeros(self.count, dtype=dtype)
        elif op is Collective.REDUCESCATTER:
            self.input = pattern(rank, self.count).to(dtype)
            self.expected = reduce_reference(red, n, self.count)[rank * m:(rank + 1) * m]
            self.output = torch.zeros(m, dtype=dtype)
        else:
            self.input = pattern(rank, m).to(dtype)
            if op is Collective.BROADCAST:
                self.expected = pattern(root, m)
            else:
                self.expected = reduce_reference(red, n, m)
            self.output = torch.empty(m, dtype=dtype)

    def reset(self) -> None:
        if not self.op.sharded:
            self.output.copy_(self.input if self.op is not Collective.BROADCAST or self.rank == self.root
                              else torch.zeros_like(self.input))  # fmt: skip
        else:
            self.output.zero_()

    def run(self, impl) -> None:
        """One call: on a TreeCollectives, else through torch.distributed (gloo, or a group)."""
        op, red = self.op, self.red
        if isinstance(impl, TreeCollectives):
            if op is Collective.BROADCAST:
                impl.broadcast(self.output, self.root)
            elif op is Collective.REDUCE:
                impl.reduce(self.output, self.root, red)
            elif op is Collective.ALLREDUCE:
                impl.all_reduce(self.output, red)
            elif op is Collective.ALLGATHER:
                impl.all_gather(self.output, self.input)
            else:
                impl.reduce_scatter(self.output, self.input, red)
            return
        torch_op, group = _TORCH_OPS[red], None if impl == "gloo" else impl
        if op is Collective.BROADCAST:
            dist.broadcast(self.output, self.root, group=group)
        elif op is Collective.REDUCE:
            dist.reduce(self.output, self.root, torch_op, group=group)
        elif op is Collective.ALLREDUCE:
            dist.all_reduce(self.output, torch_op, group=group)
        elif op is Collective.ALLGATHER:
            dist.all_gather_into_tensor(self.output, self.input, group=group)
        else:
            dist.reduce_scatter_tensor(self.output, self.input, torch_op, group=group)

    def wrong(self) -> int:
        """Elements that differ from the reference (only the root's result counts for reduce)."""
        if self.op is Collective.REDUCE and self.rank != self.root:
            return 0
        got = self.output.to(torch.float64)
        rtol = 1e-2 if self.dtype in (torch.bfloat16, torch.float16) else 1e-6
        ok = torch.isclose(got, self.expected, rtol=rtol, atol=0)
        return int((~ok).sum())


AUTO_TRIALS = 2


def _picked(group, case: Case) -> str | None:
    """What the auto group picked for this case's calls ("trees" or "gloo")."""
    from shardshift.collectives.execution.backend import call_class

    tensor = case.input if case.op is Collective.ALLGATHER else case.output  # what the backend keys on
    return group.choices.get(call_class(case.op, tensor, case.root))


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all of this host's CPUs since boot, from /proc/stat's first line
    (idle and iowait count as not busy); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def run(opts: CollectivesBenchOptions) -> int:
    """Measure every size and implementation on this rank; rank 0 prints the report. Returns 1
    if any result was wrong (every rank knows: the counts are summed), else 0."""
    init_distributed(opts.timeout_s, backend="gloo")
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    topology = opts.topology or full(n)
    probed = None
    if opts.probe:
        topology = probed = probe_topology(world)  # the same on every rank (all-gathered rates)
    options = opts.run
    impls = {}
    for name in opts.impls:
        if name == "gloo":
            impls[name] = "gloo"
        elif name == "auto":
            from shardshift.collectives.execution.backend import ShardShiftOptions

            impls[name] = dist.new_group(backend="shardshift", pg_options=ShardShiftOptions(
                topology=topology, run=options, algorithm="auto", trials=AUTO_TRIALS))
        elif name == "ring":
            impls[name] = TreeCollectives(world, topology, options, packer=ring_packing)
        else:
            impls[name] = TreeCollectives(world, topology, options)
    op, red = opts.op, Reduction.parse(opts.redop)
    dtype, root, iters = TORCH_DTYPES[opts.dtype], opts.root, opts.iters
    measured = []
    for nbytes in opts.sizes:
        case = Case(op, max(nbytes // torch.tensor([], dtype=dtype).element_size(), n), dtype, red,
                    root, rank, n)  # fmt: skip
        names = list(impls)
        times = torch.zeros(len(names), iters, dtype=torch.float64)
        wrong = torch.zeros(len(names), dtype=torch.float64)
        cpu = [[0, 0] for _ in names]  # busy and total ticks during each impl's timed calls
        for i, name in enumerate(names):
            for _ in range(2 * AUTO_TRIALS if name == "auto" else 1):
                case.reset()
                case.run(impls[name])  # warm-up: connections, plans, auto's trial calls
                wrong[i] += case.wrong()
        for rep in range(iters):
            for j in range(len(names)):
                i = (j + rep) % len(names)
                case.reset()
                dist.barrier()
                before, start = cpu_ticks(), time.perf_counter()
                case.run(impls[names[i]])
                times[i, rep] = time.perf_counter() - start
                after = cpu_ticks()
                if before is not None and after is not None:
                    cpu[i][0] += after[0] - before[0]
                    cpu[i][1] += after[1] - before[1]
                dist.barrier()  # a rank that finished early must not check while others still run
                wrong[i] += case.wrong()
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a call lasts as long as its slowest rank
        dist.all_reduce(wrong)
        for i, name in enumerate(names):
            impl = impls[name]
            packing = impl.packing(op, root) if isinstance(impl, TreeCollectives) else None
            picked = _picked(impl, case) if name == "auto" else None
            measured.append({
                "impl": name, "bytes": case.count * case.output.element_size(), "count": case.count,
                "seconds": statistics.median(times[i].tolist()), "all_seconds": times[i].tolist(),
                "wrong": int(wrong[i]),
                "num_trees": len(packing.trees) if packing else None,
                "packing_rate": packing.rate if packing else None,
                "cpu_busy": cpu[i][0] / cpu[i][1] if cpu[i][1] else None,
                **({"picked": picked} if name == "auto" else {}),
            })  # fmt: skip
    result = None
    if rank == 0:
        bound = collective_bound(probed, op, root) if probed is not None else opts.bound
        result = report(opts, rows(opts, measured, bound), probed)
    for impl in impls.values():
        if isinstance(impl, TreeCollectives):
            impl.close()
    dist.barrier()
    dist.destroy_process_group()
    if result is not None and opts.plot is not None:  # after the others are released
        from shardshift.plots.bench import draw_collectives_bench

        draw_collectives_bench(result, opts.plot)
        say(f"wrote {opts.plot}", "stderr")
    return 0 if all(r["wrong"] == 0 for r in measured) else 1
