"""The `shardshift` torch.distributed backend: collectives on packed trees over an inner gloo group.

    from shardshift.collectives import ShardShiftOptions, register_backend
    register_backend()                          # the name "shardshift" (also done on import)
    dist.init_process_group("shardshift", ...)  # or, for one group:
    group = dist.new_group(backend="shardshift", pg_options=ShardShiftOptions(topology="dgx1v:0,1,2,3"))

Runs on trees: broadcast, reduce, all_reduce, all_gather, all_gather_into_tensor, reduce_scatter,
reduce_scatter_tensor, all_reduce_coalesced and barrier, with SUM, PRODUCT, MIN, MAX and AVG
(floating dtypes). Everything else goes to an inner gloo backend registered on the group, exactly
as plain gloo would run it: point-to-point send / recv, all_to_all, gather, scatter, the other
coalesced ops, PREMUL_SUM and bitwise reductions, sparse tensors, and the functional collectives
that C++ code (DTensor) calls below Python.

Topology (the first that is set): `ShardShiftOptions(topology=...)` given as `pg_options`, the
environment variable SHARDSHIFT_TOPOLOGY, else `full`: every rank linked to every other at one
rate, which needs no measuring and packs trees that use all pairs alike. A spec is a string of
topology/spec.py (`full`, `ring`, `dgx1v:0,1,2,3`, a YAML path) or `probe`: the group measures
its pair bandwidths when it is created (topology/probe.py; about a second for 4 ranks), every rank then
holds the same measured topology. A Topology object may be given instead of a spec. A group of
some of the job's ranks (a DeviceMesh's axis) given a file or Topology of the whole job packs on
the part of that network its ranks see (`topology.spec.group_topology`). `tree_calls` counts the
calls each op ran on trees.

How calls run: every tree collective is queued to one worker thread per group, in the order the
caller issues them (the same order on every rank, as torch requires), and returns a Work at once;
`wait()` blocks until it ran, `get_future()` gives a torch Future of the output tensors (what
DDP's communication hooks use), and `async_op=False` is just an immediate wait. The trees travel
over a second, private gloo backend, so their point-to-point messages never meet the caller's own
send / recv on the delegate. Work is bounded by `RunOptions.timeout_s`; after a failure the group
refuses further tree collectives (destroy it and build a new one).

Devices: CPU tensors only (gloo). The executor itself is device-agnostic (its step-batched mode
is meant for NCCL), but this backend does not yet build NCCL inner groups: a CUDA tensor is
refused with a message. Nothing here has run on a GPU.
"""

from __future__ import annotations

import collections
import functools
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo

from shardshift.collectives.execution.reduction import Reduction, UnsupportedReduction
from shardshift.collectives.execution.runner import RunOptions, TreeCollectives
from shardshift.collectives.planning.ops import Collective
from shardshift.collectives.topology.model import Topology
from shardshift.collectives.topology.spec import DEFAULT_SPEC, group_topology, is_probe
from shardshift.compat import delegate_to_gloo

BACKEND_NAME = "shardshift"
TOPOLOGY_ENV = "SHARDSHIFT_TOPOLOGY"
ALGORITHMS = ("trees", "auto")


@dataclass(frozen=True)
class ShardShiftOptions:
    """Options of a shardshift group, passed as `pg_options`; documented where declared."""

    topology: str | Topology | None = None  # None: $SHARDSHIFT_TOPOLOGY, else "full" (module doc)
    run: RunOptions = field(default_factory=RunOptions)  # planning and executor knobs
    # Collectives of fewer bytes go to gloo's own algorithm (its latency is lower; 0: none do).
    small_bytes: int = 0
    # "trees": every tree collective runs on trees. "auto": per op, dtype and size class (bytes
    # rounded down to a power of two), the first 2 * `trials` calls alternate between trees and
    # gloo's own algorithm, timed, and later calls of the class run the faster by the slowest
    # rank's time, so every rank picks alike (`ShardShiftProcessGroup.choices` shows the picks).
    algorithm: str = "trees"
    trials: int = 2

    def __post_init__(self) -> None:
        if self.small_bytes < 0:
            raise ValueError(f"small_bytes={self.small_bytes}: give a byte count >= 0")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r}: give one of {', '.join(ALGORITHMS)}")
        if self.trials < 1:
            raise ValueError(f"trials={self.trials}: give at least 1 timed call of each algorithm")

    def topology_spec(self) -> str | Topology:
        return self.topology if self.topology is not None else os.environ.get(TOPOLOGY_ENV, DEFAULT_SPEC)

    @property
    def _timeout(self) -> timedelta:
        """What DeviceMesh reads from the options of the groups it builds (`backend_override`)."""
        return timedelta(seconds=self.run.timeout_s)


