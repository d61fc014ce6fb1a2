"""Collectives on packed trees for one process group: plan once per shape, then run.

    trees = TreeCollectives(dist.group.WORLD, presets.full(4))
    trees.all_reduce(tensor)                  # in place, like dist.all_reduce
    trees.broadcast(tensor, root=2)
    trees.all_gather(output, input)           # output holds n × input.numel() elements, rank order
    trees.reduce_scatter(output, input, "avg")

Every rank of the group calls the same methods in the same order with tensors of the same numel
and dtype, as with `torch.distributed`. The topology's rank i is the group's rank i.

Planning happens once per (op, root, numel, element size): the packing (cached per (op, root)),
its schedule with a pipeline depth chosen for the buffer size (program.py, chunks_per_tree), and
the compiled plan for this rank. The first time a plan is built, the ranks compare a digest of it
(one small all-gather on the group) so that ranks that planned differently (another topology, a
packing that came out differently) fail with a message instead of exchanging mismatched chunks.
Later calls with the same key do no planning and no extra communication.

Semantics per op (torch.distributed's, out-of-place work on scratch where torch leaves inputs be):
  broadcast       `tensor` on every rank becomes the root's.
  reduce          the root's `tensor` becomes the reduction; other ranks' tensors are unchanged
                  (they reduce in a scratch copy).
  all_reduce      `tensor` becomes the reduction on every rank; all ranks end bit-identical (the
                  result is computed once per chunk, at its tree's root, and copied).
  all_gather      `output` (n × m elements, any shape) gets every rank's `input` in rank order.
  reduce_scatter  `output` (m elements) gets shard `rank` of the reduction of the n × m `input`s.
  barrier         a one-element all-reduce.

After a failed or timed-out collective the group's point-to-point streams are out of step; this
object then refuses further calls (build a new group).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from shardshift.collectives.execution.executor import ExecMode, run_plan
from shardshift.collectives.execution.program import (
    CHUNK_SECONDS,
    MAX_CHUNKS_PER_TREE,
    MAX_CHUNKS_TOTAL,
    MIN_CHUNK_BYTES,
    ExecutionPlan,
    chunks_per_tree,
    compile_plan,
)
from shardshift.collectives.execution.reduction import Reduction
from shardshift.collectives.planning.ops import Collective
from shardshift.collectives.planning.packing import PackOptions, pack
from shardshift.collectives.planning.schedule import make_schedule
from shardshift.collectives.planning.trees import Packing
from shardshift.collectives.topology.model import Topology
from shardshift.comm.p2p import Deadline, Transport

Packer = Callable[[Topology, Collective, int], Packing]


@dataclass(frozen=True)
class RunOptions:
    """How TreeCollectives plans and runs; documented where declared."""

    mode: ExecMode | None = None  # None: DATAFLOW for CPU tensors, STEPPED otherwise
    timeout_s: float = 300.0  # bound on one collective, every wait included
    window: int = 4  # DATAFLOW: messages posted ahead per queue (peer, tree, direction)
    min_chunk_bytes: int = MIN_CHUNK_BYTES  # pipeline chunks are at least this large per tree...
    max_chunks_per_tree: int = MAX_CHUNKS_PER_TREE  # ...and at most this many per tree...
    max_chunks_total: int = MAX_CHUNKS_TOTAL  # ...and over all pieces together
    chunk_seconds: float = CHUNK_SECONDS  # aimed time of one pipeline chunk at the packing's rate
    pack_options: PackOptions = field(default_factory=PackOptions)
    verify_plans: bool = True  # compare a digest of every new plan across ranks

    def __post_init__(self) -> None:
        if self.mode is not None:
            object.__setattr__(self, "mode", ExecMode(self.mode))
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s}: give seconds > 0")
        if min(self.window, self.min_chunk_bytes, self.max_chunks_per_tree, self.max_chunks_total) < 1:
            raise ValueError("window, min_chunk_bytes, max_chunks_per_tree and max_chunks_total must be >= 1")
        if not self.chunk_seconds > 0:
            raise ValueError(f"chunk_seconds={self.chunk_seconds}: give seconds > 0")


class TreeCollectives:
    """Broadcast, reduce, all-reduce, all-gather, reduce-scatter and barrier on packed trees over
    the point-to-point operations of `group` (see module docstring)."""

    def __init__(self, group, topology: Topology, options: RunOptions | None = None,
                 packer: Packer | None = None) -> None:
        self.group = group
        self.transport = Transport(group)
        self.rank, self.size = group.rank(), group.size()
        if topology.num_ranks != self.size:
            raise ValueError(f"topology {topology.name!r} has {topology.num_ranks} ranks but the group "
                             f"has {self.size}; give a topology with one rank per group member")  # fmt: skip
        self.topology = topology
        self.options = options or RunOptions()
        self._packer = packer or (lambda t, op, root: pack(t, op, root, self.options.pack_options))
        self._packings: dict[tuple[Collective, int], Packing] = {}
        self._plans: dict[tuple[Collective, int, int, int], ExecutionPlan] = {}
        self._lock = threading.Lock()  # one collective at a time: per-pair FIFO needs it
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._broken: str | None = None
        self.plans_built = 0  # for tests and benchmarks: planning work done so far

    # ---- planning ---------------------------------------------------------------------------

    def packing(self, op: Collective | str, root: int = 0) -> Packing:
        """The packing for (op, root), solved on first use."""
        op = Collective.parse(op)
        key = (op, root if op.rooted else 0)
        if key not in self._packings:
            self._packings[key] = self._packer(self.topology, op, key[1])
        return self._packings[key]

    def plan(self, op: Collective | str, count: int, itemsize: int, root: int = 0,
             device: torch.device | None = None) -> ExecutionPlan:
        """The compiled plan for `count` elements of `itemsize` bytes (cached)."""
        op = Collective.parse(op)
        key = (op, root if op.rooted else 0, count, itemsize)
        plan = self._plans.get(key)
        if plan is None:
            packing = self.packing(op, key[1])
            nbytes = count * itemsize
            pieces = len(packing.pieces())
            k = chunks_per_tree(nbytes, pieces, trees_per_piece=len(packing.trees) // pieces,
                                seconds=nbytes / packing.rate,
                                chunk_seconds=self.options.chunk_seconds,
                                min_chunk_bytes=self.options.min_chunk_bytes,
                                max_chunks=self.options.max_chunks_per_tree,
                                max_total=self.options.max_chunks_total)  # fmt: skip
            plan = compile_plan(make_schedule(packing, k), count, self.rank, len(packing.trees))
            if self.options.verify_plans:
                self._verify(plan, device or torch.device("cpu"))
            self._plans[key] = plan
            self.plans_built += 1
        return plan

    def _verify(self, plan: ExecutionPlan, device: torch.device) -> None:
        digest = hashlib.sha256(repr(plan.digest()).encode()).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], device=device)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        self.group.allgather([everyone], [mine]).wait()
        differ = [r for r, d in enumerate(everyone) if int(d) != int(mine)]
        if differ:
            raise RuntimeError(f"rank {self.rank}: the {plan.op.value} plan for {plan.count} elements "
                               f"differs on ranks {differ}; give every rank the same topology and "
                               "packing options")  # fmt: skip

    # ---- collectives ------------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self._check_root(root)
        flat, write_back = _flat(tensor)
        if self.size > 1 and flat.numel():
            self._run(Collective.BROADCAST, flat, None, root)
        write_back()

    def reduce(self, tensor: torch.Tensor, root: int, op: Reduction | str = Reduction.SUM) -> None:
        self._check_root(root)
        red = Reduction.parse(op)
        red.check_dtype(tensor.dtype)
        flat, write_back = _flat(tensor)
        if self.rank != root:
            flat, write_back = flat.clone(), _nothing  # partial sums land in scratch
        if self.size > 1 and flat.numel():
            self._run(Collective.REDUCE, flat, red, root)
        if self.rank == root:
            red.finish(flat, self.size)
        write_back()

    def all_reduce(self, tensor: torch.Tensor, op: Reduction | str = Reduction.SUM) -> None:
        red = Reduction.parse(op)
        red.check_dtype(tensor.dtype)
        flat, write_back = _flat(tensor)
        if self.size > 1 and flat.numel():
            self._run(Collective.ALLREDUCE, flat, red)
        red.finish(flat, self.size)
        write_back()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._check_sharded("all_gather", output, input)
        flat, write_back = _flat(output)
        begin, end = self._shard(flat.numel())
        flat[begin:end].copy_(input.reshape(-1))
        if self.size > 1 and flat.numel():
            self._run(Collective.ALLGATHER, flat, None)
        write_back()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       op: Reduction | str = Reduction.SUM) -> None:
        self._check_sharded("reduce_scatter", input, output)
        red = Reduction.parse(op)
        red.check_dtype(input.dtype)
        buffer = input.reshape(-1).clone()  # every rank's shards but its own end as partial sums
        if self.size > 1 and buffer.numel():
            self._run(Collective.REDUCESCATTER, buffer, red)
        begin, end = self._shard(buffer.numel())
        result = buffer[begin:end]
        red.finish(result, self.size)
        output.copy_(result.view(output.shape))

    def barrier(self, device: torch.device | str = "cpu") -> None:
        self.all_reduce(torch.zeros(1, device=device))

    def close(self) -> None:
        """Stop the worker threads. Idle ones exit at once and are joined, so none outlives the
        process group it talks to; after a failure, threads still stuck in a wait are left to
        time out by themselves."""
        if self._pool is not None:
            self._pool.shutdown(wait=self._broken is None)
            self._pool, self._pool_size = None, 0

    # ---- internals --------------------------------------------------------------------------

    def _run(self, op: Collective, flat: torch.Tensor, red: Reduction | None, root: int = 0) -> None:
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(f"an earlier collective on this group failed ({self._broken}); "
                                   "destroy the group and build a new one")  # fmt: skip
            try:
                plan = self.plan(op, flat.numel(), flat.element_size(), root, flat.device)
                mode = self.options.mode or (ExecMode.DATAFLOW if flat.device.type == "cpu" else ExecMode.STEPPED)
                queues = len(plan.program.sends) + len(plan.program.recvs)
                if mode is ExecMode.DATAFLOW and queues > self._pool_size:
                    # One waiting thread per queue, all at once: the pool grows to the largest plan.
                    self.close()
                    self._pool = ThreadPoolExecutor(max_workers=queues,
                                                    thread_name_prefix=f"shardshift-r{self.rank}")
                    self._pool_size = queues
                run_plan(plan, flat, self.transport, combine=red.combine if red else None,
                         deadline=Deadline.after(self.options.timeout_s), mode=mode, window=self.options.window,
                         pool=self._pool)  # fmt: skip
            except Exception as err:
                self._broken = f"{type(err).__name__}: {err}"
                raise

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is not a rank of this group of {self.size} (0..{self.size - 1})")

    def _check_sharded(self, what: str, whole: torch.Tensor, part: torch.Tensor) -> None:
        if whole.numel() != self.size * part.numel() or whole.dtype != part.dtype:
            raise ValueError(f"{what}: the gathered tensor must have {self.size} × {part.numel()} = "
                             f"{self.size * part.numel()} elements of {part.dtype}, got "
                             f"{whole.numel()} of {whole.dtype}")  # fmt: skip

    def _shard(self, count: int) -> tuple[int, int]:
        per_rank = count // self.size
        return self.rank * per_rank, (self.rank + 1) * per_rank


def _nothing() -> None:
    return None


def _flat(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A flat contiguous view of `tensor`, or a flat copy plus the function that writes it back."""
    if tensor.is_contiguous():
        return tensor.view(-1), _nothing
    flat = tensor.contiguous().view(-1)
    return flat, lambda: tensor.copy_(flat.view(tensor.shape))