class _TreeWork(dist.Work):
    """A queued tree collective: done when the worker has run it."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if timeout else None
        if not self._done.wait(seconds or None):
            raise TimeoutError(f"shardshift collective not done after {seconds} s")
        self._future.wait()  # raises the collective's error, if any
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._future.value()


def call_class(op: Collective, tensor: torch.Tensor, root: int = 0) -> tuple[str, str, int]:
    """What `algorithm="auto"` decides once for: the op (with its root), the dtype, and the bytes
    rounded down to a power of two."""
    nbytes = tensor.numel() * tensor.element_size()
    return (f"{op.value}/{root}" if op.rooted else op.value, str(tensor.dtype), max(nbytes, 1).bit_length() - 1)


class Chooser:
    """Picks trees or gloo's own algorithm for each class of call by timing both (`algorithm="auto"`).

    Runs on the group's worker thread only, which takes calls in issue order, the same on every
    rank: the trial calls, and the all-reduce of their times that decides, line up across ranks.
    """

    def __init__(self, group, trials: int, clock=time.perf_counter) -> None:
        self._group, self._trials, self._clock = group, trials, clock
        self._times: dict[tuple, tuple[list[float], list[float]]] = {}  # class -> (trees, gloo)
        self.choices: dict[tuple, str] = {}  # class -> "trees" or "gloo"

    def run(self, key: tuple, trees, gloo) -> None:
        choice = self.choices.get(key)
        if choice is not None:
            return (trees if choice == "trees" else gloo)()
        times = self._times.setdefault(key, ([], []))
        turn = 0 if len(times[0]) <= len(times[1]) else 1
        start = self._clock()
        (trees, gloo)[turn]()
        times[turn].append(self._clock() - start)
        if len(times[1]) == self._trials:
            best = torch.tensor([min(times[0]), min(times[1])], dtype=torch.float64)
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX  # a call lasts as long as its slowest rank
            self._group.allreduce([best], opts).wait()
            self.choices[key] = "trees" if best[0] <= best[1] else "gloo"
            del self._times[key]


class ShardShiftProcessGroup(dist.ProcessGroup):
    """See the module docstring. Built by torch through `register_backend()`; not meant to be built by hand."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta,
                 options: ShardShiftOptions | None = None, global_ranks: list[int] | None = None) -> None:
        super().__init__(rank, size)
        self._options = options or ShardShiftOptions()
        self._timeout = timeout
        self._store = store
        # The delegate runs every op that is not ours; registering it makes torch route them there.
        self._delegate = ProcessGroupGloo(PrefixStore("delegate/", store), rank, size, timeout)
        delegate_to_gloo(self, self._delegate)
        # A private gloo group carries the trees' point-to-point messages (see module docstring).
        self._tree_pg = ProcessGroupGloo(PrefixStore("trees/", store), rank, size, timeout)
        spec = self._options.topology_spec()
        if not isinstance(spec, Topology) and is_probe(spec):
            from shardshift.collectives.topology.probe import probe_topology

            topology = probe_topology(self._tree_pg)
        else:
            world = dist.get_world_size() if dist.is_initialized() else size
            topology = group_topology(spec, list(global_ranks or range(size)), world)
        self.topology = topology
        self._trees = {"cpu": TreeCollectives(self._tree_pg, topology, self._options.run)}
        self._chooser = Chooser(self._tree_pg, self._options.trials) if self._options.algorithm == "auto" else None
        self.tree_calls: collections.Counter[str] = collections.Counter()  # op -> calls run on trees
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._serve, name=f"shardshift-pg-r{rank}", daemon=True)
        self._worker.start()

    # ---- identity -----------------------------------------------------------------------------

    @property
    def choices(self) -> dict[tuple, str]:
        """Under `algorithm="auto"`: (op, dtype, size class) -> "trees" or "gloo", as decided so far."""
        return dict(self._chooser.choices) if self._chooser else {}

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"ShardShiftProcessGroup(rank={self.rank()}, size={self.size()}, topology={self.topology.name})"

    # ---- tree collectives ----------------------------------------------------------------------

    def broadcast(self, tensors, opts):
        if len(tensors) != 1 or tensors[0].is_sparse:
            return self._delegate.broadcast(tensors, opts)
        t, root = tensors[0], opts.rootRank
        return self._submit(Collective.BROADCAST, t, tensors, lambda trees: trees.broadcast(t, root),
                            lambda: self._delegate.broadcast(tensors, opts), root=root)  # fmt: skip

    def allreduce(self, tensors, opts):
        red = self._reduction(opts.reduceOp, tensors)
        if red is None:
            return self._delegate.allreduce(tensors, opts)
        t = tensors[0]
        return self._submit(Collective.ALLREDUCE, t, tensors, lambda trees: trees.all_reduce(t, red),
                            lambda: self._delegate.allreduce(tensors, opts))  # fmt: skip

    def allreduce_coalesced(self, tensors, opts):
        red = self._reduction(opts.reduceOp, tensors, single=False)
        if red is None or len({(t.dtype, t.device) for t in tensors}) != 1:
            return self._delegate.allreduce_coalesced(tensors, opts)

        def run(trees: TreeCollectives) -> None:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            trees.all_reduce(flat, red)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()

        return self._submit(Collective.ALLREDUCE, tensors[0], tensors, run,
                            lambda: self._delegate.allreduce_coalesced(tensors, opts))

    def reduce(self, tensors, opts):
        red = self._reduction(opts.reduceOp, tensors)
        if red is None:
            return self._delegate.reduce(tensors, opts)
        t, root = tensors[0], opts.rootRank
        return self._submit(Collective.REDUCE, t, tensors, lambda trees: trees.reduce(t, root, red),
                            lambda: self._delegate.reduce(tensors, opts), root=root)  # fmt: skip

    def allgather(self, output_tensors, input_tensors, opts):
        if len(input_tensors) != 1 or len(output_tensors) != 1 or input_tensors[0].is_sparse:
            return self._delegate.allgather(output_tensors, input_tensors, opts)
        inp, outs = input_tensors[0], output_tensors[0]
        if len(outs) != self.size() or any(o.numel() != inp.numel() or o.dtype != inp.dtype for o in outs):
            return self._delegate.allgather(output_tensors, input_tensors, opts)

        def run(trees: TreeCollectives) -> None:
            flat = inp.new_empty(self.size() * inp.numel())
            trees.all_gather(flat, inp)
            for r, o in enumerate(outs):
                o.copy_(flat[r * inp.numel():(r + 1) * inp.numel()].view(o.shape))

        return self._submit(Collective.ALLGATHER, inp, output_tensors, run,
                            lambda: self._delegate.allgather(output_tensors, input_tensors, opts))  # fmt: skip

    def all_gather_single(self, output, input, opts):
        if input.is_sparse or output.numel() != self.size() * input.numel() or output.dtype != input.dtype:
            return self._delegate._allgather_base(output, input, opts)
        return self._submit(Collective.ALLGATHER, input, [output], lambda trees: trees.all_gather(output, input),
                            lambda: self._delegate._allgather_base(output, input, opts))  # fmt: skip

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        red = self._reduction(opts.reduceOp, output_tensors)
        if red is None or len(input_tensors) != 1:
            return self._delegate.reduce_scatter(output_tensors, input_tensors, opts)
        out, ins = output_tensors[0], input_tensors[0]
        if len(ins) != self.size() or any(i.numel() != out.numel() or i.dtype != out.dtype for i in ins):
            return self._delegate.reduce_scatter(output_tensors, input_tensors, opts)
        return self._submit(Collective.REDUCESCATTER, out, output_tensors,
                            lambda trees: trees.reduce_scatter(out, torch.cat([i.reshape(-1) for i in ins]), red),
                            lambda: self._delegate.reduce_scatter(output_tensors, input_tensors, opts))  # fmt: skip

    def reduce_scatter_single(self, output, input, opts):
        red = self._reduction(opts.reduceOp, [output])
        if red is None or input.numel() != self.size() * output.numel() or input.dtype != output.dtype:
            return self._delegate._reduce_scatter_base(output, input, opts)
        return self._submit(Collective.REDUCESCATTER, output, [output],
                            lambda trees: trees.reduce_scatter(output, input, red),
                            lambda: self._delegate._reduce_scatter_base(output, input, opts))  # fmt: skip

    _reduce_scatter_base = reduce_scatter_single

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        """What functional collectives (DTensor) call for all_gather_into_tensor."""
        def delegated() -> None:  # gloo's backend has no coalesced all-gather binding: one by one
            for o, i in zip(outputs, inputs):
                self._delegate._allgather_base(o, i, opts).wait()

        def run(trees: TreeCollectives) -> None:
            for o, i in zip(outputs, inputs):
                trees.all_gather(o, i)

        if not inputs or any(i.is_sparse or o.numel() != self.size() * i.numel() or o.dtype != i.dtype
                             for o, i in zip(outputs, inputs)):  # fmt: skip
            return self._submit(Collective.ALLGATHER, torch.zeros(0), outputs, None, delegated)
        return self._submit(Collective.ALLGATHER, inputs[0], outputs, run, delegated)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        """What functional collectives (DTensor) call for reduce_scatter_tensor."""
        red = self._reduction(opts.reduceOp, outputs, single=False) if outputs else None

        def delegated() -> None:
            for o, i in zip(outputs, inputs):
                self._delegate._reduce_scatter_base(o, i, opts).wait()

        def run(trees: TreeCollectives) -> None:
            for o, i in zip(outputs, inputs):
                trees.reduce_scatter(o, i, red)

        if red is None or any(i.numel() != self.size() * o.numel() or o.dtype != i.dtype
                              for o, i in zip(outputs, inputs)):  # fmt: skip
            return self._submit(Collective.REDUCESCATTER, torch.zeros(0), outputs, None, delegated)
        return self._submit(Collective.REDUCESCATTER, outputs[0], outputs, run, delegated)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def barrier(self, opts=None):
        marker = torch.zeros(1)
        return self._submit(None, marker, [], lambda trees: trees.barrier(), None)

    # ---- delegated, but defined here on purpose ------------------------------------------------
    # torch's C++ trampoline for Python process groups keeps the GIL while it runs the base
    # implementation of these methods (they are virtual there). Gloo's worker thread may need the
    # GIL to free a finished work's tensors while it holds the lock that enqueueing needs: a
    # deadlock we hit with DTensor under FSDP2. Calling the delegate from Python instead goes
    # through bindings that release the GIL.

    def send(self, tensors, dst_rank, tag):
        return self._delegate.send(tensors, dst_rank, tag)

    def recv(self, tensors, src_rank, tag):
        return self._delegate.recv(tensors, src_rank, tag)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self._delegate.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    alltoall_base = all_to_all_single

    # ---- lifecycle -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Finish queued work, stop the threads, then the inner groups (torch calls this on
        destroy_process_group). Threads are joined: one that outlived its gloo group could end the
        process in C++ teardown."""
        if self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join(self._options.run.timeout_s)
        for trees in self._trees.values():
            trees.close()
        self._tree_pg.shutdown()
        super().shutdown()

    def abort(self) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------------------

    def _reduction(self, op, tensors, single: bool = True) -> Reduction | None:
        """The reduction to run on trees, or None when the call must go to the delegate."""
        if (single and len(tensors) != 1) or any(t.is_sparse or t.is_complex() for t in tensors):
            return None
        try:
            red = Reduction.parse(op)
            red.check_dtype(tensors[0].dtype)
            return red
        except UnsupportedReduction:
            return None

    def _submit(self, op: Collective | None, tensor: torch.Tensor, result, run, small, root: int = 0) -> dist.Work:
        """Queue `run(trees)` on the worker thread, or `small()` (gloo's own algorithm: a Work, or
        None when it waits by itself) when `run` is None or the tensor is below small_bytes."""
        device = tensor.device.type
        if device not in self._trees:
            raise ValueError(f"shardshift runs CPU tensors only in this build, got a {device} tensor; "
                             "use a gloo or nccl group for it")  # fmt: skip
        future: torch.futures.Future = torch.futures.Future()
        nbytes = tensor.numel() * tensor.element_size()
        if run is None or (small is not None and nbytes < self._options.small_bytes):
            job = _waited(small)  # gloo's own, queued all the same: calls keep their issue order
        else:
            trees = self._trees[device]

            def job() -> None:
                self.tree_calls[op.value if op is not None else "barrier"] += 1
                run(trees)

            if self._chooser is not None and small is not None:
                job = functools.partial(self._chooser.run, call_class(op, tensor, root), job, _waited(small))
        self._jobs.put((job, future, result))
        return _TreeWork(future)

    def _serve(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future, result = item
            try:
                job()
            except BaseException as err:  # delivered to the caller's wait()
                future.set_exception(err)
            else:
                future.set_result(result)


def _waited(call):
    def job() -> None:
        work = call()
        if work is not None:
            work.wait()
    return job


def _create(backend_options, pg_options) -> ShardShiftProcessGroup:
    if pg_options is not None and not isinstance(pg_options, ShardShiftOptions):
        raise ValueError(f"pg_options for the shardshift backend must be ShardShiftOptions, got "
                         f"{type(pg_options).__name__}")  # fmt: skip
    return ShardShiftProcessGroup(backend_options.store, backend_options.group_rank, backend_options.group_size,
                                  backend_options.timeout, pg_options, backend_options.global_ranks_in_group)


def register_backend() -> None:
    """Register the backend with torch.distributed (idempotent; done when this module is imported).
    torch keeps backends in a process-wide table, the one piece of global state we touch."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])


register_backend()
